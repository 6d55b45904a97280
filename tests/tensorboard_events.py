"""Reading TensorBoard event files back as TensorBoard shows them (tests only; TensorBoard itself is not
installed).

An event file is a sequence of TFRecords (``uint64`` length, 4-byte CRC of it, the serialized
``Event``, 4-byte CRC of that), parsed here with tensorboardX's protobuf classes. What TensorBoard
shows of a directory follows its ``EventAccumulator`` with ``purge_orphaned_data=True`` (the default)
on files of ``file_version`` "brain.Event:2": files are read in name order, and a ``session_log``
event with status ``START`` at step ``S`` discards every event read before it whose step is
``>= S`` (the events a crashed run wrote after the step its successor resumed from).
"""

from __future__ import annotations

import pathlib
import struct
from typing import Any


def read_events(path: str | pathlib.Path) -> list[Any]:
    """Every ``Event`` of one event file, in file order."""
    from tensorboardX.proto import event_pb2

    data, pos, out = pathlib.Path(path).read_bytes(), 0, []
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        out.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
        pos += 12 + length + 4
    return out


def event_files(logdir: str | pathlib.Path) -> list[pathlib.Path]:
    """The event files of ``logdir`` in the order TensorBoard reads them (by name)."""
    return sorted(pathlib.Path(logdir).glob("events.out.tfevents.*"))


def visible(logdir: str | pathlib.Path) -> dict[str, list[tuple[int, Any]]]:
    """``{tag: [(step, Summary.Value), ...]}`` that TensorBoard keeps after purging (module docstring),
    in the order read: a step listed twice under one tag is a duplicate TensorBoard would show."""
    from tensorboardX.proto import event_pb2

    kept: list[tuple[int, str, Any]] = []
    for path in event_files(logdir):
        for event in read_events(path):
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                kept = [(step, tag, value) for step, tag, value in kept if step < event.step]
            for value in event.summary.value:
                kept.append((event.step, value.tag, value))
    out: dict[str, list[tuple[int, Any]]] = {}
    for step, tag, value in kept:
        out.setdefault(tag, []).append((step, value))
    return out


def scalars(logdir: str | pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """The visible scalar series: ``{tag: [(step, value), ...]}`` (values are float32, as stored)."""
    return {
        tag: [(step, v.simple_value) for step, v in values]
        for tag, values in visible(logdir).items()
        if values and values[0][1].WhichOneof("value") == "simple_value"
    }
