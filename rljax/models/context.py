"""Context parallelism: each packed row's tokens split over the mesh axis ``context``.

When the ambient mesh (``jax.sharding.use_abstract_mesh`` / ``jax.set_mesh``; the train step enters
its state's mesh) has a ``context`` axis of size ``C > 1``, :meth:`rljax.models.Decoder.hidden_states`
cuts every row of ``L`` tokens (padded with segment 0 to a multiple of ``2C``) into ``2C`` chunks
of ``m = L / 2C`` tokens and gives device ``i`` the chunks ``i`` and ``2C - 1 - i``
(:func:`load_balance`): under a causal mask an early chunk attends to few keys and a late chunk
to many, so every device gets the same amount of attention work ("zig-zag" split, as Megatron
context parallelism and MaxText's load-balanced ring/all-gather do). Embedding, norms, MLP / MoE
are per token and run on the local tokens; the final hidden states return to the natural order
(:func:`unbalance`), so logprobs, losses and metrics see the tokens where they always were.

Attention (:func:`context_attention`): inside ``shard_map`` over ``context`` (the other mesh axes
stay automatic), every device all-gathers the keys, values and segment ids of the row (``C`` times
its own ``2m`` tokens, restored to natural order) and attends its two query chunks to them with the
mask ``(kv_slot <= q_slot) & (seg_q == seg_kv)`` written in GLOBAL token indices (slots): chunk
``i`` only needs keys ``[0, L/2)`` (it lies in the first half), chunk ``2C - 1 - i`` all of them,
so a device computes ``m * (L/2 + L)`` scores instead of ``2m * L``. The backward of the all-gather
is a reduce-scatter of the key/value gradients.

All-gather vs ring (``collective``, ``model.context_attention``): ``"all_gather"`` (the default)
is one collective XLA schedules itself and holds all ``L`` keys/values of a layer (``2 * L * K * D``
values, small next to the activations with grouped-query heads, e.g. 8 KV heads x 128 = 1/4 of a
4096-wide hidden state); the cuDNN kernels run on its blocks. ``"ring"`` passes each device's two
key/value chunks to its neighbour ``C - 1`` times (``ppermute``; a transfer can overlap the blocks
of the previous step) and merges the partial softmaxes of the blocks by their log-normalizers
(:func:`rljax.models.attention.merge_attention`). With the zig-zag split every step after the
first has exactly two fully visible ``m x m`` blocks (the late query chunk against the visiting
early chunk, and either the early queries against the visiting early chunk, when it comes from a
device before this one, or the late queries against the visiting late chunk), so a device computes
``(2C + 1) m^2`` scores instead of the all-gather's ``3C m^2``, and holds one visiting K/V pair
at a time in the forward. The ring's blocks are XLA einsums (it needs the log-normalizer, which the
cuDNN wrapper does not return). Both are exact; both are tested against float64 and context = 1,
and ``benchmarks/memory_bench.py --long --context-attention ring`` measures the ring.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from rljax.models.attention import (
    _in_query_blocks,
    attention_mask,
    grouped_attention,
    grouped_attention_lse,
    merge_attention,
)

#: The mesh axis that splits each row's tokens (context parallelism).
CONTEXT_AXIS = "context"
#: How attention crosses the ``context`` axis (``model.context_attention``).
CONTEXT_COLLECTIVES = ("all_gather", "ring")
#: Mesh axes that split batch rows (present ones only).
ROW_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


def context_mesh() -> jax.sharding.AbstractMesh | None:
    """The ambient mesh when it has a ``context`` axis of size > 1, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        return None
    return mesh if mesh.shape[CONTEXT_AXIS] > 1 else None


def load_balance(x: chex.Array, shards: int, *, axis: int = 1) -> jax.Array:
    """Reorders ``axis`` (length ``L``, a multiple of ``2 * shards``) so that a contiguous split into
    ``shards`` parts gives part ``i`` the chunks ``i`` and ``2 * shards - 1 - i`` of ``L / (2 shards)``.

    >>> load_balance(jnp.arange(8)[None], 2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    length = x.shape[0]
    if length % (2 * shards):
        raise ValueError(f"load_balance needs a length divisible by 2 * shards = {2 * shards}, got {length}")
    halves = x.reshape(2, shards, length // (2 * shards), *x.shape[1:])
    early, late = halves[0], jnp.flip(halves[1], axis=0)
    out = jnp.stack([early, late], axis=1).reshape(length, *x.shape[1:])
    return jnp.moveaxis(out, 0, axis)


def unbalance(x: chex.Array, shards: int, *, axis: int = 1) -> jax.Array:
    """Inverse of :func:`load_balance`.

    >>> unbalance(load_balance(jnp.arange(8)[None], 2), 2).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    length = x.shape[0]
    pairs = x.reshape(shards, 2, length // (2 * shards), *x.shape[1:])
    early, late = pairs[:, 0], jnp.flip(pairs[:, 1], axis=0)
    out = jnp.concatenate([early, late], axis=0).reshape(length, *x.shape[1:])
    return jnp.moveaxis(out, 0, axis)


def token_spec(mesh: jax.sharding.AbstractMesh, ndim: int) -> PartitionSpec:
    """``PartitionSpec`` of a ``[B, L, ...]`` activation: rows over the row axes, tokens over ``context``."""
    rows = tuple(a for a in ROW_AXES if a in mesh.axis_names)
    return PartitionSpec(rows or None, CONTEXT_AXIS, *([None] * (ndim - 2)))


def constrain_tokens(x: jax.Array, mesh: jax.sharding.AbstractMesh) -> jax.Array:
    """``x [B, L, ...]`` pinned to :func:`token_spec` (rows over data/fsdp/expert, tokens over context)."""
    return jax.lax.with_sharding_constraint(x, token_spec(mesh, x.ndim))


def context_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    segment_ids: chex.Array,
    mesh: jax.sharding.AbstractMesh,
    chunk_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    implementation: str | None = None,
    collective: str = "all_gather",
    subtree_end: chex.Array | None = None,
) -> jax.Array:
    """Causal, segment-masked GQA of load-balanced rows split over the ``context`` axis.

    ``q [B, L, N, D]``, ``k, v [B, L, K, D]`` and ``segment_ids [B, L]`` are in the order of
    :func:`load_balance` (global view). Equal to ``unbalance``-ing, running
    :func:`rljax.models.attention.causal_attention` in natural order and ``load_balance``-ing the
    output. ``implementation``: None = XLA einsums (:func:`grouped_attention`, ``chunk_size``
    query blocks); ``"cudnn"`` / ``"xla"``: ``jax.nn.dot_product_attention`` with that
    implementation on the same blocks and masks.

    ``subtree_end`` (``int [B, L]``, load-balanced like ``segment_ids``; natural-order slots as
    values): prefix-tree rows (design §2.6). It travels with the keys (gathered, or passed around the
    ring) and every block takes the tree mask of :func:`rljax.models.attention.attention_mask`; the
    tree mask is causal, so the blocks either collective skips hold no visible key under it either.
    """
    shards = mesh.shape[CONTEXT_AXIS]
    if collective not in CONTEXT_COLLECTIVES:
        raise ValueError(
            f"context attention collective must be one of {CONTEXT_COLLECTIVES}, got {collective!r}"
        )
    if collective == "ring" and implementation is not None:
        raise ValueError(
            f"the ring runs XLA blocks (it merges partial softmaxes, which {implementation!r} does not "
            "return); use the all_gather collective with fused kernels"
        )
    spec4 = PartitionSpec(None, CONTEXT_AXIS, None, None)
    spec2 = PartitionSpec(None, CONTEXT_AXIS)
    args = (q, k, v, segment_ids.astype(jnp.int32))
    if subtree_end is not None:
        args += (jnp.asarray(subtree_end).astype(jnp.int32),)
    if collective == "all_gather":
        local = functools.partial(_gathered_attention, shards=shards, chunk_size=chunk_size,
                                  precision=precision, implementation=implementation)  # fmt: skip
    else:
        local = functools.partial(_ring_attention, shards=shards, chunk_size=chunk_size, precision=precision)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec4, spec4, spec4) + (spec2,) * (len(args) - 3),
        out_specs=spec4,
        axis_names={CONTEXT_AXIS},
    )(*args)


def _gathered_attention(
    q_l: jax.Array, k_l: jax.Array, v_l: jax.Array, seg_l: jax.Array, end_l: jax.Array | None = None, *,
    shards: int, chunk_size: int | None, precision: jax.lax.PrecisionLike, implementation: str | None,
) -> jax.Array:  # fmt: skip
    """One device's attention with the ``all_gather`` collective (inside ``shard_map``): it gathers
    the row's keys, values, segment ids (and subtree ends) in natural order; its early chunk reads
    the first half of them, its late chunk all of them."""
    m = q_l.shape[1] // 2
    length = 2 * shards * m
    tree = end_l is not None

    def kernel(q_i: jax.Array, k_i: jax.Array, v_i: jax.Array, mask: jax.Array) -> jax.Array:
        if implementation is None:
            return grouped_attention(q_i, k_i, v_i, mask, precision=precision)
        return jax.nn.dot_product_attention(q_i, k_i, v_i, mask=mask[:, None], implementation=implementation)

    def attend(q_chunk: jax.Array, seg_chunk: jax.Array, first: jax.Array, keys: int, k_nat, v_nat, seg_nat,
               end_nat) -> jax.Array:  # fmt: skip
        kv_slots = jnp.arange(keys, dtype=jnp.int32)
        q_slots = first + jnp.arange(m, dtype=jnp.int32)
        k_p, v_p, s_p = k_nat[:, :keys], v_nat[:, :keys], seg_nat[:, :keys]
        e_p = end_nat[:, :keys] if tree else None

        def block(q_b: jax.Array, seg_b: jax.Array, slots_b: jax.Array) -> jax.Array:
            return kernel(q_b, k_p, v_p, attention_mask(seg_b, s_p, slots_b, kv_slots, e_p))

        return _in_query_blocks(block, q_chunk, seg_chunk, q_slots, chunk_size)

    i = jax.lax.axis_index(CONTEXT_AXIS).astype(jnp.int32)
    gather = jax.tree.map(
        lambda a: unbalance(jax.lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True), shards),
        (k_l, v_l, seg_l, end_l),
    )
    early = attend(q_l[:, :m], seg_l[:, :m], i * m, length // 2, *gather)
    late = attend(q_l[:, m:], seg_l[:, m:], (2 * shards - 1 - i) * m, length, *gather)
    return jnp.concatenate([early, late], axis=1)


def _ring_attention(
    q_l: jax.Array, k_l: jax.Array, v_l: jax.Array, seg_l: jax.Array, end_l: jax.Array | None = None, *,
    shards: int, chunk_size: int | None, precision: jax.lax.PrecisionLike,
) -> jax.Array:  # fmt: skip
    """One device's attention with the ``ring`` collective (inside ``shard_map``): key/value chunks
    pass around the devices (``ppermute``), each visible part's partial softmax merged in
    (:func:`merge_attention`)."""
    m = q_l.shape[1] // 2
    tree = end_l is not None
    i = jax.lax.axis_index(CONTEXT_AXIS).astype(jnp.int32)
    chunk = jnp.arange(m, dtype=jnp.int32)

    def slots(device: jax.Array) -> tuple[jax.Array, jax.Array]:  # global slots of its two chunks
        return device * m + chunk, (2 * shards - 1 - device) * m + chunk

    def halves(a: jax.Array) -> tuple[jax.Array, jax.Array]:
        return a[:, :m], a[:, m:]

    # (out, lse) of a query chunk
    def attend_part(q_c, seg_c, slots_c, k_c, v_c, kv_seg, kv_end, kv_slots):  # fmt: skip
        def block(q_b: jax.Array, seg_b: jax.Array, slots_b: jax.Array) -> tuple[jax.Array, jax.Array]:
            mask = attention_mask(seg_b, kv_seg, slots_b, kv_slots, kv_end)
            return grouped_attention_lse(q_b, k_c, v_c, mask, precision=precision)

        return _in_query_blocks(block, q_c, seg_c, slots_c, chunk_size)

    (q_e, q_z), (s_e, s_z), (t_e, t_z) = halves(q_l), halves(seg_l), slots(i)
    e_e = end_l[:, :m] if tree else None
    # this device's own keys: the early chunk sees its early chunk, the late one both chunks
    acc_e = attend_part(q_e, s_e, t_e, k_l[:, :m], v_l[:, :m], s_e, e_e, t_e)
    acc_z = attend_part(q_z, s_z, t_z, k_l, v_l, seg_l, end_l, jnp.concatenate([t_e, t_z]))
    kv = (k_l, v_l, seg_l, end_l)  # end_l: None without a tree (an empty pytree)
    ring = [(d, (d + 1) % shards) for d in range(shards)]
    for step in range(1, shards):
        kv = jax.lax.ppermute(kv, CONTEXT_AXIS, ring)  # now the keys of device j = i - step
        j = (i - step) % shards
        (k_je, k_jz), (v_je, v_jz), (s_je, s_jz) = (halves(a) for a in kv[:3])
        e_je, e_jz = halves(kv[3]) if tree else (None, None)
        t_je, t_jz = slots(j)
        # j's early chunk precedes this device's late chunk: always visible
        acc_z = merge_attention(acc_z, attend_part(q_z, s_z, t_z, k_je, v_je, s_je, e_je, t_je))
        # j < i: early queries see j's early chunk (j's late chunk lies after both of ours);
        # j > i: late queries see j's late chunk (its early one lies after our early chunk)
        pick = functools.partial(_select, j < i)
        part = attend_part(
            pick(q_e, q_z), pick(s_e, s_z), pick(t_e, t_z),
            pick(k_je, k_jz), pick(v_je, v_jz), pick(s_je, s_jz), pick(e_je, e_jz) if tree else None,
            pick(t_je, t_jz),
        )  # fmt: skip
        acc_e = jax.tree.map(pick, merge_attention(acc_e, part), acc_e)
        acc_z = jax.tree.map(pick, acc_z, merge_attention(acc_z, part))
    return jnp.concatenate([acc_e[0], acc_z[0]], axis=1).astype(q_l.dtype)


def _select(pred: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(pred, a, b)


def pad_for_context(x: jax.Array | None, shards: int, *, value: int = 0) -> jax.Array | None:
    """``x [B, L, ...]`` padded on axis 1 with ``value`` to a multiple of ``2 * shards`` tokens."""
    if x is None:
        return None
    pad = (-x.shape[1]) % (2 * shards)
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def context_size(mesh: jax.sharding.AbstractMesh | None) -> int:
    """Size of the ``context`` axis of ``mesh`` (1 without one)."""
    if mesh is None or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[CONTEXT_AXIS])


__all__ = [
    "CONTEXT_AXIS",
    "CONTEXT_COLLECTIVES",
    "constrain_tokens",
    "context_attention",
    "context_mesh",
    "context_size",
    "load_balance",
    "pad_for_context",
    "token_spec",
    "unbalance",
]
