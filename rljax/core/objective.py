"""The exact per-mini-batch training objective (design §3.5).

For components ``c`` in ``(rl, ce, ref_kl)`` with raw per-token weights ``v_c`` and
per-token losses ``l_c``::

    loss = sum_c sum_t w_{c,t} l_{c,t},     w_{c,t} = v_{c,t} / D_{c,t}

* ``v_rl = rl_weights * loss_mask`` (times the off-policy mask when configured),
  ``l_rl`` = the configured policy loss (times the off-policy TIS weight);
* ``v_ce = ce_weights * loss_mask``, ``l_ce = -logp``;
* ``v_ref_kl = ref_kl_weights * loss_mask``, ``l_ref_kl`` = :func:`rljax.core.losses.ref_kl`.

With ``kl_coef > 0`` a KL penalty to a frozen reference policy joins the rl term on the same
weights: ``+ kl_coef * sum_t w_{rl,t} kl(logp_t, ref_t)`` with the configured estimator
(:func:`rljax.core.losses.kl`, ``batch.kl_reference_logprobs``); it is not multiplied by the TIS
weight (verl's ``use_kl_loss``, SkyRL's ``use_kl_loss``).

The normalizer ``D`` (the reduction) uses GLOBAL counts over the whole mini-batch (all
micro-batches, all devices), computed once by :func:`global_counts` and passed in. With
``n`` = tokens with ``v != 0``, ``S`` = samples with at least one such token, ``len_j`` =
such tokens in sample ``j``, ``P`` = prompt groups with at least one, ``n_g`` = such tokens
in group ``g``:

* ``token_mean`` (default): ``D = n``;
* ``sequence_mean``: ``D = S * len_j`` (each sample weighs equally);
* ``seq_mean_token_sum_norm``: ``D = S * max_len`` (Dr. GRPO, Liu et al. 2025);
* ``prompt_mean``: ``D = P * n_g`` (each prompt group weighs equally, tokens equally
  within a group; needs ``num_groups``).

Every count is a sum over samples or tokens, and a sample never spans rows, so summing the
objective (and its gradient) over any split of the rows into micro-batches gives exactly
the objective of the whole mini-batch. A component with no weighted token contributes 0.

Samples are identified by ``(row, segment_ids)``: ``segment_ids`` are 1..k per sample in a
row (0 = padding), so no static bound on the number of samples is needed.

Temperature: ``logp`` must already be temperature-scaled (the model divides logits by
``batch.temperatures`` before the log-softmax, as the sampler did); ``batch.temperatures``
is not read here.

The batch is any object with the attribute names of ``rljax.types.PackedBatch`` (this
module does not import it); all arrays are ``[R, L]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp

from rljax.core import losses, off_policy, segments

#: The objective's per-token terms: the policy loss, cross-entropy, the KL to a reference.
COMPONENTS: tuple[str, ...] = ("rl", "ce", "ref_kl")
#: Metrics of :func:`objective` that are maxima, not additive: micro-batches and mini-batches combine
#: them with ``max`` (:func:`combine_metrics`).
MAX_METRICS: tuple[str, ...] = ("off_policy/is_ratio_max",)
#: How per-token losses reduce to a scalar (design §3.5; ``config.objective.reduction``).
REDUCTIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")


def _as_pairs(value: Any, what: str) -> tuple[tuple[str, Any], ...]:
    """Mapping / ConfigDict / pairs -> sorted tuple of pairs (hashable)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    items = dict(value.items() if isinstance(value, Mapping) else value)
    pairs = tuple(sorted(items.items()))
    try:
        hash(pairs)
    except TypeError as e:
        raise ValueError(f"{what} values must be hashable (numbers, strings, None); got {items}") from e
    return pairs


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Static configuration of :func:`objective` (hashable: usable as a jit static argument).

    Attributes:
      policy_loss: a registered policy loss (:func:`rljax.core.losses.register_policy_loss`,
        built-ins in :data:`rljax.core.losses.POLICY_LOSSES`; default ``"dppo"``).
      policy_loss_kwargs: hyperparameters (and input choices, e.g. cispo's ``behavior``) of
        the policy loss, a mapping or ``(key, value)`` pairs (stored as sorted pairs);
        checked against its registration.
      reduction: one of :data:`REDUCTIONS`.
      max_len: the constant of ``seq_mean_token_sum_norm`` (required for it).
      off_policy: off-policy correction config (mapping, ConfigDict or pairs; see
        :func:`rljax.core.off_policy.resolve_config`) or None.
      entropy_coef: entropy bonus ``-coef * sum_t w_rl,t H_t``; needs ``entropy=``.
      num_groups: static bound on ``group_index`` (required for ``prompt_mean``).
      components: the components this objective trains (subset of :data:`COMPONENTS`). A
        component left out is skipped entirely (no per-token work; its loss, metrics and
        counts are 0) even if the batch carries a weight stream for it, so e.g. a grpo run
        pays nothing for the packer's all-zero ce/ref_kl streams.
      kl_coef: weight of the KL penalty to a frozen reference policy on rl tokens (0 = none; needs
        ``batch.kl_reference_logprobs``).
      kl_kind: its per-token estimator: ``k1``, ``abs``, ``k2`` or ``k3`` (:func:`rljax.core.losses.kl`).

    >>> ObjectiveConfig(policy_loss_kwargs={"kl_tau": 0.0}).policy_loss_kwargs
    (('kl_tau', 0.0),)
    """

    policy_loss: str = "dppo"
    policy_loss_kwargs: Any = ()
    reduction: str = "token_mean"
    max_len: int | None = None
    off_policy: Any = None
    entropy_coef: float = 0.0
    num_groups: int | None = None
    components: tuple[str, ...] = COMPONENTS
    kl_coef: float = 0.0
    kl_kind: str = "k3"

    def __post_init__(self) -> None:
        components = tuple(self.components)
        unknown = [c for c in components if c not in COMPONENTS]
        if unknown or not components:
            raise ValueError(f"components must be a non-empty subset of {COMPONENTS}; got {components}")
        object.__setattr__(self, "components", tuple(c for c in COMPONENTS if c in components))
        kwargs = _as_pairs(self.policy_loss_kwargs, "policy_loss_kwargs")
        object.__setattr__(self, "policy_loss_kwargs", kwargs)
        losses.validate_policy_loss(self.policy_loss, dict(kwargs))
        if self.off_policy is not None:
            pairs = _as_pairs(self.off_policy, "off_policy")
            off_policy.resolve_config(pairs)
            object.__setattr__(self, "off_policy", pairs if off_policy.is_enabled(pairs) else None)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}; got {self.reduction!r}")
        if self.reduction == "seq_mean_token_sum_norm" and not (
            isinstance(self.max_len, int) and self.max_len > 0
        ):
            raise ValueError(
                f"reduction 'seq_mean_token_sum_norm' needs max_len, a positive int (the "
                f"normalizing length); got {self.max_len!r}"
            )
        if self.num_groups is not None and not (isinstance(self.num_groups, int) and self.num_groups > 0):
            raise ValueError(f"num_groups must be a positive int or None; got {self.num_groups!r}")
        if self.reduction == "prompt_mean" and self.num_groups is None:
            raise ValueError(
                "reduction 'prompt_mean' needs num_groups, a static bound on batch.group_index + 1"
            )
        if isinstance(self.kl_coef, bool) or not isinstance(self.kl_coef, (int, float)) or self.kl_coef < 0:
            raise ValueError(f"kl_coef must be a number >= 0 (0 = no KL penalty); got {self.kl_coef!r}")
        if self.kl_kind not in losses.KL_KINDS:
            raise ValueError(f"kl_kind must be one of {losses.KL_KINDS}; got {self.kl_kind!r}")


def old_policy_readers(config: ObjectiveConfig) -> tuple[str, ...]:
    """What in ``config`` reads the old (proximal) policy's logprobs (``batch.old_logprobs``), in words;
    empty when nothing does. The policy loss does when one of its inputs is ``old_logp`` (ppo_clip,
    dual_clip, gspo, sapo, cispo with ``behavior="old"``, ...), and so does every off-policy stage
    that weighs ``old / rollout`` (design §3.4). Without an rl component nothing does.

    >>> old_policy_readers(ObjectiveConfig(policy_loss="ppo_clip"))
    ("policy loss 'ppo_clip' (its ratio and clip)",)
    >>> old_policy_readers(ObjectiveConfig())   # dppo compares with the sampler by design
    ()
    """
    if "rl" not in config.components:
        return ()
    out = []
    inputs = losses.get_policy_loss(config.policy_loss).inputs_read(dict(config.policy_loss_kwargs))
    if "old_logp" in inputs:
        out.append(f"policy loss {config.policy_loss!r} (its ratio and clip)")
    if config.off_policy is not None:
        out += [f"off-policy correction {k}" for k in off_policy.ratio_stages(config.off_policy)]
    return tuple(out)


def rollout_logprob_readers(config: ObjectiveConfig, *, old_from_rollout: bool) -> tuple[str, ...]:
    """What in ``config`` reads the sampler's logprobs (``batch.inference_logprobs``), in words; a
    sample without them cannot be trained by such an objective. ``old_from_rollout``: the old
    logprobs are the sampler's (not recomputed), so their readers count too.

    >>> rollout_logprob_readers(ObjectiveConfig(components=("rl",)), old_from_rollout=False)
    ("policy loss 'dppo'",)
    >>> ppo = ObjectiveConfig(policy_loss="ppo_clip", components=("rl",))
    >>> rollout_logprob_readers(ppo, old_from_rollout=False)
    ()
    >>> rollout_logprob_readers(ppo, old_from_rollout=True)
    ("policy loss 'ppo_clip' (its ratio and clip)",)
    """
    out = []
    if "rl" in config.components:
        inputs = losses.get_policy_loss(config.policy_loss).inputs_read(dict(config.policy_loss_kwargs))
        if "inference_logp" in inputs:
            out.append(f"policy loss {config.policy_loss!r}")
        if config.off_policy is not None:
            out += [f"off-policy correction {k}" for k in off_policy.ratio_stages(config.off_policy)]
    if old_from_rollout:
        out += [r for r in old_policy_readers(config) if r not in out and not r.startswith("off-policy")]
    if "ref_kl" in config.components:
        out.append("the ref_kl component (its trust region against the sampler)")
    return tuple(out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counts:
    """Global normalizing counts of one mini-batch (float32; a pytree). All fields are sums
    over tokens or samples, so ``Counts`` of disjoint row sets add up (``a + b``).

    Attributes:
      tokens: ``[3]`` tokens with nonzero weight per component (:data:`COMPONENTS` order);
        rl after the off-policy masks.
      sequences: ``[3]`` samples with at least one such token.
      group_tokens: ``[3, num_groups]`` such tokens per prompt group (``[3, 0]`` without
        ``num_groups``).
      rl_candidate_tokens: rl tokens before the off-policy masks.
      loss_tokens: tokens with ``loss_mask != 0``.

    >>> import numpy as np
    >>> c = Counts(np.array([2., 0, 1]), np.array([1., 0, 1]), np.zeros((3, 0)), np.float32(2), np.float32(3))
    >>> (c + c).tokens.tolist(), float((c + c).loss_tokens)
    ([4.0, 0.0, 2.0], 6.0)
    """

    tokens: jax.Array
    sequences: jax.Array
    group_tokens: jax.Array
    rl_candidate_tokens: jax.Array
    loss_tokens: jax.Array

    def __add__(self, other: Counts) -> Counts:
        return jax.tree.map(jnp.add, self, other)


# ------------------------------------------------------------------------------------------------
# Batch access
# ------------------------------------------------------------------------------------------------


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _sample_keys(segment_ids: chex.Array) -> tuple[jax.Array, int]:
    """Dense sample key ``row * (L + 1) + segment_id`` and its static bound."""
    seg = jnp.asarray(segment_ids).astype(jnp.int32)
    rows, length = seg.shape
    return jnp.arange(rows, dtype=jnp.int32)[:, None] * (length + 1) + seg, rows * (length + 1)


def _required(batch: Any, name: str, why: str) -> jax.Array:
    value = getattr(batch, name, None)
    if value is None:
        raise ValueError(f"batch.{name} is None but {why}")
    return jnp.asarray(value)


def _raw_weights(batch: Any, config: ObjectiveConfig) -> dict[str, jax.Array | None]:
    """``v_c = weights_c * loss_mask`` (rl before off-policy masks; absent rl weights = 1).

    A component is inactive (``None``) when the config leaves it out, or (ce, ref_kl) when the
    batch carries no weight stream for it.
    """
    mask = _f32(_required(batch, "loss_mask", "the objective needs the loss mask"))
    chex.assert_rank(mask, 2)
    out: dict[str, jax.Array | None] = {}
    for c, default in (("rl", 1.0), ("ce", None), ("ref_kl", None)):
        w = getattr(batch, f"{c}_weights", None)
        if c not in config.components or (w is None and default is None):
            out[c] = None
            continue
        out[c] = mask * (default if w is None else _f32(w))
        chex.assert_equal_shape([out[c], mask])
    return out


def _logprob_streams(batch: Any) -> tuple[jax.Array, jax.Array]:
    """(old_logprobs, inference_logprobs); missing old logprobs fall back to inference ones."""
    inference = _required(batch, "inference_logprobs", "policy losses, ref_kl and metrics need it")
    old = getattr(batch, "old_logprobs", None)
    return (inference if old is None else jnp.asarray(old)), inference


def _rl_correction(
    loss: jax.Array, batch: Any, candidates: jax.Array, config: ObjectiveConfig, normalizer: Any
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Off-policy correction of the rl loss (identity when not configured)."""
    if config.off_policy is None:
        return loss, candidates, {}
    old, inference = _logprob_streams(batch)
    keys, num = _sample_keys(batch.segment_ids)
    return off_policy.correct(
        loss, old, inference, candidates, keys, num, config.off_policy, normalizer=normalizer,
        staleness=getattr(batch, "token_staleness", None),
    )  # fmt: skip


def _check_group_index(group_index: jax.Array, weighted: jax.Array, num_groups: int) -> None:
    """Host-side range check of ``group_index`` (skipped under tracing)."""
    if isinstance(group_index, jax.core.Tracer) or isinstance(weighted, jax.core.Tracer):
        return
    used = group_index[weighted]
    if used.size and (int(used.min()) < 0 or int(used.max()) >= num_groups):
        raise ValueError(
            f"batch.group_index must lie in [0, num_groups={num_groups}) on weighted tokens; got range "
            f"[{int(used.min())}, {int(used.max())}]; raise ObjectiveConfig.num_groups"
        )


# ------------------------------------------------------------------------------------------------
# Counts and weights
# ------------------------------------------------------------------------------------------------


def global_counts(batch: Any, config: ObjectiveConfig) -> Counts:
    """Normalizing counts of ``batch`` for ``config`` (see :class:`Counts`).

    Call it on the whole mini-batch (host or jit, any device layout), or on each
    micro-batch and add the results: both give the same :class:`Counts`.

    >>> import numpy as np
    >>> from types import SimpleNamespace
    >>> one = np.ones((1, 4), np.float32)
    >>> b = SimpleNamespace(loss_mask=np.array([[0, 1, 1, 1]]), segment_ids=np.array([[1, 1, 2, 2]]),
    ...                     rl_weights=one, ce_weights=None, ref_kl_weights=None, group_index=0 * one,
    ...                     inference_logprobs=-one, old_logprobs=-one)
    >>> c = global_counts(b, ObjectiveConfig())
    >>> c.tokens.tolist(), c.sequences.tolist()
    ([3.0, 0.0, 0.0], [2.0, 0.0, 0.0])
    """
    raw = _raw_weights(batch, config)
    keys, num = _sample_keys(_required(batch, "segment_ids", "samples are identified by segment ids"))
    none = jnp.zeros(keys.shape, bool)
    candidates = none if raw["rl"] is None else raw["rl"] != 0
    _, rl_mask, _ = _rl_correction(jnp.zeros(keys.shape, jnp.float32), batch, candidates, config, None)
    nonzero = {"rl": candidates & (rl_mask != 0)}
    nonzero.update({c: none if raw[c] is None else raw[c] != 0 for c in ("ce", "ref_kl")})
    stacked = jnp.stack([nonzero[c].astype(jnp.float32) for c in COMPONENTS])  # [3, R, L]
    per_sample = jax.vmap(lambda x: segments.segment_sum(x, keys, num))(stacked)
    if config.num_groups is None:
        group_tokens = jnp.zeros((len(COMPONENTS), 0), jnp.float32)
    else:
        group_index = _required(batch, "group_index", "num_groups is set").astype(jnp.int32)
        _check_group_index(group_index, jnp.any(stacked != 0, axis=0), config.num_groups)
        group_tokens = jax.vmap(lambda x: segments.segment_sum(x, group_index, config.num_groups))(stacked)
    return Counts(
        tokens=jnp.sum(stacked, axis=(1, 2)),
        sequences=jnp.sum((per_sample > 0).astype(jnp.float32), axis=1),
        group_tokens=group_tokens,
        rl_candidate_tokens=jnp.sum(candidates.astype(jnp.float32)),
        loss_tokens=jnp.sum((jnp.asarray(batch.loss_mask) != 0).astype(jnp.float32)),
    )


def normalized_weights(
    raw: jax.Array, component: str, batch: Any, counts: Counts, config: ObjectiveConfig
) -> jax.Array:
    """Per-token weights ``w = v / D`` of one component for ``config.reduction``.

    ``raw`` is the component's raw weight ``v`` (``[R, L]``); see the module docstring for
    ``D``. Tokens whose ``D`` is 0 (no weighted token anywhere) get weight 0.

    >>> import numpy as np
    >>> from types import SimpleNamespace
    >>> b = SimpleNamespace(segment_ids=np.array([[1, 1, 1, 2]]))
    >>> c = Counts(tokens=np.array([4., 0, 0]), sequences=np.array([2., 0, 0]),
    ...            group_tokens=np.zeros((3, 0)), rl_candidate_tokens=4., loss_tokens=4.)
    >>> w = normalized_weights(np.ones((1, 4)), "rl", b, c, ObjectiveConfig(reduction="sequence_mean"))
    >>> [round(float(x), 4) for x in w[0]]
    [0.1667, 0.1667, 0.1667, 0.5]
    """
    chex.assert_rank(raw, 2)
    i = COMPONENTS.index(component)
    v = _f32(raw)
    nonzero = (v != 0).astype(jnp.float32)
    if config.reduction == "token_mean":
        den = jnp.broadcast_to(_f32(counts.tokens)[i], v.shape)
    elif config.reduction == "prompt_mean":
        group_tokens = _f32(counts.group_tokens)[i]
        n_prompts = jnp.sum((group_tokens > 0).astype(jnp.float32))
        group_index = jnp.asarray(batch.group_index).astype(jnp.int32)
        den = n_prompts * segments.segment_gather(group_tokens, group_index)
    else:
        n_seq = _f32(counts.sequences)[i]
        if config.reduction == "seq_mean_token_sum_norm":
            den = jnp.broadcast_to(n_seq * float(config.max_len), v.shape)
        else:  # sequence_mean
            keys, num = _sample_keys(batch.segment_ids)
            den = n_seq * segments.segment_gather(segments.segment_sum(nonzero, keys, num), keys)
    return segments.safe_div(v, den) * nonzero


# ------------------------------------------------------------------------------------------------
# Objective
# ------------------------------------------------------------------------------------------------


def _weighted_sum(w: jax.Array, loss: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(w != 0, w * loss, 0.0))


def combine_metrics(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The metrics of two disjoint parts of a mini-batch as one: sums, except :data:`MAX_METRICS`.

    >>> out = combine_metrics({"loss": 1.0, "off_policy/is_ratio_max": 2.0},
    ...                       {"loss": 0.5, "off_policy/is_ratio_max": 1.5})
    >>> {k: float(v) for k, v in out.items()}
    {'loss': 1.5, 'off_policy/is_ratio_max': 2.0}
    """
    return {k: (jnp.maximum(a[k], b[k]) if k in MAX_METRICS else a[k] + b[k]) for k in a}


def _kl_penalty(
    lp: jax.Array,
    batch: Any,
    rl_weights: jax.Array | None,
    rl_raw: jax.Array | None,
    counts: Counts,
    config: ObjectiveConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``kl_coef * sum_t w_rl,t kl(logp_t, ref_t)`` and its metrics: ``loss/kl_penalty`` (the term),
    ``ref_kl/reference_k1`` and ``ref_kl/reference_k3`` (means over the rl tokens of the k1 and k3
    estimates of ``KL(pi_train || pi_ref)``; additive like every objective metric)."""
    zero = jnp.zeros((), jnp.float32)
    if rl_weights is None:
        return zero, {"loss/kl_penalty": zero, "ref_kl/reference_k1": zero, "ref_kl/reference_k3": zero}
    why = f"kl_coef={config.kl_coef} (the KL penalty reads the reference policy's logprobs)"
    ref = _f32(_required(batch, "kl_reference_logprobs", why))
    chex.assert_equal_shape([ref, lp])
    penalty = config.kl_coef * _weighted_sum(rl_weights, losses.kl(lp, ref, kind=config.kl_kind))
    tokens = (rl_raw != 0).astype(jnp.float32)
    n_rl = _f32(counts.tokens)[0]

    def mean(kind: str) -> jax.Array:
        return jax.lax.stop_gradient(segments.safe_div(jnp.sum(losses.kl(lp, ref, kind=kind) * tokens), n_rl))

    metrics = {
        "loss/kl_penalty": jax.lax.stop_gradient(penalty),
        "ref_kl/reference_k1": mean("k1"),
        "ref_kl/reference_k3": mean("k3"),
    }
    return penalty, metrics


def objective(
    logp: chex.Array,
    batch: Any,
    counts: Counts,
    config: ObjectiveConfig,
    *,
    entropy: chex.Array | None = None,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar loss of one micro-batch and its metrics (module docstring has the math).

    Args:
      logp: ``[R, L]`` temperature-scaled train logprobs of ``batch.tokens``.
      batch: PackedBatch-like object (``[R, L]`` arrays).
      counts: :func:`global_counts` of the whole mini-batch.
      config: static :class:`ObjectiveConfig`.
      entropy: optional ``[R, L]`` per-token entropy (needed when ``entropy_coef != 0``).
      rng: optional PRNG key for policy losses that draw random numbers (``clip_cov``);
        with None they use their documented deterministic fallback.

    Returns:
      ``(loss, metrics)``. Every metric is normalized by a global count, so each one is
      ADDITIVE: summing a metric over the micro-batches of a mini-batch gives its value on
      the whole mini-batch. Keys: ``loss``, ``loss/rl``, ``loss/ce``, ``loss/ref_kl``,
      ``loss/entropy`` (the bonus term), ``rl/clip_frac`` (tokens the policy loss reports clipped or
      masked, over rl tokens), ``rl/mismatch_kl`` (k3 estimate of KL(pi_inference || pi_train) on rl
      candidate tokens, which were sampled from pi_inference), ``rl/adv_mean``,
      ``rl/adv_sq_mean``, ``ref_kl/k3`` (k3 of KL(pi_train || pi_ref) on ref_kl tokens),
      ``tokens/<component>`` (weighted tokens in this micro-batch, a plain count),
      ``off_policy/<name>`` (when configured; fractions of rl candidate tokens, and
      ``off_policy/is_ratio_max``, which micro-batches combine by ``max``: :data:`MAX_METRICS`),
      ``loss/kl_penalty``, ``ref_kl/reference_k1`` and ``ref_kl/reference_k3`` (with ``kl_coef``)
      and ``entropy`` (mean over loss-mask tokens, when given).

    >>> import numpy as np
    >>> from types import SimpleNamespace
    >>> lp = np.log(np.array([[.5, .5, .9, .1]], np.float32))
    >>> one = np.ones((1, 4), np.float32)
    >>> b = SimpleNamespace(loss_mask=one, segment_ids=one.astype(int), group_index=0 * one,
    ...                     advantages=np.array([[1., 1, -1, -1]]), rl_weights=one, ce_weights=None,
    ...                     ref_kl_weights=None, ref_logprobs=None, old_logprobs=None,
    ...                     inference_logprobs=np.log(np.array([[.5, .2, .6, .4]], np.float32)))
    >>> cfg = ObjectiveConfig()
    >>> loss, metrics = objective(lp, b, global_counts(b, cfg), cfg)
    >>> round(float(loss), 6), float(metrics["rl/clip_frac"])   # dppo reference sum / 4 tokens
    (0.125731, 0.5)
    """
    lp = _f32(logp)
    chex.assert_rank(lp, 2)
    chex.assert_type(logp, float)
    raw = _raw_weights(batch, config)
    chex.assert_equal_shape([lp, batch.loss_mask])
    old, inference = _logprob_streams(batch)
    adv = _f32(_required(batch, "advantages", "the rl component needs advantages (pass zeros if unused)"))
    keys, num = _sample_keys(_required(batch, "segment_ids", "samples are identified by segment ids"))
    if config.entropy_coef != 0.0 and entropy is None:
        raise ValueError(
            f"entropy_coef={config.entropy_coef} needs objective(..., entropy=<per-token entropy>)"
        )
    zero = jnp.zeros((), jnp.float32)
    per_token: dict[str, jax.Array] = {}

    # rl: policy loss, then the off-policy correction.
    off_metrics: dict[str, jax.Array] = {}
    candidates = jnp.zeros(lp.shape, bool) if raw["rl"] is None else raw["rl"] != 0
    clipped = jnp.zeros(lp.shape, jnp.float32)
    if raw["rl"] is not None:
        inputs = losses.LossInputs(lp, _f32(old), _f32(inference), adv, candidates, keys, num, rng)
        rl_loss, clipped = losses.policy_loss(config.policy_loss, inputs, **dict(config.policy_loss_kwargs))
        rl_loss, rl_mask, off_metrics = _rl_correction(
            rl_loss, batch, candidates, config, counts.rl_candidate_tokens
        )
        raw["rl"] = raw["rl"] * rl_mask
        per_token["rl"] = rl_loss
    if raw["ce"] is not None:
        per_token["ce"] = losses.cross_entropy(lp)
    if raw["ref_kl"] is not None:
        ref = _f32(_required(batch, "ref_logprobs", "ref_kl_weights is set (the ref_kl component needs it)"))
        per_token["ref_kl"] = losses.ref_kl(lp, _f32(inference), ref, raw["ref_kl"] != 0)

    weights = {c: normalized_weights(raw[c], c, batch, counts, config) for c in per_token}
    metrics = {
        f"loss/{c}": _weighted_sum(weights[c], per_token[c]) if c in per_token else zero for c in COMPONENTS
    }
    total = sum(metrics[f"loss/{c}"] for c in COMPONENTS)
    if config.kl_coef != 0.0:
        penalty, kl_metrics = _kl_penalty(lp, batch, weights.get("rl"), raw["rl"], counts, config)
        metrics.update(kl_metrics)
        total = total + penalty
    if entropy is not None:
        ent = _f32(entropy)
        chex.assert_equal_shape([ent, lp])
        bonus = _weighted_sum(weights["rl"], ent) if "rl" in weights else zero
        metrics["loss/entropy"] = -config.entropy_coef * bonus
        total = total + metrics["loss/entropy"]
        loss_tokens = (jnp.asarray(batch.loss_mask) != 0).astype(jnp.float32)
        metrics["entropy"] = segments.safe_div(jnp.sum(ent * loss_tokens), _f32(counts.loss_tokens))
    else:
        metrics["loss/entropy"] = jnp.zeros((), jnp.float32)
    metrics["loss"] = total

    rl_active = candidates if raw["rl"] is None else raw["rl"] != 0
    rl_tokens = rl_active.astype(jnp.float32)
    cand = candidates.astype(jnp.float32)
    n_rl, n_cand = _f32(counts.tokens)[0], _f32(counts.rl_candidate_tokens)
    metrics["rl/clip_frac"] = segments.safe_div(jnp.sum(clipped * rl_tokens), n_rl)
    mismatch = losses.kl(_f32(inference), lp, kind="k3")
    metrics["rl/mismatch_kl"] = segments.safe_div(jnp.sum(mismatch * cand), n_cand)
    metrics["rl/adv_mean"] = segments.safe_div(jnp.sum(adv * cand), n_cand)
    metrics["rl/adv_sq_mean"] = segments.safe_div(jnp.sum(jnp.square(adv) * cand), n_cand)
    if raw["ref_kl"] is not None:
        ref_tokens = (raw["ref_kl"] != 0).astype(jnp.float32)
        ref_k3 = losses.kl(lp, _f32(batch.ref_logprobs), kind="k3")
        metrics["ref_kl/k3"] = segments.safe_div(jnp.sum(ref_k3 * ref_tokens), _f32(counts.tokens)[2])
    for c in COMPONENTS:
        metrics[f"tokens/{c}"] = zero if raw[c] is None else jnp.sum((raw[c] != 0).astype(jnp.float32))
    metrics.update({f"off_policy/{k}": v for k, v in off_metrics.items()})
    return total, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
