"""One trajectory's token stream: bridge when possible, full render otherwise (design §4).

:class:`ChatSession` is the bookkeeping an agent loop needs around a renderer: it keeps the
message history (for fallback renders and for the environment) and the exact prompt ids of
the next turn. Completions are recorded as the sampler's ids and never re-tokenized::

    session = ChatSession(renderer, env.reset(task), tools=tools)
    while True:
        out = engine.generate(session.prompt_ids, stop=renderer.stop_token_ids())
        parsed = session.add_completion(out.token_ids)       # exact ids, parsed for the env
        messages, reward, done, info = env.step(parsed)
        if done:
            break
        session.add_messages(messages)                       # bridge or full render

After ``add_messages``, ``session.bridged`` says whether the new prompt extends the previous
prompt + completion (so merging turns keeps one sample), and ``session.prompt_roles``
attributes the ids that are new in this prompt (the bridge suffix, or the whole render).
``session.full_prompt_roles`` has one entry per id of the WHOLE ``prompt_ids``: the role of the
message whose body the token is, None for template scaffolding (what ``Step.prompt_roles``
records and the echo algorithm, :mod:`rljax.data.echo`, reads). For a bridged prompt it is
the previous prompt's entries, ``"assistant"`` for every sampled completion id (the end-of-turn
token included: they are the policy's own tokens), then the bridge suffix's entries (None for the
closing tokens the template adds after a cut turn, e.g. ``<|im_end|>`` after a ``max_tokens`` stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rljax.chat.base import Message, ParsedResponse, Rendered, Renderer, check_messages

__all__ = ["ChatSession", "body_roles"]


def body_roles(rendered: Rendered) -> list[str | None]:
    """Per token: its message's role when the token is message body, else None (scaffolding).

    >>> body_roles(Rendered([5, 6, 7], ["tool", "tool", None], [0, 0, None], [False, True, False]))
    [None, 'tool', None]
    """
    return [r if b else None for r, b in zip(rendered.roles, rendered.is_body, strict=True)]


class ChatSession:
    """Prompt ids for each turn of one conversation.

    Args:
      renderer: the chat format.
      messages: the initial messages (system / user ...).
      tools: tool specs passed to every render.

    >>> from rljax.chat.chatml import ChatMLRenderer
    >>> from rljax.chat.toy import toy_tokenizer
    >>> s = ChatSession(ChatMLRenderer(toy_tokenizer("chatml")), [{"role": "user", "content": "hi"}])
    >>> first = list(s.prompt_ids)
    >>> stop = s.renderer.stop_token_ids()[0]
    >>> completion = s.renderer.tokenizer.encode("yo", add_special_tokens=False) + [stop]
    >>> s.add_completion(completion).content
    'yo'
    >>> nxt = s.add_messages([{"role": "user", "content": "bye"}])
    >>> s.bridged, nxt[: len(first) + len(completion)] == first + completion
    (True, True)
    >>> len(s.full_prompt_roles) == len(nxt)
    True
    >>> [r for r in s.full_prompt_roles if r]   # "hi", the completion "yo<|im_end|>", "bye"
    ['user', 'user', 'assistant', 'assistant', 'assistant', 'user', 'user', 'user']
    """

    def __init__(
        self, renderer: Renderer, messages: Sequence[Message], *, tools: Sequence[Any] | None = None
    ):
        self.renderer = renderer
        self.tools = None if tools is None else list(tools)
        self.messages: list[dict[str, Any]] = [dict(m) for m in check_messages(messages)]
        self.prompt_roles: Rendered = renderer.render_with_roles(
            self.messages, add_generation_prompt=True, tools=self.tools
        )
        self.prompt_ids: list[int] = list(self.prompt_roles.ids)
        self.full_prompt_roles: list[str | None] = body_roles(self.prompt_roles)
        self.bridged = False
        self._completion: list[int] | None = None

    def add_completion(self, completion_ids: Sequence[int]) -> ParsedResponse:
        """Records the sampled ids of this turn; returns the parsed assistant message."""
        if self._completion is not None:
            raise ValueError("add_completion was already called for this prompt; call add_messages first")
        self._completion = [int(i) for i in completion_ids]
        parsed = self.renderer.parse_response(self._completion)
        self.messages.append(parsed.to_message())
        return parsed

    def add_messages(self, new_messages: Sequence[Message]) -> list[int]:
        """Appends environment messages; returns (and stores) the next prompt ids."""
        if self._completion is None:
            raise ValueError("add_messages needs the previous turn's completion: call add_completion first")
        new_messages = [dict(m) for m in check_messages(new_messages, allow_empty=True)]
        suffix = self.renderer.bridge_with_roles(
            self.prompt_ids, self._completion, new_messages, tools=self.tools, reply=self.messages[-1]
        )
        self.messages.extend(new_messages)
        if suffix is None:
            self.prompt_roles = self.renderer.render_with_roles(
                self.messages, add_generation_prompt=True, tools=self.tools
            )
            self.prompt_ids = list(self.prompt_roles.ids)
            self.full_prompt_roles = body_roles(self.prompt_roles)
            self.bridged = False
        else:
            self.prompt_ids = [*self.prompt_ids, *self._completion, *suffix.ids]
            self.full_prompt_roles = [
                *self.full_prompt_roles,
                *["assistant"] * len(self._completion),
                *body_roles(suffix),
            ]
            self.prompt_roles = suffix
            self.bridged = True
        self._completion = None
        return self.prompt_ids
