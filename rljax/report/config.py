"""``config.report``: where a run's metrics, rollout tables and distributions go.

Each class validates itself; its errors start with the field name (``"mode: ..."``), which the run
config turns into the key path (``config.report.wandb.mode: ...``).

>>> ReportConfig().sinks
('jsonl', 'tensorboard')
>>> try:
...     ReportConfig(sinks=("jsonl", "comet"))
... except ValueError as e:
...     print(e)
sinks: unknown sink 'comet'; known sinks: ['jsonl', 'tensorboard', 'wandb', 'mlflow']
"""

from __future__ import annotations

import dataclasses

__all__ = ["SINK_NAMES", "MlflowConfig", "ReportConfig", "WandbConfig"]

#: The sinks ``config.report.sinks`` may name (the stdout table is always on).
SINK_NAMES: tuple[str, ...] = ("jsonl", "tensorboard", "wandb", "mlflow")


def _optional_str(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}: expected a non-empty string or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases: ``wandb.init(project=, entity=, name=, mode=, tags=)``.

    ``mode="offline"`` writes the run under ``$WANDB_DIR`` (default ``<workdir>/wandb``) for a later
    ``wandb sync``; ``name`` None = the workdir's name.

    Attributes:
      project: the W&B project.
      entity: the W&B entity (None = the default one).
      name: the run's name (None = the workdir's name).
      mode: ``"online"`` or ``"offline"``.
      tags: tags of the run.
    """

    project: str = "rljax"
    entity: str | None = None
    name: str | None = None
    mode: str = "online"
    tags: tuple = ()

    def __post_init__(self) -> None:
        if not isinstance(self.project, str) or not self.project:
            raise ValueError(f"project: expected a non-empty string, got {self.project!r}")
        _optional_str("entity", self.entity)
        _optional_str("name", self.name)
        if self.mode not in ("online", "offline"):
            raise ValueError(f"mode: expected 'online' or 'offline', got {self.mode!r}")
        if isinstance(self.tags, str) or not all(isinstance(t, str) and t for t in self.tags):
            raise ValueError(f"tags: expected a list of non-empty strings, got {self.tags!r}")
        object.__setattr__(self, "tags", tuple(self.tags))


@dataclasses.dataclass(frozen=True)
class MlflowConfig:
    """MLflow: runs of ``experiment`` at ``tracking_uri`` (None = ``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///<workdir>/mlflow.db``); ``run_name`` None = the workdir's name.

    Attributes:
      tracking_uri: where runs are tracked (None = ``$MLFLOW_TRACKING_URI``, else
        ``sqlite:///<workdir>/mlflow.db``).
      experiment: the MLflow experiment.
      run_name: the run's name (None = the workdir's name).
    """

    tracking_uri: str | None = None
    experiment: str = "rljax"
    run_name: str | None = None

    def __post_init__(self) -> None:
        _optional_str("tracking_uri", self.tracking_uri)
        if not isinstance(self.experiment, str) or not self.experiment:
            raise ValueError(f"experiment: expected a non-empty string, got {self.experiment!r}")
        _optional_str("run_name", self.run_name)


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    """The run's sinks (``jsonl`` also draws ``metrics.png`` at the end) and their settings.

    Attributes:
      sinks: the sinks to write to: any of ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``.
      wandb: the Weights & Biases sink (:class:`WandbConfig`).
      mlflow: the MLflow sink (:class:`MlflowConfig`).
    """

    sinks: tuple = ("jsonl", "tensorboard")
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    mlflow: MlflowConfig = dataclasses.field(default_factory=MlflowConfig)

    def __post_init__(self) -> None:
        if isinstance(self.sinks, str):
            raise ValueError(f"sinks: expected a list of sink names, got the string {self.sinks!r}")
        for name in self.sinks:
            if name not in SINK_NAMES:
                raise ValueError(f"sinks: unknown sink {name!r}; known sinks: {list(SINK_NAMES)}")
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"sinks: a sink is named twice in {list(self.sinks)}")
        object.__setattr__(self, "sinks", tuple(self.sinks))
