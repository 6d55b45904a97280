"""The built-in ``calculator`` task written as an agent function (OpenAI SDK with ``tools=``), scored like
the env.

``config.envs.calculator.agent = "rljax.agents.calculator_agent:calculator_agent"`` trains the
``smollm2_tools`` task through the gateway instead of the env loop: an ordinary tool-calling chat
loop over ``client.chat.completions.create(..., tools=[multiply])`` whose prompt, tool results and
reward are the env's (:class:`~rljax.envs.calculator.CalculatorEnv`: ``reset`` gives the messages,
``step`` answers each turn's ``tool_calls`` with ``tool`` messages sent back with their
``tool_call_id``, and scores the final answer). ``kwargs`` are the env's constructor arguments
(``config.envs.calculator.kwargs``) plus ``max_turns`` (the env loop's ``rollout.max_turns``: a
rollout still calling tools after that many calls ends with the credit earned so far, as the env
loop's last step has). A reply cut by the token budget (``finish_reason == "length"``) ends the
rollout like the env loop's truncated turn; so does a conversation that outgrows
``rollout.max_context_len`` (the gateway answers 400 ``context_length_exceeded``).
"""

from __future__ import annotations

import json
from typing import Any

import openai

from rljax.chat.tool_calls import parse_hermes_tool_calls
from rljax.envs.base import Action, Task
from rljax.envs.calculator import CalculatorEnv

__all__ = ["calculator_agent"]


def _calls(message: Any) -> list[dict[str, Any]]:
    """The response's tool calls as the env reads them (arguments decoded from the JSON string)."""
    out = []
    for call in message.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            arguments = call.function.arguments
        out.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return out


async def calculator_agent(
    task: Task, client: Any, *, max_turns: int = 3, **env_kwargs: Any
) -> dict[str, Any]:
    """Plays one ``calculator`` task with ``client`` (an ``openai.AsyncOpenAI``); returns the reward."""
    env = CalculatorEnv(**env_kwargs)
    messages: list[dict[str, Any]] = env.reset(task)
    reward, info, turns = 0.0, {}, 0
    while turns < max_turns:
        turns += 1
        try:
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=list(env.tools)
            )
        except openai.BadRequestError as e:
            if e.code != "context_length_exceeded":
                raise
            break  # the env loop ends such a trajectory ("length") with its last step's reward
        choice = response.choices[0]
        message = choice.message
        calls, text = _calls(message), message.content or ""
        # a call that does not parse comes back as text (vLLM's fallback): parsed here, so the env
        # answers it with the error the env loop's parse gives
        content, _, errors = (text, [], []) if calls else parse_hermes_tool_calls(text)
        action = Action(text, content=content, tool_calls=calls, tool_call_errors=errors,
                        stopped=choice.finish_reason != "length")  # fmt: skip
        new, reward, done, info = env.step(action)
        if done or choice.finish_reason == "length":
            break
        messages.append(message.model_dump(exclude_none=True))  # the reply as it came
        # one tool message per call, answered by its id (the error messages of calls that did not
        # parse answer a turn without calls: no id)
        ids = [c["id"] for c in calls] if len(calls) == len(new) else [None] * len(new)
        for m, call_id in zip(new, ids, strict=True):
            messages.append(
                {"role": "tool", "content": m["content"], **({"tool_call_id": call_id} if call_id else {})}
            )
    return {"reward": reward, "metrics": {"turns": turns, "correct": bool(info.get("correct"))}}
