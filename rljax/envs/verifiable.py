"""``"verifiable"``: a single-turn environment for dataset rows scored by their ``reward_spec``.

``reset(task)`` returns the row's prompt messages (``Task.messages``); ``step(action)`` scores the
assistant's answer with :func:`rljax.envs.rewards.score` (``math_verify`` / verl ``rule``,
``exact_match``, or a user ``module:fn``) and ends the episode. It is the default environment of
verl rows, which name no ``env_class``.

>>> env = VerifiableEnv()
>>> task = Task("t", messages=[{"role": "user", "content": "2+2?"}],
...             reward_spec={"method": "exact_match", "ground_truth": "4"})
>>> env.reset(task)[0]["content"], env.step("4")[1:3]
('2+2?', (1.0, True))
"""

from __future__ import annotations

from typing import Any

from rljax.envs import rewards
from rljax.envs.base import StepResult, Task
from rljax.envs.loader import load_attr

__all__ = ["VerifiableEnv"]


class VerifiableEnv:
    """Single turn; reward from the task's ``reward_spec`` (module docstring).

    Args:
      reward_fn: ``"module:fn"`` (verl ``compute_score`` signature) scoring every task, overriding
        the rows' own methods; None = each row's ``reward_spec.method``.
      method: a method for rows whose reward_spec names none / overrides it (e.g. "math_verify").
      system_prompt: optional system message put before the row's messages (when they have none).
    """

    name = "verifiable"
    tools = None

    def __init__(
        self, *, reward_fn: str | None = None, method: str | None = None, system_prompt: str | None = None
    ):
        if reward_fn is not None:
            load_attr(reward_fn, where="reward_fn")  # fail at construction on a bad name
        self.reward_fn = reward_fn
        self.method = method
        self.system_prompt = system_prompt
        self.task: Task | None = None
        self.done = False

    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Starts the episode of a dataset row: its messages, with the env's system prompt when they have
        none."""
        if task.messages is None:
            raise ValueError(f"task {task.id!r} has no messages (the verifiable env runs dataset rows)")
        if task.reward_spec is None and self.reward_fn is None:
            raise ValueError(f"task {task.id!r} has no reward_spec and the env has no reward_fn")
        self.task, self.done = task, False
        messages = [dict(m) for m in task.messages]
        if self.system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def reward_spec(self) -> dict[str, Any]:
        """The task's ``reward_spec`` with the env's ``reward_fn`` or ``method`` in place of its method."""
        assert self.task is not None
        spec = dict(self.task.reward_spec or {})
        if self.reward_fn is not None:
            spec["method"] = self.reward_fn
        elif self.method is not None:
            spec["method"] = self.method
        return spec

    def step(self, action: str) -> StepResult:
        """Scores the response under :meth:`reward_spec` and ends the episode."""
        if self.task is None or self.done:
            raise ValueError("step() after the episode ended (or before reset); call reset(task) first")
        self.done = True
        content = getattr(action, "content", action)
        reward = rewards.score(self.reward_spec(), content, task=self.task)
        return StepResult([], reward, True, {"correct": reward == 1.0})
