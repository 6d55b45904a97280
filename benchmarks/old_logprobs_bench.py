"""Recomputing the old (proximal) policy's logprobs: its cost per step and what it changes in learning.

``--cost``: for each recipe named, a short run with ``trainer.old_logprobs="recompute"`` (forced: the
default recipes' dppo does not read the old policy) prints the seconds of each step spent in the
recompute (``time/policy_logprobs_s``) against the step's seconds (``time/step_s``), as a percentage,
over the steps after the first (which compiles).

    PYTHONPATH=. python benchmarks/old_logprobs_bench.py --cost --recipes default smollm2_cpu --steps 4

``--curves``: a recipe (the first of ``--recipes``; the default recipe below) with a loss whose ratio is
taken against the old policy (``ppo_clip``,
DAPO's clip-higher 0.2 / 0.28), once with the sampler's logprobs as the old ones
(``old_logprobs="inference"``, the behaviour before the recompute existed) and once recomputed, per
seed; both runs share the seed's warm start. It prints the train-reward curves (trailing mean of 3
steps), ``rl/clip_frac``, and the held-out pass@1 at the end (32 tasks x 8 samples).

    PYTHONPATH=. python benchmarks/old_logprobs_bench.py --curves --recipes default --steps 120 --seeds 0 1

The figures belong on a quiet machine: the cost is a ratio of wall times.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from recipes import load_recipe  # noqa: E402

from rljax.run.trainer import Trainer  # noqa: E402


def _rows(workdir: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def cost(recipe: str, steps: int) -> None:
    c = load_recipe(recipe)
    c.trainer.update(num_steps=steps, old_logprobs="recompute", eval_every=0, checkpoint_every=0)
    c.warmstart.num_steps = min(c.warmstart.num_steps, 20)  # the cost does not depend on the warm start
    with tempfile.TemporaryDirectory() as tmp:
        Trainer(c, tmp).run()
        rows = [r for r in _rows(pathlib.Path(tmp)) if "time/policy_logprobs_s" in r][1:]
    recompute = np.array([r["time/policy_logprobs_s"] for r in rows])
    step = np.array([r["time/step_s"] for r in rows])
    train = np.array([r["time/train_s"] for r in rows])
    print(
        f"{recipe}: recompute {recompute.mean():.2f} s of a {step.mean():.2f} s step "
        f"({100 * recompute.sum() / step.sum():.1f}% of the step, {100 * recompute.sum() / train.sum():.1f}% "
        f"of its training), {len(rows)} steps after the first",
        flush=True,
    )


def curves(recipe: str, steps: int, seeds: list[int]) -> None:
    summary = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            warm = load_recipe(recipe)
            warm.seed = seed
            warm.trainer.update(num_steps=0, checkpoint_every=1, eval_every=0)
            Trainer(warm, root / "warm").run()  # the seed's warm start, shared by both modes
            for mode in ("inference", "recompute"):
                c = load_recipe(recipe)
                c.seed = seed
                clip = dict(eps_low=0.2, eps_high=0.28)
                c.algorithm = dict(name="grpo", policy_loss="ppo_clip", policy_loss_kwargs=clip)
                c.warmstart.num_steps = 0
                c.model.hf_path = ""
                c.trainer.update(num_steps=steps, old_logprobs=mode, eval_every=steps, checkpoint_every=0)
                t = Trainer(c, root / mode)
                t.parts.load_policy(root / "warm" / "checkpoints", 0)
                start = time.perf_counter()
                t.run()
                wall = time.perf_counter() - start
                rows = [r for r in _rows(root / mode) if "reward/mean" in r]
                reward = np.array([r["reward/mean"] for r in rows])
                trail = np.convolve(reward, np.ones(3) / 3, mode="valid")
                clip_frac = np.mean([r.get("rl/clip_frac", np.nan) for r in rows])
                held_out = [r for r in _rows(root / mode) if "eval/pass@1" in r][-1]["eval/pass@1"]
                every_10 = np.round(trail[::10], 3).tolist()
                print(f"seed {seed} {mode}: reward (trailing 3) every 10 steps {every_10}")
                summary.append((seed, mode, float(trail[-1]), held_out, float(clip_frac), wall))
    print("seed  old_logprobs  final reward  held-out pass@1  mean clip_frac  wall s")
    for seed, mode, final, held, cf, wall in summary:
        print(f"{seed:>4}  {mode:>12}  {final:12.3f}  {held:15.3f}  {cf:14.4f}  {wall:6.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost", action="store_true")
    p.add_argument("--curves", action="store_true")
    p.add_argument("--recipes", nargs="+", default=["default", "smollm2_cpu"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    a = p.parse_args()
    if a.cost:
        for recipe in a.recipes:
            cost(recipe, a.steps)
    if a.curves:
        curves(a.recipes[0], a.steps, a.seeds)
    if not (a.cost or a.curves):
        p.error("pass --cost and/or --curves")


if __name__ == "__main__":
    main()
