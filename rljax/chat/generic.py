"""Generic renderer: any Hugging Face chat template as a token stream (design §4).

Full renders call the tokenizer's own ``apply_chat_template`` (so they are equal to it by
construction). Bridging uses the *fixed-base* method, which works for any template:

1. render a fixed base conversation ``[system, user, assistant]`` (the assistant turn has
   reasoning, so templates that keep or drop reasoning show it), and cut its ids right
   after the end-of-turn token that closes the assistant turn;
2. render ``base + new_messages`` with the generation prompt;
3. if its ids start with the cut base ids, the rest is exactly what the template appends
   after an assistant turn for these messages: ``bridge = prev_prompt + completion + rest``.
   If they do not (the template rewrote the base when messages were added, e.g. Qwen3
   dropping ``<think>`` after a new user query) or rendering fails, return None.

The end-of-turn token is found once: the first special token after the assistant content
when one assistant message is rendered (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``,
``</s>``, ...). Template behaviour that depends on the completion's own text (e.g. Qwen3
dropping an *empty* ``<think>`` block) is not detected for a completion that ends with it; use
the dedicated renderer for that format when it matters.

A completion that does not end with the end-of-turn token (cut by ``max_tokens``, ended by another
stop token) is bridged when the template, given the assistant message the conversation holds for
it, writes the sampled ids' decoded text after the generation prompt: the text of ``base + [reply]
+ new_messages`` (``base``: a base above followed by a tool result) must start with the text of
``base`` with the generation prompt, then the completion's text; the suffix is the template's
closing text of the turn (tokenized alone), its end-of-turn token and the rest of the render.

Role attribution renders each message prefix and matches message text in the full render
(best effort for templates that rewrite earlier turns; body spans are found by searching the
message's JSON-quoted content (e.g. Llama 3.1 tool results), its content, or its stripped content).

    >>> from rljax.chat.toy import toy_tokenizer
    >>> r = GenericRenderer(toy_tokenizer("chatml", chat_template="chatml"))
    >>> ids = r.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    >>> done = r.tokenizer.encode("yo", add_special_tokens=False) + r.stop_token_ids()[:1]
    >>> r.decode(r.bridge(ids, done, [{"role": "user", "content": "ok"}])[len(ids):])
    'yo<|im_end|>\\n<|im_start|>user\\nok<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from typing import Any

import jinja2

from rljax.chat.base import (
    Message,
    ParsedResponse,
    Rendered,
    Renderer,
    check_messages,
    concat_rendered,
    normalize_tools,
    unsampled_closing,
)
from rljax.chat.tool_calls import parse_hermes_tool_calls, parse_llama3_json_tool_calls, split_reasoning

__all__ = ["TOOL_PARSERS", "GenericRenderer"]

#: Tool-call parsers of :class:`GenericRenderer` by ``tool_parser`` name (None: no tool calls).
TOOL_PARSERS = {"hermes": parse_hermes_tool_calls, "llama3_json": parse_llama3_json_tool_calls, None: None}
_RENDER_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return len(os.path.commonprefix([a, b]))


def _body_candidates(message: Message) -> list[str]:
    """Strings a template may have rendered for a message's body, longest form first."""
    out = []
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        out += [json.dumps(content, ensure_ascii=False), content, content.strip()]
    elif isinstance(content, (dict, list)):
        out.append(json.dumps(content, ensure_ascii=False))
    return [c for c in dict.fromkeys(out) if c]


class GenericRenderer(Renderer):
    """Wraps a tokenizer's own chat template (see module docstring).

    Args:
      tokenizer: a fast HF tokenizer with a ``chat_template``.
      tool_parser: ``"hermes"`` (``<tool_call>`` blocks, default), ``"llama3_json"`` or None.
      reasoning_tags: ``(start, end)`` of reasoning blocks, or None for no reasoning parsing.
      template_kwargs: extra variables for the template (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tool_parser: str | None = "hermes",
        reasoning_tags: tuple[str, str] | None = ("<think>", "</think>"),
        template_kwargs: dict[str, Any] | None = None,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat_template; set tokenizer.chat_template or use a format renderer"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "GenericRenderer needs a fast (Rust) Hugging Face tokenizer (offsets for role attribution)"
            )
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_parser must be one of {sorted(map(str, TOOL_PARSERS))}, got {tool_parser!r}"
            )
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.reasoning_tags = reasoning_tags
        self.template_kwargs = dict(template_kwargs or {})
        self._special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self._end_of_turn_id = self._find_end_of_turn()
        stops = [self._end_of_turn_id] + (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        self._stop_ids = list(dict.fromkeys(int(s) for s in stops))

    # -- template access --------------------------------------------------------------
    def render_text(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> str:
        """The template's string for ``messages`` (what ``apply_chat_template(tokenize=False)`` gives)."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=normalize_tools(tools),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(i) for i in enc["input_ids"]], [tuple(o) for o in enc["offset_mapping"]]

    def _find_end_of_turn(self) -> int:
        user = [{"role": "user", "content": "x"}]
        try:
            prompt = self._encode(self.render_text(user, add_generation_prompt=True))[0]
            full = self._encode(
                self.render_text([*user, {"role": "assistant", "content": "y"}], add_generation_prompt=False)
            )[0]
        except _RENDER_ERRORS as e:
            raise ValueError(f"the chat template cannot render a user/assistant exchange: {e}") from e
        tail = full[len(prompt) :] if full[: len(prompt)] == prompt else full
        for token in tail:
            if token in self._special:
                return token
        if self.tokenizer.eos_token_id is None:
            raise ValueError(
                "cannot find the token that ends an assistant turn (no special token, no eos_token)"
            )
        return int(self.tokenizer.eos_token_id)

    # -- interface --------------------------------------------------------------------
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    def render_ids(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> list[int]:
        messages = check_messages(messages)
        return self._encode(
            self.render_text(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        )[0]

    def render_with_roles(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> Rendered:
        return self._render(messages, add_generation_prompt=add_generation_prompt, tools=tools)[0]

    def _render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None
    ) -> tuple[Rendered, str, list[tuple[int, int]]]:
        """:meth:`render_with_roles`, the template's text and each token's char offsets in it."""
        messages = check_messages(messages)
        text = self.render_text(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        ids, offsets = self._encode(text)
        ends = self._message_ends(messages, text, tools)
        bodies = self._body_spans(messages, text, ends)
        roles, indices, is_body = [], [], []
        for start, end in offsets:
            k = bisect.bisect_right(ends, start)
            in_body = [
                j for j, spans in enumerate(bodies) for a, b in spans if a < max(end, start + 1) and start < b
            ]
            idx = in_body[0] if in_body else (k if k < len(messages) else None)
            roles.append(
                messages[idx]["role"] if idx is not None else ("assistant" if add_generation_prompt else None)
            )
            indices.append(idx)
            is_body.append(bool(in_body))
        return Rendered(ids, roles, indices, is_body), text, offsets

    def _message_ends(self, messages: list[Message], text: str, tools: Sequence[Any] | None) -> list[int]:
        """Char offset in ``text`` where each message's rendering ends (monotone, best effort)."""
        ends, prev = [], 0
        for k in range(len(messages)):
            try:
                prefix = self.render_text(messages[: k + 1], add_generation_prompt=False, tools=tools)
                prev = max(prev, _common_prefix_len(prefix, text))
            except _RENDER_ERRORS:
                pass
            ends.append(prev)
        return ends

    @staticmethod
    def _body_spans(messages: list[Message], text: str, ends: list[int]) -> list[list[tuple[int, int]]]:
        spans: list[list[tuple[int, int]]] = []
        cursor = 0
        for k, message in enumerate(messages):
            start = max(cursor, ends[k - 1] if k else 0)
            stop = ends[k + 1] if k + 1 < len(ends) else len(text)  # lcp ends may cut a message short
            found: list[tuple[int, int]] = []
            for cand in _body_candidates(message):
                at = text.find(cand, start, stop)
                if at >= 0:
                    found = [(at, at + len(cand))]
                    cursor = at + len(cand)
                    break
            spans.append(found)
        return spans

    def parse_response(self, ids: Sequence[int]) -> ParsedResponse:
        ids = [int(i) for i in ids]
        stopped = bool(ids) and ids[-1] in self._stop_ids
        text = self.decode(ids[:-1] if stopped else ids)
        reasoning = None
        if self.reasoning_tags is not None:
            reasoning, text, _ = split_reasoning(
                text, start_tag=self.reasoning_tags[0], end_tag=self.reasoning_tags[1]
            )
        parser = TOOL_PARSERS[self.tool_parser]
        content, calls, errors = (text, [], []) if parser is None else parser(text)
        return ParsedResponse(content, reasoning, calls, errors, stopped)

    def _bridge_bases(self) -> list[list[dict[str, str]]]:
        assistant = {"role": "assistant", "content": "y", "reasoning_content": "r"}
        user = {"role": "user", "content": "x"}
        return [[{"role": "system", "content": "s"}, user, assistant], [user, assistant]]

    def _open_turn_bases(self) -> list[list[dict[str, str]]]:
        """Bases for an open turn's reply: the closed-turn bases then a tool result (a template that
        rewrites an earlier assistant turn when new messages come, e.g. drops its reasoning, shows
        it), or then a user message for templates without tool messages."""
        bases = self._bridge_bases()
        tool, user = {"role": "tool", "content": "t"}, {"role": "user", "content": "z"}
        return [*([*b, tool] for b in bases), [*bases[-1], user]]

    def bridge_with_roles(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
        *,
        tools: Sequence[Any] | None = None,
        reply: Message | None = None,
    ) -> Rendered | None:
        new_messages = check_messages(new_messages, allow_empty=True)
        if not prev_completion_ids:
            return None
        if int(prev_completion_ids[-1]) != self._end_of_turn_id:
            return self._bridge_open_turn(prev_prompt_ids, prev_completion_ids, new_messages, tools, reply)
        for base in self._bridge_bases():
            try:
                base_ids = self._encode(self.render_text(base, add_generation_prompt=False, tools=tools))[0]
                full = self.render_with_roles([*base, *new_messages], add_generation_prompt=True, tools=tools)
            except _RENDER_ERRORS:
                continue
            if self._end_of_turn_id not in base_ids:
                return None
            cut = len(base_ids) - base_ids[::-1].index(self._end_of_turn_id)
            if full.ids[:cut] != base_ids[:cut]:
                return None
            return full[cut:].shifted(len(base))
        return None

    def _bridge_open_turn(
        self,
        prev_prompt_ids: Sequence[int],
        completion: Sequence[int],
        new_messages: list[Message],
        tools: Sequence[Any] | None,
        reply: Message | None,
    ) -> Rendered | None:
        """The suffix after a completion that did not end with the end-of-turn token, or None.

        Fixed-base method for an open turn: with ``G`` the ids of ``base`` rendered with the
        generation prompt (``base`` rendered without it, then the opener ``O``) and ``F`` the render of
        ``base + [reply] + new_messages``, ``prev_prompt_ids`` must end with ``O`` and the text of
        ``F`` must start with the text of ``G``, then ``decode(completion)``: the sampled ids spell the
        reply the conversation holds (U+FFFD where a cut split a character). The template's text
        after it, up to the reply's end-of-turn token, is its closing of the turn, tokenized alone;
        the suffix is those ids, then ``F``'s ids from that end-of-turn token on (new messages,
        generation prompt). Where ``F``'s ids already are ``G + completion + rest`` the suffix is
        ``rest``: the full render token for token.
        """
        completion = [int(i) for i in completion]
        if reply is None:
            reply = self.parse_response(completion).to_message()
        prompt = [int(i) for i in prev_prompt_ids]
        for base in self._open_turn_bases():
            try:
                plain = self._encode(self.render_text(base, add_generation_prompt=False, tools=tools))[0]
                opened_text = self.render_text(base, add_generation_prompt=True, tools=tools)
                opened = self._encode(opened_text)[0]
                conversation = [*base, dict(reply), *new_messages]
                full, text, offsets = self._render(conversation, add_generation_prompt=True, tools=tools)
            except _RENDER_ERRORS:
                continue
            n_open = len(opened) - len(plain)
            if n_open <= 0 or opened[: len(plain)] != plain or len(prompt) < n_open:
                return None
            if prompt[len(prompt) - n_open :] != opened[len(plain) :]:
                return None
            k = len(base) + 1
            cut = len(opened) + len(completion)
            if full.ids[:cut] == [*opened, *completion]:  # the full render's own tokens
                return unsampled_closing(full[cut:].shifted(k))
            head = opened_text + self.decode(completion)
            if not text.startswith(head):
                return None
            eot = next(
                (
                    j
                    for j, (a, _) in enumerate(offsets)
                    if a >= len(head) and full.ids[j] == self._end_of_turn_id
                ),
                None,
            )
            if eot is None:
                return None
            ids = self._encode(text[len(head) : offsets[eot][0]])[0]
            closing = Rendered(ids, ["assistant"] * len(ids), [k - 1] * len(ids), [False] * len(ids))
            return unsampled_closing(concat_rendered(closing, full[eot:]).shifted(k))
        return None
