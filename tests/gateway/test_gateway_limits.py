"""The gateway's front door: the key before the body, bodies bounded without being buffered, header
blocks bounded, requests in flight per key and in all, and a protocol-correct 4xx for each refusal
(OpenAI's error body; Anthropic's on /v1/messages)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest
from gateway_helpers import CHATML, Scripted, open_session

from rljax.gateway import Gateway
from rljax.gateway.limits import Admission, HttpLimits, Refusal, check_head

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SMALL = HttpLimits(
    max_body_bytes=4096, max_header_bytes=8192, max_requests_per_key=2, max_requests=3, body_timeout_s=1.0,
    max_body_bytes_in_flight=6000,
)  # fmt: skip


class Gate:
    """An engine whose calls wait until :meth:`open` (so requests stay in flight while others come)."""

    def __init__(self, loop) -> None:
        self.loop = loop
        self.event: asyncio.Event | None = None
        self.waiting = 0
        self.inner = Scripted(lambda prompt: "ok")

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        if self.event is None:
            self.event = asyncio.Event()
        self.waiting += 1
        await self.event.wait()
        return await self.inner.generate(prompt_ids, sampling, session_id=session_id)

    def open(self) -> None:
        async def go():
            if self.event is not None:
                self.event.set()

        self.loop.run(go)


@pytest.fixture(scope="module")
def small(loop):
    gw = Gateway(CHATML, limits=SMALL)
    loop.run(gw.start)
    yield gw
    loop.run(gw.stop)


def _raw(gw: Gateway, head: str, body: bytes = b"", *, timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """Sends ``head`` (+ ``body``) on a plain socket and reads one response (status, headers, body):
    the server must answer without waiting for any more of the body than was sent."""
    with socket.create_connection((gw.host, gw.port), timeout=timeout) as s:
        s.sendall(head.encode("latin-1") + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, "the server closed the connection without an answer"
            data += chunk
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", 0))
        while len(rest) < n:
            chunk = s.recv(65536)
            assert chunk
            rest += chunk
        return int(lines[0].split()[1]), headers, rest


def _head(path: str, key: str | None, length: int | None, extra: str = "") -> str:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{size}{extra}\r\n"


def test_check_head_and_admission_by_hand():
    lim = HttpLimits(max_body_bytes=10, max_header_bytes=40, max_requests_per_key=1, max_requests=2,
                     max_body_bytes_in_flight=15)  # fmt: skip
    assert check_head([(b"content-length", b"10")], lim) == 10
    assert check_head([(b"transfer-encoding", b"chunked")], lim) is None
    for headers, status in [
        ([(b"content-length", b"11")], 413),
        ([(b"content-length", b"-1")], 400),
        ([(b"content-length", b"1"), (b"content-length", b"2")], 400),
        ([(b"x" * 30, b"y" * 7)], 431),  # 30 + 7 + 4 = 41 bytes > 40
    ]:
        with pytest.raises(Refusal) as e:
            check_head(headers, lim)
        assert e.value.status == status
    adm = Admission(lim)
    with adm.admit("a") as t1:
        t1.reserve(10)
        with pytest.raises(Refusal) as e, adm.admit("a"):
            pass
        assert (e.value.status, e.value.headers()) == (429, [(b"retry-after", b"1")])
        with adm.admit("b") as t2:
            with pytest.raises(Refusal) as e:
                t2.reserve(6)  # 10 + 6 > 15
            assert e.value.status == 503
            with pytest.raises(Refusal) as e, adm.admit("c"):
                pass
            assert e.value.status == 503
    assert (adm.requests, adm.body_bytes, adm.per_key) == (0, 0, {})
    with pytest.raises(ValueError, match="max_body_bytes_in_flight"):
        HttpLimits(max_body_bytes=10, max_body_bytes_in_flight=5)


def test_health_needs_no_key_and_says_nothing_else(gateway):
    root = gateway.base_url.removesuffix("/v1")
    r = httpx.get(root + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert set(r.headers) == {"content-type", "content-length", "date", "server"}  # uvicorn's own two
    assert httpx.post(root + "/health").status_code == 405


def test_the_key_is_checked_before_the_body(gateway):
    """A gigabyte declared and none of it sent: 401 without a key, 413 with one; both at once
    (a server that read first would wait for the body: the socket timeout would fail the test)."""
    session = open_session(gateway, Scripted(lambda p: "ok"))
    status, _, body = _raw(gateway, _head("/v1/chat/completions", None, 10**9))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, body = _raw(gateway, _head("/v1/chat/completions", session.key, 10**9))
    err = json.loads(body)["error"]
    assert status == 413 and err["code"] == "request_too_large" and "8.0 MiB" in err["message"]
    status, _, body = _raw(gateway, _head("/v1/messages", session.key, 10**9))
    assert status == 413 and json.loads(body) == {
        "type": "error",
        "error": {"type": "request_too_large", "message": json.loads(body)["error"]["message"]},
    }
    assert len(session.recorder.calls) == 0
    gateway.close_session(session)


def test_a_chunked_body_is_cut_at_the_limit(small):
    session = open_session(small, Scripted(lambda p: "ok"))
    sent = []

    def chunks():
        for _ in range(10_000):  # 10 MB offered; the answer comes after ~4 KiB
            sent.append(1024)
            yield b" " * 1024

    auth = {"Authorization": f"Bearer {session.key}", "Content-Type": "application/json"}
    r = httpx.post(small.base_url + "/chat/completions", content=chunks(), headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # the connection stays usable: the server dropped the rest of that body
    ok = httpx.post(
        small.base_url + "/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {session.key}"}
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"
    small.close_session(session)


def test_headers_are_bounded(small):
    session = open_session(small, Scripted(lambda p: "ok"))
    big = {"Authorization": f"Bearer {session.key}", "X-Pad": "p" * 9000}
    r = httpx.post(small.base_url + "/chat/completions", json=CHAT, headers=big)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    with socket.create_connection((small.host, small.port), timeout=30) as s:  # a head still arriving
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 9000)
        assert s.recv(65536).startswith(b"HTTP/1.1 400 ")  # cut off by the parser's bound

    async def in_process():  # the app's own check, for servers whose parser does not bound them
        async with small.client(session) as client:
            resp = await client._client.post(small.base_url + "/chat/completions", json=CHAT, headers=big)
            return resp.status_code, resp.json()

    status, body = asyncio.run_coroutine_threadsafe(in_process(), small._loop).result(60)
    assert status == 431 and body["error"]["code"] == "request_header_fields_too_large"
    small.close_session(session)


def test_requests_in_flight_per_key_and_in_all(loop, small):
    gate = Gate(loop)
    a, b = open_session(small, gate, tid=("a", 0)), open_session(small, gate, tid=("b", 0))
    results: dict[str, list] = {"a": [], "b": []}

    def call(session, name):
        r = httpx.post(small.base_url + "/chat/completions", json=CHAT, timeout=60,
                       headers={"Authorization": f"Bearer {session.key}"})  # fmt: skip
        results[name].append(r)

    threads = [threading.Thread(target=call, args=(a, "a")) for _ in range(2)]
    threads.append(threading.Thread(target=call, args=(b, "b")))
    for t in threads:
        t.start()
    deadline = 600  # x 0.05 s: a hang guard only
    while gate.waiting < 3 and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    assert gate.waiting == 3
    r = httpx.post(
        small.base_url + "/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {a.key}"}
    )
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    c = open_session(small, Scripted(lambda p: "ok"), tid=("c", 0))
    r = httpx.post(small.base_url + "/messages", json={**CHAT, "max_tokens": 8},
                   headers={"x-api-key": c.key})  # fmt: skip
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "overloaded_error"
    gate.open()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results["a"] + results["b"]] == [200, 200, 200]
    assert len(a.recorder.calls) == 2 and len(b.recorder.calls) == 1 and len(c.recorder.calls) == 0
    r = httpx.post(
        small.base_url + "/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {c.key}"}
    )
    assert r.status_code == 200  # the counts went back down
    for s in (a, b, c):
        small.close_session(s)


def test_a_slow_body_times_out_and_held_bodies_are_bounded(small):
    session = open_session(small, Scripted(lambda p: "ok"))
    status, _, body = _raw(small, _head("/v1/chat/completions", session.key, 100), b"{")
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    # one body of 4000 declared bytes held (half sent) + another of 4000: over the 6000 in flight
    with socket.create_connection((small.host, small.port), timeout=30) as held:
        held.sendall(_head("/v1/chat/completions", session.key, 4000).encode() + b"{" * 100)
        other = open_session(small, Scripted(lambda p: "ok"), tid=("o", 0))
        deadline = 600
        while small._admission.body_bytes < 4000 and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        status, headers, body = _raw(small, _head("/v1/chat/completions", other.key, 4000))
        assert status == 503 and headers["retry-after"] == "1"
    small.close_session(session)
    small.close_session(other)


@pytest.mark.parametrize(
    ("method", "path", "headers", "content", "status", "code"),
    [
        (
            "POST",
            "/v1/chat/completions",
            {"content-type": "text/plain"},
            b"{}",
            415,
            "unsupported_media_type",
        ),
        ("POST", "/v1/chat/completions", {"content-encoding": "gzip"}, b"{}", 415, "unsupported_media_type"),
        ("POST", "/v1/chat/completions", {}, b"[" * 100_000, 400, None),  # nested past the parser
        ("POST", "/v1/chat/completions", {}, b'{"messages": [', 400, None),  # truncated
        ("GET", "/v1/chat/completions", {}, b"", 405, "method_not_allowed"),
        ("POST", "/v1/nothing", {}, b"{}", 404, "not_found"),
    ],
)
def test_malformed_requests_get_openai_4xx(gateway, method, path, headers, content, status, code):
    session = open_session(gateway, Scripted(lambda p: "ok"))
    headers = {"Authorization": f"Bearer {session.key}", **headers}
    r = httpx.request(method, gateway.base_url.removesuffix("/v1") + path, content=content, headers=headers)
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == code
    gateway.close_session(session)
