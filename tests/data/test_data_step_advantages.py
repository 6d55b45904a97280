"""Tests for rljax.data.step_advantages (host glue of design §2.3 / §2.4)."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.core import advantages as core_adv
from rljax.core import segments
from rljax.data import StepBatch
from rljax.data import step_advantages as sa
from rljax.data.step_advantages import compute_step_advantages
from rljax.types import Step, TrajectoryID

# ------------------------------------------------------------------------------------------
# independent float64 references
# ------------------------------------------------------------------------------------------


def ref_group_adv(name, vals, norm_by_std=True, eps=1e-6):
    vals = np.asarray(vals, np.float64)
    n = vals.size
    if n < 2 or np.all(vals == vals[0]):
        return np.zeros(n)
    mean = vals.mean()
    if name == "grpo":
        return (vals - mean) / (np.std(vals, ddof=1) + eps) if norm_by_std else vals - mean
    if name == "rloo":
        return np.array([vals[i] - np.delete(vals, i).mean() for i in range(n)])
    if name == "max_rl":
        return (vals - mean) / mean if mean > 0 else np.zeros(n)
    raise AssertionError(name)


def ref_outcome(steps, name, **kw):
    """Per step: A_j * loss_mask with R_j = total reward of the last step of trajectory j."""
    reward = {s.trajectory_id: s.total_reward for s in steps if s.is_last_step}
    groups: dict[str, list[TrajectoryID]] = {}
    for tid in reward:
        groups.setdefault(tid.instance_id, []).append(tid)
    adv = {}
    for members in groups.values():
        for tid, a in zip(members, ref_group_adv(name, [reward[t] for t in members], **kw), strict=True):
            adv[tid] = a
    return [adv[s.trajectory_id] * np.asarray(s.loss_mask, np.float64) for s in steps]


def turn_indices(steps):
    seen: dict[TrajectoryID, int] = {}
    out = []
    for s in steps:
        out.append(seen.get(s.trajectory_id, 0))
        seen[s.trajectory_id] = out[-1] + 1
    return out


def ref_per_step(steps, name, gamma_turn, **kw):
    turns = turn_indices(steps)
    by_traj: dict[TrajectoryID, dict[int, float]] = {}
    for s, k in zip(steps, turns, strict=True):
        by_traj.setdefault(s.trajectory_id, {})[k] = s.total_reward
    ret = [
        sum(gamma_turn ** (i - k) * r for i, r in by_traj[s.trajectory_id].items() if i >= k)
        for s, k in zip(steps, turns, strict=True)
    ]
    groups: dict[tuple[str, int], list[int]] = {}
    for idx, (s, k) in enumerate(zip(steps, turns, strict=True)):
        groups.setdefault((s.trajectory_id.instance_id, k), []).append(idx)
    adv = np.zeros(len(steps))
    for members in groups.values():
        adv[members] = ref_group_adv(name, [ret[i] for i in members], **kw)
    return [adv[i] * np.asarray(s.loss_mask, np.float64) for i, s in enumerate(steps)]


# ------------------------------------------------------------------------------------------
# batch builders
# ------------------------------------------------------------------------------------------


def make_trajectories(seed, *, equal_turns=False, last_only=False, min_response=0):
    """List of trajectories (each a list of Steps in turn order) with random shapes."""
    rng = np.random.default_rng(seed)
    trajs = []
    for inst in range(int(rng.integers(2, 5))):
        reps = int(rng.choice([1, 2, 3, 4]))
        turns_inst = int(rng.integers(1, 4))
        for rep in range(reps):
            t = turns_inst if equal_turns else int(rng.integers(1, 4))
            steps = []
            for k in range(t):
                n = int(rng.integers(min_response, 7))
                mask = (rng.random(n) < 0.7).astype(int).tolist()
                last = k == t - 1
                reward = float(rng.integers(0, 3)) if last else (0.0 if last_only else float(rng.normal()))
                steps.append(
                    Step(
                        prompt_ids=rng.integers(0, 50, int(rng.integers(1, 5))).tolist(),
                        response_ids=rng.integers(0, 50, n).tolist(),
                        trajectory_id=TrajectoryID(f"q{inst}", rep),
                        loss_mask=mask,
                        reward=reward,
                        is_last_step=last,
                    )
                )
            trajs.append(steps)
    return trajs


def interleave(trajs, seed):
    """A random interleaving of the trajectories (turn order kept within each trajectory)."""
    rng = np.random.default_rng(seed)
    owners = np.concatenate([np.full(len(t), j) for j, t in enumerate(trajs)])
    rng.shuffle(owners)
    cursor = [0] * len(trajs)
    out = []
    for j in owners:
        out.append(trajs[j][cursor[j]])
        cursor[j] += 1
    return out


def contiguous(trajs):
    return [s for t in trajs for s in t]


def assert_steps_close(got, expected, atol=2e-5):
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=atol)


# ------------------------------------------------------------------------------------------


def test_dense_ids_and_buckets():
    ids, n = sa.dense_ids([("a", 1), ("b", 0), ("a", 1), ("c", 2), ("b", 0)])
    np.testing.assert_array_equal(ids, [0, 1, 0, 2, 1])
    assert n == 3 and ids.dtype == np.int32
    assert sa.dense_ids([])[1] == 0
    assert [sa.bucket_size(n) for n in (0, 1, 8, 9, 33)] == [8, 8, 8, 16, 64]


@pytest.mark.parametrize(
    "name,kw", [("grpo", {}), ("grpo", {"norm_by_std": False}), ("rloo", {}), ("max_rl", {})]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_outcome_vs_reference_on_interleaved_batches(name, kw, seed):
    steps = interleave(make_trajectories(seed), seed + 100)
    got = StepBatch(steps).step_advantages(name, **kw)
    assert_steps_close(got, ref_outcome(steps, name, **kw))


def test_skyrl_1492_earlier_steps_get_the_advantage_on_all_their_tokens():
    # trajectory q#0 has 3 steps; the earlier ones have LONGER and different masks than the last
    tid0, tid1 = TrajectoryID("q", 0), TrajectoryID("q", 1)
    steps = [
        Step([1], [5, 6, 7, 8, 9], tid0, loss_mask=[1, 1, 1, 1, 1], reward=0.0, is_last_step=False),
        Step([1], [5, 6, 7, 8], tid0, loss_mask=[0, 1, 1, 1], reward=0.0, is_last_step=False),
        Step([1], [5, 6], tid0, loss_mask=[1, 0], reward=1.0, is_last_step=True),
        Step([1], [5, 6, 7], tid1, loss_mask=[1, 1, 1], reward=0.0, is_last_step=True),
    ]
    got = StepBatch(steps).step_advantages("grpo", norm_by_std=False)
    expected = [[0.5] * 5, [0.0, 0.5, 0.5, 0.5], [0.5, 0.0], [-0.5, -0.5, -0.5]]
    assert_steps_close(got, expected, atol=0)


def test_outcome_ignores_rewards_of_earlier_steps():
    tid0, tid1 = TrajectoryID("q", 0), TrajectoryID("q", 1)
    steps = [
        Step([1], [2], tid0, reward=100.0, is_last_step=False),
        Step([1], [2], tid0, reward=1.0),
        Step([1], [2], tid1, reward=-50.0, is_last_step=False),
        Step([1], [2], tid1, reward=0.0),
    ]
    got = sa.compute_step_advantages(StepBatch(steps), "rloo")
    assert_steps_close(got, [[1.0], [1.0], [-1.0], [-1.0]], atol=0)


def test_per_token_rewards_are_summed():
    steps = [
        Step([1], [2, 3], TrajectoryID("q", 0), reward=[0.5, 0.5]),
        Step([1], [2, 3], TrajectoryID("q", 1), reward=[0.0, -1.0]),
    ]
    got = sa.compute_step_advantages(steps, "grpo", norm_by_std=False)  # a plain list is validated too
    assert_steps_close(got, [[1.0, 1.0], [-1.0, -1.0]], atol=0)


def test_interleaved_equals_contiguous():
    trajs = make_trajectories(7)
    a = contiguous(trajs)
    b = interleave(trajs, 3)
    assert [id(s) for s in a] != [id(s) for s in b]
    for mode, kw in (("outcome", {}), ("per_step", {"gamma_turn": 0.8})):
        got_a = dict(
            zip(map(id, a), StepBatch(a).step_advantages("grpo", reward_mode=mode, **kw), strict=True)
        )
        got_b = dict(
            zip(map(id, b), StepBatch(b).step_advantages("grpo", reward_mode=mode, **kw), strict=True)
        )
        for k, v in got_a.items():
            np.testing.assert_allclose(got_b[k], v, rtol=1e-6, atol=1e-6)


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
    batch_seed=st.integers(0, 10_000),
    perm_seed=st.integers(0, 10_000),
    mode=st.sampled_from(["outcome", "per_step"]),
    name=st.sampled_from(["grpo", "rloo", "max_rl"]),
)
def test_any_step_permutation_leaves_advantages_unchanged(batch_seed, perm_seed, mode, name):
    trajs = make_trajectories(batch_seed)
    base = contiguous(trajs)
    perm = interleave(trajs, perm_seed)  # every valid reordering (turn order within a trajectory kept)
    ref = dict(zip(map(id, base), sa.compute_step_advantages(base, name, reward_mode=mode), strict=True))
    got = sa.compute_step_advantages(perm, name, reward_mode=mode)
    for s, g in zip(perm, got, strict=True):
        np.testing.assert_allclose(g, ref[id(s)], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# per-step rewards (design §2.4)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma_turn", [1.0, 0.5])
@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_per_step_vs_reference(name, gamma_turn):
    steps = interleave(make_trajectories(11), 5)
    got = StepBatch(steps).step_advantages(name, reward_mode="per_step", gamma_turn=gamma_turn)
    assert_steps_close(got, ref_per_step(steps, name, gamma_turn))


def test_per_step_hand_values_and_group_of_one_turn():
    a0, a1 = TrajectoryID("a", 0), TrajectoryID("a", 1)
    steps = [
        Step([1], [2], a0, reward=1.0, is_last_step=False),
        Step([1], [2], a1, reward=0.0, is_last_step=False),
        Step([1], [2, 3], a0, reward=2.0, is_last_step=False),
        Step([1], [2], a1, reward=4.0),
        Step([1], [2], a0, reward=8.0),  # turn 2 of a0 has no peer -> group-of-one rule -> 0
    ]
    got = sa.compute_step_advantages(steps, "grpo", norm_by_std=False, reward_mode="per_step", gamma_turn=0.5)
    # G(a0) = [1 + .5*2 + .25*8, 2 + .5*8, 8] = [4, 6, 8]; G(a1) = [0 + .5*4, 4] = [2, 4]
    # turn 0: {4, 2} -> [1, -1]; turn 1: {6, 4} -> [1, -1]; turn 2: {8} -> 0
    assert_steps_close(got, [[1.0], [-1.0], [1.0, 1.0], [-1.0], [0.0]], atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo", "max_rl"])
def test_per_step_equals_outcome_for_terminal_rewards(name):
    # gamma_turn = 1, reward only on last steps, equal turn counts within each group
    steps = interleave(make_trajectories(21, equal_turns=True, last_only=True), 2)
    a = sa.compute_step_advantages(steps, name, reward_mode="outcome")
    b = sa.compute_step_advantages(steps, name, reward_mode="per_step", gamma_turn=1.0)
    assert_steps_close(b, a, atol=1e-5)


# ------------------------------------------------------------------------------------------
# reinforce_pp with per-step rewards
# ------------------------------------------------------------------------------------------


def ref_reinforce_pp_per_step(steps, gamma_turn):
    """Token discount 1: return of a trainable token = later trainable-token rewards of its step
    (scalar reward on the step's last trainable token) + gamma_turn * G_{k+1}; then whitened."""
    turns = turn_indices(steps)
    by_traj: dict[TrajectoryID, dict[int, float]] = {}
    for s, k in zip(steps, turns, strict=True):
        by_traj.setdefault(s.trajectory_id, {})[k] = s.total_reward
    rets = []
    for s, k in zip(steps, turns, strict=True):
        future = sum(gamma_turn ** (i - k) * r for i, r in by_traj[s.trajectory_id].items() if i > k)
        mask = np.asarray(s.loss_mask, bool)
        rew = np.zeros(len(mask))
        if s.per_token_reward:
            rew[:] = s.reward
        else:
            rew[np.flatnonzero(mask)[-1]] = s.reward
        r = np.array([rew[t:][mask[t:]].sum() + future if mask[t] else 0.0 for t in range(len(mask))])
        rets.append((r, mask))
    flat = np.concatenate([r[m] for r, m in rets])
    mean, std = flat.mean(), np.sqrt(flat.var(ddof=1) + 1e-8)
    return [np.where(m, (r - mean) / std, 0.0) for r, m in rets]


@pytest.mark.parametrize("gamma_turn", [1.0, 0.5])
def test_reinforce_pp_per_step_vs_reference(gamma_turn):
    trajs = make_trajectories(31, min_response=1)
    steps = []
    for s in interleave(trajs, 8):
        mask = list(s.loss_mask)
        mask[-1] = 1  # at least one trainable token per step
        steps.append(s.replace(loss_mask=mask))
    got = StepBatch(steps).step_advantages("reinforce_pp", reward_mode="per_step", gamma_turn=gamma_turn)
    assert_steps_close(got, ref_reinforce_pp_per_step(steps, gamma_turn), atol=1e-4)


def test_reinforce_pp_per_token_rewards_hand_values():
    tid = TrajectoryID("q", 0)
    steps = [
        Step([1], [2, 3], tid, loss_mask=[1, 1], reward=[1.0, 0.0], is_last_step=False),
        Step([1], [2, 3], tid, loss_mask=[1, 1], reward=[0.0, 2.0]),
    ]
    got = sa.compute_step_advantages(steps, "reinforce_pp", reward_mode="per_step")
    rets = np.array([3.0, 2.0, 2.0, 2.0])  # token returns with gamma = gamma_turn = 1
    expected = (rets - rets.mean()) / np.sqrt(rets.var(ddof=1) + 1e-8)
    assert_steps_close(got, [expected[:2], expected[2:]], atol=1e-5)


@pytest.fixture
def saved_estimators():
    saved = dict(core_adv.ESTIMATORS)
    yield
    core_adv._ESTIMATORS._values.clear()
    core_adv._ESTIMATORS._values.update(saved)


def discounted_return(token_rewards, mask, *, gamma=0.5):
    """A user token-level estimator: the discounted reward-to-go, no baseline, no whitening."""
    return core_adv.token_returns(token_rewards, mask, gamma=gamma)


def test_registered_token_estimator_runs_per_step_like_reinforce_pp(saved_estimators):
    """A registered kind="token" estimator works on step-wise batches."""
    core_adv.register_estimator("discounted_return_test", core_adv.Estimator(discounted_return, "token"))
    steps = [
        Step([1], [2, 3, 4], TrajectoryID("q", 0), loss_mask=[1, 0, 1], reward=1.0, is_last_step=False),
        Step([1], [7, 8], TrajectoryID("q", 1), loss_mask=[1, 1], reward=1.5),
        Step([1, 2], [5, 6], TrajectoryID("q", 0), loss_mask=[1, 1], reward=2.0),
    ]
    # gamma_turn = 0.5: G_q0 = [1 + 0.5 * 2, 2] = [2, 2]; later-turn return on the last trainable
    # token of turn 0: G_0 - r_0 = 1. Token rewards: q0 turn 0 [0, ., 1 + 1], q1 [0, 1.5], q0 turn 1
    # [0, 2]. Reward-to-go over trainable tokens (the masked token is no time step, output 0):
    #   gamma = 0.5 (the signature's default): [0.5 * 2, 0, 2], [0.5 * 1.5, 1.5], [0.5 * 2, 2]
    #   gamma = 1.0:                           [2, 0, 2],       [1.5, 1.5],       [2, 2]
    got = StepBatch(steps).step_advantages("discounted_return_test", reward_mode="per_step", gamma_turn=0.5)
    assert_steps_close(got, [[1.0, 0.0, 2.0], [0.75, 1.5], [1.0, 2.0]], atol=1e-6)
    got = compute_step_advantages(
        steps, "discounted_return_test", reward_mode="per_step", gamma_turn=0.5, gamma=1.0
    )
    assert_steps_close(got, [[2.0, 0.0, 2.0], [1.5, 1.5], [2.0, 2.0]], atol=1e-6)
    # the token rules of the built-in token estimators apply to it too
    with pytest.raises(ValueError, match="reward_mode='per_step'"):
        compute_step_advantages(steps, "discounted_return_test")
    with pytest.raises(ValueError, match=r"'discounted_return_test' got unknown hyperparameters \['lam'\]"):
        compute_step_advantages(steps, "discounted_return_test", reward_mode="per_step", lam=0.9)
    with pytest.raises(ValueError, match="length_penalty"):
        compute_step_advantages(steps, "discounted_return_test", reward_mode="per_step", length_penalty={})


def test_a_token_estimator_of_the_wrong_shape_is_a_clear_error(saved_estimators):
    core_adv.register_estimator("row_sum_test", core_adv.Estimator(lambda r, m: r.sum(-1), "token"))
    steps = [Step([1], [2], TrajectoryID("q", 0), reward=1.0)]
    with pytest.raises(ValueError, match=r"'row_sum_test' returned shape \(8,\), expected \(8, 8\)"):
        compute_step_advantages(steps, "row_sum_test", reward_mode="per_step")


# ------------------------------------------------------------------------------------------
# length penalty, custom estimators, errors
# ------------------------------------------------------------------------------------------


def test_length_penalty_spec_check_value():
    # design §3.1: r=[1,0,1,0], out=[100,50,200,100], total=[150,100,300,120], turns=[1,1,2,1]
    def one(rep, prompt, response, reward, last=True):
        return Step([1] * prompt, [2] * response, TrajectoryID("q", rep), reward=reward, is_last_step=last)

    steps = [
        one(0, 50, 100, 1.0),
        one(1, 50, 50, 0.0),
        one(2, 10, 50, 0.0, last=False),  # turn 1 of trajectory 2: 60 tokens
        one(3, 20, 100, 0.0),
        one(2, 150, 150, 1.0),  # out = 50 + 150 = 200, total = max(60, 300) = 300 -> in = 100
    ]
    got = sa.compute_step_advantages(steps, "grpo", norm_by_std=False, length_penalty={})
    a = [0.5165625, -0.4521875, 0.4040625, -0.4684375]
    expected = [
        np.full(100, a[0]),
        np.full(50, a[1]),
        np.full(50, a[2]),
        np.full(100, a[3]),
        np.full(150, a[2]),
    ]
    assert_steps_close(got, expected, atol=1e-6)
    # weights are honoured: all-zero weights leave the rewards unshaped
    plain = sa.compute_step_advantages(steps, "grpo", norm_by_std=False)
    zero = sa.compute_step_advantages(
        steps, "grpo", norm_by_std=False, length_penalty=dict(w_out=0, w_in=0, w_turn=0)
    )
    assert_steps_close(zero, plain, atol=1e-7)


def test_custom_estimator_callable():
    def best_minus(rewards, group_ids, num_groups, *, scale=1.0):
        best = segments.segment_max(rewards, group_ids, num_groups)
        return scale * (rewards - segments.segment_gather(best, group_ids))

    steps = interleave(make_trajectories(41), 1)
    got = sa.compute_step_advantages(steps, best_minus, scale=2.0)
    reward = {s.trajectory_id: s.total_reward for s in steps if s.is_last_step}
    best: dict[str, float] = {}
    for tid, r in reward.items():
        best[tid.instance_id] = max(best.get(tid.instance_id, -np.inf), r)
    expected = [
        2.0 * (reward[s.trajectory_id] - best[s.trajectory_id.instance_id]) * np.asarray(s.loss_mask)
        for s in steps
    ]
    assert_steps_close(got, expected)


def test_compiles_once_per_bucket():
    sa.compute_step_advantages(contiguous(make_trajectories(50)), "grpo")
    before = sa._broadcast._cache_size()
    # different numbers of steps/trajectories/lengths within the same buckets: no new compilation
    for n in (3, 4, 5):
        steps = [
            Step([1], [2] * (k % 3 + 1), TrajectoryID(f"g{k % 2}", k), reward=float(k)) for k in range(n)
        ]
        sa.compute_step_advantages(steps, "grpo")
    assert sa._broadcast._cache_size() <= before + 1


def test_empty_batch_and_outputs():
    assert sa.compute_step_advantages(StepBatch([]), "grpo") == []
    steps = [
        Step([1], [], TrajectoryID("q", 0), reward=1.0),
        Step([1], [4], TrajectoryID("q", 1), reward=0.0),
    ]
    got = sa.compute_step_advantages(steps, "grpo")
    assert got[0].shape == (0,) and got[1].shape == (1,)


def test_errors_are_clear():
    steps = [Step([1], [2], TrajectoryID("q", 0), reward=1.0), Step([1], [2], TrajectoryID("q", 1))]
    with pytest.raises(ValueError, match="reward_mode='per_step'"):
        sa.compute_step_advantages(steps, "reinforce_pp")
    with pytest.raises(ValueError, match="critic values"):
        sa.compute_step_advantages(steps, "gae", reward_mode="per_step")
    with pytest.raises(ValueError, match="unknown estimator"):
        sa.compute_step_advantages(steps, "ppo")
    with pytest.raises(ValueError, match="unknown reward_mode"):
        sa.compute_step_advantages(steps, "grpo", reward_mode="turn")
    with pytest.raises(ValueError, match="only applies with reward_mode='per_step'"):
        sa.compute_step_advantages(steps, "grpo", gamma_turn=0.9)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sa.compute_step_advantages(steps, "grpo", reward_mode="per_step", gamma_turn=1.5)
    with pytest.raises(ValueError, match="unknown key"):
        sa.compute_step_advantages(steps, "grpo", length_penalty={"w_output": 1.0})
    with pytest.raises(ValueError, match="outcome"):
        sa.compute_step_advantages(steps, "grpo", reward_mode="per_step", length_penalty={})
    with pytest.raises(ValueError, match="hashable"):
        sa.compute_step_advantages(steps, "grpo", eps=[1e-6])
    with pytest.raises(ValueError, match="gamma"):
        sa.compute_step_advantages(steps, "reinforce_pp", reward_mode="per_step", lam=0.9)
    with pytest.raises(ValueError, match="returned shape"):
        sa.compute_step_advantages(steps, lambda r, g, n: jnp.zeros(3))
    with pytest.raises(ValueError, match="is_last_step"):
        sa.compute_step_advantages([Step([1], [2], TrajectoryID("q", 0), is_last_step=False)], "grpo")


# ------------------------------------------------------------------------------------------------
# Errored trajectories stay out of group baselines (else they would act as phantom failures)
# ------------------------------------------------------------------------------------------------
def _group_with_errored(stop_reason: str, mode: str) -> list[Step]:
    steps = []
    for rep, reward in enumerate([1.0, 1.0, 0.5]):
        tid = TrajectoryID("q", rep)
        if mode == "per_step":  # two turns each, reward on the last
            steps.append(Step([1], [2], tid, is_last_step=False))
        steps.append(Step([1, 2, 3] if mode == "per_step" else [1], [4, 5], tid, reward=reward))
    bad = TrajectoryID("q", 3)  # as the rollout leaves an errored trajectory: masked, reward 0
    if mode == "per_step":
        steps.append(Step([1], [2], bad, loss_mask=[0], is_last_step=False))
    steps.append(Step([1], [4, 5], bad, loss_mask=[0, 0], reward=0.0, stop_reason=stop_reason))
    return steps


@pytest.mark.parametrize("stop_reason", ["error", "abort"])
@pytest.mark.parametrize("mode", ["outcome", "per_step"])
def test_errored_trajectories_are_excluded_from_group_baselines(stop_reason, mode):
    steps = _group_with_errored(stop_reason, mode)
    adv = compute_step_advantages(StepBatch(steps), "grpo", reward_mode=mode, norm_by_std=False)
    mean = (1.0 + 1.0 + 0.5) / 3  # by hand: the errored trajectory's 0 is NOT in the mean
    last = [a for a, s in zip(adv, steps, strict=True) if s.is_last_step]
    np.testing.assert_allclose([float(a[0]) for a in last[:3]], [1 - mean, 1 - mean, 0.5 - mean], atol=1e-6)
    assert all(not np.any(a) for a, s in zip(adv, steps, strict=True) if s.trajectory_id.repetition_id == 3)
    # the old behaviour (a phantom 0 in the baseline) is still available, and differs
    old = compute_step_advantages(
        StepBatch(steps), "grpo", reward_mode=mode, norm_by_std=False, exclude_errored=False
    )
    old_last = [a for a, s in zip(old, steps, strict=True) if s.is_last_step]
    np.testing.assert_allclose(float(old_last[0][0]), 1 - 2.5 / 4, atol=1e-6)


def test_a_group_of_only_errored_trajectories_gets_zero_advantages():
    steps = [Step([1], [2], TrajectoryID("q", r), loss_mask=[0], stop_reason="error") for r in range(2)]
    steps.append(Step([1], [2], TrajectoryID("p", 0), reward=1.0))
    steps.append(Step([1], [2], TrajectoryID("p", 1), reward=0.0))
    adv = compute_step_advantages(StepBatch(steps), "rloo")
    assert [a.tolist() for a in adv] == [[0.0], [0.0], [1.0], [-1.0]]
