"""Reference log-probabilities for the ref_kl component (design §3.6): who scores each algorithm's samples.

* **opd**: a frozen teacher endpoint scores every merged sample with one prefill (prompt logprobs
  over the exact ids, temperature 1), on its own worker so it never queues behind a rollout.
* **opsd**: the live policy (current parameters) scores each sample with the task's demonstration
  rendered into the prompt (:meth:`rljax.chat.Renderer.demonstration_hint`), packed and jitted
  (:func:`rljax.inference.scoring.score_sequences`), at each sample's own temperature, and the
  response part is sliced back off.

:meth:`ReferenceScorers.for_algorithm` returns a ``score(samples) -> [logprobs per sample]`` function
(:data:`rljax.data.prepare.ResponseScorer`) or None for algorithms without ref_kl.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.algorithms import Algorithm
from rljax.chat.base import Renderer
from rljax.data.demonstrations import condition_on_demonstration, slice_response
from rljax.envs.base import Task
from rljax.run.engines import EngineSet
from rljax.run.worker import Worker
from rljax.types import Step

__all__ = ["ReferenceScorers"]

Scorer = Callable[[Sequence[Step]], list[np.ndarray]]


class ReferenceScorers:
    """Builds the ref_kl scorer of each algorithm.

    Args:
      engines: the run's engines (frozen teachers).
      worker: the worker teacher requests run on.
      renderer: renders demonstration hints (opsd).
      tasks_by_id: train tasks by id (their ``demonstration``).
      score: scores token sequences under the live policy at per-sequence temperatures
        (:meth:`rljax.run.run.Run.score`; opsd scores with current parameters).
    """

    def __init__(
        self,
        engines: EngineSet,
        worker: Worker,
        renderer: Renderer,
        tasks_by_id: Mapping[str, Task],
        score: Callable[..., list[np.ndarray]],
    ) -> None:
        self.engines = engines
        self.worker = worker
        self.renderer = renderer
        self.tasks_by_id = dict(tasks_by_id)
        self.score = score
        self._hints: dict[str | None, Any] = {}

    def hint(self, demonstration: str | None) -> Any:
        """The renderer's demonstration hint (cached); raises when the renderer cannot place one."""
        if demonstration not in self._hints:
            self._hints[demonstration] = self.renderer.demonstration_hint(demonstration)
        return self._hints[demonstration]

    def for_algorithm(self, algorithm: Algorithm) -> Scorer | None:
        """The reference scorer of ``algorithm``: its frozen teacher's, the live policy's on demonstrations
        (opsd), or None without ref_kl."""
        if algorithm.action_component != "ref_kl":
            return None
        if algorithm.frozen_model is None:
            return self.score_with_demonstrations
        teacher = self.engines.frozen_model(algorithm.frozen_model, self.worker)

        def score(samples: Sequence[Step]) -> list[np.ndarray]:
            async def job() -> list[np.ndarray]:
                return list(
                    await asyncio.gather(
                        *(teacher.response_logprobs(s.prompt_ids, s.response_ids) for s in samples)
                    )
                )

            return self.worker.submit(job).result()

        return score

    def score_with_demonstrations(self, samples: Sequence[Step]) -> list[np.ndarray]:
        """opsd: the live policy's logprobs of each response, its task's demonstration in the prompt."""
        seqs, starts = [], []
        for s in samples:
            task = self.tasks_by_id.get(s.trajectory_id.instance_id)
            ids, start = condition_on_demonstration(
                s.prompt_ids, s.response_ids, self.hint(None if task is None else task.demonstration)
            )
            seqs.append(ids)
            starts.append(start)
        # the reference at each sample's own temperature, like the student's logp in the objective
        # only the responses meet the vocabulary: the prompt and the demonstration are not scored
        scores = self.score(seqs, temperature=[float(s.temperature) for s in samples], score_from=starts)
        return [
            slice_response(sc, st, len(s.response_ids))
            for sc, st, s in zip(scores, starts, samples, strict=True)
        ]
