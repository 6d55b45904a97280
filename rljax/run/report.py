"""What a run reports: per-step metric rows from rollouts and evals, and where they go.

:func:`rollout_step_metrics` and :func:`eval_metrics` turn a :class:`~rljax.rollout.RolloutResult`
into the metric keys of the run (``reward/*``, ``rollout/*``, ``eval/*``); :class:`RunSinks` sends
rows, distributions and rollout samples to the run's sinks (:mod:`rljax.report.sinks`; RL steps under
``workdir``, the warm start under ``workdir/warmstart``).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax import evaluation
from rljax.envs.base import Task
from rljax.report import metrics as metrics_lib
from rljax.report import sinks as sinks_lib
from rljax.report.config import ReportConfig
from rljax.report.records import (
    PreparationTrace,
    drop_rollout_records_after,
    rollout_distributions,
    rollout_records,
    sample_table,
    write_rollout_records,
)
from rljax.rollout import RolloutResult, TrajectoryRecord

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
    if "env_s" in rm:  # the env loop's environment calls, summed (they overlap sampling)
        out["time/env_s"] = rm["env_s"]
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
    """The run's sinks (:mod:`rljax.report.sinks`): for RL steps the stdout table plus
    ``config.report.sinks`` (``jsonl``: ``metrics.jsonl`` and ``metrics.png``; ``tensorboard``;
    ``wandb``; ``mlflow``), all opened here (a sink that cannot start raises); the warm start gets
    its own local logger (``workdir/warmstart``: table, JSONL, TensorBoard, plot), since its steps
    are not RL steps.

    A fresh run (``resume_step=None``) starts a fresh ``metrics.jsonl``. A run resumed from
    checkpoint ``R`` first makes the workdir look as if the run had stopped right after step ``R``
    (the rules of :mod:`rljax.report.sinks`): ``metrics.jsonl`` keeps its lines of steps ``<= R``
    (rewritten atomically: temporary file, ``fsync``, rename; a half-written line is dropped),
    ``rollouts/step_<S>.jsonl`` of ``S > R`` are deleted, TensorBoard purges steps ``> R``, and the
    kept rows go to the sinks as :attr:`RunInfo.history <rljax.report.sinks.RunInfo>`.
    :meth:`flush` makes all of it durable; the trainer calls it before each checkpoint commits.

    ``enabled=False`` (every process but 0 of a multi-process run) writes nothing anywhere."""

    def __init__(
        self,
        workdir: pathlib.Path,
        *,
        resume_step: int | None,
        table_keys: Sequence[str],
        enabled: bool = True,
        report: ReportConfig | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool | None = None,
    ) -> None:
        self.enabled = enabled
        self.workdir = workdir
        self.warmstart: metrics_lib.MetricsLogger | None = None
        self.report = report if report is not None else ReportConfig()
        if not enabled:
            return
        path = workdir / metrics_lib.JSONL_NAME
        history: list[dict[str, Any]] = []
        if resume_step is not None:
            history = _truncate_jsonl(path, resume_step)
            drop_rollout_records_after(workdir, resume_step)
        elif path.exists():
            path.unlink()
        sinks: list[sinks_lib.Sink] = [sinks_lib.StdoutSink(table_keys)]
        for name in self.report.sinks:
            sinks.append(_make_sink(name, self.report, workdir))
        self.rl = sinks_lib.SinkSet(sinks)
        self.rl.open(
            sinks_lib.RunInfo(
                workdir,
                config=sinks_lib.flat_config(config or {}),
                resume=resume_step is not None if resume is None else resume,
                resume_step=resume_step,
                history=history,
            )
        )

    def log(self, step: int, metrics: Mapping[str, Any], *, phase: str = "rl") -> None:
        """Logs one step's ``metrics`` to the RL sinks, or the warm start's (``phase``)."""
        if not self.enabled:
            return
        scalars = {k: v for k, v in metrics.items() if k not in metrics_lib.RESERVED_KEYS}
        if phase == "rl":
            self.rl.log_metrics(step, scalars)
            return
        if self.warmstart is None:
            ws_dir = self.workdir / "warmstart"
            if (ws_dir / metrics_lib.JSONL_NAME).exists():
                (ws_dir / metrics_lib.JSONL_NAME).unlink()
            self.warmstart = metrics_lib.MetricsLogger(
                ws_dir, table_keys=_WARMSTART_KEYS, plot_keys=("warmstart/loss", "warmstart/correct_fraction")
            )
        self.warmstart.log(step, scalars)

    def log_rollouts(
        self,
        step: int,
        trajectories: Sequence[TrajectoryRecord],
        trace: PreparationTrace | None,
        *,
        save: bool,
    ) -> None:
        """Distributions of RL step ``step`` to the sinks; with ``save``, its rollout records to
        ``rollouts/step_<step>.jsonl`` and a sample table to the sinks."""
        if not self.enabled:
            return
        self.rl.log_distributions(step, rollout_distributions(trajectories, trace))
        if save:
            records = rollout_records(trajectories, trace)
            write_rollout_records(self.workdir, step, records)
            self.rl.log_samples(step, sample_table(records, seed=step))

    def flush(self) -> None:
        """Everything logged so far is durable (files ``fsync`` ed; see :meth:`Sink.flush
        <rljax.report.sinks.Sink.flush>`) when this returns; rollout records already are."""
        if self.enabled:
            self.rl.flush()
            if self.warmstart is not None:
                self.warmstart.sync()

    def close(self) -> None:
        """Closes the RL sinks and the warm start's."""
        if not self.enabled:
            return
        self.rl.close()
        if self.warmstart is not None:
            self.warmstart.close()


def _truncate_jsonl(path: pathlib.Path, step: int) -> list[dict[str, Any]]:
    """Keeps the lines of ``path`` whose step is ``<= step`` (atomically) and returns their records.

    Lines that do not parse (the half-written last line of a killed run) are dropped. The file is
    replaced by a temporary copy (``fsync`` ed, renamed, directory ``fsync`` ed), so a crash while
    resuming leaves either the old file or the new one, never a shortened one.

    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> _ = path.write_text('{"step": 1}\\n{"step": 2}\\n{"step": 3}\\n{"st')
    >>> [r["step"] for r in _truncate_jsonl(path, 2)], path.read_text()
    ([1, 2], '{"step": 1}\\n{"step": 2}\\n')
    """
    if not path.exists():
        return []
    kept, records = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) <= step:
            kept.append(line)
            records.append(record)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return records


def _make_sink(name: str, report: ReportConfig, workdir: pathlib.Path) -> sinks_lib.Sink:
    if name == "jsonl":
        return sinks_lib.JsonlMetricsSink(workdir)
    if name == "tensorboard":
        return sinks_lib.TensorBoardMetricsSink(workdir)
    if name == "wandb":
        from rljax.report.wandb_sink import WandbSink

        return WandbSink(report.wandb)
    if name == "mlflow":
        from rljax.report.mlflow_sink import MlflowSink

        return MlflowSink(report.mlflow)
    raise ValueError(f"unknown report sink {name!r}")
