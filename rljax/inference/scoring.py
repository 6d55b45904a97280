"""Scoring many token sequences with one model: packed, bucketed, one compile per shape.

``score_sequences(model, seqs)`` returns, for every sequence ``x``, ``out[t] = log p(x[t] | x[:t])``
(``out[0] = 0``), the convention of :func:`rljax.models.sequence_logprobs`, which computes it.
Used where a model scores token streams it did not necessarily sample: the live policy as the
opsd teacher on demonstration-conditioned sequences (design §3.6), recomputed logprobs, evals.

Sequences are packed first-fit-decreasing (:func:`rljax.data.pack.first_fit_decreasing`) into
rows of ``row_len`` tokens, several per row, with segment ids (attention never crosses
sequences) and positions restarting at 0 per sequence, so a packed row gives each sequence
exactly the logprobs it has alone (Krell et al. 2021, "Efficient Sequence Packing without
Cross-contamination"). The rows are run ``rows_per_batch`` at a time through one jitted forward
of the fixed shape ``[rows_per_batch, row_len]``; ``row_len`` defaults to the longest sequence
rounded up to a power of two (at least 64), so calls with different lengths in the same bucket
reuse one compiled program.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.data.pack import PackLayout, first_fit_decreasing, unpack_responses
from rljax.models.logprobs import logit_capacity, sequence_logprobs

__all__ = ["MIN_ROW_LEN", "bucket_row_len", "score_sequences"]

#: Smallest default row length (shorter batches are padded up to it).
MIN_ROW_LEN = 64


def bucket_row_len(max_len: int, *, min_len: int = MIN_ROW_LEN) -> int:
    """The default row length for sequences of at most ``max_len`` tokens: ``max(min_len, 2**ceil(log2))``.

    >>> bucket_row_len(1), bucket_row_len(64), bucket_row_len(65), bucket_row_len(300)
    (64, 64, 128, 512)
    """
    if max_len < 0 or min_len < 1:
        raise ValueError(f"need max_len >= 0 and min_len >= 1, got {max_len} and {min_len}")
    n = min_len
    while n < max_len:
        n *= 2
    return n


@functools.partial(jax.jit, static_argnums=(0, 1))
def _packed_logprobs(
    graphdef: nnx.GraphDef,
    capacity: int | None,
    state: nnx.State,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    temperature: jax.Array,
    wanted: jax.Array | None,
) -> jax.Array:
    """``sequence_logprobs`` of ``nnx.merge(graphdef, state)`` on packed rows, of the ``wanted``
    tokens only (None: all), in a buffer of ``capacity`` (compiled once per shape and capacity)."""
    model = nnx.merge(graphdef, state)
    return sequence_logprobs(
        model, tokens, positions=positions, segment_ids=segment_ids, temperature=temperature,
        logit_mask=wanted, logit_capacity=capacity,
    )  # fmt: skip


def _as_ids(seq: Any, k: int, vocab_size: int | None) -> np.ndarray:
    ids = np.asarray(seq)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"seqs[{k}] must be a 1-D sequence of int token ids, got shape {ids.shape} {ids.dtype}"
        )
    if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        raise ValueError(
            f"seqs[{k}] has token ids in [{ids.min()}, {ids.max()}], outside the model's vocabulary "
            f"[0, {vocab_size}); score ids of the model's own tokenizer"
        )
    return ids.astype(np.int32)


def _temperatures(temperature: float | Sequence[float], n: int) -> np.ndarray:
    temps = np.asarray(temperature, np.float64)
    if temps.ndim == 0:
        temps = np.full(n, float(temps))
    elif temps.shape != (n,):
        raise ValueError(
            f"temperature must be a scalar or one value per sequence ({n}), got shape {temps.shape}"
        )
    if n and not (np.all(np.isfinite(temps)) and temps.min() > 0):
        raise ValueError(f"temperatures must be finite and > 0, got {temps.tolist()}")
    return temps.astype(np.float32)


def _score_from(score_from: Sequence[int] | None, n: int) -> np.ndarray | None:
    if score_from is None:
        return None
    starts = np.asarray(score_from)
    if starts.shape != (n,) or not (starts.size == 0 or np.issubdtype(starts.dtype, np.integer)):
        raise ValueError(
            f"score_from must be one int per sequence ({n}), got {np.asarray(score_from).tolist()}"
        )
    return starts.astype(np.int64)


def score_sequences(
    model: nnx.Module,
    seqs: Sequence[Sequence[int]],
    *,
    temperature: float | Sequence[float] = 1.0,
    row_len: int | None = None,
    rows_per_batch: int = 8,
    score_from: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Per-token log-probabilities of many sequences: ``out[i][t] = log p(seqs[i][t] | seqs[i][:t])``.

    Entry ``t`` is ``log softmax(logits(x[:t]) / tau)[x[t]]``, 0 at ``t = 0`` (design §5), equal to
    :func:`rljax.models.sequence_logprobs` of the sequence alone: sequences are packed
    first-fit-decreasing into ``[rows_per_batch, row_len]`` batches with segment ids and
    positions restarting per sequence, and each batch goes through one jitted forward
    (compiled once per ``(model structure, row_len, rows_per_batch)``).

    Args:
      model: an NNX decoder (e.g. :class:`rljax.models.Decoder`); only read.
      seqs: token id sequences (lists or 1-D int arrays; any lengths up to ``row_len``).
      temperature: one temperature for all sequences, or one per sequence.
      row_len: tokens per packed row; default the longest sequence rounded up to a power of
        two, at least :data:`MIN_ROW_LEN` (so few shapes compile).
      rows_per_batch: rows per forward pass (the batch dimension of the compiled shape).
      score_from: per sequence, the first position whose score is wanted (e.g. where a response
        starts); the earlier entries are 0 and their logits are never computed (only the wanted
        tokens meet the vocabulary, in a buffer of :func:`rljax.models.logprobs.logit_capacity`
        tokens). None: every position.

    Returns:
      One float32 array per sequence, of its length, in input order.

    Raises:
      ValueError: a sequence is longer than ``row_len``, not a 1-D int sequence, holds ids
        outside the vocabulary, a temperature is not positive, or ``score_from`` is not one int
        per sequence.

    >>> from rljax.models import sequence_logprobs
    >>> from rljax.models.tiny import tiny_model
    >>> model = tiny_model("llama", vocab_size=16, num_layers=1)
    >>> a, b = score_sequences(model, [[1, 2, 3], [4, 5]])
    >>> a.shape, b.shape, float(a[0])
    ((3,), (2,), 0.0)
    >>> bool(np.allclose(a, sequence_logprobs(model, jnp.array([[1, 2, 3]]))[0], atol=1e-6))
    True
    >>> tail, _ = score_sequences(model, [[1, 2, 3], [4, 5]], score_from=[2, 0])
    >>> float(tail[1]), bool(np.isclose(tail[2], a[2], atol=1e-6))
    (0.0, True)
    """
    if not isinstance(rows_per_batch, int) or rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be an int >= 1, got {rows_per_batch!r}")
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    ids = [_as_ids(s, k, vocab_size) for k, s in enumerate(seqs)]
    n = len(ids)
    temps = _temperatures(temperature, n)
    first_scored = _score_from(score_from, n)
    lengths = np.fromiter((x.shape[0] for x in ids), np.int64, count=n)
    if n == 0:
        return []
    longest = int(lengths.max())
    if row_len is None:
        row_len = bucket_row_len(longest)
    elif not isinstance(row_len, int) or row_len < 1:
        raise ValueError(f"row_len must be an int >= 1, got {row_len!r}")
    if longest > row_len:
        k = int(np.argmax(lengths))
        raise ValueError(
            f"seqs[{k}] has {longest} tokens > row_len={row_len}; raise row_len or leave it None "
            "(the default fits the longest sequence)"
        )
    if longest == 0:
        return [np.zeros(0, np.float32) for _ in range(n)]

    rows, starts, segs, used = first_fit_decreasing(lengths, row_len)
    num_rows = -(-int(used) // rows_per_batch) * rows_per_batch
    # Every token is a "response" token of its sample, so unpack_responses returns whole sequences.
    layout = PackLayout(
        rows=rows,
        starts=starts,
        prompt_lens=np.zeros(n, np.int64),
        response_lens=lengths,
        source_index=np.arange(n),
        seq_len=row_len,
        num_rows=num_rows,
    )
    dest, rel, _ = layout.flat_index()
    size = num_rows * row_len
    tokens = np.zeros(size, np.int32)
    tokens[dest] = np.concatenate(ids)
    positions = np.zeros(size, np.int32)
    positions[dest] = rel
    segment_ids = np.zeros(size, np.int32)
    segment_ids[dest] = np.repeat(segs, lengths)
    temperatures = np.ones(size, np.float32)
    temperatures[dest] = np.repeat(temps, lengths)
    wanted = None
    if first_scored is not None:
        wanted = np.zeros(size, bool)
        wanted[dest] = rel >= np.maximum(np.repeat(first_scored, lengths), 1)  # entry 0 is never predicted
    shape = (num_rows // rows_per_batch, rows_per_batch, row_len)
    tokens, positions, segment_ids, temperatures = (
        a.reshape(shape) for a in (tokens, positions, segment_ids, temperatures)
    )
    wanted = None if wanted is None else wanted.reshape(shape)
    capacity = None if wanted is None else logit_capacity(wanted)  # one buffer size for every batch

    graphdef, state = nnx.split(model)
    outs = [
        _packed_logprobs(
            graphdef,
            capacity,
            state,
            jnp.asarray(tokens[b]),
            jnp.asarray(positions[b]),
            jnp.asarray(segment_ids[b]),
            jnp.asarray(temperatures[b]),
            None if wanted is None else jnp.asarray(wanted[b]),
        )
        for b in range(shape[0])
    ]
    scores = np.concatenate([np.asarray(o, np.float32) for o in outs], axis=0)
    return [np.ascontiguousarray(a) for a in unpack_responses(scores, layout)]
