"""Trajectory / group indices and segment reductions (pure jax).

A *segment* is a set of entries that share an integer id in ``[0, num_segments)``: the
steps of one trajectory, the trajectories of one prompt group, the tokens of one packed
sample. All reductions here take a **static** ``num_segments`` (so they compile once per
bucket size) and are built on :func:`jax.ops.segment_sum` / :func:`jax.ops.segment_max`,
never on Python loops or ``reshape(-1, G)``: segments may have different sizes.

Conventions shared by every function of this module:

* ``x``, ``segment_ids`` and ``where`` have one shape, of any rank (``[N]`` entries, or
  ``[R, L]`` tokens of packed rows): a reduction runs over all entries of the array.
* Entries whose id lies outside ``[0, num_segments)`` (negative or too large) are
  *dropped*: they contribute to no segment. Callers use this (or ``where``) for padding.
* ``where`` (optional boolean array shaped like ``x``) masks entries out of the reduction,
  exactly as if their id were out of range.
* Empty segments have sum 0, count 0, mean 0 and std 0.

:func:`safe_div` is the core's one guarded division (``0`` where the denominator is empty).

Reference: design §2.2-§2.3; SkyRL's step-wise broadcast (``cumsum`` of the shifted
``is_last_step``) for :func:`trajectory_index`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

__all__ = [
    "segment_count",
    "segment_gather",
    "segment_max",
    "segment_mean",
    "segment_min",
    "segment_std",
    "segment_sum",
    "safe_div",
    "samples_per_token",
    "trajectory_index",
]


def trajectory_index(is_last_step: chex.Array) -> chex.Array:
    """Dense trajectory index of CONTIGUOUS steps (SkyRL's cumsum form).

    ``index[i] = #{j < i : is_last_step[j]}``: the number of trajectory ends strictly before
    step ``i``. Correct only when all steps of a trajectory are adjacent and each trajectory
    ends with its ``is_last_step=True`` step; for arbitrarily ordered steps derive the index
    from the trajectory ids instead (``rljax.data.step_advantages.dense_ids``).

    Args:
      is_last_step: bool (or 0/1 integer) array ``[B]``.

    Returns:
      int32 array ``[B]``.

    >>> import jax.numpy as jnp
    >>> trajectory_index(jnp.array([False, True, True, False, False, True])).tolist()
    [0, 0, 1, 2, 2, 2]
    """
    chex.assert_rank(is_last_step, 1)
    ends = jnp.asarray(is_last_step).astype(jnp.int32)
    return (jnp.cumsum(ends) - ends).astype(jnp.int32)


def _valid(segment_ids: chex.Array, num_segments: int, where: chex.Array | None) -> chex.Array:
    """Boolean array: entry is inside ``[0, num_segments)`` and not masked out by ``where``."""
    ok = (segment_ids >= 0) & (segment_ids < num_segments)
    if where is not None:
        chex.assert_equal_shape([segment_ids, where])
        ok = ok & jnp.asarray(where).astype(bool)
    return ok


def safe_div(num: chex.Array, den: chex.Array, where: chex.Array | None = None) -> chex.Array:
    """``num / den`` where ``where`` (default ``den > 0``) holds, else 0.

    Neither branch ever divides by zero, so values AND gradients stay finite (a plain
    ``jnp.where(ok, num / den, 0)`` has a NaN gradient where ``den = 0``). Shapes broadcast.

    >>> import jax.numpy as jnp
    >>> safe_div(jnp.array([1.0, 1.0]), jnp.array([4.0, 0.0])).tolist()
    [0.25, 0.0]
    >>> safe_div(jnp.array(3.0), jnp.array(2.0), where=jnp.array(False)).tolist()
    0.0
    """
    num, den = jnp.asarray(num), jnp.asarray(den)
    ok = den > 0 if where is None else jnp.asarray(where)
    return jnp.where(ok, num / jnp.where(ok, den, jnp.ones_like(den)), jnp.zeros_like(num))


def _check(x: chex.Array, segment_ids: chex.Array, num_segments: int) -> None:
    chex.assert_equal_shape([x, segment_ids])
    chex.assert_type(segment_ids, int)
    if not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(
            f"num_segments must be a static Python int >= 1, got {num_segments!r}; pass the (bucketed) "
            "number of segments as a static argument (e.g. functools.partial or static_argnames)."
        )


def segment_sum(
    x: chex.Array, segment_ids: chex.Array, num_segments: int, *, where: chex.Array | None = None
) -> chex.Array:
    """Per-segment sum ``S_g = sum_{i : id_i = g, where_i} x_i``.

    The one segment sum of the core (the objective's per-sample counts, the off-policy
    sequence statistics and GSPO's sequence mean all use it).

    Args:
      x: values, any shape (``[N]``, or ``[R, L]`` tokens).
      segment_ids: int array shaped like ``x``: segment of each entry (out of range -> dropped).
      num_segments: static number of segments ``G``.
      where: optional bool array shaped like ``x``; False entries are dropped.

    Returns:
      ``[G]`` sums (dtype of ``x``).

    >>> import jax.numpy as jnp
    >>> segment_sum(jnp.array([1.0, 2.0, 3.0]), jnp.array([0, 1, 0]), 2).tolist()
    [4.0, 2.0]
    >>> segment_sum(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[0, 1], [1, -1]]), 2).tolist()
    [1.0, 5.0]
    """
    _check(x, segment_ids, num_segments)
    ok = _valid(segment_ids, num_segments, where)
    ids = jnp.where(ok, segment_ids, num_segments)  # num_segments is out of range: dropped
    return jax.ops.segment_sum(jnp.where(ok, x, jnp.zeros_like(x)).reshape(-1), ids.reshape(-1), num_segments)


def segment_count(
    x: chex.Array, segment_ids: chex.Array, num_segments: int, *, where: chex.Array | None = None
) -> chex.Array:
    """Per-segment number of (unmasked) entries ``n_g = #{i : id_i = g, where_i}``.

    ``x`` only fixes the shape (kept so every reduction has the same signature).

    Returns:
      int32 ``[G]`` counts.

    >>> import jax.numpy as jnp
    >>> segment_count(jnp.zeros(4), jnp.array([0, 1, 0, 1]), 3, where=jnp.array([1, 1, 1, 0])).tolist()
    [2, 1, 0]
    """
    _check(x, segment_ids, num_segments)
    ones = jnp.ones(x.shape, jnp.int32)
    return segment_sum(ones, segment_ids, num_segments, where=where)


def segment_gather(
    segment_values: chex.Array, segment_ids: chex.Array, *, fill_value: float = 0.0
) -> chex.Array:
    """Broadcasts per-segment values back to entries: ``y_i = v[id_i]``.

    Entries whose id is out of range (e.g. padding) get ``fill_value`` (negative ids do
    NOT wrap around, unlike numpy indexing).

    Args:
      segment_values: ``[G, ...]`` one row per segment.
      segment_ids: int array of any shape ``S``.
      fill_value: value for out-of-range ids.

    Returns:
      ``S + segment_values.shape[1:]``.

    >>> import jax.numpy as jnp
    >>> segment_gather(jnp.array([10.0, 20.0]), jnp.array([1, 0, -1, 2])).tolist()
    [20.0, 10.0, 0.0, 0.0]
    """
    chex.assert_rank(segment_values, {1, 2, 3})
    chex.assert_type(segment_ids, int)
    num_segments = segment_values.shape[0]
    ok = (segment_ids >= 0) & (segment_ids < num_segments)
    gathered = segment_values[jnp.clip(segment_ids, 0, num_segments - 1)]
    ok = ok.reshape(ok.shape + (1,) * (segment_values.ndim - 1))
    return jnp.where(ok, gathered, jnp.asarray(fill_value, segment_values.dtype))


def segment_mean(
    x: chex.Array, segment_ids: chex.Array, num_segments: int, *, where: chex.Array | None = None
) -> chex.Array:
    """Per-segment mean ``mu_g = S_g / n_g`` (0 for an empty segment).

    >>> import jax.numpy as jnp
    >>> segment_mean(jnp.array([1.0, 2.0, 3.0]), jnp.array([0, 1, 0]), 3).tolist()
    [2.0, 2.0, 0.0]
    """
    _check(x, segment_ids, num_segments)
    total = segment_sum(x, segment_ids, num_segments, where=where)
    count = segment_count(x, segment_ids, num_segments, where=where).astype(total.dtype)
    return total / jnp.maximum(count, 1)


def segment_std(
    x: chex.Array, segment_ids: chex.Array, num_segments: int, *, where: chex.Array | None = None
) -> chex.Array:
    """Per-segment UNBIASED standard deviation (Bessel, ``N - 1``).

    ``sigma_g = sqrt( sum_{i in g} (x_i - mu_g)^2 / (n_g - 1) )``, computed in two passes
    (the mean is subtracted first) for numerical stability. **Convention:** a segment with
    ``n_g <= 1`` has std 0 (torch would return NaN); this is what makes the group-of-one
    rule of the estimators well defined.

    >>> import jax.numpy as jnp
    >>> segment_std(jnp.array([1.0, 3.0, 5.0]), jnp.array([0, 0, 1]), 2).tolist()
    [1.4142135381698608, 0.0]
    """
    _check(x, segment_ids, num_segments)
    mean = segment_mean(x, segment_ids, num_segments, where=where)
    centered = x - segment_gather(mean, segment_ids)
    sq = segment_sum(centered * centered, segment_ids, num_segments, where=where)
    count = segment_count(x, segment_ids, num_segments, where=where)
    var = sq / jnp.maximum(count - 1, 1).astype(sq.dtype)
    positive = (count > 1) & (var > 0)
    # sqrt only of positive values, so gradients stay finite for constant segments
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), jnp.zeros_like(var))


def segment_max(
    x: chex.Array, segment_ids: chex.Array, num_segments: int, *, where: chex.Array | None = None
) -> chex.Array:
    """Per-segment maximum; an empty segment gets the identity of max (``-inf`` / dtype min).

    >>> import jax.numpy as jnp
    >>> segment_max(jnp.array([1.0, 7.0, 3.0]), jnp.array([0, 0, 1]), 2).tolist()
    [7.0, 3.0]
    """
    _check(x, segment_ids, num_segments)
    ok = _valid(segment_ids, num_segments, where)
    ids = jnp.where(ok, segment_ids, num_segments)
    return jax.ops.segment_max(jnp.asarray(x).reshape(-1), ids.reshape(-1), num_segments)


def segment_min(
    x: chex.Array, segment_ids: chex.Array, num_segments: int, *, where: chex.Array | None = None
) -> chex.Array:
    """Per-segment minimum; an empty segment gets the identity of min (``+inf`` / dtype max).

    >>> import jax.numpy as jnp
    >>> segment_min(jnp.array([1.0, 7.0, 3.0]), jnp.array([0, 0, 1]), 2).tolist()
    [1.0, 3.0]
    """
    _check(x, segment_ids, num_segments)
    ok = _valid(segment_ids, num_segments, where)
    ids = jnp.where(ok, segment_ids, num_segments)
    return jax.ops.segment_min(jnp.asarray(x).reshape(-1), ids.reshape(-1), num_segments)


def samples_per_token(segment_ids: chex.Array, subtree_end: chex.Array | None = None) -> chex.Array:
    """float32 ``[R, L]``: how many packed samples hold each token (0 on padding).

    Plain packed rows (``subtree_end`` None): 1 on every real token (``segment_ids != 0``).
    Prefix-tree rows (design §2.6; each sample's owned tokens are one run of its segment id, and
    ``j``'s subtree is the columns ``[j, subtree_end[j]]``): token ``j`` is on the path of its owner
    and of every sample whose run starts inside its subtree, so with ``S[c]`` the number of runs
    starting at columns ``<= c``, ``count[j] = S[subtree_end[j]] - S[j] + 1``. Weighting a mean over
    tokens by it gives the mean over the samples' tokens that plain packing computes.

    >>> seg = jnp.array([[1, 1, 1, 2, 3, 0]])
    >>> samples_per_token(seg, jnp.array([[4, 4, 2, 3, 4, 0]])).tolist()
    [[3.0, 3.0, 1.0, 1.0, 1.0, 0.0]]
    """
    chex.assert_rank(segment_ids, 2)
    seg = jnp.asarray(segment_ids)
    real = seg != 0
    if subtree_end is None:
        return real.astype(jnp.float32)
    end = jnp.asarray(subtree_end).astype(jnp.int32)
    chex.assert_equal_shape([seg, end])
    starts = real & jnp.concatenate([jnp.ones_like(real[:, :1]), seg[:, 1:] != seg[:, :-1]], axis=1)
    runs = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    inside = jnp.take_along_axis(runs, jnp.clip(end, 0, seg.shape[1] - 1), axis=1) - runs
    return jnp.where(real, inside + 1, 0).astype(jnp.float32)
