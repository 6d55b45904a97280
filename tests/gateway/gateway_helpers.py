"""Shared pieces of the gateway tests: a background event loop, a scripted engine, sessions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rljax.chat import ChatMLRenderer, toy_tokenizer
from rljax.inference.engine import Completion
from rljax.recording import StepRecorder
from rljax.rollout import RolloutConfig
from rljax.run.worker import Worker

TOK = toy_tokenizer("chatml")
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
CHATML = ChatMLRenderer(TOK)
CONFIG = RolloutConfig(group_size=1, max_tokens=256, max_context_len=2048, temperature=1.0)
TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "zob"}}\n</tool_call>'


def tool_then_answer(prompt: str) -> str:
    """A scripted policy: first turn the lookup call; after a tool response, the answer."""
    return "It is red." if "<tool_response>" in prompt else TOOL_CALL


LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the color of an object.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def ids_of(text: str) -> list[int]:
    """Token ids of ``text`` (added tokens such as ``<tool_call>`` are one id each)."""
    return TOK.encode(text, add_special_tokens=False)


class Scripted:
    """An engine whose completion of a prompt is ``script(prompt text)`` + ``<|im_end|>``
    (cut at ``max_tokens``: finish "length"), every logprob ``-0.25``."""

    def __init__(self, script: Callable[[str], str], *, weight_version: int = 0, delay: float = 0.0) -> None:
        self.script = script
        self.weight_version = weight_version
        self.delay = delay
        self.prompts: list[list[int]] = []
        self.samplings: list[Any] = []

    async def generate(self, prompt_ids: Any, sampling: Any, *, session_id: str | None = None) -> Completion:
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        if self.delay:
            await asyncio.sleep(self.delay)
        ids = [*ids_of(self.script(TOK.decode(list(prompt_ids)))), IM_END][: sampling.max_tokens]
        reason = "stop" if ids[-1] == IM_END else "length"
        return Completion(ids, [-0.25] * len(ids), reason, weight_version=self.weight_version)

    async def update_weights(self, model: Any, *, version: int | None = None) -> int:
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version


def open_session(gateway: Any, engine: Any, *, config: RolloutConfig = CONFIG, tid: tuple = ("t", 0)) -> Any:
    recorder = StepRecorder(gateway.renderer, tid, temperature=config.temperature)
    return gateway.open_session(recorder, engine, config)


class Loop:
    """A background event loop (the gateway, the engines and the clients all live on it)."""

    def __init__(self) -> None:
        self.worker = Worker("gateway-tests")

    def run(self, make_coro: Callable[[], Any], timeout: float = 300) -> Any:
        return self.worker.submit(make_coro).result(timeout=timeout)

    def close(self) -> None:
        self.worker.close()
