"""Tests of rljax.data.echo: role attribution on steps and the echo token selection.

References are independent of the code under test: the tokens echo must select are found by
encoding each environment message's content string with the tokenizer and locating it in the
merged token sequence; the property test builds conversations segment by segment and knows
the role of every token by construction; the objective test recomputes the loss in float64.
"""

from __future__ import annotations

import asyncio

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from rljax.chat import ChatMLRenderer, ChatSession, Qwen3Renderer, toy_tokenizer
from rljax.core.objective import ObjectiveConfig, global_counts, objective
from rljax.data import StepBatch
from rljax.data.echo import DEFAULT_ALPHAS, check_alphas, echo_streams, response_roles
from rljax.data.merge import MergePlan, merge_steps, plan_merge
from rljax.data.pack import pack
from rljax.envs import ToolLookupEnv, make_lookup_tasks
from rljax.inference.engine import Completion
from rljax.rollout import RolloutConfig, run_rollout
from rljax.types import Step, TrajectoryID

TOK = toy_tokenizer("chatml")
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
SPECIAL_IDS = set(TOK.all_special_ids) | {int(i) for i in TOK.added_tokens_decoder}
TID = TrajectoryID("conv", 0)


def enc(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------------------
# a hand-made multi-turn ChatML conversation
# ------------------------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "You look things up."},
    {"role": "user", "content": "What color is the zorblax?"},
]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "zorblax"}}\n</tool_call>'
# (completion text, environment messages that follow it or None for the last turn)
TURNS = [
    (
        CALL,
        [
            {"role": "tool", "content": "zorblax: teal (ref 42)", "name": "lookup"},
            {"role": "tool", "content": "no other match", "name": "lookup"},
        ],
    ),
    ("It is teal.", [{"role": "user", "content": "And the quux? One word."}]),
    ("mauve", None),
]
ENV_MESSAGES = [m for _, msgs in TURNS if msgs for m in msgs]


def converse(renderer, *, bridge=True, masks=None):
    """Runs TURNS through a ChatSession (bridged, or a full render each turn); returns Steps."""
    session = ChatSession(renderer, MESSAGES)
    steps = []
    for turn, (text, env_messages) in enumerate(TURNS):
        prompt, roles = list(session.prompt_ids), list(session.full_prompt_roles)
        assert len(roles) == len(prompt)
        ids = enc(text) + [IM_END]
        session.add_completion(ids)
        steps.append(
            Step(
                prompt,
                ids,
                TID,
                loss_mask=None if masks is None else [masks[turn]] * len(ids),
                response_logprobs=[-0.5] * len(ids),
                is_last_step=env_messages is None,
                prompt_roles=roles,
            )
        )
        if env_messages is not None:
            if bridge:
                session.add_messages(env_messages)
                assert session.bridged
            else:
                session = ChatSession(renderer, [*session.messages, *env_messages])
            assert len(session.full_prompt_roles) == len(session.prompt_ids)
    return steps


def expected_env_positions(sample: Step, first_prompt_len: int, messages) -> dict[int, str]:
    """Response positions of each env message's content, located by its encoded ids, in order."""
    full = list(sample.prompt_ids) + list(sample.response_ids)
    out, cursor = {}, first_prompt_len
    for m in messages:
        needle = enc(m["content"])
        at = next(
            i for i in range(cursor, len(full) - len(needle) + 1) if full[i : i + len(needle)] == needle
        )
        out.update({at + j - first_prompt_len: m["role"] for j in range(len(needle))})
        cursor = at + len(needle)
    return out


def merged_with_roles(steps):
    batch = StepBatch(steps)
    plan = plan_merge(batch.steps)
    merged = merge_steps(batch)
    return plan, merged, response_roles(plan, batch.steps)


@pytest.mark.parametrize("alphas", [{"tool": 0.1}, {"tool": 0.1, "user": 0.3}, {"user": 0.25, "tool": 0.0}])
def test_echo_selects_exactly_the_env_message_bodies(alphas):
    steps = converse(ChatMLRenderer(TOK))
    plan, merged, roles = merged_with_roles(steps)
    (sample,) = merged  # bridged linear conversation -> one sample
    assert plan.samples == ((0, 1, 2),)
    assert sample.prompt_roles == steps[0].prompt_roles  # the first turn's roles stay with the sample
    streams = echo_streams(merged, roles, alphas)

    env_pos = expected_env_positions(sample, len(steps[0].prompt_ids), ENV_MESSAGES)
    want = {p: alphas[r] for p, r in env_pos.items() if alphas.get(r, 0) > 0}
    ce = streams.ce_weights[0]
    assert ce.dtype == np.float32 and ce.shape == (len(sample.response_ids),)
    got = {int(p): float(ce[p]) for p in np.flatnonzero(ce)}
    assert got == pytest.approx(want)
    response = np.asarray(sample.response_ids)
    echoed = response[sorted(want)].tolist()
    assert not SPECIAL_IDS & set(echoed)  # no <|im_start|>, <|im_end|>, <tool_response>, ...
    assert TOK.decode(echoed) == "".join(m["content"] for m in ENV_MESSAGES if alphas.get(m["role"], 0) > 0)
    action = np.asarray(sample.loss_mask) == 1
    assert streams.rl_weights[0].tolist() == action.astype(np.float32).tolist()
    echo = np.zeros_like(action)
    echo[sorted(want)] = True
    assert not (echo & action).any()
    assert streams.loss_mask[0].dtype == np.int32
    assert streams.loss_mask[0].tolist() == (action | echo).astype(int).tolist()
    # scaffolding around the env messages and the assistant openers stay out of the loss
    gap_tokens = ~action & ~echo
    assert gap_tokens.sum() > 20 and not streams.loss_mask[0][gap_tokens].any()
    m = streams.metrics
    for role in alphas:
        count = sum(len(enc(x["content"])) for x in ENV_MESSAGES if x["role"] == role) if alphas[role] else 0
        assert m[f"echo/tokens/{role}"] == count
    assert m["echo/tokens"] == len(want) and m["echo/samples_with_echo"] == 1
    assert m["echo/action_tokens"] == sum(len(s.response_ids) for s in steps)


def test_bridged_and_full_render_prompts_agree():
    renderer = ChatMLRenderer(TOK)
    bridged, full = converse(renderer), converse(renderer, bridge=False)
    for prev, a in zip(bridged[:-1], bridged[1:], strict=True):  # sampled ids are the policy's: "assistant"
        start = len(prev.prompt_ids)
        assert a.prompt_roles[:start] == prev.prompt_roles
        assert a.prompt_roles[start : start + len(prev.response_ids)] == ["assistant"] * len(
            prev.response_ids
        )
    for a, b in zip(bridged, full, strict=True):
        assert a.prompt_ids == b.prompt_ids  # canonical completions: the same token stream
        # only the sampled ids differ in attribution ("assistant" vs. the template's view)
        env_a = [r if r not in (None, "assistant") else None for r in a.prompt_roles]
        env_b = [r if r not in (None, "assistant") else None for r in b.prompt_roles]
        assert env_a == env_b
    alphas = {"tool": 0.1, "user": 0.3}
    results = [echo_streams(*merged_with_roles(s)[1:], alphas) for s in (bridged, full)]
    a, b = results
    for x, y in zip(a.ce_weights + a.loss_mask, b.ce_weights + b.loss_mask, strict=True):
        np.testing.assert_array_equal(x, y)
    assert results[0].metrics == results[1].metrics and results[0].metrics["echo/tokens"] > 0


def test_token_filter_narrows_only():
    steps = converse(ChatMLRenderer(TOK))
    _, merged, roles = merged_with_roles(steps)
    (sample,) = merged
    plain = echo_streams(merged, roles, {"tool": 0.1})
    seen = []
    digits = [ord(c) for c in "0123456789"]  # the toy tokenizer's id of a byte is the byte

    def only_digits(step, candidates):
        seen.append((step, candidates.copy()))
        return np.isin(np.asarray(step.response_ids), digits)

    narrowed = echo_streams(merged, roles, {"tool": 0.1}, token_filter=only_digits)
    ((step, cand),) = seen
    assert step is sample and cand.dtype == np.bool_
    np.testing.assert_array_equal(cand, plain.ce_weights[0] > 0)
    # independent: "42" inside the first tool message's content
    tool = ENV_MESSAGES[0]["content"]
    start = min(expected_env_positions(sample, len(steps[0].prompt_ids), ENV_MESSAGES[:1]))
    want = [start + tool.index("42"), start + tool.index("42") + 1]
    assert np.flatnonzero(narrowed.ce_weights[0]).tolist() == want
    assert narrowed.metrics["echo/tokens"] == 2
    assert narrowed.metrics["echo/filtered_tokens"] == plain.metrics["echo/tokens"] - 2
    assert narrowed.metrics["echo/candidate_tokens"] == plain.metrics["echo/tokens"]
    # a filter cannot widen the selection
    widened = echo_streams(merged, roles, {"tool": 0.1}, token_filter=lambda s, c: np.ones_like(c))
    np.testing.assert_array_equal(widened.ce_weights[0], plain.ce_weights[0])
    np.testing.assert_array_equal(widened.loss_mask[0], plain.loss_mask[0])


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda s, c: list(c), "numpy bool array"),
        (lambda s, c: c.astype(np.int32), "dtype int32"),
        (lambda s, c: c[:-1], "shape"),
        (lambda s, c: None, "NoneType"),
    ],
)
def test_token_filter_bad_output(bad, match):
    _, merged, roles = merged_with_roles(converse(ChatMLRenderer(TOK)))
    with pytest.raises(ValueError, match=match):
        echo_streams(merged, roles, {"tool": 0.1}, token_filter=bad)
    with pytest.raises(ValueError, match="callable"):
        echo_streams(merged, roles, {"tool": 0.1}, token_filter="digits")


@pytest.mark.filterwarnings("ignore::rljax.data.validate.AllMaskedWarning")
def test_masked_samples_give_no_echo():
    _, merged, roles = merged_with_roles(converse(ChatMLRenderer(TOK), masks=[0, 0, 0]))
    calls = []
    out = echo_streams(
        merged, roles, {"tool": 1.0, "user": 1.0}, token_filter=lambda s, c: calls.append(1) or c
    )
    assert not out.loss_mask[0].any() and not out.ce_weights[0].any() and not out.rl_weights[0].any()
    assert calls == []  # nothing to filter
    assert out.metrics["echo/tokens"] == 0 and out.metrics["echo/samples_masked"] == 1
    # one trainable turn is enough for the sample to echo all its env tokens
    _, merged, roles = merged_with_roles(converse(ChatMLRenderer(TOK), masks=[0, 0, 1]))
    out = echo_streams(merged, roles, {"tool": 1.0, "user": 1.0})
    assert out.metrics["echo/tokens"] == sum(len(enc(m["content"])) for m in ENV_MESSAGES)
    assert out.metrics["echo/samples_masked"] == 0
    assert out.metrics["echo/action_tokens"] == len(enc("mauve")) + 1


def test_without_merging_nothing_is_echoed():
    steps = converse(ChatMLRenderer(TOK))
    alone = MergePlan(samples=((0,), (1,), (2,)), gaps=((0,), (0,), (0,)), num_steps=3)
    roles = response_roles(alone, steps)
    assert roles == [[None] * len(s.response_ids) for s in steps]
    out = echo_streams(steps, roles, {"tool": 0.1, "user": 0.1})
    assert out.metrics["echo/tokens"] == 0
    for s, lm, rl, ce in zip(steps, out.loss_mask, out.rl_weights, out.ce_weights, strict=True):
        assert lm.tolist() == list(s.loss_mask) and rl.tolist() == [1.0] * len(s.loss_mask) and not ce.any()


# ------------------------------------------------------------------------------------------------
# response_roles on the design §2.5 reference layouts (hand-computed)
# ------------------------------------------------------------------------------------------------
def _s(prompt, response, roles, rep=0, last=False):
    return Step(prompt, response, ("q", rep), is_last_step=last, prompt_roles=roles)


def test_response_roles_reference_cases():
    # P=[[1],[1,2,3],[1,2,3,4,5]], R=[[2],[4],[6]] -> R=[2,3,4,5,6], gaps before turns 1 and 2
    steps = [
        _s([1], [2], ["user"]),
        _s([1, 2, 3], [4], ["user", "assistant", "tool"]),
        _s([1, 2, 3, 4, 5], [6], ["user", "assistant", "tool", "assistant", None], last=True),
    ]
    assert response_roles(plan_merge(steps), steps) == [[None, "tool", None, None, None]]
    # P=[[1],[1,2,3],[1,23,4,5],[1,23,4,5,6,7]] -> (P=[1], R=[2,3,4]) and (P=[1,23,4,5], R=[6,7,8])
    steps = [
        _s([1], [2], [None]),
        _s([1, 2, 3], [4], [None, "assistant", "user"]),
        _s([1, 23, 4, 5], [6], [None, "tool", "tool", None]),
        _s([1, 23, 4, 5, 6, 7], [8], [None, "tool", "tool", None, "assistant", "tool"], last=True),
    ]
    assert response_roles(plan_merge(steps), steps) == [[None, "user", None], [None, "tool", None]]
    # interleaved trajectories, a gap of several tokens, and a response-less merge
    steps = [
        _s([5], [6, 7], ["system"], rep=0),
        _s([9], [8], [None], rep=1),
        _s(
            [5, 6, 7, 1, 2, 3],
            [4],
            ["system", "assistant", "assistant", "tool", "tool", None],
            rep=0,
            last=True,
        ),
        _s([9, 8, 0], [1], [None, "assistant", "user"], rep=1, last=True),
    ]
    assert response_roles(plan_merge(steps), steps) == [
        [None, None, "tool", "tool", None, None],
        [None, "user", None],
    ]


def test_response_roles_errors():
    steps = [_s([1], [2], [None]), Step([1, 2, 3], [4], ("q", 0))]
    with pytest.raises(
        ValueError, match=r"step 1 \(trajectory q#0\): prompt_roles is None.*Step.prompt_roles"
    ):
        response_roles(plan_merge(steps), steps)
    steps = [_s([1], [2], [None]), _s([1, 2, 3], [4], [None, None], last=True)]
    with pytest.raises(ValueError, match="prompt_roles has 2 entries but prompt_ids has 3"):
        response_roles(plan_merge(steps), steps)
    with pytest.raises(ValueError, match="made from 2 steps but 1"):
        response_roles(plan_merge(steps), steps[:1])
    with pytest.raises(ValueError, match="MergePlan"):
        response_roles(((0, 1),), steps)


# ------------------------------------------------------------------------------------------------
# alphas and argument checks
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alphas,match",
    [
        ({"assistant": 0.1}, "policy's own actions"),
        ({"tool": -0.1}, "< 0"),
        ({"tool": float("nan")}, "finite"),
        ({"tool": True}, "finite number"),
        ({"tool": "0.1"}, "finite number"),
        ({"tool": 1e-60}, "0 in float32"),
        ({"": 0.1}, "non-empty"),
        ({3: 0.1}, "non-empty"),
        ([("tool", 0.1)], "mapping"),
    ],
)
def test_bad_alphas(alphas, match):
    with pytest.raises(ValueError, match=match):
        check_alphas(alphas)
    with pytest.raises(ValueError, match=match):
        echo_streams([], [], alphas)


def test_default_alphas_and_config_dict():
    assert dict(DEFAULT_ALPHAS) == {"tool": 0.1}
    ml_collections = pytest.importorskip("ml_collections")
    assert check_alphas(ml_collections.ConfigDict({"tool": 1, "user": 0.5})) == {"tool": 1.0, "user": 0.5}


def test_echo_streams_argument_errors():
    s = Step([1], [2, 3, 4], ("q", 0), loss_mask=[1, 0, 1])
    with pytest.raises(ValueError, match="roles has 2 entries but there are 1 samples"):
        echo_streams([s], [[None] * 3, [None] * 3], {"tool": 1.0})
    with pytest.raises(ValueError, match="has 2 entries but the sample has 3 response tokens"):
        echo_streams([s], [[None, "tool"]], {"tool": 1.0})
    with pytest.raises(ValueError, match="holds 7"):
        echo_streams([s], [[None, 7, None]], {"tool": 1.0})
    with pytest.raises(ValueError, match="response token 2 role 'tool'.*trainable action token"):
        echo_streams([s], [[None, None, "tool"]], {"tool": 1.0})
    # a role with alpha 0 on an action token is not a clash; unlisted roles are ignored
    out = echo_streams([s], [["user", "system", None]], {"user": 0.0})
    assert out.loss_mask[0].tolist() == [1, 0, 1] and out.metrics["echo/tokens"] == 0


# ------------------------------------------------------------------------------------------------
# property test: random linear conversations, roles known by construction
# ------------------------------------------------------------------------------------------------
ROLES = [None, "tool", "user", "system", "assistant"]


@st.composite
def conversations(draw):
    """Segments (tokens, role, kind) of a linear multi-turn trajectory and per-turn masks."""
    turns = draw(st.integers(1, 4))
    prompt = [
        (draw(st.lists(st.integers(0, 99), min_size=1, max_size=4)), draw(st.sampled_from(ROLES)), "env")
    ]
    segments = list(prompt)
    masks = []
    for t in range(turns):
        if t:  # environment segments between turns (possibly none: an empty gap)
            for _ in range(draw(st.integers(0, 3))):
                toks = draw(st.lists(st.integers(0, 99), min_size=1, max_size=4))
                segments.append((toks, draw(st.sampled_from(ROLES)), "env"))
        n = draw(st.integers(1, 3))
        segments.append((draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)), "assistant", f"turn{t}"))
        masks.append(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    return segments, masks


@pytest.mark.filterwarnings("ignore::rljax.data.validate.AllMaskedWarning")
@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    conv=conversations(),
    alphas=st.dictionaries(st.sampled_from(ROLES[1:4]), st.just(0.0) | st.floats(1e-6, 2)),
)
def test_random_conversations_match_reference(conv, alphas):
    segments, masks = conv
    # steps: turn t's prompt is every segment before its response
    steps, ids, roles, kinds = [], [], [], []
    for toks, role, kind in segments:
        if kind != "env":
            t = int(kind[4:])
            steps.append(
                Step(
                    list(ids),
                    toks,
                    ("p", 0),
                    loss_mask=masks[t],
                    is_last_step=False,
                    prompt_roles=list(roles),
                )
            )
        ids += toks
        roles += [role] * len(toks)
        kinds += [kind] * len(toks)
    steps[-1] = steps[-1].replace(is_last_step=True)
    plan, merged, got_roles = merged_with_roles(steps)
    assert len(merged) == 1
    out = echo_streams(merged, got_roles, alphas)

    # reference: the response region is everything after the first prompt
    start = len(steps[0].prompt_ids)
    flat_masks = [m for ms in masks for m in ms]
    trainable = any(flat_masks)
    ref_lm, ref_rl, ref_ce, it = [], [], [], iter(flat_masks)
    for role, kind in zip(roles[start:], kinds[start:], strict=True):
        if kind == "env":
            a = alphas.get(role, 0.0) if trainable else 0.0
            ref_lm.append(int(a > 0))
            ref_rl.append(0.0)
            ref_ce.append(a if a > 0 else 0.0)
        else:
            m = next(it)
            ref_lm.append(m)
            ref_rl.append(float(m))
            ref_ce.append(0.0)
    assert out.loss_mask[0].tolist() == ref_lm
    assert out.rl_weights[0].tolist() == ref_rl
    np.testing.assert_allclose(out.ce_weights[0], np.asarray(ref_ce, np.float32))
    assert out.metrics["echo/tokens"] == sum(c > 0 for c in ref_ce)


# ------------------------------------------------------------------------------------------------
# the rollout records prompt_roles; echo on a real rollout selects the tool results
# ------------------------------------------------------------------------------------------------
class FakeEngine:
    """Turn 0: the right lookup call; turn 1: the tool's answer (read from the prompt text)."""

    def __init__(self, renderer):
        self.renderer = renderer
        self.turns = {}

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        await asyncio.sleep(0)
        turn = self.turns[session_id] = self.turns.get(session_id, -1) + 1
        text = self.renderer.decode(prompt_ids)
        if turn == 0:
            key = text.rsplit("What color is the ", 1)[1].split("?", 1)[0]
            reply = CALL.replace("zorblax", key)
        else:
            reply = text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
        ids = enc(reply) + [IM_END]
        return Completion(tuple(ids), tuple([-0.25] * len(ids)), "stop", 3)


@pytest.mark.parametrize("bridge", [True, False])
def test_rollout_steps_carry_roles_and_echo_finds_tool_results(bridge):
    renderer = Qwen3Renderer(TOK)
    tasks = make_lookup_tasks(2, seed=4)
    result = run_rollout(
        tasks,
        engine=FakeEngine(renderer),
        renderer=renderer,
        make_env=ToolLookupEnv,
        config=RolloutConfig(group_size=2, bridge=bridge, max_turns=8, max_context_len=4096),
    )
    batch = result.batch
    assert len(batch) == 8
    for step in batch:
        assert step.prompt_roles is not None and len(step.prompt_roles) == len(step.prompt_ids)
        assert {"system", "user"} <= set(step.prompt_roles)
    plan = plan_merge(batch.steps)
    merged = merge_steps(batch)
    streams = echo_streams(merged, response_roles(plan, batch.steps), {"tool": 0.1})
    answers = {t.id: t.data["answer"] for t in tasks}
    assert len(merged) == 4  # canonical completions: full renders extend the previous turn too
    for sample, ce in zip(merged, streams.ce_weights, strict=True):
        answer = enc(answers[sample.trajectory_id.instance_id])
        response = list(sample.response_ids)
        first = next(i for i in range(len(response)) if response[i : i + len(answer)] == answer)
        assert np.flatnonzero(ce).tolist() == list(range(first, first + len(answer)))
        assert np.allclose(ce[first : first + len(answer)], 0.1)
    assert streams.metrics["echo/samples_with_echo"] == 4


# ------------------------------------------------------------------------------------------------
# the streams through pack + the objective: rl on actions, alpha * -logp on echo tokens
# ------------------------------------------------------------------------------------------------
def test_objective_with_echo_streams_matches_float64_reference():
    rng = np.random.default_rng(0)
    convs = [converse(ChatMLRenderer(TOK)), converse(ChatMLRenderer(TOK), masks=[1, 0, 1])]
    steps = [s.replace(trajectory_id=TrajectoryID("conv", r)) for r, c in enumerate(convs) for s in c]
    batch = StepBatch(steps)
    plan = plan_merge(batch.steps)
    merged = merge_steps(batch)
    alphas = {"tool": 0.2, "user": 0.7}
    streams = echo_streams(merged, response_roles(plan, batch.steps), alphas)
    step_adv = [np.full(len(s.response_ids), rng.normal()) * np.asarray(s.loss_mask) for s in steps]
    adv = plan.merge_arrays(step_adv)
    samples = [s.replace(loss_mask=m.tolist()) for s, m in zip(merged, streams.loss_mask, strict=True)]
    # logp: the inference logprob on sampled tokens (dppo loss = -A there), random elsewhere
    logp = [
        np.where(
            np.asarray(s.loss_mask) == 1,
            np.asarray(s.response_logprobs),
            -rng.uniform(0.1, 3, len(s.loss_mask)),
        )
        for s in merged
    ]
    packed = pack(
        samples,
        seq_len=512,
        advantages=adv,
        rl_weights=streams.rl_weights,
        ce_weights=streams.ce_weights,
        ref_logprobs=logp,  # carries the test's logp into the packed layout
    ).batch
    config = ObjectiveConfig(components=("rl", "ce"), policy_loss_kwargs={"kl_tau": 0.0})
    loss, metrics = objective(packed.ref_logprobs, packed, global_counts(packed, config), config)

    # float64 reference from the independently located env tokens
    rl_sum = rl_n = ce_sum = ce_n = 0.0
    for k, sample in enumerate(merged):
        first_prompt = len(steps[plan.samples[k][0]].prompt_ids)
        env = expected_env_positions(sample, first_prompt, ENV_MESSAGES)
        for t in range(len(sample.response_ids)):
            if sample.loss_mask[t]:
                rl_sum += -float(adv[k][t])
                rl_n += 1
            elif t in env:
                ce_sum += alphas[env[t]] * -float(logp[k][t])
                ce_n += 1
    assert metrics["tokens/ce"] == ce_n == sum(len(enc(m["content"])) for m in ENV_MESSAGES) * 2
    assert metrics["tokens/rl"] == rl_n
    np.testing.assert_allclose(float(metrics["loss/ce"]), ce_sum / ce_n, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss/rl"]), rl_sum / rl_n, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(loss), rl_sum / rl_n + ce_sum / ce_n, rtol=1e-5, atol=1e-6)
