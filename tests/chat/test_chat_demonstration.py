"""Renderer.demonstration_hint: a system turn inserted into prompts equals the template's own render.

Independent references: the reference Jinja templates of chat_fixtures (``apply_chat_template``)
rendering the conversation WITH the demonstration system message, and each renderer's own full
render of it; plus round-trip tokenization of the conditioned ids' text.
"""

import random

import chat_fixtures as cf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.chat import (
    QWEN25_DEFAULT_SYSTEM,
    ChatMLRenderer,
    GenericRenderer,
    Llama3Renderer,
    Qwen3Renderer,
    Qwen25Renderer,
)
from rljax.chat.base import DEFAULT_DEMONSTRATION_TEMPLATE, DemonstrationHint
from rljax.chat.toy import toy_tokenizer

# name -> (tokenizer key, factory, apply_chat_template kwargs, expected insert_at)
INSERTING = {
    "chatml": ("chatml", ChatMLRenderer, {}, 0),
    "qwen3": ("qwen3", Qwen3Renderer, {}, 0),
    "qwen3-template": ("qwen3", lambda t: Qwen3Renderer(t, retention="template"), {}, 0),
    "qwen3-nothink": (
        "qwen3",
        lambda t: Qwen3Renderer(t, enable_thinking=False),
        {"enable_thinking": False},
        0,
    ),
    "llama3": ("llama3", lambda t: Llama3Renderer(t, system_preamble=False), {}, 1),
    "generic-chatml": ("chatml", GenericRenderer, {}, 0),
    "generic-qwen3": ("qwen3", GenericRenderer, {}, 0),
    "generic-llama3": ("llama3", GenericRenderer, {}, 1),
}
ALL = {
    **INSERTING,
    "qwen2.5": ("qwen2.5", Qwen25Renderer, {}, 0),
    "llama3.1": ("llama3.1", Llama3Renderer, {}, 1),
}
# Generic renderers whose templates do not render a leading system message as an insertion.
NOT_INSERTING = {
    "qwen2.5": "replaces the default system prompt",
    "llama3.1": "merges the system text into the dated preamble turn",
    "gemma": "rejects system messages",
    "counting": "rewrites the first turn when a message is added",
}


def build(toks, name):
    key, factory, kwargs, insert_at = ALL[name]
    renderer = factory(toks[key])
    if isinstance(renderer, GenericRenderer):
        renderer.template_kwargs.update(kwargs)
    return toks[key], renderer, kwargs, insert_at


def insert(prompt, hint):
    return prompt[: hint.insert_at] + list(hint.ids) + prompt[hint.insert_at :]


def system(text):
    return {"role": "system", "content": text}


def conversation(rng, *, keep_system):
    messages, _ = cf.random_conversation(rng, tools_ok=False, end_with_assistant=False)
    if not keep_system:
        messages = [m for m in messages if m["role"] != "system"]
    return messages


def demonstration(rng):
    return rng.choice(["", " "]) + cf.clean_text(rng, max_words=12) + rng.choice(["", "\n", " {x} "])


@pytest.mark.parametrize("name", sorted(INSERTING))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), keep_system=st.booleans())
def test_insertion_equals_full_render_with_system_message(toks, name, seed, keep_system):
    tok, renderer, kwargs, insert_at = build(toks, name)
    rng = random.Random(seed)
    messages = conversation(rng, keep_system=keep_system)
    demo = demonstration(rng)
    hint = renderer.demonstration_hint(demo)
    assert hint.insert_at == insert_at and hint.ids
    text = DEFAULT_DEMONSTRATION_TEMPLATE.replace("{demonstration}", demo)
    prompt = renderer.render_ids(messages, add_generation_prompt=True)
    expected = cf.hf_ids(tok, [system(text), *messages], add_generation_prompt=True, **kwargs)
    assert insert(prompt, hint) == expected
    assert renderer.render_ids([system(text), *messages], add_generation_prompt=True) == expected
    assert list(hint.prefix) == prompt[:insert_at]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), keep_system=st.booleans())
def test_qwen25_demonstration_goes_before_the_system_turn(toks, seed, keep_system):
    tok, renderer, _, _ = build(toks, "qwen2.5")
    rng = random.Random(seed)
    messages = conversation(rng, keep_system=keep_system)
    demo = demonstration(rng)
    hint = renderer.demonstration_hint(demo)
    text = DEFAULT_DEMONSTRATION_TEMPLATE.replace("{demonstration}", demo)
    if messages[0]["role"] == "system":
        full = [system(text), *messages]
    else:  # the default system turn Qwen2.5 renders when the conversation has none
        full = [system(text), system(QWEN25_DEFAULT_SYSTEM), *messages]
    expected = cf.hf_ids(tok, full, add_generation_prompt=True)
    assert hint.insert_at == 0
    assert insert(renderer.render_ids(messages, add_generation_prompt=True), hint) == expected
    assert renderer.render_ids(full, add_generation_prompt=True) == expected


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), keep_system=st.booleans())
def test_llama31_demonstration_turn_goes_right_after_bos(toks, seed, keep_system):
    # Llama 3.1 puts messages[0] into its dated preamble turn, so no message list renders a
    # standalone turn first; the hint must be exactly the turn the template renders for a
    # non-leading system message, inserted after <|begin_of_text|>.
    tok, renderer, _, _ = build(toks, "llama3.1")
    rng = random.Random(seed)
    messages = conversation(rng, keep_system=keep_system)
    demo = demonstration(rng)
    hint = renderer.demonstration_hint(demo)
    text = DEFAULT_DEMONSTRATION_TEMPLATE.replace("{demonstration}", demo)
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    lead = messages[:1] if messages[0]["role"] == "system" else [system("")]
    rest = messages[1:] if messages[0]["role"] == "system" else messages
    without = cf.hf_ids(tok, [*lead, *rest], add_generation_prompt=True)
    with_turn = cf.hf_ids(tok, [*lead, system(text), *rest], add_generation_prompt=True)
    at = without.index(tok.convert_tokens_to_ids("<|eot_id|>")) + 1  # end of the dated preamble turn
    assert with_turn == without[:at] + list(hint.ids) + without[at:]
    prompt = renderer.render_ids(messages, add_generation_prompt=True)
    assert (hint.insert_at, hint.prefix) == (1, (bos,)) and prompt[0] == bos
    conditioned = insert(prompt, hint)
    assert conditioned == [bos, *hint.ids, *prompt[1:]]
    assert renderer.decode(hint.ids) == (
        "<|start_header_id|>system<|end_header_id|>\n\n" + text.strip() + "<|eot_id|>"
    )


@pytest.mark.parametrize("name", ["chatml", "qwen2.5", "qwen3", "llama3.1", "llama3"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_conditioned_prompts_with_tools_tokenize_as_their_text(toks, name, seed):
    # With tools no message list renders the insertion, but the result must still be the exact
    # tokenization of its own text (no text run split at the insertion point).
    tok, renderer, _, _ = build(toks, name)
    rng = random.Random(seed)
    conv = dict(max_calls=1, dict_tool_content=True) if name.startswith("llama3.1") else {}
    if name == "llama3":
        conv = dict(tools_ok=False)
    messages, tools = cf.random_conversation(rng, end_with_assistant=False, **conv)
    hint = renderer.demonstration_hint(demonstration(rng))
    prompt = renderer.render_ids(messages, add_generation_prompt=True, tools=tools)
    conditioned = insert(prompt, hint)
    text = renderer.decode(conditioned)
    assert text == renderer.decode(prompt[: hint.insert_at]) + renderer.decode(hint.ids) + renderer.decode(
        prompt[hint.insert_at :]
    )
    assert tok(text, add_special_tokens=False)["input_ids"] == conditioned


@pytest.mark.parametrize("name", sorted(ALL))
def test_no_demonstration_gives_an_empty_hint(toks, name):
    _, renderer, _, _ = build(toks, name)
    for demo in (None, ""):
        hint = renderer.demonstration_hint(demo)
        assert hint == DemonstrationHint(0, ()) and not hint


@pytest.mark.parametrize("key", sorted(NOT_INSERTING))
def test_generic_raises_when_the_template_does_not_insert(toks, key):
    renderer = GenericRenderer(toks[key])
    with pytest.raises(NotImplementedError, match="demonstration|system"):
        renderer.demonstration_hint("a worked example")
    assert renderer.demonstration_hint(None) == DemonstrationHint(0, ())


def test_template_argument_and_attribute():
    r = ChatMLRenderer(toy_tokenizer("chatml"))
    assert r.decode(r.demonstration_hint("4", template="Solution: {demonstration}!").ids) == (
        "<|im_start|>system\nSolution: 4!<|im_end|>\n"
    )
    assert r.decode(r.demonstration_hint("a {b} c").ids) == (
        "<|im_start|>system\nA worked demonstration for this task:\na {b} c<|im_end|>\n"
    )
    r.demonstration_template = "Hint -> {demonstration}"
    assert r.decode(r.demonstration_hint("x").ids) == "<|im_start|>system\nHint -> x<|im_end|>\n"
    with pytest.raises(ValueError, match="demonstration"):
        r.demonstration_hint("x", template="no field")
    with pytest.raises(ValueError, match="string"):
        r.demonstration_hint(42)


def test_toy_llama3_hint_by_hand():
    tok = toy_tokenizer("llama3")
    r = Llama3Renderer(tok)
    hint = r.demonstration_hint(" 2+2=4 \n", template="{demonstration}")
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|start_header_id|>",)]
    ids += list(b"system") + [tok.convert_tokens_to_ids("<|end_header_id|>")] + list(b"\n\n2+2=4")
    ids += [tok.convert_tokens_to_ids("<|eot_id|>")]
    assert hint == DemonstrationHint(1, tuple(ids), prefix=(tok.convert_tokens_to_ids("<|begin_of_text|>"),))


def test_hint_validation():
    with pytest.raises(ValueError, match="insert_at"):
        DemonstrationHint(-1, (1,))
    with pytest.raises(ValueError, match="prefix"):
        DemonstrationHint(2, (1,), prefix=(0,))
    assert DemonstrationHint(1, [np_int for np_int in (3, 4)]).ids == (3, 4)
