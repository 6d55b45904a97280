"""Memory figures of the train step, for the per-step metrics and the memory benchmark.

Two sources, both reported when available:

* **XLA's static estimate** of a compiled step (:func:`compiled_memory`): arguments + outputs -
  donated aliases + temporaries of the executable, in bytes. It is exact for what XLA allocates for
  the step on one device (activations, gradients, optimizer update), deterministic, and available on
  every backend (CPU included). Metric ``memory/step_bytes`` (and ``memory/step_temp_bytes``).
* **The device allocator's peak** (:func:`device_peak_bytes`): ``peak_bytes_in_use`` of the local
  devices' ``memory_stats()`` (GPU/TPU; the CPU backend reports none). Metric ``memory/peak_bytes``.

And the process's own resident memory (:func:`host_memory_bytes`), which on a CPU backend holds the
"device" arrays too: metrics ``memory/host_rss_bytes`` (now) and ``memory/host_peak_rss_bytes``
(the most since the process started), logged with every RL step's row.
"""

from __future__ import annotations

import ctypes
import functools
import resource
import sys
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "compiled_memory",
    "device_peak_bytes",
    "host_allocator",
    "host_memory_bytes",
    "release_freed_host_memory",
    "step_memory_metrics",
]


def compiled_memory(jitted: Any, *args: Any) -> dict[str, float]:
    """``{"step_bytes", "step_temp_bytes"}`` of ``jitted(*args)`` from XLA's memory analysis.

    ``jitted`` is a ``jax.jit`` function; the executable comes from JAX's compilation cache when
    ``jitted`` already ran on arguments of these shapes (then this costs about a millisecond).
    Returns ``{}`` when the backend gives no analysis.

    >>> import jax.numpy as jnp
    >>> f = jax.jit(lambda x: (x @ x.T).sum())
    >>> compiled_memory(f, jnp.ones((64, 32)))["step_bytes"] >= 64 * 32 * 4
    True
    """
    analysis = jitted.lower(*args).compile().memory_analysis()
    if analysis is None:
        return {}
    temp = float(analysis.temp_size_in_bytes)
    total = (
        float(analysis.argument_size_in_bytes)
        + float(analysis.output_size_in_bytes)
        - float(analysis.alias_size_in_bytes)
        + temp
    )
    return {"step_bytes": total, "step_temp_bytes": temp}


def device_peak_bytes() -> float | None:
    """The largest ``peak_bytes_in_use`` over this process's devices; None where none is reported."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(float(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def step_memory_metrics(jitted: Callable[..., Any], *args: Any) -> dict[str, float]:
    """The per-step memory metrics (``memory/step_bytes``, ``memory/step_temp_bytes`` and, on
    devices that report it, ``memory/peak_bytes``) of ``jitted(*args)``.

    >>> import jax.numpy as jnp
    >>> sorted(step_memory_metrics(jax.jit(lambda x: x + 1), jnp.ones(4)))[:2]
    ['memory/step_bytes', 'memory/step_temp_bytes']
    """
    out = {f"memory/{k}": v for k, v in compiled_memory(jitted, *args).items()}
    peak = device_peak_bytes()
    if peak is not None:
        out["memory/peak_bytes"] = peak
    return out


def host_memory_bytes() -> dict[str, float]:
    """``{"host_rss_bytes", "host_peak_rss_bytes"}``: this process's resident memory now and its peak
    since it started (what ``/usr/bin/time -v`` reports), both from one read of
    ``/proc/self/status`` (``VmRSS``, ``VmHWM``); without procfs only the peak, from ``getrusage``.

    The kernel folds its per-thread counters in lazily, so either figure may lag by a few hundred KiB.

    >>> host_memory_bytes()["host_peak_rss_bytes"] > 2**20
    True
    """
    fields = {"VmRSS:": "host_rss_bytes", "VmHWM:": "host_peak_rss_bytes"}
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                words = line.split()
                if words and words[0] in fields:
                    out[fields[words[0]]] = float(words[1]) * 1024  # kB
    except OSError:  # no procfs (macOS): the peak only; ru_maxrss is in bytes there, else kB
        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        out["host_peak_rss_bytes"] = peak if sys.platform == "darwin" else peak * 1024
    return out


@functools.cache
def host_allocator() -> str:
    """The C allocator serving this process's ``malloc``: ``"tcmalloc"`` or ``"jemalloc"`` (loaded
    with ``LD_PRELOAD``, found by their entry points in the process's global symbols), else
    ``"glibc"`` on Linux and ``"other"`` elsewhere (musl, macOS).

    >>> host_allocator() in ("tcmalloc", "jemalloc", "glibc", "other")
    True
    """
    if not sys.platform.startswith("linux"):
        return "other"
    try:
        symbols = ctypes.CDLL(None)
    except OSError:
        return "other"
    for name, entry in (("tcmalloc", "MallocExtension_ReleaseFreeMemory"), ("jemalloc", "mallctl")):
        if hasattr(symbols, entry):
            return name
    return "glibc" if hasattr(symbols, "malloc_trim") else "other"


@functools.cache
def _release_call() -> Callable[[], object] | None:
    """The allocator's call that returns freed memory to the system (None: it has none we know)."""
    allocator = host_allocator()
    symbols = ctypes.CDLL(None) if allocator in ("tcmalloc", "glibc") else None
    if allocator == "tcmalloc":
        release = symbols.MallocExtension_ReleaseFreeMemory
        release.argtypes, release.restype = [], None
        return release
    if allocator == "glibc":
        trim = symbols.malloc_trim
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return functools.partial(trim, 0)
    return None


def release_freed_host_memory() -> bool:
    """Hands the memory this process has freed but its C allocator still holds back to the system;
    returns False where the allocator has no such call (jemalloc purges on its own schedule).

    Why: a CPU backend's train step allocates and frees gigabytes of temporaries, and the sampler,
    the checkpoint writer and the host batches free large blocks from several threads; the allocator
    keeps much of that (a run's resident memory then creeps up step by step with nothing alive in
    it). Releasing once per RL step returns it; it takes milliseconds and moves no data. glibc:
    ``malloc_trim(0)``; tcmalloc (``LD_PRELOAD=libtcmalloc_minimal.so.4``, which ``./run`` sets where
    the library is installed): ``MallocExtension_ReleaseFreeMemory()``.

    >>> release_freed_host_memory() == (host_allocator() in ("glibc", "tcmalloc"))
    True
    """
    release = _release_call()
    if release is None:
        return False
    release()
    return True
