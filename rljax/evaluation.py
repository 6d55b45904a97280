"""Evaluation metrics over k samples per task: pass@k, pass^k, mean@k.

With ``n`` samples of a task of which ``c`` are correct:

* ``pass@k = 1 - C(n - c, k) / C(n, k)``: the probability that at least one of k samples drawn
  without replacement from the n is correct; the unbiased estimator of Chen et al. 2021
  ("Evaluating Large Language Models Trained on Code"), computed as the stable product
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``.
* ``pass^k = C(c, k) / C(n, k)``: the probability that all k are correct (tau-bench's reliability
  metric).
* ``mean@k``: the expected fraction of correct samples among k (= ``c / n``, whatever k).

:func:`eval_metrics` turns rollout trajectory records (``RolloutResult.trajectories``) into
``{prefix}/pass@k`` etc., overall, per env (``{prefix}/<env>/pass@k``) and per data source
(``{prefix}/data_source/<source>/pass@k``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["eval_metrics", "is_correct", "mean_at_k", "pass_at_k", "pass_hat_k"]


def _check(num_samples: Any, num_correct: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    n = np.asarray(num_samples)
    c = np.asarray(num_correct)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not (np.issubdtype(n.dtype, np.integer) and np.issubdtype(c.dtype, np.integer)):
        raise ValueError("num_samples and num_correct must be integers")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError(f"need 0 <= num_correct <= num_samples, got {c.tolist()} of {n.tolist()}")
    if np.any(n < k):
        raise ValueError(f"k={k} exceeds num_samples {n.tolist()} (pass@k needs at least k samples)")
    return n, c


def pass_at_k(num_samples: Any, num_correct: Any, k: int) -> Any:
    """Unbiased pass@k (module docstring); scalars or arrays (element-wise).

    >>> round(pass_at_k(10, 3, 1), 6), round(pass_at_k(10, 3, 5), 6), pass_at_k(10, 8, 5)
    (0.3, 0.916667, 1.0)
    """
    n, c = _check(num_samples, num_correct, k)
    out = np.empty(np.broadcast(n, c).shape, dtype=np.float64)
    for idx in np.ndindex(out.shape):
        ni = int(np.broadcast_to(n, out.shape)[idx])
        ci = int(np.broadcast_to(c, out.shape)[idx])
        if ni - ci < k:
            out[idx] = 1.0
        else:
            out[idx] = 1.0 - float(np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1)))
    return float(out) if out.ndim == 0 else out


def pass_hat_k(num_samples: Any, num_correct: Any, k: int) -> Any:
    """pass^k = C(c, k) / C(n, k): all of k samples correct.

    >>> round(pass_hat_k(10, 8, 2), 6)
    0.622222
    """
    n, c = _check(num_samples, num_correct, k)
    out = np.vectorize(lambda ni, ci: math.comb(int(ci), k) / math.comb(int(ni), k), otypes=[float])(n, c)
    return float(out) if np.ndim(out) == 0 else out


def mean_at_k(num_samples: Any, num_correct: Any, k: int) -> Any:
    """mean@k: the expected fraction correct among k samples, ``c / n``.

    >>> mean_at_k(4, 1, 2)
    0.25
    """
    n, c = _check(num_samples, num_correct, k)
    out = c / n
    return float(out) if np.ndim(out) == 0 else out


def is_correct(record: Any, *, threshold: float = 1.0) -> bool:
    """Whether a trajectory record counts as a solve: the env's last ``info["correct"]`` when it
    reports one, else ``reward >= threshold``; errored trajectories never count."""
    if getattr(record, "errored", False):
        return False
    infos = getattr(record, "infos", None) or []
    if infos and isinstance(infos[-1], Mapping) and "correct" in infos[-1]:
        return bool(infos[-1]["correct"])
    return float(record.reward) >= threshold


def eval_metrics(
    records: Iterable[Any],
    tasks: Sequence[Any] | Mapping[str, Any] | None = None,
    *,
    ks: Sequence[int] | None = None,
    prefix: str = "eval",
    correct: Callable[[Any], bool] | None = None,
) -> dict[str, float]:
    """pass@k / pass^k / mean@k from trajectory records (one group of samples per task id).

    Args:
      records: :class:`rljax.rollout.TrajectoryRecord` s (``RolloutResult.trajectories``): each
        has ``trajectory_id.instance_id`` (the task), ``env``, ``reward``, ``infos``, ``errored``.
      tasks: the tasks (list or ``{id: Task}``) for per-``data_source`` metrics; None = none.
      ks: the k values; default ``(1, n)`` with n the smallest number of samples of a task. Tasks
        with fewer than k samples are left out of that k.
      prefix: metric name prefix.
      correct: ``record -> bool``; default :func:`is_correct` (errored samples count as wrong).

    Returns:
      ``{prefix}/pass@k``, ``{prefix}/pass^k``, ``{prefix}/mean@k`` for each k (means over tasks),
      the same under ``{prefix}/<env>/...`` and ``{prefix}/data_source/<source>/...``, plus
      ``{prefix}/num_tasks``, ``{prefix}/num_samples``, ``{prefix}/num_errored``,
      ``{prefix}/reward_mean``.
    """
    correct = correct or is_correct
    by_task: dict[str, list[Any]] = {}
    for r in records:
        by_task.setdefault(r.trajectory_id.instance_id, []).append(r)
    if not by_task:
        return {}
    task_map: Mapping[str, Any] = tasks if isinstance(tasks, Mapping) else {t.id: t for t in (tasks or [])}
    n_min = min(len(v) for v in by_task.values())
    ks = sorted({1, n_min}) if ks is None else sorted(set(int(k) for k in ks))
    rows = []  # (env, data_source, n, c, mean reward)
    for task_id, recs in by_task.items():
        task = task_map.get(task_id)
        source = getattr(task, "data_source", None)
        rows.append(
            (
                recs[0].env,
                source,
                len(recs),
                sum(bool(correct(r)) for r in recs),
                [float(r.reward) for r in recs],
            )
        )
    out: dict[str, float] = {
        f"{prefix}/num_tasks": float(len(rows)),
        f"{prefix}/num_samples": float(sum(r[2] for r in rows)),
        f"{prefix}/num_errored": float(
            sum(getattr(x, "errored", False) for v in by_task.values() for x in v)
        ),
        f"{prefix}/reward_mean": float(np.mean([x for r in rows for x in r[4]])),
    }
    groups: list[tuple[str, list[tuple]]] = [(prefix, rows)]
    for env in sorted({r[0] for r in rows}):
        groups.append((f"{prefix}/{env}", [r for r in rows if r[0] == env]))
    for source in sorted({r[1] for r in rows if r[1] is not None}):
        groups.append((f"{prefix}/data_source/{source}", [r for r in rows if r[1] == source]))
    for name, group in groups:
        for k in ks:
            eligible = [r for r in group if r[2] >= k]
            if not eligible:
                continue
            n = np.array([r[2] for r in eligible])
            c = np.array([r[3] for r in eligible])
            out[f"{name}/pass@{k}"] = float(np.mean(pass_at_k(n, c, k)))
            out[f"{name}/pass^{k}"] = float(np.mean(pass_hat_k(n, c, k)))
            out[f"{name}/mean@{k}"] = float(np.mean(mean_at_k(n, c, k)))
    return out
