"""Llama 3 renderer: header-delimited turns and JSON tool calls (design §4).

Turns are ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content|trim}<|eot_id|>`` after
``<|begin_of_text|>``; the generation prompt is the assistant header. With
``system_preamble=True`` (default) this is the Llama 3.1 / 3.2 / 3.3 template (Llama 3.1
model card, "prompt format"):

* a system turn always comes first: ``Cutting Knowledge Date: December 2023\\nToday Date:
  {date_string}\\n\\n{system}`` (``Environment: ipython`` first when tools are given);
* tools are listed (``tojson(indent=4)``) in the first user turn (``tools_in_user_message``,
  default) or in the system turn;
* an assistant tool call is the whole turn: ``{"name": "f", "parameters": {json}}`` (one
  call per turn); tool results are ``ipython`` turns whose content goes through ``tojson``
  (so a string result appears quoted, exactly as the official template does).

``system_preamble=False`` is the Llama 3.0 template (no implicit system turn, no tools).
Built-in tools (``<|python_tag|>``/``<|eom_id|>`` code interpreter turns) are not rendered;
``<|eom_id|>`` is still a stop token and a ``<|python_tag|>`` completion is parsed, but a
completion ending with ``<|eom_id|>`` is not bridged (the template closes turns with
``<|eot_id|>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rljax.chat.base import Message, Piece, TemplateRenderer
from rljax.chat.chatml import tojson
from rljax.chat.tool_calls import ToolCallError, parse_llama3_json_tool_calls, tool_call_function

__all__ = ["Llama3Renderer"]

BOS, EOT, EOM = "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>"
START_HEADER, END_HEADER, END_OF_TEXT = "<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"
TOOLS_INSTRUCTION = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)
USER_TOOLS_PREFIX = (
    "Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\n"
)
SYSTEM_TOOLS_PREFIX = (
    "You have access to the following functions. "
    "To call a function, please respond with JSON for a function call."
)


def _tool_content(content: Any) -> str:
    """Jinja's ``content is mapping or content is iterable`` -> tojson (strings included)."""
    if isinstance(content, (str, Mapping, list, tuple)):
        return tojson(content)
    return "" if content is None else str(content)


def _text(message: Message, index: int) -> str:
    value = message.get("content")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(
            f"messages[{index}]['content'] must be a string for Llama 3 (tool results may be JSON), "
            f"got {type(value).__name__}"
        )
    return value


class Llama3Renderer(TemplateRenderer):
    """Llama 3.x instruct format (see module docstring).

    Args:
      tokenizer: a fast HF tokenizer with the Llama 3 header/turn special tokens.
      system_preamble: True for Llama 3.1+ (dated system turn, tools); False for Llama 3.0.
      date_string: the template's ``date_string`` (its default is "26 Jul 2024").
      tools_in_user_message: list tools in the first user turn (template default) or the system turn.

    >>> from rljax.chat.toy import toy_tokenizer
    >>> r = Llama3Renderer(toy_tokenizer("llama3"), system_preamble=False)
    >>> r.decode(r.render_ids([{"role": "user", "content": " hi "}], add_generation_prompt=True))
    '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n'
    """

    END_OF_TURN = EOT
    FORMAT = "Llama 3"

    def __init__(
        self,
        tokenizer: Any,
        *,
        system_preamble: bool = True,
        date_string: str = "26 Jul 2024",
        tools_in_user_message: bool = True,
    ):
        super().__init__(
            tokenizer,
            special_tokens=(BOS, START_HEADER, END_HEADER, EOT),
            extra_stop_tokens=(EOM, END_OF_TEXT),
        )
        self.system_preamble = bool(system_preamble)
        self.date_string = date_string
        self.tools_in_user_message = bool(tools_in_user_message)

    def _turn(self, role: str, header_role: str, index: int | None, *body: Piece) -> list[Piece]:
        return [
            Piece(START_HEADER, role, index, special=True),
            Piece(header_role, role, index),
            Piece(END_HEADER, role, index, special=True),
            *body,
            Piece(EOT, role, index, special=True),
        ]

    def _system_turn(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Piece]:
        has_system = bool(messages) and messages[0]["role"] == "system"
        idx = 0 if has_system else None
        head = "\n\n" + ("Environment: ipython\n" if tools is not None else "")
        head += f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n"
        if tools is not None and not self.tools_in_user_message:
            head += (
                SYSTEM_TOOLS_PREFIX + TOOLS_INSTRUCTION + "".join(tojson(t, indent=4) + "\n\n" for t in tools)
            )
        text = _text(messages[0], 0).strip() if has_system else ""
        return self._turn(
            "system", "system", idx, Piece(head, "system", idx), Piece(text, "system", idx, is_body=True)
        )

    def _tools_user_turn(self, message: Message, i: int, tools: list[dict[str, Any]]) -> list[Piece]:
        head = (
            "\n\n"
            + USER_TOOLS_PREFIX
            + TOOLS_INSTRUCTION
            + "".join(tojson(t, indent=4) + "\n\n" for t in tools)
        )
        role = message["role"]
        return self._turn(
            role, "user", i, Piece(head, role, i), Piece(_text(message, i).strip(), role, i, is_body=True)
        )

    def _assistant_call_turn(self, message: Message, i: int) -> list[Piece]:
        calls = message.get("tool_calls")
        if len(calls) != 1:
            raise ValueError(
                f"messages[{i}] has {len(calls)} tool calls; the Llama 3 template supports exactly one "
                "tool call per assistant turn"
            )
        fn = tool_call_function(calls[0])
        return self._turn(
            "assistant",
            "assistant",
            i,
            Piece('\n\n{"name": "', "assistant", i),
            Piece(fn["name"], "assistant", i, is_body=True),
            Piece('", "parameters": ', "assistant", i),
            Piece(tojson(fn.get("arguments")), "assistant", i, is_body=True),
            Piece("}", "assistant", i),
        )

    def _pieces(
        self, messages: list[Message], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None
    ) -> list[Piece]:
        if tools is not None and not self.system_preamble:
            raise ValueError(
                "tools need the Llama 3.1+ format: use Llama3Renderer(..., system_preamble=True)"
            )
        out = [Piece(BOS, None, None, special=True)]
        start = 0
        if self.system_preamble:
            out += self._system_turn(messages, tools)
            start = 1 if messages[0]["role"] == "system" else 0
            if tools is not None and self.tools_in_user_message:
                if start >= len(messages):
                    raise ValueError("tools go into the first user message, but the conversation has none")
                out += self._tools_user_turn(messages[start], start, tools)
                start += 1
        for i in range(start, len(messages)):
            message = messages[i]
            role = message["role"]
            if not self.system_preamble:
                if message.get("tool_calls") is not None:
                    raise ValueError(
                        f"messages[{i}] has tool_calls, which the Llama 3.0 format cannot render"
                    )
                out += self._turn(
                    role,
                    role,
                    i,
                    Piece("\n\n", role, i),
                    Piece(_text(message, i).strip(), role, i, is_body=True),
                )
            elif message.get("tool_calls") is not None:
                out += self._assistant_call_turn(message, i)
            elif role in ("tool", "ipython"):
                out += self._turn(
                    role,
                    "ipython",
                    i,
                    Piece("\n\n", role, i),
                    Piece(_tool_content(message.get("content")), role, i, is_body=True),
                )
            else:
                out += self._turn(
                    role,
                    role,
                    i,
                    Piece("\n\n", role, i),
                    Piece(_text(message, i).strip(), role, i, is_body=True),
                )
        if add_generation_prompt:
            out += [
                Piece(START_HEADER, "assistant", None, special=True),
                Piece("assistant", "assistant", None),
                Piece(END_HEADER, "assistant", None, special=True),
                Piece("\n\n", "assistant", None),
            ]
        return out

    def _parse_text(self, text: str) -> tuple[str, str | None, list[dict[str, Any]], list[ToolCallError]]:
        content, calls, errors = parse_llama3_json_tool_calls(text)
        return content, None, calls, errors
