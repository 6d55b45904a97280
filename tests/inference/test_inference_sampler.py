"""Tests of the embedded JAX sampler (rljax.inference.sampler).

References are independent of the code under test: float64 numpy versions of temperature / top-k /
top-p processing written from their definitions, hand-computed distributions, and the model's own
full forward pass (``rljax.models.sequence_logprobs`` and full logits), never the KV-cache path.
"""

import asyncio
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from inference_helpers import generate_batch
from panel_kernel import require_panel_kernel
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.inference.engine import Engine, SamplingParams
from rljax.inference.sampler import EmbeddedSampler, bucket_size, processed_logprobs, sample_from_logprobs
from rljax.models import Decoder, sequence_logprobs

VOCAB = 96
BUCKETS = dict(min_prompt_bucket=16, min_new_tokens_bucket=16, min_batch_bucket=8)


def tiny_model(seed: int = 0) -> Decoder:
    """A tiny Qwen3-shaped decoder with weights scaled up so its distributions are far from uniform."""
    model = models.tiny_model(vocab_size=VOCAB, seed=seed)
    state = nnx.state(model)
    state = jax.tree.map(lambda x: x * 20.0 if x.ndim == 2 else x, state)
    nnx.update(model, state)
    return model


_GRAPHDEF = nnx.split(tiny_model(0))[0]


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def sampler(model):
    return EmbeddedSampler(model, batch_wait_ms=5.0, **BUCKETS)


REF_LEN = 32  # references run at one padded length (right padding cannot change a causal prefix)


@jax.jit
def _ref_forward(state, tokens, temperature):
    model = nnx.merge(_GRAPHDEF, state)
    segments = (jnp.arange(REF_LEN) < tokens[1])[None].astype(jnp.int32)
    ids = tokens[0][None]
    logits = model(ids, segment_ids=segments)[0]
    logprobs = sequence_logprobs(model, ids, segment_ids=segments, temperature=temperature)[0]
    return logits, logprobs


def _reference(model, ids, temperature=1.0):
    assert len(ids) <= REF_LEN
    padded = jnp.asarray([list(ids) + [0] * (REF_LEN - len(ids)), [len(ids)] * REF_LEN], jnp.int32)
    logits, logprobs = _ref_forward(nnx.state(model), padded, jnp.float32(temperature))
    return np.asarray(logits, np.float64)[: len(ids)], np.asarray(logprobs)[: len(ids)]


def full_logits(model, ids):
    """float64 [L, V] logits of a whole sequence from one full forward pass (no cache)."""
    return _reference(model, ids)[0]


def full_logprobs(model, ids, temperature):
    """rljax.models.sequence_logprobs of the whole sequence (entry t = log p(ids[t] | ids[<t]))."""
    return _reference(model, ids, temperature)[1]


def prompts_of(rng, lengths):
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------------
# float64 numpy reference of the processed distribution
# ------------------------------------------------------------------------------------------------


def np_processed_logprobs(logits, temperature, top_k, top_p):
    """Row by row: z = logits / T; keep the k largest; then the smallest sorted prefix of mass >= p."""
    logits = np.asarray(logits, np.float64)
    out = np.full_like(logits, -np.inf)
    for b in range(logits.shape[0]):
        z = logits[b] / float(temperature[b])
        keep = np.ones(z.shape, bool)
        k = int(top_k[b])
        if 0 < k < z.size:
            order = np.argsort(-z)
            keep[:] = False
            keep[order[:k]] = True
        if top_p[b] < 1.0:
            idx = np.flatnonzero(keep)
            zk = z[idx]
            p = np.exp(zk - zk.max())
            p /= p.sum()
            order = np.argsort(-p)
            mass = 0.0
            kept = []
            for j in order:
                if mass >= top_p[b]:
                    break
                kept.append(idx[j])
                mass += p[j]
            keep[:] = False
            keep[kept] = True
        zk = z[keep]
        lse = zk.max() + np.log(np.sum(np.exp(zk - zk.max())))
        out[b, keep] = z[keep] - lse
    return out


class ProcessedLogprobsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_values(self):
        fn = self.variant(processed_logprobs)
        logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]] * 4))
        out = np.exp(
            np.asarray(
                fn(
                    logits,
                    jnp.array([1.0, 2.0, 1.0, 1.0]),
                    jnp.array([0, 0, 0, 2]),
                    jnp.array([1.0, 1.0, 0.6, 1.0]),
                )
            )
        )
        np.testing.assert_allclose(out[0], [0.5, 0.3, 0.2], atol=1e-6)
        # T = 2: p ~ sqrt(p): [0.7071, 0.5477, 0.4472] / 1.7020
        np.testing.assert_allclose(out[1], [0.41545, 0.32181, 0.26275], atol=1e-5)
        # top-p 0.6: mass before = [0, 0.5, 0.8] -> keep two, renormalize: [0.625, 0.375, 0]
        np.testing.assert_allclose(out[2], [0.625, 0.375, 0.0], atol=1e-6)
        # top-k 2: the same two tokens
        np.testing.assert_allclose(out[3], [0.625, 0.375, 0.0], atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_p_boundary_keeps_only_the_first_token(self):
        # mass before token 2 is exactly 0.5, not < 0.5 -> only token 1 survives
        out = self.variant(processed_logprobs)(
            jnp.log(jnp.array([[0.5, 0.3, 0.2]])), jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.array([0.5])
        )
        np.testing.assert_allclose(np.exp(np.asarray(out[0])), [1.0, 0.0, 0.0], atol=1e-6)

    def test_vmap_over_rows(self):
        logits = jax.random.normal(jax.random.key(0), (5, 1, 30)) * 3
        t, k, p = jnp.full((5, 1), 0.8), jnp.full((5, 1), 7, jnp.int32), jnp.full((5, 1), 0.9)
        batched = jax.jit(jax.vmap(processed_logprobs))(logits, t, k, p)[:, 0]
        direct = processed_logprobs(logits[:, 0], t[:, 0], k[:, 0], p[:, 0])
        np.testing.assert_allclose(np.asarray(batched), np.asarray(direct), rtol=1e-6)


_jit_processed = jax.jit(processed_logprobs)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([2, 7, 40]),
    temperature=st.lists(st.sampled_from([0.3, 0.7, 1.0, 2.5]), min_size=3, max_size=3),
    top_k=st.lists(st.sampled_from([0, 1, 3, 10]), min_size=3, max_size=3),
    top_p=st.lists(st.sampled_from([0.3, 0.75, 0.95, 1.0]), min_size=3, max_size=3),
)
def test_processed_logprobs_match_numpy(seed, vocab, temperature, top_k, top_p):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(3, vocab)) * 3).astype(np.float32)
    t = np.asarray(temperature, np.float32)
    k = np.asarray(top_k, np.int32)
    p = np.asarray(top_p, np.float32)
    got = np.asarray(_jit_processed(logits, t, k, p), np.float64)
    want = np_processed_logprobs(logits, t, k, p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=2e-5)


def test_gumbel_sampling_frequencies_and_greedy():
    probs = np.array([0.1, 0.6, 0.05, 0.25])
    n = 10000
    logp = jnp.log(jnp.tile(jnp.asarray(probs, jnp.float32), (n, 1)))
    keys = jax.random.split(jax.random.key(3), n)
    sample = jax.jit(sample_from_logprobs)
    tokens, token_lp = sample(logp, keys, jnp.zeros(n, bool))
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.02)
    np.testing.assert_allclose(np.asarray(token_lp), np.log(probs)[np.asarray(tokens)], rtol=1e-6)
    greedy, _ = sample(logp[:3], keys[:3], jnp.ones(3, bool))
    assert np.asarray(greedy).tolist() == [1, 1, 1]
    # excluded tokens (-inf) are never drawn
    masked = logp[:1000].at[:, 1].set(-jnp.inf)
    drawn, _ = sample(masked, keys[:1000], jnp.zeros(1000, bool))
    assert 1 not in np.asarray(drawn).tolist()


def test_bucket_size():
    assert [bucket_size(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, 16]
    assert bucket_size(3, minimum=16) == 16


# ------------------------------------------------------------------------------------------------
# generation against the model's full forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_logprobs_equal_sequence_logprobs(model, sampler, temperature):
    rng = np.random.default_rng(1)
    prompts = prompts_of(rng, [3, 11, 7])
    params = [SamplingParams(temperature=temperature, max_tokens=12, seed=i) for i in range(3)]
    outs = generate_batch(sampler, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length" and len(out.ids) == 12
        ref = full_logprobs(model, prompt + list(out.ids), temperature)
        np.testing.assert_allclose(out.logprobs, ref[len(prompt) :], **LOGPROB_TOL)
    assert len({o.ids for o in outs}) == 3


def test_greedy_matches_argmax_of_full_forward(model, sampler):
    rng = np.random.default_rng(2)
    prompts = prompts_of(rng, [4, 9])
    outs = generate_batch(sampler, prompts, SamplingParams(temperature=0.0, max_tokens=10, seed=5))
    top1 = generate_batch(sampler, prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, seed=9))
    for prompt, out, o1 in zip(prompts, outs, top1, strict=True):
        seq = prompt + list(out.ids)
        logits = full_logits(model, seq)
        for t, token in enumerate(out.ids):
            assert token == int(np.argmax(logits[len(prompt) - 1 + t]))
        # greedy logprobs are those of the T = 1 distribution (vLLM convention)
        ref = full_logprobs(model, seq, 1.0)
        np.testing.assert_allclose(out.logprobs, ref[len(prompt) :], **LOGPROB_TOL)
        assert o1.ids == out.ids
        np.testing.assert_allclose(o1.logprobs, 0.0, atol=1e-6)  # top-1 leaves one token: p = 1


def test_stop_ids_stop_and_are_included(model, sampler):
    rng = np.random.default_rng(3)
    prompts = prompts_of(rng, [5, 8, 6, 3])
    params = [
        SamplingParams(temperature=t, max_tokens=16, seed=s) for s, t in enumerate([1.0, 0.0, 1.3, 0.8])
    ]
    free = generate_batch(sampler, prompts, params)
    assert all(o.finish_reason == "length" and len(o.ids) == 16 for o in free)
    # a row's random stream depends only on its seed, so with one of its tokens as a stop id the
    # same prefix is sampled again and generation ends right after that token's first occurrence
    stops = [(o.ids[4], o.ids[9], VOCAB - 1) for o in free]
    stopped = generate_batch(
        sampler,
        prompts,
        [dataclasses.replace(p, stop_token_ids=stop) for p, stop in zip(params, stops, strict=True)],
    )
    for o, stop, out in zip(free, stops, stopped, strict=True):
        end = min(o.ids.index(t) for t in stop if t in o.ids) + 1
        assert out.finish_reason == "stop" and out.ids == o.ids[:end] and out.ids[-1] in stop
        np.testing.assert_allclose(out.logprobs, o.logprobs[:end], atol=1e-6)
    # a stop id sampled as the last budgeted token reports "stop", not "length"
    last_token = free[0].ids[8]
    last = generate_batch(
        sampler, prompts[:1], dataclasses.replace(params[0], max_tokens=9, stop_token_ids=(last_token,))
    )[0]
    assert last.ids == free[0].ids[: free[0].ids.index(last_token) + 1] and last.finish_reason == "stop"


def test_top_k_never_samples_outside_the_top_k(model, sampler):
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, [6, 2, 10, 5])
    temperature, k = 3.0, 3
    outs = generate_batch(
        sampler,
        prompts,
        [SamplingParams(temperature=temperature, top_k=k, max_tokens=16, seed=s) for s in range(4)],
    )
    for prompt, out in zip(prompts, outs, strict=True):
        logits = full_logits(model, prompt + list(out.ids))[len(prompt) - 1 : -1]
        ref = np_processed_logprobs(
            logits, [temperature] * len(logits), [k] * len(logits), [1.0] * len(logits)
        )
        for t, token in enumerate(out.ids):
            assert token in np.argsort(-logits[t])[:k]
            np.testing.assert_allclose(out.logprobs[t], ref[t, token], **LOGPROB_TOL)


def test_top_p_samples_inside_the_nucleus_with_renormalized_logprobs(model, sampler):
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, [6, 4, 9])
    temperature, p = 1.5, 0.7
    outs = generate_batch(
        sampler,
        prompts,
        [SamplingParams(temperature=temperature, top_p=p, max_tokens=16, seed=s) for s in range(3)],
    )
    for prompt, out in zip(prompts, outs, strict=True):
        logits = full_logits(model, prompt + list(out.ids))[len(prompt) - 1 : -1]
        n = len(logits)
        ref = np_processed_logprobs(logits, [temperature] * n, [0] * n, [p] * n)
        for t, token in enumerate(out.ids):
            assert np.isfinite(ref[t, token])
            np.testing.assert_allclose(out.logprobs[t], ref[t, token], **LOGPROB_TOL)


def test_batched_requests_equal_one_at_a_time(sampler):
    rng = np.random.default_rng(6)
    prompts = prompts_of(rng, [2, 13, 5, 8, 1])
    params = [
        SamplingParams(temperature=1.0, max_tokens=10, seed=11),
        SamplingParams(temperature=0.5, max_tokens=4, seed=12),
        SamplingParams(temperature=2.0, top_k=5, max_tokens=16, seed=13),
        SamplingParams(temperature=0.0, max_tokens=7, seed=14, stop_token_ids=(1, 2, 3)),
        SamplingParams(temperature=1.2, top_p=0.8, max_tokens=12, seed=15),
    ]

    async def concurrently():
        before = sampler.num_batches
        outs = await asyncio.gather(
            *(
                sampler.generate(p, s, session_id=f"s{i}")
                for i, (p, s) in enumerate(zip(prompts, params, strict=True))
            )
        )
        return outs, sampler.num_batches - before

    together, num_batches = asyncio.run(concurrently())
    assert num_batches == 1  # all five waited for each other and ran as one batch
    for prompt, s, out in zip(prompts, params, together, strict=True):
        alone = generate_batch(sampler, [prompt], s)[0]
        assert alone.ids == out.ids
        assert alone.finish_reason == out.finish_reason
        np.testing.assert_allclose(alone.logprobs, out.logprobs, **LOGPROB_TOL)


def test_seeds_reproduce_and_differ(sampler):
    prompt = [5, 6, 7]
    a = generate_batch(sampler, [prompt], SamplingParams(max_tokens=12, seed=42))[0]
    b = generate_batch(sampler, [prompt, [1, 2]], SamplingParams(max_tokens=12, seed=42))[0]
    c = generate_batch(sampler, [prompt], SamplingParams(max_tokens=12, seed=43))[0]
    assert a.ids == b.ids and a.ids != c.ids
    # seedless requests draw from the sampler's own generator: reproducible per sampler seed
    d1 = EmbeddedSampler(sampler_model := tiny_model(0), seed=1, **BUCKETS)
    d2 = EmbeddedSampler(sampler_model, seed=1, **BUCKETS)
    assert generate_batch(d1, [prompt], SamplingParams(max_tokens=8))[0].ids == (
        generate_batch(d2, [prompt], SamplingParams(max_tokens=8))[0].ids
    )


def test_compilations_are_bounded_by_buckets(sampler):
    rng = np.random.default_rng(7)
    generate_batch(sampler, prompts_of(rng, [3, 4]), SamplingParams(max_tokens=5, seed=0))
    before = EmbeddedSampler.num_compilations()
    for lengths, max_tokens in [([2, 9], 3), ([16, 1, 4], 16), ([5], 11)]:  # same buckets: 16 x 16, 8 rows
        generate_batch(sampler, prompts_of(rng, lengths), SamplingParams(max_tokens=max_tokens, seed=1))
    assert EmbeddedSampler.num_compilations() == before


def test_update_weights_swaps_parameters_and_bumps_version(model):
    s = EmbeddedSampler(model, weight_version=3, **BUCKETS)
    assert isinstance(s, Engine)
    prompt, params = [4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8)
    before = generate_batch(s, [prompt], params)[0]
    assert before.weight_version == 3
    other = tiny_model(1)
    assert asyncio.run(s.update_weights(other)) == 4
    after = generate_batch(s, [prompt], params)[0]
    assert after.weight_version == 4
    logits = full_logits(other, prompt + list(after.ids))
    assert list(after.ids) == [int(np.argmax(logits[len(prompt) - 1 + t])) for t in range(8)]
    assert s.set_weights(nnx.state(model), version=10) == 10
    assert generate_batch(s, [prompt], params)[0].ids == before.ids
    # in-place changes to the model are invisible until the next set_weights (versions stay honest)
    mutable = tiny_model(0)
    s.set_weights(mutable, version=11)
    nnx.update(mutable, nnx.state(other))
    assert generate_batch(s, [prompt], params)[0].ids == before.ids
    s.set_weights(mutable)
    assert generate_batch(s, [prompt], params)[0] == after.__class__(
        after.ids, after.logprobs, after.finish_reason, 12
    )


@pytest.mark.parametrize("layout", ["out_in", "panels"])
def test_kernel_layouts_sample_the_same_tokens(model, layout):
    """The decode copies of the kernels (``"out_in"``: transposed; ``"panels"``: packed for the AVX2
    kernel, the CPU default where it builds and is timed faster) sample what the model's own layout
    samples: same tokens for the same seeds, logprobs within float32 matmul rounding; the default
    layout also agrees with the full forward (test_logprobs_equal_sequence_logprobs)."""
    from rljax.models.layers import Linear
    from rljax.models.panel_matmul import available, use_panels

    assert jax.default_backend() == "cpu"
    if layout == "panels":
        require_panel_kernel()  # skips with the reason where it cannot build; CI requires it
        assert available(), "the panel_matmul kernel did not build (see the logged warning)"
        auto = EmbeddedSampler(model, **BUCKETS).kernel_layout
        assert auto == ("panels" if use_panels() else "out_in")  # auto picks it where it is faster
    stored = EmbeddedSampler(model, kernel_layout=layout, **BUCKETS)
    plain = EmbeddedSampler(model, kernel_layout="in_out", **BUCKETS)
    assert stored.kernel_layout == layout and plain.kernel_layout == "in_out"
    served = nnx.merge(*stored._weights[:2])
    layouts = [
        getattr(m, "kernel_layout", "in_out") for p, m in nnx.iter_graph(served) if isinstance(m, Linear)
    ]
    assert layouts.count(layout) == 7 * model.config.num_layers  # q/k/v/o, gate/up/down
    assert (getattr(served, "unembedding_panels", None) is not None) == (layout == "panels")
    prompts = [[4, 5, 6, 7], [9, 3], [1, 2, 3, 4, 5, 6]]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=i) for i in range(3)]
    a, b = generate_batch(stored, prompts, params), generate_batch(plain, prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.ids == y.ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, **LOGPROB_TOL)
    # set_weights re-lays out the new parameters (and checks them against the model's layout)
    other = tiny_model(1)
    stored.set_weights(nnx.state(other))
    plain.set_weights(nnx.state(other))
    x, y = (
        generate_batch(stored, prompts[:1], params[:1])[0],
        generate_batch(plain, prompts[:1], params[:1])[0],
    )
    assert x.ids == y.ids
    np.testing.assert_allclose(x.logprobs, y.logprobs, **LOGPROB_TOL)
    with pytest.raises(ValueError, match="kernel_layout must be one of"):
        EmbeddedSampler(model, kernel_layout="col_major")


def test_panels_fall_back_per_matrix_and_for_bfloat16():
    """Kernels whose output is not a multiple of 16 (here k/v: 2 x 4 = 8 columns, and a 90-token
    vocabulary) stay ``"out_in"`` beside packed ones and the model samples the same tokens; a bfloat16
    model is not packed at all (the kernel is float32) and ``"auto"`` keeps ``"out_in"`` for it."""
    from rljax.models.layers import Linear

    require_panel_kernel()
    odd = models.tiny_model(vocab_size=90, head_dim=4, seed=3)
    stored = EmbeddedSampler(odd, kernel_layout="panels", **BUCKETS)
    plain = EmbeddedSampler(odd, kernel_layout="in_out", **BUCKETS)
    served = nnx.merge(*stored._weights[:2])
    linears = [(p, m) for p, m in nnx.iter_graph(served) if isinstance(m, Linear)]
    by_name = {p[-1]: getattr(m, "kernel_layout", "in_out") for p, m in linears}
    assert by_name["k_proj"] == by_name["v_proj"] == "out_in" and by_name["up_proj"] == "panels"
    assert getattr(served, "unembedding_panels", None) is None
    prompts, params = [[4, 5, 6, 7], [9, 3]], [SamplingParams(max_tokens=10, seed=i) for i in range(2)]
    a, b = generate_batch(stored, prompts, params), generate_batch(plain, prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.ids == y.ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, **LOGPROB_TOL)
    bf16 = models.Decoder(odd.config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert EmbeddedSampler(bf16, **BUCKETS).kernel_layout == "out_in"
    served = nnx.merge(*EmbeddedSampler(bf16, kernel_layout="panels", **BUCKETS)._weights[:2])
    layouts = {
        getattr(m, "kernel_layout", "in_out") for _, m in nnx.iter_graph(served) if isinstance(m, Linear)
    }
    assert "panels" not in layouts and "out_in" in layouts


def test_auto_layout_follows_the_timed_choice_and_the_switch(model, monkeypatch):
    """``"auto"`` takes the kernel only where the timed comparison chose it (given here, not
    measured) or ``RLJAX_PANEL_MATMUL=1`` forces it; ``=0`` turns it off, explicit ``"panels"``
    included (every kernel then stored ``"out_in"``); a bfloat16 model never asks."""
    from rljax.models import panel_matmul as pm
    from rljax.models.decode_layout import PanelLinear, TransposedLinear
    from rljax.models.layers import Linear

    require_panel_kernel()
    monkeypatch.delenv("RLJAX_PANEL_MATMUL", raising=False)
    asked = []

    def choice(use):
        return lambda: asked.append(use) or pm.Choice(use, (1.0,), (1.2 if use else 0.8,), "given")

    monkeypatch.setattr(pm, "timed_choice", choice(False))
    assert EmbeddedSampler(model, **BUCKETS).kernel_layout == "out_in" and asked == [False]
    monkeypatch.setattr(pm, "timed_choice", choice(True))
    chosen = EmbeddedSampler(model, **BUCKETS)  # asks whether, then in which instruction set
    assert chosen.kernel_layout == "panels" and chosen.kernel_isa == "avx2" and asked == [False, True, True]
    bf16 = models.Decoder(model.config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert EmbeddedSampler(bf16, **BUCKETS).kernel_layout == "out_in" and len(asked) == 3
    monkeypatch.setattr(pm, "timed_choice", choice(False))
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "1")
    forced = EmbeddedSampler(model, **BUCKETS)
    assert forced.kernel_layout == "panels" and forced.kernel_isa == pm.supported_isas()[-1]  # the widest
    assert len(asked) == 3
    monkeypatch.setenv("RLJAX_PANEL_MATMUL", "0")
    assert EmbeddedSampler(model, **BUCKETS).kernel_layout == "out_in" and len(asked) == 3
    off = EmbeddedSampler(model, kernel_layout="panels", **BUCKETS)
    assert off.kernel_layout == "out_in"
    served = nnx.merge(*off._weights[:2])
    kinds = {p[-1]: type(m) for p, m in nnx.iter_graph(served) if isinstance(m, Linear)}
    assert kinds.pop("lm_head") is Linear  # read as [in, out] by Decoder.unembedding
    assert set(kinds.values()) == {TransposedLinear} and PanelLinear not in kinds.values()
    assert served.unembedding_panels is None


def test_transposed_keys_sample_the_same_tokens_with_shared_prefixes_and_segments(model, monkeypatch):
    """``RLJAX_TRANSPOSED_KEYS=1`` / ``0``: the decode-time copy's caches store keys transposed or not
    (a static part of the served model), through shared-prefix prefill, grown decode segments and
    a weight update; tokens are equal and logprobs within float32 noise. The model's own layout
    (``"in_out"``) keeps the plain cache."""
    monkeypatch.setenv("RLJAX_TRANSPOSED_KEYS", "1")
    moved = EmbeddedSampler(model, kernel_layout="out_in", decode_segments=3, **BUCKETS)
    assert (
        moved.transposed_keys
        and not EmbeddedSampler(model, kernel_layout="in_out", **BUCKETS).transposed_keys
    )
    monkeypatch.setenv("RLJAX_TRANSPOSED_KEYS", "0")
    plain = EmbeddedSampler(model, kernel_layout="out_in", decode_segments=3, **BUCKETS)
    assert not plain.transposed_keys
    assert (
        nnx.merge(*moved._weights[:2]).transposed_keys and not nnx.merge(*plain._weights[:2]).transposed_keys
    )
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # a group's prompt (shared-prefix prefill) and others
    prompts = [shared, shared, shared + [13], [9, 3]]
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i) for i in range(len(prompts))]
    for sampler_round in range(2):
        a, b = generate_batch(moved, prompts, params), generate_batch(plain, prompts, params)
        for x, y in zip(a, b, strict=True):
            assert x.ids == y.ids and len(x.ids) == 40
            np.testing.assert_allclose(x.logprobs, y.logprobs, **LOGPROB_TOL)
        if sampler_round == 0:
            other = nnx.state(tiny_model(1))
            moved.set_weights(other)
            plain.set_weights(other)
    assert moved.num_prefilled_tokens < moved.num_prompt_tokens  # the group's prompt was prefilled once


def test_decode_segments_sample_what_one_loop_samples(model, monkeypatch):
    """The segmented decode loop (a cache grown segment by segment) against one loop over the whole
    cache and against the full forward: same tokens for the same seeds, stop ids and budgets ending
    rows inside and across segments, logprobs equal to sequence_logprobs."""
    import rljax.inference.sampler as sampler_lib

    monkeypatch.setattr(sampler_lib, "MIN_SEGMENT_STEPS", 4)
    assert sampler_lib.decode_segment_ends(16, 3) == (6, 11, 16)
    one = EmbeddedSampler(model, decode_segments=1, **BUCKETS)
    segmented = EmbeddedSampler(model, decode_segments=3, **BUCKETS)
    rng = np.random.default_rng(8)
    prompts = prompts_of(rng, [5, 11, 2, 8])
    params = [
        SamplingParams(temperature=1.0, max_tokens=12, seed=1),
        SamplingParams(temperature=0.0, max_tokens=12, seed=2),
        SamplingParams(temperature=0.8, max_tokens=5, seed=3),  # ends inside the first segment
        SamplingParams(temperature=1.2, max_tokens=12, seed=4),
    ]
    free = generate_batch(one, prompts, params)
    # stop at the token drawn at step 7 (second segment) for two rows
    params[0] = dataclasses.replace(params[0], stop_token_ids=(free[0].ids[7],))
    params[3] = dataclasses.replace(params[3], stop_token_ids=(free[3].ids[7],))
    want = generate_batch(one, prompts, params)
    got = generate_batch(segmented, prompts, params)
    for prompt, p, w, g in zip(prompts, params, want, got, strict=True):
        assert g.ids == w.ids and g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, **LOGPROB_TOL)
        ref = full_logprobs(model, prompt + list(g.ids), p.temperature or 1.0)  # greedy: T = 1 logprobs
        np.testing.assert_allclose(g.logprobs, ref[len(prompt) :], **LOGPROB_TOL)
    assert [len(g.ids) for g in got] == [free[0].ids.index(free[0].ids[7]) + 1, 12, 5,
                                        free[3].ids.index(free[3].ids[7]) + 1]  # fmt: skip
    with pytest.raises(ValueError, match="decode_segments must be an int >= 1"):
        EmbeddedSampler(model, decode_segments=0)


def test_max_model_len_clips_max_tokens(model):
    s = EmbeddedSampler(model, max_model_len=12, **BUCKETS)
    out = generate_batch(s, [[1] * 9], SamplingParams(max_tokens=50, seed=0))[0]
    assert len(out.ids) == 3 and out.finish_reason == "length"


def test_bad_requests_raise_clear_errors(model, sampler):
    def generate(s, prompt, sampling):
        return asyncio.run(s.generate(prompt, sampling))

    with pytest.raises(ValueError, match="empty"):
        generate(sampler, [], SamplingParams())
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        generate(sampler, [VOCAB], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        generate(EmbeddedSampler(model, max_model_len=4), [1, 2, 3, 4], SamplingParams())
    with pytest.raises(ValueError, match="stop token id"):
        generate(sampler, [1], SamplingParams(stop_token_ids=(VOCAB + 5,)))
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        generate(sampler, [1], {"max_tokens": 1})
    with pytest.raises(ValueError, match="Decoder"):
        EmbeddedSampler(object())
    with pytest.raises(ValueError, match="structure"):
        sampler.set_weights(nnx.State({}))


def test_engine_errors_reach_every_caller(sampler, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    s = EmbeddedSampler(tiny_model(0), **BUCKETS)
    monkeypatch.setattr(s, "_run_batch", boom)

    async def two():
        return await asyncio.gather(
            s.generate([1, 2], SamplingParams(max_tokens=2)),
            s.generate([3], SamplingParams(max_tokens=2)),
            return_exceptions=True,
        )

    results = asyncio.run(two())
    assert all(isinstance(r, RuntimeError) for r in results)


def test_released_weights_refuse_requests_until_a_version_is_loaded(model):
    """Between ``release_weights`` and the next load a request fails with an error naming both; after
    ``update_weights`` the sampler samples that version again."""
    released = EmbeddedSampler(model)
    params = [SamplingParams(temperature=0.0, max_tokens=3)]
    before = generate_batch(released, [[1, 2, 3]], params)
    released.release_weights()
    with pytest.raises(RuntimeError, match="released the weights of version 0.*update_weights loads one"):
        generate_batch(released, [[1, 2, 3]], params)
    assert asyncio.run(released.update_weights(model, version=1)) == 1
    assert generate_batch(released, [[1, 2, 3]], params)[0].ids == before[0].ids  # greedy, same weights
