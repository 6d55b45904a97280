"""Tests of rljax.core.losses against the reference values of design §3.2-§3.3 and float64 numpy."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.core import losses


def clipped_tokens(name, logp, old, inf, adv, mask, segment_ids=None, num_segments=None, **kw):
    """The clip indicator that the registered loss ``name`` returns with its per-token loss."""
    inputs = losses.LossInputs(logp, old, inf, adv, mask, segment_ids, num_segments)
    return losses.policy_loss(name, inputs, **kw)[1]


def loss_of(fn):
    """``fn`` returning its per-token loss alone (policy losses return ``PolicyLossTerms(loss, clipped)``)."""

    @functools.wraps(fn)
    def call(*args, **kw):
        return fn(*args, **kw).loss

    return call


# ------------------------------------------------------------------------------------------------
# float64 numpy references (written from design §3.2-§3.3, independent of the code under test)
# ------------------------------------------------------------------------------------------------


def np_ratio(lp, ref):
    return np.exp(np.clip(lp - ref, -20.0, 20.0))


def np_inside(lp, ref):
    """d clip(lp - ref, -20, 20) / d lp."""
    return ((lp - ref > -20) & (lp - ref < 20)).astype(np.float64)


def np_ppo(lp, old, a, eps_low=0.2, eps_high=0.2):
    r = np_ratio(lp, old)
    unclipped, clipped = r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a
    value = -np.minimum(unclipped, clipped)
    grad = np.where(unclipped <= clipped, -a * r * np_inside(lp, old), 0.0)
    return value, grad


def np_dual_clip(lp, old, a, eps_low=0.2, eps_high=0.2, c=3.0):
    value, grad = np_ppo(lp, old, a, eps_low, eps_high)
    dual = (a < 0) & (-a * c < value)
    return np.where(dual, -a * c, value), np.where(dual, 0.0, grad)


def np_gspo(lp, old, a, mask, seg, eps_low=3e-4, eps_high=4e-4):
    """GSPO-token with the paper's default clip (Zheng et al. 2025: 3e-4 / 4e-4)."""
    value, grad = np.zeros_like(lp), np.zeros_like(lp)
    flat = [x.reshape(-1) for x in (lp, old, a, mask, seg)]
    out_v, out_g = value.reshape(-1), grad.reshape(-1)
    for j in np.unique(flat[4]):
        idx = np.nonzero(flat[4] == j)[0]
        m = flat[3][idx] != 0
        d = np.clip(flat[0][idx] - flat[1][idx], -20, 20)
        s = d[m].mean() if m.any() else 0.0
        w = np.exp(min(s, 10.0))
        aa = flat[2][idx]
        unclipped, clipped = w * aa, np.clip(w, 1 - eps_low, 1 + eps_high) * aa
        out_v[idx] = -np.minimum(unclipped, clipped)
        out_g[idx] = np.where((unclipped <= clipped) & (s < 10.0), -aa * w, 0.0)
    return value, grad


def np_cispo(lp, beh, a, eps_low=1.0, eps_high=4.0):
    c = np.clip(np_ratio(lp, beh), 1 - eps_low, 1 + eps_high)
    return -a * c * lp, -a * c


def np_dppo(lp, inf, a, mask, mask_low=0.2, mask_high=0.2, adv_tau=1.0, kl_tau=1e-3):
    dp = np.exp(lp) - np.exp(inf)
    m = (mask != 0).astype(np.float64)
    dropped = ((a > 0) & (dp > mask_high)) | ((a <= 0) & (dp < -mask_low))
    keep = m * ~dropped
    log_r = np.clip(lp - inf, -20, 20)
    r = np.exp(log_r)
    return -keep * adv_tau * a * r + kl_tau * m * log_r**2, -keep * adv_tau * a * r + 2 * kl_tau * m * log_r


def np_sapo(lp, old, a, tau_pos=1.0, tau_neg=1.05):
    r = np_ratio(lp, old)
    tau = np.where(a > 0, tau_pos, tau_neg)
    sig = 1.0 / (1.0 + np.exp(-tau * (r - 1)))
    return -sig * 4 / tau * a, -a * 4 * sig * (1 - sig) * r * np_inside(lp, old)


def np_rollout_is(lp, roll, a, eps_low=0.2, eps_high=0.2):
    r = np_ratio(lp, roll)
    c = np.where((r > 1 - eps_low) & (r < 1 + eps_high), r, 0.0)
    return -c * a * lp, -c * a


def np_is(lp, old, a):
    r = np_ratio(lp, old)
    return -r * a, -r * a * np_inside(lp, old)


def np_ref_kl(lp, inf, ref, mask, mask_low=0.2, kl_tau=1e-3):
    m = (mask != 0).astype(np.float64)
    keep = m * ~(np.exp(lp) - np.exp(inf) < -mask_low)
    log_r = np.clip(lp - inf, -20, 20)
    r = np.exp(log_r)
    return -keep * (ref - lp) * r + kl_tau * m * log_r**2, -keep * (ref - lp) * r + 2 * kl_tau * m * log_r


def np_cov(lp, a, mask):
    """(A - mean A)(logp - mean logp), means over the tokens with mask != 0 (SkyRL clip_cov/kl_cov)."""
    m = mask != 0
    if not m.any():
        return np.zeros_like(lp)
    return (a - a[m].mean()) * (lp - lp[m].mean())


def np_kl_cov(lp, old, a, mask, kl_cov_frac=0.2, ppo_kl_coef=1.0):
    """kl_cov: -A r, plus coef |logp - old| on the max(int(frac n), 1) masked tokens of largest cov."""
    m = (mask != 0).reshape(-1)
    k = max(int(kl_cov_frac * m.sum()), 1)
    order = np.argsort(-np.where(m, np_cov(lp, a, mask).reshape(-1), -np.inf), kind="stable")
    top = np.zeros(m.size, bool)
    top[order[:k]] = True
    top = (top & m).reshape(lp.shape)
    r, d = np_ratio(lp, old), lp - old
    value = -a * r + top * ppo_kl_coef * np.abs(d)
    return value, -a * r * np_inside(lp, old) + top * ppo_kl_coef * np.sign(d)


def np_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "abs":
        return np.abs(d)
    if kind == "k2":
        return d**2 / 2
    x = np.clip(-d, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


def np_entropy(logits, temperature):
    z = logits / temperature
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(-1)


def random_inputs(seed, shape=(3, 9), extreme=True):
    """float64 arrays: logp, old, inference, ref logprobs, adv, mask, segment ids."""
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(0.02, 1.0, shape))
    old = np.minimum(lp + rng.normal(0, 0.4, shape), 0.0)
    inf = np.log(np.clip(np.exp(lp) + rng.normal(0, 0.25, shape), 0.01, 1.0))
    ref = np.log(rng.uniform(0.02, 1.0, shape))
    adv = rng.normal(0, 1, shape)
    adv[0, 0] = 0.0
    mask = (rng.uniform(size=shape) < 0.75).astype(np.float64)
    seg = np.sort(rng.integers(0, 4, shape).reshape(-1)).reshape(shape)
    if extreme:  # log-ratios beyond the +-20 clip
        old[0, 1], old[1, 2] = lp[0, 1] - 30.0, lp[1, 2] + 30.0
    return lp, old, inf, ref, adv, mask, seg


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def grad_of(fn, lp, *args):
    return jax.grad(lambda x: jnp.sum(fn(x, *args)))(lp)


TOL = dict(rtol=2e-5, atol=2e-6)
BUILTIN_LOSSES = {
    "ppo_clip",
    "dual_clip",
    "gspo",
    "cispo",
    "dppo",
    "sapo",
    "rollout_is",
    "importance_sampling",
    "clip_cov",
    "kl_cov",
}

# ------------------------------------------------------------------------------------------------
# Reference values of design §3.2-§3.3
# ------------------------------------------------------------------------------------------------

P_TRAIN = np.array([0.5, 0.5, 0.9, 0.1])
P_INF = np.array([0.5, 0.2, 0.6, 0.4])
ADV = np.array([1.0, 1.0, -1.0, -1.0])
P_REF = np.array([0.6, 0.3, 0.8, 0.3])


class SpecValuesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_dppo_reference(self):
        lp, inf, a = f32(np.log(P_TRAIN), np.log(P_INF), ADV)
        loss = self.variant(loss_of(losses.dppo))(lp, inf, a, jnp.ones(4))
        np.testing.assert_allclose(loss, [-1.0, 8.39589e-4, 1.5001644, 1.92181e-3], rtol=1e-5)
        np.testing.assert_allclose(jnp.sum(loss), 0.5029258, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_ref_kl_reference(self):
        lp, inf, ref = f32(np.log(P_TRAIN), np.log(P_INF), np.log(P_REF))
        loss = self.variant(losses.ref_kl)(lp, inf, ref, jnp.ones(4))
        np.testing.assert_allclose(jnp.sum(loss), 1.2743429, rtol=1e-6)

    def test_dppo_reference_matches_numpy(self):
        value, _ = np_dppo(np.log(P_TRAIN), np.log(P_INF), ADV, np.ones(4))
        np.testing.assert_allclose(value.sum(), 0.5029258, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Values and gradients against numpy on random inputs
# ------------------------------------------------------------------------------------------------

# name -> (jax fn taking float32 arrays, numpy reference, which inputs: indices into random_inputs)
ELEMENTWISE = {
    "ppo_clip": (loss_of(losses.ppo_clip), np_ppo, (0, 1, 4)),
    "ppo_clip_asym": (
        functools.partial(loss_of(losses.ppo_clip), eps_low=0.1, eps_high=0.28),
        functools.partial(np_ppo, eps_low=0.1, eps_high=0.28),
        (0, 1, 4),
    ),
    "dual_clip": (loss_of(losses.dual_clip), np_dual_clip, (0, 1, 4)),
    "cispo": (loss_of(losses.cispo), np_cispo, (0, 1, 4)),
    "cispo_tight": (
        functools.partial(loss_of(losses.cispo), eps_low=0.2, eps_high=0.3),
        functools.partial(np_cispo, eps_low=0.2, eps_high=0.3),
        (0, 1, 4),
    ),
    "dppo": (loss_of(losses.dppo), np_dppo, (0, 2, 4, 5)),
    "dppo_kwargs": (
        functools.partial(loss_of(losses.dppo), mask_low=0.1, mask_high=0.3, adv_tau=0.5, kl_tau=0.1),
        functools.partial(np_dppo, mask_low=0.1, mask_high=0.3, adv_tau=0.5, kl_tau=0.1),
        (0, 2, 4, 5),
    ),
    "sapo": (loss_of(losses.sapo), np_sapo, (0, 1, 4)),
    "rollout_is": (loss_of(losses.rollout_is), np_rollout_is, (0, 2, 4)),
    "importance_sampling": (loss_of(losses.importance_sampling), np_is, (0, 1, 4)),
    "ref_kl": (losses.ref_kl, np_ref_kl, (0, 2, 3, 5)),
}


class ElementwiseLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*[(n, n) for n in ELEMENTWISE])
    def test_values_and_grads(self, name):
        fn, ref_fn, which = ELEMENTWISE[name]
        for seed in range(2):
            inputs = random_inputs(seed)
            args = [inputs[i] for i in which]
            want_value, want_grad = ref_fn(*args)
            jargs = f32(*args)
            got = self.variant(fn)(*jargs)
            self.assertEqual(got.dtype, jnp.float32)
            chex.assert_shape(got, args[0].shape)
            np.testing.assert_allclose(got, want_value, **TOL)
            np.testing.assert_allclose(self.variant(functools.partial(grad_of, fn))(*jargs), want_grad, **TOL)

    @parameterized.named_parameters(*[(n, n) for n in ELEMENTWISE])
    def test_vmap_over_rows(self, name):
        fn, _, which = ELEMENTWISE[name]
        inputs = random_inputs(7)
        jargs = f32(*[inputs[i] for i in which])
        np.testing.assert_allclose(jax.vmap(fn)(*jargs), fn(*jargs), rtol=1e-6, atol=1e-7)

    def test_bf16_inputs_give_float32(self):
        lp, old, _, _, adv, _, _ = random_inputs(0)
        out = loss_of(losses.ppo_clip)(*[jnp.asarray(x, jnp.bfloat16) for x in (lp, old, adv)])
        self.assertEqual(out.dtype, jnp.float32)

    def test_extreme_log_ratios_stay_finite(self):
        lp = jnp.array([0.0, -200.0, 0.0])
        old = jnp.array([-200.0, 0.0, 0.0])
        adv = jnp.array([1.0, -1.0, 1.0])
        for fn in (
            loss_of(losses.ppo_clip),
            loss_of(losses.sapo),
            loss_of(losses.importance_sampling),
            loss_of(losses.cispo),
            loss_of(losses.rollout_is),
        ):
            out = fn(lp, old, adv)
            self.assertTrue(bool(jnp.all(jnp.isfinite(out))), fn.__name__)
            self.assertTrue(bool(jnp.all(jnp.isfinite(grad_of(fn, lp, old, adv)))), fn.__name__)
        want = -np.exp(np.float32(20.0))
        np.testing.assert_allclose(loss_of(losses.importance_sampling)(lp, old, adv)[0], want, rtol=1e-6)

    def test_shape_mismatch_raises(self):
        with self.assertRaises(AssertionError):
            loss_of(losses.ppo_clip)(jnp.zeros(3), jnp.zeros(4), jnp.zeros(3))

    def test_dual_clip_rejects_c_at_most_one(self):
        with self.assertRaisesRegex(ValueError, "clip_ratio_c > 1"):
            loss_of(losses.dual_clip)(jnp.zeros(2), jnp.zeros(2), jnp.ones(2), clip_ratio_c=1.0)


class GspoTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_values_and_grads(self):
        for seed, kw in ((0, {}), (1, {"eps_low": 0.05, "eps_high": 0.05}), (2, {"eps_high": 0.5})):
            lp, old, _, _, adv, mask, seg = random_inputs(seed)
            want_value, want_grad = np_gspo(lp, old, adv, mask, seg, **kw)
            fn = functools.partial(loss_of(losses.gspo), num_segments=4, **kw)
            jl, jo, ja = f32(lp, old, adv)
            got = self.variant(fn)(jl, jo, ja, mask, seg)
            np.testing.assert_allclose(got, want_value, **TOL)
            grad_fn = jax.grad(lambda x, o, a, m, s, f=fn: jnp.sum(f(x, o, a, m, s)))
            grad = self.variant(grad_fn)(jl, jo, ja, mask, seg)
            np.testing.assert_allclose(grad, want_grad, **TOL)

    def test_masked_tokens_do_not_change_sequence_weight(self):
        lp, old, _, _, adv, mask, seg = [jnp.asarray(x) for x in random_inputs(3)]
        lp, old, adv = f32(lp, old, adv)
        base = loss_of(losses.gspo)(lp, old, adv, mask, seg, 4)
        moved = loss_of(losses.gspo)(lp, jnp.where(mask > 0, old, old - 5.0), adv, mask, seg, 4)
        np.testing.assert_allclose(base, moved, rtol=1e-6)

    def test_log_weight_clamped_at_ten(self):
        lp = jnp.zeros(2)
        out = loss_of(losses.gspo)(
            lp, jnp.full(2, -15.0), -jnp.ones(2), jnp.ones(2), jnp.zeros(2, jnp.int32), 1
        )
        np.testing.assert_allclose(out, np.exp(10.0) * np.ones(2), rtol=1e-6)
        grad = grad_of(
            lambda x: loss_of(losses.gspo)(
                x, jnp.full(2, -15.0), -jnp.ones(2), jnp.ones(2), jnp.zeros(2, jnp.int32), 1
            ),
            lp,
        )
        np.testing.assert_array_equal(grad, 0.0)

    def test_vmap_over_rows(self):
        lp, old, _, _, adv, mask, seg = random_inputs(4)
        jl, jo, ja = f32(lp, old, adv)
        fn = functools.partial(loss_of(losses.gspo), num_segments=4)
        # Row-wise, a segment id shared by two rows denotes two different sequences.
        rows = [np_gspo(*(x[i : i + 1] for x in (lp, old, adv, mask, seg)))[0] for i in range(3)]
        want = np.concatenate(rows)
        np.testing.assert_allclose(jax.vmap(fn)(jl, jo, ja, mask, seg), want, **TOL)


class OtherComponentsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_cross_entropy(self):
        lp = random_inputs(0)[0]
        jl = jnp.asarray(lp, jnp.float32)
        np.testing.assert_allclose(self.variant(losses.cross_entropy)(jl), -lp, **TOL)
        np.testing.assert_allclose(grad_of(losses.cross_entropy, jl), -np.ones_like(lp))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("k1", "abs", "k2", "k3")
    def test_kl(self, kind):
        lp, _, _, ref, *_ = random_inputs(1)
        ref[0, 0] = lp[0, 0] + 40.0  # k3 exp() term clipped at 20 and result at 10
        got = self.variant(functools.partial(losses.kl, kind=kind))(*f32(lp, ref))
        np.testing.assert_allclose(got, np_kl(lp, ref, kind), **TOL)

    def test_kl_k3_hand_values(self):
        # logp=log .5, ref=log .25: x=-log 2 -> .5 + log 2 - 1
        np.testing.assert_allclose(
            losses.kl(jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25])))[0],
            0.5 + np.log(2) - 1,
            rtol=1e-6,
        )
        self.assertEqual(float(losses.kl(jnp.array([-3.0]), jnp.array([-60.0]))[0]), 10.0)

    def test_kl_rejects_unknown_kind(self):
        with self.assertRaisesRegex(ValueError, "k3"):
            losses.kl(jnp.zeros(2), jnp.zeros(2), kind="k4")

    @chex.variants(with_jit=True, without_jit=True)
    def test_entropy_from_logits(self):
        rng = np.random.default_rng(0)
        logits = rng.normal(0, 3, (2, 5, 11))
        temps = rng.uniform(0.3, 2.0, (2, 5))
        got = self.variant(losses.entropy_from_logits)(jnp.asarray(logits, jnp.float32), jnp.asarray(temps))
        np.testing.assert_allclose(got, np_entropy(logits, temps[..., None]), rtol=1e-5, atol=1e-6)
        scalar = self.variant(losses.entropy_from_logits)(jnp.asarray(logits, jnp.float32), 0.7)
        np.testing.assert_allclose(scalar, np_entropy(logits, 0.7), rtol=1e-5, atol=1e-6)

    def test_entropy_with_masked_vocab_is_finite(self):
        logits = jnp.array([[0.0, 0.0, -jnp.inf, -jnp.inf]])
        np.testing.assert_allclose(losses.entropy_from_logits(logits), [np.log(2)], rtol=1e-6)
        grad_fn = jax.jit(jax.grad(lambda x: jnp.sum(losses.entropy_from_logits(x))))
        grad = grad_fn(jnp.array([[0.3, -0.2, -1e9]]))
        self.assertTrue(bool(jnp.all(jnp.isfinite(grad))))


# ------------------------------------------------------------------------------------------------
# Registry, adapter, clip indicators
# ------------------------------------------------------------------------------------------------


class AdapterTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        lp, old, inf, _, adv, mask, seg = random_inputs(5)
        self.np = (lp, old, inf, adv, mask, seg)
        self.j = (*f32(lp, old, inf, adv), jnp.asarray(mask), jnp.asarray(seg))

    def call(self, name, **kw):
        return losses.policy_loss(name, losses.LossInputs(*self.j, 4), **kw)[0]

    def test_routes_each_registered_loss(self):
        lp, old, inf, adv, mask, seg = self.np
        want = {
            "ppo_clip": np_ppo(lp, old, adv)[0],
            "dual_clip": np_dual_clip(lp, old, adv)[0],
            "gspo": np_gspo(lp, old, adv, mask, seg)[0],
            "cispo": np_cispo(lp, old, adv)[0],
            "dppo": np_dppo(lp, inf, adv, mask)[0],
            "sapo": np_sapo(lp, old, adv)[0],
            "rollout_is": np_rollout_is(lp, inf, adv)[0],
            "importance_sampling": np_is(lp, old, adv)[0],
            "kl_cov": np_kl_cov(lp, old, adv, mask)[0],
        }
        self.assertEqual(set(want) | {"clip_cov"}, BUILTIN_LOSSES)
        self.assertLessEqual(BUILTIN_LOSSES, set(losses.POLICY_LOSSES))
        for name, value in want.items():
            np.testing.assert_allclose(self.call(name), value, err_msg=name, **TOL)
        # clip_cov with an empty covariance band removes nothing: plain PPO
        np.testing.assert_allclose(
            self.call("clip_cov", clip_cov_lb=1e6, clip_cov_ub=1e7), np_ppo(lp, old, adv)[0], **TOL
        )

    def test_registered_value_equals_the_public_function(self):
        """Each registered built-in computes exactly its public function (a different non-default
        hyperparameter value where it has one, so the routing of keywords is exercised too)."""
        lp, old, inf, adv, mask, seg = self.j
        public = {
            "ppo_clip": lambda **kw: loss_of(losses.ppo_clip)(lp, old, adv, **kw),
            "dual_clip": lambda **kw: loss_of(losses.dual_clip)(lp, old, adv, **kw),
            "gspo": lambda **kw: loss_of(losses.gspo)(lp, old, adv, mask, seg, 4, **kw),
            "cispo": lambda **kw: loss_of(losses.cispo)(lp, old, adv, **kw),
            "dppo": lambda **kw: loss_of(losses.dppo)(lp, inf, adv, mask, **kw),
            "sapo": lambda **kw: loss_of(losses.sapo)(lp, old, adv, **kw),
            "rollout_is": lambda **kw: loss_of(losses.rollout_is)(lp, inf, adv, **kw),
            "importance_sampling": lambda **kw: loss_of(losses.importance_sampling)(lp, old, adv, **kw),
            "clip_cov": lambda **kw: loss_of(losses.clip_cov)(lp, old, adv, mask, **kw),
            "kl_cov": lambda **kw: loss_of(losses.kl_cov)(lp, old, adv, mask, **kw),
        }
        self.assertEqual(set(public), BUILTIN_LOSSES)
        for name, fn in public.items():
            loss = losses.get_policy_loss(name)
            self.assertEqual(loss.name, name)
            np.testing.assert_array_equal(self.call(name), fn(), err_msg=name)
            for k, v in loss.defaults.items():
                np.testing.assert_array_equal(
                    self.call(name, **{k: v * 0.5}), fn(**{k: v * 0.5}), err_msg=f"{name} {k}"
                )
        self.assertEqual(
            losses.get_policy_loss("cispo").hyperparameters,
            {"eps_low": 1.0, "eps_high": 4.0, "behavior": "old"},
        )

    def test_cispo_behavior_and_kwargs(self):
        lp, _, inf, adv, _, _ = self.np
        got = self.call("cispo", behavior="inference", eps_high=0.5)
        np.testing.assert_allclose(got, np_cispo(lp, inf, adv, eps_high=0.5)[0], **TOL)

    def test_jit_with_static_name(self):
        """LossInputs is a pytree whose num_segments stays static under jit."""
        fn = jax.jit(losses.policy_loss, static_argnums=0, static_argnames=("eps_high",))
        loss, clipped = fn("gspo", losses.LossInputs(*self.j, 4), eps_high=0.3)
        np.testing.assert_allclose(loss, self.call("gspo", eps_high=0.3), rtol=1e-6)
        np.testing.assert_array_equal(clipped, clipped_tokens("gspo", *self.j, 4, eps_high=0.3))

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "unknown policy loss 'ppo'"):
            self.call("ppo")
        with self.assertRaisesRegex(ValueError, r"unknown hyperparameters \['eps'\]"):
            self.call("ppo_clip", eps=0.1)
        with self.assertRaisesRegex(ValueError, "behavior"):
            self.call("cispo", behavior="ref")
        with self.assertRaisesRegex(ValueError, "behavior"):
            self.call("ppo_clip", behavior="old")
        with self.assertRaisesRegex(ValueError, "sequence-level"):
            losses.policy_loss("gspo", losses.LossInputs(*self.j[:5]))
        with self.assertRaisesRegex(ValueError, "unknown policy loss"):
            losses.validate_policy_loss("nope")
        with self.assertRaisesRegex(ValueError, "takes one LossInputs"):
            losses.get_policy_loss("dppo")(self.j)  # the old 8-array form

    def test_user_registered_loss(self):
        def reinforce(logp, adv, mask, *, scale):
            return -scale * adv * logp * mask

        def reinforce_with_clip(logp, adv, mask, *, scale=1.0):  # (loss, clipped) from one function
            return reinforce(logp, adv, mask, scale=scale), jnp.abs(adv) * scale > 1.0

        saved = dict(losses.POLICY_LOSSES)
        try:
            mine = losses.PolicyLoss(reinforce, ("logp", "adv", "mask"), {"scale": 1.0})
            got = losses.register_policy_loss("reinforce_test", mine)
            self.assertIs(losses.get_policy_loss("reinforce_test"), got)
            lp, _, _, adv, mask, _ = self.np
            # the registry's default scale=1.0 applies
            np.testing.assert_allclose(self.call("reinforce_test"), -adv * lp * mask, **TOL)
            np.testing.assert_allclose(self.call("reinforce_test", scale=2.0), -2 * adv * lp * mask, **TOL)
            np.testing.assert_array_equal(clipped_tokens("reinforce_test", *self.j, 4), 0.0)
            with self.assertRaisesRegex(ValueError, r"unknown hyperparameters \['eps'\]"):
                self.call("reinforce_test", eps=0.1)
            with self.assertRaisesRegex(ValueError, "already registered; pass overwrite=True"):
                losses.register_policy_loss("reinforce_test", mine)
            # inputs and defaults read from the signature: ("logp", "adv", "mask"), {"scale": 1.0}
            with_clip = losses.PolicyLoss(reinforce_with_clip)
            self.assertEqual(with_clip.inputs, ("logp", "adv", "mask"))
            self.assertEqual(dict(with_clip.defaults), {"scale": 1.0})
            losses.register_policy_loss("reinforce_test", with_clip, overwrite=True)
            np.testing.assert_allclose(self.call("reinforce_test"), -adv * lp * mask, **TOL)
            got = clipped_tokens("reinforce_test", *self.j, 4, scale=2.0)
            self.assertEqual(got.dtype, jnp.float32)
            np.testing.assert_array_equal(got, (np.abs(adv) * 2.0 > 1.0).astype(np.float32))
            self.assertTrue(0 < float(got.sum()) < got.size)
            losses.validate_policy_loss("reinforce_test", {"scale": 3.0})
        finally:
            losses._POLICY_LOSSES._values.clear()
            losses._POLICY_LOSSES._values.update(saved)
        with self.assertRaisesRegex(ValueError, "unknown policy loss 'reinforce_test'"):
            self.call("reinforce_test")

    def test_user_loss_with_input_choice_and_segments(self):
        def seq_reinforce(logp, behavior_logp, adv, segment_ids, num_segments, *, scale):
            d = (logp - behavior_logp).reshape(-1)
            total = jax.ops.segment_sum(d, segment_ids.reshape(-1), num_segments)
            return -scale * adv * total[segment_ids]

        choice = losses.InputChoice("behavior_logp", {"old": "old_logp", "sampler": "rollout_logp"}, "old")
        inputs = ("logp", "behavior_logp", "adv", "segment_ids", "num_segments")
        loss = losses.PolicyLoss(seq_reinforce, inputs, {"scale": 1.0}, choices={"source": choice})
        lp, old, inf, adv, _, seg = self.np

        def want(beh):
            d = lp - beh
            total = np.array([d[seg == j].sum() for j in range(4)])
            return -adv * total[seg]

        inputs = losses.LossInputs(*self.j, 4)
        np.testing.assert_allclose(loss(inputs)[0], want(old), **TOL)
        np.testing.assert_allclose(loss(inputs, source="sampler")[0], want(inf), **TOL)
        with self.assertRaisesRegex(ValueError, r"source must be one of \('old', 'sampler'\)"):
            loss(inputs, source="inference")
        with self.assertRaisesRegex(ValueError, "sequence-level"):
            loss(losses.LossInputs(*self.j[:5]))

    @parameterized.parameters(
        (dict(fn=1, inputs=("logp",)), "callable"),
        (dict(fn=losses.ppo_clip, inputs=("logp", "weird")), r"unknown: \['weird'\]"),
        (dict(fn=losses.ppo_clip, inputs=("logp", "logp")), "distinct"),
        (dict(fn=losses.ppo_clip, inputs="logp"), "tuple of input names"),
        (dict(fn=losses.ppo_clip, inputs=("logp",), defaults={"mask": 1.0}), "clash"),
        (dict(fn=losses.ppo_clip, inputs=("logp",), defaults={"e": [1]}), "hashable"),
        (dict(fn=lambda logp, *, eps: logp), r"keyword\(s\) \['eps'\] of its function have no default"),
        (dict(fn=lambda *arrays: arrays[0]), r"takes \*args, so its inputs cannot be read; declare inputs"),
        (
            dict(
                fn=losses.ppo_clip,
                inputs=("logp",),
                choices={"b": losses.InputChoice("x", {"o": "old_logp"}, "o")},
            ),
            "not among inputs",
        ),
    )
    def test_policy_loss_value_errors(self, kwargs, match):
        with self.assertRaisesRegex(ValueError, match):
            losses.PolicyLoss(**kwargs)

    def test_input_choice_errors(self):
        with self.assertRaisesRegex(ValueError, "options must map"):
            losses.InputChoice("b", {"o": "teacher_logp"}, "o")
        with self.assertRaisesRegex(ValueError, "default 'x'"):
            losses.InputChoice("b", {"o": "old_logp"}, "x")
        with self.assertRaisesRegex(ValueError, "expects a PolicyLoss"):
            losses.register_policy_loss("bad_test", losses.ppo_clip)
        with self.assertRaises(TypeError):
            losses.POLICY_LOSSES["x"] = losses.get_policy_loss("dppo")  # read-only view

    def test_clip_indicators(self):
        lp, old, inf, adv, mask, seg = self.np
        r_old, r_inf = np_ratio(lp, old), np_ratio(lp, inf)

        def ppo_hit(r, a, lo=0.2, hi=0.2):
            return ((a > 0) & (r > 1 + hi)) | ((a < 0) & (r < 1 - lo))

        dp = np.exp(lp) - np.exp(inf)
        ppo_value = np_ppo(lp, old, adv)[0]
        w = np.zeros_like(lp)
        for j in np.unique(seg):
            sel = seg == j
            m = sel & (mask != 0)
            w[sel] = np.exp(np.clip(lp[m] - old[m], -20, 20).mean()) if m.any() else 1.0
        want = {
            "ppo_clip": ppo_hit(r_old, adv),
            "dual_clip": ppo_hit(r_old, adv) | ((adv < 0) & (-3 * adv < ppo_value)),
            "gspo": ppo_hit(w, adv, 3e-4, 4e-4),  # the paper's default clip
            "cispo": (r_old < 0.0) | (r_old > 5.0),
            "dppo": ((adv > 0) & (dp > 0.2)) | ((adv <= 0) & (dp < -0.2)),
            "sapo": np.zeros_like(lp, bool),
            "rollout_is": ~((r_inf > 0.8) & (r_inf < 1.2)),
            "importance_sampling": np.zeros_like(lp, bool),
            "kl_cov": np.zeros_like(lp, bool),
        }
        for name, expected in want.items():
            got = clipped_tokens(name, *self.j, 4)
            self.assertEqual(got.dtype, jnp.float32)
            np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg=name)
        self.assertGreater(sum(float(clipped_tokens(n, *self.j, 4).sum()) for n in want), 5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), eps_low=st.floats(0.05, 0.5), eps_high=st.floats(0.05, 0.5))
def test_ppo_clipped_tokens_have_zero_gradient(seed, eps_low, eps_high):
    """Property: where ppo_clip reports a token as clipped its gradient vanishes, and elsewhere it is -A r."""
    lp, old, _, _, adv, mask, seg = random_inputs(seed, extreme=False)
    jl, jo, ja = f32(lp, old, adv)
    kw = dict(eps_low=eps_low, eps_high=eps_high)
    clipped = np.asarray(clipped_tokens("ppo_clip", jl, jo, jo, ja, mask, **kw))
    grad = np.asarray(grad_of(functools.partial(loss_of(losses.ppo_clip), **kw), jl, jo, ja))
    np.testing.assert_array_equal(grad[clipped == 1], 0.0)
    want = -adv * np_ratio(lp, old)
    np.testing.assert_allclose(grad[clipped == 0], want[clipped == 0], rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_k3_nonnegative_and_zero_on_policy(seed):
    lp, _, _, ref, *_ = random_inputs(seed, extreme=False)
    k3 = np.asarray(losses.kl(*f32(lp, ref)))
    assert (k3 >= 0).all()
    np.testing.assert_array_equal(losses.kl(*f32(lp, lp)), 0.0)


# ------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617; SkyRL clip_cov / kl_cov)
# ------------------------------------------------------------------------------------------------

# Hand case: p = [.9, .5, .5, .1], A = [4, 1, 1, -4]. mean(A) = 0.5, mean(log p) = -0.9485600, so
# cov = (A - 0.5)(log p + 0.9485600) = [2.9511982, 0.1277064, 0.1277064, 6.0931130].
# old = [.6, .5, .5, .2]: r = [1.5, 1, 1, 0.5], -A r = [-6, -1, -1, 2],
# |log r| = [0.4054651, 0, 0, 0.6931472].
HAND_P, HAND_OLD = np.array([0.9, 0.5, 0.5, 0.1]), np.array([0.6, 0.5, 0.5, 0.2])
HAND_A = np.array([4.0, 1, 1, -4])


def np_clip_cov_eligible(lp, old, a, mask, eps_low=0.2, eps_high=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0):
    """Tokens clip_cov may remove: masked in, PPO clip inactive, lb < cov < ub (SkyRL semantics)."""
    r = np_ratio(lp, old)
    ppo_clipped = -a * np.clip(r, 1 - eps_low, 1 + eps_high) > -a * r
    cov = np_cov(lp, a, mask)
    return (mask != 0) & ~ppo_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub), ppo_clipped


class CovLossesTest(chex.TestCase):
    def test_spec_defaults(self):
        """SkyRL's defaults (ppo_base_config: clip_cov.*, kl_cov.*; eps_clip_low/high 0.2)."""
        self.assertEqual(
            dict(losses.get_policy_loss("clip_cov").defaults),
            {"eps_low": 0.2, "eps_high": 0.2, "clip_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
        )
        self.assertEqual(
            dict(losses.get_policy_loss("kl_cov").defaults), {"kl_cov_frac": 0.2, "ppo_kl_coef": 1.0}
        )
        self.assertEqual(
            losses.get_policy_loss("clip_cov").inputs, ("logp", "old_logp", "adv", "mask", "rng")
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_cov_hand_values(self):
        lp, old, a = f32(np.log(HAND_P), np.log(HAND_OLD), HAND_A)
        # default kl_cov_frac=0.2: k = max(int(0.8), 1) = 1 -> token 3 (cov 6.09) gets +|log(.1/.2)|
        got = self.variant(loss_of(losses.kl_cov))(lp, old, a, jnp.ones(4))
        np.testing.assert_allclose(got, [-6.0, -1.0, -1.0, 2.6931472], rtol=1e-6)
        # kl_cov_frac=0.5: k = 2 -> tokens 3 and 0 (cov 2.95); ppo_kl_coef scales the penalty
        fn = functools.partial(loss_of(losses.kl_cov), kl_cov_frac=0.5, ppo_kl_coef=2.0)
        got = self.variant(fn)(lp, old, a, jnp.ones(4))
        np.testing.assert_allclose(got, [-6.0 + 0.8109302, -1.0, -1.0, 2.0 + 1.3862944], rtol=1e-6)
        # token 3 masked out: means over tokens 0-2 give cov = [0.7837, 0.1959, 0.1959], k = 1 -> token 0;
        # the masked token keeps its plain -A r value (the objective drops it) and no penalty
        got = self.variant(loss_of(losses.kl_cov))(lp, old, a, jnp.array([1.0, 1, 1, 0]))
        np.testing.assert_allclose(got, [-6.0 + 0.4054651, -1.0, -1.0, 2.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_cov_hand_values(self):
        lp, old, a = f32(np.log(HAND_P), np.log(HAND_OLD), HAND_A)
        on = jnp.ones(4)
        # on-policy (r = 1, no PPO clip): only token 0 has 1 < cov < 5; n_clip = max(int(4 * 2e-4), 1) = 1
        got = self.variant(loss_of(losses.clip_cov))(lp, lp, a, on)
        np.testing.assert_allclose(got, [0.0, -1.0, -1.0, 4.0], rtol=1e-6)
        # clip_cov_ub=7 makes token 3 eligible too; clip_ratio=0.5 -> n_clip = 2 removes both
        fn = functools.partial(loss_of(losses.clip_cov), clip_ratio=0.5, clip_cov_ub=7.0)
        np.testing.assert_allclose(self.variant(fn)(lp, lp, a, on), [0.0, -1.0, -1.0, 0.0], rtol=1e-6)
        # off-policy: tokens 0 (A > 0, r = 1.5) and 3 (A < 0, r = 0.5) are PPO-clipped, hence never
        # removed: plain PPO [-1.2 * 4, -1, -1, 0.8 * 4]
        np.testing.assert_allclose(self.variant(fn)(lp, old, a, on), [-4.8, -1.0, -1.0, 3.2], rtol=1e-6)
        ind = clipped_tokens("clip_cov", lp, old, old, a, on, clip_ratio=0.5, clip_cov_ub=7.0)
        np.testing.assert_array_equal(ind, [1.0, 0.0, 0.0, 1.0])
        ind = clipped_tokens("clip_cov", lp, lp, lp, a, on)
        np.testing.assert_array_equal(ind, [1.0, 0.0, 0.0, 0.0])  # the covariance removal counts as clipped

    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_cov_random_against_numpy(self):
        for seed in range(3):
            lp, old, _, _, adv, mask, _ = random_inputs(seed, extreme=False)
            for kw in ({}, {"kl_cov_frac": 0.5, "ppo_kl_coef": 0.3}):
                value, grad = np_kl_cov(lp, old, adv, mask, **kw)
                fn = functools.partial(loss_of(losses.kl_cov), **kw)
                jl, jo, ja = f32(lp, old, adv)
                np.testing.assert_allclose(self.variant(fn)(jl, jo, ja, jnp.asarray(mask)), value, **TOL)
                g = self.variant(jax.grad(lambda x: jnp.sum(fn(x, jo, ja, jnp.asarray(mask)))))(jl)  # noqa: B023
                np.testing.assert_allclose(g, grad, **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_cov_random_against_numpy_when_every_eligible_token_is_removed(self):
        """clip_ratio=1: n_clip = #masked >= #eligible, so the random subset is all of them."""
        for seed in range(3):
            lp, old, _, _, adv, mask, _ = random_inputs(seed, extreme=False)
            kw = dict(clip_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=2.0)
            eligible, ppo_clipped = np_clip_cov_eligible(
                lp, old, adv, mask, clip_cov_lb=0.05, clip_cov_ub=2.0
            )
            self.assertGreater(eligible.sum(), 2)
            ppo_value, ppo_grad = np_ppo(lp, old, adv)
            fn = functools.partial(loss_of(losses.clip_cov), **kw)
            jl, jo, ja = f32(lp, old, adv)
            m = jnp.asarray(mask)
            want = np.where(eligible, 0.0, ppo_value)
            np.testing.assert_allclose(self.variant(fn)(jl, jo, ja, m), want, **TOL)
            g = self.variant(jax.grad(lambda x: jnp.sum(fn(x, jo, ja, m))))(jl)  # noqa: B023
            np.testing.assert_allclose(g, np.where(eligible, 0.0, ppo_grad), **TOL)
            ind = clipped_tokens("clip_cov", jl, jo, jo, ja, m, **kw)
            np.testing.assert_array_equal(ind, (eligible | ppo_clipped).astype(np.float32))

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_cov_random_subset(self):
        lp, old, _, _, adv, mask, _ = random_inputs(7, shape=(6, 20), extreme=False)
        adv[0, 0] = 0.3  # every PPO value is nonzero, so a removed token is one whose value is 0
        kw = dict(clip_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=10.0)
        eligible, _ = np_clip_cov_eligible(lp, old, adv, mask, clip_cov_lb=0.0, clip_cov_ub=10.0)
        n_clip = max(int(0.05 * (mask != 0).sum()), 1)
        self.assertGreater(eligible.sum(), n_clip + 5)
        jl, jo, ja = f32(lp, old, adv)
        m = jnp.asarray(mask)
        fn = self.variant(functools.partial(loss_of(losses.clip_cov), **kw))
        ppo_value = np_ppo(lp, old, adv)[0]

        def removed(rng):
            got = np.asarray(fn(jl, jo, ja, m, rng))
            out = (got == 0) & (ppo_value != 0)
            np.testing.assert_allclose(got[~out], ppo_value[~out], **TOL)
            return out

        subsets = [removed(jax.random.PRNGKey(k)) for k in range(4)]
        for s in subsets:
            self.assertEqual(int(s.sum()), n_clip)
            self.assertTrue(np.all(eligible[s]))
        np.testing.assert_array_equal(removed(jax.random.PRNGKey(0)), subsets[0])  # same key, same subset
        self.assertGreater(len({s.tobytes() for s in subsets}), 1)  # different keys, different subsets
        # rng=None: a key hashed from the inputs -> deterministic, and the same with and without jit
        default = removed(None)
        self.assertEqual(int(default.sum()), n_clip)
        np.testing.assert_array_equal(default, np.asarray(loss_of(losses.clip_cov)(jl, jo, ja, m, **kw)) == 0)
        np.testing.assert_array_equal(default, removed(None))

    def test_clip_cov_subset_is_uniform(self):
        """Over many keys every eligible token is removed with probability n_clip / #eligible."""
        lp, a = f32(np.log(HAND_P), HAND_A)
        lp, a = jnp.tile(lp, 3), jnp.tile(a, 3)  # 12 tokens: 3 copies of token 0 eligible (1 < cov < 5)
        fn = jax.jit(
            jax.vmap(lambda k: loss_of(losses.clip_cov)(lp, lp, a, jnp.ones(12), k, clip_ratio=1 / 12))
        )
        keys = jax.random.split(jax.random.PRNGKey(0), 3000)
        freq = np.mean(np.asarray(fn(keys)) == 0, axis=0)  # n_clip = 1 of 3 eligible
        np.testing.assert_allclose(freq[[0, 4, 8]], 1 / 3, atol=5 * np.sqrt(2 / 9 / 3000))
        np.testing.assert_array_equal(freq[[1, 2, 3, 5, 6, 7, 9, 10, 11]], 0.0)

    def test_value_checks(self):
        lp, a = f32(np.log(HAND_P), HAND_A)
        with self.assertRaisesRegex(ValueError, "clip_cov_lb < clip_cov_ub"):
            loss_of(losses.clip_cov)(lp, lp, a, jnp.ones(4), clip_cov_lb=5.0, clip_cov_ub=1.0)
        with self.assertRaisesRegex(ValueError, r"clip_ratio must be a fraction in \[0, 1\]"):
            loss_of(losses.clip_cov)(lp, lp, a, jnp.ones(4), clip_ratio=2.0)
        with self.assertRaisesRegex(ValueError, "kl_cov_frac must be a fraction"):
            loss_of(losses.kl_cov)(lp, lp, a, jnp.ones(4), kl_cov_frac=-0.1)

    def test_all_masked_gives_plain_values(self):
        lp, old, a = f32(np.log(HAND_P), np.log(HAND_OLD), HAND_A)
        zero = jnp.zeros(4)
        np.testing.assert_allclose(
            loss_of(losses.kl_cov)(lp, old, a, zero), [-6.0, -1.0, -1.0, 2.0], rtol=1e-6
        )
        np.testing.assert_allclose(
            loss_of(losses.clip_cov)(lp, old, a, zero),
            np_ppo(np.log(HAND_P), np.log(HAND_OLD), HAND_A)[0],
            rtol=1e-6,
        )


if __name__ == "__main__":
    pytest.main([__file__])
