"""A real tiny training run reported everywhere: rollout records, W&B (offline), MLflow (file
store), the HTML report in headless Chromium, a sink failing mid-run, and --resume.

One module fixture trains the smoke recipe (no warm start) for 2 RL steps with every sink and
``save_rollouts_every=1``, then resumes it for a third step while the TensorBoard sink raises on
every row. Everything is read back with each library's own API (MLflow's client; wandb's protobuf
records of its offline transaction log) and compared with ``metrics.jsonl`` and with facts computed
here from the records themselves (the merge's extension rule, the overlong filter's rule).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from unittest import mock

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import ci  # noqa: E402
from recipes import load_recipe  # noqa: E402
from wandb_log import run_config, run_history  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_STEPS, RESUMED_STEPS = 2, 3
REQUIRED = (
    "trajectory_id", "turn", "messages", "completion", "prompt_ids", "completion_ids", "logprobs",
    "reward", "stop_reason", "weight_version", "sample", "advantage", "advantages", "loss_mask", "env",
    "status", "trained", "errored", "tokens",
)  # fmt: skip


class LookupAgent:
    """A scripted policy for the lookup task (the tiny untrained model never calls the tool): turn 0
    calls the tool with the asked key; turn 1 answers with the tool's word (repetition 0) or a wrong
    one (repetition 1); repetition 1 of every other task rambles past its token budget on turn 0
    ("length": the overlong filter masks it). Logprobs are fixed at -0.5 per token."""

    weight_version = 0

    def __init__(self):
        from rljax.chat import toy_tokenizer

        self.tok = toy_tokenizer("chatml")
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        from rljax.inference.engine import Completion

        text = self.tok.decode(list(prompt_ids))
        task, rep = session_id.rsplit("#", 1)
        finish = "stop"
        if "<tool_response>" not in text:
            if rep == "1" and int(task.rsplit(":", 1)[1]) % 2 == 0:
                out, finish = "I am not sure which tool", "length"
            else:
                key = re.findall(r"What color is the (\w+)\?", text)[-1]
                out = f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'
        else:
            word = re.findall(r"<tool_response>\n(\w+)", text)[-1]
            out = word if rep == "0" else "octarine"
        ids = self.tok.encode(out, add_special_tokens=False) + ([self.im_end] if finish == "stop" else [])
        return Completion(tuple(ids), tuple([-0.5] * len(ids)), finish, self.weight_version)

    async def update_weights(self, model, *, version=None):
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return self.weight_version


def _config(num_steps: int, tracking_uri: str):
    c = load_recipe("smoke")
    c.warmstart.num_steps = 0
    c.rollout.update(max_tokens=96, max_context_len=1024)
    c.trainer.update(
        num_steps=num_steps, eval_every=0, checkpoint_every=1, save_rollouts_every=1, seq_len=1024
    )
    c.trainer.filters = [dict(name="overlong", mode="enforce")]
    c.report.sinks = ["jsonl", "tensorboard", "wandb", "mlflow"]
    c.report.wandb.mode = "offline"
    c.report.wandb.tags = ["test"]
    c.report.mlflow.tracking_uri = tracking_uri
    return c


@pytest.fixture(scope="module")
def run():
    from rljax.report.sinks import TensorBoardMetricsSink
    from rljax.run.trainer import Trainer

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="rljax_report_"))
    workdir = tmp / "run"
    # wandb offline (no network); MLflow in a local SQLite file (its file store cannot hold both
    # "loss" and "loss/ce": a metric file where a directory must go)
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp / "wandb"), "WANDB_SILENT": "true"}
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with mock.patch.dict(os.environ, env):
        first = Trainer(_config(NUM_STEPS, uri), workdir, engine=LookupAgent()).run()
        ids_after_first = json.loads((workdir / "report_runs.json").read_text())

        def broken(self, step, metrics):
            raise OSError("tensorboard disk full")

        with (
            warnings.catch_warnings(record=True) as caught,
            mock.patch.object(TensorBoardMetricsSink, "log_metrics", broken),
        ):
            warnings.simplefilter("always")
            second = Trainer(_config(RESUMED_STEPS, uri), workdir, resume=True, engine=LookupAgent()).run()
    yield dict(
        tmp=tmp,
        workdir=workdir,
        history=first + second,
        ids_after_first=ids_after_first,
        warnings=[str(w.message) for w in caught if "report sink" in str(w.message)],
    )
    shutil.rmtree(tmp, ignore_errors=True)


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _records(workdir, step):
    path = workdir / "rollouts" / f"step_{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- rollout records ---------------------------------------------------------------------------------
def test_a_record_per_call_with_every_field(run):
    rows = {r["step"]: r for r in _metrics(run["workdir"])}
    assert sorted(rows) == [1, 2, 3]
    for step in (1, 2, 3):
        records = _records(run["workdir"], step)
        # the rollout's own counts, from metrics.jsonl: one record per recorded call
        assert len(records) == rows[step]["rollout/num_steps"]
        assert len({r["trajectory_id"] for r in records}) == rows[step]["rollout/num_trajectories"]
        assert sum(len(r["completion_ids"]) for r in records) == rows[step]["rollout/response_tokens"]
        for r in records:
            assert set(REQUIRED) <= set(r)
            n = len(r["completion_ids"])
            assert len(r["logprobs"]) == len(r["tokens"]) == len(r["loss_mask"]) == n > 0
            assert all(lp <= 0 for lp in r["logprobs"])
            assert r["weight_version"] == step - 1  # sync mode: rollout of step S sampled theta_{S-1}
            assert r["messages"][0]["role"] == "user"


def test_sample_ids_follow_the_extension_rule(run):
    """Turns of one trajectory share a sample exactly when a turn's prompt extends the previous
    turn's prompt + completion (design §2.5, checked here on the ids)."""
    checked = 0
    for step in (1, 2, 3):
        by_traj = {}
        for r in _records(run["workdir"], step):
            by_traj.setdefault(r["trajectory_id"], []).append(r)
        samples = set()
        for calls in by_traj.values():
            calls.sort(key=lambda r: r["turn"])
            assert [c["turn"] for c in calls] == list(range(len(calls)))
            for prev, cur in zip(calls, calls[1:], strict=False):
                full = prev["prompt_ids"] + prev["completion_ids"]
                extends = cur["prompt_ids"][: len(full)] == full
                assert (cur["sample"] == prev["sample"]) == extends
                checked += 1
            samples |= {c["sample"] for c in calls}
            # samples of different trajectories never collide
        assert len(samples) == sum(len({c["sample"] for c in calls}) for calls in by_traj.values())
        assert all(s.startswith(f"{step}:") for s in samples)
    assert checked > 0  # the smoke recipe's lookup task has two-turn trajectories


def test_status_follows_the_overlong_filter(run):
    """overlong (enforce) masks every step that did not stop on its own: a trajectory is
    "filtered" when all its steps were, and a flagged step has no trained token."""
    statuses = set()
    for step in (1, 2, 3):
        by_traj = {}
        for r in _records(run["workdir"], step):
            by_traj.setdefault(r["trajectory_id"], []).append(r)
        for calls in by_traj.values():
            status = {c["status"] for c in calls}
            assert len(status) == 1
            (status,) = status
            statuses.add(status)
            flagged = [c["stop_reason"] != "stop" for c in calls]
            assert status == ("filtered" if all(flagged) else "trained")
            for c, f in zip(calls, flagged, strict=True):
                assert (sum(c["loss_mask"]) == 0) == f
                assert c["trained"] == (status == "trained")
        # a group whose rewards are all equal has zero group-relative advantage on every token
        groups = {}
        for tid, calls in by_traj.items():
            groups.setdefault(tid.rsplit("#", 1)[0], []).append(calls[-1]["trajectory_reward"])
        for tid, calls in by_traj.items():
            rewards = groups[tid.rsplit("#", 1)[0]]
            if len(set(rewards)) == 1:
                assert all(a == 0.0 for c in calls for a in c["advantages"])
    assert statuses == {"trained", "filtered"}


# -- sinks -------------------------------------------------------------------------------------------
def _finite_rows(workdir):
    return {
        r["step"]: {k: v for k, v in r.items() if k not in ("step", "time") and v is not None}
        for r in _metrics(workdir)
    }


def test_wandb_history_equals_metrics_jsonl_and_resume_keeps_the_run(run):
    files = sorted((run["tmp"] / "wandb").rglob("run-*.wandb"))
    assert len(files) >= 2  # the first run and the resumed one (offline mode writes a file per process)
    ids, history = run_history(files)
    assert ids == {run["ids_after_first"]["wandb"]["id"]}
    expected = _finite_rows(run["workdir"])
    assert sorted(history) == sorted(expected)
    for step, row in expected.items():
        got = {k: v for k, v in history[step].items() if not k.startswith(("_", "dist/", "rollouts/"))}
        assert got.keys() == row.keys(), (step, set(got) ^ set(row))
        for k, v in row.items():
            assert math.isclose(got[k], v, rel_tol=1e-6, abs_tol=1e-12), (step, k)
        # per-step distributions (histograms) and the sample table of every step
        assert history[step]["dist/reward/_type"] == "histogram"
        assert history[step]["dist/response_length/_type"] == "histogram"
        assert history[step]["rollouts/_type"] == "table-file"
        assert history[step]["rollouts/nrows"] == expected[step]["rollout/num_trajectories"]
    config = run_config(files)
    assert config["trainer.seq_len"] == 1024 and config["report.wandb.mode"] == "offline"


def test_mlflow_history_equals_metrics_jsonl_and_resume_keeps_the_run(run):
    from mlflow import MlflowClient

    from rljax.report.mlflow_sink import mlflow_key

    ids = json.loads((run["workdir"] / "report_runs.json").read_text())["mlflow"]
    assert ids == run["ids_after_first"]["mlflow"]  # --resume continued the same run
    client = MlflowClient(tracking_uri=ids["tracking_uri"])
    experiment = client.get_experiment_by_name("rljax")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["run_id"]]
    mlrun = client.get_run(ids["run_id"])
    assert mlrun.data.params["trainer.seq_len"] == "1024"
    assert mlrun.info.status == "FINISHED"
    expected = _finite_rows(run["workdir"])
    keys = {k for row in expected.values() for k in row}
    assert {mlflow_key(k) for k in keys} == set(mlrun.data.metrics)
    for key in keys:
        history = {m.step: m.value for m in client.get_metric_history(ids["run_id"], mlflow_key(key))}
        want = {s: row[key] for s, row in expected.items() if key in row}
        assert history.keys() == want.keys(), key
        for s, v in want.items():
            assert math.isclose(history[s], v, rel_tol=1e-6, abs_tol=1e-12), (key, s)
    assert mlrun.info.artifact_uri.startswith((run["workdir"] / "mlflow-artifacts").as_uri())  # not ./mlruns
    artifacts = {a.path for a in client.list_artifacts(ids["run_id"], "rollouts")}
    assert artifacts == {f"rollouts/step_{s}.json" for s in (1, 2, 3)}


def test_a_sink_failing_mid_run_warns_once_and_training_goes_on(run):
    assert [h["step"] for h in run["history"]] == [1, 2, 3]
    assert len(run["warnings"]) == 1, run["warnings"]
    assert "'tensorboard'" in run["warnings"][0] and "tensorboard disk full" in run["warnings"][0]
    assert 3 in {r["step"] for r in _metrics(run["workdir"])}  # the other sinks got step 3


# -- the HTML report in a real browser ---------------------------------------------------------------
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    ci.missing("chromium is not installed (.ci/install_chromium.sh installs it)")


def _browse(chromium: str, tmp: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(dir=tmp, prefix="chromium_")
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}",
    ]  # fmt: skip
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120)


def test_the_report_renders_in_headless_chromium(run):
    chromium = _chromium()
    out = run["tmp"] / "report.html"
    subprocess.run(
        [sys.executable, "-m", "rljax", "view", f"--workdir={run['workdir']}", f"--out={out}"],
        check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    html = out.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    dom = _browse(chromium, run["tmp"], "--dump-dom", out.as_uri()).stdout
    import html.parser

    class Status(html.parser.HTMLParser):
        attrs: dict = {}

        def handle_starttag(self, tag, attrs):
            if dict(attrs).get("id") == "status":
                Status.attrs = dict(attrs)

    Status().feed(dom)
    status = Status.attrs
    assert status.get("data-state") == "ok", dom[-2000:]
    last = _records(run["workdir"], RESUMED_STEPS)  # the page opens on the last saved step
    assert int(status["data-step"]) == RESUMED_STEPS
    assert int(status["data-trajectories"]) == len({r["trajectory_id"] for r in last})
    assert int(status["data-calls"]) == len(last)
    assert int(status["data-tokens"]) == sum(len(r["completion_ids"]) for r in last)
    assert dom.count('class="tok"') == int(status["data-tokens"])
    assert dom.count('class="plot"') >= 4
    # another step and colour, named in the URL's fragment
    dom = _browse(
        chromium, run["tmp"], "--dump-dom", out.as_uri() + "#step=1&color=advantage&show=filtered"
    ).stdout
    Status().feed(dom)
    status, first = Status.attrs, _records(run["workdir"], 1)
    assert status.get("data-state") == "ok" and int(status["data-step"]) == 1, dom[-2000:]
    filtered = [r for r in first if r["status"] == "filtered"]
    assert int(status["data-calls"]) == len(filtered) > 0
    assert int(status["data-tokens"]) == sum(len(r["completion_ids"]) for r in filtered)
    shot = run["tmp"] / "report.png"
    _browse(chromium, run["tmp"], f"--screenshot={shot}", "--window-size=1280,900", out.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
