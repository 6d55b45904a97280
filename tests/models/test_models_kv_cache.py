"""KV-cache decoding (prefill + step-by-step) gives the logprobs of one full forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import LOGPROB_TOL

from rljax import models

VOCAB = 53
PROMPT_LENS = [5, 9, 3]
NUM_NEW = 6
PAD = max(PROMPT_LENS)


@pytest.fixture(scope="module")
def model(helpers):
    # llama3 RoPE scaling + GQA 4:1 + tied embeddings: positions must be exact for the logprobs to agree.
    cfg = models.ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        )
    )
    return helpers.random_decoder(cfg, seed=1)


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, size=n) for n in PROMPT_LENS]
    continuations = rng.integers(0, VOCAB, size=(len(PROMPT_LENS), NUM_NEW))
    return prompts, continuations


@pytest.fixture(scope="module")
def reference(model, sequences):
    """Full-forward logprobs of each continuation token (prompt + continuation as one right-padded row)."""
    prompts, cont = sequences
    length = PAD + NUM_NEW
    tokens = np.zeros((len(prompts), length), np.int64)
    seg = np.zeros((len(prompts), length), np.int32)
    for b, p in enumerate(prompts):
        n = len(p)
        tokens[b, : n + NUM_NEW] = np.concatenate([p, cont[b]])
        seg[b, : n + NUM_NEW] = 1
    logp = np.asarray(models.sequence_logprobs(model, jnp.asarray(tokens), segment_ids=jnp.asarray(seg)))
    return np.stack([logp[b, len(p) : len(p) + NUM_NEW] for b, p in enumerate(prompts)])


_prefill = models.prefill
_step = models.decode_step


def _padded_prompts(prompts, *, left: bool):
    tokens = np.zeros((len(prompts), PAD), np.int64)
    seg = np.zeros((len(prompts), PAD), np.int32)
    for b, p in enumerate(prompts):
        sl = slice(PAD - len(p), PAD) if left else slice(0, len(p))
        tokens[b, sl] = p
        seg[b, sl] = 1
    return jnp.asarray(tokens), jnp.asarray(seg)


@pytest.mark.parametrize("transposed_keys", [False, True])
@pytest.mark.parametrize("left", [False, True])
def test_prefill_then_decode_steps_match_full_forward(model, sequences, reference, left, transposed_keys):
    prompts, cont = sequences
    tokens, seg = _padded_prompts(prompts, left=left)
    logits, cache, _ = _prefill(model, tokens, segment_ids=seg, max_length=PAD + NUM_NEW,
                                transposed_keys=transposed_keys)  # fmt: skip
    assert cache.transposed_keys is transposed_keys
    np.testing.assert_array_equal(np.asarray(cache.lengths), PROMPT_LENS)
    got = []
    for j in range(NUM_NEW):
        logp = jax.nn.log_softmax(logits, axis=-1)
        got.append(np.asarray(logp)[np.arange(len(prompts)), cont[:, j]])
        logits, cache, _ = _step(model, jnp.asarray(cont[:, j]), cache)
    assert int(cache.index) == PAD + NUM_NEW and cache.transposed_keys is transposed_keys
    np.testing.assert_allclose(np.stack(got, axis=1), reference, **LOGPROB_TOL)


@pytest.mark.parametrize("transposed_keys", [False, True])
@pytest.mark.parametrize("left", [False, True])
def test_a_cache_grown_step_by_step_matches_full_forward(model, sequences, reference, left, transposed_keys):
    """Prefill into exactly the prompt's slots, then grow the cache by one slot before every step
    (the sampler's segments at their extreme): the logprobs of one full forward."""
    prompts, cont = sequences
    tokens, seg = _padded_prompts(prompts, left=left)
    logits, cache, _ = _prefill(
        model, tokens, segment_ids=seg, max_length=PAD, transposed_keys=transposed_keys
    )
    got = []
    for j in range(NUM_NEW):
        got.append(np.asarray(jax.nn.log_softmax(logits, axis=-1))[np.arange(len(prompts)), cont[:, j]])
        grown = models.grow_cache(cache, cache.max_length + 1)
        assert grown.max_length == PAD + j + 1 and int(grown.index) == int(cache.index)
        np.testing.assert_array_equal(
            np.asarray(grown.layer_keys(1))[:, : PAD + j], np.asarray(cache.layer_keys(1))
        )
        assert np.all(np.asarray(grown.segment_ids)[:, -1] == models.kv_cache.EMPTY_SLOT)
        logits, cache, _ = _step(model, jnp.asarray(cont[:, j]), grown)
    np.testing.assert_allclose(np.stack(got, axis=1), reference, **LOGPROB_TOL)
    assert models.grow_cache(cache, cache.max_length) is cache
    with pytest.raises(ValueError, match="cannot shrink"):
        models.grow_cache(cache, cache.max_length - 1)


@pytest.mark.parametrize("transposed_keys", [False, True])
def test_multi_token_decode_chunks_match_full_forward(model, sequences, reference, transposed_keys):
    prompts, cont = sequences
    tokens, seg = _padded_prompts(prompts, left=False)
    cache = models.init_cache(model.config, batch_size=len(prompts), max_length=PAD + NUM_NEW + 2,
                              transposed_keys=transposed_keys)  # fmt: skip
    decode = jax.jit(lambda m, t, c, s: m.decode(t, c, segment_ids=s))
    to_logits = jax.jit(lambda m, h: m.logits(h))
    hidden, _, cache = decode(model, tokens, cache, seg)
    last = models.decode.last_valid_index(seg)
    first_logits = to_logits(model, hidden[np.arange(len(prompts)), np.asarray(last)])
    # Feed the continuation in two chunks of 3 tokens, positions from cache.lengths.
    ones = jnp.ones((len(prompts), 3), jnp.int32)
    hidden_a, _, cache = decode(model, jnp.asarray(cont[:, :3]), cache, ones)
    hidden_b, _, cache = decode(model, jnp.asarray(cont[:, 3:]), cache, ones)
    logits = jnp.concatenate(
        [first_logits[:, None], to_logits(model, hidden_a), to_logits(model, hidden_b)[:, :-1]], axis=1
    )
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    got = np.take_along_axis(logp, cont[:, :, None], axis=-1)[..., 0]
    np.testing.assert_allclose(got, reference, **LOGPROB_TOL)
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.array(PROMPT_LENS) + NUM_NEW)


def test_cache_capacity_errors(model):
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="exceeds the cache max_length 3"):
        models.prefill(model, tokens, max_length=3)
    cache = models.prefill(model, tokens, max_length=5).cache
    cache = models.decode_step(model, jnp.zeros((1,), jnp.int32), cache).cache
    with pytest.raises(ValueError, match="KV cache is full: 5 slots used"):
        models.decode_step(model, jnp.zeros((1,), jnp.int32), cache)


def test_init_cache_layout(model):
    cache = models.init_cache(model.config, batch_size=2, max_length=7, dtype=jnp.bfloat16)
    assert len(cache.keys) == len(cache.values) == model.config.num_layers
    # Cache layout [B * K, S, D] (what the decode matmuls consume); layer_keys gives [B, S, K, D].
    assert cache.keys[0].shape == (2 * 1, 7, 8) and cache.keys[0].dtype == jnp.bfloat16
    assert cache.layer_keys(0).shape == cache.layer_values(1).shape == (2, 7, 1, 8)
    assert np.all(np.asarray(cache.segment_ids) == models.kv_cache.EMPTY_SLOT) and cache.max_length == 7
    # Transposed keys: [B * K, D, S]; the values and every view keep their shapes.
    cache = models.init_cache(model.config, batch_size=2, max_length=7, transposed_keys=True)
    assert cache.keys[0].shape == (2, 8, 7) and cache.values[0].shape == (2, 7, 8)
    assert cache.layer_keys(0).shape == cache.layer_values(1).shape == (2, 7, 1, 8)


def test_transposed_keys_hold_the_same_keys_and_survive_take_rows_and_grow(model, sequences):
    """One prefill into each key layout: the layer_keys views are equal; take_rows and grow_cache
    keep the layout (a static field, not a leaf) and the same keys."""
    prompts, _ = sequences
    tokens, seg = _padded_prompts(prompts, left=True)
    plain = _prefill(model, tokens, segment_ids=seg, max_length=PAD + 2).cache
    moved = _prefill(model, tokens, segment_ids=seg, max_length=PAD + 2, transposed_keys=True).cache
    assert jax.tree_util.tree_structure(plain) != jax.tree_util.tree_structure(moved)
    for layer in range(model.config.num_layers):
        np.testing.assert_allclose(moved.layer_keys(layer), plain.layer_keys(layer), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(moved.layer_values(layer), plain.layer_values(layer), rtol=1e-6, atol=1e-6)
    rows = jnp.array([2, 0, 2])
    taken, grown = models.take_rows(moved, rows), models.grow_cache(moved, PAD + 5)
    assert taken.transposed_keys and grown.transposed_keys
    np.testing.assert_array_equal(taken.layer_keys(1), np.asarray(moved.layer_keys(1))[np.asarray(rows)])
    np.testing.assert_array_equal(np.asarray(grown.layer_keys(1))[:, : PAD + 2], moved.layer_keys(1))
    assert grown.keys[1].shape == (len(prompts), 8, PAD + 5)
