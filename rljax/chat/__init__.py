"""Chat renderers: chat templates as token streams, and tool-call parsing (design §4).

Pick the renderer of the model's chat format (or ``GenericRenderer`` for any HF template)::

    from rljax.chat import make_renderer, ChatSession
    renderer = make_renderer("qwen3", tokenizer, retention="tool_cycle")
    prompt = renderer.render_ids(messages, add_generation_prompt=True, tools=tools)
    content, reasoning, tool_calls = renderer.parse_response(completion_ids)
    next_prompt = renderer.bridge(prompt, completion_ids, tool_messages, tools=tools)  # or None

See :mod:`rljax.chat.base` for the contract, :mod:`rljax.chat.session` for the agent-loop
helper and :mod:`rljax.chat.tool_calls` for the parsers.
"""

from rljax.chat.base import DemonstrationHint, ParsedResponse, Rendered, Renderer, TemplateRenderer
from rljax.chat.chatml import (
    QWEN25_DEFAULT_SYSTEM,
    SMOLLM2_DEFAULT_SYSTEM,
    ChatMLRenderer,
    Qwen25Renderer,
    SmolLM2Renderer,
)
from rljax.chat.generic import GenericRenderer
from rljax.chat.llama3 import Llama3Renderer
from rljax.chat.qwen3 import Qwen3Renderer
from rljax.chat.registry import RENDERERS, make_renderer
from rljax.chat.session import ChatSession
from rljax.chat.tool_calls import (
    ToolCallError,
    parse_hermes_tool_calls,
    parse_llama3_json_tool_calls,
    split_reasoning,
)
from rljax.chat.toy import toy_tokenizer

__all__ = [
    "QWEN25_DEFAULT_SYSTEM",
    "RENDERERS",
    "SMOLLM2_DEFAULT_SYSTEM",
    "ChatMLRenderer",
    "ChatSession",
    "DemonstrationHint",
    "GenericRenderer",
    "Llama3Renderer",
    "ParsedResponse",
    "Qwen25Renderer",
    "Qwen3Renderer",
    "Rendered",
    "Renderer",
    "SmolLM2Renderer",
    "TemplateRenderer",
    "ToolCallError",
    "make_renderer",
    "parse_hermes_tool_calls",
    "parse_llama3_json_tool_calls",
    "split_reasoning",
    "toy_tokenizer",
]
