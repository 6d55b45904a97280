"""Single-turn verifiable task: tiny arithmetic with an exact-match reward (design §4 built-ins).

The user asks ``"What is 3 + 4? Answer with the number only."``; the episode ends after one
assistant turn with reward::

    r = 1                       if content.strip() == str(answer)
    r = format_credit           elif content.strip() is an integer (well formed, wrong)
    r = 0                       otherwise

With ``answer_format="last_number"`` the answer is the LAST integer in the reply instead (GSM8K-style
extraction: ``"3 + 4 = 7"`` and ``"The answer is 7."`` both score 1), for instruct models that
restate the problem; ``format_credit`` then goes to a reply with a wrong last integer.

The answer vocabulary is small (operands ``0..max_operand``), so a tiny model can move its reward
on CPU. Tasks are generated in code: every problem ``a op b`` has a fixed split
(:func:`rljax.envs.base.split_of`), and :func:`make_arithmetic_tasks` samples from one split with a
seed, so train and held-out sets are disjoint and reproducible.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.envs.base import StepResult, Task, split_of

__all__ = ["ArithmeticEnv", "make_arithmetic_tasks"]

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_INT = re.compile(r"-?\d+")
PROMPT = "What is {a} {op} {b}? Answer with the number only."


def all_problems(*, max_operand: int = 9, ops: Sequence[str] = ("+",)) -> list[tuple[int, str, int]]:
    """Every ``(a, op, b)`` with operands in ``[0, max_operand]``.

    >>> len(all_problems(max_operand=2, ops=("+", "*")))
    18
    """
    bad = [op for op in ops if op not in _OPS]
    if bad or not ops:
        raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {list(ops)}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    return [(a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)]


def make_arithmetic_tasks(
    num_tasks: int,
    *,
    seed: int,
    split: str = "train",
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    test_fraction: float = 0.2,
) -> list[Task]:
    """``num_tasks`` distinct problems of ``split``, drawn with ``seed`` (fewer if the split is smaller).

    >>> tasks = make_arithmetic_tasks(3, seed=0)
    >>> len(tasks), tasks[0].env, tasks[0].split
    (3, 'arithmetic', 'train')
    >>> train = {t.id for t in make_arithmetic_tasks(1000, seed=0)}
    >>> test = {t.id for t in make_arithmetic_tasks(1000, seed=0, split="test")}
    >>> len(train) + len(test), train & test
    (100, set())
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    problems = [
        p
        for p in all_problems(max_operand=max_operand, ops=ops)
        if split_of(_key(*p), test_fraction=test_fraction) == split
    ]
    order = np.random.default_rng(seed).permutation(len(problems))[:num_tasks]
    tasks = []
    for i in order:
        a, op, b = problems[int(i)]
        tasks.append(
            Task(
                id=f"arith:{_key(a, op, b)}",
                data={"a": a, "op": op, "b": b, "answer": str(_OPS[op](a, b))},
                env=ArithmeticEnv.name,
                split=split,
                demonstration=f"{a} {op} {b} = {_OPS[op](a, b)}",  # for opsd (self-distillation)
            )
        )
    return tasks


def _key(a: int, op: str, b: int) -> str:
    return f"{a}{op}{b}"


class ArithmeticEnv:
    """One question, one answer, exact-match reward (see module docstring).

    Args:
      format_credit: reward for a well-formed (integer) but wrong answer, in ``[0, 1)``.
      system_prompt: optional system message.
      answer_format: ``"exact"`` (the reply is the bare number) or ``"last_number"`` (the reply's
        last integer is the answer).

    >>> env = ArithmeticEnv()
    >>> env.reset(Task("t", {"a": 3, "op": "+", "b": 4, "answer": "7"}))[-1]["content"]
    'What is 3 + 4? Answer with the number only.'
    >>> env.step(" 7 ")[1:3], env.done
    ((1.0, True), True)
    >>> lenient = ArithmeticEnv(answer_format="last_number")
    >>> _ = lenient.reset(Task("t", {"a": 3, "op": "+", "b": 4, "answer": "7"}))
    >>> lenient.score("3 + 4 = 7."), lenient.score("7 or 8"), lenient.score("seven")
    (1.0, 0.0, 0.0)
    """

    name = "arithmetic"
    tools = None

    def __init__(
        self, *, format_credit: float = 0.0, system_prompt: str | None = None, answer_format: str = "exact"
    ) -> None:
        if not 0.0 <= format_credit < 1.0:
            raise ValueError(f"format_credit must be in [0, 1), got {format_credit}")
        if answer_format not in ("exact", "last_number"):
            raise ValueError(f"answer_format must be 'exact' or 'last_number', got {answer_format!r}")
        self.answer_format = answer_format
        self.format_credit = float(format_credit)
        self.system_prompt = system_prompt
        self.task: Task | None = None
        self.done = False

    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Starts the episode of ``task``: the optional system prompt and the question."""
        for key in ("a", "op", "b", "answer"):
            if key not in task.data:
                raise ValueError(f"arithmetic task {task.id!r} has no {key!r} in its data")
        self.task, self.done = task, False
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        d = task.data
        messages.append({"role": "user", "content": PROMPT.format(a=d["a"], op=d["op"], b=d["b"])})
        return messages

    def score(self, content: str) -> float:
        """Reward of an answer text (module docstring)."""
        if self.task is None:
            raise ValueError("call reset(task) before step/score")
        text = content.strip()
        if self.answer_format == "last_number":
            numbers = _INT.findall(text)
            if not numbers:
                return 0.0
            return 1.0 if int(numbers[-1]) == int(self.task.data["answer"]) else self.format_credit
        if text == str(self.task.data["answer"]):
            return 1.0
        return self.format_credit if _INT.fullmatch(text) else 0.0

    def step(self, action: str) -> StepResult:
        """Scores the answer (1.0 when correct) and ends the episode."""
        if self.task is None or self.done:
            raise ValueError("step() after the episode ended (or before reset); call reset(task) first")
        self.done = True
        content = getattr(action, "content", action)
        reward = self.score(content)
        return StepResult([], reward, True, {"answer": self.task.data["answer"], "correct": reward == 1.0})

    @staticmethod
    def solution(task: Task) -> list[dict[str, Any]]:
        """The ideal assistant turn(s) after :meth:`reset` (for SFT warm starts and demos)."""
        return [{"role": "assistant", "content": str(task.data["answer"])}]
