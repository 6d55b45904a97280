"""Evaluating a checkpoint without training: the run's parts rebuilt from its config, the policy
weights of the checkpoint, and the scheduler's own evaluation (``rljax eval`` is its command line).

The metrics equal the ``eval/*`` row the trainer logged for that step (same tasks, same request
seeds): see :mod:`rljax.cli.eval` for the record's fields.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Any

from rljax.training.checkpoint import resolve_checkpoint

__all__ = ["evaluate_checkpoint"]


def evaluate_checkpoint(
    config: Any, checkpoint: str | os.PathLike, *, step: int | None = None
) -> dict[str, Any]:
    """Evaluates a checkpoint on ``config``'s eval tasks (module docstring); returns the JSON record."""
    from rljax.run.report import eval_metrics
    from rljax.run.run import Run

    directory, step = resolve_checkpoint(checkpoint, step)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="rljax_eval_"))  # the run's own workdir (server weights)
    run = Run(config, scratch)
    try:
        if not run.env_tasks.eval:
            raise ValueError(
                "the config has no eval tasks: set config.envs.<name>.num_eval_tasks (task makers) or "
                "config.envs.<name>.dataset.eval / eval_fraction (dataset files)"
            )
        run.load_policy(directory, step)
        run.sync_weights(step)
        run.start_engines(step)
        result = run.scheduler.submit_eval(step).result()
        metrics = eval_metrics(result, step, tasks=run.env_tasks.eval, pass_k=run.cfg.eval.pass_k)
    finally:
        run.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "checkpoint": str(directory / f"step_{step}"),
        "step": step,
        "num_eval_tasks": len(run.env_tasks.eval),
        "group_size": run.cfg.eval.group_size,
        "metrics": {k: metrics[k] for k in sorted(metrics)},
    }
