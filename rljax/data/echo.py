"""Echo: cross-entropy on the environment's tokens of merged multi-turn samples (design §3.3, §3.6).

The ``echo`` algorithm trains the policy's sampled action tokens with the usual rl component
(grpo advantages, the configured policy loss) and, in the same forward pass, the tokens the
ENVIRONMENT wrote (tool results, user follow-ups, ...) with a cross-entropy term weighted per
role::

    loss = sum_t w_rl,t * l_rl,t  +  sum_t w_ce,t * (-log pi(x_t | x_<t))
    v_rl,t = rl_weights_t * loss_mask_t        = 1 on trainable action tokens, 0 elsewhere
    v_ce,t = ce_weights_t * loss_mask_t        = alpha(role_t) on echo tokens, 0 elsewhere

each component normalized by its own global count (:mod:`rljax.core.objective`, design §3.5).
Advantages on echo tokens are 0 (the merge fills gap tokens with 0), and they are not rl
candidates (``rl_weights`` 0), so off-policy masks and rl metrics never see them.

Which tokens. An echo token is a token of a merged sample's response region that

* is message BODY of a role with ``alpha > 0`` (the renderer's attribution, recorded per prompt
  token in ``Step.prompt_roles``); template scaffolding (``<|im_start|>tool\\n``,
  ``<tool_response>``, ``<|im_end|>``, the next assistant opener) has role None and is never
  echoed, nor are the policy's own tokens (role ``"assistant"``, which ``alphas`` may not name);
* lies in a sample with at least one trainable action token (a trajectory that errored, or
  that a filter masked entirely, trains nothing);
* survives the optional ``token_filter(sample, candidates) -> bool mask`` (ANDed: a filter
  can only narrow the selection).

Echo needs MERGED samples: the observations are the gap tokens that prefix-aware merging
(design §2.5, :mod:`rljax.data.merge`) inserts between the turns of a sample. With merging off
every response region holds sampled tokens only, so nothing is echoed (``echo/tokens`` is 0)
and echo trains exactly like grpo. Usage::

    plan = plan_merge(batch.steps)
    merged = merge_steps(batch)                          # samples in plan order
    roles = response_roles(plan, batch.steps)            # needs Step.prompt_roles (rollout sets it)
    streams = echo_streams(merged, roles, {"tool": 0.1})
    samples = [s.replace(loss_mask=m) for s, m in zip(merged, streams.loss_mask)]
    pack(samples, ..., rl_weights=streams.rl_weights, ce_weights=streams.ce_weights)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.data.batch import StepBatch
from rljax.data.merge import MergePlan
from rljax.types import Step

__all__ = [
    "DEFAULT_ALPHAS",
    "EchoStreams",
    "TokenFilter",
    "check_alphas",
    "echo_streams",
    "response_roles",
]

#: Default echo weights: cross-entropy with weight 0.1 on tool-result bodies (design §3.6).
DEFAULT_ALPHAS: Mapping[str, float] = types.MappingProxyType({"tool": 0.1})

#: ``token_filter(sample, candidates) -> keep``: both bool arrays of ``len(sample.response_ids)``.
TokenFilter = Callable[[Step, np.ndarray], np.ndarray]

_POLICY_ROLE = "assistant"
_ROLE_TYPES = frozenset({str, type(None)})


def _where(k: int, step: Step) -> str:
    return f"sample {k} (trajectory {step.trajectory_id})"


def check_alphas(alphas: Mapping[str, float] | Any) -> dict[str, float]:
    """Validates echo weights ``{role: alpha}``; returns them as a plain dict of floats.

    Roles are non-empty strings other than ``"assistant"`` (those tokens are the policy's own
    actions, trained by the rl component); alphas are finite and ``>= 0`` (0 turns a role off).
    Accepts any mapping (or an ``ml_collections.ConfigDict``).

    >>> check_alphas({"tool": 0.1, "user": 0})
    {'tool': 0.1, 'user': 0.0}
    >>> try:
    ...     check_alphas({"assistant": 1.0})
    ... except ValueError as e:
    ...     print(str(e)[:62])
    echo alphas name role 'assistant': those tokens are the policy
    """
    if hasattr(alphas, "to_dict"):
        alphas = alphas.to_dict()
    if not isinstance(alphas, Mapping):
        raise ValueError(
            "echo alphas must be a mapping {role: weight}, e.g. {'tool': 0.1}; "
            f"got {type(alphas).__name__}"
        )
    out: dict[str, float] = {}
    for role, alpha in alphas.items():
        if not isinstance(role, str) or not role:
            raise ValueError(f"echo alphas keys must be non-empty role names (str), got {role!r}")
        if role == _POLICY_ROLE:
            raise ValueError(
                "echo alphas name role 'assistant': those tokens are the policy's own actions, trained "
                "by the rl component; echo weights apply to environment roles (e.g. 'tool', 'user')"
            )
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha):
            raise ValueError(f"echo alpha of role {role!r} must be a finite number >= 0, got {alpha!r}")
        if alpha < 0:
            raise ValueError(
                f"echo alpha of role {role!r} is {alpha} < 0; a negative weight would push the model away "
                "from the environment's text (use 0 to turn the role off)"
            )
        if alpha > 0 and np.float32(alpha) == 0:
            raise ValueError(
                f"echo alpha of role {role!r} is {alpha}, which is 0 in float32 (the weights' dtype); "
                "use 0 to turn the role off or a weight >= 1e-30"
            )
        out[role] = float(alpha)
    return out


def response_roles(plan: MergePlan, steps: Sequence[Step]) -> list[list[str | None]]:
    """Role of every response-region token of every merged sample (design §2.5 layout).

    Merged sample ``k`` made of turns ``s_0, s_1, ...`` with gaps ``g_0 = 0, g_1, ...`` has the
    response ``r_{s_0} ++ p_{s_1}[-g_1:] ++ r_{s_1} ++ ...``; its roles are
    ``[None] * |r_{s_0}| ++ prompt_roles_{s_1}[-g_1:] ++ [None] * |r_{s_1}| ++ ...``: gap
    tokens keep the role the renderer gave them in the turn's prompt, sampled tokens get None.

    Args:
      plan: :func:`rljax.data.merge.plan_merge` of ``steps``.
      steps: the UNMERGED steps the plan was made from, each with ``prompt_roles`` (the rollout
        records them; custom generators must set ``Step.prompt_roles``).

    Returns:
      One list per merged sample, in plan order (the order of
      :func:`~rljax.data.merge.merge_steps`), aligned with that sample's ``response_ids``.

    >>> from rljax.data.merge import plan_merge
    >>> steps = [Step([1], [2], ("q", 0), is_last_step=False, prompt_roles=[None]),
    ...          Step([1, 2, 7, 8], [9], ("q", 0), prompt_roles=[None, "assistant", "tool", None])]
    >>> response_roles(plan_merge(steps), steps)
    [[None, 'tool', None, None]]
    """
    if not isinstance(plan, MergePlan):
        raise ValueError(f"plan must be a MergePlan (from plan_merge), got {type(plan).__name__}")
    steps = steps.steps if isinstance(steps, StepBatch) else tuple(steps)
    if plan.num_steps != len(steps):
        raise ValueError(
            f"the plan was made from {plan.num_steps} steps but {len(steps)} were given; pass the "
            "unmerged steps the plan came from"
        )
    for i, s in enumerate(steps):
        if s.prompt_roles is None:
            raise ValueError(
                f"step {i} (trajectory {s.trajectory_id}): prompt_roles is None, but echo needs the role "
                "of every prompt token to find the environment's tokens; rljax.rollout records them, "
                "custom generators must set Step.prompt_roles (e.g. from ChatSession.full_prompt_roles)"
            )
        if len(s.prompt_roles) != len(s.prompt_ids):
            raise ValueError(
                f"step {i} (trajectory {s.trajectory_id}): prompt_roles has {len(s.prompt_roles)} entries "
                f"but prompt_ids has {len(s.prompt_ids)}; give one role per prompt token"
            )
    out: list[list[str | None]] = []
    for idx, gaps in zip(plan.samples, plan.gaps, strict=True):
        roles: list[str | None] = []
        for i, g in zip(idx, gaps, strict=True):
            if g:
                prompt_roles = steps[i].prompt_roles
                roles.extend(prompt_roles[len(prompt_roles) - g :])
            roles.extend([None] * len(steps[i].response_ids))
        out.append(roles)
    return out


@dataclasses.dataclass(frozen=True)
class EchoStreams:
    """Per-sample streams of the echo algorithm, aligned with each sample's response tokens.

    Attributes:
      loss_mask: int32; the sample's loss mask OR echo token.
      rl_weights: float32; 1 on the sample's trainable action tokens (loss mask 1), 0 elsewhere
        (echo tokens included).
      ce_weights: float32; ``alpha(role)`` on echo tokens, 0 elsewhere.
      metrics: ``echo/tokens``, ``echo/tokens/<role>`` (each role of ``alphas``),
        ``echo/candidate_tokens`` (before the token filter), ``echo/filtered_tokens`` (removed by
        it), ``echo/samples_with_echo``, ``echo/samples_masked`` (samples with environment tokens
        of an echoed role but no trainable action token: skipped), ``echo/action_tokens``.
    """

    loss_mask: list[np.ndarray]
    rl_weights: list[np.ndarray]
    ce_weights: list[np.ndarray]
    metrics: dict[str, float]


def _check_roles(roles: Sequence[str | None], n: int, k: int, step: Step) -> None:
    if isinstance(roles, (str, bytes)) or not isinstance(roles, (list, tuple, np.ndarray)):
        raise ValueError(f"roles of {_where(k, step)} must be a list (one role per response token)")
    if len(roles) != n:
        raise ValueError(
            f"roles of {_where(k, step)} has {len(roles)} entries but the sample has {n} response tokens; "
            "pass response_roles(plan, steps) for the MERGED samples, in the same order"
        )
    if set(map(type, roles)) <= _ROLE_TYPES:
        return
    bad = next((r for r in roles if not (r is None or isinstance(r, str))), None)
    if bad is not None:
        raise ValueError(
            f"roles of {_where(k, step)} holds {bad!r}; entries must be a role name (str) or None"
        )


def _apply_filter(token_filter: TokenFilter, step: Step, candidates: np.ndarray, k: int) -> np.ndarray:
    """The filter's mask ANDed with the candidates, after checking its type and shape."""
    keep = token_filter(step, candidates.copy())
    if not isinstance(keep, np.ndarray) or keep.dtype != np.bool_ or keep.shape != candidates.shape:
        got = (
            f"{type(keep).__name__} with dtype {keep.dtype} and shape {keep.shape}"
            if isinstance(keep, np.ndarray)
            else type(keep).__name__
        )
        raise ValueError(
            f"token_filter on {_where(k, step)} returned {got}; it must return a numpy bool array of "
            f"shape {candidates.shape} (one entry per response token, True = keep)"
        )
    return candidates & keep


def echo_streams(
    samples: Sequence[Step],
    roles: Sequence[Sequence[str | None]],
    alphas: Mapping[str, float] = DEFAULT_ALPHAS,
    *,
    token_filter: TokenFilter | None = None,
) -> EchoStreams:
    """Loss mask and rl/ce weight streams that add echo's cross-entropy term (see module docstring).

    For sample ``k`` with loss mask ``m`` and per-token role ``rho_t``::

        cand_t  = alpha(rho_t) > 0  and  any(m)          (alpha(None) = alpha(unlisted) = 0)
        echo_t  = cand_t and filter(sample, cand)_t
        loss_mask_t = m_t or echo_t,   rl_t = m_t,   ce_t = alpha(rho_t) * echo_t

    Args:
      samples: MERGED samples (:func:`rljax.data.merge.merge_steps`); unmerged samples have no
        environment tokens in their responses, so nothing is echoed.
      roles: :func:`response_roles` of the merged samples, in the same order.
      alphas: cross-entropy weight per environment role (default ``{"tool": 0.1}``);
        see :func:`check_alphas`.
      token_filter: optional ``(sample, candidates) -> keep`` (numpy bool arrays of the
        sample's response length) that narrows the selection, e.g. to skip error messages;
        called only for samples with at least one candidate.

    Returns:
      :class:`EchoStreams`.

    Raises:
      ValueError: bad alphas, roles that do not line up with the samples, a role with
        ``alpha > 0`` on a trainable action token, or a filter result of the wrong type/shape.

    >>> s = Step([1], [2, 3, 4, 5], ("q", 0), loss_mask=[1, 0, 0, 1])
    >>> e = echo_streams([s], [[None, None, "tool", None]], {"tool": 0.5})
    >>> e.loss_mask[0].tolist(), e.rl_weights[0].tolist(), e.ce_weights[0].tolist()
    ([1, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.0])
    >>> e.metrics["echo/tokens"], e.metrics["echo/tokens/tool"]
    (1.0, 1.0)
    """
    alphas = check_alphas(alphas)
    samples = samples.steps if isinstance(samples, StepBatch) else tuple(samples)
    if isinstance(roles, (str, bytes)) or len(roles) != len(samples):
        raise ValueError(
            f"roles has {len(roles)} entries but there are {len(samples)} samples; pass "
            "response_roles(plan, steps), one list per merged sample"
        )
    if token_filter is not None and not callable(token_filter):
        raise ValueError(f"token_filter must be callable (sample, candidates) -> mask, got {token_filter!r}")
    loss_masks, rl_weights, ce_weights = [], [], []
    per_role: collections.Counter[str] = collections.Counter()
    totals = dict.fromkeys(("candidate", "echo", "with_echo", "masked", "action"), 0)
    for k, (step, r) in enumerate(zip(samples, roles, strict=True)):
        mask = np.asarray(step.loss_mask, dtype=np.int32).reshape(-1)
        n = mask.shape[0]
        _check_roles(r, n, k, step)
        alpha = np.array([alphas.get(x, 0.0) for x in r], dtype=np.float32).reshape(n)
        candidates = alpha > 0
        action = mask != 0
        clash = np.flatnonzero(candidates & action)
        if clash.size:
            t = int(clash[0])
            raise ValueError(
                f"roles of {_where(k, step)} gives response token {t} role {r[t]!r}, but it is a trainable "
                "action token (loss_mask 1); environment roles belong to gap tokens only"
            )
        if not action.any():
            totals["masked"] += int(candidates.any())
            candidates[:] = False
        num_candidates = int(candidates.sum())
        echo = candidates
        if token_filter is not None and num_candidates:
            echo = _apply_filter(token_filter, step, candidates, k)
        num_echo = int(echo.sum())
        per_role.update(r[t] for t in np.flatnonzero(echo))
        totals["candidate"] += num_candidates
        totals["echo"] += num_echo
        totals["with_echo"] += int(num_echo > 0)
        totals["action"] += int(action.sum())
        loss_masks.append((action | echo).astype(np.int32))
        rl_weights.append(action.astype(np.float32))
        ce_weights.append(np.where(echo, alpha, 0.0).astype(np.float32))
    metrics = {
        "echo/tokens": float(totals["echo"]),
        **{f"echo/tokens/{role}": float(per_role[role]) for role in alphas},
        "echo/candidate_tokens": float(totals["candidate"]),
        "echo/filtered_tokens": float(totals["candidate"] - totals["echo"]),
        "echo/samples_with_echo": float(totals["with_echo"]),
        "echo/samples_masked": float(totals["masked"]),
        "echo/action_tokens": float(totals["action"]),
    }
    return EchoStreams(loss_masks, rl_weights, ce_weights, metrics)
