"""Credit across samples: where each turn of a trajectory sits in packed rows, and the links that
let GAE run along a trajectory's turns in time order (design §2.4, §3.6).

A trajectory's turns can end up in several samples (merging off, a prompt that does not extend
the previous turn: re-rendering, stripped thinking, a context reset, sub-agents) and those samples
in different rows. :func:`rljax.core.advantages.gae` restarts at every sample, so an earlier sample
would see none of the later turns' rewards. :func:`turn_links` gives it, for one packed mini-batch,
one link per pair of consecutive turns (with trained tokens) of each trajectory: the flat position
of the earlier turn's last kept trained token and of the later turn's first one. With the links,
GAE bootstraps each turn from the next one (``V`` and ``A`` at its first trained token), exactly as
inside one merged sample, so the returns do not depend on merging or packing.

>>> from rljax.data.pack import pack
>>> from rljax.types import Step
>>> steps = [Step([1], [2, 3], ("q", 0), is_last_step=False), Step([9], [4], ("q", 0), reward=1.0)]
>>> r = pack(steps, seq_len=4)
>>> r.batch.tokens.tolist()
[[1, 2, 3, 0], [9, 4, 0, 0]]
>>> turn_links(steps, turn_spans(steps), r.layout)[:2].tolist()  # token 3 -> token 4 (row 1); then -1
[[2, 5], [-1, -1]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rljax.data.merge import MergePlan
from rljax.data.pack import PackLayout
from rljax.data.step_advantages import bucket_size
from rljax.types import Step

__all__ = ["TurnSpans", "turn_links", "turn_spans"]

#: Per sample, ``(input step index, start, end)`` of each of its turns' responses within the sample's
#: response, in turn order (one turn per sample without merging).
TurnSpans = tuple[tuple[tuple[int, int, int], ...], ...]


def turn_spans(steps: Sequence[Step], plan: MergePlan | None = None) -> TurnSpans:
    """Where each input step's response lies in the samples: the steps themselves (``plan`` None)
    or the merged samples of ``plan`` (a turn's response follows its gap tokens).

    >>> from rljax.data.merge import plan_merge
    >>> steps = [Step([1], [2], ("q", 0), is_last_step=False), Step([1, 2, 5], [6, 7], ("q", 0))]
    >>> turn_spans(steps), turn_spans(steps, plan_merge(steps))
    ((((0, 0, 1),), ((1, 0, 2),)), (((0, 0, 1), (1, 2, 4)),))
    """
    if plan is None:
        return tuple(((i, 0, len(s.response_ids)),) for i, s in enumerate(steps))
    out = []
    for idx, gaps in zip(plan.samples, plan.gaps, strict=True):
        pos, spans = 0, []
        for i, gap in zip(idx, gaps, strict=True):
            pos += gap
            n = len(steps[i].response_ids)
            spans.append((i, pos, pos + n))
            pos += n
        out.append(tuple(spans))
    return tuple(out)


def turn_links(samples: Sequence[Step], spans: TurnSpans, layout: PackLayout) -> np.ndarray:
    """int32 ``[K, 2]`` links ``(src, dst)`` of one packed batch for
    :func:`rljax.core.advantages.gae`: for each pair of consecutive turns of a trajectory that have
    kept trained tokens, the flat index (``row * seq_len + column``) of the earlier turn's last one
    and of the later turn's first one. Turns whose trained tokens were all truncated away or masked
    are skipped (they are not time steps). Rows past the links are -1; ``K`` is a power of two
    (at least 8) so the jitted GAE compiles for few shapes.

    ``samples`` and ``spans`` describe every prepared sample (:func:`turn_spans`);
    ``layout.source_index`` says which of them the packed batch holds. Turn order within a
    trajectory is input step order (design §2.2).
    """
    pieces: dict[object, list[tuple[int, int, int]]] = {}
    responses = layout.response_starts()
    for k, source in enumerate(layout.source_index.tolist()):
        sample = samples[source]
        kept = int(layout.response_lens[k])
        trained = np.asarray(sample.loss_mask[:kept]) != 0
        base = int(responses[k])  # its response tokens follow each other (prefix-tree rows too)
        for step, lo, hi in spans[source]:
            on = np.flatnonzero(trained[lo:hi])
            if on.size:
                pieces.setdefault(sample.trajectory_id, []).append(
                    (step, base + lo + int(on[0]), base + lo + int(on[-1]))
                )
    links = []
    for turns in pieces.values():
        turns.sort()
        links += [(a[2], b[1]) for a, b in zip(turns, turns[1:], strict=False)]
    out = np.full((bucket_size(len(links)), 2), -1, np.int32)
    if links:
        out[: len(links)] = links
    return out
