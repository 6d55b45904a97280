"""Off-policy correction between the trainer's old policy and the rollout engine (design §3.4).

With ``rho_t = exp(clip(old_logp_t - rollout_logp_t, -20, 20))`` (per token) and the
sequences given by ``segment_ids`` (the sample each token belongs to), :func:`correct`
applies, in this order, each stage only if configured:

0. stale token mask: keep a token only if ``staleness <= max_token_staleness``, where
   ``staleness = trained_version - token_version`` is how many weight updates separate the weights
   that sampled the token from the weights being trained (per token: one turn that an in-flight
   weight update crossed has tokens of several versions; ``PackedBatch.token_staleness``);
1. outlier sequence reject: a sequence with ANY trainable token ``rho > hi`` or
   ``rho < lo`` is masked entirely (``outlier_token_is_threshold_low/high``);
2. token mask: keep a token only if ``lo <= rho <= hi`` (``token_mask_is_threshold_low/high``);
3. truncated importance sampling (TIS), the loss is multiplied by
   ``sg(min(rho, C))`` (``tis_ratio_type="token"``, C = ``token_tis_ratio_clip_high``) or by
   the sequence weight ``sg(min(exp(sum_masked(old - rollout)), C))``
   (``"sequence"``, C = ``sequence_tis_ratio_clip_high``);
4. sequence mask: keep a sequence only if ``exp(mean_masked(old - rollout))`` is in
   ``[geo_mask_low, geo_mask_high]`` (``sequence_mask_metric="geometric"``) or
   ``exp(sum_masked(old - rollout))`` is in ``[product_mask_low, product_mask_high]``
   (``"product"``).

Stages 1-4 use the mask left by the earlier stages. Every ratio is per token against the logprob
the engine reported for that token, i.e. under the weights of that token's own version, so TIS, the
masks and the dppo trust region (:func:`rljax.core.losses.dppo`) compare each token with the policy
that actually sampled it, also inside a turn that spans several versions. Field names and defaults
follow SkyRL's ``off_policy_correction`` config (``max_token_staleness`` is rljax's); a threshold set
to ``None`` disables that side.

References: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (TIS); Liu, Li et al. 2025, "When Speed Kills Stability" (masked / geometric IS).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import chex
import jax
import jax.numpy as jnp

from rljax import knobs
from rljax.core import segments
from rljax.core.losses import LOG_RATIO_CLIP
from rljax.knobs import knob

_OPTIONAL_THRESHOLDS = (
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
)
_TIS_TYPES = (None, "token", "sequence")
_SEQUENCE_METRICS = (None, "geometric", "product")


@knobs.section
class OffPolicyConfig:
    """The off-policy correction's keys (module docstring): SkyRL's names and defaults
    (``max_token_staleness`` is rljax's); a stage whose switch or bounds are None is off."""

    tis_ratio_type: str | None = knob(
        None,
        choices=_TIS_TYPES,
        doc="truncated importance sampling: ``token`` weighs each token by "
        "``min(rho, token_tis_ratio_clip_high)``, ``sequence`` each sequence by "
        "``min(exp(sum log rho), sequence_tis_ratio_clip_high)``; None: off",
    )
    token_tis_ratio_clip_high: float = knob(2.0, gt=0, doc="the cap of token TIS weights")
    sequence_tis_ratio_clip_high: float = knob(5.0, gt=0, doc="the cap of sequence TIS weights")
    sequence_mask_metric: str | None = knob(
        None,
        choices=_SEQUENCE_METRICS,
        doc="sequence mask: keep a sequence whose ``geometric`` mean "
        "(or ``product``) of rho is within its bounds; None: off",
    )
    geo_mask_low: float = knob(0.99, gt=0, doc="lower bound of the geometric sequence mask")
    geo_mask_high: float = knob(1.01, gt=0, doc="upper bound of the geometric sequence mask")
    product_mask_low: float = knob(0.5, gt=0, doc="lower bound of the product sequence mask")
    product_mask_high: float = knob(2.0, gt=0, doc="upper bound of the product sequence mask")
    outlier_token_is_threshold_low: float | None = knob(
        None,
        gt=0,
        doc="a sequence with any trainable token's rho below this is masked whole (None: no bound)",
    )
    outlier_token_is_threshold_high: float | None = knob(
        None,
        gt=0,
        doc="a sequence with any trainable token's rho above this is masked whole (None: no bound)",
    )
    token_mask_is_threshold_low: float | None = knob(
        None, gt=0, doc="a token whose rho is below this is masked (None: no bound)"
    )
    token_mask_is_threshold_high: float | None = knob(
        None, gt=0, doc="a token whose rho is above this is masked (None: no bound)"
    )
    max_token_staleness: int | None = knob(
        None,
        ge=0,
        doc="keep a token only if at most this many weight updates separate the weights that "
        "sampled it from the weights trained (None: off)",
    )

    def __post_init__(self) -> None:
        staleness = self.max_token_staleness
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int)):
            raise ValueError(
                f"OffPolicyConfig.max_token_staleness: expected an int >= 0 or None, got {staleness!r}"
            )
        for low, high in (
            ("geo_mask_low", "geo_mask_high"),
            ("product_mask_low", "product_mask_high"),
            _OPTIONAL_THRESHOLDS[:2],
            _OPTIONAL_THRESHOLDS[2:],
        ):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(
                    f"OffPolicyConfig.{low}: off-policy correction needs {low} <= {high}; got {lo} > {hi}"
                )


DEFAULT_CONFIG: Mapping[str, Any] = MappingProxyType(dataclasses.asdict(OffPolicyConfig()))
"""Every accepted key with its default (:class:`OffPolicyConfig`'s fields)."""

METRIC_NAMES: tuple[str, ...] = (
    "is_ratio_mean",
    "is_ratio_max",
    "stale_masked_frac",
    "outlier_masked_frac",
    "token_masked_frac",
    "tis_clipped_frac",
    "sequence_masked_frac",
    "masked_frac",
)
"""Keys of the metrics dict :func:`correct` returns (always all of them; 0 for stages that are off).
Each is a count over tokens divided by the normalizer (additive over micro-batches), except
``is_ratio_max``: the largest ``rho`` of a trainable token (micro-batches combine it by ``max``)."""


def resolve_config(config: Any) -> dict[str, Any]:
    """Returns the full off-policy config: ``DEFAULT_CONFIG`` updated with ``config``.

    ``config`` is ``None``, an :class:`OffPolicyConfig`, a mapping, an ``ml_collections.ConfigDict``
    (anything with ``to_dict``) or a sequence of ``(key, value)`` pairs. Unknown keys and invalid
    values raise ``ValueError``.

    >>> resolve_config({"tis_ratio_type": "token"})["token_tis_ratio_clip_high"]
    2.0
    """
    if isinstance(config, OffPolicyConfig):
        return dataclasses.asdict(config)
    if config is None:
        items: dict[str, Any] = {}
    elif hasattr(config, "to_dict"):
        items = dict(config.to_dict())
    else:
        items = dict(config.items() if isinstance(config, Mapping) else config)
    unknown = sorted(set(items) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(
            f"unknown off-policy correction keys {unknown}; valid keys are {sorted(DEFAULT_CONFIG)}"
        )
    return dataclasses.asdict(OffPolicyConfig(**items))


def is_enabled(config: Any) -> bool:
    """True when any stage of :func:`correct` is configured.

    >>> is_enabled({}), is_enabled({"sequence_mask_metric": "geometric"})
    (False, True)
    """
    cfg = resolve_config(config)
    return (
        cfg["tis_ratio_type"] is not None
        or cfg["sequence_mask_metric"] is not None
        or cfg["max_token_staleness"] is not None
        or any(cfg[k] is not None for k in _OPTIONAL_THRESHOLDS)
    )


def ratio_stages(config: Any) -> tuple[str, ...]:
    """The configured stages that read ``rho = old / rollout`` (every stage but the stale token
    mask), as ``key=value`` strings: each is a no-op when the old logprobs ARE the rollout ones.

    >>> ratio_stages({"tis_ratio_type": "token", "max_token_staleness": 1})
    ("tis_ratio_type='token'",)
    """
    cfg = resolve_config(config)
    keys = ("tis_ratio_type", "sequence_mask_metric", *_OPTIONAL_THRESHOLDS)
    return tuple(f"{k}={cfg[k]!r}" for k in keys if cfg[k] is not None)


def _outside(x: jax.Array, low: float | None, high: float | None) -> jax.Array:
    """Boolean ``x < low or x > high``; a ``None`` bound is open."""
    out = jnp.zeros(x.shape, bool)
    if low is not None:
        out = out | (x < low)
    if high is not None:
        out = out | (x > high)
    return out


def correct(
    loss: chex.Array,
    old_logp: chex.Array,
    rollout_logp: chex.Array,
    mask: chex.Array,
    segment_ids: chex.Array,
    num_segments: int,
    config: Any,
    *,
    normalizer: chex.Numeric | None = None,
    staleness: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Applies the configured off-policy correction (module docstring) to a per-token loss.

    Args:
      loss: per-token loss, any shape.
      old_logp: trainer logprobs before the update (same shape).
      rollout_logp: logprobs reported by the rollout engine (same shape).
      mask: trainable tokens (nonzero = trainable).
      segment_ids: int sequence id of each token, in ``[0, num_segments)``.
      num_segments: static bound on the number of sequences.
      config: static off-policy config (see :func:`resolve_config`).
      normalizer: denominator of the metrics; default the number of tokens in ``mask``.
        Passing a global token count makes the metrics additive over micro-batches.
      staleness: int ``trained_version - token_version`` per token (same shape); needed by the
        stale token mask (``max_token_staleness``), ignored otherwise.

    Returns:
      ``(loss * tis_weight, new_mask, metrics)``: the new mask is float32 0/1 and a subset
      of ``mask``; metrics (:data:`METRIC_NAMES`) are token counts divided by the normalizer:
      ``is_ratio_mean`` sums ``rho`` over ``mask``; ``*_masked_frac`` count tokens each stage
      removed; ``tis_clipped_frac`` counts surviving tokens whose TIS weight hit its cap;
      ``is_ratio_max`` is the largest ``rho`` over ``mask`` (0 when it is empty), not normalized.

    >>> import jax.numpy as jnp
    >>> old, roll = jnp.log(jnp.array([.5, .5, .5])), jnp.log(jnp.array([.5, .1, .5]))
    >>> loss, m, met = correct(jnp.ones(3), old, roll, jnp.ones(3), jnp.array([0, 0, 1]), 2,
    ...                        {"outlier_token_is_threshold_high": 3.0})
    >>> [float(x) for x in m], round(float(met["outlier_masked_frac"]), 4)
    ([0.0, 0.0, 1.0], 0.6667)
    """
    cfg = resolve_config(config)
    chex.assert_type([loss, old_logp, rollout_logp], float)
    chex.assert_equal_shape([loss, old_logp, rollout_logp, mask, segment_ids])
    ids = jnp.asarray(segment_ids)
    m0 = (jnp.asarray(mask) != 0).astype(jnp.float32)
    log_rho = jnp.asarray(old_logp, jnp.float32) - jnp.asarray(rollout_logp, jnp.float32)
    log_rho = jnp.clip(log_rho, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    rho = jnp.exp(log_rho)
    zero = jnp.zeros((), jnp.float32)

    # (0) stale token mask.
    ms, removed_stale = m0, zero
    if cfg["max_token_staleness"] is not None:
        if staleness is None:
            raise ValueError(
                "off-policy correction max_token_staleness needs the per-token staleness "
                "(PackedBatch.token_staleness: rljax.data.pack.with_token_staleness(batch, trained_version))"
            )
        chex.assert_equal_shape([staleness, mask])
        ms = m0 * (jnp.asarray(staleness) <= cfg["max_token_staleness"]).astype(jnp.float32)
        removed_stale = jnp.sum(m0 - ms)

    # (1) outlier sequence reject.
    m1, removed_outlier = ms, zero
    low, high = cfg["outlier_token_is_threshold_low"], cfg["outlier_token_is_threshold_high"]
    if low is not None or high is not None:
        bad = segments.segment_sum(ms * _outside(rho, low, high), ids, num_segments) > 0
        m1 = ms * (1.0 - segments.segment_gather(bad, ids).astype(jnp.float32))
        removed_outlier = jnp.sum(ms - m1)

    # (2) token mask.
    m2, removed_token = m1, zero
    low, high = cfg["token_mask_is_threshold_low"], cfg["token_mask_is_threshold_high"]
    if low is not None or high is not None:
        m2 = m1 * (1.0 - _outside(rho, low, high).astype(jnp.float32))
        removed_token = jnp.sum(m1 - m2)

    seq_log_rho = segments.segment_sum(log_rho * m2, ids, num_segments)

    # (3) truncated importance sampling weight.
    weight, clipped = jnp.ones_like(rho), zero
    if cfg["tis_ratio_type"] == "token":
        cap = cfg["token_tis_ratio_clip_high"]
        weight, clipped = jnp.minimum(rho, cap), jnp.sum(m2 * (rho > cap))
    elif cfg["tis_ratio_type"] == "sequence":
        cap = cfg["sequence_tis_ratio_clip_high"]
        seq_log_rho_clipped = jnp.clip(seq_log_rho, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        seq_rho = segments.segment_gather(jnp.exp(seq_log_rho_clipped), ids)
        weight, clipped = jnp.minimum(seq_rho, cap), jnp.sum(m2 * (seq_rho > cap))
    out_loss = jnp.asarray(loss, jnp.float32) * jax.lax.stop_gradient(weight)

    # (4) sequence mask.
    m3, removed_seq = m2, zero
    metric = cfg["sequence_mask_metric"]
    if metric is not None:
        if metric == "geometric":
            count = segments.segment_sum(m2, ids, num_segments)
            stat, low, high = seq_log_rho / jnp.maximum(count, 1.0), cfg["geo_mask_low"], cfg["geo_mask_high"]
        else:
            stat, low, high = seq_log_rho, cfg["product_mask_low"], cfg["product_mask_high"]
        seq_ratio = jnp.exp(jnp.clip(stat, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))
        m3 = m2 * (1.0 - segments.segment_gather(_outside(seq_ratio, low, high), ids).astype(jnp.float32))
        removed_seq = jnp.sum(m2 - m3)

    denom = jnp.sum(m0) if normalizer is None else jnp.asarray(normalizer, jnp.float32)
    counts = {
        "is_ratio_mean": jnp.sum(rho * m0),
        "stale_masked_frac": removed_stale,
        "outlier_masked_frac": removed_outlier,
        "token_masked_frac": removed_token,
        "tis_clipped_frac": clipped,
        "sequence_masked_frac": removed_seq,
        "masked_frac": jnp.sum(m0 - m3),
    }
    metrics = {k: jax.lax.stop_gradient(segments.safe_div(v, denom)) for k, v in counts.items()}
    metrics["is_ratio_max"] = jax.lax.stop_gradient(jnp.max(jnp.where(m0 > 0, rho, 0.0), initial=0.0))
    return out_loss, m3, metrics
