"""End-to-end trainer throughput: synchronous vs asynchronous (overlapped) rollouts, in one run.

Runs the default recipe (tiny model, embedded sampler, lookup task; warm start, eval and
checkpoints off) for ``--steps`` RL steps in ``sync`` mode and then in ``async`` mode
(rollout of step n+1 overlaps training of step n, ``max_off_policy_steps=1``) and prints
samples/s (trajectories per second, first ``--skip`` steps excluded: they compile) and the
async/sync ratio. The goal is >= 1.6x when generation and training take similar time; the script
prints both times per step so that balance is visible.

On CPU, XLA runs each computation on all cores by default, so generation and training would
fight for the same cores. ``--single_thread_xla`` (default on) pins each XLA computation to one
thread in BOTH modes, so async mode can use one core for generation and one for training: the
comparison is between the same kernels, run one after the other or side by side.

    python benchmarks/e2e_bench.py --steps 8
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="first steps excluded from the timing (compilation)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--single_thread_xla", type=int, default=1)
    args = p.parse_args()
    if args.single_thread_xla:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from configs import default
    from rljax.train.trainer import Trainer

    results = {}
    for mode in ("sync", "async"):
        c = default.get_config()
        c.warmstart.num_steps = 0
        c.trainer.update(
            num_steps=args.steps, mode=mode, eval_every=0, checkpoint_every=0, prompts_per_step=args.prompts
        )
        c.rollout.group_size = args.group_size
        with tempfile.TemporaryDirectory() as wd:
            hist = Trainer(c, wd).run()
        timed = hist[args.skip :]
        wall = (
            hist[-1]["time/elapsed_s"] - hist[args.skip - 1]["time/elapsed_s"]
            if args.skip
            else hist[-1]["time/elapsed_s"]
        )
        samples = sum(h["rollout/num_trajectories"] for h in timed)
        gen = sum(h["time/rollout_s"] for h in timed) / len(timed)
        train = sum(h["time/train_s"] for h in timed) / len(timed)
        results[mode] = samples / wall
        print(
            f"{mode:>5}: {samples / wall:8.2f} samples/s  (rollout {gen:.2f}s, train {train:.2f}s per step, "
            f"{len(timed)} timed steps, {wall:.1f}s)",
            flush=True,
        )
    print(f"async/sync samples/s ratio: {results['async'] / results['sync']:.2f}x (goal >= 1.6x)")


if __name__ == "__main__":
    main()
