"""Multi-turn tool task: multiply numbers too large to guess, with a ``multiply`` tool (design §4 built-ins).

The user asks ``"What is 482 * 37?"`` (a three-digit times a two-digit number: a four- or five-digit
product that a small model cannot compute or guess); the ``multiply`` tool is offered as an OpenAI
function schema (:data:`MULTIPLY_TOOL`, rendered into the system prompt by the renderer). An episode
is a call, the tool's result, then the answer::

    user: What is 482 * 37?                 assistant: <tool_call>{"name": "multiply", ...}</tool_call>
    tool: 17834                             assistant: 17834          -> done, reward 1

Reward (on the final step; intermediate steps get 0), in ``[0, 1]``::

    1                    the last integer of the final answer is the product (commas ignored)
    else max credit so far, where a turn earns
      credit[0] (0.1)    it attempts a tool call (a <tool_call> block, even malformed)
      credit[1] (0.2)    the call parses and names the ``multiply`` tool with integer a and b
      credit[2] (0.4)    it multiplies the asked numbers (in either order)

Calls of other tools are answered with an error message; a truncated turn (``action.stopped``
False) ends the episode with the credit earned so far; after ``max_tool_calls`` calling turns a
further call ends it. ``info["correct"]`` is what held-out ``eval/pass@k`` counts. Tasks come from
:func:`make_calculator_tasks`: each ``(a, b)`` pair has a fixed train / test split by a stable hash.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rljax.chat.tool_calls import make_tool_call, parse_hermes_tool_calls, tool_call_function
from rljax.envs.base import StepResult, Task, split_of, tool_replies

__all__ = ["MULTIPLY_TOOL", "SYSTEM_PROMPT", "CalculatorEnv", "last_integer", "make_calculator_tasks"]

#: The ``multiply`` tool's OpenAI function schema.
MULTIPLY_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
#: The default system prompt (the renderer lists the tool after it).
SYSTEM_PROMPT = "Compute products with the multiply tool, then answer with the number."
QUESTION = "What is {a} * {b}?"
_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (thousands separators ``,`` ignored), or None.

    >>> last_integer("482 * 37 = 17,834."), last_integer("no number")
    (17834, None)
    """
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def make_calculator_tasks(
    num_tasks: int,
    *,
    seed: int,
    split: str = "train",
    a_range: tuple[int, int] = (100, 999),
    b_range: tuple[int, int] = (10, 99),
    test_fraction: float = 0.2,
) -> list[Task]:
    """``num_tasks`` distinct products ``a * b`` of ``split`` (``a``, ``b`` in the inclusive ranges).

    >>> t = make_calculator_tasks(2, seed=0)[0]
    >>> sorted(t.data), t.data["answer"] == t.data["a"] * t.data["b"], t.env
    (['a', 'answer', 'b'], True, 'calculator')
    >>> train = {t.id for t in make_calculator_tasks(50, seed=0)}
    >>> train & {t.id for t in make_calculator_tasks(50, seed=0, split="test")}
    set()
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    (a_lo, a_hi), (b_lo, b_hi) = a_range, b_range
    if not (0 <= a_lo <= a_hi and 0 <= b_lo <= b_hi):
        raise ValueError(
            f"a_range and b_range must be (low, high) with 0 <= low <= high, got {a_range}, {b_range}"
        )
    rng = np.random.default_rng(seed)
    tasks: dict[str, Task] = {}
    size = (a_hi - a_lo + 1) * (b_hi - b_lo + 1)
    for _ in range(50 * num_tasks + 100):  # rejection sampling of the split; bounded for tiny ranges
        if len(tasks) == num_tasks:
            break
        a, b = int(rng.integers(a_lo, a_hi + 1)), int(rng.integers(b_lo, b_hi + 1))
        key = f"calc:{a}*{b}"
        if key in tasks or split_of(key, test_fraction=test_fraction) != split:
            continue
        tasks[key] = Task(
            id=key,
            data={"a": a, "b": b, "answer": a * b},
            env=CalculatorEnv.name,
            split=split,
            demonstration=f"multiply({a}, {b}) returns {a * b}, so the answer is {a * b}.",
        )
        if len(tasks) == size:
            break
    return list(tasks.values())


class CalculatorEnv:
    """The calculator episode (see module docstring).

    Args:
      max_tool_calls: tool-calling turns allowed before the episode is cut off.
      credit: partial credit for (attempting a call, a valid ``multiply`` call, the right numbers).
      system_prompt: the system message (default :data:`SYSTEM_PROMPT`; ``""`` for none: the
        renderer's default system text then carries the tools).

    >>> from rljax.envs.base import Action
    >>> env = CalculatorEnv()
    >>> _ = env.reset(Task("t", {"a": 482, "b": 37, "answer": 17834}))
    >>> call = make_tool_call("multiply", {"a": 482, "b": 37})
    >>> env.step(Action("<tool_call>...", content="", tool_calls=[call]))[:3]
    ([{'role': 'tool', 'content': '17834', 'name': 'multiply'}], 0.0, False)
    >>> env.step("It is 17834.")[1:3]
    (1.0, True)
    """

    name = "calculator"
    tools = (MULTIPLY_TOOL,)

    def __init__(
        self,
        *,
        max_tool_calls: int = 2,
        credit: tuple[float, float, float] = (0.1, 0.2, 0.4),
        system_prompt: str | None = None,
    ) -> None:
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        if len(credit) != 3 or not all(0.0 <= c < 1.0 for c in credit):
            raise ValueError(f"credit must be three partial rewards in [0, 1), got {credit}")
        self.max_tool_calls = int(max_tool_calls)
        self.credit = tuple(float(c) for c in credit)
        self.system_prompt = SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.task: Task | None = None
        self.done = False
        self.num_calls = 0
        self.best_credit = 0.0

    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Starts the episode of ``task``: the system prompt (if any) and the question."""
        for key in ("a", "b", "answer"):
            if key not in task.data:
                raise ValueError(f"calculator task {task.id!r} has no {key!r} in its data")
        self.task, self.done, self.num_calls, self.best_credit = task, False, 0, 0.0
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": QUESTION.format(a=task.data["a"], b=task.data["b"])})
        return messages

    def _earn(self, level: int) -> None:
        self.best_credit = max(self.best_credit, self.credit[level])

    def _answer_call(self, call: dict[str, Any]) -> str:
        fn = tool_call_function(call)
        if fn.get("name") != "multiply":
            return f"error: unknown tool {fn.get('name')!r}; the only tool is 'multiply'"
        args = fn.get("arguments")
        a, b = (args.get("a"), args.get("b")) if isinstance(args, dict) else (None, None)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)):
            return "error: multiply needs integer arguments 'a' and 'b'"
        self._earn(1)
        if sorted((a, b)) == sorted((self.task.data["a"], self.task.data["b"])):
            self._earn(2)
        return str(a * b)

    def step(self, action: str) -> StepResult:
        """Answers the turn's tool calls with ``tool`` messages, or scores its final answer and ends
        the episode."""
        if self.task is None or self.done:
            raise ValueError("step() after the episode ended (or before reset); call reset(task) first")
        if hasattr(action, "tool_calls"):
            content, calls, errors = action.content, action.tool_calls, action.tool_call_errors
        else:
            content, calls, errors = parse_hermes_tool_calls(str(action))
        info: dict[str, Any] = {"answer": self.task.data["answer"]}
        if calls or errors or "<tool_call>" in action:
            self._earn(0)
            truncated = not getattr(action, "stopped", True)
            if truncated or self.num_calls >= self.max_tool_calls:
                for call in calls:  # score the attempt, answer nothing
                    self._answer_call(call)
                self.done = True
                end = "truncated" if truncated else "cut_off"
                return StepResult([], self.best_credit, True, {**info, end: True, "correct": False})
            self.num_calls += 1
            messages = tool_replies("multiply", errors, [self._answer_call(c) for c in calls])
            return StepResult(messages, 0.0, False, {**info, "tool_calls": len(calls)})
        self.done = True
        correct = last_integer(content) == self.task.data["answer"]
        reward = 1.0 if correct else self.best_credit
        return StepResult([], reward, True, {**info, "correct": correct, "used_tool": self.num_calls > 0})

    @staticmethod
    def solution(task: Task) -> list[dict[str, Any]]:
        """The ideal turns after :meth:`reset`: the call, the tool's result and the answer."""
        a, b = task.data["a"], task.data["b"]
        return [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [make_tool_call("multiply", {"a": a, "b": b})],
            },
            {"role": "tool", "content": str(a * b), "name": "multiply"},
            {"role": "assistant", "content": str(a * b)},
        ]
