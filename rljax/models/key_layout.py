"""Which KV-cache key layout the embedded sampler decodes with on this machine: a timed choice.

A decode step's attention reads every cached key and value once per layer. The cache stores keys
either like the values, ``[B*K, S, D]``, or transposed, ``[B*K, D, S]`` (:class:`rljax.models.KVCache`
``transposed_keys``; :func:`rljax.models.attention.cache_attention`). With transposed keys a decode
step on the CPU runs the decode-attention kernel (:func:`rljax.models.panel_matmul.decode_attention`:
both cores, keys and values streamed once, ~16-20 GB/s on a 2-core Intel Xeon where XLA:CPU's
batched matmuls ran single-threaded at ~10 GB/s), or XLA's ``q @ keys`` where the kernel is not
available (whose scores were also faster than with the plain layout there). The generation pass
of the ~29M model (32 prompts x (64 + 128) tokens) ran 1.15x faster on that Xeon. Other CPUs were
not measured, and on an accelerator the matmul libraries take either layout at the same speed, so
the sampler's default (:func:`use_transposed_keys`) takes the transposed layout only on the CPU and
only where a timed comparison of both on decode shapes found it faster by :data:`MARGIN`, measured
at first use (a few seconds) and cached per machine (:func:`timed_choice`).
``RLJAX_TRANSPOSED_KEYS=1`` / ``0`` forces it on / off; both layouts give the same tokens and
logprobs up to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.decode import decode_step
from rljax.models.decoder import Decoder
from rljax.models.kv_cache import KVCache, init_cache

# the machine identity and cache folder of the panel kernel's timed choice (one cache for both)
from rljax.models.panel_matmul import _cache_dir, _cpu_identity, speedup, store_choice

__all__ = ["MARGIN", "KeyLayoutChoice", "timed_choice", "use_transposed_keys"]

_log = logging.getLogger(__name__)

#: The transposed layout is the default only where it beats the other by this much.
MARGIN = 0.05

#: The comparison's workload (:func:`_measure`): decode steps of a model with the ~29M Qwen3's
#: attention (8 layers, 4 kv heads x 2 query heads, head dim 64) for 32 rows at 192 slots (the end
#: of a 64-token prompt + 128 new tokens), 4 steps per pass, and the number of interleaved rounds.
#: Part of the cache key: changing it measures again.
_ROWS, _KV_HEADS, _GROUPS, _HEAD_DIM, _SLOTS, _LAYERS, _STEPS, _ROUNDS = 32, 4, 2, 64, 192, 8, 4, 7


@dataclasses.dataclass(frozen=True)
class KeyLayoutChoice:
    """The outcome of :func:`timed_choice`.

    Attributes:
      transposed: whether the transposed keys won by :data:`MARGIN`.
      transposed_s, slot_major_s: seconds of each round's workload pass with each layout.
      path: the cache file the decision is stored in.
      cached: True when read from ``path`` rather than measured by this process.
    """

    transposed: bool
    transposed_s: tuple[float, ...]
    slot_major_s: tuple[float, ...]
    path: str
    cached: bool = False

    def describe(self) -> str:
        """One line: the decision and both timings (logged once per process)."""
        verdict = "transposed [B*K, D, S]" if self.transposed else "[B*K, S, D]"
        origin = "cached" if self.cached else "measured now"
        return (
            f"decode KV caches store keys {verdict}: transposed "
            f"{statistics.median(self.transposed_s) * 1e3:.1f} ms vs "
            f"{statistics.median(self.slot_major_s) * 1e3:.1f} ms per pass of {_STEPS} decode steps "
            f"(medians of {len(self.transposed_s)} interleaved rounds; "
            f"{speedup(self.transposed_s, self.slot_major_s):.2f}x, needs >= {1 + MARGIN:.2f}x; "
            f"{origin}, {self.path})"
        )


def use_transposed_keys() -> bool:
    """Whether the embedded sampler's KV caches store keys transposed on this machine.

    ``RLJAX_TRANSPOSED_KEYS=1``: yes; ``=0``: no; unset (or ``auto``): on the CPU backend where the
    timed comparison (:func:`timed_choice`) found them faster by :data:`MARGIN`, never elsewhere.
    """
    mode = os.environ.get("RLJAX_TRANSPOSED_KEYS", "").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise ValueError(
            f"RLJAX_TRANSPOSED_KEYS must be 0 (off), 1 (on) or auto (timed, default), got {mode!r}"
        )
    if mode != "auto":
        return mode == "1"
    return jax.default_backend() == "cpu" and timed_choice().transposed


@functools.cache
def timed_choice() -> KeyLayoutChoice:
    """Both key layouts on this machine, measured at first use (:func:`_measure`) and stored beside
    the panel kernel's choice (``$RLJAX_KERNEL_CACHE`` or ``~/.cache/rljax/kernels``), keyed by the
    jaxlib version, the CPU's model name and flags, the usable core count, ``XLA_FLAGS`` and the
    workload. Read once per process and logged (INFO); delete the ``*.choice.json`` file to measure
    again."""
    key = _choice_key()
    path = _cache_dir() / f"key_layout-{key}.choice.json"
    choice = _read(path, key)
    if choice is None:
        transposed_s, slot_major_s = _measure()
        wins = speedup(transposed_s, slot_major_s) >= 1 + MARGIN
        choice = KeyLayoutChoice(wins, tuple(transposed_s), tuple(slot_major_s), str(path))
        _write(path, key, choice)
    _log.info("rljax key layout: %s", choice.describe())
    return choice


def _choice_key() -> str:
    import jaxlib

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workload = (_ROWS, _KV_HEADS, _GROUPS, _HEAD_DIM, _SLOTS, _LAYERS, _STEPS, _ROUNDS, MARGIN)
    parts = [
        jaxlib.__version__,
        *_cpu_identity(),
        str(cores),
        os.environ.get("XLA_FLAGS", ""),
        repr(workload),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _read(path: Path, key: str) -> KeyLayoutChoice | None:
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        timings = tuple(data["transposed_s"]), tuple(data["slot_major_s"])
        return KeyLayoutChoice(bool(data["transposed"]), *timings, str(path), cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, key: str, choice: KeyLayoutChoice) -> None:
    """Stores ``choice`` and its speedup (``store_choice``: written aside, then renamed)."""
    data = {"key": key, "cpu": _cpu_identity()[0], **dataclasses.asdict(choice)}
    data.pop("path"), data.pop("cached")
    data["speedup"] = speedup(choice.transposed_s, choice.slot_major_s)
    store_choice(path, data, "key layout")


def _attention_model() -> Decoder:
    """A random Qwen3 with the ~29M model's attention (8 layers, 8 query / 4 kv heads of dim 64) and
    a token's worth of everything else (hidden 128, MLP 128, vocab 256): its decode step is mostly
    the attention over the cache."""
    config = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=128, intermediate_size=128,
                         num_layers=_LAYERS, num_heads=_KV_HEADS * _GROUPS, num_kv_heads=_KV_HEADS,
                         head_dim=_HEAD_DIM, qk_norm=True, tie_word_embeddings=True)  # fmt: skip
    return Decoder(config, rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _decode_steps(graphdef: Any, state: Any, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """``_STEPS`` greedy decode steps from ``cache`` (donated: written in place, as the sampler's loop)."""
    model = nnx.merge(graphdef, state)

    def step(_: jax.Array, carry: tuple[jax.Array, KVCache]) -> tuple[jax.Array, KVCache]:
        logits, cache, _ = decode_step(model, carry[0], carry[1])
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    return jax.lax.fori_loop(0, _STEPS, step, (jnp.zeros((_ROWS,), jnp.int32), cache))


def _measure(rounds: int = _ROUNDS) -> tuple[list[float], list[float]]:
    """Seconds of ``_STEPS`` decode steps of :func:`_attention_model` from a cache whose first
    ``_SLOTS - _STEPS`` slots are filled (zeros: the speed does not depend on the values), with
    transposed and with slot-major keys, ``rounds`` times each, interleaved (the order alternating),
    after a warm-up pass of each (compilation)."""
    model = _attention_model()
    graphdef, state = nnx.split(model)
    filled = _SLOTS - _STEPS

    def full_cache(transposed: bool) -> KVCache:
        cache = init_cache(model.config, batch_size=_ROWS, max_length=_SLOTS, transposed_keys=transposed)
        written = jnp.arange(_SLOTS)[None, :] < filled
        return jax.block_until_ready(cache.replace(
            segment_ids=jnp.where(written, 1, cache.segment_ids).astype(jnp.int32),
            lengths=jnp.full((_ROWS,), filled, jnp.int32), index=jnp.asarray(filled, jnp.int32),
        ))  # fmt: skip

    seconds: dict[bool, list[float]] = {True: [], False: []}
    for i in range(rounds + 1):
        for transposed in (True, False) if i % 2 == 0 else (False, True):
            cache = full_cache(transposed)
            start = time.perf_counter()
            jax.block_until_ready(_decode_steps(graphdef, state, cache))
            if i:  # the first pass compiles
                seconds[transposed].append(time.perf_counter() - start)
    return seconds[True], seconds[False]
