"""The top-level ``launch/``: the absl launch scripts are ``rljax <sub>`` (same output, same errors),
and the cluster templates (SLURM, Kubernetes, one multi-GPU machine) render to commands whose config
keys exist and whose placement parses as a run config (a dry render: nothing is submitted)."""

from __future__ import annotations

import ast
import os
import pathlib
import runpy
import shlex
import stat
import subprocess
import sys

import pytest
import yaml

from rljax.cli import main
from rljax.cli.common import config_overrides, unknown_override
from rljax.run.config import default_config, parse_run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"


def _script(capsys, monkeypatch, name: str, *args: str) -> tuple[int, str, str]:
    """``python launch/<name>.py <args>``, run in this process (runpy: the file, as __main__)."""
    monkeypatch.setattr(sys, "argv", [f"launch/{name}.py", *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(LAUNCH / f"{name}.py"), run_name="__main__")
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def _rljax(capsys, *args: str) -> tuple[int, str, str]:
    code = main.main(["rljax", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_launch_train_is_rljax_train(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    args = ["--dry-run", "--config.trainer.num_steps=5", f"--workdir={tmp_path}/run"]
    launched = _script(capsys, monkeypatch, "train", "--config=configs/smoke.py", *args)
    command = _rljax(capsys, "train", "--config=smoke", *args)
    assert launched == command and launched[0] == 0
    assert "  trainer.num_steps = 5\n" in launched[1] and "builds:" in launched[1]
    mistake = ["--config=configs/smoke.py", "--config.model.remat=sometimes"]
    assert _script(capsys, monkeypatch, "train", *mistake) == _rljax(capsys, "train", *mistake)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["train", "eval", "serve", "export"])
def test_each_launch_script_is_its_subcommand(capsys, monkeypatch, name):
    assert _script(capsys, monkeypatch, name, "--help") == _rljax(capsys, name, "--help")


def _dict_with(config, overrides: dict[str, str]):
    """``config`` (a ConfigDict) as a dict, with ``--config.<key>=<value>`` overrides applied (values as
    Python literals, else strings)."""
    raw = config.to_dict()
    for key, text in overrides.items():
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        node, *path = [raw, *key.split(".")]
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return raw


def _check_command(argv: list[str], *, model: str, servers: tuple[str, ...], fsdp: int) -> dict[str, str]:
    """The rendered ``rljax train`` argv: its config keys exist, and its engine / mesh settings parse as
    a run config on the GPU recipe (the model path set to a stand-in: no checkpoint is read)."""
    assert argv[:2] == ["rljax", "train"]
    flags = dict(a[2:].split("=", 1) for a in argv[2:] if a.startswith("--") and "=" in a)
    overrides = {k.removeprefix("config."): v for k, v in flags.items() if k.startswith("config.")}
    assert unknown_override(default_config(), config_overrides(argv)) is None
    assert flags["config.model.hf_path"] == flags["config.tokenizer.name"] == model
    assert ast.literal_eval(flags["config.engine.server_devices"]) == servers
    assert int(flags["config.engine.num_servers"]) == len(servers)
    assert int(flags["config.mesh.fsdp"]) == fsdp
    from rljax.recipes import qwen3_gpu

    cfg = parse_run_config(_dict_with(qwen3_gpu.get_config(), overrides))
    assert cfg.engine.server_devices == servers and cfg.mesh.size == fsdp
    return flags


def _fake_scontrol(tmp_path: pathlib.Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a01\\ngpu-a02\\n"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_slurm_template_renders_one_command_per_node(tmp_path):
    env = {
        **os.environ,
        **_fake_scontrol(tmp_path),
        "RLJAX_DRY_RUN": "1",
        "MODEL_PATH": "/ckpts/Qwen3-0.6B",
        "WORKDIR": str(tmp_path / "run"),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu-a[01-02]",
        "SLURM_GPUS_ON_NODE": "8",
    }
    script = LAUNCH / "slurm" / "train.sbatch"

    def render(*extra: str) -> list[list[str]]:
        r = subprocess.run(["bash", str(script), *extra], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return [shlex.split(line) for line in r.stdout.splitlines()]

    commands = render("--config.trainer.num_steps=10")
    assert len(commands) == 2
    for rank, argv in enumerate(commands):
        flags = _check_command(argv, model="/ckpts/Qwen3-0.6B", servers=("4", "5", "6", "7"), fsdp=8)
        assert flags["coordinator_address"] == "gpu-a01:12355" and flags["num_processes"] == "2"
        assert argv[-1] == f"--process_id={rank}" and flags["workdir"] == str(tmp_path / "run")
        assert "--config.trainer.num_steps=10" in argv and "--resume" not in argv
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a requeued job resumes
    assert all("--resume" in argv for argv in render())
    env["VLLM_GPUS_PER_NODE"] = "8"
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must exceed VLLM_GPUS_PER_NODE" in r.stderr


def test_multi_gpu_script_puts_servers_on_the_last_gpus(tmp_path):
    env = {**os.environ, "RLJAX_DRY_RUN": "1", "MODEL_PATH": "/m", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env.pop("NUM_GPUS", None)
    script = str(LAUNCH / "multi_gpu.sh")
    r = subprocess.run(["bash", script, "--workdir=/runs/x"], env={**env, "VLLM_GPUS": "1"},
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    _check_command(argv, model="/m", servers=("3",), fsdp=3)
    assert argv[-1] == "--workdir=/runs/x"


@pytest.mark.subprocess
def test_kubernetes_template_renders_an_indexed_job(tmp_path):
    r = subprocess.run(
        [sys.executable, str(LAUNCH / "kubernetes" / "render.py"), "--name=rl-q3", "--image=reg/rljax:1",
         "--model_path=/data/models/Qwen3-0.6B", "--nodes=3", "--pvc=rl-data", "--vllm_gpus_per_node=1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "${" not in r.stdout
    service, job = yaml.safe_load_all(r.stdout)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "rl-q3"
    (container,) = pod["containers"]
    argv = [*container["command"], *container["args"]]
    flags = _check_command(argv, model="/data/models/Qwen3-0.6B", servers=("7",), fsdp=21)
    assert flags["coordinator_address"] == "rl-q3-0.rl-q3:12355" and flags["num_processes"] == "3"
    assert flags["process_id"] == "$(JOB_COMPLETION_INDEX)" and flags["workdir"] == "/data/runs/rl-q3"
    env = {e["name"]: e for e in container["env"]}
    assert "job-completion-index" in env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "rl-data"
