"""The Anthropic Messages wire format (``POST /v1/messages``) on top of the chat-completions path.

A Messages request is converted to the OpenAI-style request the gateway already serves
(:func:`to_chat_body`, then :func:`rljax.gateway.protocol.parse_chat_request`), so it is rendered,
bridged, sampled and recorded exactly like a chat completion; the answer is converted back
(:func:`message_body`, :func:`stream_events`). What is accepted:

* ``system``: a string or a list of text blocks (one system message);
* ``messages``: ``user`` / ``assistant`` turns, ``content`` a string or a list of blocks:
  ``text``; ``tool_use`` (``id``, ``name``, ``input``: assistant tool calls); ``tool_result``
  (``tool_use_id``, ``content`` a string or text blocks; ``is_error`` ignored: each becomes a
  ``tool`` message, in order, before the turn's text); ``thinking`` (its text is the assistant's
  ``reasoning_content``; ``signature`` ignored); ``redacted_thinking`` is dropped; anything else
  (images, documents, server tools) is 400. ``cache_control`` keys are ignored;
* ``tools``: custom tools ``{"name", "description"?, "input_schema"}`` (server tools: 400);
  ``tool_choice``: ``{"type": "auto"}`` (default) or ``{"type": "none"}`` ("any" / "tool": 400);
* ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences`` (one token each, as
  the chat path's ``stop``), ``stream``; ``metadata`` and other keys are ignored.

The answer: ``content`` = a ``thinking`` block (a parsed ``<think>`` block), a ``text`` block
(when there is text) and a ``tool_use`` block per tool call (``input`` the parsed arguments);
``stop_reason`` "tool_use" / "max_tokens" / "stop_sequence" / "end_turn"; ``usage`` the prompt
and completion token counts. Sending that message back as the next request's assistant turn
extends the call (the bridge: the same ids). Errors are Anthropic's body
``{"type": "error", "error": {"type", "message"}}``.

Streaming (``text/event-stream``): ``message_start``, then per block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``thinking_delta`` + ``signature_delta`` /
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason, output
tokens) and ``message_stop``; the deltas of each block concatenate to the non-streamed block.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from rljax.gateway.protocol import STREAM_CHUNK_CHARS, Answer, GatewayError

__all__ = [
    "anthropic_error_body",
    "message_body",
    "sse_event",
    "stop_reason_of",
    "stream_events",
    "to_chat_body",
]

#: HTTP status -> Anthropic's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP ``status``.

    >>> anthropic_error_body(401, "bad key")
    {'type': 'error', 'error': {'type': 'authentication_error', 'message': 'bad key'}}
    """
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


def _text_of(content: Any, param: str) -> str:
    """A string, or a list of text blocks joined (tool results, system prompts)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of text blocks", param)
    parts = []
    for k, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
            raise _bad(f"{param}[{k}]: only text blocks are supported here, got {kind!r}", param)
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _user_turn(content: Any, param: str) -> list[dict[str, Any]]:
    """A user turn as chat messages: its tool results (``tool`` messages), then its text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{param}.content must be a string or a list of content blocks", param)
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_result":
            result = _text_of(block.get("content"), f"{param}.content[{k}].content")
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result})
        else:
            raise _bad(
                f"{param}.content[{k}]: a user turn takes text and tool_result blocks, got {kind!r}", param
            )
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_turn(content: Any, param: str) -> dict[str, Any]:
    """An assistant turn as one chat message (text, reasoning, tool calls)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{param}.content must be a string or a list of content blocks", param)
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            message["reasoning_content"] = str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise _bad(f"{param}.content[{k}]: a tool_use block needs a name", param)
            args = {} if block.get("input") is None else block["input"]
            fn = {"name": block["name"], "arguments": args}
            calls.append({"id": str(block.get("id", f"toolu_{k}")), "type": "function", "function": fn})
        else:
            raise _bad(
                f"{param}.content[{k}]: an assistant turn takes text, thinking and tool_use blocks, "
                f"got {kind!r}",
                param,
            )
    message["content"] = "".join(texts)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of tools", "tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "custom") != "custom" or "name" not in tool:
            raise _bad(f"tools[{k}] must be a custom tool {{'name', 'description'?, 'input_schema'}} "
                       "(server tools are not supported)", f"tools[{k}]")  # fmt: skip
        fn = {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("input_schema"),
        }
        out.append({"type": "function", "function": {k2: v for k2, v in fn.items() if v is not None}})
    return out


def to_chat_body(body: Any) -> dict[str, Any]:
    """The chat-completions body of a Messages request (validated further by
    :func:`~rljax.gateway.protocol.parse_chat_request`).

    >>> b = to_chat_body({"model": "m", "max_tokens": 9, "system": "Be brief.", "messages": [
    ...     {"role": "user", "content": "hi"},
    ...     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    ...     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]})
    >>> [m["role"] for m in b["messages"]], b["max_tokens"]
    (['system', 'user', 'assistant', 'tool'], 9)
    """
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _bad("'messages' must be a non-empty list of messages", "messages")
    for i, turn in enumerate(turns):
        param = f"messages[{i}]"
        role = turn.get("role") if isinstance(turn, Mapping) else None
        if role == "user":
            messages += _user_turn(turn.get("content"), param)
        elif role == "assistant":
            messages.append(_assistant_turn(turn.get("content"), param))
        else:
            raise _bad(f"{param} must have the role 'user' or 'assistant'", param)
    out: dict[str, Any] = {"model": body.get("model") or "", "messages": messages}
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, Mapping) else None
        if kind not in ("auto", "none"):
            raise _bad(
                f"'tool_choice' must be {{'type': 'auto'}} or {{'type': 'none'}}, got {choice!r}",
                "tool_choice",
            )
        out["tool_choice"] = kind
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    return out


def stop_reason_of(answer: Answer, stop_sequence: str | None) -> str:
    """Anthropic's stop reason of an answer (``stop_sequence``: the stop string it ended on)."""
    if answer.finish_reason == "length":
        return "max_tokens"
    if answer.message.get("tool_calls"):
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content") is not None:
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        args = fn["arguments"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"],
                       "input": json.loads(args) if isinstance(args, str) else args})  # fmt: skip
    return blocks


def _usage(answer: Answer) -> dict[str, int]:
    return {"input_tokens": len(answer.prompt_ids), "output_tokens": len(answer.completion_ids)}


def message_body(answer: Answer, stop_sequence: str | None = None) -> dict[str, Any]:
    """The ``message`` object of a non-streamed call (``id`` = the answer's id)."""
    return {
        "id": answer.id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": _blocks(answer.message),
        "stop_reason": stop_reason_of(answer, stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": _usage(answer),
    }


def _pieces(text: str) -> Iterator[str]:
    for i in range(0, len(text), STREAM_CHUNK_CHARS):
        yield text[i : i + STREAM_CHUNK_CHARS]


def stream_events(answer: Answer, stop_sequence: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of a streamed call (see the module docstring)."""
    full = message_body(answer, stop_sequence)
    start = {**full, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**full["usage"], "output_tokens": 0}}  # fmt: skip
    yield "message_start", {"type": "message_start", "message": start}
    for index, block in enumerate(full["content"]):
        kind = block["type"]
        if kind == "text":
            head, deltas = (
                {"type": "text", "text": ""},
                [{"type": "text_delta", "text": p} for p in _pieces(block["text"])],
            )
        elif kind == "thinking":
            head = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": p} for p in _pieces(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            head = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            text = json.dumps(block["input"], ensure_ascii=False)
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in _pieces(text)]
        yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": head}
        for delta in deltas:
            yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": full["stop_reason"], "stop_sequence": full["stop_sequence"]},
            "usage": {"output_tokens": full["usage"]["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}


def sse_event(name: str, data: Any) -> bytes:
    """One named server-sent event."""
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
