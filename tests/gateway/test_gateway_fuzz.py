"""Property-based fuzzing of the gateway's front door: thousands of malformed chat / messages /
reward requests (wrong types, missing fields, bad JSON, truncated bodies, unknown routes and
methods, bad content types, wrong keys) get a 4xx, never a 5xx or a hang (each request has a client
timeout); the server's memory stays bounded and the next valid request is answered correctly. A
300 MB body with a valid key is refused (413) without the server's memory growing by more than a
few MB."""

from __future__ import annotations

import time

import httpx
import pytest
from fuzz_helpers import CHAT, MESSAGES, GatewayProcess, Tally, gateway_requests, rss_mb
from gateway_helpers import Scripted, open_session
from hypothesis import HealthCheck, given, settings

TIMEOUT = httpx.Timeout(60.0)  # a hang guard: a request that gets no answer fails the run


def _send(client: httpx.Client, base: str, key: str, request: tuple) -> httpx.Response:
    method, path, headers, body, which = request
    headers = dict(headers)
    if which != "none":
        headers["authorization"] = f"Bearer {key if which == 'valid' else 'sk-wrong'}"
    return client.request(method, base + path, content=body, headers=headers)


def _valid_calls_answer(client: httpx.Client, base: str, key: str) -> None:
    auth = {"authorization": f"Bearer {key}"}
    r = client.post(base + "/v1/chat/completions", json=CHAT, headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    r = client.post(base + "/v1/messages", json=MESSAGES, headers=auth)
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "ok"}]


def _fuzz(client: httpx.Client, base: str, key: str, examples: int) -> Tally:
    tally = Tally()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(gateway_requests())
    def one(request: tuple) -> None:
        r = _send(client, base, key, request)
        tally.add(r)
        assert r.status_code < 500, (request, r.status_code, r.text)

    one()
    return tally


def _report(name: str, tally: Tally, seconds: float, rss: tuple[float, float]) -> None:
    kinds = ", ".join(f"{s} {c}: {n}" for (s, c), n in sorted(tally.codes.items()))
    statuses = dict(sorted(tally.statuses.items()))
    print(f"\n{name}: {tally.total} requests in {seconds:.1f} s, statuses {statuses}, "
          f"5xx = {tally.server_errors()}; 4xx kinds: {kinds}; "
          f"RSS {rss[0]:.0f} MB, peak {rss[1]:.0f} MB")  # fmt: skip


@pytest.mark.slow
def test_fuzzed_requests_get_4xx_and_the_gateway_goes_on(gateway):
    session = open_session(gateway, Scripted(lambda prompt: "ok"))
    base = gateway.base_url.removesuffix("/v1")
    with httpx.Client(timeout=TIMEOUT) as client:
        _valid_calls_answer(client, base, session.key)
        before = rss_mb()
        t0 = time.perf_counter()
        tally = _fuzz(client, base, session.key, 300)
        _report("gateway fuzz (in process)", tally, time.perf_counter() - t0, rss_mb())
        _valid_calls_answer(client, base, session.key)
    assert tally.server_errors() == 0 and tally.total >= 300
    assert set(tally.statuses) - {200} <= {400, 401, 404, 405, 415}
    assert rss_mb()[0] - before[0] < 200  # the whole test process (the fuzz itself included)
    gateway.close_session(session)


@pytest.fixture(scope="module")
def server():
    proc = GatewayProcess()
    yield proc
    proc.close()


@pytest.mark.integration
def test_thousands_of_fuzzed_requests_in_a_gateway_process(server):
    with httpx.Client(timeout=TIMEOUT) as client:
        _valid_calls_answer(client, server.base, server.keys[0])
        base_rss = rss_mb(server.pid)[0]
        t0 = time.perf_counter()
        tally = _fuzz(client, server.base, server.keys[0], 3000)
        rss = rss_mb(server.pid)
        _report("gateway fuzz (own process)", tally, time.perf_counter() - t0, rss)
        _valid_calls_answer(client, server.base, server.keys[0])
    assert tally.server_errors() == 0 and tally.total >= 3000
    assert rss[1] - base_rss < 100  # peak over the start, with ~1,000 recorded calls held


def _stream(total: int, chunk: int = 1 << 20):
    block = b" " * chunk
    for _ in range(total // chunk):
        yield block


@pytest.mark.integration
@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content-length"])
def test_a_300_mb_body_with_a_valid_key_is_413_and_costs_no_memory(server, declared):
    size = 300 * (1 << 20)
    headers = {"authorization": f"Bearer {server.keys[1]}", "content-type": "application/json"}
    if declared:
        headers["content-length"] = str(size)
    before = rss_mb(server.pid)[0]
    with httpx.Client(timeout=TIMEOUT) as client:
        r = client.post(server.base + "/v1/chat/completions", content=_stream(size), headers=headers)
        after = rss_mb(server.pid)[0]
        print(f"\n300 MB body ({'Content-Length' if declared else 'chunked'}): {r.status_code}, "
              f"server RSS {before:.0f} MB before, {after:.0f} MB after")  # fmt: skip
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        _valid_calls_answer(client, server.base, server.keys[1])
    assert after - before < 20
