"""Tests of rljax.core.objective: numpy references per reduction and exact micro-batch additivity."""

import dataclasses
import functools
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rljax.core import losses
from rljax.core import objective as obj
from rljax.core.objective import Counts, ObjectiveConfig, combine_metrics, global_counts, objective
from rljax.types import PackedBatch

R, L, G = 8, 16, 5

# ------------------------------------------------------------------------------------------------
# Random packed batches (numpy)
# ------------------------------------------------------------------------------------------------


def make_batch(seed, *, rows=R, length=L):
    """A random packed batch: several samples per row, prompt tokens masked, padding rows."""
    rng = np.random.default_rng(seed)
    f = {
        k: np.zeros((rows, length), np.float32)
        for k in (
            "loss_mask",
            "advantages",
            "inference_logprobs",
            "old_logprobs",
            "ref_logprobs",
            "temperatures",
            "rl_weights",
            "ce_weights",
            "ref_kl_weights",
        )
    }
    int_keys = ("tokens", "positions", "segment_ids", "sample_index", "group_index")
    ints = {k: np.zeros((rows, length), np.int32) for k in int_keys}
    sample = 0
    for r in range(rows):
        if rng.uniform() < 0.15:
            continue  # a fully padded row
        t, seg = 0, 1
        while t < length - 1 and not (t > 0 and rng.uniform() < 0.2):
            n = int(min(rng.integers(2, 9), length - t))
            sl = slice(t, t + n)
            prompt = int(rng.integers(1, n))
            ints["segment_ids"][r, sl], ints["sample_index"][r, sl] = seg, sample
            ints["group_index"][r, sl] = rng.integers(0, G)
            ints["positions"][r, sl] = np.arange(n)
            ints["tokens"][r, sl] = rng.integers(1, 100, n)
            mask = np.zeros(n, np.float32)
            mask[prompt:] = rng.uniform(size=n - prompt) < 0.85
            f["loss_mask"][r, sl] = mask
            f["advantages"][r, sl] = rng.normal() * mask
            f["rl_weights"][r, sl] = float(rng.uniform() < 0.75)
            f["ce_weights"][r, sl] = rng.choice([0.0, 0.0, 0.5, 1.0])
            f["ref_kl_weights"][r, sl] = float(rng.uniform() < 0.35)
            f["temperatures"][r, sl] = 1.0
            t, seg, sample = t + n, seg + 1, sample + 1
    inf = np.log(rng.uniform(0.05, 1.0, (rows, length)))
    f["inference_logprobs"] = np.where(f["loss_mask"] > 0, inf, 0.0).astype(np.float32)
    old = np.minimum(inf + rng.normal(0, 0.2, (rows, length)), 0.0)
    f["old_logprobs"] = np.where(f["loss_mask"] > 0, old, 0.0).astype(np.float32)
    f["ref_logprobs"] = np.log(rng.uniform(0.05, 1.0, (rows, length))).astype(np.float32)
    logp = np.minimum(inf + rng.normal(0, 0.25, (rows, length)), -1e-3).astype(np.float32)
    entropy = rng.uniform(0, 3, (rows, length)).astype(np.float32)
    return PackedBatch(**f, **ints), logp, entropy


def take_rows(batch, rows, pad_to=R):
    """The micro-batch of ``rows``, padded with fully masked rows to ``pad_to`` rows."""

    def one(x):
        x = np.asarray(x)[rows]
        return np.concatenate([x, np.zeros((pad_to - len(rows), x.shape[1]), x.dtype)])

    return jax.tree.map(one, batch)


# ------------------------------------------------------------------------------------------------
# float64 numpy reference of the whole objective (loops over samples and groups)
# ------------------------------------------------------------------------------------------------


def np_policy(name, kw, lp, old, inf, adv, cand, sample_of):
    """(value, d value / d lp) of the per-token policy loss, float64."""

    def ratio(a, b):
        return np.exp(np.clip(a - b, -20, 20))

    if name == "dppo":
        dp = np.exp(lp) - np.exp(inf)
        keep = cand * ~(((adv > 0) & (dp > 0.2)) | ((adv <= 0) & (dp < -0.2)))
        log_r = np.clip(lp - inf, -20, 20)
        pg = -keep * adv * np.exp(log_r)
        return pg + 1e-3 * cand * log_r**2, pg + 2e-3 * cand * log_r
    if name == "ppo_clip":
        lo, hi = kw.get("eps_low", 0.2), kw.get("eps_high", 0.2)
        r = ratio(lp, old)
        u, c = r * adv, np.clip(r, 1 - lo, 1 + hi) * adv
        return -np.minimum(u, c), np.where(u <= c, -adv * r, 0.0)
    if name == "cispo":
        beh = inf if kw.get("behavior") == "inference" else old
        c = np.clip(ratio(lp, beh), 0.0, 5.0)
        return -adv * c * lp, -adv * c
    if name == "gspo":
        value, grad = np.zeros_like(lp), np.zeros_like(lp)
        for key in np.unique(sample_of):
            sel = sample_of == key
            m = sel & (cand > 0)
            w = np.exp(min(np.clip(lp[m] - old[m], -20, 20).mean() if m.any() else 0.0, 10.0))
            lo, hi = kw.get("eps_low", 3e-4), kw.get("eps_high", 4e-4)  # the paper's default clip
            u, c = w * adv[sel], np.clip(w, 1 - lo, 1 + hi) * adv[sel]
            value[sel], grad[sel] = -np.minimum(u, c), np.where(u <= c, -adv[sel] * w, 0.0)
        return value, grad
    if name in ("kl_cov", "clip_cov"):  # batch statistics over the rl candidate tokens of this array
        m = cand > 0
        cov = (adv - adv[m].mean()) * (lp - lp[m].mean())
        r = ratio(lp, old)
        if name == "kl_cov":
            k = max(int(kw["kl_cov_frac"] * m.sum()), 1)
            order = np.argsort(-np.where(m, cov, -np.inf).reshape(-1), kind="stable")
            top = np.zeros(m.size, bool)
            top[order[:k]] = True
            top = top.reshape(m.shape) & m
            d = lp - old
            return -adv * r + top * np.abs(d), -adv * r + top * np.sign(d)
        assert kw["clip_ratio"] == 1.0  # every eligible token removed: no randomness left
        u, c = r * adv, np.clip(r, 0.8, 1.2) * adv
        removed = m & ~(-c > -u) & (cov > kw["clip_cov_lb"]) & (cov < kw["clip_cov_ub"])
        assert removed.any()
        return np.where(removed, 0.0, -np.minimum(u, c)), np.where(removed | (u > c), 0.0, -adv * r)
    raise AssertionError(name)


def np_off_policy(old, inf, cand, sample_of):
    """Token TIS (C=1.2) then geometric sequence mask in [0.9, 1.1] (OFF_POLICY below)."""
    log_rho = np.clip(old - inf, -20, 20)
    weight = np.minimum(np.exp(log_rho), 1.2)
    mask = cand.copy()
    for key in np.unique(sample_of):
        sel = (sample_of == key) & (cand > 0)
        if sel.any() and not 0.9 <= np.exp(log_rho[sel].mean()) <= 1.1:
            mask[sample_of == key] = 0.0
    return weight, mask


OFF_POLICY = {
    "tis_ratio_type": "token",
    "token_tis_ratio_clip_high": 1.2,
    "sequence_mask_metric": "geometric",
    "geo_mask_low": 0.9,
    "geo_mask_high": 1.1,
}


def np_objective(batch, logp, cfg, entropy=None):
    """(loss, d loss / d logp) in float64, from the definitions in design §3.5."""
    b = {k: np.asarray(v, np.float64) for k, v in dataclasses.asdict(batch).items()}
    lp = np.asarray(logp, np.float64)
    sample_of = np.arange(R)[:, None] * 1000 + b["segment_ids"]
    group_of = b["group_index"]
    mask = b["loss_mask"]
    v = {"rl": b["rl_weights"] * mask, "ce": b["ce_weights"] * mask, "ref_kl": b["ref_kl_weights"] * mask}
    cand = (v["rl"] != 0).astype(np.float64)
    kw = dict(cfg.policy_loss_kwargs)
    l_rl, g_rl = np_policy(
        cfg.policy_loss, kw, lp, b["old_logprobs"], b["inference_logprobs"], b["advantages"], cand, sample_of
    )
    if cfg.off_policy is not None:
        weight, keep = np_off_policy(b["old_logprobs"], b["inference_logprobs"], cand, sample_of)
        l_rl, g_rl, v["rl"] = l_rl * weight, g_rl * weight, v["rl"] * keep
    ref_m = (v["ref_kl"] != 0).astype(np.float64)
    inf, ref = b["inference_logprobs"], b["ref_logprobs"]
    keep = ref_m * ~(np.exp(lp) - np.exp(inf) < -0.2)
    log_r = np.clip(lp - inf, -20, 20)
    l_ref = -keep * (ref - lp) * np.exp(log_r) + 1e-3 * ref_m * log_r**2
    g_ref = -keep * (ref - lp) * np.exp(log_r) + 2e-3 * ref_m * log_r
    per_token = {"rl": (l_rl, g_rl), "ce": (-lp, -np.ones_like(lp)), "ref_kl": (l_ref, g_ref)}

    total, grad = 0.0, np.zeros_like(lp)
    weights = {}
    for c in ("rl", "ce", "ref_kl"):
        vc = v[c]
        nz = vc != 0
        w = np.zeros_like(lp)
        if nz.any():
            if cfg.reduction == "token_mean":
                w = vc / nz.sum()
            elif cfg.reduction in ("sequence_mean", "seq_mean_token_sum_norm"):
                keys = [k for k in np.unique(sample_of) if nz[sample_of == k].any()]
                for k in keys:
                    sel = sample_of == k
                    den = nz[sel].sum() if cfg.reduction == "sequence_mean" else cfg.max_len
                    w[sel] = vc[sel] / (len(keys) * den)
            else:
                groups = [g for g in np.unique(group_of) if nz[group_of == g].any()]
                for g in groups:
                    sel = group_of == g
                    w[sel] = vc[sel] / (len(groups) * nz[sel].sum())
        weights[c] = w
        total += (w * per_token[c][0]).sum()
        grad += w * per_token[c][1]
    if entropy is not None:
        total -= cfg.entropy_coef * (weights["rl"] * entropy).sum()
    return total, grad


CONFIGS = {
    "dppo": dict(),
    "ppo_offpolicy": dict(
        policy_loss="ppo_clip", policy_loss_kwargs={"eps_high": 0.28}, off_policy=OFF_POLICY
    ),
    "gspo_offpolicy": dict(policy_loss="gspo", off_policy=OFF_POLICY),
    "cispo_inference": dict(policy_loss="cispo", policy_loss_kwargs={"behavior": "inference"}),
    # batch-statistics losses: not in COMBOS (their statistics are per micro-batch by design)
    "kl_cov": dict(policy_loss="kl_cov", policy_loss_kwargs={"kl_cov_frac": 0.3}),
    "clip_cov": dict(
        policy_loss="clip_cov",
        policy_loss_kwargs={"clip_ratio": 1.0, "clip_cov_lb": 0.02, "clip_cov_ub": 1.0},
    ),
}
REDUCTION_KW = {
    "token_mean": {},
    "sequence_mean": {},
    "seq_mean_token_sum_norm": {"max_len": 24},
    "prompt_mean": {"num_groups": G},
}


# (policy config, reduction) pairs under test: every reduction and every policy loss, few compilations.
COMBOS = [("dppo", r) for r in REDUCTION_KW] + [
    ("ppo_offpolicy", "token_mean"),
    ("ppo_offpolicy", "prompt_mean"),
    ("gspo_offpolicy", "sequence_mean"),
    ("cispo_inference", "seq_mean_token_sum_norm"),
]


def make_config(name, reduction, **extra):
    extra.setdefault("entropy_coef", 0.02)
    return ObjectiveConfig(**CONFIGS[name], reduction=reduction, **REDUCTION_KW[reduction], **extra)


@functools.partial(jax.jit, static_argnames="config")
def value_and_grad(logp, batch, counts, config, entropy):
    fn = lambda x: objective(x, batch, counts, config, entropy=entropy)  # noqa: E731
    return jax.value_and_grad(fn, has_aux=True)(logp)


@functools.partial(jax.jit, static_argnames=("off_policy", "num_groups"))
def _jit_counts(batch, off_policy, num_groups):
    return global_counts(batch, ObjectiveConfig(off_policy=off_policy, num_groups=num_groups))


def counts_of(batch, cfg):
    """Jitted global_counts (keyed only on the config fields counts depend on: fewer compilations)."""
    return _jit_counts(batch, off_policy=cfg.off_policy, num_groups=cfg.num_groups)


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


class ReferenceTest(chex.TestCase):
    @parameterized.named_parameters(*[(f"{n}_{r}", n, r) for n, r in COMBOS])
    def test_matches_numpy(self, name, reduction):
        cfg = make_config(name, reduction)
        for seed in (0, 1):
            batch, logp, entropy = make_batch(seed)
            counts = counts_of(batch, cfg)
            (loss, metrics), grad = value_and_grad(jnp.asarray(logp), batch, counts, cfg, entropy)
            want_loss, want_grad = np_objective(batch, logp, cfg, entropy)
            np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
            parts = sum(metrics[f"loss/{c}"] for c in (*obj.COMPONENTS, "entropy"))
            np.testing.assert_allclose(parts, loss, rtol=1e-6)
            for c in obj.COMPONENTS:  # every component is exercised by these batches
                self.assertGreater(float(jnp.abs(metrics[f"loss/{c}"])), 0.0, c)

    @chex.variants(with_jit=True, without_jit=True)
    def test_variants_and_entropy_bonus(self):
        cfg = make_config("dppo", "sequence_mean")
        batch, logp, entropy = make_batch(2)
        counts = counts_of(batch, cfg)
        fn = self.variant(functools.partial(objective, config=cfg))
        loss, metrics = fn(jnp.asarray(logp), batch, counts, entropy=jnp.asarray(entropy))
        want_loss, _ = np_objective(batch, logp, cfg, entropy=entropy)
        np.testing.assert_allclose(loss, want_loss, rtol=2e-5)
        mask = np.asarray(batch.loss_mask) != 0
        np.testing.assert_allclose(metrics["entropy"], entropy[mask].mean(), rtol=1e-5)
        self.assertLess(float(metrics["loss/entropy"]), 0.0)

    def test_counts_by_hand(self):
        one = np.ones((2, 4), np.float32)
        b = SimpleNamespace(
            loss_mask=np.array([[0, 1, 1, 0], [1, 1, 1, 1]], np.float32),
            segment_ids=np.array([[1, 1, 2, 0], [1, 1, 1, 2]]),
            group_index=np.array([[0, 0, 1, 0], [2, 2, 2, 2]]),
            rl_weights=np.array([[1, 1, 1, 0], [0, 0, 0, 0]], np.float32),
            ce_weights=np.array([[0, 0, 0, 0], [0.5, 0.5, 0.5, 0]], np.float32),
            ref_kl_weights=None,
            inference_logprobs=-one,
            old_logprobs=-one,
        )
        c = global_counts(b, ObjectiveConfig(reduction="prompt_mean", num_groups=3))
        np.testing.assert_array_equal(c.tokens, [2, 3, 0])
        np.testing.assert_array_equal(c.sequences, [2, 1, 0])
        np.testing.assert_array_equal(c.group_tokens, [[1, 1, 0], [0, 0, 3], [0, 0, 0]])
        self.assertEqual(float(c.rl_candidate_tokens), 2.0)
        self.assertEqual(float(c.loss_tokens), 6.0)

    def test_reduction_weights_by_hand(self):
        # one row, samples: A = tokens 0-2 (group 0), B = token 3 (group 1); all rl weight 1
        b = SimpleNamespace(segment_ids=np.array([[1, 1, 1, 2]]), group_index=np.array([[0, 0, 0, 1]]))
        c = Counts(
            tokens=np.array([4.0, 0, 0]),
            sequences=np.array([2.0, 0, 0]),
            group_tokens=np.array([[3.0, 1.0], [0, 0], [0, 0]]),
            rl_candidate_tokens=4.0,
            loss_tokens=4.0,
        )
        v = np.ones((1, 4))
        cases = {
            ObjectiveConfig(): [1 / 4] * 4,
            ObjectiveConfig(reduction="sequence_mean"): [1 / 6, 1 / 6, 1 / 6, 1 / 2],
            ObjectiveConfig(reduction="seq_mean_token_sum_norm", max_len=10): [1 / 20] * 4,
            ObjectiveConfig(reduction="prompt_mean", num_groups=2): [1 / 6, 1 / 6, 1 / 6, 1 / 2],
        }
        for cfg, want in cases.items():
            np.testing.assert_allclose(obj.normalized_weights(v, "rl", b, c, cfg)[0], want, rtol=1e-6)
        np.testing.assert_array_equal(obj.normalized_weights(v, "ce", b, c, ObjectiveConfig()), 0.0)

    def test_spec_dppo_case_through_objective(self):
        lp = np.log(np.array([[0.5, 0.5, 0.9, 0.1]], np.float32))
        one = np.ones((1, 4), np.float32)
        b = SimpleNamespace(
            loss_mask=one,
            segment_ids=one.astype(np.int32),
            group_index=0 * one,
            advantages=np.array([[1.0, 1, -1, -1]], np.float32),
            rl_weights=None,
            ce_weights=None,
            ref_kl_weights=np.ones((1, 4), np.float32),
            old_logprobs=None,
            inference_logprobs=np.log(np.array([[0.5, 0.2, 0.6, 0.4]], np.float32)),
            ref_logprobs=np.log(np.array([[0.6, 0.3, 0.8, 0.3]], np.float32)),
        )
        cfg = ObjectiveConfig(reduction="seq_mean_token_sum_norm", max_len=1)
        loss, m = objective(lp, b, global_counts(b, cfg), cfg)  # one sequence, max_len 1: plain sums
        np.testing.assert_allclose(m["loss/rl"], 0.5029258, rtol=1e-6)
        np.testing.assert_allclose(m["loss/ref_kl"], 1.2743429, rtol=1e-6)
        np.testing.assert_allclose(loss, 0.5029258 + 1.2743429, rtol=1e-6)
        np.testing.assert_allclose(m["rl/clip_frac"], 0.5)


class EdgeCaseTest(chex.TestCase):
    def test_zero_weight_components_give_zero_not_nan(self):
        batch, logp, ent = make_batch(3)
        for name, reduction in COMBOS:
            cfg = make_config(name, reduction)
            empty = batch.replace(ce_weights=np.zeros_like(batch.ce_weights))
            (loss, m), grad = value_and_grad(jnp.asarray(logp), empty, counts_of(empty, cfg), cfg, ent)
            self.assertEqual(float(m["loss/ce"]), 0.0)
            self.assertTrue(np.isfinite(float(loss)) and bool(jnp.all(jnp.isfinite(grad))))
            nothing = batch.replace(loss_mask=np.zeros_like(batch.loss_mask))
            counts = counts_of(nothing, cfg)
            (loss, m), grad = value_and_grad(jnp.asarray(logp), nothing, counts, cfg, ent)
            self.assertEqual(float(loss), 0.0)
            np.testing.assert_array_equal(grad, 0.0)
            for k, val in m.items():
                self.assertTrue(np.isfinite(float(val)), k)

    def test_absent_streams(self):
        batch, logp, _ = make_batch(4)
        ns = SimpleNamespace(**dataclasses.asdict(batch))
        ns.rl_weights = ns.ce_weights = ns.ref_kl_weights = ns.ref_logprobs = ns.old_logprobs = None
        cfg = ObjectiveConfig()
        loss, m = objective(jnp.asarray(logp), ns, global_counts(ns, cfg), cfg)
        explicit = batch.replace(
            rl_weights=np.ones_like(batch.rl_weights),
            ce_weights=0 * batch.ce_weights,
            ref_kl_weights=0 * batch.ce_weights,
            old_logprobs=batch.inference_logprobs,
        )
        want, _ = objective(jnp.asarray(logp), explicit, global_counts(explicit, cfg), cfg)
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        self.assertNotIn("ref_kl/k3", m)
        ns.advantages = None
        with self.assertRaisesRegex(ValueError, "advantages"):
            objective(jnp.asarray(logp), ns, global_counts(ns, cfg), cfg)
        ns.advantages, ns.ref_kl_weights = batch.advantages, batch.ref_kl_weights
        with self.assertRaisesRegex(ValueError, "ref_logprobs"):
            objective(jnp.asarray(logp), ns, global_counts(ns, cfg), cfg)

    def test_entropy_required_by_coef(self):
        batch, logp, _ = make_batch(5)
        cfg = ObjectiveConfig(entropy_coef=0.1)
        with self.assertRaisesRegex(ValueError, "entropy="):
            objective(jnp.asarray(logp), batch, global_counts(batch, cfg), cfg)

    def test_group_index_range_checked_on_host(self):
        batch, _, _ = make_batch(6)
        cfg = ObjectiveConfig(reduction="prompt_mean", num_groups=G - 1)
        with self.assertRaisesRegex(ValueError, "num_groups"):
            global_counts(batch, cfg)

    def test_config_validation_and_hashing(self):
        with self.assertRaisesRegex(ValueError, "reduction"):
            ObjectiveConfig(reduction="mean")
        with self.assertRaisesRegex(ValueError, "max_len"):
            ObjectiveConfig(reduction="seq_mean_token_sum_norm")
        with self.assertRaisesRegex(ValueError, "num_groups"):
            ObjectiveConfig(reduction="prompt_mean")
        with self.assertRaisesRegex(ValueError, "unknown hyperparameters"):
            ObjectiveConfig(policy_loss_kwargs={"eps": 0.1})
        with self.assertRaisesRegex(ValueError, "unknown policy loss"):
            ObjectiveConfig(policy_loss="grpo")
        with self.assertRaisesRegex(ValueError, "unknown off-policy"):
            ObjectiveConfig(off_policy={"tis": "token"})
        with self.assertRaisesRegex(ValueError, "hashable"):
            ObjectiveConfig(policy_loss_kwargs={"eps_low": [0.1]}, policy_loss="ppo_clip")
        a = ObjectiveConfig(
            policy_loss="ppo_clip",
            policy_loss_kwargs={"eps_high": 0.3, "eps_low": 0.1},
            off_policy=ml_collections.ConfigDict({"tis_ratio_type": "token"}),
        )
        b = ObjectiveConfig(
            policy_loss="ppo_clip",
            policy_loss_kwargs=(("eps_low", 0.1), ("eps_high", 0.3)),
            off_policy={"tis_ratio_type": "token"},
        )
        self.assertEqual(a, b)
        self.assertEqual(hash(a), hash(b))
        self.assertIsNone(ObjectiveConfig(off_policy={"tis_ratio_type": None}).off_policy)

    def test_metrics_keys(self):
        batch, logp, entropy = make_batch(7)
        cfg = make_config("ppo_offpolicy", "token_mean")
        _, m = objective(jnp.asarray(logp), batch, global_counts(batch, cfg), cfg, entropy=entropy)
        for k in (
            "loss",
            "loss/rl",
            "loss/ce",
            "loss/ref_kl",
            "loss/entropy",
            "rl/clip_frac",
            "rl/mismatch_kl",
            "rl/adv_mean",
            "rl/adv_sq_mean",
            "ref_kl/k3",
            "entropy",
            "tokens/rl",
            "off_policy/masked_frac",
            "off_policy/tis_clipped_frac",
        ):
            self.assertIn(k, m)
            self.assertEqual(jnp.shape(m[k]), ())
        cand = (np.asarray(batch.rl_weights) * np.asarray(batch.loss_mask)) != 0
        inf = np.asarray(batch.inference_logprobs, np.float64)
        x = np.clip(logp - inf, -20, 20)
        np.testing.assert_allclose(m["rl/mismatch_kl"], (np.exp(x) - x - 1)[cand].mean(), rtol=1e-4)
        np.testing.assert_allclose(m["rl/adv_mean"], np.asarray(batch.advantages)[cand].mean(), rtol=1e-5)
        self.assertGreater(float(m["off_policy/masked_frac"]), 0.0)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 4),
    combo=st.sampled_from(COMBOS),
    data=st.data(),
)
def test_micro_batches_sum_to_whole_batch(seed, k, combo, data):
    """Property: with global counts, loss, grad and metrics summed over a row split equal the whole batch."""
    cfg = make_config(*combo)
    batch, logp, entropy = make_batch(seed)
    counts = counts_of(batch, cfg)
    (loss, metrics), grad = value_and_grad(jnp.asarray(logp), batch, counts, cfg, jnp.asarray(entropy))

    owner = np.array(data.draw(st.lists(st.integers(0, k - 1), min_size=R, max_size=R)))
    total_loss, total_grad = 0.0, np.zeros((R, L))
    total_metrics = dict.fromkeys(metrics, 0.0)  # every metric sums, except the maxima: they max
    summed_counts = None
    for part in range(k):
        rows = np.nonzero(owner == part)[0]
        micro = take_rows(batch, rows)
        pad = lambda x, rows=rows: take_rows(x, rows)  # noqa: E731
        part_counts = counts_of(micro, cfg)
        summed_counts = part_counts if summed_counts is None else summed_counts + part_counts
        (m_loss, m_metrics), m_grad = value_and_grad(
            jnp.asarray(pad(logp)), micro, counts, cfg, jnp.asarray(pad(entropy))
        )
        total_loss += float(m_loss)
        total_grad[rows] += np.asarray(m_grad)[: len(rows)]
        assert not np.any(np.asarray(m_grad)[len(rows) :])  # padding rows get no gradient
        total_metrics = {k: float(v) for k, v in combine_metrics(total_metrics, m_metrics).items()}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), summed_counts, counts)
    np.testing.assert_allclose(total_loss, float(loss), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(total_grad, grad, rtol=2e-5, atol=1e-7)
    for key, value in total_metrics.items():
        np.testing.assert_allclose(value, float(metrics[key]), rtol=2e-5, atol=1e-6, err_msg=key)


def test_data_parallel_sharding_matches_single_device():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail("tests/conftest.py should provide 8 fake CPU devices")
    # Auto axis types (the classic GSPMD mode); see the report about Explicit sharding and segment_sum.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = make_config("gspo_offpolicy", "sequence_mean")
    batch, logp, ent = make_batch(11)
    counts = counts_of(batch, cfg)
    (loss, _), grad = value_and_grad(jnp.asarray(logp), batch, counts, cfg, ent)
    shard = NamedSharding(mesh, P("data"))
    s_batch = jax.device_put(batch, shard)
    s_counts = counts_of(s_batch, cfg)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b), s_counts, counts)
    s_logp, s_ent = jax.device_put((jnp.asarray(logp), jnp.asarray(ent)), shard)
    (s_loss, _), s_grad = value_and_grad(s_logp, s_batch, s_counts, cfg, s_ent)
    np.testing.assert_allclose(s_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(s_grad, grad, rtol=1e-6, atol=1e-8)


class CovLossesThroughObjectiveTest(chex.TestCase):
    """clip_cov / kl_cov via ObjectiveConfig: numpy reference with statistics over the rl tokens passed in."""

    @parameterized.named_parameters(
        ("kl_cov", "kl_cov", "token_mean"), ("clip_cov", "clip_cov", "sequence_mean")
    )
    def test_matches_numpy(self, name, reduction):
        cfg = make_config(name, reduction)
        for seed in (0, 1):
            batch, logp, entropy = make_batch(seed)
            counts = counts_of(batch, cfg)
            (loss, metrics), grad = value_and_grad(jnp.asarray(logp), batch, counts, cfg, entropy)
            want_loss, want_grad = np_objective(batch, logp, cfg, entropy)
            np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
            if name == "kl_cov":
                self.assertEqual(float(metrics["rl/clip_frac"]), 0.0)  # registered without a clip rule
            else:
                self.assertGreater(float(metrics["rl/clip_frac"]), 0.0)

    def test_micro_batches_use_their_own_statistics(self):
        """Documented: the covariance statistics are those of the micro-batch the loss sees."""
        cfg = make_config("kl_cov", "token_mean", entropy_coef=0.0)
        batch, logp, _ = make_batch(3)
        zeros = np.zeros_like(batch.loss_mask)
        batch = dataclasses.replace(batch, ce_weights=zeros, ref_kl_weights=zeros)  # rl only
        counts = counts_of(batch, cfg)
        rows = np.arange(R // 2)
        micro = take_rows(batch, rows)
        (m_loss, _), _ = value_and_grad(jnp.asarray(take_rows(logp, rows)), micro, counts, cfg, None)
        per_token, _ = np_objective(micro, take_rows(logp, rows), cfg)  # token_mean over the micro rows
        n_micro = float(counts_of(micro, cfg).tokens[0])
        np.testing.assert_allclose(float(m_loss), per_token * n_micro / float(counts.tokens[0]), rtol=2e-5)

    def test_rng_reaches_clip_cov(self):
        kw = {"clip_ratio": 0.05, "clip_cov_lb": 0.0, "clip_cov_ub": 10.0}
        cfg = ObjectiveConfig(policy_loss="clip_cov", policy_loss_kwargs=kw)
        batch, logp, _ = make_batch(4)
        counts = counts_of(batch, cfg)
        run = jax.jit(lambda lp, key: objective(lp, batch, counts, cfg, rng=key), static_argnums=())
        lp = jnp.asarray(logp)
        by_key = {float(run(lp, jax.random.PRNGKey(k))[0]) for k in range(6)}
        self.assertGreater(len(by_key), 1)  # the key picks the removed tokens
        same = [float(objective(lp, batch, counts, cfg)[0]) for _ in range(2)]
        self.assertEqual(same[0], same[1])  # rng=None: deterministic fallback


class RegisteredLossThroughObjectiveTest(chex.TestCase):
    def test_user_loss_with_clip_rule(self):
        def scaled_reinforce(logp, inference_logp, adv, *, scale=1.0):  # (loss, clipped), rlax style
            ratio = jnp.exp(logp - inference_logp)
            return -scale * adv * ratio, ratio > 1.1

        saved = dict(losses.POLICY_LOSSES)
        try:
            losses.register_policy_loss("scaled_test", losses.PolicyLoss(scaled_reinforce))
            cfg = ObjectiveConfig(
                policy_loss="scaled_test", policy_loss_kwargs={"scale": 2.0}, components=("rl",)
            )
            with pytest.raises(ValueError, match=r"unknown hyperparameters \['eps'\]"):
                ObjectiveConfig(policy_loss="scaled_test", policy_loss_kwargs={"eps": 2.0})
            batch, logp, _ = make_batch(5)
            counts = counts_of(batch, cfg)
            (loss, metrics), grad = value_and_grad(jnp.asarray(logp), batch, counts, cfg, None)
            b = {k: np.asarray(v, np.float64) for k, v in dataclasses.asdict(batch).items()}
            lp = np.asarray(logp, np.float64)
            v = b["rl_weights"] * b["loss_mask"]
            nz = v != 0
            r = np.exp(lp - b["inference_logprobs"])
            per_token = -2.0 * b["advantages"] * r
            np.testing.assert_allclose(loss, (v * per_token).sum() / nz.sum(), rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(grad, v * per_token / nz.sum(), rtol=2e-5, atol=1e-7)
            want_frac = (r[nz] > 1.1).mean()
            self.assertGreater(want_frac, 0.0)
            np.testing.assert_allclose(metrics["rl/clip_frac"], want_frac, rtol=1e-5)
        finally:
            losses._POLICY_LOSSES._values.clear()
            losses._POLICY_LOSSES._values.update(saved)


if __name__ == "__main__":
    pytest.main([__file__])


def test_components_left_out_are_skipped_entirely():
    """A component the config leaves out contributes nothing, even with nonzero weights in the batch."""
    rng = np.random.default_rng(7)
    shape = (2, 6)
    one = np.ones(shape, np.float32)
    batch = SimpleNamespace(
        loss_mask=(rng.random(shape) < 0.8).astype(np.float32),
        segment_ids=np.ones(shape, np.int32),
        group_index=np.zeros(shape, np.int32),
        advantages=rng.normal(size=shape).astype(np.float32),
        rl_weights=one,
        ce_weights=one,
        ref_kl_weights=one,
        ref_logprobs=np.log(rng.uniform(0.1, 1, shape)).astype(np.float32),
        inference_logprobs=np.log(rng.uniform(0.1, 1, shape)).astype(np.float32),
        old_logprobs=None,
    )
    logp = np.log(rng.uniform(0.1, 1, shape)).astype(np.float32)
    rl_only = SimpleNamespace(**{**vars(batch), "ce_weights": None, "ref_kl_weights": None})
    cfg_rl = ObjectiveConfig(components=("rl",))
    loss_a, m_a = objective(logp, batch, global_counts(batch, cfg_rl), cfg_rl)
    cfg_all = ObjectiveConfig()
    loss_b, m_b = objective(logp, rl_only, global_counts(rl_only, cfg_all), cfg_all)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    assert float(m_a["loss/ce"]) == 0.0 and float(m_a["tokens/ref_kl"]) == 0.0
    # and with every component active the ce and ref_kl terms do contribute
    loss_c, m_c = objective(logp, batch, global_counts(batch, cfg_all), cfg_all)
    assert float(m_c["loss/ce"]) > 0.0
    np.testing.assert_allclose(
        float(loss_c), float(m_c["loss/rl"] + m_c["loss/ce"] + m_c["loss/ref_kl"]), rtol=1e-5
    )


@pytest.mark.parametrize("components", [(), ("rl", "kl"), ("value",)])
def test_components_must_be_known(components):
    with pytest.raises(ValueError, match="components"):
        ObjectiveConfig(components=components)


def test_stale_tokens_leave_the_rl_loss_through_batch_token_staleness():
    """The objective hands ``batch.token_staleness`` to the off-policy correction: with
    ``max_token_staleness=1`` the 2-versions-stale token drops out of the rl loss and of its token
    count (global_counts runs the correction too), so the loss is the mean of the 3 others' dppo."""
    lp = np.log(np.array([[0.5, 0.5, 0.9, 0.1]], np.float32))
    one = np.ones((1, 4), np.float32)
    batch = SimpleNamespace(
        loss_mask=one, segment_ids=one.astype(int), group_index=0 * one,
        advantages=np.array([[1.0, 1, -1, -1]]),
        rl_weights=one, ce_weights=None, ref_kl_weights=None, ref_logprobs=None, old_logprobs=None,
        inference_logprobs=np.log(np.array([[0.5, 0.2, 0.6, 0.4]], np.float32)),
        token_staleness=np.array([[0, 2, 1, 0]], np.int32),
    )  # fmt: skip
    cfg = ObjectiveConfig(off_policy={"max_token_staleness": 1})
    loss, metrics = objective(lp, batch, global_counts(batch, cfg), cfg)
    per_token = np.asarray(losses.dppo(lp, batch.inference_logprobs, batch.advantages, one).loss)
    np.testing.assert_allclose(float(loss), per_token[0, [0, 2, 3]].sum() / 3, rtol=1e-6)
    assert float(metrics["off_policy/stale_masked_frac"]) == 0.25
    with pytest.raises(ValueError, match="per-token staleness"):
        objective(
            lp, SimpleNamespace(**{**vars(batch), "token_staleness": None}), global_counts(batch, cfg), cfg
        )


@pytest.mark.parametrize(
    ("kind", "want"),
    [
        # d = log(pi / pi_ref) on the 3 rl tokens: log 2, 0, log(1/2); k1 = d, k3 = r - log r - 1 with
        # r = pi_ref / pi = [1/2, 1, 2]: [0.5 - log .5 - 1, 0, 2 - log 2 - 1]
        ("k1", (np.log(2.0) + 0.0 + np.log(0.5)) / 3),
        ("k2", (0.5 * np.log(2.0) ** 2 + 0.0 + 0.5 * np.log(0.5) ** 2) / 3),
        ("k3", ((0.5 - np.log(0.5) - 1) + 0.0 + (2.0 - np.log(2.0) - 1)) / 3),
        ("abs", (np.log(2.0) + 0.0 + np.log(2.0)) / 3),
    ],
)
def test_kl_penalty_to_a_reference_hand_values(kind, want):
    """beta * token_mean of the chosen estimator over the rl tokens (the 4th token is masked), on
    top of the policy loss, with its gradient -beta d k / d logp only through the trained logprobs."""
    p, ref = np.array([[0.4, 0.3, 0.2, 0.9]]), np.array([[0.2, 0.3, 0.4, 0.1]])
    lp = jnp.asarray(np.log(p), jnp.float32)
    mask = np.array([[1.0, 1, 1, 0]], np.float32)
    batch = SimpleNamespace(
        loss_mask=mask, segment_ids=np.ones((1, 4), int), group_index=np.zeros((1, 4)),
        advantages=np.zeros((1, 4), np.float32), rl_weights=None, ce_weights=None, ref_kl_weights=None,
        ref_logprobs=None, old_logprobs=None, inference_logprobs=np.asarray(lp),
        kl_reference_logprobs=np.log(ref).astype(np.float32),
    )  # fmt: skip
    beta = 0.1
    cfg = ObjectiveConfig(policy_loss="ppo_clip", components=("rl",), kl_coef=beta, kl_kind=kind)
    loss, metrics = objective(lp, batch, global_counts(batch, cfg), cfg)  # zero advantages: KL only
    np.testing.assert_allclose(float(loss), beta * want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss/kl_penalty"]), beta * want, rtol=1e-5)
    np.testing.assert_allclose(
        float(metrics["ref_kl/reference_k1"]), (np.log(2) + np.log(0.5)) / 3, atol=1e-6
    )
    grad = jax.grad(lambda x: objective(x, batch, global_counts(batch, cfg), cfg)[0])(lp)
    assert float(grad[0, 3]) == 0.0  # masked
    d = np.log(p[0, :3]) - np.log(ref[0, :3])
    dk = {"k1": np.ones(3), "k2": d, "k3": 1 - np.exp(-d), "abs": np.where(d >= 0, 1.0, -1.0)}[kind]
    np.testing.assert_allclose(np.asarray(grad[0, :3]), beta * dk / 3, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="kl_reference_logprobs is None but kl_coef"):
        objective(lp, SimpleNamespace(**{**vars(batch), "kl_reference_logprobs": None}),
                  global_counts(batch, cfg), cfg)  # fmt: skip
