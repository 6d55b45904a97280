"""score_sequences: packed, bucketed scoring equals each sequence run alone; one trace per bucket."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.inference import scoring
from rljax.models.tiny import random_decoder

VOCAB = 61
CONFIG = models.tiny_config(vocab_size=VOCAB, rope_theta=100.0)


@pytest.fixture(scope="module")
def model():
    return random_decoder(CONFIG, seed=3)


def alone(model, seq, temperature=1.0):
    """Reference: ``sequence_logprobs`` of the sequence by itself, unpadded, as float64."""
    if len(seq) == 0:
        return np.zeros(0)
    out = models.sequence_logprobs(model, jnp.asarray(seq, jnp.int32)[None], temperature=temperature)
    return np.asarray(out[0], np.float64)


def random_seqs(rng, lengths):
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


def test_bucket_row_len_by_hand():
    assert [scoring.bucket_row_len(n) for n in (0, 1, 63, 64, 65, 128, 129, 1000)] == [
        64,
        64,
        64,
        64,
        128,
        128,
        256,
        1024,
    ]
    assert scoring.bucket_row_len(5, min_len=4) == 8
    with pytest.raises(ValueError):
        scoring.bucket_row_len(-1)


def test_mixed_lengths_equal_each_sequence_alone(model):
    rng = np.random.default_rng(0)
    # 64 fills a row; 40 is longer than half a row; 1 and 2 are edge cases.
    lengths = [1, 40, 64, 2, 17, 40, 2]
    seqs = random_seqs(rng, lengths)
    temps = rng.uniform(0.5, 1.5, size=len(seqs)).tolist()
    out = scoring.score_sequences(model, seqs, temperature=temps, rows_per_batch=2)
    assert [o.shape for o in out] == [(n,) for n in lengths]
    assert all(o.dtype == np.float32 for o in out)
    for seq, t, o in zip(seqs, temps, out, strict=True):
        np.testing.assert_allclose(o, alone(model, seq, t), **LOGPROB_TOL)
        assert o[0] == 0.0
        assert np.all(o[1:] < 0)
    # numpy arrays as input, in another order (so another packing), give the same values.
    order = rng.permutation(len(seqs))
    again = scoring.score_sequences(
        model, [np.asarray(seqs[k]) for k in order], temperature=[temps[k] for k in order], rows_per_batch=2
    )
    for k, o in zip(order, again, strict=True):
        np.testing.assert_allclose(o, out[k], **LOGPROB_TOL)


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7), seed=st.integers(0, 10**6))
def test_property_packed_equals_alone(model, lengths, seed):
    rng = np.random.default_rng(seed)
    seqs = random_seqs(rng, lengths)
    out = scoring.score_sequences(model, seqs, row_len=64, rows_per_batch=4)
    # Reference: each sequence alone in its own row, right-padded to 40 (causal attention: the
    # padding after a sequence cannot change its logprobs), one compile for all examples.
    tokens = np.zeros((7, 40), np.int32)  # always 7 rows: one reference compile
    segment_ids = np.zeros((7, 40), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        segment_ids[i, : len(s)] = 1
    ref = np.asarray(models.sequence_logprobs(model, tokens, segment_ids=segment_ids), np.float64)
    for i, (s, o) in enumerate(zip(seqs, out, strict=True)):
        np.testing.assert_allclose(o, ref[i, : len(s)], **LOGPROB_TOL)


def test_one_trace_per_bucket(model, monkeypatch):
    traces = []
    original = scoring.sequence_logprobs

    def counting(*args, **kwargs):
        traces.append(kwargs["segment_ids"].shape)  # runs only while jit traces
        return original(*args, **kwargs)

    monkeypatch.setattr(scoring, "sequence_logprobs", counting)
    rng = np.random.default_rng(1)
    first = random_seqs(rng, [70, 3, 100])  # bucket 128
    second = random_seqs(rng, [90, 128, 5, 12, 100, 70, 80, 65])  # bucket 128, several batches of 3 rows
    out1 = scoring.score_sequences(model, first, rows_per_batch=3)
    assert traces == [(3, 128)]
    out2 = scoring.score_sequences(model, second, rows_per_batch=3, temperature=0.8)
    assert traces == [(3, 128)], "a second call in the same bucket must not retrace"
    np.testing.assert_allclose(out1[2], alone(model, first[2]), **LOGPROB_TOL)
    assert [o.shape[0] for o in out2] == [90, 128, 5, 12, 100, 70, 80, 65]
    scoring.score_sequences(model, random_seqs(rng, [130]), rows_per_batch=3)
    assert traces == [(3, 128), (3, 256)], "a longer sequence moves to the next bucket"


def test_score_from_scores_the_tail_only(model, monkeypatch):
    rng = np.random.default_rng(2)
    seqs = random_seqs(rng, [30, 12, 50, 7])
    starts = [20, 0, 49, 7]  # a tail, everything, the last token, nothing
    full = scoring.score_sequences(model, seqs, rows_per_batch=2, temperature=0.9)
    capacities = []
    original = scoring._packed_logprobs

    def spy(graphdef, capacity, *args):
        capacities.append(capacity)
        return original(graphdef, capacity, *args)

    monkeypatch.setattr(scoring, "_packed_logprobs", spy)
    tail = scoring.score_sequences(model, seqs, rows_per_batch=2, temperature=0.9, score_from=starts)
    for f, t, start in zip(full, tail, starts, strict=True):
        np.testing.assert_allclose(t[start:], f[start:], **LOGPROB_TOL)
        assert not np.any(t[:start])
    # 10 + 11 + 1 wanted tokens (a sequence's first token has no prediction), in one batch of two
    # rows of 64: a buffer of 24 (the ladder's size above 22), not the batch's 128 tokens
    assert capacities == [24]
    with pytest.raises(ValueError, match="score_from must be one int per sequence"):
        scoring.score_sequences(model, seqs, score_from=[1, 2])


def test_edge_cases(model):
    assert scoring.score_sequences(model, []) == []
    out = scoring.score_sequences(model, [[], [4], [], [5, 6]])
    assert [o.tolist() for o in out[:3]] == [[], [0.0], []]
    np.testing.assert_allclose(out[3], alone(model, [5, 6]), **LOGPROB_TOL)
    assert [o.shape for o in scoring.score_sequences(model, [[], []])] == [(0,), (0,)]


def test_errors(model):
    with pytest.raises(ValueError, match="row_len"):
        scoring.score_sequences(model, [[1] * 10], row_len=8)
    with pytest.raises(ValueError, match="vocabulary"):
        scoring.score_sequences(model, [[1, VOCAB]])
    with pytest.raises(ValueError, match="vocabulary"):
        scoring.score_sequences(model, [[-1, 2]])
    with pytest.raises(ValueError, match="1-D"):
        scoring.score_sequences(model, [[[1, 2]]])
    with pytest.raises(ValueError, match="1-D"):
        scoring.score_sequences(model, [[1.5, 2.0]])
    with pytest.raises(ValueError, match="> 0"):
        scoring.score_sequences(model, [[1, 2]], temperature=0.0)
    with pytest.raises(ValueError, match="one value per sequence"):
        scoring.score_sequences(model, [[1, 2]], temperature=[1.0, 1.0])
    with pytest.raises(ValueError, match="rows_per_batch"):
        scoring.score_sequences(model, [[1, 2]], rows_per_batch=0)
