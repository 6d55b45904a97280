"""The host preparation pipeline: a rollout's batch -> training samples with their streams.

One RL step trains every algorithm of the run on the steps its environments produced
(design §3.6). The batch is validated once, where the rollout builds it; :func:`split_by_algorithm`
cuts it into whole trajectories per algorithm without validating again. For algorithm ``a`` and
its steps ``B_a``, :func:`prepare_samples` computes (merge plan computed once)::

    A        = step advantages of B_a            (rl algorithms: a.estimator; others: zeros)
    B_a, m   = filters(B_a, A)                   (enforcing filters zero loss masks; metrics m)
    S, A     = merge(B_a), A carried along        (prefix-aware, design §2.5)
    streams  = component weights of S             (what each token feeds, design §3.5)

The component streams by action component (``loss_mask`` gates all of them in the objective):

========= ============================================================================
rl        ``rl_weights`` 1 (default); echo adds ce on observation tokens of its roles:
          those tokens join the loss mask with ``rl_weights`` 0 and ``ce_weights`` alpha
ce        ``ce_weights`` 1 on trainable tokens (sft: the frozen model's samples)
ref_kl    ``ref_kl_weights`` 1 and ``ref_logprobs`` from ``score`` (opd: the frozen teacher's
          prefill logprobs; opsd: the live policy on the demonstration-conditioned prompt)
========= ============================================================================

The objective normalizes each component by its own global token count, so mixing
components (echo) or algorithms never lets one component's token count scale another's
gradient.

Reference scores (the ref_kl component) are passed in as a function: the data layer never
talks to a model. Host code only: the math lives in :mod:`rljax.core` (estimators via
:func:`rljax.data.step_advantages.compute_step_advantages`, losses in the objective).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.algorithms import Algorithm
from rljax.data.batch import StepBatch
from rljax.data.credit import TurnSpans, turn_spans
from rljax.data.filters import (
    Filter,
    StalenessFilter,
    ZeroAdvantageFilter,
    ZeroVarianceGroupFilter,
    apply_filters,
    errored_steps,
)
from rljax.data.merge import MergePlan, merge_metrics, merge_steps, plan_merge
from rljax.data.pack import STREAM_DEFAULTS
from rljax.data.step_advantages import compute_step_advantages
from rljax.types import ERROR_STOP_REASONS, Step

__all__ = [
    "PreparedSamples",
    "ResponseScorer",
    "load_observation_filter",
    "prefixed",
    "prepare_samples",
    "split_by_algorithm",
]

#: ``score(samples) -> one float array per sample``: log p of each response token under the
#: reference (the ref_kl component's ``ref_logprobs``), aligned with ``sample.response_ids``.
ResponseScorer = Callable[[Sequence[Step]], Sequence[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class PreparedSamples:
    """Training samples of one algorithm with their per-token streams (one array per sample).

    Attributes:
      samples: merged (or not) steps; echo may have widened their ``loss_mask``.
      advantages: per-token advantages (zeros for non-rl algorithms).
      rl_weights, ce_weights, ref_kl_weights, ref_logprobs: component streams, None = absent
        (the packer's default: rl weight 1, the others 0).
      token_rewards: critic algorithms (ppo): per-token rewards (:func:`token_rewards`); their
        advantages are computed on packed rows from the critic's values (zeros here).
      metrics: filter, merge and echo metrics, keys prefixed by their stage.
      sample_of_step: per input step (batch order), the index in ``samples`` of the sample it
        trained in (the merge plan's; the identity without merging). Rollout records use it.
      step_advantages: per input step, its per-token advantages before merging.
      step_filtered: per input step, whether an enforcing filter zeroed its loss mask.
      turn_spans: per sample, where each of its turns' responses lies in it
        (:func:`rljax.data.credit.turn_spans`); critic algorithms link a trajectory's turns with it.
    """

    samples: list[Step]
    advantages: list[np.ndarray]
    rl_weights: list[np.ndarray] | None = None
    ce_weights: list[np.ndarray] | None = None
    ref_kl_weights: list[np.ndarray] | None = None
    ref_logprobs: list[np.ndarray] | None = None
    token_rewards: list[np.ndarray] | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    sample_of_step: tuple[int, ...] = ()
    step_advantages: tuple[np.ndarray, ...] = ()
    step_filtered: tuple[bool, ...] = ()
    turn_spans: TurnSpans = ()

    def streams(self) -> dict[str, list[np.ndarray] | None]:
        """The per-step streams (:data:`~rljax.data.pack.STREAM_DEFAULTS`, plus ``token_rewards``
        when set) for packing."""
        out = {name: getattr(self, name) for name in STREAM_DEFAULTS}
        if self.token_rewards is not None:
            out["token_rewards"] = self.token_rewards
        return out


def token_rewards(steps: Sequence[Step]) -> list[np.ndarray]:
    """Per-response-token rewards of each step, for token-level estimators (GAE): a scalar
    ``Step.reward`` on the step's last trained response token (``loss_mask`` 1; the last token
    when none is), per-token rewards as given; 0 elsewhere.

    >>> [r.tolist() for r in token_rewards([Step([1], [2, 3], ("q", 0), reward=1.5)])]
    [[0.0, 1.5]]
    """
    out = []
    for s in steps:
        n = len(s.response_ids)
        if s.per_token_reward:
            out.append(np.asarray(s.reward, np.float32).reshape(n))
            continue
        r = np.zeros(n, np.float32)
        if n:  # on the last TRAINED token: GAE skips masked ones (e.g. a trailing observation)
            trainable = np.flatnonzero(np.asarray(s.loss_mask))
            r[int(trainable[-1]) if trainable.size else n - 1] = float(s.reward)
        out.append(r)
    return out


def split_by_algorithm(batch: StepBatch) -> dict[str, StepBatch]:
    """The batch's steps by ``Step.algorithm`` (sorted names; batch order kept), not re-validated.

    Every step of a trajectory comes from one environment and so has one algorithm: each part holds
    whole trajectories and stays valid.

    >>> steps = [Step([1], [2], ("a", 0), algorithm="sft"), Step([1], [2], ("b", 0))]
    >>> {k: len(v) for k, v in split_by_algorithm(StepBatch(steps)).items()}
    {'grpo': 1, 'sft': 1}
    """
    parts: dict[str, list[Step]] = {}
    algorithm_of: dict[Any, str] = {}
    for s in batch:
        if algorithm_of.setdefault(s.trajectory_id, s.algorithm) != s.algorithm:
            raise ValueError(
                f"trajectory {s.trajectory_id} has steps of algorithms {algorithm_of[s.trajectory_id]!r} "
                f"and {s.algorithm!r}; a trajectory is trained by one algorithm"
            )
        parts.setdefault(s.algorithm, []).append(s)
    return {name: batch.derived(parts[name]) for name in sorted(parts)}


def load_observation_filter(path: str | None) -> Callable[[Step, np.ndarray], np.ndarray] | None:
    """Imports echo's ``"module:function"`` observation filter (None passes through).

    >>> load_observation_filter("numpy:logical_not") is np.logical_not
    True
    """
    if path is None:
        return None
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"observation_filter {path!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"observation_filter {path!r} is not callable")
    return fn


def _mask_weights(samples: Sequence[Step]) -> list[np.ndarray]:
    return [np.asarray(s.loss_mask, np.float32) for s in samples]


def _check_scores(scores: Sequence[np.ndarray], samples: Sequence[Step], what: str) -> list[np.ndarray]:
    if len(scores) != len(samples):
        raise ValueError(f"{what} returned {len(scores)} arrays for {len(samples)} samples")
    out = []
    for i, (sc, s) in enumerate(zip(scores, samples, strict=True)):
        a = np.asarray(sc, np.float32)
        if a.shape != (len(s.response_ids),):
            raise ValueError(
                f"{what}: sample {i} ({s.trajectory_id}) got {a.shape[0] if a.ndim else 'scalar'} "
                f"reference logprobs for {len(s.response_ids)} response tokens"
            )
        if not np.all(np.isfinite(a)) or np.any(a > 1e-4):
            raise ValueError(f"{what}: sample {i} ({s.trajectory_id}) has logprobs not finite or > 0")
        out.append(np.minimum(a, 0.0))
    return out


def prepare_samples(
    algorithm: Algorithm,
    batch: StepBatch,
    *,
    filters: Sequence[Filter] = (),
    merge: bool = True,
    score: ResponseScorer | None = None,
    observation_filter: Callable[[Step, np.ndarray], np.ndarray] | None = None,
    trained_version: int | None = None,
) -> PreparedSamples:
    """Advantages -> filters -> merge -> component streams for the steps of ``algorithm``.

    Steps of errored trajectories (design §2.3.2) get loss mask 0 first, whatever produced them,
    so they never count in a normaliser.

    Args:
      algorithm: the (validated) algorithm that trains every step of ``batch``.
      batch: its steps.
      filters: design §3.7 filters (enforcing ones zero loss masks; all report metrics). The
        zero-advantage and zero-variance filters only apply to rl algorithms (others have no
        advantages or group baselines); the zero-variance filter takes the algorithm's
        ``reward_mode``, and a staleness filter without a ``trained_version`` takes
        ``trained_version``.
      merge: fold turns that extend each other into one sample (design §2.5). Echo needs it:
        the observation tokens it trains are the gap tokens between merged turns.
      score: the ref_kl reference of the (merged) samples; required for ref_kl algorithms.
      observation_filter: echo's optional narrowing ``fn(sample, candidates) -> mask``.
      trained_version: the version of the weights this batch trains (the RL step in a run).

    >>> from rljax.algorithms import get_algorithm
    >>> steps = [Step([1], [2, 3], ("q", r), reward=float(r)) for r in range(2)]
    >>> p = prepare_samples(get_algorithm("grpo"), StepBatch(steps))
    >>> [a.tolist() for a in p.advantages], p.ce_weights
    ([[-0.5, -0.5], [0.5, 0.5]], None)
    """
    comp = algorithm.action_component
    errored = sum(s.is_last_step and s.stop_reason in ERROR_STOP_REASONS for s in batch)
    metrics: dict[str, float] = {"advantages/errored_excluded": float(errored)} if comp == "rl" else {}
    if errored:
        batch = _mask_errored(batch)
    critic = algorithm.needs_critic
    if critic:  # advantages come later, from the critic's values on packed rows
        adv = [np.zeros(len(s.response_ids), np.float32) for s in batch]
    elif comp == "rl":
        lp = None if algorithm.length_penalty is None else dataclasses.asdict(algorithm.length_penalty)
        adv = compute_step_advantages(
            batch,
            algorithm.estimator,
            reward_mode=algorithm.reward_mode,
            length_penalty=lp,
            **dict(algorithm.estimator_kwargs),
        )
    else:
        adv = [np.zeros(len(s.response_ids), np.float32) for s in batch]
    if comp != "rl" or critic:  # no advantages (yet) or no group baseline: these would mask every token
        filters = [f for f in filters if not isinstance(f, (ZeroAdvantageFilter, ZeroVarianceGroupFilter))]
    filters = [_bind_filter(f, algorithm, trained_version) for f in filters]
    unfiltered = batch
    if filters:
        batch, fm = apply_filters(batch, filters, advantages=adv)
        metrics.update(fm)
    trace: dict[str, Any] = {
        "step_advantages": tuple(np.asarray(a, np.float32) for a in adv),
        "step_filtered": tuple(
            bool(np.any(np.asarray(a.loss_mask))) and not np.any(np.asarray(b.loss_mask))
            for a, b in zip(unfiltered, batch, strict=True)
        ),
        "sample_of_step": tuple(range(len(batch))),
        "turn_spans": turn_spans(batch.steps),
    }
    rewards = token_rewards(batch.steps) if critic else None
    echo = bool(algorithm.observation_ce) and comp == "rl"
    if echo and not merge:
        raise ValueError(
            f"algorithm {algorithm.name!r} trains observation tokens (echo), which are the tokens between "
            "merged turns; set trainer.merge=True"
        )
    roles = None
    if merge:
        plan = plan_merge(batch.steps)  # once: merging and carrying arrays along share it
        merged = merge_steps(batch, plan)
        trace["sample_of_step"] = _sample_of_step(plan)
        trace["turn_spans"] = turn_spans(batch.steps, plan)
        if echo:
            from rljax.data.echo import response_roles

            roles = response_roles(plan, batch.steps)
        adv = plan.merge_arrays(adv)
        if rewards is not None:
            rewards = plan.merge_arrays(rewards)
        metrics.update({f"merge/{k}": float(v) for k, v in merge_metrics(batch, merged).items()})
        samples = list(merged.steps)
    else:
        samples = list(batch.steps)
    adv = [np.asarray(a, np.float32) for a in adv]

    if comp == "rl" and not echo:
        return PreparedSamples(samples, adv, token_rewards=rewards, metrics=metrics, **trace)
    if echo:
        from rljax.data.echo import echo_streams

        es = echo_streams(samples, roles, algorithm.observation_ce, token_filter=observation_filter)
        samples = [
            s.replace(loss_mask=np.asarray(m, np.int32).tolist())
            for s, m in zip(samples, es.loss_mask, strict=True)
        ]
        metrics.update(es.metrics)
        return PreparedSamples(
            samples,
            adv,
            rl_weights=list(es.rl_weights),
            ce_weights=list(es.ce_weights),
            metrics=metrics,
            **trace,
        )
    if comp == "ce":
        return PreparedSamples(samples, adv, ce_weights=_mask_weights(samples), metrics=metrics, **trace)
    # ref_kl
    if score is None:
        raise ValueError(f"algorithm {algorithm.name!r} feeds ref_kl: prepare_samples needs score=")
    ref = _check_scores(score(samples), samples, f"{algorithm.name} reference scorer")
    return PreparedSamples(
        samples, adv, ref_kl_weights=_mask_weights(samples), ref_logprobs=ref, metrics=metrics, **trace
    )


def _mask_errored(batch: StepBatch) -> StepBatch:
    """``batch`` with loss mask 0 on every step of an errored trajectory."""
    bad = errored_steps(batch)
    if not any(np.any(np.asarray(s.loss_mask)) for s, b in zip(batch, bad, strict=True) if b):
        return batch  # the rollout masks them already
    steps = [
        s.replace(loss_mask=[0] * len(s.response_ids)) if b else s for s, b in zip(batch, bad, strict=True)
    ]
    return batch.derived(steps)  # only loss masks changed: still valid


def _bind_filter(f: Filter, algorithm: Algorithm, trained_version: int | None) -> Filter:
    """The filter as it applies to ``algorithm``'s batch trained at ``trained_version``."""
    if isinstance(f, ZeroVarianceGroupFilter) and f.reward_mode != algorithm.reward_mode:
        return dataclasses.replace(f, reward_mode=algorithm.reward_mode)
    if isinstance(f, StalenessFilter) and f.trained_version is None and trained_version is not None:
        return dataclasses.replace(f, trained_version=int(trained_version))
    return f


def _sample_of_step(plan: MergePlan) -> tuple[int, ...]:
    """Per input step, the index of the merged sample holding it."""
    out = [0] * plan.num_steps
    for k, idx in enumerate(plan.samples):
        for i in idx:
            out[i] = k
    return tuple(out)


def prefixed(metrics: Mapping[str, Any], algorithm: str, *, multi: bool) -> dict[str, float]:
    """Metric keys as they are (one algorithm in the run) or suffixed ``/<algorithm>`` (several)."""
    return {(f"{k}/{algorithm}" if multi else k): float(v) for k, v in metrics.items()}
