"""An agent that records what its OpenAI client got: the calculator agent, its every response asked
with ``return_token_ids`` (vLLM's extension: the prompt's and the completion's token ids)."""

from __future__ import annotations

from typing import Any

from rljax.agents.calculator_agent import calculator_agent

#: One entry per chat call: the ids and the message the client got.
RESPONSES: list[dict[str, Any]] = []


async def capturing_calculator_agent(task: Any, client: Any, **kwargs: Any) -> dict[str, Any]:
    """:func:`~rljax.agents.calculator_agent.calculator_agent` with its client's responses recorded."""
    create = client.chat.completions.create

    async def recording_create(**request: Any) -> Any:
        response = await create(**request, extra_body={"return_token_ids": True})
        choice = response.choices[0]
        RESPONSES.append(
            {
                "task": task.id,
                "prompt_ids": list(response.model_extra["prompt_token_ids"]),
                "completion_ids": list(choice.model_extra["token_ids"]),
                "message": choice.message.model_dump(exclude_none=True),
                "finish_reason": choice.finish_reason,
            }
        )
        return response

    client.chat.completions.create = recording_create
    return await calculator_agent(task, client, **kwargs)
