"""A training checkpoint's policy as a Hugging Face model directory (``rljax export`` is its command
line; see :mod:`rljax.cli.export` for what is written)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from rljax.training.checkpoint import resolve_checkpoint

__all__ = ["export_checkpoint"]


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

    from rljax.models import save_pretrained
    from rljax.models.lora import merge_lora, save_adapter
    from rljax.run.config import parse_run_config
    from rljax.run.run import Run, checkpoint_config
    from rljax.training.sharding import MeshConfig

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
