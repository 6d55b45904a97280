"""verifiers benchmark: what running an agent as a verifiers episode costs over the same
calls made by a plain agent function, both through the real gateway in front of an instant engine
(answers at once; tests/gateway/vf_helpers.py: the test environment, 2 calls per episode).

The verifiers path adds, per episode: verifiers' interception hop (the harness's calls go to its
local server, which relays them to the gateway with its eval client), the episode's runtime (local
subprocess runtime: a work directory), setup / scoring hooks, and a per-episode eval client (an
httpx client with its own SSL context: verifiers reads the rollout's key when it builds one). Printed:
rollouts/s of each at ``--rollouts`` concurrent rollouts, their ratio, and the extra wall time per
episode.

    python benchmarks/verifiers_bench.py                  # 64 concurrent rollouts
    python benchmarks/verifiers_bench.py --rollouts 256
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time
from typing import Any

from rljax.agents import agent_rollout
from rljax.agents.verifiers import VerifiersAgent
from rljax.chat import ChatMLRenderer, toy_tokenizer
from rljax.envs.base import Task
from rljax.gateway import Gateway
from rljax.rollout import RolloutConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "gateway"))
import vf_helpers as h  # noqa: E402


async def plain_agent(task: Task, client: Any) -> float:
    """The same two calls as the verifiers test harness, as a plain agent function."""
    msgs = [dict(m) for m in task.messages]
    r = await client.chat.completions.create(model="m", messages=msgs)
    msgs += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": h.FOLLOW_UP},
    ]
    await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
    return 1.0


async def run(n: int) -> tuple[float, float]:
    renderer = ChatMLRenderer(toy_tokenizer("chatml"))
    engine = h.InstantEngine(renderer)
    rows = [[i % 9, 1 + i // 9, str(i % 9 + 1 + i // 9)] for i in range(n)]
    agent = VerifiersAgent(h.ENV_ID, {**h.LOCAL, "taskset": {"rows": rows}})
    tasks = agent.tasks(env_name="arith")
    config = RolloutConfig(group_size=1, max_tokens=32, max_context_len=512, max_concurrency=n, seed=0)
    gateway = Gateway(renderer)
    try:
        # warm up: the gateway, verifiers' serving resources, the model name
        await agent_rollout(tasks[:2], agent=agent, engine=engine, gateway=gateway, config=config)
        seconds = []
        for fn in (plain_agent, agent):
            t0 = time.perf_counter()
            res = await agent_rollout(tasks, agent=fn, engine=engine, gateway=gateway, config=config)
            seconds.append(time.perf_counter() - t0)
            assert res.metrics["num_errored"] == 0 and len(res.batch) == 2 * n
    finally:
        await agent.aclose()
        await gateway.stop()
    return seconds[0], seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=64)
    args = parser.parse_args()
    h.register_env()
    plain, vf = asyncio.run(run(args.rollouts))
    n = args.rollouts
    print(f"{n} concurrent rollouts x 2 calls, instant engine, real gateway:")
    print(f"  plain agent function: {n / plain:.1f} rollouts/s ({plain:.2f} s)")
    print(f"  verifiers episodes:   {n / vf:.1f} rollouts/s ({vf:.2f} s)")
    print(
        f"  verifiers / plain throughput = {plain / vf:.2f}; "
        f"extra wall time {1e3 * (vf - plain) / n:.0f} ms/episode"
    )


if __name__ == "__main__":
    main()
