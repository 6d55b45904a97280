"""Demonstration-conditioned sequences for on-policy self-distillation (opsd, design §3.3, §3.6).

In opsd the policy samples a response ``r`` to a prompt ``p`` as usual; the *teacher* is the
same live policy shown the task's demonstration. Each sample is scored on the conditioned
sequence

    c = p[:k] ++ d ++ p[k:] ++ r,        start = len(p) + len(d)

where ``d`` is a system turn carrying the demonstration and ``k`` the position the format allows
(``Renderer.demonstration_hint``: 0 for ChatML / Qwen, 1 after Llama 3's BOS). With
``s[t] = log p(c[t] | c[:t])`` (``rljax.inference.scoring.score_sequences``), the teacher's log-probability of
response token ``j`` is ``s[start + j]``: slicing ``s[start : start + len(r)]`` gives one
``ref_logprobs`` value per response token, aligned with the sample's own logprobs for the
``ref_kl`` component (design §3.3). With an empty ``d`` the conditioned sequence is the sample
itself, so the slice is the plain prefill's response logprobs.

Reference: Zhao et al. 2026, "Self-Distilled Reasoner: On-Policy Self-Distillation for Large
Language Models" (the policy conditioned on privileged information as its own teacher).

Host code only (plain Python / numpy): the log-probabilities come from the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rljax.chat.base import DemonstrationHint

__all__ = ["condition_on_demonstration", "slice_response"]


def condition_on_demonstration(
    prompt_ids: Sequence[int], response_ids: Sequence[int], hint: DemonstrationHint
) -> tuple[list[int], int]:
    """The demonstration-conditioned sequence of a sample and where its response starts in it.

    ``ids = prompt[:k] ++ hint.ids ++ prompt[k:] ++ response`` with ``k = hint.insert_at``;
    ``start = len(prompt) + len(hint.ids)``, so ``ids[start:] == response``.

    Args:
      prompt_ids: the sample's prompt ids (what it was sampled from).
      response_ids: the sampled response ids.
      hint: a :class:`rljax.chat.base.DemonstrationHint` of the prompt's chat format
        (``renderer.demonstration_hint(task.demonstration)``).

    Returns:
      ``(ids, start)``.

    Raises:
      ValueError: ``insert_at`` is beyond the prompt, or the prompt does not start with the
        hint's ``prefix`` (e.g. a Llama 3 prompt without ``<|begin_of_text|>``).

    >>> from rljax.chat.base import DemonstrationHint
    >>> condition_on_demonstration([0, 5, 6], [7, 8], DemonstrationHint(1, (90, 91), prefix=(0,)))
    ([0, 90, 91, 5, 6, 7, 8], 5)
    >>> condition_on_demonstration([5, 6], [7], DemonstrationHint(0, ()))
    ([5, 6, 7], 2)
    """
    prompt = [int(i) for i in prompt_ids]
    response = [int(i) for i in response_ids]
    insert_at, ids, prefix = int(hint.insert_at), list(hint.ids), tuple(hint.prefix)
    if not ids:
        return prompt + response, len(prompt)
    if insert_at > len(prompt):
        raise ValueError(
            f"the demonstration goes after the first {insert_at} prompt tokens but the prompt has "
            f"{len(prompt)}; render the prompt with the renderer that built the hint"
        )
    if prefix and tuple(prompt[:insert_at]) != prefix:
        raise ValueError(
            f"the prompt starts with {prompt[:insert_at]} but the demonstration hint expects {list(prefix)} "
            "(the format's preamble, e.g. BOS); the prompt and the hint come from different chat formats"
        )
    return prompt[:insert_at] + ids + prompt[insert_at:] + response, len(prompt) + len(ids)


def slice_response(scores: Any, start: int, n: int) -> np.ndarray:
    """``scores[start : start + n]``: the per-token scores of a response inside a longer sequence.

    ``scores`` is one sequence's per-token array (``out[t] = log p(ids[t] | ids[:t])``) and
    ``start`` the index of the response's first token, as returned by
    :func:`condition_on_demonstration`; the result has one entry per response token.

    Raises:
      ValueError: ``scores`` is not 1-D, or ``[start, start + n)`` is not inside it.

    >>> slice_response(np.array([0.0, -1.0, -2.0, -3.0]), 2, 2).tolist()
    [-2.0, -3.0]
    """
    scores = np.asarray(scores)
    if scores.ndim != 1:
        raise ValueError(f"scores must be one sequence's 1-D array, got shape {scores.shape}")
    start, n = int(start), int(n)
    if start < 0 or n < 0 or start + n > scores.shape[0]:
        raise ValueError(
            f"response slice [{start}, {start + n}) is outside the {scores.shape[0]} scores; score the whole "
            "conditioned sequence (prompt + demonstration + response) and pass its response start"
        )
    return scores[start : start + n].copy()
