"""Rollout filters and DAPO dynamic sampling (design §3.7). Host-side numpy.

A filter flags steps of a :class:`~rljax.data.batch.StepBatch`; it never drops them. In
``mode="enforce"`` the loss mask of every flagged step is zeroed, so the step trains nothing
but still counts in group baselines and metrics; in ``mode="monitor"`` the batch is returned
unchanged and only the metrics report what would have been filtered.

=========================  =====================================================================
filter                     a step is flagged when
=========================  =====================================================================
gibberish                  a sampled token has ``id > id_threshold`` and
                           ``logprob < -ln(vocab_size) - margin`` (prime-rl)
repetition                 ``>= window`` consecutive sampled tokens each have ``p > prob_threshold``
zero_advantage             all its advantages are 0
overlong                   ``stop_reason`` is not an allowed one (default: anything but "stop")
overlong_unrewarded        ``len(response_ids) > max_length`` and its trajectory reward is 0
zero_variance              what the estimator baselines does not vary in its prompt group:
                           the trajectory rewards (outcome), or the turn returns at every turn
                           index (per_step); errored trajectories left out
staleness                  a trainable token was sampled ``> max_staleness`` versions before the
                           trained version (per token: :meth:`~rljax.types.Step.token_versions`)
=========================  =====================================================================

"Sampled tokens" are response tokens with ``loss_mask == 1`` in the batch given to
:func:`apply_filters` (merged samples carry observation tokens with mask 0 and logprob 0,
which must neither count as gibberish nor as confident repetition). Every filter of one
:func:`apply_filters` call sees the same input batch, so its metrics do not depend on the
order of the filters. A trajectory's reward is the total reward of its last step (design §2.3).

Errored trajectories (last stop reason in :data:`rljax.types.ERROR_STOP_REASONS`) are left out of
group spreads, as the estimators leave them out of their baselines (design §2.3.2): a group of
three successes and one error has zero advantages everywhere, and its spread is 0, not 1.

:class:`DynamicSampler` is DAPO's dynamic sampling (Yu et al., 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", §3.2): it accumulates prompt groups over sampling
rounds, keeping only groups whose spread (:func:`group_reward_spread`) is nonzero, until it has
enough.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from rljax.core.advantages import REWARD_MODES
from rljax.data.batch import StepBatch
from rljax.data.step_advantages import dense_ids, step_turn_returns
from rljax.types import ERROR_STOP_REASONS, Step

__all__ = [
    "FILTERS",
    "DynamicSampler",
    "Filter",
    "GibberishFilter",
    "OverlongFilter",
    "OverlongUnrewardedFilter",
    "RepetitionFilter",
    "StalenessFilter",
    "ZeroAdvantageFilter",
    "ZeroVarianceGroupFilter",
    "apply_filters",
    "errored_steps",
    "group_reward_spread",
    "informative_groups",
    "make_filter",
    "trajectory_rewards",
]

MODES: tuple[str, ...] = ("monitor", "enforce")
Advantages = Sequence[Any] | np.ndarray | None
#: A reward mode (design §2.3 / §2.4), or one per algorithm name (``Step.algorithm``; absent names:
#: "outcome").
RewardModes = str | Mapping[str, str]


# --------------------------------------------------------------------------------------
# batch views shared by the filters
# --------------------------------------------------------------------------------------
def _where(i: int, s: Step) -> str:
    return f"step {i} (trajectory {s.trajectory_id})"


def _lengths(batch: Sequence[Step]) -> np.ndarray:
    return np.fromiter((len(s.response_ids) for s in batch), dtype=np.int64, count=len(batch))


def _token_owner(lengths: np.ndarray) -> np.ndarray:
    """Step index of each concatenated response token."""
    return np.repeat(np.arange(lengths.shape[0]), lengths)


def _concat(values: list[Any], dtype: Any) -> np.ndarray:
    arrays = [np.asarray(v, dtype=dtype).reshape(-1) for v in values]
    return np.concatenate(arrays) if arrays else np.zeros((0,), dtype)


def _sampled_logprobs(batch: Sequence[Step], who: str) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated (logprob, sampled) per response token; logprobs are required."""
    for i, s in enumerate(batch):
        if s.response_logprobs is None:
            raise ValueError(
                f"{_where(i, s)}: the {who} filter needs response_logprobs but this step has none; "
                "request logprobs from the engine or drop the filter"
            )
    lp = _concat([s.response_logprobs for s in batch], np.float64)
    sampled = _concat([s.loss_mask for s in batch], np.int64) != 0
    return lp, sampled


def _any_per_step(token_flags: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    owner = _token_owner(lengths)
    return np.bincount(owner[token_flags], minlength=lengths.shape[0]) > 0


def trajectory_rewards(batch: Sequence[Step]) -> np.ndarray:
    """Per step, the reward of its trajectory: total reward of the trajectory's last step.

    >>> from rljax.types import Step, TrajectoryID
    >>> t = TrajectoryID("q", 0)
    >>> trajectory_rewards([Step([1], [2], t, is_last_step=False), Step([1], [3], t, reward=[0.5])])
    array([0.5, 0.5])
    """
    final = {s.trajectory_id: s.total_reward for s in batch if s.is_last_step}
    return np.array([final[s.trajectory_id] for s in batch], dtype=np.float64)


def errored_steps(batch: Sequence[Step]) -> np.ndarray:
    """Per step, whether its trajectory errored (its last step's stop reason is in
    :data:`rljax.types.ERROR_STOP_REASONS`).

    >>> from rljax.types import Step, TrajectoryID as T
    >>> errored_steps([Step([1], [2], T("a", 0), is_last_step=False),
    ...                Step([1], [2], T("a", 0), stop_reason="error"), Step([1], [2], T("b", 0))]).tolist()
    [True, True, False]
    """
    bad = {s.trajectory_id for s in batch if s.is_last_step and s.stop_reason in ERROR_STOP_REASONS}
    return np.fromiter((s.trajectory_id in bad for s in batch), bool, count=len(batch))


def _spread_by(values: np.ndarray, cells: list[Any], use: np.ndarray) -> np.ndarray:
    """Per entry, ``max - min`` of ``values`` over the used entries of its cell (0 without any)."""
    cell, num = dense_ids(cells)
    hi = np.full(num, -np.inf)
    lo = np.full(num, np.inf)
    np.maximum.at(hi, cell[use], values[use])
    np.minimum.at(lo, cell[use], values[use])
    return np.where(np.isfinite(hi), hi - lo, 0.0)[cell]


def _mode_of(reward_mode: RewardModes, algorithm: str) -> str:
    mode = reward_mode if isinstance(reward_mode, str) else reward_mode.get(algorithm, "outcome")
    if mode not in REWARD_MODES:
        raise ValueError(f"reward_mode must be one of {list(REWARD_MODES)}, got {mode!r}")
    return mode


def group_reward_spread(batch: Sequence[Step], *, reward_mode: RewardModes = "outcome") -> np.ndarray:
    """Per step, the spread of what the estimator baselines in its prompt group (``instance_id``),
    errored trajectories left out.

    ``reward_mode="outcome"`` (design §2.3): ``max - min`` of the trajectory rewards.
    ``"per_step"`` (design §2.4): the largest ``max - min`` of the turn returns ``G_jk`` among the
    steps at the same turn index ``k``, over the group's turn indices (``gamma_turn = 1``): a group
    whose final rewards agree but whose earlier turns' returns differ has non-zero advantages and a
    non-zero spread. A mapping gives each algorithm (``Step.algorithm``) its mode. A group with
    fewer than two trajectories that did not error has spread 0.

    >>> from rljax.types import Step, TrajectoryID as T
    >>> group_reward_spread([Step([1], [2], T("a", 0), reward=1.0), Step([1], [2], T("a", 1)),
    ...                      Step([1], [2], T("b", 0))])
    array([1., 1., 0.])
    >>> ok = [Step([1], [2], T("a", i), reward=1.0) for i in range(3)]
    >>> group_reward_spread(ok + [Step([1], [2], T("a", 3), stop_reason="error")]).tolist()
    [0.0, 0.0, 0.0, 0.0]
    """
    n = len(batch)
    if n == 0:
        return np.zeros((0,), np.float64)
    use = ~errored_steps(batch)
    group = [s.trajectory_id.instance_id for s in batch]
    modes = [_mode_of(reward_mode, s.algorithm) for s in batch]
    out = np.zeros((n,), np.float64)
    outcome = np.array([m == "outcome" for m in modes], bool)
    if outcome.any():
        last = np.array([s.is_last_step for s in batch], bool)
        out = np.where(outcome, _spread_by(trajectory_rewards(batch), group, use & last), out)
    if not outcome.all():
        returns, turn = step_turn_returns(batch)
        by_turn = _spread_by(returns.astype(np.float64), list(zip(group, turn.tolist(), strict=True)), use)
        g, num = dense_ids(group)
        widest = np.zeros(num)
        np.maximum.at(widest, g, by_turn)
        out = np.where(outcome, out, widest[g])
    return out


def informative_groups(
    batch: Sequence[Step], *, atol: float = 0.0, reward_mode: RewardModes = "outcome"
) -> dict[str, bool]:
    """Per prompt group (``instance_id``, first-appearance order), whether its spread
    (:func:`group_reward_spread`) is ``> atol``: the groups DAPO dynamic sampling keeps.

    >>> from rljax.types import Step, TrajectoryID as T
    >>> steps = [Step([1], [2], T("a", i), reward=1.0) for i in range(3)]
    >>> steps += [Step([1], [2], T("a", 3), stop_reason="error"), Step([1], [2], T("b", 0), reward=1.0),
    ...           Step([1], [2], T("b", 1))]
    >>> informative_groups(steps)
    {'a': False, 'b': True}
    """
    spread = group_reward_spread(batch, reward_mode=reward_mode)
    out: dict[str, bool] = {}
    for s, d in zip(batch, spread, strict=True):
        out[s.trajectory_id.instance_id] = bool(d > atol)
    return out


# --------------------------------------------------------------------------------------
# filters
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Filter:
    """Base class: ``flags`` marks steps; calling a filter applies it (see :func:`apply_filters`).

    Attributes:
      mode: "enforce" zeroes the loss mask of flagged steps; "monitor" only reports.
    """

    name: ClassVar[str] = "filter"
    mode: str = "enforce"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"{self.name} filter: mode must be one of {list(MODES)}, got {self.mode!r}")

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        """bool[num_steps]: True where the step is flagged."""
        raise NotImplementedError

    def __call__(self, batch: StepBatch, advantages: Advantages = None) -> tuple[StepBatch, dict[str, float]]:
        return apply_filters(batch, [self], advantages=advantages)


def _positive_int(owner: str, field: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{owner}: {field} must be an int >= 1, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GibberishFilter(Filter):
    """Flags a step with a sampled token ``id > id_threshold`` and ``logprob < -ln(V) - margin``.

    A rare (high-id) token sampled with probability far below uniform ``1/V`` is a sign of a
    sampler/trainer mismatch or broken decoding (prime-rl's gibberish filter).

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [7, 2], T("q", 0), response_logprobs=[-9.0, -0.1])])
    >>> f = GibberishFilter(vocab_size=100, id_threshold=5, mode="monitor")
    >>> f.flags(b)  # 7 > 5 and -9 < -ln(100) - 2 = -6.6
    array([ True])
    """

    name: ClassVar[str] = "gibberish"
    vocab_size: int
    id_threshold: int
    margin: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("gibberish filter", "vocab_size", self.vocab_size)
        if (
            not isinstance(self.id_threshold, int)
            or isinstance(self.id_threshold, bool)
            or self.id_threshold < 0
        ):
            raise ValueError(f"gibberish filter: id_threshold must be an int >= 0, got {self.id_threshold!r}")
        if not math.isfinite(self.margin):
            raise ValueError(f"gibberish filter: margin must be finite, got {self.margin!r}")

    @property
    def logprob_threshold(self) -> float:
        """Token log-probs below this (uniform over the vocabulary, less ``margin``) count as gibberish."""
        return -math.log(self.vocab_size) - self.margin

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        lp, sampled = _sampled_logprobs(batch, self.name)
        ids = _concat([s.response_ids for s in batch], np.int64)
        bad = sampled & (ids > self.id_threshold) & (lp < self.logprob_threshold)
        return _any_per_step(bad, _lengths(batch))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepetitionFilter(Filter):
    """Flags a step with ``>= window`` consecutive sampled tokens each of probability ``> prob_threshold``.

    A long run of near-certain tokens is a degenerate loop (prime-rl's repetition filter).
    Unsampled (mask-0) tokens break a run.

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [2, 2, 2], T("q", 0), response_logprobs=[-1e-3] * 3)])
    >>> RepetitionFilter(window=3).flags(b), RepetitionFilter(window=4).flags(b)
    (array([ True]), array([False]))
    """

    name: ClassVar[str] = "repetition"
    window: int
    prob_threshold: float = 0.99

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("repetition filter", "window", self.window)
        if not 0.0 < self.prob_threshold < 1.0:
            raise ValueError(
                f"repetition filter: prob_threshold must be in (0, 1), got {self.prob_threshold!r}"
            )

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        lp, sampled = _sampled_logprobs(batch, self.name)
        lengths = _lengths(batch)
        confident = sampled & (lp > math.log(self.prob_threshold))
        n = confident.shape[0]
        pos = np.arange(n)
        # index of the latest run break at or before each token: a non-confident token, or the
        # position just before the first token of each step
        breaks = np.where(confident, -1, pos)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        starts = starts[lengths > 0]
        breaks[starts] = np.maximum(breaks[starts], starts - 1)
        run_length = pos - np.maximum.accumulate(breaks) if n else pos
        return _any_per_step(confident & (run_length >= self.window), lengths)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroAdvantageFilter(Filter):
    """Flags a step whose advantages are all 0 (it would contribute no policy gradient).

    ``advantages``: one per-token array per step (as from ``StepBatch.step_advantages``) or one
    scalar per step.

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [2, 3], T("q", 0)), Step([1], [2], T("q", 1))])
    >>> ZeroAdvantageFilter().flags(b, [np.array([0.0, 0.0]), np.array([0.5])])
    array([ True, False])
    """

    name: ClassVar[str] = "zero_advantage"

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        if advantages is None:
            raise ValueError(
                "zero_advantage filter needs advantages: pass advantages=batch.step_advantages(...) "
                "to apply_filters"
            )
        n = len(batch)
        if len(advantages) != n:
            raise ValueError(f"zero_advantage filter: got {len(advantages)} advantage entries for {n} steps")
        if isinstance(advantages, np.ndarray) and advantages.ndim == 1 and advantages.dtype != object:
            return advantages == 0
        out = np.zeros((n,), bool)
        for i, (s, a) in enumerate(zip(batch, advantages, strict=True)):
            a = np.asarray(a, dtype=np.float64)
            if a.ndim != 0 and a.shape != (len(s.response_ids),):
                raise ValueError(
                    f"{_where(i, s)}: advantages have shape {a.shape} but response_ids has "
                    f"{len(s.response_ids)} tokens"
                )
            out[i] = not np.any(a)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlongFilter(Filter):
    """Flags a step whose ``stop_reason`` is not in ``allowed_stop_reasons`` (default: only "stop").

    A truncated response ("length") or an aborted one has no valid ending; training on it
    teaches the model that cut-off outputs earn the trajectory's reward (DAPO overlong
    filtering). Multi-turn rollouts whose engine reports tool-call turns as "tool_call" should
    pass ``allowed_stop_reasons=("stop", "tool_call")``.

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [2], T("q", 0), stop_reason="length"), Step([1], [2], T("q", 1))])
    >>> OverlongFilter().flags(b)
    array([ True, False])
    """

    name: ClassVar[str] = "overlong"
    allowed_stop_reasons: tuple[str, ...] = ("stop",)

    def __post_init__(self) -> None:
        super().__post_init__()
        reasons = self.allowed_stop_reasons
        if isinstance(reasons, str) or not all(isinstance(r, str) for r in reasons):
            raise ValueError(f"overlong filter: allowed_stop_reasons must be a tuple of str, got {reasons!r}")
        object.__setattr__(self, "allowed_stop_reasons", tuple(reasons))

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        allowed = set(self.allowed_stop_reasons)
        return np.array([s.stop_reason not in allowed for s in batch], dtype=bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlongUnrewardedFilter(Filter):
    """Flags a step with ``len(response_ids) > max_length`` whose trajectory reward is 0.

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [2, 3, 4], T("q", 0)), Step([1], [2, 3, 4], T("q", 1), reward=1.0)])
    >>> OverlongUnrewardedFilter(max_length=2).flags(b)
    array([ True, False])
    """

    name: ClassVar[str] = "overlong_unrewarded"
    max_length: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("overlong_unrewarded filter", "max_length", self.max_length)

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        return (_lengths(batch) > self.max_length) & (trajectory_rewards(batch) == 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroVarianceGroupFilter(Filter):
    """Flags every step of a prompt group whose spread (:func:`group_reward_spread`) is ``<= atol``.

    Such a group has zero group-relative advantage everywhere (design §3.1); a group of one
    trajectory is zero-variance too, and errored trajectories do not count. ``reward_mode`` is the
    one the advantages were computed with: "outcome" compares trajectory rewards, "per_step" the
    turn returns at each turn index. A run sets it from each algorithm (it is not a config key of
    ``trainer.filters``).

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [2], T("a", 0), reward=1.0), Step([1], [2], T("a", 1), reward=1.0),
    ...                Step([1], [2], T("b", 0), reward=1.0), Step([1], [2], T("b", 1))])
    >>> ZeroVarianceGroupFilter().flags(b)
    array([ True,  True, False, False])
    """

    name: ClassVar[str] = "zero_variance"
    atol: float = 0.0
    reward_mode: str = "outcome"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.atol) and self.atol >= 0):
            raise ValueError(f"zero_variance filter: atol must be finite and >= 0, got {self.atol!r}")
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(
                f"zero_variance filter: reward_mode must be one of {list(REWARD_MODES)}, "
                f"got {self.reward_mode!r}"
            )

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        return group_reward_spread(batch, reward_mode=self.reward_mode) <= self.atol


@dataclasses.dataclass(frozen=True, kw_only=True)
class StalenessFilter(Filter):
    """Flags a step with a trainable token sampled more than ``max_staleness`` versions before the
    trained version.

    Staleness is per token, ``trained_version - version``, from the version of every response
    token (:meth:`rljax.types.Step.token_versions`): a turn that an in-flight weight update crossed
    is judged by its trainable tokens, not by its oldest version alone (in a merged sample the
    observation tokens, loss mask 0, do not count). ``trained_version`` is the version of the
    weights the batch trains (a run sets it to the RL step; it is not a config key of
    ``trainer.filters``); without it the filter raises, since the batch alone cannot say how far
    behind its newest tokens are. To mask only the stale tokens of a turn instead of the whole
    turn, use the off-policy correction's ``max_token_staleness`` (:mod:`rljax.core.off_policy`).

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [2, 3], T("q", 0), policy_version=3, response_versions=[3, 5]),
    ...                Step([1], [2, 3], T("q", 1), policy_version=5)])
    >>> StalenessFilter(max_staleness=1, trained_version=5).flags(b)
    array([ True, False])
    >>> StalenessFilter(max_staleness=1, trained_version=7).flags(b)  # two steps later
    array([ True,  True])
    """

    name: ClassVar[str] = "staleness"
    max_staleness: int
    trained_version: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        v = self.max_staleness
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"staleness filter: max_staleness must be an int >= 0, got {v!r}")
        t = self.trained_version
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"staleness filter: trained_version must be None or an int >= 0, got {t!r}")

    def token_staleness(self, batch: Sequence[Step]) -> list[np.ndarray]:
        """Per step, int64 ``trained_version - version`` of each response token (0 where untrainable)."""
        trained = self.trained_version
        if trained is None:
            raise ValueError(
                "staleness filter: trained_version is None; set it to the version of the weights this "
                "batch trains (a run sets it to the RL step; prepare_samples(trained_version=...))"
            )
        versions = [s.token_versions() for s in batch]
        trainable = [np.asarray(s.loss_mask) != 0 for s in batch]
        out = [np.where(m, trained - v, 0) for v, m in zip(versions, trainable, strict=True)]
        pairs = zip(versions, trainable, strict=True)
        newest = max((int(v[m].max()) for v, m in pairs if m.any()), default=0)
        if newest > trained:
            raise ValueError(
                f"staleness filter: a trainable token was sampled with version {newest}, newer than "
                f"trained_version={trained}; pass the version of the weights being trained"
            )
        return out

    def flags(self, batch: Sequence[Step], advantages: Advantages = None) -> np.ndarray:
        return np.array([bool(np.any(x > self.max_staleness)) for x in self.token_staleness(batch)], bool)


#: The sample filters by name (``config.trainer.filters``; :func:`make_filter`).
FILTERS: Mapping[str, type[Filter]] = {
    cls.name: cls
    for cls in (
        GibberishFilter,
        RepetitionFilter,
        ZeroAdvantageFilter,
        OverlongFilter,
        OverlongUnrewardedFilter,
        ZeroVarianceGroupFilter,
        StalenessFilter,
    )
}


def make_filter(name: str, **kwargs: Any) -> Filter:
    """Builds a filter by name (for config files).

    >>> make_filter("overlong", mode="monitor")
    OverlongFilter(mode='monitor', allowed_stop_reasons=('stop',))
    """
    if name not in FILTERS:
        raise ValueError(f"unknown filter {name!r}; choose one of {sorted(FILTERS)}")
    try:
        return FILTERS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"filter {name!r}: {e}") from None


# --------------------------------------------------------------------------------------
# composition
# --------------------------------------------------------------------------------------
def apply_filters(
    batch: StepBatch, filters: Sequence[Filter], advantages: Advantages = None
) -> tuple[StepBatch, dict[str, float]]:
    """Runs ``filters`` on ``batch``; zeroes the loss mask of steps flagged by an enforcing filter.

    All filters see the input batch. Steps are never dropped. Metrics, per filter ``f``:
    ``filters/f/flagged`` (steps), ``filters/f/fraction`` (of steps) and
    ``filters/f/flagged_tokens`` (trainable tokens in flagged steps), in both modes; totals
    ``filters/masked_steps`` and ``filters/masked_tokens`` count what enforcement zeroed.

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> b = StepBatch([Step([1], [2], T("q", 0), stop_reason="length"), Step([1], [2], T("q", 1))])
    >>> out, m = apply_filters(b, [OverlongFilter()])
    >>> [list(s.loss_mask) for s in out], m["filters/overlong/fraction"]
    ([[0], [1]], 0.5)
    """
    if not isinstance(batch, StepBatch):
        raise ValueError(f"apply_filters expects a StepBatch, got {type(batch).__name__}")
    n = len(batch)
    trainable = np.array([int(np.count_nonzero(np.asarray(s.loss_mask))) for s in batch], dtype=np.int64)
    enforced = np.zeros((n,), bool)
    metrics: dict[str, float] = {}
    seen: set[str] = set()
    for f in filters:
        if not isinstance(f, Filter):
            raise ValueError(f"apply_filters expects Filter objects, got {f!r}")
        key = f.name
        if key in seen:
            raise ValueError(f"filter {key!r} is listed twice; configure it once")
        seen.add(key)
        flagged = np.asarray(f.flags(batch, advantages), dtype=bool)
        if flagged.shape != (n,):
            raise ValueError(f"filter {key!r} returned flags of shape {flagged.shape}, expected ({n},)")
        metrics[f"filters/{key}/flagged"] = int(flagged.sum())
        metrics[f"filters/{key}/fraction"] = float(flagged.mean()) if n else 0.0
        metrics[f"filters/{key}/flagged_tokens"] = int(trainable[flagged].sum())
        if f.mode == "enforce":
            enforced |= flagged
    masked = enforced & (trainable > 0)
    metrics["filters/masked_steps"] = int(masked.sum())
    metrics["filters/masked_tokens"] = int(trainable[masked].sum())
    if not masked.any():
        return batch, metrics
    steps = [
        s.replace(loss_mask=[0] * len(s.response_ids)) if m else s for s, m in zip(batch, masked, strict=True)
    ]
    return batch.derived(steps), metrics  # only loss masks changed: still valid


# --------------------------------------------------------------------------------------
# DAPO dynamic sampling
# --------------------------------------------------------------------------------------
class DynamicSampler:
    """Accumulates prompt groups over sampling rounds until ``target_groups`` have reward variance.

    DAPO dynamic sampling (Yu et al., 2025, §3.2): groups whose trajectory rewards are all
    equal have zero group-relative advantage, so they are discarded and more prompts are
    sampled until the batch holds ``target_groups`` groups with ``spread > atol``
    (:func:`group_reward_spread` with ``reward_mode``: errored trajectories left out, per_step
    algorithms judged by their turn returns). The loop is
    bounded by ``max_rounds``; when it runs out, :meth:`result` raises (``strict=True``) or
    returns the groups it has. Surplus groups of the last round are discarded too. Instance
    ids must be unique across rounds (a repeated prompt would merge two groups).

    >>> from rljax.data.batch import StepBatch
    >>> from rljax.types import Step, TrajectoryID as T
    >>> def group(q, rewards):
    ...     return [Step([1], [2], T(q, i), reward=r) for i, r in enumerate(rewards)]
    >>> sampler = DynamicSampler(target_groups=2, max_rounds=3)
    >>> sampler.add(StepBatch(group("a", [1, 1]) + group("b", [0, 1])))
    False
    >>> sampler.add(StepBatch(group("c", [1, 0]) + group("d", [0, 1])))
    True
    >>> batch, m = sampler.result()
    >>> sorted({s.trajectory_id.instance_id for s in batch}), m["dynamic_sampling/groups_discarded"]
    (['b', 'c'], 2)
    """

    def __init__(
        self,
        *,
        target_groups: int,
        max_rounds: int,
        atol: float = 0.0,
        strict: bool = True,
        reward_mode: RewardModes = "outcome",
    ) -> None:
        _positive_int("DynamicSampler", "target_groups", target_groups)
        _positive_int("DynamicSampler", "max_rounds", max_rounds)
        if not (math.isfinite(atol) and atol >= 0):
            raise ValueError(f"DynamicSampler: atol must be finite and >= 0, got {atol!r}")
        for mode in [reward_mode] if isinstance(reward_mode, str) else reward_mode.values():
            _mode_of(mode, "")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.atol = atol
        self.strict = strict
        self.reward_mode = reward_mode
        self.reset()

    def reset(self) -> None:
        """Forgets everything collected (start of the next training batch)."""
        self.rounds = 0
        self._kept: dict[str, list[Step]] = {}
        self._seen_ids: dict[str, int] = {}
        self._vocab_size: int | None = None
        self.groups_seen = 0
        self.trajectories_seen = 0
        self._reward_sum = 0.0

    @property
    def groups_kept(self) -> int:
        """Prompt groups kept so far, at most ``target_groups``."""
        return min(len(self._kept), self.target_groups)

    @property
    def done(self) -> bool:
        """True when enough groups are collected or the round budget is spent."""
        return len(self._kept) >= self.target_groups or self.rounds >= self.max_rounds

    def add(self, batch: StepBatch) -> bool:
        """Adds one sampling round; returns :attr:`done`."""
        if not isinstance(batch, StepBatch):
            raise ValueError(f"DynamicSampler.add expects a StepBatch, got {type(batch).__name__}")
        if self.done:
            raise ValueError(
                f"DynamicSampler is done ({len(self._kept)} groups after {self.rounds} rounds); "
                "call result() and reset() before adding more"
            )
        groups: dict[str, list[Step]] = {}
        for i, s in enumerate(batch):
            q = s.trajectory_id.instance_id
            if q in self._seen_ids:
                raise ValueError(
                    f"{_where(i, s)}: instance_id {q!r} was already sampled in round {self._seen_ids[q]}; "
                    "give every sampling round distinct instance ids"
                )
            groups.setdefault(q, []).append(s)
        self.rounds += 1
        self._vocab_size = self._vocab_size or batch.vocab_size
        keep = informative_groups(batch, atol=self.atol, reward_mode=self.reward_mode)
        ok = ~errored_steps(batch)
        rewards = trajectory_rewards([s for s, o in zip(batch, ok, strict=True) if s.is_last_step and o])
        self.trajectories_seen += rewards.shape[0]
        self._reward_sum += float(rewards.sum())
        for q, steps in groups.items():
            self._seen_ids[q] = self.rounds
            self.groups_seen += 1
            if keep[q] and len(self._kept) < self.target_groups:
                self._kept[q] = steps
        return self.done

    def result(self) -> tuple[StepBatch, dict[str, float]]:
        """The collected groups (at most ``target_groups``) as one batch, and metrics."""
        if len(self._kept) < self.target_groups and self.strict:
            raise ValueError(
                f"dynamic sampling collected {len(self._kept)} of {self.target_groups} groups with reward "
                f"variance after {self.rounds} of max_rounds={self.max_rounds} rounds; raise max_rounds, "
                "lower target_groups, check the reward function, or pass strict=False to train on fewer "
                "groups"
            )
        steps = [s for group in self._kept.values() for s in group]
        kept = len(self._kept)
        metrics = {
            "dynamic_sampling/rounds": self.rounds,
            "dynamic_sampling/groups_seen": self.groups_seen,
            "dynamic_sampling/groups_kept": kept,
            "dynamic_sampling/groups_discarded": self.groups_seen - kept,
            "dynamic_sampling/kept_fraction": kept / self.groups_seen if self.groups_seen else 0.0,
            "dynamic_sampling/exhausted": float(kept < self.target_groups),
            "dynamic_sampling/reward_mean_seen": (  # over trajectories that did not error
                self._reward_sum / self.trajectories_seen if self.trajectories_seen else 0.0
            ),
        }
        return StepBatch(steps, vocab_size=self._vocab_size), metrics
