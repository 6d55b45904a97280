"""The public step recorder (rljax.recording) used directly, without the env loop.

The renderers run on tokenizers trained in code (tests/chat/chat_fixtures.py) and are checked
against the independent reference, the Jinja chat template (``apply_chat_template``): a full render
must equal it token for token, and a bridged prompt must spell the template's text of the whole
conversation. Completions are fakes built the way a model would sample them (the template's text
of the assistant turn, tokenized on its own, plus the end-of-turn token). Merge sample counts come
from :func:`rljax.data.merge.merge_steps` on the recorded steps; :class:`rljax.chat.ChatSession`
(the env loop's previous bookkeeping) is the reference for ``continue_with``.
"""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "chat"))

import chat_fixtures as cf  # noqa: E402

from rljax.chat import ChatMLRenderer, ChatSession, Qwen3Renderer  # noqa: E402
from rljax.data import StepBatch  # noqa: E402
from rljax.data.merge import merge_steps  # noqa: E402
from rljax.inference.engine import Completion  # noqa: E402
from rljax.recording import Prompt, StepRecorder, recorded_temperature, same_reply  # noqa: E402
from rljax.types import TrajectoryID  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You answer weather questions."}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {  # with reasoning: Qwen3 keeps <think> blocks after the last user query (an empty one it drops)
    "role": "assistant",
    "content": "",
    "reasoning_content": "I should call the tool.",
    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}
# how an OpenAI client sends the reply back: content None, JSON-string arguments, its own call id,
# the reasoning dropped
ECHO = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_abc",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
TOOL = {"role": "tool", "tool_call_id": "call_abc", "content": "sunny and warm"}
ANSWER = {"role": "assistant", "content": "It is sunny and warm in Paris."}


@pytest.fixture(scope="module")
def toks():
    return cf.build_tokenizers()


@pytest.fixture(scope="module")
def qwen3(toks):
    return toks["qwen3"], Qwen3Renderer(toks["qwen3"])


@pytest.fixture(scope="module")
def chatml(toks):
    return toks["chatml"], ChatMLRenderer(toks["chatml"])


def sampled(tok, history, assistant, *, tools=None, version=0, finish="stop", experts=False, prompt_len=None):
    """A fake engine completion: the ids a model would sample for ``assistant`` after ``history``
    (finish "length": cut before the end-of-turn token), distinct logprobs, optional MoE routing."""
    ids = cf.canonical_completion(tok, history, assistant, end_of_turn="<|im_end|>", tools=tools)
    if finish == "length":
        ids = ids[:-3]
    routing = None
    if experts:  # [len(prompt) + len(ids) - 1, layers=2, top_k=2], distinct per position
        rows = prompt_len + len(ids) - 1
        routing = np.arange(rows * 4, dtype=np.int32).reshape(rows, 2, 2) % 7
    logprobs = [-0.05 * (1 + (3 * i) % 11) for i in range(len(ids))]
    return Completion(ids, logprobs, finish, version, routed_experts=routing)


def decode(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def text_of_role(tok, prompt, role):
    return decode(tok, [i for i, r in zip(prompt.ids, prompt.roles, strict=True) if r == role])


def merged(steps):
    return list(merge_steps(StepBatch(steps)))


# ------------------------------------------------------------------------------------------------
# extension: bridged prompts, roles, the Step fields, one merged sample
# ------------------------------------------------------------------------------------------------


def test_a_tool_call_conversation_is_bridged_and_merges_into_one_sample(qwen3):
    tok, renderer = qwen3
    rec = StepRecorder(renderer, TrajectoryID("weather", 2), env="agent", algorithm="rloo", temperature=0.7)
    first = [SYSTEM, QUESTION]
    p0 = rec.prompt_for(first, tools=TOOLS)
    assert p0.ids == cf.hf_ids(tok, first, add_generation_prompt=True, tools=TOOLS)
    assert not p0.extended and p0.parent is None and len(p0.roles) == len(p0.ids)
    assert text_of_role(tok, p0, "user") == QUESTION["content"]
    c0 = sampled(tok, first, CALL, tools=TOOLS, version=3, experts=True, prompt_len=len(p0.ids))
    call0 = rec.record(p0, c0)
    assert call0.index == 0 and call0.stop_reason == "stop"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in call0.reply["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]

    # the client sends the history back with its own spelling of the reply, then the tool result
    second = [SYSTEM, QUESTION, ECHO, TOOL]
    p1 = rec.prompt_for(second, tools=TOOLS)
    n = len(p0.ids) + len(c0.ids)
    assert p1.parent == 0 and p1.extended
    assert p1.ids[:n] == [*p0.ids, *c0.ids]  # prompt + completion, token for token
    # the bridged ids spell the template's text of the whole conversation (reference: Jinja)
    cf.assert_bridge_matches_template(tok, p1.ids, n, [SYSTEM, QUESTION, CALL, TOOL], tools=TOOLS)
    assert p1.roles[: len(p0.ids)] == p0.roles
    assert p1.roles[len(p0.ids) : n] == ["assistant"] * len(c0.ids)  # sampled ids, end-of-turn included
    assert text_of_role(tok, p1, "tool") == TOOL["content"]
    assert set(p1.roles[n:]) == {None, "tool"}  # scaffolding, the tool's body, the next opener

    c1 = sampled(
        tok, [*first, CALL, TOOL], ANSWER, tools=TOOLS, version=4, experts=True, prompt_len=len(p1.ids)
    )
    rec.record(p1, c1)
    steps = rec.finish(reward=1.0)
    assert [list(s.prompt_ids) for s in steps] == [p0.ids, p1.ids]
    assert [list(s.response_ids) for s in steps] == [list(c0.ids), list(c1.ids)]
    assert [list(s.response_logprobs) for s in steps] == [list(c0.logprobs), list(c1.logprobs)]
    assert [list(s.prompt_roles) for s in steps] == [p0.roles, p1.roles]
    assert [s.policy_version for s in steps] == [3, 4]
    assert [s.reward for s in steps] == [0.0, 1.0] and [s.is_last_step for s in steps] == [False, True]
    assert [s.stop_reason for s in steps] == ["stop", "stop"]
    assert steps[0].routed_experts is c0.routed_experts and steps[1].routed_experts is c1.routed_experts
    assert {(s.env, s.algorithm, s.temperature, s.trajectory_id) for s in steps} == {
        ("agent", "rloo", 0.7, TrajectoryID("weather", 2))
    }
    assert all(list(s.loss_mask) == [1] * len(s.response_ids) for s in steps)

    (sample,) = merged(steps)  # a linear conversation: one training sample
    gap = len(p1.ids) - n
    assert list(sample.prompt_ids) == p0.ids
    assert list(sample.response_ids) == [*c0.ids, *p1.ids[n:], *c1.ids]
    assert list(sample.loss_mask) == [1] * len(c0.ids) + [0] * gap + [1] * len(c1.ids)
    assert sample.reward == 1.0 and sample.is_last_step and sample.policy_version == 3
    # each token keeps the version that sampled it; the gap (call 1's prompt) takes call 1's
    assert list(sample.token_versions()) == [3] * len(c0.ids) + [4] * (gap + len(c1.ids))
    # routing of the merged sample: call 0's rows, then call 1's rows past them (rljax.data.merge)
    np.testing.assert_array_equal(
        sample.routed_experts, np.concatenate([c0.routed_experts, c1.routed_experts[n - 1 :]])
    )


def test_a_follow_up_user_turn_is_bridged_in_chatml(chatml):
    tok, renderer = chatml
    rec = StepRecorder(renderer, ("q", 0))
    first = [QUESTION]
    p0 = rec.prompt_for(first)
    c0 = sampled(tok, first, ANSWER)
    call0 = rec.record(p0, c0)
    follow = {"role": "user", "content": "And in Berlin?"}
    p1 = rec.prompt_for([QUESTION, call0.reply, follow])
    n = len(p0.ids) + len(c0.ids)
    assert p1.parent == 0 and p1.ids[:n] == [*p0.ids, *c0.ids]
    cf.assert_bridge_matches_template(tok, p1.ids, n, [QUESTION, ANSWER, follow])
    assert text_of_role(tok, p1, "user") == QUESTION["content"] + follow["content"]


# ------------------------------------------------------------------------------------------------
# no extension: full renders, new merge samples
# ------------------------------------------------------------------------------------------------


def _one_call(tok, renderer, **kwargs):
    rec = StepRecorder(renderer, ("t", 0), **kwargs)
    p0 = rec.prompt_for([SYSTEM, QUESTION], tools=TOOLS)
    rec.record(p0, sampled(tok, [SYSTEM, QUESTION], CALL, tools=TOOLS, version=1))
    return rec, p0


@pytest.mark.parametrize(
    "edit",
    ["summary", "edited_reply", "edited_system", "dropped_reply", "other_tools", "no_tools"],
)
def test_a_conversation_that_does_not_extend_a_call_is_rendered_in_full(qwen3, edit):
    tok, renderer = qwen3
    rec, _ = _one_call(tok, renderer)
    tools = TOOLS
    if edit == "summary":  # a context reset: the history replaced by a summary
        messages = [SYSTEM, {"role": "user", "content": "Summary: Paris weather was asked. Go on."}]
    elif edit == "edited_reply":
        messages = [SYSTEM, QUESTION, {**ECHO, "content": "Let me check."}, TOOL]
    elif edit == "edited_system":
        messages = [{"role": "system", "content": "Be brief."}, QUESTION, ECHO, TOOL]
    elif edit == "dropped_reply":
        messages = [SYSTEM, QUESTION, TOOL]
    elif edit == "other_tools":
        messages = [SYSTEM, QUESTION, ECHO, TOOL]
        tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "changed"}}]
    else:
        messages = [SYSTEM, QUESTION, ECHO, TOOL]
        tools = None
    p = rec.prompt_for(messages, tools=tools)
    assert p.parent is None and not p.extended
    assert p.ids == cf.hf_ids(tok, messages, add_generation_prompt=True, tools=tools)
    assert len(p.roles) == len(p.ids)


def test_a_context_reset_starts_a_second_merge_sample(qwen3):
    tok, renderer = qwen3
    rec, p0 = _one_call(tok, renderer)
    c0 = rec.calls[0].completion
    p1 = rec.prompt_for([SYSTEM, QUESTION, ECHO, TOOL], tools=TOOLS)
    c1 = sampled(tok, [SYSTEM, QUESTION, CALL, TOOL], ANSWER, tools=TOOLS, version=1)
    rec.record(p1, c1)
    assert len(merged(rec.steps())) == 1  # linear so far

    summary = [SYSTEM, {"role": "user", "content": "Summary: the user asks the weather in Paris."}]
    p2 = rec.prompt_for(summary, tools=TOOLS)
    assert p2.parent is None
    c2 = sampled(tok, summary, CALL, tools=TOOLS, version=2)
    rec.record(p2, c2)
    samples = merged(rec.steps())
    assert len(samples) == 2  # the reset starts a new sample
    assert [list(s.prompt_ids) for s in samples] == [p0.ids, p2.ids]
    assert list(samples[0].response_ids) == [*c0.ids, *p1.ids[len(p0.ids) + len(c0.ids) :], *c1.ids]

    # the summarized conversation goes on: it extends the summary's call, still two samples
    p3 = rec.prompt_for([*summary, ECHO, TOOL], tools=TOOLS)
    assert p3.parent == 2 and p3.ids[: len(p2.ids) + len(c2.ids)] == [*p2.ids, *c2.ids]
    c3 = sampled(tok, [*summary, CALL, TOOL], ANSWER, tools=TOOLS, version=2)
    rec.record(p3, c3)
    samples = merged(rec.finish(reward=0.5))
    assert [list(s.prompt_ids) for s in samples] == [p0.ids, p2.ids]
    assert list(samples[1].response_ids) == [*c2.ids, *p3.ids[len(p2.ids) + len(c2.ids) :], *c3.ids]
    assert samples[1].is_last_step and samples[1].reward == 0.5 and samples[0].reward == 0.0


def test_a_new_user_query_in_qwen3_is_not_bridged_but_extends_in_chatml(qwen3, chatml):
    """Qwen3's template drops past <think> blocks at a new user query, so its renderer refuses the
    bridge: the message-level extension alone does not make a prompt extended."""
    follow = {"role": "user", "content": "And in Berlin?"}
    for (tok, renderer), bridged in ((qwen3, False), (chatml, True)):
        rec = StepRecorder(renderer, ("q", 0))
        p0 = rec.prompt_for([QUESTION])
        call0 = rec.record(p0, sampled(tok, [QUESTION], ANSWER))
        messages = [QUESTION, {"role": "assistant", "content": call0.reply["content"]}, follow]
        p1 = rec.prompt_for(messages)
        assert p1.extended is bridged
        if not bridged:
            assert p1.ids == cf.hf_ids(tok, messages, add_generation_prompt=True)


def test_bridge_off_renders_every_prompt_in_full(qwen3):
    tok, renderer = qwen3
    rec, p0 = _one_call(tok, renderer, bridge=False)
    p1 = rec.prompt_for([SYSTEM, QUESTION, ECHO, TOOL], tools=TOOLS)
    p2 = rec.continue_with([TOOL])
    assert not p1.extended and not p2.extended
    assert p1.ids == cf.hf_ids(tok, [SYSTEM, QUESTION, ECHO, TOOL], add_generation_prompt=True, tools=TOOLS)


# ------------------------------------------------------------------------------------------------
# stop reasons, errors, temperatures
# ------------------------------------------------------------------------------------------------


def test_a_truncated_completion_keeps_length_and_is_rendered_where_the_template_rewrites_it(qwen3):
    tok, renderer = qwen3
    rec = StepRecorder(renderer, ("t", 0))
    p0 = rec.prompt_for([SYSTEM, QUESTION], tools=TOOLS)
    c0 = sampled(tok, [SYSTEM, QUESTION], CALL, tools=TOOLS, finish="length")
    call0 = rec.record(p0, c0)
    assert call0.stop_reason == "length" and not call0.parsed.stopped
    # the conversation extends the call at the message level, but the completion was cut inside its
    # tool call and a user query follows (Qwen3 drops the reasoning): the template's render differs
    # from the sampled ids, so a full render
    messages = [SYSTEM, QUESTION, call0.reply, {"role": "user", "content": "go on"}]
    p1 = rec.prompt_for(messages, tools=TOOLS)
    assert p1.parent is None
    assert p1.ids == cf.hf_ids(tok, messages, add_generation_prompt=True, tools=TOOLS)
    rec.record(p1, sampled(tok, messages, ANSWER, tools=TOOLS))
    assert [s.stop_reason for s in rec.steps()] == ["length", "stop"]
    rec.calls[-1].cut("length")  # e.g. the next prompt would not fit the context
    assert [s.stop_reason for s in rec.steps()] == ["length", "length"]
    assert len(merged(rec.steps())) == 2


@pytest.mark.parametrize("how", ["abort", "fail"])
def test_errored_trajectories_are_masked_with_zero_reward(qwen3, how):
    tok, renderer = qwen3
    rec, p0 = _one_call(tok, renderer)
    rec.calls[0].reward = 0.3
    p1 = rec.prompt_for([SYSTEM, QUESTION, ECHO, TOOL], tools=TOOLS)
    c1 = sampled(
        tok, [SYSTEM, QUESTION, CALL, TOOL], ANSWER, tools=TOOLS, finish=how if how == "abort" else "stop"
    )
    rec.record(p1, c1)
    assert [s.reward for s in rec.steps()] == ([0.0, 0.0] if how == "abort" else [0.3, 0.0])
    if how == "fail":
        rec.fail()  # e.g. the harness crashed
    assert rec.error == ("abort" if how == "abort" else "error")
    steps = rec.finish(reward=1.0)
    assert [s.stop_reason for s in steps] == ["stop", rec.error]
    assert [s.reward for s in steps] == [0.0, 0.0]
    assert all(set(s.loss_mask) == {0} for s in steps)
    assert [list(s.response_ids) for s in steps] == [list(rec.calls[0].completion.ids), list(c1.ids)]


def test_bad_arguments_are_refused(qwen3):
    tok, renderer = qwen3
    rec = StepRecorder(renderer, ("t", 0))
    with pytest.raises(ValueError, match="fail's stop_reason"):
        rec.fail("stop")
    with pytest.raises(ValueError, match="continue_with needs a recorded call"):
        rec.continue_with([TOOL])
    with pytest.raises(ValueError, match="needs a recorded call"):
        rec.finish(reward=1.0)
    p0 = rec.prompt_for([QUESTION])
    with pytest.raises(ValueError, match="empty completion"):
        rec.record(p0, Completion((), (), "stop", 0))
    with pytest.raises(TypeError, match="needs a Prompt"):
        rec.record(list(p0.ids), sampled(tok, [QUESTION], ANSWER))
    with pytest.raises(ValueError, match="ids but"):
        Prompt([1, 2], ["user"])
    with pytest.raises(ValueError, match="messages"):
        rec.prompt_for([])
    assert rec.calls == () and rec.steps() == []


def test_temperatures_per_call_and_greedy(qwen3):
    tok, renderer = qwen3
    rec = StepRecorder(renderer, ("t", 0), temperature=0.0)
    p0 = rec.prompt_for([QUESTION])
    c = sampled(tok, [QUESTION], ANSWER)
    rec.record(p0, c)
    rec.record(p0, c, temperature=0.6)
    rec.record(p0, c, temperature=1e-7)
    assert [s.temperature for s in rec.steps()] == [1.0, 0.6, 1.0]
    assert recorded_temperature(1e-5) == 1e-5 and recorded_temperature(0.99e-5) == 1.0


# ------------------------------------------------------------------------------------------------
# several conversations in one trajectory: sub-agents, forks, token-in prompts
# ------------------------------------------------------------------------------------------------


def test_interleaved_sub_agent_calls_extend_their_own_conversation(qwen3):
    tok, renderer = qwen3
    rec = StepRecorder(renderer, ("t", 0))
    main = [SYSTEM, QUESTION]
    sub = [{"role": "system", "content": "You look up weather."}, {"role": "user", "content": "Paris"}]
    p0 = rec.prompt_for(main, tools=TOOLS)
    call0 = rec.record(p0, sampled(tok, main, CALL, tools=TOOLS))
    p1 = rec.prompt_for(sub, tools=TOOLS)  # the sub-agent's own conversation: a full render
    rec.record(p1, sampled(tok, sub, CALL, tools=TOOLS))
    p2 = rec.prompt_for([*main, ECHO, TOOL], tools=TOOLS)
    p3 = rec.prompt_for([*sub, ECHO, TOOL], tools=TOOLS)
    assert (p1.parent, p2.parent, p3.parent) == (None, 0, 1)
    rec.record(p2, sampled(tok, [*main, CALL, TOOL], ANSWER, tools=TOOLS))
    rec.record(p3, sampled(tok, [*sub, CALL, TOOL], ANSWER, tools=TOOLS))
    # a fork: the main conversation continued twice from call 0 (e.g. a retried tool)
    p4 = rec.prompt_for([*main, ECHO, {**TOOL, "content": "rain"}], tools=TOOLS)
    assert p4.parent == 0 and p4.ids[: len(p0.ids) + len(call0.completion.ids)] == [
        *p0.ids,
        *call0.completion.ids,
    ]
    rec.record(p4, sampled(tok, [*main, CALL, {**TOOL, "content": "rain"}], ANSWER, tools=TOOLS))
    # merge: the main calls 0 + 2 in one sample, the sub-agent's 1 + 3 in another, the fork alone
    # (call 0's sample has moved past the prefix it shares)
    samples = merged(rec.steps())
    assert [list(s.prompt_ids) for s in samples] == [p0.ids, p1.ids, p4.ids]


def test_the_longest_extended_history_wins(chatml):
    tok, renderer = chatml
    rec = StepRecorder(renderer, ("t", 0))
    p0 = rec.prompt_for([QUESTION])
    call0 = rec.record(p0, sampled(tok, [QUESTION], ANSWER))
    follow = {"role": "user", "content": "And in Berlin?"}
    h1 = [QUESTION, call0.reply, follow]
    p1 = rec.prompt_for(h1)
    call1 = rec.record(p1, sampled(tok, h1, ANSWER))
    p2 = rec.prompt_for([*h1, call1.reply, follow])  # extends call 1 and (message-wise) not call 0
    assert p2.parent == 1
    p3 = rec.prompt_for([*h1[:2], {"role": "user", "content": "other"}])  # extends only call 0
    assert p3.parent == 0

    # a retried call: same prompt, the same reply spelled with other token ids; the latest wins
    # (its ids are what the next prompt starts with)
    again = list(call0.completion.ids)
    text = decode(tok, again[:-1])
    retry = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]  # char by char
    assert retry != again[:-1] and decode(tok, retry) == text
    call4 = rec.record(p0, Completion([*retry, again[-1]], [-0.1] * (len(retry) + 1), "stop", 0))
    assert call4.reply == call0.reply
    p5 = rec.prompt_for(h1)
    assert p5.parent == call4.index and p5.ids[: len(p0.ids) + len(retry) + 1] == [*p0.ids, *retry, again[-1]]
    for ids, parent in ((p1.ids, 0), (p5.ids, call4.index)):
        assert rec.prompt_from_ids(ids).parent == parent
    call6 = rec.record(p0, call0.completion)  # the very same ids again: the latest of equals
    assert rec.prompt_from_ids(p1.ids).parent == rec.prompt_for(h1).parent == call6.index


def test_prompts_given_as_ids_find_their_parent_by_token_prefix(chatml):
    tok, renderer = chatml
    rec = StepRecorder(renderer, ("t", 0))
    p0 = rec.prompt_from_ids([5, 6, 7])
    assert p0.parent is None and p0.roles is None and p0.messages is None
    rec.record(p0, Completion((8, 9), (-0.1, -0.2), "stop", 0))
    p1 = rec.prompt_from_ids([5, 6, 7, 8, 9, 10], roles=["user"] * 6)
    assert p1.parent == 0 and p1.roles == ["user"] * 6
    rec.record(p1, Completion((11,), (-0.3,), "stop", 0))
    assert rec.prompt_from_ids([5, 6, 7, 8, 9, 10, 11, 12]).parent == 1  # the longest prefix
    assert rec.prompt_from_ids([5, 6, 7, 8]).parent is None
    steps = rec.finish(reward=1.0)
    assert steps[0].prompt_roles is None
    with pytest.raises(ValueError, match="given as ids"):
        rec.continue_with([QUESTION])
    (sample,) = merged(steps)
    assert list(sample.response_ids) == [8, 9, 10, 11]


# ------------------------------------------------------------------------------------------------
# the env-loop form agrees with ChatSession
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "chatml"])
def test_continue_with_equals_chat_session(toks, name):
    """Random multi-turn tool conversations: ``continue_with`` gives ChatSession's prompt ids,
    roles and bridged flags (canonical completions bridge; truncated ones fall back)."""
    import random

    tok = toks[name]
    renderer = Qwen3Renderer(tok) if name == "qwen3" else ChatMLRenderer(tok)
    rng = random.Random(7)
    for episode in range(4):
        messages, tools = cf.random_conversation(rng, end_with_assistant=False, max_calls=2)
        rec = StepRecorder(renderer, ("t", episode))
        session = ChatSession(renderer, messages, tools=tools)
        prompt = rec.prompt_for(messages, tools=tools)
        history = list(messages)
        for turn in range(4):
            assert prompt.ids == session.prompt_ids and prompt.roles == session.full_prompt_roles
            calls = rng.randint(1, 2) if tools and rng.random() < 0.6 else 0
            assistant = cf.random_assistant(rng, calls=calls, reasoning="always")
            ids = cf.canonical_completion(tok, history, assistant, end_of_turn="<|im_end|>", tools=tools)
            if rng.random() < 0.25:
                ids = ids[:-1]  # truncated: no end-of-turn token
            completion = Completion(ids, [-0.1] * len(ids), "stop", turn)
            call = rec.record(prompt, completion)
            parsed = session.add_completion(ids)
            assert call.parsed == parsed and call.reply == parsed.to_message()
            new = cf.env_messages(rng, parsed)
            history = [*history, parsed.to_message(), *new]
            session.add_messages(new)
            prompt = rec.continue_with(new)
            assert prompt.extended == session.bridged and prompt.messages == session.messages
        assert prompt.ids == session.prompt_ids and prompt.roles == session.full_prompt_roles


# ------------------------------------------------------------------------------------------------
# same_reply
# ------------------------------------------------------------------------------------------------


def test_same_reply_compares_what_a_reply_says_not_its_spelling():
    gen = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": [1, 2]}}}
        ],
    }
    wire = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "zz",
                "type": "function",
                "function": {"name": "f", "arguments": json.dumps({"x": [1, 2]})},
            }
        ],
    }
    assert same_reply(wire, gen)
    assert same_reply({**wire, "reasoning_content": "think"}, gen)
    assert same_reply({**wire, "content": [{"type": "text", "text": ""}]}, gen)
    assert not same_reply({**wire, "reasoning_content": "other"}, gen)
    assert not same_reply({**wire, "content": "x"}, gen)
    assert not same_reply({**wire, "role": "user"}, gen)
    assert not same_reply({**wire, "tool_calls": []}, gen)
    other_args = [{"function": {"name": "f", "arguments": '{"x": [2, 1]}'}}]
    assert not same_reply({**wire, "tool_calls": other_args}, gen)
    assert not same_reply(
        {**wire, "tool_calls": [{"function": {"name": "g", "arguments": {"x": [1, 2]}}}]}, gen
    )
    text = {"role": "assistant", "content": "hi"}
    assert same_reply(
        {"role": "assistant", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}, text
    )
    assert same_reply({"role": "assistant", "content": "hi", "tool_calls": None}, text)


# ------------------------------------------------------------------------------------------------
# open turns: cut by max_tokens, ended by another stop token, aborted
# ------------------------------------------------------------------------------------------------


def _open_then_closed(tok, renderer, cut_ids, finish):
    """Records a call whose completion is ``cut_ids`` (no end-of-turn token) and a follow-up user turn
    sent back as an OpenAI client would (the reply as it was returned); returns the recorder."""
    rec = StepRecorder(renderer, ("t", 0))
    history = [SYSTEM, QUESTION]
    p0 = rec.prompt_for(history)
    call0 = rec.record(p0, Completion(cut_ids, [-0.5] * len(cut_ids), finish, 0))
    echo = {"role": "assistant", "content": call0.reply["content"]}
    messages = [*history, echo, {"role": "user", "content": "go on"}]
    p1 = rec.prompt_for(messages)
    rec.record(p1, sampled(tok, messages, ANSWER))
    return rec, messages


def test_a_cut_turn_is_bridged_with_the_closing_tokens_as_prompt_and_merges(chatml):
    tok, renderer = chatml
    whole = cf.canonical_completion(tok, [SYSTEM, QUESTION], ANSWER, end_of_turn="<|im_end|>")
    cut = whole[:8]  # max_tokens=8
    rec, messages = _open_then_closed(tok, renderer, cut, "length")
    call0, call1 = rec.calls
    p0, p1 = call0.prompt, call1.prompt
    assert p1.parent == 0 and call0.stop_reason == "length"
    # token for token the template's render of the history the client sent
    assert p1.ids == cf.hf_ids(tok, messages, add_generation_prompt=True)
    n = len(p0.ids) + len(cut)
    assert p1.ids[:n] == [*p0.ids, *cut]
    assert decode(tok, p1.ids[n : n + 2]) == "<|im_end|>\n"  # the closing tokens, not sampled
    assert p1.roles[n - len(cut) : n] == ["assistant"] * len(cut) and p1.roles[n : n + 2] == [None, None]
    (sample,) = merged(rec.steps())
    gap = len(p1.ids) - n
    assert decode(tok, sample.response_ids[len(cut) : len(cut) + gap]) == (
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    )
    c1 = list(call1.completion.ids)
    assert list(sample.loss_mask) == [1] * len(cut) + [0] * gap + [1] * len(c1)
    assert list(sample.response_ids) == [*cut, *p1.ids[n:], *c1]
    assert list(sample.response_logprobs) == [-0.5] * len(cut) + [0.0] * gap + list(call1.completion.logprobs)


def test_a_single_token_stop_string_ends_an_open_turn_that_is_bridged(chatml):
    tok, renderer = chatml
    whole = cf.canonical_completion(tok, [SYSTEM, QUESTION], ANSWER, end_of_turn="<|im_end|>")[:-1]
    stop = tok.encode(".", add_special_tokens=False)
    assert len(stop) == 1 and whole[-1] == stop[0]  # "... Paris." ends on the stop string "."
    rec, messages = _open_then_closed(tok, renderer, whole, "stop")
    assert rec.calls[0].reply["content"].endswith(".")
    assert rec.calls[1].prompt.parent == 0
    assert rec.calls[1].prompt.ids == cf.hf_ids(tok, messages, add_generation_prompt=True)
    assert len(merged(rec.steps())) == 1


def test_another_stop_token_is_not_bridged_the_template_never_writes_it(chatml):
    tok, renderer = chatml
    whole = cf.canonical_completion(tok, [SYSTEM, QUESTION], ANSWER, end_of_turn="<|im_end|>")[:-1]
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    rec, messages = _open_then_closed(tok, renderer, [*whole, endoftext], "stop")
    assert rec.calls[0].parsed.stopped  # a stop token of the format, not content
    assert rec.calls[1].prompt.parent is None
    assert rec.calls[1].prompt.ids == cf.hf_ids(tok, messages, add_generation_prompt=True)
    assert len(merged(rec.steps())) == 2


@pytest.mark.filterwarnings("ignore::rljax.data.validate.AllMaskedWarning")  # an errored trajectory
def test_an_aborted_turn_resumed_by_a_follow_up_merges_with_loss_mask_zero(chatml):
    tok, renderer = chatml
    whole = cf.canonical_completion(tok, [SYSTEM, QUESTION], ANSWER, end_of_turn="<|im_end|>")
    rec, messages = _open_then_closed(tok, renderer, whole[:5], "abort")
    assert rec.error == "abort" and rec.calls[1].prompt.parent == 0
    assert rec.calls[1].prompt.ids == cf.hf_ids(tok, messages, add_generation_prompt=True)
    (sample,) = merged(rec.finish(reward=1.0))
    assert set(sample.loss_mask) == {0} and sample.reward == 0.0 and sample.stop_reason == "abort"
