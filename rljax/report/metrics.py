"""Metrics sinks of a run (design §5): stdout table, JSONL, TensorBoard, a reward/loss plot, progress bars.

:class:`MetricsLogger` fans one ``log(step, metrics)`` call out to

* :class:`StdoutTable`: a compact fixed-width table of a configured list of keys (all other keys
  are hidden), with the header repeated every ``header_every`` rows;
* :class:`JsonlSink`: ``metrics.jsonl``, one JSON object per step (``{"step": N, "time": unix_s,
  **metrics}``), flushed line by line, appended to on resume; non-finite values are written as
  ``null`` so that every line is strict (RFC 8259) JSON;
* :class:`TensorBoardSink`: TensorBoard events under ``tb/`` (records encoded by
  :mod:`rljax.report.event_file`, no TensorFlow or tensorboardX), written synchronously by this process;

Both have ``sync()``: everything written so far is on disk (``fsync``) when it returns; the trainer
calls it before a checkpoint commits, so a ``kill -9`` can never leave a checkpoint ahead of them.

and ``close()`` draws ``metrics.png`` (reward mean and loss vs step, matplotlib's Agg canvas, no
``pyplot`` global state) from the whole JSONL history, so a resumed run plots its full curve.
:class:`Progress` is a tqdm bar for long phases that turns itself off when the stream is not a
terminal or ``CI`` is set, and then prints one summary line when the phase ends.

Only the primary process of a multi-host run should create a logger. The run's sinks
(:mod:`rljax.report.sinks`) wrap these writers behind one interface.
"""

from __future__ import annotations

import decimal
import functools
import json
import math
import numbers
import os
import pathlib
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

import numpy as np

from rljax.progress import Progress, is_ci
from rljax.report.event_file import event, histogram_summary, scalar_summary, text_summary, tfrecord

__all__ = [
    "DEFAULT_PLOT_KEYS",
    "DEFAULT_TABLE_KEYS",
    "JsonlSink",
    "MetricsLogger",
    "Progress",
    "StdoutTable",
    "TensorBoardSink",
    "format_value",
    "is_ci",
    "plot_history",
    "read_jsonl",
]

#: Metrics of the printed table when a run names none.
DEFAULT_TABLE_KEYS: tuple[str, ...] = ("reward/mean", "loss", "rl/clip_frac", "entropy", "grad_norm", "lr")
#: Metrics of ``metrics.png`` when a run names none.
DEFAULT_PLOT_KEYS: tuple[str, ...] = ("reward/mean", "loss")
RESERVED_KEYS: frozenset[str] = frozenset({"step", "time"})
JSONL_NAME, TB_DIR, PLOT_NAME = "metrics.jsonl", "tb", "metrics.png"

Number = int | float


# ------------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------------


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or int(step) < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return int(step)


def _scalar(key: Any, value: Any) -> Number:
    """A metric as a Python ``int`` (integers) or ``float``; one-element arrays are unwrapped."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"metric names must be non-empty str, got {key!r}")
    if key in RESERVED_KEYS:
        raise ValueError(f"metric name {key!r} is reserved for the record itself; rename it (e.g. '{key}/x')")
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy / jax arrays and scalars
        array = np.asarray(value)
        if array.size != 1 or array.dtype.kind not in "biuf":
            raise ValueError(
                f"metric {key!r} must be a single number, got an array of shape {array.shape} and dtype "
                f"{array.dtype}; reduce it (mean, sum) before logging"
            )
        value = array.reshape(()).item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"metric {key!r} must be a number, got {type(value).__name__} {value!r}")


def _scalars(metrics: Mapping[str, Any]) -> dict[str, Number]:
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    return {key: _scalar(key, value) for key, value in metrics.items()}


def format_value(value: Number | None, width: int, *, digits: int = 4) -> str:
    """``value`` right-aligned in exactly ``width`` characters (``-`` when missing).

    Integers print in full when they fit; floats with ``digits`` significant digits (``%g``), and
    fewer digits when the number would not fit otherwise.

    >>> [format_value(v, 9) for v in (0.0123456, 12, 123456789012, None, float("nan"), -1.23456e-12)]
    ['  0.01235', '       12', '1.235e+11', '        -', '      nan', '-1.23e-12']
    """
    if width < 8:
        raise ValueError(f"width must be >= 8 to hold any number, got {width}")
    if value is None:
        text = "-"
    elif isinstance(value, int) and len(str(value)) <= width:
        text = str(value)
    elif math.isnan(value) or math.isinf(value):
        text = str(float(value))
    else:
        for precision in range(digits, 0, -1):
            text = f"{value:.{precision}g}"
            if math.isinf(float(text)):  # rounded up past the largest float: truncate instead
                truncated = decimal.Context(prec=precision, rounding=decimal.ROUND_DOWN).create_decimal(value)
                text = f"{float(truncated):.{precision}g}"
            if len(text) <= width:
                break
    return text.rjust(width)


# ------------------------------------------------------------------------------------------------
# Sinks
# ------------------------------------------------------------------------------------------------


class StdoutTable:
    """A fixed-width table of ``keys`` (other metrics hidden), header every ``header_every`` rows.

    >>> import io
    >>> out = io.StringIO()
    >>> table = StdoutTable(["loss", "reward/mean"], header_every=2, stream=out)
    >>> for step in range(3):
    ...     table.write(step, {"loss": 1.0 / (step + 1), "reward/mean": step, "hidden": 7.0})
    >>> print(out.getvalue(), end="")
        step        loss  reward/mean
           0           1            0
           1         0.5            1
        step        loss  reward/mean
           2      0.3333            2
    """

    def __init__(
        self,
        keys: Sequence[str],
        *,
        header_every: int = 20,
        width: int = 10,
        digits: int = 4,
        stream: IO[str] | None = None,
    ) -> None:
        if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"keys must be a list of metric names, got {keys!r}")
        if isinstance(header_every, bool) or not isinstance(header_every, int) or header_every < 1:
            raise ValueError(f"header_every must be an int >= 1 (rows between headers), got {header_every!r}")
        format_value(0.0, width)  # validates width
        self.keys = tuple(keys)
        self.header_every = header_every
        self.digits = digits
        self.stream = stream
        self._widths = [max(width, len(k)) for k in self.keys]
        self._step_width = 8
        self._rows = 0

    def header(self) -> str:
        """The header line (step and the key names, aligned with the value columns)."""
        columns = zip(self.keys, self._widths, strict=True)
        cells = ["step".rjust(self._step_width)] + [k.rjust(w) for k, w in columns]
        return "  ".join(cells)

    def row(self, step: int, metrics: Mapping[str, Number]) -> str:
        """One table line for ``step``; keys absent from ``metrics`` show ``-``."""
        cells = [str(step).rjust(self._step_width)]
        columns = zip(self.keys, self._widths, strict=True)
        cells += [format_value(metrics.get(k), w, digits=self.digits) for k, w in columns]
        return "  ".join(cells)

    def write(self, step: int, metrics: Mapping[str, Number]) -> None:
        """Prints the row of ``step`` (after a header on rows 0, N, 2N, ...)."""
        stream = self.stream if self.stream is not None else sys.stdout
        lines = [self.header()] if self._rows % self.header_every == 0 else []
        lines.append(self.row(_check_step(step), _scalars(metrics)))
        stream.write("\n".join(lines) + "\n")
        stream.flush()
        self._rows += 1

    def close(self) -> None:
        """Nothing to release (the stream belongs to the caller)."""


def _json_value(value: Number) -> Number | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlSink:
    """Appends ``{"step": N, "time": unix_seconds, **metrics}`` lines to ``path``, flushing each one.

    A file left with a partial last line by a crash gets a newline first, so the partial line stays
    isolated (and :func:`read_jsonl` skips it).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
    >>> sink = JsonlSink(path)
    >>> sink.write(3, {"loss": 0.5, "tokens": 12, "bad": float("inf")})
    >>> sink.close()
    >>> [{k: v for k, v in r.items() if k != "time"} for r in read_jsonl(path)]
    [{'step': 3, 'loss': 0.5, 'tokens': 12, 'bad': None}]
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        self._file = open(self.path, "a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")

    def write(self, step: int, metrics: Mapping[str, Number]) -> None:
        """Appends and flushes the record of ``step`` (to the OS: a killed process loses nothing)."""
        record = {"step": _check_step(step), "time": round(time.time(), 3)}
        record.update({k: _json_value(v) for k, v in _scalars(metrics).items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def sync(self) -> None:
        """``fsync`` of the file: the records written so far survive a machine crash too."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Closes the file."""
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSONL file in file order; malformed lines (a crash mid-line) are skipped.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
    >>> _ = path.write_text('{"step": 1, "loss": 2.0}\\n{"step": 2, "lo')
    >>> read_jsonl(path)
    [{'step': 1, 'loss': 2.0}]
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if line.endswith("\n"):  # a partial LAST line is the normal trace of a crash: no warning
                    warnings.warn(f"{path}:{number}: skipping a malformed line", stacklevel=2)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


@functools.cache
def _histogram_edges() -> list[float]:
    """TensorFlow's default histogram bucket edges (what ``SummaryWriter.add_histogram`` uses):
    ``+-1e-12 * 1.1**k`` up to 1e20, and 0."""
    edges, v = [], 1e-12
    while v < 1e20:
        edges.append(v)
        v *= 1.1
    return [-e for e in reversed(edges)] + [0.0] + edges


def _next_event_seconds(logdir: pathlib.Path) -> int:
    """The seconds field of a new event file's name: now, or one past the newest existing file's
    (TensorBoard reads a directory's files in name order; a resumed run's file must come last)."""
    now = int(time.time())
    for path in logdir.glob("events.out.tfevents.*"):
        field = path.name.split(".")[3]
        if field.isdigit():
            now = max(now, int(field) + 1)
    return now


class TensorBoardSink:
    """TensorBoard events (one scalar tag per metric, histograms, text) in a new event file of ``logdir``.

    Events are written by the calling thread: each call appends TFRecords (``uint64`` length, its
    masked CRC-32C, the serialized ``Event``, its masked CRC-32C) and flushes them to the OS, and
    :meth:`sync` ``fsync`` s the file. (``tensorboardX.SummaryWriter`` hands events to a background
    thread through a queue, and its ``flush()`` does not wait for that queue, so an event logged just
    before a ``kill -9`` could be lost after the checkpoint that follows it had committed.)

    ``purge_step=S`` (a resumed run, ``S`` = the checkpoint's step + 1) starts the file with a
    ``SessionLog.START`` event at step ``S``: TensorBoard then discards the events of EARLIER files
    of the directory at steps ``>= S`` (those a killed run wrote after its last checkpoint), so each
    step shows once, with the resumed run's values. TensorBoard reads a directory's files in name
    order; names start with ``events.out.tfevents.<unix seconds>``, and a new file's seconds are
    past every existing file's (a restart within the same second still sorts after the first file).

    Non-finite values are written as they are (TensorBoard shows them as gaps / NaN).

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> sink = TensorBoardSink(d)
    >>> sink.write(1, {"loss": 0.25})
    >>> sink.close()
    >>> any(name.startswith("events.out.tfevents") for name in os.listdir(d))
    True
    """

    def __init__(self, logdir: str | os.PathLike, *, purge_step: int | None = None) -> None:
        self.logdir = pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # pid + random suffix: two writers started in the same second never share (truncate) a file;
        # the seconds field is past every existing file's, so this file sorts (and is read) last
        name = (
            f"events.out.tfevents.{_next_event_seconds(self.logdir):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        )
        self.path = self.logdir / name
        self._file = open(self.path, "xb")  # noqa: SIM115 - closed by close()
        self._file.write(tfrecord(event(wall_time=time.time(), file_version="brain.Event:2")))
        if purge_step is not None:
            start = event(wall_time=time.time(), step=_check_step(purge_step), session_start=True)
            self._file.write(tfrecord(start))
        self._file.flush()

    def _summary(self, step: int, summary: bytes) -> None:
        self._file.write(tfrecord(event(wall_time=time.time(), step=_check_step(step), summary=summary)))

    def write(self, step: int, metrics: Mapping[str, Number]) -> None:
        """One scalar event per metric at ``step``, flushed. The tag is the metric's name as it is
        (``tensorboardX.summary.scalar`` would turn ``eval/pass@1`` and ``eval/pass^1`` both into
        ``eval/pass_1``: one series with two points per step)."""
        for key, value in _scalars(metrics).items():
            self._summary(step, scalar_summary(key, float(value)))
        self._file.flush()

    def histogram(self, step: int, tag: str, values: np.ndarray) -> None:
        """A histogram event of ``values`` (1-D finite numbers) under ``tag`` at ``step``, flushed."""
        self._summary(step, histogram_summary(tag, np.asarray(values, np.float64), _histogram_edges()))
        self._file.flush()

    def text(self, step: int, tag: str, markdown: str) -> None:
        """A text (Markdown) event under ``<tag>/text_summary`` at ``step``, flushed."""
        self._summary(step, text_summary(tag, markdown))
        self._file.flush()

    def sync(self) -> None:
        """``fsync`` of the event file: the events written so far survive a machine crash too."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flushes and closes the event file."""
        if not self._file.closed:
            self._file.close()


# ------------------------------------------------------------------------------------------------
# Plot
# ------------------------------------------------------------------------------------------------


def _series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``key``, one point per step (the last value logged for a step wins: a
    resumed run re-logs steps), sorted by step; records without it or with ``null`` are skipped."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(key)
        if "step" in record and isinstance(value, numbers.Real) and not isinstance(value, bool):
            by_step[int(record["step"])] = float(value)
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """``out[i] = mean(values[max(0, i - window + 1) : i + 1])``."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def plot_history(
    records: Sequence[Mapping[str, Any]] | str | os.PathLike,
    path: str | os.PathLike,
    *,
    keys: Sequence[str] = DEFAULT_PLOT_KEYS,
    title: str | None = None,
) -> pathlib.Path:
    """Writes a PNG with one panel per key (value vs step) from records or a JSONL file.

    Each panel shows the raw curve and, from 20 points on, a trailing mean over ~5% of the points.

    >>> import tempfile, pathlib
    >>> out = plot_history([{"step": s, "loss": 1 / (s + 1)} for s in range(5)],
    ...                    pathlib.Path(tempfile.mkdtemp()) / "p.png", keys=["loss"])
    >>> out.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    from matplotlib.figure import Figure  # Agg canvas via savefig; no pyplot global state

    if isinstance(records, str | os.PathLike):
        records = read_jsonl(records)
    if isinstance(keys, str) or not keys:
        raise ValueError(f"keys must be a non-empty list of metric names, got {keys!r}")
    fig = Figure(figsize=(7.0, 2.4 * len(keys) + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys, strict=True):
        steps, values = _series(records, key)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if len(steps) == 0:
            ax.text(0.5, 0.5, f"no data for {key!r}", ha="center", va="center", transform=ax.transAxes)
            continue
        smooth = len(steps) >= 20
        ax.plot(
            steps,
            values,
            color="tab:blue",
            alpha=0.35 if smooth else 1.0,
            lw=1.0,
            marker="" if len(steps) > 50 else "o",
            ms=3,
            label=key,
        )
        if smooth:
            window = max(2, len(steps) // 20)
            mean = _trailing_mean(values, window)
            ax.plot(steps, mean, color="tab:blue", lw=2.0, label=f"mean of last {window}")
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# ------------------------------------------------------------------------------------------------
# The logger
# ------------------------------------------------------------------------------------------------


class MetricsLogger:
    """Stdout table + JSONL + TensorBoard behind one ``log(step, metrics)``; ``close()`` plots.

    Args:
      logdir: where ``metrics.jsonl``, ``tb/`` and ``metrics.png`` go; ``None`` = stdout only.
      table_keys: metrics shown on stdout, in this order (others are hidden there, but kept in
        JSONL and TensorBoard).
      header_every: rows between repeated table headers.
      stdout, jsonl, tensorboard, plot: turn each sink off.
      plot_keys: panels of the final plot.
      stream: the table's stream (default ``sys.stdout``).

    >>> import io, tempfile
    >>> out = io.StringIO()
    >>> with MetricsLogger(tempfile.mkdtemp(), table_keys=["loss"], stream=out) as logger:
    ...     logger.log(0, {"loss": 0.5, "reward/mean": 0.25})
    >>> print(out.getvalue(), end="")
        step        loss
           0         0.5
    >>> logger.plot_path.name
    'metrics.png'
    """

    def __init__(
        self,
        logdir: str | os.PathLike | None = None,
        *,
        table_keys: Sequence[str] = DEFAULT_TABLE_KEYS,
        header_every: int = 20,
        stdout: bool = True,
        jsonl: bool = True,
        tensorboard: bool = True,
        plot: bool = True,
        plot_keys: Sequence[str] = DEFAULT_PLOT_KEYS,
        stream: IO[str] | None = None,
    ) -> None:
        self.logdir = None if logdir is None else pathlib.Path(logdir)
        self.plot_keys = tuple(plot_keys)
        self.plot_path: pathlib.Path | None = None
        self._plot = plot and self.logdir is not None
        self._records: list[dict[str, Number]] = []
        self.table = StdoutTable(table_keys, header_every=header_every, stream=stream) if stdout else None
        self.jsonl = JsonlSink(self.logdir / JSONL_NAME) if jsonl and self.logdir is not None else None
        self.tensorboard = (
            TensorBoardSink(self.logdir / TB_DIR) if tensorboard and self.logdir is not None else None
        )
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Sends the metrics of ``step`` to every sink (values: numbers or one-element arrays)."""
        if self._closed:
            raise ValueError("this MetricsLogger is closed; create a new one to keep logging")
        step = _check_step(step)
        values = _scalars(metrics)
        for sink in (self.table, self.jsonl, self.tensorboard):
            if sink is not None:
                sink.write(step, values)
        if self.jsonl is None:
            self._records.append({"step": step, **values})

    def sync(self) -> None:
        """``fsync`` of the JSONL and TensorBoard files (everything logged so far is on disk)."""
        for sink in (self.jsonl, self.tensorboard):
            if sink is not None and not self._closed:
                sink.sync()

    def close(self) -> pathlib.Path | None:
        """Closes the sinks and writes ``metrics.png`` (from the JSONL history); returns its path."""
        if self._closed:
            return self.plot_path
        self._closed = True
        for sink in (self.table, self.jsonl, self.tensorboard):
            if sink is not None:
                sink.close()
        if self._plot:
            records = read_jsonl(self.jsonl.path) if self.jsonl is not None else self._records
            self.plot_path = plot_history(records, self.logdir / PLOT_NAME, keys=self.plot_keys)
        return self.plot_path

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
