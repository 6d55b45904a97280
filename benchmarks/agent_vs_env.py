"""The default task trained as an environment and as an agent through the gateway: both reward curves.

The question: trained on the same task with the same reward function, do the env version and
the agent version both learn, and does the agent version's reward rise on the default task? One
run trains ``configs/smoke.py`` (the default recipe's tool-lookup task on the smoke-sized model)
twice with the same seeds, warm start and steps: once with the env loop, once with
``config.envs.lookup.agent`` set to :func:`rljax.agents.lookup_agent.lookup_agent` (the same task
written as an OpenAI-SDK agent, every call through the run's gateway). It prints ``reward/mean`` per
step of both runs and the means over the first and last ``--window`` steps.

    python benchmarks/agent_vs_env.py                 # 150 warm-start steps, 30 RL steps each
    python benchmarks/agent_vs_env.py --steps 10 --warm-start 20 --window 3   # a quick look
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rljax.recipes import smoke  # noqa: E402
from rljax.run.trainer import Trainer  # noqa: E402

AGENT = "rljax.agents.lookup_agent:lookup_agent"


def train(agent: str, *, steps: int, warm_start: int, prompts: int, group: int) -> list[float]:
    """``reward/mean`` of every RL step of one run."""
    c = smoke.get_config()
    c.envs.lookup.update(agent=agent, num_train_tasks=256, num_eval_tasks=0)
    c.warmstart.num_steps = warm_start
    c.rollout.group_size = group
    c.trainer.update(num_steps=steps, prompts_per_step=prompts, eval_every=0, checkpoint_every=0)
    with tempfile.TemporaryDirectory() as workdir:
        rows = [r for r in Trainer(c, workdir).run() if "loss" in r]
    return [float(r["reward/mean"]) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-start", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args()
    curves = {}
    for name, agent in (("env", ""), ("agent", AGENT)):
        t0 = time.perf_counter()
        curves[name] = train(agent, steps=args.steps, warm_start=args.warm_start, prompts=args.prompts,
                             group=args.group)  # fmt: skip
        print(f"{name}: {args.steps} RL steps in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"{'step':>4} {'env':>8} {'agent':>8}")
    for i, (e, a) in enumerate(zip(curves["env"], curves["agent"], strict=True)):
        print(f"{i + 1:4d} {e:8.4f} {a:8.4f}")
    w = args.window
    for name, curve in curves.items():
        first, last = float(np.mean(curve[:w])), float(np.mean(curve[-w:]))
        verdict = "rises" if last > first else "does NOT rise"
        print(f"{name}: reward/mean steps 1-{w} {first:.4f} -> last {w} {last:.4f} ({verdict})")


if __name__ == "__main__":
    main()
