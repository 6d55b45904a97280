"""Per-token log-probabilities and entropies from hidden states: a chunked LM head with its own VJP.

For a vocabulary of ``V`` = 150k, full ``[tokens, V]`` float32 logits of a 32k-token batch would
take 19 GB. The LM head here projects hidden states ``chunk_size`` rows at a time inside a
``lax.scan`` and never keeps a chunk's logits: the forward keeps one float32 log-normalizer per row,
the backward recomputes each chunk's logits once, turns them into the logits' cotangent and
accumulates the unembedding's gradient chunk by chunk in float32 (one ``[hidden, V]`` accumulator,
never a per-chunk stack). Peak memory is ``O(chunk_size * V)`` forward and backward, the same trick
as Liger's / prime-rl's fused linear cross-entropy (Hsu et al. 2024, "Liger Kernel"), here in plain
XLA ops. The entropy's gradient is computed only when the entropy's cotangent is not a symbolic
zero (an entropy term in the loss); the weights' gradients only for weights being differentiated.

Logits only where they are needed: :func:`sequence_forward` takes ``logit_mask``, the tokens whose
logprob is wanted (the train step passes the loss mask), and gathers the hidden states that predict
them into a fixed ``[groups, logit_capacity]`` buffer (static shapes: :func:`logit_capacity` picks
the buffer's size from a small ladder on the host), so prompt and tool-output tokens never meet the
vocabulary. The buffer is gathered per row group (the rows of one data-parallel shard), so the
gather stays on the device that holds the rows.

Alignment (design §5): entry ``t`` of the output is ``log p(tokens[t] | tokens[<t])`` within its
segment, computed from the hidden state at ``t - 1`` with logits divided by the temperature of
token ``t``. Entry 0 of each row, the first token of each segment, padding (segment 0) and tokens
outside ``logit_mask`` are 0. Prefix-tree rows (design §2.6) name the predecessor of each token
explicitly (``parents``: the column of the token's parent, whose hidden state predicts it, which for
the first token of a branch is not ``t - 1``); :func:`predecessor_columns` covers both layouts, and
the gather reads each wanted token's hidden state from its predecessor's column.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

if TYPE_CHECKING:
    from rljax.models.decoder import Decoder, UnembeddingLoRA
    from rljax.models.moe import Routing
    from rljax.types import PackedBatch

#: Rows (per row group) per chunk of the LM head (bounds the ``[chunk, vocab]`` logits held).
DEFAULT_CHUNK_SIZE = 512
#: The smallest gathered buffer :func:`logit_capacity` chooses.
MIN_LOGIT_CAPACITY = 16

_F32 = jnp.float32


# ------------------------------------------------------------------------------------------------
# The chunked LM head (custom VJP)
# ------------------------------------------------------------------------------------------------


class _HeadSpec(NamedTuple):
    """Static settings of one LM-head call (hashable)."""

    chunk: int  # rows per group per chunk
    num_chunks: int
    precision: Any
    lora_scale: float | None
    with_entropy: bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Residuals:
    """What the backward reads: the inputs, the forward's normalizers, and which inputs are being
    differentiated (static)."""

    hidden: jax.Array
    w: jax.Array
    lora_a: jax.Array | None
    lora_b: jax.Array | None
    targets: jax.Array
    tau: jax.Array
    floor: jax.Array | None
    lse: jax.Array  # float32 [G, C]: each row's log-normalizer (the forward's)
    need_hidden: bool = dataclasses.field(metadata=dict(static=True))
    need_w: bool = dataclasses.field(metadata=dict(static=True))
    need_lora: bool = dataclasses.field(metadata=dict(static=True))


def _dot(x: jax.Array, y: jax.Array, contract: tuple[int, int], precision: Any, out: Any = _F32) -> jax.Array:
    """``lax.dot_general`` of two 2-D arrays contracting ``x``'s axis ``contract[0]`` with ``y``'s
    ``contract[1]`` (mixed input dtypes allowed, accumulated in ``out``)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(x, y, dims, precision=precision, preferred_element_type=out)


def _chunk_logits(spec: _HeadSpec, h: jax.Array, w: jax.Array, a: jax.Array | None, b: jax.Array | None,
                  tau: jax.Array) -> jax.Array:  # fmt: skip
    """float32 ``z = (h W + scale (h A) B) / tau`` of one chunk ``h [n, hidden]``."""
    z = _dot(h, w, (1, 0), spec.precision)
    if a is not None:
        ha = _dot(h.astype(a.dtype), a, (1, 0), spec.precision, a.dtype)
        z = z + _dot(ha, b, (1, 0), spec.precision) * spec.lora_scale
    return z / tau[:, None]


def support_mask(z: chex.Array, floor: chex.Array | None, targets: chex.Array) -> jax.Array | None:
    """bool ``[n, V]``: the entries of each row of ``z [n, V]`` a top-k / top-p sampler kept,
    ``z_v >= floor`` (``floor [n]``; ``-inf`` keeps every entry), with the row's drawn token
    ``targets [n, 1]`` always in it (it was drawn, so it was kept); None without a floor (every
    entry). The one place the LM head decides which logits a distribution covers.

    >>> support_mask(jnp.log(jnp.array([[1., 2., 5.]])), jnp.log(jnp.array([2.])), jnp.array([[0]]))
    Array([[ True,  True,  True]], dtype=bool)
    """
    if floor is None:
        return None
    chex.assert_rank(z, 2)
    chex.assert_shape(floor, (z.shape[0],))
    chex.assert_shape(targets, (z.shape[0], 1))
    return (z >= floor[:, None]) | (jnp.arange(z.shape[-1])[None, :] == targets)


def log_normalizer(
    z: chex.Array, support: chex.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The softmax normalizer of each row of ``z [n, V]`` over the row's ``support`` (bool
    ``[n, V]``, :func:`support_mask`; None: every entry; each row must keep one entry).

    With ``m = max_v z_v`` and ``e_v = exp(z_v - m)`` on the support (0 off it), ``s = sum_v e_v``:
    returns ``(lse, e, s)`` with ``lse = m + log s`` (so ``p = e / s``, ``log p_v = z_v - lse``).
    Both passes of the LM head read this ``lse`` (:func:`support_probabilities`).

    >>> z = jnp.log(jnp.array([[1., 2., 5.]]))
    >>> lse, e, s = log_normalizer(z, jnp.array([[False, True, True]]))
    >>> round(float(jnp.exp(lse[0])), 4), [round(float(x), 2) for x in e[0] / s[0]]
    (7.0, [0.0, 0.29, 0.71])
    """
    chex.assert_rank(z, 2)
    m = jnp.max(z if support is None else jnp.where(support, z, -jnp.inf), axis=-1)
    e = jnp.exp(z - m[:, None])
    if support is not None:
        e = jnp.where(support, e, 0.0)
    s = jnp.sum(e, axis=-1)
    return m + jnp.log(s), e, s


def support_probabilities(z: chex.Array, lse: chex.Array, support: chex.Array | None) -> jax.Array:
    """``p_v = exp(z_v - lse)`` on the ``support``, 0 off it: the probabilities of
    :func:`log_normalizer`'s distribution from its ``lse`` (one exponential, no reduction).

    >>> z = jnp.log(jnp.array([[1., 2., 5.]]))
    >>> support = jnp.array([[False, True, True]])
    >>> [round(float(x), 2) for x in support_probabilities(z, log_normalizer(z, support)[0], support)[0]]
    [0.0, 0.29, 0.71]
    """
    p = jnp.exp(z - lse[:, None])
    return p if support is None else jnp.where(support, p, 0.0)


def _valid_targets(targets: jax.Array, vocab: int) -> jax.Array:
    """``[n, K]`` targets with negative ids moved out of range (an id outside ``[0, V)`` gives NaN,
    never a wrap-around or a clamp)."""
    return jnp.where(targets < 0, vocab, targets)


def _forward_chunk(spec: _HeadSpec, w: jax.Array, a: jax.Array | None, b: jax.Array | None,
                   h: jax.Array, targets: jax.Array, tau: jax.Array,
                   floor: jax.Array | None) -> tuple[jax.Array, ...]:  # fmt: skip
    """``(logp [n, K], entropy [n] or None, lse [n])`` of one chunk."""
    z = _chunk_logits(spec, h, w, a, b, tau)
    tgt = _valid_targets(targets, z.shape[-1])
    lse, e, s = log_normalizer(z, support_mask(z, floor, tgt))
    logp = jnp.take_along_axis(z, tgt, axis=-1, mode="fill", fill_value=jnp.nan) - lse[:, None]
    entropy = None
    if spec.with_entropy:  # -sum p log p = log s - E_p[z - m], with m = lse - log s
        y = jnp.where(e > 0, z - (lse - jnp.log(s))[:, None], 0.0)
        entropy = jnp.log(s) - jnp.sum(e * y, axis=-1) / s
    return logp, entropy, lse


def _to_chunks(x: jax.Array, spec: _HeadSpec, fill: Any = 0) -> jax.Array:
    """``[G, C, ...]`` -> ``[num_chunks, G * chunk, ...]`` (rows padded with ``fill``)."""
    (g, c), rest = x.shape[:2], x.shape[2:]
    pad = ((0, 0), (0, spec.num_chunks * spec.chunk - c)) + ((0, 0),) * len(rest)
    x = jnp.pad(x, pad, constant_values=fill).reshape(g, spec.num_chunks, spec.chunk, *rest)
    return jnp.moveaxis(x, 1, 0).reshape(spec.num_chunks, g * spec.chunk, *rest)


def _from_chunks(x: jax.Array, groups: int, rows: int) -> jax.Array:
    """Inverse of :func:`_to_chunks`: ``[num_chunks, G * chunk, ...]`` -> ``[G, rows, ...]``."""
    (num_chunks, n), rest = x.shape[:2], x.shape[2:]
    x = jnp.moveaxis(x.reshape(num_chunks, groups, n // groups, *rest), 0, 1)
    return x.reshape(groups, num_chunks * (n // groups), *rest)[:, :rows]


def _forward_chunks(spec: _HeadSpec, hidden: jax.Array, w: jax.Array, a: jax.Array | None,
                    b: jax.Array | None, targets: jax.Array, tau: jax.Array,
                    floor: jax.Array | None) -> tuple[jax.Array | None, ...]:  # fmt: skip
    """``(logp, entropy, lse)`` of every row (``[G, C, ...]``)."""
    groups, rows = hidden.shape[:2]
    xs = (
        _to_chunks(hidden, spec),
        _to_chunks(targets, spec),
        _to_chunks(tau, spec, 1.0),
        None if floor is None else _to_chunks(floor, spec, -jnp.inf),
    )
    out = jax.lax.map(lambda x: _forward_chunk(spec, w, a, b, *x), xs)
    return tuple(None if x is None else _from_chunks(x, groups, rows) for x in out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lm_head(spec: _HeadSpec, hidden: jax.Array, w: jax.Array, a: jax.Array | None, b: jax.Array | None,
             targets: jax.Array, tau: jax.Array,
             floor: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """``(logp [G, C, K], entropy [G, C] or None)`` of the rows of ``hidden [G, C, hidden]``."""
    return _forward_chunks(spec, hidden, w, a, b, targets, tau, floor)[:2]


def _lm_head_fwd(spec: _HeadSpec, *args: Any) -> tuple[tuple[jax.Array, jax.Array | None], _Residuals]:
    hidden, w, a, b, targets, tau, floor = args  # CustomVJPPrimal (value, perturbed) leaves, or None
    value = lambda x: None if x is None else x.value  # noqa: E731
    values = [value(x) for x in args]
    logp, entropy, lse = _forward_chunks(spec, *values)
    residuals = _Residuals(
        *values,
        lse=lse,
        need_hidden=hidden.perturbed,
        need_w=w.perturbed,
        need_lora=a is not None and (a.perturbed or b.perturbed),
    )
    return (logp, entropy), residuals


def _is_zero(ct: Any) -> bool:
    return ct is None or isinstance(ct, SymbolicZero)


def _backward_chunk(spec: _HeadSpec, res: _Residuals, carry: tuple[Any, Any, Any],
                    x: tuple[Any, ...]) -> tuple[tuple[Any, Any, Any], jax.Array | None]:  # fmt: skip
    """One chunk of the backward: the cotangent ``dz`` of the raw logits ``h W (+ adapter)``, then
    ``dh = dz W^T`` (+ the adapter's share) and the weights' gradients added into
    ``carry = (dW, dA, dB)`` (float32)."""
    h, targets, tau, floor, lse, g_logp, g_ent = x
    w, a, b = res.w, res.lora_a, res.lora_b
    dw, da, db = carry
    z = _chunk_logits(spec, h, w, a, b, tau)
    tgt = _valid_targets(targets, z.shape[-1])
    p = support_probabilities(z, lse, support_mask(z, floor, tgt))
    inv_tau = 1.0 / tau[:, None]  # z = raw / tau
    dz = None
    if g_logp is not None:  # d logp_k / dz = onehot(target_k) - p
        g = g_logp * inv_tau
        rows = jnp.arange(z.shape[0])[:, None]
        dz = (-jnp.sum(g, axis=-1, keepdims=True) * p).at[rows, tgt].add(g, mode="drop")
    if g_ent is not None:  # d entropy / dz = -p (log p - E_p[log p])
        logq = z - lse[:, None]
        d_ent = (g_ent[:, None] * inv_tau) * p * (jnp.sum(p * logq, axis=-1, keepdims=True) - logq)
        dz = d_ent if dz is None else dz + d_ent
    dh = _dot(dz, w, (1, 1), spec.precision) if res.need_hidden else None
    if res.need_w:
        dw = dw + _dot(h, dz, (0, 0), spec.precision)
    if a is not None and (res.need_hidden or res.need_lora):
        ha = _dot(h.astype(a.dtype), a, (1, 0), spec.precision, a.dtype)
        dha = (_dot(dz, b, (1, 1), spec.precision) * spec.lora_scale).astype(a.dtype)
        if res.need_lora:
            db = db + _dot(ha, dz, (0, 0), spec.precision) * spec.lora_scale
            da = da + _dot(h.astype(a.dtype), dha, (0, 0), spec.precision)
        if res.need_hidden:
            dh = dh + _dot(dha, a, (1, 1), spec.precision, a.dtype)
    return (dw, da, db), None if dh is None else dh.astype(h.dtype)


def _lm_head_bwd(spec: _HeadSpec, res: _Residuals, cts: tuple[Any, Any]) -> tuple[Any, ...]:
    g_logp, g_ent = (None if _is_zero(ct) else ct for ct in cts)
    none = (None,) * 7
    if (g_logp is None and g_ent is None) or not (res.need_hidden or res.need_w or res.need_lora):
        return none
    hidden, a, b = res.hidden, res.lora_a, res.lora_b
    groups, rows = hidden.shape[:2]
    chunks = lambda x, fill=0: None if x is None else _to_chunks(x, spec, fill)  # noqa: E731
    xs = (
        chunks(hidden),
        chunks(res.targets),
        chunks(res.tau, 1.0),
        chunks(res.floor, -jnp.inf),
        chunks(res.lse),
        chunks(None if g_logp is None else g_logp.astype(_F32)),
        chunks(None if g_ent is None else g_ent.astype(_F32)),
    )
    zeros = lambda x, on: jnp.zeros(x.shape, _F32) if on else None  # noqa: E731
    lora = a is not None and res.need_lora
    carry = (zeros(res.w, res.need_w), zeros(a, lora) if a is not None else None,
             zeros(b, lora) if b is not None else None)  # fmt: skip
    (dw, da, db), dh = jax.lax.scan(functools.partial(_backward_chunk, spec, res), carry, xs)
    cast = lambda g, like: None if g is None else g.astype(like.dtype)  # noqa: E731
    dh = None if dh is None else _from_chunks(dh, groups, rows)
    return dh, cast(dw, res.w), cast(da, a), cast(db, b), None, None, None


_lm_head.defvjp(_lm_head_fwd, _lm_head_bwd, symbolic_zeros=True)


def _head_spec(rows: int, chunk_size: int, precision: Any, lora: UnembeddingLoRA | None,
               with_entropy: bool) -> _HeadSpec:  # fmt: skip
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    num_chunks = max(-(-rows // chunk_size), 1)
    scale = None if lora is None else float(lora.scale)
    return _HeadSpec(max(-(-rows // num_chunks), 1), num_chunks, precision, scale, with_entropy)


def lm_head_logprobs(
    hidden: chex.Array,
    unembedding: chex.Array,
    targets: chex.Array,
    temperature: chex.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: jax.lax.PrecisionLike = None,
    unembedding_lora: UnembeddingLoRA | None = None,
    with_entropy: bool = True,
    support_floor: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probabilities of ``targets`` (and entropies) of ``G`` row groups through the chunked LM head.

    With ``z = h W / tau`` (float32; ``z = (h W + (alpha / r) (h A) B) / tau`` with an unembedding
    adapter, :meth:`rljax.models.Decoder.unembedding_lora`) and ``lse`` the log-normalizer over the
    row's support (:func:`log_normalizer`): ``logp = z[target] - lse`` and
    ``entropy = -sum_v p_v log p_v`` with ``p = exp(z - lse)`` on the support. Computed ``chunk_size``
    rows of every group at a time; the gradient is this module's custom VJP (module docstring).

    Args:
      hidden: ``[G, C, H]`` hidden states (any float dtype), ``G`` row groups of ``C`` rows.
      unembedding: ``[H, V]`` output projection.
      targets: ``int [G, C]`` the token whose log-probability is wanted in each row, or
        ``int [G, C, K]``: K tokens per row (one softmax per row, K of its entries gathered).
      temperature: ``float [G, C]`` positive temperature of each row.
      chunk_size: rows of each group per chunk (static); the chunks are made equal.
      precision: matmul precision.
      unembedding_lora: the output projection's LoRA adapter (None: none).
      with_entropy: compute the entropies (static; False returns None).
      support_floor: ``float [G, C]`` or None: each row's softmax, logprob and entropy are those of
        the distribution renormalised over the logits ``z_v >= floor`` and the target (the top-k /
        top-p support a sampler drew the target from, :func:`support_mask`; ``-inf`` keeps every
        token). One target per row.

    Returns:
      ``(logp, entropy)``: float32 ``[G, C]`` (``[G, C, K]``) and ``[G, C]`` (or None).

    >>> h = jnp.eye(2)[None]; w = jnp.log(jnp.array([[1., 3.], [1., 1.]]))
    >>> lp, ent = lm_head_logprobs(h, w, jnp.array([[1, 0]]), jnp.ones((1, 2)), chunk_size=1)
    >>> [round(float(x), 4) for x in jnp.exp(lp[0])], [round(float(x), 4) for x in ent[0]]
    ([0.75, 0.5], [0.5623, 0.6931])
    """
    chex.assert_rank([hidden, unembedding, temperature], [3, 2, 2])
    chex.assert_rank(targets, {2, 3})
    chex.assert_equal(hidden.shape[2], unembedding.shape[0])
    chex.assert_equal(hidden.shape[:2], targets.shape[:2])
    chex.assert_equal(hidden.shape[:2], temperature.shape)
    multi = targets.ndim == 3
    groups, rows = hidden.shape[:2]
    spec = _head_spec(rows, chunk_size, precision, unembedding_lora, with_entropy)
    if rows == 0:
        return jnp.zeros(targets.shape, _F32), (jnp.zeros((groups, 0), _F32) if with_entropy else None)
    tgt = targets.astype(jnp.int32)
    tgt = tgt if multi else tgt[..., None]
    floor = None if support_floor is None else jnp.asarray(support_floor, _F32)
    if floor is not None:
        chex.assert_equal_shape([floor, temperature])
        if tgt.shape[-1] != 1:
            raise ValueError(f"support_floor applies to one target per row, got {tgt.shape[-1]} per row")
    lora = unembedding_lora
    logp, entropy = _lm_head(
        spec, hidden, unembedding, None if lora is None else lora.a, None if lora is None else lora.b,
        tgt, temperature.astype(_F32), floor,
    )  # fmt: skip
    return (logp if multi else logp[..., 0]), entropy


def token_logprobs_and_entropy(
    hidden: chex.Array,
    unembedding: chex.Array,
    targets: chex.Array,
    temperature: chex.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: jax.lax.PrecisionLike = None,
    unembedding_lora: UnembeddingLoRA | None = None,
    support_floor: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probability of ``targets`` and entropy under ``softmax(hidden @ unembedding / temperature)``.

    :func:`lm_head_logprobs` of one row group: ``hidden [N, H]``, ``targets int [N]`` (or
    ``[N, K]``), ``temperature float [N]``, ``support_floor float [N]`` or None (each row's top-k /
    top-p support floor, ``Step.response_support_floors``: the distribution renormalised over the
    logits at or above it and the target; single targets only); returns float32
    ``(logp [N] (or [N, K]), entropy [N])``.

    >>> h = jnp.eye(2); w = jnp.log(jnp.array([[1., 3.], [1., 1.]]))
    >>> lp, ent = token_logprobs_and_entropy(h, w, jnp.array([1, 0]), jnp.ones(2), chunk_size=1)
    >>> [round(float(x), 4) for x in jnp.exp(lp)], [round(float(x), 4) for x in ent]
    ([0.75, 0.5], [0.5623, 0.6931])
    """
    chex.assert_rank([hidden, unembedding, temperature], [2, 2, 1])
    chex.assert_rank(targets, {1, 2})
    chex.assert_equal(hidden.shape[0], targets.shape[0])
    chex.assert_equal(hidden.shape[0], temperature.shape[0])
    logp, entropy = lm_head_logprobs(
        hidden[None], unembedding, targets[None], temperature[None], chunk_size=chunk_size,
        precision=precision, unembedding_lora=unembedding_lora,
        support_floor=None if support_floor is None else jnp.asarray(support_floor)[None],
    )  # fmt: skip
    return logp[0], entropy[0]


# ------------------------------------------------------------------------------------------------
# Which tokens meet the vocabulary
# ------------------------------------------------------------------------------------------------


def shifted_token_mask(segment_ids: chex.Array) -> chex.Array:
    """``mask[b, t] = t > 0 and seg[b, t] == seg[b, t-1] != 0``: tokens that have an in-segment predecessor.

    >>> shifted_token_mask(jnp.array([[1, 1, 2, 2, 0]])).astype(int).tolist()
    [[0, 1, 0, 1, 0]]
    """
    chex.assert_rank(segment_ids, 2)
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return jnp.concatenate([jnp.zeros_like(same[:, :1]), same], axis=1)


def predecessor_columns(segment_ids: chex.Array, parents: chex.Array | None = None) -> jax.Array:
    """int32 ``[B, L]``: the column whose hidden state predicts each token, -1 where none does.

    Plain packed rows (``parents`` None): ``t - 1`` when token ``t`` has an in-segment predecessor
    (:func:`shifted_token_mask`), else -1. Prefix-tree rows (design §2.6): ``parents`` itself (the
    column of each token's parent; -1 at a tree's root), -1 on padding (``segment_ids == 0``).

    >>> predecessor_columns(jnp.array([[1, 1, 2, 2, 0]])).tolist()
    [[-1, 0, -1, 2, -1]]
    >>> predecessor_columns(jnp.array([[1, 1, 2, 0]]), jnp.array([[-1, 0, 0, -1]])).tolist()
    [[-1, 0, 0, -1]]
    """
    chex.assert_rank(segment_ids, 2)
    segment_ids = jnp.asarray(segment_ids)
    if parents is not None:
        parents = jnp.asarray(parents).astype(jnp.int32)
        chex.assert_equal_shape([segment_ids, parents])
        return jnp.where(segment_ids != 0, parents, -1)
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    return jnp.where(shifted_token_mask(segment_ids), t - 1, -1)


def packing_kwargs(batch: PackedBatch) -> dict[str, jax.Array | None]:
    """The packing arguments of a forward over a :class:`rljax.types.PackedBatch`:
    ``positions``, ``segment_ids`` and, for prefix-tree rows, ``parents`` and ``subtree_end`` (None
    for plain rows), as :func:`sequence_forward` and :func:`rljax.models.value.values` take them.
    Every forward of a packed batch passes all four, so a tree batch is computed as a tree.
    """
    return dict(
        positions=batch.positions,
        segment_ids=batch.segment_ids,
        parents=getattr(batch, "parents", None),
        subtree_end=getattr(batch, "subtree_end", None),
    )


def capacity_ladder(total: int, *, min_capacity: int = MIN_LOGIT_CAPACITY) -> list[int]:
    """The buffer sizes :func:`logit_capacity` chooses from for row groups of ``total`` tokens:
    ``2^k`` and ``3 * 2^(k-1)`` from ``min_capacity`` up (two per octave, so a buffer is at most 1.5x
    what it holds and a run compiles few shapes), and ``total`` itself.

    >>> capacity_ladder(300)
    [16, 24, 32, 48, 64, 96, 128, 192, 256, 300]
    """
    sizes, k = [], 1
    while k < total:
        sizes += [x for x in (k, 3 * k // 2) if min_capacity <= x < total and x not in sizes]
        k *= 2
    return [*sizes, int(total)]


def logit_capacity(logit_mask: Any, *, row_groups: int = 1, min_capacity: int = MIN_LOGIT_CAPACITY) -> int:
    """Host: the gathered buffer's size for ``logit_mask`` (numpy ``[..., B, L]``, nonzero = wanted).

    The rows of each ``[B, L]`` batch form ``row_groups`` groups of ``B / row_groups`` consecutive
    rows (the data-parallel shards); the result is the smallest size of :func:`capacity_ladder` that
    holds the wanted tokens of every group of every batch, so it is exact (nothing is dropped) and
    takes few values over a run. Pass it as ``logit_capacity`` to :func:`sequence_forward`.

    >>> mask = np.zeros((4, 64), bool); mask[0, 10:50] = True
    >>> logit_capacity(mask), logit_capacity(mask, row_groups=2), logit_capacity(mask[:, :8])
    (48, 48, 16)
    """
    mask = np.asarray(logit_mask) != 0
    if mask.ndim < 2:
        raise ValueError(f"logit_mask must be [..., B, L], got shape {mask.shape}")
    rows, length = mask.shape[-2:]
    if not (isinstance(row_groups, int) and row_groups >= 1 and rows % row_groups == 0):
        raise ValueError(f"row_groups={row_groups!r} must be a positive int dividing the {rows} rows")
    per_group = mask.reshape(-1, row_groups, rows // row_groups * length).sum(axis=-1)
    need = int(per_group.max()) if per_group.size else 0
    return next(
        c for c in capacity_ladder(rows // row_groups * length, min_capacity=min_capacity) if c >= need
    )


def _gather_plan(want: jax.Array, row_groups: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each wanted token goes in the ``[G, capacity]`` buffer.

    Returns ``(slots [G, capacity]``: the flat index in its group of the token each slot holds, or
    ``-1`` for an empty slot; ``slot [B, L]``: each token's slot (``capacity`` when it has none);
    ``overflow [B, L]``: wanted tokens beyond the capacity)."""
    batch, length = want.shape
    flat = want.reshape(row_groups, batch // row_groups * length)
    rank = jnp.cumsum(flat, axis=1, dtype=jnp.int32) - 1
    kept = flat & (rank < capacity)
    index = jnp.broadcast_to(jnp.arange(flat.shape[1], dtype=jnp.int32), flat.shape)
    slots = jnp.full((row_groups, capacity), -1, jnp.int32)
    groups = jnp.arange(row_groups)[:, None]
    slots = slots.at[groups, jnp.where(kept, rank, capacity)].set(index, mode="drop")
    slot = jnp.where(kept, rank, capacity).reshape(batch, length)
    return slots, slot, (flat & ~kept).reshape(batch, length)


class ForwardOutput(NamedTuple):
    """What one forward pass of :func:`sequence_forward` returns (a pytree; unwanted parts are None).

    Attributes:
      logprobs: float32 ``[B, L]``, ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, <t])`` within
        the segment, at the temperature of token ``t`` (0 at ``t = 0``, segment starts, padding and
        outside ``logit_mask``).
      entropy: float32 ``[B, L]`` entropy of that same distribution (same zeros), or None when
        not asked for (``with_entropy=False``).
      routing: the MoE router statistics of the forward (:class:`rljax.models.moe.Routing`:
        ``logits [B, L, M, E]``, ``experts [B, L, M, k]``, i.e. ``routed_experts`` when replaying),
        or None when not asked for (``with_routing=False``) or for a dense model.
    """

    logprobs: jax.Array
    entropy: jax.Array | None = None
    routing: Routing | None = None


def _check_groups(batch: int, row_groups: int) -> None:
    if not (isinstance(row_groups, int) and row_groups >= 1 and batch % row_groups == 0):
        raise ValueError(
            f"row_groups={row_groups!r} must be a positive int dividing the batch's {batch} rows"
        )


@functools.partial(
    jax.jit, static_argnames=("chunk_size", "with_entropy", "with_routing", "logit_capacity", "row_groups")
)
def sequence_forward(
    model: Decoder,
    tokens: chex.Array,
    *,
    positions: chex.Array | None = None,
    segment_ids: chex.Array | None = None,
    temperature: float | chex.Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    routed_experts: chex.Array | None = None,
    with_entropy: bool = True,
    with_routing: bool = False,
    logit_mask: chex.Array | None = None,
    logit_capacity: int | None = None,
    row_groups: int = 1,
    support_floors: chex.Array | None = None,
    parents: chex.Array | None = None,
    subtree_end: chex.Array | None = None,
) -> ForwardOutput:
    """Per-token logprobs (and entropies, MoE routing) of a packed batch from ONE forward pass (jitted).

    ``logp[b, t] = log softmax(logits(h[b, c]) / tau[b, t])[tokens[b, t]]`` with ``c`` the column
    that predicts token ``t`` (:func:`predecessor_columns`: ``t - 1`` in plain rows, the parent in
    prefix-tree rows) and ``entropy[b, t]`` the entropy ``-sum_v p_v log p_v`` of that same
    temperature-scaled distribution; both are 0 where no column predicts the token (``t = 0``, the
    first token of every segment, a tree's root, padding ``segment_ids == 0``) and outside
    ``logit_mask``. Logits are computed ``chunk_size`` rows at a time by the chunked LM head
    (:func:`lm_head_logprobs`).

    Logits only where they are needed: with ``logit_mask``, only the hidden states that predict its
    tokens meet the vocabulary. They are gathered, per group of ``B / row_groups`` consecutive rows,
    into a ``[row_groups, logit_capacity]`` buffer (static; :func:`logit_capacity` chooses it on the
    host from the mask) and the results scattered back. A group with more wanted tokens than the
    capacity gets NaN at the ones that did not fit (never a silent drop); ``logit_capacity`` None
    holds every token of a group (nothing saved).

    The flags are static: what is not asked for is None and is not computed, so ``with_routing=False``
    compiles the program of a plain forward.

    Args:
      model: a :class:`rljax.models.Decoder`.
      tokens: ``int32 [B, L]`` (packed rows allowed).
      positions: ``int32 [B, L]``; default restarts at 0 in every segment.
      segment_ids: ``int32 [B, L]``, 0 = padding; default all ones.
      temperature: scalar or ``float [B, L]`` (the temperature each token was sampled with).
      chunk_size: rows (per row group) per logits chunk (memory ``O(chunk_size * vocab)``).
      routed_experts: MoE router replay, ``int32 [B, L, num_moe_layers, top_k]`` (see
        :meth:`rljax.models.Decoder.hidden_states`).
      with_entropy: also return the entropies.
      with_routing: also return the MoE routing (feed it to
        :func:`rljax.models.moe.load_balancing_loss`, :func:`rljax.models.moe.router_z_loss`,
        :func:`rljax.models.moe.routing_metrics`, :func:`rljax.models.moe.flip_fraction`; mask
        with ``segment_ids != 0``). None for a dense model.
      logit_mask: ``[B, L]`` nonzero where the logprob is wanted (the train step: the loss mask),
        or None: every token.
      logit_capacity: slots per row group of the gathered buffer (static; with ``logit_mask``).
      row_groups: row groups gathered separately (static; the data-parallel shards of the rows,
        so each gathers its own rows), dividing ``B``.
      support_floors: ``float [B, L]`` or None: token ``t``'s top-k / top-p support floor
        (``PackedBatch.support_floors``; ``-inf``: the whole distribution): its logprob and entropy
        are renormalised over the support the sampler drew it from (:func:`support_mask`).
      parents, subtree_end: prefix-tree rows (design §2.6), ``int32 [B, L]`` both or neither: the
        column of each token's parent (-1 at a root) and of the last token of its subtree. Token
        ``t`` attends to its ancestors and ``logp[b, t]`` comes from the hidden state at
        ``parents[b, t]``; ``positions`` must be the depths.

    Returns:
      a :class:`ForwardOutput` ``(logprobs, entropy, routing)``.

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> out = sequence_forward(model, jnp.array([[3, 4, 5, 6]]), segment_ids=jnp.array([[1, 1, 2, 2]]))
    >>> (out.logprobs[0] < 0).astype(int).tolist(), (out.entropy[0] > 0).astype(int).tolist(), out.routing
    ([0, 1, 0, 1], [0, 1, 0, 1], None)
    >>> only = sequence_forward(model, jnp.array([[3, 4, 5, 6]]), logit_mask=jnp.array([[0, 0, 1, 1]]),
    ...                         logit_capacity=2)
    >>> (only.logprobs[0] < 0).astype(int).tolist()
    [0, 0, 1, 1]
    """
    chex.assert_rank(tokens, 2)
    batch, length = tokens.shape
    _check_groups(batch, row_groups)
    if (parents is None) != (subtree_end is None):
        raise ValueError("prefix-tree rows need both parents and subtree_end (or neither, for plain rows)")
    if segment_ids is None:
        segment_ids = jnp.ones_like(tokens, dtype=jnp.int32)
    segment_ids = jnp.asarray(segment_ids)
    temperature = jnp.asarray(temperature, _F32)
    if temperature.ndim == 0:
        temperature = jnp.broadcast_to(temperature, tokens.shape)
    elif temperature.shape != tokens.shape:
        raise ValueError(
            f"temperature must be a scalar or shaped like tokens {tokens.shape}, got {temperature.shape}"
        )
    forward = model.hidden_states(
        tokens,
        positions=positions,
        segment_ids=segment_ids,
        routed_experts=routed_experts,
        with_routing=with_routing,
        subtree_end=subtree_end,
    )
    hidden, routing = forward.hidden, forward.routing
    if length < 2:
        zeros = jnp.zeros(tokens.shape, _F32)
        return ForwardOutput(zeros, zeros if with_entropy else None, routing)
    head = functools.partial(
        lm_head_logprobs,
        unembedding=model.unembedding(),
        chunk_size=chunk_size,
        precision=model.precision,
        unembedding_lora=model.unembedding_lora(),
        with_entropy=with_entropy,
    )
    cols = predecessor_columns(segment_ids, parents)
    valid = cols >= 0
    floor = None if support_floors is None else jnp.asarray(support_floors, _F32)
    if logit_mask is None and parents is None:
        logp, entropy = _every_token(head, hidden, tokens, temperature, floor, row_groups)
    else:  # tree rows read each token's predictor through its column, like wanted tokens
        want = valid if logit_mask is None else valid & (jnp.asarray(logit_mask) != 0)
        everything = logit_mask is None or logit_capacity is None
        capacity = batch // row_groups * length if everything else logit_capacity
        logp, entropy = _wanted_tokens(head, hidden, tokens, temperature, floor, want, cols, row_groups,
                                       capacity)  # fmt: skip
    keep = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    return ForwardOutput(keep(logp), None if entropy is None else keep(entropy), routing)


def _every_token(head: Any, hidden: jax.Array, tokens: jax.Array, temperature: jax.Array,
                 floor: jax.Array | None, row_groups: int) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """The head on every position: rows ``[:, :-1]`` predict tokens ``[:, 1:]``; ``[B, L]`` out."""
    batch, length = tokens.shape
    groups = lambda x: x[:, 1:].reshape(row_groups, batch // row_groups * (length - 1))  # noqa: E731
    h = hidden[:, :-1].reshape(row_groups, -1, hidden.shape[-1])
    logp, entropy = head(h, targets=groups(tokens), temperature=groups(temperature),
                         support_floor=None if floor is None else groups(floor))  # fmt: skip
    pad = jnp.zeros((batch, 1), _F32)
    unshift = lambda x: jnp.concatenate([pad, x.reshape(batch, length - 1)], axis=1)  # noqa: E731
    return unshift(logp), None if entropy is None else unshift(entropy)


def _wanted_tokens(head: Any, hidden: jax.Array, tokens: jax.Array, temperature: jax.Array,
                   floor: jax.Array | None, want: jax.Array, cols: jax.Array, row_groups: int,
                   capacity: int) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """The head on the wanted tokens only (gathered per row group, scattered back; each token's
    hidden state from its predecessor column ``cols``); ``[B, L]`` out, NaN at wanted tokens beyond
    the capacity."""
    batch, length = tokens.shape
    slots, slot, overflow = _gather_plan(want, row_groups, capacity)
    used = slots >= 0
    src = jnp.maximum(slots, 0)  # the token a slot predicts (flat index in its group)
    # how many columns back each token's predictor sits in its row (1 in plain rows)
    back_by = jnp.arange(length, dtype=jnp.int32)[None, :] - jnp.maximum(cols, 0)

    def take(x: jax.Array, idx: jax.Array, fill: Any) -> jax.Array:
        flat = x.reshape(row_groups, batch // row_groups * length, *x.shape[2:])
        idx = idx.reshape(*idx.shape, *(1,) * (x.ndim - 2))
        got = jnp.take_along_axis(flat, idx, axis=1)
        return jnp.where(used.reshape(idx.shape), got, fill)

    h = take(hidden, src - take(back_by, src, 0), 0)
    logp, entropy = head(h, targets=take(tokens, src, 0), temperature=take(temperature, src, 1.0),
                         support_floor=None if floor is None else take(floor, src, -jnp.inf))  # fmt: skip

    def back(x: jax.Array) -> jax.Array:  # [G, capacity] -> [B, L]
        padded = jnp.concatenate([x, jnp.zeros((row_groups, 1), x.dtype)], axis=1)
        out = jnp.take_along_axis(padded, slot.reshape(row_groups, -1), axis=1).reshape(batch, length)
        return jnp.where(overflow, jnp.nan, out)

    return back(logp), None if entropy is None else back(entropy)


def sequence_logprobs(
    model: Decoder,
    tokens: chex.Array,
    *,
    positions: chex.Array | None = None,
    segment_ids: chex.Array | None = None,
    temperature: float | chex.Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    routed_experts: chex.Array | None = None,
    logit_mask: chex.Array | None = None,
    logit_capacity: int | None = None,
    parents: chex.Array | None = None,
    subtree_end: chex.Array | None = None,
) -> jax.Array:
    """float32 ``[B, L]``: entry t = ``log p(tokens[t] | tokens[<t])`` within its segment (design §5).

    Same arguments as :func:`sequence_forward` (entry 0, segment starts, padding and tokens outside
    ``logit_mask`` are 0; logits divided by the temperature of the token being predicted;
    prefix-tree rows with ``parents`` and ``subtree_end``).

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="qwen2", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4, qkv_bias=True)
    >>> lp = sequence_logprobs(Decoder(cfg, rngs=nnx.Rngs(0)), jnp.array([[1, 2, 3]]), temperature=0.7)
    >>> lp.shape, lp.dtype, float(lp[0, 0])
    ((1, 3), dtype('float32'), 0.0)
    """
    return sequence_forward(
        model,
        tokens,
        positions=positions,
        segment_ids=segment_ids,
        temperature=temperature,
        chunk_size=chunk_size,
        routed_experts=routed_experts,
        with_entropy=False,
        logit_mask=logit_mask,
        logit_capacity=logit_capacity,
        parents=parents,
        subtree_end=subtree_end,
    ).logprobs
