"""The Weights & Biases sink (``config.report.sinks=[..., "wandb"]``, settings ``config.report.wandb``).

``wandb.init(project, entity, name, mode, tags, config=<the run config, flat>, id=, resume="allow")``:
the run id is generated on a fresh run and kept in ``<workdir>/report_runs.json``; ``--resume``
passes it again, so the dashboard run continues. Metrics go to ``run.log(row, step=S)``,
distributions as ``wandb.Histogram`` under ``dist/<name>``, rollout samples as a ``wandb.Table``
under ``rollouts``. Offline mode writes under ``$WANDB_DIR`` (default ``<workdir>``) for ``wandb sync``.

Resume from checkpoint ``R`` (the rules of :mod:`rljax.report.sinks`). W&B's history of a run only
grows and its steps must increase: a resumed run's ``run.step`` is the step after the last one W&B
has, and W&B drops rows logged at smaller steps. ``wandb.log`` is not durable: it hands the row to
W&B's service process, which buffers it, and a ``kill -9`` of the trainer makes that process shut
down without writing its buffer (measured with wandb 0.31: an offline run killed 10 s after
logging three rows had written none of them). So on resume this sink first sends again the rows of
``metrics.jsonl`` (``RunInfo.history``: steps ``<= R``, written and ``fsync`` ed before their
checkpoint committed; this needs the ``jsonl`` sink, on by default) from ``run.step`` on, which are
exactly the steps W&B lacks, and then skips calls for steps below that ``run.step``: W&B keeps its
first values of those (the killed run's, equal in a deterministic run but for wall-clock times).
Only scalars are sent again; histograms and sample tables of lost steps stay lost. Offline, W&B
knows nothing of earlier files (``run.step`` is 0): the resumed file holds every step from 1, and
``wandb sync`` of the files in the order they were written keeps each step's first row.
"""

from __future__ import annotations

import math
import os
import secrets
import string
from collections.abc import Mapping
from typing import Any

import numpy as np

from rljax.report.config import WandbConfig
from rljax.report.sinks import RunInfo, SampleTable, Sink, load_run_ids, save_run_id

__all__ = ["WandbSink"]


def _config_value(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool, type(None), list)) else str(v)


def _new_run_id() -> str:
    """8 random lowercase letters and digits (the form of W&B's own run ids)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _row(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (``step`` / ``time`` of a JSONL record and nulls left out).

    >>> _row({"step": 3, "time": 1.5, "loss": 0.25, "kl": None, "bad": float("nan"), "n": 2})
    {'loss': 0.25, 'n': 2.0}
    """
    return {
        k: float(v)
        for k, v in metrics.items()
        if k not in ("step", "time") and v is not None and math.isfinite(float(v))
    }


class WandbSink(Sink):
    """Logs to one W&B run (see the module docstring)."""

    name = "wandb"

    def __init__(self, config: WandbConfig) -> None:
        self.config = config
        self.run: Any = None
        self.run_id: str | None = None
        self.first_step = 0  # W&B's next step when the sink opened: smaller steps are skipped
        self.resent: list[int] = []  # steps of RunInfo.history sent again on resume

    def open(self, run: RunInfo) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("the wandb sink needs the wandb package: pip install 'rljax[report]'") from e
        recorded = load_run_ids(run.workdir).get(self.name, {}) if run.resume else {}
        self.run_id = recorded.get("id") or _new_run_id()
        directory = os.environ.get("WANDB_DIR") or str(run.workdir)
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            name=self.config.name or run.name,
            mode=self.config.mode,
            tags=list(self.config.tags) or None,
            config={k: _config_value(v) for k, v in run.config.items()},
            id=self.run_id,
            resume="allow",
            dir=directory,
            reinit="create_new",
        )
        save_run_id(run.workdir, self.name, {"id": self.run_id, "project": self.config.project})
        if run.resume:
            self.first_step = int(self.run.step)
            for record in run.history:
                step = int(record["step"])
                if step >= self.first_step:
                    self.run.log(_row(record), step=step)
                    self.resent.append(step)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if step >= self.first_step:
            self.run.log(_row(metrics), step=step)

    def log_distributions(self, step: int, distributions: Mapping[str, np.ndarray]) -> None:
        import wandb

        if step < self.first_step:
            return
        row = {
            f"dist/{k}": wandb.Histogram(np.asarray(v, np.float64))
            for k, v in distributions.items()
            if np.asarray(v).size
        }
        if row:
            self.run.log(row, step=step)

    def log_samples(self, step: int, table: SampleTable) -> None:
        import wandb

        if step < self.first_step:
            return
        data = [[v if isinstance(v, (int, float, str)) else str(v) for v in r] for r in table.rows]
        self.run.log({"rollouts": wandb.Table(columns=list(table.columns), data=data)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
