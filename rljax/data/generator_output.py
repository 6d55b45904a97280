"""SkyRL ``GeneratorOutput`` dicts <-> rljax Steps (design §2.1).

A generator written for SkyRL returns a dict of parallel per-step lists::

    prompt_token_ids, response_ids, rewards, loss_masks            (required)
    stop_reasons, rollout_logprobs, trajectory_ids, is_last_step,
    rollout_expert_indices                                          (optional; MoE router replay)

:func:`steps_from_generator_output` checks the dict's shape (every list one entry per step,
:func:`rljax.data.validate.check_generator_output`) and builds one :class:`~rljax.types.Step`
per entry; :class:`rljax.data.batch.StepBatch.from_generator_output` then validates the steps
as any batch. :func:`to_generator_output` goes back, with :class:`~rljax.types.TrajectoryID`
objects as trajectory ids.

>>> d = {"prompt_token_ids": [[1, 2]], "response_ids": [[3]], "rewards": [1.0], "loss_masks": [[1]]}
>>> steps = steps_from_generator_output(d)
>>> steps[0].trajectory_id, to_generator_output(steps)["rewards"]
(TrajectoryID(instance_id='0', repetition_id=0), [1.0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax.data.validate import check_generator_output
from rljax.types import Step, TrajectoryID

__all__ = ["GENERATOR_KEYS", "steps_from_generator_output", "to_generator_output"]

#: The keys of a SkyRL ``GeneratorOutput`` that rljax reads and writes.
GENERATOR_KEYS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_logprobs",
    "trajectory_ids",
    "is_last_step",
    "rollout_expert_indices",
)


def steps_from_generator_output(d: Mapping[str, Any], **defaults: Any) -> list[Step]:
    """One Step per entry of a ``GeneratorOutput`` dict (shape-checked, not yet batch-validated).

    Absent ``trajectory_ids`` make each entry its own single-step trajectory (instance id = the
    entry's index); absent ``is_last_step`` marks every entry last; absent ``stop_reasons`` are
    "stop". ``defaults`` are further Step fields (``env=``, ``algorithm=``, ``temperature=``).
    """
    n = check_generator_output(d)
    traj = d.get("trajectory_ids")
    last = d.get("is_last_step")
    logprobs = d.get("rollout_logprobs")
    stops = d.get("stop_reasons")
    experts = d.get("rollout_expert_indices")
    steps = []
    for i in range(n):
        reward = d["rewards"][i]
        steps.append(
            Step(
                prompt_ids=list(d["prompt_token_ids"][i]),
                response_ids=list(d["response_ids"][i]),
                loss_mask=list(d["loss_masks"][i]),
                response_logprobs=None if logprobs is None or logprobs[i] is None else list(logprobs[i]),
                reward=reward if np.isscalar(reward) else list(reward),
                trajectory_id=TrajectoryID.coerce(traj[i]) if traj is not None else TrajectoryID(str(i), 0),
                is_last_step=True if last is None else bool(last[i]),
                stop_reason="stop" if stops is None else str(stops[i]),
                routed_experts=None if experts is None or experts[i] is None else np.asarray(experts[i]),
                **defaults,
            )
        )
    return steps


def to_generator_output(steps: Sequence[Step]) -> dict[str, list[Any] | None]:
    """The ``GeneratorOutput`` dict of ``steps`` (inverse of :func:`steps_from_generator_output`).

    ``rollout_logprobs`` is None when no step has logprobs, else one list (or None) per step;
    ``rollout_expert_indices`` is present only when a step carries MoE routing.
    """
    has_lp = any(s.response_logprobs is not None for s in steps)
    out: dict[str, list[Any] | None] = {
        "prompt_token_ids": [list(s.prompt_ids) for s in steps],
        "response_ids": [list(s.response_ids) for s in steps],
        "rewards": [list(s.reward) if s.per_token_reward else s.reward for s in steps],
        "loss_masks": [list(s.loss_mask) for s in steps],
        "stop_reasons": [s.stop_reason for s in steps],
        "rollout_logprobs": (
            [None if s.response_logprobs is None else list(s.response_logprobs) for s in steps]
            if has_lp
            else None
        ),
        "trajectory_ids": [s.trajectory_id for s in steps],
        "is_last_step": [s.is_last_step for s in steps],
    }
    if any(s.routed_experts is not None for s in steps):  # MoE router replay (absent otherwise)
        out["rollout_expert_indices"] = [
            None if s.routed_experts is None else np.asarray(s.routed_experts).tolist() for s in steps
        ]
    return out
