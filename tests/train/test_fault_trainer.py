"""Faults of a launched ``rljax train`` run that it must survive without hanging or corrupting
anything (the smoke recipe, 3 sync steps, a checkpoint every step):

* ``kill -9`` in the middle of a weight sync and in the middle of a checkpoint write
  (``RLJAX_FAULT``), then ``--resume``: metrics, rollout records and the final parameters equal an
  uninterrupted run's; every step is logged once (no prompt lost or trained twice);
* the disk full while a checkpoint is written (``enospc_during_checkpoint_write``): the save fails
  with a clear error, ``latest`` still names an intact checkpoint, and the run stops
  (``trainer.on_save_error="stop"``; a ``--resume`` then finishes it exactly) or goes on
  (``"continue"``: the failure is counted, the results are unchanged);
* an env whose calls hang or raise in 10% of cases (``fault_envs.FlakyLookup``): every such
  episode is counted and masked (never trained on), and the run ends although threads of hung
  calls are still sleeping;
* an env that hangs with no deadline: the watchdog ends the run with status 75 and a report of
  the stuck threads, the rollout and the engine.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from tolerances import MEASURED_METRIC_PREFIXES, TIMING_INDEPENDENT_ENGINE_FLAGS
from xla_flags import subprocess_env

from rljax.report.records import ROLLOUTS_DIR, read_rollout_records
from rljax.run.watchdog import EXIT_STALLED
from rljax.training import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.subprocess]

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
NUM_STEPS = 3
RUN_TIMEOUT_S = 600  # a hang guard only
BASE = (
    "--config=smoke",
    f"--config.trainer.num_steps={NUM_STEPS}",
    "--config.trainer.mode=sync",
    "--config.trainer.save_rollouts_every=1",
    "--config.trainer.keep_checkpoints=3",
    *TIMING_INDEPENDENT_ENGINE_FLAGS,  # runs compared bit for bit (tests/tolerances.py)
)
FLAKY = (
    "--config.envs.lookup.env=fault_envs:FlakyLookup",
    "--config.envs.lookup.tasks=rljax.envs.tool_lookup:make_lookup_tasks",
    "--config.warmstart.num_steps=0",
    "--config.trainer.prompts_per_step=4",
    "--config.trainer.eval_every=0",
)


def launch(workdir: pathlib.Path, *extra: str, fault: str | None = None, env: dict | None = None):
    """Runs ``rljax train`` to its end; returns ``(exit status, output, seconds)``."""
    variables = subprocess_env(
        CI="true",
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        **({ckpt.FAULT_ENV: fault} if fault else {}),
        **(env or {}),
    )
    cmd = [sys.executable, "-m", "rljax", "train", *BASE, f"--workdir={workdir}", *extra]
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    return proc.returncode, proc.stdout, time.monotonic() - start


def rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    """A metrics row without the wall-clock and resident-memory measurements."""
    return {k: v for k, v in row.items() if not k.startswith(MEASURED_METRIC_PREFIXES)}


def rollouts(workdir: pathlib.Path) -> dict[int, list[dict]]:
    return {
        int(p.stem.split("_")[1]): read_rollout_records(p)
        for p in (workdir / ROLLOUTS_DIR).glob("step_*.jsonl")
    }


def final_params(workdir: pathlib.Path) -> list[np.ndarray]:
    r = ckpt.restore(workdir / "checkpoints", step=NUM_STEPS)
    return [np.asarray(x) for x in jax.tree.leaves(r.params)]


def assert_same_run(got: pathlib.Path, want: pathlib.Path) -> None:
    """Every step logged once, with the uninterrupted run's values, records and final parameters."""
    a, b = rows(got), rows(want)
    assert [r["step"] for r in a] == list(range(1, NUM_STEPS + 1))
    assert [deterministic(r) for r in a] == [deterministic(r) for r in b]
    assert rollouts(got) == rollouts(want)
    for x, y in zip(final_params(got), final_params(want), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    wd = tmp_path_factory.mktemp("reference") / "run"
    code, out, _ = launch(wd)
    assert code == 0, out[-3000:]
    return wd


@pytest.mark.parametrize(
    ("fault", "committed"),
    [
        # version 2 is first served to evaluate step 2 (eval_every=2), before step 2's checkpoint
        ("kill_during_weight_sync:2", 1),
        ("kill_during_checkpoint_write:2", 1),  # step_2 written by orbax, not sealed
    ],
)
def test_kill9_mid_sync_or_mid_checkpoint_write_then_resume_is_exact(reference, tmp_path, fault, committed):
    wd = tmp_path / "run"
    code, out, _ = launch(wd, fault=fault)
    assert code == -signal.SIGKILL, out[-3000:]
    assert ckpt.latest_step(wd / "checkpoints") == committed
    assert ckpt.verify(wd / "checkpoints")
    assert ckpt.checkpoint_steps(wd / "checkpoints")[-1] == committed  # step_2 incomplete: not listed
    code, out, _ = launch(wd, "--resume")
    assert code == 0, out[-3000:]
    assert f"resumed from step {committed}" in out
    assert_same_run(wd, reference)


def test_disk_full_stops_the_run_clearly_and_resume_finishes_it(reference, tmp_path):
    wd = tmp_path / "run"
    code, out, _ = launch(wd, fault="enospc_during_checkpoint_write:2")
    assert code == 1, out[-3000:]
    assert "CheckpointSaveError: saving checkpoint step_2" in out
    assert "No space left on device" in out and "`latest` still names step_1" in out
    directory = wd / "checkpoints"
    assert ckpt.latest_step(directory) == 1 and ckpt.verify(directory, 1)
    assert not (directory / "step_2").exists()  # the partial step was removed
    assert [r["step"] for r in rows(wd)] == [1, 2]  # step 2's row was written before its checkpoint
    code, out, _ = launch(wd, "--resume")
    assert code == 0, out[-3000:]
    assert "resumed from step 1" in out
    assert_same_run(wd, reference)


def test_disk_full_with_on_save_error_continue_trains_on(reference, tmp_path):
    wd = tmp_path / "run"
    code, out, _ = launch(
        wd, "--config.trainer.on_save_error=continue", fault="enospc_during_checkpoint_write:2"
    )
    assert code == 0, out[-3000:]
    assert "checkpoint step_2 NOT saved" in out and "No space left on device" in out
    assert ckpt.checkpoint_steps(wd / "checkpoints") == [0, 1, 3]
    assert ckpt.latest_step(wd / "checkpoints") == NUM_STEPS
    got, want = rows(wd), rows(reference)
    assert [r.get("checkpoint/save_errors") for r in got] == [None, None, 1.0]  # counted after the failure
    got[-1].pop("checkpoint/save_errors")
    assert [deterministic(r) for r in got] == [deterministic(r) for r in want]


def test_an_env_that_hangs_or_raises_in_10_percent_of_calls(tmp_path):
    wd = tmp_path / "run"
    log = tmp_path / "faults.txt"
    code, out, seconds = launch(
        wd, *FLAKY, "--config.rollout.env_timeout_s=2", env={"RLJAX_FAULT_ENV_LOG": str(log)}
    )
    # the run ended (status 0) although the threads of the hung calls sleep for an hour
    assert code == 0, out[-3000:]
    faults = [line.split() for line in log.read_text().splitlines()]
    hung = {task for kind, task, _ in faults if kind == "hang"}
    raised = {task for kind, task, _ in faults if kind == "raise"}
    assert hung and raised  # both kinds happened in this run
    # one log line per faulty trajectory (its first fault ends it): each is counted as errored
    assert sum(r["rollout/num_errored"] for r in rows(wd)) == len(faults)
    records = [r for step in rollouts(wd).values() for r in step]
    errored = {r["trajectory_id"].split("#")[0] for r in records if r["errored"]}
    # every episode that failed after a model call, and only those, has errored records (one that
    # failed in reset made no call, so it has none)
    assert errored == {task for _, task, call in faults if call != "reset"}
    for r in records:
        if r["errored"]:  # never trained on
            assert not r["trained"] and set(r["loss_mask"]) == {0} and r["reward"] == 0.0
    print(f"\nflaky env run: {len(hung)} hung / {len(raised)} raising tasks, {seconds:.1f}s")


def test_a_stalled_run_is_ended_by_the_watchdog_with_a_report(tmp_path):
    wd = tmp_path / "run"
    code, out, seconds = launch(
        wd,
        "--config.envs.lookup.env=fault_envs:HangingLookup",
        "--config.envs.lookup.tasks=rljax.envs.tool_lookup:make_lookup_tasks",
        "--config.warmstart.num_steps=0",
        "--config.rollout.env_timeout_s=3600",  # no deadline saves it
        "--config.trainer.stall_timeout_s=20",
    )
    assert code == EXIT_STALLED, out[-3000:]
    idle = float(re.search(r"rljax watchdog: no progress for ([0-9.]+)s", out).group(1))
    assert idle >= 20  # printed to 0.1 s: a value just over the timeout reads as 20.0
    assert "last progress: 'step 1: waiting for its rollout'" in out
    assert (
        "policy: EmbeddedSampler, weight_version 0" in out and "lookup: env fault_envs:HangingLookup" in out
    )
    assert 'thread "rljax-env-step"' in out and "time.sleep(HANG_S)" in out  # the stuck env calls
    assert "asyncio task(s) of rollout_worker loop" in out
    assert "in _episode" in out  # the trajectories' await chains: inside their episodes
    (report,) = (wd / "logs").glob("stall_*.txt")
    assert "no progress for" in report.read_text()
    print(
        f"\nwatchdog: fired after {idle:.1f}s without progress (stall_timeout_s=20); run took {seconds:.1f}s"
    )
