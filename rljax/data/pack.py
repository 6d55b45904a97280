"""Packing samples into fixed-shape rows, and mini-batches of whole prompt groups (design §2.6).

A sample is ``prompt_ids ++ response_ids`` of one (merged or unmerged) step. Samples are
placed first-fit-decreasing (FFD: longest first, each into the first row with room) into
rows of ``seq_len`` tokens, several samples per row, and the row count is rounded up to a
bucket from a small set (powers of two by default, or a configured list) so that the
jitted train step compiles a bounded number of times. Every per-token stream of
:class:`~rljax.types.PackedBatch` is written at the same ``[row, column]`` as its token;
entry ``t`` refers to predicting ``tokens[t]`` from ``tokens[<t]`` of the same segment:

==================  ============================================  ==============
stream              response tokens                               prompt/padding
==================  ============================================  ==============
loss_mask           the step's loss_mask                          0
advantages          caller's per-step arrays (default 0)          0
inference_logprobs  the step's response_logprobs (0 if None)      0
old_logprobs        = inference_logprobs (trainer may recompute)  0
ref_logprobs        caller's per-step arrays (default 0)          0
rl/ce/ref_kl_w      caller's per-step arrays/scalars (1/0/0)      0
temperatures        the step's temperature on the whole sample    1.0 on padding
positions           0, 1, ... restarting at each sample           0 on padding
segment_ids         1..k for the k samples of a row               0 on padding
sample_index        dense sample id 0..n-1 (input order)          0 on padding
group_index         dense prompt-group id (by ``instance_id``)    0 on padding
==================  ============================================  ==============

Integer streams are int32, the others float32. Attention must not cross segment
boundaries (the model uses ``segment_ids``); a sample never spans rows.

Decisions (beyond design §2.6):

* Over-length samples raise ``ValueError`` naming the sample. With ``truncate=True`` the
  TAIL of the response is dropped (the prompt is the conditioning context and is kept
  whole, so the kept tokens' logprobs stay exact); a prompt that leaves no room for a
  response token is still an error. Metrics ``truncated_samples`` / ``truncated_tokens``.
  ``token_rewards`` on the cut tail's trained tokens are not dropped: they move to the last kept
  trained token (the cut tokens are then like masked ones, which are not time steps of GAE).
* ``sample_index`` and ``group_index`` are dense per packed batch (so segment reductions
  use a small static ``num_segments``); :class:`PackLayout` maps them back to the caller's
  step indices and :attr:`PackResult.group_keys` to ``instance_id`` strings.
* Mini-batches: the number of prompt groups must be a multiple of ``mini_batch_prompts``
  (else ``ValueError``; nothing is dropped silently).

Prefix trees (``prefix_sharing=True``, design §2.6): samples sorted by their shareable prefix
(prompt tokens, never a sample's last token, with the MoE routing the sampler recorded) are laid
out as trees in depth-first order, each shared token once; ``parents`` / ``subtree_end`` describe
the trees, ``positions`` are depths, and a sample's segment id marks the tokens it owns (the first
sample through a shared token owns it; response tokens are never shared). Trees longer than a row
are split at their branch points (:func:`prefix_tree_units`); trees are placed FFD like samples, and
when that needs more (bucketed) rows than plain packing each sample is its own tree. The layout
then records every sample's columns (``token_index``), so :func:`unpack` and
:func:`unpack_responses` work unchanged; metrics add ``sample_tokens`` (what plain packing lays
out) and ``shared_prefix_tokens`` (what sharing saved).

Reference: Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination"
(first-fit-decreasing packing with segment ids); SkyRL PR #1529 (mini-batches of prompts).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.data.batch import StepBatch
from rljax.types import PackedBatch, Step

__all__ = [
    "OPTIONAL_STREAMS",
    "PackLayout",
    "PackResult",
    "bucket_rows",
    "first_fit_decreasing",
    "geometric_row_buckets",
    "make_mini_batches",
    "prefix_tree_units",
    "STREAM_DEFAULTS",
    "check_streams",
    "pack",
    "unpack",
    "unpack_responses",
    "with_token_staleness",
]

# A per-step stream: None (default), one scalar for all steps, or one entry per step that is
# a scalar or an array with one value per response token.
PerStep = float | Sequence[Any] | None

#: The caller-supplied per-step streams of :func:`pack` / :func:`make_mini_batches` and the value
#: a stream takes where it is not given (design §2.6, §3.5): the one list of their names.
STREAM_DEFAULTS: Mapping[str, float] = {
    "advantages": 0.0,
    "ref_logprobs": 0.0,
    "rl_weights": 1.0,
    "ce_weights": 0.0,
    "ref_kl_weights": 0.0,
}
#: Optional per-step streams: packed only when given (their PackedBatch field is None otherwise).
OPTIONAL_STREAMS: Mapping[str, float] = {"token_rewards": 0.0}
#: Streams whose cut tail is not dropped with truncation: what the cut trained tokens carry moves to
#: the sample's last kept trained token (a truncated sample keeps its reward).
_TAIL_FOLDED: tuple[str, ...] = ("token_rewards",)


def check_streams(streams: Mapping[str, PerStep]) -> dict[str, PerStep]:
    """Every stream of :data:`STREAM_DEFAULTS` (absent ones None) and the given
    :data:`OPTIONAL_STREAMS`; unknown names raise ValueError."""
    known = {**STREAM_DEFAULTS, **OPTIONAL_STREAMS}
    unknown = sorted(set(streams) - set(known))
    if unknown:
        raise ValueError(f"unknown per-step stream(s) {unknown}; streams are {list(known)}")
    out = {name: streams.get(name) for name in STREAM_DEFAULTS}
    out.update({name: streams[name] for name in OPTIONAL_STREAMS if streams.get(name) is not None})
    return out


_RESPONSE_STREAMS = (
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "rl_weights",
    "ce_weights",
    "ref_kl_weights",
)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, np.number)) or (isinstance(v, np.ndarray) and v.ndim == 0)


# --------------------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------------------


def first_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> tuple[np.ndarray, ...]:
    """Bin-packs items first-fit-decreasing into bins of ``capacity``.

    Items are visited longest first (ties in input order); each goes into the
    lowest-numbered bin with room, or a new bin. FFD uses at most ``11/9 OPT + 6/9`` bins
    (Dósa 2007).

    Returns:
      ``(rows, starts, segments, num_rows)``: per item (input order) its bin, its offset in
      the bin and its 1-based rank within the bin; ``num_rows`` is a 0-d int array.

    >>> rows, starts, segs, n = first_fit_decreasing([3, 5, 2, 4], capacity=8)
    >>> rows.tolist(), starts.tolist(), segs.tolist(), int(n)
    ([0, 0, 1, 1], [5, 0, 4, 0], [2, 1, 2, 1], 2)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    n = lengths.shape[0]
    if n and (lengths.max() > capacity or lengths.min() < 0):
        raise ValueError(f"lengths must be in [0, capacity={capacity}], got {lengths.min()}..{lengths.max()}")
    order = np.argsort(-lengths, kind="stable")
    remaining = np.full(max(n, 1), capacity, dtype=np.int64)
    count = np.zeros(max(n, 1), dtype=np.int64)
    rows = np.zeros(n, dtype=np.int64)
    starts = np.zeros(n, dtype=np.int64)
    segs = np.zeros(n, dtype=np.int64)
    used = 0
    length_list = lengths.tolist()
    for k in order.tolist():
        need = length_list[k]
        r = int(np.argmax(remaining[:used] >= need)) if used else 0
        if not used or remaining[r] < need:
            r = used
            used += 1
        rows[k] = r
        starts[k] = capacity - remaining[r]
        remaining[r] -= need
        count[r] += 1
        segs[k] = count[r]
    return rows, starts, segs, np.asarray(used)


def bucket_rows(num_rows: int, *, row_buckets: Sequence[int] | None = None, data_parallel: int = 1) -> int:
    """Smallest allowed row count ``>= num_rows`` (at least 1) that ``data_parallel`` divides.

    ``row_buckets=None`` allows ``data_parallel * 2**k``; a list allows its entries.

    >>> bucket_rows(5), bucket_rows(5, data_parallel=3), bucket_rows(5, row_buckets=[4, 6, 8])
    (8, 6, 6)
    """
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    need = max(int(num_rows), 1)
    if row_buckets is None:
        b = data_parallel
        while b < need:
            b *= 2
        return b
    fits = sorted(b for b in row_buckets if b >= need and b % data_parallel == 0)
    if not fits:
        raise ValueError(
            f"{num_rows} rows do not fit any row bucket in {sorted(row_buckets)} that is a multiple of "
            f"data_parallel={data_parallel}; add a larger bucket (or row_buckets=None for powers of two), "
            "or pack fewer samples per batch"
        )
    return fits[0]


def geometric_row_buckets(max_rows: int, *, ratio: float = 1.03, data_parallel: int = 1) -> list[int]:
    """Row buckets ``b_0 = data_parallel``, ``b_{k+1} = ceil_dp(b_k * ratio)`` (at least one step up).

    Multiples of ``data_parallel`` up to the first one ``>= max_rows``. Rounding ``r`` rows up
    to the next bucket adds fewer than ``(ratio - 1) * r + data_parallel`` padding rows, and
    the number of buckets grows like ``log(max_rows) / log(ratio)``, so jit compiles few
    shapes while padding stays a small fraction of large batches.

    >>> geometric_row_buckets(20, ratio=1.25)
    [1, 2, 3, 4, 5, 7, 9, 12, 15, 19, 24]
    >>> geometric_row_buckets(10, ratio=1.5, data_parallel=4)
    [4, 8, 12]
    """
    if ratio <= 1.0:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    if data_parallel < 1 or max_rows < 1:
        raise ValueError(f"max_rows and data_parallel must be >= 1, got {max_rows} and {data_parallel}")
    buckets = [data_parallel]
    while buckets[-1] < max_rows:
        step_up = int(np.ceil(buckets[-1] * ratio / data_parallel)) * data_parallel
        buckets.append(max(step_up, buckets[-1] + data_parallel))
    return buckets


# --------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each packed sample sits; all arrays are int64 ``[num_samples]`` in input order.

    Attributes:
      rows, starts: row and first column of each sample.
      prompt_lens, response_lens: packed lengths (response after truncation).
      source_index: the sample's index in the caller's steps (the batch, for mini-batches).
      seq_len, num_rows: the packed shape.
      shared_lens: prefix-tree rows: the leading tokens of each sample that an earlier sample of its
        tree owns (laid out once, at that sample's columns); None for plain rows (no sharing).
      token_index: prefix-tree rows: the flat ``[num_rows * seq_len]`` index of every token of every
        sample (the concatenation in input order, shared tokens included); None for plain rows,
        where each sample's tokens are the contiguous columns from ``starts``.
    """

    rows: np.ndarray
    starts: np.ndarray
    prompt_lens: np.ndarray
    response_lens: np.ndarray
    source_index: np.ndarray
    seq_len: int
    num_rows: int
    shared_lens: np.ndarray | None = None
    token_index: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        """The number of samples placed."""
        return int(self.rows.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """Each sample's length in tokens (prompt + response)."""
        return self.prompt_lens + self.response_lens

    def flat_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dest, rel, is_response)`` for the concatenation of all samples in input order.

        ``dest`` is the index into the flattened ``[num_rows * seq_len]`` arrays, ``rel`` the
        position inside the sample and ``is_response`` marks response tokens.
        """
        lengths = self.lengths
        offsets = np.cumsum(lengths) - lengths
        rel = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(offsets, lengths)
        if self.token_index is None:
            dest = rel + np.repeat(self.rows * self.seq_len + self.starts, lengths)
        else:
            dest = self.token_index
        is_response = rel >= np.repeat(self.prompt_lens, lengths)
        return dest, rel, is_response

    def response_starts(self) -> np.ndarray:
        """int64 ``[num_samples]``: the flat index (``row * seq_len + column``) of each sample's first
        kept response token. A sample's response tokens are the consecutive flat indices from there,
        in plain and prefix-tree rows alike (response tokens are never shared). -1 for an empty
        response in prefix-tree rows.

        >>> from rljax.types import Step
        >>> steps = [Step([1, 2], [3, 4], ("q", 0)), Step([1, 2], [5], ("q", 1))]
        >>> pack(steps, seq_len=8).layout.response_starts().tolist()
        [2, 6]
        >>> pack(steps, seq_len=8, prefix_sharing=True).layout.response_starts().tolist()
        [2, 4]
        """
        if self.token_index is None:
            return self.rows * self.seq_len + self.starts + self.prompt_lens
        lengths = self.lengths
        first = np.cumsum(lengths) - lengths + self.prompt_lens
        has = self.response_lens > 0
        out = np.full(self.num_samples, -1, np.int64)
        out[has] = self.token_index[first[has]]
        return out

    def owned(self) -> np.ndarray:
        """bool, aligned with :meth:`flat_index`: the tokens each sample writes (all of them in plain
        rows; in prefix-tree rows, all but the leading ``shared_lens`` an earlier sample owns)."""
        lengths = self.lengths
        if self.shared_lens is None:
            return np.ones(int(lengths.sum()), bool)
        offsets = np.cumsum(lengths) - lengths
        rel = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(offsets, lengths)
        return rel >= np.repeat(self.shared_lens, lengths)


@dataclasses.dataclass(frozen=True)
class PackResult:
    """A packed batch with its layout, metrics and the ``instance_id`` of each group index."""

    batch: PackedBatch
    layout: PackLayout
    metrics: dict[str, Any]
    group_keys: tuple[str, ...]


def _where(steps: Sequence[Step], source: np.ndarray, k: int) -> str:
    return f"sample {int(source[k])} (trajectory {steps[k].trajectory_id})"


def _response_stream(
    name: str,
    value: PerStep,
    steps: Sequence[Step],
    source: np.ndarray,
    resp_lens: np.ndarray,
    keep_lens: np.ndarray,
    default: float,
) -> np.ndarray:
    """Concatenates a per-step stream over the (kept) response tokens of all samples."""
    total = int(keep_lens.sum())
    if value is None:
        return np.full(total, default, dtype=np.float32)
    fold = name in _TAIL_FOLDED and bool(np.any(keep_lens < resp_lens))
    if _is_scalar(value) and not fold:
        out = np.full(total, float(value), dtype=np.float32)
    else:
        if _is_scalar(value):
            value = [value] * len(steps)
        if len(value) != len(steps):
            raise ValueError(
                f"{name} has {len(value)} entries but there are {len(steps)} samples; pass one entry "
                "(a scalar or a per-response-token array) per sample, in order"
            )
        parts = []
        for k, v in enumerate(value):
            keep = int(keep_lens[k])
            if v is None:
                parts.append(np.full(keep, default, dtype=np.float32))
            elif _is_scalar(v) and keep == resp_lens[k]:
                parts.append(np.full(keep, float(v), dtype=np.float32))
            else:
                n = int(resp_lens[k])
                a = np.full(n, float(v), np.float32) if _is_scalar(v) else np.asarray(v, np.float32)
                if a.shape != (n,):
                    raise ValueError(
                        f"{name} of {_where(steps, source, k)} has shape {a.shape} but the sample has "
                        f"{n} response tokens; pass one value per response token"
                    )
                parts.append(_fold_cut_tail(a, steps[k].loss_mask, keep) if fold else a[:keep])
        out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    if not np.all(np.isfinite(out)):
        bad = int(np.searchsorted(np.cumsum(keep_lens), int(np.argmin(np.isfinite(out))), side="right"))
        raise ValueError(f"{name} of {_where(steps, source, bad)} has a non-finite value (NaN or inf)")
    return out


def _fold_cut_tail(values: np.ndarray, loss_mask: Sequence[int], keep: int) -> np.ndarray:
    """The first ``keep`` values, the values on the cut tail's trained tokens (loss mask 1) added
    to the last kept trained token (dropped when no trained token is kept).

    >>> _fold_cut_tail(np.array([0.0, 1.0, 0.0, 2.0, 5.0], np.float32), [1, 1, 0, 1, 0], 2).tolist()
    [0.0, 3.0]
    """
    out = values[:keep].copy()
    if keep == values.shape[0]:
        return out
    mask = np.asarray(loss_mask) != 0
    kept = np.flatnonzero(mask[:keep])
    if kept.size:
        out[kept[-1]] += np.float32(values[keep:][mask[keep:]].sum())
    return out


def _routed_experts(
    steps: Sequence[Step], lengths: np.ndarray, dest: np.ndarray, size: int, num_rows: int, seq_len: int
) -> np.ndarray | None:
    """``[rows, seq_len, layers, top_k]`` int32 routing of every packed token (MoE router replay).

    Sample ``k``'s packed token at position ``p`` gets row ``p`` of its ``routed_experts`` (which
    has one row per position but the last); -1 where nothing was recorded (the last token, padding,
    samples without routing). None when no sample carries routing.
    """
    first = next((s.routed_experts for s in steps if s.routed_experts is not None), None)
    if first is None:
        return None
    layers, top_k = np.shape(first)[1:]
    flat = np.full((int(lengths.sum()), layers, top_k), -1, np.int32)
    start = 0
    for s, n in zip(steps, lengths.tolist(), strict=True):
        if s.routed_experts is not None:
            rows = np.asarray(s.routed_experts)[:n]
            flat[start : start + rows.shape[0]] = rows
        start += n
    out = np.full((size, layers, top_k), -1, np.int32)
    out[dest] = flat
    return out.reshape(num_rows, seq_len, layers, top_k)


# --------------------------------------------------------------------------------------
# Prefix-tree placement
# --------------------------------------------------------------------------------------


def _sharing_keys(steps: Sequence[Step], shareable: np.ndarray) -> list[np.ndarray]:
    """Per sample, int64 ``[shareable_k, 1 + M * k]``: each shareable token id followed by the MoE
    routing the sampler recorded for it (-1 without a record; no columns when no step has one). Two
    samples share a token only when these rows agree up to it: replayed routing stays each sample's."""
    first = next((s.routed_experts for s in steps if s.routed_experts is not None), None)
    width = 0 if first is None else int(np.prod(np.shape(first)[1:]))
    keys = []
    for s, n in zip(steps, shareable.tolist(), strict=True):
        key = np.full((n, 1 + width), -1, np.int64)
        key[:, 0] = np.asarray(s.prompt_ids[:n], np.int64)
        if width and s.routed_experts is not None:
            key[:, 1:] = np.asarray(s.routed_experts, np.int64)[:n].reshape(n, width)
        keys.append(key)
    return keys


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Rows two key arrays (``_sharing_keys``) share from the start."""
    m = min(a.shape[0], b.shape[0])
    same = np.all(a[:m] == b[:m], axis=1)
    return m if bool(same.all()) else int(np.argmin(same))


def prefix_tree_units(lengths: np.ndarray, lcp: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Cuts samples in depth-first (sorted) order into trees of at most ``capacity`` tokens each.

    ``lengths[i]`` is sample ``i``'s length and ``lcp[i]`` the tokens it shares with sample ``i - 1``
    (``lcp[0] = 0``; the samples sorted so that the tokens two samples share are ``min(lcp)`` over the
    samples between them, as for sorted strings). A set of samples laid out as one tree takes
    ``sum(lengths) - sum(lcp between consecutive members)`` tokens. A range that does not fit is split
    at its branch point (depth ``d = min(lcp)``): subtrees that fit are grouped first-fit-decreasing
    into trees of at most ``capacity`` tokens that each repeat the ``d`` shared tokens once, the others
    are split further; at ``d = 0`` (nothing shared) each subtree is a tree of its own. Every sample
    fits alone (``lengths <= capacity``), so this ends.

    Returns:
      the trees, each an ascending int64 array of sample indices.

    Three samples of 6 tokens sharing 4, and one of 3 sharing nothing: as one tree the three take
    ``4 + 3 * 2 = 10`` tokens; in rows of 9 they become trees of two and one:

    >>> prefix_tree_units(np.array([6, 6, 6, 3]), np.array([0, 4, 4, 0]), capacity=10)
    [array([0, 1, 2]), array([3])]
    >>> prefix_tree_units(np.array([6, 6, 6, 3]), np.array([0, 4, 4, 0]), capacity=9)
    [array([0, 1]), array([2]), array([3])]
    """
    lengths = np.asarray(lengths, np.int64)
    lcp = np.asarray(lcp, np.int64)
    n = lengths.shape[0]
    total = np.concatenate([[0], np.cumsum(lengths)])
    shared = np.concatenate([[0], np.cumsum(lcp)])

    def cost(a: int, b: int) -> int:  # tokens of samples [a, b) as one tree
        return int(total[b] - total[a] - (shared[b] - shared[a + 1]))

    units: list[np.ndarray] = []
    pending = [(0, n)] if n else []
    while pending:
        a, b = pending.pop()
        if cost(a, b) <= capacity:
            units.append(np.arange(a, b))
            continue
        inner = lcp[a + 1 : b]
        depth = int(inner.min())
        bounds = [a, *(a + 1 + np.flatnonzero(inner == depth)).tolist(), b]
        children = list(zip(bounds[:-1], bounds[1:], strict=True))
        if depth == 0:
            pending.extend(children)
            continue
        small = [c for c in children if cost(*c) <= capacity]
        pending.extend(c for c in children if cost(*c) > capacity)
        if small:
            bins, _, _, used = first_fit_decreasing([cost(*c) - depth for c in small], capacity - depth)
            for p in range(int(used)):
                units.append(
                    np.concatenate([np.arange(*small[i]) for i in np.flatnonzero(bins == p).tolist()])
                )
    return sorted(units, key=lambda u: int(u[0]))


def _next_smaller(values: np.ndarray) -> np.ndarray:
    """``out[i]`` = the first ``j > i`` with ``values[j] < values[i]`` (``len(values)`` if none)."""
    out = np.full(values.shape[0], values.shape[0], np.int64)
    stack: list[int] = []
    for j, v in enumerate(values.tolist()):
        while stack and values[stack[-1]] > v:
            out[stack.pop()] = j
        stack.append(j)
    return out


def _lay_out_tree(
    members: np.ndarray,
    lcp: np.ndarray,
    lengths: np.ndarray,
    row: int,
    start: int,
    seq_len: int,
    parents: np.ndarray,
    ends: np.ndarray,
) -> list[np.ndarray]:
    """Writes one tree (``members``: sample indices in depth-first order; ``lcp``: what each shares with the
    member before it, 0 for the first) in depth-first order from column ``start`` of ``row`` into the
    flat ``parents`` / ``ends``. Returns each member's token columns in the row (its whole path)."""
    depth_col = np.zeros(int(lengths[members].max()), np.int64)  # column of each depth on the path
    paths, firsts, last = [], np.zeros(members.shape[0], np.int64), np.zeros(members.shape[0], np.int64)
    base, col = row * seq_len, start
    for i, k in enumerate(members.tolist()):
        u, n = int(lcp[i]), int(lengths[k])
        depth_col[u:n] = np.arange(col, col + n - u)
        parents[base + col : base + col + n - u] = (
            depth_col[u - 1 : n - 1] if u else np.r_[-1, depth_col[: n - 1]]
        )
        paths.append(depth_col[:n].copy())
        firsts[i], last[i] = col, col + n - u - 1
        col += n - u
    # Subtree ends: member i's token at depth d is on the paths of members i..f-1, f the first later
    # member sharing fewer than d + 1 tokens; walk the members with a smaller lcp (next_smaller chain).
    nxt = _next_smaller(lcp)
    m = members.shape[0]
    for i, k in enumerate(members.tolist()):
        u, hi = int(lcp[i]), int(lengths[k])
        end = np.empty(hi - u, np.int64)
        x = i + 1
        while x < m:
            lo = max(int(lcp[x]), u)
            end[lo - u : hi - u] = last[x - 1]
            if lcp[x] <= u:
                break
            hi, x = int(lcp[x]), int(nxt[x])
        else:
            end[: hi - u] = last[m - 1]
        ends[base + firsts[i] : base + last[i] + 1] = end
    return paths


@dataclasses.dataclass(frozen=True)
class _TreePlacement:
    """Prefix-tree rows: the layout, each sample's segment id, the flat ``[num_rows * seq_len]``
    ``parents`` and ``subtree_end`` columns, the rows used before bucketing and the tokens laid out."""

    layout: PackLayout
    segments: np.ndarray
    parents: np.ndarray
    subtree_end: np.ndarray
    used_rows: int
    tokens: int


def _place_prefix_tree(
    steps: Sequence[Step],
    source: np.ndarray,
    prompt_lens: np.ndarray,
    lengths: np.ndarray,
    *,
    seq_len: int,
    row_buckets: Sequence[int] | None,
    data_parallel: int,
) -> _TreePlacement:
    """Prefix-tree placement (design §2.6): samples sorted by their shareable prefix (prompt tokens with
    their recorded routing, never a sample's last token), cut into trees of at most ``seq_len`` tokens
    (:func:`prefix_tree_units`), the trees placed FFD into rows and laid out depth-first; segments are
    numbered per row in column order. Trees bin-pack worse than their samples now and then (fewer but
    larger items); when plain packing needs fewer (bucketed) rows, every sample is laid out as a tree
    of its own, so sharing never costs rows and the batch keeps its tree fields (one program)."""
    n = len(steps)
    shareable = np.minimum(prompt_lens, lengths - 1)
    keys = _sharing_keys(steps, shareable)
    order = np.asarray(sorted(range(n), key=lambda k: (keys[k].tobytes(), k)), np.int64).reshape(n)
    lcp = np.zeros(n, np.int64)
    for i in range(1, n):
        lcp[i] = _common_prefix(keys[order[i - 1]], keys[order[i]])
    trees = []
    for unit in prefix_tree_units(lengths[order], lcp, seq_len):
        # what each member shares with the member before it: the min over the samples between them
        between = np.minimum.reduceat(lcp[: unit[-1] + 1], unit[:-1] + 1) if unit.shape[0] > 1 else []
        trees.append((order[unit], np.r_[0, between].astype(np.int64)))
    sizes = np.array([int(lengths[m].sum() - c.sum()) for m, c in trees], np.int64)
    tree_rows, tree_starts, _, used = first_fit_decreasing(sizes, seq_len)
    num_rows = bucket_rows(int(used), row_buckets=row_buckets, data_parallel=data_parallel)
    plain_rows = bucket_rows(
        int(first_fit_decreasing(lengths, seq_len)[3]), row_buckets=row_buckets, data_parallel=data_parallel
    )
    if plain_rows < num_rows:  # bigger trees can bin-pack worse: lay out every sample alone instead
        trees = [(order[i : i + 1], np.zeros(1, np.int64)) for i in range(n)]
        sizes = lengths[order]
        tree_rows, tree_starts, _, used = first_fit_decreasing(sizes, seq_len)
        num_rows = plain_rows
    parents = np.full(num_rows * seq_len, -1, np.int32)
    ends = np.zeros(num_rows * seq_len, np.int32)
    rows, starts, segments, shared = (np.zeros(n, np.int64) for _ in range(4))
    paths: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    count = np.zeros(num_rows, np.int64)
    for t in np.lexsort((tree_starts, tree_rows)).tolist():
        (members, member_lcp), r = trees[t], int(tree_rows[t])
        laid = _lay_out_tree(members, member_lcp, lengths, r, int(tree_starts[t]), seq_len, parents, ends)
        for k, path, u in zip(members.tolist(), laid, member_lcp.tolist(), strict=True):
            count[r] += 1
            rows[k], starts[k], segments[k], shared[k] = r, path[0], count[r], u
            paths[k] = path + r * seq_len
    layout = PackLayout(
        rows=rows,
        starts=starts,
        prompt_lens=prompt_lens,
        response_lens=lengths - prompt_lens,
        source_index=np.asarray(source, dtype=np.int64),
        seq_len=seq_len,
        num_rows=num_rows,
        shared_lens=shared,
        token_index=np.concatenate(paths) if n else np.zeros(0, np.int64),
    )
    return _TreePlacement(layout, segments, parents, ends, int(used), int(sizes.sum()))


def _kept_lengths(
    steps: Sequence[Step], source: np.ndarray, *, seq_len: int, truncate: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(prompt_lens, resp_lens, keep_lens, over)``: each sample's prompt and response length, the
    response tokens it keeps in rows of ``seq_len`` (all of them unless ``truncate`` cuts an
    over-long one) and the indices of the over-long samples. Raises ``ValueError`` naming the sample
    for an empty prompt, a ``loss_mask`` or ``response_logprobs`` of the wrong length, and an
    over-long sample (any, without ``truncate``; one whose prompt alone fills a row, with it)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a prompt token and a response token), got {seq_len}")
    n = len(steps)
    prompt_lens = np.fromiter((len(s.prompt_ids) for s in steps), dtype=np.int64, count=n)
    resp_lens = np.fromiter((len(s.response_ids) for s in steps), dtype=np.int64, count=n)
    if n and prompt_lens.min() == 0:
        k = int(np.argmin(prompt_lens))
        raise ValueError(
            f"{_where(steps, source, k)} has an empty prompt: its first token could not be predicted; "
            "every sample needs at least one prompt token (e.g. BOS)"
        )
    # Cheap consistency checks (a StepBatch is validated already; plain Step lists may not be).
    mask_lens = np.fromiter((len(s.loss_mask) for s in steps), dtype=np.int64, count=n)
    lp_lens = np.fromiter(
        (len(r) if (r := s.response_logprobs) is not None else len(s.response_ids) for s in steps),
        dtype=np.int64,
        count=n,
    )
    for field, lens in (("loss_mask", mask_lens), ("response_logprobs", lp_lens)):
        bad = np.flatnonzero(lens != resp_lens)
        if bad.size:
            k = int(bad[0])
            raise ValueError(
                f"{_where(steps, source, k)}: {field} has {int(lens[k])} entries but response_ids has "
                f"{int(resp_lens[k])}; they must match (build a StepBatch to validate samples)"
            )
    over = np.flatnonzero(prompt_lens + resp_lens > seq_len)
    keep_lens = resp_lens
    if over.size:
        k = int(over[0])
        if not truncate:
            raise ValueError(
                f"{_where(steps, source, k)} has {int(prompt_lens[k] + resp_lens[k])} tokens (prompt "
                f"{int(prompt_lens[k])} + response {int(resp_lens[k])}) > seq_len={seq_len}; raise "
                "seq_len or pass truncate=True to drop the tail of over-long responses"
            )
        long_prompt = np.flatnonzero(prompt_lens[over] >= seq_len)
        if long_prompt.size:
            k = int(over[long_prompt[0]])
            raise ValueError(
                f"{_where(steps, source, k)} has a {int(prompt_lens[k])}-token prompt >= seq_len={seq_len}: "
                "truncation keeps the prompt whole and no response token would remain; raise seq_len"
            )
        keep_lens = np.minimum(resp_lens, seq_len - prompt_lens)
    return prompt_lens, resp_lens, keep_lens, over


def _flat_host_streams(
    steps: Sequence[Step], prompt_lens: np.ndarray, resp_lens: np.ndarray, keep_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The samples' kept tokens (prompt and response, sample after sample) and their responses' loss
    mask, sampler logprobs (0 where a step has none) and weight versions as flat arrays, one C-level
    pass per stream (no per-token Python code); and the number of steps without logprobs."""
    token_parts: list[Any] = []
    mask_parts: list[Any] = []
    logprob_parts: list[Any] = []
    version_parts: list[Any] = []
    without_logprobs = 0
    for k, s in enumerate(steps):
        keep = int(keep_lens[k])
        cut = keep < resp_lens[k]
        if s.response_versions is None:
            version_parts.append(itertools.repeat(int(s.policy_version), keep))
        else:
            version_parts.append(s.response_versions[:keep] if cut else s.response_versions)
        token_parts.append(s.prompt_ids)
        token_parts.append(s.response_ids[:keep] if cut else s.response_ids)
        mask_parts.append(s.loss_mask[:keep] if cut else s.loss_mask)
        if s.response_logprobs is None:
            without_logprobs += 1
            logprob_parts.append(itertools.repeat(0.0, keep))
        else:
            logprob_parts.append(s.response_logprobs[:keep] if cut else s.response_logprobs)
    total = int(prompt_lens.sum() + keep_lens.sum())
    n_resp = int(keep_lens.sum())
    flat_tokens = np.fromiter(itertools.chain.from_iterable(token_parts), dtype=np.int32, count=total)
    loss_mask = np.fromiter(itertools.chain.from_iterable(mask_parts), dtype=np.float32, count=n_resp)
    inference_lp = np.fromiter(itertools.chain.from_iterable(logprob_parts), dtype=np.float32, count=n_resp)
    versions = np.fromiter(itertools.chain.from_iterable(version_parts), dtype=np.int32, count=n_resp)
    return flat_tokens, loss_mask, inference_lp, versions, without_logprobs


def _place_samples(
    steps: Sequence[Step],
    source: np.ndarray,
    prompt_lens: np.ndarray,
    keep_lens: np.ndarray,
    *,
    seq_len: int,
    row_buckets: Sequence[int] | None,
    data_parallel: int,
    prefix_sharing: bool,
) -> tuple[PackLayout, _TreePlacement | None, np.ndarray, int]:
    """Where each sample goes: ``(layout, tree, segments, used_rows)``, as prefix trees (``tree``
    holds their parents and subtree ends) or plain rows filled first-fit decreasing (``tree`` None),
    the rows bucketed."""
    lengths = prompt_lens + keep_lens
    if prefix_sharing:
        tree = _place_prefix_tree(
            steps, source, prompt_lens, lengths, seq_len=seq_len, row_buckets=row_buckets,
            data_parallel=data_parallel,
        )  # fmt: skip
        return tree.layout, tree, tree.segments, tree.used_rows
    rows, starts, segs, used = first_fit_decreasing(lengths, seq_len)
    layout = PackLayout(
        rows=rows,
        starts=starts,
        prompt_lens=prompt_lens,
        response_lens=keep_lens,
        source_index=np.asarray(source, dtype=np.int64),
        seq_len=seq_len,
        num_rows=bucket_rows(int(used), row_buckets=row_buckets, data_parallel=data_parallel),
    )
    return layout, None, segs, used


def _pack_steps(
    steps: Sequence[Step],
    source: np.ndarray,
    *,
    seq_len: int,
    streams: Mapping[str, PerStep],
    row_buckets: Sequence[int] | None,
    data_parallel: int,
    truncate: bool,
    prefix_sharing: bool = False,
) -> PackResult:
    n = len(steps)
    prompt_lens, resp_lens, keep_lens, over = _kept_lengths(steps, source, seq_len=seq_len, truncate=truncate)
    lengths = prompt_lens + keep_lens

    layout, tree, segs, used = _place_samples(
        steps, source, prompt_lens, keep_lens, seq_len=seq_len, row_buckets=row_buckets,
        data_parallel=data_parallel, prefix_sharing=prefix_sharing,
    )  # fmt: skip
    num_rows = layout.num_rows
    dest, rel, is_response = layout.flat_index()
    resp_dest = dest[is_response]
    # Each column is written once, by the sample that owns it (every token of plain rows).
    own = slice(None) if tree is None else layout.owned()
    own_dest = dest[own]

    flat_tokens, loss_mask, inference_lp, versions, without_logprobs = _flat_host_streams(
        steps, prompt_lens, resp_lens, keep_lens
    )
    total = int(lengths.sum())

    group, group_keys = _group_index(steps)
    temps = np.fromiter((s.temperature for s in steps), dtype=np.float32, count=n)

    size = num_rows * seq_len

    def scatter(values: np.ndarray, where: np.ndarray, dtype: Any, fill: float = 0) -> np.ndarray:
        out = np.full(size, fill, dtype=dtype) if fill else np.zeros(size, dtype=dtype)
        out[where] = values
        return out.reshape(num_rows, seq_len)

    optional = {k: v for k, v in OPTIONAL_STREAMS.items() if streams.get(k) is not None}
    defaults = {**STREAM_DEFAULTS, **optional}
    streams = {
        name: _response_stream(name, streams.get(name), steps, source, resp_lens, keep_lens, default)
        for name, default in defaults.items()
    }

    def per_sample(values: np.ndarray) -> np.ndarray:  # one value per sample -> its owned tokens
        return np.repeat(values, lengths)[own]

    batch = PackedBatch(
        tokens=scatter(flat_tokens[own], own_dest, np.int32),
        positions=scatter(rel[own], own_dest, np.int32),
        segment_ids=scatter(per_sample(segs), own_dest, np.int32),
        sample_index=scatter(per_sample(np.arange(n)), own_dest, np.int32),
        group_index=scatter(per_sample(group), own_dest, np.int32),
        loss_mask=scatter(loss_mask, resp_dest, np.float32),
        inference_logprobs=scatter(inference_lp, resp_dest, np.float32),
        old_logprobs=scatter(inference_lp, resp_dest, np.float32),
        temperatures=scatter(per_sample(temps), own_dest, np.float32, fill=1.0),
        **{name: scatter(v, resp_dest, np.float32) for name, v in streams.items()},
        routed_experts=_routed_experts(steps, lengths, dest, size, num_rows, seq_len),
        token_versions=scatter(versions, resp_dest, np.int32),
        support_floors=_support_floors(steps, keep_lens, resp_dest, scatter),
        parents=None if tree is None else tree.parents.reshape(num_rows, seq_len),
        subtree_end=None if tree is None else tree.subtree_end.reshape(num_rows, seq_len),
    )
    metrics = {
        "num_samples": n,
        "num_groups": len(group_keys),
        **_layout_metrics(num_rows, int(used), seq_len, total, total if tree is None else tree.tokens),
        "trainable_tokens": int(loss_mask.sum()),
        "truncated_samples": int(over.size) if truncate else 0,
        "truncated_tokens": int((resp_lens - keep_lens).sum()),
        "samples_without_logprobs": without_logprobs,
    }
    return PackResult(batch=batch, layout=layout, metrics=metrics, group_keys=tuple(group_keys))


def _group_index(steps: Sequence[Step]) -> tuple[np.ndarray, dict[str, int]]:
    """Each step's prompt group (``trajectory_id.instance_id``) numbered in order of first appearance
    (int64 ``[len(steps)]``), and that numbering."""
    keys: dict[str, int] = {}
    index = np.fromiter(
        (keys.setdefault(s.trajectory_id.instance_id, len(keys)) for s in steps), np.int64, count=len(steps)
    )
    return index, keys


def _layout_metrics(num_rows: int, used: int, seq_len: int, total: int, laid: int) -> dict[str, Any]:
    """How full the rows are: ``total`` tokens of the samples, ``laid`` of them in the rows (fewer
    when prefix trees share prefixes) in ``num_rows`` rows of ``seq_len``, ``used`` holding any."""
    size = num_rows * seq_len
    return {
        "num_rows": num_rows,
        "used_rows": used,
        "padding_rows": num_rows - used,
        "seq_len": seq_len,
        "sample_tokens": total,
        "real_tokens": laid,
        "shared_prefix_tokens": total - laid,
        "capacity_tokens": size,
        "packing_efficiency": laid / size,
    }


def _support_floors(
    steps: Sequence[Step], keep_lens: np.ndarray, resp_dest: np.ndarray, scatter: Callable[..., np.ndarray]
) -> np.ndarray | None:
    """The top-k / top-p support floors of the response tokens (``-inf`` elsewhere and for steps drawn
    from the whole distribution); None when no step has any (the trainer then needs no mask)."""
    if all(s.response_support_floors is None for s in steps):
        return None
    parts = (
        itertools.repeat(-np.inf, int(k))
        if s.response_support_floors is None
        else s.response_support_floors[: int(k)]
        for s, k in zip(steps, keep_lens, strict=True)
    )
    flat = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.float32, count=int(keep_lens.sum()))
    return scatter(flat, resp_dest, np.float32, fill=-np.inf)


def pack(
    samples: StepBatch | Sequence[Step],
    *,
    seq_len: int,
    row_buckets: Sequence[int] | None = None,
    data_parallel: int = 1,
    truncate: bool = False,
    prefix_sharing: bool = False,
    **streams: PerStep,
) -> PackResult:
    """Packs samples FFD into a :class:`~rljax.types.PackedBatch` of shape ``[rows, seq_len]``.

    Args:
      samples: steps (merged or not); sample ``k`` is ``prompt_ids ++ response_ids`` of step k.
      seq_len: row length.
      row_buckets: allowed row counts (default powers of two times ``data_parallel``).
      data_parallel: the row count is a multiple of it; padding rows are fully masked.
      truncate: drop the tail of over-long responses instead of raising ``ValueError``.
      prefix_sharing: pack samples that share a prompt prefix as prefix trees (design §2.6): each
        shared token once, the batch's ``parents`` / ``subtree_end`` set (see the module docstring).
      **streams: per-step streams of :data:`STREAM_DEFAULTS` (``advantages, ref_logprobs,
        rl_weights, ce_weights, ref_kl_weights``) aligned to each step's response tokens: None
        (defaults 0, 0, 1, 0, 0), a scalar for all steps, or one entry per step, each a scalar or
        an array of ``len(response_ids)`` values.

    Zero samples give the smallest bucket of fully masked padding rows (a valid, all-masked batch).

    Returns:
      A :class:`PackResult` (``batch``, ``layout`` for :func:`unpack`, ``metrics``: rows,
      ``packing_efficiency`` = real tokens / (rows * seq_len), truncation counts, ...).

    >>> from rljax.types import Step
    >>> r = pack([Step([1, 2], [3, 4], ("q", 0)), Step([5], [6], ("q", 1))], seq_len=8,
    ...          advantages=[[0.5, 0.5], [-1.0]])
    >>> r.batch.shape, r.batch.tokens.tolist(), r.batch.segment_ids.tolist()
    ((1, 8), [[1, 2, 3, 4, 5, 6, 0, 0]], [[1, 1, 1, 1, 2, 2, 0, 0]])
    >>> r.batch.positions.tolist(), r.batch.advantages.tolist()
    ([[0, 1, 2, 3, 0, 1, 0, 0]], [[0.0, 0.0, 0.5, 0.5, 0.0, -1.0, 0.0, 0.0]])
    """
    steps = samples.steps if isinstance(samples, StepBatch) else tuple(samples)
    return _pack_steps(
        steps,
        np.arange(len(steps)),
        seq_len=seq_len,
        streams=check_streams(streams),
        row_buckets=row_buckets,
        data_parallel=data_parallel,
        truncate=truncate,
        prefix_sharing=prefix_sharing,
    )


def with_token_staleness(batch: PackedBatch, trained_version: int) -> PackedBatch:
    """``batch`` with ``token_staleness = trained_version - token_versions`` on trainable tokens (loss
    mask 1; 0 elsewhere): how many versions the weights that sampled each token are behind the weights
    being trained. Raises when a trainable token is newer than ``trained_version``.

    >>> from rljax.types import Step
    >>> b = pack([Step([1], [2, 3], ("q", 0), policy_version=4, response_versions=[4, 5])], seq_len=4).batch
    >>> b.token_versions.tolist(), with_token_staleness(b, 6).token_staleness.tolist()
    ([[0, 4, 5, 0]], [[0, 2, 1, 0]])
    """
    if batch.token_versions is None:
        raise ValueError("the batch has no token_versions; build it with rljax.data.pack.pack")
    versions = np.asarray(batch.token_versions, np.int64)
    on = np.asarray(batch.loss_mask) != 0
    staleness = np.where(on, int(trained_version) - versions, 0)
    if np.any(staleness < 0):
        raise ValueError(
            f"a trainable token was sampled with version {int(versions[on].max())}, newer than the "
            f"trained version {trained_version}; pass the version of the weights being trained"
        )
    return batch.replace(token_staleness=staleness.astype(np.int32))


def unpack_responses(array: Any, layout: PackLayout) -> list[np.ndarray]:
    """Cuts a ``[rows, seq_len]`` per-token array back into per-sample response arrays.

    Use it to bring values computed on a packed batch (e.g. recomputed logprobs) back to the
    samples, aligned with each sample's (kept) response tokens, in input order.

    >>> from rljax.types import Step
    >>> r = pack([Step([1, 2], [3, 4], ("q", 0)), Step([5], [6], ("q", 1))], seq_len=8)
    >>> [a.tolist() for a in unpack_responses(r.batch.tokens, r.layout)]
    [[3, 4], [6]]
    """
    flat = np.asarray(array).reshape(-1)
    if flat.shape[0] != layout.num_rows * layout.seq_len:
        raise ValueError(
            f"array has shape {np.shape(array)} but the layout is [{layout.num_rows}, {layout.seq_len}]"
        )
    dest, _, is_response = layout.flat_index()
    values = flat[dest[is_response]]
    return np.split(values, np.cumsum(layout.response_lens)[:-1]) if layout.num_samples else []


def unpack(packed: PackedBatch, layout: PackLayout) -> list[dict[str, Any]]:
    """Restores every sample (tokens and every stream) from a packed batch, in input order.

    Each dict has ``prompt_ids``, ``response_ids``, ``positions`` (whole sample), the response
    part of every response stream (``loss_mask``, ``advantages``, ``inference_logprobs``,
    ``old_logprobs``, ``ref_logprobs``, ``rl_weights``, ``ce_weights``, ``ref_kl_weights``, and
    ``token_versions`` / ``token_rewards`` / ``support_floors`` when the batch has them), and the
    per-sample scalars
    ``temperature``, ``segment_id``, ``sample_index``, ``group_index``, ``row`` and ``source_index``.
    Prefix-tree rows give each sample its whole sequence too (its shared prefix read where it was laid
    out once); the per-sample scalars are read at the sample's last token, which it always owns.

    >>> from rljax.types import Step
    >>> r = pack([Step([1, 2], [3, 4], ("q", 0), loss_mask=[1, 0])], seq_len=4)
    >>> s = unpack(r.batch, r.layout)[0]
    >>> s["prompt_ids"].tolist(), s["response_ids"].tolist(), s["loss_mask"].tolist()
    ([1, 2], [3, 4], [1.0, 0.0])
    """
    dest, _, _ = layout.flat_index()
    optional = tuple(
        n for n in (*OPTIONAL_STREAMS, "token_versions", "support_floors") if getattr(packed, n) is not None
    )
    response_streams = _RESPONSE_STREAMS + optional
    gathered = {
        name: np.asarray(getattr(packed, name)).reshape(-1)[dest]
        for name in ("tokens", "positions", "segment_ids", "sample_index", "group_index", "temperatures")
        + response_streams
    }
    lengths = layout.lengths
    offsets = np.cumsum(lengths) - lengths
    out = []
    for k in range(layout.num_samples):
        lo, mid, hi = int(offsets[k]), int(offsets[k] + layout.prompt_lens[k]), int(offsets[k] + lengths[k])
        last = hi - 1  # owned by the sample in prefix-tree rows too
        sample: dict[str, Any] = {
            "prompt_ids": gathered["tokens"][lo:mid],
            "response_ids": gathered["tokens"][mid:hi],
            "positions": gathered["positions"][lo:hi],
            "temperature": float(gathered["temperatures"][last]),
            "segment_id": int(gathered["segment_ids"][last]),
            "sample_index": int(gathered["sample_index"][last]),
            "group_index": int(gathered["group_index"][last]),
            "row": int(layout.rows[k]),
            "source_index": int(layout.source_index[k]),
        }
        for name in response_streams:
            sample[name] = gathered[name][mid:hi]
        out.append(sample)
    return out


# --------------------------------------------------------------------------------------
# Mini-batches
# --------------------------------------------------------------------------------------


def _select(name: str, value: PerStep, idx: np.ndarray, n: int) -> PerStep:
    if value is None or _is_scalar(value):
        return value
    if len(value) != n:
        raise ValueError(
            f"{name} has {len(value)} entries but the batch has {n} steps; pass one entry per step, in order"
        )
    return [value[i] for i in idx.tolist()]


def _balanced_assignment(group_tokens: np.ndarray, num_batches: int, per_batch: int) -> list[list[int]]:
    """Greedy balanced partition: groups (largest first) go to the lightest non-full mini-batch."""
    load = np.zeros(num_batches, dtype=np.int64)
    size = np.zeros(num_batches, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(num_batches)]
    for g in np.argsort(-group_tokens, kind="stable").tolist():
        open_ = np.flatnonzero(size < per_batch)
        b = int(open_[np.argmin(load[open_])])
        out[b].append(g)
        load[b] += group_tokens[g]
        size[b] += 1
    return [sorted(o) for o in out]


def _assign_groups(
    steps: Sequence[Step],
    group: np.ndarray,
    num_groups: int,
    mini_batch_prompts: int,
    *,
    balance_tokens: bool,
    shuffle_seed: int | None,
) -> list[list[int]]:
    """The prompt groups of each mini-batch (see :func:`make_mini_batches`): in order of first
    appearance or shuffled, or balanced by tokens."""
    num_batches = num_groups // mini_batch_prompts
    if balance_tokens:
        tokens = np.fromiter(
            (len(s.prompt_ids) + len(s.response_ids) for s in steps), np.int64, count=len(steps)
        )
        assignment = _balanced_assignment(
            np.bincount(group, weights=tokens, minlength=num_groups).astype(np.int64),
            num_batches,
            mini_batch_prompts,
        )
        if shuffle_seed is not None:
            assignment = [assignment[b] for b in np.random.default_rng(shuffle_seed).permutation(num_batches)]
        return assignment
    order = np.arange(num_groups)
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(num_groups)
    return [order[b * mini_batch_prompts : (b + 1) * mini_batch_prompts].tolist() for b in range(num_batches)]


def make_mini_batches(
    batch: StepBatch | Sequence[Step],
    *,
    mini_batch_prompts: int,
    seq_len: int,
    row_buckets: Sequence[int] | None = None,
    data_parallel: int = 1,
    truncate: bool = False,
    shuffle_seed: int | None = None,
    balance_tokens: bool = False,
    prefix_sharing: bool = False,
    **streams: PerStep,
) -> Iterator[PackResult]:
    """Splits a batch into packed mini-batches of exactly ``mini_batch_prompts`` prompt groups.

    A prompt group is every step sharing ``trajectory_id.instance_id``; a mini-batch holds
    whole groups however many steps they produced, so the number of optimizer steps per batch
    is ``num_prompts / mini_batch_prompts`` (SkyRL PR #1529). Groups are taken in order of
    first appearance, or shuffled with ``shuffle_seed``; ``balance_tokens=True`` instead
    assigns groups (largest first) to the mini-batch with the fewest tokens so far, which
    evens out row counts (fewer shapes, less padding). Streams and packing options (``prefix_sharing``
    too) are those of :func:`pack` (per-step streams index the whole batch). Each result's
    ``layout.source_index`` holds batch step indices; metrics add ``num_prompts``,
    ``mini_batch`` and ``num_mini_batches``. Raises ``ValueError`` (eagerly) when the number of
    prompts is not a multiple of ``mini_batch_prompts``.

    >>> from rljax.types import Step
    >>> steps = [Step([1], [2], (q, r)) for q in "abcd" for r in range(2)]
    >>> mbs = list(make_mini_batches(steps, mini_batch_prompts=2, seq_len=8))
    >>> [m.group_keys for m in mbs], [m.batch.shape for m in mbs]
    ([('a', 'b'), ('c', 'd')], [(1, 8), (1, 8)])
    """
    steps = batch.steps if isinstance(batch, StepBatch) else tuple(batch)
    n = len(steps)
    if mini_batch_prompts < 1:
        raise ValueError(f"mini_batch_prompts must be >= 1, got {mini_batch_prompts}")
    group, group_of = _group_index(steps)
    num_groups = len(group_of)
    if num_groups % mini_batch_prompts:
        raise ValueError(
            f"the batch has {num_groups} prompt groups, not a multiple of mini_batch_prompts="
            f"{mini_batch_prompts}; choose mini_batch_prompts dividing the number of prompts per batch"
        )
    num_batches = num_groups // mini_batch_prompts
    streams = check_streams(streams)
    for name, value in streams.items():
        _select(name, value, np.arange(0), n)  # length check up front
    assignment = _assign_groups(
        steps, group, num_groups, mini_batch_prompts, balance_tokens=balance_tokens, shuffle_seed=shuffle_seed
    )

    def generate() -> Iterator[PackResult]:
        in_batch = np.empty(num_groups, dtype=np.int64)
        for b, groups in enumerate(assignment):
            in_batch[:] = -1
            in_batch[groups] = b
            idx = np.flatnonzero(in_batch[group] == b)
            result = _pack_steps(
                [steps[i] for i in idx.tolist()],
                idx,
                seq_len=seq_len,
                row_buckets=row_buckets,
                data_parallel=data_parallel,
                truncate=truncate,
                streams={name: _select(name, value, idx, n) for name, value in streams.items()},
                prefix_sharing=prefix_sharing,
            )
            result.metrics.update(num_prompts=len(groups), mini_batch=b, num_mini_batches=num_batches)
            yield result

    return generate()
