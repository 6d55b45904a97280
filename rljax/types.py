"""Data model of rljax: host-side steps and batches, device-side packed batches.

A :class:`Step` is one LLM turn exactly as the engine saw it (token ids in, token
ids and logprobs out). A :class:`StepBatch` is an immutable, validated sequence of
steps; constructing one runs :func:`rljax.data.validate.validate_steps` and raises
``ValueError`` on the first violation. A :class:`PackedBatch` is the fixed-shape
pytree of per-token arrays the jitted train step consumes (see SPEC §2.6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

Reward = float | list[float]


@dataclasses.dataclass(frozen=True, order=True)
class TrajectoryID:
    """Identity of a trajectory: ``instance_id`` is the prompt (group) key."""

    instance_id: str
    repetition_id: int

    @classmethod
    def coerce(cls, value: Any) -> TrajectoryID:
        """Accepts a TrajectoryID, an ``(instance_id, repetition_id)`` pair or a dict."""
        if isinstance(value, TrajectoryID):
            return value
        if isinstance(value, Mapping):
            try:
                return cls(str(value["instance_id"]), int(value["repetition_id"]))
            except KeyError as e:
                raise ValueError(
                    f"trajectory_id dict needs keys 'instance_id' and 'repetition_id', got {sorted(value)}"
                ) from e
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(str(value[0]), int(value[1]))
        raise ValueError(
            "trajectory_id must be a TrajectoryID, an (instance_id, repetition_id) pair or a dict "
            f"with those keys; got {value!r}"
        )

    def __str__(self) -> str:
        return f"{self.instance_id}#{self.repetition_id}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One LLM turn (one training sample before merging). See SPEC §2.1.

    Attributes:
      prompt_ids: exact token ids the engine received for this turn.
      response_ids: exact token ids the engine returned (never re-tokenized).
      response_logprobs: engine logprob of each response token, or None.
      loss_mask: 1 = trainable; one entry per response token.
      reward: step reward (scalar) or per-token rewards (one per response token).
      trajectory_id: which trajectory (and group, via ``instance_id``) this turn belongs to.
      is_last_step: True on the final step of its trajectory.
      stop_reason: "stop", "length", "abort", "tool_call", ...
      env: name of the environment that produced the step.
      algorithm: name of the algorithm (SPEC §3.6) that trains it.
      temperature: sampling temperature; the trainer divides logits by it.
      policy_version: weight version of the policy that sampled the step.
      prompt_roles: optional, one entry per prompt token: the role of the message whose BODY
        the token is (e.g. "tool", "user"), None for template scaffolding; the rollout records
        it from the renderer, and the echo algorithm reads it (:mod:`rljax.data.echo`).
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    trajectory_id: TrajectoryID
    loss_mask: Sequence[int] | None = None
    response_logprobs: Sequence[float] | None = None
    reward: Reward = 0.0
    is_last_step: bool = True
    stop_reason: str = "stop"
    env: str = "default"
    algorithm: str = "grpo"
    temperature: float = 1.0
    policy_version: int = 0
    prompt_roles: Sequence[str | None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectory_id", TrajectoryID.coerce(self.trajectory_id))
        if self.loss_mask is None:
            object.__setattr__(self, "loss_mask", [1] * len(self.response_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def per_token_reward(self) -> bool:
        return not np.isscalar(self.reward) and not isinstance(self.reward, (int, float))

    @property
    def total_reward(self) -> float:
        """Scalar reward: the step reward, or the sum of per-token rewards."""
        return float(np.sum(self.reward)) if self.per_token_reward else float(self.reward)

    def replace(self, **changes: Any) -> Step:
        return dataclasses.replace(self, **changes)


_GENERATOR_KEYS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_logprobs",
    "trajectory_ids",
    "is_last_step",
)


class StepBatch(Sequence[Step]):
    """An immutable, validated batch of steps (SPEC §2.1, §2.2).

    Steps of one trajectory may appear in any order relative to other trajectories'
    steps; within a trajectory, list order is turn order.

    >>> from rljax.types import Step, StepBatch, TrajectoryID
    >>> b = StepBatch([Step([1, 2], [3], TrajectoryID("q0", 0), reward=1.0)])
    >>> len(b), b[0].total_reward
    (1, 1.0)
    """

    def __init__(
        self,
        steps: Sequence[Step],
        *,
        vocab_size: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        from rljax.data.validate import validate_steps

        self._steps: tuple[Step, ...] = tuple(steps)
        self.vocab_size = vocab_size
        self.metadata: dict[str, Any] = dict(metadata or {})
        validate_steps(self._steps, vocab_size=vocab_size)

    # Sequence protocol -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return StepBatch(self._steps[i], vocab_size=self.vocab_size, metadata=self.metadata)
        return self._steps[i]

    def __iter__(self) -> Iterator[Step]:
        return iter(self._steps)

    def __repr__(self) -> str:
        return f"StepBatch({len(self)} steps, {len(set(self.trajectory_ids))} trajectories)"

    @property
    def steps(self) -> tuple[Step, ...]:
        return self._steps

    @property
    def trajectory_ids(self) -> list[TrajectoryID]:
        return [s.trajectory_id for s in self._steps]

    def replace_steps(self, steps: Sequence[Step]) -> StepBatch:
        return StepBatch(steps, vocab_size=self.vocab_size, metadata=self.metadata)

    # SkyRL interop -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, vocab_size: int | None = None) -> StepBatch:
        return cls.from_generator_output(d, vocab_size=vocab_size)

    @classmethod
    def from_generator_output(
        cls, d: Mapping[str, Any], *, vocab_size: int | None = None, **defaults: Any
    ) -> StepBatch:
        """Builds a batch from a SkyRL-style ``GeneratorOutput`` dict.

        Required keys: ``prompt_token_ids, response_ids, rewards, loss_masks``; optional:
        ``stop_reasons, rollout_logprobs, trajectory_ids, is_last_step`` (absent
        trajectory ids make each row its own single-step trajectory). Extra keyword
        arguments are Step defaults (``env=``, ``algorithm=``, ``temperature=``).
        """
        from rljax.data.validate import check_generator_output

        n = check_generator_output(d)
        traj = d.get("trajectory_ids")
        last = d.get("is_last_step")
        logprobs = d.get("rollout_logprobs")
        stops = d.get("stop_reasons")
        steps = []
        for i in range(n):
            tid = TrajectoryID.coerce(traj[i]) if traj is not None else TrajectoryID(str(i), 0)
            steps.append(
                Step(
                    prompt_ids=list(d["prompt_token_ids"][i]),
                    response_ids=list(d["response_ids"][i]),
                    loss_mask=list(d["loss_masks"][i]),
                    response_logprobs=None if logprobs is None or logprobs[i] is None else list(logprobs[i]),
                    reward=d["rewards"][i] if np.isscalar(d["rewards"][i]) else list(d["rewards"][i]),
                    trajectory_id=tid,
                    is_last_step=True if last is None else bool(last[i]),
                    stop_reason="stop" if stops is None else str(stops[i]),
                    **defaults,
                )
            )
        return cls(steps, vocab_size=vocab_size)

    def to_generator_output(self) -> dict[str, list[Any]]:
        """Inverse of :meth:`from_generator_output` (trajectory ids as TrajectoryID)."""
        has_lp = any(s.response_logprobs is not None for s in self._steps)
        return {
            "prompt_token_ids": [list(s.prompt_ids) for s in self._steps],
            "response_ids": [list(s.response_ids) for s in self._steps],
            "rewards": [list(s.reward) if s.per_token_reward else s.reward for s in self._steps],
            "loss_masks": [list(s.loss_mask) for s in self._steps],
            "stop_reasons": [s.stop_reason for s in self._steps],
            "rollout_logprobs": (
                [None if s.response_logprobs is None else list(s.response_logprobs) for s in self._steps]
                if has_lp
                else None
            ),
            "trajectory_ids": [s.trajectory_id for s in self._steps],
            "is_last_step": [s.is_last_step for s in self._steps],
        }

    # Advantages --------------------------------------------------------------------
    def step_advantages(
        self, estimator: str | Callable[..., Any] = "grpo", **estimator_kwargs: Any
    ) -> list[np.ndarray]:
        """Per-token advantages of every step, in batch order (SPEC §2.3 / §2.4).

        Thin host wrapper around :func:`rljax.data.step_advantages.compute_step_advantages`.
        """
        from rljax.data.step_advantages import compute_step_advantages

        return compute_step_advantages(self, estimator, **estimator_kwargs)


def _register_dataclass(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Fixed-shape ``[rows, seq_len]`` per-token arrays (SPEC §2.6). A jax pytree.

    ``segment_ids`` is 0 on padding and 1..k for the k samples in a row; ``positions``
    restart at 0 for each sample; ``sample_index`` is a global sample id (0 on
    padding, where loss_mask is 0) used for sequence-level math across rows;
    ``group_index`` is the dense prompt-group id of that sample. ``old_logprobs``
    are the trainer's logprobs before this batch's first update (equal to
    ``inference_logprobs`` until the trainer recomputes them). Entry ``t`` of the
    per-token streams refers to predicting ``tokens[t]`` from ``tokens[<t]``: the
    loss mask is 0 on prompt tokens and padding.
    """

    tokens: Any
    positions: Any
    segment_ids: Any
    sample_index: Any
    group_index: Any
    loss_mask: Any
    advantages: Any
    inference_logprobs: Any
    old_logprobs: Any
    ref_logprobs: Any
    temperatures: Any
    rl_weights: Any
    ce_weights: Any
    ref_kl_weights: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.tokens))

    def replace(self, **changes: Any) -> PackedBatch:
        return dataclasses.replace(self, **changes)
