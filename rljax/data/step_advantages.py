"""Step-wise advantages on the host: StepBatch -> one per-token advantage array per step.

This module is glue (design §2.3, §2.4): it turns a :class:`~rljax.data.batch.StepBatch` into
dense, bucketed numpy arrays (trajectory index, group index, turn index, padded loss
masks), calls the jitted estimators of :mod:`rljax.core.advantages`, and cuts the padded
result back into one float32 array per step, in batch order. All math lives in the core.

**Order-free (Decision, beyond SkyRL).** The dense trajectory index comes from each step's
``trajectory_id`` (first appearance order), not from ``cumsum(is_last_step)``: steps of
different trajectories may be interleaved arbitrarily and the result for every step is the
same as for a contiguous batch. Within a trajectory, list order is turn order.

**Buckets.** Step rows, response length, trajectories, groups and turns are padded to the
next power of two (at least 8), so the jitted functions compile a bounded number of times.
Padded trajectories / steps get a group id that no real entry uses (one extra group), so
user-defined estimators need no padding logic.

Modes:

* ``reward_mode="outcome"`` (design §2.3, SkyRL semantics): trajectory reward ``R_j`` = total
  reward of its ``is_last_step`` step; earlier rewards are ignored. The group estimator
  runs on ``R`` grouped by ``instance_id`` and every step of trajectory ``j`` gets
  ``A_j * loss_mask[s, t]`` on its own tokens.
* ``reward_mode="per_step"`` (design §2.4): ``G_jk = sum_{i>=k} gamma_turn^(i-k) r_ji`` with
  ``r_jk`` the total reward of turn ``k``; the estimator baselines ``G_jk`` within the
  steps sharing ``(instance_id, k)``. This equals outcome mode when ``gamma_turn = 1``,
  rewards sit on last steps only, AND all trajectories of a group have the same number of
  turns (otherwise late turns have fewer peers; a turn with no peer gets 0).

Token-level estimators with step-wise batches: every registered ``kind="token"`` estimator
without a critic (``reinforce_pp`` built in, or one added with
:func:`rljax.core.advantages.register_estimator`) needs ``reward_mode="per_step"``; each step
is one row whose token rewards are its per-token rewards (a scalar reward sits on its last
trainable token) plus the discounted return of the later turns
``gamma_turn * G_{j,k+1} = G_jk - r_jk`` on its last trainable token; the core estimator then
runs on the ``[rows, width]`` token rewards and loss masks (padded rows and columns have mask
0), e.g. REINFORCE++ (token discount ``gamma``, whitening over the whole batch).
Per-token rewards on a step's masked tokens are ignored within that step (core convention)
but still count in ``r_jk`` and hence in the returns of its earlier turns.
Estimators that need critic values per token (``gae``), which a StepBatch does not carry,
are rejected here; call :func:`rljax.core.advantages.gae` on packed rows instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.core import advantages as core_adv
from rljax.data.validate import validate_steps
from rljax.types import ERROR_STOP_REASONS, Step

__all__ = ["bucket_size", "compute_step_advantages", "dense_ids", "step_turn_returns"]

_LENGTH_PENALTY_KEYS = ("w_out", "w_in", "w_turn")


def dense_ids(keys: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    """Dense ids in order of first appearance: ``(ids int32[len(keys)], number of distinct keys)``.

    >>> ids, n = dense_ids(["b", "a", "b", "c"])
    >>> ids.tolist(), n
    ([0, 1, 0, 2], 3)
    """
    table: dict[Hashable, int] = {}
    ids = np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int32, count=len(keys))
    return ids, len(table)


def bucket_size(n: int, *, minimum: int = 8) -> int:
    """Smallest power of two ``>= max(n, minimum)`` (bounds the number of jit compilations).

    >>> bucket_size(5), bucket_size(9), bucket_size(0)
    (8, 16, 8)
    """
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


# --------------------------------------------------------------------------------------------
# jitted core entry points (cached so repeated calls with the same buckets do not retrace)
# --------------------------------------------------------------------------------------------
_broadcast = jax.jit(core_adv.broadcast_to_steps)
_turn_returns = jax.jit(core_adv.turn_returns, static_argnames=("num_trajectories", "max_turns"))
_shaped_rewards = jax.jit(core_adv.length_shaped_rewards, static_argnames=("num_groups",))


@functools.lru_cache(maxsize=64)
def _jit_estimator(
    fn: Callable[..., Any], static_argnums: tuple[int, ...], static_names: tuple[str, ...]
) -> Callable[..., Any]:
    return jax.jit(fn, static_argnums=static_argnums, static_argnames=static_names)


def _static_names(kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The estimator keywords, which are static under jit (so they must be hashable)."""
    try:
        hash(tuple(kwargs.values()))
    except TypeError as e:
        raise ValueError(
            f"estimator keyword arguments must be hashable Python values (they are static under jit), "
            f"got {kwargs!r}"
        ) from e
    return tuple(sorted(kwargs))


def _checked_shape(fn: Callable[..., Any], out: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    out = np.asarray(out)
    if out.shape != shape:
        name = getattr(fn, "label", None) or getattr(fn, "__name__", fn)
        raise ValueError(f"estimator {name!r} returned shape {out.shape}, expected {shape} ({what})")
    return out


def _run_estimator(
    fn: Callable[..., Any],
    rewards: np.ndarray,
    group_ids: np.ndarray,
    num_groups: int,
    kwargs: dict[str, Any],
) -> np.ndarray:
    jitted = _jit_estimator(fn, (2,), _static_names(kwargs))
    out = jitted(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids, jnp.int32), num_groups, **kwargs)
    return _checked_shape(fn, out, rewards.shape, "one advantage per entry")


# --------------------------------------------------------------------------------------------
# host layout
# --------------------------------------------------------------------------------------------
class _Layout:
    """Dense indices and padded arrays of a list of steps."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.n = len(steps)
        self.traj, self.num_traj = dense_ids([s.trajectory_id for s in steps])
        self.lengths = np.array([len(s.response_ids) for s in steps], np.int64)
        # turn index of each step within its trajectory (list order)
        seen = np.zeros(self.num_traj, np.int32)
        self.turn = np.zeros(self.n, np.int32)
        for i, j in enumerate(self.traj):
            self.turn[i] = seen[j]
            seen[j] += 1
        self.num_turns = seen
        self.rows = bucket_size(self.n)
        self.width = bucket_size(int(self.lengths.max(initial=0)))
        self.mask = np.zeros((self.rows, self.width), np.float32)
        for i, s in enumerate(steps):
            self.mask[i, : self.lengths[i]] = np.asarray(s.loss_mask, np.float32)
        self.step_reward = np.array([s.total_reward for s in steps], np.float32)

    def split(self, padded: np.ndarray) -> list[np.ndarray]:
        """Cuts ``[rows, width]`` back into one float32 array per real step."""
        padded = np.asarray(padded, np.float32)
        return [padded[i, : self.lengths[i]].copy() for i in range(self.n)]


def _pad(values: np.ndarray, size: int, fill: float | int) -> np.ndarray:
    out = np.full((size,), fill, values.dtype)
    out[: values.shape[0]] = values
    return out


def _group_ids_with_padding(ids: np.ndarray, num: int, size: int) -> tuple[np.ndarray, int]:
    """Pads group ids to ``size`` with the fresh id ``num``; returns (ids, bucketed num_groups)."""
    return _pad(ids, size, num).astype(np.int32), bucket_size(num + 1)


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------
def _resolve_estimator(estimator: str | Callable[..., Any], reward_mode: str) -> Callable[..., Any]:
    if callable(estimator):
        return estimator
    if not isinstance(estimator, str):
        raise ValueError(f"estimator must be a name or a callable, got {estimator!r}")
    if estimator not in core_adv.ESTIMATORS:  # the core registry (user-registered ones included)
        raise ValueError(
            f"unknown estimator {estimator!r}; choose one of {core_adv.list_estimators()} "
            "or pass a callable fn(rewards, group_ids, num_groups, **kwargs) -> advantages"
        )
    est = core_adv.get_estimator(estimator)
    if est.group_relative:
        return est  # calling it applies the registered defaults and checks the kwargs
    core_adv.check_estimator_reward_mode(estimator, reward_mode, True)
    if est.needs_critic:
        critic_free = [n for n in core_adv.list_estimators() if not core_adv.get_estimator(n).needs_critic]
        raise ValueError(
            f"estimator {estimator!r} needs critic values for every token, which a StepBatch does not carry; "
            f"compute them with your value head and call rljax.core.advantages.get_estimator({estimator!r}) "
            f"on the packed rows, or use a critic-free estimator ({critic_free})"
        )
    return est  # a token-level estimator: run on per-step token rewards (_per_step_token_level)


def _length_penalty_weights(length_penalty: Any) -> dict[str, float] | None:
    if length_penalty is None:
        return None
    try:
        weights = dict(length_penalty)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"length_penalty must be None or a dict with keys from {_LENGTH_PENALTY_KEYS}, "
            f"got {length_penalty!r}"
        ) from e
    unknown = sorted(set(weights) - set(_LENGTH_PENALTY_KEYS))
    if unknown:
        raise ValueError(
            f"length_penalty has unknown key(s) {unknown}; allowed keys are {_LENGTH_PENALTY_KEYS}"
        )
    for k, v in weights.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"length_penalty[{k!r}] must be a finite number, got {v!r}")
    return {k: float(v) for k, v in weights.items()}


# --------------------------------------------------------------------------------------------
# main entry point
# --------------------------------------------------------------------------------------------
def compute_step_advantages(
    batch: Sequence[Step],
    estimator: str | Callable[..., Any] = "grpo",
    *,
    reward_mode: str = "outcome",
    gamma_turn: float = 1.0,
    length_penalty: Mapping[str, float] | None = None,
    exclude_errored: bool = True,
    **estimator_kwargs: Any,
) -> list[np.ndarray]:
    """Per-token advantages of every step, in batch order (design §2.3, §2.4).

    Args:
      batch: a validated :class:`~rljax.data.batch.StepBatch` (any other sequence of Steps is
        validated first).
      estimator: the name of a registered estimator (``"grpo"``, ``"rloo"``, ``"max_rl"``,
        ``"reinforce_pp"`` or one added with :func:`rljax.core.advantages.register_estimator`;
        token-level ones in per_step mode only, and none that needs a critic), or a
        jit-compatible callable ``fn(rewards, group_ids, num_groups, **kwargs) -> [N]``.
      reward_mode: ``"outcome"`` or ``"per_step"`` (see the module docstring).
      gamma_turn: per-turn discount of ``per_step`` mode, in ``[0, 1]``.
      length_penalty: None, or a dict of weights ``w_out, w_in, w_turn`` (missing keys take
        the defaults 0.25 / 0.1 / 0.1; ``{}`` = all defaults), outcome mode only. The
        trajectory rewards are first shaped by
        :func:`rljax.core.advantages.length_shaped_rewards` within each prompt group, then
        fed to the estimator (with ``grpo(norm_by_std=False)`` this is exactly
        :func:`~rljax.core.advantages.length_penalty`). Per trajectory: ``out`` = response
        tokens summed over its steps, ``in`` = ``max_s(prompt + response tokens) - out``
        (prompt and observation tokens, floored at 0), ``turns`` = its number of steps.
      exclude_errored: trajectories whose last step ended with a stop reason of
        :data:`rljax.types.ERROR_STOP_REASONS` (the rollout marks environment errors "error" and
        engine aborts "abort", with loss mask 0 and reward 0) are left out of every group's
        statistics (their reward 0 would otherwise act as a phantom failure in the baseline) and
        get advantage 0. With False they count like any other trajectory.
      **estimator_kwargs: passed to the estimator (hashable values; static under jit), e.g.
        ``norm_by_std=False`` for grpo or ``gamma=0.99`` for reinforce_pp.

    Returns:
      one float32 array per step, shaped like its ``response_ids``; 0 where ``loss_mask`` is 0.

    >>> from rljax.data import StepBatch
    >>> from rljax.types import Step, TrajectoryID
    >>> b = StepBatch([Step([1], [2, 3], TrajectoryID("q", 0), loss_mask=[1, 0], reward=1.0),
    ...                Step([1], [4], TrajectoryID("q", 1), reward=0.0)])
    >>> [a.tolist() for a in compute_step_advantages(b, "grpo", norm_by_std=False)]
    [[0.5, 0.0], [-0.5]]
    """
    steps = getattr(batch, "steps", None)  # a StepBatch is validated already
    if steps is None:
        steps = tuple(batch)
        validate_steps(steps)  # design §2.2
    if reward_mode not in ("outcome", "per_step"):
        raise ValueError(
            f"unknown reward_mode {reward_mode!r}; choose 'outcome' (design §2.3) or 'per_step' (§2.4)"
        )
    if isinstance(gamma_turn, bool) or not isinstance(gamma_turn, (int, float)) or not 0 <= gamma_turn <= 1:
        raise ValueError(f"gamma_turn must be a number in [0, 1], got {gamma_turn!r}")
    if reward_mode == "outcome" and gamma_turn != 1.0:
        raise ValueError(
            f"gamma_turn={gamma_turn} only applies with reward_mode='per_step'; outcome mode uses the "
            "last step's reward for every step"
        )
    weights = _length_penalty_weights(length_penalty)
    if weights is not None and reward_mode != "outcome":
        raise ValueError(
            "length_penalty shapes trajectory rewards and is supported with reward_mode='outcome' only"
        )
    fn = _resolve_estimator(estimator, reward_mode)
    if not steps:
        return []

    layout = _Layout(steps)
    if isinstance(fn, core_adv.Estimator) and fn.kind == "token":  # per_step mode (checked above)
        if weights is not None:
            raise ValueError(f"length_penalty applies to group estimators, not to {fn.label!r}")
        return _per_step_token_level(steps, layout, fn, gamma_turn, estimator_kwargs)
    errored = _errored_trajectories(steps, layout) if exclude_errored else np.zeros(layout.num_traj, bool)
    if reward_mode == "outcome":
        out = _outcome(steps, layout, fn, weights, estimator_kwargs, errored)
    else:
        out = _per_step(steps, layout, fn, gamma_turn, estimator_kwargs, errored)
    for i in np.flatnonzero(errored[layout.traj]):
        out[i] = np.zeros_like(out[i])
    return out


def _errored_trajectories(steps: Sequence[Step], layout: _Layout) -> np.ndarray:
    """bool[num_traj]: the trajectory's last step ended with an error stop reason."""
    out = np.zeros(layout.num_traj, bool)
    for i, s in enumerate(steps):
        if s.is_last_step and s.stop_reason in ERROR_STOP_REASONS:
            out[layout.traj[i]] = True
    return out


def _outcome(
    steps: Sequence[Step],
    layout: _Layout,
    fn: Callable[..., Any],
    weights: dict[str, float] | None,
    kwargs: dict[str, Any],
    errored: np.ndarray,
) -> list[np.ndarray]:
    num_traj = layout.num_traj
    last = np.array([s.is_last_step for s in steps], bool)
    traj_reward = np.zeros(num_traj, np.float32)
    traj_reward[layout.traj[last]] = layout.step_reward[last]
    first_step = np.full(num_traj, -1, np.int64)
    for i in range(layout.n - 1, -1, -1):
        first_step[layout.traj[i]] = i
    group, num_groups = dense_ids([steps[i].trajectory_id.instance_id for i in first_step])
    group = np.where(errored, num_groups, group)  # errored: the padding group, outside every baseline

    t_rows = bucket_size(num_traj)
    group_ids, g_bucket = _group_ids_with_padding(group, num_groups, t_rows)
    rewards = _pad(traj_reward, t_rows, 0.0)
    if weights is not None:
        out_len = np.bincount(layout.traj, weights=layout.lengths, minlength=num_traj)
        total = np.zeros(num_traj)
        np.maximum.at(total, layout.traj, np.array([s.num_tokens for s in steps], np.float64))
        in_len = np.maximum(total - out_len, 0.0)
        turns = layout.num_turns.astype(np.float64)
        shaped = _shaped_rewards(
            jnp.asarray(rewards),
            *(jnp.asarray(_pad(v.astype(np.float32), t_rows, 0.0)) for v in (out_len, in_len, turns)),
            jnp.asarray(group_ids),
            num_groups=g_bucket,
            **weights,
        )
        rewards = np.asarray(shaped, np.float32)
    traj_adv = _run_estimator(fn, rewards, group_ids, g_bucket, kwargs)
    step_traj = _pad(layout.traj, layout.rows, t_rows).astype(np.int32)  # padded rows: out of range -> 0
    out = _broadcast(jnp.asarray(traj_adv, jnp.float32), jnp.asarray(step_traj), jnp.asarray(layout.mask))
    return layout.split(out)


def _step_returns(layout: _Layout, gamma_turn: float) -> np.ndarray:
    """``G_jk`` of every real step (core.turn_returns on bucketed arrays)."""
    rows = layout.rows
    g = _turn_returns(
        jnp.asarray(_pad(layout.step_reward, rows, 0.0)),
        jnp.asarray(_pad(layout.traj, rows, -1).astype(np.int32)),
        jnp.asarray(_pad(layout.turn, rows, -1).astype(np.int32)),
        num_trajectories=bucket_size(layout.num_traj),
        max_turns=bucket_size(int(layout.num_turns.max())),
        gamma_turn=float(gamma_turn),
    )
    return np.asarray(g, np.float32)[: layout.n]


def step_turn_returns(steps: Sequence[Step], *, gamma_turn: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(G, turn)``: per step (batch order) the turn-level return ``G_jk`` that per_step mode
    baselines (design §2.4; float32, computed by :func:`rljax.core.advantages.turn_returns` as the
    estimators see it) and its turn index ``k`` within its trajectory (list order).

    >>> from rljax.types import Step
    >>> g, k = step_turn_returns([Step([1], [2], ("q", 0), reward=1.0, is_last_step=False),
    ...                           Step([1], [3], ("q", 0), reward=2.0)])
    >>> g.tolist(), k.tolist()
    ([3.0, 2.0], [0, 1])
    """
    if not steps:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int32)
    layout = _Layout(steps)
    return _step_returns(layout, gamma_turn), layout.turn.copy()


def _per_step(
    steps: Sequence[Step],
    layout: _Layout,
    fn: Callable[..., Any],
    gamma_turn: float,
    kwargs: dict[str, Any],
    errored: np.ndarray,
) -> list[np.ndarray]:
    returns = _step_returns(layout, gamma_turn)
    group, num_groups = dense_ids(
        [(s.trajectory_id.instance_id, int(k)) for s, k in zip(steps, layout.turn, strict=True)]
    )
    group = np.where(errored[layout.traj], num_groups, group)  # errored: outside every baseline
    group_ids, g_bucket = _group_ids_with_padding(group, num_groups, layout.rows)
    step_adv = _run_estimator(fn, _pad(returns, layout.rows, 0.0), group_ids, g_bucket, kwargs)
    out = _broadcast(
        jnp.asarray(step_adv, jnp.float32), jnp.arange(layout.rows, dtype=jnp.int32), jnp.asarray(layout.mask)
    )
    return layout.split(out)


def _per_step_token_level(
    steps: Sequence[Step], layout: _Layout, est: core_adv.Estimator, gamma_turn: float, kwargs: dict[str, Any]
) -> list[np.ndarray]:
    """A token-level estimator ``est(token_rewards [rows, width], mask [rows, width], **kwargs)``
    on one row per step (module docstring: the step's rewards plus the later turns' return)."""
    est.resolve(kwargs)  # unknown hyperparameters fail here, with the estimator's name
    future = _step_returns(layout, gamma_turn) - layout.step_reward  # = gamma_turn * G_{j,k+1}
    token_rewards = np.zeros((layout.rows, layout.width), np.float32)
    for i, s in enumerate(steps):
        n = int(layout.lengths[i])
        if n == 0:
            continue
        trainable = np.flatnonzero(layout.mask[i, :n])
        end = int(trainable[-1]) if trainable.size else n - 1
        if s.per_token_reward:
            token_rewards[i, :n] = np.asarray(s.reward, np.float32)
        else:
            token_rewards[i, end] += float(s.reward)
        token_rewards[i, end] += future[i]
    jitted = _jit_estimator(est, (), _static_names(kwargs))
    out = jitted(jnp.asarray(token_rewards), jnp.asarray(layout.mask), **kwargs)
    return layout.split(_checked_shape(est, out, token_rewards.shape, "one advantage per token"))
