"""The OpenAI chat-completions wire format: requests in, responses and server-sent events out.

:func:`parse_chat_request` validates the JSON body of ``POST /v1/chat/completions`` into a
:class:`ChatRequest` (or raises :class:`GatewayError`, which renders as OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``); :func:`completion_body` and
:func:`stream_chunks` render what the engine generated.

What is accepted (everything else a client commonly sends, e.g. ``user``, ``metadata``,
``parallel_tool_calls``, ``frequency_penalty=0``, is ignored):

* ``messages``: system / developer (rendered as system) / user / assistant / tool messages;
  ``content`` a string, null, or a list of ``{"type": "text"}`` parts (joined); assistant
  ``tool_calls`` (arguments a JSON string or object) and ``reasoning_content`` / ``reasoning``;
  keys that are null are dropped, so a client's re-serialized reply compares equal to what it was.
* ``tools``: ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
  (400 otherwise); ``tool_choice``: "auto" (default) or "none" (the tools are then not rendered);
  anything else is 400.
* sampling: ``temperature`` (>= 0), ``top_p`` in (0, 1], ``top_k`` (vLLM extra),
  ``max_tokens`` / ``max_completion_tokens`` (>= 1), ``seed``, ``n`` = 1 only, ``stop``: strings
  that are ONE token each (they become stop token ids; the engine stops on ids, so a stop string
  of several tokens would make the returned text differ from the recorded ids: 400).
* ``stream`` (+ ``stream_options.include_usage``), ``logprobs`` (``top_logprobs`` 0 only),
  ``return_token_ids`` (vLLM: ``prompt_token_ids`` on the response, ``token_ids`` on the choice).

Responses: ``finish_reason`` is "tool_calls" when the turn ended on the end-of-turn token with
tool calls, "length" when the token budget ran out, else "stop"; tool-call ``arguments`` are JSON
strings (OpenAI's wire form); ``reasoning_content`` carries a parsed ``<think>`` block.

Streaming (``text/event-stream``): ``data: {chunk}\\n\\n`` lines, ``object`` =
"chat.completion.chunk": the role first, then reasoning and content deltas, then each tool call
(its id, type and name in its first delta, the arguments string in further deltas), then a chunk
with ``finish_reason``, the usage chunk when asked, then ``data: [DONE]``. Concatenating the deltas
gives exactly the non-streamed message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "Answer",
    "ChatRequest",
    "GatewayError",
    "completion_body",
    "error_body",
    "finish_reason_of",
    "normalize_messages",
    "parse_chat_request",
    "stream_chunks",
    "wire_message",
]

#: Keys of a message that the renderers read; other keys (``refusal``, ``annotations``, ...) are dropped.
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Chars per streamed content delta.
STREAM_CHUNK_CHARS = 16


class GatewayError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the body's message / type / param / code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI-style JSON error body of this error."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",  # noqa: A002
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body.

    >>> error_body("bad", code="x")
    {'error': {'message': 'bad', 'type': 'invalid_request_error', 'param': None, 'code': 'x'}}
    """
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request (None = not given: the run's default applies)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    model: str = ""


def _text_content(content: Any, param: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _bad(f"{param}[{k}]: only text content parts are supported, got {kind!r}", param)
        return "".join(parts)
    raise _bad(f"{param} must be a string, null or a list of text parts", param)


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"{param} must be a list", param)
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise _bad(
                f"{param}[{k}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param
            )
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(f"{param}[{k}].function.arguments is not valid JSON", param) from None
        if args is None:
            args = {}
        out.append({"id": call.get("id") or f"call_{k}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})  # fmt: skip
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as the renderers take them (see the module docstring).

    >>> normalize_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": None}])
    [{'role': 'user', 'content': 'hi'}]
    """
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise _bad(f"{param} must be a message with a role in {ROLES}", param)
        msg: dict[str, Any] = {}
        for key in MESSAGE_KEYS:
            value = m.get(key)
            if value is None or (key == "tool_calls" and value == []):
                continue
            if key == "content":
                value = _text_content(value, f"{param}.content")
            elif key == "tool_calls":
                value = _tool_calls(value, f"{param}.tool_calls")
            msg[key] = value
        if msg["role"] == "developer":
            msg["role"] = "system"
        if "reasoning" in msg and "reasoning_content" not in msg:
            msg["reasoning_content"] = msg.pop("reasoning")
        msg.pop("reasoning", None)
        msg.setdefault("content", "")
        out.append(msg)
    return out


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of function tools", "tools")
    out = []
    for k, tool in enumerate(tools):
        param = f"tools[{k}]"
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, Mapping)
        ):
            raise _bad(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param, "invalid_tool")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise _bad(
                f"{param}.function.name must be a non-empty string of <= 64 chars", param, "invalid_tool"
            )
        params = fn.get("parameters")
        if params is not None and (
            not isinstance(params, Mapping) or params.get("type", "object") != "object"
        ):
            raise _bad(
                f"{param}.function.parameters must be a JSON schema of type 'object'", param, "invalid_tool"
            )
        out.append({"type": "function", "function": {k2: v for k2, v in fn.items() if v is not None}})
    return out


def _number(
    body: Mapping[str, Any], key: str, lo: float, hi: float, *, lo_open: bool = False
) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{key}' must be a number", key)
    if value < lo or value > hi or (lo_open and value == lo):
        raise _bad(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", key)
    return float(value)


def _int(body: Mapping[str, Any], key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _bad(f"'{key}' must be an integer >= {lo}, got {value!r}", key)
    return int(value)


def parse_chat_request(body: Any) -> ChatRequest:
    """Validates a ``/v1/chat/completions`` JSON body (raises :class:`GatewayError` 400).

    >>> r = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
    ...                         "max_completion_tokens": 5, "temperature": 0})
    >>> r.max_tokens, r.temperature, r.stream
    (5, 0.0, False)
    """
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    n = body.get("n", 1)
    if n != 1:
        raise _bad(f"'n' must be 1 (one completion per call: each is a recorded step), got {n!r}", "n")
    tools = body.get("tools")
    tools = _check_tools(tools) if tools else None
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise _bad(f"'tool_choice' must be 'auto' or 'none', got {choice!r}", "tool_choice")
    if choice == "none":
        tools = None
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if body.get("top_logprobs"):
        raise _bad(
            "'top_logprobs' > 0 is not supported (the sampled token's logprob is returned)", "top_logprobs"
        )
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    opts = body.get("stream_options") or {}
    return ChatRequest(
        messages=normalize_messages(body.get("messages")),
        tools=tools,
        temperature=_number(body, "temperature", 0.0, 100.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=None if body.get("top_k") in (None, -1, 0) else _int(body, "top_k", 1),
        max_tokens=max_tokens,
        stop=tuple(stop),
        seed=None if body.get("seed") is None else _int(body, "seed", -(2**63)),
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(opts, Mapping) and opts.get("include_usage")),
        logprobs=bool(body.get("logprobs", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        model=str(body.get("model") or ""),
    )


def wire_message(reply: Mapping[str, Any], call_ids: Sequence[str]) -> dict[str, Any]:
    """The assistant message on the wire: ``reply`` (parsed from the sampled ids) with tool-call
    ids ``call_ids`` and JSON-string arguments.

    >>> m = wire_message({"role": "assistant", "content": "", "tool_calls": [
    ...     {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}, ["c9"])
    >>> m["tool_calls"]
    [{'id': 'c9', 'type': 'function', 'function': {'name': 'f', 'arguments': '{"x": 1}'}}]
    """
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("reasoning_content") is not None:
        message["reasoning_content"] = reply["reasoning_content"]
    calls = reply.get("tool_calls") or []
    if calls:
        message["tool_calls"] = []
        for call, cid in zip(calls, call_ids, strict=True):
            fn = call.get("function", call)
            args = fn.get("arguments")
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            message["tool_calls"].append(
                {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}
            )
    return message


def finish_reason_of(engine_reason: str, message: Mapping[str, Any]) -> str:
    """OpenAI's finish reason: "length" stays, a stopped turn with tool calls is "tool_calls".

    >>> finish_reason_of("stop", {"tool_calls": [{}]}), finish_reason_of("length", {})
    ('tool_calls', 'length')
    """
    if engine_reason == "length":
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def _logprobs_body(tokens: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
    }


@dataclasses.dataclass(frozen=True)
class Answer:
    """Everything a response says about one recorded call."""

    id: str
    created: int
    model: str
    message: dict[str, Any]
    finish_reason: str
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    token_texts: Sequence[str] | None = None  # per completion id, when logprobs were asked
    weight_version: int = 0


def _usage(a: Answer) -> dict[str, int]:
    p, c = len(a.prompt_ids), len(a.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_body(a: Answer, req: ChatRequest) -> dict[str, Any]:
    """The ``chat.completion`` object of a non-streamed call."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": a.message,
        "finish_reason": a.finish_reason,
        "logprobs": _logprobs_body(a.token_texts or (), a.logprobs) if req.logprobs else None,
    }
    body: dict[str, Any] = {
        "id": a.id,
        "object": "chat.completion",
        "created": a.created,
        "model": a.model,
        "choices": [choice],
        "usage": _usage(a),
        "weight_version": a.weight_version,
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = list(a.prompt_ids)
        choice["token_ids"] = list(a.completion_ids)
    return body


def _pieces(text: str) -> Iterator[str]:
    for i in range(0, len(text), STREAM_CHUNK_CHARS):
        yield text[i : i + STREAM_CHUNK_CHARS]


def stream_chunks(a: Answer, req: ChatRequest) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed call (see the module docstring)."""

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": a.id, "object": "chat.completion.chunk", "created": a.created, "model": a.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}  # fmt: skip

    yield chunk({"role": "assistant", "content": ""})
    m = a.message
    for piece in _pieces(m.get("reasoning_content") or ""):
        yield chunk({"reasoning_content": piece})
    for piece in _pieces(m.get("content") or ""):
        yield chunk({"content": piece})
    for k, call in enumerate(m.get("tool_calls") or ()):
        fn = call["function"]
        head = {
            "index": k,
            "id": call["id"],
            "type": "function",
            "function": {"name": fn["name"], "arguments": ""},
        }
        yield chunk({"tool_calls": [head]})
        for piece in _pieces(fn["arguments"]):
            yield chunk({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
    extra: dict[str, Any] = {}
    if req.logprobs:
        extra["logprobs"] = _logprobs_body(a.token_texts or (), a.logprobs)
    if req.return_token_ids:
        extra["token_ids"] = list(a.completion_ids)
    last = chunk({}, a.finish_reason, **extra)
    if req.return_token_ids:
        last["prompt_token_ids"] = list(a.prompt_ids)
    yield last
    if req.include_usage:
        yield {"id": a.id, "object": "chat.completion.chunk", "created": a.created, "model": a.model,
               "choices": [], "usage": _usage(a)}  # fmt: skip


def sse(obj: Any) -> bytes:
    """One server-sent event line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
