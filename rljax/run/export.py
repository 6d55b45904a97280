"""A training checkpoint's policy, or a GGUF file's model, as a Hugging Face model directory
(``rljax export`` is its command line; see :mod:`rljax.cli.export` for what is written).

The directory is the same for both: ``config.json`` + ``model.safetensors`` (tied embeddings stored
once, ``tie_word_embeddings: true``), the tokenizer (``tokenizer.json``, ``tokenizer_config.json``
with the chat template and special tokens, ``chat_template.jinja``) and ``generation_config.json``
(the BOS / EOS / pad ids, EOS extended by the chat renderer's end-of-turn tokens). transformers and
vLLM load it as a model of their own kind.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

from rljax.training.checkpoint import read_config, resolve_checkpoint

__all__ = ["export_checkpoint", "export_gguf", "write_model_dir"]


def _output_dir(out: str | os.PathLike, overwrite: bool) -> pathlib.Path:
    """``out`` as an absolute path, refusing a non-empty directory unless ``overwrite``."""
    out = pathlib.Path(out).absolute()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite or choose another --out")
    return out


def write_model_dir(
    model: Any,
    tokenizer: Any,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    stop_token_ids: Sequence[int] = (),
) -> None:
    """Writes ``model`` (a :class:`rljax.models.Decoder`) and ``tokenizer`` as an HF model directory
    (see the module docstring); ``dtype`` ("float32" / "bfloat16") is the weights' storage dtype
    (default: the model's parameter dtype); ``stop_token_ids`` join the EOS ids of
    ``generation_config.json``."""
    import jax.numpy as jnp

    from rljax.models.hf_io import (
        generation_token_ids,
        save_generation_config,
        save_pretrained,
        save_tokenizer_files,
    )

    save_pretrained(model, out, dtype=None if dtype is None else jnp.dtype(dtype))
    save_tokenizer_files(tokenizer, out, model_max_length=model.config.max_position_embeddings)
    save_generation_config(out, generation_token_ids(model.config, tokenizer, stop_token_ids))


def export_gguf(
    gguf_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Writes the model of a GGUF file (every tensor dequantized, as rljax trains it) and its tokenizer
    and chat template to ``out``, so vLLM or transformers can serve the base model of a run that reads
    the same file. ``dtype`` default: float32 (what the dequantized values are). Returns a summary.

    The tokenizer is rljax's reading of the file (:func:`rljax.models.gguf_tokenizer`), not
    transformers' own GGUF conversion, which splits digits differently for some vocabularies.
    """
    from rljax.models import from_gguf, gguf_tokenizer

    out = _output_dir(out, overwrite)
    model = from_gguf(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    write_model_dir(model, gguf_tokenizer(gguf_path), out, dtype=dtype)
    return {"gguf": str(pathlib.Path(gguf_path).absolute()), "out": str(out), "kind": "gguf",
            "dtype": dtype or "float32"}  # fmt: skip


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str | None = None,
    adapter_only: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Writes the policy of a checkpoint to ``out`` (see the module docstring); returns a summary.

    The run's model is rebuilt from its config (``model.hf_path``: an HF directory or a ``.gguf``
    file, or ``model.init``) and the checkpoint's policy weights replace the fresh ones; the
    tokenizer is the run's (``tokenizer.name``), and its renderer's stop tokens end generations.
    """
    import dataclasses

    import jax.numpy as jnp

    from rljax.models.hf_io import save_tokenizer_files
    from rljax.models.lora import merge_lora, save_adapter
    from rljax.run.config import parse_config_record
    from rljax.run.run import Run
    from rljax.training.sharding import MeshConfig

    out = _output_dir(out, overwrite)
    directory, step = resolve_checkpoint(checkpoint, step)
    record = read_config(directory, step=step)
    if not record:
        raise ValueError(f"{directory}/step_{step} records no run config; it was not written by the trainer")
    cfg = parse_config_record(record)
    if adapter_only and not cfg.lora:
        raise ValueError("--adapter_only: this run trained the full model (config.lora is empty)")
    # the model parts only, on one device (whatever mesh the run trained on)
    run = Run(dataclasses.replace(cfg, mesh=MeshConfig()), directory, rollouts=False)
    run.load_policy(directory, step)  # the policy (a LoRA run: adapters, and a warm-started base)
    model, tokenizer = run.current_model(), run.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        save_adapter(model, out, base_model_name_or_path=cfg.model.hf_path or None)
        save_tokenizer_files(tokenizer, out, model_max_length=model.config.max_position_embeddings)
        kind = "adapter"
    else:
        if cfg.lora:
            model = merge_lora(model)
        write_model_dir(model, tokenizer, out, dtype=dtype, stop_token_ids=run.renderer.stop_token_ids())
        kind = "merged" if cfg.lora else "full"
    return {"checkpoint": str(directory / f"step_{step}"), "step": step, "out": str(out), "kind": kind,
            "dtype": dtype or str(jnp.dtype(model.param_dtype))}  # fmt: skip
