"""End-to-end trainer runs on the smoke recipe: sinks, policy versions, and bit-for-bit resume.

The kill -9 tests run ``rljax train`` in a subprocess that SIGKILLs itself right after or
right before a checkpoint commits (``RLJAX_FAULT``, rljax.training.checkpoint), resume it with
``--resume`` and compare metrics.jsonl, the rollout records and TensorBoard with an uninterrupted run
of the same config: every step exactly once, with the same values (wall-clock times aside).
"""

from __future__ import annotations

import json
import math
import pathlib
import signal
import subprocess
import sys

import pytest
from recipes import load_recipe
from tensorboard_events import scalars as tb_scalars
from tolerances import MEASURED_METRIC_PREFIXES, TIMING_INDEPENDENT_ENGINE, TIMING_INDEPENDENT_ENGINE_FLAGS
from xla_flags import subprocess_env

from rljax.report.records import ROLLOUTS_DIR, read_rollout_records
from rljax.run.trainer import Trainer
from rljax.training import checkpoint as ckpt

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _smoke(**trainer):
    c = load_recipe("smoke")
    c.trainer.update(**trainer)
    c.engine.update(**TIMING_INDEPENDENT_ENGINE)  # runs compared bit for bit (tests/tolerances.py)
    return c


def _records(workdir: pathlib.Path) -> dict[int, dict]:
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[int(rec["step"])] = rec
    return out


def _deterministic(rec: dict) -> dict:
    """Everything but the wall-clock and resident-memory measurements."""
    return {k: v for k, v in rec.items() if not k.startswith(MEASURED_METRIC_PREFIXES)}


def _assert_same(a: dict, b: dict, *, skip_eval: bool = False) -> None:
    da, db = _deterministic(a), _deterministic(b)
    if skip_eval:
        da = {k: v for k, v in da.items() if not k.startswith("eval/")}
        db = {k: v for k, v in db.items() if not k.startswith("eval/")}
    assert set(da) == set(db)
    for k in da:
        x, y = da[k], db[k]
        same = x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        assert same, f"{k}: {x!r} != {y!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 4-step runs (sync and async), computed once per module."""
    out = {}
    for mode in ("sync", "async"):
        wd = tmp_path_factory.mktemp(f"ref_{mode}")
        Trainer(_smoke(num_steps=4, mode=mode), wd).run()
        out[mode] = (wd, _records(wd))
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_run_writes_sinks_checkpoints_and_versions(reference, mode):
    wd, recs = reference[mode]
    assert sorted(recs) == [1, 2, 3, 4]
    assert (wd / "metrics.png").stat().st_size > 0
    assert any((wd / "tb").iterdir())
    assert (wd / "warmstart" / "metrics.jsonl").exists()
    assert ckpt.latest_step(wd / "checkpoints") == 4
    assert ckpt.checkpoint_steps(wd / "checkpoints") == [3, 4]  # keep_checkpoints=2
    lags = [recs[s]["policy_version/lag"] for s in (1, 2, 3, 4)]
    versions = [recs[s]["policy_version/max"] for s in (1, 2, 3, 4)]
    if mode == "sync":
        assert lags == [0, 0, 0, 0] and versions == [0, 1, 2, 3]
    else:  # rollout n+1 overlaps training n: sampled with theta_n, one version stale
        assert lags == [0, 1, 1, 1] and versions == [0, 0, 1, 2]
    # eval_every=2; async mode reports an eval one step later (it runs beside the next training step)
    eval_at = {2: 2, 4: 4} if mode == "sync" else {3: 2, 4: 4}
    for s in (1, 2, 3, 4):
        if s in eval_at:
            assert recs[s]["eval/step"] == eval_at[s] and 0.0 <= recs[s]["eval/reward_mean"] <= 1.0
        else:
            assert "eval/reward_mean" not in recs[s]
    for r in recs.values():
        assert r["rollout/num_trajectories"] == 4  # 2 prompts x group 2
        assert r["optimizer_steps"] == 1
        # checkpoint_every=1: each row reports the checkpoint saved before its step (step 0's too)
        assert r["time/checkpoint_s"] > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_in_process_is_bit_for_bit(reference, tmp_path, mode):
    _, ref = reference[mode]
    Trainer(_smoke(num_steps=2, mode=mode), tmp_path).run()
    Trainer(_smoke(num_steps=4, mode=mode), tmp_path, resume=True).run()
    got = _records(tmp_path)
    assert sorted(got) == [1, 2, 3, 4]
    # the resumed process saved no checkpoint before step 3; checkpoint 3's time is in row 4
    assert "time/checkpoint_s" not in got[3] and got[4]["time/checkpoint_s"] > 0
    for s in (1, 2, 3, 4):
        # the 2-step run evaluates at its own last step (2) at once, the 4-step run reports that eval
        # one step later in async mode; everything else, and all of steps 3-4, must be identical
        _assert_same(got[s], ref[s], skip_eval=s <= 2)


def test_eval_at_start_logs_step_0_as_rljax_eval_scores_checkpoint_0(tmp_path):
    """``trainer.eval_at_start``: the starting weights' held-out eval is the row of step 0, with the
    metrics ``rljax eval`` (its own code path) computes on checkpoint ``step_0``; a resumed run does not
    evaluate its start again."""
    from rljax.run.evaluate import evaluate_checkpoint

    c = _smoke(num_steps=1, eval_at_start=True, keep_checkpoints=0)
    Trainer(c, tmp_path).run()
    recs = _records(tmp_path)
    assert sorted(recs) == [0, 1]
    assert recs[0]["eval/step"] == 0 and "loss" not in recs[0]
    record = evaluate_checkpoint(c, tmp_path / "checkpoints", step=0)
    assert record["step"] == 0
    assert {k: recs[0][k] for k in record["metrics"]} == record["metrics"]
    Trainer(_smoke(num_steps=2, eval_at_start=True, keep_checkpoints=0), tmp_path, resume=True).run()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in lines) == [0, 1, 2]  # step 0 once


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
        "--config.trainer.mode=async",
        "--config.trainer.save_rollouts_every=1",
        *TIMING_INDEPENDENT_ENGINE_FLAGS,
        *extra,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _jsonl_steps(workdir: pathlib.Path) -> list[int]:
    """The step of every line of metrics.jsonl, in file order (a step twice: logged twice)."""
    return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _rollouts(workdir: pathlib.Path) -> dict[int, list[dict]]:
    return {
        int(p.stem.split("_")[1]): read_rollout_records(p)
        for p in (workdir / ROLLOUTS_DIR).glob("step_*.jsonl")
    }


def _tensorboard(workdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows of the run's scalars, the machine's measurements left out."""
    return {k: v for k, v in tb_scalars(workdir / "tb").items() if not k.startswith(MEASURED_METRIC_PREFIXES)}


@pytest.fixture(scope="module")
def launched_reference(tmp_path_factory):
    """An uninterrupted run through the same launcher (same process setup as the killed runs)."""
    wd = tmp_path_factory.mktemp("launched_ref") / "run"
    proc = _launch(wd)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    return wd


@pytest.mark.subprocess
@pytest.mark.parametrize("point", ["kill_after_checkpoint_commit", "kill_before_checkpoint_commit"])
def test_kill9_at_the_commit_then_resume_matches_uninterrupted(launched_reference, tmp_path, point):
    """SIGKILL right after / right before checkpoint 2 commits (RLJAX_FAULT), then --resume: metrics.jsonl,
    the rollout records and TensorBoard hold every step once, equal to the uninterrupted run's."""
    ref = launched_reference
    wd = tmp_path / "run"
    killed = _launch(wd, fault=f"{point}:2")
    out, _ = killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL, out[-3000:]
    committed = 2 if point == "kill_after_checkpoint_commit" else 1
    assert ckpt.latest_step(wd / "checkpoints") == committed
    # step 2's row and records were written before its checkpoint could commit
    assert _jsonl_steps(wd) == [1, 2] and sorted(_rollouts(wd)) == [1, 2]
    resumed = _launch(wd, "--resume")
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log[-3000:]
    assert f"resumed from step {committed}" in log
    assert _jsonl_steps(wd) == [1, 2, 3, 4]
    got, want = _records(wd), _records(ref)
    for s in (1, 2, 3, 4):
        _assert_same(got[s], want[s])
    assert _rollouts(wd) == _rollouts(ref)
    shown, expected = _tensorboard(wd), _tensorboard(ref)
    assert shown.keys() == expected.keys() and [s for s, _ in shown["loss"]] == [1, 2, 3, 4]
    for tag, series in shown.items():
        steps = [s for s, _ in series]
        assert steps == sorted(set(steps)), tag  # no step twice (eval/* tags: eval steps only)
        assert series == expected[tag], tag


def _ppo(**trainer):
    c = _smoke(**trainer)
    c.algorithm = "ppo"
    c.critic.update(learning_rate=1e-3, warmup_steps=1, value_clip=0.2)
    return c


def test_ppo_trains_the_critic_and_resumes_bit_for_bit(tmp_path):
    """PPO through the trainer: critic-only warm-up step, then both updates; checkpoints hold the
    critic and its optimizer state, and a resumed run continues exactly."""
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    Trainer(_ppo(num_steps=4), ref_dir).run()
    ref = _records(ref_dir)
    assert ref[1]["optimizer_steps"] == 0 and ref[1]["critic/optimizer_steps"] == 1  # warm-up: critic only
    for s in (2, 3, 4):
        assert ref[s]["optimizer_steps"] == 1 and ref[s]["critic/optimizer_steps"] == 1
        for key in (
            "critic/value_loss",
            "critic/explained_variance",
            "critic/clip_frac",
            "critic/value_mean",
        ):
            assert math.isfinite(ref[s][key])
    Trainer(_ppo(num_steps=2), cut_dir).run()
    Trainer(_ppo(num_steps=4), cut_dir, resume=True).run()
    got = _records(cut_dir)
    for s in (3, 4):
        _assert_same(got[s], ref[s])
