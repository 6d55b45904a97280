"""Per-token losses: policy-gradient surrogates, cross entropy, reference KL, entropy.

Every loss here is elementwise over any shape (``[B, L]`` padded or ``[R, L]`` packed)
and returns the per-token loss with the shape of ``logp``, masked positions included
(SPEC §3.2-§3.3, §3.6b). Masks, weights and normalizers are applied by
:mod:`rljax.core.objective`. Only :func:`gspo` is sequence-level: it takes
``segment_ids`` (the sample each token belongs to, values in ``[0, num_segments)``)
and a static ``num_segments``.

Importance ratios are computed in float32 as ``exp(clip(logp - ref, -20, 20))`` so a
wild log-ratio never overflows. ``sg`` below is ``jax.lax.stop_gradient``.

Policy losses can be called by name through :func:`policy_loss`, which routes the
uniform arguments ``(logp, old_logp, inference_logp, adv, mask, segment_ids,
num_segments)`` to each loss by parameter name (see :data:`POLICY_LOSSES`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp

_LOG_RATIO_CLIP = 20.0
_GSPO_LOG_WEIGHT_MAX = 10.0
_KL_KINDS = ("k1", "abs", "k2", "k3")


def _f32(x: chex.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _log_ratio(logp: chex.Array, ref_logp: chex.Array) -> jax.Array:
    """``clip(logp - ref_logp, -20, 20)`` in float32."""
    return jnp.clip(_f32(logp) - _f32(ref_logp), -_LOG_RATIO_CLIP, _LOG_RATIO_CLIP)


def _ratio(logp: chex.Array, ref_logp: chex.Array) -> jax.Array:
    """``exp(clip(logp - ref_logp, -20, 20))`` in float32."""
    return jnp.exp(_log_ratio(logp, ref_logp))


def _is_on(mask: chex.Array) -> jax.Array:
    """Float32 0/1 indicator of ``mask != 0``."""
    return (jnp.asarray(mask) != 0).astype(jnp.float32)


def _check(floats: list[chex.Array], others: tuple[chex.Array, ...] = ()) -> None:
    chex.assert_type(floats, float)
    chex.assert_equal_shape([*floats, *others])


def _clipped_surrogate(ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float) -> jax.Array:
    """``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``."""
    return -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)


def _surrogate_clipped(ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float) -> jax.Array:
    """1.0 where the PPO clip is active (the clipped branch wins and cuts the gradient)."""
    hit = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return hit.astype(jnp.float32)


# ------------------------------------------------------------------------------------------------
# Policy losses
# ------------------------------------------------------------------------------------------------


def ppo_clip(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> jax.Array:
    """PPO clipped surrogate, per token.

    ``r = exp(clip(logp - old_logp, -20, 20))``;
    ``loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``.
    Asymmetric ``eps_high`` is DAPO's clip-higher.

    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms";
    Yu et al. 2025, "DAPO" (decoupled clip).

    >>> import jax.numpy as jnp
    >>> loss = ppo_clip(jnp.log(jnp.array([1.5, 0.5])), jnp.zeros(2), jnp.array([1.0, 1.0]))
    >>> [round(float(x), 4) for x in loss]
    [-1.2, -0.5]
    """
    _check([logp, old_logp, adv])
    return _clipped_surrogate(_ratio(logp, old_logp), _f32(adv), eps_low, eps_high)


def dual_clip(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> jax.Array:
    """Dual-clip PPO: the PPO loss, further bounded by ``-A c`` where ``A < 0``.

    ``loss = ppo_clip`` for ``A >= 0``; ``min(-A c, ppo_clip)`` for ``A < 0`` (so a huge
    ratio on a negative-advantage token cannot produce an unbounded loss).

    Reference: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL".

    >>> import jax.numpy as jnp
    >>> loss = dual_clip(jnp.log(jnp.array([10.0, 10.0])), jnp.zeros(2), jnp.array([-1.0, 1.0]))
    >>> [round(float(x), 4) for x in loss]
    [3.0, -1.2]
    """
    _check([logp, old_logp, adv])
    if isinstance(clip_ratio_c, (int, float)) and clip_ratio_c <= 1.0:
        raise ValueError(f"dual_clip needs clip_ratio_c > 1 (it bounds the loss at -A*c); got {clip_ratio_c}")
    a = _f32(adv)
    base = _clipped_surrogate(_ratio(logp, old_logp), a, eps_low, eps_high)
    return jnp.where(_dual_bound_active(base, a, clip_ratio_c), -a * clip_ratio_c, base)


def _dual_bound_active(ppo_loss: jax.Array, adv: jax.Array, clip_ratio_c: float) -> jax.Array:
    """Boolean: ``A < 0`` and the dual bound ``-A c`` is below the PPO loss."""
    return (adv < 0) & (-adv * clip_ratio_c < ppo_loss)


def _segment_masked_mean(
    x: jax.Array, mask: jax.Array, segment_ids: chex.Array, num_segments: int
) -> jax.Array:
    """Per-token value of the masked mean of ``x`` over the token's segment (0 if empty)."""
    ids = jnp.asarray(segment_ids).reshape(-1)
    total = jax.ops.segment_sum(jnp.where(mask > 0, x, 0.0).reshape(-1), ids, num_segments=num_segments)
    count = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=num_segments)
    mean = total / jnp.maximum(count, 1.0)
    return mean[ids].reshape(x.shape)


def _gspo_log_weight(
    logp: chex.Array, old_logp: chex.Array, mask: chex.Array, segment_ids: chex.Array, num_segments: int
) -> jax.Array:
    """``min(logp - sg(logp) + sg(s), 10)`` with ``s`` the masked sequence mean log-ratio."""
    lp = _f32(logp)
    s = _segment_masked_mean(_log_ratio(lp, old_logp), _is_on(mask), segment_ids, num_segments)
    return jnp.minimum(lp - jax.lax.stop_gradient(lp) + jax.lax.stop_gradient(s), _GSPO_LOG_WEIGHT_MAX)


def gspo(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    segment_ids: chex.Array,
    num_segments: int,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> jax.Array:
    """GSPO: PPO clipping on a sequence-level importance weight, per token.

    ``s_j = mean_{t in j, mask}(clip(logp - old_logp, -20, 20))`` for each sequence
    (segment) ``j``; ``log w_t = min(logp_t - sg(logp_t) + sg(s_j), 10)``, so ``w_t``
    has the value ``exp(s_j)`` and the gradient of ``logp_t``;
    ``loss = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)``.

    Reference: Zheng et al. 2025, "Group Sequence Policy Optimization" (token variant,
    GSPO-token); SkyRL ``gspo`` policy loss.

    >>> import jax.numpy as jnp
    >>> logp = jnp.log(jnp.array([1.1, 1.1, 2.0]))   # ratios vs old_logp = 0
    >>> loss = gspo(logp, jnp.zeros(3), jnp.ones(3), jnp.ones(3), jnp.array([0, 0, 1]), 2)
    >>> [round(float(x), 4) for x in loss]
    [-1.1, -1.1, -1.2]
    """
    _check([logp, old_logp, adv], (mask, segment_ids))
    w = jnp.exp(_gspo_log_weight(logp, old_logp, mask, segment_ids, num_segments))
    return _clipped_surrogate(w, _f32(adv), eps_low, eps_high)


def cispo(
    logp: chex.Array,
    behavior_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 1.0,
    eps_high: float = 4.0,
) -> jax.Array:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight, per token.

    ``r_b = exp(clip(logp - behavior_logp, -20, 20))``;
    ``loss = -A sg(clip(r_b, 1 - eps_low, 1 + eps_high)) logp``. The behaviour logprobs
    are the old policy's or the rollout engine's (see :func:`policy_loss`).

    Reference: MiniMax 2025, "MiniMax-M1" (CISPO).

    >>> import jax.numpy as jnp
    >>> loss = cispo(jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.05, 0.5])), jnp.ones(2))
    >>> [round(float(x), 4) for x in loss]
    [3.4657, 0.6931]
    """
    _check([logp, behavior_logp, adv])
    weight = jnp.clip(_ratio(logp, behavior_logp), 1.0 - eps_low, 1.0 + eps_high)
    return -_f32(adv) * jax.lax.stop_gradient(weight) * _f32(logp)


def _dppo_masked(
    logp: chex.Array, inference_logp: chex.Array, adv: chex.Array, mask_low: float, mask_high: float
) -> jax.Array:
    """Boolean: token outside DPPO's probability-difference trust region."""
    dp = jnp.exp(_f32(logp)) - jnp.exp(_f32(inference_logp))
    a = _f32(adv)
    return ((a > 0) & (dp > mask_high)) | ((a <= 0) & (dp < -mask_low))


def dppo(
    logp: chex.Array,
    inference_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
) -> jax.Array:
    """DPPO (prime-rl default loss): probability-difference trust region plus a KL term.

    ``dp = exp(logp) - exp(logp_inf)``; a token is dropped from the policy term where
    ``A > 0 and dp > mask_high`` or ``A <= 0 and dp < -mask_low``;
    ``keep = mask and not dropped``; ``r_inf = exp(clip(logp - logp_inf, -20, 20))``;
    ``loss = -keep adv_tau A r_inf + kl_tau mask log(r_inf)^2``.

    Reference: prime-rl ``default`` loss (PrimeIntellect, 2025).

    >>> import jax.numpy as jnp
    >>> p, q = jnp.array([.5, .5, .9, .1]), jnp.array([.5, .2, .6, .4])
    >>> loss = dppo(jnp.log(p), jnp.log(q), jnp.array([1.0, 1, -1, -1]), jnp.ones(4))
    >>> round(float(loss.sum()), 5)
    0.50293
    """
    _check([logp, inference_logp, adv], (mask,))
    on = _is_on(mask)
    keep = on * (1.0 - _dppo_masked(logp, inference_logp, adv, mask_low, mask_high).astype(jnp.float32))
    log_r = _log_ratio(logp, inference_logp)
    return -keep * adv_tau * _f32(adv) * jnp.exp(log_r) + kl_tau * on * jnp.square(log_r)


def sapo(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> jax.Array:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip, per token.

    ``r = exp(clip(logp - old_logp, -20, 20))``; ``tau = tau_pos if A > 0 else tau_neg``;
    ``gate = sigmoid(tau (r - 1)) 4 / tau``; ``loss = -gate A`` (gradient ``-A r
    sigmoid'(tau(r-1)) 4``, which equals ``-A`` at ``r = 1``).

    Reference: Qwen team 2025, "Soft Adaptive Policy Optimization".

    >>> import jax.numpy as jnp
    >>> loss = sapo(jnp.zeros(2), jnp.zeros(2), jnp.array([1.0, -1.0]))
    >>> [round(float(x), 4) for x in loss]
    [-2.0, 1.9048]
    """
    _check([logp, old_logp, adv])
    a = _f32(adv)
    tau = jnp.where(a > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (_ratio(logp, old_logp) - 1.0)) * 4.0 / tau
    return -gate * a


def rollout_is(
    logp: chex.Array,
    rollout_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> jax.Array:
    """REINFORCE with a rollout importance weight that is zeroed outside a trust band.

    ``r = exp(clip(logp - rollout_logp, -20, 20))``; ``c = r`` if
    ``1 - eps_low < r < 1 + eps_high`` (open interval) else ``0``;
    ``loss = -sg(c) A logp``.

    Reference: prime-rl / Liu et al. 2025, "When Speed Kills Stability" (masked IS).

    >>> import jax.numpy as jnp
    >>> loss = rollout_is(jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.5, 0.1])), jnp.ones(2))
    >>> [round(float(x), 4) for x in loss]
    [0.6931, 0.0]
    """
    _check([logp, rollout_logp, adv])
    r = _ratio(logp, rollout_logp)
    c = jnp.where((r > 1.0 - eps_low) & (r < 1.0 + eps_high), r, 0.0)
    return -jax.lax.stop_gradient(c) * _f32(adv) * _f32(logp)


def importance_sampling(logp: chex.Array, old_logp: chex.Array, adv: chex.Array) -> jax.Array:
    """Unclipped importance-sampled policy gradient: ``loss = -r A``, per token.

    ``r = exp(clip(logp - old_logp, -20, 20))``; the gradient is ``-A r grad(logp)``.

    Reference: Sutton & Barto, "Reinforcement Learning", §5.5 (importance sampling).

    >>> import jax.numpy as jnp
    >>> loss = importance_sampling(jnp.log(jnp.array([2.0])), jnp.zeros(1), jnp.ones(1))
    >>> [round(float(x), 4) for x in loss]
    [-2.0]
    """
    _check([logp, old_logp, adv])
    return -_ratio(logp, old_logp) * _f32(adv)


# ------------------------------------------------------------------------------------------------
# Other components
# ------------------------------------------------------------------------------------------------


def cross_entropy(logp: chex.Array) -> jax.Array:
    """Negative log-likelihood of the target token: ``loss = -logp`` (SFT, distillation).

    >>> import jax.numpy as jnp
    >>> [round(float(x), 4) for x in cross_entropy(jnp.log(jnp.array([0.5, 0.25])))]
    [0.6931, 1.3863]
    """
    chex.assert_type(logp, float)
    return -_f32(logp)


def ref_kl(
    logp: chex.Array,
    inference_logp: chex.Array,
    ref_logp: chex.Array,
    mask: chex.Array,
    *,
    mask_low: float = 0.2,
    kl_tau: float = 1e-3,
) -> jax.Array:
    """On-policy distillation towards a reference (teacher) policy, per token.

    ``dp = exp(logp) - exp(logp_inf)``; ``keep = mask and not(dp < -mask_low)``;
    ``r_inf = exp(clip(logp - logp_inf, -20, 20))``;
    ``loss = -keep sg(logp_ref - logp) r_inf + kl_tau mask log(r_inf)^2``: a policy
    gradient with per-token advantage ``logp_ref - logp`` (reverse KL to the teacher).

    Reference: Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD);
    prime-rl on-policy distillation loss.

    >>> import jax.numpy as jnp
    >>> p, q, t = jnp.array([.5, .5, .9, .1]), jnp.array([.5, .2, .6, .4]), jnp.array([.6, .3, .8, .3])
    >>> round(float(ref_kl(jnp.log(p), jnp.log(q), jnp.log(t), jnp.ones(4)).sum()), 5)
    1.27434
    """
    _check([logp, inference_logp, ref_logp], (mask,))
    on = _is_on(mask)
    lp = _f32(logp)
    dp = jnp.exp(lp) - jnp.exp(_f32(inference_logp))
    keep = on * (dp >= -mask_low).astype(jnp.float32)
    log_r = _log_ratio(lp, inference_logp)
    teacher_adv = jax.lax.stop_gradient(_f32(ref_logp) - lp)
    return -keep * teacher_adv * jnp.exp(log_r) + kl_tau * on * jnp.square(log_r)


def kl(logp: chex.Array, ref_logp: chex.Array, *, kind: str = "k3") -> jax.Array:
    """Per-token estimators of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    With ``d = logp - logp_ref``: ``k1 = d``, ``abs = |d|``, ``k2 = d^2 / 2``;
    ``k3``: ``x = clip(logp_ref - logp, -20, 20)``, ``k3 = clip(exp(x) - x - 1, -10, 10)``
    (unbiased and non-negative).

    Reference: J. Schulman 2020, "Approximating KL Divergence" (k1/k2/k3).

    >>> import jax.numpy as jnp
    >>> lp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
    >>> [round(float(kl(lp, ref, kind=k)[0]), 4) for k in ("k1", "abs", "k2", "k3")]
    [0.6931, 0.6931, 0.2402, 0.1931]
    """
    chex.assert_type([logp, ref_logp], float)
    chex.assert_equal_shape([logp, ref_logp])
    if kind not in _KL_KINDS:
        raise ValueError(f"kl kind must be one of {_KL_KINDS}; got {kind!r}")
    d = _f32(logp) - _f32(ref_logp)
    if kind == "k1":
        return d
    if kind == "abs":
        return jnp.abs(d)
    if kind == "k2":
        return 0.5 * jnp.square(d)
    x = jnp.clip(-d, -_LOG_RATIO_CLIP, _LOG_RATIO_CLIP)
    return jnp.clip(jnp.exp(x) - x - 1.0, -10.0, 10.0)


def entropy_from_logits(logits: chex.Array, temperature: chex.Numeric | chex.Array = 1.0) -> jax.Array:
    """Entropy of ``softmax(logits / temperature)`` over the last axis, in float32.

    ``z = logits / T``; ``H = logsumexp(z) - sum_v softmax(z)_v z_v``. ``temperature`` is
    a scalar or has the shape of ``logits[..., 0]`` (one temperature per token), and
    must be positive. Vocabulary entries with ``-inf`` logits contribute 0.

    >>> import jax.numpy as jnp
    >>> round(float(entropy_from_logits(jnp.zeros((1, 4)))[0]), 4)   # log(4)
    1.3863
    """
    chex.assert_type(logits, float)
    t = jnp.asarray(temperature, jnp.float32)
    if t.ndim:
        chex.assert_shape(t, jnp.shape(logits)[:-1])
        t = t[..., None]
    z = _f32(logits) / t
    # H is shift-invariant; shifting by the max avoids float32 cancellation in lse(z) - E[z].
    z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    p = jax.nn.softmax(z, axis=-1)
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(p * jnp.where(p > 0, z, 0.0), axis=-1)


# ------------------------------------------------------------------------------------------------
# Registry and uniform adapter
# ------------------------------------------------------------------------------------------------

POLICY_LOSSES: dict[str, Callable[..., jax.Array]] = {
    "ppo_clip": ppo_clip,
    "dual_clip": dual_clip,
    "gspo": gspo,
    "cispo": cispo,
    "dppo": dppo,
    "sapo": sapo,
    "rollout_is": rollout_is,
    "importance_sampling": importance_sampling,
}
"""Policy losses by name. A registered function's positional parameters must be named
from ``logp, old_logp, inference_logp, rollout_logp, behavior_logp, adv, mask, segment_ids,
num_segments``; :func:`policy_loss` fills them by name, so users may register their own."""

_DEFAULT_LOSSES: dict[str, Callable[..., jax.Array]] = dict(POLICY_LOSSES)
_ROUTED = ("logp", "old_logp", "inference_logp", "rollout_logp", "behavior_logp", "adv", "mask",
           "segment_ids", "num_segments")
_BEHAVIORS = ("old", "inference")


def _clip_ppo(args: dict[str, Any], kw: dict[str, Any]) -> jax.Array:
    r = _ratio(args["logp"], args["old_logp"])
    return _surrogate_clipped(r, _f32(args["adv"]), kw.get("eps_low", 0.2), kw.get("eps_high", 0.2))


def _clip_dual(args: dict[str, Any], kw: dict[str, Any]) -> jax.Array:
    a = _f32(args["adv"])
    ppo = _clipped_surrogate(_ratio(args["logp"], args["old_logp"]), a, kw.get("eps_low", 0.2),
                             kw.get("eps_high", 0.2))
    dual = _dual_bound_active(ppo, a, kw.get("clip_ratio_c", 3.0))
    return jnp.maximum(_clip_ppo(args, kw), dual.astype(jnp.float32))


def _clip_gspo(args: dict[str, Any], kw: dict[str, Any]) -> jax.Array:
    log_w = _gspo_log_weight(args["logp"], args["old_logp"], args["mask"], args["segment_ids"],
                             args["num_segments"])
    eps_low, eps_high = kw.get("eps_low", 0.2), kw.get("eps_high", 0.2)
    return _surrogate_clipped(jnp.exp(log_w), _f32(args["adv"]), eps_low, eps_high)


def _clip_cispo(args: dict[str, Any], kw: dict[str, Any]) -> jax.Array:
    r = _ratio(args["logp"], args["behavior_logp"])
    out = (r < 1.0 - kw.get("eps_low", 1.0)) | (r > 1.0 + kw.get("eps_high", 4.0))
    return out.astype(jnp.float32)


def _clip_dppo(args: dict[str, Any], kw: dict[str, Any]) -> jax.Array:
    dropped = _dppo_masked(args["logp"], args["inference_logp"], args["adv"], kw.get("mask_low", 0.2),
                           kw.get("mask_high", 0.2))
    return dropped.astype(jnp.float32)


def _clip_rollout_is(args: dict[str, Any], kw: dict[str, Any]) -> jax.Array:
    r = _ratio(args["logp"], args["rollout_logp"])
    inside = (r > 1.0 - kw.get("eps_low", 0.2)) & (r < 1.0 + kw.get("eps_high", 0.2))
    return 1.0 - inside.astype(jnp.float32)


_CLIP_INDICATORS: dict[str, Callable[[dict[str, Any], dict[str, Any]], jax.Array]] = {
    "ppo_clip": _clip_ppo,
    "dual_clip": _clip_dual,
    "gspo": _clip_gspo,
    "cispo": _clip_cispo,
    "dppo": _clip_dppo,
    "rollout_is": _clip_rollout_is,
}


def validate_policy_loss(name: str, kwargs: dict[str, Any] | None = None) -> None:
    """Raises ``ValueError`` unless ``name`` is registered and accepts ``kwargs``.

    Used at config time so a typo fails before anything is traced.

    >>> validate_policy_loss("dppo", {"kl_tau": 0.0})
    >>> validate_policy_loss("cispo", {"behavior": "inference", "eps_high": 2.0})
    """
    _validated(name, dict(kwargs or {}))


def _validated(name: str, kwargs: dict[str, Any]) -> tuple[Callable[..., jax.Array], dict[str, Any], str]:
    """Checks name, parameter names and hyperparameters; returns (fn, hyperparameters, behavior)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    fn = POLICY_LOSSES[name]
    kw = dict(kwargs)
    params = inspect.signature(fn).parameters
    behavior = kw.pop("behavior", "old") if "behavior_logp" in params else "old"
    if behavior not in _BEHAVIORS:
        raise ValueError(f"{name}: behavior must be one of {_BEHAVIORS} (which logprobs r_b uses); "
                         f"got {behavior!r}")
    positional = [p for p in params.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    unknown_pos = [p.name for p in positional if p.name not in _ROUTED]
    if unknown_pos:
        raise ValueError(f"policy loss {name!r} has parameters {unknown_pos} that policy_loss cannot fill; "
                         f"name them from {_ROUTED}")
    hyper = {p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    bad = sorted(set(kw) - hyper)
    if bad:
        raise ValueError(f"policy loss {name!r} got unknown hyperparameters {bad}; it accepts {sorted(hyper)}"
                         + (" and 'behavior'" if "behavior_logp" in params else ""))
    return fn, kw, behavior


def _route(
    name: str,
    logp: chex.Array,
    old_logp: chex.Array,
    inference_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    segment_ids: chex.Array,
    num_segments: int,
    kwargs: dict[str, Any],
) -> tuple[Callable[..., jax.Array], dict[str, Any], dict[str, Any]]:
    """Validates ``name``/``kwargs``; returns (fn, routed positional args, hyperparameters)."""
    fn, kw, behavior = _validated(name, kwargs)
    params = inspect.signature(fn).parameters
    available = {
        "logp": logp, "old_logp": old_logp, "inference_logp": inference_logp, "rollout_logp": inference_logp,
        "behavior_logp": old_logp if behavior == "old" else inference_logp, "adv": adv, "mask": mask,
        "segment_ids": segment_ids, "num_segments": num_segments,
    }
    positional = [p for p in params.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    needs_segments = "segment_ids" in params or "num_segments" in params
    if needs_segments and (segment_ids is None or num_segments is None):
        raise ValueError(
            f"policy loss {name!r} is sequence-level: pass segment_ids and a static num_segments"
        )
    return fn, {p.name: available[p.name] for p in positional}, kw


def policy_loss(
    name: str,
    logp: chex.Array,
    old_logp: chex.Array,
    inference_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    segment_ids: chex.Array | None = None,
    num_segments: int | None = None,
    **kwargs: Any,
) -> jax.Array:
    """Calls the policy loss ``name`` of :data:`POLICY_LOSSES` with uniform arguments.

    Each loss receives the arguments its parameters name: ``old_logp`` (trainer logprobs
    before the update), ``inference_logp``/``rollout_logp`` (the sampler's logprobs),
    ``behavior_logp`` (``old_logp``, or ``inference_logp`` with ``behavior="inference"``;
    used by ``cispo``), ``adv``, ``mask``, ``segment_ids``, ``num_segments``. ``kwargs``
    are the loss's keyword hyperparameters; unknown names raise ``ValueError``.

    >>> import jax.numpy as jnp
    >>> lp = jnp.log(jnp.array([0.5, 0.5]))
    >>> loss = policy_loss("ppo_clip", lp, lp, lp, jnp.ones(2), jnp.ones(2), eps_high=0.28)
    >>> [round(float(x), 4) for x in loss]
    [-1.0, -1.0]
    """
    fn, args, kw = _route(name, logp, old_logp, inference_logp, adv, mask, segment_ids, num_segments, kwargs)
    return fn(**args, **kw)


def clipped_tokens(
    name: str,
    logp: chex.Array,
    old_logp: chex.Array,
    inference_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    segment_ids: chex.Array | None = None,
    num_segments: int | None = None,
    **kwargs: Any,
) -> jax.Array:
    """Float32 0/1 per token: where the policy loss ``name`` clipped or masked the token.

    Same arguments as :func:`policy_loss`. "Clipped" means the loss's trust-region rule
    was active: PPO/GSPO clip branch taken, dual-clip bound taken, CISPO weight clipped,
    DPPO token dropped, rollout-IS weight zeroed. Losses without such a rule (``sapo``,
    ``importance_sampling``, user losses) give zeros. The objective turns this into a
    clip fraction over trainable tokens.

    >>> import jax.numpy as jnp
    >>> lp, old = jnp.log(jnp.array([0.9, 0.5])), jnp.log(jnp.array([0.5, 0.5]))
    >>> [float(x) for x in clipped_tokens("ppo_clip", lp, old, old, jnp.ones(2), jnp.ones(2))]
    [1.0, 0.0]
    """
    fn, args, kw = _route(name, logp, old_logp, inference_logp, adv, mask, segment_ids, num_segments, kwargs)
    indicator = _CLIP_INDICATORS.get(name) if POLICY_LOSSES.get(name) is _DEFAULT_LOSSES.get(name) else None
    if indicator is None:
        return jnp.zeros(jnp.shape(logp), jnp.float32)
    return indicator(args, kw)

