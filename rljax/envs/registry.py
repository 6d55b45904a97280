"""Environments by id, and how to add your own without editing rljax.

An environment is any class (or factory) whose instances run one episode: ``reset(task) ->
messages``, then ``step(action) -> (messages, reward, done, info)`` after every assistant turn
(sync or ``async``; see :mod:`rljax.envs.base`). A run names it in ``config.envs.<name>.env``:

1. an import string, ``"my_pkg.envs:MyEnv"``: the class, or a factory called with the section's
   ``kwargs``; imported when the trainer is built (the module must be importable: an installed
   package, or its directory on ``PYTHONPATH``);
2. an id registered in Python before the trainer is built: ``rljax.envs.register("my-env",
   entry_point=MyEnv)`` (or ``entry_point="my_pkg.envs:MyEnv"``, imported on first use);
3. an id an installed package declares as an entry point of the group ``rljax.envs``, found
   through :mod:`importlib.metadata` (the package is imported only when the id is used)::

       # pyproject.toml of my_pkg
       [project.entry-points."rljax.envs"]
       my-env = "my_pkg.envs:MyEnv"

The built-in ids (:data:`ENVS`) and the library forms (``"skyrl_gym:<env id>"``,
``"reasoning_gym:<dataset>"``) keep their meaning: :func:`register` refuses them and an entry point
of such a name is never consulted. A registered id wins over an installed one of the same name.

Tasks: a run's tasks come from ``config.envs.<name>.dataset`` (rows, see
:func:`rljax.envs.load_dataset_tasks`) or from a **task maker**, the first of:
``config.envs.<name>.tasks = "my_pkg.envs:make_tasks"``, the ``tasks=`` given to :func:`register`,
the env's own ``make_tasks`` attribute (a staticmethod or classmethod of the class), the built-in
one. It is called as::

    make_tasks(num_tasks, *, seed, split, **task_kwargs) -> list[Task]

for ``split="train"`` (``num_train_tasks``, ``seed``) and ``"test"`` (``num_eval_tasks``,
``seed + 1``; not called for 0 tasks). It returns :class:`~rljax.envs.base.Task` records (or
dicts of their fields, e.g. ``{"id": "q1", "data": {...}}``) with unique ids; at most ``num_tasks``
are kept.

>>> class Echo:
...     @staticmethod
...     def make_tasks(num_tasks, *, seed, split):
...         return [{"id": f"{split}-{w}", "data": {"word": w}} for w in ["hi", "yo"][:num_tasks]]
...     def reset(self, task):
...         self.word = task.data["word"]
...         return [{"role": "user", "content": f"Say {self.word}."}]
...     def step(self, action):
...         return [], float(action.strip() == self.word), True, {}
>>> register("echo-example", entry_point=Echo)
>>> env, tasks = make_env("echo-example"), make_tasks("echo-example", 2, seed=0)
>>> env.reset(tasks[1])[0]["content"], env.step(" yo ")[1]
('Say yo.', 1.0)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rljax.envs.arithmetic import ArithmeticEnv, make_arithmetic_tasks
from rljax.envs.base import Task
from rljax.envs.calculator import CalculatorEnv, make_calculator_tasks
from rljax.envs.guess_number import GuessNumberEnv, make_guess_tasks
from rljax.envs.loader import load_attr, split_import_string
from rljax.envs.tool_lookup import ToolLookupEnv, make_lookup_tasks
from rljax.envs.verifiable import VerifiableEnv

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVS",
    "LIBRARIES",
    "TASK_MAKERS",
    "EnvSpec",
    "env_factory",
    "make_env",
    "make_tasks",
    "register",
    "run_task_maker",
    "task_maker",
]

#: The importlib.metadata entry-point group installed packages declare their envs in.
ENTRY_POINT_GROUP = "rljax.envs"

#: The built-in environment classes by name (``config.envs.<name>.env``).
ENVS: dict[str, type] = {
    ArithmeticEnv.name: ArithmeticEnv,
    CalculatorEnv.name: CalculatorEnv,
    GuessNumberEnv.name: GuessNumberEnv,
    ToolLookupEnv.name: ToolLookupEnv,
    VerifiableEnv.name: VerifiableEnv,
}
#: The task makers of the built-in environments by name.
TASK_MAKERS: dict[str, Callable[..., list[Task]]] = {
    ArithmeticEnv.name: make_arithmetic_tasks,
    CalculatorEnv.name: make_calculator_tasks,
    GuessNumberEnv.name: make_guess_tasks,
    ToolLookupEnv.name: make_lookup_tasks,
}
#: Environment libraries named as ``<library>:<id>`` (``skyrl_gym:gsm8k``, ``reasoning_gym:leg_counting``).
LIBRARIES = ("skyrl_gym", "reasoning_gym")

Factory = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """A registered environment: ``entry_point`` builds it and ``tasks`` makes its tasks (None: the
    entry point's ``make_tasks`` attribute, if any); each a callable or a ``"module:attr"`` string
    imported on first use. ``origin`` says where the id came from (in error messages)."""

    id: str
    entry_point: Factory | str
    tasks: Factory | str | None = None
    origin: str = "rljax.envs.register"


_REGISTERED: dict[str, EnvSpec] = {}


def _identity(obj: Factory | str | None) -> str | None:
    """What makes two registrations the same: the import string, or the callable's qualified name
    (so re-running a notebook cell that defines and registers a class replaces it silently)."""
    if obj is None or isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def register(id: str, entry_point: Factory | str, *, tasks: Factory | str | None = None) -> None:
    """Makes ``id`` name an environment (for ``config.envs.<name>.env = id`` and :func:`make_env`).

    ``entry_point``: the env class or a factory (called with the env's ``kwargs``), or its
    ``"module:attr"`` import string (imported on first use). ``tasks``: its task maker (module
    docstring), same forms; None = the entry point's ``make_tasks`` attribute. Registering an id
    again replaces it (with a warning when the new entry point is a different one); built-in and
    library names are refused.

    >>> register("arith-copy", entry_point="rljax.envs.arithmetic:ArithmeticEnv",
    ...          tasks="rljax.envs.arithmetic:make_arithmetic_tasks")
    >>> type(make_env("arith-copy")).__name__, len(make_tasks("arith-copy", 3, seed=0))
    ('ArithmeticEnv', 3)
    """
    if not isinstance(id, str) or not id or ":" in id or id != id.strip():
        raise ValueError(f"an environment id is a non-empty string without ':' or outer spaces, got {id!r}")
    if id in ENVS or id in LIBRARIES:
        raise ValueError(f"{id!r} is a built-in environment name; register yours under another id")
    for what, obj in (("entry_point", entry_point), ("tasks", tasks)):
        if isinstance(obj, str):
            split_import_string(obj, where=f"register({id!r}) {what}")  # its form now, its import on use
        elif obj is not None and not callable(obj):
            raise ValueError(f"register({id!r}): {what} must be a callable or 'module:attr', got {obj!r}")
    old = _REGISTERED.get(id)
    if old is not None and _identity(old.entry_point) != _identity(entry_point):
        warnings.warn(
            f"environment {id!r} was registered as {_identity(old.entry_point)}; now "
            f"{_identity(entry_point)} replaces it",
            RuntimeWarning,
            stacklevel=2,
        )
    _REGISTERED[id] = EnvSpec(id, entry_point, tasks)


def _installed(id: str) -> EnvSpec | None:
    """The entry point ``id`` of the group ``rljax.envs`` among the installed distributions."""
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP).select(name=id)
    by_value = {ep.value: ep for ep in found}  # the same distribution seen twice on sys.path: one
    if not by_value:
        return None
    if len(by_value) > 1:
        raise ValueError(
            f"environment {id!r} is declared by several installed entry points ({ENTRY_POINT_GROUP}): "
            f"{sorted(by_value)}; uninstall one, or name the env by its import string"
        )
    ep = next(iter(by_value.values()))
    dist = getattr(ep.dist, "name", None) or "?"
    return EnvSpec(id, ep.value, None, origin=f"the entry point {id!r} of distribution {dist!r}")


def _installed_ids() -> list[str]:
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def _library(name: str) -> tuple[str, str | None] | None:
    """``("skyrl_gym", "gsm8k")`` for ``"skyrl_gym:gsm8k"``, ``(lib, None)`` for a bare library name."""
    lib, sep, rest = name.partition(":")
    if lib not in LIBRARIES:
        return None
    if sep and not rest:
        raise ValueError(f"environment {name!r} names no {lib} id after the colon")
    return lib, rest or None


def _library_env(lib: str, id: str | None) -> Factory:
    if lib == "skyrl_gym":
        from rljax.envs.skyrl_gym import SkyRLGymEnv

        return functools.partial(SkyRLGymEnv, id)
    from rljax.envs.reasoning_gym import ReasoningGymEnv

    return functools.partial(ReasoningGymEnv, id)


def _prefix(where: str | None, text: str) -> str:
    return f"{where}: {text}" if where else text


def _load(obj: Factory | str, spec: EnvSpec, what: str, where: str | None) -> Factory:
    if callable(obj):
        return obj
    context = f"{what} of environment {spec.id!r} (from {spec.origin})"
    return load_attr(obj, where=_prefix(where, context))


def _resolve(name: str, where: str | None) -> tuple[Factory, Factory | None]:
    """The constructor of the env ``name`` and its default task maker (None when it has none)."""
    if not isinstance(name, str) or not name:
        raise ValueError(_prefix(where, f"an environment is named by a non-empty string, got {name!r}"))
    lib = _library(name)
    if lib is not None:
        maker = None
        if lib[0] == "reasoning_gym" and lib[1] is not None:
            from rljax.envs.reasoning_gym import make_reasoning_gym_tasks

            maker = functools.partial(make_reasoning_gym_tasks, lib[1])
        return _library_env(*lib), maker
    if name in ENVS:
        return ENVS[name], TASK_MAKERS.get(name)
    if ":" in name:
        ctor = load_attr(name, where=where)
        return ctor, _own_task_maker(ctor)
    spec = _REGISTERED.get(name) or _installed(name)
    if spec is None:
        raise ValueError(_prefix(where, _unknown(name)))
    ctor = _load(spec.entry_point, spec, "the entry point", where)
    maker = _load(spec.tasks, spec, "the task maker", where) if spec.tasks is not None else None
    return ctor, maker or _own_task_maker(ctor)


def _own_task_maker(ctor: Factory) -> Factory | None:
    maker = getattr(ctor, "make_tasks", None)
    return maker if callable(maker) else None


def _unknown(name: str) -> str:
    return (
        f"unknown environment {name!r}; built-in ones are {sorted(ENVS)}, registered ones "
        f"{sorted(_REGISTERED)}, installed ones (entry points {ENTRY_POINT_GROUP!r}) {_installed_ids()}; "
        "or a library ('skyrl_gym:<env id>', 'reasoning_gym:<dataset>'), or an import string "
        "'module:Class' (see rljax.envs.registry)"
    )


def env_factory(
    name: str, kwargs: Mapping[str, Any] | None = None, *, where: str | None = None
) -> Callable[[], Any]:
    """A zero-argument factory of fresh ``name`` environments built with ``kwargs``; the name is
    resolved (and its module imported) now, so a bad one fails here, its message prefixed ``where``.

    >>> new = env_factory("arithmetic", {"format_credit": 0.1})
    >>> new() is not new(), new().format_credit
    (True, 0.1)
    """
    ctor, _ = _resolve(name, where)
    kw = dict(kwargs or {})
    return lambda: ctor(**kw)


def make_env(name: str, **kwargs: Any) -> Any:
    """A fresh environment by name (keyword arguments go to its constructor).

    Names: the built-ins (``ENVS``), registered and installed ids and ``"module:Class"`` strings
    (module docstring), ``"skyrl_gym:<env id>"`` (kwargs: ``env_config``,
    ``on_postprocessed_action``), ``"skyrl_gym"`` (env id from each task's ``env_class``),
    ``"reasoning_gym:<dataset>"`` / ``"reasoning_gym"`` (kwargs: ``answer_tag``,
    ``extract_answer``, ``system_prompt``).
    """
    return env_factory(name, kwargs)()


def task_maker(name: str, *, where: str | None = None) -> Factory:
    """The task maker of the env ``name`` (module docstring); ``ValueError`` when it has none."""
    lib = _library(name) if isinstance(name, str) else None
    if lib is not None and (lib[0] != "reasoning_gym" or lib[1] is None):
        raise ValueError(
            _prefix(
                where,
                f"{name!r} generates no tasks; skyrl-gym tasks come from dataset rows "
                "(load_dataset_tasks), reasoning-gym ones from 'reasoning_gym:<dataset>'",
            )
        )
    ctor, maker = _resolve(name, where)
    if maker is None:
        raise ValueError(
            _prefix(
                where,
                f"environment {name!r} ({getattr(ctor, '__qualname__', ctor)!r}) has no task maker: give it "
                "a make_tasks(num_tasks, *, seed, split, **task_kwargs) staticmethod, or set "
                "config.envs.<name>.tasks = 'module:function' or config.envs.<name>.dataset",
            )
        )
    return maker


def run_task_maker(
    maker: Factory, num_tasks: int, *, seed: int, split: str, where: str | None = None, **kwargs: Any
) -> list[Task]:
    """``maker(num_tasks, seed=seed, split=split, **kwargs)`` checked: Task records (dicts of Task
    fields are converted), at most ``num_tasks``; no call for 0 tasks.

    >>> def two(num_tasks, *, seed, split):
    ...     return [{"id": "a"}, {"id": "b"}]
    >>> [t.id for t in run_task_maker(two, 1, seed=0, split="train")]
    ['a']
    """
    if num_tasks == 0:
        return []
    made = maker(num_tasks, seed=seed, split=split, **kwargs)
    what = _prefix(where, f"the task maker {getattr(maker, '__qualname__', maker)!r}")
    if isinstance(made, (str, bytes, Mapping)) or not isinstance(made, Iterable):
        raise ValueError(f"{what} returned {type(made).__name__}, not a list of Task")
    tasks = []
    for t in made:
        if len(tasks) == num_tasks:
            break
        if isinstance(t, Mapping):
            try:
                t = Task(**t)
            except TypeError as e:
                raise ValueError(f"{what} returned a task dict that is not Task fields: {e}") from None
        if not isinstance(t, Task):
            raise ValueError(
                f"{what} returned {type(t).__name__} {t!r:.60}, not a Task or dict of Task fields",
            )
        tasks.append(t)
    return tasks


def make_tasks(name: str, num_tasks: int, *, seed: int, split: str = "train", **kwargs: Any) -> list[Task]:
    """``num_tasks`` tasks of ``split``, generated from ``seed`` by the env ``name``'s task maker
    (module docstring): a built-in's, a registered or installed env's, or a reasoning-gym dataset's
    (``"reasoning_gym:<dataset>"``, kwargs = the dataset's config; ``"reasoning_gym:mix"`` with
    ``datasets=``)."""
    return run_task_maker(task_maker(name), num_tasks, seed=seed, split=split, **kwargs)
