"""Tests for rljax.core.segments against hand values and float64 numpy loop references."""

from __future__ import annotations

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from rljax.core import segments

# ------------------------------------------------------------------------------------------
# float64 numpy references (loops, written independently of the code under test)
# ------------------------------------------------------------------------------------------


def ref_members(ids, where, g):
    return [i for i in range(len(ids)) if ids[i] == g and (where is None or where[i])]


def ref_sum(x, ids, n, where=None):
    return np.array([sum(float(x[i]) for i in ref_members(ids, where, g)) for g in range(n)])


def ref_count(ids, n, where=None):
    return np.array([len(ref_members(ids, where, g)) for g in range(n)])


def ref_mean(x, ids, n, where=None):
    out = []
    for g in range(n):
        m = ref_members(ids, where, g)
        out.append(np.mean([float(x[i]) for i in m]) if m else 0.0)
    return np.array(out)


def ref_std(x, ids, n, where=None):
    out = []
    for g in range(n):
        vals = np.array([float(x[i]) for i in ref_members(ids, where, g)], np.float64)
        out.append(np.std(vals, ddof=1) if len(vals) > 1 else 0.0)
    return np.array(out)


def ref_max(x, ids, n, where=None):
    out = []
    for g in range(n):
        vals = [float(x[i]) for i in ref_members(ids, where, g)]
        out.append(max(vals) if vals else -np.inf)
    return np.array(out)


def ref_min(x, ids, n, where=None):
    out = []
    for g in range(n):
        vals = [float(x[i]) for i in ref_members(ids, where, g)]
        out.append(min(vals) if vals else np.inf)
    return np.array(out)


def random_case(seed, n=40, num_segments=7):
    rng = np.random.default_rng(seed)
    # ids include out-of-range entries (-1 and num_segments + 2) and leave some segments empty
    ids = rng.choice(np.array([-1, 0, 0, 1, 2, 2, 2, 4, 5, num_segments + 2]), size=n).astype(np.int32)
    x = rng.normal(size=n).astype(np.float32) * 3.0
    where = rng.random(n) < 0.8
    return x, ids, where


# ------------------------------------------------------------------------------------------


class TrajectoryIndexTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_values(self):
        got = self.variant(segments.trajectory_index)(
            jnp.array([True, False, True, True, False, False, True])
        )
        np.testing.assert_array_equal(got, [0, 1, 1, 2, 3, 3, 3])
        chex.assert_type(got, jnp.int32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_random_vs_reference(self):
        rng = np.random.default_rng(0)
        last = rng.random(50) < 0.3
        expected = [int(np.sum(last[:i])) for i in range(50)]
        np.testing.assert_array_equal(self.variant(segments.trajectory_index)(jnp.asarray(last)), expected)

    def test_integer_input(self):
        got = segments.trajectory_index(jnp.array([0, 1, 1], jnp.int32))
        np.testing.assert_array_equal(got, [0, 0, 1])


class SegmentReductionTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_reductions_vs_reference(self, seed):
        x, ids, where = random_case(seed)
        n = 7
        for w in (None, where):
            jw = None if w is None else jnp.asarray(w)
            kw = dict(where=jw)
            fns = {
                "sum": (segments.segment_sum, ref_sum(x, ids, n, w)),
                "mean": (segments.segment_mean, ref_mean(x, ids, n, w)),
                "std": (segments.segment_std, ref_std(x, ids, n, w)),
                "max": (segments.segment_max, ref_max(x, ids, n, w)),
                "min": (segments.segment_min, ref_min(x, ids, n, w)),
            }
            for name, (fn, expected) in fns.items():
                got = self.variant(functools.partial(fn, num_segments=n, **kw))(
                    jnp.asarray(x), jnp.asarray(ids)
                )
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=name)
            count = self.variant(functools.partial(segments.segment_count, num_segments=n, **kw))(
                jnp.asarray(x), jnp.asarray(ids)
            )
            np.testing.assert_array_equal(count, ref_count(ids, n, w))

    def test_hand_values(self):
        x = jnp.array([1.0, 2.0, 3.0, 10.0, 4.0])
        ids = jnp.array([0, 0, 0, 2, -1])
        np.testing.assert_allclose(segments.segment_sum(x, ids, 3), [6.0, 0.0, 10.0])
        np.testing.assert_array_equal(segments.segment_count(x, ids, 3), [3, 0, 1])
        np.testing.assert_allclose(segments.segment_mean(x, ids, 3), [2.0, 0.0, 10.0])
        # unbiased: var([1,2,3]) = 1; empty and single-element segments -> 0 (documented convention)
        np.testing.assert_allclose(segments.segment_std(x, ids, 3), [1.0, 0.0, 0.0])
        np.testing.assert_allclose(segments.segment_max(x, ids, 3), [3.0, -np.inf, 10.0])

    def test_std_is_stable_for_large_offsets(self):
        x = jnp.array([1e4 + 1.0, 1e4 + 2.0, 1e4 + 3.0], jnp.float32)
        np.testing.assert_allclose(segments.segment_std(x, jnp.zeros(3, jnp.int32), 1), [1.0], rtol=1e-3)

    def test_where_equals_dropping(self):
        x, ids, where = random_case(5)
        dropped_ids = np.where(where, ids, -1).astype(np.int32)
        a = segments.segment_std(jnp.asarray(x), jnp.asarray(ids), 7, where=jnp.asarray(where))
        b = segments.segment_std(jnp.asarray(x), jnp.asarray(dropped_ids), 7)
        np.testing.assert_allclose(a, b, rtol=1e-6)

    def test_nonstatic_num_segments_is_a_clear_error(self):
        with pytest.raises(ValueError, match="static"):
            jax.jit(segments.segment_sum)(jnp.ones(3), jnp.zeros(3, jnp.int32), 2)
        with pytest.raises(ValueError, match=">= 1"):
            segments.segment_sum(jnp.ones(3), jnp.zeros(3, jnp.int32), 0)

    def test_shape_mismatch_raises(self):
        with pytest.raises(AssertionError):
            segments.segment_sum(jnp.ones(3), jnp.zeros(4, jnp.int32), 2)
        with pytest.raises(AssertionError):
            segments.segment_sum(jnp.ones((2, 3)), jnp.zeros((3, 2), jnp.int32), 2)

    @chex.variants(with_jit=True, without_jit=True)
    def test_token_arrays_reduce_over_all_entries(self):
        """[R, L] token arrays (the objective's and off-policy's use): the same as the flat [R*L] case."""
        x, ids, where = random_case(4)
        x2, ids2, w2 = (a[:12].reshape(3, 4) for a in (x, ids, where))
        for name in (
            "segment_sum",
            "segment_count",
            "segment_mean",
            "segment_std",
            "segment_max",
            "segment_min",
        ):
            fn = functools.partial(getattr(segments, name), num_segments=7, where=jnp.asarray(w2))
            got = self.variant(fn)(jnp.asarray(x2), jnp.asarray(ids2))
            flat = getattr(segments, name)(
                jnp.asarray(x2.reshape(-1)),
                jnp.asarray(ids2.reshape(-1)),
                7,
                where=jnp.asarray(w2.reshape(-1)),
            )
            np.testing.assert_allclose(got, flat, rtol=1e-6, err_msg=name)
        # hand case: ids -1 and 2 (= num_segments) are dropped
        got = segments.segment_sum(
            jnp.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]]), jnp.array([[0, 1, -1], [1, 2, 0]]), 2
        )
        np.testing.assert_array_equal(got, [33.0, 10.0])


def test_safe_div_values_and_finite_gradients():
    num, den = jnp.array([1.0, 2.0, 3.0]), jnp.array([4.0, 0.0, -1.0])
    np.testing.assert_array_equal(segments.safe_div(num, den), [0.25, 0.0, 0.0])  # default: den > 0
    np.testing.assert_array_equal(segments.safe_div(num, den, where=den != 0), [0.25, 0.0, -3.0])
    grad = jax.grad(lambda d: jnp.sum(segments.safe_div(num, d)))(den)
    np.testing.assert_array_equal(grad, [-1.0 / 16.0, 0.0, 0.0])  # a plain where(ok, n/d, 0) gives NaN


class SegmentGatherTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gather_fill_and_no_wraparound(self):
        v = jnp.array([10.0, 20.0, 30.0])
        ids = jnp.array([2, 0, -1, 3, -3, 1])
        got = self.variant(functools.partial(segments.segment_gather, fill_value=-7.0))(v, ids)
        np.testing.assert_allclose(got, [30.0, 10.0, -7.0, -7.0, -7.0, 20.0])

    def test_gather_2d_values_and_ids(self):
        v = jnp.arange(6.0).reshape(3, 2)
        got = segments.segment_gather(v, jnp.array([[2, 9], [0, 1]]))
        np.testing.assert_allclose(got, [[[4.0, 5.0], [0.0, 0.0]], [[0.0, 1.0], [2.0, 3.0]]])

    def test_mean_gathered_back_is_group_mean(self):
        x, ids, _ = random_case(3)
        got = segments.segment_gather(
            segments.segment_mean(jnp.asarray(x), jnp.asarray(ids), 7), jnp.asarray(ids)
        )
        ref = ref_mean(x, ids, 7)
        expected = [ref[g] if 0 <= g < 7 else 0.0 for g in ids]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


_sum_jit = jax.jit(segments.segment_sum, static_argnums=2)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    ids=st.lists(st.integers(-2, 6), min_size=16, max_size=16),
    x=st.lists(st.floats(-100, 100, width=32), min_size=16, max_size=16),
    perm_seed=st.integers(0, 2**31 - 1),
)
def test_segment_sum_total_and_permutation_invariance(ids, x, perm_seed):
    x = np.asarray(x, np.float32)
    ids = np.asarray(ids, np.int32)
    got = np.asarray(_sum_jit(jnp.asarray(x), jnp.asarray(ids), 5), np.float64)
    valid = (ids >= 0) & (ids < 5)
    np.testing.assert_allclose(got.sum(), x[valid].astype(np.float64).sum(), atol=1e-2)
    perm = np.random.default_rng(perm_seed).permutation(16)
    got_perm = np.asarray(_sum_jit(jnp.asarray(x[perm]), jnp.asarray(ids[perm]), 5), np.float64)
    np.testing.assert_allclose(got_perm, got, atol=1e-3)
