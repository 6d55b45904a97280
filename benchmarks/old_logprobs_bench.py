"""Recomputing the old (proximal) policy's logprobs: its cost per step and what it changes in learning.

``--cost``: for each recipe named, a short run with ``trainer.old_logprobs="recompute"`` (forced: the
default recipes' dppo does not read the old policy) prints the seconds of each step spent in the
recompute (``time/policy_logprobs_s``) against the step's seconds (``time/step_s``), as a percentage,
over the steps after the first (which compiles).

    PYTHONPATH=. python benchmarks/old_logprobs_bench.py --cost --recipes default smollm2_cpu --steps 4

``--curves``: a recipe (the first of ``--recipes``) with a loss whose ratio is taken against the old
policy (``ppo_clip``, DAPO's clip-higher 0.2 / 0.28), in ``trainer.mode="async"`` by default (each step
trains on samples of the previous version: the case the recompute exists for; in ``sync`` mode with a
float32 sampler the sampler's logprobs ARE the old policy's and the arms coincide). Arms, per seed,
sharing the seed's warm start: the sampler's logprobs as the old ones (``old_logprobs="inference"``,
the behaviour before the recompute existed), recomputed, and recomputed with token TIS (cap 2, as
the GPU recipes). It prints the train-reward curves (trailing mean of 3 steps), ``rl/clip_frac``,
``off_policy/is_ratio_mean`` and the held-out pass@1 at the end (32 tasks x 8 samples).

    PYTHONPATH=. python benchmarks/old_logprobs_bench.py --curves --recipes default --steps 40 --seeds 0 1

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


#: The arms of ``--curves``: the old logprobs and the off-policy correction of each.
ARMS = {
    "inference": ("inference", None),
    "recompute": ("recompute", None),
    "recompute+tis": ("recompute", dict(tis_ratio_type="token", token_tis_ratio_clip_high=2.0)),
}


def _arm_config(recipe: str, seed: int, steps: int, mode: str, arm: str) -> Any:
    """The recipe with ppo_clip (DAPO's 0.2 / 0.28) in ``mode``, the arm's old logprobs and correction,
    and no warm start of its own (the seed's shared one is loaded)."""
    old_logprobs, correction = ARMS[arm]
    c = load_recipe(recipe)
    c.seed = seed
    clip = dict(eps_low=0.2, eps_high=0.28)
    c.algorithm = dict(name="grpo", policy_loss="ppo_clip", policy_loss_kwargs=clip)
    if correction:
        c.objective.off_policy = correction
    c.warmstart.num_steps = 0
    c.model.hf_path = ""
    c.trainer.update(num_steps=steps, mode=mode, old_logprobs=old_logprobs, eval_every=steps)
    c.trainer.checkpoint_every = 0
    return c


def curves(recipe: str, steps: int, seeds: list[int], mode: str, arms: list[str]) -> None:
    summary = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            warm = load_recipe(recipe)
            warm.seed = seed
            warm.trainer.update(num_steps=0, checkpoint_every=1, eval_every=0)
            Trainer(warm, root / "warm").run()  # the seed's warm start, shared by every arm
            for arm in arms:
                t = Trainer(_arm_config(recipe, seed, steps, mode, arm), root / arm)
                t.parts.load_policy(root / "warm" / "checkpoints", 0)
                start = time.perf_counter()
                t.run()
                wall = time.perf_counter() - start
                rows = [r for r in _rows(root / arm) if "reward/mean" in r]
                reward = np.array([r["reward/mean"] for r in rows])
                trail = np.convolve(reward, np.ones(3) / 3, mode="valid")
                clip_frac = np.mean([r.get("rl/clip_frac", np.nan) for r in rows])
                ratio = np.mean([r.get("off_policy/is_ratio_mean", np.nan) for r in rows])
                held_out = [r for r in _rows(root / arm) if "eval/pass@1" in r][-1]["eval/pass@1"]
                every_10 = np.round(trail[::10], 3).tolist()
                print(f"seed {seed} {arm}: reward (trailing 3) every 10 steps {every_10}", flush=True)
                summary.append((seed, arm, float(trail[-1]), held_out, float(clip_frac), float(ratio), wall))
    print(f"{recipe}, trainer.mode={mode}, ppo_clip 0.2 / 0.28, {steps} steps")
    print("seed  arm             final reward  held-out pass@1  mean clip_frac  mean is_ratio  wall s")
    for seed, arm, final, held, cf, ratio, wall in summary:
        print(f"{seed:>4}  {arm:<14}  {final:12.3f}  {held:15.3f}  {cf:14.4f}  {ratio:13.4f}  {wall:6.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost", action="store_true")
    p.add_argument("--curves", action="store_true")
    p.add_argument("--recipes", nargs="+", default=["default", "smollm2_cpu"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--mode", default="async", help="trainer.mode of --curves (async: one version stale)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    a = p.parse_args()
    if a.cost:
        for recipe in a.recipes:
            cost(recipe, a.steps)
    if a.curves:
        curves(a.recipes[0], a.steps, a.seeds, a.mode, a.arms)
    if not (a.cost or a.curves):
        p.error("pass --cost and/or --curves")


if __name__ == "__main__":
    main()
