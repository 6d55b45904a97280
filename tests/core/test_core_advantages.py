"""Tests for rljax.core.advantages: design §3.1 reference values and float64 numpy references."""

from __future__ import annotations

import functools
import inspect

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from rljax.core import advantages as adv

# ------------------------------------------------------------------------------------------
# float64 numpy references (loops; written from the formulas of design §3.1, not from the code)
# ------------------------------------------------------------------------------------------


def _peers(group_ids, i, num_groups):
    g = group_ids[i]
    if not 0 <= g < num_groups:
        return None
    return [j for j in range(len(group_ids)) if group_ids[j] == g]


def ref_grpo(r, gid, num_groups, norm_by_std=True, eps=1e-6):
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    for i in range(len(r)):
        p = _peers(gid, i, num_groups)
        if p is None or len(p) < 2 or len({r[j] for j in p}) == 1:
            continue
        vals = r[p]
        out[i] = r[i] - vals.mean()
        if norm_by_std:
            out[i] /= np.std(vals, ddof=1) + eps
    return out


def ref_rloo(r, gid, num_groups):
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    for i in range(len(r)):
        p = _peers(gid, i, num_groups)
        if p is None or len(p) < 2:
            continue
        others = [r[j] for j in p if j != i]
        out[i] = r[i] - np.mean(others)  # leave-one-out form
    return out


def ref_max_rl(r, gid, num_groups):
    r = np.asarray(r, np.float64)
    out = np.zeros_like(r)
    for i in range(len(r)):
        p = _peers(gid, i, num_groups)
        if p is None or len(p) < 2:
            continue
        mean = r[p].mean()
        if mean > 0:
            out[i] = (r[i] - mean) / mean
    return out


def ref_length_penalty(r, out_len, in_len, turns, gid, num_groups, w_out=0.25, w_in=0.1, w_turn=0.1):
    r = np.asarray(r, np.float64)
    shaped = np.zeros_like(r)
    for i in range(len(r)):
        p = _peers(gid, i, num_groups)
        if p is None:
            continue
        frac = (
            w_out * out_len[i] / max(1.0, max(out_len[j] for j in p))
            + w_in * in_len[i] / max(1.0, max(in_len[j] for j in p))
            + w_turn * turns[i] / max(1.0, max(turns[j] for j in p))
        )
        shaped[i] = r[i] - np.mean(r[p]) * frac
    result = np.zeros_like(r)
    for i in range(len(r)):
        p = _peers(gid, i, num_groups)
        if p is not None:
            result[i] = shaped[i] - np.mean(shaped[p])
    return result


def ref_token_returns(rew, mask, gamma):
    rew = np.asarray(rew, np.float64)
    out = np.zeros_like(rew)
    for b in range(rew.shape[0]):
        idx = [t for t in range(rew.shape[1]) if mask[b, t]]
        running = 0.0
        for t in reversed(idx):
            running = rew[b, t] + gamma * running
            out[b, t] = running
    return out


def ref_whiten(x, mask, eps=1e-8):
    x = np.asarray(x, np.float64)
    sel = x[np.asarray(mask, bool)]
    if sel.size == 0:
        return np.zeros_like(x)
    mean = sel.mean()
    var = sel.var(ddof=1) if sel.size > 1 else 0.0
    return np.where(np.asarray(mask, bool), (x - mean) / np.sqrt(var + eps), 0.0)


def ref_gae(rew, values, mask, gamma, lam):
    rew = np.asarray(rew, np.float64)
    values = np.asarray(values, np.float64)
    raw = np.zeros_like(rew)
    for b in range(rew.shape[0]):
        idx = [t for t in range(rew.shape[1]) if mask[b, t]]
        for pos in range(len(idx) - 1, -1, -1):
            t = idx[pos]
            v_next = values[b, idx[pos + 1]] if pos + 1 < len(idx) else 0.0
            a_next = raw[b, idx[pos + 1]] if pos + 1 < len(idx) else 0.0
            raw[b, t] = rew[b, t] + gamma * v_next - values[b, t] + gamma * lam * a_next
    returns = np.where(np.asarray(mask, bool), raw + values, 0.0)
    return ref_whiten(raw, mask), returns


def ref_turn_returns(r, traj, turn, num_traj, max_turns, gamma):
    out = np.zeros(len(r))
    for s in range(len(r)):
        if not (0 <= traj[s] < num_traj and 0 <= turn[s] < max_turns):
            continue
        out[s] = sum(
            gamma ** (turn[q] - turn[s]) * r[q]
            for q in range(len(r))
            if traj[q] == traj[s] and turn[q] >= turn[s] and 0 <= turn[q] < max_turns
        )
    return out


def random_groups(seed, n=30, num_groups=8, binary=False):
    """Variable group sizes, groups of one, an empty group, an all-equal group, padding ids."""
    rng = np.random.default_rng(seed)
    sizes = [1, 2, 3, 5, 7, 4, 0, 3]
    gid = np.concatenate([np.full(k, g) for g, k in enumerate(sizes)]).astype(np.int32)
    r = rng.integers(0, 2, size=gid.size).astype(np.float32) if binary else rng.normal(size=gid.size)
    r = r.astype(np.float32)
    r[gid == 7] = 0.25  # all-equal group
    pad = n - gid.size
    gid = np.concatenate([gid, np.full(pad, num_groups, np.int32)])  # out-of-range padding
    r = np.concatenate([r, rng.normal(size=pad).astype(np.float32)])
    perm = rng.permutation(n)
    return r[perm], gid[perm]


GROUP_FNS = {
    "grpo": (adv.grpo, ref_grpo),
    "grpo_nostd": (
        functools.partial(adv.grpo, norm_by_std=False),
        functools.partial(ref_grpo, norm_by_std=False),
    ),
    "rloo": (adv.rloo, ref_rloo),
    "max_rl": (adv.max_rl, ref_max_rl),
}


# ------------------------------------------------------------------------------------------
# group estimators
# ------------------------------------------------------------------------------------------


class GroupEstimatorTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_spec_values(self):
        r = jnp.array([1.0, 0.0, 0.0, 0.0])
        g = jnp.zeros(4, jnp.int32)
        np.testing.assert_allclose(
            self.variant(functools.partial(adv.max_rl, num_groups=1))(r, g), [3, -1, -1, -1]
        )
        # grpo by hand: mean 0.25, unbiased std 0.5
        np.testing.assert_allclose(
            self.variant(functools.partial(adv.grpo, num_groups=1))(r, g),
            np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6),
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            self.variant(functools.partial(adv.grpo, num_groups=1, norm_by_std=False))(r, g),
            [0.75, -0.25, -0.25, -0.25],
        )
        np.testing.assert_allclose(
            self.variant(functools.partial(adv.rloo, num_groups=1))(r, g),
            [1.0, -1 / 3, -1 / 3, -1 / 3],
            rtol=1e-6,
        )

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*GROUP_FNS)
    def test_group_of_one_and_all_equal_are_exactly_zero(self, name):
        fn, _ = GROUP_FNS[name]
        # float32 means of [0.9]*3 and [0.3]*6 are off by one ulp: a naive (r - mean) / (std + eps)
        # would give ~1e-2 instead of 0
        r = jnp.array([5.0] + [0.9] * 3 + [0.3] * 6)
        g = jnp.array([0] + [1] * 3 + [2] * 6)
        got = self.variant(functools.partial(fn, num_groups=3))(r, g)
        np.testing.assert_array_equal(got, np.zeros(10))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*GROUP_FNS)
    def test_random_vs_reference(self, name):
        fn, ref = GROUP_FNS[name]
        run = self.variant(functools.partial(fn, num_groups=8))
        for seed, binary in ((0, False), (1, True), (2, False)):
            r, g = random_groups(seed, binary=binary)
            np.testing.assert_allclose(
                run(jnp.asarray(r), jnp.asarray(g)), ref(r, g, 8), rtol=2e-5, atol=2e-5
            )

    @parameterized.parameters(*GROUP_FNS)
    def test_padding_does_not_change_real_results(self, name):
        fn = jax.jit(GROUP_FNS[name][0], static_argnums=2)
        rng = np.random.default_rng(7)
        r = rng.normal(size=12).astype(np.float32)
        g = np.repeat(np.arange(3), 4).astype(np.int32)
        base = np.asarray(fn(jnp.asarray(r), jnp.asarray(g), 3))
        pad_r = rng.normal(size=5).astype(np.float32) * 100
        # (a) a fresh in-range group id for the padding, (b) out-of-range ids (negative and too large)
        for pad_g, num_groups in ((np.full(5, 4), 6), (np.array([-1, 6, 6, -5, 100]), 6)):
            rr = jnp.asarray(np.concatenate([r, pad_r]))
            gg = jnp.asarray(np.concatenate([g, pad_g]).astype(np.int32))
            got = np.asarray(fn(rr, gg, num_groups))
            np.testing.assert_allclose(got[:12], base, rtol=1e-6, atol=1e-7)
            if pad_g[0] < 0:
                np.testing.assert_array_equal(got[12:], 0.0)

    @parameterized.parameters(*GROUP_FNS)
    def test_vmap_over_independent_batches(self, name):
        fn, ref = GROUP_FNS[name]
        cases = [random_groups(s) for s in (3, 4, 5)]
        r = jnp.asarray(np.stack([c[0] for c in cases]))
        g = jnp.asarray(np.stack([c[1] for c in cases]))
        got = jax.vmap(functools.partial(fn, num_groups=8))(r, g)
        for k, (rk, gk) in enumerate(cases):
            np.testing.assert_allclose(got[k], ref(rk, gk, 8), rtol=2e-5, atol=2e-5)

    @parameterized.parameters(*GROUP_FNS)
    def test_gradients_are_finite_on_degenerate_groups(self, name):
        fn, _ = GROUP_FNS[name]
        r = jnp.array([1.0, 0.0, 0.0, 2.0, 2.0, 0.0])
        g = jnp.array([0, 1, 1, 2, 2, 3])
        grad = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, g, 4) ** 2)))(r)
        assert np.all(np.isfinite(np.asarray(grad)))

    def test_registry(self):
        builtin = {
            "grpo": ("group", False),
            "rloo": ("group", False),
            "max_rl": ("group", False),
            "reinforce_pp": ("token", False),
            "gae": ("token", True),
        }
        assert set(builtin) <= set(adv.ESTIMATORS)
        for name, (kind, critic) in builtin.items():
            est = adv.get_estimator(name)
            got = (est.kind, est.needs_critic, est.name, est.group_relative)
            assert got == (kind, critic, name, kind == "group")
            params = list(inspect.signature(est.fn).parameters.values())
            positional = (
                ["rewards", "group_ids", "num_groups"]
                if kind == "group"
                else (["token_rewards", "values", "mask"] if critic else ["token_rewards", "mask"])
            )
            assert [p.name for p in params[: len(positional)]] == positional
        # design §3.6b defaults (read from the signatures); gae's segment_ids is a data input, not one
        assert dict(adv.get_estimator("grpo").defaults) == {"norm_by_std": True, "eps": 1e-6}
        assert dict(adv.get_estimator("gae").defaults) == {"gamma": 1.0, "lam": 1.0}
        assert dict(adv.get_estimator("reinforce_pp").defaults) == {"gamma": 1.0}
        assert dict(adv.get_estimator("rloo").defaults) == {}
        with pytest.raises(TypeError):
            adv.ESTIMATORS["x"] = adv.get_estimator("grpo")  # read-only view

    def test_registered_estimator_defaults_and_kwargs(self):
        r, g = jnp.array([1.0, 0.0, 0.0, 3.0]), jnp.array([0, 0, 1, 1])
        grpo = adv.get_estimator("grpo")
        np.testing.assert_allclose(grpo(r, g, 2), ref_grpo(np.asarray(r), np.asarray(g), 2), rtol=1e-5)
        np.testing.assert_allclose(grpo(r, g, 2, norm_by_std=False), [0.5, -0.5, -1.5, 1.5], rtol=1e-6)
        with pytest.raises(ValueError, match=r"estimator 'grpo' got unknown hyperparameters \['gamma'\]"):
            grpo(r, g, 2, gamma=1.0)
        with pytest.raises(ValueError, match="unknown estimator 'vtrace'"):
            adv.get_estimator("vtrace")

    def test_register_estimator(self):
        def scaled_mean_baseline(rewards, group_ids, num_groups, *, scale):
            mean = jax.ops.segment_sum(rewards, group_ids, num_groups) / jax.ops.segment_sum(
                jnp.ones_like(rewards), group_ids, num_groups
            )
            return scale * (rewards - mean[group_ids])

        mine = adv.Estimator(scaled_mean_baseline, "group", {"scale": 2.0})
        saved = dict(adv.ESTIMATORS)
        try:
            got = adv.register_estimator("scaled_test", mine)
            assert got.name == "scaled_test" and adv.get_estimator("scaled_test") is got
            assert adv.is_group_estimator("scaled_test") and "scaled_test" in adv.list_estimators()
            r, g = jnp.array([1.0, 0.0, 4.0, 2.0]), jnp.array([0, 0, 1, 1])
            # defaults from the registration: 2 * (r - mean_g) = [1, -1, 2, -2]
            np.testing.assert_allclose(got(r, g, 2), [1.0, -1.0, 2.0, -2.0], rtol=1e-6)
            np.testing.assert_allclose(
                jax.jit(got, static_argnums=2)(r, g, 2, scale=1.0), [0.5, -0.5, 1.0, -1.0], rtol=1e-6
            )
            adv.check_estimator_reward_mode("scaled_test", "outcome", True)  # group estimators: any mode
            with pytest.raises(ValueError, match="already registered; pass overwrite=True"):
                adv.register_estimator("scaled_test", mine)
            adv.register_estimator("tok_test", adv.Estimator(adv.reinforce_pp, "token", {"gamma": 1.0}))
            assert not adv.is_group_estimator("tok_test")
            with pytest.raises(ValueError, match="reward_mode='per_step'"):
                adv.check_estimator_reward_mode("tok_test", "outcome", True)
            adv.check_estimator_reward_mode("tok_test", "per_step", True)
        finally:
            adv._ESTIMATORS._values.clear()
            adv._ESTIMATORS._values.update(saved)
        assert "scaled_test" not in adv.ESTIMATORS

    def test_estimator_defaults_come_from_the_signature_unless_given(self):
        def centered(rewards, group_ids, num_groups, *, scale=3.0):
            return scale * (rewards - jnp.mean(rewards))  # one group

        r, g = jnp.array([1.0, 0.0]), jnp.array([0, 0])
        est = adv.Estimator(centered, "group")
        assert dict(est.defaults) == {"scale": 3.0}
        np.testing.assert_allclose(est(r, g, 1), [1.5, -1.5])
        variant = adv.Estimator(centered, "group", {"scale": 1.0})  # a registered variant
        np.testing.assert_allclose(variant(r, g, 1), [0.5, -0.5])

    @parameterized.parameters(
        (dict(fn=1, kind="group"), "callable"),
        (dict(fn=adv.rloo, kind="outcome"), "kind must be one of"),
        (dict(fn=adv.gae, kind="group", needs_critic=True), "needs_critic needs kind='token'"),
        (dict(fn=adv.rloo, kind="group", defaults={"x": [1]}), "hashable"),
        (dict(fn=adv.rloo, kind="group", defaults={"1x": 1}), "identifiers"),
        (dict(fn=lambda r, g, n, *, scale: r, kind="group"), r"keyword\(s\) \['scale'\]"),
    )
    def test_estimator_value_errors(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            adv.Estimator(**kwargs)
        with pytest.raises(ValueError, match="expects an Estimator"):
            adv.register_estimator("bad_test", adv.rloo)

    @parameterized.parameters(
        ("grpo", "outcome", True, True),
        ("rloo", "per_step", True, True),
        ("max_rl", "outcome", False, True),
        ("gae", "outcome", True, False),
        ("reinforce_pp", "outcome", True, False),
        ("gae", "per_step", True, True),
        ("reinforce_pp", "per_step", True, True),
        ("gae", "outcome", False, True),
        ("reinforce_pp", "outcome", False, True),
    )
    def test_estimator_reward_mode_rule(self, estimator, mode, step_wise, ok):
        if ok:
            adv.check_estimator_reward_mode(estimator, mode, step_wise)
        else:
            with pytest.raises(ValueError, match="reward_mode='per_step'"):
                adv.check_estimator_reward_mode(estimator, mode, step_wise)

    def test_estimator_reward_mode_errors(self):
        with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
            adv.check_estimator_reward_mode("ppo", "outcome", True)
        with pytest.raises(ValueError, match="unknown reward_mode 'turn'"):
            adv.check_estimator_reward_mode("grpo", "turn", True)
        with pytest.raises(ValueError, match="step_wise must be a bool"):
            adv.check_estimator_reward_mode("grpo", "outcome", "yes")
        assert adv.REWARD_MODES == ("outcome", "per_step")

    def test_errors(self):
        with pytest.raises(ValueError, match="num_groups"):
            jax.jit(adv.grpo)(jnp.ones(3), jnp.zeros(3, jnp.int32), 1)
        with pytest.raises(AssertionError):
            adv.grpo(jnp.ones(3, jnp.int32), jnp.zeros(3, jnp.int32), 1)  # int rewards


_grpo_nostd = jax.jit(functools.partial(adv.grpo, norm_by_std=False), static_argnums=2)
_rloo = jax.jit(adv.rloo, static_argnums=2)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    gid=st.lists(st.integers(0, 5), min_size=24, max_size=24),
    r=st.lists(st.floats(-10, 10, width=32), min_size=24, max_size=24),
)
def test_centered_estimators_sum_to_zero_per_group(gid, r):
    gid = np.asarray(gid, np.int32)
    r = np.asarray(r, np.float32)
    for fn in (_grpo_nostd, _rloo):
        out = np.asarray(fn(jnp.asarray(r), jnp.asarray(gid), 6), np.float64)
        for g in range(6):
            np.testing.assert_allclose(out[gid == g].sum(), 0.0, atol=1e-3)


# ------------------------------------------------------------------------------------------
# length penalty
# ------------------------------------------------------------------------------------------


class LengthPenaltyTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_spec_check_value(self):
        out = np.array([100.0, 50.0, 200.0, 100.0])
        total = np.array([150.0, 100.0, 300.0, 120.0])
        fn = self.variant(functools.partial(adv.length_penalty, num_groups=1))
        got = fn(
            jnp.array([1.0, 0.0, 1.0, 0.0]),
            jnp.asarray(out, jnp.float32),
            jnp.asarray(total - out, jnp.float32),  # design §3.1 gives totals; `in` = total - out
            jnp.array([1.0, 1.0, 2.0, 1.0]),
            jnp.zeros(4, jnp.int32),
        )
        np.testing.assert_allclose(got, [0.5165625, -0.4521875, 0.4040625, -0.4684375], atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_random_groups_vs_reference(self):
        rng = np.random.default_rng(11)
        r, g = random_groups(2)
        n = r.size
        out_len = rng.integers(0, 300, n).astype(np.float32)
        in_len = rng.integers(0, 3, n).astype(np.float32)  # exercises the max floored at 1
        turns = rng.integers(1, 5, n).astype(np.float32)
        kw = dict(w_out=0.3, w_in=0.2, w_turn=0.05)
        fn = self.variant(functools.partial(adv.length_penalty, num_groups=8, **kw))
        got = fn(*(jnp.asarray(a) for a in (r, out_len, in_len, turns, g)))
        np.testing.assert_allclose(got, ref_length_penalty(r, out_len, in_len, turns, g, 8, **kw), atol=3e-6)

    def test_shaped_rewards_then_centering_is_the_penalty(self):
        rng = np.random.default_rng(1)
        r, g = random_groups(6)
        lens = [jnp.asarray(rng.integers(1, 50, r.size).astype(np.float32)) for _ in range(3)]
        shaped = adv.length_shaped_rewards(jnp.asarray(r), *lens, jnp.asarray(g), 8)
        a = adv.length_penalty(jnp.asarray(r), *lens, jnp.asarray(g), 8)
        b = adv.grpo(shaped, jnp.asarray(g), 8, norm_by_std=False)
        # equal except on all-equal shaped groups (grpo's exact-zero rule); groups of one are 0 in both
        np.testing.assert_allclose(a, b, atol=1e-6)


# ------------------------------------------------------------------------------------------
# token-level estimators
# ------------------------------------------------------------------------------------------


def random_rows(seed, b=5, length=9):
    rng = np.random.default_rng(seed)
    rew = rng.normal(size=(b, length)).astype(np.float32)
    values = rng.normal(size=(b, length)).astype(np.float32)
    mask = (rng.random((b, length)) < 0.7).astype(np.int32)
    mask[0, 5:] = 0  # right padding
    mask[1] = 0  # empty row
    mask[2, :3] = 0  # left (prompt) zeros
    return rew, values, mask


class TokenEstimatorTest(parameterized.TestCase):
    def test_token_returns_hand_values(self):
        # row 0: interior masked token is transparent; row 1: returns restart at the row end
        rew = jnp.array([[1.0, 5.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
        mask = jnp.array([[1, 0, 1, 1], [1, 1, 0, 0]])
        got = adv.token_returns(rew, mask, gamma=0.5)
        np.testing.assert_allclose(got, [[1.0 + 0.5 * 1.0, 0.0, 1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1.0,), (0.9,))
    def test_reinforce_pp_vs_reference(self, gamma):
        rew, _, mask = random_rows(0)
        got = self.variant(functools.partial(adv.reinforce_pp, gamma=gamma))(
            jnp.asarray(rew), jnp.asarray(mask)
        )
        expected = ref_whiten(ref_token_returns(rew, mask, gamma), mask)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        rets = self.variant(functools.partial(adv.token_returns, gamma=gamma))(
            jnp.asarray(rew), jnp.asarray(mask)
        )
        np.testing.assert_allclose(rets, ref_token_returns(rew, mask, gamma), rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1.0, 1.0), (0.99, 0.95), (0.5, 0.0))
    def test_gae_vs_reference(self, gamma, lam):
        rew, values, mask = random_rows(1)
        a, ret = self.variant(functools.partial(adv.gae, gamma=gamma, lam=lam))(
            jnp.asarray(rew), jnp.asarray(values), jnp.asarray(mask)
        )
        ref_a, ref_ret = ref_gae(rew, values, mask, gamma, lam)
        np.testing.assert_allclose(a, ref_a, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)

    def test_gae_hand_values(self):
        # gamma=lam=1, V beyond the end = 0: A_1 = 1 - 0.25, A_0 = (0 + 0.25 - 0.5) + A_1; returns = A + V
        _, ret = adv.gae(jnp.array([[0.0, 1.0, 0.0]]), jnp.array([[0.5, 0.25, 9.0]]), jnp.array([[1, 1, 0]]))
        np.testing.assert_allclose(ret, [[1.0, 1.0, 0.0]])

    def test_masked_positions_do_not_leak(self):
        rew, values, mask = random_rows(2)
        rng = np.random.default_rng(3)
        noise = rng.normal(size=rew.shape).astype(np.float32) * 100 * (1 - mask)
        a1, r1 = adv.gae(jnp.asarray(rew), jnp.asarray(values), jnp.asarray(mask), gamma=0.9, lam=0.8)
        a2, r2 = adv.gae(
            jnp.asarray(rew + noise), jnp.asarray(values + noise), jnp.asarray(mask), gamma=0.9, lam=0.8
        )
        np.testing.assert_allclose(a1, a2, atol=1e-6)
        np.testing.assert_allclose(r1, r2, atol=1e-6)
        p1 = adv.reinforce_pp(jnp.asarray(rew), jnp.asarray(mask))
        p2 = adv.reinforce_pp(jnp.asarray(rew + noise), jnp.asarray(mask))
        np.testing.assert_allclose(p1, p2, atol=1e-6)
        assert np.all(np.asarray(a1)[mask == 0] == 0) and np.all(np.asarray(p1)[mask == 0] == 0)

    def test_vmap_over_independent_batches(self):
        cases = [random_rows(s) for s in (4, 5, 6)]
        rew = jnp.asarray(np.stack([c[0] for c in cases]))
        val = jnp.asarray(np.stack([c[1] for c in cases]))
        mask = jnp.asarray(np.stack([c[2] for c in cases]))
        got_pp = jax.vmap(functools.partial(adv.reinforce_pp, gamma=0.9))(rew, mask)
        got_a, got_r = jax.vmap(functools.partial(adv.gae, gamma=0.9, lam=0.7))(rew, val, mask)
        for k, (r, v, m) in enumerate(cases):
            np.testing.assert_allclose(got_pp[k], ref_whiten(ref_token_returns(r, m, 0.9), m), atol=2e-5)
            ref_a, ref_r = ref_gae(r, v, m, 0.9, 0.7)
            np.testing.assert_allclose(got_a[k], ref_a, atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(got_r[k], ref_r, atol=2e-5, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_masked_whiten(self):
        rng = np.random.default_rng(9)
        x = rng.normal(size=(4, 6)).astype(np.float32) * 5 + 3
        mask = (rng.random((4, 6)) < 0.6).astype(np.float32)
        got = self.variant(adv.masked_whiten)(jnp.asarray(x), jnp.asarray(mask))
        np.testing.assert_allclose(got, ref_whiten(x, mask), rtol=1e-5, atol=1e-5)
        # one or zero kept entries: variance taken as 0, output 0 (no NaN)
        single = np.zeros((4, 6), np.float32)
        single[2, 3] = 1.0
        one = self.variant(adv.masked_whiten)(jnp.asarray(x), jnp.asarray(single))
        np.testing.assert_array_equal(one, np.zeros((4, 6)))
        none = self.variant(adv.masked_whiten)(jnp.asarray(x), jnp.zeros((4, 6)))
        np.testing.assert_array_equal(none, np.zeros((4, 6)))


# ------------------------------------------------------------------------------------------
# step-wise helpers
# ------------------------------------------------------------------------------------------


class StepHelpersTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_broadcast_to_steps(self):
        a = jnp.array([2.0, -1.0, 0.5])
        # interleaved steps; an earlier step (row 0) has a LONGER mask than its trajectory's last step (row 3)
        ids = jnp.array([0, 1, 2, 0, 7, -1])
        mask = jnp.array(
            [[1, 1, 1, 1], [0, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], jnp.int32
        )
        got = self.variant(adv.broadcast_to_steps)(a, ids, mask)
        expected = [[2, 2, 2, 2], [0, -1, -1, 0], [0.5, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
        np.testing.assert_array_equal(got, np.asarray(expected, np.float32))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1.0,), (0.7,))
    def test_turn_returns_vs_reference(self, gamma):
        rng = np.random.default_rng(4)
        turns_per_traj = [3, 1, 4, 2]
        traj = np.concatenate([np.full(k, j) for j, k in enumerate(turns_per_traj)])
        turn = np.concatenate([np.arange(k) for k in turns_per_traj])
        r = rng.normal(size=traj.size).astype(np.float32)
        # padding entries: out-of-range trajectory and out-of-range turn
        traj = np.concatenate([traj, [4, 0]]).astype(np.int32)
        turn = np.concatenate([turn, [0, 6]]).astype(np.int32)
        r = np.concatenate([r, [100.0, 100.0]]).astype(np.float32)
        perm = rng.permutation(r.size)
        r, traj, turn = r[perm], traj[perm], turn[perm]
        fn = self.variant(
            functools.partial(adv.turn_returns, num_trajectories=4, max_turns=6, gamma_turn=gamma)
        )
        got = fn(jnp.asarray(r), jnp.asarray(traj), jnp.asarray(turn))
        np.testing.assert_allclose(got, ref_turn_returns(r, traj, turn, 4, 6, gamma), rtol=1e-5, atol=1e-5)

    def test_turn_returns_hand_values(self):
        got = adv.turn_returns(
            jnp.array([0.0, 1.0, 10.0]), jnp.array([0, 0, 0]), jnp.array([0, 1, 2]), 1, 4, gamma_turn=0.5
        )
        np.testing.assert_allclose(got, [0.5 + 2.5, 1.0 + 5.0, 10.0])


# ------------------------------------------------------------------------------------------
# gae along links: one trajectory's turns spread over samples and rows
# ------------------------------------------------------------------------------------------
def random_linked_layout(seed, rows=4, width=24, num_links=16):
    """Trajectories of 1-4 turns, each turn a stretch of response tokens (some masked); a
    trajectory's turns go into 1-3 samples in time order (a sample may skip turns that another
    sample holds, as interleaved sub-agents do), each sample a segment with a masked prompt and
    masked gap tokens between its turns, placed in rows in a shuffled order. Returns the packed
    arrays, the links (last trained token of each turn -> first trained token of the next turn
    with trained tokens, padded with -1) and each trajectory's trained flat positions in time order."""
    rng = np.random.default_rng(seed)
    rew = rng.normal(size=(rows, width)).astype(np.float32)
    values = rng.normal(size=(rows, width)).astype(np.float32)
    mask = np.zeros((rows, width), np.int32)
    segs = np.zeros((rows, width), np.int32)
    fill = [0] * rows
    chains, links = [], []
    for _ in range(8):
        lengths = rng.integers(1, 4, int(rng.integers(1, 5)))
        turns = [(rng.random(n) < 0.75).astype(np.int32) for n in lengths]
        owner = rng.integers(0, int(rng.integers(1, 4)), len(turns))  # not sorted: samples interleave
        samples = [[k for k in range(len(turns)) if owner[k] == s] for s in np.unique(owner)]
        rng.shuffle(samples)
        where = {}  # turn -> its trained flat positions
        placed = True
        for sample in samples:
            prompt = int(rng.integers(1, 3))
            gaps = [int(rng.integers(0, 3)) if i else 0 for i in range(len(sample))]
            need = prompt + sum(gaps) + sum(len(turns[k]) for k in sample)
            row = next((r for r in range(rows) if fill[r] + need <= width), None)
            if row is None:
                placed = False
                break
            col, seg_id = fill[row] + prompt, int(segs[row].max()) + 1
            segs[row, fill[row] : fill[row] + need] = seg_id
            for k, gap in zip(sample, gaps, strict=True):
                col += gap
                mask[row, col : col + len(turns[k])] = turns[k]
                where[k] = [row * width + col + j for j in np.flatnonzero(turns[k])]
                col += len(turns[k])
            fill[row] += need
        if not placed:
            break
        order = [p for k in range(len(turns)) for p in where[k]]
        chains.append(order)
        trained = [where[k] for k in range(len(turns)) if where[k]]
        links += [(a[-1], b[0]) for a, b in zip(trained, trained[1:], strict=False)]
    assert len(links) <= num_links
    links = np.array(links + [(-1, -1)] * (num_links - len(links)), np.int32).reshape(num_links, 2)
    return rew, values, mask, segs, links, chains


def ref_linked_gae(rew, values, chains, gamma, lam):
    """float64: GAE along each trajectory's trained positions in time order."""
    r, v = np.asarray(rew, np.float64).reshape(-1), np.asarray(values, np.float64).reshape(-1)
    raw = np.zeros_like(r)
    for order in chains:
        next_v = next_a = 0.0
        for p in reversed(order):
            next_a = r[p] + gamma * next_v - v[p] + gamma * lam * next_a
            next_v = v[p]
            raw[p] = next_a
    return raw.reshape(rew.shape)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8), (0.7, 0.0)])
def test_gae_along_links_equals_gae_over_each_trajectory_in_time_order(gamma, lam):
    fn = jax.jit(functools.partial(adv.gae, gamma=gamma, lam=lam))
    across_rows = backward = 0
    for seed in range(6):
        rew, values, mask, segs, links, chains = random_linked_layout(seed)
        src, dst = links[links[:, 0] >= 0].T
        assert src.size >= 3  # several links per case
        across_rows += int(np.sum(src // rew.shape[1] != dst // rew.shape[1]))
        backward += int(np.sum(dst < src))
        a, ret = fn(*(jnp.asarray(x) for x in (rew, values, mask, segs, links)))
        raw = ref_linked_gae(rew, values, chains, gamma, lam)
        np.testing.assert_allclose(ret, np.where(mask, raw + values, 0.0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(a, ref_whiten(raw, mask), rtol=1e-4, atol=1e-5)
    assert across_rows and backward  # links to other rows and to earlier positions occur


def test_gae_without_links_or_with_padding_links_is_unchanged():
    rew, values, mask, segs, links, _ = random_linked_layout(0)
    fn = jax.jit(functools.partial(adv.gae, gamma=0.9, lam=0.8))
    plain = fn(*(jnp.asarray(x) for x in (rew, values, mask, segs)))
    padded = fn(*(jnp.asarray(x) for x in (rew, values, mask, segs)), -jnp.ones((4, 2), jnp.int32))
    for x, y in zip(plain, padded, strict=True):  # the same up to float32 rounding of the sums
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
