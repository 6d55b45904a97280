"""Export a training checkpoint's policy, or a GGUF file's model, as a Hugging Face model directory.

    rljax export --checkpoint=/runs/qwen3 --out=/models/qwen3_rl
    rljax export --checkpoint=/runs/qwen3/checkpoints/step_200 --out=/models/q --dtype=bfloat16
    rljax export --checkpoint=/runs/lora --out=/models/adapter --adapter_only   # LoRA runs
    rljax export --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --out=/models/smollm2   # a GGUF base model

``--checkpoint`` is a run's workdir, its ``checkpoints/`` directory (the latest step, or ``--step``)
or one ``step_N``. No config flag: the run's config is read from the checkpoint, the model is rebuilt
from it (``model.hf_path`` or ``model.init``, ``lora``) and the checkpoint's policy weights (the
float32 masters) replace the fresh ones. Written to ``--out``: ``config.json`` + safetensors in
``--dtype`` (default: the master dtype), which transformers and vLLM load, the run's tokenizer
files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template and special tokens; the
toy tokenizers are HF tokenizers too) and ``generation_config.json`` (BOS / EOS / pad ids, EOS
including the renderer's end-of-turn tokens). A run whose ``model.hf_path`` is a ``.gguf`` file is
exported the same way (its trained float32 weights; nothing is re-quantized).
A LoRA run exports merged weights (base + ``alpha / r * A B``), or with ``--adapter_only`` the PEFT
adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) for ``model.hf_path``.

``--gguf=FILE`` instead writes the same directory for a GGUF file's model itself (every tensor
dequantized to float32, or ``--dtype``; the tokenizer and chat template read from the file), e.g. to
serve the base model of a GGUF run with vLLM.
"""

from __future__ import annotations

from absl import app, flags
from absl import logging as absl_logging

from rljax.run.export import export_checkpoint, export_gguf


def define_flags() -> None:
    """The CLI's flags, defined only when it runs: importing :func:`export_checkpoint` (tests,
    notebooks) must not claim absl flag names (``--checkpoint``, ``--out``, ``--step``) that the other
    launchers (``rljax eval``, ``rljax make-dataset``) define in the same process."""
    flags.DEFINE_string(
        "checkpoint", None, "A run's workdir, its checkpoints/ directory, or a checkpoints/step_N directory."
    )
    flags.DEFINE_string("gguf", None, "Export this GGUF file's model instead of a checkpoint.")
    flags.DEFINE_string("out", None, "The HF model directory to write.")
    flags.DEFINE_integer("step", None, "Which step of a checkpoint directory (default: the latest).")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Weight dtype (default: the masters').")
    flags.DEFINE_bool("adapter_only", False, "LoRA runs: write the PEFT adapter only.")
    flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out.")


def main(argv: list[str]) -> None:
    """Runs ``rljax export`` with the parsed flags (``argv``: what absl left, the program name only)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every file it reads at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    f = flags.FLAGS
    if f.gguf:
        _export_gguf(f)
        return
    if not f.checkpoint or not f.out:
        raise app.UsageError("--checkpoint=DIR (or --gguf=FILE) and --out=HF_DIR are required")
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


def _export_gguf(f: flags.FlagValues) -> None:
    """``rljax export --gguf=FILE --out=HF_DIR [--dtype] [--overwrite]``."""
    clashing = [name for name in ("checkpoint", "step", "adapter_only") if f[name].present]
    if clashing:
        raise app.UsageError(f"--gguf exports a GGUF file, not a checkpoint: drop --{', --'.join(clashing)}")
    if not f.out:
        raise app.UsageError("--gguf=FILE needs --out=HF_DIR")
    try:
        summary = export_gguf(f.gguf, f.out, dtype=f.dtype, overwrite=f.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    print(f"exported {summary['gguf']} ({summary['dtype']} weights) to {summary['out']}", flush=True)
