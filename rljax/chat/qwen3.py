"""Qwen3 renderer: ChatML + ``<think>`` reasoning + Hermes tools (design §4).

The Qwen3 template (Qwen3 model card, "thinking" and "multi-turn") renders an assistant turn
as ``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` only when it comes after the last
*user query* (a ``user`` message that is not a ``<tool_response>`` wrapper) and is either the
last message or has non-empty reasoning; earlier turns lose their ``<think>`` block. So once
a new user query arrives the template re-renders history differently from what was sampled,
and a token-exact bridge is impossible for that turn.

``retention`` chooses how this renderer treats past reasoning:

* ``"tool_cycle"`` (default): full renders are the Qwen3 template exactly (reasoning kept
  within the current tool-calling cycle, dropped before the last user query). ``bridge``
  extends through tool results and returns None when new messages contain a user query and
  the history holds a ``</think>`` (the template would drop it). Known, accepted deviation:
  an *empty* ``<think>`` block sampled in the cycle is kept by the bridge though the template
  would drop it on a re-render.
* ``"template"``: full renders as above; ``bridge`` returns None whenever a re-render by the
  template could differ: a user query after reasoning, an empty ``<think>`` block in the
  completion or the generation prompt (``enable_thinking=False``), no user query in the
  history, or an assistant turn right before the generation prompt.
* ``"all"``: every assistant turn keeps its reasoning (the template with the last-query rule
  switched off); ``bridge`` always extends, so a whole trajectory is one append-only token
  stream. Full renders equal the Qwen3 template whenever no reasoning precedes the last user
  query.

``enable_thinking=False`` appends ``<think>\\n\\n</think>\\n\\n`` to the generation prompt like
the template's ``enable_thinking`` switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from rljax.chat.base import Message, Piece
from rljax.chat.chatml import IM_END, IM_START, ChatMLRenderer, message_text
from rljax.chat.tool_calls import ToolCallError, parse_hermes_tool_calls, split_reasoning

__all__ = ["RETENTIONS", "Qwen3Renderer", "is_user_query", "last_query_index"]

Retention = Literal["all", "tool_cycle", "template"]
#: How :class:`Qwen3Renderer` keeps past reasoning (its ``retention``; see the module docstring).
RETENTIONS: tuple[str, ...] = ("all", "tool_cycle", "template")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def is_user_query(message: Message) -> bool:
    """A user message that is not a ``<tool_response>...</tool_response>`` wrapper (Qwen3 rule).

    >>> is_user_query({"role": "user", "content": "hi"})
    True
    >>> is_user_query({"role": "user", "content": "<tool_response>1</tool_response>"})
    False
    """
    content = message.get("content")
    return (
        message.get("role") == "user"
        and isinstance(content, str)
        and not (content.startswith("<tool_response>") and content.endswith("</tool_response>"))
    )


def last_query_index(messages: Sequence[Message]) -> int:
    """Index of the last user query; ``len(messages) - 1`` when there is none (Qwen3 template).

    >>> last_query_index([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    0
    """
    for i in range(len(messages) - 1, -1, -1):
        if is_user_query(messages[i]):
            return i
    return len(messages) - 1


def assistant_reasoning(message: Message, index: int) -> tuple[str, str]:
    """``(reasoning, content)`` of an assistant message as the Qwen3 template reads them.

    ``reasoning_content`` when it is a string, else a ``<think>...</think>`` prefix of the
    content is split off.

    >>> assistant_reasoning({"role": "assistant", "content": "<think>\\nr\\n</think>\\n\\nC"}, 0)
    ('r', 'C')
    """
    content = message_text(message, index)
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if "</think>" in content:
        head, tail = content.split("</think>")[0], content.split("</think>")[-1]
        return head.rstrip("\n").split("<think>")[-1].lstrip("\n"), tail.lstrip("\n")
    return "", content


def _turns(text: str) -> list[tuple[str, str]]:
    """``(role, body)`` of each ChatML turn in decoded text (body without ``<|im_end|>``)."""
    out = []
    for turn in text.split(IM_START)[1:]:
        role, _, body = turn.partition("\n")
        out.append((role, body.split(IM_END)[0]))
    return out


class Qwen3Renderer(ChatMLRenderer):
    """Qwen3 (hybrid thinking) renderer. See the module docstring for ``retention``.

    Args:
      tokenizer: a fast HF tokenizer with ``<|im_start|>``/``<|im_end|>`` added tokens.
      retention: ``"tool_cycle"`` (default), ``"template"`` or ``"all"``.
      enable_thinking: False appends an empty ``<think>`` block to the generation prompt.

    >>> from rljax.chat.toy import toy_tokenizer
    >>> r = Qwen3Renderer(toy_tokenizer("chatml"))
    >>> ids = r.tokenizer.encode("<think>\\nhmm\\n</think>\\n\\n4", add_special_tokens=False)
    >>> content, reasoning, calls = r.parse_response(ids + r.stop_token_ids()[:1])
    >>> content, reasoning, calls
    ('4', 'hmm', [])
    """

    FORMAT = "Qwen3"
    RAW_STRING_ARGUMENTS = True

    def __init__(self, tokenizer: Any, *, retention: Retention = "tool_cycle", enable_thinking: bool = True):
        if retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {retention!r}")
        super().__init__(tokenizer, default_system=None)
        self.retention = retention
        self.enable_thinking = bool(enable_thinking)

    def _last_query_index(self, messages: list[Message]) -> int:
        return -1 if self.retention == "all" else last_query_index(messages)

    def _assistant_head(self, messages: list[Message], i: int, *, last_query: int) -> tuple[list[Piece], str]:
        reasoning, content = assistant_reasoning(messages[i], i)
        out = [Piece(IM_START, "assistant", i, special=True)]
        if i > last_query and (i == len(messages) - 1 or reasoning):
            out += [
                Piece("assistant\n<think>\n", "assistant", i),
                Piece(reasoning.strip("\n"), "assistant", i, is_body=True),
                Piece("\n</think>\n\n", "assistant", i),
                Piece(content.lstrip("\n"), "assistant", i, is_body=True),
            ]
        else:
            out += [Piece("assistant\n", "assistant", i), Piece(content, "assistant", i, is_body=True)]
        return out, content

    def _generation_prompt(self) -> list[Piece]:
        out = super()._generation_prompt()
        if not self.enable_thinking:
            out.append(Piece(EMPTY_THINK, "assistant", None))
        return out

    def _parse_text(self, text: str) -> tuple[str, str | None, list[dict[str, Any]], list[ToolCallError]]:
        reasoning, rest, _ = split_reasoning(text)
        content, calls, errors = parse_hermes_tool_calls(rest)
        return content, reasoning, calls, errors

    def _bridge_allowed(
        self, prev_prompt_ids: Sequence[int], prev_completion_ids: Sequence[int], new_messages: list[Message]
    ) -> bool:
        if self.retention == "all":
            return True
        new_query = any(is_user_query(m) for m in new_messages)
        if self.retention == "tool_cycle" and not new_query:
            return True
        text = self.decode([*prev_prompt_ids, *prev_completion_ids])
        if new_query:
            return "</think>" not in text
        return self._template_keeps_history(text)

    def _reply_context(self, prev_prompt_ids: Sequence[int]) -> list[Message]:
        """A user query before an open turn's reply when the history has one (the template keeps
        that reply's reasoning only after the last query), else nothing."""
        if self.retention == "all":
            return super()._reply_context(prev_prompt_ids)
        turns = _turns(self.decode(prev_prompt_ids))
        if any(role == "user" and is_user_query({"role": "user", "content": body}) for role, body in turns):
            return super()._reply_context(prev_prompt_ids)
        return []

    def _template_keeps_history(self, text: str) -> bool:
        """Strict check for ``retention="template"`` when no new user query arrives."""
        turns = _turns(text)
        if len(turns) < 2 or turns[-1][0] != "assistant" or turns[-2][0] == "assistant":
            return False
        if not any(
            role == "user" and is_user_query({"role": "user", "content": body}) for role, body in turns
        ):
            return False
        last = turns[-1][1]
        if "</think>" in last:
            reasoning, _, _ = split_reasoning(last)
            return bool(reasoning)
        return True
