"""The environment protocol of the agent loop, and the small types around it (design §4).

An environment is one episode's state machine; the rollout builds a fresh one per trajectory::

    messages = env.reset(task)                            # initial chat messages (system / user)
    messages, reward, done, info = env.step(action)       # after each assistant turn

Both methods may be plain functions or coroutines (``async def``); the rollout awaits whatever
they return. ``env.tools`` (optional) lists the tool specs (OpenAI JSON-schema dicts) rendered into
the system prompt, and ``env.name`` names the environment on every emitted step.

The action passed to ``step`` is an :class:`Action`: a ``str`` holding the assistant's decoded text
(stop token removed, reasoning and tool-call markup kept), so an environment can treat it as the
plain action text; it also carries what the renderer parsed from the sampled token ids
(``content``, ``reasoning``, ``tool_calls``, ``tool_call_errors``, ``stopped``), so tool-using
environments need not know the chat format. A turn cut by the token budget arrives with
``stopped=False``; the rollout ends the trajectory after it, so the reward ``step`` returns for it
is final.

Tasks are :class:`Task` records (``id`` is the prompt-group key, ``data`` the env-specific payload).
Built-in task sets are generated in code from a seed; :func:`split_of` assigns every task key to
"train" or "test" by a stable hash, so held-out tasks never appear in training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from rljax.chat.tool_calls import ToolCallError

__all__ = [
    "Action",
    "Environment",
    "StepResult",
    "Task",
    "maybe_await",
    "mean_numeric_metrics",
    "split_of",
    "tool_replies",
]

Message = Mapping[str, Any]
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Task:
    """One task instance.

    Attributes:
      id: unique key; it becomes ``TrajectoryID.instance_id`` (the GRPO group of its repetitions).
      data: environment-specific payload (question, answer, tables, ...).
      env: name of the environment that runs it (lets one rollout mix environments).
      split: "train" or "test".
      demonstration: optional worked solution of the task as text (e.g. a reference answer with
        its derivation). Algorithms that condition on demonstrations (opsd) render it into a
        system block of the scoring prompt (``Renderer.demonstration_hint``); the sampled
        prompt never contains it. None = no demonstration.
      messages: the prompt as chat messages (dataset rows: the row's ``prompt``), or None when the
        environment builds its own prompt from ``data``.
      reward_spec: how the answer is scored (SkyRL ``reward_spec`` / verl ``reward_model``):
        ``{"method": ..., "ground_truth": ...}``; None = the environment's own scorer.
      data_source: the row's ``data_source`` (evaluation metrics are reported per data source).
      extra_info: the row's ``extra_info`` (free-form, passed to environments and reward functions).

    >>> Task("arith-3+4", {"question": "3+4", "answer": "7"}, env="arithmetic").id
    'arith-3+4'
    >>> Task("arith-3+4", demonstration="3 + 4 = 7, so the answer is 7.").demonstration[:5]
    '3 + 4'
    """

    id: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env: str | None = None
    split: str = "train"
    demonstration: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    reward_spec: Mapping[str, Any] | None = None
    data_source: str | None = None
    extra_info: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Task.id must be a non-empty string, got {self.id!r}")
        if self.split not in SPLITS:
            raise ValueError(f"Task.split must be one of {SPLITS}, got {self.split!r}")
        if self.messages is not None:
            if isinstance(self.messages, (str, Mapping)) or not all(
                isinstance(m, Mapping) and "role" in m for m in self.messages
            ):
                raise ValueError(
                    f"Task.messages must be a list of message dicts with a role, got {self.messages!r:.80}"
                )
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))


class StepResult(NamedTuple):
    """What ``env.step`` returns; unpacks as ``messages, reward, done, info``.

    ``messages`` are the new chat messages (tool results, user follow-ups) the next turn sees;
    ``reward`` is this step's reward (environments with outcome rewards give 0 until the end).
    """

    messages: list[dict[str, Any]]
    reward: float
    done: bool
    info: dict[str, Any]


class Action(str):
    """The assistant's turn: its text (a ``str``) plus what the renderer parsed from its ids.

    >>> a = Action("7", content="7")
    >>> a == "7", a.content, a.tool_calls, a.stopped
    (True, '7', [], True)
    """

    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    tool_call_errors: list[ToolCallError]
    stopped: bool

    def __new__(
        cls,
        text: str,
        *,
        content: str | None = None,
        reasoning: str | None = None,
        tool_calls: Sequence[dict[str, Any]] = (),
        tool_call_errors: Sequence[ToolCallError] = (),
        stopped: bool = True,
    ) -> Action:
        obj = super().__new__(cls, text)
        obj.content = text if content is None else content
        obj.reasoning = reasoning
        obj.tool_calls = list(tool_calls)
        obj.tool_call_errors = list(tool_call_errors)
        obj.stopped = bool(stopped)
        return obj

    @classmethod
    def from_parsed(cls, text: str, parsed: Any) -> Action:
        """From a renderer's :class:`rljax.chat.ParsedResponse`."""
        return cls(
            text,
            content=parsed.content,
            reasoning=parsed.reasoning,
            tool_calls=parsed.tool_calls,
            tool_call_errors=parsed.errors,
            stopped=parsed.stopped,
        )


@runtime_checkable
class Environment(Protocol):
    """One episode of a task. ``reset``/``step`` may be sync or ``async``.

    Optional attributes read by the rollout: ``name`` (str, default the class name) and ``tools``
    (list of tool specs, default none).
    """

    def reset(self, task: Task) -> Sequence[Message] | Awaitable[Sequence[Message]]:
        """Starts the episode; returns the initial messages."""
        ...

    def step(self, action: str) -> Any:
        """Consumes one assistant turn; returns ``(messages, reward, done, info)`` (or awaits to it)."""
        ...


async def maybe_await(value: Any) -> Any:
    """Awaits ``value`` when it is awaitable, else returns it (sync/async environments alike).

    >>> import asyncio
    >>> async def f():
    ...     return 1
    >>> asyncio.run(maybe_await(f())), asyncio.run(maybe_await(2))
    (1, 2)
    """
    if inspect.isawaitable(value):
        return await value
    return value


def as_step_result(value: Any) -> StepResult:
    """Checks and normalizes what ``env.step`` returned (a 4-sequence) into a :class:`StepResult`.

    >>> as_step_result(([], 1, True, {})).reward
    1.0
    """
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise ValueError(
            f"env.step must return (messages, reward, done, info); got {type(value).__name__} {value!r:.80}"
        )
    messages, reward, done, info = value
    if isinstance(messages, Mapping) or not isinstance(messages, Sequence):
        raise ValueError(f"env.step messages must be a list of message dicts, got {messages!r:.80}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"env.step reward must be a finite number, got {reward!r}")
    return StepResult([dict(m) for m in messages], float(reward), bool(done), dict(info or {}))


def tool_replies(name: str, errors: Sequence[Any], answers: Sequence[str]) -> list[dict[str, str]]:
    """The ``tool`` messages answering one turn's calls of tool ``name``: a parse error's reason for each
    malformed call (``errors``, each with ``.reason``), then each parsed call's answer; a turn that
    yields neither still gets one error message, so the model always hears back.

    >>> tool_replies("lookup", [], ["42"])
    [{'role': 'tool', 'content': '42', 'name': 'lookup'}]
    >>> tool_replies("lookup", [], [])[0]["content"]
    'error: could not parse the tool call'
    """
    messages = [
        {"role": "tool", "content": f"error: could not parse the tool call ({e.reason})", "name": name}
        for e in errors
    ]
    messages += [{"role": "tool", "content": answer, "name": name} for answer in answers]
    return messages or [{"role": "tool", "content": "error: could not parse the tool call", "name": name}]


def split_of(key: str, *, test_fraction: float = 0.2) -> str:
    """ "train" or "test" for a task key, by a stable hash (same answer in every process).

    >>> split_of("3+4") in ("train", "test")
    True
    """
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64
    return "test" if h < test_fraction else "train"


def mean_numeric_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per key, the mean of the numeric (and bool) values over episode metric dicts; others dropped.

    >>> mean_numeric_metrics([{"steps": 2, "ok": True, "name": "x"}, {"steps": 4, "ok": False}])
    {'steps': 3.0, 'ok': 0.5}
    """
    values: dict[str, list[float]] = {}
    for m in metrics:
        for k, v in m.items():
            if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
                values.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in values.items()}
