"""The Weights & Biases sink (``config.report.sinks=[..., "wandb"]``, settings ``config.report.wandb``).

``wandb.init(project, entity, name, mode, tags, config=<the run config, flat>, id=, resume="allow")``:
the run id is generated on a fresh run and kept in ``<workdir>/report_runs.json``; ``--resume``
passes it again, so the dashboard run continues (W&B ignores rows at steps it already has, so rows
re-logged after the checkpoint keep their first values). Metrics go to ``run.log(row, step=S)``,
distributions as ``wandb.Histogram`` under ``dist/<name>``, rollout samples as a ``wandb.Table``
under ``rollouts``. Offline mode writes under ``$WANDB_DIR`` (default ``<workdir>``) for ``wandb sync``.
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


class WandbSink(Sink):
    """Logs to one W&B run (see the module docstring)."""

    name = "wandb"

    def __init__(self, config: WandbConfig) -> None:
        self.config = config
        self.run: Any = None
        self.run_id: str | None = None

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

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self.run.log(row, step=step)

    def log_distributions(self, step: int, distributions: Mapping[str, np.ndarray]) -> None:
        import wandb

        row = {
            f"dist/{k}": wandb.Histogram(np.asarray(v, np.float64))
            for k, v in distributions.items()
            if np.asarray(v).size
        }
        if row:
            self.run.log(row, step=step)

    def log_samples(self, step: int, table: SampleTable) -> None:
        import wandb

        data = [[v if isinstance(v, (int, float, str)) else str(v) for v in r] for r in table.rows]
        self.run.log({"rollouts": wandb.Table(columns=list(table.columns), data=data)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
