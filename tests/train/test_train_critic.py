"""PPO's critic pieces (:mod:`rljax.training.critic`) against hand values and independent references.

* token rewards of merged multi-turn samples sit on each turn's last response token;
* ``ppo_advantages`` on a hand-sized packed row (a merged 2-turn sample with an observation
  token + a single-turn sample): every advantage and return computed by hand;
* ``ppo_advantages`` (values + GAE on packed rows) equals a float64 numpy backward loop per sample
  over its trained tokens (observation tokens are not time steps; samples never bootstrap across),
  both per unpacked sample and on random packed rows with random holes in the loss mask (a loop
  that walks each row's segments itself, no unpacking);
* a step's reward must reach the GAE even when its last response token is masked;
* ``critic_step`` equals the same update done by hand: the clipped value loss written out in numpy
  terms, ``jax.grad`` of it, and optax.adamw applied explicitly; its metrics (value loss clipped /
  unclipped, clip fraction, explained variance, value mean) equal float64 numpy on the critic's
  pre-update values;
* one PPO step through the trainer's pieces equals the hand computation of both updates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rljax.algorithms import get_algorithm
from rljax.core.objective import ObjectiveConfig
from rljax.data import StepBatch
from rljax.data.pack import pack, unpack
from rljax.data.prepare import prepare_samples
from rljax.models.tiny import random_decoder, tiny_config
from rljax.models.value import ValueModel
from rljax.models.value import values as model_values
from rljax.training.critic import CriticConfig, critic_step, critic_values, ppo_advantages
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import TrainConfig, TrainState
from rljax.types import Step

CFG = tiny_config("qwen3", vocab_size=64, hidden_size=32, head_dim=8)
SEQ = 48


def _two_turn_trajectories(rng, n=3):
    """Trajectories of 2 turns whose second prompt extends the first (they merge)."""
    steps = []
    for i in range(n):
        p1 = rng.integers(1, 64, 4).tolist()
        r1 = rng.integers(1, 64, 3).tolist()
        obs = rng.integers(1, 64, 2).tolist()
        r2 = rng.integers(1, 64, 4).tolist()
        tid = (f"q{i}", 0)
        steps.append(Step(p1, r1, tid, reward=float(rng.normal()), is_last_step=False))
        steps.append(Step(p1 + r1 + obs, r2, tid, reward=float(rng.normal()), is_last_step=True))
    return steps


def test_token_rewards_of_merged_turns_sit_on_each_turns_last_token():
    steps = _two_turn_trajectories(np.random.default_rng(0), n=1)
    prep = prepare_samples(get_algorithm("ppo"), StepBatch(steps))
    (sample,), (rewards,) = prep.samples, prep.token_rewards
    # merged response: r1 (3) + obs (2, loss 0) + r2 (4)
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    want = np.zeros(9, np.float32)
    want[2], want[8] = steps[0].reward, steps[1].reward
    np.testing.assert_array_equal(rewards, want)
    assert not np.any(np.concatenate(prep.advantages))  # advantages come from the critic later


def _gae_reference(rewards, values, mask, gamma, lam):
    """float64 backward loop over ONE sample's trained positions (mask 1) only."""
    idx = np.flatnonzero(mask)
    adv = np.zeros(len(rewards))
    next_v, next_a = 0.0, 0.0
    for t in idx[::-1]:
        delta = rewards[t] + gamma * next_v - values[t]
        next_a = delta + gamma * lam * next_a
        next_v = values[t]
        adv[t] = next_a
    ret = np.where(mask, adv + values, 0.0)
    return adv, ret


def _packed(seed, *, with_rewards=True):
    steps = _two_turn_trajectories(np.random.default_rng(seed), n=3)
    prep = prepare_samples(get_algorithm("ppo"), StepBatch(steps))
    kw = dict(token_rewards=prep.token_rewards) if with_rewards else {}
    return pack(prep.samples, seq_len=SEQ, row_buckets=[2], **kw)


@pytest.mark.parametrize("gamma, lam, whiten", [(1.0, 1.0, False), (0.9, 0.8, False), (0.95, 0.7, True)])
def test_ppo_advantages_equal_a_float64_reference(gamma, lam, whiten):
    result = _packed(1)
    batch, layout = result.batch, result.layout
    assert batch.tokens.shape[0] == 2 and int(batch.segment_ids.max()) >= 2  # several samples per row
    rng = np.random.default_rng(5)
    old_values = jnp.asarray(rng.normal(size=batch.tokens.shape).astype(np.float32))
    adv, ret = ppo_advantages(old_values, batch, CriticConfig(gamma=gamma, lam=lam, whiten_advantages=whiten))
    values_of = unpack(batch.replace(advantages=np.asarray(old_values)), layout)
    got_adv, got_ret = (
        unpack(batch.replace(advantages=np.asarray(adv)), layout),
        unpack(batch.replace(advantages=np.asarray(ret)), layout),
    )
    raw_all, mask_all = [], []
    want_ret = []
    for s, v, ga, gr in zip(unpack(batch, layout), values_of, got_adv, got_ret, strict=True):
        r = np.asarray(s["token_rewards"], np.float64) if "token_rewards" in s else None
        assert r is not None
        mask = np.asarray(s["loss_mask"]) != 0
        a_ref, r_ref = _gae_reference(r, np.asarray(v["advantages"], np.float64), mask, gamma, lam)
        np.testing.assert_allclose(gr["advantages"], r_ref, rtol=1e-5, atol=1e-5)
        raw_all.append(a_ref[mask])
        mask_all.append(mask)
        want_ret.append(r_ref)
        if not whiten:
            np.testing.assert_allclose(ga["advantages"], np.where(mask, a_ref, 0.0), rtol=1e-5, atol=1e-5)
    if whiten:
        flat = np.concatenate(raw_all)
        white = (flat - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8)
        got = np.concatenate([np.asarray(g["advantages"])[m] for g, m in zip(got_adv, mask_all, strict=True)])
        np.testing.assert_allclose(got, white, rtol=1e-4, atol=1e-5)


# -- ppo_advantages: hand values and random packed rows ------------------------------------------


def _prepared_batch(steps: list[Step], seq_len: int, **pack_kwargs):
    prep = prepare_samples(get_algorithm("ppo"), StepBatch(steps))
    return pack(prep.samples, seq_len=seq_len, token_rewards=prep.token_rewards, **pack_kwargs).batch


def _hand_row():
    """Row: [a-prompt 1 2 | a-turn1 3 4 | obs 5 | a-turn2 6 | b-prompt 7 | b 8 9 | pad x3]."""
    steps = [
        Step([1, 2], [3, 4], ("a", 0), reward=1.0, is_last_step=False),
        Step([1, 2, 3, 4, 5], [6], ("a", 0), reward=2.0),
        Step([7], [8, 9], ("b", 0), reward=-1.0),
    ]
    batch = _prepared_batch(steps, 12)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0]]
    assert batch.token_rewards.tolist() == [[0, 0, 0, 1, 0, 2, 0, 0, -1, 0, 0, 0]]
    # 9.0 on every untrained position: none of it may leak into the result
    old_values = jnp.array([[9.0, 9.0, 0.5, 0.25, 9.0, 1.0, 9.0, 0.2, -0.4, 9.0, 9.0, 9.0]])
    return batch, old_values


def test_ppo_advantages_hand_values():
    batch, old_values = _hand_row()
    adv, ret = ppo_advantages(old_values, batch, CriticConfig(gamma=0.5, lam=0.5, whiten_advantages=False))
    # sample a (trained t = 2, 3, 5; the observation token at 4 is not a time step), gamma*lam = 0.25:
    #   t=5: delta = 2 - 1.0 = 1.0                    A = 1.0             R = 2.0
    #   t=3: delta = 1 + 0.5*1.0 - 0.25 = 1.25        A = 1.25 + 0.25*1.0 = 1.5    R = 1.75
    #   t=2: delta = 0 + 0.5*0.25 - 0.5 = -0.375      A = -0.375 + 0.25*1.5 = 0    R = 0.5
    # sample b (trained t = 7, 8; it never bootstraps from a):
    #   t=8: delta = -1 + 0.4 = -0.6                  A = -0.6            R = -1.0
    #   t=7: delta = 0.5*(-0.4) - 0.2 = -0.4          A = -0.4 + 0.25*(-0.6) = -0.55   R = -0.35
    want_adv = [[0, 0, 0.0, 1.5, 0, 1.0, 0, -0.55, -0.6, 0, 0, 0]]
    want_ret = [[0, 0, 0.5, 1.75, 0, 2.0, 0, -0.35, -1.0, 0, 0, 0]]
    np.testing.assert_allclose(np.asarray(adv), want_adv, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), want_ret, atol=1e-6)

    white, ret_w = ppo_advantages(old_values, batch, CriticConfig(gamma=0.5, lam=0.5, whiten_advantages=True))
    raw = np.array([0.0, 1.5, 1.0, -0.55, -0.6])
    want_white = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(white)[0, [2, 3, 5, 7, 8]], want_white, rtol=1e-5)
    assert not np.any(np.asarray(white)[np.asarray(batch.loss_mask) == 0])
    np.testing.assert_allclose(np.asarray(ret_w), want_ret, atol=1e-6)  # returns are never whitened


def _gae_rows_reference(rewards, values, mask, segment_ids, gamma, lam):
    """float64: for each row and each segment, a backward loop over its trained positions."""
    adv = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        for seg in set(segment_ids[b].tolist()) - {0}:
            idx = [t for t in range(rewards.shape[1]) if segment_ids[b, t] == seg and mask[b, t]]
            next_v = next_a = 0.0
            for t in reversed(idx):
                delta = rewards[b, t] + gamma * next_v - values[b, t]
                next_a = delta + gamma * lam * next_a
                next_v = values[b, t]
                adv[b, t] = next_a
    ret = np.where(mask, adv + values, 0.0)
    return adv, ret


def _random_steps(rng, n_traj=5):
    """Merged 2-turn trajectories (observation tokens between turns) and single turns, with random
    holes in the response loss masks (a turn's last token always trained) and random rewards."""

    def resp(k):
        mask = (rng.random(k) < 0.7).astype(int).tolist()
        mask[-1] = 1
        return rng.integers(1, 64, k).tolist(), mask

    steps = []
    for i in range(n_traj):
        p1 = rng.integers(1, 64, int(rng.integers(1, 4))).tolist()
        r1, m1 = resp(int(rng.integers(2, 6)))
        tid = (f"q{i}", 0)
        if i % 2:
            steps.append(Step(p1, r1, tid, loss_mask=m1, reward=float(rng.normal())))
            continue
        obs = rng.integers(1, 64, int(rng.integers(1, 3))).tolist()
        r2, m2 = resp(int(rng.integers(2, 5)))
        steps.append(Step(p1, r1, tid, loss_mask=m1, reward=float(rng.normal()), is_last_step=False))
        steps.append(Step(p1 + r1 + obs, r2, tid, loss_mask=m2, reward=float(rng.normal())))
    return steps


@pytest.mark.parametrize(
    "seed, gamma, lam, whiten", [(0, 1.0, 1.0, False), (1, 0.9, 0.7, False), (2, 0.97, 0.9, True)]
)
def test_ppo_advantages_random_rows_equal_float64_loop(seed, gamma, lam, whiten):
    rng = np.random.default_rng(seed)
    batch = _prepared_batch(_random_steps(rng), 32, row_buckets=[2])
    segs = np.asarray(batch.segment_ids)
    assert segs.shape[0] == 2 and all(len(set(r.tolist()) - {0}) >= 2 for r in segs)  # packed rows
    mask = np.asarray(batch.loss_mask) != 0
    values = rng.normal(size=segs.shape)
    values = np.where(mask, values, 50.0)  # junk off the mask must not leak
    rewards = np.asarray(batch.token_rewards, np.float64)
    adv, ret = ppo_advantages(
        jnp.asarray(values, jnp.float32), batch, CriticConfig(gamma=gamma, lam=lam, whiten_advantages=whiten)
    )
    values32 = np.asarray(jnp.asarray(values, jnp.float32), np.float64)
    ref_adv, ref_ret = _gae_rows_reference(rewards, values32, mask, segs, gamma, lam)
    if whiten:
        sel = ref_adv[mask]
        ref_adv = np.where(mask, (ref_adv - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8), 0.0)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value_clip", [None, 0.1])
def test_critic_step_metrics_equal_float64_reference(value_clip):
    rng = np.random.default_rng(7)
    batch = _prepared_batch(_random_steps(rng), 32, row_buckets=[2])
    vm = ValueModel.from_policy(random_decoder(CFG, seed=0), rngs=nnx.Rngs(0))
    vm.value_kernel[...] = 0.3 * jax.random.normal(jax.random.key(1), vm.value_kernel[...].shape)
    vm.value_bias[...] = jnp.array([0.1])
    state = TrainState.create(vm, TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3)))
    v = np.asarray(critic_values(state, batch), np.float64)  # before the (donating) step
    old = (v + 0.2 * rng.normal(size=v.shape)).astype(np.float32)
    returns = rng.normal(size=v.shape).astype(np.float32)
    _, metrics = critic_step(
        state, batch, jnp.asarray(old), jnp.asarray(returns), CriticConfig(value_clip=value_clip)
    )

    m = np.asarray(batch.loss_mask) != 0
    v, old64, r = v[m], old.astype(np.float64)[m], returns.astype(np.float64)[m]
    loss = 0.5 * (v - r) ** 2
    clipped = np.zeros_like(loss)
    if value_clip is not None:
        vc = old64 + np.clip(v - old64, -value_clip, value_clip)
        clipped = (0.5 * (vc - r) ** 2 > loss).astype(np.float64)
        loss = np.maximum(loss, 0.5 * (vc - r) ** 2)
        assert 0 < clipped.mean() < 1  # both branches occur
    ev = 1.0 - np.var(r - v) / np.var(r)
    got = {k: float(metrics[k]) for k in metrics}
    np.testing.assert_allclose(got["critic/value_loss"], loss.mean(), rtol=1e-5)
    np.testing.assert_allclose(got["critic/clip_frac"], clipped.mean(), atol=1e-7)
    np.testing.assert_allclose(got["critic/explained_variance"], ev, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["critic/value_mean"], v.mean(), rtol=1e-5, atol=1e-6)
    assert np.isfinite(got["critic/grad_norm"]) and got["critic/grad_norm"] > 0


def test_reward_reaches_gae_when_last_response_token_is_masked():
    # SkyRL-style response ending in untrained tokens (e.g. an observation appended to the response)
    batch = _prepared_batch([Step([1, 2], [3, 4, 5, 6], ("q", 0), loss_mask=[1, 1, 0, 0], reward=1.0)], 8)
    _, ret = ppo_advantages(jnp.zeros(batch.tokens.shape), batch, CriticConfig(whiten_advantages=False))
    # gamma = lam = 1 and V = 0: every trained token's return is the step reward
    np.testing.assert_allclose(np.asarray(ret)[np.asarray(batch.loss_mask) != 0], [1.0, 1.0])


def _value_model(seed=0):
    return ValueModel.from_policy(random_decoder(CFG, seed=seed), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("value_clip", [None, 0.05])
def test_critic_step_equals_the_hand_computed_update(value_clip):
    batch = _packed(2).batch
    vm = _value_model()
    # a non-zero head so old values, returns and the clip all matter
    vm.value_kernel[...] = 0.3 * jax.random.normal(jax.random.key(3), vm.value_kernel[...].shape)
    opt = OptimizerConfig(learning_rate=1e-2, max_grad_norm=1e9, weight_decay=0.0, eps=1e-8)
    state = TrainState.create(vm, TrainConfig(optimizer=opt))
    params0 = jax.tree.map(jnp.copy, state.params)
    graphdef = state.graphdef
    cc = CriticConfig(value_clip=value_clip)
    old = critic_values(state, batch)
    old = old + 0.1 * jax.random.normal(jax.random.key(9), old.shape)  # sampling-time values differ
    returns = jnp.asarray(np.random.default_rng(4).normal(size=old.shape).astype(np.float32))

    def hand_loss(params):
        v = model_values(nnx.merge(graphdef, params), batch.tokens, positions=batch.positions,
                         segment_ids=batch.segment_ids)  # fmt: skip
        m = (batch.loss_mask != 0).astype(np.float32)
        unclipped = (v - returns) ** 2
        if value_clip is None:
            per = 0.5 * unclipped
        else:
            vc = old + jnp.clip(v - old, -value_clip, value_clip)
            per = 0.5 * jnp.maximum(unclipped, (vc - returns) ** 2)
        return jnp.sum(per * m) / m.sum()

    loss, grads = jax.value_and_grad(hand_loss)(params0)
    tx = optax.adamw(1e-2, b1=opt.b1, b2=opt.b2, eps=1e-8, weight_decay=0.0)
    updates, _ = tx.update(grads, tx.init(params0), params0)
    want = optax.apply_updates(params0, updates)

    new, metrics = critic_step(state, batch, old, returns, cc)
    np.testing.assert_allclose(float(metrics["critic/value_loss"]), float(loss), rtol=1e-6)
    leaves = zip(jax.tree.leaves(new.params), jax.tree.leaves(want), jax.tree.leaves(grads), strict=True)
    for a, b, g in leaves:
        a, b, g = np.asarray(a), np.asarray(b), np.abs(np.asarray(g))
        # Adam's first step moves each parameter by lr * g / (|g| + eps): lr * sign(g) wherever |g|
        # is well above float32 gradient noise (~1e-6 of the largest), any value in [-lr, lr] below it
        settled = g > 1e-4 * g.max()
        np.testing.assert_allclose(a[settled], b[settled], rtol=1e-5, atol=1e-7)
        assert np.all(np.abs(a - b) <= 2 * 1e-2 + 1e-6)
    if value_clip is not None:
        assert 0 < float(metrics["critic/clip_frac"]) < 1


def test_one_ppo_step_by_hand():
    """Values -> GAE -> policy ppo_clip step and critic step, against the pieces composed by hand."""
    from rljax.training.step import mini_batch_counts, train_step

    batch = _packed(3).batch
    policy = random_decoder(CFG, seed=1)
    critic = TrainState.create(_value_model(1), TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3)))
    cc = CriticConfig(gamma=1.0, lam=0.95, whiten_advantages=True, value_clip=0.2)
    old_values = critic_values(critic, batch)
    # a fresh head gives V = 0 everywhere: GAE reduces to reward-to-go over trained tokens
    assert not np.any(np.asarray(old_values))
    adv, ret = ppo_advantages(old_values, batch, cc)
    objective = ObjectiveConfig(policy_loss="ppo_clip", components=("rl",))
    pstate = TrainState.create(
        policy, TrainConfig(objective=objective, optimizer=OptimizerConfig(learning_rate=1e-3))
    )
    # on-policy: old logprobs are the policy's own (independent forward), so every ratio is 1
    from rljax.models import sequence_logprobs

    own = sequence_logprobs(
        policy, jnp.asarray(batch.tokens), positions=batch.positions, segment_ids=batch.segment_ids
    )
    pbatch = batch.replace(advantages=np.asarray(adv), old_logprobs=np.asarray(own) * batch.loss_mask)
    new_policy, pm = train_step(pstate, pbatch, mini_batch_counts(pbatch, objective))
    new_critic, cm = critic_step(critic, batch, old_values, ret, cc)
    assert int(new_policy.step) == 1 and int(new_critic.step) == 1
    # ppo_clip with ratio 1: loss = -mean_t A_t over rl tokens = -(mean of whitened advantages) = 0
    assert abs(float(pm["loss/rl"])) < 1e-5 and float(pm["rl/clip_frac"]) == 0.0
    assert float(pm["grad_norm"]) > 0  # yet the gradient sum_t A_t grad log p_t is not 0
    # the critic regresses V = 0 onto the returns: loss = 0.5 mean R^2, explained variance 0
    m = np.asarray(batch.loss_mask) != 0
    np.testing.assert_allclose(
        float(cm["critic/value_loss"]), 0.5 * np.mean(np.asarray(ret)[m] ** 2), rtol=1e-5
    )
    assert abs(float(cm["critic/explained_variance"])) < 1e-6
    # after the step the critic moved toward the returns
    new_values = critic_values(new_critic, batch)
    before = np.mean((np.asarray(ret)[m]) ** 2)
    after = np.mean((np.asarray(ret)[m] - np.asarray(new_values)[m]) ** 2)
    assert after < before


def test_ppo_advantages_need_rewards():
    batch = _packed(4, with_rewards=False).batch
    assert batch.token_rewards is None
    with pytest.raises(ValueError, match="token_rewards"):
        ppo_advantages(jnp.zeros(batch.tokens.shape), batch, CriticConfig())


def test_critic_config_validation():
    for bad in (dict(gamma=1.5), dict(value_clip=0.0), dict(warmup_steps=-1)):
        with pytest.raises(ValueError):
            CriticConfig(**bad)
    assert dataclasses.replace(CriticConfig(), value_clip=None).value_clip is None


# -- credit across samples: a trajectory's turns in several samples and rows ---------------------


def _trajectories_across_samples(rng):
    """Three trajectories whose turns do not all merge: a (turn 1 extends turn 0, turn 2 a context
    reset), b (a sub-agent call between two turns of the main agent, which merge around it) and c
    (one turn). Rewards on every turn, holes in the loss masks."""

    def resp(n):
        mask = (rng.random(n) < 0.75).astype(int).tolist()
        mask[0] = 1
        return rng.integers(1, 64, n).tolist(), mask

    def step(prompt, tid, last, n):
        ids, mask = resp(n)
        return Step(prompt, ids, tid, loss_mask=mask, reward=float(rng.normal()), is_last_step=last)

    a0 = step([1, 2, 3], ("a", 0), False, 4)
    a1 = step(a0.prompt_ids + a0.response_ids + [7, 8], ("a", 0), False, 3)
    a2 = step([1, 5], ("a", 0), True, 5)  # does not extend: a new sample
    b0 = step([4, 4], ("b", 0), False, 3)
    b1 = step([6], ("b", 0), False, 2)  # the sub-agent
    b2 = step(b0.prompt_ids + b0.response_ids + [9], ("b", 0), True, 3)  # merges into b0's sample
    c0 = step([3], ("c", 0), True, 4)
    return [a0, a1, b0, b1, a2, b2, c0]


def _reference_returns(steps, value_of, gamma, lam):
    """float64: per (step, response position) of trained tokens, GAE along the trajectory's trained
    tokens in turn order; each step's reward on its last trained token."""
    out = {}
    for tid in {s.trajectory_id for s in steps}:
        order = [(i, j) for i, s in enumerate(steps) if s.trajectory_id == tid
                 for j in np.flatnonzero(s.loss_mask)]  # fmt: skip
        next_v = next_a = 0.0
        for i, j in reversed(order):
            last = np.flatnonzero(steps[i].loss_mask)[-1]
            r = steps[i].reward if j == last else 0.0
            next_a = r + gamma * next_v - value_of[i, j] + gamma * lam * next_a
            next_v = value_of[i, j]
            out[i, j] = next_a + value_of[i, j]
    return out


def _positions(prep, layout):
    """(step, response position) -> flat packed index of every kept response token."""
    out = {}
    for k, source in enumerate(layout.source_index.tolist()):
        base = layout.rows[k] * layout.seq_len + layout.starts[k] + layout.prompt_lens[k]
        for i, lo, hi in prep.turn_spans[source]:
            for j in range(min(hi, layout.response_lens[k]) - lo):
                out[i, j] = int(base + lo + j)
    return out


def _linked_returns(steps, value_of, cc, *, merge, seq_len, truncate=False):
    from rljax.data.credit import turn_links

    prep = prepare_samples(get_algorithm("ppo"), StepBatch(steps), merge=merge)
    result = pack(prep.samples, seq_len=seq_len, truncate=truncate, token_rewards=prep.token_rewards)
    at = _positions(prep, result.layout)
    values = np.full(result.batch.tokens.size, 50.0, np.float32)  # junk off the trained tokens
    for key, p in at.items():
        values[p] = value_of[key]
    links = turn_links(prep.samples, prep.turn_spans, result.layout)
    _, ret = ppo_advantages(jnp.asarray(values.reshape(result.batch.shape)), result.batch, cc, links)
    flat = np.asarray(ret).reshape(-1)
    return {key: float(flat[p]) for key, p in at.items() if steps[key[0]].loss_mask[key[1]]}, result


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_turns_in_several_samples_get_the_returns_of_the_whole_trajectory(gamma, lam):
    """Merged or not, with a prompt that does not extend and an interleaved sub-agent, packed into
    several rows: every trained token's return is GAE's along its trajectory in turn order."""
    rng = np.random.default_rng(11)
    steps = _trajectories_across_samples(rng)
    value_of = {(i, j): float(rng.normal()) for i, s in enumerate(steps) for j in range(len(s.response_ids))}
    want = _reference_returns(steps, value_of, gamma, lam)
    cc = CriticConfig(gamma=gamma, lam=lam, whiten_advantages=False)
    for merge in (True, False):
        got, result = _linked_returns(steps, value_of, cc, merge=merge, seq_len=16)
        assert result.batch.shape[0] >= 3 and result.layout.num_samples == (5 if merge else 7)
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], [want[k] for k in want], rtol=1e-5, atol=1e-5)


def test_a_truncated_sample_keeps_its_reward_and_its_link():
    """truncate=True cuts the merged sample a0 + a1 inside a1: a1's reward (on its cut last trained
    token) moves to the last kept trained token, and that token still bootstraps from a2."""
    rng = np.random.default_rng(12)
    steps = _trajectories_across_samples(rng)[:3] + _trajectories_across_samples(rng)[4:5]
    a0, a1, _, a2 = steps
    steps = [a0, a1.replace(loss_mask=[1, 1, 1]), a2]
    value_of = {(i, j): float(rng.normal()) for i, s in enumerate(steps) for j in range(len(s.response_ids))}
    seq_len = len(a1.prompt_ids) + 1  # a0's sample keeps a1's first response token only
    got, result = _linked_returns(
        steps, value_of, CriticConfig(whiten_advantages=False), merge=True, seq_len=seq_len, truncate=True
    )
    assert result.metrics["truncated_samples"] == 1
    # gamma = lam = 1: a return is the rewards from the token on plus nothing bootstrapped at the end
    total = a0.reward + a1.reward + a2.reward
    np.testing.assert_allclose([got[0, j] for j in np.flatnonzero(a0.loss_mask)], total, rtol=1e-5)
    np.testing.assert_allclose(got[1, 0], a1.reward + a2.reward, rtol=1e-5)
    assert (1, 1) not in got  # cut
    np.testing.assert_allclose([got[2, j] for j in np.flatnonzero(a2.loss_mask)], a2.reward, rtol=1e-5)
