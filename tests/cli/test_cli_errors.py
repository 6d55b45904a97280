"""Every command-line or config mistake is ONE line on stderr and exit status 2, found before anything
is touched: the workdir is not created, an old run survives a failed ``--overwrite``; ``--dry-run``
checks and describes a run without a workdir; ``rljax <sub> --help`` lists the subcommand's flags.

In-process (``rljax.cli.main.main`` with an argv): a launched ``rljax`` pays seconds of imports per
call, so one subprocess test checks the real exit status and stderr of the console script.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest
from xla_flags import subprocess_env

from rljax import extras
from rljax.cli import main
from rljax.run.placement import MEM_FRACTION_ENV

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _process_state(monkeypatch):
    """What a subcommand may change in this process is put back: the root logger's handlers (absl
    adds its own), the trainer's memory-share variable and JAX's visible-GPU option."""
    import jax

    handlers = list(logging.root.handlers)
    monkeypatch.delenv(MEM_FRACTION_ENV, raising=False)
    visible = jax.config.read("jax_cuda_visible_devices")
    yield
    logging.root.handlers[:] = handlers
    jax.config.update("jax_cuda_visible_devices", visible)


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main.main(["rljax", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    return lines[0]


@pytest.fixture(scope="module")
def config_files(tmp_path_factory):
    """Config files with mistakes of their own (Python errors, a wrong type, a key of no section)."""
    d = tmp_path_factory.mktemp("configs")
    head = "from rljax.recipes import smoke\n\ndef get_config():\n    c = smoke.get_config()\n"
    files = {
        "syntax": "def get_config(:\n    pass\n",
        "name": head + "    c.trainer.num_steps = undefined_name\n    return c\n",
        "type": head + "    c.trainer.seq_len = 'long'\n    return c\n",
        "extra_key": head + "    c.trainer.seqlen = 5\n    return c\n",
    }
    for name, text in files.items():
        (d / f"{name}.py").write_text(text)
    return d


# (arguments after --config=smoke, what the line must say); each mistake is caught before the workdir
SMOKE_MISTAKES = [
    (["--config.model.remat=sometimes"],
     "config.model.remat: expected one of ['none', 'full', 'dots_saveable'], got 'sometimes'"),
    (["--config.trainer.num_stpes=2"], "config.trainer.num_stpes: unknown key; did you mean 'num_steps'?"),
    (["--config.nope.x=1"], "config.nope: unknown key; known keys of config: ["),
    (["--config.trainer.num_steps=abc"], "config.trainer.num_steps: expected an int, got 'abc'"),
    (["--config.trainer.merge=maybe"], "config.trainer.merge: expected True or False, got 'maybe'"),
    (["--config.trainer.seq_len=0"], "config.trainer.seq_len: expected an int >= 1, got 0"),
    (["--config.trainer.mini_batch_prompts=3"], "config.trainer.mini_batch_prompts: 3 does not divide"),
    (["--config.trainer.prompts_per_step=64"], "config.trainer.prompts_per_step=64 exceeds the 16 train"),
    (["--config.model.router_replay=r3"], "config.model.router_replay='r3' replays MoE routing"),
    (["--config.model.hf_path=/no/such/model"], "config.model.hf_path: no such file or directory"),
    (["--config.tokenizer.name=/no/such/tokenizer"], "config.tokenizer.name: no such file or directory"),
    (["--config.algorithm=grpoo"], "config.algorithm: unknown algorithm 'grpoo'; did you mean 'grpo'?"),
    (["--config.renderer.kwargs.retention=x"],
     "config.renderer.kwargs holds no keys to override; set it whole"),
    (["--config.engine.client.timeot_s=5"],
     "config.engine.client.timeot_s: unknown key; did you mean 'timeout_s'? known keys of config.engine.cl"),
    (["--config.engine.client.timeout_s=0"],
     "config.engine.client.timeout_s: expected a number > 0, got 0.0"),
    (["--config.engine.stall_timeout_s=5"],
     "config.engine.stall_timeout_s: moved to config.engine.client.stall_timeout_s"),
    (["--config.objective.off_policy.tis_ratio_type=tokens"],
     "config.objective.off_policy.tis_ratio_type: expected one of [None, 'token', 'sequence'], got 'tokens'"),
    (["--config.engine.server.dtype=bfloat16"],
     "config.engine.server.dtype: set by the run; use config.engine.dtype"),
    (["--config.engine.kind=vllm", "--config.engine.server_devices=('0', '1')"],
     "config.engine.server_devices: has 2 entries for engine.num_servers=1"),
    (["--config.engine.trainer_memory_fraction=1.5"], "config.engine.trainer_memory_fraction: expected a"),
    (["--config.engine.prefix_sharing=maybe"],
     "config.engine.prefix_sharing: expected one of ['auto', 'off'], got 'maybe'"),
    (["--config.rollout.top_p=0"], "config.rollout.top_p: expected a number in (0, 1], got 0.0"),
    (["--config.optimizer.learning_rate=-1"],
     "config.optimizer.learning_rate: expected a number > 0, got -1.0"),
    (["--config.warmstart.optimizer.lr=1"],
     "config.warmstart.optimizer.lr: unknown key; did you mean 'learning_rate'? known keys of config.warmst"),
    (["--config.warmstart.optimizer={'learning_rate': 1e-3}"],
     "config.warmstart.optimizer.learning_rate: set by the warm start; use warmstart.learning_rate"),
    (["--config.critic.gamma=2"], "config.critic.gamma: expected a number in [0, 1], got 2.0"),
    (["--config.critic.optimizer.weight_decy=1"],
     "config.critic.optimizer.weight_decy: unknown key; did you mean 'weight_decay'?"),
    (["--config.lora={'rank': 0}"], "config.lora.rank: expected an int >= 1, got 0"),
    (["--config.mesh.fsdp=0"], "config.mesh.fsdp: expected an int >= 1, got 0"),
    (["--config.report.wandb.mode=sometimes"],
     "config.report.wandb.mode: expected one of ['online', 'offline'], got 'sometimes'"),
    (["--config.frozen_models={'t': {'base_url': 'http://h:1', 'timout_s': 1}}"],
     "config.frozen_models.t.timout_s: unknown key; did you mean 'timeout_s'?"),
    (["--worddir=/tmp/x"], "unknown flag --worddir; did you mean --workdir?"),
    (["--resume"], "--resume needs --workdir"),
    (["unexpected"], "unexpected arguments ['unexpected']"),
]  # fmt: skip


@pytest.mark.parametrize("args, says", SMOKE_MISTAKES, ids=[" ".join(a) for a, _ in SMOKE_MISTAKES])
def test_each_mistake_is_one_line_and_exit_2(capsys, tmp_path, args, says):
    workdir = tmp_path / "run"
    flags = [f"--workdir={workdir}"] if args != ["--resume"] else []
    code, _, err = _run(capsys, "train", "--config=smoke", *flags, *args)
    line = _one_line(err)
    assert code == 2 and line.startswith("rljax train: ") and says in line, line
    assert not workdir.exists()


def test_config_file_mistakes_name_the_file_line(capsys, tmp_path, config_files):
    cases = {
        "syntax": f'--config: SyntaxError: invalid syntax (File "{config_files}/syntax.py", line 1)',
        "name": "--config: NameError: name 'undefined_name' is not defined "
        f'(File "{config_files}/name.py", line 5)',
        "type": "--config: TypeError: Could not override field 'seq_len' (reference). long is of original "
        "type <class 'str'> and cannot be casted to type <class 'int'> "
        f'(File "{config_files}/type.py", line 5)',
        "extra_key": "config.trainer.seqlen: unknown key; did you mean 'seq_len'?",
    }
    for name, says in cases.items():
        code, _, err = _run(capsys, "train", f"--config={config_files}/{name}.py", f"--workdir={tmp_path}/w")
        assert code == 2 and says in _one_line(err), (name, err)
    code, _, err = _run(capsys, "train", f"--config={config_files}/missing.py")
    assert code == 2 and "no config file" in _one_line(err) and "missing.py" in err
    code, _, err = _run(capsys, "train", "--config=smok")
    assert code == 2 and "no recipe named 'smok'; did you mean 'smoke'?" in _one_line(err)
    code, _, err = _run(capsys, "train")
    assert code == 2 and "--config=<recipe name or config file> is required" in _one_line(err)
    assert not (tmp_path / "w").exists()


def test_a_missing_extra_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(extras, "_installed", lambda name: name != "wandb")
    code, _, err = _run(capsys, "train", "--config=smoke", f"--workdir={tmp_path}/w",
                        "--config.report.sinks=('jsonl', 'wandb')")  # fmt: skip
    assert code == 2
    assert _one_line(err) == (
        "rljax train: config.report.sinks needs the 'report' extra (missing: wandb): "
        "pip install 'rljax[report]'"
    )
    assert not (tmp_path / "w").exists()


def test_failed_overwrite_leaves_the_previous_run_intact(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for mistake in ("--config.model.remat=sometimes", "--config.trainer.prompts_per_step=64"):
        code, _, err = _run(capsys, "train", "--config=smoke", f"--workdir={run}", "--overwrite", mistake)
        assert code == 2, err
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    code, _, err = _run(capsys, "train", "--config=smoke", f"--workdir={run}")  # no --overwrite
    assert code == 2 and "already holds a run; pass --resume" in _one_line(err)


def test_resume_checks_the_checkpoint_before_anything(capsys, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    code, _, err = _run(capsys, "train", "--config=smoke", f"--workdir={tmp_path}", "--resume")
    assert code == 2 and "holds no complete checkpoint, so there is nothing to resume" in _one_line(err)
    assert os.listdir(tmp_path) == ["checkpoints"]


def test_dry_run_prints_the_resolved_config_and_creates_nothing(capsys, tmp_path):
    workdir = tmp_path / "run"
    code, out, err = _run(capsys, "train", "--config=smoke", f"--workdir={workdir}", "--dry-run",
                          "--config.trainer.num_steps=7")  # fmt: skip
    assert code == 0, err
    assert not workdir.exists()
    assert "  trainer.num_steps = 7\n" in out and "  trainer.seq_len = 256\n" in out  # smoke's own value
    assert "  rollout.top_p = 1.0\n" in out  # a default the recipe does not set
    assert "  algorithm: grpo (estimator grpo, policy loss dppo)\n" in out
    assert "  env lookup: lookup, 16 train / 2 eval tasks, algorithm grpo\n" in out
    assert "  policy engine: embedded JAX sampler (max_batch_size 8)\n" in out
    assert out.rstrip().endswith("nothing was created, deleted or started")
    # the keys of typed sections are set one by one from the command line, list values whole (the
    # trainer applies config.trainer.filters: tests/train/test_train_run_config.py's async test)
    code, out, err = _run(capsys, "train", "--config=smoke", "--dry-run",
                          "--config.trainer.filters=[{'name': 'overlong', 'mode': 'monitor'}]",
                          "--config.objective.off_policy.max_token_staleness=2",
                          "--config.engine.client.timeout_s=5", "--config.engine.supervisor.max_restarts=0",
                          "--config.model.init.rope_theta=500000.0")  # fmt: skip
    assert code == 0, err
    assert "  trainer.filters = ({'name': 'overlong', 'mode': 'monitor'},)\n" in out
    assert "  objective.off_policy.max_token_staleness = 2\n" in out
    assert "  objective.off_policy.token_tis_ratio_clip_high = 2.0\n" in out  # the others: defaults
    assert "  engine.client.timeout_s = 5.0\n" in out and "  engine.supervisor.max_restarts = 0\n" in out
    assert "  model.init.rope_theta = 500000.0\n" in out and "  model.init.hidden_size = 16\n" in out
    # an existing run is neither refused nor deleted by a dry run of --overwrite
    (workdir / "checkpoints").mkdir(parents=True)
    code, _, err = _run(capsys, "train", "--config=smoke", f"--workdir={workdir}", "--dry_run", "--overwrite")
    assert code == 0 and (workdir / "checkpoints").is_dir(), err


@pytest.mark.parametrize(
    "sub, flags",
    [
        ("train", ["--config", "--workdir", "--resume", "--overwrite", "--dry_run", "--allow_config_change"]),
        ("eval", ["--config", "--checkpoint", "--step", "--metrics_out"]),
        ("export", ["--checkpoint", "--gguf", "--out", "--dtype", "--adapter_only"]),
        ("view", ["--workdir", "--out", "--max_trajectories"]),
        ("serve", ["--config", "--port", "--host", "--api_key"]),
        ("make-dataset", ["--source", "--num", "--out", "--dataset_config"]),
    ],
)
def test_subcommand_help_lists_its_own_flags(capsys, sub, flags):
    code, out, _ = _run(capsys, sub, "--help")
    assert code == 0 and out.startswith(f"usage: rljax {sub} [flags]")
    listed = {
        line.split(":")[0].strip().replace("[no]", "") for line in out.splitlines() if line.startswith("  --")
    }
    assert set(flags) <= listed, listed
    assert "--verbosity" not in listed  # absl's own flags are --helpfull's


@pytest.mark.subprocess
def test_the_console_script_exits_2_with_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "rljax", "train", "--config=smoke", f"--workdir={tmp_path}/run",
         "--config.model.remat=sometimes"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr == (
        "rljax train: config.model.remat: expected one of ['none', 'full', 'dots_saveable'], "
        "got 'sometimes'\n"
    )
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A Qwen3 checkpoint directory as the GPU recipes read it before loading weights: its
    config.json (tiny shapes) and a toy ChatML tokenizer; no weights (a dry run reads none)."""
    import json

    from rljax.chat import toy_tokenizer

    path = tmp_path_factory.mktemp("qwen3")
    tok = toy_tokenizer("chatml")
    config = dict(model_type="qwen3", vocab_size=len(tok) + 7, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=1e6,
                  rms_norm_eps=1e-6)  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(path)
    return path


def test_the_one_gpu_recipe_dry_runs_on_cpu(capsys, monkeypatch, tiny_checkpoint):
    """configs/qwen3_1gpu.py checked whole on this CPU machine as if it had one GPU: the trainer's
    memory share, the server sharing its GPU; then the two-GPU variant and the mistakes it prevents."""
    monkeypatch.setenv("RLJAX_VLLM_PYTHON", sys.executable)  # any existing python: nothing is launched
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    model = [f"--config.model.hf_path={tiny_checkpoint}", f"--config.tokenizer.name={tiny_checkpoint}"]
    code, out, err = _run(capsys, "train", "--config=qwen3_1gpu", "--dry-run", *model)
    assert code == 0, err
    assert "  engine.trainer_memory_fraction = 0.5\n" in out
    assert "  trainer placement: XLA_PYTHON_CLIENT_MEM_FRACTION=0.5\n" in out
    assert "    server 0: GPUs the trainer's GPUs, {" in out and "'gpu_memory_utilization': 0.4" in out
    assert "  model: qwen3, 2 layers, hidden 64" in out and "trainer: async, 1 process(es)" in out
    assert (
        os.environ[MEM_FRACTION_ENV] == "0.5"
    )  # set before JAX starts (this process's CPU backend ignores it)

    monkeypatch.delenv(MEM_FRACTION_ENV)
    model.append("--config.envs.lookup.num_train_tasks=64")  # the recipe's 20,000 tasks take seconds
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    own_gpu = ["--config.engine.server_devices=('1',)", "--config.engine.trainer_memory_fraction=0",
               "--config.engine.server.gpu_memory_utilization=0.85"]  # fmt: skip
    code, out, err = _run(capsys, "train", "--config=qwen3_1gpu", "--dry-run", *model, *own_gpu)
    assert code == 0, err
    assert "  trainer placement: jax_cuda_visible_devices=0\n" in out and "    server 0: GPUs 1, {" in out

    code, _, err = _run(capsys, "train", "--config=qwen3_1gpu", "--dry-run", *model,
                        "--config.engine.trainer_memory_fraction=0.6")  # fmt: skip
    assert code == 2 and "the trainer and 1 launched vLLM server(s) share GPU 0" in _one_line(err)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    code, _, err = _run(capsys, "train", "--config=qwen3_gpu", "--dry-run", *model)  # servers not placed
    assert code == 2 and "JAX's default (75% or more" in _one_line(err)
