"""The loss functions of the Tinker API, per token, with their documented semantics.

Every Tinker loss is a SUM over the tokens of every datum (no mean): position ``i`` of a datum's
``model_input`` predicts ``target_tokens[i]`` with logprob ``logp_i = log p_theta(target_i | x_<=i)``,
and with ``q_i`` the sampler's logprob (``loss_fn_inputs["logprobs"]``), ``A_i`` the advantage and
``r_i = exp(logp_i - q_i)``:

* ``cross_entropy``: ``L = -sum_i w_i logp_i`` (``weights`` w, default 1). ``target_tokens`` (and
  ``weights``) may be ``[N, K]``: K targets per position, ``logp_ik = log p(target_ik | x_<=i)`` from
  one softmax, ``L = -sum_ik w_ik logp_ik`` (what ``forward_backward_custom`` with a target
  distribution sends).
* ``importance_sampling``: ``L = -sum_i r_i A_i``.
* ``ppo``: ``L = -sum_i min(r_i A_i, clip(r_i, lo, hi) A_i)`` with ``lo = clip_low_threshold``
  (default 0.8) and ``hi = clip_high_threshold`` (default 1.2), from ``loss_fn_config`` or per token
  from ``loss_fn_inputs``.
* ``cispo``: ``L = -sum_i sg(clip(r_i, lo, hi)) logp_i A_i`` (same thresholds).
* ``dro``: ``L = -sum_i (logp_i A_i - beta / 2 (logp_i - q_i)^2)`` with ``beta`` in ``loss_fn_config``
  (required: the API documents no default).
* ``gspo`` (GSPO-token): ``s = exp(mean_{i in M}(logp_i - q_i))`` over the tokens ``M`` that
  ``sequence_ratio_mask`` marks (default: every token of the datum), each token's ratio
  ``s_i = sg(s) p_i / sg(p_i)``; ``L = -sum_i min(s_i A_i, clip(s_i, lo, hi) A_i)``.

The math shared with rljax's own objectives is :mod:`rljax.core.losses` (``cross_entropy``,
``importance_sampling``, ``ppo_clip``, ``cispo``, ``gspo``); the thresholds are ratios here
(``lo = 1 - eps_low``, ``hi = 1 + eps_high`` there). rljax clips log-ratios to +-20 (and GSPO's log
weight to 10) against overflow, which only matters far outside any trust region.

``custom`` losses run in the SDK (``forward_backward_custom`` with a callable, or with a loss made by
``ServiceClient.create_custom_loss``: this server tells the SDK ``custom_loss_server_side=False``, so
the SDK runs the traced loss itself): it asks for a forward pass (``cross_entropy`` inputs, ``[N]`` or
``[N, K]`` targets), differentiates the user's loss of the logprobs locally and sends
``weights = -dC/dlogp`` back through ``cross_entropy``, so the gradient is exact.
``loss_fn="custom"`` (an uploaded loss graph, run by id) is refused.

``stable_reinforce`` is refused: the SDK (0.38.0) defines only its protocol (samples recorded with
``record_stability_info=True``, datums naming them by ``sequence_id`` provenance spans,
``loss_fn_config`` ``kl_coeff``), and Tinker's documentation (alpha) says the objective uses "minimal
additional information captured at sampling time" without saying which, or what the objective is; a
loss of that name would be a guess.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from rljax.core import losses as core

__all__ = ["LOSS_INPUTS", "SEGMENT_LOSSES", "SUPPORTED_LOSSES", "check_config", "token_losses"]

#: loss name -> (required per-token inputs, optional per-token inputs) besides ``target_tokens``.
LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": ((), ("weights",)),
    "importance_sampling": (("logprobs", "advantages"), ()),
    "ppo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "dro": (("logprobs", "advantages"), ()),
    "gspo": (
        ("logprobs", "advantages"),
        ("clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask"),
    ),
}
#: The Tinker loss functions the server implements (the keys of :data:`LOSS_INPUTS`).
SUPPORTED_LOSSES = tuple(LOSS_INPUTS)
#: Losses that reduce over each datum's tokens (segment sums with a static bound ``num_segments``);
#: the others are compiled without it (one program for any number of datums).
SEGMENT_LOSSES = ("gspo",)
#: scalar options of ``loss_fn_config`` per loss, with defaults (None: required).
LOSS_CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}
_UNSUPPORTED = {
    "stable_reinforce": "stable_reinforce is not supported: Tinker publishes its protocol "
    "(record_stability_info samples, sequence_id provenance, kl_coeff) but not its objective nor what "
    "the sampler records, so this server does not guess one; use importance_sampling, ppo, cispo, "
    "dro or gspo, or a custom loss (forward_backward_custom)",
    "custom": "loss_fn='custom' runs an uploaded loss graph, which this server does not store; use "
    "forward_backward_custom with the default client-side custom losses",
}


def check_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """The loss's scalar options (``loss_fn_config`` over the defaults); ValueError naming what is wrong."""
    if loss_fn in _UNSUPPORTED:
        raise ValueError(_UNSUPPORTED[loss_fn])
    if loss_fn not in LOSS_CONFIG:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; this server supports {list(SUPPORTED_LOSSES)}")
    known = LOSS_CONFIG[loss_fn]
    config = dict(config or {})
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(
            f"loss_fn_config keys {unknown} are not options of {loss_fn!r} (it takes {sorted(known)})"
        )
    out: dict[str, float] = {}
    for key, default in known.items():
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"loss {loss_fn!r} needs loss_fn_config[{key!r}]")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"loss_fn_config[{key!r}] must be a number, got {value!r}") from None
    return out


def token_losses(
    loss_fn: str,
    logp: jax.Array,
    inputs: Mapping[str, jax.Array],
    config: Mapping[str, float],
    segment_ids: jax.Array,
    num_segments: int,
) -> jax.Array:
    """Per-token loss ``[R, L]`` of a packed batch (0 off the datums' tokens; the loss is its sum).

    ``inputs`` holds ``[R, L]`` arrays: ``mask`` (1 on a datum's tokens), the loss's per-token inputs
    and, where the loss takes them, ``clip_low_threshold`` / ``clip_high_threshold`` (the config's
    values where a datum gave none) and ``sequence_ratio_mask``. ``segment_ids``: the datum of each
    token (0 = padding), ``num_segments`` bounds them (static).
    """
    mask = inputs["mask"]
    if loss_fn == "cross_entropy":  # logp and weights [R, L] or [R, L, K] (K targets per position)
        per_token = inputs["weights"] * core.cross_entropy(logp)
        return jnp.where(mask.reshape(*mask.shape, *(1,) * (logp.ndim - 2)) > 0, per_token, 0.0)
    q, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        per_token = core.importance_sampling(logp, q, adv).loss
    elif loss_fn == "ppo":
        lo, hi = inputs["clip_low_threshold"], inputs["clip_high_threshold"]
        per_token = core.ppo_clip(logp, q, adv, eps_low=1.0 - lo, eps_high=hi - 1.0).loss
    elif loss_fn == "cispo":
        lo, hi = inputs["clip_low_threshold"], inputs["clip_high_threshold"]
        per_token = core.cispo(logp, q, adv, eps_low=1.0 - lo, eps_high=hi - 1.0).loss
    elif loss_fn == "dro":
        per_token = -(logp * adv - 0.5 * config["beta"] * jnp.square(logp - q))
    elif loss_fn == "gspo":
        lo, hi = inputs["clip_low_threshold"], inputs["clip_high_threshold"]
        in_ratio = mask * inputs["sequence_ratio_mask"]
        per_token = core.gspo(
            logp, q, adv, in_ratio, segment_ids, num_segments, eps_low=1.0 - lo, eps_high=hi - 1.0
        ).loss
    else:  # check_config rejects the others first
        raise ValueError(f"unknown loss_fn {loss_fn!r}")
    return jnp.where(mask > 0, per_token, 0.0)
