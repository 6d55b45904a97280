"""PPO's critic pieces against independent references.

* token rewards of merged multi-turn samples sit on each turn's last response token;
* ``ppo_advantages`` (values + GAE on packed rows) equals a float64 numpy backward loop per sample
  over its trained tokens (observation tokens are not time steps; samples never bootstrap across);
* ``critic_step`` equals the same update done by hand: the clipped value loss written out in numpy
  terms, ``jax.grad`` of it, and optax.adamw applied explicitly;
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
from rljax.train.critic import CriticConfig, critic_step, critic_values, ppo_advantages
from rljax.train.optim import OptimizerConfig
from rljax.train.step import TrainConfig, TrainState
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
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    if value_clip is not None:
        assert 0 < float(metrics["critic/clip_frac"]) < 1


def test_one_ppo_step_by_hand():
    """Values -> GAE -> policy ppo_clip step and critic step, against the pieces composed by hand."""
    from rljax.train.step import mini_batch_counts, train_step

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
