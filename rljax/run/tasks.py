"""The run's environments and tasks: env factories, train/eval task lists, the seeded task order.

:func:`build_env_tasks` turns ``config.envs`` (or caller-supplied factories and tasks) into one
:class:`EnvTasks`; :class:`TaskIterator` draws the prompts of each RL step from the train tasks,
epoch by epoch, and its position is checkpointed so a resumed run draws exactly what the
uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax import envs as builtin_envs
from rljax.envs.base import Task
from rljax.envs.loader import load_attr
from rljax.envs.registry import env_factory, run_task_maker, task_maker
from rljax.envs.rewards import load_function
from rljax.run.config import EnvSection, RunConfig

__all__ = ["EnvTasks", "TaskIterator", "build_env_tasks"]


class TaskIterator:
    """Draws prompts epoch by epoch from seeded permutations; no task repeats within one draw.

    Epoch ``e`` visits the tasks in the order ``default_rng([seed, e]).permutation(N)``. A draw of
    ``n`` tasks that crosses into epoch ``e + 1`` takes the rest from the new epoch but never a task
    it already holds: those move to the back of epoch ``e + 1``'s order (deterministically), so
    every epoch still visits every task once and one RL step never trains a prompt twice.
    ``state()`` is JSON (``epoch``, ``position`` and the current epoch's order) and ``restore``
    continues exactly there.

    >>> it = TaskIterator([Task(f"t{i}") for i in range(3)], seed=0)
    >>> [t.id for t in it.take(2)], [t.id for t in it.take(2)], it.state()["epoch"]
    (['t2', 't0'], ['t1', 't2'], 1)
    """

    def __init__(self, tasks: Sequence[Task], *, seed: int) -> None:
        if not tasks:
            raise ValueError("the task iterator needs at least one task; check the env's num_train_tasks")
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"task ids must be unique (a task id is a prompt group); {dup!r} repeats")
        self.tasks = list(tasks)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))

    def take(self, n: int) -> list[Task]:
        """The next ``n`` tasks (distinct; ``n`` may not exceed the number of tasks)."""
        if n > len(self.tasks):
            raise ValueError(
                f"cannot draw {n} distinct tasks from {len(self.tasks)}: prompts_per_step must not exceed "
                "the number of train tasks"
            )
        picked: list[int] = []
        while len(picked) < n:
            if self.position == len(self.tasks):
                order = self._permutation(self.epoch + 1)
                held = np.isin(order, picked)  # already in this draw: to the back, in their order
                self.epoch, self.position = self.epoch + 1, 0
                self._order = np.concatenate([order[~held], order[held]])
            picked.append(int(self._order[self.position]))
            self.position += 1
        return [self.tasks[i] for i in picked]

    def state(self) -> dict[str, Any]:
        """The checkpointable state: epoch, position and task order."""
        return {"epoch": self.epoch, "position": self.position, "order": self._order.tolist()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from a :meth:`state`; a task order that no longer fits the task list raises
        ``ValueError``."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        order = state.get("order")
        self._order = self._permutation(self.epoch) if order is None else np.asarray(order, np.int64)
        if sorted(self._order.tolist()) != list(range(len(self.tasks))):
            raise ValueError(
                f"the checkpoint's task order covers {len(self._order)} tasks, the run has "
                f"{len(self.tasks)}: the task list changed since the checkpoint was written"
            )


def _dataset_tasks(name: str, spec: EnvSection, *, seed: int) -> tuple[list[Task], list[Task]]:
    """Train / eval tasks of ``config.envs.<name>.dataset`` (separate files or a held-out fraction)."""
    d = spec.dataset
    common = dict(format=d.get("format", "auto"), env=name, seed=seed)
    fraction = d.get("eval_fraction")
    try:
        train = builtin_envs.load_dataset_tasks(d["train"], split="train", eval_fraction=fraction, **common)
        if d.get("eval"):
            evals = builtin_envs.load_dataset_tasks(d["eval"], split="test", **common)
        elif fraction:
            evals = builtin_envs.load_dataset_tasks(
                d["train"], split="test", eval_fraction=fraction, **common
            )
        else:
            evals = []
    except (OSError, ValueError) as e:
        raise ValueError(f"config.envs.{name}.dataset: {e}") from None
    if spec.num_train_tasks is not None:
        train = train[: spec.num_train_tasks]
    if spec.num_eval_tasks is not None:
        evals = evals[: spec.num_eval_tasks]
    _check_reward_functions(name, [*train, *evals])
    if not train:
        raise ValueError(f"config.envs.{name}.dataset: no train rows in {d['train']!r}")
    return train, evals


@dataclasses.dataclass(frozen=True)
class EnvTasks:
    """Env name -> zero-argument factory, and the run's train / eval tasks (``Task.env`` = env name).

    ``agents``: env name -> agent function of the envs run as agents through the gateway
    (``config.envs.<name>.agent`` / ``agent_command``), ``agent_kwargs`` their keyword arguments;
    their factories build the env class of their task maker (the warm start's demonstrations), or
    raise when there is none."""

    factories: Mapping[str, Callable[[], Any]]
    train: tuple[Task, ...]
    eval: tuple[Task, ...]
    agents: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    agent_kwargs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def by_id(self) -> dict[str, Task]:
        """The train tasks by id."""
        return {t.id: t for t in self.train}


def build_env_tasks(
    cfg: RunConfig,
    *,
    make_env: Mapping[str, Callable[[], Any]] | None = None,
    tasks: Mapping[str, tuple[Sequence[Task], Sequence[Task]]] | None = None,
) -> EnvTasks:
    """Factories and tasks of every env of ``cfg.envs``; ``make_env`` / ``tasks`` override an env's.

    Raises ``ValueError`` for a ``make_env`` or ``tasks`` key that ``config.envs`` lacks (it would be
    ignored), for unknown env kinds or constructor keywords, and for duplicate task ids.
    """
    for what, given in (("make_env", make_env), ("tasks", tasks)):
        extra = sorted(set(given or {}) - set(cfg.envs))
        if extra:
            raise ValueError(
                f"Trainer({what}=...) names envs {extra} that config.envs lacks ({sorted(cfg.envs)}); add "
                f"config.envs.<name> = dict(env=...) for each, or drop them"
            )
    factories: dict[str, Callable[[], Any]] = {}
    agents: dict[str, Callable[..., Any]] = {}
    agent_kwargs: dict[str, dict[str, Any]] = {}
    train: list[Task] = []
    evals: list[Task] = []
    for name, spec in cfg.envs.items():
        if spec.verifiers:
            agents[name], agent_kwargs[name] = _verifiers_agent(name, spec), {}
            factories[name] = _no_env(name)
        elif spec.agent or spec.agent_command:
            agents[name], agent_kwargs[name] = _agent_of(name, spec), dict(spec.kwargs)
            factories[name] = _agent_env_factory(name, spec)
        elif make_env is not None and name in make_env:
            factories[name] = make_env[name]
        else:
            factories[name] = _env_factory(name, spec)
        if tasks is not None and name in tasks:
            tr, ev = tasks[name]
        elif spec.verifiers:
            tr, ev = _verifiers_tasks(name, spec, agents[name])
        elif spec.dataset:
            tr, ev = _dataset_tasks(name, spec, seed=cfg.seed)
        else:
            tr, ev = _made_tasks(name, spec, seed=cfg.seed)
        train += [dataclasses.replace(t, env=name) for t in tr]
        evals += [dataclasses.replace(t, env=name) for t in ev]
    return EnvTasks(
        factories=factories, train=tuple(train), eval=tuple(evals), agents=agents, agent_kwargs=agent_kwargs
    )


def _env_factory(name: str, spec: EnvSection) -> Callable[[], Any]:
    """The env's factory (its name resolved, its module imported), and one env built now: a bad name,
    keyword or value fails here, with its key path."""
    factory = env_factory(spec.env, spec.kwargs, where=f"config.envs.{name}.env")
    try:
        factory()
    except TypeError as e:
        raise ValueError(f"config.envs.{name}.kwargs: {e}") from None
    except ValueError as e:
        key, sep, why = str(e).partition(": ")
        if sep and key in spec.kwargs:  # "<keyword>: why" names its key
            raise ValueError(f"config.envs.{name}.kwargs.{key}: {why}") from None
        raise ValueError(f"config.envs.{name}: {e}") from None
    return factory


def _made_tasks(name: str, spec: EnvSection, *, seed: int) -> tuple[list[Task], list[Task]]:
    """Train / eval tasks of the env's task maker: ``config.envs.<name>.tasks``, else the env's own
    (:mod:`rljax.envs.registry`); train split seeded by ``seed``, eval split by ``seed + 1``."""
    if spec.tasks:
        maker = load_attr(spec.tasks, where=f"config.envs.{name}.tasks")
    else:
        try:
            maker = task_maker(spec.env, where=f"config.envs.{name}.env")
        except ValueError as e:
            if not (spec.agent or spec.agent_command):
                raise
            raise ValueError(
                f"config.envs.{name}: an agent's tasks come from dataset=dict(train=...), from "
                f"tasks='module:function' or from the task maker of env= ({e})"
            ) from None
    kwargs = dict(spec.task_kwargs)
    n_train = 256 if spec.num_train_tasks is None else spec.num_train_tasks
    n_eval = 0 if spec.num_eval_tasks is None else spec.num_eval_tasks
    where = f"config.envs.{name}"
    train = run_task_maker(maker, n_train, seed=seed, split="train", where=where, **kwargs)
    evals = run_task_maker(maker, n_eval, seed=seed + 1, split="test", where=where, **kwargs)
    return train, evals


def _check_reward_functions(name: str, tasks: Sequence[Task]) -> None:
    """Imports every ``"module:function"`` reward method the rows name: a bad one fails now, not
    when its first answer is scored."""
    checked: set[str] = set()
    for t in tasks:
        spec = t.reward_spec or {}
        method = spec.get("method", spec.get("style"))
        if isinstance(method, str) and ":" in method and method not in checked:
            try:
                load_function(method)
            except ValueError as e:
                where = f"config.envs.{name}.dataset: task {t.id!r} reward_spec.method"
                raise ValueError(f"{where}: {e}") from None
            checked.add(method)


def _agent_of(name: str, spec: EnvSection) -> Callable[..., Any]:
    """The agent function of an agent env (imported now: a wrong name fails before anything runs)."""
    from rljax.agents.runners import CommandAgent, load_agent

    try:
        return load_agent(spec.agent) if spec.agent else CommandAgent(spec.agent_command)
    except ValueError as e:
        raise ValueError(f"config.envs.{name}: {e}") from None


def _agent_env_factory(name: str, spec: EnvSection) -> Callable[[], Any]:
    """An agent env's factory: its task maker's env class (the warm start reads its solutions)."""
    kind = spec.env
    if kind in builtin_envs.ENVS:
        kwargs = dict(spec.kwargs)
        return lambda: builtin_envs.make_env(kind, **kwargs)

    def no_env() -> Any:
        raise ValueError(f"config.envs.{name} is an agent (config.envs.{name}.agent): it has no env class")

    return no_env


def _verifiers_agent(name: str, spec: EnvSection) -> Callable[..., Any]:
    """A verifiers env's agent (the env loaded now: a wrong id or config fails before anything runs)."""
    from rljax.agents.verifiers import verifiers_agent

    try:
        return verifiers_agent(spec.verifiers, spec.env_args)
    except (ImportError, ValueError, TypeError) as e:
        raise ValueError(f"config.envs.{name}.verifiers: {type(e).__name__}: {e}") from None


def _no_env(name: str) -> Callable[[], Any]:
    def no_env() -> Any:
        raise ValueError(f"config.envs.{name} is a verifiers env (run as an agent): it has no env class")

    return no_env


def _verifiers_tasks(name: str, spec: EnvSection, agent: Any) -> tuple[list[Task], list[Task]]:
    """A verifiers env's train tasks (its taskset) and eval tasks (the taskset with eval_env_args)."""
    train = agent.tasks(env_name=name, split="train", limit=spec.num_train_tasks)
    evals = []
    if spec.eval_env_args and spec.num_eval_tasks != 0:
        evals = agent.tasks(
            env_name=name, split="test", taskset_args=spec.eval_env_args, limit=spec.num_eval_tasks
        )
    if not train:
        raise ValueError(f"config.envs.{name}: verifiers env {spec.verifiers!r} yields no tasks")
    return train, evals
