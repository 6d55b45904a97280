"""Quick checks of the report layer: config errors with key paths, the sink set's failure rules,
the preparation trace against hand-built merges, rollout records of a gateway-style call, the HTML
page's self-containment."""

from __future__ import annotations

import json
import pathlib
import re
import warnings

import numpy as np
import pytest

from rljax.algorithms import get_algorithm
from rljax.data.batch import StepBatch
from rljax.data.prepare import prepare_samples
from rljax.inference.engine import Completion
from rljax.report.html import build_report
from rljax.report.records import PreparationTrace, rollout_records, sample_table, write_rollout_records
from rljax.report.sinks import RunInfo, Sink, SinkSet
from rljax.rollout import TrajectoryRecord
from rljax.run.config import default_config, parse_run_config
from rljax.types import Step, TrajectoryID


# -- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "report, message",
    [
        ({"sinks": ["jsonl", "comet"]}, "config.report.sinks: unknown sink 'comet'"),
        ({"sinks": "wandb"}, "config.report.sinks: expected a list or tuple"),
        ({"wandb": {"mode": "shared"}}, "config.report.wandb.mode: expected one of ['online', 'offline']"),
        ({"wandb": {"projekt": "x"}}, "config.report.wandb.projekt: unknown key"),
        ({"mlflow": {"experiment": ""}}, "config.report.mlflow.experiment: expected a non-empty string"),
        ({"sinks": ["jsonl", "jsonl"]}, "config.report.sinks: a sink is named twice"),
    ],
)
def test_report_config_errors_name_their_key(report, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_run_config({"report": report})


def test_save_rollouts_every_is_checked_and_report_defaults_render():
    with pytest.raises(ValueError, match="config.trainer.save_rollouts_every: expected an int >= 0"):
        parse_run_config({"trainer": {"save_rollouts_every": -1}})
    c = default_config()
    assert c.trainer.save_rollouts_every == 0 and list(c.report.sinks) == ["jsonl", "tensorboard"]
    c.report.sinks = ["jsonl", "wandb"]  # an object field: lists from --config.report.sinks work
    c.report.wandb.tags = ["a", "b"]
    parsed = parse_run_config(c)
    assert parsed.report.sinks == ("jsonl", "wandb") and parsed.report.wandb.tags == ("a", "b")


# -- the sink set --------------------------------------------------------------------------------------
class Recording(Sink):
    name = "recording"

    def __init__(self):
        self.rows = []

    def log_metrics(self, step, metrics):
        self.rows.append((step, dict(metrics)))


class FailsOnStep(Sink):
    name = "flaky"

    def __init__(self, step):
        self.step = step

    def log_metrics(self, step, metrics):
        if step >= self.step:
            raise ConnectionError("dashboard unreachable")


class CannotStart(Sink):
    name = "nostart"

    def open(self, run):
        raise PermissionError("no API key")


def test_a_sink_that_cannot_start_is_an_error_naming_it(tmp_path):
    good = Recording()
    sinks = SinkSet([good, CannotStart()])
    with pytest.raises(
        RuntimeError, match="report sink 'nostart' could not start: PermissionError: no API key"
    ):
        sinks.open(RunInfo(tmp_path))


def test_a_sink_failing_mid_run_is_warned_once_and_the_others_go_on(tmp_path):
    good = Recording()
    sinks = SinkSet([FailsOnStep(2), good])
    sinks.open(RunInfo(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 5):
            sinks.log_metrics(step, {"loss": float(step)})
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "'flaky'" in messages[0] and "at step 2" in messages[0]
    assert sinks.failures == {"flaky": 3}
    assert [s for s, _ in good.rows] == [1, 2, 3, 4]


# -- the preparation trace -------------------------------------------------------------------------------
def _steps():
    """Trajectory q#0: turn 1 extends turn 0 ([1] + [2] is a prefix of [1, 2, 3]); turn 2 does not
    ([9] starts over: a context reset) -> samples {0, 1} and {2}. q#1: one turn."""
    t0, t1 = TrajectoryID("q", 0), TrajectoryID("q", 1)
    return [
        Step([1], [2], t0, is_last_step=False),
        Step([1, 2, 3], [4, 5], t0, is_last_step=False),
        Step([9], [6], t0, reward=1.0),
        Step([1], [7, 8], t1, reward=0.0),
    ]


def test_the_trace_names_the_merged_sample_of_each_step():
    steps = _steps()
    prepared = prepare_samples(get_algorithm("grpo"), StepBatch(steps))
    trace = PreparationTrace(step=4)
    trace.add(steps, prepared)
    t0, t1 = TrajectoryID("q", 0), TrajectoryID("q", 1)
    ids = [trace.get(t0, k).sample for k in range(3)] + [trace.get(t1, 0).sample]
    assert ids[0] == ids[1] != ids[2] != ids[3] and len(set(ids)) == 3
    assert trace.samples_of(t0) == 2 and trace.samples_of(t1) == 1
    # outcome advantages by hand: rewards (1, 0), group mean 0.5 -> +0.5 / -0.5 on every token (the
    # registered grpo centres without dividing by the std, as prepare_samples' own example shows)
    assert [trace.get(t0, k).advantages.tolist() for k in range(3)] == [[0.5], [0.5, 0.5], [0.5]]
    assert trace.get(t1, 0).advantages.tolist() == [-0.5, -0.5]
    # the merged samples hold what the trace says: sample of turns 0+1 = response [2] + gap [3] + [4, 5]
    merged = {tuple(s.response_ids) for s in prepared.samples}
    assert merged == {(2, 3, 4, 5), (6,), (7, 8)}


def test_filtered_steps_are_traced():
    steps = _steps()
    steps[3] = steps[3].replace(stop_reason="length")
    from rljax.data.filters import make_filter

    prepared = prepare_samples(
        get_algorithm("grpo"), StepBatch(steps), filters=[make_filter("overlong", mode="enforce")]
    )
    assert prepared.step_filtered == (False, False, False, True)


# -- records ---------------------------------------------------------------------------------------------
class _Renderer:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def _gateway_record():
    from rljax.recording import Prompt, RecordedCall

    tid = TrajectoryID("t", 0)
    call = RecordedCall(
        index=0,
        prompt=Prompt([1, 2], None, None, [{"role": "user", "content": "hi"}]),
        completion=Completion((3, 4), (-0.25, -1.5), "stop", 2),
        temperature=1.0,
        reward=0.5,
        renderer=_Renderer(),
        returned={"role": "assistant", "content": "cd as sent"},
    )
    step = Step([1, 2], [3, 4], tid, reward=0.5, stop_reason="stop", policy_version=2)
    return TrajectoryRecord(tid, env="agent", reward=0.5, num_turns=1, steps=[step], calls=[call])


def test_records_of_a_gateway_call(tmp_path):
    rec = _gateway_record()
    steps = rec.steps
    trace = PreparationTrace(step=3)
    trace.add(steps, prepare_samples(get_algorithm("grpo"), StepBatch(steps)))
    (r,) = rollout_records([rec], trace)
    assert r["completion"] == "cd as sent"  # what the client was answered, not a re-decode
    assert r["tokens"] == ["c", "d"] and r["completion_ids"] == [3, 4] and r["logprobs"] == [-0.25, -1.5]
    assert r["messages"] == [{"role": "user", "content": "hi"}] and r["prompt_ids"] == [1, 2]
    assert (r["sample"], r["weight_version"], r["reward"], r["status"]) == ("3:0", 2, 0.5, "trained")
    assert r["advantages"] == [0.0, 0.0]  # a group of one: no baseline difference
    dropped = rollout_records([rec], PreparationTrace(step=3))[0]  # not in the trained batch
    assert (dropped["sample"], dropped["status"], dropped["trained"]) == (None, "dropped", False)
    path = write_rollout_records(tmp_path, 3, [r])
    assert path == tmp_path / "rollouts" / "step_3.jsonl"
    assert json.loads(path.read_text()) == r
    table = sample_table([r])
    assert table.as_dicts()[0]["status"] == "trained" and table.as_dicts()[0]["length"] == 2


def test_the_page_is_self_contained_and_escapes_its_data(tmp_path):
    rec = _gateway_record()
    rec.calls[0].prompt.messages[0]["content"] = "</script><script>alert(1)</script>"
    write_rollout_records(tmp_path, 1, rollout_records([rec], None))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    page = build_report(tmp_path)
    assert page.count("</script>") == 2  # the data block's and the script's own, nothing injected
    assert "<script src" not in page and "<link" not in page and "https://" not in page
    start = page.index('type="application/json">') + len('type="application/json">')
    data = json.loads(page[start : page.index("</script>", start)])
    assert data["steps"]["1"][0]["messages"][0]["content"] == "</script><script>alert(1)</script>"
    assert "prompt_ids" not in data["steps"]["1"][0] and data["steps"]["1"][0]["prompt_len"] == 2
    assert np.isclose(data["metrics"][0]["reward/mean"], 0.5)
    assert pathlib.Path(tmp_path / "rollouts" / "step_1.jsonl").exists()


def _tb_events(logdir: pathlib.Path):
    """Every Event of the TFRecord files in ``logdir`` (8-byte length, 4-byte crc, data, 4-byte crc),
    parsed with tensorboardX's own protobuf classes."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(logdir.glob("events.out.tfevents*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            out.append(event)
            pos += 12 + length + 4
    return out


def test_tensorboard_gets_histograms_and_the_sample_table(tmp_path):
    from rljax.report.sinks import SampleTable, TensorBoardMetricsSink

    sink = TensorBoardMetricsSink(tmp_path)
    sink.open(RunInfo(tmp_path))
    sink.log_metrics(2, {"reward/mean": 0.25})
    sink.log_distributions(2, {"reward": np.array([0.0, 1.0, 1.0]), "empty": np.array([])})
    sink.log_samples(2, SampleTable((("q#0", "env", 1, "[]", "a|b", 1.0, 0.5, "stop", 3, "trained"),)))
    sink.close()
    values = {(e.step, v.tag): v for e in _tb_events(tmp_path / "tb") for v in e.summary.value}
    assert values[(2, "reward/mean")].simple_value == 0.25
    histo = values[(2, "dist/reward")].histo
    assert (histo.num, histo.sum, histo.min, histo.max) == (3, 2.0, 0.0, 1.0)
    assert (2, "dist/empty") not in values
    text = values[(2, "rollouts/text_summary")].tensor.string_val[0].decode()
    assert "| trajectory_id | env |" in text and "a\\|b" in text


def test_mlflow_keys_of_distinct_eval_metrics_stay_distinct():
    """pass@k and pass^k (and every other eval metric name) map to different MLflow keys: one
    series never overwrites another."""
    import string

    from rljax.report.mlflow_sink import mlflow_key

    names = [f"eval/{m}{k}" for m in ("pass@", "pass^", "mean@") for k in (1, 4, 8)]  # rljax.evaluation's
    keys = [mlflow_key(n) for n in [*names, "eval/reward_mean"]]
    assert len(set(keys)) == len(keys), keys
    allowed = set(string.ascii_letters + string.digits + "_-. :/")  # MLflow's key alphabet
    assert all(set(k) <= allowed for k in keys), keys
