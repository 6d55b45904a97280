"""Parity with HF transformers on packed rows and per-token temperatures (entropy included).

References are computed in float64 numpy from the HF model's logits, never from rljax.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models

VOCAB = 320
ATOL = 2e-5  # observed ~3e-6; design §5 requires 1e-4


def _logprobs(model, tokens, **kwargs):
    """``(logprobs, entropy)`` of :func:`rljax.models.sequence_forward` (jitted by the library)."""
    out = models.sequence_forward(model, tokens, **kwargs)
    return out.logprobs, out.entropy


def test_per_token_temperature_and_entropy_match_transformers(hf_checkpoint, helpers):
    hf_model, path = hf_checkpoint("qwen3", False)
    model = models.from_pretrained(path)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, size=(2, 24))
    tau = rng.uniform(0.3, 2.0, size=tokens.shape)
    logp, ent = _logprobs(model, jnp.asarray(tokens), temperature=jnp.asarray(tau, jnp.float32), chunk_size=8)
    np.testing.assert_allclose(
        np.asarray(logp), helpers.hf_token_logprobs(hf_model, tokens, temperature=tau), atol=ATOL, rtol=0
    )
    # Entropy of softmax(logits[t-1] / tau[t]) in float64 numpy.
    z = helpers.hf_logits(hf_model, tokens)[:, :-1] / tau[:, 1:, None]
    z = z - z.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ref_ent = np.zeros(tokens.shape)
    ref_ent[:, 1:] = -(np.exp(logq) * logq).sum(-1)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=ATOL, rtol=0)
    # A scalar temperature equals the same value given per token.
    scalar, _ = _logprobs(model, jnp.asarray(tokens), temperature=0.7, chunk_size=8)
    per_token, _ = _logprobs(
        model, jnp.asarray(tokens), temperature=jnp.full(tokens.shape, 0.7), chunk_size=8
    )
    np.testing.assert_allclose(np.asarray(scalar), np.asarray(per_token), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name,attention_chunk", [("qwen2", None), ("llama3", 6)])
def test_packed_rows_match_each_sample_alone_in_transformers(name, attention_chunk, hf_checkpoint, helpers):
    hf_model, path = hf_checkpoint(name, True)
    model = models.from_pretrained(path, attention_chunk_size=attention_chunk)
    rng = np.random.default_rng(2)
    lengths = [[7, 12], [5, 9, 3]]
    seq_len = 20
    samples = [[rng.integers(0, VOCAB, size=n) for n in row] for row in lengths]
    tokens = np.zeros((2, seq_len), np.int64)
    segment_ids = np.zeros((2, seq_len), np.int32)
    positions = np.zeros((2, seq_len), np.int32)
    for r, row in enumerate(samples):
        start = 0
        for s, sample in enumerate(row):
            n = len(sample)
            tokens[r, start : start + n] = sample
            segment_ids[r, start : start + n] = s + 1
            positions[r, start : start + n] = np.arange(n)
            start += n
        tokens[r, start:] = rng.integers(0, VOCAB, size=seq_len - start)  # garbage under padding
    logp, ent = _logprobs(model, jnp.asarray(tokens), segment_ids=jnp.asarray(segment_ids), chunk_size=16)
    logp = np.asarray(logp)
    for r, row in enumerate(samples):
        start = 0
        for sample in row:
            n = len(sample)
            ref = helpers.hf_token_logprobs(hf_model, sample[None])[0]
            np.testing.assert_allclose(logp[r, start : start + n], ref, atol=ATOL, rtol=0)
            start += n
        assert np.all(logp[r, start:] == 0.0) and np.all(np.asarray(ent)[r, start:] == 0.0)
    # Explicit positions give the same result as the default derived from segment_ids.
    explicit, _ = _logprobs(
        model,
        jnp.asarray(tokens),
        segment_ids=jnp.asarray(segment_ids),
        positions=jnp.asarray(positions),
        chunk_size=16,
    )
    np.testing.assert_array_equal(np.asarray(explicit), logp)
