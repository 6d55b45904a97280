"""What a run reports: per-step metric rows from rollouts and evals, and where they go.

:func:`rollout_step_metrics` and :func:`eval_metrics` turn a :class:`~rljax.rollout.RolloutResult`
into the metric keys of the run (``reward/*``, ``rollout/*``, ``eval/*``); :class:`RunSinks` writes
rows to the stdout table, ``metrics.jsonl``, TensorBoard and the plot (RL steps under ``workdir``,
the warm start under ``workdir/warmstart``).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax import evaluation
from rljax.envs.base import Task
from rljax.rollout import RolloutResult
from rljax.train import metrics as metrics_lib

__all__ = ["RunSinks", "eval_metrics", "rollout_step_metrics"]

_WARMSTART_KEYS = (
    "warmstart/loss",
    "warmstart/grad_norm",
    "warmstart/correct_fraction",
    "warmstart/step_time_s",
)


def _correct_fraction(result: RolloutResult) -> float | None:
    infos = [i for rec in result.trajectories for i in rec.infos if "correct" in i]
    return float(np.mean([bool(i["correct"]) for i in infos])) if infos else None


def rollout_step_metrics(result: RolloutResult) -> dict[str, float]:
    """The ``reward/*``, ``turns/*`` and ``rollout/*`` metrics of one RL step's rollout."""
    rm = result.metrics
    out = {
        "reward/mean": rm["reward_mean"],
        "reward/std": rm["reward_std"],
        "reward/max": rm["reward_max"],
        "turns/mean": rm["turns_mean"],
        "rollout/num_trajectories": float(rm["num_trajectories"]),
        "rollout/num_steps": rm["num_steps"],
        "rollout/num_errored": rm["num_errored"],
        "rollout/response_tokens": rm["response_tokens"],
        "rollout/end_length_fraction": rm["end_length_fraction"],
        "rollout/bridged_fraction": rm["bridged_fraction"],
        "time/rollout_s": rm["wall_time_s"],
    }
    for k, v in rm.items():
        if k.startswith("reward_mean/"):
            out["reward/mean/" + k.split("/", 1)[1]] = v
        elif k.startswith(("dynamic_sampling/", "env/")):
            out[k] = float(v)
    correct = _correct_fraction(result)
    if correct is not None:
        out["correct_fraction"] = correct
    return out


def eval_metrics(
    result: RolloutResult, step: int, *, tasks: Sequence[Task] = (), pass_k: Sequence[int] = ()
) -> dict[str, float]:
    """The ``eval/*`` metrics of a held-out evaluation after RL step ``step``.

    ``eval/reward_mean``, ``eval/correct_fraction`` (envs that report ``correct``), and pass@k /
    pass^k / mean@k (:func:`rljax.evaluation.eval_metrics`) overall, per env and per data source,
    for ``pass_k`` (default: 1 and the number of samples per task).
    """
    out = {"eval/reward_mean": result.metrics["reward_mean"], "eval/step": float(step)}
    correct = _correct_fraction(result)
    if correct is not None:
        out["eval/correct_fraction"] = correct
    passes = evaluation.eval_metrics(result.trajectories, list(tasks), ks=list(pass_k) or None)
    out.update({k: float(v) for k, v in passes.items() if k != "eval/reward_mean"})
    return out


class RunSinks:
    """The run's metrics: :class:`rljax.train.metrics.MetricsLogger` for RL steps (``workdir``: stdout
    table, ``metrics.jsonl``, TensorBoard, ``metrics.png``) and another for the warm start
    (``workdir/warmstart``). On resume, JSONL lines of steps after the checkpoint are dropped first,
    so the file reads as one uninterrupted run; a fresh run starts a fresh file.

    ``enabled=False`` (every process but 0 of a multi-process run) writes nothing anywhere."""

    def __init__(
        self,
        workdir: pathlib.Path,
        *,
        resume_step: int | None,
        table_keys: Sequence[str],
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.workdir = workdir
        self.warmstart: metrics_lib.MetricsLogger | None = None
        if not enabled:
            return
        path = workdir / metrics_lib.JSONL_NAME
        if resume_step is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a half-written line of the killed run
                if int(rec.get("step", 0)) <= resume_step:
                    kept.append(line)
            path.write_text("".join(k + "\n" for k in kept))
        elif path.exists():
            path.unlink()
        self.rl = metrics_lib.MetricsLogger(workdir, table_keys=table_keys)

    def log(self, step: int, metrics: Mapping[str, Any], *, phase: str = "rl") -> None:
        if not self.enabled:
            return
        scalars = {k: v for k, v in metrics.items() if k not in metrics_lib.RESERVED_KEYS}
        if phase == "rl":
            self.rl.log(step, scalars)
            return
        if self.warmstart is None:
            ws_dir = self.workdir / "warmstart"
            if (ws_dir / metrics_lib.JSONL_NAME).exists():
                (ws_dir / metrics_lib.JSONL_NAME).unlink()
            self.warmstart = metrics_lib.MetricsLogger(
                ws_dir, table_keys=_WARMSTART_KEYS, plot_keys=("warmstart/loss", "warmstart/correct_fraction")
            )
        self.warmstart.log(step, scalars)

    def close(self) -> None:
        if not self.enabled:
            return
        self.rl.close()
        if self.warmstart is not None:
            self.warmstart.close()
