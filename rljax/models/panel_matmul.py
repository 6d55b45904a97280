"""A few-row float32 matmul kernel for decode steps on x86-64 CPUs (an XLA FFI custom call).

``panel_matmul(x, panels)`` computes ``x [M, K] @ W [K, N]`` with ``W`` stored as column panels
``[N / 16, K, 16]`` (:func:`pack_panels`): each 16-column panel is contiguous, so a decode step,
which multiplies one row per sequence by every weight, streams each panel once while the rows
accumulate in vector registers, prefetching the next panel and sharing the panels with XLA's
intra-op thread pool. Two instruction sets (:data:`ISAS`): ``"avx2"`` (up to 6 rows x 1 panel in
12 of the 16 AVX registers) and, on CPUs with AVX-512F, ``"avx512"`` (up to 12 rows x 2 panels in
24 of the 32 registers: a panel row is one register, and each broadcast input feeds two FMAs).
Whether either beats XLA:CPU depends on the machine, not on its flags: on a 2-core AMD EPYC (no
AVX-512) a ``[32, 512] @ [512, 1536]`` product with weights streamed from memory ran at
~125 GFLOP/s against ~70 for XLA's own kernels; on a 2-core Intel Xeon with AVX-512 XLA was
faster than the AVX2 kernel (~70 vs ~60 GFLOP/s on :func:`timed_choice`'s workload; the 29M
model's sampling pass 1.1-1.4x slower with it). So the embedded sampler's default takes a kernel
only where :func:`use_panels` says so: a timed comparison of XLA and every instruction set the CPU
has on decode shapes at first use, cached per machine and build (:func:`timed_choice`; the
fastest kernel is :func:`kernel_isa`); ``RLJAX_PANEL_MATMUL=1`` / ``0`` forces the kernel on (the
widest instruction set) / off, ``=avx2`` / ``=avx512`` forces it on with that one (see
docs/results.md).

The same library holds the decode steps' attention over a KV cache with transposed keys
(:func:`decode_attention`; the embedded sampler's caches store keys so where that was measured
faster, :mod:`rljax.models.key_layout`): XLA:CPU runs it on one thread, the kernel on every thread
of XLA's intra-op pool.

The source (``csrc/panel_matmul.cc``) is compiled on first use with the system's C++ compiler
(``$CXX``, else ``c++``/``g++``) against jaxlib's FFI headers into a per-user cache
(``$RLJAX_KERNEL_CACHE`` or ``~/.cache/rljax/kernels``, else a temporary directory), keyed by the
source, the jaxlib version and the compiler flags, and registered with ``jax.ffi``.
:func:`available` is False (:func:`unavailable_reason` says why), and callers keep XLA's matmul,
when the backend is not the CPU, the CPU lacks AVX2/FMA, no compiler works, or
``RLJAX_PANEL_MATMUL=0``.

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
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ISAS",
    "MARGIN",
    "NO_KERNEL_ISA",
    "PANEL",
    "DECODE_ATTENTION_TARGET",
    "Choice",
    "available",
    "decode_attention",
    "kernel_isa",
    "pack_panels",
    "panel_matmul",
    "prefers_panels",
    "speedup",
    "supported_isas",
    "timed_choice",
    "unavailable_reason",
    "unpack_panels",
    "use_panels",
]

#: Columns per panel (two 8-float AVX registers); ``N`` must be a multiple of it.
PANEL = 16

#: The kernel's instruction sets, narrowest first; :func:`supported_isas` says which this CPU runs.
ISAS = ("avx2", "avx512")
_TARGETS = {"avx2": "rljax_panel_matmul", "avx512": "rljax_panel_matmul_avx512"}
#: The decode-attention kernel's FFI target (:func:`decode_attention`), in the same library.
DECODE_ATTENTION_TARGET = "rljax_decode_attention"
#: :func:`unavailable_reason` on a CPU that runs none of :data:`ISAS` (the kernel built, the CPU
#: cannot run it).
NO_KERNEL_ISA = "this CPU lacks AVX2/FMA"
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


def panel_matmul(x: chex.Array, panels: chex.Array, isa: str = "avx2") -> jax.Array:
    """float32 ``x [M, K] @ W [K, N]`` with ``W`` given as :func:`pack_panels` panels (the FFI kernel
    for instruction set ``isa``, one of :func:`supported_isas`; the sampler's is :func:`kernel_isa`).

    Call only where :func:`available` is True (inside ``jit`` too); no gradient is defined (decode only).
    """
    chex.assert_rank(x, 2)
    chex.assert_rank(panels, 3)
    chex.assert_type([x, panels], jnp.float32)
    if panels.shape[1] != x.shape[1] or panels.shape[2] != PANEL:
        raise ValueError(f"panel_matmul: x {x.shape} does not match panels {panels.shape} ([N/16, K, 16])")
    if not available():
        raise RuntimeError("panel_matmul: the kernel is not available here (see rljax.models.panel_matmul)")
    if isa not in supported_isas():
        raise ValueError(f"panel_matmul isa must be one of this CPU's {supported_isas()}, got {isa!r}")
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(_TARGETS[isa], out)(x, panels)


def decode_attention(
    q: chex.Array, keys: chex.Array, values: chex.Array, valid: chex.Array, *, scale: float
) -> jax.Array:
    """One decode step's attention from a KV cache whose keys are stored transposed (the FFI kernel
    ``rljax_decode_attention``, AVX2; shares XLA's intra-op thread pool): for cache entry
    ``c = b * K + k`` and query ``g``,
    ``out[c, g] = softmax_j(scale * q[c, g] . keys[c, :, j], masked where not valid[b, j]) @ values[c]``
    (:func:`rljax.models.attention.cache_attention` with ``transposed_keys`` and one query token).

    Args:
      q: float32 ``[C, G, D]`` (``C = B * K`` entries, ``G`` query heads per kv head, ``D`` a
        multiple of 8); keys: ``[C, D, S]``; values: ``[C, S, D]``; valid: ``[B, S]`` (nonzero where
        the slot is attended); scale: the scores' factor.

    Returns:
      float32 ``[C, G, D]``. Call only where :func:`available` is True; no gradient (decode only).
    """
    chex.assert_rank([q, keys, values, valid], [3, 3, 3, 2])
    chex.assert_type([q, keys, values], jnp.float32)
    c, g, d = q.shape
    s = values.shape[1]
    if (
        keys.shape != (c, d, s)
        or values.shape != (c, s, d)
        or valid.shape[1] != s
        or c % valid.shape[0]
        or d % 8
    ):
        raise ValueError(
            f"decode_attention: q {q.shape}, keys {keys.shape}, values {values.shape}, valid {valid.shape} "
            "do not match [C, G, D], [C, D, S], [C, S, D], [B, S] (C a multiple of B, D of 8)"
        )
    if not available():
        raise RuntimeError(
            "decode_attention: the kernel is not available here (see rljax.models.panel_matmul)"
        )
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(DECODE_ATTENTION_TARGET, out)
    return call(q, keys, values, valid.astype(jnp.int32), scale=np.float32(scale))


def available() -> bool:
    """True when the kernel is built, registered and usable on this process's default backend (and
    ``RLJAX_PANEL_MATMUL`` is not ``0``). Whether it is also *faster* here is :func:`use_panels`."""
    return unavailable_reason() is None


def supported_isas() -> tuple[str, ...]:
    """The instruction sets of :data:`ISAS` the kernel runs with here (empty where it is not
    :func:`available`)."""
    if not available():
        return ()
    return ISAS if _avx512_supported else ISAS[:1]


def unavailable_reason() -> str | None:
    """Why :func:`available` is False here, in words; None when it is True."""
    if _mode() == "0":
        return "RLJAX_PANEL_MATMUL=0 turns it off"
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()!r}, not the CPU"
    if not _register():
        return _unregistered_because
    return None


# -- whether to use it: a timed comparison on this machine ----------------------------------------

#: ``EmbeddedSampler(kernel_layout="auto")`` takes the kernel only where it beats XLA by this much.
MARGIN = 0.05

#: The comparison's workload (:func:`_measure`): the MLP matmuls of one decode step of the ~29M Qwen3
#: (hidden 512, intermediate 1536, 8 layers: 72 MiB of float32 weights, more than the CPU caches of
#: a core hold, so they stream from memory as in a decode step) for 32 rows (sequences), and the
#: number of interleaved rounds. Part of the cache key: changing it measures again.
_ROWS, _HIDDEN, _INTERMEDIATE, _LAYERS, _ROUNDS = 32, 512, 1536, 8, 9


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of the timed comparison behind :func:`use_panels`.

    Attributes:
      use_panels: whether the kernel won by :data:`MARGIN` (:func:`prefers_panels`).
      panel_s, xla_s: seconds of each round's workload pass with the kernel (the fastest of the
        instruction sets measured, ``isa``) and with XLA (the weights stored ``[out, in]``, the
        sampler's layout without the kernel), in round order.
      path: the cache file the decision is stored in.
      cached: True when read from ``path`` rather than measured by this process.
      isa: the kernel's instruction set with the best :func:`speedup` over XLA, where it beats the
        narrowest one (AVX2) by :data:`MARGIN` (:func:`kernel_isa`).
    """

    use_panels: bool
    panel_s: tuple[float, ...]
    xla_s: tuple[float, ...]
    path: str
    cached: bool = False
    isa: str = "avx2"

    def describe(self) -> str:
        """One line: the decision and both timings (logged once per process)."""
        verdict = f"the panel kernel ({self.isa})" if self.use_panels else "XLA's matmul"
        origin = "cached" if self.cached else "measured now"
        return (
            f"decode matmuls use {verdict}: panels ({self.isa}) "
            f"{statistics.median(self.panel_s) * 1e3:.1f} ms vs "
            f"XLA {statistics.median(self.xla_s) * 1e3:.1f} ms per 32-row MLP pass of the 29M model "
            f"(medians of {len(self.panel_s)} interleaved rounds; XLA / panels "
            f"{speedup(self.panel_s, self.xla_s):.2f}x, panels need >= {1 + MARGIN:.2f}x; "
            f"{origin}, {self.path})"
        )


def speedup(panel_s: Sequence[float], xla_s: Sequence[float]) -> float:
    """Median over rounds of ``xla_s[i] / panel_s[i]``: each round timed both back to back, so load
    that changes between rounds cancels in the ratio.

    >>> speedup([1.0, 2.0, 1.0], [1.2, 2.2, 0.5])
    1.1
    """
    if len(panel_s) != len(xla_s) or not panel_s:
        raise ValueError(f"need the same number (>= 1) of rounds, got {len(panel_s)} and {len(xla_s)}")
    return statistics.median(x / p for p, x in zip(panel_s, xla_s, strict=True))


def prefers_panels(panel_s: Sequence[float], xla_s: Sequence[float], *, margin: float = MARGIN) -> bool:
    """True when the kernel beats XLA by at least ``margin`` (``speedup >= 1 + margin``); a tie or a
    small edge keeps XLA, whose matmul needs no extra copy of the weights.

    >>> prefers_panels([1.0, 1.0], [1.1, 1.1]), prefers_panels([1.0, 1.0], [1.02, 1.03])
    (True, False)
    """
    return speedup(panel_s, xla_s) >= 1 + margin


def use_panels() -> bool:
    """Whether ``EmbeddedSampler(kernel_layout="auto")`` multiplies with the kernel on this machine.

    ``RLJAX_PANEL_MATMUL=1`` (or ``avx2`` / ``avx512``): wherever it is :func:`available`; ``=0``:
    never; unset (or ``auto``): where it is available and the timed comparison
    (:func:`timed_choice`) found it faster than XLA by :data:`MARGIN`. A CPU flag alone does not say
    so: on an AMD EPYC without AVX-512 the AVX2 kernel decoded 1.26x faster than XLA, on an Intel
    Xeon with AVX-512 1.4x slower.
    """
    mode = _mode()
    if mode == "0" or not available():
        return False
    return mode != "auto" or timed_choice().use_panels


def kernel_isa() -> str:
    """The instruction set the sampler's kernel runs with (:func:`panel_matmul` ``isa``).

    ``RLJAX_PANEL_MATMUL=avx2`` / ``avx512``: that one (a ``ValueError`` where the CPU lacks it);
    ``=1``: the widest this CPU has; unset (or ``auto``): the fastest in the timed comparison
    (:func:`timed_choice`). Call only where :func:`available` is True.
    """
    mode = _mode()
    if mode in ISAS:
        if mode not in supported_isas():
            have = supported_isas()
            raise ValueError(f"RLJAX_PANEL_MATMUL={mode}: this CPU lacks it (it has {have})")
        return mode
    if mode == "auto":
        return timed_choice().isa
    return supported_isas()[-1]


def _mode() -> str:
    mode = os.environ.get("RLJAX_PANEL_MATMUL", "").strip().lower() or "auto"
    if mode not in ("0", "1", "auto", *ISAS):
        raise ValueError(
            "RLJAX_PANEL_MATMUL must be 0 (off), 1 (on), auto (timed, default) or an instruction set "
            f"of {ISAS} (on with it), got {mode!r}"
        )
    return mode


@functools.cache
def timed_choice() -> Choice:
    """The kernel against XLA on this machine, measured at first use (:func:`_measure`: ~1 s) and
    stored beside the library. The file is keyed by the build (source, jaxlib, compiler, flags), the
    CPU's model name and feature flags, the usable core count, ``XLA_FLAGS`` (they change XLA's
    code) and the workload: another machine, build, XLA setting or workload measures afresh. Read
    once per process and logged (INFO) with both timings; delete the ``*.choice.json`` file to
    measure again. Call only where :func:`available` is True."""
    return _timed_choice(_measure)


def _timed_choice(
    measure: Callable[[], tuple[Mapping[str, Sequence[float]] | Sequence[float], Sequence[float]]],
) -> Choice:
    """The stored choice, or ``measure()``'s: ``(kernel seconds, XLA seconds)`` per round, the kernel's
    as a sequence (the AVX2 kernel's) or a mapping ``{isa: seconds}``; the best ``isa`` is chosen."""
    key = _choice_key()
    path = _cache_dir() / f"panel_matmul-{key}.choice.json"
    choice = _read_choice(path, key)
    if choice is None:
        kernel_s, xla_s = measure()
        by_isa = dict(kernel_s) if isinstance(kernel_s, Mapping) else {"avx2": kernel_s}
        isa = _fastest_isa({name: speedup(seconds, xla_s) for name, seconds in by_isa.items()})
        panel_s = by_isa[isa]
        choice = Choice(prefers_panels(panel_s, xla_s), tuple(panel_s), tuple(xla_s), str(path), isa=isa)
        _write_choice(path, key, choice, by_isa)
    _log.info("rljax panel_matmul: %s", choice.describe())
    return choice


def _fastest_isa(speedups: Mapping[str, float], *, margin: float = MARGIN) -> str:
    """The instruction set with the best speedup over XLA, where it beats the narrowest one measured
    by ``margin`` (wider vectors can lower the clock of the whole core); else the narrowest.

    >>> _fastest_isa({"avx2": 1.20, "avx512": 1.30}), _fastest_isa({"avx2": 1.20, "avx512": 1.24})
    ('avx512', 'avx2')
    """
    narrowest = min(speedups, key=ISAS.index)
    best = max(speedups, key=lambda name: speedups[name])
    return best if speedups[best] >= speedups[narrowest] * (1 + margin) else narrowest


def _choice_key() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workload = (_ROWS, _HIDDEN, _INTERMEDIATE, _LAYERS, _ROUNDS, MARGIN)
    parts = [_build_key(), *_cpu_identity(), str(cores), os.environ.get("XLA_FLAGS", ""), repr(workload)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu_identity() -> tuple[str, str]:
    """The CPU's model name and feature flags (``/proc/cpuinfo``; ``platform``'s words elsewhere)."""
    fields: dict[str, str] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields.get("model name") or f"{platform.machine()} {platform.processor()}", fields.get("flags", "")


def _read_choice(path: Path, key: str) -> Choice | None:
    """The stored choice, or None when there is none (or it is unreadable, or another key's)."""
    try:
        data = json.loads(path.read_text())
        if data["key"] != key or data["isa"] not in ISAS:
            return None
        return Choice(bool(data["use_panels"]), tuple(data["panel_s"]), tuple(data["xla_s"]), str(path), True,
                      data["isa"])  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_choice(path: Path, key: str, choice: Choice, by_isa: Mapping[str, Sequence[float]]) -> None:
    """Stores ``choice`` and every instruction set's timings (written aside, then renamed: concurrent
    first uses are safe)."""
    import jaxlib

    data = {
        "key": key,
        "use_panels": choice.use_panels,
        "isa": choice.isa,
        "panel_s": list(choice.panel_s),
        "xla_s": list(choice.xla_s),
        "speedup": speedup(choice.panel_s, choice.xla_s),
        "isa_speedups": {name: speedup(seconds, choice.xla_s) for name, seconds in by_isa.items()},
        "cpu": _cpu_identity()[0],
        "jaxlib": jaxlib.__version__,
    }
    store_choice(path, data, "panel_matmul")


def store_choice(path: Path, data: dict, what: str) -> None:
    """Writes a timed choice's ``data`` (JSON) to ``path``: aside, then renamed, so concurrent first
    uses are safe; a failure is logged (the decision still holds for this process)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        _log.info("could not store the %s choice in %s: %s", what, path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _measure(rounds: int = _ROUNDS) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds of one workload pass (see ``_ROWS``) with the kernel in each of this CPU's instruction
    sets (``{isa: seconds}``) and with XLA, ``rounds`` times each, interleaved (the order rotating),
    after a warm-up call of each (compilation)."""
    shapes = [(_HIDDEN, _INTERMEDIATE), (_HIDDEN, _INTERMEDIATE), (_INTERMEDIATE, _HIDDEN)] * _LAYERS
    rng = np.random.default_rng(0)  # numpy: no eager jax op to compile, the setup stays ~0.1 s
    weights = [rng.standard_normal(s, np.float32) * np.float32(s[0] ** -0.5) for s in shapes]
    x = jnp.asarray(rng.standard_normal((_ROWS, _HIDDEN), np.float32))
    panels = [jnp.asarray(w.reshape(w.shape[0], -1, PANEL).transpose(1, 0, 2).copy()) for w in weights]
    out_in = [jnp.asarray(w.T.copy()) for w in weights]
    runs = {isa: (jax.jit(functools.partial(_mlp_pass, functools.partial(panel_matmul, isa=isa))), panels)
            for isa in supported_isas()}  # fmt: skip
    runs["xla"] = (jax.jit(functools.partial(_mlp_pass, _matmul_out_in)), out_in)
    del weights
    for fn, ws in runs.values():
        jax.block_until_ready(fn(ws, x))
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn, ws = runs[name]
            start = time.perf_counter()
            jax.block_until_ready(fn(ws, x))
            seconds[name].append(time.perf_counter() - start)
    xla_s = seconds.pop("xla")
    return seconds, xla_s


def _mlp_pass(matmul: Callable[[jax.Array, jax.Array], jax.Array], weights: list, x: jax.Array) -> jax.Array:
    """The gated MLPs of a decode step: ``x + down(silu(gate(x)) * up(x))`` per layer."""
    for i in range(0, len(weights), 3):
        gate, up, down = weights[i : i + 3]
        x = x + matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down)
    return x


def _matmul_out_in(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for ``w`` stored ``[out, in]`` (:class:`rljax.models.decode_layout.TransposedLinear`)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


#: Why :func:`_register` failed (for :func:`unavailable_reason`).
_unregistered_because = "not registered yet"
#: Whether this CPU runs the AVX-512 kernel (set by :func:`_register`).
_avx512_supported = False


@functools.cache
def _register() -> bool:
    global _unregistered_because, _avx512_supported
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        _log.warning("rljax panel_matmul kernel unavailable (XLA's matmul is used instead): %s", e)
        _unregistered_because = f"the kernel did not build or load: {e}"
        return False
    if not lib.rljax_panel_matmul_supported():
        _unregistered_because = NO_KERNEL_ISA
        return False
    jax.ffi.register_ffi_target(_TARGETS["avx2"], jax.ffi.pycapsule(lib.RljaxPanelMatmul), platform="cpu")
    capsule = jax.ffi.pycapsule(lib.RljaxDecodeAttention)
    jax.ffi.register_ffi_target(DECODE_ATTENTION_TARGET, capsule, platform="cpu")
    _avx512_supported = bool(lib.rljax_panel_matmul_avx512_supported())
    if _avx512_supported:
        capsule = jax.ffi.pycapsule(lib.RljaxPanelMatmulAvx512)
        jax.ffi.register_ffi_target(_TARGETS["avx512"], capsule, platform="cpu")
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


def _build_key() -> str:
    """Names one build: the source, the jaxlib version, the compiler and its flags."""
    import jaxlib

    words = [jaxlib.__version__, _compiler(), " ".join(_FLAGS)]
    return hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), *(w.encode() for w in words)])).hexdigest()[:16]


def _build() -> Path:
    """The compiled library, built once per (source, jaxlib, compiler, flags) into the cache."""
    cxx = _compiler()
    lib = _cache_dir() / f"panel_matmul-{_build_key()}.so"
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
