"""Micro-batches of a packed mini-batch by a token budget (host side, fixed shapes).

A mini-batch of ``R`` packed rows of ``L`` tokens is cut into ``k`` micro-batches of ``r`` rows::

    r = data_parallel * max(1, floor(micro_batch_tokens / L))
    k = ceil(R / r)              (R padded to k * r with fully masked rows)

The budget is per data-parallel shard (what one device, or one tensor-parallel group, holds at a
time): each shard gets at most ``micro_batch_tokens`` tokens of every micro-batch (at least one
row, even when a row is longer than the budget). The micro-batch shape depends only on
``(L, budget, data_parallel)``, and the stacked ``[k, r, L]`` shape takes one value per row
bucket of the packer (bounded recompiles).
Padding rows are empty (segment 0, every mask and weight 0, temperature 1, no routed experts; in
prefix-tree batches no parent and ``subtree_end`` 0), so they add nothing to any count, loss or
gradient. Prefix trees never span rows, so whole rows keep every sample whole.

>>> from rljax.data.pack import pack
>>> from rljax.types import Step
>>> batch = pack([Step([1, 2], [3, 4], ("q", i)) for i in range(3)], seq_len=4).batch
>>> split_by_token_budget(batch, micro_batch_tokens=8).tokens.shape
(2, 2, 4)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rljax.types import PackedBatch

__all__ = ["EMPTY_ROW_VALUES", "micro_batch_rows", "pad_rows", "split_by_token_budget"]

#: The value an empty (padding) row holds in each PackedBatch field; fields not listed hold 0.
EMPTY_ROW_VALUES = {"temperatures": 1.0, "routed_experts": -1, "support_floors": -np.inf, "parents": -1}


def micro_batch_rows(*, seq_len: int, micro_batch_tokens: int, data_parallel: int = 1) -> int:
    """Rows per micro-batch: per data-parallel shard the most whole rows within the budget (at
    least one), times ``data_parallel``.

    >>> micro_batch_rows(seq_len=512, micro_batch_tokens=2048), micro_batch_rows(
    ...     seq_len=512, micro_batch_tokens=2048, data_parallel=3)
    (4, 12)
    """
    if seq_len < 1 or micro_batch_tokens < 1 or data_parallel < 1:
        raise ValueError(
            f"seq_len, micro_batch_tokens and data_parallel must be >= 1; got {seq_len}, "
            f"{micro_batch_tokens}, {data_parallel}"
        )
    return data_parallel * max(1, micro_batch_tokens // seq_len)


def pad_rows(batch: PackedBatch, num_rows: int) -> PackedBatch:
    """``batch`` with empty rows appended up to ``num_rows`` (numpy; see :data:`EMPTY_ROW_VALUES`).

    >>> from rljax.data.pack import pack
    >>> from rljax.types import Step
    >>> b = pad_rows(pack([Step([1], [2], ("q", 0))], seq_len=2).batch, 3)
    >>> b.segment_ids.tolist(), b.temperatures.tolist()
    ([[1, 1], [0, 0], [0, 0]], [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    """
    rows = int(np.shape(batch.tokens)[0])
    if num_rows < rows:
        raise ValueError(f"pad_rows cannot shrink a batch of {rows} rows to {num_rows}")
    changes = {}
    for field in dataclasses.fields(batch):
        x = getattr(batch, field.name)
        if x is None:
            continue
        x = np.asarray(x)
        pad = np.full((num_rows - rows, *x.shape[1:]), EMPTY_ROW_VALUES.get(field.name, 0), x.dtype)
        changes[field.name] = np.concatenate([x, pad])
    return dataclasses.replace(batch, **changes)


def split_by_token_budget(
    batch: PackedBatch, *, micro_batch_tokens: int, data_parallel: int = 1, min_micro_batches: int = 1
) -> PackedBatch:
    """``[R, L]`` -> ``[k, r, L]`` micro-batches of at most ``micro_batch_tokens`` tokens per
    data-parallel shard (see the module docstring); consecutive rows per micro-batch, empty rows
    padding the last.

    ``data_parallel`` must divide ``R`` (the packer's ``data_parallel``), so sharding rows of each
    micro-batch over the data-parallel devices stays exact. ``min_micro_batches``: at least this many
    (``k = max(ceil(R / r), min_micro_batches)``), the extra ones all empty rows: a trainer keeps
    ``k``, and so its compiled step, when a mini-batch packs into fewer rows than an earlier one
    (:func:`rljax.training.step.train_mini_batch` skips empty micro-batches).

    >>> from rljax.data.pack import pack
    >>> from rljax.types import Step
    >>> batch = pack([Step([1, 2], [3, 4], ("q", 0))], seq_len=4).batch
    >>> micro = split_by_token_budget(batch, micro_batch_tokens=4, min_micro_batches=3)
    >>> micro.tokens.shape, micro.segment_ids[:, 0, 0].tolist()
    ((3, 1, 4), [1, 0, 0])
    """
    rows, seq_len = (int(n) for n in np.shape(batch.tokens)[:2])
    if rows % data_parallel:
        raise ValueError(f"{rows} rows are not a multiple of data_parallel={data_parallel}")
    r = micro_batch_rows(seq_len=seq_len, micro_batch_tokens=micro_batch_tokens, data_parallel=data_parallel)
    r = min(r, rows)
    k = max(-(-rows // r), min_micro_batches)
    padded = pad_rows(batch, k * r)
    return PackedBatch(
        **{
            f.name: None if getattr(padded, f.name) is None else
            np.asarray(getattr(padded, f.name)).reshape(k, r, *np.shape(getattr(padded, f.name))[1:])
            for f in dataclasses.fields(padded)
        }
    )  # fmt: skip
