"""Train step time of one global batch on 8 CPU devices: 1 process x 8 vs 2 processes x 4 (gloo).

For each mesh (default: data-parallel ``8,1,1`` and the tests' ``2,2,2``) one run starts, one after
the other (never concurrently), two jobs that train the same model on the same global batches:

* ``1 x 8``: one process with ``--xla_force_host_platform_device_count=8``;
* ``2 x 4``: two processes with 4 devices each, joined by :func:`rljax.training.distributed.initialize`
  (gloo CPU collectives over 127.0.0.1), each feeding its half of the rows.

Each job prints the median / best time of the jitted train step, the CPU time (user / system) of
its processes per step, the host-side placement of a batch (``shard_batch`` +
``mini_batch_counts``), a bare all-reduce of a gradient-sized float32 buffer (bandwidth) and of
one float (latency) over the 8 devices, and the collectives in the compiled step. The summary
gives the 2 x 4 / 1 x 8 ratio of the median step (goal <= 1.3x) and where the difference goes.

Findings (2-core shared CPU machine, ~5M-parameter model, 8 x 512 tokens): data parallel
``8,1,1`` ~1.2x (PASS: 16 collectives, the gradient all-reduce ~+50 ms); ``2,2,2`` ~1.6x (FAIL:
116 collectives, FSDP all-gathers and tensor-parallel all-reduces every layer). With gloo every
device is a gloo rank (its log: "Rank r is connected to 7 peer ranks"), and the traffic goes
through TCP sockets: the processes' system CPU time per step grows ~4x (0.6 s -> 2.3 s) and, on a machine
whose cores are all busy with compute, that CPU is taken from the step. Across real hosts with
their own cores (and NCCL / ICI on accelerators) this contention does not exist; on CPU hosts
prefer data parallelism across processes.

Usage::

    python benchmarks/multihost_bench.py [--quick] [--mesh 8,1,1 2,2,2] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import socket
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RATIO_GOAL = 1.3
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short rows (smoke run)")
    p.add_argument(
        "--mesh",
        nargs="+",
        default=["8,1,1", "2,2,2"],
        help="data,fsdp,tensor over the 8 devices; several meshes are compared one after the other",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per job")
    p.add_argument("--rows", type=int, default=8, help="rows of the global batch")
    p.add_argument("--seq-len", type=int, default=None, help="row length (default 512; --quick 64)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    p.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for both jobs' processes")
    # internal: one process of a job
    p.add_argument("--role", choices=["parent", "single", "worker"], default="parent", help=argparse.SUPPRESS)
    p.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# One process of a job
# ------------------------------------------------------------------------------------------------


def run_job(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    from rljax.training import distributed

    if args.role == "worker":
        distributed.initialize(
            distributed.DistributedConfig(
                coordinator_address=f"127.0.0.1:{args.port}",
                num_processes=2,
                process_id=args.process_id,
                cpu_collectives="gloo",
                initialization_timeout_s=120,
                shutdown_timeout_s=60,
            )
        )
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from rljax.core.objective import ObjectiveConfig
    from rljax.data.pack import pack
    from rljax.models import Decoder, ModelConfig, num_params
    from rljax.training.optimizer import OptimizerConfig
    from rljax.training.sharding import make_mesh, shard_batch
    from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step
    from rljax.types import Step

    if args.quick:
        cfg = ModelConfig(
            model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True,
        )  # fmt: skip
    else:
        cfg = ModelConfig(
            model_type="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4,
            num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True, tie_word_embeddings=True,
        )  # fmt: skip
    seq_len = args.seq_len or (64 if args.quick else 512)
    data, fsdp, tensor = (int(x) for x in args.mesh[0].split(","))
    mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    config = TrainConfig(
        objective=ObjectiveConfig(),
        optimizer=OptimizerConfig(learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0),
        chunk_size=max(256, args.rows * seq_len // 4),
    )
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    n_params = num_params(model)
    state = TrainState.create(model, config, mesh=mesh)
    del model

    def global_batch(seed: int):
        rng = np.random.default_rng(seed)
        steps = []
        for i in range(2 * args.rows):  # two samples per row
            prompt, response = seq_len // 8, seq_len // 2 - seq_len // 8
            steps.append(
                Step(
                    prompt_ids=rng.integers(0, cfg.vocab_size, prompt).tolist(),
                    response_ids=rng.integers(0, cfg.vocab_size, response).tolist(),
                    trajectory_id=(f"q{i // 4}", i % 4),
                    response_logprobs=np.log(rng.uniform(1e-4, 1e-3, response)).tolist(),
                )
            )
        advantages = [np.full(len(s.response_ids), rng.normal(), np.float32) for s in steps]
        return pack(steps, seq_len=seq_len, advantages=advantages, row_buckets=[args.rows]).batch

    rows = distributed.process_share(args.rows)

    def place(batch):
        local = jax.tree.map(lambda x: np.asarray(x)[rows.start : rows.stop], batch)
        sharded = shard_batch(local, mesh)
        return sharded, mini_batch_counts(sharded, config.objective)

    host_batches = [global_batch(seed) for seed in range(2)]
    placed = [place(b) for b in host_batches]
    t0 = time.perf_counter()
    compiled = train_step.lower(state, *placed[0]).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    collectives = {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in COLLECTIVES}

    state, metrics = train_step(state, *placed[0])  # warm-up
    jax.block_until_ready((state, metrics))
    step_times, place_times = [], []
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(args.steps):
        t0 = time.perf_counter()
        batch, counts = place(host_batches[i % 2])
        jax.block_until_ready((batch, counts))
        place_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch, counts)
        jax.block_until_ready((state, metrics))
        step_times.append(time.perf_counter() - t0)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    loss = float(metrics["loss"])

    # bare all-reduces over all 8 devices: a gradient-sized buffer (bandwidth) and 1 float (latency)
    def time_all_reduce(floats_per_device: int) -> list[float]:
        row_sharded = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "tensor")))
        mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        shards = [jax.device_put(np.ones((1, floats_per_device), np.float32), d) for d in mine]
        x = jax.make_array_from_single_device_arrays((8, floats_per_device), row_sharded, shards)
        replicated = NamedSharding(mesh, PartitionSpec())
        reduce = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=replicated)
        jax.block_until_ready(reduce(x))
        times = []
        for _ in range(max(args.steps, 10)):
            t0 = time.perf_counter()
            jax.block_until_ready(reduce(x))
            times.append(time.perf_counter() - t0)
        return times

    n = n_params  # every device holds a full gradient: the data-parallel all-reduce
    reduce_times, latency_times = time_all_reduce(n), time_all_reduce(1)

    return {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "params": n_params,
        "tokens": args.rows * seq_len,
        "compile_s": compile_s,
        "step_s": step_times,
        "cpu_user_s": (cpu1.ru_utime - cpu0.ru_utime) / args.steps,  # per step, this process
        "cpu_sys_s": (cpu1.ru_stime - cpu0.ru_stime) / args.steps,
        "place_s": place_times,
        "all_reduce_s": reduce_times,
        "all_reduce_floats": n,
        "latency_s": latency_times,
        "collectives": collectives,
        "loss": loss,
    }


# ------------------------------------------------------------------------------------------------
# Parent: the two jobs and the summary
# ------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    args: argparse.Namespace, mesh: str, devices: int, roles: list[tuple[str, int]], port: int
) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {args.xla_flags}".strip(),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    forwarded = ["--mesh", mesh, "--steps", str(args.steps), "--rows", str(args.rows)]
    forwarded += ["--quick"] if args.quick else []
    forwarded += ["--seq-len", str(args.seq_len)] if args.seq_len else []
    procs = []
    for role, pid in roles:
        cmd = [sys.executable, __file__, "--role", role, "--process_id", str(pid), "--port", str(port)]
        procs.append(
            subprocess.Popen(
                cmd + forwarded, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=args.timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"job process failed (exit {p.returncode}):\n{err[-4000:]}")
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: JAX's preemption notifier catches SIGTERM
                p.wait()
    return results


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _summary(name: str, results: list[dict]) -> dict:
    # processes are synchronized by the step's collectives: take the slowest process's numbers
    step = max(_median(r["step_s"]) for r in results)
    best = max(min(r["step_s"]) for r in results)
    place = max(_median(r["place_s"]) for r in results)
    reduce = max(_median(r["all_reduce_s"]) for r in results)
    latency = max(_median(r["latency_s"]) for r in results)
    user = sum(r["cpu_user_s"] for r in results)  # CPU seconds per step, all processes
    system = sum(r["cpu_sys_s"] for r in results)
    r0 = results[0]
    tok_s = r0["tokens"] / step
    print(
        f"{name}: step {1e3 * step:8.1f} ms median ({1e3 * best:.1f} best, {tok_s:,.0f} tok/s) | "
        f"place batch {1e3 * place:6.1f} ms | all-reduce of {r0['all_reduce_floats'] * 4 / 2**20:.1f} MiB "
        f"{1e3 * reduce:6.1f} ms, of 1 float {1e3 * latency:.2f} ms | compile {r0['compile_s']:.1f} s | "
        f"loss {r0['loss']:+.5f}\n    CPU per step (all processes; batch placement included): "
        f"user {user:.2f} s, system {system:.2f} s"
    )
    return {
        "step": step,
        "place": place,
        "reduce": reduce,
        "latency": latency,
        "user": user,
        "system": system,
        "collectives": r0["collectives"],
        "loss": r0["loss"],
    }


def compare(args: argparse.Namespace, mesh: str) -> None:
    one = _summary("1 process  x 8 devices", _launch(args, mesh, 8, [("single", 0)], 0))
    workers = [("worker", 0), ("worker", 1)]
    two = _summary("2 processes x 4 devices", _launch(args, mesh, 4, workers, _free_port()))
    ops = ", ".join(f"{k} {v}" for k, v in one["collectives"].items() if v)
    print(f"collectives in the compiled step (both jobs: the same program): {ops}")
    ratio = two["step"] / one["step"]
    verdict = "PASS" if ratio <= RATIO_GOAL else "FAIL"
    print(f"ratio 2x4 / 1x8 (median step): {ratio:.2f}x  goal <= {RATIO_GOAL}x  {verdict}")
    delta = two["step"] - one["step"]
    comm, place = two["reduce"] - one["reduce"], two["place"] - one["place"]
    count = sum(one["collectives"].values())
    latency = count * (two["latency"] - one["latency"])
    same = abs(one["loss"] - two["loss"]) < 1e-4
    print(
        f"overhead: {1e3 * delta:+.1f} ms per step. Across processes (gloo over TCP vs in-process) a "
        f"gradient-sized all-reduce costs {1e3 * comm:+.1f} ms more, and {count} collectives x the extra "
        f"latency of a 1-float all-reduce ~ {1e3 * latency:+.1f} ms; CPU time per step "
        f"{one['user'] + one['system']:.2f} s -> {two['user'] + two['system']:.2f} s (system "
        f"{one['system']:.2f} -> {two['system']:.2f} s: TCP copies and gloo I/O threads take cores from "
        f"compute when both processes share them); host batch placement {1e3 * place:+.1f} ms (outside "
        f"the step); losses equal: {same}"
    )


def main() -> None:
    args = parse_args()
    if args.role != "parent":
        print("RESULT " + json.dumps(run_job(args)), flush=True)
        return
    seq_len = args.seq_len or (64 if args.quick else 512)
    print(
        f"{args.rows} rows x {seq_len} tokens per global batch; {args.steps} timed steps; "
        f"{os.cpu_count()} CPU cores; jobs run one after the other"
    )
    t0 = time.perf_counter()
    for mesh in args.mesh:
        print(f"\n== mesh (data, fsdp, tensor) = ({mesh})")
        compare(args, mesh)
    print(f"total bench time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
