"""Tool-call and reasoning parsing on text (rljax.chat.tool_calls)."""

import json
import random

import chat_fixtures as cf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.chat.tool_calls import (
    ToolCallError,
    make_tool_call,
    parse_hermes_tool_calls,
    parse_llama3_json_tool_calls,
    split_reasoning,
    tool_call_function,
)


def test_hermes_hand_examples():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3.5]}}\n</tool_call>'
    )
    content, calls, errors = parse_hermes_tool_calls(text)
    assert content == "Let me check."
    assert errors == []
    assert calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        },
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": {"a": 1, "b": [2, 3.5]}},
        },
    ]


def test_hermes_no_calls_keeps_text_verbatim():
    assert parse_hermes_tool_calls("  plain\n\n answer \n") == ("  plain\n\n answer \n", [], [])


def test_hermes_string_arguments_are_decoded():
    _, calls, errors = parse_hermes_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
    )
    assert errors == [] and calls[0]["function"] == {"name": "f", "arguments": {"x": 2}}


@pytest.mark.parametrize(
    "body, reason",
    [
        ('{"name": "f", "arguments": {"x": 1}', "invalid JSON"),
        ("not json at all", "invalid JSON"),
        ('{"arguments": {}}', "non-empty string 'name'"),
        ('{"name": "", "arguments": {}}', "non-empty string 'name'"),
        ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "f", "arguments": "nope"}', "not valid JSON"),
        ('["f"]', "must be a JSON object"),
    ],
)
def test_hermes_malformed_calls_are_reported_not_raised(body, reason):
    good = '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>'
    content, calls, errors = parse_hermes_tool_calls(f"hi\n{good}\n<tool_call>\n{body}\n</tool_call>")
    assert content == "hi"
    assert [c["function"]["name"] for c in calls] == ["ok"]
    assert len(errors) == 1 and isinstance(errors[0], ToolCallError)
    assert errors[0].raw == body and reason in errors[0].reason


def test_hermes_unterminated_block():
    content, calls, errors = parse_hermes_tool_calls('x\n<tool_call>\n{"name": "f", "argum')
    assert content == "x" and calls == []
    assert errors[0].reason.startswith("unterminated") and errors[0].raw == '{"name": "f", "argum'


def test_hermes_text_after_calls_is_kept_in_content():
    text = 'a\n<tool_call>{"name": "f", "arguments": {}}</tool_call> and more'
    assert parse_hermes_tool_calls(text)[0] == "a and more"


def test_llama3_hand_examples():
    content, calls, errors = parse_llama3_json_tool_calls('{"name": "add", "parameters": {"a": 1}}')
    assert (content, errors) == ("", [])
    assert calls == [make_tool_call("add", {"a": 1})]
    _, calls, _ = parse_llama3_json_tool_calls('<|python_tag|>{"name": "a", "arguments": {}}; {"name": "b"}')
    assert [c["function"] for c in calls] == [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]
    assert [c["id"] for c in calls] == ["call_0", "call_1"]


@pytest.mark.parametrize(
    "text, n_errors",
    [
        ("Hello there.", 0),
        ('{"answer": 4}', 0),  # JSON without a name: an answer, not a call
        ('{"name": "f", "parameters": {"a": 1}', 1),  # truncated JSON
        ('{"name": "f"} trailing words', 1),
        ('<|python_tag|>{"answer": 4}', 1),
    ],
)
def test_llama3_non_calls_and_malformed(text, n_errors):
    content, calls, errors = parse_llama3_json_tool_calls(text)
    assert calls == [] and content == text and len(errors) == n_errors


def test_split_reasoning_hand_examples():
    assert split_reasoning("<think>\nA\nB\n</think>\n\nC\n") == ("A\nB", "C\n", True)
    assert split_reasoning("A</think>C") == ("A", "C", True)  # opener in the prompt (Qwen3 2507)
    assert split_reasoning("<think>\n\n</think>\n\nC") == ("", "C", True)
    assert split_reasoning("\n<think>\npartial") == ("partial", "", False)
    assert split_reasoning("no tags") == (None, "no tags", False)


def test_tool_call_function_accepts_nested_and_flat():
    assert tool_call_function({"type": "function", "function": {"name": "f", "arguments": {}}})["name"] == "f"
    assert tool_call_function({"name": "g", "arguments": {}})["name"] == "g"
    with pytest.raises(ValueError, match="string 'name'"):
        tool_call_function({"function": {"arguments": {}}})
    with pytest.raises(ValueError, match="must be a dict"):
        tool_call_function("f()")


def _hermes_render(content: str, calls: list[dict]) -> str:
    """Independent reference of the Qwen template's assistant text for calls."""
    parts = [content]
    for k, c in enumerate(calls):
        sep = "\n" if (k or content) else ""
        parts.append(
            f'{sep}<tool_call>\n{{"name": "{c["name"]}", "arguments": '
            f"{json.dumps(c['arguments'], ensure_ascii=False)}}}\n</tool_call>"
        )
    return "".join(parts)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_hermes_roundtrip_random(seed):
    rng = random.Random(seed)
    content = cf.random_text(rng).replace("<tool_call>", "")
    calls = [cf.random_call(rng, nested=False) for _ in range(rng.randint(0, 3))]
    parsed_content, parsed, errors = parse_hermes_tool_calls(_hermes_render(content, calls))
    assert errors == []
    assert [p["function"] for p in parsed] == calls
    assert parsed_content == content


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_llama3_roundtrip_random(seed):
    rng = random.Random(seed)
    call = cf.random_call(rng, nested=False)
    text = f'{{"name": "{call["name"]}", "parameters": {json.dumps(call["arguments"], ensure_ascii=False)}}}'
    content, parsed, errors = parse_llama3_json_tool_calls(text)
    assert (content, errors) == ("", []) and parsed[0]["function"] == call


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(
            list('<>/{}[]":,; \nabtool_cthinkname1')
            + [
                "<tool_call>",
                "</tool_call>",
                "<think>",
                "</think>",
                "<|python_tag|>",
                '{"name": ',
                '"arguments": ',
            ]
        )
    )
)
def test_parsers_never_raise(parts):
    text = "".join(parts)
    for parse in (parse_hermes_tool_calls, parse_llama3_json_tool_calls):
        content, calls, errors = parse(text)
        assert isinstance(content, str)
        assert all(isinstance(e, ToolCallError) for e in errors)
        assert all(isinstance(c["function"]["arguments"], dict) for c in calls)
    reasoning, content, closed = split_reasoning(text)
    assert closed == ("</think>" in text) and isinstance(content, str)


# -- the ChatML family's convention as SmolLM2 writes it: tools=, unknown tools, text around calls ----
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def test_hermes_calls_of_known_tools_with_text_before_and_after():
    text = (
        'I will add them.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '\n<tool_call>\n{"name": "lookup", "arguments": {"key": "zob"}}\n</tool_call> Done.'
    )
    content, calls, errors = parse_hermes_tool_calls(text, tools=[ADD, LOOKUP])
    assert errors == []
    assert calls == [
        make_tool_call("add", {"a": 2, "b": 3}),
        make_tool_call("lookup", {"key": "zob"}, index=1),
    ]
    # the text before the first block, then the non-blank text after each block
    assert content == "I will add them. Done."


def test_hermes_unknown_tool_is_an_error_next_to_the_known_calls():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    )
    content, calls, errors = parse_hermes_tool_calls(text, tools=[ADD, "lookup"])
    assert content == ""
    assert [c["function"]["name"] for c in calls] == ["add", "lookup"]
    assert [c["id"] for c in calls] == ["call_0", "call_1"]  # ids number the calls that parsed
    assert errors == [
        ToolCallError(
            '{"name": "search", "arguments": {"q": "x"}}',
            "unknown tool 'search'; the tools are ['add', 'lookup']",
        )
    ]
    # without tools= any name is a call (the renderers' parse_response does not know the tools)
    assert len(parse_hermes_tool_calls(text)[1]) == 3


def test_hermes_malformed_json_with_tools_is_reported_and_the_text_stays_out_of_content():
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
    content, calls, errors = parse_hermes_tool_calls(text, tools=[ADD])
    assert (content, calls) == ("Sure. ", [])
    assert len(errors) == 1 and errors[0].reason.startswith("invalid JSON")
    assert errors[0].raw == '{"name": "add", "arguments": {"a": 1,}}'


def test_tool_names_rejects_specs_without_a_name():
    with pytest.raises(ValueError, match=r"tools\[1\] must be a tool spec with a string name"):
        parse_hermes_tool_calls("x", tools=[ADD, {"type": "function", "function": {}}])
