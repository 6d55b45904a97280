"""The training attention (causal block skipping) against float64 numpy references written with loops.

References: a float64 loop attention (forward) and its hand-derived float64 backward
(``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(P * dP))``, ``dQ = dS K / sqrt(D)``,
``dK = dS^T Q / sqrt(D)``, summed over the query heads of each key/value head), both independent of
the JAX code; the traced graph is checked for the skipped blocks (no ``T x T`` scores).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.models import Decoder, ModelConfig
from rljax.models.attention import causal_attention, causal_block_size, packed_attention


def _np_mask(seg: np.ndarray) -> np.ndarray:
    b, t = seg.shape
    mask = np.zeros((b, t, t), bool)
    for bi in range(b):
        for i in range(t):
            for j in range(t):
                mask[bi, i, j] = j <= i and seg[bi, i] == seg[bi, j]
    return mask


def _np_forward(q, k, v, mask):
    """float64 loops; returns the output and the probabilities ``P[b, h, i, j]``."""
    b, t, n, d = q.shape
    group = n // k.shape[2]
    out = np.zeros((b, t, n, d))
    probs = np.zeros((b, n, t, k.shape[1]))
    for bi in range(b):
        for h in range(n):
            for i in range(t):
                s = np.array([q[bi, i, h] @ k[bi, j, h // group] for j in range(k.shape[1])]) / np.sqrt(d)
                s = np.where(mask[bi, i], s, -np.inf)
                p = np.exp(s - s.max())
                probs[bi, h, i] = p / p.sum()
                out[bi, i, h] = probs[bi, h, i] @ v[bi, :, h // group]
    return out, probs


def _np_backward(q, k, v, mask, d_out):
    """float64 gradients of ``sum(out * d_out)`` w.r.t. q, k, v (softmax backward by hand)."""
    _, probs = _np_forward(q, k, v, mask)
    b, t, n, d = q.shape
    group = n // k.shape[2]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        for h in range(n):
            g = h // group
            p = probs[bi, h]  # [T, S]
            do = d_out[bi, :, h]  # [T, D]
            dv[bi, :, g] += p.T @ do
            dp = do @ v[bi, :, g].T
            ds = p * (dp - np.sum(p * dp, axis=1, keepdims=True))
            dq[bi, :, h] = ds @ k[bi, :, g] / np.sqrt(d)
            dk[bi, :, g] += ds.T @ q[bi, :, h] / np.sqrt(d)
    return dq, dk, dv


def _case(seed, *, b=2, t=11, n=4, kv=2, d=8):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(b, t, h, d)) for h in (n, kv, kv))
    # Packed rows: consecutive samples 1, 2, ... then padding (0) at the end of some rows.
    seg = np.zeros((b, t), np.int32)
    for bi in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=2, replace=False))
        seg[bi] = np.searchsorted(cuts, np.arange(t), side="right") + 1
        if bi % 2:
            seg[bi, -2:] = 0
    return q, k, v, seg


def _f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


class CausalAttentionTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((None, 4, 2), (6, 6, 1))
    def test_forward_matches_float64_loops(self, block, heads, kv_heads):
        q, k, v, seg = _case(block or 0, n=heads, kv=kv_heads)
        fn = self.variant(functools.partial(causal_attention, block_size=block))
        got = fn(*_f32(q, k, v), segment_ids=jnp.asarray(seg))
        want, _ = _np_forward(q, k, v, _np_mask(seg))
        chex.assert_shape(got, q.shape)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)

    @parameterized.parameters((1, 4, 2), (3, 4, 2), (4, 4, 4), (10, 4, 2), (11, 4, 2), (50, 4, 1))
    def test_forward_block_sizes_match_float64_loops(self, block, heads, kv_heads):
        q, k, v, seg = _case(block, n=heads, kv=kv_heads)
        fn = jax.jit(functools.partial(causal_attention, block_size=block))
        got = fn(*_f32(q, k, v), segment_ids=jnp.asarray(seg))
        np.testing.assert_allclose(np.asarray(got), _np_forward(q, k, v, _np_mask(seg))[0], atol=2e-5)

    @parameterized.parameters(None, 2, 4, 7)
    def test_gradients_match_hand_derived_float64_backward(self, block):
        q, k, v, seg = _case(10, t=9)
        d_out = np.random.default_rng(11).normal(size=q.shape)

        def loss(q_, k_, v_):
            out = causal_attention(q_, k_, v_, segment_ids=jnp.asarray(seg), block_size=block)
            return jnp.sum(out * jnp.asarray(d_out, jnp.float32))

        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*_f32(q, k, v))
        want = _np_backward(q, k, v, _np_mask(seg), d_out)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, atol=5e-5)

    def test_equals_packed_attention(self):
        q, k, v, seg = _case(3, t=13)
        slots = jnp.arange(13)
        seg_j = jnp.asarray(seg)
        want = jax.jit(packed_attention)(*_f32(q, k, v), q_segment_ids=seg_j, kv_segment_ids=seg_j,
                                         q_slots=slots, kv_slots=slots)  # fmt: skip
        got = jax.jit(functools.partial(causal_attention, block_size=4))(*_f32(q, k, v), segment_ids=seg_j)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)

    def test_vmap_over_rows(self):
        q, k, v, seg = _case(4)
        one = lambda qi, ki, vi, si: causal_attention(qi[None], ki[None], vi[None], segment_ids=si[None],
                                                      block_size=3)[0]  # fmt: skip
        per_row = jax.jit(jax.vmap(one))(*_f32(q, k, v), jnp.asarray(seg))
        batched = jax.jit(functools.partial(causal_attention, block_size=3))(
            *_f32(q, k, v), segment_ids=jnp.asarray(seg)
        )
        np.testing.assert_allclose(np.asarray(per_row), np.asarray(batched), atol=1e-6)

    def test_bfloat16_inputs_keep_dtype_and_stay_close(self):
        q, k, v, seg = _case(5)
        bf = tuple(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
        got = jax.jit(functools.partial(causal_attention, block_size=4))(*bf, segment_ids=jnp.asarray(seg))
        assert got.dtype == jnp.bfloat16
        want, _ = _np_forward(*(np.asarray(a, np.float64) for a in bf), _np_mask(seg))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=5e-2)

    def test_padding_only_rows_are_finite(self):
        q, k, v, _ = _case(6)
        fn = jax.jit(functools.partial(causal_attention, block_size=4))
        out = fn(*_f32(q, k, v), segment_ids=jnp.zeros((2, 11), jnp.int32))
        assert bool(jnp.all(jnp.isfinite(out)))

    def test_skips_masked_key_blocks_forward_and_backward(self):
        t, block = 64, 16
        q, k, v, seg = _case(7, b=1, t=t, n=2, kv=1)

        def loss(q_, k_, v_):
            out = causal_attention(q_, k_, v_, segment_ids=jnp.asarray(seg), block_size=block)
            return jnp.sum(jnp.sin(out))

        shapes = []

        def walk(jx):
            for eqn in jx.eqns:
                shapes.extend(tuple(o.aval.shape) for o in eqn.outvars if hasattr(o.aval, "shape"))
            for sub in jax.extend.core.subjaxprs(jx):
                walk(sub)

        walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*_f32(q, k, v)).jaxpr)
        # Scores of query block i: [..., block, (i + 1) * block]; never the dense [..., T, T].
        assert not [s for s in shapes if len(s) >= 2 and s[-2:] == (t, t)], "a dense [T, T] score was built"
        for i in range(t // block):
            assert [s for s in shapes if len(s) >= 2 and s[-2:] == (block, (i + 1) * block)], i

    def test_bad_block_size_is_a_clear_error(self):
        q, k, v, seg = _case(8)
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            causal_attention(*_f32(q, k, v), segment_ids=jnp.asarray(seg), block_size=0)


@settings(max_examples=10, deadline=None)
@given(
    t=st.integers(1, 9),
    block=st.integers(1, 10),
    heads=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
    seed=st.integers(0, 2**16),
)
def test_any_block_size_matches_float64_loops(t, block, heads, seed):
    rng = np.random.default_rng(seed)
    n, kv = heads
    q, k, v = (rng.normal(size=(1, t, h, 4)) for h in (n, kv, kv))
    seg = rng.integers(0, 3, size=(1, t)).astype(np.int32)  # any pattern, not only packed runs
    fn = jax.jit(functools.partial(causal_attention, block_size=block))
    got = fn(*_f32(q, k, v), segment_ids=jnp.asarray(seg))
    want, _ = _np_forward(q, k, v, _np_mask(seg))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_causal_block_size_values():
    # 128 * ceil(T / 1024), capped: hand-computed.
    lengths = (1, 100, 1000, 1024, 1025, 2048, 3000)
    assert [causal_block_size(n) for n in lengths] == [128, 128, 128, 128, 256, 256, 384]
    assert causal_block_size(16384, max_block_size=1024) == 1024
    assert causal_block_size(1024, max_block_size=64) == 64
    with pytest.raises(ValueError, match="positive row length"):
        causal_block_size(0)
    with pytest.raises(ValueError, match="max_block_size must be a positive int"):
        causal_block_size(8, max_block_size=0)


def test_decoder_forward_is_independent_of_the_attention_blocks():
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 64, size=(2, 13)))
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0]], [5, 4, 2, 2], axis=1).repeat(2, axis=0))
    forward = nnx.jit(lambda m, x, s: m(x, segment_ids=s))
    # None: one block (13 < 128); 3: five blocks, the last one shorter.
    dense, blocked = (
        np.asarray(forward(Decoder(cfg, attention_chunk_size=chunk, rngs=nnx.Rngs(0)), tokens, seg))
        for chunk in (None, 3)
    )
    np.testing.assert_allclose(blocked, dense, atol=1e-5)


def _jaxpr_eqns(jaxpr):
    yield from jaxpr.eqns
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _jaxpr_eqns(sub)


def test_decoder_training_forward_skips_masked_key_blocks():
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=8)  # fmt: skip
    model = Decoder(cfg, rngs=nnx.Rngs(0))  # default attention_chunk_size; no GQA, so scores are [.., T, S]
    t = 256  # causal_block_size(256) = 128: two query blocks, the first one sees 128 keys only
    graphdef, params = nnx.split(model)
    loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x))
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, jnp.zeros((1, t), jnp.int32)).jaxpr
    shapes = {tuple(v.aval.shape) for e in _jaxpr_eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")}
    assert not [s for s in shapes if len(s) >= 2 and s[-2:] == (t, t)], "dense [T, T] scores were built"
    assert [s for s in shapes if len(s) >= 2 and s[-2:] == (128, 128)]


def test_linear_kernel_gradient_contracts_a_single_axis():
    # Performance guard: the kernel gradient of a [B, T, in] input must be one plain matmul over the
    # flattened tokens (contracting (B, T) as two axes is several times slower on XLA:CPU).
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x))
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, jnp.zeros((2, 5), jnp.int32)).jaxpr
    dots = [e for e in _jaxpr_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert dots
    for eqn in dots:
        (lhs_contract, rhs_contract), _ = eqn.params["dimension_numbers"]
        assert len(lhs_contract) == len(rhs_contract) == 1, eqn
