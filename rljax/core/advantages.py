"""Advantage estimators, length shaping and the step-wise broadcast (pure jax).

Group-relative estimators (:func:`grpo`, :func:`rloo`, :func:`max_rl`) map one scalar
reward per trajectory to one scalar advantage, grouped by a dense prompt-group id with a
static ``num_groups`` (design §3.1). They share the signature
``fn(rewards, group_ids, num_groups, **kwargs) -> [N]``.

**Registry.** Every estimator is registered as one :class:`Estimator` value (function,
hyperparameter defaults, kind ``"group"`` or ``"token"``, ``needs_critic``); see
:data:`ESTIMATORS`. ``rljax.algorithms``, config validation and the host step-wise
advantages read it, and the estimator / reward-mode rule
(:func:`check_estimator_reward_mode`) is derived from it, so an estimator added with
:func:`register_estimator` works everywhere a built-in one does.

Shared conventions:

* **Group of one -> 0** (Decision; SkyRL returns the raw reward) and **all-equal group -> 0**
  (exactly, not ``~0/eps``).
* **Padding**: entries whose group id is outside ``[0, num_groups)`` get advantage 0 and do
  not influence any real group; alternatively give padding a group id that no real entry
  uses (it is then its own group and real results are unchanged).

Token-level estimators (:func:`reinforce_pp`, :func:`gae`) run a reverse :func:`jax.lax.scan`
along the last axis of ``[B, L]`` rows; each row is one sequence (the recursion restarts at
the row end). Positions with ``mask == 0`` (prompt, observation, padding) are **not time
steps**: the recursion carries straight through them (so observation tokens of a merged
multi-turn sample do not cut credit assignment, unlike verl's reset-on-mask), rewards
placed on them are ignored, and their outputs are 0.

References are given per function; the formulas are design §2.3, §2.4 and §3.1.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rljax.core import registry, segments

__all__ = [
    "ESTIMATORS",
    "ESTIMATOR_KINDS",
    "REWARD_MODES",
    "Estimator",
    "broadcast_to_steps",
    "check_estimator_reward_mode",
    "get_estimator",
    "is_group_estimator",
    "list_estimators",
    "register_estimator",
    "gae",
    "grpo",
    "length_penalty",
    "length_shaped_rewards",
    "masked_whiten",
    "max_rl",
    "reinforce_pp",
    "rloo",
    "token_returns",
    "turn_returns",
]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _static_int(value: int, name: str) -> int:
    try:
        n = operator.index(value)
    except TypeError as e:
        raise ValueError(
            f"{name} must be a static Python int, got {value!r}; mark it static under jit "
            f"(functools.partial or static_argnames=('{name}',))."
        ) from e
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}; pad it to a bucket of at least one group.")
    return n


def _check_group_inputs(rewards: chex.Array, group_ids: chex.Array, num_groups: int) -> int:
    chex.assert_rank([rewards, group_ids], 1)
    chex.assert_equal_shape([rewards, group_ids])
    chex.assert_type(rewards, float)
    chex.assert_type(group_ids, int)
    return _static_int(num_groups, "num_groups")


def _group_stats(rewards: chex.Array, group_ids: chex.Array, num_groups: int):
    """Per-entry (mean, count, degenerate) of its group; degenerate = n <= 1 or all equal."""
    mean = segments.segment_gather(segments.segment_mean(rewards, group_ids, num_groups), group_ids)
    count = segments.segment_gather(segments.segment_count(rewards, group_ids, num_groups), group_ids)
    hi = segments.segment_gather(segments.segment_max(rewards, group_ids, num_groups), group_ids)
    lo = segments.segment_gather(segments.segment_min(rewards, group_ids, num_groups), group_ids)
    degenerate = (count <= 1) | (hi == lo)  # out-of-range ids: count 0 -> degenerate
    return mean, count, degenerate


# --------------------------------------------------------------------------------------------
# group-relative estimators
# --------------------------------------------------------------------------------------------
def grpo(
    rewards: chex.Array,
    group_ids: chex.Array,
    num_groups: int,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> chex.Array:
    """GRPO group-normalized advantage.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased (N-1) group std; with
    ``norm_by_std=False`` (Dr. GRPO) ``A_i = r_i - mean_g``. Groups of one and groups whose
    rewards are all equal get exactly 0.

    References: Shao et al. 2024, DeepSeekMath (arXiv:2402.03300); Liu et al. 2025,
    Understanding R1-Zero-Like Training (Dr. GRPO, arXiv:2503.20783).

    Args:
      rewards: float ``[N]`` one scalar reward per trajectory.
      group_ids: int ``[N]`` dense group (prompt) id in ``[0, num_groups)``.
      num_groups: static number of groups (may be a padded bucket).
      norm_by_std: divide by the group std.
      eps: added to the std.

    Returns:
      float ``[N]`` advantages.

    >>> import jax.numpy as jnp
    >>> grpo(jnp.array([1.0, 0.0, 5.0]), jnp.array([0, 0, 1]), 2, norm_by_std=False).tolist()
    [0.5, -0.5, 0.0]
    """
    num_groups = _check_group_inputs(rewards, group_ids, num_groups)
    mean, _, degenerate = _group_stats(rewards, group_ids, num_groups)
    centered = rewards - mean
    if norm_by_std:
        std = segments.segment_gather(segments.segment_std(rewards, group_ids, num_groups), group_ids)
        centered = centered / (std + eps)
    return jnp.where(degenerate, jnp.zeros_like(centered), centered)


def rloo(rewards: chex.Array, group_ids: chex.Array, num_groups: int) -> chex.Array:
    """REINFORCE leave-one-out advantage.

    ``A_i = r_i - mean_{j != i, j in g} r_j = (r_i - mean_g) * n_g / (n_g - 1)``; groups of
    one (no other sample to form a baseline) and all-equal groups get 0.

    References: Kool et al. 2019, Buy 4 REINFORCE Samples, Get a Baseline for Free!;
    Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740).

    >>> import jax.numpy as jnp
    >>> rloo(jnp.array([1.0, 0.0, 0.0, 0.0]), jnp.array([0, 0, 0, 0]), 1).tolist()
    [1.0, -0.3333333432674408, -0.3333333432674408, -0.3333333432674408]
    """
    num_groups = _check_group_inputs(rewards, group_ids, num_groups)
    mean, count, degenerate = _group_stats(rewards, group_ids, num_groups)
    n = count.astype(rewards.dtype)
    adv = (rewards - mean) * segments.safe_div(n, n - 1, where=~degenerate)
    return jnp.where(degenerate, jnp.zeros_like(adv), adv)


def max_rl(rewards: chex.Array, group_ids: chex.Array, num_groups: int) -> chex.Array:
    """MaxRL (maximum-likelihood) advantage: normalize by the group mean reward.

    ``A_i = (r_i - mean_g) / mean_g`` if ``mean_g > 0`` else 0. For binary rewards ``mean_g``
    is the empirical pass rate ``p``, and ``grad log p = grad p / p``: the REINFORCE estimate
    of ``grad p`` (baseline ``mean_g``) divided by ``p`` ascends the log-likelihood of success
    instead of the success rate. Groups of one and all-equal groups get 0 (design §3.1).

    >>> import jax.numpy as jnp
    >>> max_rl(jnp.array([1.0, 0.0, 0.0, 0.0]), jnp.array([0, 0, 0, 0]), 1).tolist()
    [3.0, -1.0, -1.0, -1.0]
    """
    num_groups = _check_group_inputs(rewards, group_ids, num_groups)
    mean, _, degenerate = _group_stats(rewards, group_ids, num_groups)
    adv = segments.safe_div(rewards - mean, mean, where=(mean > 0) & ~degenerate)
    return adv


# --------------------------------------------------------------------------------------------
# length shaping (prime-rl "linear")
# --------------------------------------------------------------------------------------------
def length_shaped_rewards(
    rewards: chex.Array,
    output_lengths: chex.Array,
    input_lengths: chex.Array,
    num_turns: chex.Array,
    group_ids: chex.Array,
    num_groups: int,
    *,
    w_out: float = 0.25,
    w_in: float = 0.1,
    w_turn: float = 0.1,
) -> chex.Array:
    """Group-relative linear length shaping of the rewards (prime-rl "linear").

    Within each group ``g``::

        frac_i   = w_out * out_i / max_g(out) + w_in * in_i / max_g(in) + w_turn * turns_i / max_g(turns)
        shaped_i = r_i - mean_g(r) * frac_i

    where every ``max_g`` is floored at 1. ``out`` is the number of generated (response)
    tokens, ``in`` the number of NON-generated tokens of the trajectory (prompt plus
    observations, i.e. ``total - out``), ``turns`` the number of LLM turns. Longer / more
    expensive trajectories lose a fraction of the group's mean reward.

    >>> import jax.numpy as jnp
    >>> ones = jnp.ones(2)
    >>> shaped = length_shaped_rewards(jnp.array([1.0, 0.0]), jnp.array([10.0, 5.0]), ones, ones,
    ...                                jnp.array([0, 0]), 1)
    >>> [round(float(x), 6) for x in shaped]
    [0.775, -0.1625]
    """
    num_groups = _check_group_inputs(rewards, group_ids, num_groups)
    chex.assert_equal_shape([rewards, output_lengths, input_lengths, num_turns])

    def relative(v: chex.Array) -> chex.Array:
        v = v.astype(rewards.dtype)
        vmax = segments.segment_max(v, group_ids, num_groups)
        return v / segments.segment_gather(jnp.maximum(vmax, 1.0), group_ids, fill_value=1.0)

    frac = w_out * relative(output_lengths) + w_in * relative(input_lengths) + w_turn * relative(num_turns)
    mean = segments.segment_gather(segments.segment_mean(rewards, group_ids, num_groups), group_ids)
    return rewards - mean * frac


def length_penalty(
    rewards: chex.Array,
    output_lengths: chex.Array,
    input_lengths: chex.Array,
    num_turns: chex.Array,
    group_ids: chex.Array,
    num_groups: int,
    *,
    w_out: float = 0.25,
    w_in: float = 0.1,
    w_turn: float = 0.1,
) -> chex.Array:
    """Length-penalized group advantage: ``A_i = shaped_i - mean_g(shaped)``.

    ``shaped`` is :func:`length_shaped_rewards`; equivalently ``grpo(shaped,
    norm_by_std=False)`` up to the all-equal rule. design §3.1 check (one group, ``in =
    total - out``)::

        r=[1,0,1,0], out=[100,50,200,100], total=[150,100,300,120], turns=[1,1,2,1]
        -> A=[0.5165625, -0.4521875, 0.4040625, -0.4684375]

    >>> import jax.numpy as jnp
    >>> out = jnp.array([100.0, 50.0, 200.0, 100.0])
    >>> total = jnp.array([150.0, 100.0, 300.0, 120.0])
    >>> a = length_penalty(jnp.array([1.0, 0.0, 1.0, 0.0]), out, total - out,
    ...                    jnp.array([1.0, 1.0, 2.0, 1.0]), jnp.zeros(4, jnp.int32), 1)
    >>> [round(float(x), 7) for x in a]
    [0.5165625, -0.4521875, 0.4040625, -0.4684375]
    """
    shaped = length_shaped_rewards(
        rewards,
        output_lengths,
        input_lengths,
        num_turns,
        group_ids,
        num_groups,
        w_out=w_out,
        w_in=w_in,
        w_turn=w_turn,
    )
    mean = segments.segment_gather(segments.segment_mean(shaped, group_ids, num_groups), group_ids)
    valid = (group_ids >= 0) & (group_ids < num_groups)
    return jnp.where(valid, shaped - mean, jnp.zeros_like(shaped))


# --------------------------------------------------------------------------------------------
# token-level estimators
# --------------------------------------------------------------------------------------------
def masked_whiten(x: chex.Array, mask: chex.Array, *, eps: float = 1e-8) -> chex.Array:
    """Whitens ``x`` over all positions where ``mask`` is 1 (batch-level, any shape).

    ``mu = sum(x m) / sum(m)``, ``var = sum((x - mu)^2 m) / (sum(m) - 1)`` (unbiased),
    ``y = (x - mu) * rsqrt(var + eps) * m``; ``mask`` is read as boolean (nonzero = keep).
    **Convention:** with ``sum(m) <= 1`` the variance
    is taken as 0 (verl raises); the output is then 0 everywhere.

    >>> import jax.numpy as jnp
    >>> [round(float(v), 5) for v in masked_whiten(jnp.array([1.0, 3.0, 100.0]), jnp.array([1, 1, 0]))]
    [-0.70711, 0.70711, 0.0]
    """
    chex.assert_equal_shape([x, mask])
    chex.assert_type(x, float)
    keep = mask != 0
    n = jnp.sum(keep).astype(x.dtype)
    mean = jnp.sum(jnp.where(keep, x, 0.0)) / jnp.maximum(n, 1.0)
    centered = jnp.where(keep, x - mean, jnp.zeros_like(x))
    var = jnp.where(n > 1, jnp.sum(centered * centered) / jnp.maximum(n - 1.0, 1.0), 0.0)
    return centered * jax.lax.rsqrt(var + eps)


def _reverse_scan_rows(step_fn, init, *row_arrays: chex.Array) -> Any:
    """Runs ``step_fn(carry, columns) -> (carry, out_columns)`` from the last column to the first;
    the outputs (an array or a tuple of arrays) come back as ``[B, L]``."""
    columns = tuple(jnp.swapaxes(a, 0, 1) for a in row_arrays)  # [L, B]
    _, out = jax.lax.scan(step_fn, init, columns, reverse=True)
    return jax.tree.map(lambda o: jnp.swapaxes(o, 0, 1), out)


def token_returns(token_rewards: chex.Array, mask: chex.Array, *, gamma: float = 1.0) -> chex.Array:
    """Discounted reward-to-go along each row, over trainable positions only.

    ``ret_t = r_t + gamma * ret_{t'}`` where ``t'`` is the next position with ``mask = 1``
    in the same row (0 past the row end). Masked positions are not time steps: their
    rewards are ignored and their output is 0.

    >>> import jax.numpy as jnp
    >>> token_returns(jnp.array([[0.0, 0.0, 9.0, 1.0]]), jnp.array([[1, 0, 1, 1]]), gamma=0.5).tolist()
    [[4.75, 0.0, 9.5, 1.0]]
    """
    chex.assert_rank([token_rewards, mask], 2)
    chex.assert_equal_shape([token_rewards, mask])
    chex.assert_type(token_rewards, float)
    m = mask.astype(bool)

    def step(carry, col):
        r, keep = col
        ret = jnp.where(keep, r + gamma * carry, carry)
        return ret, jnp.where(keep, ret, jnp.zeros_like(ret))

    init = jnp.zeros(token_rewards.shape[:1], token_rewards.dtype)
    return _reverse_scan_rows(step, init, token_rewards, m)


def reinforce_pp(token_rewards: chex.Array, mask: chex.Array, *, gamma: float = 1.0) -> chex.Array:
    """REINFORCE++ advantages: token returns, then masked whitening over the whole batch.

    ``A = masked_whiten(token_returns(r, m, gamma), m)``; each row is one sequence (returns
    restart at the row end). Masked positions carry the return through (Decision, see the
    module docstring) and get advantage 0.

    Reference: Hu 2025, REINFORCE++ (arXiv:2501.03262).

    >>> import jax.numpy as jnp
    >>> adv = reinforce_pp(jnp.array([[0.0, 1.0], [0.0, 0.0]]), jnp.array([[1, 1], [1, 0]]))
    >>> [[round(float(x), 5) for x in row] for row in adv]
    [[0.57735, 0.57735], [-1.1547, 0.0]]
    """
    returns = token_returns(token_rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask)


def gae(
    token_rewards: chex.Array,
    values: chex.Array,
    mask: chex.Array,
    segment_ids: chex.Array | None = None,
    links: chex.Array | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[chex.Array, chex.Array]:
    """Generalized advantage estimation over trainable positions of each row, optionally
    continued across rows and samples along ``links``.

    With ``t'`` the next position with ``mask = 1`` in the row (``V_{t'} = A_{t'} = 0`` past
    the row end, and, when ``segment_ids`` is given, past the end of the position's segment:
    samples packed into one row never bootstrap from each other)::

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        returns = A + V            (before whitening)
        adv     = masked_whiten(A, mask)

    Masked positions are skipped: their values never enter a ``delta`` (no leakage from
    observation tokens or padding), and both outputs are 0 there.

    ``links`` (int ``[K, 2]``, rows ``(src, dst)`` of flat indices into the row-major ``[B * L]``
    arrays; rows with a negative entry are ignored) chain pieces of one trajectory that sit in
    different samples or rows: for each link, ``t' = dst`` for the trained position ``src``, which
    then no longer bootstraps from the positions after it in its own row. This is the
    recursion above along the trajectory's trained tokens in time order, whatever the layout
    (design §2.4). ``src`` and ``dst`` must be trained positions, each ``src`` at most once, and
    following links must never come back to a position (links go forward in time). The chains
    are resolved in ``ceil(log2(K + 1))`` pointer-jumping steps over ``K``.

    Reference: Schulman et al. 2016, High-Dimensional Continuous Control Using GAE
    (arXiv:1506.02438).

    Returns:
      ``(advantages, returns)``, both ``[B, L]``.

    >>> import jax.numpy as jnp
    >>> adv, ret = gae(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.25]]), jnp.array([[1, 1]]))
    >>> ret.tolist()
    [[1.0, 1.0]]
    >>> # one trajectory in two samples (segments 1 and 2): position 1 continues at position 2
    >>> r, v, m = jnp.array([[0.0, 0.0, 1.0]]), jnp.zeros((1, 3)), jnp.ones((1, 3))
    >>> gae(r, v, m, jnp.array([[1, 1, 2]]), jnp.array([[1, 2]]))[1].tolist()
    [[1.0, 1.0, 1.0]]
    """
    chex.assert_rank([token_rewards, values, mask], 2)
    chex.assert_equal_shape([token_rewards, values, mask])
    chex.assert_type([token_rewards, values], float)
    m = mask.astype(bool)
    segs = jnp.zeros(mask.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    chex.assert_equal_shape([segs, mask])
    size = mask.shape[0] * mask.shape[1]
    if links is None:
        src = dst = jnp.zeros((0,), jnp.int32)
    else:
        links = jnp.asarray(links, jnp.int32)
        chex.assert_rank(links, 2)
        chex.assert_axis_dimension(links, 1, 2)
        chex.assert_type(links, int)
        valid = jnp.all(links >= 0, axis=1) & jnp.all(links < size, axis=1)
        src = jnp.where(valid, links[:, 0], size)  # out of range: dropped by the scatters below
        dst = jnp.where(valid, links[:, 1], size)
    cut = jnp.zeros(size, bool).at[src].set(True, mode="drop").reshape(mask.shape)
    values = values.astype(token_rewards.dtype)
    raw_adv, run_end, after = _gae_runs(token_rewards, values, m, segs, cut, gamma=gamma, lam=lam)
    if links is not None:
        raw_adv = raw_adv + _linked_bootstrap(raw_adv, values, m, run_end, after, src, dst, gamma, lam)
    returns = (raw_adv + values) * m.astype(values.dtype)
    return masked_whiten(raw_adv, mask), returns


def _gae_runs(
    token_rewards: chex.Array,
    values: chex.Array,
    keep: chex.Array,
    segs: chex.Array,
    cut: chex.Array,
    *,
    gamma: float,
    lam: float,
) -> tuple[chex.Array, chex.Array, chex.Array]:
    """GAE within runs: a run is a maximal stretch of a segment's trained positions that ends at
    the segment's last trained position or at a ``cut`` position (a link's ``src``), with no
    bootstrap past its end. Returns ``[B, L]`` advantages, the flat index of each trained
    position's run end (-1 off the mask), and the number of trained positions after it in its run."""
    rows, width = keep.shape
    flat = jnp.arange(rows * width, dtype=jnp.int32).reshape(rows, width)

    def step(carry, col):
        next_value, next_adv, next_seg, end, count = carry
        r, v, k, seg, c, pos = col
        fresh = (seg != next_seg) | c  # a new run (read right to left) starts from zeros
        next_value = jnp.where(fresh, 0.0, next_value)
        next_adv = jnp.where(fresh, 0.0, next_adv)
        end = jnp.where(fresh, -1, end)
        count = jnp.where(fresh, 0, count)
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        mine = jnp.where(end >= 0, end, pos)
        carry = (
            jnp.where(k, v, next_value),
            jnp.where(k, adv, next_adv),
            seg,
            jnp.where(k, mine, end),
            jnp.where(k, count + 1, count),
        )
        return carry, (jnp.where(k, adv, jnp.zeros_like(adv)), jnp.where(k, mine, -1), jnp.where(k, count, 0))

    zeros = jnp.zeros((rows,), token_rewards.dtype)
    ints = jnp.zeros((rows,), jnp.int32)
    init = (zeros, zeros, jnp.full((rows,), -1, jnp.int32), ints - 1, ints)
    return _reverse_scan_rows(step, init, token_rewards, values, keep, segs, cut, flat)


def _linked_bootstrap(
    raw_adv: chex.Array,
    values: chex.Array,
    keep: chex.Array,
    run_end: chex.Array,
    after: chex.Array,
    src: chex.Array,
    dst: chex.Array,
    gamma: float,
    lam: float,
) -> chex.Array:
    """What the links add to the run-local advantages ``a``: ``(gamma lam)^d_t * E_k`` for a
    trained position ``t`` with ``d_t`` trained positions after it in its run, whose run ends at
    the ``src`` of link ``k``, where ``E_k = gamma V_dst + gamma lam A_dst`` is what that ``src``
    bootstraps from. ``A_dst = a_dst + (gamma lam)^d_dst E_k'`` (``k'`` the link leaving ``dst``'s
    run) makes ``E`` affine along each chain, ``E_k = b_k + m_k E_k'``, solved by pointer jumping."""
    size = raw_adv.size
    num = src.shape[0]
    a, v, end, d = (x.reshape(-1) for x in (raw_adv, values, run_end, after))
    link_at = jnp.full((size,), num, jnp.int32).at[src].set(jnp.arange(num, dtype=jnp.int32), mode="drop")
    gl = gamma * lam
    on = dst < size
    at = jnp.minimum(dst, size - 1)
    b = jnp.where(on, gamma * (v[at] + lam * a[at]), 0.0)
    mult = jnp.where(on, gamma * lam * jnp.power(gl, d[at]), 0.0)
    nxt = jnp.where(on & (end[at] >= 0), link_at[jnp.maximum(end[at], 0)], num)
    b, mult = jnp.append(b, 0.0).astype(a.dtype), jnp.append(mult, 0.0).astype(a.dtype)
    nxt = jnp.append(nxt, num)  # the terminal entry: E = 0, points to itself
    for _ in range(max(num, 1).bit_length()):  # 2^steps > num: every chain reaches the terminal
        b, mult, nxt = b + mult * b[nxt], mult * mult[nxt], nxt[nxt]
    k = jnp.where(end >= 0, link_at[jnp.maximum(end, 0)], num)
    out = jnp.where(keep.reshape(-1), jnp.power(gl, d) * b[k], 0.0)
    return out.reshape(raw_adv.shape).astype(raw_adv.dtype)


# --------------------------------------------------------------------------------------------
# step-wise helpers
# --------------------------------------------------------------------------------------------
def broadcast_to_steps(
    traj_advantages: chex.Array, step_traj_ids: chex.Array, loss_mask: chex.Array
) -> chex.Array:
    """Per-token advantages of steps from per-trajectory scalars (design §2.3.3).

    ``adv[s, t] = A[traj(s)] * loss_mask[s, t]``: every step gets its trajectory's advantage
    on each of ITS OWN trainable tokens (regression against SkyRL issue #1492, where earlier
    steps received the last step's masked row). Steps with an out-of-range trajectory id
    (padding) get 0. Order-free: steps of trajectories may be interleaved.

    Args:
      traj_advantages: float ``[T]``.
      step_traj_ids: int ``[B]`` trajectory of each step row.
      loss_mask: ``[B, L]`` (0/1) padded per-step masks.

    Returns:
      float ``[B, L]``.

    >>> import jax.numpy as jnp
    >>> broadcast_to_steps(jnp.array([2.0, -1.0]), jnp.array([1, 0]), jnp.array([[1, 0], [1, 1]])).tolist()
    [[-1.0, 0.0], [2.0, 2.0]]
    """
    chex.assert_rank([traj_advantages, step_traj_ids, loss_mask], [1, 1, 2])
    chex.assert_equal_shape_prefix([step_traj_ids, loss_mask], 1)
    chex.assert_type([traj_advantages, step_traj_ids], [float, int])
    per_step = segments.segment_gather(traj_advantages, step_traj_ids)
    m = loss_mask.astype(traj_advantages.dtype)
    return jnp.where(m != 0, per_step[:, None] * m, jnp.zeros_like(m))


def turn_returns(
    step_rewards: chex.Array,
    traj_ids: chex.Array,
    turn_ids: chex.Array,
    num_trajectories: int,
    max_turns: int,
    *,
    gamma_turn: float = 1.0,
) -> chex.Array:
    """Turn-level discounted returns for per-step rewards (design §2.4).

    ``G_jk = sum_{i >= k} gamma_turn^(i - k) r_ji`` for step ``k`` of trajectory ``j``.
    Steps may come in any order: they are scattered into a dense ``[num_trajectories,
    max_turns]`` grid by ``(traj_ids, turn_ids)``, a reverse scan over turns accumulates the
    discounted sum, and the result is gathered back. ``(traj, turn)`` pairs must be unique;
    a missing turn counts as reward 0. Entries with an out-of-range trajectory or turn id
    (padding) contribute nothing and get 0.

    Args:
      step_rewards: float ``[N]`` scalar reward of each step.
      traj_ids: int ``[N]`` dense trajectory id in ``[0, num_trajectories)``.
      turn_ids: int ``[N]`` turn index of the step within its trajectory, in ``[0, max_turns)``.
      num_trajectories: static (bucketed) number of trajectories.
      max_turns: static (bucketed) number of turns.
      gamma_turn: per-turn discount.

    Returns:
      float ``[N]`` returns.

    >>> import jax.numpy as jnp
    >>> turn_returns(jnp.array([1.0, 2.0, 4.0]), jnp.array([0, 0, 0]), jnp.array([2, 0, 1]), 1, 3,
    ...              gamma_turn=0.5).tolist()
    [1.0, 4.25, 4.5]
    """
    chex.assert_rank([step_rewards, traj_ids, turn_ids], 1)
    chex.assert_equal_shape([step_rewards, traj_ids, turn_ids])
    chex.assert_type([step_rewards, traj_ids, turn_ids], [float, int, int])
    num_trajectories = _static_int(num_trajectories, "num_trajectories")
    max_turns = _static_int(max_turns, "max_turns")
    valid = (traj_ids >= 0) & (traj_ids < num_trajectories) & (turn_ids >= 0) & (turn_ids < max_turns)
    flat = jnp.where(valid, traj_ids * max_turns + turn_ids, num_trajectories * max_turns)
    grid = segments.segment_sum(step_rewards, flat, num_trajectories * max_turns, where=valid)
    grid = grid.reshape(num_trajectories, max_turns)

    def step(carry, r):
        g = r + gamma_turn * carry
        return g, g

    _, returns_t = jax.lax.scan(step, jnp.zeros(num_trajectories, grid.dtype), grid.T, reverse=True)
    return segments.segment_gather(returns_t.T.reshape(-1), flat)


# --------------------------------------------------------------------------------------------
# registry: an estimator is a value (function + hyperparameter defaults + kind)
# --------------------------------------------------------------------------------------------
#: Estimator kinds: ``"group"`` = one scalar per trajectory baselined within its prompt group
#: (outcome estimators); ``"token"`` = per-token returns along each sequence.
ESTIMATOR_KINDS: tuple[str, ...] = ("group", "token")
#: Reward modes of step-wise training (design §2.3 ``"outcome"``, §2.4 ``"per_step"``).
REWARD_MODES: tuple[str, ...] = ("outcome", "per_step")


@dataclasses.dataclass(frozen=True, eq=False)
class Estimator:
    """An advantage estimator as one value: function, hyperparameter defaults, kind, needs.

    Attributes:
      fn: the estimator. ``kind="group"``: ``fn(rewards [N], group_ids [N], num_groups,
        **hyperparameters) -> [N]`` (group-relative, outcome rewards, design §2.3/§3.1).
        ``kind="token"``: ``fn(token_rewards [B, L], mask [B, L], **hyperparameters) -> [B, L]``,
        or with ``needs_critic`` ``fn(token_rewards, values, mask, **hyperparameters) ->
        (advantages, returns)``.
      kind: ``"group"`` or ``"token"`` (:data:`ESTIMATOR_KINDS`).
      defaults: hyperparameter name -> default; calling the value passes every one of them
        (the registry's defaults are the ones that apply). ``None`` (default): ``fn``'s
        keyword-only parameters with the defaults of its signature, so they are declared once
        (:func:`rljax.core.registry.signature_parts`; positional parameters are data inputs).
      needs_critic: the estimator reads value-head predictions (gae).
      name: set by :func:`register_estimator` (used in error messages).

    Calling an ``Estimator`` calls ``fn`` with the positional arguments unchanged and the
    defaults updated by the keyword arguments (unknown names raise ``ValueError``).

    >>> import jax.numpy as jnp
    >>> est = get_estimator("grpo")
    >>> est.kind, est.defaults["norm_by_std"], est.needs_critic
    ('group', True, False)
    >>> est(jnp.array([1.0, 0.0]), jnp.array([0, 0]), 1, norm_by_std=False).tolist()
    [0.5, -0.5]
    """

    fn: Callable[..., Any]
    kind: str
    defaults: Mapping[str, Any] | None = None
    needs_critic: bool = False
    name: str | None = None

    def __post_init__(self) -> None:
        what = f"estimator {self.label!r}"
        if not callable(self.fn):
            raise ValueError(f"{what}: fn must be callable, got {self.fn!r}")
        if self.kind not in ESTIMATOR_KINDS:
            raise ValueError(f"{what}: kind must be one of {ESTIMATOR_KINDS}, got {self.kind!r}")
        if not isinstance(self.needs_critic, bool):
            raise ValueError(f"{what}: needs_critic must be a bool, got {self.needs_critic!r}")
        if self.needs_critic and self.kind != "token":
            raise ValueError(f"{what}: a critic gives per-token values, so needs_critic needs kind='token'")
        defaults = registry.signature_parts(self.fn, what)[1] if self.defaults is None else self.defaults
        defaults = registry.freeze_defaults(defaults, what)
        registry.check_required(what, self.fn, defaults)
        object.__setattr__(self, "defaults", defaults)

    @property
    def label(self) -> str:
        """The estimator's name in messages: its registered name, else its function's name."""
        return self.name or getattr(self.fn, "__name__", repr(self.fn))

    @property
    def group_relative(self) -> bool:
        """True for ``kind="group"`` (baselines within prompt groups)."""
        return self.kind == "group"

    def resolve(self, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Validates ``kwargs``; returns every hyperparameter (defaults updated by ``kwargs``).

        >>> get_estimator("gae").resolve({"lam": 0.95})
        {'gamma': 1.0, 'lam': 0.95}
        """
        kw = dict(kwargs or {})
        registry.check_hyperparameters(f"estimator {self.label!r}", kw, self.defaults)
        return {**self.defaults, **kw}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **self.resolve(kwargs))


_ESTIMATORS: registry.Registry[Estimator] = registry.Registry("estimator")

ESTIMATORS: Mapping[str, Estimator] = _ESTIMATORS.view
"""Read-only live view: name -> :class:`Estimator` (add entries with :func:`register_estimator`)."""


def register_estimator(name: str, estimator: Estimator, *, overwrite: bool = False) -> Estimator:
    """Registers ``estimator`` under ``name`` and returns the registered value (its ``name`` set).

    A ``kind="group"`` estimator then works wherever grpo does: ``Algorithm(...,
    estimator=name)`` (group-relative rules included), step-wise advantages
    (``rljax.data.step_advantages.compute_step_advantages``), length shaping.

    >>> import jax.numpy as jnp
    >>> def centered(rewards, group_ids, num_groups, *, scale):
    ...     return scale * (rewards - segments.segment_gather(
    ...         segments.segment_mean(rewards, group_ids, num_groups), group_ids))
    >>> _ = register_estimator("centered", Estimator(centered, "group", {"scale": 1.0}), overwrite=True)
    >>> get_estimator("centered")(jnp.array([1.0, 0.0]), jnp.array([0, 0]), 1, scale=2.0).tolist()
    [1.0, -1.0]
    >>> is_group_estimator("centered")
    True
    """
    if not isinstance(estimator, Estimator):
        raise ValueError(f"register_estimator expects an Estimator, got {type(estimator).__name__}")
    if estimator.name != name:
        estimator = dataclasses.replace(estimator, name=name)
    return _ESTIMATORS.register(name, estimator, overwrite=overwrite)


def get_estimator(name: str) -> Estimator:
    """The registered :class:`Estimator` ``name`` (``ValueError`` listing the names if unknown).

    >>> get_estimator("gae").needs_critic
    True
    """
    return _ESTIMATORS.get(name)


def list_estimators() -> list[str]:
    """Registered estimator names, sorted.

    >>> {"gae", "grpo", "max_rl", "reinforce_pp", "rloo"} <= set(list_estimators())
    True
    """
    return _ESTIMATORS.names()


def is_group_estimator(name: str) -> bool:
    """True when ``name`` is a registered group-relative (``kind="group"``) estimator.

    >>> is_group_estimator("rloo"), is_group_estimator("gae"), is_group_estimator("nope")
    (True, False, False)
    """
    est = ESTIMATORS.get(name) if isinstance(name, str) else None
    return est is not None and est.kind == "group"


def check_estimator_reward_mode(estimator: str, reward_mode: str, step_wise: bool) -> None:
    """Config-time rule of design §2.2/§2.4: step-wise training with a token-level estimator.

    Token-level estimators (``kind="token"``: gae, reinforce_pp) need a reward per token (or
    per turn); with step-wise samples and outcome rewards (design §2.3) they would see one
    reward at the end of each trajectory only and silently mis-credit earlier turns, so they
    are rejected unless ``reward_mode="per_step"`` (design §2.4). Group estimators (grpo, rloo,
    max_rl and any registered ``kind="group"`` one) work in either mode.

    >>> check_estimator_reward_mode("gae", "per_step", True)
    >>> try:
    ...     check_estimator_reward_mode("gae", "outcome", True)
    ... except ValueError as e:
    ...     print(str(e)[:58])
    estimator 'gae' is not an outcome estimator and cannot run
    """
    est = get_estimator(estimator)
    if reward_mode not in REWARD_MODES:
        raise ValueError(f"unknown reward_mode {reward_mode!r}; choose one of {list(REWARD_MODES)}")
    if not isinstance(step_wise, (bool, np.bool_)):
        raise ValueError(f"step_wise must be a bool, got {step_wise!r}")
    if step_wise and est.kind == "token" and reward_mode != "per_step":
        groups = [n for n in list_estimators() if is_group_estimator(n)]
        raise ValueError(
            f"estimator {estimator!r} is not an outcome estimator and cannot run step-wise with "
            f"reward_mode={reward_mode!r}: set reward_mode='per_step' (design §2.4), or use an outcome "
            f"estimator ({groups}), or train non-step-wise"
        )


# Defaults come from each function's signature (design §3.6b), the one place they are written.
for _name, _est in {
    "grpo": Estimator(grpo, "group"),
    "rloo": Estimator(rloo, "group"),
    "max_rl": Estimator(max_rl, "group"),
    "reinforce_pp": Estimator(reinforce_pp, "token"),
    "gae": Estimator(gae, "token", needs_critic=True),
}.items():
    register_estimator(_name, _est)
del _name, _est
