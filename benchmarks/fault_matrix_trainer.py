"""The trainer's fault matrix: each fault injected into a launched ``rljax train`` run (the smoke
recipe, 3 sync steps), how long it took to be detected, and what became of the run.

Rows (``detected after``: from the fault to the run noticing it):

* ``kill -9 mid weight sync`` / ``kill -9 mid checkpoint write`` (``RLJAX_FAULT``): the process is
  gone at once (nothing to detect in-process); the outcome is whether ``--resume`` reproduces the
  uninterrupted run (metrics, rollout records, final parameters);
* ``disk full in checkpoint write`` (``enospc_during_checkpoint_write``), with
  ``trainer.on_save_error`` "stop" and "continue": from the start of the failing save to its
  error (``time/checkpoint_s`` analogue, read from the log);
* ``env hangs / raises in 10% of calls`` (``tests/train/fault_envs.py:FlakyLookup``,
  ``rollout.env_timeout_s``): a hung call is detected at its deadline; the outcome counts the
  errored (masked) trajectories and checks that the process exits although hung threads remain;
* ``agent never exits``: an ``agent_command`` that never returns, killed at its deadline with its
  children;
* ``run stalls`` (an env that hangs with no deadline): the watchdog's measured time without
  progress when it fired (``trainer.stall_timeout_s``).

    python benchmarks/fault_matrix_trainer.py [--stall_timeout_s 20] [--env_timeout_s 2]

Measured on the 2-core development machine (shared, load 5-9; 4 min 38 s in all)::

    fault                                     detected after (s)         outcome
    kill -9 mid weight sync                   0 (process gone)           latest=step_1; resume exact (28s)
    kill -9 mid checkpoint write              0 (process gone)           latest=step_1; resume exact (28s)
    disk full in checkpoint write (stop)      at once (write's error)    exit 1, latest=step_1 intact;
                                                                         --resume exact
    disk full in checkpoint write (continue)  at once (write's error)    exit 0, trained on,
                                                                         checkpoints [0, 1, 3]
    env hangs / raises in 10% of calls        2 (env_timeout_s)          exit 0 in 25s; 8 hung + 2 raising
                                                                         of 24 trajectories counted, masked
    agent process never exits                 15 (env_timeout_s)         1 of 10 timed out, its processes
                                                                         killed; rollout 15.8s
    run stalls (env hangs, no deadline)       23.4 (stall_timeout_s=20)  exit 75, report written

The watchdog checks every ``min(stall_timeout_s / 4, 5)`` s, so it fires between ``stall_timeout_s``
and ``stall_timeout_s + 5`` s after the last progress.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from rljax.training import checkpoint as ckpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAULT_ENVS = ROOT / "tests" / "train"
NUM_STEPS = 3
BASE = (
    "--config=smoke",
    f"--config.trainer.num_steps={NUM_STEPS}",
    "--config.trainer.mode=sync",
    "--config.trainer.save_rollouts_every=1",
    "--config.trainer.keep_checkpoints=3",
)


def launch(workdir: pathlib.Path, *extra: str, fault: str | None = None, env: dict | None = None):
    """``(exit status, output, seconds)`` of one ``rljax train`` run."""
    variables = {
        **os.environ,
        "CI": "true",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(FAULT_ENVS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **({ckpt.FAULT_ENV: fault} if fault else {}),
        **(env or {}),
    }
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rljax", "train", *BASE, f"--workdir={workdir}", *extra],
        cwd=ROOT, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800,
    )  # fmt: skip
    return proc.returncode, proc.stdout, time.monotonic() - start


def deterministic_rows(workdir: pathlib.Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "throughput"))} for r in rows]


def same_run(got: pathlib.Path, want: pathlib.Path) -> bool:
    """Same metrics rows (each step once), rollout records and final parameters."""
    if deterministic_rows(got) != deterministic_rows(want):
        return False
    for name in sorted(p.name for p in (want / "rollouts").glob("*.jsonl")):
        if (got / "rollouts" / name).read_text() != (want / "rollouts" / name).read_text():
            return False
    a = jax.tree.leaves(ckpt.restore(got / "checkpoints", step=NUM_STEPS).params)
    b = jax.tree.leaves(ckpt.restore(want / "checkpoints", step=NUM_STEPS).params)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def kill_and_resume(tmp: pathlib.Path, reference: pathlib.Path, fault: str) -> tuple[str, str]:
    wd = tmp / fault.split(":")[0]
    code, out, _ = launch(wd, fault=fault)
    if code != -signal.SIGKILL:
        return "-", f"NOT killed (status {code})"
    latest = ckpt.latest_step(wd / "checkpoints")
    code, out, seconds = launch(wd, "--resume")
    exact = code == 0 and same_run(wd, reference)
    verdict = "resume exact" if exact else f"resume DIFFERS (status {code})"
    return "0 (process gone)", f"latest=step_{latest}; {verdict} ({seconds:.0f}s)"


def disk_full(tmp: pathlib.Path, reference: pathlib.Path, policy: str) -> tuple[str, str]:
    wd = tmp / f"enospc_{policy}"
    code, out, _ = launch(
        wd, f"--config.trainer.on_save_error={policy}", fault="enospc_during_checkpoint_write:2"
    )
    found = "No space left on device" in out and "`latest` still names step_1" in out
    intact = ckpt.verify(wd / "checkpoints", 1)
    latest = ckpt.latest_step(wd / "checkpoints")
    if policy == "stop":
        ok = code == 1 and found and latest == 1
        code2, _, _ = launch(wd, "--resume")
        exact = code2 == 0 and same_run(wd, reference)
        outcome = f"exit {code}, latest=step_1 intact={intact}; --resume exact={exact}"
    else:
        rows = deterministic_rows(wd)
        ok = code == 0 and found and latest == NUM_STEPS and rows[-1].get("checkpoint/save_errors") == 1.0
        outcome = f"exit {code}, trained on, checkpoints {ckpt.checkpoint_steps(wd / 'checkpoints')}"
    return "at once (the write's error)", ("OK: " if ok else "FAILED: ") + outcome


def flaky_env(tmp: pathlib.Path, env_timeout_s: float) -> tuple[str, str]:
    wd, log = tmp / "flaky", tmp / "flaky_faults.txt"
    code, out, seconds = launch(
        wd,
        "--config.envs.lookup.env=fault_envs:FlakyLookup",
        "--config.envs.lookup.tasks=rljax.envs.tool_lookup:make_lookup_tasks",
        "--config.warmstart.num_steps=0",
        "--config.trainer.prompts_per_step=4",
        "--config.trainer.eval_every=0",
        f"--config.rollout.env_timeout_s={env_timeout_s}",
        env={"RLJAX_FAULT_ENV_LOG": str(log)},
    )
    faults = [line.split()[0] for line in log.read_text().splitlines()] if log.exists() else []
    rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    errored = sum(r["rollout/num_errored"] for r in rows)
    total = sum(r["rollout/num_trajectories"] for r in rows)
    ok = code == 0 and errored == len(faults)
    outcome = (
        f"{'OK' if ok else 'FAILED'}: exit {code} in {seconds:.0f}s; {faults.count('hang')} hung + "
        f"{faults.count('raise')} raising of {int(total)} trajectories counted and masked"
    )
    return f"{env_timeout_s:g} (env_timeout_s)", outcome


AGENT = """
import json, os, subprocess, sys, time, urllib.request
task = json.loads(os.environ["RLJAX_TASK"])
body = {"model": "m", "messages": [{"role": "user", "content": task["id"]}]}
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
json.load(urllib.request.urlopen(req))
if task["data"].get("hang"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    open(task["data"]["pids"], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(3600)
print(json.dumps({"reward": 1.0}))
"""


def agent_never_exits(tmp: pathlib.Path, deadline_s: float) -> tuple[str, str]:
    sys.path.insert(0, str(ROOT / "tests" / "gateway"))
    from gateway_helpers import CHATML, Scripted

    from rljax.agents import CommandAgent, agent_rollout
    from rljax.envs.base import Task
    from rljax.gateway import Gateway
    from rljax.rollout import RolloutConfig

    script, pids = tmp / "agent.py", tmp / "agent_pids.txt"
    script.write_text(AGENT)
    tasks = [Task(f"t{i}", {"hang": i == 3, "pids": str(pids)}) for i in range(10)]
    config = RolloutConfig(group_size=1, max_tokens=16, max_context_len=512, env_timeout_s=deadline_s)

    async def main():
        gateway = Gateway(CHATML)
        try:
            return await agent_rollout(
                tasks, agent=CommandAgent(f"{sys.executable} {script}"), engine=Scripted(lambda p: "ok"),
                gateway=gateway, config=config,
            )  # fmt: skip
        finally:
            await gateway.stop()

    start = time.monotonic()
    result = asyncio.run(main())
    seconds = time.monotonic() - start
    time.sleep(0.5)  # SIGKILL is immediate; the kernel needs a moment to tear the processes down
    gone = all(_state(p) in ("gone", "Z") for p in map(int, pids.read_text().split()))
    m = result.metrics
    ok = m["errored_env_timeout"] == 1 and m["num_completed"] == 9 and gone
    return (
        f"{deadline_s:g} (env_timeout_s)",
        f"{'OK' if ok else 'FAILED'}: 1 of 10 timed out, its processes killed={gone}; rollout {seconds:.1f}s",
    )


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def stall(tmp: pathlib.Path, stall_timeout_s: float) -> tuple[str, str]:
    wd = tmp / "stall"
    code, out, seconds = launch(
        wd,
        "--config.envs.lookup.env=fault_envs:HangingLookup",
        "--config.envs.lookup.tasks=rljax.envs.tool_lookup:make_lookup_tasks",
        "--config.warmstart.num_steps=0",
        "--config.rollout.env_timeout_s=3600",
        f"--config.trainer.stall_timeout_s={stall_timeout_s}",
    )
    match = re.search(r"rljax watchdog: no progress for ([0-9.]+)s", out)
    idle = float(match.group(1)) if match else float("nan")
    report = bool(list((wd / "logs").glob("stall_*.txt")))
    ok = code == 75 and report and 'thread "rljax-env-step"' in out
    return (
        f"{idle:.1f} (stall_timeout_s={stall_timeout_s:g})",
        f"{'OK' if ok else 'FAILED'}: exit {code}, report written={report}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stall_timeout_s", type=float, default=20.0)
    parser.add_argument("--env_timeout_s", type=float, default=2.0)
    parser.add_argument("--agent_timeout_s", type=float, default=15.0)
    args = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rljax_fault_matrix_"))
    reference = tmp / "reference"
    code, out, seconds = launch(reference)
    if code != 0:
        sys.exit(f"the reference run failed:\n{out[-3000:]}")
    print(f"reference run: {seconds:.0f}s ({tmp})", flush=True)
    matrix = [
        ("kill -9 mid weight sync", *kill_and_resume(tmp, reference, "kill_during_weight_sync:2")),
        ("kill -9 mid checkpoint write", *kill_and_resume(tmp, reference, "kill_during_checkpoint_write:2")),
        ("disk full in checkpoint write (stop)", *disk_full(tmp, reference, "stop")),
        ("disk full in checkpoint write (continue)", *disk_full(tmp, reference, "continue")),
        ("env hangs / raises in 10% of calls", *flaky_env(tmp, args.env_timeout_s)),
        ("agent process never exits", *agent_never_exits(tmp, args.agent_timeout_s)),
        ("run stalls (env hangs, no deadline)", *stall(tmp, args.stall_timeout_s)),
    ]
    widths = [
        max(len(row[i]) for row in [("fault", "detected after (s)", "outcome"), *matrix]) for i in range(3)
    ]
    for row in [("fault", "detected after (s)", "outcome"), tuple("-" * w for w in widths), *matrix]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
