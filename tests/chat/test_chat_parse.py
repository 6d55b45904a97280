"""parse_response from completion ids, ChatSession bookkeeping, registry and toy tokenizers."""

import random

import chat_fixtures as cf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.chat import (
    RENDERERS,
    ChatMLRenderer,
    ChatSession,
    GenericRenderer,
    Llama3Renderer,
    ParsedResponse,
    Qwen3Renderer,
    Qwen25Renderer,
    make_renderer,
    toy_tokenizer,
)

PARSE_CONFIGS = {
    "chatml": ("chatml", ChatMLRenderer, "<|im_end|>", 2, False),
    "qwen2.5": ("qwen2.5", Qwen25Renderer, "<|im_end|>", 2, False),
    "qwen3": ("qwen3", Qwen3Renderer, "<|im_end|>", 2, True),
    "llama3.1": ("llama3.1", Llama3Renderer, "<|eot_id|>", 1, False),
    "generic-qwen3": ("qwen3", GenericRenderer, "<|im_end|>", 2, True),
    "generic-llama3.1": (
        "llama3.1",
        lambda t: GenericRenderer(t, tool_parser="llama3_json"),
        "<|eot_id|>",
        1,
        False,
    ),
}


def expected_message(key, assistant):
    """What parsing the template's rendering of ``assistant`` must give back (independent restatement)."""
    content = assistant.get("content") or ""
    calls = [c["function"] for c in assistant.get("tool_calls", [])]
    if key.startswith("llama3"):
        content = "" if calls else content.strip()
    return content, calls


@pytest.mark.parametrize("name", sorted(PARSE_CONFIGS))
def test_parse_roundtrips_template_rendering(toks, name):
    key, factory, eot, max_calls, thinks = PARSE_CONFIGS[name]
    tok = toks[key]
    renderer = factory(tok)
    rng = random.Random(len(name))
    tools = cf.random_tools(rng)
    for _ in range(30):
        history = [{"role": "user", "content": "q"}]
        calls = rng.randint(0, max_calls)
        assistant = cf.random_assistant(rng, calls=calls, reasoning="always" if thinks else "never")
        ids = cf.canonical_completion(tok, history, assistant, end_of_turn=eot, tools=tools)
        parsed = renderer.parse_response(ids)
        content, expected_calls = expected_message(key, assistant)
        assert parsed.stopped and parsed.errors == []
        assert [c["function"] for c in parsed.tool_calls] == expected_calls
        assert all(
            c["type"] == "function" and c["id"] == f"call_{k}" for k, c in enumerate(parsed.tool_calls)
        )
        if thinks:
            assert parsed.reasoning == assistant["reasoning_content"].strip("\n")
            assert parsed.content == content.lstrip("\n")
        else:
            assert parsed.reasoning is None and parsed.content == content
        # unpacking as (content, reasoning, tool_calls)
        c, r, t = parsed
        assert (c, r, t) == (parsed.content, parsed.reasoning, parsed.tool_calls)


def test_parse_hand_examples(toks):
    tok = toks["qwen3"]
    r = Qwen3Renderer(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    text = (
        "<think>\nI should add.\n</think>\n\nSure.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    parsed = r.parse_response(enc(text) + [end])
    assert parsed.content == "Sure." and parsed.reasoning == "I should add." and parsed.stopped
    assert parsed.tool_calls == [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    ]
    assert parsed.to_message() == {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "I should add.",
        "tool_calls": parsed.tool_calls,
    }
    # malformed JSON: reported, not raised; the loop goes on
    bad = r.parse_response(enc('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>') + [end])
    assert bad.tool_calls == [] and len(bad.errors) == 1 and "invalid JSON" in bad.errors[0].reason
    # truncated inside the reasoning block
    cut = r.parse_response(enc("<think>\nstill going"))
    assert (cut.content, cut.reasoning, cut.stopped) == ("", "still going", False)
    # a different stop token also counts as stopped
    other = tok.convert_tokens_to_ids("<|endoftext|>")
    assert (
        r.parse_response(enc("hi") + [other]).stopped
        and r.parse_response(enc("hi") + [other]).content == "hi"
    )
    # Llama 3 JSON call with the python tag
    lt = toks["llama3.1"]
    lr = Llama3Renderer(lt)
    ids = lt.encode('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}', add_special_tokens=False)
    parsed = lr.parse_response(ids + [lt.convert_tokens_to_ids("<|eom_id|>")])
    assert parsed.stopped and parsed.tool_calls[0]["function"] == {"name": "f", "arguments": {"x": "y"}}
    broken = lr.parse_response(lt.encode('{"name": "f", "parameters": {', add_special_tokens=False))
    assert broken.tool_calls == [] and broken.errors and not broken.stopped


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(0, 40))
def test_parse_never_raises_on_random_ids(toks, seed, n):
    rng = random.Random(seed)
    for key, factory in (("qwen3", Qwen3Renderer), ("llama3.1", Llama3Renderer), ("chatml", GenericRenderer)):
        tok = toks[key]
        ids = [rng.randrange(len(tok)) for _ in range(n)]
        parsed = factory(tok).parse_response(ids)
        assert isinstance(parsed, ParsedResponse) and isinstance(parsed.content, str)


def test_session_errors_and_flow(toks):
    tok = toks["chatml"]
    session = ChatSession(ChatMLRenderer(tok), [{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="call add_completion first"):
        session.add_messages([{"role": "user", "content": "x"}])
    session.add_completion(tok.encode("a", add_special_tokens=False))  # truncated: no stop token
    with pytest.raises(ValueError, match="already called"):
        session.add_completion([])
    first = list(session.prompt_ids)
    session.add_messages([{"role": "user", "content": "x"}])
    # the cut turn is closed by the template's <|im_end|>\n (not sampled) and the history goes on
    assert session.bridged and session.prompt_ids[: len(first) + 1] == [*first, *tok.encode("a")]
    assert session.prompt_ids == cf.hf_ids(tok, session.messages, add_generation_prompt=True)
    assert session.full_prompt_roles[len(first) : len(first) + 3] == ["assistant", None, None]
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user"]


def test_registry_and_toy_tokenizers(toks):
    assert sorted(RENDERERS) == ["chatml", "generic", "llama3", "qwen2.5", "qwen3", "smollm2"]
    assert isinstance(make_renderer("qwen3", toks["qwen3"], retention="all"), Qwen3Renderer)
    for family, name in (("chatml", "qwen3"), ("llama3", "llama3")):
        tok = toy_tokenizer(family)
        text = "héllo 東京 🙂\n\n"
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        make_renderer(name, tok)  # has the format's special tokens
    generic = GenericRenderer(toy_tokenizer("llama3", chat_template="llama3"))
    assert generic.stop_token_ids() == [generic.tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    with pytest.raises(ValueError, match="family"):
        toy_tokenizer("mistral")
