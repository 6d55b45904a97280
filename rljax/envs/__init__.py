"""Multi-turn environments: the protocol and the built-in tasks (design §4).

An environment runs one episode: ``reset(task) -> messages`` then ``step(action) -> (messages,
reward, done, info)`` after every assistant turn (sync or ``async``). See :mod:`rljax.envs.base`.

Built in:

* ``"arithmetic"`` (:class:`ArithmeticEnv`): single-turn, exact-match reward.
* ``"lookup"`` (:class:`ToolLookupEnv`): multi-turn tool use (``lookup`` tool via Qwen/Hermes
  ``<tool_call>`` JSON, a tool message back, then the answer), with shaped partial credit.
* ``"verifiable"`` (:class:`VerifiableEnv`): dataset rows scored by their ``reward_spec``
  (``math_verify``, ``exact_match``, a user ``module:fn``); see :func:`load_dataset_tasks`.

Environment libraries (the ``envs`` extra):

* ``"skyrl_gym:<env id>"`` / ``"skyrl_gym"`` (:class:`~rljax.envs.skyrl_gym.SkyRLGymEnv`): any
  registered skyrl-gym environment, unchanged.
* ``"reasoning_gym:<dataset>"`` / ``"reasoning_gym"``: reasoning-gym datasets
  (:mod:`rljax.envs.reasoning_gym`); ``make_tasks("reasoning_gym:<dataset>", n, seed=, split=,
  **config)`` generates their tasks, ``"reasoning_gym:mix"`` with ``datasets=`` weighted mixes.

>>> from rljax import envs
>>> env = envs.make_env("arithmetic")
>>> tasks = envs.make_tasks("arithmetic", 4, seed=0, split="test")
>>> len(tasks), env.reset(tasks[0])[0]["role"]
(4, 'user')
"""

from collections.abc import Callable
from typing import Any

from rljax.envs.arithmetic import ArithmeticEnv, make_arithmetic_tasks
from rljax.envs.base import (
    Action,
    Environment,
    StepResult,
    Task,
    as_step_result,
    maybe_await,
    mean_numeric_metrics,
    split_of,
)
from rljax.envs.datasets import load_dataset_tasks, task_to_row, write_rows
from rljax.envs.tool_lookup import COLORS, LOOKUP_TOOL, ToolLookupEnv, make_lookup_tasks
from rljax.envs.verifiable import VerifiableEnv

ENVS: dict[str, type] = {
    ArithmeticEnv.name: ArithmeticEnv,
    ToolLookupEnv.name: ToolLookupEnv,
    VerifiableEnv.name: VerifiableEnv,
}
TASK_MAKERS: dict[str, Callable[..., list[Task]]] = {
    ArithmeticEnv.name: make_arithmetic_tasks,
    ToolLookupEnv.name: make_lookup_tasks,
}
LIBRARIES = ("skyrl_gym", "reasoning_gym")


def _library(name: str) -> tuple[str, str | None] | None:
    """``("skyrl_gym", "gsm8k")`` for ``"skyrl_gym:gsm8k"``, ``(lib, None)`` for a bare library name."""
    lib, sep, rest = name.partition(":")
    if lib not in LIBRARIES:
        return None
    if sep and not rest:
        raise ValueError(f"environment {name!r} names no {lib} id after the colon")
    return lib, rest or None


def make_env(name: str, **kwargs: Any) -> Any:
    """A fresh environment by name (keyword arguments go to its constructor).

    Names: the built-ins (``ENVS``), ``"skyrl_gym:<env id>"`` (kwargs: ``env_config``,
    ``on_postprocessed_action``), ``"skyrl_gym"`` (env id from each task's ``env_class``),
    ``"reasoning_gym:<dataset>"`` / ``"reasoning_gym"`` (kwargs: ``answer_tag``,
    ``extract_answer``, ``system_prompt``).
    """
    lib = _library(name)
    if lib is not None:
        if lib[0] == "skyrl_gym":
            from rljax.envs.skyrl_gym import SkyRLGymEnv

            return SkyRLGymEnv(lib[1], **kwargs)
        from rljax.envs.reasoning_gym import ReasoningGymEnv

        return ReasoningGymEnv(lib[1], **kwargs)
    if name not in ENVS:
        raise ValueError(
            f"unknown environment {name!r}; built-in ones are {sorted(ENVS)}, libraries "
            "'skyrl_gym:<env id>' and 'reasoning_gym:<dataset>'"
        )
    return ENVS[name](**kwargs)


def make_tasks(name: str, num_tasks: int, *, seed: int, split: str = "train", **kwargs: Any) -> list[Task]:
    """``num_tasks`` tasks of ``split``, generated from ``seed``: a built-in environment's, or a
    reasoning-gym dataset's (``"reasoning_gym:<dataset>"``, kwargs = the dataset's config;
    ``"reasoning_gym:mix"`` with ``datasets=``)."""
    lib = _library(name)
    if lib is not None:
        if lib[0] != "reasoning_gym" or lib[1] is None:
            raise ValueError(
                f"{name!r} generates no tasks; skyrl-gym tasks come from dataset rows "
                "(load_dataset_tasks), reasoning-gym ones from 'reasoning_gym:<dataset>'"
            )
        from rljax.envs.reasoning_gym import make_reasoning_gym_tasks

        return make_reasoning_gym_tasks(lib[1], num_tasks, seed=seed, split=split, **kwargs)
    if name not in TASK_MAKERS:
        raise ValueError(f"unknown environment {name!r}; built-in ones are {sorted(TASK_MAKERS)}")
    return TASK_MAKERS[name](num_tasks, seed=seed, split=split, **kwargs)


__all__ = [
    "COLORS",
    "ENVS",
    "LIBRARIES",
    "LOOKUP_TOOL",
    "TASK_MAKERS",
    "Action",
    "ArithmeticEnv",
    "Environment",
    "StepResult",
    "Task",
    "ToolLookupEnv",
    "VerifiableEnv",
    "as_step_result",
    "load_dataset_tasks",
    "make_arithmetic_tasks",
    "make_env",
    "make_lookup_tasks",
    "make_tasks",
    "maybe_await",
    "mean_numeric_metrics",
    "split_of",
    "task_to_row",
    "write_rows",
]
