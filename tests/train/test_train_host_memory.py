"""The process's resident memory as the per-step metrics report it (rljax.training.memory)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import ci
import numpy as np
import pytest

from rljax.training.memory import host_allocator, host_memory_bytes, release_freed_host_memory

MIB = 2**20
#: The kernel's RSS counters are cached per thread and folded in lazily (up to 64 pages a thread), so
#: the high-water mark taken at an unmap can trail an earlier VmRSS read by a few hundred KiB.
COUNTER_LAG = 4 * MIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the current RSS comes from procfs")
def test_rss_follows_an_allocation_and_the_peak_keeps_it():
    release_freed_host_memory()  # memory freed earlier but still resident would take the block unseen
    before = host_memory_bytes()
    block = np.ones(256 * MIB // 8)  # 256 MiB, every page written
    during = host_memory_bytes()
    # the other threads of the process may allocate or free a little meanwhile: a margin of 32 MiB
    assert during["host_rss_bytes"] - before["host_rss_bytes"] > 224 * MIB
    assert during["host_peak_rss_bytes"] >= during["host_rss_bytes"] - COUNTER_LAG
    del block  # unmapped, or (in a process whose allocator took it from its heap) trimmed back:
    release_freed_host_memory()
    after = host_memory_bytes()
    assert after["host_rss_bytes"] < during["host_rss_bytes"] - 224 * MIB  # a large block goes back
    assert after["host_peak_rss_bytes"] >= during["host_rss_bytes"] - COUNTER_LAG  # the peak does not


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and procfs")
def test_freed_holes_in_the_heap_go_back_to_the_system():
    """Small blocks come from the allocator's heap (below glibc's mmap threshold; tcmalloc's spans):
    freeing all but every 64th leaves holes the allocator keeps (the resident memory does not fall)
    until it is asked to release them (glibc's ``malloc_trim``, tcmalloc's ``ReleaseFreeMemory``)."""
    release_freed_host_memory()  # earlier tests' holes would take the blocks without growing
    start = host_memory_bytes()["host_rss_bytes"]
    blocks = [bytearray(4000) for _ in range(100_000)]  # ~390 MiB of 4 kB heap blocks
    grown = host_memory_bytes()["host_rss_bytes"]
    assert grown - start > 300 * MIB
    kept = blocks[::64]
    del blocks
    held = host_memory_bytes()["host_rss_bytes"]
    assert held > grown - 64 * MIB  # freed, but still resident
    assert release_freed_host_memory()
    assert host_memory_bytes()["host_rss_bytes"] < held - 300 * MIB
    assert len(kept) == 1563


def _peak_rss_while(fn: Callable[[], object]) -> int:
    """The largest resident size seen (every 2 ms, from another thread) while ``fn()`` runs."""
    peak = host_memory_bytes()["host_rss_bytes"]
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.002):
            peak = max(peak, host_memory_bytes()["host_rss_bytes"])

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak, host_memory_bytes()["host_rss_bytes"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the current RSS comes from procfs")
def test_a_checkpoint_is_written_without_a_second_copy_of_its_arrays(tmp_path):
    """Compressing arrays as they are written holds a compressed copy of each (measured: +1.4 GiB
    for a 1.5 GiB state); written uncompressed, a save adds next to nothing to the process."""
    import jax

    from rljax.training import checkpoint as ckpt

    params = {f"w{i}": jax.random.normal(jax.random.key(i), (4096, 4096)) for i in range(4)}  # 256 MiB
    jax.block_until_ready(params)
    ckpt.save(tmp_path, 0, params={"w": params["w0"][:8]}, opt_state=())  # orbax's one-time set-up
    release_freed_host_memory()
    before = host_memory_bytes()["host_rss_bytes"]
    peak = _peak_rss_while(lambda: ckpt.save(tmp_path, 1, params=params, opt_state=()))
    assert peak - before < 64 * MIB, f"+{(peak - before) / MIB:.0f} MiB while saving 256 MiB"
    restored = ckpt.restore(tmp_path, params=params, opt_state=())
    assert all(np.array_equal(restored.params[k], params[k]) for k in params)


CI = ci.under_ci()
#: the allocators ``./run`` may preload (tcmalloc: .ci/install_tcmalloc.sh) and whether each has a
#: release call; glibc is what a process gets without LD_PRELOAD
PRELOADS = {"glibc": (None, True), "tcmalloc": ("tcmalloc_minimal", True), "jemalloc": ("jemalloc", False)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and glibc")
@pytest.mark.parametrize("allocator", list(PRELOADS))
def test_the_preloaded_allocator_is_detected_and_its_release_used(allocator):
    library, releases = PRELOADS[allocator]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if library is not None:
        found = ctypes.util.find_library(library)
        if found is None:
            if allocator == "tcmalloc":  # ./run test installs it (.ci/install_tcmalloc.sh)
                ci.missing("tcmalloc is not installed (.ci/install_tcmalloc.sh installs it)")
            pytest.skip(f"{allocator} is not installed")
        env["LD_PRELOAD"] = found
    code = (
        "from rljax.training.memory import host_allocator, release_freed_host_memory\n"
        "print(host_allocator(), release_freed_host_memory())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [allocator, str(releases)]


@pytest.mark.skipif(not CI, reason="./run test preloads tcmalloc; a plain pytest need not")
def test_the_suite_runs_on_tcmalloc_under_ci():
    assert host_allocator() == "tcmalloc", os.environ.get("LD_PRELOAD")
