"""SmolLM2's renderer with tools, on the REAL SmolLM2-135M-Instruct tokenizer (read from the cached GGUF
file; skipped without it) and real multi-turn conversations with tool calls and results.

References, independent of the renderer: ``apply_chat_template`` of the real tokenizer with a Jinja
template of the ChatML family's tool convention (``chat_fixtures.SMOLLM2_TOOLS_TEMPLATE``, written
from the Qwen2.5 template and SmolLM2's own), and hand-written expected parses. Completions are the
ids a model writes: the template's text of the turn tokenized alone (canonical), and the call spelled
compactly without newlines (``<tool_call>{...}</tool_call>``, as models often write it), whose
tokens a full render would not reproduce; the bridge must extend both exactly.
"""

from __future__ import annotations

import copy
import json

import chat_fixtures as cf
import pytest
from smollm2 import require_smollm2

from rljax.chat import ChatSession, make_renderer
from rljax.chat.tool_calls import make_tool_call
from rljax.models import gguf_tokenizer

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _call(name, args, k=0):
    return make_tool_call(name, args, index=k)


# (messages, tools): each a whole conversation; every assistant turn is sampled in the test
CONVERSATIONS = [
    (
        [
            {"role": "system", "content": "You are a weather assistant. Use the tools."},
            {"role": "user", "content": "What's the weather in Paris and in Tokyo?"},
            {
                "role": "assistant",
                "content": "Let me check both cities.",
                "tool_calls": [
                    _call("get_weather", {"city": "Paris"}),
                    _call("get_weather", {"city": "Tokyo"}, 1),
                ],
            },
            {"role": "tool", "content": "18°C, sunny", "tool_call_id": "call_0"},
            {"role": "tool", "content": "24°C, light rain", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "Paris: 18°C and sunny. Tokyo: 24°C with light rain."},
            {"role": "user", "content": "Thanks! And Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Zürich"})]},
            {"role": "tool", "content": "9°C, fog", "tool_call_id": "call_0"},
            {"role": "assistant", "content": "Zürich is foggy at 9°C."},
        ],
        [WEATHER],
    ),
    (
        [
            {"role": "user", "content": "What is 4821 * 37? Use the calculator."},
            {"role": "assistant", "content": "", "tool_calls": [_call("multiply", {"a": 4821, "b": 37})]},
            {"role": "tool", "content": "178377"},
            {"role": "assistant", "content": "4821 * 37 = 178377."},
            {"role": "user", "content": "And times 2, using the tool again?"},
            {
                "role": "assistant",
                "content": "Sure.",
                "tool_calls": [_call("multiply", {"a": 178377, "b": 2})],
            },
            {"role": "tool", "content": "356754"},
            {"role": "assistant", "content": "It is 356754."},
        ],
        [MULTIPLY, WEATHER],
    ),
]


@pytest.fixture(scope="module")
def real():
    """``(tokenizer, renderer, reference tokenizer)``: SmolLM2's tokenizer, the ``smollm2`` renderer, and
    a copy of the tokenizer whose chat template is the tool convention's reference template."""
    tokenizer = gguf_tokenizer(require_smollm2())
    reference = copy.deepcopy(tokenizer)
    reference.chat_template = cf.SMOLLM2_TOOLS_TEMPLATE
    return tokenizer, make_renderer("smollm2", tokenizer), reference


def _compact(message):
    """The assistant text with each call spelled ``<tool_call>{json}</tool_call>``, no newlines."""
    calls = "".join(
        "<tool_call>" + json.dumps(c["function"], ensure_ascii=False) + "</tool_call>"
        for c in message.get("tool_calls", [])
    )
    return message["content"] + calls


def _turns(messages):
    """``(index of each assistant message, the messages that follow it up to the next one)``."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            j = k + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            out.append((k, messages[k + 1 : j]))
    return out


@pytest.mark.parametrize("spelling", ["canonical", "compact"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_tool_turns_bridge_exactly_with_the_real_tokenizer(real, conversation, spelling):
    tokenizer, renderer, reference = real
    messages, tools = CONVERSATIONS[conversation]
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    session = ChatSession(renderer, messages[: _turns(messages)[0][0]], tools=tools)
    assert session.prompt_ids == cf.hf_ids(
        reference, session.messages, add_generation_prompt=True, tools=tools
    )
    for k, new in _turns(messages):
        history, message = messages[:k], messages[k]
        if spelling == "canonical":  # the template's text of the turn, tokenized alone, as generated
            completion = cf.canonical_completion(
                reference, history, message, end_of_turn="<|im_end|>", tools=tools
            )
        else:
            completion = tokenizer.encode(_compact(message), add_special_tokens=False) + [eot]
        parsed = session.add_completion(completion)
        assert parsed.errors == [] and parsed.stopped
        assert parsed.content == message["content"]
        assert [c["function"] for c in parsed.tool_calls] == [
            c["function"] for c in message.get("tool_calls", [])
        ]
        if not new:
            break
        before = list(session.prompt_ids)
        after = session.add_messages(new)
        assert session.bridged and after[: len(before) + len(completion)] == before + completion
        # the appended ids are the reference's tokens after the assistant turn's <|im_end|>: the tool
        # results (SmolLM2's `tool` turns) or the user turn, then the generation prompt
        full = cf.hf_ids(reference, messages[: k + 1] + new, add_generation_prompt=True, tools=tools)
        turn_end = cf.hf_ids(reference, messages[: k + 1], add_generation_prompt=False, tools=tools)
        assert full[: len(turn_end)] == turn_end and turn_end[-2:] == [eot, tokenizer.encode("\n")[0]]
        assert after[len(before) + len(completion) :] == full[len(turn_end) - 1 :]
        if spelling == "canonical":  # the whole prompt is the reference render, token for token
            assert after == full


def test_malformed_and_unknown_calls_are_errors_and_still_bridge(real):
    tokenizer, renderer, reference = real
    messages = [{"role": "user", "content": "What is 4821 * 37?"}]
    session = ChatSession(renderer, messages, tools=[MULTIPLY])
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    bad = 'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 4821, "b": 37}\n</tool_call>'
    completion = tokenizer.encode(bad, add_special_tokens=False) + [eot]
    parsed = session.add_completion(completion)
    assert parsed.content == "Let me compute." and parsed.tool_calls == []
    assert len(parsed.errors) == 1 and parsed.errors[0].reason.startswith("invalid JSON")
    before = list(session.prompt_ids)
    new = [{"role": "tool", "content": "error: invalid JSON"}]
    after = session.add_messages(new)
    assert session.bridged and after[: len(before) + len(completion)] == before + completion
    assert renderer.decode(after[len(before) + len(completion) :]) == (
        "\n<|im_start|>tool\nerror: invalid JSON<|im_end|>\n<|im_start|>assistant\n"
    )
    # a call of a tool that is not offered parses (the env answers it); tools= makes it an error
    unknown = tokenizer.encode('<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>')
    assert renderer.parse_response(unknown).tool_calls[0]["function"]["name"] == "divide"
    assert "unknown tool 'divide'" in cf_parse(renderer.decode(unknown), [MULTIPLY])[2][0].reason


def cf_parse(text, tools):
    from rljax.chat.tool_calls import parse_hermes_tool_calls

    return parse_hermes_tool_calls(text, tools=tools)
