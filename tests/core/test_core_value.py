"""PPO critic pieces: value loss (clipped / unclipped), explained variance and segment-aware GAE,
against independent float64 numpy references on random inputs (masks, packed samples with
observation tokens that are not time steps)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.core import advantages, losses


def _np_value_loss(v, old, r, clip):
    v, old, r = (np.asarray(x, np.float64) for x in (v, old, r))
    plain = 0.5 * (v - r) ** 2
    if clip is None:
        return plain, np.zeros_like(plain)
    vc = old + np.clip(v - old, -clip, clip)
    clipped = 0.5 * (vc - r) ** 2
    return np.maximum(plain, clipped), (clipped > plain).astype(np.float64)


class ValueLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_against_numpy(self):
        rng = np.random.default_rng(0)
        v, old, r = (rng.normal(size=(4, 9)).astype(np.float32) for _ in range(3))
        for clip in (None, 0.2, 1.0):
            fn = self.variant(lambda a, b, c, clip=clip: losses.value_loss(a, b, c, value_clip=clip))
            ind = self.variant(
                lambda a, b, c, clip=clip: losses.value_clipped_tokens(a, b, c, value_clip=clip)
            )
            want, want_ind = _np_value_loss(v, old, r, clip)
            np.testing.assert_allclose(np.asarray(fn(v, old, r)), want, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(ind(v, old, r)), want_ind)

    def test_hand_computed(self):
        # V=2, V_old=0, R=3, c=0.5: plain 0.5; clipped V_c=0.5 -> 0.5*2.5^2 = 3.125 (the larger)
        assert (
            float(losses.value_loss(jnp.array([2.0]), jnp.array([0.0]), jnp.array([3.0]), value_clip=0.5)[0])
            == 3.125
        )
        assert float(losses.value_loss(jnp.array([2.0]), jnp.array([0.0]), jnp.array([3.0]))[0]) == 0.5

    def test_gradient_is_cut_where_the_clipped_branch_wins(self):
        g = jax.grad(
            lambda v: losses.value_loss(v, jnp.zeros(2), jnp.array([3.0, 3.0]), value_clip=0.5).sum()
        )
        # token 0 (V=2): clipped branch larger and constant in V -> 0; token 1 (V=0.25): plain branch
        np.testing.assert_allclose(np.asarray(g(jnp.array([2.0, 0.25]))), [0.0, 0.25 - 3.0])

    def test_bad_clip(self):
        with pytest.raises(ValueError, match="value_clip must be > 0"):
            losses.value_loss(jnp.ones(1), jnp.ones(1), jnp.ones(1), value_clip=0.0)


def test_explained_variance_against_numpy():
    rng = np.random.default_rng(1)
    r = rng.normal(size=(3, 7))
    v = r + 0.3 * rng.normal(size=(3, 7))
    m = rng.random((3, 7)) > 0.3
    rr, vv = r[m], v[m]
    want = 1 - np.var(rr - vv) / np.var(rr)
    got = losses.explained_variance(jnp.asarray(v, jnp.float32), jnp.asarray(r, jnp.float32), m)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    assert float(losses.explained_variance(jnp.ones(3), jnp.ones(3), jnp.ones(3))) == 0.0  # Var(R) = 0


def _np_gae(rewards, values, mask, segs, gamma, lam):
    """Reference: per sample (segment), the trainable positions in order are the time steps."""
    adv = np.zeros_like(rewards, np.float64)
    for b in range(rewards.shape[0]):
        for s in set(segs[b].tolist()):
            steps = [t for t in range(rewards.shape[1]) if segs[b, t] == s and mask[b, t]]
            nxt_v = nxt_a = 0.0
            for t in reversed(steps):
                a = rewards[b, t] + gamma * nxt_v - values[b, t] + gamma * lam * nxt_a
                adv[b, t] = a
                nxt_v, nxt_a = values[b, t], a
    returns = (adv + values) * mask
    mean = (adv * mask).sum() / mask.sum()
    var = (((adv - mean) ** 2) * mask).sum() / (mask.sum() - 1)
    whitened = (adv - mean) / np.sqrt(var + 1e-8) * mask
    return whitened, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_segment_gae_on_packed_rows_with_observation_tokens(gamma, lam):
    rng = np.random.default_rng(2)
    segs = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 2, 2]])  # two samples per row, padding
    mask = (rng.random(segs.shape) > 0.3) & (segs > 0)  # masked = prompt / observation tokens
    rewards = rng.normal(size=segs.shape)
    values = rng.normal(size=segs.shape)
    want_adv, want_ret = _np_gae(rewards, values, mask.astype(np.float64), segs, gamma, lam)
    adv, ret = advantages.gae(
        jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32), jnp.asarray(mask),
        gamma=gamma, lam=lam, segment_ids=jnp.asarray(segs),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-4, atol=1e-4)
    # without segment ids the second sample of a row would bootstrap from the first one's values
    _, leaky = advantages.gae(jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32),
                              jnp.asarray(mask), gamma=gamma, lam=lam)  # fmt: skip
    if gamma * max(lam, 1e-9) > 0 and lam > 0:
        assert np.abs(np.asarray(leaky) - want_ret).max() > 1e-3
