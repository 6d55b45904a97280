"""Core benchmark: step-wise advantages and the default objective vs a memory floor.

Two jitted workloads, each timed against the floor ``bytes that must move at least once /
this machine's memory bandwidth`` (bandwidth measured in the same run by a large copy):

1. step-wise advantages for 16k trajectories (1-8 steps each, groups of 8): trajectory
   rewards -> grpo -> broadcast to each step's own trainable tokens (``[steps, L]``);
2. the default objective (dppo, token_mean) forward + gradient w.r.t. the train logprobs
   over ``[256, 2048]`` token arrays.

The floor counts only the arrays the math cannot avoid: for (1) the per-trajectory
rewards, group ids, the per-step trajectory ids and loss mask, and the advantages written
(measured with a fresh output buffer and with the loss-mask buffer donated as the output);
for (2) the train logprobs, inference logprobs, advantages and loss mask read, and the
gradient written. Goal: time / floor <= 3.

    python benchmarks/core_bench.py            # full sizes
    python benchmarks/core_bench.py --quick    # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import numpy as np

from rljax.core import advantages, objective
from rljax.types import PackedBatch

GOAL_RATIO = 3.0


def measure_bandwidth(num_bytes: int = 1 << 28, repeats: int = 7) -> float:
    """Bytes/s of a large memory copy (each byte read once and written once)."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def best_time(fn: Callable[[], object], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def advantage_workload(num_traj: int, group_size: int, resp_len: int, seed: int = 0):
    """Returns ``(time_fn(donate) -> seconds, floor_bytes, num_steps)``.

    With ``donate=True`` the loss-mask buffer is donated to the jitted function, so XLA writes
    the ``[steps, L]`` advantages into it instead of faulting in a fresh 75 MB buffer on every
    call (the page faults, not the math, dominate the undonated time). A fresh mask is put on
    the device before each call, outside the timed region, in both modes.
    """
    rng = np.random.default_rng(seed)
    steps_per_traj = rng.integers(1, 9, size=num_traj)
    num_steps = int(steps_per_traj.sum())
    step_traj = np.repeat(np.arange(num_traj, dtype=np.int32), steps_per_traj)
    rng.shuffle(step_traj)  # interleaved order: broadcasting must not rely on contiguity
    lengths = rng.integers(resp_len // 4, resp_len + 1, size=num_steps)
    mask = (np.arange(resp_len)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.integers(0, 2, size=num_traj).astype(np.float32)
    group_ids = (np.arange(num_traj) // group_size).astype(np.int32)
    num_groups = num_traj // group_size

    def run(rewards, group_ids, step_traj, mask):
        traj_adv = advantages.grpo(rewards, group_ids, num_groups)
        return advantages.broadcast_to_steps(traj_adv, step_traj, mask)

    fixed = tuple(jax.device_put(a) for a in (rewards, group_ids, step_traj))
    compiled = {False: jax.jit(run), True: jax.jit(run, donate_argnums=3)}

    def time_fn(donate: bool, repeats: int) -> float:
        best = float("inf")
        for i in range(repeats + 2):  # two warm-up calls (compile)
            fresh_mask = jax.device_put(mask).block_until_ready()
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[donate](*fixed, fresh_mask))
            if i >= 2:
                best = min(best, time.perf_counter() - t0)
        return best

    floor_bytes = sum(a.nbytes for a in (rewards, group_ids, step_traj, mask)) + mask.nbytes  # + output
    return time_fn, floor_bytes, num_steps


def objective_workload(rows: int, seq_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (rows, seq_len)
    sample_len = 256
    segment_ids = (np.arange(seq_len)[None, :] // sample_len + 1).repeat(rows, 0).astype(np.int32)
    loss_mask = (rng.random(shape) < 0.8).astype(np.float32)
    inference = np.log(rng.uniform(0.05, 1.0, shape)).astype(np.float32)
    logp = (inference + rng.normal(0, 0.1, shape)).clip(max=0).astype(np.float32)
    adv = rng.normal(size=shape).astype(np.float32)
    zeros = np.zeros(shape, np.float32)
    batch = PackedBatch(  # what the packer emits for a grpo mini-batch (ce/ref_kl weights all zero)
        tokens=np.zeros(shape, np.int32),
        positions=np.zeros(shape, np.int32),
        segment_ids=segment_ids,
        sample_index=np.zeros(shape, np.int32),
        group_index=np.zeros(shape, np.int32),
        loss_mask=loss_mask,
        advantages=adv,
        inference_logprobs=inference,
        old_logprobs=inference,
        ref_logprobs=zeros,
        temperatures=np.ones(shape, np.float32),
        rl_weights=np.ones(shape, np.float32),
        ce_weights=zeros,
        ref_kl_weights=zeros,
    )
    batch = jax.tree.map(jax.device_put, batch)
    config = objective.ObjectiveConfig(components=("rl",))  # what the default algorithm (grpo) trains
    counts = objective.global_counts(batch, config)

    @jax.jit
    def run(logp, batch, counts):
        return jax.value_and_grad(lambda lp: objective.objective(lp, batch, counts, config)[0])(logp)

    logp_dev = jax.device_put(logp)
    floor_bytes = 5 * logp.nbytes  # logp, inference, adv, mask read; grad written
    return (lambda: run(logp_dev, batch, counts)), floor_bytes


def report(name: str, seconds: float, floor_bytes: int, bandwidth: float) -> float:
    floor = floor_bytes / bandwidth
    ratio = seconds / floor
    verdict = "PASS" if ratio <= GOAL_RATIO else "FAIL"
    print(
        f"{name}: {seconds * 1e3:.2f} ms | floor {floor_bytes / 1e6:.1f} MB -> {floor * 1e3:.2f} ms | "
        f"time/floor {ratio:.2f} (goal <= {GOAL_RATIO:.0f}) {verdict}"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    num_traj, resp_len, rows, seq_len = (2048, 64, 32, 2048) if args.quick else (16384, 256, 256, 2048)

    bandwidth = measure_bandwidth()
    print(f"devices: {jax.devices()} | memory bandwidth (copy, read+write): {bandwidth / 1e9:.2f} GB/s")

    time_adv, adv_bytes, num_steps = advantage_workload(num_traj, 8, resp_len)
    t_plain, t_adv = time_adv(False, args.repeats), time_adv(True, args.repeats)
    print(
        f"step-wise advantages: {num_traj} trajectories, {num_steps} steps x {resp_len} tokens, groups of 8"
    )
    report("  grpo + broadcast (fresh output buffer)", t_plain, adv_bytes, bandwidth)
    report("  grpo + broadcast (mask buffer donated)", t_adv, adv_bytes, bandwidth)

    run_obj, obj_bytes = objective_workload(rows, seq_len)
    t_obj = best_time(run_obj, args.repeats)
    print(f"objective: dppo token_mean forward+grad over [{rows}, {seq_len}]")
    report("  dppo objective", t_obj, obj_bytes, bandwidth)


if __name__ == "__main__":
    main()
