"""``config.report``: where a run's metrics, rollout tables and distributions go.

Each class is a knobs section (:mod:`rljax.knobs`) and validates itself; its errors start with the
field (``"WandbConfig.mode: ..."``), which the run config turns into the key path
(``config.report.wandb.mode: ...``).

>>> ReportConfig().sinks
('jsonl', 'tensorboard')
>>> try:
...     ReportConfig(sinks=("jsonl", "comet"))
... except ValueError as e:
...     print(e)
ReportConfig.sinks: unknown sink 'comet'; known sinks: ['jsonl', 'tensorboard', 'wandb', 'mlflow']
"""

from __future__ import annotations

from rljax import knobs
from rljax.knobs import knob

__all__ = ["SINK_NAMES", "MlflowConfig", "ReportConfig", "WandbConfig"]

#: The sinks ``config.report.sinks`` may name (the stdout table is always on).
SINK_NAMES: tuple[str, ...] = ("jsonl", "tensorboard", "wandb", "mlflow")
#: ``config.report.wandb.mode`` values.
WANDB_MODES: tuple[str, ...] = ("online", "offline")


def _text(where: str, value: object, *, optional: bool = False) -> None:
    """``value`` is a non-empty string (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        expected = "a non-empty string" + (" or None" if optional else "")
        raise ValueError(f"{where}: expected {expected}, got {value!r}")


@knobs.section
class WandbConfig:
    """Weights & Biases: ``wandb.init(project=, entity=, name=, mode=, tags=)``.

    ``mode="offline"`` writes the run under ``$WANDB_DIR`` (default ``<workdir>/wandb``) for a later
    ``wandb sync``; ``name`` None = the workdir's name.
    """

    project: str = knob("rljax", doc="the W&B project")
    entity: str | None = knob(None, doc="the W&B entity (None = the default one)")
    name: str | None = knob(None, doc="the run's name (None = the workdir's name)")
    mode: str = knob(
        "online",
        choices=WANDB_MODES,
        doc="``online``, or ``offline`` (written under ``$WANDB_DIR`` for a later ``wandb sync``)",
    )
    tags: tuple = knob((), doc="tags of the run (non-empty strings)")

    def __post_init__(self) -> None:
        _text("WandbConfig.project", self.project)
        _text("WandbConfig.entity", self.entity, optional=True)
        _text("WandbConfig.name", self.name, optional=True)
        if isinstance(self.tags, str) or not all(isinstance(t, str) and t for t in self.tags):
            raise ValueError(f"WandbConfig.tags: expected a list of non-empty strings, got {self.tags!r}")
        object.__setattr__(self, "tags", tuple(self.tags))


@knobs.section
class MlflowConfig:
    """MLflow: runs of ``experiment`` at ``tracking_uri`` (None = ``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///<workdir>/mlflow.db``); ``run_name`` None = the workdir's name.
    """

    tracking_uri: str | None = knob(
        None,
        doc="where runs are tracked (None = ``$MLFLOW_TRACKING_URI``, else "
        "``sqlite:///<workdir>/mlflow.db``)",
    )
    experiment: str = knob("rljax", doc="the MLflow experiment")
    run_name: str | None = knob(None, doc="the run's name (None = the workdir's name)")

    def __post_init__(self) -> None:
        _text("MlflowConfig.tracking_uri", self.tracking_uri, optional=True)
        _text("MlflowConfig.experiment", self.experiment)
        _text("MlflowConfig.run_name", self.run_name, optional=True)


@knobs.section
class ReportConfig:
    """The run's sinks (``jsonl`` also draws ``metrics.png`` at the end) and their settings."""

    sinks: tuple = knob(
        ("jsonl", "tensorboard"),
        doc="the sinks to write to: any of ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow`` (the "
        "stdout table is always on)",
    )
    wandb: WandbConfig = knob(WandbConfig(), doc="the Weights & Biases sink (:class:`WandbConfig`)")
    mlflow: MlflowConfig = knob(MlflowConfig(), doc="the MLflow sink (:class:`MlflowConfig`)")

    def __post_init__(self) -> None:
        if isinstance(self.sinks, str):
            raise ValueError(
                f"ReportConfig.sinks: expected a list of sink names, got the string {self.sinks!r}"
            )
        for name in self.sinks:
            if name not in SINK_NAMES:
                raise ValueError(
                    f"ReportConfig.sinks: unknown sink {name!r}; known sinks: {list(SINK_NAMES)}"
                )
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"ReportConfig.sinks: a sink is named twice in {list(self.sinks)}")
        object.__setattr__(self, "sinks", tuple(self.sinks))
