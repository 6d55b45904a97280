"""Export a training checkpoint's policy as a Hugging Face model directory.

    python -m launch.export --checkpoint=/runs/qwen3 --out=/models/qwen3_rl
    python -m launch.export --checkpoint=/runs/qwen3/checkpoints/step_200 --out=/models/q --dtype=bfloat16
    python -m launch.export --checkpoint=/runs/lora --out=/models/adapter --adapter_only   # LoRA runs

``--checkpoint`` is a run's workdir, its ``checkpoints/`` directory (the latest step, or ``--step``)
or one ``step_N``. No config flag: the run's config is read from the checkpoint, the model is rebuilt
from it (``model.hf_path`` or ``model.init``, ``lora``) and the checkpoint's policy weights (the
float32 masters) replace the fresh ones. Written to ``--out``: ``config.json`` + safetensors in
``--dtype`` (default: the master dtype), which transformers and vLLM load, and the run's tokenizer
files (``tokenizer.json``, its config and chat template; the toy tokenizers are HF tokenizers too).
A LoRA run exports merged weights (base + ``alpha / r * A B``), or with ``--adapter_only`` the PEFT
adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) for ``model.hf_path``.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

from absl import app, flags
from absl import logging as absl_logging


def _define_flags() -> None:
    """The CLI's flags, defined only when it runs: importing :func:`export_checkpoint` (tests,
    notebooks) must not claim absl flag names (``--checkpoint``, ``--out``, ``--step``) that the other
    launchers (``launch.eval``, ``launch.make_dataset``) define in the same process."""
    flags.DEFINE_string(
        "checkpoint", None, "A run's workdir, its checkpoints/ directory, or a checkpoints/step_N directory."
    )
    flags.DEFINE_string("out", None, "The HF model directory to write.")
    flags.DEFINE_integer("step", None, "Which step of a checkpoint directory (default: the latest).")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Weight dtype (default: the masters').")
    flags.DEFINE_bool("adapter_only", False, "LoRA runs: write the PEFT adapter only.")
    flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out.")


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    adapter_only: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Writes the policy of a checkpoint to ``out`` (see the module docstring); returns a summary."""
    import dataclasses

    import jax.numpy as jnp

    from launch.common import resolve_checkpoint
    from rljax.models import save_pretrained
    from rljax.models.lora import merge_lora, save_adapter
    from rljax.train.run import Run, checkpoint_config
    from rljax.train.run_config import parse_run_config
    from rljax.train.sharding import MeshConfig

    out = pathlib.Path(out).absolute()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite or choose another --out")
    directory, step = resolve_checkpoint(checkpoint, step)
    cfg = parse_run_config(checkpoint_config(directory, step))
    if adapter_only and not cfg.lora:
        raise ValueError("--adapter_only: this run trained the full model (config.lora is empty)")
    # the model parts only, on one device (whatever mesh the run trained on)
    run = Run(dataclasses.replace(cfg, mesh=MeshConfig()), directory, rollouts=False)
    run.load_policy(
        directory, step, verify=False
    )  # checkpoint_config verified it; the policy (a LoRA run: adapters, and a warm-started base)
    model, tokenizer = run.current_model(), run.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        save_adapter(model, out, base_model_name_or_path=cfg.model.hf_path or None)
        kind = "adapter"
    else:
        if cfg.lora:
            model = merge_lora(model)
        save_pretrained(model, out, dtype=None if dtype is None else jnp.dtype(dtype))
        kind = "merged" if cfg.lora else "full"
    tokenizer.save_pretrained(out)
    return {"checkpoint": str(directory / f"step_{step}"), "step": step, "out": str(out), "kind": kind,
            "dtype": dtype or str(jnp.dtype(model.param_dtype))}  # fmt: skip


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every file it reads at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    f = flags.FLAGS
    if not f.checkpoint or not f.out:
        raise app.UsageError("--checkpoint=DIR and --out=HF_DIR are required")
    try:
        summary = export_checkpoint(
            f.checkpoint,
            f.out,
            step=f.step,
            dtype=f.dtype,
            adapter_only=f.adapter_only,
            overwrite=f.overwrite,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    print(
        f"exported {summary['kind']} weights ({summary['dtype']}) of {summary['checkpoint']} "
        f"to {summary['out']}",
        flush=True,
    )


def run() -> None:
    """Console entry point."""
    sys.path.insert(0, os.getcwd())
    _define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
