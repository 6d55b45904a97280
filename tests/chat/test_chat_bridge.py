"""bridge(): exact prefix, equality with a full template render, and every None case."""

import collections
import json
import random

import chat_fixtures as cf
import pytest

from rljax.chat import (
    ChatMLRenderer,
    GenericRenderer,
    Llama3Renderer,
    Qwen3Renderer,
    Qwen25Renderer,
    SmolLM2Renderer,
)

# name -> (tokenizer key, factory, template kwargs, end-of-turn token, conversation kwargs, policy)
# policy: "always" = bridged whenever the completion ends with end-of-turn; "no_query" = and no new
# user query arrives; "never".
Q = dict(max_calls=2)
L = dict(max_calls=1, dict_tool_content=True)
P = dict(tools_ok=False)
BRIDGE_CONFIGS = {
    "chatml": ("chatml", ChatMLRenderer, {}, "<|im_end|>", Q, "always"),
    "qwen2.5": ("qwen2.5", Qwen25Renderer, {}, "<|im_end|>", Q, "always"),
    "qwen3": ("qwen3", Qwen3Renderer, {}, "<|im_end|>", Q, "no_query"),
    "qwen3-template": (
        "qwen3",
        lambda t: Qwen3Renderer(t, retention="template"),
        {},
        "<|im_end|>",
        Q,
        "no_query",
    ),
    "llama3.1": ("llama3.1", Llama3Renderer, {}, "<|eot_id|>", L, "always"),
    "llama3": ("llama3", lambda t: Llama3Renderer(t, system_preamble=False), {}, "<|eot_id|>", P, "always"),
    "smollm2-tools": ("smollm2-tools", SmolLM2Renderer, {}, "<|im_end|>", Q, "always"),
    "generic-chatml": ("chatml", GenericRenderer, {}, "<|im_end|>", Q, "always"),
    "generic-qwen2.5": ("qwen2.5", GenericRenderer, {}, "<|im_end|>", Q, "always"),
    "generic-qwen3": ("qwen3", GenericRenderer, {}, "<|im_end|>", Q, "no_query"),
    "generic-llama3.1": (
        "llama3.1",
        lambda t: GenericRenderer(t, tool_parser="llama3_json"),
        {},
        "<|eot_id|>",
        L,
        "always",
    ),
    "generic-llama3": ("llama3", GenericRenderer, {}, "<|eot_id|>", P, "always"),
    "generic-gemma": ("gemma", GenericRenderer, {}, "<end_of_turn>", P, "always"),
}


def make(toks, name):
    key, factory, kwargs, eot, conv, policy = BRIDGE_CONFIGS[name]
    return toks[key], factory(toks[key]), kwargs, eot, conv, policy


def history_for(rng, name, conv):
    messages, tools = cf.random_conversation(rng, end_with_assistant=False, reasoning="always", **conv)
    if name == "generic-gemma":
        messages = [m for m in messages if m["role"] != "system"] or [{"role": "user", "content": "q"}]
    return messages, tools


@pytest.mark.parametrize("name", sorted(BRIDGE_CONFIGS))
def test_bridge_extends_exactly_and_equals_full_render(toks, name):
    tok, renderer, kwargs, eot, conv, policy = make(toks, name)
    rng = random.Random(sum(map(ord, name)))
    n_bridged = 0
    for _ in range(16):
        history, tools = history_for(rng, name, conv)
        calls = rng.randint(1, conv.get("max_calls", 1)) if tools and rng.random() < 0.75 else 0
        assistant = cf.random_assistant(rng, calls=calls, reasoning="always")
        completion = cf.canonical_completion(tok, history, assistant, end_of_turn=eot, tools=tools, **kwargs)
        prompt = renderer.render_ids(history, add_generation_prompt=True, tools=tools)
        parsed = renderer.parse_response(completion)
        new = cf.env_messages(rng, parsed, dict_tool_content=conv.get("dict_tool_content", False))
        bridged = renderer.bridge(prompt, completion, new, tools=tools)
        has_query = any(cf.is_query(m) for m in new)
        expect = policy == "always" or (policy == "no_query" and not has_query)
        assert (bridged is not None) == expect, (new, policy)
        if bridged is None:
            continue
        n_bridged += 1
        assert bridged[: len(prompt) + len(completion)] == prompt + completion
        conversation = [*history, parsed.to_message(), *new]
        cf.assert_bridge_matches_template(
            tok, bridged, len(prompt) + len(completion), conversation, tools=tools, **kwargs
        )
        suffix = renderer.bridge_with_roles(prompt, completion, new, tools=tools)
        assert bridged == prompt + completion + suffix.ids
    assert n_bridged >= 4


# Open turns: every format above, plus SmolLM2's ChatML with its own default system prompt.
OPEN_CONFIGS = {
    **BRIDGE_CONFIGS,
    "smollm2": ("smollm2", SmolLM2Renderer, {}, "<|im_end|>", P, "always"),
}


def open_turns(rng, ids, other_stops):
    """Ways a turn ends without the end-of-turn token, from the ids of its whole text: cut by
    ``max_tokens`` at a random length, cut right before the end-of-turn token, ended by a
    single-token stop string the client asked for (it stays in the content), ended by another stop
    token of the format."""
    out = [("cut", ids[: rng.randint(1, len(ids) - 1)]), ("whole", ids)] if len(ids) > 1 else []
    out.append(("stop string", [*ids, rng.choice(ids)]))
    out += [("other stop", [*ids, stop]) for stop in other_stops]
    return out


@pytest.mark.parametrize("name", sorted(OPEN_CONFIGS))
def test_open_turns_are_bridged_exactly_where_the_full_render_agrees(toks, name):
    """An open turn is bridged where the template's text of the history (the reply as the client
    holds it: parsed from the ids) starts with the text of the prompt and the sampled ids; the
    bridged ids then spell that text, keep the sampled ids, and equal the template's own ids
    wherever those continue the sampled ids."""
    key, factory, kwargs, eot, conv, _ = OPEN_CONFIGS[name]
    tok, renderer = toks[key], factory(toks[key])
    eot_id = tok.convert_tokens_to_ids(eot)
    other_stops = [s for s in renderer.stop_token_ids() if s != eot_id]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    rng = random.Random(sum(map(ord, name)) + 3)
    counts, closings = {}, collections.Counter()
    for _ in range(12):
        history, tools = history_for(rng, name, conv)
        calls = rng.randint(1, conv.get("max_calls", 1)) if tools and rng.random() < 0.5 else 0
        qwen3 = "qwen3" in name  # a thinking model: reasoning first, kept while tool results come
        assistant = cf.random_assistant(rng, calls=calls, reasoning="always" if qwen3 else "random")
        whole = cf.canonical_completion(tok, history, assistant, end_of_turn=eot, tools=tools, **kwargs)[:-1]
        if not whole:
            continue
        prompt = renderer.render_ids(history, add_generation_prompt=True, tools=tools)
        for kind, completion in open_turns(rng, whole, other_stops):
            reply = renderer.parse_response(completion).to_message()  # what the client holds
            new = cf.env_messages(rng, renderer.parse_response(completion))
            if name == "llama3.1":  # the reference template renders one tool call per turn
                new = [m for m in new if m["role"] != "tool"] or [{"role": "user", "content": "go on"}]
            if qwen3:  # (a user query drops the reasoning: tested in the agent loop)
                new = [m for m in new if m["role"] == "tool"] or [{"role": "tool", "content": "done"}]
            conversation = [*history, reply, *new]
            reference = cf.hf_ids(tok, conversation, add_generation_prompt=True, tools=tools, **kwargs)
            text = cf.hf_text(tok, conversation, add_generation_prompt=True, tools=tools, **kwargs)
            n = len(prompt) + len(completion)
            same_ids = reference[:n] == prompt + completion
            agrees = text.startswith(decode(prompt + completion))
            if name == "generic-qwen3":  # the fixed-base method refuses where a user query may rewrite
                agrees &= not any(cf.is_query(m) for m in new)
            bridged = renderer.bridge(prompt, completion, new, tools=tools)
            assert (bridged is not None) == agrees, (kind, completion, new)
            done, total = counts.get(kind, (0, 0))
            counts[kind] = (done + (bridged is not None), total + 1)
            counts["ids agree"] = counts.get("ids agree", 0) + (same_ids and agrees)
            if bridged is None:
                continue
            assert bridged[:n] == prompt + completion and decode(bridged) == text
            if same_ids:
                assert bridged == reference  # token for token the template's render of the history
            suffix = renderer.bridge_with_roles(prompt, completion, new, tools=tools, reply=reply)
            assert bridged == prompt + completion + suffix.ids
            # the template's closing of the turn (not sampled) comes first: the end-of-turn token
            # and what the template writes around it; it belongs to no new message and is no body
            first = suffix.message_indices.index(0)
            assert eot_id in suffix.ids[:first]
            assert set(suffix.message_indices[:first]) == {None} and not any(suffix.is_body[:first])
            closings[renderer.decode(suffix.ids[: suffix.ids.index(eot_id) + 1])] += 1
    print(name, counts, dict(closings))
    assert counts.get("other stop", (0, 0))[0] == 0  # the template never writes another stop token
    assert counts["whole"][0] >= 4 and counts["cut"][0] >= 2, counts


def qwen3_prompt_and_completion(tok, renderer, completion_text):
    history = [{"role": "user", "content": "q"}]
    prompt = renderer.render_ids(history, add_generation_prompt=True)
    completion = tok.encode(completion_text, add_special_tokens=False) + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    return history, prompt, completion


def test_qwen3_retention_policies(toks):
    tok = toks["qwen3"]
    tool = [{"role": "tool", "content": "r"}]
    user = [{"role": "user", "content": "next question"}]
    wrapped = [{"role": "user", "content": "<tool_response>\nr\n</tool_response>"}]  # not a query
    think = "<think>\nplan\n</think>\n\nanswer"
    empty = "<think>\n\n</think>\n\nanswer"
    cases = {
        # retention: {(completion, new): bridged?}
        "all": {
            (think, "tool"): True,
            (think, "user"): True,
            (empty, "tool"): True,
            ("answer", "user"): True,
        },
        "tool_cycle": {
            (think, "tool"): True,
            (think, "user"): False,
            (think, "wrapped"): True,
            (empty, "tool"): True,
            ("answer", "user"): True,
        },
        "template": {
            (think, "tool"): True,
            (think, "user"): False,
            (think, "wrapped"): True,
            (empty, "tool"): False,
            ("answer", "user"): True,
            ("answer", "tool"): True,
        },
    }
    news = {"tool": tool, "user": user, "wrapped": wrapped}
    for retention, table in cases.items():
        renderer = Qwen3Renderer(tok, retention=retention)
        for (text, kind), expected in table.items():
            history, prompt, completion = qwen3_prompt_and_completion(tok, renderer, text)
            bridged = renderer.bridge(prompt, completion, news[kind])
            assert (bridged is not None) == expected, (retention, text, kind)
            if bridged is None:
                continue
            assert bridged[: len(prompt) + len(completion)] == prompt + completion
            full = [*history, renderer.parse_response(completion).to_message(), *news[kind]]
            reference = cf.hf_ids(tok, full, add_generation_prompt=True)
            # where the template re-renders history differently, only "all"/"tool_cycle" bridge
            if retention == "template" or (text == think and kind != "user"):
                assert bridged == reference
            else:
                assert bridged != reference or text == "answer"


def test_qwen3_template_retention_refuses_unprovable_histories(toks):
    tok = toks["qwen3"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    tool = [{"role": "tool", "content": "r"}]
    completion = tok.encode("<think>\nplan\n</think>\n\nok", add_special_tokens=False) + [eot]
    strict, loose = Qwen3Renderer(tok, retention="template"), Qwen3Renderer(tok)
    # no user query in the history: the template would drop the reasoning
    no_query = [{"role": "system", "content": "s"}]
    prompt = strict.render_ids(no_query, add_generation_prompt=True)
    assert strict.bridge(prompt, completion, tool) is None
    assert loose.bridge(prompt, completion, tool) is not None
    # an assistant turn right before the generation prompt (it stops being the last message)
    ends_with_assistant = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    prompt = strict.render_ids(ends_with_assistant, add_generation_prompt=True)
    assert strict.bridge(prompt, completion, tool) is None
    # enable_thinking=False puts an empty think block in the generation prompt
    nothink = Qwen3Renderer(tok, retention="template", enable_thinking=False)
    prompt = nothink.render_ids([{"role": "user", "content": "q"}], add_generation_prompt=True)
    assert nothink.bridge(prompt, tok.encode("ok", add_special_tokens=False) + [eot], tool) is None
    loose_nothink = Qwen3Renderer(tok, enable_thinking=False)
    assert loose_nothink.bridge(prompt, tok.encode("ok", add_special_tokens=False) + [eot], tool) is not None


def test_generic_refuses_templates_that_rewrite_history(toks):
    tok = toks["counting"]
    renderer = GenericRenderer(tok)
    history = [{"role": "user", "content": "q"}]
    prompt = renderer.render_ids(history, add_generation_prompt=True)
    assert prompt == cf.hf_ids(tok, history, add_generation_prompt=True)
    completion = tok.encode("a", add_special_tokens=False) + renderer.stop_token_ids()[:1]
    assert renderer.bridge(prompt, completion, [{"role": "user", "content": "n"}]) is None


def test_generic_gemma_uses_the_base_without_system(toks):
    tok = toks["gemma"]
    renderer = GenericRenderer(tok)
    assert renderer.stop_token_ids() == [
        tok.convert_tokens_to_ids("<end_of_turn>"),
        tok.convert_tokens_to_ids("<eos>"),
    ]
    history = [{"role": "user", "content": "q"}]
    prompt = renderer.render_ids(history, add_generation_prompt=True)
    completion = tok.encode("hi there", add_special_tokens=False) + renderer.stop_token_ids()[:1]
    new = [{"role": "user", "content": "more"}]
    bridged = renderer.bridge(prompt, completion, new)
    full = [*history, {"role": "assistant", "content": "hi there"}, *new]
    assert bridged == cf.hf_ids(tok, full, add_generation_prompt=True)


@pytest.mark.parametrize("name", ["chatml", "qwen3", "llama3.1", "generic-chatml", "generic-llama3.1"])
def test_bridge_roles_of_the_appended_ids(toks, name):
    tok, renderer, kwargs, eot, conv, _ = make(toks, name)
    rng = random.Random(7)
    for _ in range(8):
        history, tools = history_for(rng, name, conv)
        assistant = cf.random_assistant(rng, reasoning="always")
        completion = cf.canonical_completion(tok, history, assistant, end_of_turn=eot, tools=tools, **kwargs)
        prompt = renderer.render_ids(history, add_generation_prompt=True, tools=tools)
        new = [{"role": "tool", "content": cf.clean_text(rng) + " end"} for _ in range(rng.randint(1, 2))]
        new.append({"role": "user", "content": cf.clean_text(rng) + " end"})
        if name.startswith("qwen3"):
            new = new[:-1]
        suffix = renderer.bridge_with_roles(prompt, completion, new, tools=tools)
        for i, m in enumerate(new):
            assert {suffix.roles[t] for t in range(len(suffix)) if suffix.message_indices[t] == i} == {
                m["role"]
            }
            body = tok.decode(
                [
                    t
                    for t, b, k in zip(suffix.ids, suffix.is_body, suffix.message_indices, strict=True)
                    if b and k == i
                ]
            )
            expected = m["content"]
            if "llama3.1" in name and m["role"] == "tool":
                expected = json.dumps(expected, ensure_ascii=False)
            assert body == expected
        # the generation prompt closes the suffix and belongs to no message
        assert suffix.message_indices[-1] is None and suffix.roles[-1] == "assistant"
        # tokens before the first new message continue the previous (assistant) turn
        first = suffix.message_indices.index(0)
        assert all(k is None for k in suffix.message_indices[:first])


def test_bridge_with_no_new_messages(toks):
    tok = toks["chatml"]
    renderer = ChatMLRenderer(tok)
    prompt = renderer.render_ids([{"role": "user", "content": "q"}], add_generation_prompt=True)
    completion = tok.encode("a", add_special_tokens=False) + renderer.stop_token_ids()[:1]
    bridged = renderer.bridge(prompt, completion, [])
    assert tok.decode(bridged[len(prompt) + len(completion) :]) == "\n<|im_start|>assistant\n"
