"""In-flight weight updates of the embedded sampler: a batch switches to new weights between decode
segments without dropping its running sequences.

References are the model's own full forward pass (``rljax.models.sequence_logprobs`` and full
logits, never the KV-cache path) under each version's weights, and a plain (not in-flight) run of
the old weights: every token before the switch is the old weights' token with their logprob, every
token after it is drawn from the new weights' distribution given the whole sequence so far.
"""

import asyncio
import threading

import numpy as np
import pytest
from flax import nnx
from test_inference_sampler import BUCKETS, full_logits, full_logprobs, tiny_model
from tolerances import LOGPROB_TOL

from rljax.inference import sampler as sampler_module
from rljax.inference.engine import Engine, SamplingParams
from rljax.inference.sampler import EmbeddedSampler

pytestmark = pytest.mark.slow

PROMPTS = [[4, 5, 6, 7], [9, 3, 1], [2, 8, 8, 8, 5]]
SAMPLING = [
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(temperature=1.0, max_tokens=24, seed=11),
    SamplingParams(temperature=0.7, max_tokens=20, seed=5),
]
SEGMENT = 4


@pytest.fixture(scope="module")
def models():
    return tiny_model(0), tiny_model(1)


def _sampler(model, **kwargs):
    return EmbeddedSampler(
        model, in_flight_updates=True, in_flight_segment_steps=SEGMENT, batch_wait_ms=0.0, **BUCKETS, **kwargs
    )


def _switch_after_segments(monkeypatch, sampler, new_model, segments, version):
    """Makes the batch thread call ``set_weights`` right after its ``segments``-th decode segment:
    the update arrives while the batch is decoding, deterministically."""
    real = sampler_module._JITTED_SEGMENT
    calls = []

    def segment(*args):
        out = real(*args)
        calls.append(1)
        if len(calls) == segments:
            sampler.set_weights(new_model, version=version)
        return out

    monkeypatch.setattr(sampler_module, "_JITTED_SEGMENT", segment)


def _check_spans(completion, prompt, old, new, switch_step, old_version, new_version):
    """Each span re-scored with its version's weights; greedy tokens are each version's argmax."""
    ids = list(completion.ids)
    n = len(ids)
    assert [(s.version, s.start, s.end) for s in completion.weight_versions] == [
        (old_version, 0, switch_step),
        (new_version, switch_step, n),
    ]
    assert completion.weight_version == old_version
    assert completion.token_versions() == [old_version] * switch_step + [new_version] * (n - switch_step)
    return ids


def test_update_mid_decode_switches_running_rows_exactly(models, monkeypatch):
    old, new = models
    s = _sampler(old, weight_version=3)
    assert isinstance(s, Engine) and s.supports_in_flight_updates
    plain = EmbeddedSampler(old, batch_wait_ms=0.0, weight_version=3, **BUCKETS)
    before = s._run_batch(PROMPTS, SAMPLING)
    reference = plain._run_batch(PROMPTS, SAMPLING)
    # no update: the segmented loop samples what the one-program loop samples
    for a, b in zip(before, reference, strict=True):
        assert a.ids == b.ids and a.weight_versions == b.weight_versions
        np.testing.assert_allclose(a.logprobs, b.logprobs, **LOGPROB_TOL)

    _switch_after_segments(monkeypatch, s, new, segments=2, version=7)
    switch = 2 * SEGMENT
    out = s._run_batch(PROMPTS, SAMPLING)
    assert s.weight_version == 7 and s.num_in_flight_switches == 1
    for prompt, params, got, ref in zip(PROMPTS, SAMPLING, out, reference, strict=True):
        ids = _check_spans(got, prompt, old, new, switch, 3, 7)
        assert ids[:switch] == list(ref.ids[:switch])  # the old weights' tokens, same draws
        seq = prompt + ids
        lp_old = full_logprobs(old, seq, params.temperature or 1.0)[len(prompt) :]
        lp_new = full_logprobs(new, seq, params.temperature or 1.0)[len(prompt) :]
        got_lp = np.asarray(got.logprobs)
        np.testing.assert_allclose(got_lp[:switch], lp_old[:switch], **LOGPROB_TOL)
        np.testing.assert_allclose(got_lp[switch:], lp_new[switch:], **LOGPROB_TOL)
        # the new weights really differ on these tokens (the check above could fail)
        assert np.max(np.abs(got_lp[switch:] - lp_old[switch:])) > 1e-2
        if params.temperature == 0.0:
            logits_old, logits_new = full_logits(old, seq), full_logits(new, seq)
            for t, token in enumerate(ids):
                logits = logits_old if t < switch else logits_new
                assert token == int(np.argmax(logits[len(prompt) - 1 + t])), t


def test_update_before_the_first_token_gives_one_span_of_the_new_version(models, monkeypatch):
    old, new = models
    s = _sampler(old)
    real_start = sampler_module._JITTED_START

    def start(*args):
        out = real_start(*args)
        s.set_weights(new, version=1)  # arrives after the prefill, before any token
        return out

    monkeypatch.setattr(sampler_module, "_JITTED_START", start)
    got = s._run_batch(PROMPTS[:1], SAMPLING[:1])[0]
    assert [(v.version, v.start, v.end) for v in got.weight_versions] == [(1, 0, len(got.ids))]
    logits = full_logits(new, PROMPTS[0] + list(got.ids))
    assert list(got.ids) == [int(np.argmax(logits[3 + t])) for t in range(len(got.ids))]


def test_update_weights_returns_once_the_running_batch_decodes_with_it(models, monkeypatch):
    """The Engine contract: ``update_weights`` called while ``generate`` is in flight returns after
    the running batch switched; the completion then carries both versions."""
    old, new = models
    s = _sampler(old)
    real = sampler_module._JITTED_SEGMENT
    started = threading.Event()

    def slow_segment(*args):
        out = real(*args)
        started.set()
        threading.Event().wait(0.05)  # keeps the batch running while the update arrives
        return out

    monkeypatch.setattr(sampler_module, "_JITTED_SEGMENT", slow_segment)
    params = SamplingParams(temperature=0.0, max_tokens=24)

    async def run():
        task = asyncio.ensure_future(s.generate(PROMPTS[0], params))
        await asyncio.to_thread(started.wait, 60.0)
        version = await s.update_weights(new, version=1)
        switches_when_returned = s.num_in_flight_switches
        return version, switches_when_returned, await task

    version, switches, got = asyncio.run(run())
    assert version == 1 and switches == 1
    spans = got.weight_versions
    assert [v.version for v in spans] == [0, 1] and spans[1].start % SEGMENT == 0
    seq = PROMPTS[0] + list(got.ids)
    logits_old, logits_new = full_logits(old, seq), full_logits(new, seq)
    for t, token in enumerate(got.ids):
        logits = logits_old if t < spans[1].start else logits_new
        assert token == int(np.argmax(logits[3 + t])), t


def test_without_in_flight_updates_a_batch_finishes_on_its_weights(models, monkeypatch):
    old, new = models
    s = EmbeddedSampler(old, batch_wait_ms=0.0, **BUCKETS)
    assert not s.supports_in_flight_updates
    real = sampler_module._JITTED_GENERATE

    def generate(*args):
        s.set_weights(new)  # arrives while the one-program batch runs
        return real(*args)

    monkeypatch.setattr(sampler_module, "_JITTED_GENERATE", generate)
    got = s._run_batch(PROMPTS[:1], SAMPLING[:1])[0]
    assert got.weight_version == 0 and len(got.weight_versions) == 1
    logits = full_logits(old, PROMPTS[0] + list(got.ids))
    assert list(got.ids) == [int(np.argmax(logits[3 + t])) for t in range(len(got.ids))]
    assert s.weight_version == 1 and nnx.state(new) is not None


def test_moe_routing_after_an_update_is_the_new_weights_routing(monkeypatch):
    """MoE router replay: a switch recomputes the running rows' routing with the new weights, so a
    completion's recorded routing is its last version's throughout (the routing its last span was
    sampled with): equal to the new weights' full forward, and replaying it reproduces the last
    span's logprobs exactly."""
    import jax.numpy as jnp

    from rljax import models
    from rljax.models.tiny import tiny_model as tiny_decoder

    old, new = tiny_decoder("qwen3_moe", seed=0), tiny_decoder("qwen3_moe", seed=1)
    s = _sampler(old)
    _switch_after_segments(monkeypatch, s, new, segments=2, version=1)
    switch = 2 * SEGMENT
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=3 + i) for i in range(2)]
    out = s._run_batch(PROMPTS[:2], params)
    assert s.num_in_flight_switches == 1
    for prompt, got in zip(PROMPTS[:2], out, strict=True):
        ids = list(got.ids)
        assert len(ids) > switch
        assert [(v.version, v.start) for v in got.weight_versions] == [(0, 0), (1, switch)]
        seq = jnp.asarray([prompt + ids])
        n = seq.shape[1]
        routed_new = np.asarray(new.hidden_states(seq, with_routing=True).routing.experts)[0, : n - 1]
        routed_old = np.asarray(old.hidden_states(seq, with_routing=True).routing.experts)[0, : n - 1]
        assert np.any(routed_new != routed_old)  # the versions route differently: the check can fail
        np.testing.assert_array_equal(got.routed_experts, routed_new)
        replay = np.concatenate([got.routed_experts, -np.ones_like(got.routed_experts[:1])])[None]
        lp = models.sequence_logprobs(new, seq, routed_experts=jnp.asarray(replay))
        lp = np.asarray(lp)[0, len(prompt) :]
        np.testing.assert_allclose(lp[switch:], np.asarray(got.logprobs)[switch:], **LOGPROB_TOL)
