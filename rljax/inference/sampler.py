"""Embedded JAX sampler: batched in-process generation with the trainer's own parameters (design §5).

The default engine on a single machine. It implements :class:`rljax.inference.engine.Engine`
(``await sampler.generate(prompt_ids, sampling, session_id=...)``) on top of the model's KV cache
(:func:`rljax.models.prefill` / :func:`rljax.models.decode_step`), and needs no weight sync:
:meth:`EmbeddedSampler.update_weights` just swaps the parameter reference and bumps the version.

Batching. Concurrent ``generate`` calls are queued for ``batch_wait_ms`` and run together as one
jitted program: prompts are left-padded (segment id 0 marks padding, positions count only real
tokens, so padding never changes a row's logits), then one ``lax.while_loop`` samples a token for
every row, feeds it back through the cache and stops when every row is done. Each row carries its
own temperature, top-k, top-p, token budget, stop ids and seed. Shapes are bucketed to powers of
two (prompt length, new tokens, batch rows, stop ids), so ``jit`` compiles a bounded number of
programs. A row's random stream depends only on its seed and the step index
(``fold_in(key(seed), t)``), so a request gives the same completion alone or inside any batch.

Logprobs (vLLM ``logprobs_mode="processed_logprobs"``, design §5): each returned logprob is
``log p~(token)`` under the *processed* distribution the token was drawn from::

    z = logits / T                                   (T = 1 for greedy rows, T < 1e-5)
    z = z  where z >= (k-th largest z) else -inf     (top-k, when enabled)
    z = z  where z >= tau_p else -inf                (top-p: tau_p = smallest z of the shortest
                                                      prefix of the sorted distribution whose
                                                      mass before it is < p)
    log p~ = log_softmax(z)

With top-k and top-p off this is exactly what :func:`rljax.models.sequence_logprobs` computes with
``temperature=T`` on the same tokens, which the tests check. Sampling is by inversion of the
cumulative distribution (one uniform per row and step: ``x_t = min{v : F(v) > u F(V-1)}``,
``F = cumsum(p~)``), an exact draw from ``p~`` that needs ``B`` random numbers per step instead of
the ``B x V`` of Gumbel-max; greedy rows take ``argmax(log p~)``. References: Holtzman et al. 2020
(nucleus sampling); vLLM ``v1/sample/ops/topk_topp_sampler.py`` (top-k then top-p on
temperature-scaled logits); Devroye 1986 (inversion).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.inference.engine import Completion, SamplingParams
from rljax.models.decode import SharedPrefix, decode_step, prefill
from rljax.models.decode_layout import decode_layout
from rljax.models.key_layout import use_transposed_keys
from rljax.models.kv_cache import EMPTY_SLOT, grow_cache
from rljax.models.panel_matmul import available as panel_matmul_available
from rljax.models.panel_matmul import kernel_isa, use_panels
from rljax.types import VersionSpan

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "GREEDY_EPS",
    "KERNEL_LAYOUTS",
    "MIN_SEGMENT_STEPS",
    "MIN_SHARED_PREFIX",
    "EmbeddedSampler",
    "auto_kernel_layout",
    "bucket_size",
    "shared_prefix_groups",
    "decode_segment_ends",
    "first_argmax",
    "generate_tokens",
    "processed_logprobs",
    "processed_logprobs_and_floor",
    "sample_by_inversion",
    "sample_from_logprobs",
    "step_uniforms",
    "to_decode_layout",
]

#: Temperatures below this mean greedy decoding (vLLM's ``_SAMPLING_EPS``).
GREEDY_EPS = 1e-5
#: Finish codes of a sequence in the decode loop: still running, stopped (a stop token), out of
#: tokens (``max_tokens`` or the context).
FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
_FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}
_NEG_INF = -jnp.inf
#: Fewest decode steps per segment of the generation loop (:func:`decode_segment_ends`).
MIN_SEGMENT_STEPS = 32
#: Fewest leading tokens two different prompts of a batch must share for the sampler to prefill
#: them once (:func:`shared_prefix_groups`); identical prompts always share.
MIN_SHARED_PREFIX = 16
#: Smallest padded width of the rows' own prompt tokens after a shared prefix (fewer programs).
_MIN_OWN_BUCKET = 8


def bucket_size(n: int, *, minimum: int = 1) -> int:
    """Smallest power of two ``>= max(n, minimum)`` (bounds the number of jit compilations).

    >>> bucket_size(5), bucket_size(16), bucket_size(3, minimum=8)
    (8, 16, 8)
    """
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def shared_prefix_groups(
    prompts: Sequence[Sequence[int]], *, min_shared: int | None = MIN_SHARED_PREFIX
) -> tuple[list[int], list[int]]:
    """Groups a batch's prompts by shared prefix: ``(group of each prompt, shared length of each group)``.

    Identical prompts form one group whose prefix is the whole prompt (a GRPO group's samples arrive
    together). With ``min_shared`` (None: identical prompts only), different prompts that share at
    least ``min_shared`` leading tokens group too, with the longest prefix common to the whole group
    (multi-turn samples whose histories start alike). The prompts are taken in lexicographic order,
    where a group's common prefix is the smallest one between neighbours, and each joins the group
    before it when the common prefix stays ``>= min_shared`` and the prefill tokens the group saves do
    not drop (``k * lcp_new >= (k - 1) * lcp_old`` for a group of ``k``): one short match never cuts a
    long shared prefix. Groups are numbered in order of their first prompt; a lone prompt is a group
    of one whose prefix is the whole prompt.

    >>> shared_prefix_groups([[1, 2, 3], [4, 5], [1, 2, 3]])
    ([0, 1, 0], [3, 2])
    >>> shared_prefix_groups([[1, 2, 3, 4], [1, 9], [1, 2, 3, 5], [1, 2, 3]], min_shared=2)
    ([0, 1, 0, 0], [3, 2])
    >>> shared_prefix_groups([[1, 2, 3, 4], [1, 2, 3, 5]], min_shared=None)
    ([0, 1], [4, 4])
    """
    if min_shared is not None and min_shared < 1:
        raise ValueError(f"min_shared must be None or >= 1, got {min_shared}")
    runs: list[list[int]] = []
    common: list[int] = []
    for i in sorted(range(len(prompts)), key=lambda j: list(prompts[j])):
        p = prompts[i]
        if runs:
            last, old, k = prompts[runs[-1][-1]], common[-1], len(runs[-1])
            new = min(old, _common_prefix_len(last, p))
            identical = new == old == len(p) == len(last)
            if identical or (min_shared is not None and new >= min_shared and k * new >= (k - 1) * old):
                runs[-1].append(i)
                common[-1] = new
                continue
        runs.append([i])
        common.append(len(p))
    order = sorted(range(len(runs)), key=lambda r: min(runs[r]))
    groups = [0] * len(prompts)
    for g, r in enumerate(order):
        for i in runs[r]:
            groups[i] = g
    return groups, [common[r] for r in order]


def processed_logprobs(
    logits: chex.Array,
    temperature: chex.Array,
    top_k: chex.Array,
    top_p: chex.Array,
) -> jax.Array:
    """Log-probabilities of the processed sampling distribution (temperature, top-k, top-p).

    Per row: ``z = logits / T``; top-k keeps ``z >= z_(k)`` (the k-th largest, ties kept);
    top-p then keeps, in descending order, every token whose preceding mass (under the top-k
    renormalized distribution) is ``< p`` (ties with the last kept value kept too); the result is
    ``log_softmax`` over the kept tokens (``-inf`` elsewhere). ``top_k <= 0`` or ``>= V`` and
    ``top_p >= 1`` disable the filters. Holtzman et al. 2020; the vLLM processed-logprobs order.

    Args:
      logits: float ``[B, V]``.
      temperature: float ``[B]``, > 0 (pass 1.0 for greedy rows).
      top_k: int ``[B]``; 0 disables.
      top_p: float ``[B]`` in (0, 1]; 1 disables.

    Returns:
      float32 ``[B, V]`` log-probabilities (``-inf`` on filtered tokens).

    >>> lp = processed_logprobs(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), jnp.ones(1),
    ...                         jnp.array([2]), jnp.ones(1))
    >>> [round(float(x), 4) for x in jnp.exp(lp[0])]
    [0.625, 0.375, 0.0]
    """
    return processed_logprobs_and_floor(logits, temperature, top_k, top_p)[0]


def processed_logprobs_and_floor(
    logits: chex.Array,
    temperature: chex.Array,
    top_k: chex.Array,
    top_p: chex.Array,
) -> tuple[jax.Array, jax.Array]:
    """:func:`processed_logprobs` and each row's **support floor**: a value between the smallest kept
    ``z = logits / T`` and the largest dropped one (their midpoint), so the support the token was
    drawn from is exactly ``{v : z_v >= floor}``, robust to perturbations of ``z`` smaller than half
    the gap. The trainer renormalizes its own logprobs over the same support
    (:func:`rljax.models.logprobs.token_logprobs_and_entropy`), so ratios compare like with like.
    A row that drops nothing (filters off, or they keep every token) has floor ``-inf``.

    >>> lp, floor = processed_logprobs_and_floor(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), jnp.ones(1),
    ...                                          jnp.array([2]), jnp.ones(1))
    >>> round(float(floor[0]), 4), round(float((jnp.log(0.3) + jnp.log(0.2)) / 2), 4)
    (-1.4067, -1.4067)
    """
    chex.assert_rank([logits, temperature, top_k, top_p], [2, 1, 1, 1])
    chex.assert_equal_shape_prefix([logits, temperature, top_k, top_p], 1)
    z = logits.astype(jnp.float32) / temperature.astype(jnp.float32)[:, None]
    vocab = z.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab).astype(jnp.int32)
    p = top_p.astype(jnp.float32)
    needs_filter = jnp.any(k < vocab) | jnp.any(p < 1.0)
    no_floor = jnp.full(z.shape[:1], _NEG_INF, jnp.float32)

    def filtered(z: jax.Array) -> tuple[jax.Array, jax.Array]:
        desc = -jnp.sort(-z, axis=-1)
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
        desc = jnp.where(desc >= kth, desc, _NEG_INF)
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = (mass_before < p[:, None]) | (p[:, None] >= 1.0)
        num_kept = jnp.maximum(jnp.sum(keep & (desc > _NEG_INF), axis=-1), 1)
        threshold = jnp.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)
        kept = z >= threshold
        largest_dropped = jnp.max(jnp.where(kept, _NEG_INF, z), axis=-1)
        floor = jnp.where(largest_dropped > _NEG_INF, 0.5 * (threshold[:, 0] + largest_dropped), _NEG_INF)
        return jnp.where(kept, z, _NEG_INF), floor

    z, floor = jax.lax.cond(needs_filter, filtered, lambda z: (z, no_floor), z)
    return jax.nn.log_softmax(z, axis=-1), floor


def first_argmax(x: chex.Array) -> jax.Array:
    """Index of the first maximum along the last axis (``jnp.argmax`` semantics for non-NaN input).

    ``min{v : x_v = max(x)}`` as two plain reductions; XLA's variadic (value, index) reduce behind
    ``jnp.argmax`` is several times slower on CPU.

    >>> first_argmax(jnp.array([[1.0, 3.0, 3.0], [-jnp.inf, -jnp.inf, 0.0]])).tolist()
    [1, 2]
    """
    size = x.shape[-1]
    iota = jnp.arange(size, dtype=jnp.int32)
    return jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), iota, size), axis=-1)


def _first_index_above(cdf: jax.Array, x: jax.Array, mass: jax.Array) -> jax.Array:
    """Per row ``min{i : cdf_i > x}``, clamped to the last ``i`` with ``mass_i > 0`` (rounding guard)."""
    size = cdf.shape[-1]
    drawn = jnp.sum(cdf <= x[:, None], axis=-1, dtype=jnp.int32)
    last = jnp.max(jnp.where(mass > 0, jnp.arange(size, dtype=jnp.int32), 0), axis=-1)
    return jnp.minimum(drawn, last)


def sample_by_inversion(
    logprobs: chex.Array, uniforms: chex.Array, greedy: chex.Array
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row from ``p = exp(logprobs)`` given one uniform per row (inversion).

    With ``F(v) = sum_{w <= v} p_w`` and ``u ~ U[0, 1)``, the token is ``min{v : F(v) > u F(V-1)}``,
    so ``P(v) = (F(v) - F(v-1)) / F(V-1) = p_v`` (the inversion method, Devroye 1986, "Non-Uniform
    Random Variate Generation", §II.2). It is evaluated in two levels, both exact: the vocabulary is
    cut into blocks of ``C ~ sqrt(V)`` tokens, the block is found by inverting the block masses,
    then the token by inverting that block's probabilities at the remaining mass, so no prefix sum
    longer than ``~sqrt(V)`` is formed. Tokens with ``p_v = 0`` (``-inf`` after top-k/top-p) are
    never drawn: they never raise ``F``, and rounding at a block's edge falls back to its last
    token with ``p_v > 0``. Greedy rows take :func:`first_argmax` of ``logprobs`` and ignore ``u``.

    Args:
      logprobs: float ``[B, V]`` (``-inf`` allowed on excluded tokens; at least one finite per row).
      uniforms: float ``[B]`` in ``[0, 1)``.
      greedy: bool ``[B]``.

    Returns:
      ``(tokens int32 [B], their logprobs float32 [B])``.

    >>> lp = jnp.log(jnp.array([[0.2, 0.5, 0.3]] * 3))
    >>> tok, _ = sample_by_inversion(lp, jnp.array([0.1, 0.65, 0.1]), jnp.array([False, False, True]))
    >>> tok.tolist()
    [0, 1, 1]
    """
    chex.assert_rank([logprobs, uniforms, greedy], [2, 1, 1])
    chex.assert_equal_shape_prefix([logprobs, uniforms, greedy], 1)
    logprobs = logprobs.astype(jnp.float32)
    batch, vocab = logprobs.shape
    block = bucket_size(math.isqrt(vocab))
    num_blocks = -(-vocab // block)
    probs = jnp.pad(jnp.exp(logprobs), ((0, 0), (0, num_blocks * block - vocab)))
    blocks = probs.reshape(batch, num_blocks, block)
    block_mass = jnp.sum(blocks, axis=-1)  # [B, nb]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    x = uniforms.astype(jnp.float32) * block_cdf[:, -1]
    b = _first_index_above(block_cdf, x, block_mass)
    rest = x - jnp.take_along_axis(block_cdf - block_mass, b[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [B, C]
    i = _first_index_above(jnp.cumsum(inner, axis=-1), jnp.maximum(rest, 0.0), inner)
    tokens = jnp.where(greedy, first_argmax(logprobs), b * block + i)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def sample_from_logprobs(
    logprobs: chex.Array, keys: chex.Array, greedy: chex.Array
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row: :func:`sample_by_inversion` with ``u = uniform(key)`` per row.

    One uniform per row instead of a Gumbel variate per vocabulary entry (Gumbel-max) makes the
    randomness of a decode step ``O(B)`` instead of ``O(B V)``; greedy rows take ``argmax(logp)``.

    Args:
      logprobs: float ``[B, V]`` (``-inf`` allowed on excluded tokens).
      keys: ``[B]`` typed PRNG keys, one per row.
      greedy: bool ``[B]``.

    Returns:
      ``(tokens int32 [B], their logprobs float32 [B])``.

    >>> lp = jnp.log(jnp.array([[0.0, 1.0, 0.0], [0.2, 0.5, 0.3]]))
    >>> keys = jax.random.split(jax.random.key(0), 2)
    >>> tok, tok_lp = sample_from_logprobs(lp, keys, jnp.array([False, True]))
    >>> tok.tolist(), [round(float(x), 4) for x in tok_lp]
    ([1, 1], [0.0, -0.6931])
    """
    chex.assert_rank([logprobs, greedy], [2, 1])
    chex.assert_equal_shape_prefix([logprobs, keys, greedy], 1)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    return sample_by_inversion(logprobs, uniforms, greedy)


def step_uniforms(seeds: chex.Array, num_steps: int) -> jax.Array:
    """``u[b, t] = uniform(fold_in(key(seeds[b]), t))``: every row's draws for ``num_steps`` steps at once.

    A row's draws depend only on its seed and the step (never on the batch it runs in), and the
    generation loop reads them instead of running a PRNG every step.

    >>> u = step_uniforms(jnp.array([7, 8], jnp.uint32), 3)
    >>> u.shape, bool((u[0] == step_uniforms(jnp.array([7], jnp.uint32), 3)[0]).all())
    ((2, 3), True)
    """
    chex.assert_rank(seeds, 1)

    def row(seed: jax.Array) -> jax.Array:
        key = jax.random.key(seed)
        return jax.vmap(lambda t: jax.random.uniform(jax.random.fold_in(key, t), (), jnp.float32))(
            jnp.arange(num_steps, dtype=jnp.int32)
        )

    return jax.vmap(row)(seeds)


@dataclasses.dataclass(frozen=True)
class _Carry:
    step: jax.Array
    logits: jax.Array
    cache: Any
    ids: jax.Array
    logprobs: jax.Array
    num_tokens: jax.Array
    finish: jax.Array
    routing: Any = None  # MoE: int32 [B, M, layers, k] experts of each fed (generated) token
    floors: Any = None  # float32 [B, M]: each sampled token's support floor (-inf: no truncation)


jax.tree_util.register_dataclass(
    _Carry,
    data_fields=["step", "logits", "cache", "ids", "logprobs", "num_tokens", "finish", "routing", "floors"],
    meta_fields=[],
)


def _decode_body(
    model: Any,
    c: _Carry,
    *,
    temp: jax.Array,
    greedy: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    uniforms: jax.Array,
    stop_ids: jax.Array,
    max_new: jax.Array,
    pad_id: int,
    record: bool,
) -> _Carry:
    """One decode step of every row: sample from ``c.logits``, record, feed the token back."""
    logp, floor = processed_logprobs_and_floor(c.logits, temp, top_k, top_p)
    u = jax.lax.dynamic_index_in_dim(uniforms, c.step, axis=1, keepdims=False)
    token, token_logp = sample_by_inversion(logp, u, greedy)
    active = c.finish == FINISH_RUNNING
    token = jnp.where(active, token, pad_id)
    ids = jax.lax.dynamic_update_slice_in_dim(c.ids, token[:, None], c.step, axis=1)
    logprobs = jax.lax.dynamic_update_slice_in_dim(
        c.logprobs, jnp.where(active, token_logp, 0.0)[:, None], c.step, axis=1
    )
    num_tokens = c.num_tokens + active.astype(jnp.int32)
    hit_stop = jnp.any(token[:, None] == stop_ids, axis=1)
    finish = jnp.where(
        active & hit_stop,
        FINISH_STOP,
        jnp.where(active & (num_tokens >= max_new), FINISH_LENGTH, c.finish),
    )
    next_logits, cache, fed = decode_step(model, token, c.cache, with_routing=record)
    routing = c.routing
    if record:
        routing = jax.lax.dynamic_update_slice_in_dim(routing, fed.experts.astype(jnp.int32), c.step, axis=1)
    finish = finish.astype(jnp.int32)
    floors = jax.lax.dynamic_update_slice_in_dim(
        c.floors, jnp.where(active, floor, _NEG_INF)[:, None], c.step, axis=1
    )
    return _Carry(c.step + 1, next_logits, cache, ids, logprobs, num_tokens, finish, routing, floors)


def generate_tokens(
    model: Any,
    prompt: chex.Array,
    prompt_segment_ids: chex.Array,
    *,
    temperature: chex.Array,
    top_k: chex.Array,
    top_p: chex.Array,
    max_new: chex.Array,
    stop_ids: chex.Array,
    seeds: chex.Array,
    max_new_tokens: int,
    pad_id: int = 0,
    segment_ends: Sequence[int] | None = None,
    shared_prefix: SharedPrefix | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Samples up to ``max_new_tokens`` tokens per row in ``lax.while_loop`` segments (jit-safe).

    Prefills the left-padded prompts into a cache of ``P + segment_ends[0]`` slots, then each step
    draws ``x_t ~ p~(. | prompt, x_<t)`` (:func:`processed_logprobs`, :func:`sample_by_inversion`
    with the uniform of key ``fold_in(key(seed), t)``, all drawn before the loop by
    :func:`step_uniforms`) for rows still running and feeds it back with one
    :func:`rljax.models.decode_step`, which updates the loop-carried cache in place. A row finishes
    after emitting a stop id (kept in the output) or ``max_new`` tokens; the loop ends when all rows
    are done. No host synchronization happens inside the loop.

    The steps run in consecutive loops that end at ``segment_ends`` (:func:`decode_segment_ends`); the
    cache grows by :func:`rljax.models.grow_cache` before each later one to ``P + end`` slots, so a step
    attends to the slots its segment fills rather than to all ``P + max_new_tokens`` (the attention
    work of a decode step is proportional to the cache length). The draws do not depend on the
    segmentation; the logprobs agree to float32 rounding (a softmax over fewer empty slots).

    Args:
      model: a :class:`rljax.models.Decoder`.
      prompt: int32 ``[B, P]``, left-padded; ``prompt_segment_ids`` int32 ``[B, P]`` (0 = padding).
      temperature: float ``[B]``; values < :data:`GREEDY_EPS` mean greedy (logprobs at T = 1).
      top_k: int32 ``[B]`` (0 = off); top_p: float ``[B]`` (1 = off).
      max_new: int32 ``[B]`` token budget per row (0 = an idle padding row).
      stop_ids: int32 ``[B, S]`` stop ids per row, padded with -1.
      seeds: uint32 ``[B]``.
      max_new_tokens: static loop bound (``>= max(max_new)``).
      pad_id: id written after a row finishes.
      segment_ends: static, increasing step counts ending with ``max_new_tokens``: one loop per
        entry (each one more copy of the decode step to compile); default one loop.
      shared_prefix: prompts that share prefixes (:class:`rljax.models.decode.SharedPrefix`): row
        ``b``'s prompt is ``shared_prefix.tokens[rows[b]]`` then ``prompt[b]`` (its own tokens,
        possibly none), and each prefix is prefilled once (:func:`rljax.models.prefill`). The
        sampling is that of the concatenated prompts; ``P`` below is then ``Pp + T``.

    Returns:
      ``(ids int32 [B, M], logprobs float32 [B, M], num_tokens int32 [B], finish int32 [B], routing,
      floors float32 [B, M])`` with ``finish`` in {:data:`FINISH_STOP`, :data:`FINISH_LENGTH`} (0 for
      idle rows). ``routing`` is None for dense models; for MoE models ``(prompt_experts int32
      [B, P, layers, k], generated_experts int32 [B, M, layers, k])``: the experts every prompt token
      and every fed generated token was routed to (router replay, R3). ``floors``: each sampled
      token's support floor (:func:`processed_logprobs_and_floor`; ``-inf`` where nothing was cut).
    """
    chex.assert_rank([prompt, prompt_segment_ids, stop_ids], 2)
    chex.assert_rank([temperature, top_k, top_p, max_new, seeds], 1)
    chex.assert_equal_shape([prompt, prompt_segment_ids])
    batch, prompt_len = prompt.shape[0], _prompt_width(prompt, shared_prefix)
    greedy = temperature < GREEDY_EPS
    temp = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    uniforms = step_uniforms(seeds, max_new_tokens)  # [B, M], drawn once, outside the loop
    record = bool(getattr(model.config, "moe_layers", ()))  # static: MoE models record routing
    ends = tuple(segment_ends or (max_new_tokens,))
    if ends[-1] != max_new_tokens or any(b <= a for a, b in zip((0, *ends), ends, strict=False)):
        raise ValueError(f"segment_ends must increase from > 0 to max_new_tokens={max_new_tokens}: {ends}")
    logits, cache, prompt_routing = prefill(
        model, prompt, max_length=prompt_len + ends[0], segment_ids=prompt_segment_ids, with_routing=record,
        shared_prefix=shared_prefix,
    )  # fmt: skip
    gen_routing = None
    if record:
        gen_routing = jnp.full((batch, max_new_tokens, *prompt_routing.experts.shape[2:]), -1, jnp.int32)
    idle = max_new <= 0
    init = _Carry(
        step=jnp.zeros((), jnp.int32),
        logits=logits,
        cache=cache,
        ids=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32),
        num_tokens=jnp.zeros((batch,), jnp.int32),
        finish=jnp.where(idle, FINISH_LENGTH, FINISH_RUNNING).astype(jnp.int32),
        routing=gen_routing,
        floors=jnp.full((batch, max_new_tokens), _NEG_INF, jnp.float32),
    )

    def cond(c: _Carry, end: int) -> jax.Array:
        return (c.step < end) & jnp.any(c.finish == FINISH_RUNNING)

    body = functools.partial(
        _decode_body, model, temp=temp, greedy=greedy, top_k=top_k, top_p=top_p, uniforms=uniforms,
        stop_ids=stop_ids, max_new=max_new, pad_id=pad_id, record=record,
    )  # fmt: skip

    out = init
    for i, end in enumerate(ends):
        if i:
            out = dataclasses.replace(out, cache=grow_cache(out.cache, prompt_len + end))
        out = jax.lax.while_loop(functools.partial(cond, end=end), body, out)
    routing = (prompt_routing.experts.astype(jnp.int32), out.routing) if record else None
    return out.ids, out.logprobs, out.num_tokens, out.finish, routing, out.floors


def decode_segment_ends(
    max_new_tokens: int, max_segments: int, *, prompt_len: int = 0, min_steps: int | None = None
) -> tuple[int, ...]:
    """Step counts at which :func:`generate_tokens`'s decode segments end (the last is ``max_new_tokens``).

    ``n = clip(max_new_tokens // min_steps, 1, max_segments)`` segments of (nearly) equal length
    (``min_steps`` defaults to :data:`MIN_SEGMENT_STEPS`):
    ``end_i = ceil(max_new_tokens * (i + 1) / n)``. Segment ``i`` decodes with a cache of
    ``P + end_i`` slots, so a step attends to the slots filled by its segment's end instead of all
    ``P + max_new_tokens``; each segment is one more copy of the decode step in the compiled program,
    and each growth one copy of the cache. With a prompt longer than the generation
    (``prompt_len > max_new_tokens``) segments would save under a quarter of the loop's attention
    and copy a mostly-prompt cache (twice its memory while it grows), so there is one loop.

    >>> decode_segment_ends(128, 4), decode_segment_ends(100, 4), decode_segment_ends(16, 4)
    ((32, 64, 96, 128), (34, 67, 100), (16,))
    >>> decode_segment_ends(128, 4, prompt_len=64), decode_segment_ends(128, 4, prompt_len=4096)
    ((32, 64, 96, 128), (128,))
    """
    min_steps = MIN_SEGMENT_STEPS if min_steps is None else min_steps
    if max_new_tokens < 1 or max_segments < 1 or min_steps < 1 or prompt_len < 0:
        raise ValueError(
            f"decode_segment_ends needs positive sizes, got max_new_tokens={max_new_tokens}, "
            f"max_segments={max_segments}, min_steps={min_steps}, prompt_len={prompt_len}"
        )
    if prompt_len > max_new_tokens:
        return (max_new_tokens,)
    n = min(max(max_new_tokens // min_steps, 1), max_segments)
    return tuple(-(-max_new_tokens * (i + 1) // n) for i in range(n))


def _generate_program(
    graphdef: Any,
    state: Any,
    prompt: jax.Array,
    prompt_segment_ids: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    max_new: jax.Array,
    stop_ids: jax.Array,
    seeds: jax.Array,
    max_new_tokens: int,
    pad_id: int,
    segment_ends: tuple[int, ...] | None = None,
    shared_prefix: SharedPrefix | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Any]:
    model = nnx.merge(graphdef, state)
    return generate_tokens(
        model,
        prompt,
        prompt_segment_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new=max_new,
        stop_ids=stop_ids,
        seeds=seeds,
        max_new_tokens=max_new_tokens,
        pad_id=pad_id,
        segment_ends=segment_ends,
        shared_prefix=shared_prefix,
    )


def _prompt_width(prompt: jax.Array, shared_prefix: SharedPrefix | None) -> int:
    """Cache slots a batch's prompts fill: their own columns, after the shared prefixes' when given."""
    return prompt.shape[1] + (0 if shared_prefix is None else shared_prefix.tokens.shape[1])


def _row_spans(switches: Sequence[tuple[int, int]], num_tokens: int) -> tuple[VersionSpan, ...]:
    """Version spans of a row's ``num_tokens`` tokens from the batch's ``(first step, version)`` switches
    (token ``t`` was sampled at step ``t``).

    >>> _row_spans([(0, 3), (16, 4), (32, 6)], 20)
    (VersionSpan(version=3, start=0, end=16), VersionSpan(version=4, start=16, end=20))
    """
    spans = []
    for (start, version), (end, _) in zip(switches, [*switches[1:], (num_tokens, None)], strict=True):
        start, end = min(start, num_tokens), min(end, num_tokens)
        if end > start:
            spans.append(VersionSpan(int(version), start, end))
    return tuple(spans)


def _left_padded(
    sequences: Sequence[Sequence[int]], rows: int, width: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, segment_ids)`` int32 ``[rows, width]``: each sequence right-aligned, 1 on its tokens.

    >>> [a.tolist() for a in _left_padded([[7, 8], [9]], 3, 3, 0)]
    [[[0, 7, 8], [0, 0, 9], [0, 0, 0]], [[0, 1, 1], [0, 0, 1], [0, 0, 0]]]
    """
    tokens = np.full((rows, width), pad_id, np.int32)
    segments = np.zeros((rows, width), np.int32)
    for i, seq in enumerate(sequences):
        if len(seq):
            tokens[i, width - len(seq) :] = seq
            segments[i, width - len(seq) :] = 1
    return tokens, segments


def _firsts(groups: Sequence[int], items: Sequence[Any]) -> list[tuple[int, Any]]:
    """``(group, item)`` for the first item of each group, in group order (groups numbered 0, 1, ...).

    >>> _firsts([1, 0, 1, 2], "abcd")
    [(0, 'b'), (1, 'a'), (2, 'd')]
    """
    first: dict[int, Any] = {}
    for g, item in zip(groups, items, strict=True):
        first.setdefault(g, item)
    return sorted(first.items())


def _snapshot(state: Any) -> Any:
    """New Variable wrappers around the same arrays: later in-place updates of the model stay invisible."""
    return jax.tree.map(lambda x: x, state)


_JITTED_GENERATE = jax.jit(_generate_program, static_argnums=(0, 10, 11, 12))


# -- in-flight weight updates: the same decode loop, driven segment by segment from the host --------
def _start_program(
    graphdef: Any,
    state: Any,
    prompt: jax.Array,
    prompt_segment_ids: jax.Array,
    max_new: jax.Array,
    max_new_tokens: int,
    pad_id: int,
    shared_prefix: SharedPrefix | None = None,
) -> tuple[_Carry, Any]:
    """Prefills the prompts (after their shared prefixes, :func:`generate_tokens`) into a cache of
    ``P + max_new_tokens`` slots; returns the loop carry at step 0 and the prompt routing (MoE) or None."""
    model = nnx.merge(graphdef, state)
    batch, prompt_len = prompt.shape[0], _prompt_width(prompt, shared_prefix)
    record = bool(getattr(model.config, "moe_layers", ()))
    logits, cache, prompt_routing = prefill(
        model, prompt, max_length=prompt_len + max_new_tokens, segment_ids=prompt_segment_ids,
        with_routing=record, shared_prefix=shared_prefix,
    )  # fmt: skip
    gen_routing = None
    if record:
        gen_routing = jnp.full((batch, max_new_tokens, *prompt_routing.experts.shape[2:]), -1, jnp.int32)
    carry = _Carry(
        step=jnp.zeros((), jnp.int32),
        logits=logits,
        cache=cache,
        ids=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32),
        num_tokens=jnp.zeros((batch,), jnp.int32),
        finish=jnp.where(max_new <= 0, FINISH_LENGTH, FINISH_RUNNING).astype(jnp.int32),
        routing=gen_routing,
        floors=jnp.full((batch, max_new_tokens), _NEG_INF, jnp.float32),
    )
    return carry, (prompt_routing.experts.astype(jnp.int32) if record else None)


def _segment_program(
    graphdef: Any,
    state: Any,
    carry: _Carry,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    max_new: jax.Array,
    stop_ids: jax.Array,
    seeds: jax.Array,
    end: jax.Array,
    max_new_tokens: int,
    pad_id: int,
) -> _Carry:
    """Runs the decode loop of :func:`generate_tokens` from ``carry.step`` to step ``end`` (or until
    every row is done) with the given weights; ``end`` is traced, so every segment shares one program."""
    model = nnx.merge(graphdef, state)
    greedy = temperature < GREEDY_EPS
    temp = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    body = functools.partial(
        _decode_body, model, temp=temp, greedy=greedy, top_k=top_k, top_p=top_p,
        uniforms=step_uniforms(seeds, max_new_tokens), stop_ids=stop_ids, max_new=max_new, pad_id=pad_id,
        record=carry.routing is not None,
    )  # fmt: skip
    return jax.lax.while_loop(lambda c: (c.step < end) & jnp.any(c.finish == FINISH_RUNNING), body, carry)


def _recompute_program(
    graphdef: Any,
    state: Any,
    carry: _Carry,
    prompt: jax.Array,
    prompt_segment_ids: jax.Array,
    width: int,
    pad_id: int,
    prompt_routing: Any = None,
    shared_prefix: SharedPrefix | None = None,
) -> tuple[_Carry, Any]:
    """The carry with its KV cache and next-token logits recomputed by the given (new) weights.

    Prefills each row's prompt and its ``carry.num_tokens`` generated tokens (the first ``width``
    columns of prompt + generated ids; ``width >= P + step``) into a cache of the carry's size, then
    marks the slots from ``P + step`` on as unwritten and sets the write index there: the same cache
    that prefill plus ``step`` decode steps with the new weights would have built (slot ``P + t``
    holds generated token ``t``), so later steps sample exactly from the new weights' distribution
    given the sequence so far.

    MoE (``carry.routing`` recorded): the running rows' recorded routing, of the prompt
    (``prompt_routing``, returned updated) and of the generated tokens fed so far, is replaced by
    the new weights' routing of the same positions: the routing every later token is computed
    with. A completion's recorded routing is thus that of its last weight version throughout, and
    replaying it reproduces exactly the forward of its last span's tokens (design §5). Finished
    rows keep theirs (all their tokens are of the old version).

    With ``shared_prefix`` (:func:`generate_tokens`) the prefixes are prefilled once again and
    ``prompt`` holds the rows' own prompt tokens after them (``P = Pp + T``).
    """
    model = nnx.merge(graphdef, state)
    prompt_len = _prompt_width(prompt, shared_prefix)
    max_length = carry.cache.max_length
    gen = carry.ids[:, : width - prompt_len]
    valid = jnp.arange(width - prompt_len, dtype=jnp.int32)[None, :] < carry.num_tokens[:, None]
    tokens = jnp.concatenate([prompt, jnp.where(valid, gen, pad_id)], axis=1)
    segments = jnp.concatenate([prompt_segment_ids, valid.astype(jnp.int32)], axis=1)
    record = carry.routing is not None
    logits, cache, routing = prefill(
        model, tokens, max_length=max_length, segment_ids=segments, with_routing=record,
        shared_prefix=shared_prefix,
    )  # fmt: skip
    index = prompt_len + carry.step
    written = jnp.arange(max_length, dtype=jnp.int32)[None, :] < index
    cache = cache.replace(segment_ids=jnp.where(written, cache.segment_ids, EMPTY_SLOT), index=index)
    gen_routing = carry.routing
    if record:
        experts = routing.experts.astype(jnp.int32)
        running = carry.finish == FINISH_RUNNING
        prompt_routing = jnp.where(running[:, None, None, None], experts[:, :prompt_len], prompt_routing)
        fed = (running[:, None] & valid)[:, :, None, None]
        refreshed = jnp.where(fed, experts[:, prompt_len:], carry.routing[:, : width - prompt_len])
        gen_routing = jax.lax.dynamic_update_slice_in_dim(carry.routing, refreshed, 0, axis=1)
    return dataclasses.replace(carry, logits=logits, cache=cache, routing=gen_routing), prompt_routing


_JITTED_START = jax.jit(_start_program, static_argnums=(0, 5, 6))
_JITTED_SEGMENT = jax.jit(_segment_program, static_argnums=(0, 10, 11), donate_argnums=(2,))
_JITTED_RECOMPUTE = jax.jit(_recompute_program, static_argnums=(0, 5, 6), donate_argnums=(2,))

#: ``EmbeddedSampler(kernel_layout=...)`` values.
KERNEL_LAYOUTS = ("auto", "in_out", "out_in", "panels")


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _decode_state(
    graphdef: Any, state: Any, layout: str = "out_in", isa: str | None = None, transposed_keys: bool = False
) -> Any:
    return nnx.state(decode_layout(nnx.merge(graphdef, state), layout, isa, transposed_keys=transposed_keys))


def to_decode_layout(
    graphdef: Any, state: Any, layout: str = "out_in", isa: str | None = None, transposed_keys: bool = False
) -> tuple[Any, Any]:
    """``(graphdef, state)`` of the sampler's decode-time copy of the model, a
    :class:`rljax.models.decode_layout.DecodeModel` with its Linear kernels stored for decoding
    (:func:`rljax.models.decode_layout.decode_layout`: ``"out_in"`` transposed, ``"panels"`` packed
    for the CPU kernel), as new arrays made by one jitted copy.

    Stored, not transposed inside the generation program: XLA:CPU folds an in-program transpose
    back into the matmul and the gain is lost (``benchmarks/generation_bench.py`` prints the
    weight-matmul floor with each stored layout). ``transposed_keys``: the copy's KV caches store
    the keys transposed (:attr:`rljax.models.decode_layout.DecodeModel.transposed_keys`).
    """
    return (
        decode_graphdef(graphdef, state, layout, isa, transposed_keys),
        _decode_state(graphdef, state, layout, isa, transposed_keys),
    )


def decode_graphdef(
    graphdef: Any, state: Any, layout: str = "out_in", isa: str | None = None, transposed_keys: bool = False
) -> Any:
    """The graphdef of :func:`to_decode_layout`'s model (traced abstractly: no arrays are made)."""
    relaid = lambda s: decode_layout(nnx.merge(graphdef, s), layout, isa, transposed_keys=transposed_keys)  # noqa: E731
    return nnx.graphdef(nnx.eval_shape(relaid, state))


def auto_kernel_layout(model: Any) -> str:
    """``EmbeddedSampler(kernel_layout="auto")``: ``"in_out"`` off the CPU; on a CPU ``"panels"``
    for a float32 model where the AVX2 kernel of :mod:`rljax.models.panel_matmul` is available and
    measured faster than XLA on this machine (:func:`rljax.models.panel_matmul.use_panels`: a
    timed comparison at first use, cached; ``RLJAX_PANEL_MATMUL=1`` / ``0`` forces it on / off),
    else ``"out_in"``."""
    if jax.default_backend() != "cpu":
        return "in_out"
    if jnp.dtype(getattr(model, "dtype", jnp.float32)) == jnp.float32 and use_panels():
        return "panels"
    return "out_in"


class EmbeddedSampler:
    """In-process batched JAX generation with the trainer's parameters (an :class:`Engine`).

    Args:
      model: a :class:`rljax.models.Decoder` (its current parameters are used; see
        :meth:`set_weights`).
      max_batch_size: most requests per jitted call (rounded up to a power of two).
      min_batch_bucket: smallest number of rows of a jitted call (fewer distinct shapes to compile).
      batch_wait_ms: how long the first queued request waits for others to join its batch.
      min_prompt_bucket: smallest padded prompt length (buckets are powers of two above it).
      min_new_tokens_bucket: smallest loop bound for new tokens.
      max_model_len: longest prompt + completion; ``max_tokens`` is clipped to fit (the
        completion then ends with "length"); default the model's ``max_position_embeddings``.
      seed: seeds the draws for requests that give no ``SamplingParams.seed``.
      weight_version: the version reported for the initial parameters.
      pad_id: id used for padding (any valid id; padding is masked).
      kernel_layout: how the sampler stores its copy of the Linear kernels: ``"in_out"`` (the
        model's own arrays, no copy), ``"out_in"`` (a transposed copy made on every
        :meth:`set_weights`, :func:`to_decode_layout`: decode's few-row matmuls run faster on
        XLA:CPU than with ``"in_out"``) or ``"panels"`` (a copy packed into 16-column panels, output
        projection included, multiplied by the AVX2 or AVX-512 kernel of
        :mod:`rljax.models.panel_matmul`, :attr:`kernel_isa`; float32 models on x86-64 CPUs;
        ``"out_in"`` where the kernel is not available, and ``kernel_layout`` then says so);
        ``"auto"`` (default, :func:`auto_kernel_layout`): ``"panels"`` where that kernel is
        available and measured faster than XLA on this machine (timed once, cached), else
        ``"out_in"`` on CPU, and ``"in_out"`` elsewhere (the copy would hold the weights twice in
        accelerator memory). 29M Qwen3, 32 x (64 + 128) tokens: see docs/results.md. With a copy
        (``"out_in"`` / ``"panels"``), its KV caches store the keys transposed where that was
        measured faster on this machine (:attr:`transposed_keys`,
        :func:`rljax.models.key_layout.use_transposed_keys`).
      decode_segments: most segments of a call's decode loop (:func:`generate_tokens`): each
        segment's steps attend only to the cache slots filled by its end, so more segments mean
        less attention work per step and a longer compile (one more decode step per segment).
        A segment is at least :data:`MIN_SEGMENT_STEPS` steps, so short generations keep one loop,
        and so do generations shorter than their (padded) prompt (:func:`decode_segment_ends`).
        Default 4 (29M Qwen3, 32 x (64 + 128) tokens on CPU: 1.07x the tokens/s of one loop, the
        program 4-6 s slower to compile); 1 turns it off.
      in_flight_updates: apply new weights to running sequences (:attr:`supports_in_flight_updates`):
        each batch decodes in host-driven segments of ``in_flight_segment_steps`` steps and, at the
        first segment boundary after :meth:`set_weights`, switches to the new weights and
        RECOMPUTES its running rows' KV cache with them (one prefill of prompt + tokens so far;
        PipelineRL instead keeps the stale cache), so every token after the switch is sampled
        exactly from the new weights given the sequence so far and every token's version names
        the weights whose distribution it was drawn from (:attr:`Completion.weight_versions`).
        Off (default): one compiled loop per batch, and a batch finishes on the weights it
        started with.
      in_flight_segment_steps: decode steps between two weight checks with ``in_flight_updates``.
      prefix_sharing: prefill a prompt prefix shared by requests of one batch once and start each
        of them from a copy of its cache (:func:`shared_prefix_groups`; what vLLM's prefix caching
        saves): identical prompts (a GRPO group's samples, which arrive together) and prompts that
        share at least ``min_shared_prefix`` leading tokens (multi-turn samples whose histories start
        alike); used where it prefills fewer (padded) tokens than the batch's own prompts. The same
        tokens for the same seeds as without it, logprobs and support floors within float32
        rounding. Models with linear-attention layers (Qwen3.5 / Qwen3-Next) share identical prompts
        only, each row starting from a copy of the prefix's recurrent state and convolution window.
        Default True.
      min_shared_prefix: fewest leading tokens different prompts must share to be prefilled once
        (identical prompts always are).

    >>> import asyncio
    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> from rljax.inference.engine import SamplingParams
    >>> from rljax.models.tiny import tiny_model
    >>> sampler = EmbeddedSampler(tiny_model(vocab_size=32, num_layers=1))
    >>> out = asyncio.run(sampler.generate([1, 2, 3], SamplingParams(max_tokens=4, seed=7)))
    >>> len(out.ids), out.finish_reason, out.weight_version
    (4, 'length', 0)
    """

    def __init__(
        self,
        model: Any,
        *,
        max_batch_size: int = 64,
        min_batch_bucket: int = 1,
        batch_wait_ms: float = 2.0,
        min_prompt_bucket: int = 32,
        min_new_tokens_bucket: int = 16,
        max_model_len: int | None = None,
        seed: int = 0,
        weight_version: int = 0,
        pad_id: int = 0,
        kernel_layout: str = "auto",
        decode_segments: int = 4,
        in_flight_updates: bool = False,
        in_flight_segment_steps: int = 16,
        prefix_sharing: bool = True,
        min_shared_prefix: int = MIN_SHARED_PREFIX,
    ) -> None:
        if kernel_layout not in KERNEL_LAYOUTS:
            raise ValueError(
                f"EmbeddedSampler kernel_layout must be one of {KERNEL_LAYOUTS}, got {kernel_layout!r}"
            )
        if not isinstance(model, nnx.Module) or not hasattr(model, "config"):
            raise ValueError(
                f"EmbeddedSampler needs an rljax.models.Decoder, got {type(model).__name__}; "
                "build one with rljax.models.Decoder(...) or rljax.models.from_pretrained(...)"
            )
        if kernel_layout == "auto":
            kernel_layout = auto_kernel_layout(model)
        elif kernel_layout == "panels" and not panel_matmul_available():
            kernel_layout = "out_in"  # decided here, not inside the jitted copy (its trace is cached)
        self.kernel_layout = kernel_layout
        #: the panel kernel's instruction set (``"avx2"`` / ``"avx512"``) with ``"panels"``, else None.
        self.kernel_isa = kernel_isa() if kernel_layout == "panels" else None
        #: whether the decode-time copy's KV caches store the keys transposed (``"out_in"`` /
        #: ``"panels"`` only: :func:`rljax.models.key_layout.use_transposed_keys`).
        self.transposed_keys = kernel_layout != "in_out" and use_transposed_keys()
        sizes = dict(
            max_batch_size=max_batch_size,
            min_batch_bucket=min_batch_bucket,
            min_prompt_bucket=min_prompt_bucket,
            min_new_tokens_bucket=min_new_tokens_bucket,
            decode_segments=decode_segments,
            in_flight_segment_steps=in_flight_segment_steps,
            min_shared_prefix=min_shared_prefix,
        )
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EmbeddedSampler {name} must be an int >= 1, got {value!r}")
        if batch_wait_ms < 0:
            raise ValueError(f"EmbeddedSampler batch_wait_ms must be >= 0, got {batch_wait_ms}")
        graphdef, state = nnx.split(model)
        self._graphdef = graphdef  # the model's own layout: set_weights merges new states with it
        self._decode_graphdefs: dict[Any, Any] = {}  # model graphdef -> its decode-time copy's
        self._structure = jax.tree_util.tree_structure(state)
        self.config = model.config
        self.vocab_size = int(model.config.vocab_size)
        self.max_batch_size = bucket_size(max_batch_size)
        self.min_batch_bucket = min(bucket_size(min_batch_bucket), self.max_batch_size)
        self.batch_wait_s = float(batch_wait_ms) / 1000.0
        self.min_prompt_bucket = int(min_prompt_bucket)
        self.min_new_tokens_bucket = int(min_new_tokens_bucket)
        self.decode_segments = int(decode_segments)
        self.prefix_sharing = bool(prefix_sharing)
        self.min_shared_prefix = int(min_shared_prefix)
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        if not 0 <= pad_id < self.vocab_size:
            raise ValueError(f"pad_id must be a token id in [0, {self.vocab_size}), got {pad_id}")
        self.pad_id = int(pad_id)
        # (graphdef, state, version) as served, swapped as one reference so a batch never mixes them.
        self._weights: tuple[Any, Any, int] = (*self._served(graphdef, state), int(weight_version))
        self._rng = np.random.default_rng(seed)
        self._queue: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.num_batches = 0
        self.num_requests = 0
        #: prompt tokens of the requests served, and how many of them were prefilled (fewer when
        #: requests shared a prefix: ``prefix_sharing``).
        self.num_prompt_tokens = 0
        self.num_prefilled_tokens = 0
        self.in_flight_updates = bool(in_flight_updates)
        self.in_flight_segment_steps = int(in_flight_segment_steps)
        #: in-flight mode: decode segments run, weight switches applied to running batches, and the
        #: seconds spent recomputing their KV caches (the cost of a switch).
        self.num_segments_run = 0
        self.num_in_flight_switches = 0
        self.cache_recompute_s = 0.0
        self._running_versions: dict[int, int] = {}  # running batch id -> version it decodes with
        self._batch_ids = itertools.count()
        self._switched = threading.Condition()

    # -- weights --------------------------------------------------------------------------
    def _served(self, graphdef: Any, state: Any) -> tuple[Any, Any]:
        if self.kernel_layout != "in_out":
            layout = self.kernel_layout
            served = self._decode_graphdefs.get(graphdef)
            how = (layout, self.kernel_isa, self.transposed_keys)
            if served is None:  # traced once per model graphdef, not on every weight sync
                served = self._decode_graphdefs[graphdef] = decode_graphdef(graphdef, state, *how)
            return served, _decode_state(graphdef, state, *how)
        return graphdef, _snapshot(state)

    @property
    def weight_version(self) -> int:
        """The version new requests are served with."""
        return self._weights[2]

    #: Completions of top-k / top-p draws carry their support floors (``Completion.support_floors``).
    reports_sampling_support = True

    @property
    def supports_in_flight_updates(self) -> bool:
        """:class:`Engine` attribute: True when built with ``in_flight_updates=True``."""
        return self.in_flight_updates

    def set_weights(self, model_or_state: Any, *, version: int | None = None) -> int:
        """Serves new parameters (a Decoder or its ``nnx.State``); returns the new version.

        No sync: the references to the (immutable) parameter arrays are swapped (with
        ``kernel_layout="out_in"`` / ``"panels"``, to a relaid copy of the Linear kernels, dispatched
        asynchronously). Batches already running keep the parameters (and version) they started
        with, and later in-place changes to ``model_or_state`` are not seen until the next
        ``set_weights``, so the reported version always names the parameters that produced a
        completion.
        """
        if isinstance(model_or_state, nnx.Module):
            graphdef, state = nnx.split(model_or_state)
        elif isinstance(model_or_state, nnx.State):
            graphdef, state = self._graphdef, model_or_state
        else:
            raise ValueError(
                f"set_weights takes an rljax Decoder or its nnx.State, got {type(model_or_state).__name__}"
            )
        old_version = self._weights[2]
        if jax.tree_util.tree_structure(state) != self._structure:
            raise ValueError(
                "the new parameters do not have the structure of the sampler's model; "
                "pass a model of the same architecture (or nnx.state(model))"
            )
        new_version = old_version + 1 if version is None else int(version)
        self._weights = (*self._served(graphdef, state), new_version)
        return new_version

    def release_weights(self) -> None:
        """Lets go of the served weights (the decode-layout copy: about a model's size of memory)
        until the next :meth:`set_weights` / :meth:`update_weights`. A sync run calls this while it
        trains: no request samples a version after its rollout. Batches already running keep the
        weights they started with; requests arriving meanwhile fail with an error that says so.

        >>> from rljax.models.tiny import tiny_model
        >>> model = tiny_model(vocab_size=32, num_layers=1)
        >>> sampler = EmbeddedSampler(model)
        >>> sampler.release_weights()
        >>> sampler.weight_version, sampler.holds_weights
        (0, False)
        >>> asyncio.run(sampler.update_weights(model, version=1)), sampler.holds_weights
        (1, True)
        """
        graphdef, _, version = self._weights
        self._weights = (graphdef, None, version)

    @property
    def holds_weights(self) -> bool:
        """False between :meth:`release_weights` and the next weight load."""
        return self._weights[1] is not None

    async def update_weights(self, model: Any, *, version: int | None = None) -> int:
        """:class:`Engine` method: :meth:`set_weights`; with ``in_flight_updates`` it then waits until
        every running batch decodes with the new weights (at its next segment boundary) or is done."""
        new_version = self.set_weights(model, version=version)
        if self.in_flight_updates:
            await asyncio.to_thread(self._wait_switched, new_version)
        return new_version

    def _wait_switched(self, version: int) -> None:
        with self._switched:
            running = self._running_versions
            self._switched.wait_for(
                lambda: self._weights[2] != version or all(v == version for v in running.values())
            )

    def _set_running(self, batch_id: int, version: int | None) -> None:
        with self._switched:
            if version is None:
                self._running_versions.pop(batch_id, None)
            else:
                self._running_versions[batch_id] = version
            self._switched.notify_all()

    # -- requests ---------------------------------------------------------------------------
    def _check_request(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty; the sampler needs at least one prompt token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the model vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, which leaves no room under max_model_len "
                f"{self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        bad_stop = [t for t in sampling.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})")
        return prompt

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Completion:
        """:class:`Engine` method: queues the request; it runs with whatever else arrives meanwhile.

        ``session_id`` is accepted for the protocol (there is one replica, so it changes nothing).
        """
        prompt = self._check_request(prompt_ids, sampling)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._queue.append((prompt, sampling, future))
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._worker = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            if self.batch_wait_s:
                await asyncio.sleep(self.batch_wait_s)
            loop = asyncio.get_running_loop()
            batch = [
                r for r in self._queue[: self.max_batch_size] if not r[2].done() and r[2].get_loop() is loop
            ]
            del self._queue[: self.max_batch_size]
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(
                    self._run_batch, [r[0] for r in batch], [r[1] for r in batch]
                )
            except Exception as e:  # surfaced to every caller of this batch
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(e)
            else:
                for (_, _, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)

    # -- the jitted call ------------------------------------------------------------------
    def _seed(self, sampling: SamplingParams) -> int:
        if sampling.seed is None:
            return int(self._rng.integers(0, 2**32))
        return int(sampling.seed) % 2**32

    def _held_weights(self) -> tuple[Any, Any, int]:
        """``(graphdef, state, version)`` of the weights a batch samples; an error after
        :meth:`release_weights` until a version is loaded again."""
        graphdef, state, version = self._weights
        if state is None:
            raise RuntimeError(
                f"the sampler released the weights of version {version} (release_weights) and has not "
                "loaded a version since; update_weights loads one"
            )
        return graphdef, state, version

    def _run_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        graphdef, state, version = self._held_weights()
        n = len(prompts)
        rows = bucket_size(n, minimum=self.min_batch_bucket)
        tokens, segments, shared, row_segments = self._prompt_arrays(prompts, rows)
        prompt_len = row_segments.shape[1]
        budgets = [
            min(s.max_tokens, self.max_model_len - len(p)) for p, s in zip(prompts, params, strict=True)
        ]
        new_len = bucket_size(max(budgets), minimum=self.min_new_tokens_bucket)
        num_stop = bucket_size(max(len(s.stop_token_ids) for s in params), minimum=4)

        temperature = np.ones((rows,), np.float32)
        top_k = np.zeros((rows,), np.int32)
        top_p = np.ones((rows,), np.float32)
        max_new = np.zeros((rows,), np.int32)
        stop_ids = np.full((rows, num_stop), -1, np.int32)
        seeds = np.zeros((rows,), np.uint32)
        for i, s in enumerate(params):
            temperature[i] = s.temperature
            top_k[i] = 0 if s.top_k is None else min(int(s.top_k), self.vocab_size)
            top_p[i] = s.top_p
            max_new[i] = budgets[i]
            stop_ids[i, : len(s.stop_token_ids)] = s.stop_token_ids
            seeds[i] = self._seed(s)
        switches = [(0, version)]  # (first step, version) of each weight switch
        if self.in_flight_updates:
            ids, logprobs, num_tokens, finish, routing, floors = self._generate_in_flight(
                (graphdef, state, version),
                switches,
                (tokens, segments, temperature, top_k, top_p, max_new, stop_ids, seeds),
                new_len,
                shared,
            )
        else:
            ids, logprobs, num_tokens, finish, routing, floors = _JITTED_GENERATE(
                graphdef,
                state,
                tokens,
                segments,
                temperature,
                top_k,
                top_p,
                max_new,
                stop_ids,
                seeds,
                new_len,
                self.pad_id,
                decode_segment_ends(new_len, self.decode_segments, prompt_len=prompt_len),
                shared,
            )
        ids, logprobs, num_tokens, finish, routing, floors = jax.device_get(
            (ids, logprobs, num_tokens, finish, routing, floors)
        )
        self.num_batches += 1
        self.num_requests += n
        self.num_prompt_tokens += sum(map(len, prompts))
        self.num_prefilled_tokens += int(segments.sum())
        if shared is not None:
            self.num_prefilled_tokens += int(shared.segment_ids.sum())
        out = []
        for i in range(n):
            k = int(num_tokens[i])
            lp = np.minimum(logprobs[i, :k].astype(np.float64), 0.0)
            if not np.all(np.isfinite(lp)):
                raise FloatingPointError(
                    "the sampler produced a non-finite logprob (NaN parameters or logits?); "
                    "check the model weights"
                )
            routed = None
            if routing is not None:  # rows of prompt + generated tokens but the last (vLLM's layout)
                prompt_rows = routing[0][i, row_segments[i] != 0]
                routed = np.concatenate([prompt_rows, routing[1][i, : max(k - 1, 0)]], axis=0)
            spans = _row_spans(switches, k)
            truncated = bool(top_k[i] and top_k[i] < self.vocab_size) or float(top_p[i]) < 1.0
            out.append(
                Completion(
                    ids=tuple(int(t) for t in ids[i, :k]),
                    logprobs=tuple(float(x) for x in lp),
                    finish_reason=_FINISH_NAMES[int(finish[i])],
                    weight_version=spans[0].version if spans else version,
                    routed_experts=routed,
                    weight_versions=spans,
                    support_floors=tuple(float(x) for x in floors[i, :k]) if truncated else None,
                )
            )
        return out

    def _prompt_arrays(
        self, prompts: list[list[int]], rows: int
    ) -> tuple[np.ndarray, np.ndarray, SharedPrefix | None, np.ndarray]:
        """A batch's prompts as the generation program takes them: ``(tokens, segment_ids,
        shared_prefix, row_segment_ids)``.

        Without shared prefixes (:func:`shared_prefix_groups` finds none, or sharing is off or would
        not save prefill work) each row's prompt is left-padded to ``P`` and ``shared_prefix`` is
        None. Otherwise each group's prefix is a left-padded row of ``shared_prefix`` (``Pp`` wide),
        and ``tokens`` holds each row's own tokens after it (``T`` wide, possibly 0).
        ``row_segment_ids`` ``[rows, Pp + T]`` marks each row's prompt slots in the cache.
        """
        lengths = [len(p) for p in prompts]
        width = bucket_size(max(lengths), minimum=self.min_prompt_bucket)
        groups, shared = list(range(len(prompts))), lengths
        if self.prefix_sharing:
            # Linear-attention layers: a row's own tokens are left-padded after the prefix, and their
            # causal convolution does not reach across padding inside a sample (the window would be
            # cut), so only identical prompts share (the copied state and window are then exact).
            min_shared = None if getattr(self.config, "linear_layers", ()) else self.min_shared_prefix
            groups, shared = shared_prefix_groups(prompts, min_shared=min_shared)
        if len(shared) < len(prompts):
            own = [n - shared[g] for n, g in zip(lengths, groups, strict=True)]
            prefix_width = bucket_size(max(shared), minimum=self.min_prompt_bucket)
            own_width = bucket_size(max(own), minimum=_MIN_OWN_BUCKET) if max(own) else 0
            prefix_rows = bucket_size(len(shared))
            if prefix_rows * prefix_width + rows * own_width < rows * width:  # fewer tokens to prefill
                firsts = [p[: shared[g]] for g, p in _firsts(groups, prompts)]
                prefix = _left_padded(firsts, prefix_rows, prefix_width, self.pad_id)
                owns = [p[n - k :] for p, n, k in zip(prompts, lengths, own, strict=True)]
                tokens, segments = _left_padded(owns, rows, own_width, self.pad_id)
                row_prefix = np.zeros((rows,), np.int32)
                row_prefix[: len(groups)] = groups
                row_segments = np.concatenate([prefix[1][row_prefix], segments], axis=1)
                return tokens, segments, SharedPrefix(*prefix, row_prefix), row_segments
        tokens, segments = _left_padded(prompts, rows, width, self.pad_id)
        return tokens, segments, None, segments

    def _generate_in_flight(
        self,
        weights: tuple[Any, Any, int],
        switches: list[tuple[int, int]],
        arrays: tuple[np.ndarray, ...],
        new_len: int,
        shared: SharedPrefix | None = None,
    ) -> tuple[Any, Any, Any, Any, Any, Any]:
        """:func:`generate_tokens`'s loop run segment by segment, switching to newer weights between
        segments (cache recomputed, :func:`_recompute_program`); appends each switch to ``switches``."""
        graphdef, state, version = weights
        tokens, segments, temperature, top_k, top_p, max_new, stop_ids, seeds = arrays
        prompt_len = _prompt_width(tokens, shared)
        batch_id = next(self._batch_ids)
        self._set_running(batch_id, version)
        try:
            start_args = (tokens, segments, max_new, new_len, self.pad_id, shared)
            carry, prompt_routing = _JITTED_START(graphdef, state, *start_args)
            step = 0
            while step < new_len:
                served = self._weights
                if served[2] != version:
                    graphdef, state, version = served
                    start = time.perf_counter()
                    width = min(bucket_size(prompt_len + step), prompt_len + new_len)
                    carry, prompt_routing = _JITTED_RECOMPUTE(
                        graphdef, state, carry, tokens, segments, width, self.pad_id, prompt_routing, shared
                    )
                    jax.block_until_ready(carry.logits)
                    self.cache_recompute_s += time.perf_counter() - start
                    self.num_in_flight_switches += 1
                    if switches[-1][0] == step:
                        switches.pop()  # a switch before any token of the last span
                    switches.append((step, version))
                    self._set_running(batch_id, version)
                end = min(step + self.in_flight_segment_steps, new_len)
                carry = _JITTED_SEGMENT(
                    graphdef, state, carry, temperature, top_k, top_p, max_new, stop_ids, seeds,
                    np.int32(end), new_len, self.pad_id,
                )  # fmt: skip
                self.num_segments_run += 1
                step = end
                if not np.any(np.asarray(carry.finish) == FINISH_RUNNING):
                    break
        finally:
            self._set_running(batch_id, None)
        routing = None if prompt_routing is None else (prompt_routing, carry.routing)
        return carry.ids, carry.logprobs, carry.num_tokens, carry.finish, routing, carry.floors

    @staticmethod
    def num_compilations() -> int:
        """How many generation programs ``jit`` has compiled in this process (all samplers)."""
        return int(_JITTED_GENERATE._cache_size())

    def __repr__(self) -> str:
        return (
            f"EmbeddedSampler(vocab={self.vocab_size}, max_batch_size={self.max_batch_size}, "
            f"weight_version={self.weight_version})"
        )
