"""A REAL vLLM (CPU) server against rljax: logprob parity, token-in/token-out, weight sync, failover.

One server (tiny random Qwen3, tied embeddings, float32) is shared by the whole session (conftest).
Parity bound: ``max |vLLM - rljax| <= 1e-4`` on the same float32 weights (design §5).
"""

import asyncio
import dataclasses
import sys
import time

import httpx
import numpy as np
import pytest
from inference_helpers import session_server
from test_inference_launcher import fake_config

from rljax import models
from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import (
    SyncConfig,
    VLLMClient,
    VLLMServer,
    WeightSyncError,
    free_port,
    probe_sequence,
)

pytestmark = pytest.mark.integration

ATOL = 1e-4
VOCAB = 512
FAST = dict(backoff_s=0.05, backoff_max_s=0.2, cooldown_s=60.0)


def run(coro):
    return asyncio.run(coro)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


async def serve(server, client: VLLMClient, model) -> None:
    """Makes the shared server serve ``model`` (verified sync) unless it already does."""
    if server.served is not model:
        await client.update_weights(model)
        server.served = model


def hybrid(body: models.Decoder, head_from: models.Decoder) -> models.Decoder:
    """``body``'s weights with an UNTIED output head equal to ``head_from``'s embedding."""
    tensors = models.to_hf_state_dict(body)
    tensors["lm_head.weight"] = models.to_hf_state_dict(head_from)["model.embed_tokens.weight"]
    config = dataclasses.replace(body.config, tie_word_embeddings=False)
    return models.from_hf_state_dict(config, tensors)


def test_prompt_logprobs_match_rljax(vllm_server, tiny_models):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in (2, 9, 64, 300, 511)]

    async def main():
        async with VLLMClient([vllm_server.url]) as client:
            await serve(vllm_server, client, tiny_models.a)
            return await asyncio.gather(*(client.score(s) for s in seqs))

    for seq, got in zip(seqs, run(main()), strict=True):
        assert got.shape == (len(seq),) and got[0] == 0.0
        assert max_diff(got, tiny_models.logprobs(tiny_models.a, seq)) <= ATOL
        # The comparison has teeth: another model's logprobs are far away.
        if len(seq) > 8:
            assert max_diff(got, tiny_models.logprobs(tiny_models.b, seq)) > 1.0


def test_tied_sync_naive_is_caught_and_explicit_head_sync_matches(vllm_server, tiny_models):
    a, b, c = tiny_models.a, tiny_models.b, tiny_models.c
    probe = probe_sequence(vocab_size=VOCAB, length=48, seed=7).tolist()

    async def main():
        async with VLLMClient([vllm_server.url]) as client:
            await serve(vllm_server, client, a)
        # 1. The naive in-place reload (checkpoint without lm_head.weight) is caught by verification...
        async with VLLMClient([vllm_server.url], sync=SyncConfig(explicit_lm_head=False)) as naive:
            with pytest.raises(WeightSyncError, match="differ from the trainer's") as info:
                await naive.update_weights(b)
            vllm_server.served = None
            naive_scores = await naive.score(probe, gated=False)
            with pytest.raises(WeightSyncError, match="last weight sync failed"):
                await naive.generate([1, 2, 3], SamplingParams(max_tokens=2))
        # 2. ...and the explicit-head sync fixes it, for one model after another.
        async with VLLMClient([vllm_server.url]) as client:
            v1 = await client.update_weights(b)
            report_b = client.last_sync
            scores_b = await client.score(probe)
            v2 = await client.update_weights(c)
            report_c = client.last_sync
            scores_c = await client.score(probe)
            vllm_server.served = c
        return info.value, naive_scores, (v1, report_b, scores_b), (v2, report_c, scores_c)

    error, naive_scores, (v1, report_b, scores_b), (v2, report_c, scores_c) = run(main())
    # What the naive sync served: b's body with a's (stale) output head, not b.
    assert max_diff(naive_scores, tiny_models.logprobs(b, probe)) > 1.0
    assert max_diff(naive_scores, tiny_models.logprobs(hybrid(b, a), probe)) <= ATOL
    assert "explicit_lm_head=True" in str(error)
    assert (v1, v2) == (1, 2)
    for report, scores, model in ((report_b, scores_b, b), (report_c, scores_c, c)):
        assert len(report.max_abs_diff) == 1 and report.max_abs_diff[0] <= ATOL
        assert max_diff(scores, tiny_models.logprobs(model, probe)) <= ATOL
        assert report.reload_s < 30
    print(
        f"\nsync timings: write {report_b.write_s:.3f}s reload {report_b.reload_s:.3f}s "
        f"verify {report_b.verify_s:.3f}s; max abs diff {report_b.max_abs_diff[0]:.2e}"
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_in_token_out_generation_matches_rljax_scoring(vllm_server, tiny_models, temperature):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 5, 12, 40)]
    sampling = [
        SamplingParams(temperature=temperature, max_tokens=24, seed=100 + i) for i in range(len(prompts))
    ]

    async def main():
        async with VLLMClient([vllm_server.url]) as client:
            await serve(vllm_server, client, tiny_models.a)
            outs = await asyncio.gather(
                *(
                    client.generate(p, s, session_id=f"t{i}")
                    for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
                )
            )
            again = await client.generate(prompts[2], sampling[2])  # same seed -> same tokens
            return outs, again, client.weight_version

    outs, again, version = run(main())
    model = tiny_models.a
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason in ("length", "stop") and out.weight_version == version
        assert len(out.ids) == len(out.logprobs) >= 1 and all(0 <= t < VOCAB for t in out.ids)
        if out.finish_reason == "length":
            assert len(out.ids) == 24
        # Each returned logprob is the trainer's logprob of that exact token (temperature-scaled).
        ref = tiny_models.logprobs(model, prompt + list(out.ids), temperature=temperature)[len(prompt) :]
        assert max_diff(out.logprobs, ref) <= ATOL
    assert again.ids == outs[2].ids


def test_stop_token_ids_end_generation_and_are_returned(vllm_server, tiny_models):
    prompt = [5, 6, 7, 8]
    sampling = SamplingParams(temperature=1.0, max_tokens=24, seed=3)

    async def main():
        async with VLLMClient([vllm_server.url]) as client:
            await serve(vllm_server, client, tiny_models.a)
            free = await client.generate(prompt, sampling)
            stop = free.ids[5]
            j = free.ids.index(stop)
            stopped = await client.generate(prompt, dataclasses.replace(sampling, stop_token_ids=(stop,)))
            return free, stopped, j

    free, stopped, j = run(main())
    assert stopped.finish_reason == "stop"
    assert stopped.ids == free.ids[: j + 1] and stopped.logprobs == pytest.approx(
        free.logprobs[: j + 1], abs=ATOL
    )


async def stream_chunks(url: str, model: str, prompt: list[int], *, chunks: int) -> None:
    """Returns once a streamed generation of ``prompt`` has produced ``chunks`` chunks (then disconnects)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 400, "stream": True}
    seen = 0
    async with httpx.AsyncClient(timeout=120.0) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen >= chunks:
                    return


def test_abort_is_surfaced_with_exact_partial_tokens(vllm_server, tiny_models):
    # 8 long generations at once on a server slowed to 10 ms a step (500 tokens: ~5 s); then one
    # more, streamed request, sent after them; once it has streamed 3 tokens the 8 (sent earlier)
    # are decoding, and the server-side abort lands mid-decode however loaded the machine is.
    prompts = [[9, 8, 7, i] for i in range(8)]

    async def main():
        async with VLLMClient([vllm_server.url], stream=False) as client:
            await serve(vllm_server, client, tiny_models.a)
            await client.set_step_delay(0.01)
            try:
                tasks = [
                    asyncio.create_task(client.generate(p, SamplingParams(max_tokens=500, seed=i)))
                    for i, p in enumerate(prompts)
                ]
                await asyncio.sleep(0.05)  # let the 8 requests leave first
                await stream_chunks(vllm_server.url, client.model, [9, 8, 7, 100], chunks=3)
                await client.post_all("/pause?mode=abort")
                await client.post_all("/resume")
                return await asyncio.gather(*tasks)
            finally:
                await client.set_step_delay(0)

    outs = run(main())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "abort" and len(out.ids) < 500, (out.finish_reason, len(out.ids))
        # the tokens returned before the abort are exact: their logprobs are the trainer's
        if out.ids:
            ref = tiny_models.logprobs(tiny_models.a, prompt + list(out.ids))[len(prompt) :]
            assert max_diff(out.logprobs, ref) <= ATOL
    assert any(out.ids for out in outs)  # partial outputs came back, not only empty ones


def test_step_delay_slows_each_decode_step(vllm_server, tiny_models):
    """``set_step_delay``: every model step that runs tokens waits first, so a generation of n
    tokens takes at least n x the delay (a lower bound, whatever the machine's speed)."""
    delay = 0.1

    async def main():
        async with VLLMClient([vllm_server.url], stream=False) as client:
            await serve(vllm_server, client, tiny_models.a)
            await client.set_step_delay(delay)
            try:
                start = time.perf_counter()
                out = await client.generate([4, 5, 6], SamplingParams(max_tokens=16, seed=0))
                return out, time.perf_counter() - start
            finally:
                await client.set_step_delay(0)

    out, seconds = run(main())
    assert len(out.ids) >= 2 and seconds >= len(out.ids) * delay, (len(out.ids), seconds)


def test_failover_when_a_server_dies_mid_batch(vllm_server, tiny_models, fake_shim, tmp_path):
    # Server 0: a (fake) server that answers slowly and is killed while it holds half the batch.
    doomed = VLLMServer(fake_config(fake_shim, tmp_path, DELAY=5.0), python=sys.executable).start()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, 6).tolist() for _ in range(8)]

    async def main():
        async with VLLMClient([vllm_server.url]) as client:
            await serve(vllm_server, client, tiny_models.a)
        async with VLLMClient([doomed.url, vllm_server.url], **FAST) as client:
            tasks = [
                asyncio.create_task(
                    client.generate(p, SamplingParams(max_tokens=8, seed=i), session_id=f"s{i}")
                )
                for i, p in enumerate(prompts)
            ]
            await asyncio.sleep(0.5)
            assert client.servers[0].outstanding == 4  # least-outstanding put half the batch there
            doomed.kill()
            outs = await asyncio.gather(*tasks)
            return outs, client

    try:
        outs, client = run(main())
    finally:
        doomed.stop()
    assert client.servers[0].failures >= 1
    # Every completion came from the real server (the fake's tokens would not match the model).
    for prompt, out in zip(prompts, outs, strict=True):
        ref = tiny_models.logprobs(tiny_models.a, prompt + list(out.ids))[len(prompt) :]
        assert len(out.ids) == 8 and max_diff(out.logprobs, ref) <= ATOL
    assert all(session_server(client, f"s{i}") == vllm_server.url for i in range(8))


def test_dead_port_next_to_a_real_server(vllm_server, tiny_models):
    dead = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with VLLMClient([vllm_server.url]) as client:
            await serve(vllm_server, client, tiny_models.a)
        async with VLLMClient([dead, vllm_server.url], **FAST) as client:
            outs = await asyncio.gather(
                *(client.generate([i + 1], SamplingParams(max_tokens=4)) for i in range(4))
            )
            return outs, client

    outs, client = run(main())
    assert all(len(o.ids) == 4 for o in outs) and client.servers[0].failures >= 1
    assert client.servers[1].requests >= 4
