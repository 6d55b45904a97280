"""Rollout records: what each recorded call of an RL step was, and how the step trained it.

``config.trainer.save_rollouts_every = N`` writes ``<workdir>/rollouts/step_<S>.jsonl`` for the RL
steps ``S`` with ``S % N == 0``: one JSON object per recorded call (environment rollouts and
gateway agents alike, both from :attr:`rljax.rollout.TrajectoryRecord.calls`)::

    trajectory_id   "<task id>#<repetition>"           turn          index of the call (0, 1, ...)
    env             environment name                   messages      the conversation sent
    completion      the assistant content as returned  reply         the assistant message
    prompt_ids      exact prompt ids                   completion_ids / logprobs (one per token)
    tokens          each completion id decoded alone   reward, stop_reason, weight_version
    sample          id of the merged sample it trained in ("<step>:<n>"; null: not in the batch)
    advantages      per completion token (before merging; [] when not trained)
    advantage       their mean                         loss_mask     per completion token
    status          "trained" | "filtered" | "errored" | "dropped" (of its trajectory)
    trained         status == "trained"                errored       the trajectory errored
    trajectory_reward, end                             the trajectory's reward and how it ended

A file is written whole (temporary file, ``fsync``, rename) before its step's checkpoint commits; a
run resumed from checkpoint ``R`` deletes the files of steps after ``R``
(:func:`drop_rollout_records_after`), which it writes again.

``completion`` is the content the client was answered with when a front door answered one (the
gateway sets ``RecordedCall.returned``), else the decoded completion ids, which is the text the
environment was given. ``sample`` comes from the trainer's own preparation
(:class:`rljax.data.prepare.PreparedSamples` ``sample_of_step``): the calls of a trajectory that
the merge folded into one sample share the id. A trajectory is "filtered" when an enforcing
filter zeroed all its steps, "dropped" when its steps were not in the trained batch (dynamic
sampling discarded its group, or ``rollout.on_error="drop"``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.data.prepare import PreparedSamples
from rljax.report.sinks import SampleTable
from rljax.rollout import TrajectoryRecord
from rljax.types import Step, TrajectoryID

__all__ = [
    "ROLLOUTS_DIR",
    "PreparationTrace",
    "StepTrace",
    "drop_rollout_records_after",
    "read_rollout_records",
    "rollout_distributions",
    "rollout_records",
    "rollouts_path",
    "sample_table",
    "write_rollout_records",
]

#: Folder of a run's workdir holding the rollout records (``step_<S>.jsonl``).
ROLLOUTS_DIR = "rollouts"
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


def rollouts_path(workdir: str | os.PathLike, step: int) -> pathlib.Path:
    """``<workdir>/rollouts/step_<step>.jsonl``."""
    return pathlib.Path(workdir) / ROLLOUTS_DIR / f"step_{int(step)}.jsonl"


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What the preparation did with one step: its merged sample, advantages, whether filtered."""

    sample: str
    advantages: np.ndarray
    filtered: bool


class PreparationTrace:
    """Per ``(trajectory, turn)``, the :class:`StepTrace` of one RL step's preparation.

    The trainer calls :meth:`add` with each algorithm's part of the batch and its
    :class:`~rljax.data.prepare.PreparedSamples`; sample ids are ``"<step>:<k>"`` with ``k`` counting
    the merged samples of the whole RL step (algorithms in the order they were prepared).

    >>> from rljax.algorithms import get_algorithm
    >>> from rljax.data.batch import StepBatch
    >>> from rljax.data.prepare import prepare_samples
    >>> steps = [Step([1], [2], ("q", 0), is_last_step=False), Step([1, 2, 3], [4], ("q", 0), reward=1.0),
    ...          Step([1], [5], ("q", 1))]
    >>> trace = PreparationTrace(step=7)
    >>> trace.add(steps, prepare_samples(get_algorithm("grpo"), StepBatch(steps)))
    >>> [trace.get(TrajectoryID("q", 0), t).sample for t in (0, 1)], trace.get(TrajectoryID("q", 1), 0).sample
    (['7:0', '7:0'], '7:1')
    """

    def __init__(self, step: int) -> None:
        self.step = int(step)
        self._by_key: dict[tuple[TrajectoryID, int], StepTrace] = {}
        self._samples: dict[TrajectoryID, set[str]] = {}
        self._offset = 0

    def add(self, steps: Sequence[Step], prepared: PreparedSamples) -> None:
        """Records the preparation of ``steps`` (one algorithm's part, in batch order)."""
        if len(prepared.sample_of_step) != len(steps):
            raise ValueError(
                f"the preparation traced {len(prepared.sample_of_step)} steps for a part of {len(steps)}"
            )
        turns: dict[TrajectoryID, int] = {}
        for i, s in enumerate(steps):
            turn = turns.get(s.trajectory_id, 0)
            turns[s.trajectory_id] = turn + 1
            sample = f"{self.step}:{self._offset + prepared.sample_of_step[i]}"
            self._by_key[(s.trajectory_id, turn)] = StepTrace(
                sample, np.asarray(prepared.step_advantages[i], np.float64), bool(prepared.step_filtered[i])
            )
            self._samples.setdefault(s.trajectory_id, set()).add(sample)
        self._offset += len(prepared.samples)

    def get(self, trajectory: TrajectoryID, turn: int) -> StepTrace | None:
        """The trace of one trajectory's turn, or None when it was not traced."""
        return self._by_key.get((trajectory, turn))

    def samples_of(self, trajectory: TrajectoryID) -> int:
        """How many merged samples the trajectory's steps trained in (0: not in the batch)."""
        return len(self._samples.get(trajectory, ()))


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(float(x)) else None


def _reward(value: Any) -> Any:
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_json_float(v) for v in np.asarray(value, np.float64).reshape(-1)]
    return _json_float(value)


def _status(rec: TrajectoryRecord, traces: list[StepTrace | None]) -> str:
    if rec.errored:
        return "errored"
    if not traces or any(t is None for t in traces):
        return "dropped"
    return "filtered" if all(t.filtered for t in traces) else "trained"


def rollout_records(trajectories: Iterable[TrajectoryRecord], trace: PreparationTrace | None) -> list[dict]:
    """One record per recorded call of ``trajectories`` (see the module docstring)."""
    out = []
    for rec in trajectories:
        calls = list(rec.calls)
        traces = [trace.get(rec.trajectory_id, t) if trace is not None else None for t in range(len(calls))]
        status = _status(rec, traces)
        for turn, (call, tr) in enumerate(zip(calls, traces, strict=True)):
            ids = [int(i) for i in call.completion.ids]
            renderer = call.renderer
            tokens = [renderer.decode([i]) for i in ids] if renderer is not None else [str(i) for i in ids]
            if call.returned is not None:
                reply = call.returned
                completion = reply.get("content") or ""
            else:
                reply = call.reply if renderer is not None else None
                completion = renderer.decode(ids) if renderer is not None else ""
            step = rec.steps[turn] if turn < len(rec.steps) else None
            mask = [int(m) for m in step.loss_mask] if step is not None else [0] * len(ids)
            if tr is not None and tr.filtered:
                mask = [0] * len(ids)
            advantages = [] if tr is None else [_json_float(a) for a in tr.advantages]
            out.append(
                {
                    "trajectory_id": f"{rec.trajectory_id.instance_id}#{rec.trajectory_id.repetition_id}",
                    "turn": turn,
                    "env": rec.env,
                    "messages": call.prompt.messages,
                    "completion": completion,
                    "reply": reply,
                    "prompt_ids": [int(i) for i in call.prompt.ids],
                    "completion_ids": ids,
                    "tokens": tokens,
                    "logprobs": [_json_float(x) for x in call.completion.logprobs],
                    "reward": _reward(step.reward if step is not None else call.reward),
                    "stop_reason": step.stop_reason if step is not None else call.stop_reason,
                    "weight_version": call.completion.weight_version,
                    "weight_versions": [span.as_dict() for span in call.completion.weight_versions],
                    "sample": None if tr is None else tr.sample,
                    "advantages": advantages,
                    "advantage": _json_float(np.mean(tr.advantages)) if tr is not None and len(ids) else None,
                    "loss_mask": mask,
                    "status": status,
                    "trained": status == "trained",
                    "errored": rec.errored,
                    "trajectory_reward": _json_float(rec.reward),
                    "end": rec.end,
                }
            )
    return out


def write_rollout_records(
    workdir: str | os.PathLike, step: int, records: Sequence[Mapping[str, Any]]
) -> pathlib.Path:
    """Writes ``records`` to ``rollouts/step_<step>.jsonl`` durably (temporary file, ``fsync``,
    rename, ``fsync`` of the directory: when this returns, a crash leaves the whole file or, if it
    came before, none) and returns its path. A file of the step already there is replaced."""
    path = rollouts_path(workdir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, allow_nan=False, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)
    return path


def drop_rollout_records_after(workdir: str | os.PathLike, step: int) -> list[int]:
    """Deletes ``rollouts/step_<S>.jsonl`` of every ``S > step`` (and temporaries of killed writes);
    returns the dropped steps, sorted. A run resumed from checkpoint ``step`` calls it: those
    records belong to steps it trains again.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> for s in (2, 4, 6):
    ...     _ = write_rollout_records(d, s, [{"step": s}])
    >>> drop_rollout_records_after(d, 4), sorted(p.name for p in (pathlib.Path(d) / ROLLOUTS_DIR).iterdir())
    ([6], ['step_2.jsonl', 'step_4.jsonl'])
    """
    directory = pathlib.Path(workdir) / ROLLOUTS_DIR
    if not directory.is_dir():
        return []
    dropped = []
    for path in directory.iterdir():
        if path.name.endswith(".jsonl.tmp"):
            path.unlink(missing_ok=True)
        elif (match := _STEP_FILE.fullmatch(path.name)) and int(match.group(1)) > step:
            path.unlink(missing_ok=True)
            dropped.append(int(match.group(1)))
    if dropped:
        _fsync_dir(directory)
    return sorted(dropped)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_rollout_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of one ``step_<S>.jsonl`` file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sample_table(records: Sequence[Mapping[str, Any]], *, max_rows: int = 32, seed: int = 0) -> SampleTable:
    """One row per trajectory (its last call), at most ``max_rows`` drawn at random (``seed``)."""
    by_traj: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        by_traj.setdefault(r["trajectory_id"], []).append(r)
    names = list(by_traj)
    if len(names) > max_rows:
        names = sorted(random.Random(seed).sample(names, max_rows), key=names.index)
    rows = []
    for name in names:
        calls = by_traj[name]
        last = calls[-1]
        advs = [a for c in calls for a in c["advantages"] if a is not None]
        rows.append(
            (
                name,
                last["env"],
                len(calls),
                json.dumps(last["messages"], ensure_ascii=False),
                last["completion"],
                last["trajectory_reward"],
                float(np.mean(advs)) if advs else None,
                last["stop_reason"],
                sum(len(c["completion_ids"]) for c in calls),
                last["status"],
            )
        )
    return SampleTable(tuple(rows))


def rollout_distributions(
    trajectories: Sequence[TrajectoryRecord], trace: PreparationTrace | None
) -> dict[str, np.ndarray]:
    """The per-step distributions: ``reward`` (per trajectory), ``advantage`` (per trained
    completion token), ``response_length`` (tokens per call), ``turns`` (per trajectory) and
    ``samples_per_trajectory`` (merged samples per trajectory in the batch)."""
    rewards, turns, lengths, advantages, samples = [], [], [], [], []
    for rec in trajectories:
        rewards.append(rec.reward)
        turns.append(rec.num_turns)
        lengths += [len(s.response_ids) for s in rec.steps]
        if trace is None:
            continue
        n = trace.samples_of(rec.trajectory_id)
        if n:
            samples.append(n)
        for t, s in enumerate(rec.steps):
            tr = trace.get(rec.trajectory_id, t)
            if tr is not None and not tr.filtered:
                mask = np.asarray(s.loss_mask, bool)
                if mask.shape == tr.advantages.shape:
                    advantages += tr.advantages[mask].tolist()
    out = {
        "reward": np.asarray(rewards, np.float64),
        "turns": np.asarray(turns, np.float64),
        "response_length": np.asarray(lengths, np.float64),
    }
    if trace is not None:
        out["advantage"] = np.asarray(advantages, np.float64)
        out["samples_per_trajectory"] = np.asarray(samples, np.float64)
    return out
