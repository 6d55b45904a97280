"""Interactive game without tools: find a hidden number from higher / lower replies (design §4 built-ins).

The user thinks of a number between 1 and ``n`` and gives the assistant ``max_guesses`` tries; after
each wrong guess it answers whether its number is higher or lower, so the environment's replies
decide the next move::

    user: I am thinking of a number between 1 and 13. ... You have 4 guesses.
    assistant: 7          user: My number is higher than 7.
    assistant: 10         user: My number is lower than 10.
    assistant: 8          -> done, reward 1

A guess is the first integer of the reply (a reply without one uses up a guess and is told to answer
with a number). Reward 1 when a guess hits the number, else 0 when the guesses run out (or a turn is
truncated); ``info["correct"]`` is what held-out ``eval/pass@k`` counts. ``max_guesses`` is the
number of guesses binary search needs for ``n`` (``n.bit_length()``) plus ``extra_guesses`` (default
0): a player who halves the range always wins, one who ignores the replies (never repeating a guess)
wins ``max_guesses / n`` of the games, about a quarter for ``n`` from 10 to 30.

Tasks (:func:`make_guess_tasks`) are pairs ``(n, number)`` with ``n`` in a range; each pair has a
fixed train / test split by a stable hash. The number is hidden: two tasks of the same ``n`` have the
same prompt, and the held-out tasks test the strategy on numbers and ranges the training never hid.
:meth:`GuessNumberEnv.solution` plays binary search (the demonstrations of a warm start).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rljax.envs.base import StepResult, Task, split_of

__all__ = ["GuessNumberEnv", "binary_search_guesses", "make_guess_tasks"]

PROMPT = (
    "I am thinking of a number between 1 and {n}. Guess it: reply with one number. After each guess "
    "I tell you whether my number is higher or lower. You have {max_guesses} guesses."
)
HIGHER = "My number is higher than {guess}."
LOWER = "My number is lower than {guess}."
NO_NUMBER = "Reply with one number between 1 and {n}."
_INT = re.compile(r"-?\d+")


def binary_search_guesses(n: int, number: int) -> list[int]:
    """The guesses of binary search over ``1..n`` (the middle of the range left, rounded down) until
    it hits ``number``.

    >>> binary_search_guesses(13, 8), binary_search_guesses(13, 7)
    ([7, 10, 8], [7])
    """
    if not 1 <= number <= n:
        raise ValueError(f"number must be in [1, n={n}], got {number}")
    lo, hi, out = 1, n, []
    while True:
        guess = (lo + hi) // 2
        out.append(guess)
        if guess == number:
            return out
        lo, hi = (guess + 1, hi) if number > guess else (lo, guess - 1)


def make_guess_tasks(
    num_tasks: int,
    *,
    seed: int,
    split: str = "train",
    n_range: tuple[int, int] = (10, 30),
    extra_guesses: int = 0,
    test_fraction: float = 0.2,
) -> list[Task]:
    """``num_tasks`` distinct games ``(n, number)`` of ``split``, ``n`` in the inclusive ``n_range``.

    >>> t = make_guess_tasks(3, seed=0)[0]
    >>> sorted(t.data), t.data["max_guesses"] == t.data["n"].bit_length(), t.env
    (['max_guesses', 'n', 'number'], True, 'guess_number')
    >>> games = [(n, k) for n in range(10, 31) for k in range(1, n + 1)]
    >>> len(make_guess_tasks(1000, seed=0)) + len(make_guess_tasks(1000, seed=0, split="test")) == len(games)
    True
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    lo, hi = n_range
    if not 1 <= lo <= hi:
        raise ValueError(f"n_range must be (low, high) with 1 <= low <= high, got {n_range}")
    if extra_guesses < 0:
        raise ValueError(f"extra_guesses must be >= 0, got {extra_guesses}")
    games = [(n, k) for n in range(lo, hi + 1) for k in range(1, n + 1)]
    games = [g for g in games if split_of(f"guess:{g[0]}:{g[1]}", test_fraction=test_fraction) == split]
    order = np.random.default_rng(seed).permutation(len(games))[:num_tasks]
    tasks = []
    for i in order:
        n, number = games[int(i)]
        guesses = binary_search_guesses(n, number)
        tasks.append(
            Task(
                id=f"guess:{n}:{number}",
                data={"n": n, "number": number, "max_guesses": n.bit_length() + extra_guesses},
                env=GuessNumberEnv.name,
                split=split,
                demonstration="Binary search: guess " + ", then ".join(map(str, guesses)) + ".",
            )
        )
    return tasks


class GuessNumberEnv:
    """The guessing game (see module docstring).

    Args:
      system_prompt: optional system message (None: the renderer's default, if any).

    >>> env = GuessNumberEnv()
    >>> env.reset(Task("t", {"n": 13, "number": 8, "max_guesses": 4}))[-1]["content"][:43]
    'I am thinking of a number between 1 and 13.'
    >>> env.step("7")[:3]
    ([{'role': 'user', 'content': 'My number is higher than 7.'}], 0.0, False)
    >>> env.step("I guess 8.")[1:3]
    (1.0, True)
    """

    name = "guess_number"
    tools = None

    def __init__(self, *, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt
        self.task: Task | None = None
        self.done = False
        self.guesses: list[int | None] = []

    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Starts the game of ``task``: the optional system prompt and the rules."""
        for key in ("n", "number", "max_guesses"):
            if key not in task.data:
                raise ValueError(f"guess_number task {task.id!r} has no {key!r} in its data")
        self.task, self.done, self.guesses = task, False, []
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        d = task.data
        messages.append({"role": "user", "content": PROMPT.format(n=d["n"], max_guesses=d["max_guesses"])})
        return messages

    def step(self, action: str) -> StepResult:
        """Reads the guess; answers higher / lower, or ends the game (hit, out of guesses, truncated)."""
        if self.task is None or self.done:
            raise ValueError("step() after the game ended (or before reset); call reset(task) first")
        d = self.task.data
        found = _INT.search(getattr(action, "content", action))
        guess = int(found.group()) if found else None
        self.guesses.append(guess)
        info: dict[str, Any] = {"number": d["number"], "guesses": len(self.guesses)}
        if guess == d["number"]:
            self.done = True
            return StepResult([], 1.0, True, {**info, "correct": True})
        if len(self.guesses) >= d["max_guesses"] or not getattr(action, "stopped", True):
            self.done = True
            return StepResult([], 0.0, True, {**info, "correct": False})
        if guess is None:
            reply = NO_NUMBER.format(n=d["n"])
        else:
            reply = (HIGHER if d["number"] > guess else LOWER).format(guess=guess)
        return StepResult([{"role": "user", "content": reply}], 0.0, False, info)

    @staticmethod
    def solution(task: Task) -> list[dict[str, Any]]:
        """Binary search's turns after :meth:`reset`: each guess and the reply to it."""
        n, number = task.data["n"], task.data["number"]
        guesses = binary_search_guesses(n, number)
        out: list[dict[str, Any]] = []
        for k, guess in enumerate(guesses):
            out.append({"role": "assistant", "content": str(guess)})
            if k + 1 < len(guesses):
                out.append(
                    {"role": "user", "content": (HIGHER if number > guess else LOWER).format(guess=guess)}
                )
        return out
