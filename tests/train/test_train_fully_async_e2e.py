"""``trainer.mode = "fully_async"`` end to end on the smoke recipe (embedded sampler): the stream's
metrics in the sinks, the staleness bound, and ``kill -9`` + ``--resume`` losing no prompt and
training none twice."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import pytest
from recipes import load_recipe
from tensorboard_events import scalars as tb_scalars
from xla_flags import subprocess_env

from rljax.report.records import ROLLOUTS_DIR, read_rollout_records
from rljax.run.config import parse_run_config
from rljax.run.run import stored_abstract
from rljax.run.tasks import TaskIterator, build_env_tasks
from rljax.run.trainer import Trainer
from rljax.training import checkpoint as ckpt

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

STREAM_KEYS = (
    "async/staleness_mean",
    "async/staleness_min",
    "async/staleness_max",
    "async/staleness_inflight_mean",
    "async/staleness_queue_mean",
    "async/groups_inflight",
    "async/groups_queued",
    "async/groups_dropped_stale",
    "async/groups_dropped_no_variance",
    "async/draws_pending",
    "async/draws_skipped",
    "async/engine_idle_fraction",
    "async/rollout_tokens_per_s",
    "async/train_tokens_per_s",
    "async/inflight_updates",
)


def _rows(workdir: pathlib.Path) -> dict[int, dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {int(r["step"]): r for r in map(json.loads, lines)}


def test_fully_async_trains_within_the_bound_and_logs_the_stream(tmp_path):
    c = load_recipe("smoke")
    c.trainer.update(num_steps=4, mode="fully_async", max_off_policy_steps=2, checkpoint_every=0)
    # tokens 2 versions behind the trained weights are masked by the per-token stale mask
    c.objective.off_policy = {"max_token_staleness": 1}
    history = Trainer(c, tmp_path).run()
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    rows, shown = _rows(tmp_path), tb_scalars(tmp_path / "tb")
    for s in (1, 2, 3, 4):
        r = rows[s]
        assert r["rollout/num_trajectories"] == 4 and r["optimizer_steps"] == 1
        for key in STREAM_KEYS:
            assert key in r, key
        assert 0 <= r["async/staleness_min"] <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2
        assert r["policy_version/lag"] <= 2 and r["async/groups_dropped_stale"] == 0
        assert 0.0 <= r["async/engine_idle_fraction"] <= 1.0
        total = r["async/staleness_inflight_mean"] + r["async/staleness_queue_mean"]
        assert total == pytest.approx(r["async/staleness_mean"])
        # the packed batch's per-token staleness agrees with the scheduler's: some tokens are masked
        # exactly when some trained token is 2 versions stale
        assert (r["off_policy/stale_masked_frac"] > 0) == (r["async/staleness_max"] == 2)
    assert rows[1]["async/staleness_max"] == 0  # nothing was published before step 1
    assert [s for s, _ in shown["async/staleness_mean"]] == [1, 2, 3, 4]  # every sink has them
    assert 0.0 <= rows[2]["eval/reward_mean"] <= 1.0  # eval_every=2 runs beside the stream


def test_fully_async_over_few_tasks_trains_every_step(tmp_path):
    """6 tasks, 4 prompts per step, bound 1: up to 8 groups may be live, so every task is drawn
    again while its previous group is still running or waiting (the stream defers those draws; one
    step trains one group per task). All 12 steps train, within the bound, without a stale drop."""
    c = load_recipe("smoke")
    c.envs.lookup.update(num_train_tasks=6, num_eval_tasks=0)
    c.warmstart.num_steps = 0
    c.trainer.update(
        num_steps=12, mode="fully_async", prompts_per_step=4, max_off_policy_steps=1,
        checkpoint_every=0, eval_every=0, stall_timeout_s=300,  # a stall ends the run, loudly
    )  # fmt: skip
    history = Trainer(c, tmp_path).run()
    assert [h["step"] for h in history] == list(range(1, 13))
    rows = _rows(tmp_path)
    for s in range(1, 13):
        r = rows[s]
        assert r["rollout/num_trajectories"] == 8 and r["optimizer_steps"] == 1
        assert r["async/staleness_max"] <= 1 and r["policy_version/lag"] <= 1
        assert r["async/groups_dropped_stale"] == 0
        assert r["async/staleness_inflight_mean"] >= 0 and r["async/staleness_queue_mean"] >= 0


def _launch(workdir: pathlib.Path, *extra: str, fault: str | None = None) -> subprocess.Popen:
    env = subprocess_env(CI="true", **({ckpt.FAULT_ENV: fault} if fault else {}))
    cmd = [
        sys.executable,
        "-m",
        "rljax",
        "train",
        "--config=smoke",
        f"--workdir={workdir}",
        "--config.trainer.num_steps=4",
        "--config.trainer.mode=fully_async",
        "--config.trainer.save_rollouts_every=1",
        *extra,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _trained_tasks(workdir: pathlib.Path) -> dict[int, list[str]]:
    """Per row, the task ids its rollout trained (one per prompt group)."""
    out = {}
    for p in (workdir / ROLLOUTS_DIR).glob("step_*.jsonl"):
        ids = {r["trajectory_id"].rsplit("#", 1)[0] for r in read_rollout_records(p)}
        out[int(p.stem.split("_")[1])] = sorted(ids)
    return out


@pytest.mark.subprocess
def test_kill9_after_a_checkpoint_then_resume_loses_no_prompt_and_trains_none_twice(tmp_path):
    wd = tmp_path / "run"
    killed = _launch(wd, fault="kill_after_checkpoint_commit:2")
    out, _ = killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL, out[-3000:]
    assert ckpt.latest_step(wd / "checkpoints") == 2
    before = _trained_tasks(wd)
    assert sorted(before) == [1, 2]
    restored = ckpt.restore(
        wd / "checkpoints",
        params=stored_abstract(wd / "checkpoints", 2, "params"),
        opt_state=stored_abstract(wd / "checkpoints", 2, "opt_state"),
        step=2,
    )
    stream = restored.data_state["tasks"]
    outstanding = [task_id for task_id, _, _ in stream["outstanding"]]
    assert len(outstanding) >= 2  # the groups started on theta_1 (k=1, 2 prompts per step) at least
    resumed = _launch(wd, "--resume")
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log[-3000:]
    assert "resumed from step 2" in log
    after = _trained_tasks(wd)
    assert sorted(after) == [1, 2, 3, 4] and all(len(ids) == 2 for ids in after.values())
    trained = [t for s in (1, 2, 3, 4) for t in after[s]]
    assert len(trained) == len(set(trained))  # none twice (16 tasks: one epoch holds every draw)
    # nothing lost: the checkpoint's draws are the trained ones plus the outstanding ones, and every
    # outstanding draw trains after the resume (k=1: due by the next two steps)
    cfg = parse_run_config(restored.config)
    order = TaskIterator(build_env_tasks(cfg).train, seed=cfg.seed)
    drawn = [order.take(1)[0].id for _ in range(stream["next_draw"])]
    assert sorted(before[1] + before[2] + outstanding) == sorted(drawn)
    assert set(outstanding) <= set(after[3] + after[4])
    assert [json.loads(line)["step"] for line in (wd / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
    ]
