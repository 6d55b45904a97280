"""Multi-turn tool-use task: look a fact up with a tool, then answer (design §4 built-ins).

Each task hides a small table ``{object: color}`` (made-up object names, colors from a short
list). The user asks ``"What color is the zorb?"``; the only way to know is to call the ``lookup``
tool (Qwen/Hermes ``<tool_call>{"name": "lookup", "arguments": {"key": "zorb"}}</tool_call>``),
read the tool message (``"red"``) and answer with that word. Turn structure::

    user: What color is the zorb?      assistant: <tool_call>...</tool_call>
    tool: red                          assistant: red          -> done, reward 1

Reward (given on the final step only; intermediate steps get 0), in ``[0, 1]``::

    1                    the final answer equals the object's color (case/punctuation-insensitive)
    else max credit so far, where a turn earns
      credit[0] (0.1)    it attempts a tool call (a <tool_call> block, even malformed)
      credit[1] (0.2)    the call parses and names the ``lookup`` tool
      credit[2] (0.4)    it looks up the asked object

A truncated turn (``action.stopped`` False: the sampler hit its token budget) ends the episode
with the credit earned so far, so partial credit also reaches a model that does not yet stop.
The shaped partial credit, the short answer list (a random guess scores ``1/len(colors)``) and the
few turns make the reward movable by a tiny model within minutes of RL on CPU. After
``max_tool_calls`` calls a further call ends the episode with the credit earned so far.
Task sets come from :func:`make_lookup_tasks`; object names are assigned to the train or test
split by a stable hash, so held-out tasks ask about objects never seen in training.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.chat.tool_calls import make_tool_call, parse_hermes_tool_calls, tool_call_function
from rljax.envs.base import StepResult, Task, split_of, tool_replies

__all__ = [
    "COLORS",
    "COMPACT_SYSTEM_PROMPT",
    "LOOKUP_TOOL",
    "SYSTEM_PROMPT",
    "ToolLookupEnv",
    "make_lookup_tasks",
    "object_names",
]

#: The colors the lookup task's objects can have.
COLORS = ("red", "blue", "green", "gold")
#: The ``lookup`` tool's OpenAI function schema (rendered into the prompt unless ``compact``).
LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the color of an object.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the object's name"}},
            "required": ["key"],
        },
    },
}
#: The default system prompt (the tool schema is rendered with it).
SYSTEM_PROMPT = "Find facts with the lookup tool. Answer with one word."
#: The system prompt of ``compact=True``: the tool-call format in one line, no tool schema.
COMPACT_SYSTEM_PROMPT = (
    'Call <tool_call>\n{"name": "lookup", "arguments": {"key": NAME}}\n</tool_call> '
    "to get a color. Answer with one word."
)
QUESTION = "What color is the {key}?"
_ONSETS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_CODAS = "bgkmnprt"


def object_names(split: str | None = None, *, test_fraction: float = 0.2) -> list[str]:
    """All made-up object names (consonant-vowel-consonant, e.g. "zob"), optionally of one split.

    >>> names = object_names()
    >>> len(names), names[0]
    (560, 'bab')
    >>> set(object_names("train")) & set(object_names("test"))
    set()
    """
    names = [a + b + c for a, b, c in itertools.product(_ONSETS, _VOWELS, _CODAS)]
    if split is None:
        return names
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    return [n for n in names if split_of("lookup:" + n, test_fraction=test_fraction) == split]


def make_lookup_tasks(
    num_tasks: int,
    *,
    seed: int,
    split: str = "train",
    num_entries: int = 3,
    colors: Sequence[str] = COLORS,
    test_fraction: float = 0.2,
) -> list[Task]:
    """``num_tasks`` random tables of ``num_entries`` objects of ``split`` and one question each.

    >>> t = make_lookup_tasks(2, seed=0)[0]
    >>> sorted(t.data), t.data["answer"] == t.data["table"][t.data["query"]], t.env
    (['answer', 'query', 'table'], True, 'lookup')
    """
    if num_entries < 1 or len(colors) < 2:
        raise ValueError(f"need num_entries >= 1 and >= 2 colors, got {num_entries}, {list(colors)}")
    names = object_names(split, test_fraction=test_fraction)
    rng = np.random.default_rng(seed)
    tasks = []
    for i in range(num_tasks):
        keys = [names[int(j)] for j in rng.choice(len(names), size=num_entries, replace=False)]
        table = {k: str(colors[int(rng.integers(len(colors)))]) for k in keys}
        query = keys[int(rng.integers(num_entries))]
        tasks.append(
            Task(
                id=f"lookup:{split}:{seed}:{i}",
                data={"table": table, "query": query, "answer": table[query]},
                env=ToolLookupEnv.name,
                split=split,
                # for opsd (self-distillation): what a solved episode looks like
                demonstration=f'lookup("{query}") returns {table[query]}, so the answer is {table[query]}.',
            )
        )
    return tasks


def _normalize(text: str) -> str:
    return text.strip().strip(".!\"'").strip().lower()


class ToolLookupEnv:
    """The lookup episode (see module docstring).

    Args:
      max_tool_calls: tool-calling turns allowed before the episode is cut off.
      credit: partial credit for (attempting a call, naming ``lookup``, asking the right key).
      system_prompt: system message (default :data:`SYSTEM_PROMPT`, or the compact one).
      compact: describe the tool in one line of the system prompt instead of rendering the tool
        schema (``tools`` is then None): ~60 instead of ~500 prompt tokens with a byte-level
        tokenizer, for quick CPU runs.

    >>> from rljax.chat.tool_calls import make_tool_call
    >>> from rljax.envs.base import Action
    >>> env = ToolLookupEnv()
    >>> _ = env.reset(Task("t", {"table": {"zob": "red"}, "query": "zob", "answer": "red"}))
    >>> call = make_tool_call("lookup", {"key": "zob"})
    >>> messages, reward, done, _ = env.step(Action("<tool_call>...", content="", tool_calls=[call]))
    >>> messages, reward, done
    ([{'role': 'tool', 'content': 'red', 'name': 'lookup'}], 0.0, False)
    >>> env.step("Red.")[1:3]
    (1.0, True)
    """

    name = "lookup"

    def __init__(
        self,
        *,
        max_tool_calls: int = 2,
        credit: tuple[float, float, float] = (0.1, 0.2, 0.4),
        system_prompt: str | None = None,
        compact: bool = False,
    ) -> None:
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        if len(credit) != 3 or not all(0.0 <= c < 1.0 for c in credit):
            raise ValueError(f"credit must be three partial rewards in [0, 1), got {credit}")
        self.max_tool_calls = int(max_tool_calls)
        self.credit = tuple(float(c) for c in credit)
        default = COMPACT_SYSTEM_PROMPT if compact else SYSTEM_PROMPT
        self.system_prompt = default if system_prompt is None else system_prompt
        self.tools = None if compact else (LOOKUP_TOOL,)
        self.task: Task | None = None
        self.done = False
        self.num_calls = 0
        self.best_credit = 0.0

    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Starts the episode of ``task``: the optional system prompt and the question."""
        for key in ("table", "query", "answer"):
            if key not in task.data:
                raise ValueError(f"lookup task {task.id!r} has no {key!r} in its data")
        self.task, self.done, self.num_calls, self.best_credit = task, False, 0, 0.0
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": QUESTION.format(key=task.data["query"])})
        return messages

    def _earn(self, level: int) -> None:
        self.best_credit = max(self.best_credit, self.credit[level])

    def _answer_call(self, call: dict[str, Any]) -> str:
        fn = tool_call_function(call)
        if fn.get("name") != "lookup":
            return f"error: unknown tool {fn.get('name')!r}; the only tool is 'lookup'"
        self._earn(1)
        args = fn.get("arguments")
        key = args.get("key") if isinstance(args, dict) else None
        if not isinstance(key, str):
            return "error: lookup needs a string argument 'key'"
        key = _normalize(key)
        if key == self.task.data["query"]:
            self._earn(2)
        return self.task.data["table"].get(key, f"no object named {key!r}")

    def step(self, action: str) -> StepResult:
        """Answers the turn's ``lookup`` calls with tool messages, or scores its final answer and ends the
        episode."""
        if self.task is None or self.done:
            raise ValueError("step() after the episode ended (or before reset); call reset(task) first")
        if hasattr(action, "tool_calls"):
            content, calls, errors = action.content, action.tool_calls, action.tool_call_errors
        else:
            content, calls, errors = parse_hermes_tool_calls(str(action))
        info: dict[str, Any] = {"answer": self.task.data["answer"]}
        truncated = not getattr(action, "stopped", True)
        if calls or errors or "<tool_call>" in action:
            self._earn(0)
            if truncated:  # the rollout ends here: score the attempt, answer nothing
                for call in calls:
                    self._answer_call(call)
                self.done = True
                return StepResult([], self.best_credit, True, {**info, "truncated": True, "correct": False})
            if self.num_calls >= self.max_tool_calls:
                self.done = True
                return StepResult([], self.best_credit, True, {**info, "cut_off": True, "correct": False})
            self.num_calls += 1
            messages = tool_replies("lookup", errors, [self._answer_call(c) for c in calls])
            return StepResult(messages, 0.0, False, info)
        self.done = True
        correct = _normalize(content) == self.task.data["answer"]
        return StepResult([], 1.0 if correct else self.best_credit, True, {**info, "correct": correct})

    @staticmethod
    def solution(task: Task) -> list[dict[str, Any]]:
        """The ideal turns after :meth:`reset`: the call, the tool result and the answer."""
        call = make_tool_call("lookup", {"key": task.data["query"]})
        return [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": task.data["answer"], "name": "lookup"},
            {"role": "assistant", "content": task.data["answer"]},
        ]
