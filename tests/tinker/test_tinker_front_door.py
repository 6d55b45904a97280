"""The Tinker API's front door: healthz without a key, the key before the body, bounded bodies
(declared, chunked, zstd-expanded), and a ``{"detail": ...}`` 4xx for every malformed request; the
fuzz run sends a thousand malformed requests to a real service (zero 5xx, the next valid request
answered) and a 300 MB body with a valid key (413, RSS flat)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import tracemalloc

import httpx
import pytest

pytest.importorskip("tinker")
import uvicorn  # noqa: E402
import zstandard  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rljax.gateway.limits import HttpLimits  # noqa: E402
from rljax.tinker.server import DEFAULT_LIMITS, MiB, make_app  # noqa: E402
from rljax.tinker.service import ServiceOptions, UserError  # noqa: E402

KEY = "sk-front"
SMALL = HttpLimits(max_body_bytes=4096, max_body_bytes_in_flight=8192)


class _Stub:
    """A service that refuses everything (the front door's checks come before any of it)."""

    options = ServiceOptions(api_keys=(KEY,))
    max_context = 64

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise UserError(f"stub: {name}")

        return refuse


def _serve(app) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(1200):  # a hang guard
        if server.started:
            break
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stub():
    server, base = _serve(make_app(_Stub(), limits=SMALL))
    yield base
    server.should_exit = True


def _first_line(base: str, head: bytes) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        return s.recv(65536)


def test_healthz_needs_no_key_and_says_nothing_else(stub):
    r = httpx.get(stub + "/api/v1/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.post(stub + "/api/v1/healthz").json() == {"status": "ok"}
    assert httpx.get(stub + "/api/v1/get_server_capabilities").status_code == 401


def test_key_before_body_and_bodies_bounded(stub):
    head = b"POST /api/v1/create_model HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n"
    assert _first_line(stub, head + b"\r\n").startswith(b"HTTP/1.1 401 ")  # none of the body sent
    assert _first_line(stub, head + f"X-API-Key: {KEY}\r\n\r\n".encode()).startswith(b"HTTP/1.1 413 ")
    auth = {"x-api-key": KEY, "content-type": "application/json"}
    r = httpx.post(stub + "/api/v1/asample", content=(b" " * 1024 for _ in range(100)), headers=auth)
    assert r.status_code == 413 and "4096" in r.json()["detail"]
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 100_000)  # ~20 bytes that expand to 100 kB
    r = httpx.post(
        stub + "/api/v1/forward_backward", content=bomb, headers={**auth, "content-encoding": "zstd"}
    )
    assert r.status_code == 413 and "decompressed" in r.json()["detail"]
    r = httpx.post(
        stub + "/api/v1/forward_backward", content=b"junk", headers={**auth, "content-encoding": "zstd"}
    )
    assert r.status_code == 400 and "zstd" in r.json()["detail"]


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status"),
    [
        ("POST", "/api/v1/session_heartbeat", {}, b'{"session_id": 5}', 400),
        (
            "POST",
            "/api/v1/create_model",
            {},
            b'{"session_id": "s", "base_model": "b", "lora_config": 3}',
            400,
        ),
        ("POST", "/api/v1/optim_step", {}, b'{"model_id": "m", "adam_params": {"learning_rate": "x"}}', 400),
        ("POST", "/api/v1/asample", {}, b'{"num_samples": 1000000000}', 400),
        ("POST", "/api/v1/asample", {}, b'{"prompt": {"chunks": [{"tokens": ["a"]}]}}', 400),
        ("POST", "/api/v1/retrieve_future", {}, b"[" * 4000, 400),
        ("POST", "/api/v1/optim_step", {"content-type": "text/plain"}, b"{}", 415),
        ("POST", "/api/v1/optim_step", {"content-encoding": "gzip"}, b"{}", 415),
        ("GET", "/api/v1/optim_step", {}, b"", 405),
        ("POST", "/api/v1/nothing", {}, b"{}", 404),
        ("GET", "/api/v1/training_runs/../checkpoints", {}, b"", 404),
    ],
)
def test_malformed_requests_get_a_detail_4xx(stub, method, path, headers, body, status):
    r = httpx.request(method, stub + path, content=body, headers={"x-api-key": KEY, **headers})
    assert r.status_code == status and isinstance(r.json()["detail"], str)


# -- a real service ---------------------------------------------------------------------------------------
scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=10)
json_values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=10,
)
ROUTES = (
    "session_heartbeat", "create_model", "get_info", "optim_step", "save_weights", "save_weights_for_sampler",
    "load_weights", "create_sampling_session", "asample", "retrieve_future", "forward_backward",
    "create_session", "get_server_capabilities", "training_runs/x/checkpoints", "samplers/x", "nope",
)  # fmt: skip
FIELDS = (
    "session_id", "base_model", "model_id", "lora_config", "optimizer_config", "model_seq_id", "adam_params",
    "path", "request_id", "prompt", "num_samples", "sampling_params", "sampling_session_id", "model_path",
)  # fmt: skip


@st.composite
def tinker_requests(draw):
    route = draw(st.sampled_from(ROUTES))
    method = draw(st.sampled_from(["POST", "POST", "GET", "DELETE"]))
    if route == "forward_backward":
        body = draw(st.binary(max_size=200))
    else:
        obj = draw(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5) | json_values)
        body = str(obj).encode() if draw(st.booleans()) and obj else json.dumps(obj).encode()
    headers = {"x-api-key": draw(st.sampled_from([KEY, KEY, KEY, "wrong"]))}
    if draw(st.integers(0, 5)) == 0:
        headers["content-type"] = draw(st.sampled_from(["text/plain", "application/x-protobuf"]))
    return method, f"/api/v1/{route}", headers, body


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from rljax.recipes import tinker as tinker_config
    from rljax.tinker import serve_in_thread

    srv = serve_in_thread(tinker_config.get_config(), tmp_path_factory.mktemp("front"), api_keys=(KEY,))
    yield srv
    srv.stop()


def _valid_answers(client: httpx.Client, base: str) -> None:
    r = client.post(base + "/api/v1/create_session", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["session_id"].startswith("session-")


@pytest.mark.integration
def test_a_thousand_fuzzed_requests_to_a_real_service(real):
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60.0) as client:
        _valid_answers(client, real.base_url)
        before = _rss_mb()
        t0 = time.perf_counter()

        @settings(max_examples=1000, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(tinker_requests())
        def one(request):
            method, path, headers, body = request
            r = client.request(method, real.base_url + path, content=body, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (request, r.status_code, r.text)

        one()
        took, counts = time.perf_counter() - t0, dict(sorted(statuses.items()))
        print(f"\nTinker fuzz: {sum(counts.values())} requests in {took:.1f} s, statuses {counts}, "
              f"RSS {before:.0f} -> {_rss_mb():.0f} MB")  # fmt: skip
        _valid_answers(client, real.base_url)
    assert sum(statuses.values()) >= 1000 and not any(s >= 500 for s in statuses)


@pytest.mark.integration
def test_a_300_mb_body_with_a_valid_key_is_413_at_flat_memory(real):
    size, block = 300 << 20, b" " * (1 << 20)
    before = _rss_mb()
    chunks = (block for _ in range(size >> 20))
    tracemalloc.start()
    try:
        r = httpx.post(real.base_url + "/api/v1/asample", content=chunks, timeout=120,
                       headers={"x-api-key": KEY, "content-type": "application/json"})  # fmt: skip
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"\nTinker 300 MB body: {r.status_code}, Python heap peak {peak / MiB:.0f} MB while it was sent, "
          f"RSS {before:.0f} -> {_rss_mb():.0f} MB")  # fmt: skip
    # The server shares this process. It holds a body up to its limit (128 MiB: such a body is
    # accepted) and refuses it once it passes the limit; buffering the whole body would hold its
    # 300 MB. Half-way between separates the two (the process's RSS was too coarse a measure: the
    # other threads moved it by 4-162 MB under the parallel suite; measured peak here: 131 MB).
    limit = DEFAULT_LIMITS.max_body_bytes
    assert r.status_code == 413 and peak < limit + (size - limit) / 2
