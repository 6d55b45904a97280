"""Pure attention math of the decoder: rotary embeddings, packed masks, grouped-query attention.

Everything here is a pure, jit/vmap-safe function of arrays. The decoder modules call these; the KV
cache reuses the same mask and attention with "slot" indices, so a packed forward, a prefill and a
step-by-step decode are one code path. The training forward (:func:`causal_attention`) computes
the same attention in causal query blocks that skip the key blocks every query of the block masks.

Packing convention (design §2.6): ``segment_ids`` is ``int32 [B, L]`` with 0 = padding and 1..k for
the samples packed in a row; ``positions`` restart at 0 for every sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp

from rljax.models import panel_matmul

# A finite "minus infinity": a fully masked row (e.g. left padding in a cache) gives a uniform
# softmax instead of NaN, and never wins against an unmasked score.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def segment_positions(segment_ids: chex.Array) -> chex.Array:
    """Positions that restart at 0 at the start of every run of equal segment ids.

    ``pos[b, t] = t - start(b, t)`` where ``start`` is the index of the first token of the run of
    equal ``segment_ids`` that contains ``t`` (padding runs get positions too; they are ignored).

    >>> segment_positions(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    chex.assert_rank(segment_ids, 2)
    length = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
    is_start = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start = jax.lax.cummax(jnp.where(is_start, idx, 0), axis=1)
    return idx - start


def rope_table(positions: chex.Array, inv_freq: chex.Array) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of the rotary angles ``theta = positions * inv_freq``: float32 ``[B, T, D/2]`` each.

    They depend only on the positions, so a forward computes them once and every layer's
    :func:`apply_rotary` reads them (:meth:`rljax.models.Decoder.hidden_states` does, and keeps XLA
    from fusing a fresh ``cos`` / ``sin`` into every layer's rotation, forward and backward, which
    evaluated them once per head and element; see ``Decoder._rope``).

    >>> cos, sin = rope_table(jnp.array([[0, 1]]), jnp.array([1.0]))
    >>> cos.shape, [round(float(c), 4) for c in cos[0, :, 0]]
    ((1, 2, 1), [1.0, 0.5403])
    """
    chex.assert_rank([positions, inv_freq], [2, 1])
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)  # [B, T, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: chex.Array, cos: chex.Array, sin: chex.Array) -> chex.Array:
    """:func:`apply_rope` with the angles' ``cos`` / ``sin`` given (:func:`rope_table`, ``[B, T, D/2]``).

    >>> cos, sin = rope_table(jnp.array([[0]]), jnp.array([1.0]))
    >>> apply_rotary(jnp.ones((1, 1, 1, 2)), cos, sin).tolist()
    [[[[1.0, 1.0]]]]
    """
    chex.assert_rank([x, cos, sin], [4, 3, 3])
    chex.assert_equal(x.shape[-1], 2 * cos.shape[-1])
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x: chex.Array, positions: chex.Array, inv_freq: chex.Array) -> chex.Array:
    """Rotary position embedding, "rotate half" layout (as HF transformers and vLLM store weights).

    With ``theta_i = pos * inv_freq_i`` and ``x = [x1, x2]`` split in halves of the head dim:
    ``rope(x) = [x1 cos(theta) - x2 sin(theta), x2 cos(theta) + x1 sin(theta)]``
    (Su et al. 2021, RoFormer, eq. 34 with the half-split pairing). Angles are float32.
    ``apply_rotary(x, *rope_table(positions, inv_freq))``.

    Args:
      x: ``[B, T, N, D]`` queries or keys.
      positions: ``int [B, T]`` absolute position of each token within its sample.
      inv_freq: ``float [D // 2]`` inverse frequencies.

    >>> x = jnp.ones((1, 1, 1, 2))
    >>> apply_rope(x, jnp.array([[0]]), jnp.array([1.0])).tolist()
    [[[[1.0, 1.0]]]]
    """
    chex.assert_rank([x, positions, inv_freq], [4, 2, 1])
    chex.assert_equal(x.shape[-1], 2 * inv_freq.shape[0])
    return apply_rotary(x, *rope_table(positions, inv_freq))


def attention_mask(
    q_segment_ids: chex.Array,
    kv_segment_ids: chex.Array,
    q_slots: chex.Array,
    kv_slots: chex.Array,
    kv_subtree_end: chex.Array | None = None,
) -> chex.Array:
    """Causal AND same-segment mask: ``mask[b,i,j] = (kv_slot_j <= q_slot_i) & (seg_q[b,i] == seg_kv[b,j])``,
    or the prefix-tree mask when ``kv_subtree_end`` is given.

    Slots are indices into the key/value sequence (``arange(L)`` for a packed forward; cache slots
    when decoding). Padding (segment 0) only sees padding, so no real token ever attends to it and
    no softmax row is empty.

    Prefix-tree rows (design §2.6): the tokens of a tree are laid out in depth-first order and
    ``kv_subtree_end[b, j]`` is the slot of the last token of ``j``'s subtree, so ``j`` is an
    ancestor of ``i`` (or ``i`` itself) iff ``j <= i <= subtree_end[j]``:
    ``mask[b,i,j] = (kv_slot_j <= q_slot_i <= kv_subtree_end[b,j]) | (q_slot_i == kv_slot_j)``. Segment
    ids are not read then (in a tree row they name the sample that owns each token, and a branch
    attends to the prefix another sample owns); the second term keeps every row non-empty whatever
    padding holds (a real token's ``subtree_end`` is at least its own slot).

    >>> seg = jnp.array([[1, 1, 2]])
    >>> attention_mask(seg, seg, jnp.arange(3), jnp.arange(3)).astype(int).tolist()
    [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]
    >>> end = jnp.array([[2, 1, 2]])  # token 0 is the root; tokens 1 and 2 are two branches
    >>> attention_mask(seg, seg, jnp.arange(3), jnp.arange(3), end).astype(int).tolist()
    [[[1, 0, 0], [1, 1, 0], [1, 0, 1]]]
    """
    chex.assert_rank([q_segment_ids, kv_segment_ids, q_slots, kv_slots], [2, 2, 1, 1])
    causal = kv_slots[None, :] <= q_slots[:, None]  # [T, S]
    if kv_subtree_end is not None:
        chex.assert_equal_shape([kv_segment_ids, kv_subtree_end])
        inside = q_slots[None, :, None] <= kv_subtree_end[:, None, :]  # [B, T, S]
        itself = kv_slots[None, :] == q_slots[:, None]
        return (inside & causal[None]) | itself[None]
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # [B, T, S]
    return same & causal[None]


def grouped_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    mask: chex.Array,
    *,
    precision: jax.lax.PrecisionLike = None,
) -> chex.Array:
    """Masked softmax attention with grouped key/value heads (GQA, Ainslie et al. 2023).

    Query head ``h`` uses key/value head ``h // G`` with ``G = N // K`` (the HF ``repeat_kv`` order):
    ``out = softmax(q k^T / sqrt(D) + log mask) v``; scores and softmax in float32.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]``; mask: ``bool [B, T, S]``.

    Returns:
      ``[B, T, N, D]`` in the dtype of ``q``.

    >>> q = jnp.zeros((1, 2, 2, 4)); k = jnp.zeros((1, 2, 1, 4)); v = jnp.arange(8.).reshape(1, 2, 1, 4)
    >>> m = jnp.array([[[True, False], [True, True]]])
    >>> grouped_attention(q, k, v, m)[0, :, 0].tolist()
    [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]
    """
    return grouped_attention_lse(q, k, v, mask, precision=precision)[0].astype(q.dtype)


def grouped_attention_lse(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    mask: chex.Array,
    *,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`grouped_attention` in float32 with the log-normalizer of every query row and head.

    Returns ``(out float32 [B, T, N, D], lse float32 [B, T, N])`` with
    ``lse = log sum_j exp(q k_j^T / sqrt(D))`` over the unmasked keys. Attention over the union of
    two disjoint key sets is the ``exp(lse)``-weighted mean of the two partial outputs (the
    blockwise softmax of Milakov & Gimelshein 2018, as ring attention merges its blocks, Liu et al.
    2023); :func:`merge_attention` does it. A fully masked row gets ``lse`` near the float32 minimum,
    so it carries no weight in a merge with any unmasked block.

    >>> q = jnp.zeros((1, 1, 1, 2)); k = jnp.zeros((1, 2, 1, 2)); v = jnp.ones((1, 2, 1, 2))
    >>> out, lse = grouped_attention_lse(q, k, v, jnp.ones((1, 1, 2), bool))
    >>> round(float(lse[0, 0, 0]), 4)  # log(e^0 + e^0)
    0.6931
    """
    chex.assert_rank([q, k, v, mask], [4, 4, 4, 3])
    chex.assert_equal_shape([k, v])
    b, t, n, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({kv_heads})")
    groups = n // kv_heads
    f32 = jnp.float32
    # Heads moved in front of the sequence axes first, so both products are plain batched matmuls
    # over (B, K) with the contraction innermost: [B, K, G*T, D] x [B, K, S, D]^T, then
    # [B, K, G*T, S] x [B, K, S, D]. Contracting the strided [B, T, K, G, D] layout directly is
    # several times slower on CPU, forward and backward.
    qt = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, groups * t, d)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bkmd,bksd->bkms", qt, kt, precision=precision, preferred_element_type=f32)
    scores = scores.reshape(b, kv_heads, groups, t, s) * (d**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    # softmax(x) v = (exp(x - m) v) / sum(exp(x - m)) for any constant m (the row max, for range).
    # Normalizing the [.., D] product instead of the [.., S] probabilities (FlashAttention-2's
    # deferred normalization, Dao 2023, section 3.1) saves a pass over the scores, and the backward
    # then reduces rowsum(dout * out) over D instead of rowsum(P * dP) over S (FlashAttention,
    # Dao et al. 2022, appendix B.2).
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    weights = jnp.exp(scores - row_max)
    denom = jnp.sum(weights, axis=-1).reshape(b, kv_heads, groups * t, 1)
    weights = weights.astype(v.dtype).reshape(b, kv_heads, groups * t, s)
    out = jnp.einsum("bkms,bksd->bkmd", weights, vt, precision=precision, preferred_element_type=f32) / denom
    out = out.reshape(b, kv_heads, groups, t, d).transpose(0, 3, 1, 2, 4)
    # log sum_j exp(score_j) per query row and head, for merging partial results over key blocks
    # (unused outputs are dropped by XLA, so grouped_attention pays nothing for it)
    lse = (row_max[..., 0] + jnp.log(denom.reshape(b, kv_heads, groups, t))).transpose(0, 3, 1, 2)
    return out.reshape(b, t, n, d), lse.reshape(b, t, n)


def merge_attention(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Attention over the union of two disjoint key sets from the partial ``(out, lse)`` of each
    (:func:`grouped_attention_lse`): ``lse = logaddexp(lse_a, lse_b)``,
    ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``.

    >>> half = (jnp.full((1, 1, 1, 1), 2.0), jnp.zeros((1, 1, 1)))
    >>> out, lse = merge_attention(half, (jnp.full((1, 1, 1, 1), 4.0), jnp.zeros((1, 1, 1))))
    >>> float(out[0, 0, 0, 0])
    3.0
    """
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    out = out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None]
    return out, lse


def packed_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    q_segment_ids: chex.Array,
    kv_segment_ids: chex.Array,
    q_slots: chex.Array,
    kv_slots: chex.Array,
    chunk_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> chex.Array:
    """Causal, segment-masked GQA over packed rows, optionally in blocks of ``chunk_size`` queries.

    Equal to ``grouped_attention(q, k, v, attention_mask(q_segment_ids, kv_segment_ids, q_slots,
    kv_slots))``. With ``chunk_size`` set and ``T > chunk_size``, queries are processed in blocks
    (``lax.map`` over rematerialized blocks) and each block builds its own mask, so neither the
    ``[B, T, S]`` mask nor the ``[B, N, T, S]`` scores exist at once: memory ``O(chunk_size * S)``
    instead of ``O(T * S)``, forward and backward (the query-blocking half of FlashAttention,
    Dao et al. 2022, without the online softmax over key blocks).

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]``.
      q_segment_ids: ``int [B, T]``; kv_segment_ids: ``int [B, S]``; q_slots: ``int [T]``;
        kv_slots: ``int [S]`` (see :func:`attention_mask`).
      chunk_size: queries per block (static), or None for one block.
      precision: matmul precision.

    >>> q = jnp.zeros((1, 3, 2, 4)); kv = jnp.arange(12.).reshape(1, 3, 1, 4); seg = jnp.array([[1, 1, 2]])
    >>> out = packed_attention(q, kv, kv, q_segment_ids=seg, kv_segment_ids=seg, q_slots=jnp.arange(3),
    ...                        kv_slots=jnp.arange(3), chunk_size=2)
    >>> out[0, :, 0, 0].tolist()
    [0.0, 2.0, 8.0]
    """
    chex.assert_rank([q, k, v, q_segment_ids, kv_segment_ids, q_slots, kv_slots], [4, 4, 4, 2, 2, 1, 1])

    def attend(q_i: jax.Array, seg_i: jax.Array, slots_i: jax.Array) -> jax.Array:
        mask = attention_mask(seg_i, kv_segment_ids, slots_i, kv_slots)
        return grouped_attention(q_i, k, v, mask, precision=precision)

    return _in_query_blocks(attend, q, q_segment_ids, q_slots, chunk_size)


# Causal blocks per row in the training forward: the scores computed are (n + 1) / (2 n) of the dense
# T x T ones for n equal blocks (56 % at 8); more blocks save little and lengthen the unrolled graph.
_CAUSAL_BLOCKS = 8
_CAUSAL_BLOCK_QUANTUM = 128


def causal_block_size(length: int, *, max_block_size: int | None = None) -> int:
    """Query block size for :func:`causal_attention` on rows of ``length`` tokens.

    ``block = min(max_block_size, 128 * ceil(length / (8 * 128)))``: about an eighth of the row in
    multiples of 128 (so at most 8 blocks, fewer for short rows), capped by the memory bound
    ``max_block_size`` (None: no cap).

    >>> causal_block_size(1024), causal_block_size(3000), causal_block_size(16384, max_block_size=1024)
    (128, 384, 1024)
    """
    if length <= 0:
        raise ValueError(f"causal_block_size needs a positive row length, got {length}")
    if max_block_size is not None and max_block_size <= 0:
        raise ValueError(f"max_block_size must be a positive int or None, got {max_block_size}")
    quantum = _CAUSAL_BLOCK_QUANTUM
    block = -(-length // (_CAUSAL_BLOCKS * quantum)) * quantum
    return block if max_block_size is None else min(block, max_block_size)


def causal_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    segment_ids: chex.Array,
    block_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    kernel: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array] | None = None,
    subtree_end: chex.Array | None = None,
) -> chex.Array:
    """Causal, segment-masked GQA of packed rows over themselves, skipping fully masked key blocks.

    Equal to ``packed_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
    q_slots=arange(T), kv_slots=arange(T))``, i.e. ``out[b, i] = softmax_j(q_i . k_j / sqrt(D) +
    log mask[b, i, j]) v_j`` with ``mask[b, i, j] = (j <= i) & (seg[b, i] == seg[b, j])``.

    With ``block_size`` set and ``T > block_size``, the queries are cut into consecutive blocks of
    ``block_size`` (the last one shorter) and the block of queries ``[s, e)`` attends to the keys
    ``[0, e)`` only: every later key is masked by causality, so its scores are never computed
    (for ``n`` equal blocks, ``(n + 1) / (2 n)`` of the dense ``T x T`` scores, forward and backward).
    This is the causal block skipping of FlashAttention-2 (Dao 2023, section 3.1), with one static
    key prefix per query block instead of an online softmax. Each block is rematerialized in the
    backward pass (``jax.checkpoint``), so memory is ``O(block_size * T)`` as in
    :func:`packed_attention`. The blocks are unrolled (static shapes) up to 4 blocks; a longer row
    (``T > 4 * block_size``, e.g. 64k tokens with 1024-query blocks) runs 4 query groups, each over
    its static causal key prefix in sequential ``lax.map`` blocks (:func:`_long_causal_attention`),
    because XLA keeps all unrolled blocks' scores alive at once (``O(T^2)`` in total).

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, T, K, D]`` (the same tokens as the queries).
      segment_ids: ``int [B, T]``, 0 = padding, samples ``1..k`` packed in each row.
      block_size: queries per block (static), or None for one block.
      precision: matmul precision.
      kernel: ``kernel(q_block, k_prefix, v_prefix, mask) -> out_block`` computing one block's masked
        attention (``mask bool [B, Tq, S]``); default :func:`grouped_attention` with ``precision``
        (:mod:`rljax.models.attention_backends` passes fused kernels).
      subtree_end: ``int [B, T]`` for prefix-tree rows (the tree mask of :func:`attention_mask`,
        which is causal too, so the same key blocks are skipped); None: the segment mask.

    Returns:
      ``[B, T, N, D]`` in the dtype of ``q``.

    >>> q = jnp.zeros((1, 3, 2, 4)); kv = jnp.arange(12.).reshape(1, 3, 1, 4); seg = jnp.array([[1, 1, 2]])
    >>> causal_attention(q, kv, kv, segment_ids=seg, block_size=2)[0, :, 0, 0].tolist()
    [0.0, 2.0, 8.0]
    """
    chex.assert_rank([q, k, v, segment_ids], [4, 4, 4, 2])
    chex.assert_equal_shape([k, v])
    chex.assert_equal_shape_prefix([q, k, v, segment_ids], 2)
    t = q.shape[1]
    if kernel is None:

        def kernel(q_: jax.Array, k_: jax.Array, v_: jax.Array, mask: jax.Array) -> jax.Array:
            return grouped_attention(q_, k_, v_, mask, precision=precision)

    if subtree_end is not None:
        subtree_end = jnp.asarray(subtree_end).astype(jnp.int32)
        chex.assert_equal_shape([segment_ids, subtree_end])
    if block_size is None or t <= block_size:
        slots = jnp.arange(t, dtype=jnp.int32)
        mask = attention_mask(segment_ids, segment_ids, slots, slots, subtree_end)
        return kernel(q, k, v, mask)
    if block_size <= 0:
        raise ValueError(f"attention block_size must be a positive int or None, got {block_size}")

    if -(-t // block_size) > _LONG_ROW_BLOCKS:
        return _long_causal_attention(q, k, v, segment_ids, block_size, kernel, subtree_end)

    def block(start: int, end: int) -> Callable[..., jax.Array]:
        @jax.checkpoint
        def attend(q_i: jax.Array, k_all: jax.Array, v_all: jax.Array, seg: jax.Array,
                   ends: jax.Array | None) -> jax.Array:  # fmt: skip
            # Slicing inside the checkpoint keeps the full k, v (not one prefix per block) as residuals.
            q_slots, kv_slots = jnp.arange(start, end, dtype=jnp.int32), jnp.arange(end, dtype=jnp.int32)
            kv_ends = None if ends is None else ends[:, :end]
            mask = attention_mask(seg[:, start:end], seg[:, :end], q_slots, kv_slots, kv_ends)
            return kernel(q_i, k_all[:, :end], v_all[:, :end], mask)

        return attend

    outs = [
        block(start, min(t, start + block_size))(
            q[:, start : start + block_size], k, v, segment_ids, subtree_end
        )
        for start in range(0, t, block_size)
    ]
    return jnp.concatenate(outs, axis=1)


def _long_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    block_size: int,
    kernel: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array],
    subtree_end: jax.Array | None = None,
) -> jax.Array:
    """:func:`causal_attention` of rows longer than ``4 * block_size``: memory linear in ``T``.

    Unrolling ``T / block_size`` blocks would let XLA keep every block's scores alive at once (the sum
    over blocks of ``block * end`` is ``O(T^2 / 2)``; measured: 0.63 GiB at 8k, 2.3 GiB at 16k for a
    2-head layer). Instead the queries are cut into :data:`_LONG_ROW_GROUPS` consecutive groups; group
    ``[s, e)`` attends to the static key prefix ``[0, e)`` (causal skipping at group granularity:
    ``(G + 1) / (2 G)`` of the dense scores) and runs its queries in sequential, rematerialized blocks
    of ``block_size`` (``lax.map``), so at most ``G`` blocks of ``block_size x T`` scores exist.
    """
    t = q.shape[1]
    group = -(-t // _LONG_ROW_GROUPS)
    outs = []
    for start in range(0, t, group):
        end = min(t, start + group)
        kv_slots = jnp.arange(end, dtype=jnp.int32)

        def attend(q_i: jax.Array, seg_i: jax.Array, slots_i: jax.Array, end: int = end,
                   kv_slots: jax.Array = kv_slots) -> jax.Array:  # fmt: skip
            kv_ends = None if subtree_end is None else subtree_end[:, :end]
            mask = attention_mask(seg_i, segment_ids[:, :end], slots_i, kv_slots, kv_ends)
            return kernel(q_i, k[:, :end], v[:, :end], mask)

        slots = jnp.arange(start, end, dtype=jnp.int32)
        outs.append(_in_query_blocks(attend, q[:, start:end], segment_ids[:, start:end], slots, block_size))
    return jnp.concatenate(outs, axis=1)


#: Rows of more than this many attention blocks take :func:`_long_causal_attention`, in this many
#: query groups (each with its own static causal key prefix).
_LONG_ROW_BLOCKS = 4
_LONG_ROW_GROUPS = 4


def _in_query_blocks(
    attend: Callable[[jax.Array, jax.Array, jax.Array], Any],
    q: jax.Array,
    q_segment_ids: jax.Array,
    q_slots: jax.Array,
    chunk_size: int | None,
) -> Any:
    """``attend(q, q_segment_ids, q_slots)`` at once, or over blocks of ``chunk_size`` queries.

    ``attend`` returns an array or a pytree of arrays ``[B, T, ...]`` (per query)."""
    b, t, n, d = q.shape
    if chunk_size is None or t <= chunk_size:
        return attend(q, q_segment_ids, q_slots)
    if chunk_size <= 0:
        raise ValueError(f"attention chunk_size must be a positive int or None, got {chunk_size}")
    num_blocks = -(-t // chunk_size)
    pad = num_blocks * chunk_size - t
    # Padded queries get segment -2 (matches nothing): a uniform, finite softmax that is sliced off.
    q_b = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, num_blocks, chunk_size, n, d)
    seg_b = jnp.pad(q_segment_ids, ((0, 0), (0, pad)), constant_values=-2).reshape(b, num_blocks, chunk_size)
    slots_b = jnp.pad(q_slots, (0, pad)).reshape(num_blocks, chunk_size)

    @jax.checkpoint
    def block(args: tuple[jax.Array, jax.Array, jax.Array]) -> Any:
        return attend(*args)

    out = jax.lax.map(block, (q_b.swapaxes(0, 1), seg_b.swapaxes(0, 1), slots_b))  # [nb, B, C, ...]
    return jax.tree.map(
        lambda o: o.swapaxes(0, 1).reshape(b, num_blocks * chunk_size, *o.shape[3:])[:, :t], out
    )


# -- KV-cache layout -------------------------------------------------------------------------------
# A decode step reads the whole cache once per layer, so the cache is stored exactly as the attention
# matmuls consume it: one batch axis ``B * K`` (row-major over (row, kv head)), then slots and the
# head dim. Values are ``[B*K, S, D]`` and the output is ``[B*K, G*T, S] x [B*K, S, D]``. Keys are
# stored either the same way (``[B*K, S, D]``, scores ``[B*K, S, D] x [B*K, G*T, D]^T``) or transposed
# (``[B*K, D, S]``, scores ``[B*K, G*T, D] x [B*K, D, S]``): on an Intel Xeon (AVX-512) XLA:CPU runs a
# decode step's scores against transposed keys ~2.5x faster (the slot axis, the long one, is then the
# vectorized minor axis of both the keys and the scores). Either way the one ``dynamic_update_slice``
# that writes a step's keys/values feeds the matmul directly and XLA updates the (loop-carried or
# donated) buffer in place instead of copying it every step.
_KQ_DIMS = (((2,), (2,)), ((0,), (0,)))  # [BK, S, D] x [BK, GT, D] -> [BK, S, GT]
_QK_T_DIMS = (((2,), (1,)), ((0,), (0,)))  # [BK, GT, D] x [BK, D, S] -> [BK, GT, S]
_PV_DIMS = (((2,), (1,)), ((0,), (0,)))  # [BK, GT, S] x [BK, S, D] -> [BK, GT, D]


def to_cache_layout(x: chex.Array, *, transposed: bool = False) -> chex.Array:
    """``[B, T, K, D]`` keys/values -> the cache layout ``[B*K, T, D]`` (entry ``b*K + k``), or
    ``[B*K, D, T]`` with ``transposed`` (keys stored transposed, :func:`cache_attention`).

    >>> x = jnp.arange(8).reshape(1, 2, 2, 2)          # B=1, T=2, K=2, D=2
    >>> to_cache_layout(x)[:, :, 0].tolist()            # head 0: tokens 0, 1; head 1: tokens 0, 1
    [[0, 4], [2, 6]]
    >>> to_cache_layout(x, transposed=True)[:, 0].tolist()   # the same, dim 0 of each token
    [[0, 4], [2, 6]]
    """
    chex.assert_rank(x, 4)
    b, t, k, d = x.shape
    if transposed:
        return x.transpose(0, 2, 3, 1).reshape(b * k, d, t)
    return x.transpose(0, 2, 1, 3).reshape(b * k, t, d)


def from_cache_layout(x: chex.Array, *, batch_size: int, transposed: bool = False) -> chex.Array:
    """Inverse of :func:`to_cache_layout`: ``[B*K, S, D]`` (or ``[B*K, D, S]``, ``transposed``) ->
    ``[B, S, K, D]``.

    >>> x = jnp.arange(8).reshape(1, 2, 2, 2)
    >>> bool((from_cache_layout(to_cache_layout(x), batch_size=1) == x).all())
    True
    >>> y = from_cache_layout(to_cache_layout(x, transposed=True), batch_size=1, transposed=True)
    >>> bool((y == x).all())
    True
    """
    chex.assert_rank(x, 3)
    bk = x.shape[0]
    if batch_size <= 0 or bk % batch_size:
        raise ValueError(f"cache leading axis {bk} is not a multiple of batch_size {batch_size}")
    if transposed:
        x = x.swapaxes(1, 2)
    _, s, d = x.shape
    return x.reshape(batch_size, bk // batch_size, s, d).transpose(0, 2, 1, 3)


def cache_attention(
    q: chex.Array,
    k_cache: chex.Array,
    v_cache: chex.Array,
    *,
    q_segment_ids: chex.Array,
    kv_segment_ids: chex.Array,
    q_slots: chex.Array,
    kv_slots: chex.Array,
    chunk_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    transposed_keys: bool = False,
) -> chex.Array:
    """:func:`packed_attention` with keys/values in the KV-cache layout ``[B*K, S, D]`` (keys
    ``[B*K, D, S]`` with ``transposed_keys``).

    With ``G = N // K`` query heads per key/value head and ``c = b*K + h // G`` the cache entry of
    query head ``h`` of row ``b``:
    ``out[b, t, h] = softmax_j(q[b, t, h] . k_cache[c, j] / sqrt(D) + log mask[b, t, j]) v_cache[c]``
    with ``mask = attention_mask(q_segment_ids, kv_segment_ids, q_slots, kv_slots)`` (GQA, Ainslie
    et al. 2023); scores and softmax in float32. Equal to ``packed_attention(q, from_cache_layout(
    k_cache), from_cache_layout(v_cache), ...)`` without moving the cache.

    Args:
      q: ``[B, T, N, D]``; k_cache: ``[B*K, S, D]``, or ``[B*K, D, S]`` with ``transposed_keys``;
        v_cache: ``[B*K, S, D]`` (see :func:`to_cache_layout`).
      q_segment_ids: ``int [B, T]``; kv_segment_ids: ``int [B, S]``; q_slots: ``int [T]``;
        kv_slots: ``int [S]``.
      chunk_size: queries per block (static), or None for one block.
      precision: matmul precision.
      transposed_keys: ``k_cache`` holds the keys transposed (static).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``q``.

    >>> q = jnp.zeros((1, 2, 2, 4)); kv = jnp.arange(8.).reshape(1, 2, 4)   # K=1, S=2 slots
    >>> seg = jnp.array([[1, 1]]); slots = jnp.arange(2)
    >>> out = cache_attention(q, kv, kv, q_segment_ids=seg, kv_segment_ids=seg, q_slots=slots,
    ...                       kv_slots=slots)
    >>> out[0, :, 0].tolist()
    [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]
    """
    chex.assert_rank([q, k_cache, v_cache, q_segment_ids, kv_segment_ids, q_slots, kv_slots],
                     [4, 3, 3, 2, 2, 1, 1])  # fmt: skip
    kv_heads, groups = _cache_head_counts(q, k_cache, v_cache, transposed_keys)
    bk, s, _ = v_cache.shape
    b, _, n, d = q.shape
    scale = d**-0.5
    f32 = jnp.float32

    def attend(q_i: jax.Array, seg_i: jax.Array, slots_i: jax.Array) -> jax.Array:
        t = q_i.shape[1]
        mask = attention_mask(seg_i, kv_segment_ids, slots_i, kv_slots)  # [B, T, S]
        # [B, T, K, G, D] -> [B*K, G*T, D]: one batch axis, matching the cache.
        qc = q_i.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4).reshape(bk, groups * t, d)
        if transposed_keys:  # q @ keys: [B*K, G*T, S]
            scores = jax.lax.dot_general(
                qc, k_cache, _QK_T_DIMS, precision=precision, preferred_element_type=f32
            )
            scores = scores.reshape(b, kv_heads, groups, t, s) * scale
        else:
            # Scores as cache @ q^T ([B*K, S, G*T]): with the cache as the left operand a decode step is
            # a matrix-vector product that streams the cache once (q @ cache^T is several times slower).
            scores = jax.lax.dot_general(
                k_cache, qc, _KQ_DIMS, precision=precision, preferred_element_type=f32
            )
            scores = scores.reshape(b, kv_heads, s, groups, t).transpose(0, 1, 3, 4, 2) * scale
        scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype).reshape(bk, groups * t, s)
        out = jax.lax.dot_general(probs, v_cache, _PV_DIMS, precision=precision, preferred_element_type=f32)
        out = out.reshape(b, kv_heads, groups, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, n, d)
        return out.astype(q_i.dtype)

    if transposed_keys and q.shape[1] == 1 and _decode_kernel_applies(q, k_cache, v_cache):
        # one decode step on a CPU: the decode-attention kernel (both cores, the cache streamed once)
        mask = attention_mask(q_segment_ids, kv_segment_ids, q_slots, kv_slots)[:, 0]  # [B, S]
        qc = q.reshape(b, kv_heads, groups, d).reshape(bk, groups, d)
        out = panel_matmul.decode_attention(qc, k_cache, v_cache, mask, scale=scale)
        return out.reshape(b, 1, n, d)
    return _in_query_blocks(attend, q, q_segment_ids, q_slots, chunk_size)


def _cache_head_counts(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, transposed_keys: bool
) -> tuple[int, int]:
    """``(kv heads, query heads per kv head)`` of a KV cache for queries ``q``; a ``ValueError`` when
    the cache's shapes do not fit them."""
    bk, s, d = v_cache.shape
    key_shape = (bk, d, s) if transposed_keys else v_cache.shape
    if k_cache.shape != key_shape:
        raise ValueError(
            f"k_cache must be {key_shape} (transposed_keys={transposed_keys}), got {k_cache.shape}"
        )
    b, n = q.shape[0], q.shape[2]
    if bk % b or n % (bk // b):
        raise ValueError(
            f"cache leading axis {bk} must be batch ({b}) x kv heads, with query heads ({n}) a multiple "
            "of the kv heads; build the cache with rljax.models.init_cache for this model and batch"
        )
    return bk // b, n // (bk // b)


def _decode_kernel_applies(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> bool:
    """Whether :func:`rljax.models.panel_matmul.decode_attention` runs this decode step: float32, a
    head dim that is a multiple of 8, and the kernel available (the CPU backend, AVX2; not with
    ``RLJAX_PANEL_MATMUL=0``)."""
    f32 = all(x.dtype == jnp.float32 for x in (q, k_cache, v_cache))
    return f32 and q.shape[-1] % 8 == 0 and panel_matmul.available()
