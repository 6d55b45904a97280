"""The sampler's fast path: inversion sampling, precomputed per-step uniforms, and the compiled loop.

References are independent of the code under test: hand-computed inversions, float64 numpy
``searchsorted`` on the cumulative distribution, ``np.argmax``, direct ``jax.random`` calls, and
empirical frequencies; the compiled program is checked for per-step PRNG loops and cache copies.
"""

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

from rljax.inference import sampler as sampler_lib
from rljax.inference.sampler import decode_segment_ends, first_argmax, sample_by_inversion, step_uniforms
from rljax.models import tiny_config, tiny_model


def np_inversion(logprobs: np.ndarray, u: float) -> int:
    """float64: the first token whose cumulative probability exceeds u * total."""
    p = np.exp(np.asarray(logprobs, np.float64))
    cdf = np.cumsum(p)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


class InversionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_values(self):
        # p = [0.2, 0.5, 0.3]: u in [0, .2) -> 0, [.2, .7) -> 1, [.7, 1) -> 2; greedy ignores u
        lp = jnp.log(jnp.array([[0.2, 0.5, 0.3]] * 6))
        u = jnp.array([0.0, 0.19, 0.21, 0.69, 0.71, 0.999])
        tokens, token_lp = self.variant(sample_by_inversion)(lp, u, jnp.zeros(6, bool))
        assert tokens.tolist() == [0, 0, 1, 1, 2, 2]
        np.testing.assert_allclose(np.asarray(token_lp), np.log([0.2, 0.2, 0.5, 0.5, 0.3, 0.3]), rtol=1e-6)
        greedy, _ = self.variant(sample_by_inversion)(lp, u, jnp.ones(6, bool))
        assert greedy.tolist() == [1] * 6

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(1, 5, 33, 513)
    def test_excluded_tokens_are_never_drawn_even_at_the_edges(self, vocab):
        rng = np.random.default_rng(vocab)
        logits = rng.normal(size=(4, vocab)) * 2
        logits[:, ::3] = -np.inf  # includes token 0 and, for 513, whole blocks of ~sqrt(V) tokens
        logits[:, vocab // 2 :] = -np.inf
        logits[:, min(1, vocab - 1)] = 0.0  # at least one finite token
        lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
        edges = jnp.array([0.0, 1e-9, 0.5, np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
        tokens, token_lp = self.variant(sample_by_inversion)(lp, edges, jnp.zeros(4, bool))
        assert np.all(np.isfinite(logits[np.arange(4), np.asarray(tokens)]))
        assert np.all(np.isfinite(np.asarray(token_lp)))
        finite = np.flatnonzero(np.isfinite(logits[0]))
        assert int(tokens[0]) == finite[0] and int(tokens[-1]) == finite[-1]

    def test_vmap_over_rows(self):
        lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (5, 1, 70)) * 2, axis=-1)
        u = jax.random.uniform(jax.random.key(1), (5, 1))
        batched = jax.jit(jax.vmap(sample_by_inversion))(lp, u, jnp.zeros((5, 1), bool))[0][:, 0]
        direct = sample_by_inversion(lp[:, 0], u[:, 0], jnp.zeros(5, bool))[0]
        assert batched.tolist() == direct.tolist()


_jit_inversion = jax.jit(sample_by_inversion)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([1, 2, 7, 40, 100, 257]),
    excluded=st.floats(0.0, 0.8),
)
def test_inversion_matches_float64_searchsorted(seed, vocab, excluded):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(8, vocab)) * 3
    logits[rng.random((8, vocab)) < excluded] = -np.inf
    logits[np.arange(8), rng.integers(0, vocab, 8)] = 1.0
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    u = rng.random(8).astype(np.float32)
    got, got_lp = _jit_inversion(lp, u, np.zeros(8, bool))
    for b in range(8):
        cdf = np.cumsum(np.exp(lp[b].astype(np.float64)))
        if np.min(np.abs(cdf - u[b] * cdf[-1])) < 1e-5:
            continue  # u sits on a boundary within float32 rounding: either side is right
        want = np_inversion(lp[b], float(u[b]))
        assert int(got[b]) == want, (b, int(got[b]), want)
        assert float(got_lp[b]) == lp[b, want]


def test_frequencies_follow_the_distribution():
    p = np.array([0.05, 0.0, 0.4, 0.0, 0.15, 0.3, 0.1, 0.0, 0.0])
    n = 40000
    lp = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, p.size))
    u = jax.random.uniform(jax.random.key(3), (n,))
    tokens, _ = _jit_inversion(lp, u, jnp.zeros(n, bool))
    freq = np.bincount(np.asarray(tokens), minlength=p.size) / n
    np.testing.assert_allclose(freq, p, atol=4 * math.sqrt(0.25 / n))
    assert np.all(freq[p == 0] == 0)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 2.0, 3.0]), min_size=1, max_size=12),
        min_size=1,
        max_size=4,
    ).filter(lambda rows: len({len(r) for r in rows}) == 1)
)
def test_first_argmax_is_numpy_argmax(rows):
    x = np.asarray(rows, np.float32)
    assert np.asarray(first_argmax(jnp.asarray(x))).tolist() == np.argmax(x, axis=-1).tolist()


def test_step_uniforms_are_per_row_and_per_step_draws():
    seeds = jnp.array([3, 0, 2**32 - 1], jnp.uint32)
    u = np.asarray(jax.jit(step_uniforms, static_argnums=1)(seeds, 5))
    assert u.shape == (3, 5) and np.all((u >= 0) & (u < 1))
    for b, seed in enumerate([3, 0, 2**32 - 1]):
        key = jax.random.key(np.uint32(seed))
        want = [float(jax.random.uniform(jax.random.fold_in(key, t), ())) for t in range(5)]
        np.testing.assert_array_equal(u[b], np.asarray(want, np.float32))
    # a row's draws do not depend on the other rows nor on the number of steps
    np.testing.assert_array_equal(np.asarray(step_uniforms(seeds[1:2], 3))[0], u[1, :3])


# ------------------------------------------------------------------------------------------------
# the compiled generation program
# ------------------------------------------------------------------------------------------------


def _computation(hlo: str, name: str) -> str:
    start = hlo.index(f"%{name} ")
    return hlo[start : hlo.index("\n}\n", start)]


@pytest.mark.parametrize("ends", [(16,), (8, 16), (5, 11, 16)])
def test_generation_loop_has_no_per_step_prng_loop_or_cache_copy(ends):
    cfg = tiny_config(vocab_size=96)
    graphdef, state = nnx.split(tiny_model(vocab_size=96))
    rows, prompt_len, new = 4, 16, 16
    args = (
        np.ones((rows, prompt_len), np.int32), np.ones((rows, prompt_len), np.int32),
        np.ones(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
        np.full(rows, new, np.int32), np.full((rows, 4), -1, np.int32), np.arange(rows, dtype=np.uint32),
    )  # fmt: skip
    hlo = sampler_lib._JITTED_GENERATE.lower(graphdef, state, *args, new, 0, ends).compile().as_text()
    loops = re.findall(r"= \(s32\[\], f32\[\d+,96\].*?\) while\(.*?body=%([\w.\-]+)", hlo)
    assert len(loops) == len(ends), (
        "expected one generation while_loop per segment, carrying [rows, vocab] logits"
    )
    # Each segment's loop carries a cache of prompt + segment-end slots, in order.
    sizes = []
    for loop in loops:
        body = _computation(hlo, loop)
        # No PRNG (threefry runs as a rolled loop on CPU: ~270 extra ops per step before) inside the step.
        assert " while(" not in body
        # Each cache array ([rows * kv_heads, slots, head_dim]) is only written in place, never copied.
        produced = {}
        for line in body.splitlines():
            m = re.search(r"= f32\[(\d+),(\d+),(\d+)\]\S* ([\w\-]+)\(", line)
            if m and m.group(4) not in ("bitcast", "get-tuple-element", "parameter"):
                shape = tuple(int(m.group(i)) for i in (1, 2, 3))
                if shape[0] == rows * cfg.num_kv_heads and shape[2] == cfg.head_dim and shape[1] > prompt_len:
                    produced.setdefault(shape[1], []).append(line.strip()[:140])
        assert len(produced) == 1, produced
        [(slots, lines)] = produced.items()
        assert len(lines) == 2 * cfg.num_layers and all("dynamic-update-slice" in p for p in lines), lines
        sizes.append(slots)
    assert sorted(sizes) == [prompt_len + e for e in ends]


def test_decode_segment_ends_hand_values():
    assert decode_segment_ends(128, 4) == (32, 64, 96, 128)  # 32-step segments
    assert decode_segment_ends(64, 4) == (32, 64)  # at least MIN_SEGMENT_STEPS (32) steps each
    assert decode_segment_ends(31, 4) == (31,)
    assert decode_segment_ends(100, 3) == (34, 67, 100)  # ceil(100 / 3), ceil(200 / 3)
    assert decode_segment_ends(1024, 4) == (256, 512, 768, 1024)
    assert decode_segment_ends(128, 1) == (128,)
    assert decode_segment_ends(10, 4, min_steps=2) == (3, 5, 8, 10)
    # a prompt longer than the generation keeps one loop (little attention to save, a big cache to copy)
    assert decode_segment_ends(128, 4, prompt_len=128) == (32, 64, 96, 128)
    assert decode_segment_ends(128, 4, prompt_len=129) == (128,)
    with pytest.raises(ValueError, match="positive"):
        decode_segment_ends(0, 4)
