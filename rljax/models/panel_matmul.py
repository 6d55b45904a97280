"""A few-row float32 matmul kernel for decode steps on x86-64 CPUs (an XLA FFI custom call).

``panel_matmul(x, panels)`` computes ``x [M, K] @ W [K, N]`` with ``W`` stored as column panels
``[N / 16, K, 16]`` (:func:`pack_panels`): each 16-column panel is contiguous, so a decode step,
which multiplies one row per sequence by every weight, streams each panel once while up to six rows
accumulate in AVX2 registers, prefetching the next panel and sharing the panels with XLA's intra-op
thread pool. On the 2-core development machine a ``[32, 512] @ [512, 1536]`` product with weights
streamed from memory ran at ~125 GFLOP/s against ~70 for XLA:CPU's own kernels on the same shapes
(see docs/results.md for the sampler-level figures).

The source (``csrc/panel_matmul.cc``) is compiled on first use with the system's C++ compiler
(``$CXX``, else ``c++``/``g++``) against jaxlib's FFI headers into a per-user cache
(``$RLJAX_KERNEL_CACHE`` or ``~/.cache/rljax/kernels``, else a temporary directory), keyed by the
source, the jaxlib version and the compiler flags, and registered with ``jax.ffi``.
:func:`available` is False, and callers keep XLA's matmul, when the backend is not the CPU, the CPU
lacks AVX2/FMA, no compiler works, or ``RLJAX_PANEL_MATMUL=0``.

>>> import jax.numpy as jnp, numpy as np
>>> w = np.arange(12 * 32, dtype=np.float32).reshape(12, 32) / 100
>>> x = np.ones((3, 12), np.float32)
>>> if available():
...     y = panel_matmul(jnp.asarray(x), pack_panels(jnp.asarray(w)))
...     np.testing.assert_allclose(y, x @ w, rtol=1e-6)
>>> pack_panels(jnp.asarray(w)).shape
(2, 12, 16)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import chex
import jax
import jax.numpy as jnp

__all__ = ["PANEL", "available", "pack_panels", "panel_matmul", "unpack_panels"]

#: Columns per panel (two 8-float AVX registers); ``N`` must be a multiple of it.
PANEL = 16

_TARGET = "rljax_panel_matmul"
_SOURCE = Path(__file__).parent / "csrc" / "panel_matmul.cc"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-mavx2", "-mfma", "-w")
_log = logging.getLogger(__name__)


def pack_panels(kernel: chex.Array) -> jax.Array:
    """``[K, N]`` (a Linear kernel stored ``[in, out]``) -> ``[N / 16, K, 16]`` column panels.

    >>> pack_panels(jnp.arange(2 * 32).reshape(2, 32))[1, 0, :3].tolist()  # W[0, 16:19]
    [16, 17, 18]
    """
    chex.assert_rank(kernel, 2)
    k, n = kernel.shape
    if n % PANEL:
        raise ValueError(f"pack_panels needs a multiple of {PANEL} output columns, got {n}")
    return jnp.transpose(kernel.reshape(k, n // PANEL, PANEL), (1, 0, 2))


def unpack_panels(panels: chex.Array) -> jax.Array:
    """Inverse of :func:`pack_panels`: ``[N / 16, K, 16]`` -> ``[K, N]``."""
    chex.assert_rank(panels, 3)
    p, k, w = panels.shape
    return jnp.transpose(panels, (1, 0, 2)).reshape(k, p * w)


def panel_matmul(x: chex.Array, panels: chex.Array) -> jax.Array:
    """float32 ``x [M, K] @ W [K, N]`` with ``W`` given as :func:`pack_panels` panels (the FFI kernel).

    Call only where :func:`available` is True (inside ``jit`` too); no gradient is defined (decode only).
    """
    chex.assert_rank(x, 2)
    chex.assert_rank(panels, 3)
    chex.assert_type([x, panels], jnp.float32)
    if panels.shape[1] != x.shape[1] or panels.shape[2] != PANEL:
        raise ValueError(f"panel_matmul: x {x.shape} does not match panels {panels.shape} ([N/16, K, 16])")
    if not available():
        raise RuntimeError("panel_matmul: the kernel is not available here (see rljax.models.panel_matmul)")
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out)(x, panels)


def available() -> bool:
    """True when the kernel is built, registered and usable on this process's default backend."""
    if os.environ.get("RLJAX_PANEL_MATMUL", "1") == "0" or jax.default_backend() != "cpu":
        return False
    return _register()


@functools.cache
def _register() -> bool:
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        _log.warning("rljax panel_matmul kernel unavailable (XLA's matmul is used instead): %s", e)
        return False
    if not lib.rljax_panel_matmul_supported():
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.RljaxPanelMatmul), platform="cpu")
    return True


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (set $CXX)")


def _cache_dir() -> Path:
    """``$RLJAX_KERNEL_CACHE`` or ``~/.cache/rljax/kernels``; a per-user temporary directory when
    that cannot be created (a read-only home, say)."""
    preferred = Path(os.environ.get("RLJAX_KERNEL_CACHE") or Path.home() / ".cache" / "rljax" / "kernels")
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    except OSError as e:
        fallback = Path(tempfile.gettempdir()) / f"rljax-kernels-{os.getuid()}"
        _log.info("kernel cache %s unusable (%s); using %s", preferred, e, fallback)
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _build() -> Path:
    """The compiled library, built once per (source, jaxlib, compiler, flags) into the cache."""
    import jaxlib

    cxx = _compiler()
    parts = [_SOURCE.read_bytes(), jaxlib.__version__.encode(), cxx.encode(), " ".join(_FLAGS).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    lib = _cache_dir() / f"panel_matmul-{key}.so"
    if lib.exists():
        return lib
    # built aside, then renamed into place: concurrent builds (test workers) are safe
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {_SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, lib)
    return lib
