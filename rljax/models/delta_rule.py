"""Pure math of the Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5 linear-attention layers).

The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", eq. 10) keeps a matrix state ``S [Dk, Dv]`` per head and, for every token ``t`` with
key ``k_t`` and query ``q_t`` (L2-normalized; the query also scaled by ``1 / sqrt(Dk)``), value
``v_t``, log decay ``g_t <= 0`` and write strength ``beta_t`` in (0, 1)::

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T      a_t = exp(g_t)
        = (I - beta_t k_t k_t^T) a_t S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

:func:`gated_delta_rule_recurrent` runs it token by token (the decoding form; one token is
:func:`gated_delta_rule_step`); :func:`gated_delta_rule_chunked` computes the same outputs in chunks
of ``C`` tokens, a scan over chunks whose intra-chunk part is matmuls (the WY / UT representation of
a product of Householder-like updates: Yang et al. 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length", sec. 3, with the decay of the gated paper, sec. 3.3). Within a
chunk starting from state ``S_0``, with ``Gamma_t = prod_{m<=t} a_m`` and the strictly lower
triangular ``A[t, j] = beta_t (k_t . k_j) Gamma_t / Gamma_j``::

    (I + A) Delta = V_beta - (K_beta * Gamma) S_0     (row t of Delta: beta_t (v_t - (a_t S_{t-1})^T k_t))
    O = (Q * Gamma) S_0 + (Q K^T * Gamma_t / Gamma_j)_{j <= t} Delta
    S_C = Gamma_C S_0 + sum_j (Gamma_C / Gamma_j) k_j Delta_j^T

Packed rows (design §2.6). ``resets [B, T]`` marks the tokens whose state starts from zero (the first
token of every sample): a reset at ``m`` is ``a_m = 0``, so every ``Gamma_t / Gamma_j`` across it is 0
and the chunked form masks those entries instead of taking exponentials of huge differences. A token
whose ``beta`` and ``g`` are 0 leaves the state unchanged (the model gives padding those values).

:func:`causal_conv1d` is the causal depthwise convolution before the mixer, its window cut at the same
sample boundaries; :func:`sample_resets` derives the reset flags from segment ids.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> q, k = (jnp.asarray(l2_normalize(rng.normal(size=(1, 10, 2, 4)))) for _ in range(2))
>>> v = jnp.asarray(rng.normal(size=(1, 10, 2, 3)))
>>> g, beta = -jnp.abs(jnp.asarray(rng.normal(size=(1, 10, 2)))), jnp.full((1, 10, 2), 0.5)
>>> resets = jnp.zeros((1, 10), bool).at[:, 0].set(True)
>>> o1, s1 = gated_delta_rule_chunked(q, k, v, g, beta, resets, chunk_size=4)
>>> o2, s2 = gated_delta_rule_recurrent(q, k, v, g, beta, resets)
>>> bool(jnp.allclose(o1, o2, atol=1e-5)), bool(jnp.allclose(s1, s2, atol=1e-5)), o1.shape, s1.shape
(True, True, (1, 10, 2, 3), (1, 2, 4, 3))
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

__all__ = [
    "DEFAULT_DELTA_CHUNK_SIZE",
    "causal_conv1d",
    "conv_window",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_step",
    "l2_normalize",
    "last_valid_segment",
    "sample_resets",
    "unit_lower_inverse",
]

#: Tokens per chunk of :func:`gated_delta_rule_chunked` (the FLA kernels' and transformers' size).
DEFAULT_DELTA_CHUNK_SIZE = 64


def l2_normalize(x: chex.Array, eps: float = 1e-6) -> chex.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (the FLA / transformers convention: ``eps``
    inside the root).

    >>> l2_normalize(jnp.array([3.0, 4.0]), eps=0.0).tolist()
    [0.6000000238418579, 0.800000011920929]
    """
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _previous_valid_segment(segment_ids: chex.Array, prev_segment: chex.Array) -> jax.Array:
    """``out[b, t]``: segment id of the last valid (non-zero) token before ``t`` in row ``b``, or
    ``prev_segment[b]`` when there is none."""
    length = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
    last = jax.lax.cummax(jnp.where(segment_ids != 0, idx, -1), axis=1)  # last valid index <= t
    before = jnp.concatenate([jnp.full_like(last[:, :1], -1), last[:, :-1]], axis=1)
    seg_before = jnp.take_along_axis(segment_ids, jnp.maximum(before, 0), axis=1)
    return jnp.where(before >= 0, seg_before, prev_segment[:, None].astype(segment_ids.dtype))


def sample_resets(segment_ids: chex.Array, prev_segment: chex.Array | None = None) -> jax.Array:
    """``bool [B, T]``: the valid tokens (segment id != 0) whose segment differs from that of the last
    valid token before them (``prev_segment [B]`` for the first; default -1, nothing before): the first
    token of every sample, where the recurrent state restarts from zero. Padding never resets and,
    with ``beta = g = 0``, never writes, so a sample's state runs through padding unchanged.

    >>> sample_resets(jnp.array([[0, 0, 1, 1, 2, 2, 0]])).astype(int).tolist()
    [[0, 0, 1, 0, 1, 0, 0]]
    >>> sample_resets(jnp.array([[1, 1], [2, 2]]), prev_segment=jnp.array([1, 1])).astype(int).tolist()
    [[0, 0], [1, 0]]
    """
    chex.assert_rank(segment_ids, 2)
    if prev_segment is None:
        prev_segment = jnp.full(segment_ids.shape[:1], -1, segment_ids.dtype)
    return (segment_ids != 0) & (segment_ids != _previous_valid_segment(segment_ids, prev_segment))


def last_valid_segment(segment_ids: chex.Array, prev_segment: chex.Array) -> jax.Array:
    """Segment id of each row's last valid token (``prev_segment [B]`` for a row of padding only).

    >>> last_valid_segment(jnp.array([[1, 2, 0], [0, 0, 0]]), jnp.array([5, 5])).tolist()
    [2, 5]
    """
    chex.assert_rank(segment_ids, 2)
    pad = jnp.zeros_like(segment_ids[:, :1])
    return _previous_valid_segment(jnp.concatenate([segment_ids, pad], axis=1), prev_segment)[:, -1]


def causal_conv1d(
    x: chex.Array,
    weight: chex.Array,
    segment_ids: chex.Array,
    *,
    window: chex.Array | None = None,
    window_segment: chex.Array | None = None,
) -> jax.Array:
    """Causal depthwise convolution that never crosses a sample boundary (no activation).

    ``y[t, c] = sum_{j < K} weight[j, c] x[t - K + 1 + j, c]`` over the inputs of the same sample as
    ``t`` (others count as 0: exactly the zero-padded convolution of each sample alone; transformers'
    ``F.conv1d(..., padding=K - 1)[:T]`` with its ``[C, 1, K]`` weight transposed to ``[K, C]``).
    ``window [B, K - 1, C]`` holds the inputs before ``x`` (a decode cache, zeros where none),
    belonging to segment ``window_segment [B]``; default none. Samples must be contiguous runs of
    equal ``segment_ids`` (padding may come before or after them, not inside).

    >>> x = jnp.arange(1.0, 6.0)[None, :, None]
    >>> causal_conv1d(x, jnp.ones((2, 1)), jnp.array([[1, 1, 1, 2, 2]]))[0, :, 0].tolist()
    [1.0, 3.0, 5.0, 4.0, 9.0]
    """
    chex.assert_rank([x, weight, segment_ids], [3, 2, 2])
    b, _, c = x.shape
    taps = weight.shape[0]
    chex.assert_equal(weight.shape[1], c)
    if window is None:
        window = jnp.zeros((b, taps - 1, c), x.dtype)
        window_segment = jnp.full((b,), -1, segment_ids.dtype)
    xs = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    segs = jnp.concatenate([jnp.repeat(window_segment[:, None], taps - 1, axis=1), segment_ids], axis=1)
    length = x.shape[1]
    out = jnp.zeros_like(x)
    for j in range(taps):  # K (4) shifted, masked multiply-adds: one fused elementwise pass
        same = (segs[:, j : j + length] == segment_ids)[..., None]
        out = out + jnp.where(same, xs[:, j : j + length], 0) * weight[j].astype(x.dtype)
    return out


def conv_window(
    x: chex.Array,
    segment_ids: chex.Array,
    window: chex.Array,
    window_segment: chex.Array,
) -> tuple[jax.Array, jax.Array]:
    """The convolution window after ``x``: ``(the last K - 1 inputs of each row's last valid token's
    sample [B, K - 1, C] (zeros before the sample's start), that sample's id [B])``, ``window`` and
    ``window_segment`` (as in :func:`causal_conv1d`) being those before ``x``. A row whose new tokens
    are all padding keeps its window.

    >>> w, s = conv_window(jnp.array([[[5.0], [6.0], [0.0]]]), jnp.array([[2, 2, 0]]),
    ...                    jnp.array([[[1.0], [2.0]]]), jnp.array([1]))
    >>> w[0, :, 0].tolist(), s.tolist()
    ([5.0, 6.0], [2])
    """
    chex.assert_rank([x, segment_ids, window, window_segment], [3, 2, 3, 1])
    keep = window.shape[1]
    xs = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    segs = jnp.concatenate([jnp.repeat(window_segment[:, None], keep, axis=1), segment_ids], axis=1)
    valid = jnp.concatenate(
        [jnp.ones_like(window_segment[:, None].repeat(keep, 1), bool), segment_ids != 0], 1
    )
    idx = jnp.arange(xs.shape[1], dtype=jnp.int32)
    last = jnp.max(jnp.where(valid, idx[None, :], 0), axis=1)  # >= keep - 1
    take = last[:, None] - (keep - 1) + jnp.arange(keep, dtype=jnp.int32)[None, :]
    new_window = jnp.take_along_axis(xs, take[..., None], axis=1)
    new_segment = jnp.take_along_axis(segs, last[:, None], axis=1)[:, 0]
    same = jnp.take_along_axis(segs, take, axis=1) == new_segment[:, None]
    return jnp.where(same[..., None], new_window, 0), new_segment


def gated_delta_rule_step(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    g: chex.Array,
    beta: chex.Array,
    state: chex.Array,
    reset: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule (module docstring): ``(o [B, H, Dv], new state [B, H, Dk, Dv])``.

    ``q``, ``k`` ``[B, H, Dk]`` (normalized and scaled by the caller), ``v [B, H, Dv]``, ``g``,
    ``beta [B, H]``, ``state [B, H, Dk, Dv]``; ``reset [B]``: start these rows from a zero state.
    Computed in float32 (or float64 inputs' precision).
    """
    chex.assert_rank([q, k, v, g, beta, state], [3, 3, 3, 2, 2, 4])
    f = jnp.promote_types(state.dtype, jnp.float32)
    q, k, v, g, beta, state = (a.astype(f) for a in (q, k, v, g, beta, state))
    if reset is not None:
        state = jnp.where(reset[:, None, None, None], 0, state)
    s = state * jnp.exp(g)[..., None, None]
    delta = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q), s


def gated_delta_rule_recurrent(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    g: chex.Array,
    beta: chex.Array,
    resets: chex.Array,
    initial_state: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (``lax.scan`` of :func:`gated_delta_rule_step`).

    Args: as :func:`gated_delta_rule_chunked`. Returns ``(o [B, T, H, Dv], final state)`` in float32.
    """
    chex.assert_rank([q, k, v, g, beta, resets], [4, 4, 4, 3, 3, 2])
    b, _, h, dk = k.shape
    dv = v.shape[-1]
    f = jnp.promote_types(q.dtype, jnp.float32)
    state = jnp.zeros((b, h, dk, dv), f) if initial_state is None else initial_state.astype(f)

    def step(s, xs):
        o, s = gated_delta_rule_step(*xs[:5], s, xs[5])
        return s, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, resets))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


@jax.custom_vjp
def unit_lower_inverse(a: chex.Array) -> jax.Array:
    """``(I + a)^-1`` for strictly lower triangular ``a [..., C, C]``, by forward substitution
    (row ``i`` of the inverse is ``e_i - a[i] @ inverse``, rows in order; as the FLA kernels and
    transformers compute the delta rule's UT transform). Its gradient is the matrix inverse's,
    ``-T^T G T^T`` with ``T`` the inverse, restricted to the strictly lower triangle: two matmuls.

    XLA:CPU's ``triangular_solve`` took 97 ms for 36 systems of 64 x 64 (this: 0.7 ms) and the
    solve's gradient compiled 3x slower.

    >>> unit_lower_inverse(jnp.array([[0.0, 0.0], [2.0, 0.0]])).tolist()
    [[1.0, 0.0], [-2.0, 1.0]]
    """
    size = a.shape[-1]
    eye = jnp.eye(size, dtype=a.dtype)

    def row(i, inverse):
        new = eye[i] - jnp.einsum("...j,...jk->...k", a[..., i, :], inverse)
        return jax.lax.dynamic_update_index_in_dim(inverse, new, i, axis=-2)

    return jax.lax.fori_loop(0, size, row, jnp.zeros_like(a))


def _unit_lower_inverse_fwd(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    inverse = unit_lower_inverse(a)
    return inverse, inverse


def _unit_lower_inverse_bwd(inverse: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    t = jnp.swapaxes(inverse, -1, -2)
    return (jnp.tril(-(t @ g @ t), -1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``[B, N*C, H, ...]`` -> ``[B, H, N, C, ...]``."""
    b, t, h = x.shape[:3]
    x = x.reshape(b, t // chunk, chunk, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def gated_delta_rule_chunked(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    g: chex.Array,
    beta: chex.Array,
    resets: chex.Array,
    initial_state: chex.Array | None = None,
    *,
    chunk_size: int = DEFAULT_DELTA_CHUNK_SIZE,
    precision: jax.lax.PrecisionLike = None,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks (module docstring): ``(o [B, T, H, Dv], final state [B, H, Dk, Dv])``.

    Args:
      q, k: ``[B, T, H, Dk]`` queries / keys (L2-normalized, the query scaled by ``Dk^-1/2``; shared
        key heads already repeated to ``H``).
      v: ``[B, T, H, Dv]``.
      g: ``[B, T, H]`` log decays (``<= 0``); beta: ``[B, T, H]`` write strengths.
      resets: ``bool [B, T]``: the state restarts from zero before these tokens (:func:`sample_resets`).
      initial_state: ``[B, H, Dk, Dv]`` state before the first token (default zeros).
      chunk_size: tokens per chunk (``T`` is padded to a multiple with no-op tokens).
      precision: of the matmuls.

    All math in float32 (float64 when given float64 inputs). Per chunk: the pairwise decays are
    ``exp(G_t - G_j)`` of the in-chunk cumulative log decay ``G`` (at most 0 below the diagonal),
    zeroed across resets; ``(I + A)^-1`` by forward substitution (:func:`unit_lower_inverse`); then
    one scan step over chunks carries the state.
    """
    chex.assert_rank([q, k, v, g, beta, resets], [4, 4, 4, 3, 3, 2])
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    f = jnp.promote_types(q.dtype, jnp.float32)
    chunk = max(1, min(chunk_size, t))
    pad = -t % chunk
    q, k, v, g, beta = (a.astype(f) for a in (q, k, v, g, beta))
    if pad:  # no-op tokens: beta = g = 0 (no write, no decay), no reset
        q, k, v, g, beta = (
            jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (q, k, v, g, beta)
        )
        resets = jnp.pad(resets, [(0, 0), (0, pad)])
    n = (t + pad) // chunk
    dot = lambda a, b_, spec: jnp.einsum(spec, a, b_, precision=precision)  # noqa: E731
    qc, kc, vc = _chunks(q, chunk), _chunks(k, chunk), _chunks(v, chunk)  # [B, H, N, C, D]
    gc, bc = _chunks(g, chunk), _chunks(beta, chunk)  # [B, H, N, C]
    rc = jnp.cumsum(resets.reshape(b, n, chunk).astype(jnp.int32), axis=-1)[:, None]  # [B, 1, N, C]
    cum = jnp.cumsum(gc, axis=-1)  # G: in-chunk cumulative log decay
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = lower & (rc[..., :, None] == rc[..., None, :])  # no reset in (j, t]
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # Gamma_t / Gamma_j
    from_start = jnp.where(rc == 0, jnp.exp(cum), 0)  # Gamma_t (0 after a reset in the chunk)
    to_end = jnp.where(same[..., -1, :], jnp.exp(cum[..., -1:] - cum), 0)  # Gamma_C / Gamma_j
    chunk_decay = jnp.where(rc[..., -1] == 0, jnp.exp(cum[..., -1]), 0)  # Gamma_C
    k_beta = kc * bc[..., None]
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    a = jnp.where(strict, dot(k_beta, kc, "...tk,...jk->...tj") * decay, 0)
    rhs = jnp.concatenate([vc * bc[..., None], k_beta * from_start[..., None]], axis=-1)
    solved = dot(unit_lower_inverse(a), rhs, "...tj,...jd->...td")
    u, w = solved[..., :dv], solved[..., dv:]  # Delta = u - w S_0
    attn = dot(qc, kc, "...tk,...jk->...tj") * decay  # lower incl. diagonal (decay is 0 above)
    q_start = qc * from_start[..., None]
    k_end = kc * to_end[..., None]

    def step(state, xs):  # state [B, H, Dk, Dv]; xs: one chunk of every per-chunk array
        u_i, w_i, attn_i, q_i, k_i, decay_i = xs
        delta = u_i - dot(w_i, state, "bhck,bhkv->bhcv")
        o = dot(q_i, state, "bhck,bhkv->bhcv") + dot(attn_i, delta, "bhtj,bhjv->bhtv")
        state = state * decay_i[..., None, None] + dot(k_i, delta, "bhck,bhcv->bhkv")
        return state, o

    state = jnp.zeros((b, h, dk, dv), f) if initial_state is None else initial_state.astype(f)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, attn, q_start, k_end, chunk_decay))
    state, o = jax.lax.scan(step, state, xs)  # o [N, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(o, 1, 2), state
