"""Tests of rljax.core.off_policy: hand-built cases per stage and a float64 numpy reference."""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl.testing import parameterized

from rljax.core import off_policy
from rljax.core.off_policy import correct

ROLL = -1.0
SEG = np.array([[0, 0, 1, 1], [2, 2, 2, 3]])


def logps(rho):
    """(old_logp, rollout_logp) float32 with exp(old - rollout) == rho."""
    rho = np.asarray(rho, np.float64)
    return jnp.asarray(ROLL + np.log(rho), jnp.float32), jnp.full(rho.shape, ROLL, jnp.float32)


def run(rho, mask, config, loss=None, seg=SEG, num_segments=4, **kw):
    old, roll = logps(rho)
    loss = jnp.ones(old.shape, jnp.float32) if loss is None else jnp.asarray(loss, jnp.float32)
    return correct(loss, old, roll, jnp.asarray(mask), jnp.asarray(seg), num_segments, config, **kw)


ONES = np.ones((2, 4))

# ------------------------------------------------------------------------------------------------
# Hand-built cases, one per stage
# ------------------------------------------------------------------------------------------------


class StageTest(chex.TestCase):
    def test_disabled_is_identity(self):
        loss = np.arange(8.0).reshape(2, 4)
        mask = np.array([[1, 0, 1, 1], [1, 1, 0, 1]])
        out, m, met = run(3 * ONES, mask, {}, loss=loss)
        np.testing.assert_array_equal(out, loss)
        np.testing.assert_array_equal(m, mask)
        self.assertEqual(m.dtype, jnp.float32)
        self.assertEqual(set(met), set(off_policy.METRIC_NAMES))
        for k in off_policy.METRIC_NAMES:
            self.assertEqual(float(met[k]), 3.0 if k in ("is_ratio_mean", "is_ratio_max") else 0.0, k)
        self.assertFalse(off_policy.is_enabled(None))

    def test_outlier_rejects_whole_sequence(self):
        rho = [[1.0, 3.0, 1.0, 1.0], [1.0, 0.4, 1.0, 1.0]]
        mask = [[1, 1, 1, 1], [1, 0, 1, 1]]  # the 0.4 token is not trainable: no rejection
        cfg = {"outlier_token_is_threshold_low": 0.5, "outlier_token_is_threshold_high": 2.0}
        _, m, met = run(rho, mask, cfg)
        np.testing.assert_array_equal(m, [[0, 0, 1, 1], [1, 0, 1, 1]])
        np.testing.assert_allclose(met["outlier_masked_frac"], 2 / 7, rtol=1e-6)
        np.testing.assert_allclose(met["masked_frac"], 2 / 7, rtol=1e-6)
        # one-sided: only the low threshold -> the 3.0 token is fine, a trainable 0.4 rejects sequence 2
        _, m, _ = run(rho, ONES, {"outlier_token_is_threshold_low": 0.5})
        np.testing.assert_array_equal(m, [[1, 1, 1, 1], [0, 0, 0, 1]])

    def test_token_mask(self):
        rho = [[1.0, 1.3, 0.7, 1.0], [1.0, 1.0, 1.0, 5.0]]
        _, m, met = run(rho, ONES, {"token_mask_is_threshold_low": 0.8, "token_mask_is_threshold_high": 1.25})
        np.testing.assert_array_equal(m, [[1, 0, 0, 1], [1, 1, 1, 0]])
        np.testing.assert_allclose(met["token_masked_frac"], 3 / 8, rtol=1e-6)
        _, m, _ = run(rho, ONES, {"token_mask_is_threshold_high": 1.25})
        np.testing.assert_array_equal(m, [[1, 0, 1, 1], [1, 1, 1, 0]])

    def test_stale_token_mask_uses_each_token_version(self):
        # one turn per sequence; an in-flight update crossed the turns of sequences 0 and 2, so their
        # tokens have different versions. Trained version 5; token versions by hand:
        versions = np.array([[5, 4, 3, 2], [3, 3, 5, 4]])
        staleness = 5 - versions  # [[0, 1, 2, 3], [2, 2, 0, 1]]
        rho = [[1.0, 1.5, 9.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
        cfg = {"max_token_staleness": 1, "outlier_token_is_threshold_high": 2.0, "tis_ratio_type": "token"}
        loss, m, met = run(rho, ONES, cfg, staleness=jnp.asarray(staleness))
        # tokens more than 1 version stale are masked; the wild rho = 9 token is one of them, so it
        # rejects nothing; TIS weights are min(rho, 2) per token
        np.testing.assert_array_equal(m, [[1, 1, 0, 0], [0, 0, 1, 1]])
        np.testing.assert_allclose(loss, [[1.0, 1.5, 2.0, 1.0], ONES[1]], rtol=1e-6)
        np.testing.assert_allclose(met["stale_masked_frac"], 4 / 8, rtol=1e-6)
        np.testing.assert_allclose(met["outlier_masked_frac"], 0.0)
        np.testing.assert_allclose(met["masked_frac"], 4 / 8, rtol=1e-6)
        np.testing.assert_allclose(met["tis_clipped_frac"], 0.0)  # the clipped token was masked first
        # max_token_staleness=0 keeps only tokens of the trained version
        _, m, _ = run(ONES, ONES, {"max_token_staleness": 0}, staleness=jnp.asarray(staleness))
        np.testing.assert_array_equal(m, [[1, 0, 0, 0], [0, 0, 1, 0]])
        # without the stage, staleness changes nothing
        _, m, met = run(rho, ONES, {"tis_ratio_type": "token"}, staleness=jnp.asarray(staleness))
        np.testing.assert_array_equal(m, ONES)
        np.testing.assert_allclose(met["stale_masked_frac"], 0.0)
        with self.assertRaisesRegex(ValueError, "per-token staleness"):
            run(ONES, ONES, {"max_token_staleness": 1})

    def test_token_tis(self):
        rho = np.array([[1.0, 3.0, 0.5, 2.5], [1.5, 1.0, 9.0, 1.0]])
        mask = np.array([[1, 1, 1, 1], [1, 1, 0, 1]])
        loss = np.full((2, 4), -2.0)
        out, m, met = run(rho, mask, {"tis_ratio_type": "token"}, loss=loss)
        np.testing.assert_allclose(out, -2.0 * np.minimum(rho, 2.0), rtol=1e-6)
        np.testing.assert_array_equal(m, mask)
        np.testing.assert_allclose(met["tis_clipped_frac"], 2 / 7, rtol=1e-6)  # 3.0 and 2.5; 9.0 is masked
        out, _, _ = run(rho, mask, {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.2}, loss=loss)
        np.testing.assert_allclose(out, -2.0 * np.minimum(rho, 1.2), rtol=1e-6)

    def test_sequence_tis(self):
        rho = np.array([[3.0, 3.0, 2.0, 0.5], [1.5, 1.0, 1.0, 1.0]])
        mask = np.array([[1, 1, 1, 1], [1, 0, 1, 1]])
        rho[1, 1] = 100.0  # masked: must not enter the sequence product
        out, _, met = run(rho, mask, {"tis_ratio_type": "sequence"})
        # sequences: 0 -> 9 (capped at 5), 1 -> 1.0, 2 -> 1.5, 3 -> 1.0
        np.testing.assert_allclose(out, [[5.0, 5.0, 1.0, 1.0], [1.5, 1.5, 1.5, 1.0]], rtol=1e-5)
        np.testing.assert_allclose(met["tis_clipped_frac"], 2 / 7, rtol=1e-6)

    def test_geometric_sequence_mask(self):
        rho = np.array([[1.005, 0.999, 1.02, 1.0], [1.03, 0.98, 1.0, 1.0]])
        _, m, met = run(rho, ONES, {"sequence_mask_metric": "geometric"})
        # geo means: seq0 ~1.002 keep, seq1 ~1.00995 keep, seq2 ~1.0032 keep, seq3 1 keep
        np.testing.assert_array_equal(m, ONES)
        rho[0, 2] = 1.05  # seq1 geo mean ~1.0247 > 1.01
        rho[1, 3] = 0.9  # seq3 0.9 < 0.99
        _, m, met = run(rho, ONES, {"sequence_mask_metric": "geometric"})
        np.testing.assert_array_equal(m, [[1, 1, 0, 0], [1, 1, 1, 0]])
        np.testing.assert_allclose(met["sequence_masked_frac"], 3 / 8, rtol=1e-6)
        cfg = {"sequence_mask_metric": "geometric", "geo_mask_low": 0.5, "geo_mask_high": 1.1}
        _, m, _ = run(rho, ONES, cfg)
        np.testing.assert_array_equal(m, ONES)

    def test_product_sequence_mask(self):
        rho = np.array([[1.5, 1.5, 3.0, 1.0], [0.7, 0.7, 1.0, 0.4]])
        # products: seq0 2.25 > 2, seq1 3.0 > 2, seq2 0.49 < 0.5, seq3 0.4 < 0.5
        _, m, met = run(rho, ONES, {"sequence_mask_metric": "product"})
        np.testing.assert_array_equal(m, np.zeros((2, 4)))
        np.testing.assert_allclose(met["sequence_masked_frac"], 1.0)
        mask = np.array([[1, 0, 0, 1], [1, 1, 1, 0]])  # seq0 -> 1.5, seq1 -> 1.0, seq2 0.49, seq3 empty
        _, m, _ = run(rho, mask, {"sequence_mask_metric": "product"})
        np.testing.assert_array_equal(m, [[1, 0, 0, 1], [0, 0, 0, 0]])
        _, m, _ = run(
            rho, ONES, {"sequence_mask_metric": "product", "product_mask_low": 0.3, "product_mask_high": 2.5}
        )
        np.testing.assert_array_equal(m, [[1, 1, 0, 0], [1, 1, 1, 1]])  # only seq1 (3.0) is out

    def test_stage_order(self):
        """A token removed by the token mask (2) leaves the TIS (3) and sequence-mask (4) sums."""
        rho = np.array([[1.0, 50.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
        cfg = {
            "token_mask_is_threshold_high": 10.0,
            "tis_ratio_type": "sequence",
            "sequence_mask_metric": "product",
        }
        out, m, met = run(rho, ONES, cfg)
        np.testing.assert_array_equal(m, [[1, 0, 1, 1], [1, 1, 1, 1]])
        np.testing.assert_allclose(out, ONES, rtol=1e-6)
        np.testing.assert_allclose(met["token_masked_frac"], 1 / 8)
        np.testing.assert_allclose(met["sequence_masked_frac"], 0.0)
        # without the token mask, the 50x token dominates: capped TIS weight 5 and product mask drops seq 0
        out, m, met = run(rho, ONES, {k: v for k, v in cfg.items() if not k.startswith("token_mask")})
        np.testing.assert_allclose(out, [[5, 5, 1, 1], [1, 1, 1, 1]], rtol=1e-6)
        np.testing.assert_array_equal(m, [[0, 0, 1, 1], [1, 1, 1, 1]])
        np.testing.assert_allclose(met["sequence_masked_frac"], 2 / 8)
        np.testing.assert_allclose(met["tis_clipped_frac"], 2 / 8)
        # the outlier reject (1) runs before everything: sequence 0 is gone before the token mask sees it
        _, m, met = run(rho, ONES, {**cfg, "outlier_token_is_threshold_high": 20.0})
        np.testing.assert_array_equal(m, [[0, 0, 1, 1], [1, 1, 1, 1]])
        np.testing.assert_allclose(met["outlier_masked_frac"], 2 / 8)
        np.testing.assert_allclose(met["token_masked_frac"], 0.0)

    def test_normalizer_and_empty_mask(self):
        rho = np.array([[1.0, 3.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
        _, _, met = run(rho, ONES, {"tis_ratio_type": "token"}, normalizer=16.0)
        np.testing.assert_allclose(met["tis_clipped_frac"], 1 / 16)
        np.testing.assert_allclose(met["is_ratio_mean"], 10 / 16, rtol=1e-6)
        cfg = {"tis_ratio_type": "token", "sequence_mask_metric": "geometric"}
        out, m, met = run(rho, np.zeros((2, 4)), cfg)
        for v in met.values():
            self.assertEqual(float(v), 0.0)
        np.testing.assert_array_equal(m, 0.0)

    def test_tis_weight_is_stop_gradient(self):
        rho = np.array([[1.0, 3.0, 0.5, 2.5], [1.5, 1.0, 9.0, 1.0]])
        old, roll = logps(rho)
        cfg = {"tis_ratio_type": "token"}

        def total(loss, o):
            return jnp.sum(correct(loss, o, roll, jnp.ones((2, 4)), jnp.asarray(SEG), 4, cfg)[0])

        g_loss, g_old = jax.grad(total, argnums=(0, 1))(jnp.ones((2, 4)), old)
        np.testing.assert_allclose(g_loss, np.minimum(rho, 2.0), rtol=1e-6)
        np.testing.assert_array_equal(g_old, 0.0)


class ConfigTest(chex.TestCase):
    def test_defaults_and_inputs(self):
        cfg = off_policy.resolve_config(None)
        self.assertEqual(cfg, dict(off_policy.DEFAULT_CONFIG))
        self.assertEqual((cfg["geo_mask_low"], cfg["geo_mask_high"]), (0.99, 1.01))
        self.assertEqual((cfg["product_mask_low"], cfg["product_mask_high"]), (0.5, 2.0))
        self.assertEqual((cfg["token_tis_ratio_clip_high"], cfg["sequence_tis_ratio_clip_high"]), (2.0, 5.0))
        cd = ml_collections.ConfigDict({"tis_ratio_type": "token", "token_tis_ratio_clip_high": 3.0})
        self.assertEqual(off_policy.resolve_config(cd)["token_tis_ratio_clip_high"], 3.0)
        pairs = (("tis_ratio_type", "sequence"),)
        self.assertEqual(off_policy.resolve_config(pairs)["tis_ratio_type"], "sequence")
        rho = np.array([[1.0, 3.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
        out, _, _ = run(rho, ONES, cd)
        np.testing.assert_allclose(out[0, 1], 3.0, rtol=1e-6)

    @parameterized.parameters(
        ({"tis": "token"}, "unknown off-policy correction keys"),
        ({"tis_ratio_type": "tokens"}, "tis_ratio_type"),
        ({"sequence_mask_metric": "arith"}, "sequence_mask_metric"),
        ({"geo_mask_low": 1.2}, "geo_mask_low <= geo_mask_high"),
        ({"token_tis_ratio_clip_high": None}, r"token_tis_ratio_clip_high: expected a number > 0, got None"),
        ({"product_mask_high": -1.0}, r"product_mask_high: expected a number > 0, got -1.0"),
        ({"outlier_token_is_threshold_low": 3.0, "outlier_token_is_threshold_high": 2.0}, "<="),
        ({"token_mask_is_threshold_high": "1.0"}, r"expected a number > 0 or None, got '1.0'"),
        ({"max_token_staleness": -1}, "max_token_staleness"),
        ({"max_token_staleness": 1.5}, "max_token_staleness"),
        ({"max_token_staleness": True}, "max_token_staleness"),
    )
    def test_invalid(self, cfg, message):
        with self.assertRaisesRegex(ValueError, message):
            off_policy.resolve_config(cfg)
        with self.assertRaisesRegex(ValueError, message):
            run(ONES, ONES, cfg)


# ------------------------------------------------------------------------------------------------
# float64 numpy reference on random inputs
# ------------------------------------------------------------------------------------------------


def np_correct(loss, old, roll, mask, seg, cfg, staleness=None):
    """Straightforward per-sequence loops (float64)."""
    full = {**off_policy.DEFAULT_CONFIG, **cfg}
    log_rho = np.clip(old - roll, -20, 20)
    rho = np.exp(log_rho)
    m0 = (mask != 0).astype(np.float64)
    m = m0.copy()
    seqs = [seg == j for j in np.unique(seg)]
    removed = {}

    def outside(x, lo, hi):
        return (lo is not None and x < lo) or (hi is not None and x > hi)

    if full["max_token_staleness"] is not None:
        m[staleness > full["max_token_staleness"]] = 0.0
    removed["stale_masked_frac"] = m0.sum() - m.sum()
    fresh = m.copy()

    lo, hi = full["outlier_token_is_threshold_low"], full["outlier_token_is_threshold_high"]
    before = m.sum()
    if lo is not None or hi is not None:
        for s in seqs:
            if any(outside(r, lo, hi) for r in rho[s & (fresh > 0)]):
                m[s] = 0.0
    removed["outlier_masked_frac"] = before - m.sum()

    lo, hi = full["token_mask_is_threshold_low"], full["token_mask_is_threshold_high"]
    before = m.sum()
    if lo is not None or hi is not None:
        for idx in zip(*np.nonzero(m), strict=True):
            if outside(rho[idx], lo, hi):
                m[idx] = 0.0
    removed["token_masked_frac"] = before - m.sum()

    weight = np.ones_like(rho)
    clipped = 0.0
    if full["tis_ratio_type"] == "token":
        cap = full["token_tis_ratio_clip_high"]
        weight = np.minimum(rho, cap)
        clipped = ((rho > cap) & (m > 0)).sum()
    elif full["tis_ratio_type"] == "sequence":
        cap = full["sequence_tis_ratio_clip_high"]
        for s in seqs:
            ratio = np.exp(np.clip(log_rho[s & (m > 0)].sum(), -20, 20))
            weight[s] = min(ratio, cap)
            clipped += (m[s] > 0).sum() * (ratio > cap)

    before = m.sum()
    metric = full["sequence_mask_metric"]
    if metric is not None:
        m_stage = m.copy()
        for s in seqs:
            vals = log_rho[s & (m_stage > 0)]
            if metric == "geometric":
                stat = vals.mean() if vals.size else 0.0
                lo, hi = full["geo_mask_low"], full["geo_mask_high"]
            else:
                stat, lo, hi = vals.sum(), full["product_mask_low"], full["product_mask_high"]
            if outside(np.exp(np.clip(stat, -20, 20)), lo, hi):
                m[s] = 0.0
    removed["sequence_masked_frac"] = before - m.sum()
    n = m0.sum()
    metrics = {k: v / n for k, v in removed.items()}
    metrics.update(
        is_ratio_mean=(rho * m0).sum() / n, tis_clipped_frac=clipped / n, masked_frac=(m0.sum() - m.sum()) / n
    )
    metrics["is_ratio_max"] = rho[m0 > 0].max() if (m0 > 0).any() else 0.0  # the largest, not a fraction
    return loss * weight, m, metrics


RANDOM_CONFIGS = {
    "token_tis_geo": {
        "tis_ratio_type": "token",
        "sequence_mask_metric": "geometric",
        "geo_mask_low": 0.9,
        "geo_mask_high": 1.1,
    },
    "seq_tis_product": {
        "tis_ratio_type": "sequence",
        "sequence_mask_metric": "product",
        "sequence_tis_ratio_clip_high": 2.0,
        "product_mask_low": 0.2,
        "product_mask_high": 4.0,
    },
    "everything": {
        "outlier_token_is_threshold_low": 0.3,
        "outlier_token_is_threshold_high": 3.0,
        "token_mask_is_threshold_low": 0.7,
        "token_mask_is_threshold_high": 1.4,
        "tis_ratio_type": "token",
        "token_tis_ratio_clip_high": 1.2,
        "sequence_mask_metric": "geometric",
        "geo_mask_low": 0.95,
        "geo_mask_high": 1.05,
    },
    "outlier_only": {"outlier_token_is_threshold_high": 1.4},
    "stale": {"max_token_staleness": 1, "outlier_token_is_threshold_high": 1.4, "tis_ratio_type": "token"},
}


class RandomReferenceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*[(k, k) for k in RANDOM_CONFIGS])
    def test_matches_numpy(self, name):
        cfg = RANDOM_CONFIGS[name]
        for seed in range(2):
            rng = np.random.default_rng(seed)
            shape = (4, 12)
            roll = np.log(rng.uniform(0.05, 1.0, shape))
            old = roll + rng.normal(0, 0.35, shape)
            mask = (rng.uniform(size=shape) < 0.8).astype(np.float64)
            seg = np.sort(rng.integers(0, 10, shape).reshape(-1)).reshape(shape)
            loss = rng.normal(0, 1, shape)
            staleness = rng.integers(0, 3, shape)
            want_loss, want_mask, want_metrics = np_correct(loss, old, roll, mask, seg, cfg, staleness)
            fn = self.variant(functools.partial(correct, num_segments=10, config=cfg))
            got_loss, got_mask, got_metrics = fn(
                *[jnp.asarray(x, jnp.float32) for x in (loss, old, roll)],
                mask=jnp.asarray(mask),
                segment_ids=jnp.asarray(seg),
                staleness=jnp.asarray(staleness),
            )
            np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(got_mask, want_mask)
            for k in off_policy.METRIC_NAMES:
                np.testing.assert_allclose(got_metrics[k], want_metrics[k], rtol=1e-5, err_msg=k)
            # the masks must actually have done something on these inputs for the check to mean anything
            acted = float(got_metrics["masked_frac"]) + float(got_metrics["tis_clipped_frac"])
            self.assertGreater(acted, 0.0)

    def test_vmap_over_rows_equals_rowwise_sequences(self):
        rng = np.random.default_rng(3)
        roll = np.log(rng.uniform(0.05, 1.0, (3, 6)))
        old = roll + rng.normal(0, 0.3, (3, 6))
        seg = np.array([[0, 0, 1, 1, 1, 2]] * 3)
        cfg = RANDOM_CONFIGS["everything"]
        f = functools.partial(correct, num_segments=3, config=cfg)
        args = [jnp.asarray(x, jnp.float32) for x in (np.ones((3, 6)), old, roll)]
        got_loss, got_mask, _ = jax.vmap(f)(*args, jnp.ones((3, 6)), jnp.asarray(seg))
        for i in range(3):
            want_loss, want_mask, _ = np_correct(np.ones(6), old[i], roll[i], np.ones(6), seg[i], cfg)
            np.testing.assert_allclose(got_loss[i], want_loss, rtol=1e-5)
            np.testing.assert_array_equal(got_mask[i], want_mask)


if __name__ == "__main__":
    pytest.main([__file__])
