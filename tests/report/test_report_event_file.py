"""TensorBoard event records encoded by rljax.report.event_file: byte for byte what protobuf's own
serializer makes of tensorboardX's message classes (and tensorboardX's summary builders) for the same
events, CRC-32C against its check value and tensorboardX's implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboardX import summary as tbx_summary
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c as tbx_masked_crc32c

from rljax.report.event_file import (
    crc32c,
    event,
    histogram_summary,
    masked_crc32c,
    scalar_summary,
    text_summary,
    tfrecord,
)
from rljax.report.metrics import _histogram_edges

EDGES = _histogram_edges()


def test_crc32c_check_value_and_masking_equal_tensorboardx():
    assert crc32c(b"123456789") == 0xE3069283  # CRC-32C's published check value
    assert crc32c(b"") == 0
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 100, 5000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == tbx_masked_crc32c(data)


def test_tfrecord_framing():
    data = b"an event"
    record = tfrecord(data)
    assert record[:8] == (8).to_bytes(8, "little")
    assert int.from_bytes(record[8:12], "little") == tbx_masked_crc32c(record[:8])
    assert record[12:20] == data
    assert int.from_bytes(record[20:], "little") == tbx_masked_crc32c(data)


@settings(max_examples=200, deadline=None)
@given(
    tag=st.text(min_size=1, max_size=40),
    value=st.floats(allow_nan=True, allow_infinity=True, width=64),
    step=st.integers(min_value=0, max_value=2**62),
    wall_time=st.floats(min_value=0.0, max_value=4e9),
)
def test_scalar_events_equal_protobufs(tag, value, step, wall_time):
    ours = event(wall_time=wall_time, step=step, summary=scalar_summary(tag, value))
    theirs = Event(
        wall_time=wall_time, step=step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])
    ).SerializeToString()
    if math.isnan(value):  # NaN payload bits may differ; both are NaN, the rest is equal
        assert len(ours) == len(theirs) and ours[:-4] == theirs[:-4]
        assert math.isnan(Event.FromString(ours).summary.value[0].simple_value)
    else:
        assert ours == theirs


def test_file_version_and_session_start_events_equal_protobufs():
    assert (
        event(wall_time=1.5, file_version="brain.Event:2")
        == Event(wall_time=1.5, file_version="brain.Event:2").SerializeToString()
    )
    start = Event(wall_time=2.25, step=7, session_log=SessionLog(status=SessionLog.START))
    assert event(wall_time=2.25, step=7, session_start=True) == start.SerializeToString()
    with pytest.raises(ValueError, match="exactly one"):
        event(wall_time=1.0, file_version="x", session_start=True)


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(1).normal(size=1000),  # both signs, many buckets
        np.random.default_rng(2).uniform(3.0, 9.0, size=50),  # positive only: support starts late
        np.array([0.0]),  # one value: min = max = sum = 0 (left out as proto3 defaults)
        np.array([0.0, 0.0, 1e-13]),
        np.array([-1e19, 1e19]),
        np.arange(-5, 6, dtype=np.float64),
    ],
    ids=["normal", "positive", "zero", "tiny", "huge", "integers"],
)
def test_histograms_equal_tensorboardx(values):
    theirs = tbx_summary.histogram("adv/hist", values, EDGES).SerializeToString()
    assert histogram_summary("adv/hist", values, EDGES) == theirs


def test_histogram_of_nothing_in_range_says_so():
    with pytest.raises(ValueError, match="at least one value"):
        histogram_summary("h", np.array([]), EDGES)
    with pytest.raises(ValueError, match="within its edges"):
        histogram_summary("h", np.array([np.inf]), [0.0, 1.0])


@pytest.mark.parametrize("markdown", ["", "**bold** step", "ünïcode — text\nwith lines"])
def test_text_equals_tensorboardx(markdown):
    assert text_summary("samples", markdown) == tbx_summary.text("samples", markdown).SerializeToString()


@pytest.mark.subprocess
def test_the_sink_imports_neither_tensorboardx_nor_torch(tmp_path):
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from rljax.report.metrics import TensorBoardSink\n"
        f"sink = TensorBoardSink({str(tmp_path)!r}, purge_step=3)\n"
        "sink.write(3, {'loss': 0.5}); sink.text(3, 'note', 'hi'); sink.histogram(3, 'h', [1.0, 2.0])\n"
        "sink.close()\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'tensorboardX', 'torch'})))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == []
