"""Mixture-of-experts feed-forward (Qwen2-MoE / Qwen3-MoE): routing, grouped expert compute, expert
parallelism, router replay (R3) and the auxiliary losses / metrics of the router.

Sparse block (Shazeer et al. 2017; Qwen-MoE)::

    z = x @ W_router                                   # float32 router logits [N, E]
    p = softmax(z);  ids = top_k(p, k)                 # or ids = routed_experts (replay)
    w = p[ids]  (/ sum(p[ids]) when norm_topk_prob)    # gate weights, differentiable in W_router
    y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))  with e = ids_j
    qwen2_moe adds  sigmoid(x @ w_sg) * shared_mlp(x)

Expert weights are stacked per layer (``experts.gate_proj`` ``[E, hidden, I]``, ``experts.up_proj``
``[E, hidden, I]``, ``experts.down_proj`` ``[E, I, hidden]``). Only the ``N * k`` routed (token,
expert) pairs are computed, never every expert on every token, and no pair is dropped:

* ``impl="ragged"``: pairs sorted by expert + :func:`jax.lax.ragged_dot` (grouped matmul). The
  default on GPU / TPU. XLA:CPU lowers ``ragged_dot`` to a masked dense product over ALL experts
  (measured 45x slower than the grouped FLOPs), so it is not the CPU default.
* ``impl="tiled"`` (CPU default): pairs sorted by expert and laid out in tiles of ``tile`` rows that
  each hold one expert only (every group padded to a multiple of ``tile``); one batched matmul of
  the tiles against their expert's weights. Padding costs at most ``E * (tile - 1)`` rows.
* ``impl="dense"``: every expert on every token, weighted by the (sparse) gate matrix; the
  reference for tests and the naive baseline of ``benchmarks/moe_bench.py``.

Expert parallelism: when the ambient mesh (``jax.set_mesh(mesh)``) has an ``expert`` axis of size
``D > 1``, experts are sharded over it (``E / D`` per shard) and tokens (rows sharded over
``data``, ``fsdp`` and ``expert``) are exchanged inside ``shard_map``: each shard sends every routed
pair to the shard owning its expert with ``all_to_all``, runs its local experts, and the results come
back with a second ``all_to_all``. XLA:CPU has no ``ragged_all_to_all``, so the exchange buffers have
the dropless worst-case size (``D x`` the routed pairs); the result equals the single-device one.

Router replay (R3): pass ``routed_experts`` (int32, ``[..., k]`` per token and MoE layer) and the
block dispatches to those experts with gate weights recomputed from the CURRENT router logits over
them, so the trainer computes the sampler's network and gradients still reach the router.
"""

from __future__ import annotations

import math
from typing import Literal

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from rljax.models.layers import _INIT_STD, MLP, Linear

Impl = Literal["auto", "ragged", "tiled", "dense"]
IMPLS = ("auto", "ragged", "tiled", "dense")
EXPERT_AXIS = "expert"
#: Mesh axes that split token rows (the expert axis borrows from data parallelism outside MoE layers).
TOKEN_AXES = ("data", "fsdp", EXPERT_AXIS)
MAX_TILE = 128


@flax.struct.dataclass
class Routing:
    """Router statistics of the ``M`` MoE layers of a forward pass (in layer order).

    Attributes:
      logits: float32 ``[..., M, E]`` router logits of every token (leading axes: those of tokens).
      experts: int32 ``[..., M, k]`` experts each token was dispatched to (chosen by the router,
        or the replayed ``routed_experts``).
    """

    logits: jax.Array
    experts: jax.Array


# --------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------


def route(
    logits: chex.Array,
    top_k: int,
    *,
    norm_topk_prob: bool,
    routed_experts: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(experts int32 [..., k], gate weights float32 [..., k])`` from router logits ``[..., E]``.

    ``experts`` = top-k of ``softmax(logits)`` (ties: lower index first), or ``routed_experts`` when
    given (replay). Weights are ``softmax(logits)`` at those experts, renormalized to sum 1 when
    ``norm_topk_prob`` (= a softmax over the selected logits); either way a differentiable function
    of the current logits. A replay row whose ids are all negative means "not recorded" (padding, or
    the last token of a sample, which the sampler never processed): that token routes by its own
    top-k. A replayed id ``>= E`` (or a row mixing negative and valid ids) gives NaN weights (loud).

    >>> ids, w = route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2, norm_topk_prob=True)
    >>> ids.tolist(), [round(float(v), 4) for v in w[0]]
    ([[1, 2]], [0.6667, 0.3333])
    >>> ids, w = route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2, norm_topk_prob=False,
    ...                routed_experts=jnp.array([[0, 2]]))
    >>> ids.tolist(), [round(float(v), 4) for v in w[0]]
    ([[0, 2]], [0.1, 0.3])
    >>> route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2, norm_topk_prob=True,
    ...       routed_experts=jnp.array([[-1, -1]]))[0].tolist()  # not recorded: own top-k
    [[1, 2]]
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, experts = jax.lax.top_k(probs, top_k)
    if routed_experts is not None:
        chex.assert_shape(routed_experts, (*logits.shape[:-1], top_k))
        replay = jnp.asarray(routed_experts).astype(jnp.int32)
        recorded = jnp.any(replay >= 0, axis=-1, keepdims=True)
        experts = jnp.where(recorded, replay, experts)
    experts = experts.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, experts, axis=-1, mode="fill", fill_value=jnp.nan)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights


# --------------------------------------------------------------------------------------------------
# Grouped expert compute
# --------------------------------------------------------------------------------------------------


def default_impl() -> str:
    """``"tiled"`` on CPU, ``"ragged"`` (``jax.lax.ragged_dot``) on GPU / TPU."""
    return "tiled" if jax.default_backend() == "cpu" else "ragged"


def _resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"MoE impl must be one of {IMPLS}, got {impl!r}")
    return default_impl() if impl == "auto" else impl


def tile_size(num_pairs: int, num_experts: int, *, max_tile: int = MAX_TILE) -> int:
    """Rows per expert tile: the power of two nearest half the mean group size, in ``[1, max_tile]``.

    Padding then costs at most ``E * (tile - 1)`` rows, about the routed pairs' own count.

    >>> tile_size(16384, 64), tile_size(16, 8), tile_size(1, 128)
    (128, 1, 1)
    """
    mean = num_pairs / max(num_experts, 1)
    return int(min(max_tile, max(1, 2 ** math.floor(math.log2(max(mean / 2, 1))))))


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _ffn_ragged(xs, group_sizes, w_gate, w_up, w_down, precision):
    """Grouped SwiGLU on expert-sorted rows with ``jax.lax.ragged_dot`` (rows past the groups give 0)."""
    g = jax.lax.ragged_dot(xs, w_gate, group_sizes, precision=precision)
    u = jax.lax.ragged_dot(xs, w_up, group_sizes, precision=precision)
    return jax.lax.ragged_dot(_swiglu(g, u), w_down, group_sizes, precision=precision)


def _tile_layout(
    sorted_groups: jax.Array, group_sizes: jax.Array, tile: int
) -> tuple[jax.Array, jax.Array, int]:
    """Slot of each expert-sorted pair in the tile layout, and the expert of each tile.

    Groups are padded to a multiple of ``tile`` rows; ``num_tiles = ceil(P / tile) + E`` is a static
    upper bound on the tiles used. Pairs of the sentinel group ``E`` (no expert) get slot
    ``num_tiles * tile`` (out of range: never written, read as zeros).
    """
    num_pairs = sorted_groups.shape[0]
    num_groups = group_sizes.shape[0]
    num_tiles = -(-num_pairs // tile) + num_groups
    tiles_per_group = (group_sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_per_group)
    padded_start = (tile_end - tiles_per_group) * tile
    pair_start = jnp.cumsum(group_sizes) - group_sizes
    g = jnp.minimum(sorted_groups, num_groups - 1)
    rank = jnp.arange(num_pairs, dtype=jnp.int32) - pair_start[g]
    slot = jnp.where(sorted_groups < num_groups, padded_start[g] + rank, num_tiles * tile)
    tile_group = jnp.searchsorted(tile_end, jnp.arange(num_tiles, dtype=jnp.int32), side="right")
    return slot.astype(jnp.int32), jnp.minimum(tile_group, num_groups - 1).astype(jnp.int32), num_tiles


def grouped_ffn(
    x: chex.Array,
    groups: chex.Array,
    w_gate: chex.Array,
    w_up: chex.Array,
    w_down: chex.Array,
    *,
    impl: str = "auto",
    precision: jax.lax.PrecisionLike = None,
    tile: int | None = None,
) -> jax.Array:
    """``out[r, j] = down_g(silu(gate_g(x[r])) * up_g(x[r]))`` with ``g = groups[r, j]``, computed only
    for those ``R * k`` (row, expert) pairs; a group outside ``[0, E)`` gives zeros.

    Args:
      x: ``[R, H]`` rows.
      groups: ``int32 [R, k]`` experts of each row (``-1`` or ``>= E``: none).
      w_gate, w_up: ``[E, H, I]``; w_down: ``[E, I, H]``.
      impl: "auto", "ragged", "tiled" or "dense" (see the module docstring).
      precision: matmul precision.
      tile: rows per tile for "tiled" (default :func:`tile_size`).

    Returns:
      ``[R, k, H]``.

    >>> w = jnp.ones((3, 2, 4)); wd = jnp.ones((3, 4, 2))
    >>> out = grouped_ffn(jnp.ones((2, 2)), jnp.array([[2, 0], [3, 2]]), w, w, wd, impl="tiled")
    >>> [[round(float(v), 2) for v in r] for r in out[..., 0]]  # 4 * silu(2) * 2 = 14.09 per pair
    [[14.09, 14.09], [0.0, 14.09]]
    """
    impl = _resolve(impl)
    chex.assert_rank([x, groups], [2, 2])
    num_experts = w_gate.shape[0]
    rows, k = groups.shape
    num_pairs = rows * k
    flat = groups.reshape(-1).astype(jnp.int32)
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # sentinel E = no expert
    if impl == "dense":
        gate = jax.nn.one_hot(key.reshape(rows, k), num_experts, dtype=x.dtype)  # sentinel -> zeros
        g = jnp.einsum("rh,ehi->eri", x, w_gate, precision=precision)
        u = jnp.einsum("rh,ehi->eri", x, w_up, precision=precision)
        y = jnp.einsum("eri,eih->erh", _swiglu(g, u), w_down, precision=precision)
        return jnp.einsum("erh,rke->rkh", y, gate, precision=precision)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # pairs sorted by expert
    sorted_groups = key[order]
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    if impl == "ragged":
        ys = _ffn_ragged(jnp.take(x, order // k, axis=0), group_sizes, w_gate, w_up, w_down, precision)
        ys = jnp.where((sorted_groups < num_experts)[:, None], ys, 0)
        out = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
        return out.reshape(rows, k, -1)
    tile = tile_size(num_pairs, num_experts) if tile is None else int(tile)
    slot, tile_group, num_tiles = _tile_layout(sorted_groups, group_sizes, tile)
    size = num_tiles * tile
    # pair feeding each slot (num_pairs = padding), then the slot of each pair in input order
    slot_pair = jnp.full((size,), num_pairs, jnp.int32).at[slot].set(order, mode="drop")
    pair_slot = jnp.zeros((num_pairs,), jnp.int32).at[order].set(slot, unique_indices=True)
    xp = jnp.take(x, slot_pair // k, axis=0, mode="fill", fill_value=0).reshape(num_tiles, tile, -1)

    def bmm(a: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum("tmh,thi->tmi", a, w[tile_group], precision=precision)

    yp = bmm(_swiglu(bmm(xp, w_gate), bmm(xp, w_up)), w_down).reshape(size, -1)
    return jnp.take(yp, pair_slot, axis=0, mode="fill", fill_value=0).reshape(rows, k, -1)


def moe_ffn(
    x: chex.Array,
    experts: chex.Array,
    weights: chex.Array,
    w_gate: chex.Array,
    w_up: chex.Array,
    w_down: chex.Array,
    *,
    impl: str = "auto",
    precision: jax.lax.PrecisionLike = None,
    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh | None = None,
) -> jax.Array:
    """``y[n] = sum_j weights[n, j] * expert_{experts[n, j]}(x[n])`` for ``x [N, H]``, ``experts [N, k]``.

    Only the ``N * k`` routed pairs are computed (see :func:`grouped_ffn`). With a ``mesh`` that has
    an ``expert`` axis of size > 1, experts are sharded over it and pairs exchanged by all-to-all
    (:func:`expert_parallel_ffn`); default mesh: the ambient one (``jax.set_mesh``).
    """
    chex.assert_rank([x, experts, weights], [2, 2, 2])
    ep_mesh = _expert_mesh(mesh)
    if ep_mesh is not None:
        return expert_parallel_ffn(x, experts, weights, w_gate, w_up, w_down, mesh=ep_mesh, impl=impl,
                                   precision=precision)  # fmt: skip
    ys = grouped_ffn(x, experts, w_gate, w_up, w_down, impl=impl, precision=precision)
    return jnp.einsum("nkh,nk->nh", ys, weights.astype(ys.dtype), precision=precision)


def _expert_mesh(mesh=None):
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
        return None
    return mesh


def expert_parallel_ffn(
    x: chex.Array,
    experts: chex.Array,
    weights: chex.Array,
    w_gate: chex.Array,
    w_up: chex.Array,
    w_down: chex.Array,
    *,
    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh,
    impl: str = "auto",
    precision: jax.lax.PrecisionLike = None,
) -> jax.Array:
    """:func:`moe_ffn` with experts sharded over the mesh axis ``expert`` (``shard_map`` + all-to-all).

    Token rows are split over ``(data, fsdp, expert)`` (padded to a multiple of their product);
    experts over ``expert``. Per shard: pairs are bucketed by destination shard into a ``[D, n*k, H]``
    buffer (dropless worst case), exchanged with ``all_to_all``, run through the local experts with
    :func:`grouped_ffn`, sent back with ``all_to_all`` and combined with the gate weights.
    """
    num_experts = w_gate.shape[0]
    d = mesh.shape[EXPERT_AXIS]
    if num_experts % d:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert mesh axis size {d}")
    token_axes = tuple(a for a in TOKEN_AXES if a in mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in token_axes]))
    n = x.shape[0]
    pad = (-n) % shards
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        experts = jnp.pad(experts, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    rows = PartitionSpec(token_axes, None)
    wspec = PartitionSpec(EXPERT_AXIS, None, None)

    def local(x, experts, weights, w_gate, w_up, w_down):
        n_loc, k = experts.shape
        e_loc = w_gate.shape[0]
        pairs = n_loc * k
        flat = experts.reshape(-1)
        dest = jnp.clip(flat // e_loc, 0, d - 1)
        order = jnp.argsort(dest, stable=True)
        dest_s = dest[order]
        counts = jnp.bincount(dest, length=d)
        rank = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest_s]
        send = jnp.zeros((d, pairs, x.shape[1]), x.dtype).at[dest_s, rank].set(x[order // k])
        send_e = jnp.full((d, pairs), -1, jnp.int32).at[dest_s, rank].set(flat[order] - dest_s * e_loc)
        recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True)
        recv_e = jax.lax.all_to_all(send_e, EXPERT_AXIS, 0, 0, tiled=True)
        out = grouped_ffn(recv.reshape(d * pairs, -1), recv_e.reshape(-1, 1), w_gate, w_up, w_down,
                          impl=impl, precision=precision)  # fmt: skip
        back = jax.lax.all_to_all(out.reshape(d, pairs, -1), EXPERT_AXIS, 0, 0, tiled=True)
        ys = jnp.zeros((pairs, x.shape[1]), out.dtype).at[order].set(back[dest_s, rank])
        return jnp.einsum(
            "nkh,nk->nh", ys.reshape(n_loc, k, -1), weights.astype(ys.dtype), precision=precision
        )

    y = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, wspec, wspec, wspec),
        out_specs=rows,
    )(x, experts, weights, w_gate, w_up, w_down)
    return y[:n]


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------


class Experts(nnx.Module):
    """Stacked SwiGLU experts: ``gate_proj``, ``up_proj`` ``[E, H, I]``; ``down_proj`` ``[E, I, H]``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        param_dtype: jnp.dtype,
        init_std: float,
        rngs: nnx.Rngs,
    ) -> None:
        init = jax.nn.initializers.normal(init_std)
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, i), param_dtype),
                                   logical_axes=("expert", "embed", "moe_mlp"))  # fmt: skip
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, i), param_dtype),
                                 logical_axes=("expert", "embed", "moe_mlp"))  # fmt: skip
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), param_dtype),
                                   logical_axes=("expert", "moe_mlp", "embed"))  # fmt: skip


class SparseMoeBlock(nnx.Module):
    """Router (``gate``), stacked ``experts`` and, for qwen2_moe, ``shared_expert`` + ``shared_expert_gate``.

    ``__call__(x [B, T, H], routed_experts=None [B, T, k])`` returns ``(y, logits [B, T, E] float32,
    experts [B, T, k] int32)``.
    """

    def __init__(
        self,
        config,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        precision: jax.lax.PrecisionLike,
        impl: str,
        rngs: nnx.Rngs,
    ) -> None:
        c = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.gate = Linear(c.hidden_size, c.num_experts, use_bias=False, logical_axes=("embed", None), **kw)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size,
                               param_dtype=param_dtype, init_std=_INIT_STD, rngs=rngs)  # fmt: skip
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c, intermediate_size=c.shared_expert_intermediate_size, **kw)
            self.shared_expert_gate = Linear(
                c.hidden_size, 1, use_bias=False, logical_axes=("embed", None), **kw
            )
        else:
            self.shared_expert = self.shared_expert_gate = None
        _resolve(impl)
        self.top_k = c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        self.impl = impl
        self.dtype = dtype
        self.precision = precision

    def router_logits(self, x: jax.Array) -> jax.Array:
        """float32 router logits ``[..., E]``."""
        x2 = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        z = jnp.dot(x2, self.gate.kernel[...].astype(self.dtype), precision=self.precision,
                    preferred_element_type=jnp.float32)  # fmt: skip
        return z.reshape(*x.shape[:-1], z.shape[-1])

    def __call__(
        self, x: jax.Array, *, routed_experts: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        shape = x.shape
        logits = self.router_logits(x)
        experts, weights = route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob,
                                 routed_experts=routed_experts)  # fmt: skip
        x2 = x.reshape(-1, shape[-1]).astype(self.dtype)
        w = self.experts
        y = moe_ffn(
            x2,
            experts.reshape(-1, self.top_k),
            weights.reshape(-1, self.top_k).astype(self.dtype),
            w.gate_proj[...].astype(self.dtype),
            w.up_proj[...].astype(self.dtype),
            w.down_proj[...].astype(self.dtype),
            impl=self.impl,
            precision=self.precision,
        ).reshape(shape)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.astype(self.dtype), logits, experts


# --------------------------------------------------------------------------------------------------
# Auxiliary losses and metrics (pure functions of a Routing)
# --------------------------------------------------------------------------------------------------


def _flat(routing: Routing, mask: chex.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logits [N, M, E], experts [N, M, k], mask float32 [N])`` over all tokens."""
    m, e = routing.logits.shape[-2:]
    logits = routing.logits.reshape(-1, m, e).astype(jnp.float32)
    experts = routing.experts.reshape(-1, m, routing.experts.shape[-1])
    if mask is None:
        weights = jnp.ones((logits.shape[0],), jnp.float32)
    else:
        weights = jnp.asarray(mask).reshape(-1).astype(jnp.float32)
    chex.assert_equal(weights.shape[0], logits.shape[0])
    return logits, experts, weights


def expert_load(routing: Routing, mask: chex.Array | None = None) -> jax.Array:
    """float32 ``[M, E]``: share of the routed (token, slot) pairs of each layer sent to each expert
    (rows sum to 1; masked tokens, e.g. padding ``segment_ids == 0``, excluded).

    >>> r = Routing(logits=jnp.zeros((4, 1, 2)), experts=jnp.array([[[0]], [[0]], [[0]], [[1]]]))
    >>> expert_load(r).tolist()
    [[0.75, 0.25]]
    """
    logits, experts, w = _flat(routing, mask)
    onehot = jax.nn.one_hot(experts, logits.shape[-1], dtype=jnp.float32).sum(axis=2)  # [N, M, E]
    counts = jnp.einsum("nme,n->me", onehot, w)
    return counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1e-9)


def load_balancing_loss(routing: Routing, mask: chex.Array | None = None) -> jax.Array:
    """Switch-Transformer load-balancing loss (Fedus et al. 2021), averaged over MoE layers:
    ``E * sum_e f_e * P_e`` with ``f_e`` the share of routed pairs sent to expert ``e`` (no gradient)
    and ``P_e`` the mean router probability of ``e`` over (unmasked) tokens. 1.0 when uniform.

    transformers' Qwen-MoE ``load_balancing_loss_func`` counts ``f_e`` per token instead of per pair
    (``k`` times this value) and pools all layers before the product.

    >>> z = jnp.zeros((8, 2, 4))  # uniform router, balanced choices
    >>> r = Routing(logits=z, experts=jnp.tile(jnp.arange(4).reshape(4, 1, 1), (2, 2, 1)))
    >>> float(load_balancing_loss(r))
    1.0
    """
    logits, _, w = _flat(routing, mask)
    f = jax.lax.stop_gradient(expert_load(routing, mask))  # [M, E]
    probs = jax.nn.softmax(logits, axis=-1)
    p = jnp.einsum("nme,n->me", probs, w) / jnp.maximum(jnp.sum(w), 1e-9)
    return logits.shape[-1] * jnp.mean(jnp.sum(f * p, axis=-1))


def router_z_loss(routing: Routing, mask: chex.Array | None = None) -> jax.Array:
    """Router z-loss (ST-MoE, Zoph et al. 2022): mean over tokens and layers of ``logsumexp(z)^2``.

    >>> float(router_z_loss(Routing(logits=jnp.zeros((3, 1, 4)), experts=jnp.zeros((3, 1, 1), int))))
    1.921812...
    """
    logits, _, w = _flat(routing, mask)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [N, M]
    return jnp.sum(jnp.mean(lse * lse, axis=-1) * w) / jnp.maximum(jnp.sum(w), 1e-9)


def routing_entropy(routing: Routing, mask: chex.Array | None = None) -> jax.Array:
    """float32 ``[M]``: mean entropy (nats) of the router softmax per MoE layer (``log E`` = uniform)."""
    logits, _, w = _flat(routing, mask)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)  # [N, M]
    return jnp.einsum("nm,n->m", ent, w) / jnp.maximum(jnp.sum(w), 1e-9)


def routing_metrics(routing: Routing, mask: chex.Array | None = None, *, prefix: str = "routing/") -> dict:
    """Scalar metrics: ``load_max_over_mean`` (mean over layers of ``max_e load / mean_e load``; 1 =
    balanced, ``E / k`` = collapsed), its worst layer, ``entropy`` (mean over layers), ``aux_loss``
    and ``z_loss``; plus per-layer ``load_max_over_mean/{m}`` and ``entropy/{m}``."""
    load = expert_load(routing, mask)
    ratio = jnp.max(load, axis=-1) * load.shape[-1]  # max / mean (mean = 1 / E)
    ent = routing_entropy(routing, mask)
    out = {
        f"{prefix}load_max_over_mean": jnp.mean(ratio),
        f"{prefix}load_max_over_mean_worst_layer": jnp.max(ratio),
        f"{prefix}entropy": jnp.mean(ent),
        f"{prefix}aux_loss": load_balancing_loss(routing, mask),
        f"{prefix}z_loss": router_z_loss(routing, mask),
    }
    for m in range(load.shape[0]):
        out[f"{prefix}load_max_over_mean/{m}"] = ratio[m]
        out[f"{prefix}entropy/{m}"] = ent[m]
    return out


def top_k_experts(logits: chex.Array, top_k: int) -> jax.Array:
    """int32 ``[..., k]``: the experts a router with these logits chooses (as :func:`route`)."""
    return jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), top_k)[1].astype(jnp.int32)


def flip_fraction(
    chosen: chex.Array, recorded: chex.Array, mask: chex.Array | None = None, *, per_layer: bool = False
) -> jax.Array:
    """Share of tokens whose top-k expert SET differs between ``chosen`` and ``recorded``
    (``int [..., M, k]`` each) in at least one MoE layer (``per_layer``: float32 ``[M]`` per layer).

    >>> a = jnp.array([[[0, 1]], [[2, 3]]]); b = jnp.array([[[1, 0]], [[2, 1]]])
    >>> float(flip_fraction(a, b))
    0.5
    """
    chex.assert_equal_shape([chosen, recorded])
    m, k = chosen.shape[-2:]
    differ = jnp.any(jnp.sort(chosen, axis=-1) != jnp.sort(recorded, axis=-1), axis=-1).reshape(-1, m)
    w = (
        jnp.ones((differ.shape[0],), jnp.float32)
        if mask is None
        else jnp.asarray(mask).reshape(-1).astype(jnp.float32)
    )
    total = jnp.maximum(jnp.sum(w), 1e-9)
    if per_layer:
        return jnp.einsum("nm,n->m", differ.astype(jnp.float32), w) / total
    return jnp.sum(jnp.any(differ, axis=-1).astype(jnp.float32) * w) / total
