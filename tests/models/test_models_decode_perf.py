"""The fast decode path: cache-layout attention against independent references, and the compiled
decode loop checked for per-step copies of the cache (the cause of decode time growing with cache size).

References: a float64 numpy attention written with loops, and the packed (training) attention on the
same keys/values in the ``[B, S, K, D]`` layout; the end-to-end check is prefill + decode steps
against one full forward (:func:`rljax.models.sequence_logprobs`).
"""

from __future__ import annotations

import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.models.attention import (
    attention_mask,
    cache_attention,
    from_cache_layout,
    grouped_attention,
    packed_attention,
    to_cache_layout,
)


def _np_cache_attention(q, k_cache, v_cache, mask):
    """float64 loops: query head h of row b reads cache entry b*K + h // (N // K)."""
    b, t, n, d = q.shape
    kv = k_cache.shape[0] // b
    out = np.zeros((b, t, n, d))
    for bi in range(b):
        for h in range(n):
            c = bi * kv + h // (n // kv)
            for i in range(t):
                s = np.array([q[bi, i, h] @ k_cache[c, j] for j in range(k_cache.shape[1])]) / np.sqrt(d)
                s = np.where(mask[bi, i], s, -np.inf)
                p = np.exp(s - s.max())
                out[bi, i, h] = (p / p.sum()) @ v_cache[c]
    return out


def _random_case(seed, *, b=2, t=3, s=7, n=4, kv=2, d=8, prefix=0):
    """Queries at slots [prefix, prefix + t) of an s-slot cache; a few slots empty (-1) or padding (0)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, d)).astype(np.float32)
    k = rng.normal(size=(b * kv, s, d)).astype(np.float32)
    v = rng.normal(size=(b * kv, s, d)).astype(np.float32)
    kv_seg = rng.choice([1, 1, 1, 2, 0], size=(b, s)).astype(np.int32)
    kv_seg[:, prefix + t :] = -1  # not written yet
    q_seg = kv_seg[:, prefix : prefix + t].copy()
    q_seg[:, -1] = 1  # the last query is real
    kv_seg[:, prefix : prefix + t] = q_seg
    return q, k, v, q_seg, kv_seg, np.arange(prefix, prefix + t, dtype=np.int32), np.arange(s, dtype=np.int32)


class CacheAttentionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((4, 2, 1, None), (4, 1, 3, None), (2, 2, 4, 2), (6, 3, 1, 2))
    def test_matches_float64_loops(self, n, kv, t, chunk):
        q, k, v, q_seg, kv_seg, q_slots, kv_slots = _random_case(n + kv + t, t=t, n=n, kv=kv, prefix=2)
        fn = self.variant(functools.partial(cache_attention, chunk_size=chunk))
        got = fn(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_slots=q_slots, kv_slots=kv_slots)
        mask = (kv_slots[None, None, :] <= q_slots[None, :, None]) & (q_seg[:, :, None] == kv_seg[:, None, :])
        want = _np_cache_attention(q.astype(np.float64), k, v, mask)
        chex.assert_shape(got, q.shape)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)

    def test_equals_packed_attention_in_the_training_layout(self):
        q, k, v, q_seg, kv_seg, q_slots, kv_slots = _random_case(0, b=3, t=5, s=11, n=6, kv=3)
        kw = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_slots=q_slots, kv_slots=kv_slots)
        got = cache_attention(q, k, v, **kw)
        want = packed_attention(
            q, from_cache_layout(k, batch_size=3), from_cache_layout(v, batch_size=3), **kw
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **LOGPROB_TOL)
        mask = attention_mask(q_seg, kv_seg, q_slots, kv_slots)
        direct = grouped_attention(
            q, from_cache_layout(k, batch_size=3), from_cache_layout(v, batch_size=3), mask
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(direct), **LOGPROB_TOL)

    def test_vmap_over_examples(self):
        q, k, v, q_seg, kv_seg, q_slots, kv_slots = _random_case(1, b=2, kv=2)
        one = lambda qi, ki, vi, qs, ks: cache_attention(
            qi[None],
            ki,
            vi,
            q_segment_ids=qs[None],
            kv_segment_ids=ks[None],
            q_slots=q_slots,
            kv_slots=kv_slots,
        )[0]
        per_row = jax.vmap(one)(q, k.reshape(2, 2, 7, 8), v.reshape(2, 2, 7, 8), q_seg, kv_seg)
        batched = cache_attention(
            q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_slots=q_slots, kv_slots=kv_slots
        )
        np.testing.assert_allclose(np.asarray(per_row), np.asarray(batched), atol=1e-6)

    def test_bad_cache_shape_is_a_clear_error(self):
        q, k, v, q_seg, kv_seg, q_slots, kv_slots = _random_case(2, b=2, kv=2)
        with self.assertRaisesRegex(ValueError, "batch .* x kv heads"):
            cache_attention(
                q,
                k[:3],
                v[:3],
                q_segment_ids=q_seg,
                kv_segment_ids=kv_seg,
                q_slots=q_slots,
                kv_slots=kv_slots,
            )


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 4), k=st.integers(1, 3), d=st.integers(1, 4))
def test_cache_layout_round_trip_and_order(b, t, k, d):
    x = np.arange(b * t * k * d).reshape(b, t, k, d)
    flat = np.asarray(to_cache_layout(jnp.asarray(x)))
    moved = np.asarray(to_cache_layout(jnp.asarray(x), transposed=True))
    assert flat.shape == (b * k, t, d) and moved.shape == (b * k, d, t)
    for bi in range(b):
        for ki in range(k):
            np.testing.assert_array_equal(flat[bi * k + ki], x[bi, :, ki])
            np.testing.assert_array_equal(moved[bi * k + ki], x[bi, :, ki].T)
    np.testing.assert_array_equal(np.asarray(from_cache_layout(jnp.asarray(flat), batch_size=b)), x)
    back = from_cache_layout(jnp.asarray(moved), batch_size=b, transposed=True)
    np.testing.assert_array_equal(np.asarray(back), x)


# ------------------------------------------------------------------------------------------------
# end to end with several kv heads (the cache's row-major (row, head) order matters only when K > 1)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gqa_model(helpers):
    cfg = models.tiny_config(vocab_size=61, hidden_size=48, num_heads=6, num_kv_heads=3, head_dim=16)
    return helpers.random_decoder(cfg, seed=3)


@pytest.mark.parametrize("transposed_keys", [False, True])
def test_left_padded_prefill_and_decode_match_full_forward_with_three_kv_heads(gqa_model, transposed_keys):
    rng = np.random.default_rng(4)
    lengths, steps, width = [6, 2, 4], 5, 6
    prompts = [rng.integers(0, 61, n) for n in lengths]
    cont = rng.integers(0, 61, (3, steps))
    tokens = np.zeros((3, width), np.int32)
    seg = np.zeros((3, width), np.int32)
    full = np.zeros((3, width + steps), np.int32)
    full_seg = np.zeros((3, width + steps), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :], seg[i, width - len(p) :] = p, 1
        full[i, : len(p) + steps], full_seg[i, : len(p) + steps] = np.concatenate([p, cont[i]]), 1
    ref = np.asarray(
        models.sequence_logprobs(gqa_model, jnp.asarray(full), segment_ids=jnp.asarray(full_seg))
    )
    logits, cache, _ = models.prefill(
        gqa_model,
        jnp.asarray(tokens),
        segment_ids=jnp.asarray(seg),
        max_length=12,
        transposed_keys=transposed_keys,
    )
    assert cache.keys[0].shape == ((3 * 3, 16, 12) if transposed_keys else (3 * 3, 12, 16))
    got = []
    for j in range(steps):
        got.append(np.asarray(jax.nn.log_softmax(logits))[np.arange(3), cont[:, j]])
        logits, cache, _ = models.decode_step(gqa_model, jnp.asarray(cont[:, j]), cache)
    want = np.stack([ref[i, len(p) : len(p) + steps] for i, p in enumerate(prompts)])
    np.testing.assert_allclose(np.stack(got, axis=1), want, **LOGPROB_TOL)
    # The cache holds exactly the keys a full forward computes, per row and kv head, in [B, S, K, D] views.
    assert cache.layer_keys(1).shape == (3, 12, 3, 16)


# ------------------------------------------------------------------------------------------------
# the compiled decode loop: one in-place write per cache array and step, no per-step cache copies
# ------------------------------------------------------------------------------------------------


def _while_body(hlo: str) -> str:
    match = re.search(r"while\(.*?\), condition=%[\w.\-]+, body=%([\w.\-]+)", hlo)
    assert match, "no while loop in the compiled program"
    start = hlo.index(f"%{match.group(1)} ")
    return hlo[start : hlo.index("\n}\n", start)]


def _cache_sized_results(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Instructions that produce a float array as large as one cache array, in any shape or layout
    (bitcasts, tuple accesses and parameters produce no data and are left out)."""
    size = math.prod(shape)
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\S* ([\w\-]+)\(", line)
        if m and m.group(2) not in ("bitcast", "get-tuple-element", "parameter"):
            if math.prod(int(x) for x in m.group(1).split(",")) == size:
                found.append(line.strip()[:160])
    return found


@pytest.fixture(scope="module")
def tiny_qwen3():
    return models.tiny_model(head_dim=16)


@pytest.mark.parametrize("transposed_keys", [False, True])
def test_compiled_decode_loop_updates_the_cache_in_place(tiny_qwen3, transposed_keys):
    rows, slots = 4, 40
    graphdef, state = nnx.split(tiny_qwen3)

    def loop(state, cache):
        m = nnx.merge(graphdef, state)

        def body(_, carry):
            logits, cache, _ = models.decode_step(m, carry[0], carry[1])
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, 8, body, (jnp.zeros((rows,), jnp.int32), cache))

    cache = models.prefill(
        tiny_qwen3, jnp.ones((rows, 16), jnp.int32), max_length=slots, transposed_keys=transposed_keys
    ).cache
    hlo = jax.jit(loop, donate_argnums=1).lower(state, cache).compile().as_text()
    # Per step and cache array exactly one instruction produces cache-sized data: its in-place write
    # (a dynamic-update-slice fusion). The [B, S, K, D] layout added a transposed copy of every
    # array per step here (8 instead of 4), plus whole-cache copies at larger sizes.
    produced = _cache_sized_results(_while_body(hlo), cache.keys[0].shape)
    assert len(produced) == 2 * tiny_qwen3.config.num_layers, produced
    assert all("dynamic-update-slice" in line and " copy(" not in line for line in produced), produced


@pytest.mark.parametrize("transposed_keys", [False, True])
def test_decode_step_donates_and_aliases_the_cache(tiny_qwen3, transposed_keys):
    cache = models.prefill(
        tiny_qwen3, jnp.ones((2, 8), jnp.int32), max_length=24, transposed_keys=transposed_keys
    ).cache
    tokens = jnp.zeros((2,), jnp.int32)
    hlo = models.decode._decode_step.lower(tiny_qwen3, tokens, cache).compile().as_text()
    num_params = len(jax.tree.leaves(nnx.state(tiny_qwen3)))
    aliased = set(re.findall(r"\{[\d,]*\}: \((\d+), \{\}, may-alias\)", hlo))
    # every key/value buffer of the cache (parameters after the model's and the tokens) is reused
    cache_params = {str(num_params + 1 + i) for i in range(2 * tiny_qwen3.config.num_layers)}
    assert cache_params <= aliased, (cache_params, aliased)
    entry = hlo[hlo.index("\nENTRY ") :]
    produced = _cache_sized_results(entry[: entry.index("\n}\n")], cache.keys[0].shape)
    assert len(produced) == 2 * tiny_qwen3.config.num_layers, produced
    # At run time the donated input buffers are consumed (reused by the returned cache).
    new_cache = models.decode_step(tiny_qwen3, tokens, cache).cache
    assert cache.keys[0].is_deleted() and not new_cache.keys[0].is_deleted()
    assert int(new_cache.index) == 9
