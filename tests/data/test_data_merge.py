"""Tests of rljax.data.merge: design §2.5 reference cases, an independent naive reference, properties."""

from __future__ import annotations

import copy
from collections import defaultdict

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from rljax.data import StepBatch
from rljax.data.merge import MergePlan, merge_metrics, merge_steps, plan_merge
from rljax.types import Step, TrajectoryID


def _traj(prompts, responses, *, masks=None, logprobs=None, rewards=None, tid=("q", 0), **kw):
    """Builds the steps of one trajectory (is_last_step on the final one)."""
    n = len(prompts)
    return [
        Step(
            prompt_ids=prompts[i],
            response_ids=responses[i],
            loss_mask=None if masks is None else masks[i],
            response_logprobs=None if logprobs is None else logprobs[i],
            reward=0.0 if rewards is None else rewards[i],
            trajectory_id=tid,
            is_last_step=i == n - 1,
            **kw,
        )
        for i in range(n)
    ]


# ----------------------------------------------------------------------------------------
# design §2.5 reference cases
# ----------------------------------------------------------------------------------------


def test_spec_case_1_gap_tokens_masks_logprobs_rewards():
    b = StepBatch(
        _traj(
            [[10], [10, 20, 30]],
            [[20], [40, 41]],
            masks=[[1], [1, 1]],
            logprobs=[[-0.5], [-0.3, -0.4]],
            rewards=[[1.0], [0.0, 5.0]],
        )
    )
    m = merge_steps(b)
    assert len(m) == 1
    s = m[0]
    assert list(s.prompt_ids) == [10]
    assert list(s.response_ids) == [20, 30, 40, 41]
    assert list(s.loss_mask) == [1, 0, 1, 1]
    np.testing.assert_array_equal(s.response_logprobs, [-0.5, 0.0, -0.3, -0.4])
    np.testing.assert_array_equal(s.reward, [1.0, 0.0, 0.0, 5.0])
    assert s.is_last_step


def test_spec_case_2_three_turn_chain():
    m = merge_steps(StepBatch(_traj([[1], [1, 2, 3], [1, 2, 3, 4, 5]], [[2], [4], [6]])))
    assert len(m) == 1
    assert list(m[0].prompt_ids) == [1]
    assert list(m[0].response_ids) == [2, 3, 4, 5, 6]
    assert list(m[0].loss_mask) == [1, 0, 1, 0, 1]


def test_spec_case_3_no_prefix_no_merge():
    m = merge_steps(StepBatch(_traj([[10], [99, 88]], [[20], [30]])))
    assert len(m) == 2
    assert [s.is_last_step for s in m] == [False, True]
    assert [list(s.prompt_ids) for s in m] == [[10], [99, 88]]


def test_spec_case_4_overlap_shorter_prompt_never_merges():
    # prompt [10, 20] is shorter than the running [10, 20, 30] although prompt+response extends it.
    m = merge_steps(StepBatch(_traj([[10], [10, 20]], [[20, 30], [30, 40]])))
    assert len(m) == 2
    assert [list(s.response_ids) for s in m] == [[20, 30], [30, 40]]


def test_spec_case_5_branch_then_continue_new_branch():
    m = merge_steps(
        StepBatch(_traj([[1], [1, 2, 3], [1, 23, 4, 5], [1, 23, 4, 5, 6, 7]], [[2], [4], [6], [8]]))
    )
    assert len(m) == 2
    assert (list(m[0].prompt_ids), list(m[0].response_ids), m[0].is_last_step) == ([1], [2, 3, 4], False)
    assert (list(m[1].prompt_ids), list(m[1].response_ids), m[1].is_last_step) == (
        [1, 23, 4, 5],
        [6, 7, 8],
        True,
    )
    assert list(m[1].loss_mask) == [1, 0, 1]


# ----------------------------------------------------------------------------------------
# Longest prefix, open samples, ordering
# ----------------------------------------------------------------------------------------


def test_longest_open_prefix_wins():
    # A = [1, 2]; B = [1] + [2, 3, 4] (prompt shorter than A: new sample). Turn 3's prompt extends both;
    # B is longer, so B takes it.
    m = merge_steps(StepBatch(_traj([[1], [1], [1, 2, 3, 4, 5]], [[2], [2, 3, 4], [6]])))
    assert len(m) == 2
    assert list(m[0].response_ids) == [2]  # A untouched
    assert list(m[1].response_ids) == [2, 3, 4, 5, 6]
    assert list(m[1].loss_mask) == [1, 1, 1, 0, 1]


def test_context_reset_returns_to_older_sample_and_final_sample_is_last():
    # main agent (turn 0), sub-agent with a fresh context (turn 1), main agent again (turn 2).
    m = merge_steps(StepBatch(_traj([[1], [7], [1, 2, 3]], [[2], [8], [4]])))
    assert [list(s.prompt_ids) for s in m] == [[7], [1]]  # ordered by last merged turn
    assert list(m[1].response_ids) == [2, 3, 4]
    assert [s.is_last_step for s in m] == [False, True]


def test_interleaved_trajectories_merge_like_separate_ones():
    a = _traj([[1], [1, 2, 3], [1, 2, 3, 4, 5]], [[2], [4], [6]], tid=("q", 0))
    b = _traj([[9], [9, 8, 7]], [[8], [6]], tid=("q", 1))
    inter = StepBatch([a[0], b[0], a[1], b[1], a[2]])
    m = merge_steps(inter)
    assert len(m) == 2
    by_tid = {s.trajectory_id: s for s in m}
    assert list(by_tid[TrajectoryID("q", 0)].response_ids) == [2, 3, 4, 5, 6]
    assert list(by_tid[TrajectoryID("q", 1)].response_ids) == [8, 7, 6]
    assert all(s.is_last_step for s in m)
    # Same ids in the same prompt positions of two trajectories never merge across trajectories.
    c = _traj([[1]], [[2]], tid=("q", 2))
    d = _traj([[1, 2, 3]], [[4]], tid=("q", 3))
    assert len(merge_steps(StepBatch(c + d))) == 2


def test_equal_length_prompt_merges_with_empty_gap():
    m = merge_steps(StepBatch(_traj([[1], [1, 2]], [[2], [3]])))
    assert list(m[0].response_ids) == [2, 3]
    assert list(m[0].loss_mask) == [1, 1]


def test_fields_of_merged_sample():
    steps = [
        Step([5], [6], ("g", 3), is_last_step=False, stop_reason="tool_call", policy_version=4, env="e"),
        Step([5, 6, 7], [8], ("g", 3), is_last_step=True, stop_reason="length", policy_version=2, env="e"),
    ]
    s = merge_steps(StepBatch(steps))[0]
    assert s.trajectory_id == TrajectoryID("g", 3)
    assert s.stop_reason == "length"
    assert s.policy_version == 2
    assert s.env == "e"


def test_incompatible_turns_do_not_merge():
    # different temperature
    t = _traj([[1], [1, 2, 3]], [[2], [4]])
    t = [t[0], t[1].replace(temperature=0.5)]
    assert len(merge_steps(StepBatch(t))) == 2
    # logprobs present on one turn only
    u = _traj([[1], [1, 2, 3]], [[2], [4]], logprobs=[[-1.0], [-1.0]])
    u = [u[0], u[1].replace(response_logprobs=None)]
    assert len(merge_steps(StepBatch(u))) == 2


def test_input_untouched_and_numpy_inputs():
    steps = _traj(
        [np.array([1]), np.array([1, 2, 3])],
        [np.array([2]), np.array([4])],
        masks=[np.array([1]), np.array([0])],
        logprobs=[np.array([-0.1]), np.array([-0.2])],
    )
    b = StepBatch(steps)
    snapshot = copy.deepcopy(b.to_generator_output())
    m = merge_steps(b)
    assert list(m[0].response_ids) == [2, 3, 4]
    assert all(type(x) is int for x in m[0].response_ids)
    assert list(m[0].loss_mask) == [1, 0, 0]
    after = b.to_generator_output()
    for key, value in snapshot.items():
        assert repr(after[key]) == repr(value), key
    assert len(b) == 2


def test_metrics_count_samples_and_trained_tokens():
    b = StepBatch(_traj([[1], [1, 2, 3], [1, 2, 3, 4, 5]], [[2], [4], [6]]))
    met = merge_metrics(b, merge_steps(b))
    # before: (1+1) + (3+1) + (5+1) = 12; after: 1 + 5 = 6
    assert met["num_samples_before_merge"] == 3
    assert met["num_samples_after_merge"] == 1
    assert met["trained_tokens_before_merge"] == 12
    assert met["trained_tokens_after_merge"] == 6
    assert met["merge_token_ratio"] == pytest.approx(0.5)


def test_merge_plan_merge_arrays_matches_merged_streams():
    steps = _traj([[1], [1, 2, 3], [1, 23, 4, 5], [1, 23, 4, 5, 6, 7]], [[2], [4], [6], [8]])
    plan = plan_merge(steps)
    assert plan.samples == ((0, 1), (2, 3))
    assert plan.gaps == ((0, 1), (0, 1))
    adv = plan.merge_arrays([[0.5], [1.5], [2.5], [3.5]], fill=-9.0)
    np.testing.assert_array_equal(adv[0], [0.5, -9.0, 1.5])
    np.testing.assert_array_equal(adv[1], [2.5, -9.0, 3.5])
    with pytest.raises(ValueError, match="one per-token array per input step"):
        plan.merge_arrays([[0.5]])
    assert MergePlan(samples=(), gaps=(), num_steps=0).merge_arrays([]) == []


# ----------------------------------------------------------------------------------------
# Scalar rewards: outcome-mode advantages unchanged by merging (hand computation)
# ----------------------------------------------------------------------------------------


def _outcome_token_advantages(steps):
    """Independent design §2.3 reference: R_j = last step's reward, A_j = R_j - mean over the group
    (grpo without std), each step gets A_j * its own loss mask."""
    last_reward = {s.trajectory_id: s.total_reward for s in steps if s.is_last_step}
    groups = defaultdict(list)
    for tid, r in last_reward.items():
        groups[tid.instance_id].append(r)
    adv = {tid: r - np.mean(groups[tid.instance_id]) for tid, r in last_reward.items()}
    return [adv[s.trajectory_id] * np.asarray(s.loss_mask, dtype=np.float64) for s in steps]


def test_scalar_reward_is_last_turn_reward_and_outcome_advantages_unchanged():
    # Trajectory 0: two turns (rewards 0.3 then 1.0), trajectory 1: one turn (reward 0.0). Same group.
    t0 = _traj([[1], [1, 2, 5, 3]], [[2, 5], [4]], masks=[[1, 1], [1]], rewards=[0.3, 1.0], tid=("q", 0))
    t1 = _traj([[1]], [[9, 9]], rewards=[0.0], tid=("q", 1))
    b = StepBatch(t0 + t1)
    m = merge_steps(b)
    merged = {s.trajectory_id: s for s in m}
    assert merged[TrajectoryID("q", 0)].reward == 1.0
    # Hand computation: R = [1.0, 0.0], mean 0.5 -> A = [+0.5, -0.5].
    # Before merging: step 0 tokens [0.5, 0.5], step 1 [0.5]; step of t1 [-0.5, -0.5].
    before = _outcome_token_advantages(list(b))
    np.testing.assert_allclose(before[0], [0.5, 0.5])
    np.testing.assert_allclose(before[1], [0.5])
    # After merging: response [2, 5, 3, 4], gap token 3 has mask 0 -> [0.5, 0.5, 0, 0.5].
    after = _outcome_token_advantages(list(m))
    i0 = [s.trajectory_id for s in m].index(TrajectoryID("q", 0))
    np.testing.assert_allclose(after[i0], [0.5, 0.5, 0.0, 0.5])
    np.testing.assert_allclose(after[1 - i0], [-0.5, -0.5])
    # Every trainable token keeps its advantage: merge the per-step arrays and compare.
    carried = plan_merge(list(b)).merge_arrays(before)
    np.testing.assert_allclose(np.concatenate(carried), np.concatenate(after))


# ----------------------------------------------------------------------------------------
# Independent naive reference and properties
# ----------------------------------------------------------------------------------------


def _naive_merge(steps):
    """Straightforward token-by-token implementation of design §2.5 (with the documented decisions)."""
    samples = []  # dicts
    open_by = defaultdict(list)
    for pos, s in enumerate(steps):
        prompt = [int(x) for x in s.prompt_ids]
        best = None
        for cand in open_by[s.trajectory_id]:
            full = cand["prompt"] + cand["response"]
            if len(full) > len(prompt) or cand["temperature"] != s.temperature:
                continue
            if (cand["lp"] is None) != (s.response_logprobs is None):
                continue
            if all(prompt[t] == full[t] for t in range(len(full))):
                if best is None or len(full) > len(best["prompt"] + best["response"]):
                    best = cand
        resp = [int(x) for x in s.response_ids]
        mask = [int(x) for x in s.loss_mask]
        lp = None if s.response_logprobs is None else [float(x) for x in s.response_logprobs]
        rew = list(s.reward) if s.per_token_reward else None
        if best is None:
            cand = dict(
                prompt=prompt, response=resp, mask=mask, lp=lp, rew=rew, scalar=s.reward,
                last=s.is_last_step, stop=s.stop_reason, tid=s.trajectory_id, temperature=s.temperature,
                pos=pos,
            )  # fmt: skip
            open_by[s.trajectory_id].append(cand)
            samples.append(cand)
            continue
        gap = prompt[len(best["prompt"]) + len(best["response"]) :]
        for tok in gap:
            best["response"].append(tok)
            best["mask"].append(0)
            if best["lp"] is not None:
                best["lp"].append(0.0)
            if best["rew"] is not None:
                best["rew"].append(0.0)
        best["response"] += resp
        best["mask"] += mask
        if best["lp"] is not None:
            best["lp"] += lp
        if best["rew"] is not None:
            best["rew"] += rew
        best["scalar"] = s.reward
        best["last"] = best["last"] or s.is_last_step
        best["stop"] = s.stop_reason
        best["pos"] = pos
    return sorted(samples, key=lambda c: c["pos"])


@st.composite
def _batches(draw, per_token=None):
    """Random multi-turn trajectories (extensions, context resets, returns to older contexts, overlaps,
    shorter prompts, temperature changes) with interleaved trajectories. Response logprobs are unique
    tags so each response token can be traced."""
    tok = st.integers(0, 4)  # tiny alphabet: accidental prefixes are frequent
    per_token = draw(st.booleans()) if per_token is None else per_token
    tag = iter(range(1, 10_000))
    trajs = []
    for j in range(draw(st.integers(1, 4))):
        fulls, steps = [], []
        n_turns = draw(st.integers(1, 6))
        for t in range(n_turns):
            kind = (
                draw(st.sampled_from(["extend", "old", "reset", "overlap", "shorter"])) if fulls else "reset"
            )
            if kind == "extend":
                prompt = fulls[-1] + draw(st.lists(tok, max_size=3))
            elif kind == "old":
                prompt = draw(st.sampled_from(fulls)) + draw(st.lists(tok, max_size=3))
            elif kind == "reset":
                prompt = draw(st.lists(tok, min_size=1, max_size=4))
            elif kind == "overlap":
                prompt = fulls[-1][: max(1, len(fulls[-1]) - 1)]
            else:
                f = draw(st.sampled_from(fulls))
                prompt = f[: draw(st.integers(1, len(f)))]
            response = draw(st.lists(tok, min_size=0, max_size=3))
            fulls.append(prompt + response)
            steps.append(
                Step(
                    prompt_ids=prompt,
                    response_ids=response,
                    loss_mask=draw(
                        st.lists(st.integers(0, 1), min_size=len(response), max_size=len(response))
                    ),
                    response_logprobs=[-next(tag) / 1024 for _ in response],
                    reward=[float(draw(st.integers(-2, 2))) for _ in response]
                    if per_token
                    else float(draw(st.integers(-2, 2))),
                    trajectory_id=(f"q{j % 2}", j),
                    is_last_step=t == n_turns - 1,
                    stop_reason=f"s{t}",
                    temperature=draw(st.sampled_from([1.0, 1.0, 1.0, 0.5])),
                )
            )
        trajs.append(steps)
    labels = [j for j, s in enumerate(trajs) for _ in s]
    order = draw(st.permutations(labels))
    cursor = [0] * len(trajs)
    out = []
    for j in order:
        out.append(trajs[j][cursor[j]])
        cursor[j] += 1
    return out


@pytest.mark.filterwarnings("ignore::rljax.data.validate.AllMaskedWarning")
@settings(max_examples=150, deadline=None)
@given(_batches())
def test_matches_naive_reference(steps):
    merged = merge_steps(StepBatch(steps))
    ref = _naive_merge(steps)
    assert len(merged) == len(ref)
    for s, r in zip(merged, ref, strict=True):
        assert s.trajectory_id == r["tid"]
        assert list(s.prompt_ids) == r["prompt"]
        assert list(s.response_ids) == r["response"]
        assert list(s.loss_mask) == r["mask"]
        assert list(s.response_logprobs) == r["lp"]
        if r["rew"] is not None:
            assert list(s.reward) == r["rew"]
        else:
            assert s.reward == r["scalar"]
        assert s.is_last_step == r["last"]
        assert s.stop_reason == r["stop"]


@pytest.mark.filterwarnings("ignore::rljax.data.validate.AllMaskedWarning")
@settings(max_examples=150, deadline=None)
@given(_batches())
def test_every_response_token_once_and_only_exact_prefix_merges(steps):
    merged = merge_steps(StepBatch(steps))
    tags = {}
    for i, s in enumerate(steps):
        for t, lp in enumerate(s.response_logprobs):
            tags[lp] = (i, t)
    seen = set()
    for s in merged:
        lp = np.asarray(s.response_logprobs)
        full = list(s.prompt_ids) + list(s.response_ids)
        n_prompt = len(s.prompt_ids)
        # Each traced token keeps its id and mask; gap tokens carry logprob 0 and mask 0.
        for t, v in enumerate(lp.tolist()):
            if v == 0.0:
                assert s.loss_mask[t] == 0
                continue
            i, k = tags[v]
            assert v not in seen
            seen.add(v)
            assert s.response_ids[t] == steps[i].response_ids[k]
            assert s.loss_mask[t] == steps[i].loss_mask[k]
        # Reconstruct the member steps (first token position of each response segment) and check that
        # every member's prompt is EXACTLY the merged sequence before its response.
        members = sorted({tags[v][0] for v in lp.tolist() if v != 0.0})
        for i in members:
            st_ = steps[i]
            if not st_.response_ids:
                continue
            start = n_prompt + int(np.flatnonzero(lp == st_.response_logprobs[0])[0])
            assert full[:start] == list(st_.prompt_ids)
            assert full[start : start + len(st_.response_ids)] == list(st_.response_ids)
    assert seen == set(tags)
    # One last sample per trajectory, and it is that trajectory's last sample in the output.
    last_pos = {s.trajectory_id: k for k, s in enumerate(merged)}
    assert [k for k, s in enumerate(merged) if s.is_last_step] == sorted(last_pos.values())
    assert sum(len(s.prompt_ids) + len(s.response_ids) for s in merged) <= sum(
        len(s.prompt_ids) + len(s.response_ids) for s in steps
    )


@pytest.mark.filterwarnings("ignore::rljax.data.validate.AllMaskedWarning")
@settings(max_examples=25, deadline=None)
@given(_batches(per_token=False), st.sampled_from(["grpo", "rloo", "max_rl"]))
def test_outcome_advantages_identical_through_the_real_estimators(steps, estimator):
    """StepBatch.step_advantages (the core estimators) before merging, carried through the merge plan,
    equals step_advantages computed on the merged batch: merging never changes an outcome advantage."""
    batch = StepBatch(steps)
    merged = merge_steps(batch)
    before = batch.step_advantages(estimator)
    after = merged.step_advantages(estimator)
    carried = plan_merge(steps).merge_arrays(before)
    assert len(carried) == len(after)
    for c, a in zip(carried, after, strict=True):
        np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-6)
