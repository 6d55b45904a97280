"""The AVX2 few-row matmul kernel (``rljax.models.panel_matmul``) against float64 numpy.

The reference bound is the textbook one for a float32 dot product of length K summed in any order:
``|fl(x . w) - x . w| <= K * eps32 * (|x| . |w|)`` per output element (Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., eq. 3.5, first order) — an a priori bound, not a measured one, so
it holds on any machine, while a wrong panel, row, prefetch or thread split gives errors of the
size of the outputs themselves.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import panel_matmul as pm

EPS32 = float(np.finfo(np.float32).eps)

# M: 1 row .. past a 48-row tile (and every micro-kernel remainder 1-5); N: 1 panel .. several work
# items of 4 panels plus a partial one; K: odd and short, and the decode shapes. Products of 2^20
# multiply-adds or more are shared with XLA's thread pool (the last two), smaller ones run inline.
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


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert jax.default_backend() == "cpu"
    # this project's machines (x86-64 with AVX2/FMA and a C++ compiler) must build it
    assert pm.available(), "the panel_matmul kernel did not build (see the logged warning)"


def within_float32_bound(y, x, w):
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64
    bound = x.shape[1] * EPS32 * (np.abs(x64) @ np.abs(w64)) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= bound), f"max err / bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_matches_float64_numpy(shape, jit):
    m, k, n = shape
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(k, n)).astype(np.float32)
    fn = jax.jit(pm.panel_matmul) if jit else pm.panel_matmul
    within_float32_bound(fn(jnp.asarray(x), pm.pack_panels(jnp.asarray(w))), x, w)


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


def test_switch_and_build_failure_fall_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "0")
    assert not pm.available()
    monkeypatch.delenv("RLJAX_PANEL_MATMUL")
    assert pm.available()
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


def test_an_unusable_cache_directory_falls_back_to_a_temporary_one(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("RLJAX_KERNEL_CACHE", str(blocker / "kernels"))
    monkeypatch.setattr(pm.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fallback = pm._cache_dir()  # where _build then writes the library
    assert fallback == tmp_path / "tmp" / f"rljax-kernels-{os.getuid()}" and fallback.is_dir()
