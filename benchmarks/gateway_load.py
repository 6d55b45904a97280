"""Gateway load test: hundreds of concurrent agent rollouts, none lost or misattributed.

``--rollouts`` agent rollouts (default 512) run at once against one gateway on one event loop, each
with its own key and its own HTTP client (a keep-alive connection, as a harness in its own process
has), ``--turns`` chat calls each: every call adds a user message naming its rollout and turn
("rollout 17 turn 2") to the conversation so far. The engine is instant and echoes what it read
("ack 17 2"), so a call routed to the wrong session, or answered with another call's completion,
shows. After the run each rollout is checked:

* every call answered 200 with its own echo (errors = 0);
* its session recorded exactly ``turns`` calls, in order, each prompt holding exactly its own
  turns' messages and each completion its own echo (nothing lost, nothing misattributed).

Printed: rollouts, calls, errors, lost / misattributed rollouts, latency p50 / p99 per call (client
side, over HTTP), wall time and calls/s.

    python benchmarks/gateway_load.py                      # 512 rollouts x 3 turns
    python benchmarks/gateway_load.py --rollouts 64 --turns 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from typing import Any

import httpx
import numpy as np

from rljax.chat import ChatMLRenderer, toy_tokenizer
from rljax.gateway import Gateway
from rljax.inference.engine import Completion
from rljax.recording import StepRecorder
from rljax.rollout import RolloutConfig

TOK = toy_tokenizer("chatml")
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
CONFIG = RolloutConfig(group_size=1, max_tokens=32, max_context_len=4096, temperature=1.0)
_TURN = re.compile(r"rollout (\d+) turn (\d+)")


class EchoEngine:
    """An instant engine: the completion of a prompt is ``ack R T`` for the last "rollout R turn T"
    in it, then the end-of-turn token."""

    async def generate(self, prompt_ids: Any, sampling: Any, *, session_id: str | None = None) -> Completion:
        await asyncio.sleep(0)  # a real engine answers later: let the other rollouts in
        rollout, turn = _TURN.findall(TOK.decode(list(prompt_ids)))[-1]
        ids = [*TOK.encode(f"ack {rollout} {turn}", add_special_tokens=False), IM_END]
        return Completion(ids, [-0.5] * len(ids), "stop", weight_version=0)


async def _rollout(gw: Gateway, key: str, index: int, turns: int, latencies: list[float]) -> list[str]:
    """One agent: ``turns`` calls extending one conversation; the problems it saw (empty: none)."""
    problems: list[str] = []
    messages: list[dict[str, Any]] = []
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=120.0) as client:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"rollout {index} turn {turn}"})
            t0 = time.perf_counter()
            try:
                r = await client.post("/chat/completions", json={"model": "m", "messages": messages})
            except httpx.HTTPError as e:
                problems.append(f"turn {turn}: {type(e).__name__}: {e}")
                break
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                problems.append(f"turn {turn}: HTTP {r.status_code} {r.text[:200]}")
                break
            reply = r.json()["choices"][0]["message"]
            if reply.get("content") != f"ack {index} {turn}":
                problems.append(f"turn {turn}: answered {reply.get('content')!r}")
            messages.append({"role": "assistant", "content": reply.get("content")})
    return problems


def _check_record(recorder: StepRecorder, index: int, turns: int) -> str | None:
    """Why ``recorder`` (rollout ``index``'s session) is not exactly its ``turns`` calls, or None."""
    calls = list(recorder.calls)
    if len(calls) != turns:
        return f"{len(calls)} recorded calls, not {turns}"
    for turn, call in enumerate(calls):
        seen = _TURN.findall(TOK.decode(list(call.prompt.ids)))
        if seen != [(str(index), str(t)) for t in range(turn + 1)]:
            return f"call {turn}: its prompt holds the turns {seen}"
        if TOK.decode(list(call.completion.ids)) != f"ack {index} {turn}<|im_end|>":
            return f"call {turn}: its completion is {TOK.decode(list(call.completion.ids))!r}"
    return None


async def run_load(rollouts: int = 512, turns: int = 3) -> dict[str, Any]:
    """Runs the load test; returns its figures (see the module docstring)."""
    gw = Gateway(ChatMLRenderer(TOK))
    await gw.start()
    engine = EchoEngine()
    try:
        sessions = [
            gw.open_session(StepRecorder(gw.renderer, ("load", i), temperature=1.0), engine, CONFIG)
            for i in range(rollouts)
        ]
        latencies: list[float] = []
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(_rollout(gw, s.key, i, turns, latencies) for i, s in enumerate(sessions)),
            return_exceptions=True,
        )
        wall = time.perf_counter() - t0
        errors = [str(r) if isinstance(r, BaseException) else "; ".join(r) for r in results]
        records = [_check_record(s.recorder, i, turns) for i, s in enumerate(sessions)]
    finally:
        await gw.stop()
    lat = np.asarray(latencies) * 1e3
    return {
        "rollouts": rollouts,
        "turns": turns,
        "calls": len(latencies),
        "errors": sum(1 for e in errors if e),
        "misattributed_or_lost": sum(1 for r in records if r),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "wall_s": wall,
        "calls_per_s": len(latencies) / wall if wall else None,
        "first_problems": [e for e in errors if e][:3] + [r for r in records if r][:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    out = asyncio.run(run_load(args.rollouts, args.turns))
    print(
        f"{out['rollouts']} concurrent rollouts x {out['turns']} turns: {out['calls']} calls, "
        f"errors = {out['errors']}, lost or misattributed = {out['misattributed_or_lost']}, "
        f"latency p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, "
        f"{out['wall_s']:.1f} s ({out['calls_per_s']:.0f} calls/s)"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
