"""The sink interface of a run's reporting, and the local sinks (stdout table, JSONL, TensorBoard).

A :class:`Sink` is opened once with the run's :class:`RunInfo`, then receives, per RL step,

* ``log_metrics(step, row)``: the step's scalar metrics (every sink);
* ``log_distributions(step, {name: values})``: per-step distributions (reward per trajectory,
  advantage, response length, turns per trajectory, samples per trajectory after merge), to sinks
  that draw histograms (TensorBoard, Weights & Biases);
* ``log_samples(step, table)``: every ``trainer.save_rollouts_every`` steps, a table of sampled
  rollouts (:class:`SampleTable`), to sinks that show tables (TensorBoard text, W&B tables, MLflow
  artifacts);

* ``flush()``: everything logged so far must be durable when it returns: files written and
  ``fsync`` ed (JSONL, TensorBoard), remote calls answered. The trainer calls it after a step's row
  and records and BEFORE that step's checkpoint commits, so a committed checkpoint is never ahead
  of its sinks (a ``kill -9`` right after the commit loses nothing);

and is closed at the end. :class:`SinkSet` fans each call out: a sink that cannot START is an
error (the run stops before its first step, naming the sink); a sink that raises mid-run is warned
about once (``RuntimeWarning``) and the run goes on, the other sinks unaffected.

Resume from checkpoint ``R`` (:class:`RunInfo` ``resume_step``). A killed run may have logged steps
after ``R`` (their checkpoint never committed); the resumed run trains them again. Every step must
end up in each sink exactly once:

* ``metrics.jsonl``: lines of steps ``> R`` (and a half-written last line) are dropped before the
  sink opens (:class:`rljax.run.report.RunSinks`), so the file reads as one uninterrupted run;
* ``rollouts/step_<S>.jsonl``: files of ``S > R`` are deleted likewise;
* TensorBoard: the resumed run's event file starts with a purge event at step ``R + 1``
  (``SessionLog.START``), so TensorBoard discards the killed run's events of steps ``> R``;
* W&B and MLflow keep a history per run that only grows: a step they already have keeps its first
  values and is not sent again (no duplicates; the redone step's values equal the first ones in a
  deterministic run, wall-clock times aside), and steps up to ``R`` that they lack are sent again
  from ``metrics.jsonl`` (``RunInfo.history``): see each sink's module for how it knows.

Remote sinks (:mod:`rljax.report.wandb_sink`, :mod:`rljax.report.mlflow_sink`) remember the id of
the run they log to in ``<workdir>/report_runs.json`` (:func:`load_run_ids`), so that ``--resume``
continues the same dashboard run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import warnings
from collections.abc import Mapping, Sequence
from typing import IO, Any, ClassVar

import numpy as np

from rljax.report import metrics as metrics_lib

__all__ = [
    "SAMPLE_COLUMNS",
    "JsonlMetricsSink",
    "RunInfo",
    "SampleTable",
    "Sink",
    "SinkSet",
    "StdoutSink",
    "TensorBoardMetricsSink",
    "flat_config",
    "load_run_ids",
    "save_run_id",
]

logger = logging.getLogger(__name__)

RUN_IDS_NAME = "report_runs.json"

#: Columns of a rollout sample table (one row per trajectory).
SAMPLE_COLUMNS: tuple[str, ...] = (
    "trajectory_id",
    "env",
    "turns",
    "messages",
    "completion",
    "reward",
    "advantage",
    "stop_reason",
    "length",
    "status",
)


@dataclasses.dataclass(frozen=True)
class SampleTable:
    """Sampled rollouts of one step: ``rows`` of values in :data:`SAMPLE_COLUMNS` order.

    ``messages`` is the last call's conversation as JSON text, ``completion`` the trajectory's last
    completion, ``length`` its completion tokens over all turns, ``status`` "trained", "filtered"
    (an enforcing filter zeroed it), "errored" or "dropped" (not in the trained batch).
    """

    rows: tuple[tuple[Any, ...], ...]
    columns: tuple[str, ...] = SAMPLE_COLUMNS

    def as_dicts(self) -> list[dict[str, Any]]:
        """The rows as dicts keyed by column."""
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a sink is opened with.

    Attributes:
      workdir: the run's directory (sinks keep their files and run ids there).
      config: the run config as flat ``{"trainer.seq_len": 384, ...}`` (the run's config / params).
      resume: the run continues from a checkpoint: remote sinks continue the run recorded in
        ``workdir`` (a fresh run when none is).
      resume_step: the checkpoint's step (rows after it are logged again).
      history: on resume, the rows of steps ``<= resume_step`` that ``metrics.jsonl`` holds
        (``{"step": S, "time": t, **metrics}``, in step order), for sinks that may have lost some
        (a remote service's buffer dies with the killed process) and send them again.
    """

    workdir: pathlib.Path
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resume: bool = False
    resume_step: int | None = None
    history: Sequence[Mapping[str, Any]] = ()

    @property
    def name(self) -> str:
        """The run's name: its workdir's folder name."""
        return self.workdir.name


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened to dotted keys; lists and tuples kept as lists.

    >>> flat_config({"a": {"b": 1, "c": (2, 3)}, "d": {}})
    {'a.b': 1, 'a.c': [2, 3], 'd': {}}
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flat_config(value, path))
        else:
            out[path] = list(value) if isinstance(value, tuple) else value
    return out


def load_run_ids(workdir: str | os.PathLike) -> dict[str, Any]:
    """``{sink name: what it recorded}`` from ``<workdir>/report_runs.json`` ({} when absent)."""
    path = pathlib.Path(workdir) / RUN_IDS_NAME
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def save_run_id(workdir: str | os.PathLike, sink: str, value: Mapping[str, Any]) -> None:
    """Records what ``sink`` needs to continue its run (atomically: write then rename)."""
    path = pathlib.Path(workdir) / RUN_IDS_NAME
    data = load_run_ids(workdir)
    data[sink] = dict(value)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


class Sink:
    """The interface (every method but :meth:`log_metrics` defaults to doing nothing)."""

    name: ClassVar[str] = "sink"

    def open(self, run: RunInfo) -> None:
        """Starts the sink; raising here stops the run before it trains."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """The scalar metrics of RL step ``step``."""
        raise NotImplementedError

    def log_distributions(self, step: int, distributions: Mapping[str, np.ndarray]) -> None:
        """Per-step distributions (1-D arrays of values); sinks without histograms ignore them."""

    def log_samples(self, step: int, table: SampleTable) -> None:
        """A table of sampled rollouts; sinks without tables ignore it."""

    def flush(self) -> None:
        """Makes everything logged so far durable (called before a checkpoint commits)."""

    def close(self) -> None:
        """Flushes and releases the sink."""


class StdoutSink(Sink):
    """The fixed-width table of ``keys`` on stdout (:class:`rljax.report.metrics.StdoutTable`)."""

    name = "stdout"

    def __init__(self, keys: Sequence[str], *, stream: IO[str] | None = None) -> None:
        self.table = metrics_lib.StdoutTable(keys, stream=stream)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.table.write(step, metrics)


class JsonlMetricsSink(Sink):
    """``metrics.jsonl`` (:class:`rljax.report.metrics.JsonlSink`), and ``metrics.png`` of
    ``plot_keys`` drawn from the whole file at close (a resumed run plots its full curve)."""

    name = "jsonl"

    def __init__(
        self, logdir: str | os.PathLike, *, plot_keys: Sequence[str] = metrics_lib.DEFAULT_PLOT_KEYS
    ):
        self.logdir = pathlib.Path(logdir)
        self.plot_keys = tuple(plot_keys)
        self.writer: metrics_lib.JsonlSink | None = None
        self.plot_path: pathlib.Path | None = None

    def open(self, run: RunInfo) -> None:
        self.writer = metrics_lib.JsonlSink(self.logdir / metrics_lib.JSONL_NAME)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self.writer is not None, "open() the sink first"
        self.writer.write(step, metrics)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.sync()

    def close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        self.plot_path = metrics_lib.plot_history(
            self.writer.path, self.logdir / metrics_lib.PLOT_NAME, keys=self.plot_keys
        )


class TensorBoardMetricsSink(Sink):
    """TensorBoard under ``<logdir>/tb``: scalars, histograms (``dist/<name>``) and the sample
    table as a Markdown text summary (``rollouts``). A resumed run's file starts with a purge event
    at ``resume_step + 1`` (:class:`rljax.report.metrics.TensorBoardSink`)."""

    name = "tensorboard"
    MAX_TEXT_ROWS: ClassVar[int] = 16
    MAX_CELL_CHARS: ClassVar[int] = 400

    def __init__(self, logdir: str | os.PathLike) -> None:
        self.logdir = pathlib.Path(logdir)
        self.writer: metrics_lib.TensorBoardSink | None = None

    def open(self, run: RunInfo) -> None:
        purge = None if run.resume_step is None else run.resume_step + 1
        self.writer = metrics_lib.TensorBoardSink(self.logdir / metrics_lib.TB_DIR, purge_step=purge)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self.writer is not None, "open() the sink first"
        self.writer.write(step, metrics)

    def log_distributions(self, step: int, distributions: Mapping[str, np.ndarray]) -> None:
        assert self.writer is not None, "open() the sink first"
        for key, values in distributions.items():
            values = np.asarray(values, np.float64)
            if values.size:
                self.writer.histogram(step, f"dist/{key}", values)

    def log_samples(self, step: int, table: SampleTable) -> None:
        assert self.writer is not None, "open() the sink first"

        def cell(v: Any) -> str:
            text = str(v).replace("|", "\\|").replace("\n", " ")
            return text if len(text) <= self.MAX_CELL_CHARS else text[: self.MAX_CELL_CHARS] + "…"

        lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
        lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in table.rows[: self.MAX_TEXT_ROWS]]
        self.writer.text(step, "rollouts", "\n".join(lines))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.sync()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class SinkSet:
    """Several sinks behind one interface: opening fails loudly, logging warns once per sink.

    >>> class Broken(Sink):
    ...     name = "broken"
    ...     def log_metrics(self, step, metrics):
    ...         raise OSError("disk full")
    >>> import warnings
    >>> sinks = SinkSet([Broken()])
    >>> sinks.open(RunInfo(pathlib.Path(".")))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     sinks.log_metrics(1, {"loss": 1.0}); sinks.log_metrics(2, {"loss": 1.0})
    >>> len(caught), sinks.failures
    (1, {'broken': 2})
    """

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)
        self.failures: dict[str, int] = {}
        self._opened: list[Sink] = []

    def open(self, run: RunInfo) -> None:
        """Opens every sink; one that cannot start closes those already open and raises ``RuntimeError``."""
        for sink in self.sinks:
            try:
                sink.open(run)
            except Exception as e:
                self.close()
                raise RuntimeError(
                    f"report sink {sink.name!r} could not start: {type(e).__name__}: {e}"
                ) from e
            self._opened.append(sink)

    def _each(self, method: str, step: int | None, *args: Any) -> None:
        for sink in self._opened:
            try:
                getattr(sink, method)(*args) if step is None else getattr(sink, method)(step, *args)
            except Exception as e:  # a dashboard failing mid-run never stops training
                count = self.failures.get(sink.name, 0)
                self.failures[sink.name] = count + 1
                if count == 0:
                    where = "" if step is None else f" at step {step}"
                    message = (
                        f"report sink {sink.name!r} failed in {method}{where}: {type(e).__name__}: "
                        f"{e}; the run goes on (later failures of this sink are counted, not reported)"
                    )
                    logger.warning(message)
                    warnings.warn(message, RuntimeWarning, stacklevel=3)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Logs ``metrics`` to every sink (a failing sink warns once and the run goes on)."""
        self._each("log_metrics", step, metrics)

    def log_distributions(self, step: int, distributions: Mapping[str, np.ndarray]) -> None:
        """Logs ``distributions`` to every sink (a failing sink warns once and the run goes on)."""
        self._each("log_distributions", step, distributions)

    def log_samples(self, step: int, table: SampleTable) -> None:
        """Logs the sample ``table`` to every sink (a failing sink warns once and the run goes on)."""
        self._each("log_samples", step, table)

    def flush(self) -> None:
        self._each("flush", None)

    def close(self) -> None:
        """Closes the open sinks in reverse order; a failure to close warns."""
        opened, self._opened = self._opened, []
        for sink in reversed(opened):
            try:
                sink.close()
            except Exception as e:
                logger.warning("report sink %r failed to close: %s: %s", sink.name, type(e).__name__, e)
                warnings.warn(f"report sink {sink.name!r} failed to close: {e}", RuntimeWarning, stacklevel=2)
