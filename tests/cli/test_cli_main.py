"""The ``rljax`` command: subcommand dispatch, ``--version``, recipes by name, and its errors."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

import rljax
from rljax.cli import common, main

RECIPES = pathlib.Path(__file__).resolve().parents[2] / "configs"  # the one copy of the recipes


def test_version_agrees_with_the_package_metadata(capsys):
    assert rljax.__version__ == importlib.metadata.version("rljax")
    assert main.main(["rljax", "--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rljax {rljax.__version__}"


def test_usage_lists_every_subcommand_and_recipe(capsys):
    assert main.main(["rljax"]) == 2  # no subcommand: usage on stdout, non-zero
    out = capsys.readouterr().out
    for name in ("train", "eval", "serve", "view", "export", "make-dataset"):
        assert f"  {name} " in out
    assert "smoke" in out and "default" in out
    assert main.main(["rljax", "--help"]) == 0


def test_unknown_subcommand_and_unknown_recipe_are_one_line_errors(capsys):
    assert main.main(["rljax", "trian"]) == 2
    assert "unknown subcommand 'trian'" in capsys.readouterr().err
    assert main.main(["rljax", "train", "--config=no_such_recipe"]) == 2
    err = capsys.readouterr().err
    assert "no recipe named 'no_such_recipe'" in err and "smoke" in err


def test_recipe_names_are_the_shipped_files():
    files = sorted(p.stem for p in RECIPES.glob("*.py") if p.stem != "__init__")
    assert common.recipe_names() == files
    assert {"default", "smoke", "reasoning_gym", "vllm_local", "qwen3_gpu", "tinker"} <= set(files)


@pytest.mark.parametrize(
    "args, want",
    [
        (["--config=smoke"], [f"--config={RECIPES / 'smoke.py'}"]),
        (["--config", "default"], ["--config", str(RECIPES / "default.py")]),
        (["--config=smoke:arg"], [f"--config={RECIPES / 'smoke.py'}:arg"]),  # config-file arguments kept
        (["--config=my.py", "--config.seed=3"], ["--config=my.py", "--config.seed=3"]),  # a file stays
        (["--config=./dir/x.py"], ["--config=./dir/x.py"]),
        (["--config.trainer.num_steps=2"], ["--config.trainer.num_steps=2"]),  # overrides untouched
    ],
)
def test_config_names_resolve_to_recipe_files(args, want, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    (tmp_path / "my.py").write_text("")
    (tmp_path / "dir" / "x.py").write_text("")
    assert common.resolve_config_args(["rljax train", *args]) == ["rljax train", *want]


@pytest.mark.parametrize("value", ["missing.py", "./dir/missing.py", "/no/such/dir/x.py"])
def test_a_config_path_that_does_not_exist_is_named(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"^--config={value}: no config file '{value}'"):
        common.resolve_config_args(["rljax train", f"--config={value}"])


def test_an_existing_file_named_like_a_recipe_wins(tmp_path, monkeypatch):
    (tmp_path / "smoke").write_text("")
    monkeypatch.chdir(tmp_path)
    assert common.resolve_config_args(["x", "--config=smoke"]) == ["x", "--config=smoke"]


@pytest.mark.subprocess
def test_python_dash_m_rljax_is_the_same_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rljax", "--version"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == f"rljax {rljax.__version__}", r.stderr


@pytest.mark.integration
@pytest.mark.subprocess
def test_ctrl_c_stops_a_run_with_one_line_naming_the_checkpoint_to_resume(tmp_path):
    """SIGINT (Ctrl-C) during training: exit 130, no traceback, one line naming the latest checkpoint,
    and that checkpoint is intact (``--resume`` continues from it: the resume tests cover the rest)."""
    import json
    import signal
    import time

    from xla_flags import subprocess_env

    from rljax.training import checkpoint as ckpt

    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rljax", "train", "--config=smoke", f"--workdir={workdir}",
           "--config.trainer.num_steps=1000"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(CI="true"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job gets it
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # step 2 logged
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    step = ckpt.latest_step(workdir / "checkpoints")
    assert step is not None and step >= 1  # the smoke recipe checkpoints every step
    assert json.loads(metrics.read_text().splitlines()[1])["step"] == 2
    said = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert said == [f"interrupted: the latest checkpoint is step_{step} in {workdir / 'checkpoints'}; the "
                    "same command with --resume continues from it"], err  # fmt: skip
