"""``rljax export``: a run's checkpoint as an HF directory that transformers loads.

References: transformers' own forward of the exported directory (torch float32) against rljax's
logits of the restored checkpoint; peft for the LoRA adapter export.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from recipes import load_recipe
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.models.lora import merge_lora
from rljax.run.export import export_checkpoint
from rljax.run.trainer import Trainer
from rljax.training.step import merge_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration


def _run(tmp_path, **extra):
    c = load_recipe("smoke")
    c.trainer.update(num_steps=1, eval_every=0, checkpoint_every=1)
    c.update(**extra)
    t = Trainer(c, tmp_path / "run")
    t.run()
    return t


def _hf_logprobs(directory, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return np.concatenate([[0.0], logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()])


def _rljax_logprobs(model, ids):
    return np.asarray(models.sequence_logprobs(model, jnp.asarray([ids], jnp.int32))[0], np.float64)


@pytest.mark.subprocess
def test_export_full_run_loads_in_transformers(tmp_path):
    t = _run(tmp_path)
    ids = np.random.default_rng(0).integers(0, t.parts.model_vocab, 40).tolist()
    out = tmp_path / "hf"
    summary = export_checkpoint(tmp_path / "run", out)
    assert summary["kind"] == "full" and summary["step"] == 1 and summary["dtype"] == "float32"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    got = _rljax_logprobs(t.parts.current_model(), ids)
    np.testing.assert_allclose(_hf_logprobs(out, ids), got, **LOGPROB_TOL)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(t.parts.tokenizer)
    # bf16 export via the launcher: the tensors are bf16 and transformers loads them
    with pytest.raises(FileExistsError):
        export_checkpoint(tmp_path / "run", out)
    proc = subprocess.run(
        [sys.executable, "-m", "rljax", "export", f"--checkpoint={tmp_path / 'run'}",
         f"--out={tmp_path / 'bf16'}", "--dtype=bfloat16"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exported full weights (bfloat16)" in proc.stdout
    header = json.loads(
        (tmp_path / "bf16" / "model.safetensors").read_bytes()[8:][: 1 << 16].split(b"}}")[0] + b"}}"
    )
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    bf16 = _hf_logprobs(tmp_path / "bf16", ids)
    assert np.max(np.abs(bf16 - _rljax_logprobs(t.parts.current_model(), ids))) < 0.2  # bf16 weight rounding


def test_export_lora_run_merged_and_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    t = _run(tmp_path, lora=dict(rank=4, alpha=8.0, targets=("q_proj", "v_proj")))
    ids = np.random.default_rng(1).integers(0, t.parts.model_vocab, 32).tolist()
    want = _rljax_logprobs(t.parts.current_model(), ids)
    merged = tmp_path / "merged"
    assert export_checkpoint(tmp_path / "run", merged)["kind"] == "merged"
    np.testing.assert_allclose(_hf_logprobs(merged, ids), want, **LOGPROB_TOL)
    # the adapter alone, on its base: the run's frozen base weights (adapters zeroed, then folded)
    adapter = tmp_path / "adapter"
    assert export_checkpoint(tmp_path / "run", adapter, adapter_only=True)["kind"] == "adapter"
    zero_adapters = jax.tree.map(jnp.zeros_like, t.state.params)
    base = merge_lora(merge_model(t.state.graphdef, zero_adapters, t.state.frozen))
    models.save_pretrained(base, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    with torch.no_grad():
        logits = peft.PeftModel.from_pretrained(hf, adapter)(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    got = np.concatenate([[0.0], logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()])
    np.testing.assert_allclose(got, want, **LOGPROB_TOL)


@pytest.mark.subprocess
@pytest.mark.parametrize("other", ["rljax.cli.eval", "rljax.cli.make_dataset", "rljax.cli.train"])
def test_export_imports_beside_the_other_launchers(other, tmp_path):
    """Importing ``export_checkpoint`` defines no absl flags, so it loads in the same process as any
    other launcher (``--checkpoint`` / ``--out`` / ``--step`` clashed with rljax.cli.eval and
    rljax.cli.make_dataset and broke tests that imported both)."""
    code = f"import rljax.cli.export, {other}; from rljax.run.export import export_checkpoint; print('ok')"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.subprocess
def test_export_gguf_usage_errors(tmp_path):
    """``--gguf`` exports a file, not a checkpoint: checkpoint flags beside it and a missing file are
    one-line usage errors that write nothing."""

    def export(*flags):
        return subprocess.run([sys.executable, "-m", "rljax", "export", *flags],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip

    clash = export(f"--gguf={tmp_path / 'm.gguf'}", f"--checkpoint={tmp_path}", "--step=3", "--out=o")
    assert clash.returncode != 0 and "drop --checkpoint, --step" in clash.stderr, clash.stderr[-2000:]
    missing = export(f"--gguf={tmp_path / 'm.gguf'}", f"--out={tmp_path / 'o'}")
    assert missing.returncode != 0 and "no GGUF file at" in missing.stderr, missing.stderr[-2000:]
    assert not (tmp_path / "o").exists()
