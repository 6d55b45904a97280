"""Environment execution overhead of the agent loop.

1,024 trajectories x 4 turns against an environment whose ``step`` sleeps 50 ms (a synchronous
variant, run in rljax's env thread pool, and an ``async`` variant), with an engine that answers
instantly. The floor is the sleeping alone at the configured concurrency:
``turns x 50 ms x ceil(trajectories / concurrency)``; the goal is a wall time within 1.5x of it.

    python benchmarks/env_bench.py [--trajectories 1024] [--turns 4] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

from rljax.chat import ChatMLRenderer, toy_tokenizer
from rljax.envs import Task
from rljax.inference.engine import Completion
from rljax.rollout import RolloutConfig, run_rollout

TOK = toy_tokenizer("chatml")
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
ANSWER = tuple(TOK.encode("ok", add_special_tokens=False)) + (IM_END,)


class InstantEngine:
    async def generate(self, prompt_ids, sampling, *, session_id=None):
        return Completion(ANSWER, (-0.1,) * len(ANSWER), "stop", 0)


def make_envs(turns: int, sleep_s: float):
    class SyncEnv:
        name = "sync"
        tools = None

        def reset(self, task):
            self.turn = 0
            return [{"role": "user", "content": "start"}]

        def step(self, action):
            time.sleep(sleep_s)
            self.turn += 1
            return [{"role": "user", "content": "next"}], 1.0, self.turn == turns, {}

    class AsyncEnv(SyncEnv):
        name = "async"

        async def step(self, action):
            await asyncio.sleep(sleep_s)
            self.turn += 1
            return [{"role": "user", "content": "next"}], 1.0, self.turn == turns, {}

    return SyncEnv, AsyncEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--sleep_ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    sleep_s = args.sleep_ms / 1000
    ideal = args.turns * sleep_s * math.ceil(args.trajectories / args.concurrency)
    tasks = [Task(f"t{i}") for i in range(args.trajectories)]
    config = RolloutConfig(group_size=1, max_turns=args.turns + 1, max_concurrency=args.concurrency)
    renderer = ChatMLRenderer(TOK)
    print(
        f"{args.trajectories} trajectories x {args.turns} turns, env step {args.sleep_ms:.0f} ms, "
        f"concurrency {args.concurrency}: ideal {ideal:.2f} s (goal <= 1.5x)"
    )
    for env in make_envs(args.turns, sleep_s):
        best = math.inf
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = run_rollout(
                tasks, engine=InstantEngine(), renderer=renderer, make_env=env, config=config
            )
            best = min(best, time.perf_counter() - start)
            assert result.metrics["num_completed"] == args.trajectories
            assert result.metrics["num_steps"] == args.trajectories * args.turns
        print(f"  {env.name:5s} env: wall {best:.2f} s, ratio to ideal {best / ideal:.2f}x")


if __name__ == "__main__":
    main()
