"""configs/qwen35_gpu.py smoke-tested on CPU through ``rljax train``: a tiny random Qwen3.5
checkpoint written by transformers (a Gated DeltaNet layer and a gated attention layer) trains 2 RL
steps with LoRA on the attention and DeltaNet projections, the embedded sampler swapped in for vLLM
and the mesh shrunk to the process's 2 fake devices."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from recipes import load_recipe
from xla_flags import subprocess_env

from rljax.run.config import parse_run_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_recipe_parses_and_keeps_context_parallelism_off():
    cfg = parse_run_config(load_recipe("qwen35_gpu"))
    assert cfg.mesh.context == 1 and cfg.engine.kind == "vllm" and cfg.model.remat == "full"


@pytest.mark.subprocess
def test_qwen35_gpu_recipe_trains_a_tiny_qwen35_through_rljax_train(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rljax.chat import toy_tokenizer

    tok = toy_tokenizer("chatml")
    hf_cfg = transformers.Qwen3_5TextConfig(
        vocab_size=len(tok) + 7, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(hf_cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    ckpt, work = str(tmp_path / "ckpt"), tmp_path / "run"
    lora = (
        "{'rank': 4, 'alpha': 8.0, 'targets': ('q_proj', 'v_proj', 'in_proj_qkv', 'in_proj_z', 'out_proj')}"
    )
    r = subprocess.run(
        [
            sys.executable, "-m", "rljax", "train", "--config=qwen35_gpu", f"--workdir={work}",
            f"--config.model.hf_path={ckpt}", f"--config.tokenizer.name={ckpt}",
            "--config.renderer.name=chatml", "--config.engine.kind=embedded", "--config.mesh.fsdp=2",
            f"--config.lora={lora}",
            "--config.envs.lookup.num_train_tasks=8", "--config.envs.lookup.num_eval_tasks=0",
            "--config.rollout.group_size=2", "--config.rollout.max_turns=1", "--config.rollout.max_tokens=16",
            "--config.rollout.max_context_len=896", "--config.trainer.num_steps=2",
            "--config.trainer.prompts_per_step=2", "--config.trainer.mini_batch_prompts=2",
            "--config.trainer.seq_len=1024", "--config.trainer.micro_batch_tokens=1024",
            "--config.trainer.eval_every=0", "--config.trainer.checkpoint_every=0",
        ],
        cwd=ROOT, env=subprocess_env(devices=2), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["update_skipped"] == 0 and row["rollout/num_errored"] == 0 for row in rows)
