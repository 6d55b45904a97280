"""Datums of Tinker requests -> one packed, fixed-shape batch (and the logprobs back per datum).

A datum is ``model_input`` tokens ``x[0..N)`` and per-token loss inputs of length N (position i
predicts ``target_tokens[i]``). Datums are packed first-fit-decreasing
(:func:`rljax.data.pack.first_fit_decreasing`, the trainer's packer) into rows of length ``L``
(a power of two >= the longest datum and >= ``min_len``), several per row as segments (attention
stays within a segment, positions restart). The row count is a power of two >= ``min_rows`` and the
segment bound a power of two >= datums + 1 and >= ``min_segments``, so the jitted step sees a small
fixed set of shapes: every batch of at most ``min_rows`` rows of length ``L`` runs the one program of
shape ``[min_rows, L]``, larger ones the programs of ``2 min_rows``, ``4 min_rows``, ... rows, each
compiled once, when first needed.

``target_tokens`` may be ``[N, K]`` (K targets per position, its ``weights`` shaped alike): the batch
then packs them as ``[R, L, K']``, ``K'`` its largest K rounded up to a power of two, the extra
columns targeting token 0 with weight 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from rljax.data.pack import first_fit_decreasing

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
    """One datum: ``tokens`` int ``[N]``, ``targets`` int ``[N]`` or ``[N, K]`` and its per-token float
    inputs (each ``[N]``, or shaped like ``targets`` for the batch's ``target_inputs``)."""

    tokens: np.ndarray
    targets: np.ndarray
    inputs: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class PackedDatums:
    """``arrays``: ``[R, L]`` tokens / targets / positions / segment_ids / mask and every float input
    (targets and the target inputs ``[R, L, K]`` when some datum has K targets per position);
    ``where[k] = (row, start, length)`` of datum k; ``widths[k]``: its K (None: one target per
    position); ``num_segments``: static bound on segment ids."""

    arrays: dict[str, np.ndarray]
    where: list[tuple[int, int, int]]
    num_segments: int
    widths: list[int | None] = dataclasses.field(default_factory=list)

    def per_datum(self, x: np.ndarray) -> list[np.ndarray]:
        """Splits an ``[R, L]`` (or ``[R, L, K]``) result back into one array per datum, each shaped
        like its ``targets`` (in request order)."""
        out = []
        for k, (r, s, n) in enumerate(self.where):
            y = np.asarray(x[r, s : s + n])
            if y.ndim == 2:
                width = self.widths[k] if self.widths else None
                y = y[:, 0] if width is None else y[:, :width]
            out.append(y)
        return out


def pack_datums(
    datums: Sequence[Datum],
    *,
    float_inputs: Mapping[str, float],
    min_len: int = 32,
    min_rows: int = 1,
    min_segments: int = 1,
    target_inputs: Collection[str] = (),
) -> PackedDatums:
    """Packs ``datums``; ``float_inputs`` names every float input of the batch with the value it takes
    where a datum does not give it (and on padding); ``target_inputs`` names those shaped like the
    targets (``[N, K]`` where a datum has K targets per position; 0 on the padding columns).

    >>> d = [Datum(np.array([1, 2, 3]), np.array([2, 3, 4]), {}), Datum(np.array([5]), np.array([6]), {})]
    >>> p = pack_datums(d, float_inputs={"weights": 1.0}, min_len=4)
    >>> p.arrays["tokens"].tolist(), p.arrays["segment_ids"].tolist(), p.where
    ([[1, 2, 3, 5]], [[1, 1, 1, 2]], [(0, 0, 3), (0, 3, 1)])
    """
    if not datums:
        raise ValueError("no datums to pack")
    lengths = [len(d.tokens) for d in datums]
    length = pow2(max(lengths), min_len)
    bins, starts, _, used = first_fit_decreasing(lengths, length)  # the trainer's packer (rljax.data)
    where = [(int(r), int(s), n) for r, s, n in zip(bins, starts, lengths, strict=True)]
    rows = pow2(int(used), min_rows)
    widths = [int(d.targets.shape[1]) if d.targets.ndim == 2 else None for d in datums]
    multi = any(w is not None for w in widths)
    cols = (pow2(max(w or 1 for w in widths)),) if multi else ()
    arrays = {
        "tokens": np.zeros((rows, length), np.int32),
        "targets": np.zeros((rows, length, *cols), np.int32),
        "positions": np.zeros((rows, length), np.int32),
        "segment_ids": np.zeros((rows, length), np.int32),
        "mask": np.zeros((rows, length), np.float32),
    }
    for name, default in float_inputs.items():
        if multi and name in target_inputs:
            arrays[name] = np.zeros((rows, length, *cols), np.float32)
        else:
            arrays[name] = np.full((rows, length), default, np.float32)
    for k, (d, (r, s, n)) in enumerate(zip(datums, where, strict=True)):
        arrays["tokens"][r, s : s + n] = d.tokens
        width = widths[k] or 1
        if multi:
            arrays["targets"][r, s : s + n, :width] = d.targets.reshape(n, width)
        else:
            arrays["targets"][r, s : s + n] = d.targets
        arrays["positions"][r, s : s + n] = np.arange(n)
        arrays["segment_ids"][r, s : s + n] = k + 1
        arrays["mask"][r, s : s + n] = 1.0
        for name in float_inputs:
            if multi and name in target_inputs:
                value = d.inputs.get(name, float_inputs[name])
                arrays[name][r, s : s + n, :width] = (
                    np.broadcast_to(value, (n, width))
                    if np.ndim(value) == 0
                    else np.reshape(value, (n, width))
                )
            elif name in d.inputs:
                arrays[name][r, s : s + n] = d.inputs[name]
    return PackedDatums(arrays, where, pow2(len(datums) + 1, min_segments), widths)
