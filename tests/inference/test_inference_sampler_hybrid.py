"""The embedded sampler on hybrid Qwen3.5-MoE models: it decodes with a per-row recurrent state and
convolution window for the Gated DeltaNet layers and the KV cache for the attention layers.

References are the model's own full forward (``rljax.models.sequence_logprobs``, no cache) on each
prompt + completion: sampled logprobs equal it for prompts of different lengths (left-padded in one
batch), with decode segments that grow the cache, and for GRPO-like groups of identical prompts,
each prefilled once and copied to its rows (recurrent state and convolution window included); the
recorded MoE routing replays to the same logprobs; and an in-flight weight switch (which recomputes
the running rows' states from their right-padded tokens so far) gives every later token the new
weights' logprob.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from inference_helpers import generate_batch
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.inference import sampler as sampler_module
from rljax.inference.engine import SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.models.tiny import random_decoder, tiny_config

VOCAB = 96
BUCKETS = dict(min_prompt_bucket=16, min_new_tokens_bucket=16, min_batch_bucket=4)
PROMPTS = [[4, 5, 6, 7, 1, 2, 3], [9, 3, 1], [2, 8, 8, 8, 5, 11, 12, 13, 14, 15, 16]]


def _model(seed: int) -> models.Decoder:
    return random_decoder(tiny_config("qwen3_5_moe_text", vocab_size=VOCAB), seed=seed)


def _reference(model, prompt, ids, temperature, routed=None):
    """Logprobs of ``ids`` after ``prompt`` from one full forward (row right-padded to 48 tokens:
    one compiled program for every reference)."""
    seq = list(prompt) + list(ids)
    tokens = np.zeros((1, 48), np.int32)
    tokens[0, : len(seq)] = seq
    segments = (np.arange(48) < len(seq)).astype(np.int32)[None]
    replay = None
    if routed is not None:  # router replay: the recorded experts of every fed token, -1 after
        replay = -np.ones((1, 48, *routed.shape[1:]), np.int32)
        replay[0, : len(routed)] = routed
        replay = jnp.asarray(replay)
    lp = models.sequence_logprobs(model, jnp.asarray(tokens), segment_ids=jnp.asarray(segments),
                                  temperature=temperature, routed_experts=replay)  # fmt: skip
    return np.asarray(lp)[0, len(prompt) : len(seq)]


def test_sampled_logprobs_equal_the_full_forward_and_routing_replays():
    """Three prompts, two of them repeated (GRPO groups): each distinct prompt is prefilled once and
    its rows start from copies of its state. Prompts that share only a prefix are not shared on these
    models: a row's own tokens after a shared prefix are left-padded, and the causal convolution
    does not reach across padding inside a sample (its window would be cut)."""
    model = _model(0)
    sampler = EmbeddedSampler(model, batch_wait_ms=0.0, decode_segments=2, min_shared_prefix=2, **BUCKETS)
    prompts = [PROMPTS[i] for i in (0, 1, 2, 0, 0, 2)]
    temperatures = (1.0, 0.7, 1.3, 1.0, 0.9, 1.1)
    params = [SamplingParams(temperature=t, max_tokens=24, seed=i) for i, t in enumerate(temperatures)]
    outs = generate_batch(sampler, prompts, params)
    assert sampler.num_prefilled_tokens == sum(map(len, PROMPTS)) < sampler.num_prompt_tokens
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert len(out.ids) == 24
        want = _reference(model, prompt, out.ids, p.temperature)
        np.testing.assert_allclose(out.logprobs, want, **LOGPROB_TOL)
        routed = np.asarray(out.routed_experts)  # [P + M - 1, layers, k]
        assert routed.shape == (len(prompt) + 23, 2, 2)
        np.testing.assert_allclose(
            _reference(model, prompt, out.ids, p.temperature, routed), want, **LOGPROB_TOL
        )
    assert len({o.ids for o in outs}) == 6
    a = PROMPTS[2]  # shares its first 5 tokens with a[:5] + [1, 2]: identical prompts only
    assert sampler._prompt_arrays([a, a[:5] + [1, 2], a], 4)[2].rows.tolist() == [0, 1, 0, 0]


def test_in_flight_switch_recomputes_the_recurrent_states(monkeypatch):
    old, new = _model(0), _model(1)
    sampler = EmbeddedSampler(old, in_flight_updates=True, in_flight_segment_steps=4, batch_wait_ms=0.0,
                              **BUCKETS)  # fmt: skip
    real = sampler_module._JITTED_SEGMENT
    calls = []

    def segment(*args):  # the update lands after the 2nd decode segment (step 8), deterministically
        out = real(*args)
        calls.append(1)
        if len(calls) == 2:
            sampler.set_weights(new, version=1)
        return out

    monkeypatch.setattr(sampler_module, "_JITTED_SEGMENT", segment)
    # row 1 stops early (max 5 tokens) and sits right-padded in the recomputed prefill
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=3 + i) for i, n in enumerate((20, 5, 20))]
    outs = generate_batch(sampler, PROMPTS, params)
    assert sampler.num_in_flight_switches == 1
    for prompt, out in zip(PROMPTS, outs, strict=True):
        lp = np.asarray(out.logprobs)
        old_lp = _reference(old, prompt, out.ids, 1.0)
        np.testing.assert_allclose(lp[:8], old_lp[:8], **LOGPROB_TOL)
        if len(out.ids) > 8:
            np.testing.assert_allclose(lp[8:], _reference(new, prompt, out.ids, 1.0)[8:], **LOGPROB_TOL)
            assert np.abs(lp[8:] - old_lp[8:]).max() > 1e-2  # the versions differ: the check can fail
