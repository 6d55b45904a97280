"""Gateway benchmark: what an agent's call through the OpenAI-compatible gateway costs.

1. **Per-call overhead** (instant engine: a completion returned without computing anything): one
   ``/v1/chat/completions`` call of a 2-call tool conversation (the lookup task's shape: the first
   call renders the prompt, the second extends it: the bridge), minus calling the engine directly
   with the same prompt ids (what the env loop does). p50 / p99 over sequential calls, wall and CPU
   time (this process, all threads), the first rollouts left out (warm-up). Five views of one call,
   interleaved rollout by rollout (the same machine load for each):

   (a) server side: the gateway's ASGI app from the request's arrival (headers parsed) to the
       response handed to uvicorn, minus the engine's time inside it;
   (b) a minimal HTTP/1.1 client (one keep-alive socket per rollout, the request in one write, the
       response read by its content-length): the gateway with its HTTP server (uvicorn), plus a
       ``json.dumps`` / ``json.loads`` and two socket calls of the client. THE GOAL IS JUDGED ON
       THIS LINE (the gateway's own overhead, an upper bound of it): p50 <= 2 ms;
   (c) ``httpx`` (a lean general-purpose client) and (d) the ``openai`` SDK over HTTP: what a
       harness in its own process sees. What (d) adds over (b) is the SDK building the request
       (its TypedDict transform of the messages), httpx, and parsing the response into pydantic
       models: a harness pays it against any OpenAI-compatible server (vLLM's too), so it is the
       harness's cost;
   (e) the ``openai`` SDK client that agent functions get (:meth:`Gateway.client`): on the
       gateway's loop its calls reach the app without a socket (no TCP, no HTTP codecs).
2. **Against the engine's time on the default task**: (b)'s p50 divided by the embedded sampler's
   latency for one default-task call (the default recipe's model, a ~60-token prompt,
   ``rollout.max_tokens`` new tokens). Goal: <= 10%. (d)'s and (e)'s shares are printed too.
3. **Throughput** at 64 and 256 concurrent rollouts (2 calls each): calls/s of agent rollouts
   through the gateway vs the env loop (:func:`rljax.rollout.rollout`) running the same
   conversation on the same engine, as a ratio: with the instant engine for an openai-SDK agent
   (an agent function with the client it gets, (e)) and a minimal-client agent (over HTTP: the
   gateway with its HTTP server), and with the embedded sampler (what a run sees). Every
   configuration runs once untimed first (both halves), so neither pays the sampler's compiles.

    python benchmarks/gateway_bench.py            # full
    python benchmarks/gateway_bench.py --quick    # fewer calls, smaller rollouts
    python benchmarks/gateway_bench.py --overhead-only --calls 150   # part 1 only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.parse
from typing import Any

import numpy as np

from rljax.agents import agent_rollout
from rljax.chat import make_renderer
from rljax.envs.base import Task
from rljax.gateway import Gateway
from rljax.inference.engine import Completion, SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.recording import StepRecorder
from rljax.rollout import RolloutConfig, rollout
from rljax.run.builders import build_model, build_tokenizer
from rljax.run.config import default_config, parse_run_config

GOAL_P50_MS = 2.0
GOAL_FRACTION = 0.10
TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "zob"}}\n</tool_call>'


class Instant:
    """An engine that answers at once: a tool call first, then a one-word answer."""

    weight_version = 0

    def __init__(self, tokenizer: Any, end: int) -> None:
        self.call = (*tokenizer.encode(TOOL_CALL, add_special_tokens=False), end)
        self.answer = (*tokenizer.encode("red", add_special_tokens=False), end)

    async def generate(
        self, prompt_ids: Any, sampling: SamplingParams, *, session_id: str | None = None
    ) -> Any:
        ids = self.answer if len(prompt_ids) > 80 else self.call
        ids = ids[: sampling.max_tokens]
        return Completion(ids, (-0.1,) * len(ids), "stop", 0)

    async def update_weights(self, model: Any, *, version: int | None = None) -> int:
        return 0


def conversation(turn: int, reply: dict[str, Any] | None) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What color is the zob?"}]
    if turn and reply is not None:
        msgs += [reply, {"role": "tool", "tool_call_id": "x", "content": "red"}]
    return msgs


class RawClient:
    """A minimal HTTP/1.1 client of one rollout: one keep-alive connection, each request written in
    one call, the response read by its content-length."""

    def __init__(self, base_url: str, key: str) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.host, self.port, self.path = url.hostname, url.port, url.path.rstrip("/")
        self.auth = f"authorization: Bearer {key}\r\n".encode()
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        data = json.dumps(body).encode()
        writer.write(
            f"POST {self.path}{path} HTTP/1.1\r\nhost: {self.host}\r\n".encode() + self.auth
            + f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data
        )  # fmt: skip
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        out = json.loads(await reader.readexactly(length))
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{head.splitlines()[0]!r}: {out}")
        return out

    async def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


class Timed:
    """The engine, timing each generate (its share of the server-side time)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.times = engine, []
        self.weight_version = engine.weight_version

    async def generate(self, prompt_ids: Any, sampling: SamplingParams, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = await self.engine.generate(prompt_ids, sampling, **kwargs)
        self.times.append(time.perf_counter() - t0)
        return out


CLIENTS = ("raw", "httpx", "openai", "in_process")


async def overhead(renderer: Any, engine: Any, n: int, warmup: int = 10) -> dict[str, np.ndarray]:
    """Per-call seconds, for each client kind (CLIENTS) and "server": the call's wall ("<kind>")
    and CPU ("<kind>_cpu") time minus calling the engine directly with the same ids; for the
    server side, the app's time minus the engine's inside it ("server", "server_cpu": from the
    minimal client's calls, when nothing else runs on the loop). ``n`` rollouts of 2 calls per
    kind, the kinds interleaved rollout by rollout; the first ``warmup`` rollouts left out."""
    import httpx

    gateway = Gateway(renderer)
    app, spans = gateway.app, []

    async def timed_app(scope: Any, receive: Any, send: Any) -> None:
        t0, c0 = time.perf_counter(), time.process_time()

        async def timed_send(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                spans.append((time.perf_counter() - t0, time.process_time() - c0))

        await app(scope, receive, timed_send)

    gateway.app = timed_app  # before start(): what uvicorn serves
    await gateway.start()
    timed = Timed(engine)
    cfg = RolloutConfig(group_size=1, max_tokens=64, max_context_len=2048)
    out: dict[str, list[float]] = {}
    try:
        for i in range(warmup + n):
            for kind in CLIENTS:
                session = gateway.open_session(StepRecorder(renderer, (f"t{i}", 0)), timed, cfg)
                if kind in ("openai", "in_process"):
                    client = gateway.client(session, in_process=kind == "in_process")
                elif kind == "httpx":
                    auth = {"authorization": f"Bearer {session.key}"}
                    client = httpx.AsyncClient(base_url=gateway.base_url, timeout=None, headers=auth)
                else:
                    client = RawClient(gateway.base_url, session.key)
                reply = None
                for turn in range(2):
                    body = {"model": "m", "messages": conversation(turn, reply)}
                    spans.clear()
                    timed.times.clear()
                    t0, c0 = time.perf_counter(), time.process_time()
                    if kind in ("openai", "in_process"):
                        r = await client.chat.completions.create(**body)
                        reply = r.choices[0].message.model_dump(exclude_none=True)
                    elif kind == "httpx":
                        r = await client.post("/chat/completions", json=body)
                        reply = r.json()["choices"][0]["message"]
                    else:
                        reply = (await client.post("/chat/completions", body))["choices"][0]["message"]
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    (span_wall, span_cpu), engine_in = spans[-1], timed.times[-1]
                    ids = session.recorder.calls[-1].prompt.ids
                    t0, c0 = time.perf_counter(), time.process_time()
                    await engine.generate(ids, SamplingParams(max_tokens=64))
                    d_wall, d_cpu = time.perf_counter() - t0, time.process_time() - c0
                    if i < warmup:
                        continue
                    out.setdefault(kind, []).append(wall - d_wall)
                    out.setdefault(kind + "_cpu", []).append(cpu - d_cpu)
                    out.setdefault("direct", []).append(d_wall)
                    if kind == "raw":
                        out.setdefault("server", []).append(span_wall - engine_in)
                        out.setdefault("server_cpu", []).append(span_cpu - min(engine_in, span_cpu))
                gateway.close_session(session)
                await (client.close() if kind != "httpx" else client.aclose())
    finally:
        await gateway.stop()
    return {k: np.asarray(v) for k, v in out.items()}


class TwoTurns:
    """The benchmark conversation as an env (for the env loop)."""

    tools = None

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.turn = 0
        return conversation(0, None)

    def step(self, action: Any) -> tuple[list[dict[str, Any]], float, bool, dict]:
        self.turn += 1
        return [{"role": "tool", "content": "red"}], 1.0, self.turn == 2, {}


async def two_turn_agent(task: Task, client: Any) -> float:
    msgs = conversation(0, None)
    for _ in range(2):
        r = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "red"}]
    return 1.0


async def two_turn_raw_agent(task: Task, client: Any) -> float:
    """:func:`two_turn_agent` with the minimal client (on the rollout's base URL and key)."""
    raw = RawClient(str(client.base_url), client.api_key)
    msgs = conversation(0, None)
    try:
        for _ in range(2):
            r = await raw.post("/chat/completions", {"model": "m", "messages": msgs})
            msgs += [r["choices"][0]["message"], {"role": "tool", "content": "red"}]
    finally:
        await raw.close()
    return 1.0


async def throughput(
    renderer: Any, engine: Any, rollouts: int, max_tokens: int, agent: Any = two_turn_agent
) -> tuple[float, float]:
    """Calls/s of ``rollouts`` concurrent 2-call rollouts: (gateway, env loop); each half runs once
    untimed first (the sampler's compiles for these batch shapes, the SDK's lazy imports)."""
    tasks = [Task(f"t{i}") for i in range(rollouts)]
    cfg = RolloutConfig(group_size=1, max_turns=2, max_tokens=max_tokens, max_context_len=2048,
                        max_concurrency=rollouts, seed=0)  # fmt: skip
    rates = []
    for timed in (False, True):
        gateway = Gateway(renderer)
        t0 = time.perf_counter()
        res = await agent_rollout(tasks, agent=agent, engine=engine, gateway=gateway, config=cfg)
        via = len(res.batch) / (time.perf_counter() - t0)
        await gateway.stop()
        t0 = time.perf_counter()
        res = await rollout(tasks, engine=engine, renderer=renderer, make_env=TwoTurns, config=cfg)
        loop = len(res.batch) / (time.perf_counter() - t0)
        if timed:
            rates = [via, loop]
    return rates[0], rates[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, default=None, help="rollouts (2 calls each) per client kind")
    parser.add_argument("--overhead-only", action="store_true", help="part 1 only (no model, no throughput)")
    args = parser.parse_args()
    cfg = parse_run_config(default_config())
    tok = build_tokenizer(cfg.tokenizer)
    renderer = make_renderer(cfg.renderer.name, tok, **cfg.renderer.kwargs)
    instant = Instant(tok, renderer.stop_token_ids()[0])
    n = args.calls or (60 if args.quick else 300)

    t = asyncio.run(overhead(renderer, instant, n))
    calls = len(t["raw"])
    direct = 1e6 * statistics.median(t["direct"])
    print(f"per-call overhead of the gateway, instant engine, {calls} calls per line (p50 / p99, minus "
          f"calling the engine directly, p50 {direct:.0f} us):")  # fmt: skip
    lines = [
        ("server", "(a) server side: the app, request in -> response out, minus the engine"),
        ("raw", "(b) minimal HTTP/1.1 client: the gateway + its HTTP server  <- THE GOAL'S LINE"),
        ("httpx", "(c) httpx client"),
        ("openai", "(d) openai SDK client: + the SDK's request building and pydantic parsing"),
        ("in_process", "(e) the openai SDK client agent functions get (Gateway.client, in-process)"),
    ]
    p50s = {}
    for key, label in lines:
        w, c = 1e3 * t[key], 1e3 * t[key + "_cpu"]
        p50s[key] = float(np.percentile(w, 50))
        print(f"  {label:78s} wall {p50s[key]:6.2f} / {np.percentile(w, 99):6.2f} ms, "
              f"cpu {np.percentile(c, 50):6.2f} / {np.percentile(c, 99):6.2f} ms")  # fmt: skip
    p50 = p50s["raw"]
    print(f"goal (b) p50 <= {GOAL_P50_MS} ms: {p50:.2f} ms = {p50 / GOAL_P50_MS:.2f} of it "
          f"({'met' if p50 <= GOAL_P50_MS else 'NOT met'}); wall time includes waiting for a CPU on a busy "
          "machine, cpu time is this process's, all threads")  # fmt: skip
    if args.overhead_only:
        return

    model = build_model(cfg.model, vocab_size=len(tok), seed=0)
    sampler = EmbeddedSampler(model, max_batch_size=cfg.engine.max_batch_size,
                              min_batch_bucket=cfg.engine.min_batch_bucket, batch_wait_ms=0.0,
                              min_prompt_bucket=cfg.engine.min_prompt_bucket,
                              min_new_tokens_bucket=cfg.engine.min_new_tokens_bucket)  # fmt: skip
    prompt = renderer.render_ids(conversation(0, None), add_generation_prompt=True)
    sampling = SamplingParams(max_tokens=cfg.rollout.max_tokens, seed=1)

    async def engine_time() -> float:
        await sampler.generate(prompt, sampling)  # compile
        times = []
        for _ in range(5 if args.quick else 20):
            t0 = time.perf_counter()
            await sampler.generate(prompt, sampling)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t_engine = asyncio.run(engine_time())
    frac = p50 / 1e3 / t_engine
    print(f"default-task engine call (embedded sampler, default model, {len(prompt)}-token prompt, "
          f"{sampling.max_tokens} new tokens): {1e3 * t_engine:.1f} ms; (b) p50 = {100 * frac:.1f}% of it "
          f"(goal <= {100 * GOAL_FRACTION:.0f}%: {'met' if frac <= GOAL_FRACTION else 'NOT met'}); "
          f"(d) openai SDK p50 = {100 * p50s['openai'] / 1e3 / t_engine:.1f}% of it, (e) "
          f"{100 * p50s['in_process'] / 1e3 / t_engine:.1f}%")  # fmt: skip

    for rollouts in (64, 256):
        for agent, name in (
            (two_turn_agent, "openai-SDK agent"),
            (two_turn_raw_agent, "minimal-client agent"),
        ):
            via, loop = asyncio.run(throughput(renderer, instant, rollouts, 64, agent))
            print(f"throughput, {rollouts} concurrent rollouts, instant engine, {name}: gateway {via:.0f} "
                  f"calls/s, env loop {loop:.0f} calls/s, ratio {via / loop:.3f}")  # fmt: skip
        via, loop = asyncio.run(throughput(renderer, sampler, rollouts, 16 if args.quick else 64))
        print(f"throughput, {rollouts} concurrent rollouts, embedded sampler: gateway {via:.1f} calls/s, "
              f"env loop {loop:.1f} calls/s, ratio {via / loop:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
