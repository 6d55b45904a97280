"""Frozen models (rljax.inference.frozen): config parsing, a mocked endpoint, and a REAL vLLM server.

The real-server tests use the session's shared vLLM server (conftest ``vllm_server``) as the frozen
endpoint, first making it serve ``tiny_models.a`` through a separate, verified ``VLLMClient`` sync
(other tests change its weights). References are rljax's own ``sequence_logprobs`` of the same
weights (``tiny_models.logprobs``); bound 1e-4 (design §5).
"""

import asyncio
import json

import httpx
import ml_collections
import numpy as np
import pytest

from rljax.inference import Engine, FrozenModel, FrozenModelConfig, frozen_models_from_config
from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import RequestRejectedError, ServerUnavailableError, VLLMClient

ATOL = 1e-4
VOCAB = 512
URL = "http://127.0.0.1:8001"


def run(coro):
    return asyncio.run(coro)


def max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


# --------------------------------------------------------------------------------------------------
# config parsing (no server)


def test_config_normalizes_urls_and_keeps_fields():
    cfgs = frozen_models_from_config(
        {
            "teacher": {"base_url": "http://127.0.0.1:8001/v1/", "model": "qwen", "max_concurrency": 4},
            "sampler": {"base_url": ["https://h1:9000/", "http://h2:9000/api/v1", "http://h3:9000"]},
        }
    )
    assert sorted(cfgs) == ["sampler", "teacher"]
    t = cfgs["teacher"]
    assert (t.name, t.base_url, t.model, t.max_concurrency) == (
        "teacher",
        ("http://127.0.0.1:8001",),
        "qwen",
        4,
    )
    assert cfgs["sampler"].base_url == ("https://h1:9000", "http://h2:9000/api", "http://h3:9000")
    assert cfgs["sampler"].model is None and cfgs["sampler"].timeout_s == 300.0
    assert frozen_models_from_config(None) == {} and frozen_models_from_config({}) == {}
    # ml_collections config (what rljax.cli.train passes) and the list form.
    cd = ml_collections.ConfigDict({"teacher": {"base_url": URL, "model": None}})
    assert frozen_models_from_config(cd)["teacher"].base_url == (URL,)
    listed = frozen_models_from_config([{"name": "t", "base_url": URL}, FrozenModelConfig("u", URL + "/v1")])
    assert listed["t"].base_url == listed["u"].base_url == (URL,)
    assert hash(t) == hash(FrozenModelConfig("teacher", URL + "/v1", model="qwen", max_concurrency=4))


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"teacher": {"model": "m"}}, "needs a base_url"),
        ({"teacher": {"base_url": None}}, "needs a base_url"),
        ({"teacher": {"base_url": URL, "temprature": 1.0}}, r"unknown key\(s\) \['temprature'\]"),
        ({"teacher": {"base_url": "127.0.0.1:8001"}}, "absolute http"),
        ({"teacher": {"base_url": "ftp://host:21"}}, "absolute http"),
        ({"teacher": {"base_url": "http://"}}, "absolute http"),
        ({"teacher": {"base_url": "http://host:notaport"}}, "not a valid URL"),
        ({"teacher": {"base_url": "http://host:1/v1?x=1"}}, "query or fragment"),
        ({"teacher": {"base_url": 8001}}, "base_url: expected a URL or a non-empty list"),
        ({"teacher": {"base_url": [8001]}}, "must be a str"),
        ({"teacher": {"base_url": []}}, "base_url: expected a URL or a non-empty list"),
        ({"teacher": {"base_url": [URL, URL + "/v1"]}}, "same server twice"),
        ([{"name": "t", "base_url": URL}, {"name": "t", "base_url": "http://h:2"}], "'t' twice"),
        ({"policy": {"base_url": URL}}, "reserved"),
        ({"my teacher": {"base_url": URL}}, "without whitespace"),
        ({"http://h:1": {"base_url": URL}}, "looks like a URL"),
        ({"t": {"name": "u", "base_url": URL}}, "its 'name' is 'u'"),
        ({"t": {"base_url": URL, "model": ""}}, "frozen model 't': model: expected None"),
        (
            {"t": {"base_url": URL, "max_concurrency": 0}},
            "frozen model 't': max_concurrency: expected an int >= 1",
        ),
        ({"t": {"base_url": URL, "max_concurrency": 2.5}}, "max_concurrency: expected an int"),
        ({"t": {"base_url": URL, "timeout_s": 0}}, "timeout_s: expected a number > 0"),
        ({"t": {"base_url": URL, "backoff_s": -1}}, "backoff_s: expected a number >= 0"),
        ({"t": URL}, "must be a mapping"),
        ("http://h:1", "must be a mapping"),
        ([{"base_url": URL}], "with a 'name'"),
    ],
)
def test_config_errors_say_what_is_wrong(cfg, match):
    with pytest.raises(ValueError, match=match):
        frozen_models_from_config(cfg)


def test_from_config_accepts_a_mapping_and_rejects_garbage():
    m = FrozenModel.from_config({"name": "t", "base_url": [URL + "/v1", "http://127.0.0.1:8002/"]})
    assert m.name == "t" and m.urls == [URL, "http://127.0.0.1:8002"] and m.model is None
    assert isinstance(m, Engine) and m.weight_version == m.version == 0
    with pytest.raises(ValueError, match="mapping with 'name'"):
        FrozenModel.from_config({"base_url": URL})
    with pytest.raises(ValueError, match="needs a base_url"):
        FrozenModel.from_config({"name": "t"})


# --------------------------------------------------------------------------------------------------
# a mocked endpoint (httpx.MockTransport): discovery, edge cases, ordering, errors


def mock_logprob(prefix: list[int], token: int) -> float:
    """The mock server's log p(token | prefix): any deterministic function that depends on both."""
    return -0.01 * (1 + (7 * token + 3 * len(prefix) + sum(prefix)) % 97)


class MockServer:
    """A fake OpenAI server: /v1/models lists ``models`` (None: route missing), scores with mock_logprob."""

    def __init__(self, models=("served-name",), *, delays=None, fail_on=None):
        self.models = models
        self.delays = delays or {}
        self.fail_on = fail_on
        self.log: list[tuple[str, str, dict | None]] = []
        self.active = self.peak = self.cancelled = 0
        self.answered: list[list[int]] = []  # prompts in the order their answers were sent

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.log.append((request.method, request.url.path, body))
        if request.url.path == "/v1/models":
            if self.models is None:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"object": "list", "data": [{"id": m} for m in self.models]})
        ids = body["prompt"]
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delays.get(len(ids), 0.0))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
        self.answered.append(ids)
        if self.fail_on is not None and len(ids) == self.fail_on:
            return httpx.Response(400, json={"error": "too long"})
        entries = [None] + [
            {str(ids[t]): {"logprob": mock_logprob(ids[:t], ids[t])}} for t in range(1, len(ids))
        ]
        choice = {"prompt_token_ids": ids, "prompt_logprobs": entries, "token_ids": [0],
                  "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "length"}  # fmt: skip
        return httpx.Response(200, json={"choices": [choice]})


def reference(ids: list[int]) -> np.ndarray:
    return np.array([0.0] + [mock_logprob(ids[:t], ids[t]) for t in range(1, len(ids))])


def mocked(server: MockServer, **fields) -> FrozenModel:
    fields = {"name": "t", "base_url": URL, "backoff_s": 0.0, **fields}
    return FrozenModel.from_config(fields, transport=httpx.MockTransport(server))


def test_model_name_discovered_once_and_sent_with_every_request():
    server = MockServer(models=("first", "second"))

    async def main():
        async with mocked(server) as m:
            assert m.model is None
            await asyncio.gather(m.score([1, 2, 3]), m.score([4, 5]), m.response_logprobs([1], [2]))
            return m.model

    assert run(main()) == "first"
    paths = [p for _, p, _ in server.log]
    assert paths.count("/v1/models") == 1 and paths.count("/v1/completions") == 3
    assert {b["model"] for _, p, b in server.log if p == "/v1/completions"} == {"first"}


def test_explicit_model_is_never_discovered_and_missing_route_uses_client_default():
    explicit, no_route = MockServer(), MockServer(models=None)

    async def main():
        async with mocked(explicit, model="mine") as a, mocked(no_route) as b:
            await a.score([1, 2])
            await b.score([1, 2])
            return a.model, b.model

    assert run(main()) == ("mine", VLLMClient([URL]).model)
    assert [p for _, p, _ in explicit.log] == ["/v1/completions"]


def test_servers_serving_different_models_are_rejected():
    servers = {"h1:1": MockServer(models=("a",)), "h2:1": MockServer(models=("b",))}

    async def route(request):
        return await servers[f"{request.url.host}:{request.url.port}"](request)

    m = FrozenModel.from_config(
        {"name": "t", "base_url": ["http://h1:1", "http://h2:1"]}, transport=httpx.MockTransport(route)
    )
    with pytest.raises(ValueError, match="serve different models"):
        run(m.score([1, 2]))


def test_unreachable_discovery_raises_after_retries():
    calls = []

    def refuse(request):
        calls.append(request.url.path)
        raise httpx.ConnectError("refused", request=request)

    m = FrozenModel.from_config({"name": "t", "base_url": URL, "max_retries": 2, "backoff_s": 0.0},
                                transport=httpx.MockTransport(refuse))  # fmt: skip
    with pytest.raises(ServerUnavailableError, match="GET /v1/models failed"):
        run(m.score([1, 2]))
    assert calls == ["/v1/models"] * 3


def test_short_sequences_and_one_token_prompts():
    server = MockServer()

    async def main():
        async with mocked(server, model="m") as m:
            one = await m.score([9])
            empty_response = await m.response_logprobs([3], [])
            resp = await m.response_logprobs([3], [4])  # 1-token prompt + 1-token response: 2 ids scored
            resp_np = await m.response_logprobs(np.array([3, 5]), np.array([4, 6, 8], np.int32))
            with pytest.raises(ValueError, match="non-empty prompt"):
                await m.response_logprobs([], [1])
            with pytest.raises(ValueError, match="empty"):
                await m.score([])
            with pytest.raises(ValueError, match="integer token ids"):
                await m.score([1.5, 2.0])
            with pytest.raises(ValueError, match="1-D"):
                await m.score([[1, 2]])
            return one, empty_response, resp, resp_np

    one, empty_response, resp, resp_np = run(main())
    assert one.tolist() == [0.0] and empty_response.shape == (0,)
    np.testing.assert_allclose(resp, [mock_logprob([3], 4)], atol=1e-12)
    np.testing.assert_allclose(resp_np, reference([3, 5, 4, 6, 8])[2:], atol=1e-12)
    assert [b["prompt"] for _, _, b in server.log] == [[3, 4], [3, 5, 4, 6, 8]]


def test_score_many_keeps_input_order_under_bounded_concurrency(capsys):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in rng.integers(1, 40, 30)]
    # Longer sequences answer faster, so completion order is far from input order.
    server = MockServer(delays={n: 0.02 * (40 - n) / 40 for n in range(41)})

    async def main():
        async with mocked(server, model="m", max_concurrency=3) as m:
            return await m.score_many(seqs, progress=True), await m.score_many([])

    outs, none = run(main())
    assert none == [] and len(outs) == len(seqs)
    for seq, out in zip(seqs, outs, strict=True):
        assert max_diff(out, reference(seq)) <= 1e-12
    assert server.peak == 3  # bounded by max_concurrency, and actually concurrent
    # 1-token sequences need no request; the others were answered out of input order.
    sent = [s for s in seqs if len(s) > 1]
    assert sorted(server.answered) == sorted(sent) and server.answered != sent
    assert "score t: 30/30 seq" in capsys.readouterr().err


def test_score_many_failure_cancels_the_rest_and_raises_the_error():
    server = MockServer(delays={30: 5.0}, fail_on=7)
    seqs = [list(range(n)) for n in (30, 30, 7, 30)]

    async def main():
        async with mocked(server, model="m") as m:
            with pytest.raises(RequestRejectedError, match="HTTP 400"):
                await asyncio.wait_for(m.score_many(seqs), timeout=3.0)

    run(main())
    assert server.cancelled == 3  # the slow requests were cancelled, not left running


def test_update_weights_raises_type_error():
    async def main():
        async with mocked(MockServer(), model="m") as m:
            with pytest.raises(TypeError, match="never updated"):
                await m.update_weights(object(), version=3)
            with pytest.raises(TypeError, match="never updated"):
                await m.client.update_weights(object())
            return m.weight_version

    assert run(main()) == 0


# --------------------------------------------------------------------------------------------------
# a REAL vLLM server as the frozen endpoint

integration = pytest.mark.integration


async def serve(server, model) -> None:
    """Makes the shared server serve ``model`` (verified sync, separate client) unless it already does."""
    if server.served is not model:
        async with VLLMClient([server.url]) as client:
            await client.update_weights(model)
        server.served = model


@integration
def test_real_score_score_many_and_response_logprobs_match_rljax(vllm_server, tiny_models):
    a = tiny_models.a
    rng = np.random.default_rng(3)
    lengths = (2, 17, 100, 300)
    seqs = [rng.integers(0, VOCAB, lengths[i % 4]).tolist() for i in range(16)]
    refs = [tiny_models.logprobs(a, s) for s in seqs]

    async def main():
        await serve(vllm_server, a)
        async with FrozenModel.from_config(
            {"name": "teacher", "base_url": vllm_server.url, "max_concurrency": 4}
        ) as m:
            single = await m.score(seqs[2])
            many = await m.score_many(seqs)
            reversed_many = await m.score_many(seqs[::-1])
            responses = [
                await m.response_logprobs(s[:k], s[k:]) for s, k in ((seqs[1], 1), (seqs[1], 9), (seqs[0], 1))
            ]
            return single, many, reversed_many, responses

    single, many, reversed_many, responses = run(main())
    assert single.dtype == np.float64 and single[0] == 0.0
    assert max_diff(single, refs[2]) <= ATOL
    for out, ref in zip(many, refs, strict=True):
        assert max_diff(out, ref) <= ATOL
    for out, ref in zip(reversed_many, refs[::-1], strict=True):
        assert max_diff(out, ref) <= ATOL
    for out, (i, k) in zip(responses, ((1, 1), (1, 9), (0, 1)), strict=True):
        assert out.shape == (len(seqs[i]) - k,) and max_diff(out, refs[i][k:]) <= ATOL
    # The comparison has teeth: another model's logprobs are far away.
    assert max_diff(many[3], tiny_models.logprobs(tiny_models.b, seqs[3])) > 1.0


@integration
def test_real_generate_is_exact_and_never_stale(vllm_server, tiny_models):
    a = tiny_models.a
    prompts = [[5, 6, 7, 8, 9], [11]]

    async def main():
        await serve(vllm_server, a)
        async with FrozenModel.from_config({"name": "sampler", "base_url": vllm_server.url + "/v1"}) as m:
            sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
            outs = [await m.generate(p, sampling, session_id="s") for p in prompts]
            again = await m.generate(prompts[0], sampling)
            with pytest.raises(TypeError, match="never updated"):
                await m.update_weights(tiny_models.b)
            return outs, again, m.weight_version

    outs, again, version = run(main())
    assert version == 0 and vllm_server.served is a
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.weight_version == 0 and out.finish_reason in ("length", "stop")
        assert 1 <= len(out.ids) <= 12 and all(0 <= t < VOCAB for t in out.ids)
        ref = tiny_models.logprobs(a, prompt + list(out.ids))[len(prompt) :]
        assert max_diff(out.logprobs, ref) <= ATOL
    assert again.ids == outs[0].ids


@integration
def test_real_base_url_forms_and_model_discovery(vllm_server, tiny_models):
    a = tiny_models.a
    seq = np.random.default_rng(4).integers(0, VOCAB, 17).tolist()
    forms = [vllm_server.url, vllm_server.url + "/v1", vllm_server.url + "/v1/", [vllm_server.url + "/"]]

    async def main():
        await serve(vllm_server, a)
        async with httpx.AsyncClient() as http:
            listed = (await http.get(vllm_server.url + "/v1/models")).json()["data"][0]["id"]
        found = []
        for form in forms:
            async with FrozenModel.from_config({"name": "t", "base_url": form}) as m:
                found.append((m.model, await m.score(seq), m.model, m.urls))
        async with FrozenModel.from_config(
            {"name": "t", "base_url": vllm_server.url, "model": "no-such-model"}
        ) as m:
            with pytest.raises(RequestRejectedError, match="HTTP 404"):
                await m.score(seq)
        return listed, found

    listed, found = run(main())
    assert listed == vllm_server.config.served_model_name
    ref = tiny_models.logprobs(a, seq)
    for before, scores, after, urls in found:
        assert before is None and after == listed and urls == [vllm_server.url]
        assert max_diff(scores, ref) <= ATOL
