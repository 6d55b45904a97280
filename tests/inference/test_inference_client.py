"""VLLMClient against in-process fake vLLM servers: exact parsing, clear errors, routing, failover."""

import asyncio
import base64
import io
import math
import threading
import time

import httpx
import inference_fakes as fk
import numpy as np
import pytest
from inference_helpers import session_server

from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import (
    MalformedResponseError,
    RequestRejectedError,
    ServerUnavailableError,
    VLLMClient,
    completion_payload,
    parse_completion,
    parse_prompt_logprobs,
    score_payload,
)

PROMPT = [3, 14, 15, 92, 65]
FAST = dict(backoff_s=0.01, backoff_max_s=0.05, cooldown_s=30.0)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def fake():
    with fk.FakeVLLM() as server:
        yield server


@pytest.fixture
def two_fakes():
    with fk.FakeVLLM() as a, fk.FakeVLLM() as b:
        yield a, b


def dead_url() -> str:
    from rljax.inference.vllm import free_port

    return f"http://127.0.0.1:{free_port()}"


# ------------------------------------------------------------------------------------------------
# payloads and parsing (pure)


def test_completion_payload_fields():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, stop_token_ids=(2,), seed=11)
    body = completion_payload(np.array([1, 2]), p, model="m")
    assert body == {
        "model": "m", "prompt": [1, 2], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True, "stream": False,
        "stop_token_ids": [2], "seed": 11,
    }  # fmt: skip
    assert all(type(t) is int for t in body["prompt"])  # numpy ints would not serialize
    body = completion_payload([1], SamplingParams(), model="m")
    assert body["top_k"] == -1 and "seed" not in body and "stop_token_ids" not in body
    s = score_payload([4, 5, 6], model="m")
    assert s["prompt_logprobs"] == 0 and s["max_tokens"] == 1 and s["temperature"] == 1.0


def _choice(**kw):
    c = {"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.25, -1.5]}, "finish_reason": "length",
         "prompt_token_ids": [1, 2]}  # fmt: skip
    c.update(kw)
    return {"choices": [c]}


def test_parse_completion_valid():
    c = parse_completion(_choice(), prompt_ids=[1, 2], weight_version=4)
    assert (c.ids, c.logprobs, c.finish_reason, c.weight_version) == ((7, 8), (-0.25, -1.5), "length", 4)
    c = parse_completion(_choice(finish_reason="abort", token_ids=[], logprobs={"token_logprobs": []}),
                         prompt_ids=[1, 2], weight_version=0)  # fmt: skip
    assert c.finish_reason == "abort" and c.ids == ()


def _npy_b64(array) -> str:
    """vLLM's encoding of routed experts (its docs: base64 of the ``.npy`` bytes)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def test_parse_completion_routed_experts():
    """A recorded-shape answer of a 4-layer MoE server (layers 1 and 3 sparse, top-2, uint8):
    prompt [1, 2] + completion [7, 8] -> 3 routed rows; rljax keeps its MoE layers in order."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 8, size=(3, 4, 2)).astype(np.uint8)
    body = _choice(routed_experts=_npy_b64(raw))
    c = parse_completion(body, prompt_ids=[1, 2], weight_version=0, routed_layers=(1, 3))
    assert c.routed_experts.dtype == np.int32 and c.routed_experts.shape == (3, 2, 2)
    np.testing.assert_array_equal(c.routed_experts[:, 0], raw[:, 1])
    np.testing.assert_array_equal(c.routed_experts[:, 1], raw[:, 3])
    whole = parse_completion(body, prompt_ids=[1, 2], weight_version=0)
    np.testing.assert_array_equal(whole.routed_experts, raw)
    assert parse_completion(_choice(), prompt_ids=[1, 2], weight_version=0).routed_experts is None
    for bad, match in [
        (_npy_b64(raw[:2]), r"shape \(3, layers, top_k\)"),
        (_npy_b64(raw.astype(np.float32)), "int array"),
        ("not base64!", "not base64"),
    ]:
        with pytest.raises(MalformedResponseError, match=match):
            parse_completion(_choice(routed_experts=bad), prompt_ids=[1, 2], weight_version=0)
    with pytest.raises(MalformedResponseError, match="cannot select MoE layers"):
        parse_completion(body, prompt_ids=[1, 2], weight_version=0, routed_layers=(1, 4))


@pytest.mark.parametrize(
    "body, match",
    [
        ([], "not a JSON object"),
        ({"choices": []}, "exactly one choice"),
        (_choice(token_ids=None), "lacks 'token_ids'"),
        (_choice(logprobs=None), "lacks 'token_ids' or 'logprobs.token_logprobs'"),
        (_choice(token_ids=[7]), "1 token ids but 2 logprobs"),
        (_choice(token_ids=[7, -1]), "non-negative ints"),
        (_choice(token_ids=[7, 8.0]), "non-negative ints"),
        (_choice(logprobs={"token_logprobs": [-0.25, None]}), "finite numbers"),
        (_choice(logprobs={"token_logprobs": [-0.25, math.inf]}), "finite numbers"),
        (_choice(logprobs={"token_logprobs": [-0.25, 0.5]}), "<= 0"),
        (_choice(finish_reason=None), "unknown finish_reason"),
        (_choice(prompt_token_ids=[1, 3]), "differ from the 2 ids sent"),
        (
            _choice(logprobs={"token_logprobs": [-0.25, -1.5], "tokens": ["token_id:8", "token_id:7"]}),
            "not aligned",
        ),
    ],
)
def test_parse_completion_malformed(body, match):
    with pytest.raises(MalformedResponseError, match=match):
        parse_completion(body, prompt_ids=[1, 2], weight_version=0)


def test_parse_prompt_logprobs():
    ids = [5, 6, 7]
    body = {"choices": [{"prompt_logprobs": [None, {"6": {"logprob": -0.5}, "9": {"logprob": -0.1}},
                                             {"7": {"logprob": -2.0, "rank": 3}}]}]}  # fmt: skip
    np.testing.assert_array_equal(parse_prompt_logprobs(body, ids=ids), [0.0, -0.5, -2.0])
    body["choices"][0]["prompt_logprobs"][2] = {"8": {"logprob": -0.1}}
    with pytest.raises(
        MalformedResponseError, match=r"prompt_logprobs\[2\] has no finite logprob for token 7"
    ):
        parse_prompt_logprobs(body, ids=ids)
    body["choices"][0]["prompt_logprobs"] = [None]
    with pytest.raises(MalformedResponseError, match="one entry per prompt token"):
        parse_prompt_logprobs(body, ids=ids)


# ------------------------------------------------------------------------------------------------
# over HTTP


def test_generate_and_score_exact(fake):
    async def main():
        async with VLLMClient([fake.url], model="tiny") as client:
            c = await client.generate(np.array(PROMPT), SamplingParams(max_tokens=6, temperature=0.5))
            s = await client.score(PROMPT)
        return c, s

    c, s = run(main())
    ids, lps = fk.expected_generation(PROMPT, 6)
    assert list(c.ids) == ids and np.allclose(c.logprobs, lps, atol=0, rtol=1e-15)
    assert c.finish_reason == "length" and c.weight_version == 0
    np.testing.assert_allclose(s, fk.expected_scores(PROMPT), rtol=1e-15)
    sent = fake.calls[0][2]
    assert sent["prompt"] == PROMPT and sent["model"] == "tiny" and sent["temperature"] == 0.5


@pytest.mark.parametrize(
    "mode, error, match",
    [
        ("mismatch", MalformedResponseError, "5 token ids but 4 logprobs"),
        ("missing", MalformedResponseError, "lacks 'token_ids'"),
        ("badjson", MalformedResponseError, "not JSON"),
        ("nonfinite", MalformedResponseError, "finite"),
        ("wrong_prompt", MalformedResponseError, "echoed prompt_token_ids"),
        ("bad_finish", MalformedResponseError, "exploded"),
        ("two_choices", MalformedResponseError, "exactly one choice"),
        ("http400", RequestRejectedError, "HTTP 400.*prompt too long"),
    ],
)
def test_bad_answers_raise_at_once_and_are_not_retried(two_fakes, mode, error, match):
    bad, good = two_fakes
    bad.mode = mode

    async def main():
        async with VLLMClient([bad.url, good.url], max_retries=3, **FAST) as client:
            with pytest.raises(error, match=match):
                await client.generate(PROMPT, SamplingParams(max_tokens=5), session_id="s")
            return client

    client = run(main())
    # One request, to the first server, and nothing sent elsewhere: no retry turned it into "data".
    assert bad.count() == 1 and good.count() == 0
    assert client.servers[0].failures == 0


def test_score_missing_token_is_malformed(fake):
    fake.mode = "missing_prompt_token"

    async def main():
        async with VLLMClient([fake.url]) as client:
            await client.score(PROMPT)

    with pytest.raises(MalformedResponseError, match="no finite logprob for token 14"):
        run(main())


@pytest.mark.parametrize("mode", ["http500", "close"])
def test_transient_failures_fail_over(two_fakes, mode):
    bad, good = two_fakes
    bad.mode = mode

    async def main():
        async with VLLMClient([bad.url, good.url], **FAST) as client:
            c = await client.generate(PROMPT, SamplingParams(max_tokens=3), session_id="traj")
            return client, c

    client, c = run(main())
    assert list(c.ids) == fk.expected_generation(PROMPT, 3)[0]
    assert bad.count() == 1 and good.count() == 1
    assert client.servers[0].failures == 1 and session_server(client, "traj") == good.url


def test_dead_port_fails_over_and_all_dead_raises():
    async def main():
        with fk.FakeVLLM() as good:
            async with VLLMClient([dead_url(), good.url], **FAST) as client:
                outs = await asyncio.gather(*(client.generate([i, 1], SamplingParams(max_tokens=2))
                                              for i in range(6)))  # fmt: skip
            assert [list(o.ids) for o in outs] == [fk.expected_generation([i, 1], 2)[0] for i in range(6)]
            assert good.count() == 6
        urls = [dead_url(), dead_url()]
        async with VLLMClient(urls, max_retries=2, **FAST) as client:
            with pytest.raises(ServerUnavailableError, match="failed after 3 attempts") as info:
                await client.generate(PROMPT, SamplingParams(max_tokens=2))
        # The message lists every attempt, each on a server, alternating between them.
        msg = str(info.value)
        assert msg.count("ConnectError") == 3 and urls[0] in msg and urls[1] in msg

    run(main())


def test_timeout_fails_over(two_fakes):
    slow, good = two_fakes
    slow.delay_s = 2.0

    async def main():
        async with VLLMClient([slow.url, good.url], timeout_s=0.3, **FAST) as client:
            return await client.generate(PROMPT, SamplingParams(max_tokens=2))

    c = run(main())
    assert list(c.ids) == fk.expected_generation(PROMPT, 2)[0] and good.count() == 1


async def _until(condition, timeout_s: float = 20.0) -> None:
    """Polls ``condition()`` until it holds (bounded: a broken client fails instead of hanging)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_least_outstanding_load_balancing(two_fakes):
    a, b = two_fakes
    a.hold, b.hold = threading.Event(), threading.Event()  # nothing finishes until all 8 are out

    async def main():
        async with VLLMClient([a.url, b.url]) as client:
            one = SamplingParams(max_tokens=1)
            tasks = [asyncio.create_task(client.generate([i], one)) for i in range(8)]
            await _until(lambda: a.in_flight + b.in_flight == 8)
            a.hold.set()
            b.hold.set()
            await asyncio.gather(*tasks)

    run(main())
    assert (a.count(), b.count()) == (4, 4)
    assert a.max_in_flight == 4 and b.max_in_flight == 4


def test_least_outstanding_prefers_the_idle_server(two_fakes):
    a, b = two_fakes
    a.hold = threading.Event()  # a long request keeps server a busy until released

    async def main():
        async with VLLMClient([a.url, b.url]) as client:
            long = asyncio.create_task(client.generate([1], SamplingParams(max_tokens=1)))
            await _until(lambda: a.in_flight == 1)
            for i in range(5):  # sequential short requests: b always has fewer outstanding
                await client.generate([i], SamplingParams(max_tokens=1))
            a.hold.set()
            await long

    run(main())
    assert (a.count(), b.count()) == (1, 5)


def test_sticky_sessions_and_reassignment_on_failure(two_fakes):
    a, b = two_fakes

    async def main():
        async with VLLMClient([a.url, b.url], **FAST) as client:
            for turn in range(4):
                for s in ("x", "y", "z"):
                    await client.generate([turn], SamplingParams(max_tokens=1), session_id=s)
            pinned = {s: session_server(client, s) for s in "xyz"}
            # Every request of a session went to its one server.
            assert a.count() + b.count() == 12
            per_server = {a.url: a.count(), b.url: b.count()}
            assert sorted(per_server.values()) == sorted(
                [4 * sum(1 for u in pinned.values() if u == url) for url in (a.url, b.url)]
            )
            assert len(set(pinned.values())) == 2  # sessions are spread over both servers
            # The server of session x breaks: x moves to the other server and stays there.
            broken = a if pinned["x"] == a.url else b
            other = b if broken is a else a
            broken.mode = "http500"
            for _ in range(3):
                await client.generate([9], SamplingParams(max_tokens=1), session_id="x")
            assert session_server(client, "x") == other.url
            client.end_session("x")
            assert session_server(client, "x") is None

    run(main())


def test_concurrency_is_bounded(fake):
    fake.hold = threading.Event()

    async def main():
        async with VLLMClient([fake.url], max_concurrency=3) as client:
            one = SamplingParams(max_tokens=1)
            tasks = [asyncio.create_task(client.generate([i], one)) for i in range(9)]
            await _until(lambda: fake.in_flight == 3)
            await asyncio.sleep(0.2)  # a client that breaks its bound sends a 4th within this window
            fake.hold.set()
            await asyncio.gather(*tasks)
            assert client.in_flight == 0

    run(main())
    assert fake.max_in_flight == 3 and fake.count() == 9


def test_backoff_schedule():
    client = VLLMClient(["http://127.0.0.1:1"], backoff_s=0.5, backoff_max_s=3.0)
    assert [client.backoff(a) for a in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_unhealthy_servers_recover_after_cooldown():
    now = [0.0]
    client = VLLMClient(["http://a", "http://b"], cooldown_s=10.0, clock=lambda: now[0])
    client._mark_failed(0)
    assert client.pick_server() == 1 and client.pick_server() == 1
    now[0] = 10.0
    assert {client.pick_server() for _ in range(2)} == {0, 1}  # back in rotation
    client._mark_failed(0)
    client._mark_failed(1)
    now[0] = 15.0
    assert client.pick_server() == 0  # none healthy: the one whose cool-down ends first


def test_constructor_validation():
    with pytest.raises(ValueError, match="list of server URLs"):
        VLLMClient("http://a")
    with pytest.raises(ValueError, match="at least one"):
        VLLMClient([])
    with pytest.raises(ValueError, match="duplicate"):
        VLLMClient(["http://a/", "http://a"])
    with pytest.raises(ValueError, match="max_concurrency"):
        VLLMClient(["http://a"], max_concurrency=0)
    with pytest.raises(ValueError, match="non-empty prompt"):
        run(VLLMClient(["http://a"]).generate([], SamplingParams()))
    with pytest.raises(ValueError, match="at least 2 token ids"):
        run(VLLMClient(["http://a"]).score([1]))


def test_custom_transport_is_used():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        prompt = __import__("json").loads(request.content)["prompt"]
        status, raw = fk.completion_body({"prompt": prompt, "max_tokens": 2}, "ok")
        return httpx.Response(status, content=raw)

    async def main():
        async with VLLMClient(["http://x"], transport=httpx.MockTransport(handler)) as client:
            return await client.generate([1, 2], SamplingParams(max_tokens=2))

    assert list(run(main()).ids) == fk.expected_generation([1, 2], 2)[0] and seen == ["/v1/completions"]


async def _closing_keepalive_server(idle_close_s: float, connections: list[int]) -> asyncio.Server:
    """An HTTP/1.1 server whose keep-alive timer fires exactly when a late request arrives: a request
    on a connection idle for >= ``idle_close_s`` is dropped unanswered (what uvicorn does when its
    timer closes the socket while the request is in flight). ``connections`` counts accepted sockets."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        answered_at = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length")
                ]
                await reader.readexactly(length[0] if length else 0)
                if answered_at is not None and time.monotonic() - answered_at >= idle_close_s:
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                answered_at = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("keepalive_s, outcome", [(30.0, "dropped"), (0.05, "answered")])
def test_idle_connections_are_not_reused_past_the_keepalive(keepalive_s, outcome):
    """CI saw ``ReadError`` on an adapter unload: with client and server keep-alive timers both at 5 s,
    a request can go out on a pooled connection the server is closing. A client that drops idle
    connections before the server's timer never sends on one (the second post opens a new socket)."""
    connections: list[int] = []

    async def main():
        server = await _closing_keepalive_server(0.3, connections)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, VLLMClient([url], keepalive_s=keepalive_s) as client:
            first = await client.post_each("/admin", {"a": 1})
            await asyncio.sleep(0.4)  # longer than the server's 0.3 s; oversleeping changes nothing
            return first, await client.post_each("/admin", {"a": 2})

    first, second = run(main())
    assert first == [(200, "ok")]
    if outcome == "dropped":  # the failure mode: the idle connection was reused and died
        assert isinstance(second[0], httpx.TransportError) and len(connections) == 1
    else:
        assert second == [(200, "ok")] and len(connections) == 2


def _generate_answer(**choice):
    base = {
        "token_ids": [7, 3, 9],
        "logprobs": {
            "content": [{"token_id": t, "logprob": x} for t, x in ((7, -0.5), (3, -1.25), (9, 0.0))]
        },
        "finish_reason": "length",
        "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}],
    }
    return {"choices": [{**base, **choice}]}


def test_parse_generate_answer_with_version_spans():
    from rljax.inference.vllm.pause import VLLM_DEFAULT_LABEL, parse_generate
    from rljax.types import VersionSpan

    c = parse_generate(_generate_answer(), prompt_ids=[1, 2], default_version=0)
    assert c.ids == (7, 3, 9) and c.logprobs == (-0.5, -1.25, 0.0) and c.finish_reason == "length"
    assert c.weight_versions == (VersionSpan(2, 0, 1), VersionSpan(5, 1, 3)) and c.weight_version == 2
    assert c.token_versions() == [2, 5, 5] and c.routed_experts is None
    # the server's never-set label is the client's default version
    unset = [{"version": VLLM_DEFAULT_LABEL, "start": 0, "end": 3}]
    assert (
        parse_generate(
            _generate_answer(weight_versions=unset), prompt_ids=[1], default_version=4
        ).weight_version
        == 4
    )
    bad = {
        "is not for token": dict(
            logprobs={
                "content": [
                    {"token_id": 7, "logprob": -1.0},
                    {"token_id": 4, "logprob": -1.0},
                    {"token_id": 9, "logprob": -1.0},
                ]
            }
        ),
        "finite numbers <= 0": dict(
            logprobs={"content": [{"token_id": t, "logprob": 0.5} for t in (7, 3, 9)]}
        ),
        "non-negative ints": dict(token_ids=[7, -3, 9]),
        "unknown finish_reason": dict(finish_reason="tired"),
        "do not cover": dict(weight_versions=[{"version": "2", "start": 0, "end": 2}]),
    }
    for match, change in bad.items():
        with pytest.raises(MalformedResponseError, match=match):
            parse_generate(_generate_answer(**change), prompt_ids=[1, 2], default_version=0)
