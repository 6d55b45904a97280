"""rljax.cli.eval: evaluating a checkpoint without training reproduces the trainer's own eval rows.

Principle of the comparison: the trainer evaluates the weights of step N (``theta_N``, the weights
it then checkpoints as ``step_N``) with the scheduler's eval rollout, whose request seeds derive only
from the config seed and (task id, sample, turn), and the embedded sampler gives a request the same
completion alone or inside any batch. ``rljax eval`` restores ``theta_N`` bit for bit and runs
that same eval, so every ``eval/*`` metric must be EQUAL (not close) to the row the trainer logged
at step N; a wrong step, a fresh (unrestored) model or other seeds would break the equality.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from recipes import load_recipe
from xla_flags import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

# smoke recipe, with more eval samples than it has (2 tasks x 1) so pass@k is not all-or-nothing
OVERRIDES = {"envs.lookup.num_eval_tasks": 4, "eval.group_size": 4, "eval.pass_k": (1, 2, 4)}


def _config():
    c = load_recipe("smoke")
    c.envs.lookup.num_eval_tasks = 4
    c.eval.update(group_size=4, pass_k=(1, 2, 4))
    return c


def _flags() -> list[str]:
    return [f"--config.{k}={v}" for k, v in OVERRIDES.items()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step smoke run: evals after steps 2 and 3, checkpoints step_2 and step_3 kept."""
    from rljax.run.trainer import Trainer

    workdir = tmp_path_factory.mktemp("run")
    Trainer(_config(), workdir).run()
    rows = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rows[int(rec["step"])] = {k: v for k, v in rec.items() if k.startswith("eval/")}
    assert sorted(s for s, r in rows.items() if r) == [2, 3]
    return workdir, rows


def _assert_equal_evals(got: dict, logged: dict) -> None:
    assert set(got) == set(logged)
    for k in ("eval/pass@1", "eval/pass@4", "eval/lookup/pass@1", "eval/reward_mean"):
        assert k in got
    for k, v in logged.items():
        assert got[k] == v, f"{k}: rljax.cli.eval {got[k]!r} != trainer {v!r}"


@pytest.mark.subprocess
def test_launch_eval_cli_reproduces_the_logged_eval(run, tmp_path):
    workdir, rows = run
    out = tmp_path / "eval.json"
    env = subprocess_env()
    r = subprocess.run(
        [sys.executable, "-m", "rljax", "eval", "--config=smoke", f"--checkpoint={workdir}",
         f"--metrics_out={out}", *_flags()],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["step"] == 3 and record["checkpoint"].endswith("step_3")  # the latest checkpoint
    assert record["num_eval_tasks"] == 4 and record["group_size"] == 4
    _assert_equal_evals(record["metrics"], rows[3])
    assert "eval/pass@1" in r.stdout and str(out) in r.stdout


def test_evaluate_checkpoint_of_a_step_dir(run):
    from rljax.run.evaluate import evaluate_checkpoint

    workdir, rows = run
    record = evaluate_checkpoint(_config(), workdir / "checkpoints" / "step_2")
    assert record["step"] == 2
    _assert_equal_evals(record["metrics"], rows[2])


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    from rljax.training.checkpoint import resolve_checkpoint

    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        resolve_checkpoint(tmp_path)


@pytest.mark.subprocess
def test_cli_needs_checkpoint():
    r = subprocess.run(
        [sys.executable, "-m", "rljax", "eval", "--config=smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "--checkpoint" in r.stderr + r.stdout
