"""ChatML and Qwen2.5 renderers (design §4).

ChatML turns are ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt is
``<|im_start|>assistant\\n``. Tool use follows the Qwen2.5 template (Hermes style, see the
Qwen2.5 model card "function calling"):

* tools: a system turn ``{system}\\n\\n# Tools ... <tools>\\n{json}...\\n</tools> ...``;
* assistant calls: ``{content}\\n<tool_call>\\n{"name": ..., "arguments": {json}}\\n</tool_call>``;
* tool results: consecutive ``tool`` messages share one ``user`` turn of
  ``\\n<tool_response>\\n{content}\\n</tool_response>`` blocks.

``Qwen25Renderer`` is the same format with Qwen2.5's default system prompt; ``SmolLM2Renderer`` is
SmolLM2-Instruct's template (ChatML with its own default system prompt and ``tool`` turns), whose
missing tool format is filled in with this convention. Usage::

    r = ChatMLRenderer(tokenizer)                      # or Qwen25Renderer(tokenizer)
    prompt = r.render_ids(messages, add_generation_prompt=True, tools=tools)
    content, reasoning, tool_calls = r.parse_response(completion_ids)
    next_prompt = r.bridge(prompt, completion_ids, tool_messages, tools=tools) or r.render_ids(...)
"""

from __future__ import annotations

import json
from typing import Any

from rljax.chat.base import Message, Piece, TemplateRenderer
from rljax.chat.tool_calls import ToolCallError, parse_hermes_tool_calls, tool_call_function

__all__ = [
    "QWEN25_DEFAULT_SYSTEM",
    "SMOLLM2_DEFAULT_SYSTEM",
    "TOOLS_FOOTER",
    "TOOLS_HEADER",
    "ChatMLRenderer",
    "Qwen25Renderer",
    "SmolLM2Renderer",
    "tojson",
]

#: The system turn Qwen2.5's chat template adds when a conversation has none.
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
#: The system turn SmolLM2-Instruct's chat template adds when a conversation has none.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

#: The system turn's text before the tools' JSON schemas (the ChatML family's tool convention).
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
#: The system turn's text after the tools' schemas: how to answer with ``<tool_call>`` blocks.
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tojson(value: Any, *, indent: int | None = None) -> str:
    """The ``tojson`` filter of Hugging Face chat templates (``json.dumps``, non-ASCII kept).

    >>> tojson({"a": "é", "b": [1, 2]})
    '{"a": "é", "b": [1, 2]}'
    """
    return json.dumps(value, ensure_ascii=False, indent=indent)


def message_text(message: Message, index: int, key: str = "content") -> str:
    """A string field of a message (``None``/missing -> ``""``); other types are an error."""
    value = message.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(
            f"messages[{index}]['{key}'] must be a string for this format, got {type(value).__name__}; "
            "join text parts into one string first"
        )
    return value


class ChatMLRenderer(TemplateRenderer):
    """ChatML with Qwen2.5-style tools (see module docstring).

    Args:
      tokenizer: a fast HF tokenizer with ``<|im_start|>`` and ``<|im_end|>`` added tokens.
      default_system: system text used when the conversation has no system message (Qwen2.5:
        :data:`QWEN25_DEFAULT_SYSTEM`); None renders no system turn in that case.

    >>> from rljax.chat.toy import toy_tokenizer
    >>> r = ChatMLRenderer(toy_tokenizer("chatml"))
    >>> ids = r.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    >>> r.decode(ids)
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    >>> done = r.tokenizer.encode("hello", add_special_tokens=False) + r.stop_token_ids()[:1]
    >>> r.decode(r.bridge(ids, done, [{"role": "user", "content": "ok"}])[len(ids):])
    'hello<|im_end|>\\n<|im_start|>user\\nok<|im_end|>\\n<|im_start|>assistant\\n'
    """

    END_OF_TURN = IM_END
    FORMAT = "ChatML"
    # Qwen2.5 renders string arguments with ``tojson`` too (quoted); Qwen3 inserts them raw.
    RAW_STRING_ARGUMENTS = False

    def __init__(self, tokenizer: Any, *, default_system: str | None = None):
        super().__init__(tokenizer, special_tokens=(IM_START, IM_END), extra_stop_tokens=(ENDOFTEXT,))
        self.default_system = default_system

    # -- pieces -------------------------------------------------------------------------
    def _system_pieces(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Piece]:
        has_system = messages[0]["role"] == "system"
        text = message_text(messages[0], 0) if has_system else self.default_system
        idx = 0 if has_system else None
        if not tools and text is None:
            return []
        out = [Piece(IM_START, "system", idx, special=True), Piece("system\n", "system", idx)]
        if text is not None:
            out.append(Piece(text, "system", idx, is_body=has_system))
        if tools:
            out.append(Piece(("\n\n" if text is not None else "") + TOOLS_HEADER, "system", idx))
            out.extend(Piece("\n" + tojson(t), "system", idx) for t in tools)
            out.append(Piece(TOOLS_FOOTER, "system", idx))
        out += [Piece(IM_END, "system", idx, special=True), Piece("\n", "system", idx)]
        return out

    def _plain_turn(self, role: str, text: str, i: int) -> list[Piece]:
        return [
            Piece(IM_START, role, i, special=True),
            Piece(role + "\n", role, i),
            Piece(text, role, i, is_body=True),
            Piece(IM_END, role, i, special=True),
            Piece("\n", role, i),
        ]

    def _tool_call_pieces(self, message: Message, i: int, *, content: str) -> list[Piece]:
        out = []
        for k, call in enumerate(message.get("tool_calls") or ()):
            fn = tool_call_function(call)
            args = fn.get("arguments")
            args_text = args if (self.RAW_STRING_ARGUMENTS and isinstance(args, str)) else tojson(args)
            sep = "\n" if (k > 0 or content) else ""
            out += [
                Piece(sep + '<tool_call>\n{"name": "', "assistant", i),
                Piece(fn["name"], "assistant", i, is_body=True),
                Piece('", "arguments": ', "assistant", i),
                Piece(args_text, "assistant", i, is_body=True),
                Piece("}\n</tool_call>", "assistant", i),
            ]
        return out

    def _assistant_head(self, messages: list[Message], i: int, *, last_query: int) -> tuple[list[Piece], str]:
        """Opening and content pieces of assistant turn ``i``; returns them and the content."""
        content = message_text(messages[i], i)
        return [
            Piece(IM_START, "assistant", i, special=True),
            Piece("assistant\n", "assistant", i),
            Piece(content, "assistant", i, is_body=True),
        ], content

    def _tool_pieces(self, messages: list[Message], i: int) -> list[Piece]:
        out = []
        if i == 0 or messages[i - 1]["role"] != "tool":
            out += [Piece(IM_START, "tool", i, special=True), Piece("user", "tool", i)]
        out += [
            Piece("\n<tool_response>\n", "tool", i),
            Piece(message_text(messages[i], i), "tool", i, is_body=True),
            Piece("\n</tool_response>", "tool", i),
        ]
        if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
            out += [Piece(IM_END, "tool", i, special=True), Piece("\n", "tool", i)]
        return out

    def _last_query_index(self, messages: list[Message]) -> int:
        return len(messages) - 1

    def _generation_prompt(self) -> list[Piece]:
        return [Piece(IM_START, "assistant", None, special=True), Piece("assistant\n", "assistant", None)]

    def _pieces(
        self, messages: list[Message], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None
    ) -> list[Piece]:
        out = self._system_pieces(messages, tools)
        last_query = self._last_query_index(messages)
        for i, message in enumerate(messages):
            role = message["role"]
            if role == "user" or (role == "system" and i > 0):
                out += self._plain_turn(role, message_text(message, i), i)
            elif role == "assistant":
                head, content = self._assistant_head(messages, i, last_query=last_query)
                out += head + self._tool_call_pieces(message, i, content=content)
                out += [Piece(IM_END, "assistant", i, special=True), Piece("\n", "assistant", i)]
            elif role == "tool":
                out += self._tool_pieces(messages, i)
            elif role != "system":
                raise ValueError(
                    f"messages[{i}] has role {role!r}; the {self.FORMAT} format renders only "
                    "system, user, assistant and tool messages"
                )
        if add_generation_prompt:
            out += self._generation_prompt()
        return out

    def _parse_text(self, text: str) -> tuple[str, str | None, list[dict[str, Any]], list[ToolCallError]]:
        content, calls, errors = parse_hermes_tool_calls(text)
        return content, None, calls, errors


class Qwen25Renderer(ChatMLRenderer):
    """Qwen2.5 (Instruct / Coder): ChatML with the default system prompt and Hermes tools.

    >>> from rljax.chat.toy import toy_tokenizer
    >>> r = Qwen25Renderer(toy_tokenizer("chatml"))
    >>> r.decode(r.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=False))[:40]
    '<|im_start|>system\\nYou are Qwen, created'
    """

    FORMAT = "Qwen2.5"

    def __init__(self, tokenizer: Any, *, default_system: str | None = QWEN25_DEFAULT_SYSTEM):
        super().__init__(tokenizer, default_system=default_system)


class SmolLM2Renderer(ChatMLRenderer):
    """SmolLM2-Instruct's chat template (the ``tokenizer.chat_template`` of its HF repo and GGUF files),
    with the ChatML family's tool-call convention where that template has none.

    Every message is a ChatML turn ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, ``tool`` messages
    included (under their own role, not Qwen's ``<tool_response>`` blocks); a conversation that does
    not start with a system message gets :data:`SMOLLM2_DEFAULT_SYSTEM`. Without tools and tool calls
    the ids are those of the model's own template, token for token.

    SmolLM2's template has no tool format (it drops ``tools`` and assistant ``tool_calls``), so tools
    follow the convention of the ChatML family (Hermes / Qwen2.5):

    * ``tools``: listed as JSON schemas in the system turn, after its text (the conversation's
      system message, else the default one): ``{system}\\n\\n# Tools ... <tools>\\n{json}...\\n</tools>``
      and the instruction to answer with ``<tool_call></tool_call>`` blocks (:data:`TOOLS_HEADER`,
      :data:`TOOLS_FOOTER`);
    * a call: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the assistant's text,
      after its content; several calls are several blocks; an assistant message's ``tool_calls``
      render that way;
    * a result: a ``tool`` message, rendered as the template renders any role.

    Responses are parsed with :func:`~rljax.chat.tool_calls.parse_hermes_tool_calls`: blocks become
    ``tool_calls``, malformed ones (invalid JSON, no name, unterminated) ``errors``, never raised.
    The tool-call text is ordinary BPE text for this tokenizer (no added tokens), so what the model
    writes is read back whatever its spacing; bridged turns keep the sampled ids as they are.

    >>> from rljax.chat.toy import toy_tokenizer
    >>> r = SmolLM2Renderer(toy_tokenizer("chatml"))
    >>> print(r.decode(r.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)))
    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    hi<|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
    >>> ids = r.tokenizer.encode('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    >>> r.parse_response(ids).tool_calls[0]["function"]
    {'name': 'add', 'arguments': {'a': 2}}
    """

    FORMAT = "SmolLM2"

    def __init__(self, tokenizer: Any, *, default_system: str | None = SMOLLM2_DEFAULT_SYSTEM):
        super().__init__(tokenizer, default_system=default_system)

    def _tool_pieces(self, messages: list[Message], i: int) -> list[Piece]:
        return self._plain_turn("tool", message_text(messages[i], i), i)
