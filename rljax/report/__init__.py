"""What users look at: a run's metric sinks (stdout, JSONL, TensorBoard, Weights & Biases, MLflow),
its rollout records (``rollouts/step_<S>.jsonl``) and the static HTML report (``rljax view``).

Modules: :mod:`~rljax.report.metrics` (the local writers), :mod:`~rljax.report.sinks` (the sink
interface), :mod:`~rljax.report.wandb_sink`, :mod:`~rljax.report.mlflow_sink`,
:mod:`~rljax.report.records` (rollout records, sample tables, distributions),
:mod:`~rljax.report.config` (``config.report``) and :mod:`~rljax.report.html` (the report page).
"""
