"""StepBatch: an immutable, validated sequence of steps (design §2.1, §2.2).

Constructing a :class:`StepBatch` runs :func:`rljax.data.validate.validate_steps` once and raises
``ValueError`` on the first violation. Everything the data layer derives from a valid batch
without breaking a rule (a subset of whole trajectories, loss masks zeroed by a filter, the
merge of its turns) is built with :meth:`StepBatch.derived`, which does not validate again: a
batch is validated once, where it enters the pipeline.

>>> from rljax.types import Step, TrajectoryID
>>> b = StepBatch([Step([1, 2], [3], TrajectoryID("q0", 0), reward=1.0)])
>>> len(b), b[0].total_reward
(1, 1.0)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rljax.data.generator_output import steps_from_generator_output, to_generator_output
from rljax.data.step_advantages import compute_step_advantages
from rljax.data.validate import validate_steps
from rljax.types import Step, TrajectoryID

__all__ = ["StepBatch"]


class StepBatch(Sequence[Step]):
    """An immutable, validated batch of steps (design §2.1, §2.2).

    Steps of one trajectory may appear in any order relative to other trajectories' steps;
    within a trajectory, list order is turn order. An empty batch is valid.

    Args:
      steps: the steps.
      vocab_size: when given, every token id must lie in ``[0, vocab_size)``.
      metadata: free-form batch metadata (e.g. the rollout's metrics).
    """

    def __init__(
        self,
        steps: Sequence[Step],
        *,
        vocab_size: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self._steps: tuple[Step, ...] = tuple(steps)
        self.vocab_size = vocab_size
        self.metadata: dict[str, Any] = dict(metadata or {})
        validate_steps(self._steps, vocab_size=vocab_size)

    @classmethod
    def _trusted(
        cls, steps: Sequence[Step], *, vocab_size: int | None, metadata: Mapping[str, Any] | None
    ) -> StepBatch:
        out = cls.__new__(cls)
        out._steps = tuple(steps)
        out.vocab_size = vocab_size
        out.metadata = dict(metadata or {})
        return out

    def derived(self, steps: Sequence[Step]) -> StepBatch:
        """A batch of ``steps`` derived from this valid batch, NOT validated again.

        For the data layer's own transformations that keep every rule of design §2.2 by
        construction: subsets of whole trajectories, zeroed loss masks, merged turns. Use the
        constructor (or :meth:`replace_steps`) for anything else.
        """
        return StepBatch._trusted(steps, vocab_size=self.vocab_size, metadata=self.metadata)

    # Sequence protocol -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):  # a slice may cut a trajectory: validated
            return StepBatch(self._steps[i], vocab_size=self.vocab_size, metadata=self.metadata)
        return self._steps[i]

    def __iter__(self) -> Iterator[Step]:
        return iter(self._steps)

    def __repr__(self) -> str:
        return f"StepBatch({len(self)} steps, {len(set(self.trajectory_ids))} trajectories)"

    @property
    def steps(self) -> tuple[Step, ...]:
        """The validated steps, in the order given."""
        return self._steps

    @property
    def trajectory_ids(self) -> list[TrajectoryID]:
        """The trajectory id of each step, in step order."""
        return [s.trajectory_id for s in self._steps]

    def replace_steps(self, steps: Sequence[Step]) -> StepBatch:
        """A new validated batch of ``steps`` with this batch's vocab size and metadata."""
        return StepBatch(steps, vocab_size=self.vocab_size, metadata=self.metadata)

    # SkyRL interop (rljax.data.generator_output) -------------------------------------
    @classmethod
    def from_generator_output(
        cls, d: Mapping[str, Any], *, vocab_size: int | None = None, **defaults: Any
    ) -> StepBatch:
        """Builds a validated batch from a SkyRL-style ``GeneratorOutput`` dict.

        Required keys: ``prompt_token_ids, response_ids, rewards, loss_masks``; optional:
        ``stop_reasons, rollout_logprobs, trajectory_ids, is_last_step`` (absent trajectory
        ids make each row its own single-step trajectory). Extra keyword arguments are Step
        defaults (``env=``, ``algorithm=``, ``temperature=``).
        """
        return cls(steps_from_generator_output(d, **defaults), vocab_size=vocab_size)

    from_dict = from_generator_output

    def to_generator_output(self) -> dict[str, Any]:
        """Inverse of :meth:`from_generator_output` (trajectory ids as TrajectoryID)."""
        return to_generator_output(self._steps)

    #: Per-token advantages of every step, in batch order (design §2.3 / §2.4): the function
    #: :func:`rljax.data.step_advantages.compute_step_advantages` itself, bound to the batch.
    step_advantages = compute_step_advantages
