"""A tiny fake of vLLM's OpenAI-compatible server for client/launcher tests (no torch, no model).

``/v1/completions`` answers from closed-form rules the tests recompute independently:

- generation: ``ids[k] = (sum(prompt) + k) % vocab``, ``logprobs[k] = -0.1 * (k + 1)``,
  finish_reason "length" (all ``max_tokens`` ids);
- scoring (``prompt_logprobs`` in the body): ``entry[t] = {str(ids[t]): {"logprob": -0.01 * t}}``.

``mode`` breaks the answer in one way ("mismatch", "missing", "badjson", "nonfinite", "wrong_prompt",
"bad_finish", "two_choices", "missing_prompt_token", "offset_scores", "http500", "http400", "close",
"unhealthy").
Dev-mode routes (/pause, /resume, /reset_prefix_cache, /collective_rpc, /update_weight_version)
answer 200 and are logged (``fail_paths`` / ``rpc_methods`` make them fail).

vLLM's weight bookkeeping, as far as the tests need it: every successful reload
(``/collective_rpc``) counts one in ``reloads``; ``/update_weight_version`` sets ``label``
("default" until then); ``/inference/v1/generate`` answers the generation rule with ONE
weight-version span carrying ``label`` (the scale-out route). With ``honour_pause``, a generation
that arrives between ``/pause`` and ``/resume`` waits for the resume, as vLLM queues requests
added while paused; ``served`` records ``(path, prompt, reloads, label)`` of every generation at
the moment it is generated, so a test knows which weights produced each answer.

Run in-process (:class:`FakeVLLM`, a thread) or as a process: :func:`write_vllm_shim` writes a fake
``vllm.entrypoints.openai.api_server`` module so :class:`rljax.inference.vllm.VLLMServer` can launch
it with the test's own python (settings via ``FAKE_VLLM_*`` environment variables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 100


def expected_generation(
    prompt: list[int], max_tokens: int, vocab: int = VOCAB
) -> tuple[list[int], list[float]]:
    """What the fake returns for a healthy generation (the tests' independent reference)."""
    ids = [(sum(prompt) + k) % vocab for k in range(max_tokens)]
    return ids, [-0.1 * (k + 1) for k in range(max_tokens)]


def expected_scores(ids: list[int]) -> list[float]:
    """What the fake returns when scoring ``ids`` (entry 0 = 0)."""
    return [0.0] + [-0.01 * t for t in range(1, len(ids))]


class FakeVLLM:
    """A fake vLLM server on a background thread. Attributes may be changed while it runs."""

    def __init__(
        self, *, mode: str = "ok", delay_s: float = 0.0, admin_delay_s: float = 0.0, port: int = 0
    ) -> None:
        self.mode = mode
        self.delay_s = delay_s
        self.admin_delay_s = admin_delay_s
        self.fail_paths: set[str] = set()  # admin paths that answer HTTP 500
        # When set, /collective_rpc of a method not in it answers HTTP 500 the way vLLM does when
        # its worker has no such method (e.g. a server started without rljax's worker extension).
        self.rpc_methods: set[str] | None = None
        self.calls: list[tuple[float, str, dict | None]] = []  # (time, path, body)
        self.reloads = 0  # successful /collective_rpc reloads
        self.label = "default"  # the engine's weight-version label (/update_weight_version)
        self.honour_pause = False  # generations arriving while paused wait for /resume
        self.paused = False
        self.pauses = 0  # /pause requests applied (counted once the engine is paused)
        self.served: list[tuple[str, list[int], int, str]] = []  # (path, prompt, reloads, label)
        self._resumed = threading.Condition()
        self._connections: list[socket.socket] = []
        self.in_flight = 0
        self.max_in_flight = 0
        # When set to an Event, completions wait for it (up to 30 s) before answering, so tests
        # decide when in-flight requests finish instead of racing a sleep against the machine.
        self.hold: threading.Event | None = None
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self._httpd.daemon_threads = True
        # stop() waits for the serving loop's next poll: 0.05 s, not the default 0.5 s per fake
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def paths(self) -> list[str]:
        """Paths of the requests received, in order."""
        return [p for _, p, _ in self.calls]

    def count(self, path: str = "/v1/completions") -> int:
        return sum(p == path for p in self.paths())

    def start(self) -> FakeVLLM:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and drops every open connection (as a process that dies does)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> FakeVLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def completion_body(request: dict, mode: str) -> tuple[int, bytes]:
    """(status, body bytes) the fake answers to a ``/v1/completions`` request in ``mode``."""
    prompt = [int(t) for t in request["prompt"]]
    if mode == "http500":
        return 500, b'{"error": "engine dead"}'
    if mode == "http400":
        return 400, json.dumps({"error": {"message": f"prompt too long ({len(prompt)} tokens)"}}).encode()
    if "prompt_logprobs" in request:
        key = (lambda t: str(prompt[t] + 1)) if mode == "missing_prompt_token" else (lambda t: str(prompt[t]))
        off = 1e-3 if mode == "offset_scores" else 0.0  # a server whose weights are slightly off
        entries = [None] + [{key(t): {"logprob": -0.01 * t - off, "rank": 1}} for t in range(1, len(prompt))]
        choice = {"index": 0, "token_ids": [0], "prompt_token_ids": prompt, "prompt_logprobs": entries,
                  "logprobs": None, "finish_reason": "length"}  # fmt: skip
        return 200, json.dumps({"choices": [choice]}).encode()
    ids, logprobs = expected_generation(prompt, int(request["max_tokens"]))
    choice = {"index": 0, "text": "", "token_ids": ids, "prompt_token_ids": prompt,
              "logprobs": {"token_logprobs": logprobs, "tokens": [f"token_id:{i}" for i in ids]},
              "finish_reason": "length"}  # fmt: skip
    if mode == "mismatch":
        choice["logprobs"]["token_logprobs"] = logprobs[:-1]
    elif mode == "missing":
        del choice["token_ids"]
    elif mode == "nonfinite":
        choice["logprobs"]["token_logprobs"] = [float("nan")] + logprobs[1:]
    elif mode == "wrong_prompt":
        choice["prompt_token_ids"] = prompt[:-1]
    elif mode == "bad_finish":
        choice["finish_reason"] = "exploded"
    body = {"id": "cmpl-fake", "choices": [choice, choice] if mode == "two_choices" else [choice]}
    raw = json.dumps(body).encode()
    if mode == "badjson":
        raw = raw[: len(raw) // 2]  # a body cut in the middle
    return 200, raw


GENERATE_PATH = "/inference/v1/generate"
GENERATION_PATHS = ("/v1/completions", GENERATE_PATH)


def generate_body(request: dict, label: str) -> tuple[int, bytes]:
    """(status, body bytes) the fake answers to an ``/inference/v1/generate`` request: the
    generation rule, one weight-version span labelled ``label``."""
    prompt = [int(t) for t in request["token_ids"]]
    ids, logprobs = expected_generation(prompt, int(request["sampling_params"]["max_tokens"]))
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs, strict=True)]
    choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": "length",
              "weight_versions": [{"version": label, "start": 0, "end": len(ids)}]}  # fmt: skip
    return 200, json.dumps({"choices": [choice]}).encode()


def _make_handler(server: FakeVLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def setup(self) -> None:
            super().setup()
            with server._lock:
                server._connections.append(self.connection)

        def _send(self, status: int, raw: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            server.calls.append((time.monotonic(), self.path, None))
            if self.path == "/health":
                self._send(503 if server.mode == "unhealthy" else 200, b"")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            path = self.path
            server.calls.append((time.monotonic(), path, body))
            if path in GENERATION_PATHS and body is None:
                return  # the client gave up on it before sending the body (e.g. its server went down)
            if path not in GENERATION_PATHS:
                time.sleep(server.admin_delay_s)
                method = (body or {}).get("method") if path == "/collective_rpc" else None
                if path.split("?")[0] in server.fail_paths:
                    self._send(500, json.dumps({"error": f"{path} failed in the worker"}).encode())
                elif (
                    method is not None and server.rpc_methods is not None and method not in server.rpc_methods
                ):
                    message = (
                        "Call to collective_rpc method failed: Worker failed with error "
                        f"''CPUWorker' object has no attribute '{method}''"
                    )
                    self._send(500, json.dumps({"error": {"message": message, "code": 500}}).encode())
                else:
                    self._admin(path, body, method)
                    self._send(200, json.dumps({"status": "ok"}).encode())
                return
            with server._lock:
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
            try:
                time.sleep(server.delay_s)
                if server.hold is not None:
                    server.hold.wait(timeout=30)
                if server.mode == "close":
                    self.close_connection = True
                    self.connection.shutdown(2)  # drop the connection without an answer
                    return
                with server._resumed:  # vLLM queues a request added while paused until /resume
                    server._resumed.wait_for(lambda: not (server.honour_pause and server.paused), timeout=30)
                    prompt = body["prompt"] if path == "/v1/completions" else body["token_ids"]
                    server.served.append((path, list(prompt), server.reloads, server.label))
                if path == GENERATE_PATH:
                    self._send(*generate_body(body, server.label))
                else:
                    self._send(*completion_body(body, server.mode))
            finally:
                with server._lock:
                    server.in_flight -= 1

        def _admin(self, path: str, body: dict | None, method: str | None) -> None:
            """The state an admin route changes (it answered 200)."""
            route = path.split("?")[0]
            with server._resumed:
                if route == "/pause":
                    server.paused = True
                    server.pauses += 1
                elif route == "/resume":
                    server.paused = False
                    server._resumed.notify_all()
                elif route == "/update_weight_version":
                    server.label = str(body["new_version"])
                elif method is not None and "reload" in method:
                    server.reloads += 1

    return Handler


# ------------------------------------------------------------------------------------------------
# the same fake as a process started by the real launcher


def write_vllm_shim(directory: str) -> str:
    """Writes a package ``vllm.entrypoints.openai.api_server`` under ``directory`` that runs this fake.

    Returns ``directory`` (put it on PYTHONPATH of the launched process).
    """
    pkg = os.path.join(directory, "vllm", "entrypoints", "openai")
    os.makedirs(pkg, exist_ok=True)
    for d in (os.path.join(directory, "vllm"), os.path.join(directory, "vllm", "entrypoints"), pkg):
        open(os.path.join(d, "__init__.py"), "w").close()
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(pkg, "api_server.py"), "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {here!r})\nimport inference_fakes\ninference_fakes.main()\n")
    return directory


def main(argv: list[str] | None = None) -> None:
    """Entry point of the shim: parses vLLM's flags we use and serves until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    print(f"fake vllm starting on {args.host}:{args.port}", flush=True)
    if os.environ.get("FAKE_VLLM_CRASH"):
        print("RuntimeError: boom (fake engine failed to start)", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_VLLM_IGNORE_TERM"):
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("FAKE_VLLM_CHILD_PIDFILE"):
        # Like vLLM's engine-core process: a child that must die with the server.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_VLLM_CHILD_PIDFILE"], "w") as f:
            f.write(str(child.pid))
    time.sleep(float(os.environ.get("FAKE_VLLM_START_DELAY", "0")))
    server = FakeVLLM(
        mode=os.environ.get("FAKE_VLLM_MODE", "ok"),
        delay_s=float(os.environ.get("FAKE_VLLM_DELAY", "0")),
        port=args.port,
    )
    print("fake vllm ready", flush=True)
    server._httpd.serve_forever()
