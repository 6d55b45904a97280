"""Datums of Tinker requests -> one packed, fixed-shape batch (and the logprobs back per datum).

A datum is ``model_input`` tokens ``x[0..N)`` and per-token loss inputs of length N (position i
predicts ``target_tokens[i]``). Datums are packed first-fit-decreasing into rows of length ``L``
(a power of two >= the longest datum and >= ``min_len``), several per row as segments (attention
stays within a segment, positions restart); the row count and the number of segment ids are
rounded up to powers of two, so the jitted step sees few distinct shapes and recompiles only when a
batch outgrows every earlier one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["Datum", "PackedDatums", "pack_datums", "pow2"]


def pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum).

    >>> pow2(5), pow2(1, 8), pow2(64)
    (8, 8, 64)
    """
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Datum:
    """One datum: ``tokens`` int ``[N]`` and its per-token float inputs (each ``[N]``)."""

    tokens: np.ndarray
    targets: np.ndarray
    inputs: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class PackedDatums:
    """``arrays``: ``[R, L]`` tokens / targets / positions / segment_ids / mask and every float input;
    ``where[k] = (row, start, length)`` of datum k; ``num_segments``: static bound on segment ids."""

    arrays: dict[str, np.ndarray]
    where: list[tuple[int, int, int]]
    num_segments: int

    def per_datum(self, x: np.ndarray) -> list[np.ndarray]:
        """Splits an ``[R, L]`` result back into one array per datum (in request order)."""
        return [np.asarray(x[r, s : s + n]) for r, s, n in self.where]


def pack_datums(
    datums: Sequence[Datum], *, float_inputs: Mapping[str, float], min_len: int = 32, min_rows: int = 1
) -> PackedDatums:
    """Packs ``datums``; ``float_inputs`` names every float input of the batch with the value it takes
    where a datum does not give it (and on padding).

    >>> d = [Datum(np.array([1, 2, 3]), np.array([2, 3, 4]), {}), Datum(np.array([5]), np.array([6]), {})]
    >>> p = pack_datums(d, float_inputs={"weights": 1.0}, min_len=4)
    >>> p.arrays["tokens"].tolist(), p.arrays["segment_ids"].tolist(), p.where
    ([[1, 2, 3, 5]], [[1, 1, 1, 2]], [(0, 0, 3), (0, 3, 1)])
    """
    if not datums:
        raise ValueError("no datums to pack")
    lengths = [len(d.tokens) for d in datums]
    length = pow2(max(lengths), min_len)
    order = sorted(range(len(datums)), key=lambda k: -lengths[k])
    fill: list[int] = []
    where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(datums)
    for k in order:
        n = lengths[k]
        row = next((r for r, used in enumerate(fill) if used + n <= length), None)
        if row is None:
            fill.append(0)
            row = len(fill) - 1
        where[k] = (row, fill[row], n)
        fill[row] += n
    rows = pow2(len(fill), min_rows)
    arrays = {
        "tokens": np.zeros((rows, length), np.int32),
        "targets": np.zeros((rows, length), np.int32),
        "positions": np.zeros((rows, length), np.int32),
        "segment_ids": np.zeros((rows, length), np.int32),
        "mask": np.zeros((rows, length), np.float32),
    }
    for name, default in float_inputs.items():
        arrays[name] = np.full((rows, length), default, np.float32)
    for k, (d, (r, s, n)) in enumerate(zip(datums, where, strict=True)):
        arrays["tokens"][r, s : s + n] = d.tokens
        arrays["targets"][r, s : s + n] = d.targets
        arrays["positions"][r, s : s + n] = np.arange(n)
        arrays["segment_ids"][r, s : s + n] = k + 1
        arrays["mask"][r, s : s + n] = 1.0
        for name, value in d.inputs.items():
            if name in arrays:
                arrays[name][r, s : s + n] = value
    return PackedDatums(arrays, where, pow2(len(datums) + 1))
