"""The few-row matmul kernel (``rljax.models.panel_matmul``, AVX2 and AVX-512) against float64 numpy,
and the timed choice of whether (and in which instruction set) the sampler uses it.

The reference bound is the textbook one for a float32 dot product of length K summed in any order:
``|fl(x . w) - x . w| <= K * eps32 * (|x| . |w|)`` per output element (Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., eq. 3.5, first order) — an a priori bound, not a measured one, so
it holds on any machine, while a wrong panel, row, prefetch or thread split gives errors of the
size of the outputs themselves.

Tests that run the kernel skip, with the reason, where it cannot be built, and fail there instead
under ``RLJAX_REQUIRE_PANEL_KERNEL=1``; an instruction set the CPU lacks skips them in any case
(``tests/panel_kernel.py``). The choice (kernel or XLA) is tested as logic on given timings, so no
test depends on which is faster on the machine it runs on.
"""

import dataclasses
import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from panel_kernel import REQUIRE_ENV, require_isa, require_panel_kernel

from rljax.models import panel_matmul as pm

EPS32 = float(np.finfo(np.float32).eps)

# M: 1 row .. past a 48-row tile (and every AVX2 micro-kernel remainder 1-5; AVX-512 row splits of 1,
# 2, 3 and 5 calls); N: 1 panel .. several work items of 4 panels plus a partial one, odd panel
# counts (the AVX-512 kernel's single-panel tail); K: odd and short, and the decode shapes. Products
# of 2^20 multiply-adds or more are shared with XLA's thread pool (the last two), smaller ones run
# inline.
SHAPES = [
    (1, 7, 16),
    (2, 1, 32),
    (5, 33, 48),
    (6, 64, 16),
    (13, 100, 80),
    (47, 40, 272),
    (48, 16, 64),
    (49, 64, 64),
    (97, 130, 80),
    (100, 256, 208),
    (32, 512, 1536),
]


@pytest.fixture(scope="module")
def kernel():
    assert jax.default_backend() == "cpu"
    require_panel_kernel()  # skips with the reason where it cannot build; CI requires it
    assert pm.available(), "the panel_matmul kernel did not build (see the logged warning)"


def within_float32_bound(y, x, w):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64
    bound = x.shape[1] * EPS32 * (np.abs(x64) @ np.abs(w64)) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= bound), f"max err / bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("isa", "jit"), [("avx2", False), ("avx2", True), ("avx512", True)],
                         ids=["avx2-eager", "avx2-jit", "avx512-jit"])  # fmt: skip
@pytest.mark.usefixtures("kernel")
def test_matches_float64_numpy(shape, jit, isa):
    require_isa(isa)
    m, k, n = shape
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(k, n)).astype(np.float32)
    fn = functools.partial(pm.panel_matmul, isa=isa)
    fn = jax.jit(fn) if jit else fn
    within_float32_bound(fn(jnp.asarray(x), pm.pack_panels(jnp.asarray(w))), x, w)


@pytest.mark.usefixtures("kernel")
def test_inside_a_loop_with_transposed_and_sliced_operands():
    """In a while loop's body (as the decode steps), with an operand XLA produces transposed and
    one sliced out of a stack: the custom call still gets dense row-major buffers."""
    rng = np.random.default_rng(0)
    xt = rng.normal(size=(64, 9)).astype(np.float32)  # x = xt.T: [9, 64]
    ws = rng.normal(size=(3, 64, 64)).astype(np.float32)

    @jax.jit
    def run(xt, panels):
        def body(i, acc):
            return acc + pm.panel_matmul(xt.T, panels[i])

        return jax.lax.fori_loop(0, 3, body, jnp.zeros((9, 64), jnp.float32))

    y = run(jnp.asarray(xt), jax.vmap(pm.pack_panels)(jnp.asarray(ws)))
    ref = sum(xt.T.astype(np.float64) @ w.astype(np.float64) for w in ws)
    bound = 3 * 64 * EPS32 * sum(np.abs(xt.T) @ np.abs(w) for w in ws)
    assert np.all(np.abs(np.asarray(y) - ref) <= bound)


def test_pack_and_unpack_panels():
    w = jnp.arange(3 * 48, dtype=jnp.float32).reshape(3, 48)
    panels = pm.pack_panels(w)
    assert panels.shape == (3, 3, 16)
    assert panels[2, 1].tolist() == w[1, 32:48].tolist()  # panel 2 = columns 32..47
    assert (pm.unpack_panels(panels) == w).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        pm.pack_panels(jnp.zeros((4, 24)))


def test_bad_operands_raise_clear_errors():
    panels = pm.pack_panels(jnp.zeros((8, 16), jnp.float32))
    with pytest.raises(ValueError, match="does not match panels"):
        pm.panel_matmul(jnp.zeros((2, 7), jnp.float32), panels)
    with pytest.raises(AssertionError):  # chex: float32 only
        pm.panel_matmul(jnp.zeros((2, 8), jnp.bfloat16), panels)
    if pm.available():
        with pytest.raises(ValueError, match="isa must be one of"):
            pm.panel_matmul(jnp.zeros((2, 8), jnp.float32), panels, isa="sse2")


@pytest.mark.usefixtures("kernel")
def test_switch_and_build_failure_fall_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(pm, "_unregistered_because", pm._unregistered_because)  # restored afterwards
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "0")
    assert not pm.available()
    assert "RLJAX_PANEL_MATMUL=0" in pm.unavailable_reason()
    monkeypatch.delenv("RLJAX_PANEL_MATMUL")
    assert pm.available()
    assert pm.unavailable_reason() is None
    # a compiler that fails: a clear error from the build, and registration reports "unavailable"
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'no such compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("RLJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="no such compiler"):
        pm._build()
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-written left behind
    assert pm._register.__wrapped__() is False
    assert "unavailable" in caplog.text
    assert "no such compiler" in pm._unregistered_because  # what unavailable_reason() then reports


def test_an_unusable_cache_directory_falls_back_to_a_temporary_one(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("RLJAX_KERNEL_CACHE", str(blocker / "kernels"))
    monkeypatch.setattr(pm.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fallback = pm._cache_dir()  # where _build then writes the library
    assert fallback == tmp_path / "tmp" / f"rljax-kernels-{os.getuid()}" and fallback.is_dir()


# -- the timed choice: kernel or XLA ------------------------------------------------------------------


def test_the_kernel_is_preferred_only_by_a_clear_margin():
    """Paired rounds: the median of XLA / panels must reach 1 + MARGIN (1.05); ties keep XLA."""
    assert pm.MARGIN == 0.05
    assert pm.speedup([2.0, 1.0, 4.0], [3.0, 1.0, 4.4]) == pytest.approx(1.1)  # ratios 1.5, 1.0, 1.1
    assert pm.prefers_panels([1.0] * 3, [1.06] * 3)
    assert pm.prefers_panels([1.0] * 3, [1.05] * 3)  # exactly the margin
    assert not pm.prefers_panels([1.0] * 3, [1.04] * 3)
    assert not pm.prefers_panels([1.0] * 3, [1.0] * 3)
    assert not pm.prefers_panels([1.0] * 3, [0.7] * 3)  # the Xeon case: the kernel 1.4x slower
    assert pm.prefers_panels([1.0] * 3, [1.26] * 3)  # the EPYC case
    assert not pm.prefers_panels([1.0] * 3, [1.2] * 3, margin=0.25)


def test_the_choice_pairs_rounds_so_a_loaded_round_does_not_flip_it():
    """Load that slows both sides of a round cancels in its ratio, and one outlier round (the kernel's
    first call on a cold cache, a neighbour's burst) cannot outvote the others."""
    panel = [1.0, 3.0, 1.0, 1.0, 9.0]  # the second and fifth timing rounds ran on a loaded machine
    xla = [0.9, 2.8, 0.9, 0.9, 1.0]  # XLA 10 % faster in every quiet round
    assert pm.speedup(panel, xla) == pytest.approx(0.9)
    assert not pm.prefers_panels(panel, xla)
    assert pm.prefers_panels([1.0, 1.0, 5.0], [1.2, 1.2, 1.0])  # one bad round out of three
    with pytest.raises(ValueError, match="same number"):
        pm.speedup([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="same number"):
        pm.speedup([], [])


def _choice(use: bool, isa: str = "avx2") -> pm.Choice:
    return pm.Choice(use, (1.0,), (1.1 if use else 0.9,), "given", isa=isa)


def test_the_switch_forces_the_kernel_on_or_off_and_auto_follows_the_timing(monkeypatch):
    """``RLJAX_PANEL_MATMUL``: 1 on (where available, the widest instruction set), ``avx2`` /
    ``avx512`` on with that one, and 0 off, without measuring; unset or ``auto`` asks the timed
    choice (also for the instruction set); anything else is an error. Registration is faked: no
    build needed."""
    monkeypatch.setattr(pm, "_register", lambda: True)
    monkeypatch.setattr(pm, "_avx512_supported", True)
    timed = []
    monkeypatch.setattr(pm, "timed_choice", lambda: timed.append(1) or _choice(chosen, "avx512"))
    for env, chosen, want, measured, isa in [
        (None, True, True, 1, "avx512"), (None, False, False, 1, "avx512"), ("auto", True, True, 1, "avx512"),
        ("AUTO ", False, False, 1, "avx512"), ("1", False, True, 0, "avx512"), ("1", True, True, 0, "avx512"),
        ("0", True, False, 0, None), ("avx2", False, True, 0, "avx2"), ("AVX512", False, True, 0, "avx512"),
    ]:  # fmt: skip
        if env is None:
            monkeypatch.delenv("RLJAX_PANEL_MATMUL", raising=False)
        else:
            monkeypatch.setenv("RLJAX_PANEL_MATMUL", env)
        timed.clear()
        assert pm.use_panels() is want, (env, chosen)
        assert len(timed) == measured, env
        if isa is not None:
            assert pm.kernel_isa() == isa, env
    monkeypatch.setattr(pm, "_avx512_supported", False)  # a CPU without AVX-512
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "1")
    assert pm.supported_isas() == ("avx2",) and pm.kernel_isa() == "avx2"
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "avx512")
    with pytest.raises(ValueError, match="lacks it"):
        pm.kernel_isa()
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "0")
    assert not pm.available()  # still "0": the kernel is off altogether
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "1")
    monkeypatch.setattr(pm, "_register", lambda: False)  # forced on, but it did not build
    assert pm.use_panels() is False
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "yes")
    with pytest.raises(ValueError, match="RLJAX_PANEL_MATMUL must be 0"):
        pm.use_panels()


@pytest.fixture
def choice_cache(monkeypatch, tmp_path):
    """A fresh cache directory, a fixed compiler name (the key needs no compiler installed) and the
    process-wide decision forgotten before and after."""
    monkeypatch.setenv("RLJAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(pm, "_compiler", lambda: "c++")
    pm.timed_choice.cache_clear()
    yield tmp_path
    pm.timed_choice.cache_clear()


def test_the_choice_is_written_once_reused_and_rekeyed(choice_cache, monkeypatch, caplog):
    """Measured once and stored; read back (not measured) while the key holds; measured afresh
    when the CPU, the jaxlib version or XLA_FLAGS change; each decision logged with both timings."""
    import jaxlib

    caplog.set_level(logging.INFO, logger=pm.__name__)
    calls = []

    def measure(panel, xla):
        return lambda: calls.append(1) or ([panel] * 3, [xla] * 3)

    def never():
        raise AssertionError("measured although a stored choice matches")

    first = pm._timed_choice(measure(0.010, 0.012))
    assert first.use_panels and not first.cached and calls == [1] and first.isa == "avx2"
    assert "panels (avx2) 10.0 ms vs XLA 12.0 ms" in caplog.text and "measured now" in caplog.text
    (stored,) = choice_cache.glob("*.choice.json")
    data = json.loads(stored.read_text())
    assert data["use_panels"] is True and data["speedup"] == pytest.approx(1.2) and data["isa"] == "avx2"
    assert data["jaxlib"] == jaxlib.__version__ and data["cpu"]
    again = pm._timed_choice(never)
    assert again == pm.Choice(True, first.panel_s, first.xla_s, str(stored), cached=True)

    monkeypatch.setattr(pm, "_cpu_identity", lambda: ("Another CPU", "fma avx2 avx512f"))
    other = pm._timed_choice(measure(0.010, 0.007))
    assert not other.use_panels and not other.cached and len(calls) == 2
    assert "XLA's matmul" in caplog.text and "panels (avx2) 10.0 ms vs XLA 7.0 ms" in caplog.text
    assert pm._timed_choice(never) == pm.Choice(False, other.panel_s, other.xla_s, other.path, cached=True)
    assert len(list(choice_cache.glob("*.choice.json"))) == 2  # one per machine

    monkeypatch.setattr(jaxlib, "__version__", "0.0.0-other")
    assert not pm._timed_choice(measure(0.010, 0.011)).cached and len(calls) == 3
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert not pm._timed_choice(measure(0.010, 0.011)).cached and len(calls) == 4
    assert pm._timed_choice(never).cached

    # several instruction sets: the one with the best paired speedup over XLA is chosen and stored
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    rounds = {"avx2": [0.010, 0.010, 0.030], "avx512": [0.008, 0.012, 0.009]}  # avx512: 1.25, 0.83, 3.3
    wide = pm._timed_choice(lambda: (rounds, [0.010, 0.010, 0.030]))  # avx2: 1.0 in every round
    assert wide.use_panels and wide.isa == "avx512" and wide.panel_s == tuple(rounds["avx512"])
    data = json.loads(open(wide.path).read())
    assert data["isa"] == "avx512" and data["isa_speedups"]["avx2"] == pytest.approx(1.0)
    assert pm._timed_choice(never) == dataclasses.replace(wide, cached=True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")  # AVX-512 2% ahead: AVX2 kept
    close = pm._timed_choice(lambda: ({"avx2": [0.0100] * 3, "avx512": [0.0098] * 3}, [0.012] * 3))
    assert close.use_panels and close.isa == "avx2"


def test_a_damaged_or_foreign_choice_file_is_measured_again(choice_cache):
    first = pm._timed_choice(lambda: ([1.0], [2.0]))
    path = choice_cache / os.path.basename(first.path)
    path.write_text("{not json")
    assert pm._timed_choice(lambda: ([1.0], [0.5])).use_panels is False
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "key": "someone else's"}))
    assert pm._timed_choice(lambda: ([1.0], [2.0])).use_panels is True


def test_timed_choice_measures_and_logs_once_per_process(choice_cache, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=pm.__name__)
    calls = []
    monkeypatch.setattr(pm, "_measure", lambda: calls.append(1) or ({"avx2": [1.0, 1.0]}, [0.8, 0.9]))
    assert pm.timed_choice() is pm.timed_choice()
    assert calls == [1] and caplog.text.count("decode matmuls use XLA's matmul") == 1


@pytest.mark.usefixtures("kernel")
def test_the_measurement_times_both_sides_once_per_round():
    """The real workload (the 29M model's MLP matmuls at 32 rows), two rounds: a positive time for
    each side in each round (which side wins is this machine's business, not the test's)."""
    kernel_s, xla_s = pm._measure(rounds=2)
    assert set(kernel_s) == set(pm.supported_isas()) and len(xla_s) == 2
    assert all(
        len(seconds) == 2 and all(0 < t < 60 for t in seconds) for seconds in [*kernel_s.values(), xla_s]
    )


def test_an_unbuildable_kernel_skips_its_tests_unless_required(monkeypatch):
    """A kernel that did not build fails its tests under ``RLJAX_REQUIRE_PANEL_KERNEL=1``; a CPU
    without one of its instruction sets (AVX2 for the kernel, AVX-512 for its wide variant) skips
    them even then."""
    monkeypatch.setattr(pm, "unavailable_reason", lambda: "no C++ compiler found (set $CXX)")
    with pytest.raises(pytest.skip.Exception, match="no C\\+\\+ compiler"):
        require_panel_kernel({})
    with pytest.raises(pytest.skip.Exception):
        require_panel_kernel({REQUIRE_ENV: "0"})
    with pytest.raises(pytest.fail.Exception, match=f"no C\\+\\+ compiler.*{REQUIRE_ENV}=1"):
        require_panel_kernel({REQUIRE_ENV: "1"})
    monkeypatch.setattr(pm, "unavailable_reason", lambda: pm.NO_KERNEL_ISA)  # built; the CPU lacks AVX2
    with pytest.raises(pytest.skip.Exception, match="lacks AVX2"):
        require_panel_kernel({REQUIRE_ENV: "1"})
    monkeypatch.setattr(pm, "unavailable_reason", lambda: None)
    assert require_panel_kernel({REQUIRE_ENV: "1"}) is None
    monkeypatch.setenv(REQUIRE_ENV, "1")
    monkeypatch.setattr(pm, "supported_isas", lambda: ("avx2",))  # an AMD EPYC without AVX-512
    with pytest.raises(pytest.skip.Exception, match="does not run the avx512 kernel"):
        require_isa("avx512")
    assert require_isa("avx2") is None
