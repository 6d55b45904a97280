"""Renderer interface: chat templates as token streams (design §4).

A renderer turns OpenAI-style messages (dicts with ``role``, ``content`` and optionally
``reasoning_content``, ``tool_calls``, ``tool_call_id``, ``name``) into token ids for one chat
format, and reads completions back. The agent loop never re-tokenizes generated text: the
next prompt is the previous prompt + the sampled completion ids + the ids :meth:`Renderer.bridge` adds
for the new environment messages, so a trainer sees exactly the ids the sampler produced.

Interface (every renderer):

* ``render_ids(messages, *, add_generation_prompt, tools=None) -> list[int]`` -- the full
  conversation, token for token equal to ``tokenizer.apply_chat_template(messages,
  tools=tools, add_generation_prompt=..., tokenize=True, return_dict=False)`` of the
  format's reference template.
* ``render_with_roles(...) -> Rendered`` -- the same ids plus, per token, the role and index
  of the message it came from and whether it is message *body* (text written by that
  message's author) or template scaffolding. ``Rendered.mask(roles={"tool"})`` gives e.g. the
  tool-response body tokens the "echo" algorithm trains with cross-entropy.
* ``parse_response(completion_ids) -> ParsedResponse`` -- content, reasoning, tool calls
  (unpacks as ``content, reasoning, tool_calls = ...``); malformed tool calls are listed in
  ``.errors``, never raised.
* ``stop_token_ids() -> list[int]`` -- ids that end an assistant turn (pass to the sampler).
* ``bridge(prev_prompt_ids, prev_completion_ids, new_messages, *, tools=None, reply=None)`` --
  ids that start with ``prev_prompt_ids + prev_completion_ids`` exactly, then the new messages
  and the next assistant opener; ``None`` when the renderer cannot show that this is what the
  format's template appends (e.g. the template would rewrite earlier turns). The caller then
  falls back to ``render_ids``. ``bridge_with_roles`` returns only the appended part, with roles
  (message indices refer to ``new_messages``).
  A completion that did not end with the end-of-turn token (cut by ``max_tokens``, ended by
  another stop token, aborted) is an *open* turn: the appended part then starts with the
  template's closing tokens of the turn (e.g. ``<|im_end|>`` and a newline), which were not sampled and are
  prompt tokens like the rest of the suffix. It is bridged where the template's text of the turn
  holding ``reply`` (the assistant message the conversation has for that completion, what a
  client sent back; default: parsed from its ids) is the generation prompt's text, the sampled
  ids' decoded text (U+FFFD where a cut split a character), then closing text the template writes
  after it: the sampled ids are kept as sampled, the closing text is tokenized alone, and the
  result spells the full render of the history character for character (token for token where
  the full render's ids continue the sampled ids). Otherwise (the template strips or rewrites
  the cut text, the completion ends with a stop token the template never writes) ``None``.
* ``demonstration_hint(demonstration) -> DemonstrationHint`` -- the ids of a system turn that
  carries a task's demonstration and where to insert them into any prompt of this format
  (after the template's fixed preamble, e.g. ``<|begin_of_text|>``), for scoring samples on a
  demonstration-conditioned prompt (opsd, design §3.6).

Renderers that spell out a format (ChatML, Qwen3, Llama 3) build ids from *pieces*: single
special tokens (one id each) and text between them, each text run tokenized as a whole. A
Hugging Face tokenizer splits its input at added tokens before normalizing and
pre-tokenizing, so this is exactly how the whole rendered string is tokenized, whatever the
message text contains; the constructor checks that the tokenizer behaves that way.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from rljax.chat.tool_calls import ToolCallError

__all__ = [
    "DEFAULT_DEMONSTRATION_TEMPLATE",
    "DemonstrationHint",
    "Message",
    "ParsedResponse",
    "Piece",
    "Rendered",
    "Renderer",
    "TemplateRenderer",
    "check_messages",
    "demonstration_text",
    "encode_pieces",
    "normalize_tools",
]

#: A chat message: an OpenAI-style mapping (``role``, ``content``, optional ``tool_calls``, ...).
Message = Mapping[str, Any]

#: Default text of the system turn that carries a task's demonstration (opsd).
DEFAULT_DEMONSTRATION_TEMPLATE = "A worked demonstration for this task:\n{demonstration}"


@dataclasses.dataclass(frozen=True)
class Rendered:
    """Token ids with per-token provenance.

    Attributes:
      ids: token ids.
      roles: role of the message each token belongs to (``None`` for tokens of no message,
        e.g. ``<|begin_of_text|>``); the generation prompt has role ``"assistant"``.
      message_indices: index of that message in the rendered list (``None`` for scaffolding
        that belongs to no message: BOS, default system prompt, generation prompt).
      is_body: True for tokens of message text (content, reasoning, tool-call name and
        arguments), False for template scaffolding.

    >>> r = Rendered([5, 6, 7], ["user", "user", "tool"], [0, 0, 1], [False, True, True])
    >>> r.mask(roles={"tool"}), r.mask()
    ([0, 0, 1], [0, 1, 1])
    """

    ids: list[int]
    roles: list[str | None]
    message_indices: list[int | None]
    is_body: list[bool]

    def __post_init__(self) -> None:
        n = len(self.ids)
        if not len(self.roles) == len(self.message_indices) == len(self.is_body) == n:
            raise ValueError(
                f"Rendered fields must have one entry per id: ids={n}, roles={len(self.roles)}, "
                f"message_indices={len(self.message_indices)}, is_body={len(self.is_body)}"
            )

    def __len__(self) -> int:
        return len(self.ids)

    def mask(self, *, roles: Iterable[str] | None = None, body_only: bool = True) -> list[int]:
        """1 for tokens of the given roles (all roles if None), body tokens only by default."""
        wanted = None if roles is None else set(roles)
        return [
            int((wanted is None or r in wanted) and (b or not body_only) and r is not None)
            for r, b in zip(self.roles, self.is_body, strict=True)
        ]

    def shifted(self, offset: int) -> Rendered:
        """Message indices minus ``offset``; indices that become negative turn into None."""
        idx = [None if i is None or i - offset < 0 else i - offset for i in self.message_indices]
        return dataclasses.replace(self, message_indices=idx)

    def __getitem__(self, s: slice) -> Rendered:
        if not isinstance(s, slice):
            raise TypeError("Rendered supports slicing only; index .ids for a single id")
        return Rendered(self.ids[s], self.roles[s], self.message_indices[s], self.is_body[s])


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
    """What a completion says. Unpacks as ``content, reasoning, tool_calls``.

    Attributes:
      content: the answer text (reasoning block and tool-call blocks removed).
      reasoning: text of the ``<think>`` block, or None when there is none.
      tool_calls: OpenAI-style calls ``{"id", "type", "function": {"name", "arguments": dict}}``.
      errors: tool calls that could not be parsed (never raised).
      stopped: True when the completion ended with a stop token (else it was truncated).

    >>> p = ParsedResponse("hi", None, [], [], True)
    >>> content, reasoning, calls = p
    >>> p.to_message()
    {'role': 'assistant', 'content': 'hi'}
    """

    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    errors: list[ToolCallError]
    stopped: bool

    def __iter__(self) -> Iterator[Any]:
        return iter((self.content, self.reasoning, self.tool_calls))

    def to_message(self) -> dict[str, Any]:
        """The assistant message to append to the history (for full re-renders)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [dict(c) for c in self.tool_calls]
        return message


@dataclasses.dataclass(frozen=True)
class DemonstrationHint:
    """A demonstration rendered as a system turn, and where it goes in a prompt of its format.

    The demonstration-conditioned prompt of a prompt ``p`` is
    ``p[:insert_at] + ids + p[insert_at:]`` (see
    :func:`rljax.data.demonstrations.condition_on_demonstration`).

    Attributes:
      insert_at: number of leading prompt tokens the turn goes after: the template's fixed
        preamble (0 for ChatML / Qwen, 1 for Llama 3's ``<|begin_of_text|>``).
      ids: token ids of the whole system turn (empty: no demonstration, nothing inserted).
      prefix: the ids a prompt must start with for the insertion to be right (the preamble,
        ``len(prefix) == insert_at``); empty means "not checked".

    >>> h = DemonstrationHint(1, (7, 8), prefix=(0,))
    >>> p = [0, 5, 6]
    >>> p[: h.insert_at] + list(h.ids) + p[h.insert_at :]
    [0, 7, 8, 5, 6]
    """

    insert_at: int
    ids: tuple[int, ...]
    prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.insert_at, int) or self.insert_at < 0:
            raise ValueError(f"DemonstrationHint.insert_at must be an int >= 0, got {self.insert_at!r}")
        object.__setattr__(self, "ids", tuple(int(i) for i in self.ids))
        object.__setattr__(self, "prefix", tuple(int(i) for i in self.prefix))
        if self.prefix and len(self.prefix) != self.insert_at:
            raise ValueError(
                f"DemonstrationHint.prefix has {len(self.prefix)} ids but insert_at={self.insert_at}; "
                "the prefix is the prompt's first insert_at ids (or empty to skip the check)"
            )

    def __bool__(self) -> bool:
        return bool(self.ids)


def demonstration_text(demonstration: str | None, template: str) -> str | None:
    """The system text carrying ``demonstration`` (``template`` formatted), or None when there is none.

    ``None`` and ``""`` mean "no demonstration". ``template`` must contain ``{demonstration}``.

    >>> demonstration_text("2 + 2 = 4", "Example:\\n{demonstration}")
    'Example:\\n2 + 2 = 4'
    >>> demonstration_text("", "Example:\\n{demonstration}") is None
    True
    """
    if demonstration is None or demonstration == "":
        return None
    if not isinstance(demonstration, str):
        raise ValueError(f"demonstration must be a string or None, got {type(demonstration).__name__}")
    if not isinstance(template, str) or "{demonstration}" not in template:
        raise ValueError(
            f"demonstration template must be a string containing '{{demonstration}}', got {template!r}"
        )
    return template.replace("{demonstration}", demonstration)


def _find_insertion(plain: Sequence[int], conditioned: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
    """Smallest ``i`` and non-empty ``h`` with ``conditioned == plain[:i] + h + plain[i:]``, or None."""
    plain, conditioned = list(plain), list(conditioned)
    extra = len(conditioned) - len(plain)
    if extra <= 0:
        return None
    for i in range(len(plain) + 1):
        if i and conditioned[i - 1] != plain[i - 1]:
            return None
        if conditioned[i + extra :] == plain[i:]:
            return i, tuple(conditioned[i : i + extra])
    return None  # pragma: no cover - the loop returns at i = len(plain) at the latest


# Probe conversations of the fixed-base demonstration method (different lengths and texts, with and
# without a system message, so a template whose insertion point or hint depends on the
# conversation is caught).
_HINT_BASES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "x"},),
    ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "y"}),
    (
        {"role": "user", "content": "Hello there, what is 12 + 30?"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "user", "content": "thanks"},
    ),
)


def check_messages(messages: Sequence[Message], *, allow_empty: bool = False) -> list[Message]:
    """Validates the message list shape; returns it as a list.

    >>> check_messages([{"role": "user", "content": "hi"}])
    [{'role': 'user', 'content': 'hi'}]
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages and not allow_empty:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {m!r}")
    return list(messages)


def normalize_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Tool specs as JSON-schema dicts (callables converted like ``apply_chat_template`` does)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, Mapping):
            out.append(dict(tool))
        elif callable(tool):
            from transformers.utils import get_json_schema

            out.append(get_json_schema(tool))
        else:
            raise ValueError(
                f"tools[{i}] must be a JSON-schema dict or a function, got {type(tool).__name__}"
            )
    return out


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece of a rendered conversation.

    ``special`` pieces are a single special token (one id); other pieces are text, and
    consecutive text pieces are tokenized together as one string.
    """

    text: str
    role: str | None = None
    message_index: int | None = None
    is_body: bool = False
    special: bool = False


def _text_runs(pieces: Sequence[Piece]) -> list[list[Piece] | Piece]:
    """Groups consecutive non-empty text pieces into runs; special pieces stand alone."""
    out: list[list[Piece] | Piece] = []
    for p in pieces:
        if p.special:
            out.append(p)
        elif p.text:
            if out and isinstance(out[-1], list):
                out[-1].append(p)
            else:
                out.append([p])
    return out


def _attribute(run: list[Piece], offsets: Sequence[tuple[int, int]]) -> Iterator[tuple[Piece, bool]]:
    """For each token (by char offsets) its first piece and whether it overlaps a body piece."""
    starts = []
    bodies = [0]  # bodies[k]: how many of run[:k] are body pieces (an overlap test in O(1))
    pos = 0
    for p in run:
        starts.append(pos)
        pos += len(p.text)
        bodies.append(bodies[-1] + p.is_body)
    if len(run) == 1:
        yield from ((run[0], run[0].is_body) for _ in offsets)
        return
    right, left = bisect.bisect_right, bisect.bisect_left
    for start, end in offsets:
        first = max(0, right(starts, start) - 1)
        last = max(first, left(starts, max(end, start + 1)) - 1)
        yield run[first], bodies[last + 1] > bodies[first]


#: Below this many characters in all, the texts of a render are encoded one by one, not in a batch.
_PARALLEL_ENCODE_CHARS = 4096
#: A renderer's cache of encoded texts keeps texts of at most this many characters (template
#: scaffolding such as ``"\n"`` or ``"assistant\n"`` recurs in every render and bridge) ...
_CACHED_TEXT_CHARS = 64
#: ... and at most this many of them.
_CACHED_TEXTS = 4096

Encoded = tuple[Sequence[int], Sequence[tuple[int, int]]]


def _encode_texts(tokenizer: Any, texts: list[str], cache: dict[str, Encoded] | None = None) -> list[Encoded]:
    """``(ids, char offsets)`` of each text, as ``tokenizer(texts, add_special_tokens=False,
    return_offsets_mapping=True)`` gives them.

    A Hugging Face fast tokenizer's ``__call__`` configures its Rust tokenizer (no truncation, no
    padding, ``split_special_tokens``) and then calls its ``encode_batch``; when the Rust
    tokenizer is already in that state it is called directly, which skips ~0.1 ms of Python
    per call (a chat call's prompt is rendered on the request path of the gateway). Short
    inputs (a bridge, a short conversation) are encoded one text at a time: ``encode_batch``
    hands several texts to a thread pool, which for a few hundred characters costs several times
    the encoding itself in CPU (the same ids and offsets either way). On that path, short texts
    are looked up in / added to ``cache`` (text -> encoding; the renderer's, for its tokenizer).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or backend.truncation is not None
        or backend.padding is not None
        or bool(backend.encode_special_tokens) != bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(encoded["input_ids"], encoded["offset_mapping"], strict=True))
    if sum(map(len, texts)) >= _PARALLEL_ENCODE_CHARS:
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
    out = []
    for text in texts:
        hit = None if cache is None else cache.get(text)
        if hit is None:
            e = backend.encode(text, add_special_tokens=False)
            hit = (tuple(e.ids), tuple(e.offsets))
            if cache is not None and len(text) <= _CACHED_TEXT_CHARS and len(cache) < _CACHED_TEXTS:
                cache[text] = hit
        out.append(hit)
    return out


def encode_pieces(
    tokenizer: Any,
    pieces: Sequence[Piece],
    special_ids: Mapping[str, int],
    *,
    cache: dict[str, Encoded] | None = None,
) -> Rendered:
    """Tokenizes pieces: special pieces map to their id, each text run is encoded whole.

    Tokens are attributed to the piece holding their first character and count as body when
    they overlap a body piece (a BPE token may straddle a boundary, e.g. ``"\\n\\n"``).
    ``cache``: encodings of short texts of ``tokenizer`` (see :func:`_encode_texts`).
    """
    runs = _text_runs(pieces)
    texts = ["".join(p.text for p in r) for r in runs if isinstance(r, list)]
    encoded = _encode_texts(tokenizer, texts, cache) if texts else []
    ids: list[int] = []
    roles: list[str | None] = []
    indices: list[int | None] = []
    body: list[bool] = []
    k = 0
    for r in runs:
        if isinstance(r, Piece):
            ids.append(special_ids[r.text])
            roles.append(r.role)
            indices.append(r.message_index)
            body.append(r.is_body)
            continue
        run_ids, offsets = encoded[k]
        k += 1
        for tok, (piece, is_body) in zip(run_ids, _attribute(r, offsets), strict=True):
            ids.append(int(tok))
            roles.append(piece.role)
            indices.append(piece.message_index)
            body.append(is_body)
    return Rendered(ids, roles, indices, body)


class Renderer(abc.ABC):
    """A chat format as token streams. See the module docstring for the contract."""

    tokenizer: Any

    @abc.abstractmethod
    def render_with_roles(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> Rendered:
        """Full conversation ids with per-token role/message/body attribution."""

    def render_ids(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> list[int]:
        """Full conversation ids (== ``apply_chat_template(..., tokenize=True)``)."""
        return self.render_with_roles(messages, add_generation_prompt=add_generation_prompt, tools=tools).ids

    @abc.abstractmethod
    def parse_response(self, ids: Sequence[int]) -> ParsedResponse:
        """Content, reasoning and tool calls of one completion, from its token ids."""

    @abc.abstractmethod
    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn."""

    @abc.abstractmethod
    def bridge_with_roles(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
        *,
        tools: Sequence[Any] | None = None,
        reply: Message | None = None,
    ) -> Rendered | None:
        """The ids :meth:`bridge` appends after prompt + completion (with roles), or None.

        ``reply``: the assistant message the conversation holds for the completion (what a client
        sends back), checked against the sampled ids when the turn is open; None parses it from
        the ids."""

    def bridge(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
        *,
        tools: Sequence[Any] | None = None,
        reply: Message | None = None,
    ) -> list[int] | None:
        """``prev_prompt + prev_completion + [closing tokens] + new messages + assistant opener``,
        or None (see the module docstring)."""
        suffix = self.bridge_with_roles(
            prev_prompt_ids, prev_completion_ids, new_messages, tools=tools, reply=reply
        )
        if suffix is None:
            return None
        return [*map(int, prev_prompt_ids), *map(int, prev_completion_ids), *suffix.ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens kept, no clean-up (for environments and parsing)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    demonstration_template: str = DEFAULT_DEMONSTRATION_TEMPLATE

    def demonstration_hint(
        self, demonstration: str | None, *, template: str | None = None
    ) -> DemonstrationHint:
        """A system turn carrying ``demonstration`` and where it goes in this format's prompts (opsd).

        This default is the *fixed-base* method: for fixed probe conversations ``c`` (with and
        without a system message) it renders ``c`` and ``[system(text)] + c`` (with the
        generation prompt) and requires the second to be the first with one contiguous block of
        ids inserted, at the same index and with the same ids for every probe; that block and
        index are the hint (the smallest such index). Otherwise (the template
        merges the system text into another turn, replaces a default system prompt, rejects
        system messages, ...) it raises ``NotImplementedError``: use the format's renderer.

        Args:
          demonstration: the task's demonstration text; None or ``""`` gives an empty hint.
          template: system text with a ``{demonstration}`` field (default:
            :attr:`demonstration_template`).
        """
        text = demonstration_text(
            demonstration, self.demonstration_template if template is None else template
        )
        if text is None:
            return DemonstrationHint(0, ())
        found = set()
        for base in _HINT_BASES:
            try:
                plain = self.render_ids(base, add_generation_prompt=True)
                conditioned = self.render_ids(
                    [{"role": "system", "content": text}, *base], add_generation_prompt=True
                )
            except Exception as e:  # any template error: the method does not apply
                raise NotImplementedError(
                    f"{type(self).__name__} cannot render a leading system message ({e}); demonstration "
                    "conditioning needs a chat template with system messages"
                ) from e
            found.add(_find_insertion(plain, conditioned))
        if len(found) != 1 or None in found:
            raise NotImplementedError(
                f"{type(self).__name__}: this chat template does not render a leading system message as "
                "an insertion into the conversation's ids (it merges it into another turn or replaces a "
                "default system prompt), so a demonstration cannot be inserted into prompts token-exactly; "
                "use the format's renderer (chatml, qwen3, llama3) for demonstration conditioning"
            )
        insert_at, ids = found.pop()
        prefix = self.render_ids(_HINT_BASES[0], add_generation_prompt=True)[:insert_at]
        return DemonstrationHint(insert_at, ids, prefix=tuple(prefix))


def _added_token(tokenizer: Any, text: str) -> Any | None:
    for token in tokenizer.added_tokens_decoder.values():
        if token.content == text:
            return token
    return None


def require_special_tokens(tokenizer: Any, tokens: Iterable[str], *, fmt: str) -> dict[str, int]:
    """Ids of the format's special tokens; clear errors when the tokenizer does not fit."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"the {fmt} renderer needs a fast (Rust) Hugging Face tokenizer for offsets; got "
            f"{type(tokenizer).__name__}. Load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    ids = {}
    for text in tokens:
        token = _added_token(tokenizer, text)
        if token is None:
            raise ValueError(
                f"the tokenizer has no added token {text!r}, which the {fmt} format needs; "
                "use a tokenizer of that model family or GenericRenderer"
            )
        if token.lstrip or token.rstrip:
            raise ValueError(
                f"added token {text!r} strips adjacent whitespace (lstrip/rstrip), so piecewise "
                f"tokenization would differ from the template's; use GenericRenderer for this tokenizer"
            )
        ids[text] = int(tokenizer.convert_tokens_to_ids(text))
    return ids


def check_piecewise_tokenization(tokenizer: Any, special: str, *, fmt: str) -> None:
    """Checks that text after a special token tokenizes as it does alone (no prefix-space tricks)."""
    probe = "\nuser says: hello  world\n\n{}"
    alone = tokenizer(probe, add_special_tokens=False)["input_ids"]
    joined = tokenizer(special + probe, add_special_tokens=False)["input_ids"]
    if list(joined[1:]) != list(alone):
        raise ValueError(
            f"this tokenizer does not tokenize text after {special!r} independently (e.g. it prepends a "
            f"space to each segment), so the {fmt} renderer cannot build ids piecewise; use GenericRenderer"
        )


_BRIDGE_BASE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "y"},
)


class TemplateRenderer(Renderer):
    """A renderer that spells its format out as :class:`Piece` lists.

    Subclasses define ``_pieces`` (the template logic), ``END_OF_TURN`` (the special token
    that closes an assistant turn), ``_parse_text`` and the set of special tokens. Bridging
    renders a fixed base conversation ``[user, assistant]`` followed by the new messages and
    keeps the pieces after the base assistant's end-of-turn token: the template logic that
    produces them is the same code as for full renders, so the two cannot disagree.
    """

    END_OF_TURN: str = ""
    FORMAT: str = ""

    def __init__(
        self, tokenizer: Any, *, special_tokens: Sequence[str], extra_stop_tokens: Sequence[str] = ()
    ):
        self.tokenizer = tokenizer
        self._special_ids = require_special_tokens(tokenizer, special_tokens, fmt=self.FORMAT)
        self._encoded: dict[str, Encoded] = {}  # short texts' encodings (encode_pieces)
        check_piecewise_tokenization(tokenizer, self.END_OF_TURN, fmt=self.FORMAT)
        self._end_of_turn_id = self._special_ids[self.END_OF_TURN]
        stops = [self._end_of_turn_id]
        for text in extra_stop_tokens:
            token = _added_token(tokenizer, text)
            if token is not None:
                stops.append(int(tokenizer.convert_tokens_to_ids(text)))
        self._stop_ids = list(dict.fromkeys(stops))

    # -- template ---------------------------------------------------------------------
    @abc.abstractmethod
    def _pieces(
        self, messages: list[Message], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None
    ) -> list[Piece]:
        """The format's template as pieces (mirrors the reference Jinja template)."""

    @abc.abstractmethod
    def _parse_text(self, text: str) -> tuple[str, str | None, list[dict[str, Any]], list[ToolCallError]]:
        """``(content, reasoning, tool_calls, errors)`` of a completion's text."""

    def _bridge_allowed(
        self, prev_prompt_ids: Sequence[int], prev_completion_ids: Sequence[int], new_messages: list[Message]
    ) -> bool:
        """Format-specific reasons the template would re-render history (default: none)."""
        return True

    # -- interface --------------------------------------------------------------------
    def render_with_roles(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> Rendered:
        pieces = self._pieces(
            check_messages(messages),
            add_generation_prompt=add_generation_prompt,
            tools=normalize_tools(tools),
        )
        return encode_pieces(self.tokenizer, pieces, self._special_ids, cache=self._encoded)

    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    def parse_response(self, ids: Sequence[int]) -> ParsedResponse:
        ids = [int(i) for i in ids]
        stopped = bool(ids) and ids[-1] in self._stop_ids
        text = self.decode(ids[:-1] if stopped else ids)
        content, reasoning, calls, errors = self._parse_text(text)
        return ParsedResponse(content, reasoning, calls, errors, stopped)

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
        if not self._bridge_allowed(prev_prompt_ids, prev_completion_ids, new_messages):
            return None
        if int(prev_completion_ids[-1]) != self._end_of_turn_id:
            return self._bridge_open_turn(prev_prompt_ids, prev_completion_ids, new_messages, tools, reply)
        base = len(_BRIDGE_BASE)
        pieces = self._pieces(
            [*_BRIDGE_BASE, *new_messages], add_generation_prompt=True, tools=normalize_tools(tools)
        )
        cut = _last_index(
            pieces, lambda p: p.special and p.text == self.END_OF_TURN and p.message_index == base - 1
        )
        if cut is None:  # pragma: no cover - every format closes the assistant turn
            return None
        return encode_pieces(
            self.tokenizer, pieces[cut + 1 :], self._special_ids, cache=self._encoded
        ).shifted(base)

    def _reply_context(self, prev_prompt_ids: Sequence[int]) -> list[Message]:
        """Messages that stand for the history before an open turn's reply when it is rendered
        for the check of :meth:`_bridge_open_turn` (a user message; formats whose rendering of an
        assistant turn depends on the history override this)."""
        return [dict(_BRIDGE_BASE[0])]

    def _bridge_open_turn(
        self,
        prev_prompt_ids: Sequence[int],
        completion: Sequence[int],
        new_messages: list[Message],
        tools: Sequence[Any] | None,
        reply: Message | None,
    ) -> Rendered | None:
        """The suffix after a completion that did not end with the end-of-turn token, or None.

        Renders ``context + [reply] + new_messages`` and takes the reply's turn ``T`` (from its
        opening special token to its end-of-turn token, exclusive: both ends are special tokens, so
        ``T`` tokenizes as in any full render); ``opener`` is the generation prompt
        ``prev_prompt_ids`` ends with (from its last occurrence of ``T``'s first token).

        The bridge holds when the text of ``T`` is ``decode(opener) + decode(completion) + closing``:
        the sampled ids spell the reply the conversation holds (what a client got and sent back,
        U+FFFD included where the cut split a character), and the template writes only ``closing``
        after it (e.g. ``\n</think>\n\n`` closing reasoning cut short; usually nothing). The
        suffix is then ``closing`` tokenized alone, the end-of-turn token and everything after it
        (new messages, generation prompt), and ``prev_prompt + completion + suffix`` spells the
        full render of the history character for character, with the sampled ids kept as sampled.
        Where the ids of ``T`` already are ``opener + completion + rest``, the suffix is ``rest``,
        the end-of-turn token and what follows: the full render token for token. A template that
        rewrites the cut text (strips it, re-serializes a call) or a completion ending with a stop
        token it never writes: None.
        """
        completion = [int(i) for i in completion]
        if reply is None:
            reply = self.parse_response(completion).to_message()
        context = self._reply_context(prev_prompt_ids)
        k = len(context)
        try:
            messages = check_messages([*context, dict(reply), *new_messages])
            pieces = self._pieces(messages, add_generation_prompt=True, tools=normalize_tools(tools))
        except (ValueError, TypeError, KeyError):  # the full render raises the same to the caller
            return None
        start = next((j for j, p in enumerate(pieces) if p.message_index == k), None)
        end = _last_index(pieces, lambda p: p.special and p.text == self.END_OF_TURN and p.message_index == k)
        if start is None or end is None or not pieces[start].special:
            return None
        turn = encode_pieces(self.tokenizer, pieces[start:end], self._special_ids, cache=self._encoded)
        opener = _generation_prompt_of(prev_prompt_ids, turn.ids[0])
        if not opener:
            return None
        n = len(opener) + len(completion)
        if turn.ids[:n] == [*opener, *completion]:  # the full render's own tokens
            rest = encode_pieces(self.tokenizer, pieces[end:], self._special_ids, cache=self._encoded)
            return unsampled_closing(concat_rendered(turn[n:], rest).shifted(k + 1))
        closing = _closing_text(
            "".join(p.text for p in pieces[start:end]), self.decode(opener), self.decode(completion)
        )
        if closing is None:
            return None
        suffix = [Piece(closing, "assistant", k), *pieces[end:]]
        return unsampled_closing(
            encode_pieces(self.tokenizer, suffix, self._special_ids, cache=self._encoded).shifted(k + 1)
        )

    def demonstration_hint(
        self, demonstration: str | None, *, template: str | None = None
    ) -> DemonstrationHint:
        """A system turn carrying ``demonstration``, inserted after the format's fixed preamble.

        The ids are the pieces this renderer produces for a system message that is not the
        first message (a plain system turn: no default prompt, tools or date preamble), and
        ``insert_at`` is the length of the pieces every render starts with that belong to no
        message (Llama 3's ``<|begin_of_text|>``; nothing for ChatML). The turn starts with a
        special token and the prompt continues with one, so its text runs tokenize exactly as
        in a full render. For a conversation without tools the result is this renderer's full
        render of ``[system(text)] + messages`` (Qwen2.5: before its default system turn; Llama
        3.1+: before the dated system turn, an extra turn the official template never emits).

        Args:
          demonstration: the task's demonstration text; None or ``""`` gives an empty hint.
          template: system text with a ``{demonstration}`` field (default:
            :attr:`demonstration_template`).

        >>> from rljax.chat.toy import toy_tokenizer
        >>> from rljax.chat.llama3 import Llama3Renderer
        >>> r = Llama3Renderer(toy_tokenizer("llama3"))
        >>> h = r.demonstration_hint("2 + 2 = 4", template="Example: {demonstration}")
        >>> h.insert_at, r.decode(h.ids)
        (1, '<|start_header_id|>system<|end_header_id|>\\n\\nExample: 2 + 2 = 4<|eot_id|>')
        """
        text = demonstration_text(
            demonstration, self.demonstration_template if template is None else template
        )
        if text is None:
            return DemonstrationHint(0, ())
        probe = [{"role": "system", "content": ""}, {"role": "system", "content": text}, *_HINT_BASES[0]]
        pieces = self._pieces(probe, add_generation_prompt=False, tools=None)
        span = [k for k, p in enumerate(pieces) if p.message_index == 1]
        plain = self._pieces(list(_HINT_BASES[0]), add_generation_prompt=False, tools=None)
        lead = 0
        while lead < len(plain) and plain[lead].role is None and plain[lead].message_index is None:
            lead += 1
        contiguous = bool(span) and span == list(range(span[0], span[-1] + 1))
        if not (
            contiguous
            and pieces[span[0]].special
            and span[-1] + 1 < len(pieces)
            and pieces[span[-1] + 1].special
            and all(p.special for p in plain[:lead])
            and lead < len(plain)
            and plain[lead].special
        ):  # pragma: no cover - holds for every built-in format; guards subclasses
            raise NotImplementedError(
                f"{type(self).__name__}: a system turn is not delimited by special tokens in this format, "
                "so it cannot be inserted into prompts token-exactly"
            )
        ids = encode_pieces(self.tokenizer, [pieces[k] for k in span], self._special_ids).ids
        prefix = encode_pieces(self.tokenizer, plain[:lead], self._special_ids).ids
        return DemonstrationHint(len(prefix), tuple(ids), prefix=tuple(prefix))


def _closing_text(turn_text: str, opener_text: str, sampled_text: str) -> str | None:
    """What a template writes after the sampled text of an open turn: ``turn_text`` (the turn as the
    template renders the reply, up to its end-of-turn token) minus ``opener_text + sampled_text``;
    None when the turn does not start with them (the template rewrote the reply).

    >>> _closing_text("<s>assistant\\n<think>\\nhm\\n</think>\\n\\n", "<s>assistant\\n", "<think>\\nhm")
    '\\n</think>\\n\\n'
    >>> _closing_text("<s>assistant\\nhi", "<s>assistant\\n", "hi ") is None   # a template that strips
    True
    """
    head = opener_text + sampled_text
    return turn_text[len(head) :] if turn_text.startswith(head) else None


def _generation_prompt_of(prompt_ids: Sequence[int], opening_id: int) -> list[int]:
    """The tail of ``prompt_ids`` from its last ``opening_id`` (the turn opener the generation prompt
    starts with), or ``[]`` when it has none."""
    for i in range(len(prompt_ids) - 1, -1, -1):
        if int(prompt_ids[i]) == opening_id:
            return [int(t) for t in prompt_ids[i:]]
    return []


def concat_rendered(*parts: Rendered) -> Rendered:
    """The ids of ``parts`` one after the other, with their attribution.

    >>> concat_rendered(Rendered([1], ["user"], [0], [True]), Rendered([2], [None], [None], [False])).ids
    [1, 2]
    """
    return Rendered(
        [i for p in parts for i in p.ids],
        [r for p in parts for r in p.roles],
        [k for p in parts for k in p.message_indices],
        [b for p in parts for b in p.is_body],
    )


def unsampled_closing(suffix: Rendered) -> Rendered:
    """``suffix`` with its tokens of no new message marked as scaffolding: after an open turn they
    are the template's closing of the cut reply (not sampled: never message body, never trained)."""
    body = [b and k is not None for b, k in zip(suffix.is_body, suffix.message_indices, strict=True)]
    return dataclasses.replace(suffix, is_body=body)


def _last_index(items: Sequence[Any], pred: Callable[[Any], bool]) -> int | None:
    for i in range(len(items) - 1, -1, -1):
        if pred(items[i]):
            return i
    return None
