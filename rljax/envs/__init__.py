"""Multi-turn environments: the protocol and the built-in tasks (design §4).

An environment runs one episode: ``reset(task) -> messages`` then ``step(action) -> (messages,
reward, done, info)`` after every assistant turn (sync or ``async``). See :mod:`rljax.envs.base`.

Built in:

* ``"arithmetic"`` (:class:`ArithmeticEnv`): single-turn, exact-match reward.
* ``"lookup"`` (:class:`ToolLookupEnv`): multi-turn tool use (``lookup`` tool via Qwen/Hermes
  ``<tool_call>`` JSON, a tool message back, then the answer), with shaped partial credit.
* ``"calculator"`` (:class:`CalculatorEnv`): multi-turn tool use on numbers too large to guess
  (call ``multiply``, read its result, answer), with shaped partial credit.
* ``"guess_number"`` (:class:`GuessNumberEnv`): an interactive game without tools, a hidden number
  found from higher / lower replies within a few guesses.
* ``"verifiable"`` (:class:`VerifiableEnv`): dataset rows scored by their ``reward_spec``
  (``math_verify``, ``exact_match``, a user ``module:fn``); see :func:`load_dataset_tasks`.

Environment libraries (the ``envs`` extra):

* ``"skyrl_gym:<env id>"`` / ``"skyrl_gym"`` (:class:`~rljax.envs.skyrl_gym.SkyRLGymEnv`): any
  registered skyrl-gym environment, unchanged.
* ``"reasoning_gym:<dataset>"`` / ``"reasoning_gym"``: reasoning-gym datasets
  (:mod:`rljax.envs.reasoning_gym`); ``make_tasks("reasoning_gym:<dataset>", n, seed=, split=,
  **config)`` generates their tasks, ``"reasoning_gym:mix"`` with ``datasets=`` weighted mixes.

Your own (no edit to rljax; :mod:`rljax.envs.registry` tells how): ``config.envs.<name>.env =
"my_pkg.envs:MyEnv"``, an id given to :func:`register`, or an id an installed package declares as
an entry point of the group ``rljax.envs``.

>>> from rljax import envs
>>> env = envs.make_env("arithmetic")
>>> tasks = envs.make_tasks("arithmetic", 4, seed=0, split="test")
>>> len(tasks), env.reset(tasks[0])[0]["role"]
(4, 'user')
"""

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
from rljax.envs.calculator import MULTIPLY_TOOL, CalculatorEnv, make_calculator_tasks
from rljax.envs.datasets import load_dataset_tasks, task_to_row, write_rows
from rljax.envs.guess_number import GuessNumberEnv, make_guess_tasks
from rljax.envs.loader import LoadError, load_attr
from rljax.envs.registry import (
    ENTRY_POINT_GROUP,
    ENVS,
    LIBRARIES,
    TASK_MAKERS,
    env_factory,
    make_env,
    make_tasks,
    register,
)
from rljax.envs.tool_lookup import COLORS, LOOKUP_TOOL, ToolLookupEnv, make_lookup_tasks
from rljax.envs.verifiable import VerifiableEnv

__all__ = [
    "COLORS",
    "ENTRY_POINT_GROUP",
    "ENVS",
    "LIBRARIES",
    "LOOKUP_TOOL",
    "MULTIPLY_TOOL",
    "LoadError",
    "TASK_MAKERS",
    "Action",
    "ArithmeticEnv",
    "CalculatorEnv",
    "Environment",
    "GuessNumberEnv",
    "StepResult",
    "Task",
    "ToolLookupEnv",
    "VerifiableEnv",
    "as_step_result",
    "env_factory",
    "load_attr",
    "load_dataset_tasks",
    "make_arithmetic_tasks",
    "make_calculator_tasks",
    "make_env",
    "make_guess_tasks",
    "make_lookup_tasks",
    "make_tasks",
    "maybe_await",
    "mean_numeric_metrics",
    "register",
    "split_of",
    "task_to_row",
    "write_rows",
]
