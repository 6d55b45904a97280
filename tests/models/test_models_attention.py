"""Attention math against float64 numpy references written independently (loops / complex numbers)."""

from __future__ import annotations

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.models.attention import (
    apply_rope,
    attention_mask,
    grouped_attention,
    grouped_attention_lse,
    merge_attention,
    packed_attention,
    segment_positions,
)


def _np_segment_positions(seg: np.ndarray) -> np.ndarray:
    out = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            out[b, t] = out[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
    return out


def _np_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]  # pair (i, i + D/2) as one complex number
    z = z * np.exp(1j * pos[:, :, None, None] * inv_freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def _np_attention(q, k, v, mask):
    b, t, n, d = q.shape
    kv = k.shape[2]
    out = np.zeros((b, t, n, d))
    for bi in range(b):
        for h in range(n):
            g = h // (n // kv)
            for i in range(t):
                s = np.array([q[bi, i, h] @ k[bi, j, g] / np.sqrt(d) for j in range(k.shape[1])])
                s = np.where(mask[bi, i], s, -np.inf)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, i, h] = p @ v[bi, :, g]
    return out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=9, max_size=9), min_size=1, max_size=3))
def test_segment_positions_matches_loop(rows):
    seg = np.array(rows, np.int32)
    np.testing.assert_array_equal(np.asarray(segment_positions(jnp.asarray(seg))), _np_segment_positions(seg))
    per_row = jax.vmap(lambda r: segment_positions(r[None])[0])(jnp.asarray(seg))
    np.testing.assert_array_equal(np.asarray(per_row), _np_segment_positions(seg))


class RopeTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_complex_rotation(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(2, 5, 3, 8))
        pos = rng.integers(0, 1000, size=(2, 5))
        inv_freq = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
        got = self.variant(apply_rope)(jnp.asarray(x, jnp.float32), jnp.asarray(pos), jnp.asarray(inv_freq))
        np.testing.assert_allclose(np.asarray(got), _np_rope(x, pos, inv_freq), atol=2e-4)

    def test_scores_depend_only_on_relative_position(self):
        rng = np.random.default_rng(1)
        q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
        inv_freq = jnp.asarray(1.0 / 100.0 ** (np.arange(0, 16, 2) / 16), jnp.float32)

        def score(m, n):
            qm = apply_rope(q, jnp.array([[m]]), inv_freq)
            kn = apply_rope(k, jnp.array([[n]]), inv_freq)
            return float(jnp.sum(qm * kn))

        np.testing.assert_allclose(score(7, 3), score(104, 100), rtol=1e-4)
        assert abs(score(7, 3) - score(7, 4)) > 1e-3


class AttentionTest(parameterized.TestCase):
    def test_mask_hand_example(self):
        seg = jnp.array([[1, 1, 2, 2, 0]])
        slots = jnp.arange(5)
        expected = np.array(
            [
                [1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 0, 0, 1],
            ]
        )
        np.testing.assert_array_equal(np.asarray(attention_mask(seg, seg, slots, slots))[0], expected)
        # Cache slots: 2 queries at slots 3, 4 against 5 slots, slot 2 belongs to another segment.
        kv_seg = jnp.array([[1, 1, 2, 1, 1]])
        got = attention_mask(jnp.array([[1, 1]]), kv_seg, jnp.array([3, 4]), slots)
        np.testing.assert_array_equal(np.asarray(got)[0], [[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]])

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((4, 4), (4, 2), (6, 1))
    def test_grouped_attention_matches_loop(self, heads, kv_heads):
        rng = np.random.default_rng(heads * 10 + kv_heads)
        q = rng.normal(size=(2, 6, heads, 8))
        k = rng.normal(size=(2, 6, kv_heads, 8))
        v = rng.normal(size=(2, 6, kv_heads, 8))
        seg = rng.integers(0, 3, size=(2, 6))
        mask = np.asarray(attention_mask(jnp.asarray(seg), jnp.asarray(seg), jnp.arange(6), jnp.arange(6)))
        f32 = lambda a: jnp.asarray(a, jnp.float32)
        got = self.variant(grouped_attention)(f32(q), f32(k), f32(v), jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(got), _np_attention(q, k, v, mask), atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_lse_and_merge_over_key_splits_equal_the_whole(self):
        """grouped_attention_lse's log-normalizer is log sum exp of the unmasked scaled scores
        (float64 numpy), and merge_attention over any split of the keys (a block fully masked for
        some rows included) gives attention over all keys: the ring's invariant."""
        rng = np.random.default_rng(5)
        q, k, v = (
            rng.normal(size=(2, 6, 4, 8)),
            rng.normal(size=(2, 10, 2, 8)),
            rng.normal(size=(2, 10, 2, 8)),
        )
        mask = rng.random((2, 6, 10)) < 0.6
        mask[:, :, 0] = True  # every row sees one key...
        mask[:, :3, 5:] = False  # ...and rows 0-2 nothing of the second block
        f32 = lambda a: jnp.asarray(a, jnp.float32)
        lse_fn = self.variant(grouped_attention_lse)
        out, lse = lse_fn(f32(q), f32(k), f32(v), jnp.asarray(mask))
        scores = np.einsum("btnd,bsnd->btns", q, np.repeat(k, 2, axis=2)) / np.sqrt(8)
        want_lse = np.log(np.sum(np.where(mask[:, :, None], np.exp(scores), 0.0), axis=-1))
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out), _np_attention(q, k, v, mask), atol=1e-5)
        for split in (1, 5, 9):
            a = lse_fn(f32(q), f32(k[:, :split]), f32(v[:, :split]), jnp.asarray(mask[..., :split]))
            b = lse_fn(f32(q), f32(k[:, split:]), f32(v[:, split:]), jnp.asarray(mask[..., split:]))
            merged, merged_lse = self.variant(merge_attention)(a, b)
            np.testing.assert_allclose(np.asarray(merged), _np_attention(q, k, v, mask), atol=1e-5)
            np.testing.assert_allclose(np.asarray(merged_lse), want_lse, atol=1e-5, rtol=1e-5)

    def test_fully_masked_row_is_finite(self):
        q = jnp.ones((1, 1, 2, 4))
        k = jnp.ones((1, 3, 1, 4))
        out = grouped_attention(q, k, k, jnp.zeros((1, 1, 3), bool))
        assert bool(jnp.all(jnp.isfinite(out)))


def _np_mask(q_seg, kv_seg, q_slots, kv_slots):
    b, t, s = q_seg.shape[0], len(q_slots), len(kv_slots)
    mask = np.zeros((b, t, s), bool)
    for bi in range(b):
        for i in range(t):
            for j in range(s):
                mask[bi, i, j] = kv_slots[j] <= q_slots[i] and q_seg[bi, i] == kv_seg[bi, j]
    return mask


class PackedAttentionTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(None, 1, 3, 4, 7, 50)
    def test_query_blocks_match_loop(self, chunk):
        rng = np.random.default_rng(7)
        q, k, v = rng.normal(size=(2, 7, 4, 8)), rng.normal(size=(2, 9, 2, 8)), rng.normal(size=(2, 9, 2, 8))
        q_seg, kv_seg = rng.integers(0, 3, size=(2, 7)), rng.integers(0, 3, size=(2, 9))
        q_slots, kv_slots = np.arange(2, 9), np.arange(9)  # queries are the last 7 of 9 cache slots
        f32 = lambda a: jnp.asarray(a, jnp.float32)
        fn = self.variant(
            lambda q_, k_, v_: packed_attention(
                q_, k_, v_, q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg),
                q_slots=jnp.asarray(q_slots), kv_slots=jnp.asarray(kv_slots), chunk_size=chunk,
            )
        )  # fmt: skip
        got = fn(f32(q), f32(k), f32(v))
        mask = _np_mask(q_seg, kv_seg, q_slots, kv_slots)
        ref = _np_attention(q, k, v, mask)
        rows = mask.any(-1)  # rows with no visible key are unspecified (finite) in both
        np.testing.assert_allclose(np.asarray(got)[rows], ref[rows], atol=1e-5)

    def test_blocked_gradients_equal_and_memory_bounded(self):
        rng = np.random.default_rng(8)
        t, chunk = 64, 16
        q, k, v = (jnp.asarray(rng.normal(size=(1, t, 2, 8)), jnp.float32) for _ in range(3))
        seg = jnp.asarray(np.repeat([1, 2, 0], [30, 20, 14])[None])
        slots = jnp.arange(t)

        def loss(q_, k_, v_, c):
            out = packed_attention(q_, k_, v_, q_segment_ids=seg, kv_segment_ids=seg, q_slots=slots,
                                   kv_slots=slots, chunk_size=c)  # fmt: skip
            return jnp.sum(jnp.sin(out))

        grads = [jax.grad(loss, argnums=(0, 1, 2))(q, k, v, c) for c in (None, chunk)]
        for a, b in zip(*grads, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, chunk)
        shapes = []

        def walk(jx):
            for eqn in jx.eqns:
                shapes.extend(tuple(o.aval.shape) for o in eqn.outvars if hasattr(o.aval, "shape"))
            for sub in jax.extend.core.subjaxprs(jx):
                walk(sub)

        walk(jaxpr.jaxpr)
        assert not [s for s in shapes if len(s) >= 2 and s[-2:] == (t, t)], "a [T, T] score/mask was built"
        assert [s for s in shapes if len(s) >= 2 and s[-2:] == (chunk, t)]
