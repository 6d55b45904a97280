"""Pure attention math of the decoder: rotary embeddings, packed masks, grouped-query attention.

Everything here is a pure, jit/vmap-safe function of arrays. The decoder modules call these; the KV
cache reuses the same mask and attention with "slot" indices, so a packed forward, a prefill and a
step-by-step decode are one code path.

Packing convention (SPEC §2.6): ``segment_ids`` is ``int32 [B, L]`` with 0 = padding and 1..k for
the samples packed in a row; ``positions`` restart at 0 for every sample.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

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


def apply_rope(x: chex.Array, positions: chex.Array, inv_freq: chex.Array) -> chex.Array:
    """Rotary position embedding, "rotate half" layout (as HF transformers and vLLM store weights).

    With ``theta_i = pos * inv_freq_i`` and ``x = [x1, x2]`` split in halves of the head dim:
    ``rope(x) = [x1 cos(theta) - x2 sin(theta), x2 cos(theta) + x1 sin(theta)]``
    (Su et al. 2021, RoFormer, eq. 34 with the half-split pairing). Angles are float32.

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
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention_mask(
    q_segment_ids: chex.Array,
    kv_segment_ids: chex.Array,
    q_slots: chex.Array,
    kv_slots: chex.Array,
) -> chex.Array:
    """Causal AND same-segment mask: ``mask[b,i,j] = (kv_slot_j <= q_slot_i) & (seg_q[b,i] == seg_kv[b,j])``.

    Slots are indices into the key/value sequence (``arange(L)`` for a packed forward; cache slots
    when decoding). Padding (segment 0) only sees padding, so no real token ever attends to it and
    no softmax row is empty.

    >>> seg = jnp.array([[1, 1, 2]])
    >>> attention_mask(seg, seg, jnp.arange(3), jnp.arange(3)).astype(int).tolist()
    [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]
    """
    chex.assert_rank([q_segment_ids, kv_segment_ids, q_slots, kv_slots], [2, 2, 1, 1])
    causal = kv_slots[None, :] <= q_slots[:, None]  # [T, S]
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
    chex.assert_rank([q, k, v, mask], [4, 4, 4, 3])
    chex.assert_equal_shape([k, v])
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({kv_heads})")
    qg = q.reshape(b, t, kv_heads, n // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=precision, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=precision, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, d).astype(q.dtype)


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
    b, t, n, d = q.shape
    if chunk_size is None or t <= chunk_size:
        mask = attention_mask(q_segment_ids, kv_segment_ids, q_slots, kv_slots)
        return grouped_attention(q, k, v, mask, precision=precision)
    if chunk_size <= 0:
        raise ValueError(f"attention chunk_size must be a positive int or None, got {chunk_size}")
    num_blocks = -(-t // chunk_size)
    pad = num_blocks * chunk_size - t
    # Padded queries get segment -2 (matches nothing): a uniform, finite softmax that is sliced off.
    q_b = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, num_blocks, chunk_size, n, d)
    seg_b = jnp.pad(q_segment_ids, ((0, 0), (0, pad)), constant_values=-2).reshape(b, num_blocks, chunk_size)
    slots_b = jnp.pad(q_slots, (0, pad)).reshape(num_blocks, chunk_size)

    @jax.checkpoint
    def block(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        q_i, seg_i, slots_i = args
        mask = attention_mask(seg_i, kv_segment_ids, slots_i, kv_slots)
        return grouped_attention(q_i, k, v, mask, precision=precision)

    out = jax.lax.map(block, (q_b.swapaxes(0, 1), seg_b.swapaxes(0, 1), slots_b))  # [nb, B, C, N, D]
    return out.swapaxes(0, 1).reshape(b, num_blocks * chunk_size, n, d)[:, :t]
