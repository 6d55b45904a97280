"""Parsing of model completions: reasoning blocks and tool calls (design §4).

Pure string functions used by the renderers' ``parse_response``. They never raise on
malformed model output: a tool call that cannot be parsed is returned as a
:class:`ToolCallError` next to the calls that could, so one bad generation never kills an
agent loop (the environment can answer it with an error message instead).

Formats:

* Hermes / Qwen (ChatML, Qwen2.5, Qwen3, and SmolLM2 by rljax's convention):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks after the
  message content (Qwen2.5 model card; vLLM's ``hermes`` parser).
* Llama 3.1+ JSON: the whole message is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several calls may be separated by ``;``) (Llama 3.1 model card,
  "JSON based tool calling"; vLLM's ``llama3_json`` parser).
* Reasoning: ``<think>...</think>`` before the answer (Qwen3 model card).

A parsed call is an OpenAI-style dict ``{"id", "type": "function", "function": {"name",
"arguments"}}`` with ``arguments`` decoded to a dict, which is what the chat templates expect
when the call is rendered back into history.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "ToolCallError",
    "make_tool_call",
    "parse_hermes_tool_calls",
    "parse_llama3_json_tool_calls",
    "split_reasoning",
    "tool_call_function",
    "tool_names",
]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A tool call the model attempted but that could not be parsed.

    Attributes:
      raw: the text of the attempted call (the body of the block, or the whole message).
      reason: what is wrong, e.g. ``"invalid JSON: Expecting ',' delimiter ..."``.
    """

    raw: str
    reason: str


def make_tool_call(name: str, arguments: dict[str, Any], *, index: int = 0) -> dict[str, Any]:
    """Builds an OpenAI-style tool call dict (what ``parse_response`` returns).

    >>> make_tool_call("add", {"a": 1}, index=2)
    {'id': 'call_2', 'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}
    """
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_function(tool_call: Any) -> dict[str, Any]:
    """Returns the ``{"name", "arguments"}`` part of a nested (OpenAI) or flat tool call.

    >>> tool_call_function({"function": {"name": "f", "arguments": {}}})
    {'name': 'f', 'arguments': {}}
    >>> tool_call_function({"name": "f", "arguments": "{}"})
    {'name': 'f', 'arguments': '{}'}
    """
    if not isinstance(tool_call, dict):
        raise ValueError(f"a tool call must be a dict, got {type(tool_call).__name__}: {tool_call!r}")
    function = tool_call.get("function")
    if function:
        tool_call = function
    if not isinstance(tool_call, dict) or not isinstance(tool_call.get("name"), str):
        raise ValueError(
            "a tool call needs a string 'name' (flat) or 'function': {'name': ..., 'arguments': ...}; "
            f"got {tool_call!r}"
        )
    return tool_call


def split_reasoning(
    text: str, *, start_tag: str = "<think>", end_tag: str = "</think>"
) -> tuple[str | None, str, bool]:
    """Splits ``<think>reasoning</think>content`` the way the Qwen3 template reads it back.

    Math (Qwen3 chat template, assistant branch): ``reasoning = text.split(end)[0]
    .split(start)[-1].strip("\\n")`` and ``content = text.split(end)[-1].lstrip("\\n")``.
    Without ``end_tag``: if the text opens a reasoning block that never closes (a truncated
    completion) everything after ``start_tag`` is reasoning; otherwise there is no reasoning.

    Returns:
      ``(reasoning or None, content, closed)`` where ``closed`` says whether the end tag was seen.

    >>> split_reasoning("<think>\\nhmm\\n</think>\\n\\nHi")
    ('hmm', 'Hi', True)
    >>> split_reasoning("Hi")
    (None, 'Hi', False)
    >>> split_reasoning("<think>\\nstill thinking")
    ('still thinking', '', False)
    """
    if end_tag in text:
        head, _, tail = text.partition(end_tag)
        return head.split(start_tag)[-1].strip("\n"), tail.lstrip("\n"), True
    stripped = text.lstrip("\n")
    if stripped.startswith(start_tag):
        return stripped[len(start_tag) :].strip("\n"), "", False
    return None, text, False


def _decode_arguments(arguments: Any) -> dict[str, Any]:
    """Arguments as a dict: a dict as is, a JSON string decoded; anything else is an error."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"'arguments' is a string that is not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"'arguments' must be a JSON object, got {type(arguments).__name__}")
    return arguments


def _call_from_json(obj: Any, *, arguments_keys: tuple[str, ...], index: int) -> dict[str, Any]:
    """Validates one decoded call object and converts it to the OpenAI dict."""
    if not isinstance(obj, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a non-empty string 'name'")
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = {} if key is None else _decode_arguments(obj[key])
    return make_tool_call(name, arguments, index=index)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def tool_names(tools: Iterable[Any] | None) -> frozenset[str] | None:
    """The names of ``tools`` (OpenAI specs ``{"type": "function", "function": {"name"}}``, flat
    ``{"name"}`` specs, or plain names); None for None.

    >>> sorted(tool_names([{"type": "function", "function": {"name": "add"}}, "lookup"]))
    ['add', 'lookup']
    """
    if tools is None:
        return None
    names = set()
    for i, tool in enumerate(tools):
        if isinstance(tool, str):
            names.add(tool)
            continue
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"tools[{i}] must be a tool spec with a string name, got {tool!r}")
        names.add(spec["name"])
    return frozenset(names)


def parse_hermes_tool_calls(
    text: str, *, tools: Iterable[Any] | None = None
) -> tuple[str, list[dict[str, Any]], list[ToolCallError]]:
    """Parses Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks out of message text.

    The content is the text before the first block minus the one ``"\\n"`` the Qwen
    templates put between content and calls; non-blank text between or after blocks is
    appended to it. An unterminated block or invalid JSON becomes a :class:`ToolCallError`.
    ``tools`` (the specs or names the model was given; None: any name) makes a call to a tool
    not among them a :class:`ToolCallError` too.

    >>> c, calls, errs = parse_hermes_tool_calls(
    ...     'Sure.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
    >>> c, calls[0]["function"], errs
    ('Sure.', {'name': 'add', 'arguments': {'a': 1}}, [])
    >>> parse_hermes_tool_calls("<tool_call>\\n{oops}\\n</tool_call>")[2][0].reason[:12]
    'invalid JSON'
    >>> parse_hermes_tool_calls('<tool_call>{"name": "rm"}</tool_call>', tools=["add"])[2][0].reason
    "unknown tool 'rm'; the tools are ['add']"
    """
    known = tool_names(tools)
    matches = list(_HERMES_BLOCK.finditer(text))
    if not matches:
        return text, [], []
    content = text[: matches[0].start()]
    content = content[:-1] if content.endswith("\n") else content
    calls: list[dict[str, Any]] = []
    errors: list[ToolCallError] = []
    for i, match in enumerate(matches):
        gap_end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        extra = text[match.end() : gap_end]
        if extra.strip():
            content += extra
        body = match.group(1).strip()
        if not match.group(2):
            errors.append(ToolCallError(body, "unterminated <tool_call> block (no </tool_call>)"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(ToolCallError(body, f"invalid JSON: {e}"))
            continue
        try:
            call = _call_from_json(obj, arguments_keys=("arguments", "parameters"), index=len(calls))
        except ValueError as e:
            errors.append(ToolCallError(body, str(e)))
            continue
        name = call["function"]["name"]
        if known is not None and name not in known:
            errors.append(ToolCallError(body, f"unknown tool {name!r}; the tools are {sorted(known)}"))
            continue
        calls.append(call)
    return content, calls, errors


def _split_json_objects(text: str) -> list[Any]:
    """Decodes ``obj (; obj)*`` with optional whitespace; raises ValueError on anything else."""
    decoder = json.JSONDecoder()
    objects, pos = [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON: {e}") from None
        objects.append(obj)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return objects
        if text[pos] != ";":
            raise ValueError(
                f"unexpected text after a JSON tool call at char {pos}: {text[pos : pos + 20]!r}"
            )
        pos += 1


def parse_llama3_json_tool_calls(
    text: str, *, python_tag: str = "<|python_tag|>"
) -> tuple[str, list[dict[str, Any]], list[ToolCallError]]:
    """Parses Llama 3.1+ JSON tool calls: the whole message is ``{"name", "parameters"}``.

    A message counts as a tool-call attempt when, after an optional ``<|python_tag|>``, it
    starts with ``{``. Objects without a ``"name"`` (plain JSON answers) stay content; JSON
    that does not decode is a :class:`ToolCallError` and the text stays content.

    >>> _, calls, _ = parse_llama3_json_tool_calls('{"name": "add", "parameters": {"a": 1}}')
    >>> calls[0]["function"]
    {'name': 'add', 'arguments': {'a': 1}}
    >>> parse_llama3_json_tool_calls("The answer is 4.")
    ('The answer is 4.', [], [])
    """
    body = text.strip()
    tagged = body.startswith(python_tag)
    if tagged:
        body = body[len(python_tag) :].strip()
    if not body.startswith("{"):
        return text, [], []
    try:
        objects = _split_json_objects(body)
    except ValueError as e:
        return text, [], [ToolCallError(body, str(e))]
    if not all(isinstance(o, dict) and "name" in o for o in objects):
        if tagged:
            return text, [], [ToolCallError(body, "a <|python_tag|> call needs JSON objects with a 'name'")]
        return text, [], []
    calls: list[dict[str, Any]] = []
    errors: list[ToolCallError] = []
    for obj in objects:
        try:
            calls.append(_call_from_json(obj, arguments_keys=("parameters", "arguments"), index=len(calls)))
        except ValueError as e:
            errors.append(ToolCallError(json.dumps(obj, ensure_ascii=False), str(e)))
    return "", calls, errors
