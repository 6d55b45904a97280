"""Chunked logprobs/entropy: float64 numpy references, chunked == unchunked, packing, remat, memory."""

from __future__ import annotations

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
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.models.logprobs import shifted_token_mask, token_logprobs_and_entropy


def _np_logprobs_entropy(h, w, targets, tau):
    z = (h.astype(np.float64) @ w.astype(np.float64)) / tau[:, None]
    z = z - z.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logq[np.arange(len(targets)), targets], -(np.exp(logq) * logq).sum(-1), np.exp(logq)


def _kernel_inputs(n=30, hidden=8, vocab=97, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, hidden)).astype(np.float32)
    w = rng.normal(size=(hidden, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, size=n)
    tau = rng.uniform(0.4, 2.0, size=n).astype(np.float32)
    return h, w, targets, tau


class KernelTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(1, 7, 30, 64)
    def test_matches_numpy(self, chunk_size):
        h, w, targets, tau = _kernel_inputs()
        fn = self.variant(lambda *a: token_logprobs_and_entropy(*a, chunk_size=chunk_size))
        logp, ent = fn(jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets), jnp.asarray(tau))
        ref_logp, ref_ent, _ = _np_logprobs_entropy(h, w, targets, tau.astype(np.float64))
        assert logp.dtype == ent.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=2e-5, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-5, rtol=1e-6)

    def test_gradient_matches_analytic(self):
        # d/dh sum_t logp_t = (w[:, y_t] - w p_t) / tau_t ;  d/dw = sum_t h_t (onehot_t - p_t)^T / tau_t
        h, w, targets, tau = _kernel_inputs(n=13, seed=1)
        grad_h, grad_w = jax.grad(
            lambda h_, w_: jnp.sum(
                token_logprobs_and_entropy(h_, w_, jnp.asarray(targets), jnp.asarray(tau), chunk_size=4)[0]
            ),
            argnums=(0, 1),
        )(jnp.asarray(h), jnp.asarray(w))
        _, _, p = _np_logprobs_entropy(h, w, targets, tau.astype(np.float64))
        resid = (np.eye(w.shape[1])[targets] - p) / tau[:, None].astype(np.float64)
        np.testing.assert_allclose(np.asarray(grad_h), resid @ w.T.astype(np.float64), atol=2e-5)
        np.testing.assert_allclose(np.asarray(grad_w), h.T.astype(np.float64) @ resid, atol=2e-5)

    def test_no_full_logits_in_forward_or_backward(self):
        h, w, targets, tau = _kernel_inputs(n=60, hidden=8, vocab=97)
        chunk = 16

        def loss(h_, w_):
            logp, ent = token_logprobs_and_entropy(
                h_, w_, jnp.asarray(targets), jnp.asarray(tau), chunk_size=chunk
            )
            return jnp.sum(logp) + jnp.sum(ent)

        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
        shapes = []

        def walk(jx):
            for eqn in jx.eqns:
                shapes.extend(v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.extend.core.subjaxprs(jx):
                walk(sub)

        walk(jaxpr.jaxpr)
        vocab_rows = [int(np.prod(s[:-1])) for s in shapes if len(s) >= 2 and s[-1] == 97]
        assert vocab_rows and max(vocab_rows) <= chunk, sorted(set(vocab_rows))

    def test_out_of_range_targets_give_nan_rows_only(self):
        h, w, targets, tau = _kernel_inputs(n=6, vocab=97)
        targets[1], targets[4] = -1, 97
        logp, _ = token_logprobs_and_entropy(h, w, targets, tau, chunk_size=4)
        np.testing.assert_array_equal(np.isnan(np.asarray(logp)), [False, True, False, False, True, False])

    def test_bad_chunk_size(self):
        h, w, targets, tau = _kernel_inputs(n=4)
        with self.assertRaisesRegex(ValueError, "chunk_size must be a positive int"):
            token_logprobs_and_entropy(h, w, targets, tau, chunk_size=0)


_kernel = jax.jit(token_logprobs_and_entropy, static_argnames=("chunk_size",))


@settings(max_examples=10, deadline=None)
@given(chunk=st.sampled_from([1, 2, 5, 8, 22, 40]), seed=st.integers(0, 1000))
def test_chunking_does_not_change_results(chunk, seed):
    h, w, targets, tau = (jnp.asarray(a) for a in _kernel_inputs(n=23, seed=seed))
    a = _kernel(h, w, targets, tau, chunk_size=chunk)
    b = _kernel(h, w, targets, tau, chunk_size=23)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-6)


def test_shifted_token_mask_hand_example():
    seg = jnp.array([[1, 1, 1, 2, 0, 0], [3, 3, 0, 4, 4, 4]])
    expected = [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 1, 1]]
    np.testing.assert_array_equal(np.asarray(shifted_token_mask(seg)).astype(int), expected)


# ---------------------------------------------------------------------------------------------
# sequence_logprobs on a random decoder (its forward is checked against transformers elsewhere).

VOCAB = 61


@pytest.fixture(scope="module")
def model(helpers):
    cfg = models.tiny_config(vocab_size=VOCAB, head_dim=16)
    return helpers.random_decoder(cfg, seed=0)


def _seq(model, tokens, **kwargs):
    """``(logprobs, entropy)`` of :func:`rljax.models.sequence_forward` (jitted by the library)."""
    out = models.sequence_forward(model, tokens, **kwargs)
    return out.logprobs, out.entropy


def test_sequence_logprobs_alignment_temperature_and_masks(model):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(2, 12))
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [7] * 12])
    tau = rng.uniform(0.5, 1.5, size=tokens.shape).astype(np.float32)
    logp, ent = _seq(model, jnp.asarray(tokens), segment_ids=jnp.asarray(seg), temperature=jnp.asarray(tau),
                     chunk_size=5)  # fmt: skip
    # Reference: full logits of each sample run alone, shifted and scaled in numpy float64.
    ref_lp, ref_ent = np.zeros(tokens.shape), np.zeros(tokens.shape)
    forward = jax.jit(lambda m, t: m(t))
    for b, spans in enumerate([[(0, 5), (5, 9)], [(0, 12)]]):
        for s, e in spans:
            # The sample alone at the start of a row (causal: what follows it does not matter).
            alone = np.concatenate([tokens[b, s:e], np.zeros(12 - (e - s), tokens.dtype)])[None]
            logits = np.asarray(forward(model, jnp.asarray(alone)), np.float64)[0, : e - s]
            z = logits[:-1] / tau[b, s + 1 : e, None]
            z = z - z.max(-1, keepdims=True)
            logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
            ref_lp[b, s + 1 : e] = logq[np.arange(e - s - 1), tokens[b, s + 1 : e]]
            ref_ent[b, s + 1 : e] = -(np.exp(logq) * logq).sum(-1)
    np.testing.assert_allclose(np.asarray(logp), ref_lp, **LOGPROB_TOL)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=1e-5)
    assert np.all(np.asarray(logp)[0, [0, 5, 9, 10, 11]] == 0.0)


@settings(max_examples=8, deadline=None)
@given(cuts=st.lists(st.integers(1, 15), min_size=1, max_size=4, unique=True), seed=st.integers(0, 99))
def test_packed_row_equals_samples_alone(model, cuts, seed):
    rng = np.random.default_rng(seed)
    length = 16
    bounds = [0, *sorted(cuts), length]
    tokens = rng.integers(0, VOCAB, size=(1, length))
    seg = np.zeros((1, length), np.int32)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg[0, s:e] = i + 1
    seg[0, bounds[-2] :] = 0  # last span is padding
    packed, _ = _seq(model, jnp.asarray(tokens), segment_ids=jnp.asarray(seg), chunk_size=16)
    for s, e in zip(bounds[:-2], bounds[1:-1], strict=True):
        alone = np.zeros((1, length), np.int32)
        alone[0, : e - s] = 1
        single = np.zeros((1, length), np.int64)
        single[0, : e - s] = tokens[0, s:e]
        ref, _ = _seq(model, jnp.asarray(single), segment_ids=jnp.asarray(alone), chunk_size=16)
        np.testing.assert_allclose(np.asarray(packed)[0, s:e], np.asarray(ref)[0, : e - s], **LOGPROB_TOL)
    assert np.all(np.asarray(packed)[0, bounds[-2] :] == 0.0)


def test_chunked_gradients_equal_unchunked_and_remat_and_attention_blocks(model):
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, size=(2, 10)))
    params = nnx.state(model, nnx.Param)
    graphdef = nnx.graphdef(model)

    def loss(p, chunk, remat):
        m = nnx.merge(graphdef, p)
        m.remat = remat
        m.attention_chunk_size = 4 if remat else None  # 10 tokens -> 3 query blocks, one padded
        # remat: False / True ("full") / "dots_saveable" (keep matmul outputs, recompute the rest)
        lp, ent = _seq(m, tokens, chunk_size=chunk)
        return jnp.sum(lp) + 0.1 * jnp.sum(ent)

    grads = {
        key: jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))(params, *key)
        for key in [(20, False), (3, True), (3, "dots_saveable")]
    }
    ref_val, ref_grad = grads[(20, False)]
    for val, grad in grads.values():
        np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_bfloat16_compute_is_close_to_float32(model):
    cfg = model.config
    abstract = nnx.eval_shape(lambda: models.Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                                     rngs=nnx.Rngs(0)))  # fmt: skip
    bf16 = nnx.merge(nnx.graphdef(abstract), nnx.state(model))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, size=(1, 12)))
    lp16, _ = _seq(bf16, tokens, chunk_size=16)
    lp32, _ = _seq(model, tokens, chunk_size=16)
    assert lp16.dtype == jnp.float32 and bf16.hidden_states(tokens).hidden.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lp16), np.asarray(lp32), atol=0.3)


def test_argument_errors_and_short_rows(model):
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="temperature must be a scalar or shaped like tokens"):
        models.sequence_logprobs(model, tokens, temperature=jnp.ones((2, 4)))
    np.testing.assert_array_equal(
        np.asarray(models.sequence_logprobs(model, tokens[:, :1])), np.zeros((2, 1))
    )


def test_padding_ids_are_ignored_and_invalid_real_ids_are_loud(model):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, VOCAB, size=(1, 10))
    seg = np.array([[1] * 6 + [0] * 4])
    base, _ = _seq(model, jnp.asarray(tokens), segment_ids=jnp.asarray(seg), chunk_size=16)
    garbage = tokens.copy()
    garbage[0, 6:] = [-1, VOCAB, 10**6, -(10**6)]
    got, _ = _seq(model, jnp.asarray(garbage), segment_ids=jnp.asarray(seg), chunk_size=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(base))
    for bad in (-1, VOCAB):
        invalid = tokens.copy()
        invalid[0, 2] = bad
        lp, _ = _seq(model, jnp.asarray(invalid), segment_ids=jnp.asarray(seg), chunk_size=16)
        assert np.isnan(np.asarray(lp)[0, 2:6]).all()


def test_sequence_forward_returns_and_computes_only_what_is_asked_for(model, helpers):
    moe = helpers.random_decoder(models.tiny_config("qwen3_moe", vocab_size=VOCAB, head_dim=16), seed=1)
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, VOCAB, size=(2, 9)))
    full = models.sequence_forward(moe, tokens, with_routing=True)
    plain = models.sequence_forward(moe, tokens)
    bare = models.sequence_forward(moe, tokens, with_entropy=False)
    assert plain.routing is None and bare.entropy is None and bare.routing is None
    cfg = moe.config
    assert full.routing.experts.shape == (2, 9, len(cfg.moe_layers), cfg.num_experts_per_tok)
    for out in (plain, bare):  # the flags change what is returned, never the values
        np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(full.logprobs))
    np.testing.assert_array_equal(np.asarray(plain.entropy), np.asarray(full.entropy))
    np.testing.assert_array_equal(
        np.asarray(models.sequence_logprobs(moe, tokens)), np.asarray(full.logprobs)
    )
    assert models.sequence_forward(model, tokens, with_routing=True).routing is None  # dense: none to give

    # Without the entropy the compiled program has no entropy: one reduction fewer (its sum over the
    # vocabulary; the normalizer's max and sum stay).
    def reductions(**flags):
        hlo = models.sequence_forward.lower(model, tokens, **flags).compile().as_text()
        return hlo.count(" reduce(")

    assert 0 < reductions(with_entropy=False) < reductions(with_entropy=True)
