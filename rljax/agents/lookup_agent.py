"""The built-in ``lookup`` task written as an agent function (OpenAI SDK), scored like the env.

``config.envs.lookup.agent = "rljax.agents.lookup_agent:lookup_agent"`` trains the default task
through the gateway instead of the env loop: the same prompt (:meth:`ToolLookupEnv.reset`), the
same tool answers and the same reward (the env's :meth:`~ToolLookupEnv.step` scores each reply),
but driven by an ordinary chat loop over ``client.chat.completions.create``. ``kwargs`` are the
env's constructor arguments (``config.envs.lookup.kwargs``), plus ``max_turns`` (the env loop's
``rollout.max_turns``: a rollout that has not finished after that many calls ends with reward 0,
as the env loop's last intermediate step has; so does a conversation that outgrows
``rollout.max_context_len``: the gateway answers 400 ``context_length_exceeded``).
"""

from __future__ import annotations

import json
from typing import Any

import openai

from rljax.envs.base import Action, Task
from rljax.envs.tool_lookup import ToolLookupEnv

__all__ = ["lookup_agent"]


def _tool_calls(message: Any) -> list[dict[str, Any]]:
    calls = []
    for call in message.tool_calls or []:
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError:
            args = call.function.arguments
        calls.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}
        )
    return calls


async def lookup_agent(task: Task, client: Any, *, max_turns: int = 3, **env_kwargs: Any) -> dict[str, Any]:
    """Plays one ``lookup`` task with ``client`` (an ``openai.AsyncOpenAI``); returns the reward."""
    env = ToolLookupEnv(**env_kwargs)
    messages: list[dict[str, Any]] = env.reset(task)
    for turn in range(max_turns):
        try:
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=env.tools
            )
        except openai.BadRequestError as e:
            if e.code != "context_length_exceeded":
                raise
            # the env loop ends such a trajectory ("length") with its last step's reward: 0 here
            return {"reward": 0.0, "metrics": {"turns": turn, "correct": False}}
        choice = response.choices[0]
        msg = choice.message
        calls = _tool_calls(msg)
        action = Action(msg.content or "", content=msg.content or "", tool_calls=calls,
                        stopped=choice.finish_reason != "length")  # fmt: skip
        new, reward, done, info = env.step(action)
        if done or choice.finish_reason == "length":
            return {"reward": reward, "metrics": {"turns": turn + 1, "correct": bool(info.get("correct"))}}
        messages.append(msg.model_dump(exclude_none=True))
        ids = [c["id"] for c in calls] or [None] * len(new)
        for m, cid in zip(new, ids + [None] * (len(new) - len(ids)), strict=False):
            messages.append({**m, "tool_call_id": cid} if cid else m)
    return {"reward": 0.0, "metrics": {"turns": max_turns, "correct": False}}
