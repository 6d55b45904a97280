"""Reading an offline Weights & Biases run back (tests only).

An offline run is a ``run-<id>.wandb`` file: wandb's transaction log, a LevelDB-style log (32 KiB
blocks of records, each ``crc32 (4 bytes) | length (2) | type (1: full, 2: first, 3: middle, 4:
last)``, after a 7-byte ``:W&B`` header) of ``wandb.proto.wandb_internal_pb2.Record`` messages,
which wandb's own protobuf classes parse. wandb has no public reader for offline runs (its ``Api``
reads the server), so this walks the log and lets wandb parse every record.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any

BLOCK = 32768
HEADER = 7


def wandb_records(path: str | pathlib.Path) -> list[Any]:
    """Every ``Record`` of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, pending, out = HEADER, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's trailer is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the block end
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def run_history(paths: list[pathlib.Path]) -> tuple[set[str], dict[int, dict[str, Any]]]:
    """``(run ids, {step: {key: value}})`` of the history rows of ``paths`` (values JSON-decoded;
    nested keys joined with ``/``; a step logged in several calls is one row)."""
    ids: set[str] = set()
    rows: dict[int, dict[str, Any]] = {}
    for path in paths:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item
                }
                rows.setdefault(int(items["_step"]), {}).update(items)
    return ids, rows


def history_steps(paths: list[pathlib.Path]) -> list[int]:
    """The step of every history record of ``paths``, in order (a step twice: logged twice)."""
    steps = []
    for path in paths:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): i.value_json for i in record.history.item}
                steps.append(int(json.loads(items["_step"])))
    return steps


def run_config(paths: list[pathlib.Path]) -> dict[str, Any]:
    """The config updates of the runs' ``config`` records."""
    out: dict[str, Any] = {}
    for path in paths:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") in ("config", "run"):
                cfg = record.config if record.WhichOneof("record_type") == "config" else record.run.config
                out.update({u.key: json.loads(u.value_json) for u in cfg.update})
    return out
