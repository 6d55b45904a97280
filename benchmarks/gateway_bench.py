"""Gateway benchmark (issue 21): what an agent's call through the OpenAI-compatible gateway costs.

1. **Per-call overhead** (instant engine: a completion returned without computing anything): the
   latency of one ``/v1/chat/completions`` call of a 3-turn tool conversation (the lookup task's
   shape) made with the ``openai`` SDK, minus calling the engine directly with the same prompt ids
   (what the env loop does). Includes the SDK, HTTP, JSON, the bridge / render and the record.
   p50 and p99 over sequential calls. Goal: p50 <= 2 ms.
2. **Against the engine's time on the default task**: the p50 overhead divided by the embedded
   sampler's latency for one default-task call (the default recipe's model, a ~60-token prompt,
   ``rollout.max_tokens`` new tokens). Goal: <= 10%.
3. **Throughput** at 64 and 256 concurrent rollouts (2 calls each): calls/s of agent rollouts
   through the gateway vs the env loop (:func:`rljax.rollout.rollout`) running the same
   conversation on the same engine, printed as a ratio (instant engine: the gateway's own
   capacity; embedded sampler: what a run sees).

    python benchmarks/gateway_bench.py            # full
    python benchmarks/gateway_bench.py --quick    # fewer calls, smaller rollouts
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from rljax.chat import make_renderer
from rljax.envs.base import Task
from rljax.gateway import Gateway, agent_rollout
from rljax.inference.engine import Completion, SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.recording import StepRecorder
from rljax.rollout import RolloutConfig, rollout
from rljax.train.builders import build_model, build_tokenizer
from rljax.train.run_config import default_config, parse_run_config

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


async def overhead(renderer: Any, engine: Any, n: int) -> dict[str, np.ndarray]:
    """Per-call latency (s) through the gateway (openai SDK) and of the engine called directly,
    wall clock and this process's CPU time (all threads: client, server, tokenizer)."""
    gateway = Gateway(renderer)
    await gateway.start()
    cfg = RolloutConfig(group_size=1, max_tokens=64, max_context_len=2048)
    out: dict[str, list[float]] = {"via": [], "direct": [], "via_cpu": [], "direct_cpu": []}
    try:
        for i in range(n):
            session = gateway.open_session(StepRecorder(renderer, (f"t{i}", 0)), engine, cfg)
            client = gateway.client(session)
            reply = None
            for turn in range(2):
                msgs = conversation(turn, reply)
                t0, c0 = time.perf_counter(), time.process_time()
                r = await client.chat.completions.create(model="m", messages=msgs)
                out["via"].append(time.perf_counter() - t0)
                out["via_cpu"].append(time.process_time() - c0)
                reply = r.choices[0].message.model_dump(exclude_none=True)
                ids = session.recorder.calls[-1].prompt.ids
                t0, c0 = time.perf_counter(), time.process_time()
                await engine.generate(ids, SamplingParams(max_tokens=64))
                out["direct"].append(time.perf_counter() - t0)
                out["direct_cpu"].append(time.process_time() - c0)
            gateway.close_session(session)
            await client.close()
    finally:
        await gateway.stop()
    return {k: np.asarray(v[10:]) for k, v in out.items()}  # the first calls warm up


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


async def throughput(renderer: Any, engine: Any, rollouts: int, max_tokens: int) -> tuple[float, float]:
    """Calls/s of ``rollouts`` concurrent 2-call rollouts: (gateway, env loop)."""
    tasks = [Task(f"t{i}") for i in range(rollouts)]
    cfg = RolloutConfig(group_size=1, max_turns=2, max_tokens=max_tokens, max_context_len=2048,
                        max_concurrency=rollouts, seed=0)  # fmt: skip
    gateway = Gateway(renderer)
    t0 = time.perf_counter()
    res = await agent_rollout(tasks, agent=two_turn_agent, engine=engine, gateway=gateway, config=cfg)
    via = len(res.batch) / (time.perf_counter() - t0)
    await gateway.stop()
    t0 = time.perf_counter()
    res = await rollout(tasks, engine=engine, renderer=renderer, make_env=TwoTurns, config=cfg)
    loop = len(res.batch) / (time.perf_counter() - t0)
    return via, loop


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cfg = parse_run_config(default_config())
    tok = build_tokenizer(cfg.tokenizer)
    renderer = make_renderer(cfg.renderer.name, tok, **cfg.renderer.kwargs)
    instant = Instant(tok, renderer.stop_token_ids()[0])
    n = 60 if args.quick else 300

    t = asyncio.run(overhead(renderer, instant, n))
    for kind, extra in (("wall", t["via"] - t["direct"]), ("cpu", t["via_cpu"] - t["direct_cpu"])):
        q50, q99 = 1e3 * float(np.percentile(extra, 50)), 1e3 * float(np.percentile(extra, 99))
        print(f"per-call overhead, {kind} time (instant engine, {len(extra)} calls): p50 {q50:.2f} ms, "
              f"p99 {q99:.2f} ms; p50 / goal {GOAL_P50_MS} ms = {q50 / GOAL_P50_MS:.2f}")  # fmt: skip
        if kind == "wall":
            p50 = q50
    print(
        f"(direct engine call p50 {1e6 * statistics.median(t['direct']):.0f} us; wall time includes "
        "waiting for a CPU on a busy machine, cpu time is this process's, all threads)"
    )

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
          f"{sampling.max_tokens} new tokens): {1e3 * t_engine:.1f} ms; overhead p50 = {100 * frac:.1f}% "
          f"of it; / goal {100 * GOAL_FRACTION:.0f}% = {frac / GOAL_FRACTION:.2f}")  # fmt: skip

    for rollouts in (64, 256):
        via, loop = asyncio.run(throughput(renderer, instant, rollouts, 64))
        print(f"throughput, {rollouts} concurrent rollouts, instant engine: gateway {via:.0f} calls/s, "
              f"env loop {loop:.0f} calls/s, ratio {via / loop:.3f}")  # fmt: skip
        via, loop = asyncio.run(throughput(renderer, sampler, rollouts, 16 if args.quick else 64))
        print(f"throughput, {rollouts} concurrent rollouts, embedded sampler: gateway {via:.1f} calls/s, "
              f"env loop {loop:.1f} calls/s, ratio {via / loop:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
