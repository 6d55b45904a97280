"""The MLflow sink (``config.report.sinks=[..., "mlflow"]``, settings ``config.report.mlflow``).

Through ``mlflow.MlflowClient(tracking_uri)`` (default: ``$MLFLOW_TRACKING_URI`` when set, else
``sqlite:///<workdir>/mlflow.db``, MLflow's recommended local store; a ``file:`` store works too
where ``MLFLOW_ALLOW_FILE_STORE=true``, since MLflow 3 put it in maintenance mode): a run of
``experiment`` (created when missing) named ``run_name``; the run config is its
params (flat keys; values cut to MLflow's 6000 characters). Metrics are ``log_batch``-ed with
``step=S``; MLflow keys allow letters, digits and ``_-. :/`` only, so other characters become ``_``
(``eval/pass@1`` -> ``eval/pass_1``) and non-finite values are left out (JSONL writes them as null).
Rollout samples are table artifacts ``rollouts/step_<S>.json`` (an experiment this sink creates in a
local store keeps its artifacts in ``<workdir>/mlflow-artifacts``); MLflow has no histograms, so
distributions are not sent. The run id is kept in ``<workdir>/report_runs.json``: ``--resume``
continues that run (and leaves its params as they are).

Resume from checkpoint ``R`` (the rules of :mod:`rljax.report.sinks`). MLflow keeps every value
logged, so a step logged twice would have two points, and ``log_table`` appends to an existing
table artifact. ``log_batch`` is synchronous (the store has the row when it returns), so after a
``kill -9`` the run holds every step whose checkpoint committed, and maybe steps after ``R``. On
resume the sink reads which ``(key, step)`` pairs and ``rollouts/step_<S>.json`` tables the run
already has and never sends those again (a redone step keeps its first values: the killed run's,
equal in a deterministic run but for wall-clock times); rows of ``metrics.jsonl`` up to ``R``
(``RunInfo.history``) that the run lacks are sent again.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import time
from collections.abc import Mapping

from rljax.report.config import MlflowConfig
from rljax.report.sinks import RunInfo, SampleTable, Sink, load_run_ids, save_run_id

__all__ = ["MlflowSink", "mlflow_key"]

_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")
MAX_PARAM_CHARS = 6000
BATCH = 1000  # MLflow's limit of metrics per log_batch call


#: Characters of rljax's own metric names that MLflow rejects, spelled out so that names which differ
#: only in them stay two series (``pass@k`` and ``pass^k`` would both become ``pass_k``).
_SPELLED = {"@": "_at_", "^": "_all_"}


def mlflow_key(key: str) -> str:
    """``key`` with the characters MLflow rejects replaced: ``@`` by ``_at_``, ``^`` by ``_all_``
    (pass^k: all k samples correct), any other by ``_``.

    >>> mlflow_key("eval/pass@1"), mlflow_key("eval/pass^1"), mlflow_key("reward/mean")
    ('eval/pass_at_1', 'eval/pass_all_1', 'reward/mean')
    """
    for char, spelled in _SPELLED.items():
        key = key.replace(char, spelled)
    return _BAD.sub("_", key)


class MlflowSink(Sink):
    """Logs to one MLflow run (see the module docstring)."""

    name = "mlflow"

    def __init__(self, config: MlflowConfig) -> None:
        self.config = config
        self.client = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self.logged: dict[str, set[int]] = {}  # a continued run's {MLflow key: steps it has}
        self.tables: set[str] = set()  # a continued run's rollouts/step_<S>.json artifacts

    def open(self, run: RunInfo) -> None:
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Param
        except ImportError as e:
            raise ImportError("the mlflow sink needs the mlflow package: pip install 'rljax[report]'") from e
        uri = (
            self.config.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(pathlib.Path(run.workdir) / 'mlflow.db').absolute()}"
        )
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        recorded = load_run_ids(run.workdir).get(self.name, {}) if run.resume else {}
        if recorded.get("run_id") and recorded.get("tracking_uri") == uri:
            self.run_id = recorded["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._read_logged()
            for record in run.history:
                self.log_metrics(int(record["step"]), record)
        else:
            # a local store (sqlite / file) would put artifacts under ./mlruns of the CWD: keep them
            # in the workdir; a tracking server decides for itself
            local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
            artifacts = (
                (pathlib.Path(run.workdir) / "mlflow-artifacts").absolute().as_uri() if local else None
            )
            experiment = self.client.get_experiment_by_name(self.config.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(self.config.experiment, artifact_location=artifacts)
            )
            created = self.client.create_run(experiment_id, run_name=self.config.run_name or run.name)
            self.run_id = created.info.run_id
            params = [Param(mlflow_key(k), str(v)[:MAX_PARAM_CHARS]) for k, v in sorted(run.config.items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        save_run_id(run.workdir, self.name, {"run_id": self.run_id, "tracking_uri": uri})

    def _read_logged(self) -> None:
        """What the continued run already has: every metric's steps and the table artifacts."""
        for key in self.client.get_run(self.run_id).data.metrics:
            self.logged[key] = {m.step for m in self.client.get_metric_history(self.run_id, key)}
        self.tables = {a.path for a in self.client.list_artifacts(self.run_id, "rollouts")}

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(mlflow_key(k), float(v), now, int(step))
            for k, v in metrics.items()
            if k not in ("step", "time")  # a metrics.jsonl record sent again
            and v is not None
            and math.isfinite(float(v))
            and int(step) not in self.logged.get(mlflow_key(k), ())
        ]
        for i in range(0, len(rows), BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i : i + BATCH])

    def log_samples(self, step: int, table: SampleTable) -> None:
        artifact = f"rollouts/step_{step}.json"
        if artifact in self.tables:
            return
        columns = {c: [r[i] for r in table.rows] for i, c in enumerate(table.columns)}
        self.client.log_table(self.run_id, data=columns, artifact_file=artifact)

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.client = None
