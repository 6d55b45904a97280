"""Evaluate a training checkpoint on the config's held-out tasks, without training.

For example::

    rljax eval --config=reasoning_gym --checkpoint=/tmp/rg
    rljax eval --config=reasoning_gym --checkpoint=/tmp/rg/checkpoints/step_0 \\
        --config.eval.group_size=16 --config.eval.pass_k="(1, 4, 16)" --metrics_out=/tmp/rg_step0.json

``--checkpoint`` is a run's workdir (its ``checkpoints/``), a checkpoint directory (the ``latest``
step) or one ``step_N``. The run's parts are rebuilt from ``--config`` exactly as ``rljax train``
builds them (the run object, :class:`rljax.run.run.Run`: tokenizer, model, envs and their eval
tasks, policy engine, rollout scheduler; no trainer loop), the policy weights of the checkpoint
replace the fresh ones (their shapes and dtypes must match: use the training config; a damaged
checkpoint is refused), and the scheduler's own evaluation runs: every eval task
``config.eval.group_size`` times at ``config.eval.temperature``, with the same request
seeds as the evaluations of the training run. So the metrics equal the ``eval/*`` row the trainer
logged for that step: ``eval/reward_mean``, ``eval/pass@k`` (unbiased, Chen et al. 2021),
``eval/pass^k``, ``eval/mean@k``, overall, per env (``eval/<env>/...``) and per data source
(``eval/data_source/<source>/...``), for ``config.eval.pass_k`` (default ``(1, group_size)``).
Overrides such as ``--config.eval.group_size=16`` evaluate with more samples.

They are printed and written as JSON (``--metrics_out``; default ``<workdir>/eval_step_<N>.json`` next to
the checkpoint directory): ``{"checkpoint", "step", "num_eval_tasks", "group_size", "metrics"}``.
No warm start runs, nothing is trained and the checkpoint directory is not modified.
"""

from __future__ import annotations

import json
import math
import pathlib
import types

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from rljax.run.evaluate import evaluate_checkpoint
from rljax.run.preflight import plan_run
from rljax.training.checkpoint import CheckpointCorruptedError, resolve_checkpoint

_FLAGS = types.SimpleNamespace()  # the flag holders, once define_flags() ran


def define_flags() -> None:
    """The subcommand's absl flags, defined only when it runs: importing this module (the docs,
    tests) must not claim flag names that other subcommands define in the same process."""
    _FLAGS.config = config_flags.DEFINE_config_file(
        "config", None, "The ml_collections config file the checkpoint was trained with.", lock_config=True
    )
    _FLAGS.checkpoint = flags.DEFINE_string(
        "checkpoint",
        None,
        "A run's workdir, its checkpoints/ directory, or one checkpoints/step_N directory.",
    )
    _FLAGS.step = flags.DEFINE_integer(
        "step", None, "Which step of a checkpoint directory (default: the latest)."
    )
    _FLAGS.out = flags.DEFINE_string(
        "metrics_out", None, "JSON output file (default: <workdir>/eval_step_<N>.json)."
    )


def _default_out(directory: pathlib.Path, step: int) -> pathlib.Path:
    workdir = directory.parent if directory.name == "checkpoints" else directory
    return workdir / f"eval_step_{step}.json"


def main(argv: list[str]) -> None:
    """Runs ``rljax eval`` with the parsed flags (``argv``: what absl left, the program name only)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config.<key>=<value> for overrides")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every file it reads at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    if _FLAGS.config.value is None:
        raise app.UsageError(
            "--config=<recipe or file> (the config the checkpoint was trained with) is required"
        )
    if not _FLAGS.checkpoint.value:
        raise app.UsageError(
            "--checkpoint=DIR is required (a run's workdir, checkpoints/ or checkpoints/step_N)"
        )
    try:
        resolve_checkpoint(_FLAGS.checkpoint.value, _FLAGS.step.value)
        plan = plan_run(_FLAGS.config.value)  # the whole config, before anything is built
    except (FileNotFoundError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    if not plan.env_tasks.eval:
        raise app.UsageError(
            "config.envs: no eval tasks; set config.envs.<name>.num_eval_tasks (task makers) or "
            "config.envs.<name>.dataset.eval / eval_fraction (dataset files)"
        )
    try:
        record = evaluate_checkpoint(plan.config, _FLAGS.checkpoint.value, step=_FLAGS.step.value)
    except (FileNotFoundError, CheckpointCorruptedError) as e:
        raise app.UsageError(str(e)) from None
    directory, step = pathlib.Path(record["checkpoint"]).parent, record["step"]
    out = pathlib.Path(_FLAGS.out.value) if _FLAGS.out.value else _default_out(directory, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    width = max(len(k) for k in record["metrics"])
    tasks, samples = record["num_eval_tasks"], record["group_size"]
    print(f"eval of {record['checkpoint']} ({tasks} tasks x {samples} samples):")
    for k, v in record["metrics"].items():
        shown = f"{v:.4f}" if isinstance(v, float) and not math.isnan(v) else str(v)
        print(f"  {k:<{width}}  {shown}")
    print(f"wrote {out}", flush=True)
