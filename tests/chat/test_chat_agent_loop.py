"""Simulated agent loops: the ids a trainer sees are exactly the ids that were sampled.

Each episode runs a ChatSession for 2-5 turns. Completions are either canonical (the template's
own text for a random assistant message, tokenized as a model would sample it) or random
ordinary token ids, ending with the end-of-turn token, another stop token, or nothing
(truncated). The environment answers tool calls with tool results, else with a user turn.
Checks per turn: when bridged, the next prompt starts with prompt + completion exactly and (for
canonical histories) spells the template's rendering; when not, it is the template's full
render; bridging happens exactly when the format allows it (after a turn not closed by the
end-of-turn token: where the template's text of the history continues the sampled ids' text).
Per episode: the reference prefix merge turns the steps into samples whose trainable tokens are
exactly the sampled completions.
"""

import random

import chat_fixtures as cf
import pytest

from rljax.chat import (
    ChatMLRenderer,
    ChatSession,
    GenericRenderer,
    Llama3Renderer,
    Qwen3Renderer,
    Qwen25Renderer,
)

Q = dict(max_calls=2)
L = dict(max_calls=1, dict_tool_content=True)
P = dict(tools_ok=False)
NOTHINK = {"enable_thinking": False}
# name -> (tokenizer key, factory, template kwargs, end-of-turn, conversation kwargs, policy, reference)
LOOPS = {
    "chatml": ("chatml", ChatMLRenderer, {}, "<|im_end|>", Q, "always", "template"),
    "qwen2.5": ("qwen2.5", Qwen25Renderer, {}, "<|im_end|>", Q, "always", "template"),
    "qwen3": ("qwen3", Qwen3Renderer, {}, "<|im_end|>", Q, "no_think_query", "template"),
    "qwen3-template": (
        "qwen3",
        lambda t: Qwen3Renderer(t, retention="template"),
        {},
        "<|im_end|>",
        Q,
        "no_think_query",
        "template",
    ),
    "qwen3-all": (
        "qwen3",
        lambda t: Qwen3Renderer(t, retention="all"),
        {},
        "<|im_end|>",
        Q,
        "always",
        "self",
    ),
    "qwen3-nothink": (
        "qwen3",
        lambda t: Qwen3Renderer(t, enable_thinking=False),
        NOTHINK,
        "<|im_end|>",
        Q,
        "no_think_query",
        None,
    ),
    "qwen3-nothink-template": (
        "qwen3",
        lambda t: Qwen3Renderer(t, retention="template", enable_thinking=False),
        NOTHINK,
        "<|im_end|>",
        Q,
        "never",
        "template",
    ),
    "llama3.1": ("llama3.1", Llama3Renderer, {}, "<|eot_id|>", L, "always", "template"),
    "llama3": (
        "llama3",
        lambda t: Llama3Renderer(t, system_preamble=False),
        {},
        "<|eot_id|>",
        P,
        "always",
        "template",
    ),
    "generic-chatml": ("chatml", GenericRenderer, {}, "<|im_end|>", Q, "always", "template"),
    "generic-qwen3": ("qwen3", GenericRenderer, {}, "<|im_end|>", Q, "no_query", "template"),
    "generic-llama3.1": (
        "llama3.1",
        lambda t: GenericRenderer(t, tool_parser="llama3_json"),
        {},
        "<|eot_id|>",
        L,
        "always",
        "template",
    ),
    "generic-gemma": ("gemma", GenericRenderer, {}, "<end_of_turn>", P, "always", "template"),
    "generic-counting": ("counting", GenericRenderer, {}, "<|im_end|>", P, "never", "template"),
}


def expected_bridge(policy, tok, eot_id, prompt, completion, new):
    stop = bool(completion) and completion[-1] == eot_id
    query = any(cf.is_query(m) for m in new)
    if policy == "always":
        return stop
    if policy == "never":
        return False
    if policy == "no_query":
        return stop and not query
    history = tok.decode(prompt + completion, skip_special_tokens=False)
    return stop and not (query and "</think>" in history)


def initial_messages(rng, name, conv):
    messages = []
    if rng.random() < 0.5 and name != "generic-gemma":
        messages.append({"role": "system", "content": cf.random_text(rng)})
    messages.append({"role": "user", "content": cf.random_text(rng)})
    tools = cf.random_tools(rng) if conv.get("tools_ok", True) and rng.random() < 0.8 else None
    return messages, tools


def sample_completion(rng, tok, session, name, eot, conv, kwargs, plain, other_stops):
    """Returns (completion ids, canonical?)."""
    if name != "generic-counting" and rng.random() < 0.6:
        calls = rng.randint(1, conv.get("max_calls", 1)) if session.tools and rng.random() < 0.6 else 0
        reasoning = "never" if kwargs.get("enable_thinking") is False else "always"
        assistant = cf.random_assistant(rng, calls=calls, reasoning=reasoning)
        return cf.canonical_completion(
            tok, session.messages, assistant, end_of_turn=eot, tools=session.tools, **kwargs
        ), True
    ids = [rng.choice(plain) for _ in range(rng.randint(0, 12))]
    r = rng.random()
    if r < 0.75:
        ids.append(tok.convert_tokens_to_ids(eot))
    elif r < 0.87 and other_stops:
        ids.append(rng.choice(other_stops))
    return ids, False


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_agent_loop_zero_drift(toks, name):
    key, factory, kwargs, eot, conv, policy, reference = LOOPS[name]
    tok = toks[key]
    renderer = factory(tok)
    if isinstance(renderer, GenericRenderer):
        renderer.template_kwargs.update(kwargs)
    eot_id = tok.convert_tokens_to_ids(eot)
    other_stops = [s for s in renderer.stop_token_ids() if s != eot_id]
    plain = cf.plain_ids(tok)
    rng = random.Random(sum(map(ord, name)) + 1)
    n_bridged = n_turns = n_open = n_open_bridged = 0
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def reference_ids(messages):
        if reference == "self":
            return renderer.render_ids(messages, add_generation_prompt=True, tools=tools)
        return cf.hf_ids(tok, messages, add_generation_prompt=True, tools=tools, **kwargs)

    for _ in range(20):
        messages, tools = initial_messages(rng, name, conv)
        session = ChatSession(renderer, messages, tools=tools)
        assert session.prompt_ids == cf.hf_ids(
            tok, messages, add_generation_prompt=True, tools=tools, **kwargs
        )
        steps, canonical_so_far, bridged_flags = [], True, []
        for _ in range(rng.randint(2, 5)):
            prompt = list(session.prompt_ids)
            completion, canonical = sample_completion(
                rng, tok, session, name, eot, conv, kwargs, plain, other_stops
            )
            canonical_so_far &= canonical
            in_sync = prompt == reference_ids(session.messages)  # the prompt is the full render
            parsed = session.add_completion(completion)
            steps.append((prompt, list(completion)))
            new = cf.env_messages(rng, parsed, dict_tool_content=conv.get("dict_tool_content", False))
            session.add_messages(new)
            assert len(session.full_prompt_roles) == len(session.prompt_ids)  # one role per prompt id
            n_turns += 1
            bridged_flags.append(session.bridged)
            if completion and completion[-1] == eot_id:
                assert session.bridged == expected_bridge(policy, tok, eot_id, prompt, completion, new)
            else:  # an open turn: bridged exactly where the full render's text continues the
                # sampled ids' text (the reply as the session holds it: parsed from the ids)
                n_open += 1
                full = reference_ids(session.messages)
                n = len(prompt) + len(completion)
                if in_sync:
                    agrees = (
                        policy != "never"
                        and bool(completion)
                        and decode(full).startswith(decode(prompt + completion))
                    )
                    if policy == "no_query":  # the fixed-base method refuses where a query may rewrite
                        agrees &= not any(cf.is_query(m) for m in new)
                    assert session.bridged == agrees
                if session.bridged:
                    n_open_bridged += 1
                    suffix = session.prompt_roles  # the template's closing of the turn comes first
                    first = suffix.message_indices.index(0)
                    assert eot_id in suffix.ids[:first] and set(suffix.message_indices[:first]) == {None}
                    if (
                        in_sync
                    ):  # the full render's text, and its very ids where they continue the sampled ids
                        assert decode(session.prompt_ids) == decode(full)
                        assert (session.prompt_ids == full) == (full[:n] == prompt + completion)
            if session.bridged:
                n_bridged += 1
                assert session.prompt_ids[: len(prompt) + len(completion)] == prompt + completion
                assert session.full_prompt_roles[len(prompt) : len(prompt) + len(completion)] == (
                    ["assistant"] * len(completion)
                )
                assert session.prompt_ids == prompt + completion + session.prompt_roles.ids
                if canonical_so_far and reference == "template":
                    cf.assert_bridge_matches_template(
                        tok,
                        session.prompt_ids,
                        len(prompt) + len(completion),
                        session.messages,
                        tools=tools,
                        **kwargs,
                    )
                if canonical_so_far and reference == "self":
                    own = renderer.render_ids(session.messages, add_generation_prompt=True, tools=tools)
                    assert renderer.decode(session.prompt_ids) == renderer.decode(own)
            else:
                if reference == "template" or policy != "always":
                    expected = cf.hf_ids(
                        tok, session.messages, add_generation_prompt=True, tools=tools, **kwargs
                    )
                    assert session.prompt_ids == expected
        # zero drift: what the trainer trains on (after prefix merging) is exactly what was sampled
        samples = cf.merge_linear(steps)
        assert len(samples) <= 1 + sum(not b for b in bridged_flags[:-1])  # every bridged turn merges
        trained = [t for s in samples for t, m in zip(s["response"], s["mask"], strict=True) if m]
        assert trained == [t for _, c in steps for t in c]
        for s in samples:  # the merged sample is the context of its last turn plus that turn's completion
            prompt, completion = steps[s["last"]]
            assert s["prompt"] + s["response"] == prompt + completion
    if policy != "never":
        assert n_bridged >= n_turns // (4 if policy == "always" else 6), (n_bridged, n_turns)
    else:
        assert n_bridged == 0
    print(f"{name}: {n_open_bridged} of {n_open} open turns bridged")
