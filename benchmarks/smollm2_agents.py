"""A shipped recipe trained for several seeds, one run at a time: held-out curves, wall time, peak memory
and the multi-turn figures (turns, merging, where a step's time goes).

For each seed ``S`` it runs, as a user would and one process at a time::

    rljax train --config=RECIPE --config.seed=S --workdir=OUT/seedS --overwrite [--set ...]

(the recipes set ``trainer.eval_at_start``: the run's step-0 row is the held-out eval of its starting
point, the base model or the warm-started one; a run without it gets ``rljax eval`` of checkpoint
``step_0`` instead), reads ``metrics.jsonl`` and prints per seed: ``eval/pass@1`` at step 0 and at
every evaluated step with the run's elapsed time there (``time/elapsed_s``, the warm start included)
and the RL time since step 0, the first step whose pass@1 is at least ``--goal`` above step 0's,
the train process's wall time and peak RSS (its
``ru_maxrss``), and the means over the RL steps of: turns per trajectory, trained tokens after
merging vs the unmerged step-wise count (prompt + response tokens of every step), the share of
follow-up turns that merged into their trajectory's sample, and the step's seconds in the rollout
(sampling, with the environment's calls inside; their summed seconds apart), the train step and
the rest. Everything lands in ``OUT/summary.json`` too.

``--agent MODULE:FUNCTION`` runs the recipe's env as that agent through the gateway
(``config.envs.<env>.agent``), e.g. the ``smollm2_tools`` task as
``rljax.agents.calculator_agent:calculator_agent``. ``--set KEY=VALUE`` passes any
``--config.KEY=VALUE`` to both commands (a shorter run: ``--set trainer.num_steps=4``).

    python benchmarks/smollm2_agents.py --recipe smollm2_tools --seeds 0 1 --out /tmp/tools
    python benchmarks/smollm2_agents.py --recipe smollm2_tools --seeds 0 1 --out /tmp/tools_gw \\
        --agent rljax.agents.calculator_agent:calculator_agent
    python benchmarks/smollm2_agents.py --recipe smollm2_game --seeds 0 1 --out /tmp/game
    python benchmarks/smollm2_agents.py --summarize /tmp/tools/seed0   # a finished run's figures only

Needs the SmolLM2 GGUF file (``.ci/install_smollm2.sh``). The date, the CPU and the load average
before and after each run are recorded: on a shared machine the times are upper bounds.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def recipe_config(recipe: str) -> Any:
    """The config of a shipped recipe's name or a config file's path (``get_config()``)."""
    from rljax.cli.common import recipe_path

    path = pathlib.Path(recipe) if recipe.endswith(".py") else recipe_path(recipe)
    spec = importlib.util.spec_from_file_location("recipe_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def run_measured(cmd: Sequence[str], log: pathlib.Path) -> dict[str, float]:
    """Runs ``cmd`` (stdout and stderr to ``log``); its wall seconds and peak RSS in GiB (Linux
    ``ru_maxrss`` is in KiB). Raises when it fails."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}; the end of {log}:\n{tail}")
    return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20}


def figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means over the RL steps of the multi-turn figures (module docstring)."""
    steps = [r for r in rows if "rollout/num_trajectories" in r]

    def mean(f: Any) -> float:
        values = [f(r) for r in steps]
        values = [v for v in values if v is not None and np.isfinite(v)]
        return float(np.mean(values)) if values else float("nan")

    def merged_share(r: dict[str, Any]) -> float | None:
        follow_ups = r["rollout/num_steps"] - r["rollout/num_trajectories"]
        merged = r["merge/num_samples_before_merge"] - r["merge/num_samples_after_merge"]
        return merged / follow_ups if follow_ups else None

    return {
        "turns_per_trajectory": mean(lambda r: r["rollout/num_steps"] / r["rollout/num_trajectories"]),
        "trained_tokens_unmerged": mean(lambda r: r["merge/trained_tokens_before_merge"]),
        "trained_tokens_merged": mean(lambda r: r["merge/trained_tokens_after_merge"]),
        "merged_token_ratio": mean(lambda r: r["merge/merge_token_ratio"]),
        "follow_ups_merged": mean(merged_share),
        "bridged_fraction": mean(lambda r: r.get("rollout/bridged_fraction")),
        "step_s": mean(lambda r: r.get("time/step_s")),
        "rollout_s": mean(lambda r: r.get("time/rollout_s")),
        "env_calls_s": mean(lambda r: r.get("time/env_s")),
        "train_s": mean(lambda r: r.get("time/train_s")),
    }


def read_rows(workdir: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``."""
    from rljax.report.metrics import JSONL_NAME, read_jsonl

    return read_jsonl(workdir / JSONL_NAME)


def step0_eval(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's own eval of its starting point (``trainer.eval_at_start``: the row of step 0)."""
    return next((r for r in rows if r["step"] == 0 and "eval/pass@1" in r), None)


def seed_summary(rows: list[dict[str, Any]], base: dict[str, Any], goal: float) -> dict[str, Any]:
    """The held-out curve from step 0's eval ``base``, the step the goal is met and the figures.
    Times: the run's elapsed seconds (warm start included) and the RL seconds since step 0's eval."""
    start = float(base.get("time/elapsed_s", 0.0))
    curve = [(0, float(base["eval/pass@1"]), start)]
    curve += [
        (int(r["step"]), float(r["eval/pass@1"]), float(r["time/elapsed_s"]))
        for r in rows
        if "eval/pass@1" in r and r["step"] > 0
    ]
    met = next(((s, p, t) for s, p, t in curve[1:] if p >= curve[0][1] + goal), None)

    def point(s: int, p: float, t: float) -> dict[str, float]:
        return {"step": s, "pass@1": p, "elapsed_s": t, "rl_s": t - start}

    return {
        "curve": [point(*c) for c in curve],
        "goal_met": None if met is None else point(*met),
        "figures": figures(rows),
    }


def print_summary(seed: str, result: dict[str, Any], goal: float) -> None:
    """One seed's lines (module docstring)."""
    train = result.get("train")
    if train:
        load = result["load_avg_1min"]
        print(f"\nseed {seed}: train {train['wall_s'] / 60:.1f} min, peak RSS {train['peak_rss_gib']:.1f} "
              f"GiB, load {load[0]:.1f} -> {load[1]:.1f}", flush=True)  # fmt: skip
    else:
        print(f"\n{seed}:")
    points = [
        f"step {c['step']} {c['pass@1']:.3f} ({c['elapsed_s'] / 60:.1f} min, RL {c['rl_s'] / 60:.1f} min)"
        for c in result["curve"]
    ]
    print("  held-out pass@1: " + ", ".join(points))
    met = result["goal_met"]
    print(f"  +{goal} over step 0: " + ("not met" if met is None else
          f"met at step {met['step']} (RL {met['rl_s'] / 60:.1f} min)"))  # fmt: skip
    print("  " + ", ".join(f"{k} {v:.3g}" for k, v in result["figures"].items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", help="a shipped recipe's name (configs/) or config file")
    parser.add_argument(
        "--summarize", nargs="+", default=[], metavar="WORKDIR", help="finished runs' figures only"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--agent", default="", help="run the recipe's env as this agent (module:function)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--config.KEY=VALUE")
    parser.add_argument("--goal", type=float, default=0.15, help="the rise of held-out pass@1 to look for")
    parser.add_argument("--out", help="one workdir per seed under it, and summary.json")
    args = parser.parse_args()
    if args.summarize:
        for workdir in map(pathlib.Path, args.summarize):
            rows = read_rows(workdir)
            base = step0_eval(rows)
            if base is None:
                raise SystemExit(f"{workdir}: no step-0 eval row (trainer.eval_at_start was off)")
            print_summary(str(workdir), seed_summary(rows, base, args.goal), args.goal)
        return
    if not (args.recipe and args.out):
        parser.error("--recipe and --out are required (or --summarize)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"--config.{kv}" for kv in args.set]
    if args.agent:
        envs = list(recipe_config(args.recipe).envs)
        if len(envs) != 1:
            raise SystemExit(f"--agent needs a recipe with one env, {args.recipe} has {envs}")
        overrides.append(f"--config.envs.{envs[0]}.agent={args.agent}")
    rljax = [sys.executable, "-m", "rljax"]
    summary: dict[str, Any] = {
        "recipe": args.recipe,
        "agent": args.agent or None,
        "overrides": overrides,
        "date": datetime.date.today().isoformat(),
        "cpu": subprocess.run(
            ["sh", "-c", "lscpu | grep 'Model name' | cut -d: -f2"], capture_output=True, text=True
        ).stdout.strip(),  # fmt: skip
        "cpus": os.cpu_count(),
        "seeds": {},
    }
    for seed in args.seeds:
        workdir = out / f"seed{seed}"
        config = [f"--config={args.recipe}", f"--config.seed={seed}", *overrides]
        load = [os.getloadavg()[0]]
        train = run_measured(
            [*rljax, "train", *config, f"--workdir={workdir}", "--overwrite"], out / f"train{seed}.log"
        )
        rows = read_rows(workdir)
        base = step0_eval(rows)
        if base is None:  # a config without trainer.eval_at_start: rljax eval of checkpoint 0
            step0 = workdir / "checkpoints" / "step_0"
            run_measured([*rljax, "eval", *config, f"--checkpoint={step0}"], out / f"eval{seed}.log")
            base = json.loads((workdir / "eval_step_0.json").read_text())["metrics"]
        load.append(os.getloadavg()[0])
        result = {**seed_summary(rows, base, args.goal), "train": train, "load_avg_1min": load}
        summary["seeds"][str(seed)] = result
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(str(seed), result, args.goal)
    print(f"\nwrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
