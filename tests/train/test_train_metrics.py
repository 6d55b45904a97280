"""Metrics sinks: JSONL round trip, the stdout table, TensorBoard event files, the PNG plot, progress."""

from __future__ import annotations

import io
import json
import math
import pathlib
import struct
import zlib

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from rljax.report import metrics as mt


def history(n: int = 30) -> list[tuple[int, dict]]:
    rng = np.random.default_rng(0)
    out = []
    for step in range(n):
        out.append(
            (
                step,
                {
                    "reward/mean": float(np.tanh(step / 10) + 0.1 * rng.normal()),
                    "loss": float(np.exp(-step / 8) + 0.02 * rng.normal()),
                    "tokens": int(rng.integers(100, 1000)),
                    "lr": np.float32(1e-6),  # numpy scalar
                    "grad_norm": jnp.float32(0.5 + step),  # jax scalar
                    "ok": True,
                },
            )
        )
    return out


# ------------------------------------------------------------------------------------------------
# JSONL
# ------------------------------------------------------------------------------------------------


def test_jsonl_round_trip_flushes_every_line_and_appends(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = mt.JsonlSink(path)
    logged = history(5)
    for i, (step, metrics) in enumerate(logged):
        sink.write(step, metrics)
        assert len(path.read_text().splitlines()) == i + 1  # on disk before close
    sink.write(5, {"loss": float("nan"), "reward/mean": -float("inf")})
    sink.close()
    lines = path.read_text().splitlines()
    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    records = mt.read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    for record, (step, metrics) in zip(records, logged, strict=False):
        assert isinstance(record["time"], float)
        assert record["tokens"] == metrics["tokens"] and isinstance(record["tokens"], int)
        assert record["reward/mean"] == metrics["reward/mean"]  # exact float round trip
        assert record["lr"] == float(np.float32(1e-6)) and record["grad_norm"] == 0.5 + step
        assert record["ok"] == 1
    assert records[-1]["loss"] is None and records[-1]["reward/mean"] is None
    # a crash left a partial line: reopening appends on a fresh line, the reader skips the fragment
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')
    sink = mt.JsonlSink(path)
    sink.write(7, {"loss": 0.5})
    sink.close()
    with pytest.warns(UserWarning, match="skipping a malformed line"):
        records = mt.read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 7]


def test_metric_values_are_validated():
    sink = mt.StdoutTable(["loss"], stream=io.StringIO())
    with pytest.raises(ValueError, match="reserved"):
        sink.write(0, {"step": 1.0})
    with pytest.raises(ValueError, match="'text' must be a number"):
        sink.write(0, {"text": "hi"})
    with pytest.raises(ValueError, match="'vec' must be a single number.*shape \\(3,\\)"):
        sink.write(0, {"vec": np.ones(3)})
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        sink.write(-1, {"loss": 1.0})
    with pytest.raises(ValueError, match="header_every must be an int >= 1"):
        mt.StdoutTable(["loss"], header_every=0)
    with pytest.raises(ValueError, match="keys must be a list"):
        mt.StdoutTable("loss")
    assert mt.StdoutTable(["x"], stream=io.StringIO()).row(0, {"x": 1}) == "       0           1"


# ------------------------------------------------------------------------------------------------
# stdout table
# ------------------------------------------------------------------------------------------------


def test_stdout_table_layout():
    out = io.StringIO()
    table = mt.StdoutTable(["reward/mean", "loss", "a_rather_long_metric_name"], header_every=3, stream=out)
    rows = [
        (0, {"reward/mean": 0.5, "loss": 1.23456789, "hidden/metric": 99.0}),
        (10, {"reward/mean": -0.125, "loss": 1e-7, "a_rather_long_metric_name": 12345678901}),
        (20, {"loss": float("nan")}),
        (123456, {"reward/mean": 1.0, "loss": 250000.0, "a_rather_long_metric_name": 3}),
    ]
    for step, metrics in rows:
        table.write(step, metrics)
    expected = (
        "    step  reward/mean        loss  a_rather_long_metric_name\n"
        "       0          0.5       1.235                          -\n"
        "      10       -0.125       1e-07                12345678901\n"
        "      20            -         nan                          -\n"
        "    step  reward/mean        loss  a_rather_long_metric_name\n"
        "  123456            1     2.5e+05                          3\n"
    )
    assert out.getvalue() == expected
    assert "hidden" not in out.getvalue()
    widths = {len(line) for line in out.getvalue().splitlines()}
    assert widths == {len("    step  reward/mean        loss  a_rather_long_metric_name")}


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    value=st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**30), 10**30),
    width=st.integers(8, 14),
)
def test_property_format_value_is_fixed_width_and_faithful(value, width):
    text = mt.format_value(value, width)
    assert len(text) == width and text == text.rstrip()
    parsed = float(text)
    if isinstance(value, int) and len(str(value)) <= width:
        assert int(text) == value
    elif math.isnan(value):
        assert math.isnan(parsed)
    elif math.isinf(value):
        assert parsed == value
    else:  # at least 1 significant digit (3 where there is room): bounded relative error
        digits = 1 if width < 10 else 3
        assert parsed == pytest.approx(float(value), rel=10 ** (1 - digits) * 0.51, abs=0.0)


# ------------------------------------------------------------------------------------------------
# TensorBoard: read the event files back with an independent TFRecord reader (CRC32C checked)
# ------------------------------------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tfrecords(path: pathlib.Path) -> list[bytes]:
    data, records, pos = path.read_bytes(), [], 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        assert length_crc == masked_crc(header), "corrupt record length"
        payload = data[pos + 12 : pos + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert payload_crc == masked_crc(payload), "corrupt record payload"
        records.append(payload)
        pos += 16 + length
    return records


def test_crc32c_reference_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    logged = history(6)
    sink = mt.TensorBoardSink(tmp_path)
    for step, metrics in logged:
        sink.write(step, metrics)
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0  # flushed before close
    sink.close()
    scalars: dict[str, dict[int, float]] = {}
    events = [event_pb2.Event.FromString(r) for r in read_tfrecords(files[0])]
    assert events[0].file_version.startswith("brain.Event:")
    for event in events[1:]:
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    assert set(scalars) == {"reward/mean", "loss", "tokens", "lr", "grad_norm", "ok"}
    for step, metrics in logged:
        for key, value in metrics.items():
            assert scalars[key][step] == np.float32(float(value))  # simple_value is float32


# ------------------------------------------------------------------------------------------------
# The logger, the plot
# ------------------------------------------------------------------------------------------------


def png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    return struct.unpack(">II", data[16:24])


def test_logger_writes_every_sink_and_plots_the_full_history_on_close(tmp_path):
    out = io.StringIO()
    logged = history(40)
    logger = mt.MetricsLogger(tmp_path, table_keys=["reward/mean", "loss"], header_every=10, stream=out)
    for step, metrics in logged[:25]:
        logger.log(step, metrics)
    logger.close()
    # a resumed run (from step 20) appends to the same JSONL; the plot shows the whole history
    with mt.MetricsLogger(tmp_path, table_keys=["loss"], stream=io.StringIO()) as logger:
        for step, metrics in logged[20:]:
            logger.log(step, metrics)
    assert logger.plot_path == tmp_path / "metrics.png"
    width, height = png_size(logger.plot_path)
    assert width > 300 and height > 200 and logger.plot_path.stat().st_size > 10_000
    records = mt.read_jsonl(tmp_path / "metrics.jsonl")
    assert len(records) == 45 and [r["step"] for r in records][-20:] == list(range(20, 40))
    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 2  # the second writer (same second, same host) did not truncate the first
    loss_steps = [
        event.step
        for path in event_files
        for event in map(event_pb2.Event.FromString, read_tfrecords(path))
        if any(v.tag == "loss" for v in event.summary.value)
    ]
    assert sorted(loss_steps) == sorted(list(range(25)) + list(range(20, 40)))
    lines = out.getvalue().splitlines()
    assert len(lines) == 25 + 3 and lines[0].split() == ["step", "reward/mean", "loss"]
    assert lines[11] == lines[0] and lines[22] == lines[0]
    with pytest.raises(ValueError, match="closed"):
        logger.log(99, {"loss": 1.0})


def test_plot_series_uses_the_last_value_per_step_and_handles_missing_keys(tmp_path):
    records = [
        {"step": 2, "loss": 3.0},
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": None},
        {"step": 3, "reward/mean": 0.5},
    ]
    steps, values = mt._series(records, "loss")
    assert steps.tolist() == [1, 2] and values.tolist() == [1.0, 2.0]
    steps, values = mt._series(records, "reward/mean")
    assert steps.tolist() == [3] and values.tolist() == [0.5]
    np.testing.assert_allclose(mt._trailing_mean(np.array([1.0, 2.0, 3.0, 4.0]), 2), [1.0, 1.5, 2.5, 3.5])
    path = mt.plot_history(records, tmp_path / "p.png", keys=["loss", "missing"], title="t")
    assert png_size(path)[1] > 0


def test_logger_without_logdir_is_stdout_only(tmp_path):
    out = io.StringIO()
    with mt.MetricsLogger(table_keys=["loss"], stream=out) as logger:
        logger.log(1, {"loss": 2.0})
    assert logger.plot_path is None and out.getvalue().splitlines()[1].split() == ["1", "2"]
    # JSONL off but plot on: the plot comes from the in-memory history
    with mt.MetricsLogger(tmp_path, jsonl=False, tensorboard=False, stdout=False) as logger:
        for step, metrics in history(3):
            logger.log(step, metrics)
    assert png_size(logger.plot_path)[0] > 0 and not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------
# Progress
# ------------------------------------------------------------------------------------------------


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_one_line_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    tty = FakeTTY()
    with mt.Progress(total=4, desc="rollout", stream=tty) as bar:
        for _ in range(4):
            bar.update()
        bar.set_postfix(reward=0.5)
    assert bar.enabled and "rollout" in tty.getvalue() and "4/4" in tty.getvalue()

    monkeypatch.setenv("CI", "true")
    tty = FakeTTY()
    items = list(mt.Progress(iter(range(5)), desc="train", unit="step", stream=tty))
    assert items == list(range(5))
    lines = tty.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train: 5 step in ")  # no bar, one final line

    monkeypatch.setenv("CI", "false")
    pipe = io.StringIO()  # not a terminal
    with mt.Progress(total=3, desc="eval", stream=pipe) as bar:
        bar.update(2)
        bar.set_postfix(acc=0.75)
    assert not bar.enabled
    assert pipe.getvalue().startswith("eval: 2/3 it in ") and pipe.getvalue().endswith(" acc=0.75\n")
    assert mt.is_ci() is False
    with pytest.raises(ValueError, match="needs an iterable"):
        list(mt.Progress(stream=pipe))


def test_tensorboard_tags_are_the_metric_names(tmp_path):
    """pass@k and pass^k are two series (tensorboardX's tag cleaning would make both eval/pass_1)."""
    from tensorboard_events import scalars

    sink = mt.TensorBoardSink(tmp_path)
    sink.write(1, {"eval/pass@1": 1.0, "eval/pass^1": 0.5})
    sink.close()
    assert scalars(tmp_path) == {"eval/pass@1": [(1, 1.0)], "eval/pass^1": [(1, 0.5)]}
