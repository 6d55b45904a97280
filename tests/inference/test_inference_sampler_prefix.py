"""The embedded sampler prefills a prompt prefix shared by several requests once (prefix sharing).

References: hand-worked groupings, the model's own full forward (logits, ``sequence_logprobs``,
router choices; never the KV-cache path) on each whole sequence, and the same sampler with
``prefix_sharing=False``, which must draw the same tokens for the same seeds.
"""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_inference_sampler import BUCKETS, np_processed_logprobs, tiny_model
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.inference import sampler as sampler_module
from rljax.inference.engine import SamplingParams
from rljax.inference.sampler import EmbeddedSampler, shared_prefix_groups
from rljax.models import SharedPrefix, prefill

VOCAB = 96
REF_LEN = 48  # full forwards run at one padded length (right padding cannot change a causal prefix)


@nnx.jit
def _padded_forward(model, tokens, segment_ids):
    out = model.hidden_states(tokens, segment_ids=segment_ids, with_routing=bool(model.config.moe_layers))
    experts = None if out.routing is None else out.routing.experts
    return model.logits(out.hidden), experts


def full_forward(model, ids):
    """float64 logits ``[L, V]`` of one whole sequence (no cache) and its routed experts (MoE) or None."""
    tokens = np.zeros((1, REF_LEN), np.int32)
    tokens[0, : len(ids)] = ids
    logits, experts = _padded_forward(
        model, jnp.asarray(tokens), jnp.asarray(tokens * 0 + (np.arange(REF_LEN) < len(ids)))
    )
    experts = None if experts is None else np.asarray(experts)[0, : len(ids)]
    return np.asarray(logits, np.float64)[0, : len(ids)], experts


def np_support_floors(logits, temperature, processed):
    """Midpoint between the smallest kept and the largest dropped ``logits / T`` of each row (the
    kept tokens: finite ``processed`` logprobs); ``-inf`` where nothing is dropped."""
    z = logits / temperature
    kept = np.isfinite(processed)
    dropped = np.where(kept, -np.inf, z).max(axis=1)
    return np.where(np.isfinite(dropped), 0.5 * (np.where(kept, z, np.inf).min(axis=1) + dropped), -np.inf)


def check_floors(floors, want, z):
    """Support floors within float32 noise of ``want``. A floor is a value of ``z = logits / T``, whose
    rounding between equivalent float32 programs grows with the step's largest ``|z|`` (measured: up
    to 2.9e-6 of it, KV-cache decode vs full forward, shared prefix or not); the bound allows
    1e-5 of it (plus 1e-5), ~1000x below a floor taken at the wrong step or support."""
    bound = 1e-5 * (1 + np.abs(z).max(axis=1))
    err = np.abs(np.asarray(floors, np.float64) - np.asarray(want, np.float64))
    assert np.all(err <= bound), f"floor error / bound up to {np.max(err / bound):.3g}"


def check_against_full_forward(model, prompt, params, completion, *, routing=True, unshared=None):
    """The completion's logprobs are the full forward's processed distribution at its tokens, and
    its support floors (top-k / top-p rows) that distribution's and, given, those of the ``unshared``
    completion; MoE (with ``routing``): its recorded experts are the full forward's over prompt +
    completion but the last token."""
    seq = prompt + list(completion.ids)
    logits, experts = full_forward(model, seq)
    logits = logits[len(prompt) - 1 : -1]
    n, temperature = len(logits), params.temperature or 1.0
    ref = np_processed_logprobs(logits, [temperature] * n, [params.top_k or 0] * n, [params.top_p] * n)
    np.testing.assert_allclose(completion.logprobs, ref[np.arange(n), list(completion.ids)], **LOGPROB_TOL)
    truncated = bool(params.top_k) or params.top_p < 1.0
    assert (completion.support_floors is not None) == truncated
    if truncated:
        floors = np_support_floors(logits, temperature, ref)
        assert np.isfinite(floors).all()  # something was cut at every step: the check compares values
        check_floors(completion.support_floors, floors, logits / temperature)
        if unshared is not None:
            check_floors(completion.support_floors, unshared.support_floors, logits / temperature)
    if routing and experts is not None:
        np.testing.assert_array_equal(completion.routed_experts, experts[:-1])


def test_shared_prefix_groups_by_hand():
    x = [5] * 8
    a, b, c, short = x + [1], x + [2], x + [3], [5, 5, 9]
    # identical prompts only (min_shared=None): a GRPO group's samples
    assert shared_prefix_groups([a, b, a, a], min_shared=None) == ([0, 1, 0, 0], [9, 9])
    # a, b, c share 8 tokens; `short` shares 2 with them: joining would cut the group's prefix from 8
    # to 2 and save 3 * 2 = 6 < 2 * 8 = 16 prefill tokens, so it stays alone
    assert shared_prefix_groups([a, b, short, c], min_shared=2) == ([0, 0, 1, 0], [8, 3])
    assert shared_prefix_groups([a, b, short, c], min_shared=9) == ([0, 1, 2, 3], [9, 9, 3, 9])
    # a prompt that is the shared prefix itself joins with no tokens of its own; ids by first member
    assert shared_prefix_groups([[7, 7], x, a, [7, 7]], min_shared=4) == ([0, 1, 1, 0], [2, 8])
    # one short match does not cut a long prefix, but equal savings do join: 2 * 4 >= 1 * 8
    assert shared_prefix_groups([x, x[:4] + [0]], min_shared=4) == ([0, 0], [4])
    with pytest.raises(ValueError, match="min_shared"):
        shared_prefix_groups([a], min_shared=0)


def test_prompt_arrays_share_only_where_they_prefill_fewer_tokens():
    model = tiny_model(0)
    s = EmbeddedSampler(model, min_shared_prefix=4, **BUCKETS)
    a = list(range(1, 8))
    tokens, segments, shared, row_segments = s._prompt_arrays([a, a, [9, 8]], 8)
    assert shared is not None and tokens.shape == (8, 0)  # identical prompts: no tokens of their own
    np.testing.assert_array_equal(shared.rows[:3], [0, 0, 1])
    np.testing.assert_array_equal(shared.tokens[0, -7:], a)
    assert shared.segment_ids.sum() == 7 + 2 and row_segments[:3].sum(axis=1).tolist() == [7, 7, 2]
    # 8 rows of 16 prompt slots vs 2 prefix rows of 16 + 8 rows of 16 own slots: no saving, no sharing
    long_a, long_b = a + list(range(20, 28)), a + list(range(30, 39))
    assert s._prompt_arrays([long_a, long_b], 8)[2] is None
    assert s._prompt_arrays([[1, 2], [3, 4]], 8)[2] is None  # nothing shared
    off = EmbeddedSampler(model, prefix_sharing=False, **BUCKETS)
    assert off._prompt_arrays([a, a], 8)[2] is None


def test_prefill_with_a_shared_prefix_equals_the_full_forward():
    """Prefixes prefilled once and copied to their rows, then each row's own tokens (none for some, a
    padding prefix row too): the next-token logits of every whole prompt and, after one decode step,
    of the prompt plus one token."""
    model = tiny_model(0)
    prefixes = [[3, 1, 4, 1, 5], [2, 7]]
    own = [[], [9], [6, 6, 6], [], [8, 2]]
    rows = [0, 0, 1, 1, 0]
    width, own_width = 8, 4
    tokens = np.zeros((3, width), np.int32)  # a third, all-padding prefix row
    seg = np.zeros((3, width), np.int32)
    for g, p in enumerate(prefixes):
        tokens[g, width - len(p) :], seg[g, width - len(p) :] = p, 1
    own_tokens = np.zeros((5, own_width), np.int32)
    own_seg = np.zeros((5, own_width), np.int32)
    for b, o in enumerate(own):
        if o:
            own_tokens[b, own_width - len(o) :], own_seg[b, own_width - len(o) :] = o, 1
    shared = SharedPrefix(jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(rows, jnp.int32))
    logits, cache, _ = prefill(model, jnp.asarray(own_tokens), segment_ids=jnp.asarray(own_seg),
                               max_length=width + own_width + 1, shared_prefix=shared)  # fmt: skip
    whole = [prefixes[g] + o for g, o in zip(rows, own, strict=True)]
    assert cache.lengths.tolist() == [len(w) for w in whole] and int(cache.index) == width + own_width
    nxt = jnp.asarray([11, 12, 13, 14, 15], jnp.int32)
    after = models.decode_step(model, nxt, cache).logits
    for b, w in enumerate(whole):
        ref = full_forward(model, w + [int(nxt[b])])[0]
        np.testing.assert_allclose(logits[b], ref[len(w) - 1], atol=2e-4, rtol=1e-5)
        np.testing.assert_allclose(after[b], ref[len(w)], atol=2e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="exceeds the cache max_length"):
        prefill(model, jnp.asarray(own_tokens), max_length=width + own_width - 1, shared_prefix=shared)


def _params():
    """Temperatures, top-k, top-p, greedy and a budget that ends early, one per request."""
    return [
        SamplingParams(temperature=1.0, max_tokens=12, seed=1),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=12, seed=2),
        SamplingParams(temperature=1.3, top_p=0.8, max_tokens=12, seed=3),
        SamplingParams(temperature=0.0, max_tokens=12, seed=4),
        SamplingParams(temperature=1.0, max_tokens=5, seed=5),
        SamplingParams(temperature=1.2, top_k=9, top_p=0.9, max_tokens=12, seed=6),
        SamplingParams(temperature=1.0, max_tokens=12, seed=7),
        SamplingParams(temperature=0.9, max_tokens=12, seed=8),
    ]


def _prompts():
    """A GRPO-like group of 3 identical prompts, 3 prompts sharing a 20-token history (one of them the
    history itself), and 2 lone prompts, all of different lengths across groups."""
    rng = np.random.default_rng(3)
    group = rng.integers(0, VOCAB, 7).tolist()
    history = rng.integers(0, VOCAB, 20).tolist()
    return [group, history + [4, 5], group, history, rng.integers(0, VOCAB, 11).tolist(), group,
            history + [1], rng.integers(0, VOCAB, 3).tolist()]  # fmt: skip


def _run(sampler, prompts, params):
    async def main():
        return await asyncio.gather(*(sampler.generate(p, s) for p, s in zip(prompts, params, strict=True)))

    before = sampler.num_batches
    outs = asyncio.run(main())
    assert sampler.num_batches == before + 1  # one batch: the requests met in the batching window
    return outs


def _lora_model():
    """The tiny model with LoRA adapters on projections and the unembedding, visibly non-zero."""
    from rljax.models import lora

    model = tiny_model(0)
    targets = ("q_proj", "v_proj", "down_proj", "lm_head")
    lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=4.0, targets=targets), rngs=nnx.Rngs(1))
    for _, var in nnx.to_flat_state(lora.lora_state(model)):
        var.set_value(var.get_value() + 0.3)
    return model


def test_shared_prefixes_sample_what_separate_prompts_sample():
    """Same tokens, finish reasons, logprobs and support floors as without sharing, stop ids ending
    rows; logprobs and floors equal the full forward's processed distribution's; the shared tokens
    are prefilled once. The model carries LoRA adapters (projections and unembedding), which act on
    the shared prefill too."""
    model = _lora_model()
    prompts, params = _prompts(), _params()
    shared = EmbeddedSampler(model, batch_wait_ms=5.0, min_shared_prefix=4, **BUCKETS)
    alone = EmbeddedSampler(model, batch_wait_ms=5.0, prefix_sharing=False, **BUCKETS)
    free = _run(alone, prompts, params)
    for i in (0, 6):  # stop on the token drawn at step 6
        params[i] = dataclasses.replace(params[i], stop_token_ids=(free[i].ids[6],))
    want, got = _run(alone, prompts, params), _run(shared, prompts, params)
    assert alone.num_prefilled_tokens == alone.num_prompt_tokens == 2 * sum(map(len, prompts))
    assert shared.num_prompt_tokens == sum(map(len, prompts))
    assert shared.num_prefilled_tokens == 7 + (20 + 2 + 1) + 11 + 3  # each shared token once
    for prompt, p, w, g in zip(prompts, params, want, got, strict=True):
        assert g.ids == w.ids and g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, **LOGPROB_TOL)
        assert (g.support_floors is None) == (w.support_floors is None)
        check_against_full_forward(model, prompt, p, g, unshared=w)
    assert [g.finish_reason for g in got[:5:4]] == ["stop", "length"] and len(got[4].ids) == 5


def _moe_model():
    from rljax.models.tiny import random_decoder, tiny_config

    return random_decoder(tiny_config("qwen3_moe", vocab_size=VOCAB), seed=2)


@pytest.mark.slow
def test_in_flight_switch_recomputes_shared_prefixes(monkeypatch):
    """A weight switch mid-decode recomputes the cache from the shared prefixes with the new weights:
    the tokens before the switch follow the old weights' full forward, those after it the new
    weights' (logprobs and, MoE, the recorded routing of the whole sequence: shared prefix, own
    prompt tokens and completion). Without a switch, the routing records of shared prefixes are
    checked on the hybrid MoE model (test_inference_sampler_hybrid.py)."""
    old, new = _moe_model(), _moe_model()
    nnx.update(new, jax.tree.map(lambda x: x * 1.3, nnx.state(new)))
    prompts, params = _prompts()[:4], [SamplingParams(max_tokens=16, seed=20 + i) for i in range(4)]
    s = EmbeddedSampler(old, in_flight_updates=True, in_flight_segment_steps=4, batch_wait_ms=0.0,
                        min_shared_prefix=4, **BUCKETS)  # fmt: skip
    real, calls = sampler_module._JITTED_SEGMENT, []

    def segment(*args):
        out = real(*args)
        calls.append(1)
        if len(calls) == 2:
            s.set_weights(new, version=1)
        return out

    monkeypatch.setattr(sampler_module, "_JITTED_SEGMENT", segment)
    got = s._run_batch(prompts, params)
    assert s.num_in_flight_switches == 1 and s.num_prefilled_tokens == 7 + 22
    for prompt, p, g in zip(prompts, params, got, strict=True):
        assert [(v.version, v.start, v.end) for v in g.weight_versions] == [(0, 0, 8), (1, 8, 16)]
        assert g.routed_experts.shape[0] == len(prompt) + len(g.ids) - 1
        before = dataclasses.replace(g, ids=g.ids[:8], logprobs=g.logprobs[:8], weight_versions=())
        check_against_full_forward(old, prompt, p, before, routing=False)  # routing: the last version's
        after = dataclasses.replace(g, ids=g.ids[8:], logprobs=g.logprobs[8:], weight_versions=())
        check_against_full_forward(new, prompt + list(g.ids[:8]), p, after)
