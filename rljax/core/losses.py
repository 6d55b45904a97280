"""Per-token losses: policy-gradient surrogates, cross entropy, reference KL, entropy.

Every loss here is elementwise over any shape (``[B, L]`` padded or ``[R, L]`` packed)
and returns the per-token loss with the shape of ``logp``, masked positions included
(design §3.2-§3.3, §3.6b); a policy loss returns it as :class:`PolicyLossTerms` ``(loss,
clipped)`` together with where its trust-region rule cut the token, both from one computation.
Masks, weights and normalizers are applied by :mod:`rljax.core.objective`. Only :func:`gspo` is
sequence-level: it takes ``segment_ids`` (the sample each token belongs to, values in
``[0, num_segments)``) and a static ``num_segments``.

Importance ratios are computed in float32 as ``exp(clip(logp - ref, -20, 20))`` so a
wild log-ratio never overflows. ``sg`` below is ``jax.lax.stop_gradient``.

Only :func:`clip_cov` and :func:`kl_cov` use statistics of the whole array passed in
(covariances over its masked tokens); see their docstrings.

**Registry.** Each policy loss is registered as one :class:`PolicyLoss` value that carries
its function, the uniform inputs it reads (fields of :class:`LossInputs`: ``logp, old_logp,
inference_logp/rollout_logp, adv, mask, segment_ids, num_segments, rng``), its
hyperparameters with their defaults and its input choices (cispo's ``behavior``: old or
inference logprobs). A built-in is registered as its public function itself: its inputs and
defaults are read from its signature, the one place they are written (the estimators'
registry, :mod:`rljax.core.advantages`, reads its functions the same way). Calling a
registered loss with one :class:`LossInputs` (:func:`policy_loss`) returns ``(per_token_loss,
clipped)``: the clip indicator of the ``rl/clip_frac`` metric comes out of the loss computation
itself. The
objective, :func:`validate_policy_loss` and ``rljax.algorithms`` read the same
registration, so a loss added with :func:`register_policy_loss` works everywhere a built-in
one does.

>>> sorted(get_policy_loss("dppo").defaults.items())
[('adv_tau', 1.0), ('kl_tau', 0.001), ('mask_high', 0.2), ('mask_low', 0.2)]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from rljax.core import registry, segments

#: Every importance ratio of the core is ``exp(clip(log r, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))``.
LOG_RATIO_CLIP = 20.0
_GSPO_LOG_WEIGHT_MAX = 10.0
#: The per-token KL estimators of :func:`kl` (Schulman 2020).
KL_KINDS: tuple[str, ...] = ("k1", "abs", "k2", "k3")


def _f32(x: chex.Array) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _log_ratio(logp: chex.Array, ref_logp: chex.Array) -> jax.Array:
    """``clip(logp - ref_logp, -20, 20)`` in float32."""
    return jnp.clip(_f32(logp) - _f32(ref_logp), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)


def _ratio(logp: chex.Array, ref_logp: chex.Array) -> jax.Array:
    """``exp(clip(logp - ref_logp, -20, 20))`` in float32."""
    return jnp.exp(_log_ratio(logp, ref_logp))


def _is_on(mask: chex.Array) -> jax.Array:
    """Float32 0/1 indicator of ``mask != 0``."""
    return (jnp.asarray(mask) != 0).astype(jnp.float32)


def _check(floats: list[chex.Array], others: tuple[chex.Array, ...] = ()) -> None:
    chex.assert_type(floats, float)
    chex.assert_equal_shape([*floats, *others])


class PolicyLossTerms(NamedTuple):
    """What every built-in policy loss returns: the per-token loss and where its rule cut it.

    Attributes:
      loss: the per-token loss, float32, shaped like ``logp`` (masked positions included).
      clipped: float32 0/1, shaped like ``loss``: 1 where the loss's trust-region rule was active
        (PPO / GSPO clip branch taken, dual-clip bound taken, CISPO weight clipped, DPPO token
        dropped, rollout-IS weight zeroed, Clip-Cov token removed); all zeros for losses without
        such a rule. The objective's ``rl/clip_frac`` is its weighted mean.
    """

    loss: jax.Array
    clipped: jax.Array


def _terms(loss: jax.Array, clipped: jax.Array | None = None) -> PolicyLossTerms:
    cut = jnp.zeros(loss.shape, jnp.float32) if clipped is None else (clipped != 0).astype(jnp.float32)
    return PolicyLossTerms(loss, cut)


def _ppo_surrogate(ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float) -> PolicyLossTerms:
    """``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` and where the clipped branch
    wins (``A > 0, ratio > 1 + eps_high`` or ``A < 0, ratio < 1 - eps_low``: no gradient there)."""
    loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
    hit = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return _terms(loss, hit)


# ------------------------------------------------------------------------------------------------
# Policy losses: each returns PolicyLossTerms(loss, clipped); its signature declares its inputs
# (positional) and hyperparameters with their defaults (keyword-only), read by the registry below.
# ------------------------------------------------------------------------------------------------


def ppo_clip(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> PolicyLossTerms:
    """PPO clipped surrogate, per token.

    ``r = exp(clip(logp - old_logp, -20, 20))``;
    ``loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``; ``clipped`` where the clipped
    branch wins. Asymmetric ``eps_high`` is DAPO's clip-higher.

    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms";
    Yu et al. 2025, "DAPO" (decoupled clip).

    >>> import jax.numpy as jnp
    >>> loss, clipped = ppo_clip(jnp.log(jnp.array([1.5, 0.5])), jnp.zeros(2), jnp.array([1.0, 1.0]))
    >>> [round(float(x), 4) for x in loss], clipped.tolist()
    ([-1.2, -0.5], [1.0, 0.0])
    """
    _check([logp, old_logp, adv])
    return _ppo_surrogate(_ratio(logp, old_logp), _f32(adv), eps_low, eps_high)


def dual_clip(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> PolicyLossTerms:
    """Dual-clip PPO: the PPO loss, further bounded by ``-A c`` where ``A < 0``.

    ``loss = ppo_clip`` for ``A >= 0``; ``min(-A c, ppo_clip)`` for ``A < 0`` (so a huge
    ratio on a negative-advantage token cannot produce an unbounded loss); ``clipped`` where the
    PPO clip or the dual bound is active.

    Reference: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL".

    >>> import jax.numpy as jnp
    >>> loss, clipped = dual_clip(jnp.log(jnp.array([10.0, 10.0])), jnp.zeros(2), jnp.array([-1.0, 1.0]))
    >>> [round(float(x), 4) for x in loss], clipped.tolist()
    ([3.0, -1.2], [1.0, 1.0])
    """
    _check([logp, old_logp, adv])
    if isinstance(clip_ratio_c, (int, float)) and clip_ratio_c <= 1.0:
        raise ValueError(f"dual_clip needs clip_ratio_c > 1 (it bounds the loss at -A*c); got {clip_ratio_c}")
    a = _f32(adv)
    base, ppo_hit = _ppo_surrogate(_ratio(logp, old_logp), a, eps_low, eps_high)
    bound = (a < 0) & (-a * clip_ratio_c < base)  # the dual bound is below the PPO loss
    return _terms(jnp.where(bound, -a * clip_ratio_c, base), (ppo_hit > 0) | bound)


def _gspo_log_weight(
    logp: chex.Array, old_logp: chex.Array, mask: chex.Array, segment_ids: chex.Array, num_segments: int
) -> jax.Array:
    """``min(logp - sg(logp) + sg(s), 10)`` with ``s`` the masked sequence mean log-ratio."""
    lp, ids = _f32(logp), jnp.asarray(segment_ids)
    s = segments.segment_mean(_log_ratio(lp, old_logp), ids, num_segments, where=jnp.asarray(mask) != 0)
    s = segments.segment_gather(s, ids)  # each token: the masked mean of its sequence (0 if empty)
    return jnp.minimum(lp - jax.lax.stop_gradient(lp) + jax.lax.stop_gradient(s), _GSPO_LOG_WEIGHT_MAX)


def gspo(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    segment_ids: chex.Array,
    num_segments: int,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> PolicyLossTerms:
    """GSPO: PPO clipping on a sequence-level importance weight, per token.

    ``s_j = mean_{t in j, mask}(clip(logp - old_logp, -20, 20))`` for each sequence
    (segment) ``j``; ``log w_t = min(logp_t - sg(logp_t) + sg(s_j), 10)``, so ``w_t``
    has the value ``exp(s_j)`` and the gradient of ``logp_t``;
    ``loss = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)``.

    The default clip is the paper's (3e-4 / 4e-4): a sequence weight is the geometric mean of its
    token ratios, so it stays far closer to 1 than a token ratio and PPO's 0.2 would never clip.
    The ratio is against the old (proximal) policy, which the trainer recomputes for gspo
    (``trainer.old_logprobs``, design §3.4): against the sampler's logprobs, float noise of
    0.01 nats alone would clip about half the sequences.

    Reference: Zheng et al. 2025, "Group Sequence Policy Optimization" (token variant,
    GSPO-token); SkyRL ``gspo`` policy loss.

    >>> import jax.numpy as jnp
    >>> logp = jnp.log(jnp.array([1.1, 1.1, 2.0]))   # ratios vs old_logp = 0
    >>> out = gspo(logp, jnp.zeros(3), jnp.ones(3), jnp.ones(3), jnp.array([0, 0, 1]), 2,
    ...            eps_low=0.2, eps_high=0.2)
    >>> [round(float(x), 4) for x in out.loss], out.clipped.tolist()
    ([-1.1, -1.1, -1.2], [0.0, 0.0, 1.0])
    """
    _check([logp, old_logp, adv], (mask, segment_ids))
    w = jnp.exp(_gspo_log_weight(logp, old_logp, mask, segment_ids, num_segments))
    return _ppo_surrogate(w, _f32(adv), eps_low, eps_high)


def cispo(
    logp: chex.Array,
    behavior_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 1.0,
    eps_high: float = 4.0,
) -> PolicyLossTerms:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight, per token.

    ``r_b = exp(clip(logp - behavior_logp, -20, 20))``;
    ``loss = -A sg(clip(r_b, 1 - eps_low, 1 + eps_high)) logp``; ``clipped`` where the weight
    was clipped. The behaviour logprobs are the old policy's or the rollout engine's (the
    registered loss's ``behavior`` choice, :func:`policy_loss`).

    Reference: MiniMax 2025, "MiniMax-M1" (CISPO).

    >>> import jax.numpy as jnp
    >>> loss, clipped = cispo(jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.05, 0.5])), jnp.ones(2))
    >>> [round(float(x), 4) for x in loss], clipped.tolist()
    ([3.4657, 0.6931], [1.0, 0.0])
    """
    _check([logp, behavior_logp, adv])
    r = _ratio(logp, behavior_logp)
    weight = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high)
    loss = -_f32(adv) * jax.lax.stop_gradient(weight) * _f32(logp)
    return _terms(loss, (r < 1.0 - eps_low) | (r > 1.0 + eps_high))


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
) -> PolicyLossTerms:
    """DPPO (prime-rl default loss): probability-difference trust region plus a KL term.

    ``dp = exp(logp) - exp(logp_inf)``; a token is dropped from the policy term where
    ``A > 0 and dp > mask_high`` or ``A <= 0 and dp < -mask_low`` (``clipped``);
    ``keep = mask and not dropped``; ``r_inf = exp(clip(logp - logp_inf, -20, 20))``;
    ``loss = -keep adv_tau A r_inf + kl_tau mask log(r_inf)^2``.

    Reference: prime-rl ``default`` loss (PrimeIntellect, 2025).

    >>> import jax.numpy as jnp
    >>> p, q = jnp.array([.5, .5, .9, .1]), jnp.array([.5, .2, .6, .4])
    >>> loss, dropped = dppo(jnp.log(p), jnp.log(q), jnp.array([1.0, 1, -1, -1]), jnp.ones(4))
    >>> round(float(loss.sum()), 5), dropped.tolist()
    (0.50293, [0.0, 1.0, 0.0, 1.0])
    """
    _check([logp, inference_logp, adv], (mask,))
    on, a = _is_on(mask), _f32(adv)
    dp = jnp.exp(_f32(logp)) - jnp.exp(_f32(inference_logp))
    dropped = ((a > 0) & (dp > mask_high)) | ((a <= 0) & (dp < -mask_low))
    keep = on * (1.0 - dropped.astype(jnp.float32))
    log_r = _log_ratio(logp, inference_logp)
    return _terms(-keep * adv_tau * a * jnp.exp(log_r) + kl_tau * on * jnp.square(log_r), dropped)


def sapo(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyLossTerms:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip, per token.

    ``r = exp(clip(logp - old_logp, -20, 20))``; ``tau = tau_pos if A > 0 else tau_neg``;
    ``gate = sigmoid(tau (r - 1)) 4 / tau``; ``loss = -gate A`` (gradient ``-A r
    sigmoid'(tau(r-1)) 4``, which equals ``-A`` at ``r = 1``). No hard rule: ``clipped`` is 0.

    Reference: Qwen team 2025, "Soft Adaptive Policy Optimization".

    >>> import jax.numpy as jnp
    >>> loss, _ = sapo(jnp.zeros(2), jnp.zeros(2), jnp.array([1.0, -1.0]))
    >>> [round(float(x), 4) for x in loss]
    [-2.0, 1.9048]
    """
    _check([logp, old_logp, adv])
    a = _f32(adv)
    tau = jnp.where(a > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (_ratio(logp, old_logp) - 1.0)) * 4.0 / tau
    return _terms(-gate * a)


def rollout_is(
    logp: chex.Array,
    rollout_logp: chex.Array,
    adv: chex.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> PolicyLossTerms:
    """REINFORCE with a rollout importance weight that is zeroed outside a trust band.

    ``r = exp(clip(logp - rollout_logp, -20, 20))``; ``c = r`` if
    ``1 - eps_low < r < 1 + eps_high`` (open interval) else ``0`` (``clipped``);
    ``loss = -sg(c) A logp``.

    Reference: prime-rl / Liu et al. 2025, "When Speed Kills Stability" (masked IS).

    >>> import jax.numpy as jnp
    >>> loss, zeroed = rollout_is(jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.5, 0.1])), jnp.ones(2))
    >>> [round(float(x), 4) for x in loss], zeroed.tolist()
    ([0.6931, 0.0], [0.0, 1.0])
    """
    _check([logp, rollout_logp, adv])
    r = _ratio(logp, rollout_logp)
    inside = (r > 1.0 - eps_low) & (r < 1.0 + eps_high)
    c = jnp.where(inside, r, 0.0)
    return _terms(-jax.lax.stop_gradient(c) * _f32(adv) * _f32(logp), ~inside)


def importance_sampling(logp: chex.Array, old_logp: chex.Array, adv: chex.Array) -> PolicyLossTerms:
    """Unclipped importance-sampled policy gradient: ``loss = -r A``, per token (``clipped`` is 0).

    ``r = exp(clip(logp - old_logp, -20, 20))``; the gradient is ``-A r grad(logp)``.

    Reference: Sutton & Barto, "Reinforcement Learning", §5.5 (importance sampling).

    >>> import jax.numpy as jnp
    >>> out = importance_sampling(jnp.log(jnp.array([2.0])), jnp.zeros(1), jnp.ones(1))
    >>> [round(float(x), 4) for x in out.loss], out.clipped.tolist()
    ([-2.0], [0.0])
    """
    _check([logp, old_logp, adv])
    return _terms(-_ratio(logp, old_logp) * _f32(adv))


def _masked_mean(x: jax.Array, on: jax.Array) -> jax.Array:
    """Scalar mean of ``x`` over entries with ``on > 0`` (0 when there are none)."""
    return jnp.sum(jnp.where(on > 0, x, 0.0)) / jnp.maximum(jnp.sum(on), 1.0)


def _covariance(logp: chex.Array, adv: chex.Array, on: jax.Array) -> jax.Array:
    """Per-token ``(A - mean(A)) (sg(logp) - mean(sg(logp)))``, means over tokens with ``on > 0``."""
    lp = jax.lax.stop_gradient(_f32(logp))
    a = jax.lax.stop_gradient(_f32(adv))
    return (a - _masked_mean(a, on)) * (lp - _masked_mean(lp, on))


def _ranks(priority: jax.Array) -> jax.Array:
    """Rank of each entry in ascending ``priority`` over the whole array (ties: lower flat index first)."""
    flat = priority.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    ranks = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return ranks.reshape(priority.shape)


def _count(fraction: float, on: jax.Array) -> jax.Array:
    """``max(floor(fraction * #on), 1)`` in float32 (SkyRL's ``max(int(frac * n), 1)``)."""
    return jnp.maximum(jnp.floor(fraction * jnp.sum(on)), 1.0)


def _data_key(on: jax.Array, *arrays: chex.Array) -> jax.Array:
    """A PRNG key hashed from the bits of ``arrays`` on the tokens with ``on > 0`` (deterministic)."""
    pos = jnp.arange(on.size, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(1)
    keep = on.reshape(-1) > 0
    h = jnp.uint32(0x811C9DC5)
    for i, x in enumerate(arrays):
        bits = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(_f32(x)), jnp.uint32).reshape(-1)
        mixed = jnp.where(keep, bits * (pos + jnp.uint32(2 * i)), jnp.uint32(0))
        h = h * jnp.uint32(0x01000193) + jnp.sum(mixed, dtype=jnp.uint32)
    return jax.random.PRNGKey(h)


def _check_fraction(name: str, value: Any) -> None:
    if isinstance(value, (int, float)) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a fraction in [0, 1]; got {value}")


def clip_cov(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    rng: jax.Array | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> PolicyLossTerms:
    """Clip-Cov: PPO clipping plus removal of a random few high-covariance tokens, per token.

    With ``on = mask != 0`` and means over the tokens with ``on`` in the array passed in::

        cov_t    = (A_t - mean(A)) (sg(logp_t) - mean(sg(logp)))
        eligible = on and not ppo_clipped and clip_cov_lb < cov_t < clip_cov_ub
        n_clip   = max(floor(clip_ratio * sum(on)), 1)
        S        = a uniformly random subset of min(n_clip, #eligible) eligible tokens
        loss_t   = 0 if t in S else ppo_clip(logp, old_logp, A; eps_low, eps_high)_t

    ``ppo_clipped`` = the PPO clip branch is active (``A > 0, r > 1 + eps_high`` or
    ``A < 0, r < 1 - eps_low``); ``clipped`` marks those tokens and ``S``. Tokens in ``S``
    contribute neither loss nor gradient (as in SkyRL and verl, which multiply the loss by a 0/1
    correction); a large positive covariance between log-probability and advantage is what drives
    the policy entropy down, so cutting those updates keeps entropy from collapsing.

    **Randomness (Decision).** SkyRL draws ``S`` with ``torch.randperm``. Here ``S`` is the
    ``n_clip`` eligible tokens with the smallest ``uniform(key)`` draw, which is a uniform
    random subset under ``jit``. ``key`` is ``rng`` when given (the objective forwards its
    ``rng=``); with ``rng=None`` it is hashed from the bits of ``logp``, ``old_logp`` and
    ``adv`` on the tokens in ``mask``: deterministic for the same inputs (reproducible runs
    and resumes), different whenever the batch or the policy changes.

    **Batch statistics.** The means, ``sum(on)`` and the subset are taken over the array
    passed in, so with micro-batching they are per micro-batch (as in SkyRL, where they are
    per micro-batch and per worker); results then differ from one big batch.

    Reference: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models" (arXiv:2505.22617), Clip-Cov; SkyRL ``clip_cov`` policy loss
    (defaults ``clip_ratio=0.0002``, ``clip_cov_lb=1``, ``clip_cov_ub=5``, eps 0.2/0.2).

    >>> import jax.numpy as jnp
    >>> lp = jnp.log(jnp.array([0.9, 0.5, 0.5, 0.1]))   # on-policy: r = 1, no PPO clipping
    >>> adv = jnp.array([4.0, 1.0, 1.0, -4.0])          # cov = [2.95, 0.13, 0.13, 6.09]
    >>> loss, removed = clip_cov(lp, lp, adv, jnp.ones(4), clip_ratio=0.25)   # n_clip = 1: token 0
    >>> [round(float(x), 4) for x in loss], removed.tolist()
    ([0.0, -1.0, -1.0, 4.0], [1.0, 0.0, 0.0, 0.0])
    """
    _check([logp, old_logp, adv], (mask,))
    _check_fraction("clip_cov: clip_ratio", clip_ratio)
    numbers = isinstance(clip_cov_lb, (int, float)) and isinstance(clip_cov_ub, (int, float))
    if numbers and clip_cov_lb >= clip_cov_ub:
        raise ValueError(f"clip_cov needs clip_cov_lb < clip_cov_ub; got {clip_cov_lb} >= {clip_cov_ub}")
    on, a = _is_on(mask), _f32(adv)
    base, ppo_hit = _ppo_surrogate(_ratio(logp, old_logp), a, eps_low, eps_high)
    cov = _covariance(logp, a, on)
    eligible = (on > 0) & (ppo_hit == 0) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    key = _data_key(on, logp, old_logp, adv) if rng is None else rng
    u = jax.random.uniform(key, jnp.shape(cov), jnp.float32)
    removed = eligible & (_ranks(jnp.where(eligible, u, jnp.inf)) < _count(clip_ratio, on))
    return _terms(jnp.where(removed, 0.0, base), (ppo_hit > 0) | removed)


def kl_cov(
    logp: chex.Array,
    old_logp: chex.Array,
    adv: chex.Array,
    mask: chex.Array,
    *,
    kl_cov_frac: float = 0.2,
    ppo_kl_coef: float = 1.0,
) -> PolicyLossTerms:
    """KL-Cov: importance-sampled policy gradient plus a KL penalty on the highest-covariance tokens.

    With ``on = mask != 0``, means over the tokens with ``on`` in the array passed in and
    ``r = exp(clip(logp - old_logp, -20, 20))``::

        cov_t  = (A_t - mean(A)) (sg(logp_t) - mean(sg(logp)))
        k      = max(floor(kl_cov_frac * sum(on)), 1)
        top    = the k tokens with ``on`` of largest cov (ties: lower flat index first)
        loss_t = -A_t r_t + [t in top] ppo_kl_coef |logp_t - old_logp_t|

    There is no ratio clipping (``clipped`` is 0): the penalty pulls the high-covariance tokens
    (which drive the entropy down) back towards the old policy. The selection is deterministic.

    **Batch statistics.** The means, ``sum(on)`` and the top-k are taken over the array
    passed in, so with micro-batching they are per micro-batch (as in SkyRL); results then
    differ from one big batch.

    Reference: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models" (arXiv:2505.22617), KL-Cov; SkyRL ``kl_cov`` policy loss
    (defaults ``kl_cov_frac=0.2``, ``ppo_kl_coef=1``).

    >>> import jax.numpy as jnp
    >>> lp, old = jnp.log(jnp.array([0.9, 0.5, 0.5, 0.1])), jnp.log(jnp.array([0.6, 0.5, 0.5, 0.2]))
    >>> loss, _ = kl_cov(lp, old, jnp.array([4.0, 0.0, 0.0, -4.0]), jnp.ones(4), kl_cov_frac=0.25)
    >>> [round(float(x), 4) for x in loss]   # token 3 has the largest covariance: + |log(0.1/0.2)|
    [-6.0, 0.0, 0.0, 2.6931]
    """
    _check([logp, old_logp, adv], (mask,))
    _check_fraction("kl_cov: kl_cov_frac", kl_cov_frac)
    on = _is_on(mask)
    cov = _covariance(logp, adv, on)
    penalized = (on > 0) & (_ranks(jnp.where(on > 0, -cov, jnp.inf)) < _count(kl_cov_frac, on))
    pg = -_f32(adv) * _ratio(logp, old_logp)
    return _terms(pg + jnp.where(penalized, ppo_kl_coef * jnp.abs(_f32(logp) - _f32(old_logp)), 0.0))


# ------------------------------------------------------------------------------------------------
# Other components
# ------------------------------------------------------------------------------------------------


def value_loss(
    values: chex.Array,
    old_values: chex.Array,
    returns: chex.Array,
    *,
    value_clip: float | None = None,
) -> jax.Array:
    """PPO critic loss per token (the objective applies masks and normalizers).

    ``0.5 (V - R)^2``; with ``value_clip = c``, the pessimistic clipped form of PPO's value
    function (``V_c = V_old + clip(V - V_old, -c, c)``)::

        0.5 * max((V - R)^2, (V_c - R)^2)

    ``V_old`` are the critic's values at sampling time, ``R`` the GAE returns. In float32.
    Reference: Schulman et al. 2017 (PPO); the clipped form as in OpenAI baselines / verl / SkyRL.

    >>> import jax.numpy as jnp
    >>> v, old, ret = jnp.array([2.0, 0.0]), jnp.array([0.0, 0.0]), jnp.array([0.0, 1.0])
    >>> value_loss(v, old, ret).tolist(), value_loss(v, old, ret, value_clip=0.5).tolist()
    ([2.0, 0.5], [2.0, 0.5])
    """
    _check([values, old_values, returns])
    v, r = _f32(values), _f32(returns)
    loss = 0.5 * jnp.square(v - r)
    if value_clip is None:
        return loss
    _check_value_clip(value_clip)
    old = _f32(old_values)
    clipped = old + jnp.clip(v - old, -value_clip, value_clip)
    return jnp.maximum(loss, 0.5 * jnp.square(clipped - r))


def value_clipped_tokens(
    values: chex.Array, old_values: chex.Array, returns: chex.Array, *, value_clip: float | None = None
) -> jax.Array:
    """Float32 0/1 per token: the clipped branch of :func:`value_loss` is strictly larger (its
    gradient is cut). All zeros without ``value_clip``.

    >>> import jax.numpy as jnp
    >>> value_clipped_tokens(jnp.array([2.0]), jnp.array([0.0]), jnp.array([3.0]), value_clip=0.5).tolist()
    [1.0]
    """
    _check([values, old_values, returns])
    if value_clip is None:
        return jnp.zeros(jnp.shape(values), jnp.float32)
    _check_value_clip(value_clip)
    v, r, old = _f32(values), _f32(returns), _f32(old_values)
    clipped = old + jnp.clip(v - old, -value_clip, value_clip)
    return (jnp.square(clipped - r) > jnp.square(v - r)).astype(jnp.float32)


def _check_value_clip(value_clip: float) -> None:
    if isinstance(value_clip, (int, float)) and not value_clip > 0:
        raise ValueError(f"value_clip must be > 0 (or None for no clipping), got {value_clip}")


def explained_variance(values: chex.Array, returns: chex.Array, mask: chex.Array) -> jax.Array:
    """``1 - Var(R - V) / Var(R)`` over tokens with ``mask != 0`` (population variances; 0 if Var(R) = 0).

    1 = the critic predicts the returns exactly; 0 = no better than their mean; < 0 = worse.

    >>> import jax.numpy as jnp
    >>> float(explained_variance(jnp.array([1.0, 2.0]), jnp.array([1.0, 3.0]), jnp.ones(2)))
    0.75
    """
    _check([values, returns])
    m = _is_on(mask)
    n = jnp.maximum(jnp.sum(m), 1.0)
    r, v = _f32(returns), _f32(values)

    def var(x: jax.Array) -> jax.Array:
        mean = jnp.sum(x * m) / n
        return jnp.sum(jnp.square(x - mean) * m) / n

    var_r = var(r)
    return jnp.where(var_r > 0, 1.0 - var(r - v) / jnp.where(var_r > 0, var_r, 1.0), 0.0)


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
    (unbiased and non-negative), computed as ``expm1(x) - x``: ``exp(x) - 1`` in float32 cancels near
    ``x = 0`` (the on-policy tokens) and could round below zero; ``expm1(x) >= x`` rounds to a value
    ``>= x``, so the difference is never negative.

    Reference: J. Schulman 2020, "Approximating KL Divergence" (k1/k2/k3).

    >>> import jax.numpy as jnp
    >>> lp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
    >>> [round(float(kl(lp, ref, kind=k)[0]), 4) for k in ("k1", "abs", "k2", "k3")]
    [0.6931, 0.6931, 0.2402, 0.1931]
    """
    chex.assert_type([logp, ref_logp], float)
    chex.assert_equal_shape([logp, ref_logp])
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}; got {kind!r}")
    d = _f32(logp) - _f32(ref_logp)
    if kind == "k1":
        return d
    if kind == "abs":
        return jnp.abs(d)
    if kind == "k2":
        return 0.5 * jnp.square(d)
    x = jnp.clip(-d, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return jnp.clip(jnp.expm1(x) - x, -10.0, 10.0)


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
# Registry: a policy loss is a value (function + the inputs it reads + hyperparameter defaults)
# ------------------------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["logp", "old_logp", "inference_logp", "adv", "mask", "segment_ids", "rng"],
    meta_fields=["num_segments"],
)
@dataclasses.dataclass(frozen=True)
class LossInputs:
    """The uniform inputs of every registered policy loss, as one value (a pytree).

    Arrays share one shape (``[B, L]`` padded or ``[R, L]`` packed). ``num_segments`` is a
    pytree meta field, so a ``LossInputs`` passed through ``jax.jit`` keeps it static.

    Attributes:
      logp: temperature-scaled train logprobs.
      old_logp: trainer logprobs before the update.
      inference_logp: the sampler's logprobs (losses may also name them ``rollout_logp``).
      adv: per-token advantages.
      mask: trainable tokens (nonzero = trainable).
      segment_ids: int sample of each token, in ``[0, num_segments)`` (sequence-level losses).
      num_segments: static bound on ``segment_ids``.
      rng: optional PRNG key for losses that draw random numbers (``clip_cov``).

    >>> import jax.numpy as jnp
    >>> x = LossInputs(*([jnp.zeros(2)] * 5))
    >>> x.rollout_logp is x.inference_logp, x.num_segments
    (True, None)
    """

    logp: chex.Array
    old_logp: chex.Array
    inference_logp: chex.Array
    adv: chex.Array
    mask: chex.Array
    segment_ids: chex.Array | None = None
    num_segments: int | None = None
    rng: jax.Array | None = None

    @property
    def rollout_logp(self) -> chex.Array:
        """Alias of :attr:`inference_logp` (the rollout engine is the sampler)."""
        return self.inference_logp


#: The inputs a policy loss can declare: the fields of :class:`LossInputs` and ``rollout_logp``.
LOSS_INPUTS: tuple[str, ...] = (*(f.name for f in dataclasses.fields(LossInputs)), "rollout_logp")
_SEGMENT_INPUTS = ("segment_ids", "num_segments")


@dataclasses.dataclass(frozen=True, eq=False)
class InputChoice:
    """A hyperparameter that picks which uniform input fills one argument of a loss.

    Attributes:
      slot: the name of the argument in :attr:`PolicyLoss.inputs` (e.g. ``"behavior_logp"``).
      options: hyperparameter value -> uniform input of :data:`LOSS_INPUTS` that fills it.
      default: the value used when the hyperparameter is not given.

    >>> c = InputChoice("behavior_logp", {"old": "old_logp", "inference": "inference_logp"}, "old")
    >>> c.options[c.default]
    'old_logp'
    """

    slot: str
    options: Mapping[str, str]
    default: str

    def __post_init__(self) -> None:
        options = dict(self.options)
        if not options or any(v not in LOSS_INPUTS for v in options.values()):
            raise ValueError(
                f"InputChoice {self.slot!r}: options must map values to inputs of "
                f"{LOSS_INPUTS}; got {options}"
            )
        if self.default not in options:
            raise ValueError(
                f"InputChoice {self.slot!r}: default {self.default!r} is not one of {sorted(options)}"
            )
        object.__setattr__(self, "options", MappingProxyType(options))


@dataclasses.dataclass(frozen=True, eq=False)
class PolicyLoss:
    """A per-token policy loss as one value: function, the inputs it reads, hyperparameter defaults.

    Like an optax ``GradientTransformation`` bundles ``init``/``update``, a ``PolicyLoss``
    bundles everything a caller needs, so the objective, config validation and
    ``rljax.algorithms`` all read the same registration (:func:`register_policy_loss`).
    Calling it with one :class:`LossInputs` returns ``(per_token_loss, clipped)``: the loss
    shaped like ``logp`` and a float32 0/1 indicator of the tokens whose trust-region rule cut
    them (the objective's ``rl/clip_frac``), both from the one call.

    Attributes:
      fn: ``fn(*inputs, **hyperparameters)`` returning the per-token loss, or the pair
        ``(loss, clipped)`` with ``clipped`` (bool or 0/1, same shape) where the loss's clip /
        mask rule was active (e.g. :class:`PolicyLossTerms`, what every built-in returns); a
        loss that returns only the loss reports no clipped tokens. A built-in's ``fn`` is its
        public function.
      inputs: the uniform inputs ``fn`` takes positionally, in order, from
        :data:`LOSS_INPUTS` (``logp``; ``old_logp`` = trainer logprobs before the update;
        ``inference_logp`` or its alias ``rollout_logp`` = the sampler's logprobs; ``adv``;
        ``mask`` = trainable tokens; ``segment_ids``/``num_segments`` = the sample of each
        token and a static bound, for sequence-level losses; ``rng`` = an optional PRNG key,
        ``None`` unless the caller passes one), or the ``slot`` of one of ``choices``.
        ``None`` (default): the names of ``fn``'s positional parameters.
      defaults: hyperparameter name -> default; ``fn`` is always called with every one of
        them. ``None`` (default): ``fn``'s keyword-only parameters with the defaults of its
        signature, so they are declared once (:func:`rljax.core.registry.signature_parts`).
      choices: hyperparameter name -> :class:`InputChoice`, e.g. cispo's ``behavior``.
      name: set by :func:`register_policy_loss` (used in error messages).

    >>> import jax.numpy as jnp
    >>> def reinforce(logp, adv, *, scale=1.0):
    ...     return -scale * adv * logp
    >>> loss = PolicyLoss(reinforce)           # inputs ("logp", "adv"), defaults {"scale": 1.0}
    >>> lp = jnp.log(jnp.array([0.5, 0.25]))
    >>> per_token, clipped = loss(LossInputs(lp, lp, lp, jnp.ones(2), jnp.ones(2)), scale=2.0)
    >>> [round(float(x), 4) for x in per_token], clipped.tolist()
    ([1.3863, 2.7726], [0.0, 0.0])
    """

    fn: Callable[..., Any]
    inputs: tuple[str, ...] | None = None
    defaults: Mapping[str, Any] | None = None
    choices: Mapping[str, InputChoice] = dataclasses.field(default_factory=dict)
    name: str | None = None

    def __post_init__(self) -> None:
        what = f"policy loss {self.label!r}"
        if not callable(self.fn):
            raise ValueError(f"{what}: fn must be callable, got {self.fn!r}")
        if self.inputs is None or self.defaults is None:
            inputs, defaults, _ = registry.signature_parts(self.fn, what)
            if self.inputs is None and inputs is None:
                raise ValueError(f"{what}: fn takes *args, so its inputs cannot be read; declare inputs")
            object.__setattr__(self, "inputs", inputs if self.inputs is None else self.inputs)
            object.__setattr__(self, "defaults", defaults if self.defaults is None else self.defaults)
        if isinstance(self.inputs, str) or not all(isinstance(i, str) for i in self.inputs):
            raise ValueError(f"{what}: inputs must be a tuple of input names, got {self.inputs!r}")
        inputs = tuple(self.inputs)
        choices = dict(self.choices)
        for k, c in choices.items():
            if not isinstance(c, InputChoice):
                raise ValueError(f"{what}: choices[{k!r}] must be an InputChoice, got {c!r}")
        slots = {c.slot: k for k, c in choices.items()}
        unknown = [i for i in inputs if i not in LOSS_INPUTS and i not in slots]
        if unknown or len(set(inputs)) != len(inputs) or not inputs:
            raise ValueError(
                f"{what}: inputs {list(inputs)} must be distinct names from {LOSS_INPUTS} "
                f"(or the slot of a declared choice); unknown: {unknown}"
            )
        unused = sorted(s for s in slots if s not in inputs)
        if unused:
            raise ValueError(f"{what}: choice slot(s) {unused} are not among inputs {list(inputs)}")
        defaults = registry.freeze_defaults(self.defaults, what)
        clash = sorted((set(defaults) & set(choices)) | ((set(defaults) | set(choices)) & set(LOSS_INPUTS)))
        if clash:
            raise ValueError(f"{what}: hyperparameter name(s) {clash} clash with choices or input names")
        registry.check_required(what, self.fn, defaults)
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "defaults", defaults)
        object.__setattr__(self, "choices", MappingProxyType(choices))

    @property
    def label(self) -> str:
        """The loss's name in messages: its registered name, else its function's name."""
        return self.name or getattr(self.fn, "__name__", repr(self.fn))

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """Every accepted keyword with its default (``defaults`` plus each choice's default).

        >>> get_policy_loss("cispo").hyperparameters
        {'eps_low': 1.0, 'eps_high': 4.0, 'behavior': 'old'}
        """
        return {**self.defaults, **{k: c.default for k, c in self.choices.items()}}

    def resolve(self, kwargs: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        """Validates ``kwargs``; returns (hyperparameters for ``fn``, slot -> chosen uniform input).

        >>> get_policy_loss("cispo").resolve({"behavior": "inference"})
        ({'eps_low': 1.0, 'eps_high': 4.0}, {'behavior_logp': 'inference_logp'})
        """
        kw = dict(kwargs or {})
        registry.check_hyperparameters(f"policy loss {self.label!r}", kw, self.hyperparameters)
        routes = {}
        for k, c in self.choices.items():
            value = kw.pop(k, c.default)
            if not isinstance(value, str) or value not in c.options:
                raise ValueError(
                    f"policy loss {self.label!r}: {k} must be one of {tuple(c.options)} (which "
                    f"input fills {c.slot}); got {value!r}"
                )
            routes[c.slot] = c.options[value]
        return {**self.defaults, **kw}, routes

    def inputs_read(self, kwargs: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """The uniform inputs a call with ``kwargs`` reads (choices resolved; ``rollout_logp``
        spelled ``inference_logp``): e.g. whether the loss takes a ratio against the old policy
        (``old_logp``) or the sampler (``inference_logp``).

        >>> get_policy_loss("cispo").inputs_read({"behavior": "inference"})
        ('logp', 'inference_logp', 'adv')
        """
        _, routes = self.resolve(kwargs)
        names = (routes.get(i, i) for i in self.inputs)
        return tuple("inference_logp" if n == "rollout_logp" else n for n in names)

    def __call__(self, inputs: LossInputs, **kwargs: Any) -> PolicyLossTerms:
        """:class:`PolicyLossTerms` ``(per-token loss, float32 0/1 clipped)`` from ``inputs``;
        ``kwargs`` are the hyperparameters and choices (the registered defaults fill in the rest)."""
        if not isinstance(inputs, LossInputs):
            raise ValueError(f"policy loss {self.label!r} takes one LossInputs, got {type(inputs).__name__}")
        hyper, routes = self.resolve(kwargs)
        names = [routes.get(i, i) for i in self.inputs]
        segmented = inputs.segment_ids is not None and inputs.num_segments is not None
        if any(n in _SEGMENT_INPUTS for n in names) and not segmented:
            raise ValueError(
                f"policy loss {self.label!r} is sequence-level: pass segment_ids and a static num_segments"
            )
        out = self.fn(*(getattr(inputs, n) for n in names), **hyper)
        loss, clipped = out if isinstance(out, tuple) else (out, None)
        loss = jnp.asarray(loss)
        clipped = jnp.zeros(loss.shape, jnp.float32) if clipped is None else jnp.asarray(clipped) != 0
        if loss.shape != jnp.shape(inputs.logp) or clipped.shape != loss.shape:
            raise ValueError(
                f"policy loss {self.label!r} returned shapes {loss.shape} (loss) and "
                f"{clipped.shape} (clipped); both must be logp's shape {jnp.shape(inputs.logp)}"
            )
        return PolicyLossTerms(loss, clipped.astype(jnp.float32))


_POLICY_LOSSES: registry.Registry[PolicyLoss] = registry.Registry("policy loss")

POLICY_LOSSES: Mapping[str, PolicyLoss] = _POLICY_LOSSES.view
"""Read-only live view: name -> :class:`PolicyLoss` (add entries with :func:`register_policy_loss`)."""


def register_policy_loss(name: str, loss: PolicyLoss, *, overwrite: bool = False) -> PolicyLoss:
    """Registers ``loss`` under ``name`` and returns the registered value (its ``name`` set).

    Everything that accepts a built-in loss name then accepts ``name``: ``Algorithm(...,
    policy_loss=name)``, ``ObjectiveConfig(policy_loss=name)`` (its ``rl/clip_frac`` metric
    included), :func:`policy_loss`. Replacing a loss (``overwrite=True``) does not retrace a
    train step already compiled with the name.

    >>> import jax.numpy as jnp
    >>> def reinforce(logp, adv, mask, *, scale=1.0):
    ...     return -scale * adv * logp * mask, jnp.abs(adv) > 1.0   # (loss, clipped)
    >>> _ = register_policy_loss("my_reinforce", PolicyLoss(reinforce), overwrite=True)
    >>> lp = jnp.log(jnp.array([0.5, 0.5]))
    >>> inputs = LossInputs(lp, lp, lp, jnp.array([1.0, 2.0]), jnp.ones(2))
    >>> loss, clipped = policy_loss("my_reinforce", inputs)
    >>> [round(float(x), 4) for x in loss], clipped.tolist()
    ([0.6931, 1.3863], [0.0, 1.0])
    """
    if not isinstance(loss, PolicyLoss):
        raise ValueError(f"register_policy_loss expects a PolicyLoss, got {type(loss).__name__}")
    if loss.name != name:
        loss = dataclasses.replace(loss, name=name)
    return _POLICY_LOSSES.register(name, loss, overwrite=overwrite)


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered :class:`PolicyLoss` ``name`` (``ValueError`` listing the names if unknown).

    >>> get_policy_loss("ppo_clip").defaults["eps_high"]
    0.2
    """
    return _POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Registered policy loss names, sorted.

    >>> {"dppo", "clip_cov", "kl_cov"} <= set(list_policy_losses())
    True
    """
    return _POLICY_LOSSES.names()


def validate_policy_loss(name: str, kwargs: Mapping[str, Any] | None = None) -> None:
    """Raises ``ValueError`` unless ``name`` is registered and accepts ``kwargs``.

    Used at config time so a typo fails before anything is traced.

    >>> validate_policy_loss("dppo", {"kl_tau": 0.0})
    >>> validate_policy_loss("cispo", {"behavior": "inference", "eps_high": 2.0})
    """
    get_policy_loss(name).resolve(kwargs)


def policy_loss(name: str, inputs: LossInputs, **kwargs: Any) -> PolicyLossTerms:
    """Calls the registered policy loss ``name``: ``(per-token loss, clipped)``.

    Each loss receives the inputs its registration declares (:class:`PolicyLoss`); ``kwargs``
    are its hyperparameters and choices (e.g. cispo's ``behavior="inference"``); unknown
    names raise ``ValueError``. ``clipped`` is float32 0/1: where the loss's trust-region
    rule was active (PPO/GSPO clip branch taken, dual-clip bound taken, CISPO weight clipped,
    DPPO token dropped, rollout-IS weight zeroed, Clip-Cov PPO clip or covariance removal);
    zeros for ``sapo``, ``importance_sampling`` and ``kl_cov``, which have no such rule.

    >>> import jax.numpy as jnp
    >>> lp, old = jnp.log(jnp.array([0.9, 0.5])), jnp.log(jnp.array([0.5, 0.5]))
    >>> loss, clipped = policy_loss("ppo_clip", LossInputs(lp, old, old, jnp.ones(2), jnp.ones(2)))
    >>> [round(float(x), 4) for x in loss], clipped.tolist()
    ([-1.2, -1.0], [1.0, 0.0])
    """
    return get_policy_loss(name)(inputs, **kwargs)


_BEHAVIOR = InputChoice("behavior_logp", {"old": "old_logp", "inference": "inference_logp"}, "old")

# Inputs and defaults come from each function's signature (design §3.6b), the one place they are
# written: the same idiom as the estimators' registry (rljax.core.advantages).
for _name, _loss in {
    "ppo_clip": PolicyLoss(ppo_clip),
    "dual_clip": PolicyLoss(dual_clip),
    "gspo": PolicyLoss(gspo),
    "cispo": PolicyLoss(cispo, choices={"behavior": _BEHAVIOR}),
    "dppo": PolicyLoss(dppo),
    "sapo": PolicyLoss(sapo),
    "rollout_is": PolicyLoss(rollout_is),
    "importance_sampling": PolicyLoss(importance_sampling),
    "clip_cov": PolicyLoss(clip_cov),
    "kl_cov": PolicyLoss(kl_cov),
}.items():
    register_policy_loss(_name, _loss)
del _name, _loss
