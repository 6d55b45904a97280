"""PPO's critic pieces (:mod:`rljax.train.critic`): hand values and float64 references that
complement tests/train/test_train_critic.py.

* ``ppo_advantages`` on a hand-sized packed row (a merged 2-turn sample with an observation
  token + a single-turn sample): every advantage and return computed by hand;
* ``ppo_advantages`` on random packed rows with random holes in the loss mask, against a plain
  float64 backward loop that walks each row's segments itself (no unpacking);
* ``critic_step``'s metrics (value loss clipped / unclipped, clip fraction, explained variance,
  value mean) against float64 numpy on the critic's pre-update values;
* a step's reward must reach the GAE even when its last response token is masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.algorithms import get_algorithm
from rljax.data import StepBatch
from rljax.data.pack import pack
from rljax.data.prepare import prepare_samples
from rljax.models.tiny import random_decoder, tiny_config
from rljax.models.value import ValueModel
from rljax.train.critic import CriticConfig, critic_step, critic_values, ppo_advantages
from rljax.train.optim import OptimizerConfig
from rljax.train.step import TrainConfig, TrainState
from rljax.types import Step

CFG = tiny_config("qwen3", vocab_size=64, hidden_size=32, head_dim=8)


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
