"""rljax.cli.train: absl flags + ml_collections config_flags errors and workdir handling (no training)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from xla_flags import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.subprocess  # every test runs rljax train


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run(
        [sys.executable, "-m", "rljax", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--config.trainer.no_such_key=1", "no_such_key"),
        ("--config.nope.x=1", "nope"),
        ("--config.trainer.num_steps=abc", "num_steps"),
    ],
)
def test_bad_overrides_fail_with_the_key_named(tmp_path, override, needle):
    r = _run("--config=smoke", f"--workdir={tmp_path}", override)
    assert r.returncode != 0
    assert needle in r.stderr + r.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_config_is_a_usage_error():
    r = _run()
    assert r.returncode != 0 and "--config" in r.stderr + r.stdout


def test_resume_needs_workdir():
    r = _run("--config=smoke", "--resume")
    assert r.returncode != 0 and "--workdir" in r.stderr + r.stdout


def test_existing_run_is_not_overwritten(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    r = _run("--config=smoke", f"--workdir={tmp_path}")
    assert r.returncode != 0 and "--resume" in r.stderr + r.stdout
    assert (tmp_path / "checkpoints").exists()


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    r = _run("--config=smoke", f"--workdir={tmp_path}", "--resume", timeout=300)
    assert r.returncode != 0 and "no complete checkpoint" in r.stderr + r.stdout
    assert not (tmp_path / "metrics.jsonl").exists()
