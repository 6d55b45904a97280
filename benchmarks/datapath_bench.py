"""Host data-path benchmark: prefix merging, packing efficiency, validate+merge+pack throughput.

One run prints three figures, each with its goal, the ratio measured/goal and PASS/FAIL:

1. trained tokens / unique tokens of linear multi-turn trajectories (each turn's prompt is
   the previous full sequence plus an observation), unmerged and merged, for
   T = 1, 2, 4, 8, 16, 32 turns. Goal: merged <= 1.05 at T = 16 (unmerged grows ~T/2).
2. packing efficiency (real tokens / rows * seq_len) and the number of distinct
   ``[rows, seq_len]`` shapes for a heavy-tailed length mix: 2,000 samples (250 prompts x 8),
   lengths lognormal(mu=6.5, sigma=1.0) clipped to 64..8192, fixed seed, packed into
   mini-batches of 50 prompts. Goal: >= 95 % with <= 4 shapes.
3. host throughput of ``StepBatch(...)`` (validation) + ``merge_steps`` + ``make_mini_batches``
   on a realistic multi-turn batch, in rollout tokens (prompt + response of every step handed
   to the data path) per second; best of several repeats. Goal: >= 2M tokens/s. Tokens/s of
   the packed (merged) output and a single-turn batch are printed for information.

Usage: ``python benchmarks/datapath_bench.py [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rljax.data import StepBatch
from rljax.data.merge import merge_metrics, merge_steps
from rljax.data.pack import geometric_row_buckets, make_mini_batches
from rljax.types import Step

VOCAB = 151_936


def _verdict(name: str, measured: float, goal: float, *, higher_is_better: bool, fmt: str = "{:.3f}") -> bool:
    ok = measured >= goal if higher_is_better else measured <= goal
    sign = ">=" if higher_is_better else "<="
    print(
        f"  {name}: {fmt.format(measured)}  (goal {sign} {fmt.format(goal)}, ratio measured/goal "
        f"{measured / goal:.3f})  {'PASS' if ok else 'FAIL'}"
    )
    return ok


def _best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _linear_trajectory(rng: np.random.Generator, turns: int, tid: tuple[str, int], *, prompt: int,
                       obs: int, response: int) -> list[Step]:  # fmt: skip
    """Turn i's prompt = turn i-1's prompt + response + an observation."""
    steps = []
    context = rng.integers(0, VOCAB, prompt).tolist()
    for t in range(turns):
        resp = rng.integers(0, VOCAB, response).tolist()
        steps.append(
            Step(
                context,
                resp,
                tid,
                response_logprobs=(-rng.random(response)).tolist(),
                is_last_step=t == turns - 1,
            )
        )
        context = context + resp + rng.integers(0, VOCAB, obs).tolist()
    return steps


def bench_merge_ratio(quick: bool) -> bool:
    print(
        "\n[1] trained tokens / unique tokens, linear trajectories (prompt 256, observation 64, response 128)"
    )
    rng = np.random.default_rng(0)
    reps = 2 if quick else 8
    print(f"  {'T':>3} {'unmerged':>9} {'merged':>7} {'(T+1)/2-ish':>11} {'samples before->after':>22}")
    merged_at_16 = float("nan")
    for turns in (1, 2, 4, 8, 16, 32):
        steps = [s for r in range(reps) for s in _linear_trajectory(rng, turns, ("q", r), prompt=256, obs=64,
                                                                     response=128)]  # fmt: skip
        batch = StepBatch(steps, vocab_size=VOCAB)
        merged = merge_steps(batch)
        m = merge_metrics(batch, merged)
        # Unique tokens of a linear trajectory: its final turn's prompt + response (computed from the input).
        unique = sum(s.num_tokens for s in steps if s.is_last_step)
        before, after = m["trained_tokens_before_merge"] / unique, m["trained_tokens_after_merge"] / unique
        if turns == 16:
            merged_at_16 = after
        print(
            f"  {turns:>3} {before:>9.3f} {after:>7.3f} {(turns + 1) / 2:>11.1f} "
            f"{m['num_samples_before_merge']:>12} -> {m['num_samples_after_merge']}"
        )
    return _verdict("merged trained/unique at T=16", merged_at_16, 1.05, higher_is_better=False)


def bench_packing(quick: bool) -> bool:
    del quick  # fast enough to run in full
    seq_len, prompts, per_prompt, mini_batch_prompts = 8192, 250, 8, 50
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(6.5, 1.0, prompts * per_prompt)), 64, 8192).astype(np.int64)
    steps = []
    for k, n in enumerate(lengths.tolist()):
        p = max(1, int(0.3 * n))
        steps.append(Step([1] * p, [2] * (n - p), (f"p{k // per_prompt}", k % per_prompt)))
    print(
        f"\n[2] packing: {len(steps)} samples ({prompts} prompts x {per_prompt}), lognormal(6.5, 1.0) "
        f"lengths clipped to 64..8192 (mean {lengths.mean():.0f}, p50 {np.median(lengths):.0f}, "
        f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()})"
    )
    print(
        f"  seq_len={seq_len}, mini_batch_prompts={mini_batch_prompts} ({prompts // mini_batch_prompts} "
        "mini-batches), row_buckets=geometric_row_buckets(4096, ratio=r)"
    )
    ok = True
    for balance, ratio in ((True, 1.03), (False, 1.05)):
        buckets = geometric_row_buckets(4096, ratio=ratio)
        t0 = time.perf_counter()
        mbs = list(
            make_mini_batches(
                steps,
                mini_batch_prompts=mini_batch_prompts,
                seq_len=seq_len,
                row_buckets=buckets,
                balance_tokens=balance,
            )
        )
        dt = time.perf_counter() - t0
        real = sum(mb.metrics["real_tokens"] for mb in mbs)
        capacity = sum(mb.metrics["capacity_tokens"] for mb in mbs)
        shapes = sorted({mb.batch.shape for mb in mbs})
        print(
            f"  balance_tokens={balance}, ratio={ratio} ({len(buckets)} buckets; those in 40..64: "
            f"{[b for b in buckets if 40 <= b <= 64]}): "
            f"rows used {[mb.metrics['used_rows'] for mb in mbs]} -> {[mb.batch.shape[0] for mb in mbs]}, "
            f"shapes {shapes} ({dt:.2f}s)"
        )
        ok &= _verdict("  packing efficiency", real / capacity, 0.95, higher_is_better=True)
        ok &= _verdict("  distinct shapes", len(shapes), 4, higher_is_better=False, fmt="{:.0f}")
    return ok


def _realistic_batch(rng: np.random.Generator, prompts: int, reps: int) -> list[Step]:
    """Agent rollouts: 1-6 turns, first prompt 200-1500 tokens, responses 50-800, observations 20-300."""
    steps = []
    for q in range(prompts):
        for r in range(reps):
            turns = int(rng.integers(1, 7))
            context = rng.integers(0, VOCAB, int(rng.integers(200, 1500))).tolist()
            for t in range(turns):
                n = int(rng.integers(50, 800))
                resp = rng.integers(0, VOCAB, n).tolist()
                steps.append(
                    Step(
                        context,
                        resp,
                        (f"p{q}", r),
                        loss_mask=[1] * n,
                        response_logprobs=(-rng.random(n)).tolist(),
                        reward=float(rng.random()),
                        is_last_step=t == turns - 1,
                    )
                )
                context = context + resp + rng.integers(0, VOCAB, int(rng.integers(20, 300))).tolist()
    return steps


def _single_turn_batch(rng: np.random.Generator, prompts: int, reps: int) -> list[Step]:
    steps = []
    for q in range(prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(100, 600))).tolist()
        for r in range(reps):
            n = int(rng.integers(100, 1000))
            steps.append(
                Step(prompt, rng.integers(0, VOCAB, n).tolist(), (f"p{q}", r),
                     response_logprobs=(-rng.random(n)).tolist(), reward=float(r % 2))
            )  # fmt: skip
    return steps


def _time_pipeline(steps: list[Step], repeats: int, mini_batch_prompts: int) -> dict[str, float]:
    t_validate, batch = _best_of(lambda: StepBatch(steps, vocab_size=VOCAB), repeats)
    t_merge, merged = _best_of(lambda: merge_steps(batch), repeats)
    # Advantages come from the core estimators (not part of this figure); any per-token arrays will do.
    advantages = [np.full(len(s.response_ids), 0.5, np.float32) for s in merged]
    t_pack, mbs = _best_of(
        lambda: list(
            make_mini_batches(
                merged,
                mini_batch_prompts=mini_batch_prompts,
                seq_len=16384,
                advantages=advantages,
                row_buckets=geometric_row_buckets(4096, ratio=1.03),
            )
        ),
        repeats,
    )
    total = t_validate + t_merge + t_pack
    rollout_tokens = sum(s.num_tokens for s in steps)
    packed_tokens = sum(mb.metrics["real_tokens"] for mb in mbs)
    print(
        f"  {len(steps)} steps, {rollout_tokens / 1e6:.2f}M rollout tokens -> {len(merged)} samples, "
        f"{packed_tokens / 1e6:.2f}M packed tokens in {len(mbs)} mini-batches"
    )
    print(
        f"  validate {t_validate:.3f}s + merge {t_merge:.3f}s + pack {t_pack:.3f}s = {total:.3f}s; "
        f"packed output {packed_tokens / total / 1e6:.2f}M tokens/s"
    )
    return {"rollout_tps": rollout_tokens / total, "packed_tps": packed_tokens / total}


def bench_throughput(quick: bool) -> bool:
    repeats = 2 if quick else 5
    prompts = 16 if quick else 64
    rng = np.random.default_rng(0)
    print(f"\n[3] host throughput, validate + merge + pack (best of {repeats})")
    print(f"  multi-turn agent batch ({prompts} prompts x 8, 1-6 turns):")
    multi = _time_pipeline(_realistic_batch(rng, prompts, 8), repeats, mini_batch_prompts=prompts // 4)
    print(f"  single-turn batch ({prompts * 2} prompts x 16):")
    single = _time_pipeline(
        _single_turn_batch(rng, prompts * 2, 16), repeats, mini_batch_prompts=prompts // 2
    )
    ok = _verdict(
        "multi-turn rollout tokens/s", multi["rollout_tps"], 2e6, higher_is_better=True, fmt="{:,.0f}"
    )
    ok &= _verdict(
        "single-turn rollout tokens/s", single["rollout_tps"], 2e6, higher_is_better=True, fmt="{:,.0f}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer repeats")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    results = [bench_merge_ratio(args.quick), bench_packing(args.quick), bench_throughput(args.quick)]
    print(f"\n{sum(results)}/{len(results)} figures PASS ({time.perf_counter() - t0:.1f}s)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
