"""The resume rules of a run's sinks (rljax.report.sinks), sink by sink, without training.

A first attempt logs steps 1..4 and dies; the run resumes from checkpoint 2 and logs steps 3..4 again
with other values (what a non-deterministic run would produce). Every sink must then hold each step
exactly once: the local ones (JSONL, rollouts/, TensorBoard) the resumed attempt's steps 3..4, the
remote ones (MLflow's SQLite store, W&B's offline transaction log, both read back with each
library's own API) their first values, plus any row up to the checkpoint they had lost.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from unittest import mock

import pytest
from tensorboard_events import event_files, read_events, scalars
from wandb_log import history_steps, run_history

from rljax.report.config import MlflowConfig, ReportConfig, WandbConfig
from rljax.report.records import ROLLOUTS_DIR, read_rollout_records, write_rollout_records
from rljax.report.sinks import RunInfo
from rljax.run.report import RunSinks

RESUMED_FROM = 2


def _row(step: int, attempt: int) -> dict[str, float]:
    return {"loss": step + 10.0 * attempt, "reward/mean": 0.5 * step}


def _local_sinks(workdir: pathlib.Path, resume_step: int | None) -> RunSinks:
    report = ReportConfig(sinks=("jsonl", "tensorboard"))
    return RunSinks(workdir, resume_step=resume_step, table_keys=(), report=report, config={})


def _log(sinks: RunSinks, workdir: pathlib.Path, steps: range, attempt: int) -> None:
    for step in steps:
        write_rollout_records(workdir, step, [{"step": step, "attempt": attempt}])
        sinks.log(step, _row(step, attempt))
        sinks.flush()


def test_local_sinks_resume_as_one_uninterrupted_run(tmp_path):
    first = _local_sinks(tmp_path, None)
    _log(first, tmp_path, range(1, 5), attempt=1)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-line
    (tmp_path / ROLLOUTS_DIR / "step_5.jsonl.tmp").write_text("{")  # killed mid-write

    resumed = _local_sinks(tmp_path, RESUMED_FROM)
    # before anything is logged again: the workdir looks as if the run had stopped after step 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 11.0), (2, 12.0)]
    assert sorted(p.name for p in (tmp_path / ROLLOUTS_DIR).iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    _log(resumed, tmp_path, range(3, 5), attempt=2)
    resumed.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want = [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
    assert [(r["step"], r["loss"]) for r in lines] == want
    records = {s: read_rollout_records(tmp_path / ROLLOUTS_DIR / f"step_{s}.jsonl") for s in range(1, 5)}
    assert records == {s: [{"step": s, "attempt": 1 if s <= RESUMED_FROM else 2}] for s in range(1, 5)}
    # TensorBoard: both files hold steps 3 and 4; the purge event of the second hides the first's
    files = event_files(tmp_path / "tb")
    assert len(files) == 2
    written = [
        e.step for path in files for e in read_events(path) for v in e.summary.value if v.tag == "loss"
    ]
    assert sorted(written) == [1, 2, 3, 3, 4, 4]
    assert scalars(tmp_path / "tb")["loss"] == want
    assert scalars(tmp_path / "tb")["reward/mean"] == [(s, 0.5 * s) for s in range(1, 5)]


def test_a_fresh_run_starts_fresh_files(tmp_path):
    first = _local_sinks(tmp_path, None)
    _log(first, tmp_path, range(1, 3), attempt=1)
    first.close()
    again = _local_sinks(tmp_path, None)
    _log(again, tmp_path, range(1, 2), attempt=2)
    again.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 21.0)]


def _history(steps: range, attempt: int) -> list[dict]:
    """Rows as metrics.jsonl holds them (with step, time and a null)."""
    return [{"step": s, "time": 1.0e9 + s, **_row(s, attempt), "kl": None} for s in steps]


def test_mlflow_resume_sends_what_the_run_lacks_and_nothing_twice(tmp_path):
    from mlflow import MlflowClient

    from rljax.report.mlflow_sink import MlflowSink
    from rljax.report.sinks import SampleTable

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = MlflowConfig(tracking_uri=uri)
    workdir = tmp_path / "run"
    workdir.mkdir()

    def table(step: int, attempt: int) -> SampleTable:
        return SampleTable(((f"q{step}#{attempt}", "env", 1, "[]", "a", 1.0, 0.0, "stop", 1, "trained"),))

    first = MlflowSink(config)
    first.open(RunInfo(workdir))
    for step in (1, 3, 4):  # the dashboard was unreachable at step 2 (a warned sink failure)
        first.log_metrics(step, _row(step, 1))
        first.log_samples(step, table(step, 1))
    # killed: never closed
    resumed = MlflowSink(config)
    resumed.open(RunInfo(workdir, resume=True, resume_step=RESUMED_FROM, history=_history(range(1, 3), 1)))
    for step in (3, 4, 5):
        resumed.log_metrics(step, _row(step, 2))
        resumed.log_samples(step, table(step, 2))
    resumed.close()

    client = MlflowClient(tracking_uri=uri)
    assert resumed.run_id == first.run_id
    for key in ("loss", "reward/mean"):
        points = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, key))
        want = [(s, _row(s, 1 if s <= 4 else 2)[key]) for s in range(1, 6)]  # first values kept
        assert points == want, key
    assert "kl" not in client.get_run(first.run_id).data.metrics  # nulls are not metrics
    tables = {a.path for a in client.list_artifacts(first.run_id, "rollouts")}
    assert tables == {f"rollouts/step_{s}.json" for s in (1, 3, 4, 5)}
    path = client.download_artifacts(first.run_id, "rollouts/step_3.json", str(tmp_path))
    assert json.loads(pathlib.Path(path).read_text())["data"] == [
        ["q3#1", "env", 1, "[]", "a", 1.0, 0.0, "stop", 1, "trained"]
    ]
    assert client.get_run(first.run_id).info.status == "FINISHED"


class _StubRun:
    """What WandbSink uses of a W&B run: ``step`` (W&B's next step) and ``log``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.logged: list[tuple[int, dict]] = []

    def log(self, row, step):
        self.logged.append((step, dict(row)))

    def finish(self):
        pass


def test_wandb_resume_resends_from_the_step_wandb_reports_and_skips_older_steps(tmp_path):
    """Online, W&B tells a resumed run its next step (here 2: it has step 1 only, the rows of step 2
    died in its service process's buffer): the sink sends step 2 again from metrics.jsonl and skips
    every call below step 2."""
    wandb = pytest.importorskip("wandb")
    from rljax.report.sinks import SampleTable
    from rljax.report.wandb_sink import WandbSink

    stub = _StubRun(step=2)
    sink = WandbSink(WandbConfig(mode="online"))
    with mock.patch.object(wandb, "init", return_value=stub):
        sink.open(RunInfo(tmp_path, resume=True, resume_step=RESUMED_FROM, history=_history(range(1, 3), 1)))
    sink.log_metrics(1, _row(1, 2))
    sink.log_samples(1, SampleTable(()))
    sink.log_distributions(1, {})
    sink.log_metrics(3, _row(3, 2))
    assert sink.resent == [2]
    assert stub.logged == [(2, _row(2, 1)), (3, _row(3, 2))]  # step, time and nulls left out


@pytest.mark.integration
def test_wandb_offline_resume_holds_every_step_once(tmp_path):
    """Offline, W&B knows nothing of the killed run's file: the resumed file holds steps 1..R from
    metrics.jsonl and the steps after R from the resumed run, each once."""
    pytest.importorskip("wandb")
    from rljax.report.wandb_sink import WandbSink

    workdir = tmp_path / "run"
    workdir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_SILENT": "true"}
    with mock.patch.dict(os.environ, env):
        first = WandbSink(WandbConfig(mode="offline"))
        first.open(RunInfo(workdir))
        first.close()  # the killed attempt's rows never reached its file
        files_before = set((tmp_path / "wandb").rglob("run-*.wandb"))
        resumed = WandbSink(WandbConfig(mode="offline"))
        resumed.open(
            RunInfo(workdir, resume=True, resume_step=RESUMED_FROM, history=_history(range(1, 3), 1))
        )
        for step in (3, 4):
            resumed.log_metrics(step, _row(step, 2))
        resumed.close()
    (new,) = set((tmp_path / "wandb").rglob("run-*.wandb")) - files_before
    # wandb's service process writes the file; on a loaded machine the last records can land just
    # after finish() returns, so read until they are there (a bounded wait, not a speed assumption)
    deadline = time.monotonic() + 60
    while history_steps([new]) != [1, 2, 3, 4] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert history_steps([new]) == [1, 2, 3, 4]  # one history record per step
    ids, history = run_history([new])
    assert ids == {first.run_id}
    assert {s: history[s]["loss"] for s in history} == {1: 11.0, 2: 12.0, 3: 23.0, 4: 24.0}


def test_a_resumed_event_file_sorts_after_the_first_within_the_same_second(tmp_path, monkeypatch):
    """TensorBoard reads a directory's event files in name order: a writer started in the same second
    as an earlier one (a fast restart) must still sort after it, or its purge step hides nothing."""
    from rljax.report.metrics import TensorBoardSink

    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.5)  # every writer starts in one second
    paths = []
    for _ in range(5):
        sink = TensorBoardSink(tmp_path)
        sink.write(1, {"loss": 1.0})
        sink.close()
        paths.append(sink.path)
    assert event_files(tmp_path) == paths  # creation order is name order
