"""Full renders equal apply_chat_template token for token; role attribution; piecewise tokenization."""

import json
import random

import chat_fixtures as cf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.chat import (
    ChatMLRenderer,
    GenericRenderer,
    Llama3Renderer,
    Qwen3Renderer,
    Qwen25Renderer,
    SmolLM2Renderer,
    make_renderer,
)
from rljax.chat import base as base_module
from rljax.chat.base import Piece, _encode_texts, encode_pieces

# name -> (tokenizer key, renderer factory, apply_chat_template kwargs, conversation kwargs)
QWEN_CONV = dict(max_calls=2)
LLAMA_CONV = dict(max_calls=1, dict_tool_content=True)
PLAIN_CONV = dict(tools_ok=False)
CONFIGS = {
    "chatml": ("chatml", ChatMLRenderer, {}, QWEN_CONV),
    "qwen2.5": ("qwen2.5", Qwen25Renderer, {}, QWEN_CONV),
    "qwen3": ("qwen3", Qwen3Renderer, {}, QWEN_CONV),
    "qwen3-template": ("qwen3", lambda t: Qwen3Renderer(t, retention="template"), {}, QWEN_CONV),
    "qwen3-nothink": (
        "qwen3",
        lambda t: Qwen3Renderer(t, enable_thinking=False),
        {"enable_thinking": False},
        QWEN_CONV,
    ),
    "llama3.1": ("llama3.1", Llama3Renderer, {}, LLAMA_CONV),
    "llama3.1-systools": (
        "llama3.1",
        lambda t: Llama3Renderer(t, date_string="01 Jan 2025", tools_in_user_message=False),
        {"date_string": "01 Jan 2025", "tools_in_user_message": False},
        LLAMA_CONV,
    ),
    "llama3": ("llama3", lambda t: Llama3Renderer(t, system_preamble=False), {}, PLAIN_CONV),
    "smollm2": ("smollm2", SmolLM2Renderer, {}, PLAIN_CONV),
    # SmolLM2's template has no tool format: the reference is the ChatML family's convention
    "smollm2-tools": ("smollm2-tools", SmolLM2Renderer, {}, QWEN_CONV),
    "generic-chatml": ("chatml", GenericRenderer, {}, QWEN_CONV),
    "generic-qwen2.5": ("qwen2.5", GenericRenderer, {}, QWEN_CONV),
    "generic-qwen3": ("qwen3", GenericRenderer, {}, QWEN_CONV),
    "generic-llama3.1": ("llama3.1", lambda t: GenericRenderer(t, tool_parser="llama3_json"), {}, LLAMA_CONV),
    "generic-llama3": ("llama3", GenericRenderer, {}, PLAIN_CONV),
    "generic-gemma": ("gemma", GenericRenderer, {}, PLAIN_CONV),
}


def build(toks, name):
    key, factory, kwargs, conv = CONFIGS[name]
    tok = toks[key]
    renderer = factory(tok)
    if isinstance(renderer, GenericRenderer):
        renderer.template_kwargs.update(kwargs)
    return tok, renderer, kwargs, conv


def conversation(rng, name, conv):
    messages, tools = cf.random_conversation(rng, **conv)
    if name == "generic-gemma":
        messages = [m for m in messages if m["role"] != "system"]
    return messages, tools


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_full_render_equals_apply_chat_template(toks, name):
    tok, renderer, kwargs, conv = build(toks, name)
    rng = random.Random(hash(name) % 1000)
    for _ in range(25):
        messages, tools = conversation(rng, name, conv)
        for gen in (True, False):
            expected = cf.hf_ids(tok, messages, add_generation_prompt=gen, tools=tools, **kwargs)
            assert renderer.render_ids(messages, add_generation_prompt=gen, tools=tools) == expected
            rendered = renderer.render_with_roles(messages, add_generation_prompt=gen, tools=tools)
            assert rendered.ids == expected


EDGE_QWEN = [
    [{"role": "user", "content": "say <|im_end|> and <think>x</think> literally"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [
        {"role": "user", "content": "\n\n  q \n"},
        {"role": "assistant", "content": "\n<think>\nr\n</think>\n\nA"},
    ],
    [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>r</think>A"},
        {"role": "user", "content": "<tool_response>not a query</tool_response>"},
    ],
    [
        {"role": "system", "content": "s1"},
        {"role": "user", "content": "q"},
        {"role": "system", "content": "s2"},
    ],
    [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "\n\nplan\n",
            "tool_calls": [{"name": "f", "arguments": '{"raw": "string args"}'}],
        },
        {"role": "tool", "content": "ünï 東京 🙂"},
        {"role": "tool", "content": ""},
        {"role": "assistant", "content": "done", "reasoning_content": ""},
    ],
    [{"role": "tool", "content": "a tool result first"}, {"role": "user", "content": "q"}],
]


@pytest.mark.parametrize("name", ["chatml", "qwen2.5", "qwen3", "qwen3-nothink", "generic-qwen3"])
@pytest.mark.parametrize("case", range(len(EDGE_QWEN)))
def test_edge_cases_qwen_family(toks, name, case):
    tok, renderer, kwargs, _ = build(toks, name)
    messages = EDGE_QWEN[case]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for gen in (True, False):
        expected = cf.hf_ids(tok, messages, add_generation_prompt=gen, tools=tools, **kwargs)
        assert renderer.render_ids(messages, add_generation_prompt=gen, tools=tools) == expected


def test_qwen25_quotes_string_arguments_qwen3_inserts_them_raw(toks):
    messages = EDGE_QWEN[5]
    q25 = Qwen25Renderer(toks["qwen2.5"]).decode(
        Qwen25Renderer(toks["qwen2.5"]).render_ids(messages, add_generation_prompt=False)
    )
    q3 = Qwen3Renderer(toks["qwen3"]).decode(
        Qwen3Renderer(toks["qwen3"]).render_ids(messages, add_generation_prompt=False)
    )
    assert '"arguments": "{\\"raw\\": \\"string args\\"}"}' in q25
    assert '"arguments": {"raw": "string args"}}' in q3


def test_qwen3_all_retention_keeps_reasoning_the_template_drops(toks):
    tok = toks["qwen3"]
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "old thought"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "new thought"},
    ]
    template = tok.decode(cf.hf_ids(tok, messages, add_generation_prompt=False))
    assert "old thought" not in template and "new thought" in template
    r_all = Qwen3Renderer(tok, retention="all")
    text = r_all.decode(r_all.render_ids(messages, add_generation_prompt=False))
    assert "<|im_start|>assistant\n<think>\nold thought\n</think>\n\na1<|im_end|>" in text
    assert text.replace("<think>\nold thought\n</think>\n\n", "") == template
    # no reasoning before the last query: "all" equals the template
    rng = random.Random(5)
    for _ in range(15):
        messages, tools = cf.random_conversation(rng, reasoning="never")
        for gen in (True, False):
            assert r_all.render_ids(messages, add_generation_prompt=gen, tools=tools) == cf.hf_ids(
                tok, messages, add_generation_prompt=gen, tools=tools
            )


def test_llama3_tool_content_types_and_errors(toks):
    tok = toks["llama3.1"]
    r = Llama3Renderer(tok)
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [cf.random_call(random.Random(0))]},
        {"role": "tool", "content": {"temp": 21, "unit": "C"}},
        {"role": "ipython", "content": ["a", 1]},
        {"role": "tool", "content": 42},
    ]
    tools = cf.random_tools(random.Random(1))
    assert r.render_ids(messages, add_generation_prompt=True, tools=tools) == cf.hf_ids(
        tok, messages, add_generation_prompt=True, tools=tools
    )
    two_calls = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [cf.random_call(random.Random(0))] * 2},
    ]
    with pytest.raises(ValueError, match="exactly one tool call"):
        r.render_ids(two_calls, add_generation_prompt=False)
    with pytest.raises(ValueError, match="first user message"):
        r.render_ids([{"role": "system", "content": "s"}], add_generation_prompt=False, tools=tools)
    with pytest.raises(ValueError, match="Llama 3.1"):
        Llama3Renderer(tok, system_preamble=False).render_ids(
            messages[:1], add_generation_prompt=False, tools=tools
        )


def test_clear_errors(toks):
    r = ChatMLRenderer(toks["chatml"])
    with pytest.raises(ValueError, match="empty"):
        r.render_ids([], add_generation_prompt=True)
    with pytest.raises(ValueError, match="string 'role'"):
        r.render_ids([{"content": "x"}], add_generation_prompt=True)
    with pytest.raises(ValueError, match="must be a string"):
        r.render_ids(
            [{"role": "user", "content": [{"type": "text", "text": "x"}]}], add_generation_prompt=True
        )
    with pytest.raises(ValueError, match="role 'developer'"):
        r.render_ids([{"role": "developer", "content": "x"}], add_generation_prompt=True)
    with pytest.raises(ValueError, match="no added token '<\\|begin_of_text\\|>'"):
        Llama3Renderer(toks["chatml"])
    with pytest.raises(ValueError, match="retention"):
        Qwen3Renderer(toks["qwen3"], retention="some")
    with pytest.raises(ValueError, match="unknown renderer"):
        make_renderer("nope", toks["chatml"])
    tok = toks["chatml"]
    template, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(ValueError, match="no chat_template"):
            GenericRenderer(tok)
    finally:
        tok.chat_template = template


def test_tools_as_python_functions(toks):
    def get_weather(city: str) -> str:
        """Gets the weather.

        Args:
            city: the city name
        """
        return city

    tok = toks["qwen3"]
    messages = [{"role": "user", "content": "q"}]
    assert Qwen3Renderer(tok).render_ids(
        messages, add_generation_prompt=True, tools=[get_weather]
    ) == cf.hf_ids(tok, messages, add_generation_prompt=True, tools=[get_weather])


# -- role attribution ----------------------------------------------------------------------------------
def expected_body(name, message):
    if "llama3.1" in name and message["role"] == "tool":
        return json.dumps(message["content"], ensure_ascii=False)
    return message["content"]


def clean_conversation(rng, name):
    """Messages whose bodies end in a word character, so no BPE token straddles a body boundary."""
    messages, tools = cf.random_conversation(rng, max_calls=1 if "llama" in name else 2)
    for m in messages:
        if m["role"] in ("user", "system", "tool"):
            m["content"] = cf.clean_text(rng) + " end"
    if "llama3" in name and "3.1" not in name:
        messages = [
            m for m in messages if m["role"] in ("user", "system", "assistant") and "tool_calls" not in m
        ]
        tools = None
    return messages, tools


@pytest.mark.parametrize(
    "name",
    [
        "chatml",
        "qwen2.5",
        "qwen3",
        "llama3.1",
        "llama3",
        "generic-chatml",
        "generic-qwen2.5",
        "generic-llama3.1",
    ],
)
def test_role_attribution(toks, name):
    tok, renderer, _, _ = build(toks, name)
    special_ids = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    rng = random.Random(11)
    for _ in range(15):
        messages, tools = clean_conversation(rng, name)
        r = renderer.render_with_roles(messages, add_generation_prompt=True, tools=tools)
        for i, m in enumerate(messages):
            assert all(r.roles[t] == m["role"] for t in range(len(r)) if r.message_indices[t] == i)
            if m["role"] in ("user", "tool") or (m["role"] == "system" and i == 0):
                body = [r.ids[t] for t in range(len(r)) if r.message_indices[t] == i and r.is_body[t]]
                assert tok.decode(body) == expected_body(name, m), (i, m)
        assert not any(r.is_body[t] for t in range(len(r)) if r.ids[t] in special_ids)
        tool_text = tok.decode([t for t, k in zip(r.ids, r.mask(roles={"tool"}), strict=True) if k])
        assert tool_text == "".join(expected_body(name, m) for m in messages if m["role"] == "tool")
        # the generation prompt belongs to no message, with role assistant
        assert r.message_indices[-1] is None and r.roles[-1] == "assistant" and not r.is_body[-1]


def test_generic_attribution_matches_format_renderer(toks):
    rng = random.Random(3)
    for key, cls in (("chatml", ChatMLRenderer), ("qwen2.5", Qwen25Renderer)):
        a, b = cls(toks[key]), GenericRenderer(toks[key])
        for _ in range(10):
            messages, tools = clean_conversation(rng, key)
            ra = a.render_with_roles(messages, add_generation_prompt=True, tools=tools)
            rb = b.render_with_roles(messages, add_generation_prompt=True, tools=tools)
            assert ra.ids == rb.ids
            for t in range(len(ra)):
                if ra.message_indices[t] is not None:
                    assert (ra.message_indices[t], ra.roles[t]) == (rb.message_indices[t], rb.roles[t])
                    if ra.roles[t] in ("user", "tool"):
                        assert ra.is_body[t] == rb.is_body[t]


def test_token_straddling_a_body_boundary_counts_as_body(toks):
    tok = toks["chatml"]
    r = ChatMLRenderer(tok)
    # "!\n" is one pre-token in the Qwen regex, so "ok!" + "\n</tool_response>" shares a token
    messages = [{"role": "user", "content": "q"}, {"role": "tool", "content": "ok!"}]
    rendered = r.render_with_roles(messages, add_generation_prompt=False)
    body = tok.decode(
        [
            i
            for i, b, k in zip(rendered.ids, rendered.is_body, rendered.message_indices, strict=True)
            if b and k == 1
        ]
    )
    assert body.startswith("ok!") and body in ("ok!", "ok!\n")


# -- piecewise tokenization -------------------------------------------------------------------------
BOUNDARY_TEXTS = ["\n\nhello", "hello\n\n", " {", "!\n", "  ", "\t\n ", "é", "🙂x", "42", "a'll", "\r\n"]


@settings(max_examples=80, deadline=None)
@given(
    parts=st.lists(st.sampled_from(BOUNDARY_TEXTS + ["<|im_end|>", "<|im_start|>", "<think>"]), max_size=10)
)
def test_encode_pieces_equals_whole_string_tokenization(toks, parts):
    tok = toks["chatml"]
    specials = {
        "<|im_start|>": tok.convert_tokens_to_ids("<|im_start|>"),
        "<|im_end|>": tok.convert_tokens_to_ids("<|im_end|>"),
    }
    pieces = [Piece(p, "user", 0, special=p in specials) for p in parts]
    rendered = encode_pieces(tok, pieces, specials)
    assert rendered.ids == tok("".join(parts), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("long", [False, True], ids=["one-by-one", "batch"])
@pytest.mark.parametrize("state", ["plain", "truncation", "split_special_tokens"])
def test_encode_pieces_fast_path_equals_the_tokenizer_call(toks, state, long):
    """encode_pieces calls the Rust tokenizer directly only when that equals calling the HF
    tokenizer (no truncation / padding set on it, same split_special_tokens); otherwise the HF
    call (which resets those settings first). Either way: the ids and offsets of the HF call."""
    tok = toks["chatml"]
    texts = [*BOUNDARY_TEXTS, "user\nWhat is <think> 2+2?", "x" * 50]
    if long:  # past _PARALLEL_ENCODE_CHARS: encode_batch
        texts.append("lorem ipsum <|im_end|> dolor\n\n" * 200)
    want = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    backend = tok.backend_tokenizer
    try:
        if state == "truncation":
            backend.enable_truncation(max_length=3)
        elif state == "split_special_tokens":
            backend.encode_special_tokens = True  # the HF call sets it back to tok.split_special_tokens
        got = _encode_texts(tok, texts)
    finally:
        backend.no_truncation()
        backend.encode_special_tokens = tok.split_special_tokens
    assert [list(ids) for ids, _ in got] == [list(ids) for ids in want["input_ids"]]
    want_offsets = [list(map(tuple, offs)) for offs in want["offset_mapping"]]
    assert [list(map(tuple, offs)) for _, offs in got] == want_offsets


def test_cached_text_encodings_render_the_same_ids(toks, monkeypatch):
    """A renderer caches the encodings of short texts (template scaffolding); renders that hit the
    cache, and renders once the cache is full, equal apply_chat_template."""
    monkeypatch.setattr(base_module, "_CACHED_TEXTS", 6)
    tok = toks["chatml"]
    r = ChatMLRenderer(tok)
    convs = [
        [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]
        for text in [*BOUNDARY_TEXTS, "x" * 100]
    ]
    for _ in range(2):
        for messages in convs:
            for gen in (False, True):
                want = cf.hf_ids(tok, messages, add_generation_prompt=gen)
                assert r.render_ids(messages, add_generation_prompt=gen) == want
    assert 0 < len(r._encoded) <= 6
    assert all(len(text) <= base_module._CACHED_TEXT_CHARS for text in r._encoded)


def test_naive_piecewise_tokenization_would_differ(toks):
    """Why text runs are tokenized whole: splitting at a non-special boundary changes merges."""
    tok = toks["chatml"]
    a, b = "user\n", "\nhello"
    whole = tok(a + b, add_special_tokens=False)["input_ids"]
    naive = tok(a, add_special_tokens=False)["input_ids"] + tok(b, add_special_tokens=False)["input_ids"]
    assert naive != whole
    r = ChatMLRenderer(tok)
    ids = r.render_ids([{"role": "user", "content": "\nhello"}], add_generation_prompt=False)
    assert ids == cf.hf_ids(tok, [{"role": "user", "content": "\nhello"}], add_generation_prompt=False)


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(list(" \n\t\r!?.{}\"'é東🙂aZ09_<>|/") + ["<|im_end|>", "\n\n"]), max_size=20
    )
)
def test_hypothesis_content_chatml_and_llama(toks, parts):
    content = "".join(parts)
    for key, renderer in (
        ("chatml", ChatMLRenderer(toks["chatml"])),
        ("llama3.1", Llama3Renderer(toks["llama3.1"])),
    ):
        messages = [
            {"role": "system", "content": content},
            {"role": "user", "content": content},
            {"role": "assistant", "content": content},
            {"role": "tool", "content": content},
        ]
        assert renderer.render_ids(messages, add_generation_prompt=True) == cf.hf_ids(
            toks[key], messages, add_generation_prompt=True
        )
