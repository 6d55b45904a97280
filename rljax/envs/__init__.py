"""Multi-turn environments: the protocol and the built-in tasks (SPEC §4).

An environment runs one episode: ``reset(task) -> messages`` then ``step(action) -> (messages,
reward, done, info)`` after every assistant turn (sync or ``async``). See :mod:`rljax.envs.base`.

Built in:

* ``"arithmetic"`` (:class:`ArithmeticEnv`): single-turn, exact-match reward.
* ``"lookup"`` (:class:`ToolLookupEnv`): multi-turn tool use (``lookup`` tool via Qwen/Hermes
  ``<tool_call>`` JSON, a tool message back, then the answer), with shaped partial credit.

>>> from rljax import envs
>>> env = envs.make_env("arithmetic")
>>> tasks = envs.make_tasks("arithmetic", 4, seed=0, split="test")
>>> len(tasks), env.reset(tasks[0])[0]["role"]
(4, 'user')
"""

from collections.abc import Callable
from typing import Any

from rljax.envs.arithmetic import ArithmeticEnv, make_arithmetic_tasks
from rljax.envs.base import Action, Environment, StepResult, Task, as_step_result, maybe_await, split_of
from rljax.envs.tool_lookup import COLORS, LOOKUP_TOOL, ToolLookupEnv, make_lookup_tasks

ENVS: dict[str, type] = {ArithmeticEnv.name: ArithmeticEnv, ToolLookupEnv.name: ToolLookupEnv}
TASK_MAKERS: dict[str, Callable[..., list[Task]]] = {
    ArithmeticEnv.name: make_arithmetic_tasks,
    ToolLookupEnv.name: make_lookup_tasks,
}


def make_env(name: str, **kwargs: Any) -> Any:
    """A fresh built-in environment by name (keyword arguments go to its constructor)."""
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; built-in ones are {sorted(ENVS)}")
    return ENVS[name](**kwargs)


def make_tasks(name: str, num_tasks: int, *, seed: int, split: str = "train", **kwargs: Any) -> list[Task]:
    """``num_tasks`` tasks of a built-in environment's ``split``, generated from ``seed``."""
    if name not in TASK_MAKERS:
        raise ValueError(f"unknown environment {name!r}; built-in ones are {sorted(TASK_MAKERS)}")
    return TASK_MAKERS[name](num_tasks, seed=seed, split=split, **kwargs)


__all__ = [
    "COLORS",
    "ENVS",
    "LOOKUP_TOOL",
    "TASK_MAKERS",
    "Action",
    "ArithmeticEnv",
    "Environment",
    "StepResult",
    "Task",
    "ToolLookupEnv",
    "as_step_result",
    "make_arithmetic_tasks",
    "make_env",
    "make_lookup_tasks",
    "make_tasks",
    "maybe_await",
    "split_of",
]
