"""Prefix-aware merging of multi-turn steps into fewer training samples (design §2.5).

A multi-turn agent emits one :class:`~rljax.types.Step` per LLM turn, and the prompt of
turn ``i`` usually repeats every token of turns ``< i``. Training each step as its own
sample costs ``O(T^2)`` tokens for ``T`` turns. Merging folds turn ``i`` into an earlier
sample when that sample's full sequence ``f = prompt + response`` is an exact prefix of
``prompt_ids[i]``::

    response  <- response ++ prompt_ids[i][len(f):] ++ response_ids[i]
    loss_mask <- loss_mask ++ [0] * gap ++ loss_mask[i]            (gap = len(prompt_ids[i]) - len(f))
    logprobs  <- logprobs ++ [0.0] * gap ++ logprobs[i]
    rewards   <- rewards ++ [0] * gap ++ rewards[i]                 (per-token rewards)

so a linear trajectory trains ``O(T)`` tokens, and the model sees exactly the same
context for every trainable token. Earlier samples of a trajectory stay open: a turn
extends the open sample with the LONGEST matching prefix (prime-rl's rule; it handles
interleaved sub-agents and context resets). Anything that is not an exact prefix starts
a new sample (graceful fallback); a turn whose prompt is shorter than the running
sequence never merges.

Decisions (beyond design §2.5):

* Scalar rewards: a merged sample's reward is the reward of its last merged turn. The
  outcome-mode trajectory reward (design §2.3: the reward of the trajectory's last step) and
  hence every outcome-mode advantage of every trainable token are unchanged by merging.
  Per-token rewards are concatenated (gap tokens get 0), as in the reference case of design §2.5;
  their sum over the final sample then includes earlier turns' rewards, which is what a
  token-level estimator (reinforce_pp) expects. To use per-step rewards (design §2.4),
  compute advantages on the unmerged batch and carry them with
  :meth:`MergePlan.merge_arrays` (gap tokens get ``fill``).
* A turn merges only into an open sample with the same temperature, env, algorithm and
  presence of logprobs (a packed sample has one temperature, and logprobs cannot be
  invented). Among equally long matching prefixes the earliest-opened sample wins.
* ``policy_version`` of a merged sample is the OLDEST version among its turns (the
  conservative choice for staleness checks); when its turns carry different versions (or one turn
  was crossed by an in-flight weight update) ``response_versions`` keeps every token's version
  (gap tokens take the version of the turn whose prompt they come from; they are never trained).
  Other fields come from its first turn, except
  ``stop_reason`` (last merged turn) and ``is_last_step`` (holds the trajectory's final turn).
  ``prompt_roles`` is the first turn's, so it stays aligned with the merged sample's prompt;
  the roles of the gap tokens are the tails of the later turns' ``prompt_roles``
  (:func:`rljax.data.echo.response_roles`). Top-k / top-p support floors
  (``response_support_floors``) are kept when any turn has them: ``-inf`` (nothing cut) on gap
  tokens and on the tokens of turns drawn from the whole distribution.
* MoE routing (``routed_experts``, rows = positions): a merged sample's row for position p is
  the routing recorded by the FIRST of its turns that processed p (each later turn contributes the
  rows past what earlier turns covered). That is the routing the sampler's KV cache reflects under
  prefix caching; an engine that re-processes the prefix each turn (the embedded sampler) may route
  the prefix slightly differently in later turns. A sample gets routing only when all its turns
  carry it (else None: no replay for that sample).
* Output order: each merged sample takes the batch position of its last merged turn, so
  the sample holding a trajectory's final turn is the trajectory's last sample and the
  merged batch is again a valid :class:`~rljax.data.batch.StepBatch`.

References: SkyRL ``merge_stepwise_output`` and prime-rl's trajectory interleaving
(longest-prefix extension), see design §2.5.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rljax.data.batch import StepBatch
from rljax.types import Step, TrajectoryID

__all__ = ["MergePlan", "merge_metrics", "merge_steps", "plan_merge", "trained_tokens"]


def _as_list(x: Any) -> list:
    """Returns ``x`` as a Python list without copying lists (numpy via ``tolist``)."""
    if isinstance(x, list):
        return x
    if isinstance(x, np.ndarray):
        return x.tolist()
    return list(x)


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """How the steps of a batch fold into merged samples.

    Attributes:
      samples: one tuple of input step indices (turn order) per merged sample, in output order.
      gaps: for each merged sample, the number of gap (observation/template) tokens inserted
        before each of its turns' responses (0 for its first turn).
      num_steps: number of input steps.
    """

    samples: tuple[tuple[int, ...], ...]
    gaps: tuple[tuple[int, ...], ...]
    num_steps: int

    @property
    def num_samples(self) -> int:
        """The number of samples after merging."""
        return len(self.samples)

    def merge_arrays(self, arrays: Sequence[Any], *, fill: float = 0.0) -> list[np.ndarray]:
        """Merges one per-step, per-response-token array per input step like the responses.

        ``out[k] = a[s0] ++ [fill]*gap1 ++ a[s1] ++ ...`` for merged sample ``k`` made of
        steps ``s0, s1, ...``. Use it to carry advantages computed before merging.

        >>> plan = MergePlan(samples=((0, 1),), gaps=((0, 2),), num_steps=2)
        >>> plan.merge_arrays([[1.0], [3.0, 4.0]])[0].tolist()
        [1.0, 0.0, 0.0, 3.0, 4.0]
        """
        if len(arrays) != self.num_steps:
            raise ValueError(
                f"merge_arrays got {len(arrays)} arrays but the plan has {self.num_steps} steps; "
                "pass one per-token array per input step, in batch order"
            )
        out = []
        for idx, gaps in zip(self.samples, self.gaps, strict=True):
            parts = []
            for i, g in zip(idx, gaps, strict=True):
                a = np.asarray(arrays[i])
                if g:
                    parts.append(np.full((g,), fill, dtype=a.dtype))
                parts.append(a)
            out.append(np.concatenate(parts) if len(parts) > 1 else np.array(parts[0]))
        return out


@dataclasses.dataclass
class _OpenSample:
    full: list  # prompt + response so far
    sample: int  # index into the plan's sample list
    key: tuple  # compatibility key of the sample's turns


def _compat_key(step: Step) -> tuple:
    return (step.temperature, step.env, step.algorithm, step.response_logprobs is None)


def plan_merge(steps: Sequence[Step]) -> MergePlan:
    """Decides which steps merge into which samples (design §2.5), without building them.

    Turn ``i`` extends the open sample ``s`` of its trajectory with the longest full
    sequence ``f_s`` such that ``len(f_s) <= len(prompt_i)`` and
    ``prompt_i[:len(f_s)] == f_s`` (and the same temperature/env/algorithm/logprob
    presence); otherwise it opens a new sample. Steps of different trajectories may be
    interleaved; within a trajectory, list order is turn order.

    >>> from rljax.types import Step
    >>> s = [Step([1], [2], ("q", 0), is_last_step=False), Step([1, 2, 3], [4], ("q", 0))]
    >>> plan_merge(s).samples, plan_merge(s).gaps
    (((0, 1),), ((0, 1),))
    """
    open_by_traj: dict[TrajectoryID, list[_OpenSample]] = {}
    samples: list[list[int]] = []
    gaps: list[list[int]] = []
    for i, step in enumerate(steps):
        prompt = _as_list(step.prompt_ids)
        n = len(prompt)
        key = _compat_key(step)
        opened = open_by_traj.setdefault(step.trajectory_id, [])
        best: _OpenSample | None = None
        best_len = -1
        for cand in opened:
            m = len(cand.full)
            # Cheap checks first; the slice compare runs in C.
            if best_len < m <= n and cand.key == key and prompt[:m] == cand.full:
                best, best_len = cand, m
        full = prompt + _as_list(step.response_ids)
        if best is None:
            opened.append(_OpenSample(full=full, sample=len(samples), key=key))
            samples.append([i])
            gaps.append([0])
        else:
            samples[best.sample].append(i)
            gaps[best.sample].append(n - best_len)
            best.full = full
    order = sorted(range(len(samples)), key=lambda k: samples[k][-1])
    return MergePlan(
        samples=tuple(tuple(samples[k]) for k in order),
        gaps=tuple(tuple(gaps[k]) for k in order),
        num_steps=len(steps),
    )


def _build_sample(steps: Sequence[Step], idx: Sequence[int], gaps: Sequence[int]) -> Step:
    """Concatenates the turns ``idx`` (with ``gaps`` observation tokens) into one Step."""
    first = steps[idx[0]]
    if len(idx) == 1:
        return first
    last = steps[idx[-1]]
    response = list(_as_list(first.response_ids))
    mask = list(_as_list(first.loss_mask))
    has_lp = first.response_logprobs is not None
    logprobs = list(_as_list(first.response_logprobs)) if has_lp else None
    per_token = first.per_token_reward
    rewards = list(_as_list(first.reward)) if per_token else None
    # MoE routing: each position keeps the routing of the first turn that processed it (a later
    # turn's prefill re-processes the prefix; with prefix caching its KV is the first turn's)
    routed = all(steps[i].routed_experts is not None for i in idx)
    routing = [np.asarray(first.routed_experts)] if routed else None
    # per-token versions only when the merged turns do not all share one version
    multi_version = len({v for i in idx for v in _versions_of(steps[i])}) > 1
    versions = list(first.token_versions()) if multi_version else None
    # top-k / top-p support floors when any turn has them (-inf: drawn from the whole distribution)
    truncated = any(steps[i].response_support_floors is not None for i in idx)
    floors = _support_floors(first) if truncated else None
    covered = len(first.prompt_ids) + len(first.response_ids)
    for i, g in zip(idx[1:], gaps[1:], strict=True):
        s = steps[i]
        if routing is not None:
            full = len(s.prompt_ids) + len(s.response_ids)
            routing.append(np.asarray(s.routed_experts)[covered - 1 : full - 1])
            covered = full
        if versions is not None:
            versions.extend([int(s.policy_version)] * g)
            versions.extend(s.token_versions().tolist())
        if floors is not None:
            floors.extend([-math.inf] * g)
            floors.extend(_support_floors(s))
        if g:
            prompt = _as_list(s.prompt_ids)
            response.extend(prompt[len(prompt) - g :])
            mask.extend([0] * g)
            if logprobs is not None:
                logprobs.extend([0.0] * g)
            if rewards is not None:
                rewards.extend([0.0] * g)
        response.extend(_as_list(s.response_ids))
        mask.extend(_as_list(s.loss_mask))
        if logprobs is not None:
            logprobs.extend(_as_list(s.response_logprobs))
        if rewards is not None:
            rewards.extend(_as_list(s.reward))
    return first.replace(
        response_ids=response,
        loss_mask=mask,
        response_logprobs=logprobs,
        reward=rewards if per_token else last.reward,
        is_last_step=any(steps[i].is_last_step for i in idx),
        stop_reason=last.stop_reason,
        policy_version=min(steps[i].policy_version for i in idx),
        routed_experts=None if routing is None else np.concatenate(routing, axis=0),
        response_versions=versions,
        response_support_floors=floors,
    )


def _support_floors(step: Step) -> list[float]:
    """A step's support floors, ``-inf`` (nothing cut) for a step without them."""
    if step.response_support_floors is None:
        return [-math.inf] * len(step.response_ids)
    return [float(x) for x in step.response_support_floors]


def _versions_of(step: Step) -> set[int]:
    """The distinct weight versions of a step's response tokens (its policy version when none)."""
    if step.response_versions is None:
        return {int(step.policy_version)}
    return {int(v) for v in step.response_versions}


def merge_steps(batch: StepBatch, plan: MergePlan | None = None) -> StepBatch:
    """Merges the steps of each trajectory by the extension property (design §2.5).

    Pure: ``batch`` is untouched; unmerged steps are shared (Steps are immutable), and when
    no step merges ``batch`` itself is returned. The result keeps ``vocab_size`` and
    ``metadata``; it is valid by construction, so it is not validated again. ``plan`` is
    ``plan_merge(batch.steps)`` when the caller has it already (it is computed otherwise).
    See the module docstring for the rule and the reward/ordering decisions.

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step
    >>> b = StepBatch([Step([10], [20], ("q", 0), is_last_step=False, reward=1.0),
    ...                Step([10, 20, 30], [40, 41], ("q", 0), reward=2.0)])
    >>> m = merge_steps(b)
    >>> len(m), list(m[0].response_ids), list(m[0].loss_mask), m[0].reward
    (1, [20, 30, 40, 41], [1, 0, 1, 1], 2.0)
    """
    steps = batch.steps
    plan = plan_merge(steps) if plan is None else plan
    if plan.num_samples == len(steps):
        return batch  # nothing merges: the (immutable, already validated) batch is the result
    merged = [_build_sample(steps, idx, g) for idx, g in zip(plan.samples, plan.gaps, strict=True)]
    return batch.derived(merged)  # valid by construction (tested against a reference merger)


def trained_tokens(steps: Sequence[Step]) -> int:
    """Tokens that go through the model: ``sum(len(prompt) + len(response))`` over samples."""
    return int(sum(len(s.prompt_ids) + len(s.response_ids) for s in steps))


def merge_metrics(before: Sequence[Step], after: Sequence[Step]) -> dict[str, float]:
    """Sample and token counts before/after :func:`merge_steps` (design §2.5).

    ``trained_tokens`` counts prompt + response tokens, i.e. what the forward pass costs.

    >>> from rljax.types import Step
    >>> a = [Step([1], [2], ("q", 0), is_last_step=False), Step([1, 2, 3], [4], ("q", 0))]
    >>> merge_metrics(a, [Step([1], [2, 3, 4], ("q", 0))])["trained_tokens_after_merge"]
    4
    """
    tb, ta = trained_tokens(before), trained_tokens(after)
    return {
        "num_samples_before_merge": len(before),
        "num_samples_after_merge": len(after),
        "trained_tokens_before_merge": tb,
        "trained_tokens_after_merge": ta,
        "merge_token_ratio": ta / tb if tb else 1.0,
    }
