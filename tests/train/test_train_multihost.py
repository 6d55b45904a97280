"""Multi-process training on JAX's distributed runtime, with real processes on 127.0.0.1.

Each run starts ``multihost_worker.py`` twice (2 processes x 4 CPU devices = 8 global devices,
gloo collectives) and compares with this pytest process (1 process x 8 devices, tests/conftest.py):

* 3 train steps where every process feeds half of the rows equal a 1-process run of the same
  global batches (tolerances of test_train_sharding.py);
* checkpoints saved by 2 processes (sharded, no gather) restore bit-equal in 1 process on another
  mesh, and those saved by 1 process restore bit-equal in 2;
* ``kill -9`` of one process: the survivor exits non-zero, with a clear message, within seconds
  (heartbeat timeout), whether it waits in a barrier or in a collective; a missing coordinator
  fails ``initialize`` with a clear error;
* the trainer in ``trainer.mode="fully_async"``: each process streams its own tasks, every step
  trains the same gathered batch on both, within the staleness bound, no task twice, and the
  checkpoint holds both processes' streams.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import train_fixtures as tf
from xla_flags import xla_flags

from rljax.envs.base import Task
from rljax.models import load_hf_tensors
from rljax.run.run import stored_abstract
from rljax.run.streaming import owned_tasks
from rljax.run.tasks import TaskIterator
from rljax.training import checkpoint
from rljax.training.distributed import (
    DistributedConfig,
    agree_max,
    barrier,
    initialize,
    process_share,
    reduce_metrics,
)
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import TrainState, mini_batch_counts, train_step

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
REPO = pathlib.Path(__file__).resolve().parents[2]
OBJ = tf.OBJ
CONFIG = tf.TRAIN_CONFIG  # shared with the other sharded-step tests (train_fixtures)
NUM_STEPS = 3
RUN_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
    env.update(
        XLA_FLAGS=xla_flags(4),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    return env


class Run:
    """The worker processes of one multi-process run; logs in ``out/log<i>.txt``."""

    def __init__(self, mode: str, out: pathlib.Path, *args: str, num_processes: int = 2, ids=None):
        out.mkdir(parents=True, exist_ok=True)
        self.out, port = out, free_port()
        ids = list(range(num_processes)) if ids is None else list(ids)
        self.logs = {i: out / f"log{i}.txt" for i in ids}
        self.procs = {}
        for i in ids:
            cmd = [sys.executable, str(WORKER), mode, "--port", str(port), "--process_id", str(i)]
            cmd += ["--num_processes", str(num_processes), "--out", str(out), *args]
            with open(self.logs[i], "w") as log:
                self.procs[i] = subprocess.Popen(cmd, env=worker_env(), stdout=log, stderr=subprocess.STDOUT)

    def text(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(f"--- process {i} ---\n{self.text(i)[-6000:]}" for i in self.logs)

    def wait_for(self, i: int, marker: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while marker not in self.text(i):
            if time.monotonic() > deadline or self.procs[i].poll() is not None:
                self.kill()
                pytest.fail(f"process {i} never printed {marker!r}:\n{self.all_logs()}")
            time.sleep(0.1)

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout_s
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in self.procs.values()]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"processes still running after {timeout_s}s:\n{self.all_logs()}")

    def kill(self) -> None:
        for p in self.procs.values():  # SIGKILL: JAX's preemption notifier catches SIGTERM
            if p.poll() is None:
                p.kill()
                p.wait()

    def check(self) -> None:
        rcs = self.wait()
        assert rcs == [0] * len(rcs), f"exit codes {rcs}:\n{self.all_logs()}"


def gather_npz(path: pathlib.Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    with np.load(path) as z:
        params = [z[f"p{i}"] for i in range(sum(k[0] == "p" and k[1:].isdigit() for k in z.files))]
        opt = [z[f"o{i}"] for i in range(sum(k[0] == "o" and k[1:].isdigit() for k in z.files))]
    return params, opt


def assert_bit_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def two_process_train(tmp_path_factory):
    """3 steps in 2 processes; their gathered params / opt state / metrics and a 2-process checkpoint."""
    out = tmp_path_factory.mktemp("multihost_train")
    run = Run("train", out, "--ckpt", str(out / "ckpt"))
    run.check()
    return out, run


@pytest.fixture(scope="module")
def one_process_run():
    """The same 3 steps in this process: 1 process x 8 devices, the same (2, 2, 2) mesh."""
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    history = []
    for i in range(NUM_STEPS):
        sharded = shard_batch(tf.make_batch(100 + i), mesh)
        state, metrics = train_step(state, sharded, mini_batch_counts(sharded, OBJ))
        history.append({k: float(v) for k, v in metrics.items()})
    return tf.params_numpy(state), history


@pytest.mark.subprocess
def test_two_processes_train_like_one(two_process_train, one_process_run):
    out, run = two_process_train
    want_params, want_metrics = one_process_run
    assert "SHARE [0, 1, 2, 3] MAIN True" in run.text(0)
    assert "SHARE [4, 5, 6, 7] MAIN False" in run.text(1)
    with np.load(out / "train.npz") as z:
        keys, metrics = list(z["metric_keys"]), z["metrics"]
        assert int(z["helper_agree_max"]) == 6  # max(5 + 0, 5 + 1)
        assert float(z["helper_reduce"]) == (0.0 * 1 + 1.0 * 2) / 3  # weights 1 and 2
    for step in range(NUM_STEPS):
        got = dict(zip(keys, metrics[step], strict=True))
        for key in ("loss", "loss/rl", "loss/ce", "grad_norm", "lr", "entropy", "rl/mismatch_kl"):
            np.testing.assert_allclose(got[key], want_metrics[step][key], rtol=1e-5, atol=1e-7)
        assert got["step"] == step + 1
    params, _ = gather_npz(out / "train.npz")
    assert len(params) == len(want_params)
    for got, want in zip(params, want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.subprocess
@pytest.mark.parametrize("collective", ["all_gather", "ring"])
def test_two_processes_with_context_parallelism_train_like_one(tmp_path, collective):
    """mesh (data=2, context=2, tensor=2) over 2 processes x 4 devices equals 1 process x 8 devices
    (all-gathered keys in this process; the workers all-gather them too, or pass them in a ring)."""
    run = Run("context", tmp_path, "--collective", collective)
    mesh = make_mesh(data=2, context=2, tensor=2)
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    want = []
    for i in range(2):
        sharded = shard_batch(tf.make_batch(100 + i), mesh)
        state, metrics = train_step(state, sharded, mini_batch_counts(sharded, OBJ))
        want.append({k: float(v) for k, v in metrics.items()})
    run.check()
    with np.load(tmp_path / "context.npz") as z:
        keys, metrics = list(z["metric_keys"]), z["metrics"]
    for step in range(2):
        got = dict(zip(keys, metrics[step], strict=True))
        for key in ("loss", "loss/rl", "loss/ce", "grad_norm", "entropy"):
            np.testing.assert_allclose(got[key], want[step][key], rtol=1e-5, atol=1e-7)
    params, _ = gather_npz(tmp_path / "context.npz")
    for got, want_p in zip(params, tf.params_numpy(state), strict=True):
        np.testing.assert_allclose(got, want_p, rtol=1e-5, atol=1e-6)


@pytest.mark.subprocess
def test_weights_for_vllm_written_by_both_processes(two_process_train):
    """``write_distributed``: each host gathers one whole parameter at a time and writes the ones
    dealt to it; together the files equal the single-process HF state dict bit for bit, and the
    probe logprobs (from the sharded model) equal a host copy's."""
    out, run = two_process_train
    lines = [line for i in (0, 1) for line in run.text(i).splitlines() if line.startswith("HF_FILES ")]
    files = [ast.literal_eval(line.split("HF_FILES ", 1)[1]) for line in lines]
    assert len(files) == 2 and files[0] and files[1] and not set(files[0]) & set(files[1])
    on_disk = sorted(p.name for p in (out / "hf").glob("*.safetensors"))
    assert sorted(files[0] + files[1]) == on_disk
    got = load_hf_tensors(out / "hf")
    with np.load(out / "hf_ref.npz") as z:
        want = {k[2:]: z[k] for k in z.files if k.startswith("t:")}
        np.testing.assert_allclose(z["expected"], z["local_logprobs"], rtol=0, atol=2e-5)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.subprocess
def test_checkpoints_move_between_one_and_two_processes(two_process_train, tmp_path):
    out, _ = two_process_train
    saved_params, saved_opt = gather_npz(out / "train.npz")
    # 2 processes -> 1 process, onto another mesh
    mesh = make_mesh(fsdp=4, tensor=2)
    target = TrainState.create(tf.make_model(1), CONFIG, mesh=mesh)
    restored = checkpoint.restore(out / "ckpt", params=target.params, opt_state=target.opt_state)
    assert restored.step == NUM_STEPS and restored.data_state == {"pos": NUM_STEPS}
    assert restored.config == {"processes": 2}
    assert jax.random.key_data(restored.rng).tolist() == jax.random.key_data(jax.random.key(7)).tolist()
    leaf = jax.tree.leaves(restored.params)[0]
    assert leaf.sharding == jax.tree.leaves(target.params)[0].sharding
    assert_bit_equal([np.asarray(x) for x in jax.tree.leaves(restored.params)], saved_params)
    assert_bit_equal([np.asarray(x) for x in jax.tree.leaves(restored.opt_state)], saved_opt)
    # 1 process -> 2 processes (saved from the fsdp=4 x tensor=2 mesh, restored onto (2, 2, 2))
    one = tmp_path / "ckpt_1proc"
    checkpoint.save(
        one, NUM_STEPS, params=restored.params, opt_state=restored.opt_state, data_state={"pos": 9}
    )
    run = Run("restore", tmp_path / "restore", "--ckpt", str(one))
    run.check()
    params, opt = gather_npz(tmp_path / "restore" / "restore.npz")
    assert_bit_equal(params, saved_params)
    assert_bit_equal(opt, saved_opt)
    with np.load(tmp_path / "restore" / "restore.npz") as z:
        assert int(z["step"]) == NUM_STEPS and int(z["pos"]) == 9


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "victim, wait",
    [(1, "barrier"), (1, "collective"), (0, "collective")],
    ids=["worker_dies_coordinator_in_barrier", "worker_dies_in_collective", "coordinator_dies"],
)
def test_killed_peer_fails_the_survivor_fast(tmp_path, victim, wait):
    heartbeat_s = 10
    run = Run(
        "fault", tmp_path, "--victim", str(victim), "--wait", wait, "--heartbeat_timeout_s", str(heartbeat_s)
    )
    survivor = 1 - victim
    try:
        run.wait_for(victim, "READY", RUN_TIMEOUT_S)
        run.wait_for(survivor, "WAITING", RUN_TIMEOUT_S)
        time.sleep(1.0)  # the survivor is blocked in the barrier / collective
        os.kill(run.procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            rc = run.procs[survivor].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the survivor still runs 60 s after its peer was killed:\n{run.all_logs()}")
        elapsed = time.monotonic() - killed
    finally:
        run.kill()
    log = run.text(survivor)
    assert rc != 0, log
    assert elapsed < 60, elapsed
    assert elapsed < 2 * heartbeat_s + 10, (elapsed, log)  # detected by heartbeats, not a long timeout
    clear = (
        "another task died" in log  # JAX terminates survivors (SIGABRT) when a peer stops heartbeating
        or f"barrier 'fault_test' failed on process {survivor}" in log  # rljax barrier's RuntimeError
        or "SURVIVOR_ERROR" in log
    )
    assert clear, log
    assert "UNEXPECTED" not in log


@pytest.mark.subprocess
def test_initialize_without_coordinator_fails_clearly(tmp_path):
    run = Run("connect", tmp_path, "--initialization_timeout_s", "3", ids=[1])
    start = time.monotonic()
    (rc,) = run.wait(timeout_s=120)
    log = run.text(1)
    assert rc == 3, log
    assert "INIT_ERROR jax.distributed.initialize failed (process 1 of 2, coordinator 127.0.0.1:" in log
    assert "could not reach the coordinator 127.0.0.1:" in log and "initialization_timeout_s=3s" in log
    assert time.monotonic() - start < 60


def test_single_process_helpers_and_config_validation():
    assert initialize(DistributedConfig(num_processes=1)) is False
    assert [len(process_share(7, process_index=i, process_count=3)) for i in range(3)] == [3, 2, 2]
    assert list(process_share(2, process_index=3, process_count=4)) == []
    assert agree_max(-3) == -3
    assert reduce_metrics({"a": 1.5}, weights=0.0) == {"a": pytest.approx(float("nan"), nan_ok=True)}
    barrier("single", timeout_s=1)
    with pytest.raises(ValueError, match="coordinator_address must be 'host:port'"):
        DistributedConfig(coordinator_address="localhost")
    with pytest.raises(ValueError, match="cpu_collectives must be one of"):
        DistributedConfig(cpu_collectives="nccl")
    with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive int"):
        DistributedConfig(heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match="process_index must be an int in \\[0, 2\\)"):
        process_share(4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="weights must be a finite float >= 0"):
        reduce_metrics({"a": 1.0}, weights=-1.0)
    # JAX already runs in this process: a multi-process initialize must refuse clearly
    assert jax.device_count() == 8
    with pytest.raises(RuntimeError, match="must run before any JAX computation"):
        initialize(DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0))


@pytest.mark.integration
@pytest.mark.subprocess
def test_fully_async_streams_per_process_and_trains_one_gathered_batch(tmp_path):
    """2 processes, smoke recipe, embedded samplers, ``max_off_policy_steps=1``, 4 prompts per step (2
    from each process's stream), 3 steps, an eval at step 2, checkpoints at steps 0, 2 and 3."""
    run = Run("stream", tmp_path)
    run.check()
    k, steps, group_size = 1, 3, 2
    got = [json.loads((tmp_path / f"stream_p{i}.json").read_text()) for i in (0, 1)]
    assert got[0]["steps"] == got[1]["steps"] == [1, 2, 3]
    # one batch per step, equal on both processes: the same samples, tokens and staleness
    assert got[0]["taken"] == got[1]["taken"]
    taken = got[0]["taken"]
    train = got[0]["train"]
    index = {task: i for i, task in enumerate(train)}  # process p owns train[p::2]
    assert [t["step"] for t in taken] == list(range(steps))
    trained_by: list[list[list[str]]] = [[], []]  # process -> step -> its groups' task ids
    for t in taken:
        groups = list(dict.fromkeys(task for task, _, _, _ in t["samples"]))
        trajectories = {(task, rep) for task, rep, _, _ in t["samples"]}
        assert len(groups) == 4 and len(trajectories) == 4 * group_size
        # process order: the first 2 groups are process 0's, drawn from its own tasks (even indices)
        assert [index[g] % 2 for g in groups] == [0, 0, 1, 1], groups
        trained_by[0].append(groups[:2])
        trained_by[1].append(groups[2:])
        assert all(0 <= stale <= k for _, _, _, stale in t["samples"]), t["samples"]
    trained = [g for by in trained_by for gs in by for g in gs]
    assert len(trained) == len(set(trained))  # no task twice, across steps and processes
    # the rows' stream metrics are the gathered batch's, equal on both processes
    for r0, r1 in zip(got[0]["rows"], got[1]["rows"], strict=True):
        same = {key for key in r0 if key != "async/train_tokens_per_s"}  # per process: its step time
        assert {key: r0[key] for key in same} == {key: r1[key] for key in same}
        assert r0["policy_version/lag"] <= k and r0["async/staleness_max"] <= k
        assert r0["rollout/num_trajectories"] == 4 * group_size
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["optimizer_steps"] >= 1 for r in rows)
    assert 0.0 <= rows[1]["eval/reward_mean"] <= 1.0  # the eval beside both streams, gathered
    # checkpoint 2 holds both streams: each process's draws are the groups it trained in steps 1-2
    # plus its untrained ones (numbered i * 2 + p), which step 3 trains
    directory = tmp_path / "run" / "checkpoints"
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # saved over 2 processes' devices
    abstract = {
        item: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
            stored_abstract(directory, 2, item),
        )
        for item in ("params", "opt_state")
    }
    stream = checkpoint.restore(directory, **abstract, step=2).data_state["tasks"]
    assert stream["process_count"] == 2 and len(stream["processes"]) == 2
    for p, state in enumerate(stream["processes"]):
        outstanding = [task for task, _, _ in state["outstanding"]]
        assert all(number % 2 == p for _, number, _ in state["outstanding"])
        order = TaskIterator(owned_tasks([Task(t) for t in train], p, 2), seed=got[0]["seed"])
        drawn = [order.take(1)[0].id for _ in range(state["next_draw"])]
        assert sorted(trained_by[p][0] + trained_by[p][1] + outstanding) == sorted(drawn)
        assert set(outstanding) <= set(trained_by[p][2])
