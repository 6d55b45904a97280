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
* ``impl="tiled"`` (CPU default): pairs sorted by expert once and laid out in tiles of ``tile`` rows
  that each hold one expert only (every group padded to a multiple of ``tile``); a loop over the
  used tiles multiplies each tile by its expert's weights, indexed in place (no per-tile weight
  copies; the gate and up projections as one ``[H, 2I]`` matmul). A hand-written VJP
  (``jax.custom_vjp``) reuses the sort and moves rows by gathers only: the transpose of a
  permutation is its inverse, whereas XLA's transpose of a gather is a scatter-add (slow on CPU);
  the gate-weighted combine is a sum of ``k`` gathers. Padding costs at most ``E * (tile - 1)`` rows.
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

import functools
import math
from typing import Literal, NamedTuple

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from rljax.models.layers import _INIT_STD, MLP, Linear
from rljax.models.lora import expert_weights

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


class _TilePlan(NamedTuple):
    """Tile layout of the ``P = R k`` routed pairs (pair ``p`` = row ``p // k``, slot ``p % k``); int32.

    Attributes:
      slot_pair: ``[T * tile]`` pair feeding each slot of the tiles (``P`` for padding).
      pair_slot: ``[P]`` slot of each pair (``T * tile``, out of range, for a pair with no expert).
      tile_group: ``[T]`` expert of each tile.
      num_used: ``[]`` tiles holding pairs (the other tiles of the static bound ``T`` are skipped).
    """

    slot_pair: jax.Array
    pair_slot: jax.Array
    tile_group: jax.Array
    num_used: jax.Array


def _pair_keys(groups: jax.Array, num_experts: int) -> jax.Array:
    """int32 ``[R * k]``: the expert of each (row, slot) pair, or the sentinel ``E`` (none) when
    outside ``[0, E)``."""
    flat = groups.reshape(-1).astype(jnp.int32)
    return jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)


def _tile_plan(key: jax.Array, num_experts: int, tile: int) -> _TilePlan:
    """Sort the pairs by expert (``key``, sentinel ``E`` = none) once, and derive the permutation both
    ways: forward and backward then move rows with gathers only (the autodiff transpose of a gather
    is a scatter-add, slow on XLA:CPU; the transpose of a permutation is its inverse, a gather)."""
    num_pairs = key.shape[0]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    slot, tile_group, num_tiles = _tile_layout(key[order], group_sizes, tile)
    slot_pair = jnp.full((num_tiles * tile,), num_pairs, jnp.int32).at[slot].set(order, mode="drop")
    pair_slot = jnp.zeros((num_pairs,), jnp.int32).at[order].set(slot, unique_indices=True)
    num_used = jnp.sum((group_sizes + tile - 1) // tile).astype(jnp.int32)
    return _TilePlan(slot_pair, pair_slot, tile_group, num_used)


def _take_rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """``a[index]`` along the first axis; an out-of-range index reads zeros."""
    return jnp.take(a, index, axis=0, mode="fill", fill_value=0)


def _gather_sum(a: jax.Array, index: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """``out[r] = sum_j weights[r, j] a[index[r, j]]`` (weights 1 when None; out-of-range reads 0).

    A sum of ``k`` row gathers rather than a gather to ``[R, k, H]`` and a reduction: XLA:CPU fuses
    each gather into the elementwise sum, so no ``[R, k, H]`` buffer is written.
    """
    out = None
    for j in range(index.shape[1]):
        term = _take_rows(a, index[:, j])
        term = term if weights is None else term * weights[:, j, None]
        out = term if out is None else out + term
    return out


# Row movement between token order and the tile layout. Each is a gather whose VJP is written as
# the gather by the inverse index (XLA's own transpose would be a scatter-add).


@jax.custom_vjp
def _unpermute(ys: jax.Array, plan: _TilePlan) -> jax.Array:
    """``out[p] = ys[pair_slot[p]]`` (zeros for a pair with no expert): ``[P, H]``.

    VJP: ``dys[s] = dout[slot_pair[s]]`` (zeros for padding).
    """
    return _take_rows(ys, plan.pair_slot)


def _unpermute_fwd(ys, plan):
    return _unpermute(ys, plan), (jnp.zeros_like(ys, shape=()), plan)


def _unpermute_bwd(res, dout):
    ys, plan = res
    return _cotangent_like(_take_rows(dout, plan.slot_pair), ys), None


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine(ys: jax.Array, weights: jax.Array, plan: _TilePlan, k: int) -> jax.Array:
    """``y[r] = sum_j weights[r, j] ys[pair_slot[r k + j]]``: ``[R, H]`` (gather and sum, fused).

    VJP: ``dys[s] = weights[p] dy[p // k]`` with ``p = slot_pair[s]`` (zeros for padding) and
    ``dweights[r, j] = <dy[r], ys[pair_slot[r k + j]]>``.
    """
    return _gather_sum(ys, plan.pair_slot.reshape(-1, k), weights.astype(ys.dtype))


def _combine_fwd(ys, weights, plan, k):
    return _combine(ys, weights, plan, k), (ys, weights, plan)


def _combine_bwd(k, res, dy):
    ys, weights, plan = res
    w_slot = _take_rows(weights.reshape(-1), plan.slot_pair).astype(ys.dtype)
    dys = _take_rows(dy, plan.slot_pair // k) * w_slot[:, None]
    index = plan.pair_slot.reshape(-1, k)
    dweights = jnp.stack([jnp.sum(_take_rows(ys, index[:, j]) * dy, axis=-1) for j in range(k)], axis=1)
    dweights = dweights.astype(weights.dtype)
    return _cotangent_like(dys, ys), _cotangent_like(dweights, weights), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _set_tile(a: jax.Array, value: jax.Array, i: jax.Array) -> jax.Array:
    """``a[i] = value`` in place (``i`` in range: no bounds select)."""
    return jax.lax.dynamic_update_index_in_dim(a, value.astype(a.dtype), i, 0)


def _add_tile(a: jax.Array, value: jax.Array, i: jax.Array) -> jax.Array:
    """``a[i] += value`` in place."""
    return _set_tile(a, jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) + value, i)


def _varying(a: jax.Array) -> frozenset:
    """The manual mesh axes ``a`` varies over (inside ``shard_map``; empty outside)."""
    axis_type = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(axis_type.varying) if axis_type is not None else frozenset()


def _cotangent_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """``ct`` summed over the manual axes it varies over and ``primal`` does not: in a hand-written
    VJP, the transpose of the implicit broadcast of an invariant primal (e.g. expert weights
    replicated over ``data``, used with rows split over it) that JAX's autodiff would insert."""
    extra = tuple(sorted(_varying(ct) - _varying(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def _zeros(shape: tuple[int, ...], dtype, like: tuple[jax.Array, ...]) -> jax.Array:
    """Zeros that vary over every manual mesh axis any of ``like`` varies over: inside ``shard_map``
    a loop carry must have the type of the loop body's output (a plain broadcast outside)."""
    out = jnp.zeros_like(like[0], dtype=dtype, shape=shape)
    for a in like[1:]:
        out = out + jnp.zeros_like(a, dtype=dtype, shape=())
    return out


def _tile_rows(x: jax.Array, plan: _TilePlan, t: jax.Array, tile: int, k: int) -> jax.Array:
    """``[tile, H]``: the rows of ``x`` feeding tile ``t`` (zeros for padding), gathered in the loop
    so that no ``[T * tile, H]`` copy of the routed rows is materialised."""
    rows = jax.lax.dynamic_slice_in_dim(plan.slot_pair, t * tile, tile) // k
    return _take_rows(x, rows)


def _expert_gate_up(w_gate: jax.Array, w_up: jax.Array, e: jax.Array) -> jax.Array:
    """``[H, 2I]``: expert ``e``'s gate and up projections side by side (one copy of that expert's
    weights, which slicing it for the matmul costs anyway; no ``[E, H, 2I]`` copy of all experts)."""
    return jnp.concatenate([w_gate[e], w_up[e]], axis=-1)


def _tiles_forward(
    x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, plan: _TilePlan, k: int, precision
) -> tuple[jax.Array, jax.Array]:
    """``gu_t = x_t W_gu[e_t]`` (``[g | u]``: the gate and up projections side by side, ``x_t`` the
    rows of tile ``t``) and ``y_t = (silu(g_t) * u_t) W_down[e_t]`` for the used tiles
    ``t < num_used`` (``e_t = tile_group[t]``).

    A loop over tiles that indexes the stacked weights by the tile's expert: no ``T x`` copy of the
    weights (a batched matmul against ``W[tile_group]`` materialises one per tile), and the unused
    tiles of the static bound are skipped (their rows are zeros, never read back).
    Returns ``(y [T, tile, H], gu [T, tile, 2I])``.
    """
    num_tiles = plan.tile_group.shape[0]
    tile = plan.slot_pair.shape[0] // num_tiles
    inter = w_down.shape[1]

    def body(t, carry):
        y, gu_all = carry
        e = plan.tile_group[t]
        gu = jnp.dot(_tile_rows(x, plan, t, tile, k), _expert_gate_up(w_gate, w_up, e), precision=precision)
        yt = jnp.dot(_swiglu(gu[:, :inter], gu[:, inter:]), w_down[e], precision=precision)
        return _set_tile(y, yt, t), _set_tile(gu_all, gu, t)

    like = (x, w_gate, w_up, w_down, *plan)
    y0 = _zeros((num_tiles, tile, x.shape[1]), x.dtype, like)
    gu0 = _zeros((num_tiles, tile, 2 * inter), x.dtype, like)
    return jax.lax.fori_loop(0, plan.num_used, body, (y0, gu0))


def _tiles_backward(
    dy: jax.Array,
    x: jax.Array,
    gu_all: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    plan: _TilePlan,
    k: int,
    precision,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """VJP of :func:`_tiles_forward` w.r.t. ``(x_t, W_gate, W_up, W_down)`` given ``dy = dL/dy [T, tile, H]``.

    Per used tile, with ``s = sigmoid(g)``, ``h = g s u``::

        dh = dy W_down[e]^T;  du = dh * g s;  dg = dh * u * s (1 + g (1 - s))
        dx_t = [dg | du] W_gu[e]^T
        dW_down[e] += h^T dy;  [dW_gate[e] | dW_up[e]] += x_t^T [dg | du]   (in >= float32)

    ``dx_t`` overwrites ``dy[t]`` in the loop carry (no fresh ``[T, tile, H]`` buffer).
    """
    acc = jnp.promote_types(w_gate.dtype, jnp.float32)
    tile = dy.shape[1]
    inter = w_down.shape[1]

    def body(t, carry):
        dxp, dwg, dwu, dwd = carry
        e = plan.tile_group[t]
        a, gu, dyt = _tile_rows(x, plan, t, tile, k), gu_all[t], dxp[t]
        g, u = gu[:, :inter], gu[:, inter:]
        s = jax.nn.sigmoid(g)
        silu = g * s
        dh = jnp.dot(dyt, w_down[e].T, precision=precision)
        dgu = jnp.concatenate([dh * u * s * (1 + g * (1 - s)), dh * silu], axis=-1)
        dx = jnp.dot(dgu, _expert_gate_up(w_gate, w_up, e).T, precision=precision)
        dwd = _add_tile(dwd, jnp.dot((silu * u).T, dyt, precision=precision, preferred_element_type=acc), e)
        dwgu = jnp.dot(a.T, dgu, precision=precision, preferred_element_type=acc)
        dwg, dwu = _add_tile(dwg, dwgu[:, :inter], e), _add_tile(dwu, dwgu[:, inter:], e)
        return _set_tile(dxp, dx, t), dwg, dwu, dwd

    like = (dy, x, gu_all, w_gate, w_up, w_down, *plan)
    dxp0 = dy.astype(x.dtype) + _zeros((), x.dtype, like)
    init = (dxp0, *(_zeros(w.shape, acc, like) for w in (w_gate, w_up, w_down)))
    return jax.lax.fori_loop(0, plan.num_used, body, init)


#: Per-tile matmul size (``tile * H * I`` multiply-adds) from which the tiles are looped over; below
#: it the loop's per-iteration overhead dominates on CPU and one batched matmul against per-tile
#: copies of the weights is faster.
LOOP_MIN_TILE_MACS = 1 << 22


def _loop_over_tiles(plan: _TilePlan, w_down: jax.Array) -> bool:
    tile = plan.slot_pair.shape[0] // plan.tile_group.shape[0]
    return tile * w_down.shape[1] * w_down.shape[2] >= LOOP_MIN_TILE_MACS


def _tiles_forward_batched(x, w_gate, w_up, w_down, plan, k, precision):
    """:func:`_tiles_forward` as batched matmuls against ``W[tile_group]`` (small tiles)."""
    num_tiles, inter = plan.tile_group.shape[0], w_down.shape[1]
    w_gu = jnp.concatenate([w_gate, w_up], axis=-1)
    xp = _take_rows(x, plan.slot_pair // k).reshape(num_tiles, -1, x.shape[1])
    gu = jnp.einsum("tmh,thj->tmj", xp, w_gu[plan.tile_group], precision=precision)
    h = _swiglu(gu[..., :inter], gu[..., inter:])
    return jnp.einsum("tmi,tih->tmh", h, w_down[plan.tile_group], precision=precision), gu


def _tiles_backward_batched(dy, x, gu, w_gate, w_up, w_down, plan, k, precision):
    """:func:`_tiles_backward` as batched matmuls; per-tile weight grads summed per expert."""
    w_gu = jnp.concatenate([w_gate, w_up], axis=-1)
    acc = jnp.promote_types(w_gu.dtype, jnp.float32)
    tg, inter = plan.tile_group, w_down.shape[1]
    xp = _take_rows(x, plan.slot_pair // k).reshape(*dy.shape[:2], -1)
    g, u = gu[..., :inter], gu[..., inter:]
    s = jax.nn.sigmoid(g)
    silu = g * s
    dh = jnp.einsum("tmh,tih->tmi", dy, w_down[tg], precision=precision)
    dgu = jnp.concatenate([dh * u * s * (1 + g * (1 - s)), dh * silu], axis=-1)
    dxp = jnp.einsum("tmj,thj->tmh", dgu, w_gu[tg], precision=precision)
    dwd_t = jnp.einsum("tmi,tmh->tih", silu * u, dy, precision=precision, preferred_element_type=acc)
    dwgu_t = jnp.einsum("tmh,tmj->thj", xp, dgu, precision=precision, preferred_element_type=acc)
    dwd = jnp.zeros(w_down.shape, acc).at[tg].add(dwd_t)
    dwgu = jnp.zeros(w_gu.shape, acc).at[tg].add(dwgu_t)
    return dxp.astype(x.dtype), dwgu[..., :inter], dwgu[..., inter:], dwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _tiles(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    plan: _TilePlan,
    k: int,
    precision,
) -> jax.Array:
    """``ys [T * tile, H]``: the SwiGLU expert of each slot's pair (row ``slot_pair // k`` of
    ``x [R, H]``) by its tile's expert (see :func:`_tiles_forward`).

    VJP: the loop of :func:`_tiles_backward`, then ``dx[r] = sum_j dxs[pair_slot[r k + j]]`` (the
    inverse permutation, a gather; XLA's transpose of the row gather would be a scatter-add).
    """
    return _tiles_fwd(x, w_gate, w_up, w_down, plan, k, precision)[0]


def _tiles_fwd(x, w_gate, w_up, w_down, plan, k, precision):
    fwd = _tiles_forward if _loop_over_tiles(plan, w_down) else _tiles_forward_batched
    y, gu = fwd(x, w_gate, w_up, w_down, plan, k, precision)
    return y.reshape(-1, x.shape[1]), (x, gu, w_gate, w_up, w_down, plan)


def _tiles_bwd(k, precision, res, dys):
    x, gu, w_gate, w_up, w_down, plan = res
    dy = dys.reshape(*gu.shape[:2], -1)
    bwd = _tiles_backward if _loop_over_tiles(plan, w_down) else _tiles_backward_batched
    dxp, dwg, dwu, dwd = bwd(dy, x, gu, w_gate, w_up, w_down, plan, k, precision)
    dx = _gather_sum(dxp.reshape(dys.shape), plan.pair_slot.reshape(-1, k))
    grads = (dx, dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype), dwd.astype(w_down.dtype))
    return (*map(_cotangent_like, grads, (x, w_gate, w_up, w_down)), None)


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def _tiled(
    x: jax.Array,
    key: jax.Array,
    k: int,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    tile: int | None,
    precision,
) -> tuple[jax.Array, _TilePlan]:
    """Expert outputs of the pairs in the tile layout ``[T * tile, H]`` and the plan to read them back."""
    num_experts = w_gate.shape[0]
    tile = tile_size(key.shape[0], num_experts) if tile is None else int(tile)
    plan = _tile_plan(key, num_experts, tile)
    return _tiles(x, w_gate, w_up, w_down, plan, k, precision), plan


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
    key = _pair_keys(groups, num_experts)
    if impl == "dense":
        gate = jax.nn.one_hot(key.reshape(rows, k), num_experts, dtype=x.dtype)  # sentinel -> zeros
        g = jnp.einsum("rh,ehi->eri", x, w_gate, precision=precision)
        u = jnp.einsum("rh,ehi->eri", x, w_up, precision=precision)
        y = jnp.einsum("eri,eih->erh", _swiglu(g, u), w_down, precision=precision)
        return jnp.einsum("erh,rke->rkh", y, gate, precision=precision)
    if impl == "ragged":
        order = jnp.argsort(key, stable=True).astype(jnp.int32)  # pairs sorted by expert
        sorted_groups = key[order]
        group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
        ys = _ffn_ragged(jnp.take(x, order // k, axis=0), group_sizes, w_gate, w_up, w_down, precision)
        ys = jnp.where((sorted_groups < num_experts)[:, None], ys, 0)
        out = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
        return out.reshape(rows, k, -1)
    ys, plan = _tiled(x, key, k, w_gate, w_up, w_down, tile=tile, precision=precision)
    return _unpermute(ys, plan).reshape(rows, k, -1)


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
    if _resolve(impl) == "tiled":
        k = experts.shape[1]
        key = _pair_keys(experts, w_gate.shape[0])
        ys, plan = _tiled(x, key, k, w_gate, w_up, w_down, tile=None, precision=precision)
        return _combine(ys, weights, plan, k)  # the gate-weighted sum, without a [N, k, H] buffer
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

    def weights(
        self, dtype: jnp.dtype, precision: jax.lax.PrecisionLike = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(gate, up, down)`` in ``dtype`` as the forward uses them: with a LoRA adapter on the experts,
        ``W_e + (alpha / r) A_e B_e`` per expert (:func:`rljax.models.lora.expert_weights`)."""
        return expert_weights(self, dtype, precision)


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
        w_gate, w_up, w_down = self.experts.weights(self.dtype, self.precision)
        y = moe_ffn(
            x2,
            experts.reshape(-1, self.top_k),
            weights.reshape(-1, self.top_k).astype(self.dtype),
            w_gate,
            w_up,
            w_down,
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
