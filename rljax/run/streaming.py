"""Fully asynchronous (streaming) rollouts: ``config.trainer.mode = "fully_async"``.

Rollouts run continuously, one prompt group (a task x ``group_size`` trajectories) at a time per
slot, on whatever weights the policy engine serves when the group starts. RL step ``m`` takes
``prompts_per_step`` (``B``) COMPLETE groups, whichever prompts they are, trains ``theta_m`` on
them and publishes ``theta_{m+1}``; the engine is switched to it without draining (groups in
flight finish on the old weights, or move to the new ones at the next segment boundary on
engines that update in flight; every token records its version).

Staleness. A group that started on version ``s`` and trains in step ``m`` is ``m - s`` versions
stale (per token: ``m - token version``, never more). The bound ``m - s <= k``
(``k = max_off_policy_steps``) gives every group a deadline ``d = s + k``: the last step that may
train it. Two rules keep every deadline, so nothing is ever dropped for staleness:

* **Admission** (AReaL's capacity rule, Fu et al. 2025, §5: at most ``(k + v + 1) * B`` groups
  admitted while the engine serves version ``v``): with ``m`` steps consumed, a new group may
  start only while ``live < (v + k + 1 - m) * B`` (``live`` = groups running or finished and not
  yet trained). Every live group's deadline is at most ``v + k``, so this says: the groups due by
  ``v + k`` fit in the ``v + k + 1 - m`` steps left until then.
* **Consumption** (earliest deadline first): step ``m`` takes complete groups in deadline order,
  and only a choice that leaves, for every later step ``n``, at most ``(n - m) * B`` live groups
  due by ``n``; when the complete groups allow no such choice it waits for more to finish.
  This is exactly where AReaL's rule alone falls short: a slow group can be overtaken by newer
  ones and miss its deadline. With both rules a feasible choice always exists among the live
  groups (induction over steps; ``StreamState.choose`` documents it), so the bound is a
  guarantee, not an expectation.

Repeated tasks. A task has at most one live group (running, or finished and not yet trained): a
task id is a prompt group downstream (advantages, filters, packing and records group by it), so one
step cannot train two groups of one task. The task iterator hands every task out again each epoch,
so the stream can draw a task whose earlier group is still live (near an epoch boundary; with few
tasks per ``prompts_per_step``, often). That draw is **deferred**, not started: it keeps its draw
number, waits in ``StreamState.pending`` and starts first once its task's group has trained, while
the stream draws on (:meth:`StreamState.start_next`). A task has at most one deferred draw; a
further draw of it meanwhile is skipped (``async/draws_skipped``): the task's groups take longer
than the iterator's pace, it trains as often as they allow, and the backlog stays bounded (a
draw per task). Deferring rather than keying groups by draw number keeps the task id the group key
everywhere, and keeps the rules above exact: the live groups' tasks being distinct, any ``B``
complete groups form a step, so a due group can always be taken (two live groups of one task, both
due, could never train in one step: the stream would wait forever). When every task has a live
group nothing starts until a step trains one. With many more train tasks than ``(k + 1) * B`` (per
process) a deferral is rare (a task comes up again while its group is live only near an epoch
boundary) and a skip rarer still (it takes a whole epoch of draws while one group is live).

A group found stale anyway (a safety net: it never happens under the two rules) is dropped,
counted in ``async/groups_dropped_stale`` and its prompt drawn again first; it is never trained.
With dynamic sampling, a group without reward variance is dropped as it finishes
(``async/groups_dropped_no_variance``; DAPO's rule, the prompt is consumed).

Resume: groups in flight are re-drawn, not checkpointed. A checkpoint at step ``n`` holds the task
iterator's position and the draws not yet trained (deferred, running or finished but not taken,
with their draw numbers); ``--resume`` starts those again first (deferring any whose task is live
again), on ``theta_n``, then continues the iterator.
No prompt is lost and none is trained twice; which groups finish first depends on timing, so a
resumed run is not bit-for-bit the uninterrupted one (sync and async modes are).

Several processes (a multi-host run; design §5, as the async mode in :mod:`rljax.run.scheduler`).
Every process runs its own stream on its own engine with ``B_p = B / P`` groups per step
(``prompts_per_step`` must divide by the process count ``P``:
:func:`~rljax.run.builders.process_batch`) and the same
``k``; the admission and consumption rules then hold per process, so every process's groups keep
their deadlines and the bound holds for the whole batch.

* **Draws.** Process ``p`` owns the train tasks ``train[p::P]`` (:func:`owned_tasks`) and draws
  them epoch by epoch with its own seeded :class:`~rljax.run.tasks.TaskIterator`; its ``i``-th draw
  is number ``i * P + p`` (:func:`draw_number`), unique in the run, and its request seeds derive
  from that number. No task is ever drawn by two processes and each process defers its own repeats,
  so a step's gathered groups never share a task id. The draw order differs from a one-process run's.
* **Steps.** :meth:`StreamingScheduler.take` (main thread, every process, in step order) chooses this
  process's ``B_p`` groups on its own loop, then gathers every process's share
  (:func:`~rljax.training.distributed.allgather_objects`, process order, each in draw order) into one
  batch, equal on every process; the staleness check and the ``async/*`` metrics are computed over
  that whole batch, so they are equal on every process too. Collectives run on the main thread
  only; the stream's loop issues none.
* **Versions.** A stream serves only the newest published version and may skip some, so processes
  do not serve versions in step and there is no per-version barrier (the async mode's). Weights
  written to files for vLLM servers (``workdir/weights/v<N>``, written by every process together on
  the main thread, before any stream may load them) are deleted only once every process's stream has
  taken up a newer version: each share carries the newest version its stream has started loading,
  and a version older than all of them is released after the gather.
* **Checkpoints.** :meth:`StreamingScheduler.data_state` gathers every process's iterator position and
  outstanding draws (``{"process_count": P, "processes": [...]}``, the same on every process; orbax
  writes it once); ``restore`` gives each process its own entry. Resuming with another process count
  is a clear error, not a redistribution: the task partitions and iterator orders depend on ``P``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.data.filters import informative_groups
from rljax.envs.base import Task
from rljax.rollout import RolloutResult, _raise_all_errored, merge_rollout_results
from rljax.run.builders import process_batch
from rljax.run.scheduler import RolloutScheduler, _release, derive_seed
from rljax.run.tasks import TaskIterator
from rljax.training.distributed import allgather_objects

__all__ = [
    "Draw",
    "Group",
    "StreamState",
    "StreamingScheduler",
    "combine_stream_metrics",
    "draw_number",
    "newest_token_version",
    "owned_tasks",
    "staleness_metrics",
]


@dataclasses.dataclass(frozen=True)
class Draw:
    """One drawn prompt: the task, its draw number (unique in the run) and its attempt (> 0: drawn
    again after a staleness drop)."""

    task: Task
    number: int
    attempt: int = 0


@dataclasses.dataclass
class Group:
    """One prompt group of the stream: its draw, the version it started on, and, when it finished,
    the version it finished on (the served one, or a newer one an in-flight switch already sampled
    some of its tokens with) and its rollout."""

    draw: Draw
    start_version: int
    started: float
    finish_version: int | None = None
    finished: float | None = None
    result: RolloutResult | None = None

    @property
    def task_id(self) -> str:
        return self.draw.task.id


class StreamState:
    """The bookkeeping and the admission / consumption rules of the stream (no I/O, no clock of its
    own: every method takes the time or version it needs, so a simulated clock can drive it).

    Args:
      batch: ``B``, groups per RL step (``prompts_per_step``).
      max_staleness: ``k``, versions a group may be stale when it trains (``max_off_policy_steps``).
      num_steps: RL steps of the run (no group is started that no step would train).
      next_step: the next step to consume (a resumed run: the checkpoint's step).

    Its state: ``running`` (draw number -> group), ``ready`` (finished, not yet trained),
    ``pending`` (draws not started: deferred while their task's group is live, dropped stale, or
    resumed from a checkpoint), and the counts ``dropped_stale``, ``dropped_no_variance`` and
    ``draws_skipped``.

    >>> s = StreamState(batch=2, max_staleness=1, num_steps=10)
    >>> s.admission_room(version=0)   # (0 + 1 + 1 - 0) * 2 groups may start on version 0
    4
    """

    def __init__(self, *, batch: int, max_staleness: int, num_steps: int, next_step: int = 0) -> None:
        self.batch = int(batch)
        self.k = int(max_staleness)
        self.num_steps = int(num_steps)
        self.next_step = int(next_step)
        self.running: dict[int, Group] = {}
        self.ready: list[Group] = []
        self.pending: list[Draw] = []  # drawn, not started: deferred, dropped stale or resumed
        self.dropped_stale = 0
        self.dropped_no_variance = 0
        self.draws_skipped = 0  # drawn while their task had a live group and a pending draw

    # -- counts -----------------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Groups started and not yet trained or dropped."""
        return len(self.running) + len(self.ready)

    @property
    def live_tasks(self) -> set[str]:
        """The task ids of the live groups (distinct: a task has at most one live group)."""
        return {*(g.task_id for g in self.running.values()), *(g.task_id for g in self.ready)}

    def deadline(self, group: Group) -> int:
        """The last step that may train ``group``."""
        return group.start_version + self.k

    def admission_room(self, *, version: int) -> int:
        """How many more groups may start on ``version`` now (AReaL's capacity rule, and no more
        than the remaining steps train): ``min((v + k + 1 - m) * B, (num_steps - m) * B) - live``."""
        m = self.next_step
        cap = min((version + self.k + 1 - m) * self.batch, (self.num_steps - m) * self.batch)
        return max(cap - self.live, 0)

    # -- the stream's events ----------------------------------------------------------------------------
    def admit(self, draw: Draw, *, version: int, now: float) -> Group | None:
        """Records that ``draw`` starts on ``version`` (call only with :meth:`admission_room` > 0), or,
        while a group of its task is live, defers it and returns None: it waits in ``pending``
        (:meth:`next_pending` gives it back once that group has trained or been dropped), unless a
        draw of its task already waits there; then it is skipped (counted in ``draws_skipped``)."""
        if self.admission_room(version=version) <= 0:
            raise RuntimeError("admit() without admission room: the capacity rule would break")
        if draw.task.id in self.live_tasks:
            if any(d.task.id == draw.task.id for d in self.pending):
                self.draws_skipped += 1
            else:
                self.pending.append(draw)
            return None
        group = Group(draw, start_version=int(version), started=float(now))
        self.running[draw.number] = group
        return group

    def next_pending(self) -> Draw | None:
        """The first pending draw (in the order they were queued) whose task has no live group,
        removed from ``pending``; None when there is none."""
        live = self.live_tasks
        for i, draw in enumerate(self.pending):
            if draw.task.id not in live:
                return self.pending.pop(i)
        return None

    def start_next(
        self, new_draw: Callable[[], Draw], *, num_tasks: int, version: int, now: float
    ) -> Group | None:
        """Starts the next group on ``version``, or returns None when none may start now.

        A pending draw whose task is free starts first. Otherwise new draws are taken in order
        (``new_draw()``: the task iterator's next task, numbered) until one starts, each whose task
        is live deferred or skipped (:meth:`admit`). None when there is no admission room, or when
        all ``num_tasks`` tasks (the ones ``new_draw`` draws from) have a live group: nothing may
        start until a step trains one. While one is free a new draw reaches it within two epochs
        (every task comes up once per epoch).
        """
        if self.admission_room(version=version) <= 0:
            return None
        draw = self.next_pending()
        if draw is not None:
            return self.admit(draw, version=version, now=now)
        if len(self.live_tasks) >= num_tasks:
            return None
        for _ in range(2 * num_tasks):
            group = self.admit(new_draw(), version=version, now=now)
            if group is not None:
                return group
        raise RuntimeError(f"no draw of {2 * num_tasks} reached one of the free tasks (num_tasks is wrong)")

    def finish(
        self, number: int, result: RolloutResult, *, version: int, now: float, keep: bool = True
    ) -> Group:
        """Records that group ``number`` finished while ``version`` was served; ``keep=False``
        (dynamic sampling: no reward variance) drops it. A group already past its deadline is dropped
        as stale and its prompt queued to be drawn again."""
        group = self.running.pop(number)
        group.finish_version, group.finished, group.result = int(version), float(now), result
        if self.deadline(group) < self.next_step:
            self._drop_stale(group)
        elif not keep:
            self.dropped_no_variance += 1
        else:
            self.ready.append(group)
        return group

    def _drop_stale(self, group: Group) -> None:
        self.dropped_stale += 1
        d = group.draw
        self.pending.insert(0, Draw(d.task, d.number, d.attempt + 1))  # drawn again first

    def choose(self, step: int) -> list[Group] | None:
        """The groups step ``step`` trains, or None while the finished ones allow no safe choice.

        The first ``B`` finished groups in earliest-deadline order (then finishing order), if
        afterwards every later step ``n`` has at most ``(n - step) * B`` live groups due by ``n``: for
        each ``n >= step``, at least ``need_n = c_n - (n - step) * B`` of the chosen ones are due by
        ``n`` (``c_n``: live groups due by ``n``). Earliest-deadline order maximizes the chosen ones
        due by every ``n`` at once, so if it fails no choice of finished groups succeeds.
        Why a choice always exists once enough groups finish: before step ``m``, ``c_n <= (n - m +
        1) * B`` for every ``n`` (admission keeps it for the newest deadline, consumption for the
        others), so ``need_n <= min(B, c_n)``, which the first ``B`` live groups in deadline order meet.
        The live groups hold distinct tasks (:meth:`admit` defers a draw whose task is live), so
        any ``B`` of them form a step: no constraint between groups can leave a due one untakeable.

        Finished groups already past their deadline are dropped first (see :meth:`finish`).
        """
        if step != self.next_step:
            raise RuntimeError(f"the stream consumes step {self.next_step} next, not step {step}")
        for g in [g for g in self.ready if self.deadline(g) < step]:
            self.ready.remove(g)
            self._drop_stale(g)
        order = sorted(self.ready, key=lambda g: (self.deadline(g), g.finished, g.draw.number))
        if len(order) < self.batch:
            return None
        chosen = order[: self.batch]
        deadlines = [self.deadline(g) for g in [*self.ready, *self.running.values()]]
        chosen_d = [self.deadline(g) for g in chosen]
        for n in range(step, step + self.k + 1):
            need = sum(d <= n for d in deadlines) - (n - step) * self.batch
            if sum(d <= n for d in chosen_d) < need:
                return None
        return chosen

    def consume(self, chosen: Sequence[Group]) -> None:
        """Removes the groups a step took; the next step is the following one."""
        for g in chosen:
            self.ready.remove(g)
        self.next_step += 1

    def outstanding(self) -> list[Draw]:
        """Draws not yet trained (pending, running, finished), in draw order: what a resumed run
        draws first."""
        draws = [*self.pending, *(g.draw for g in self.running.values()), *(g.draw for g in self.ready)]
        return sorted(draws, key=lambda d: d.number)


def staleness_metrics(
    groups: Sequence[Group], step: int, *, frozen: frozenset[str] = frozenset()
) -> dict[str, float]:
    """``async/staleness_{mean,min,max}`` over the trained tokens (loss mask 1) of ``groups``,
    staleness = ``step - token version``, and its split: ``async/staleness_inflight_mean`` (versions
    published while the token's group was still generating: ``finish version - token version``) and
    ``async/staleness_queue_mean`` (versions published while it waited to train: ``step - finish
    version``); the two add up to the mean. Steps of frozen samplers (their version means nothing) are
    left out."""
    stale: list[np.ndarray] = []
    inflight: list[np.ndarray] = []
    for g in groups:
        assert g.result is not None and g.finish_version is not None
        for s in g.result.batch:
            if s.algorithm in frozen:
                continue
            versions = s.token_versions()[np.asarray(s.loss_mask, bool)]
            stale.append(step - versions)
            inflight.append(g.finish_version - versions)
    every = np.concatenate(stale) if stale else np.zeros(0, np.int64)
    if every.size == 0:
        nan = math.nan
        return {f"async/staleness_{k}": nan for k in ("mean", "min", "max", "inflight_mean", "queue_mean")}
    fly = np.concatenate(inflight)
    return {
        "async/staleness_mean": float(every.mean()),
        "async/staleness_min": float(every.min()),
        "async/staleness_max": float(every.max()),
        "async/staleness_inflight_mean": float(fly.mean()),
        "async/staleness_queue_mean": float((every - fly).mean()),
    }


def newest_token_version(batch: Sequence[Any], *, frozen: frozenset[str] = frozenset()) -> int:
    """The newest weight version of any response token in ``batch`` (steps of frozen samplers left
    out); -1 when there is none.

    >>> from rljax.types import Step
    >>> newest_token_version([Step([1], [5, 6], ("a", 0), response_versions=[3, 4], policy_version=3)])
    4
    """
    newest = [int(s.token_versions().max()) for s in batch if s.algorithm not in frozen and s.response_ids]
    return max(newest, default=-1)


def trained_tokens(batch: Sequence[Any]) -> int:
    """Response tokens with loss mask 1 in ``batch``."""
    return int(sum(int(np.sum(s.loss_mask)) for s in batch))


def owned_tasks(tasks: Sequence[Task], process_index: int, process_count: int) -> list[Task]:
    """The train tasks process ``process_index`` draws from: every ``process_count``-th, from its index
    on (disjoint, together all of them; a task list ordered by env still spreads every env).

    >>> [t.id for t in owned_tasks([Task(f"t{i}") for i in range(5)], 1, 2)]
    ['t1', 't3']
    """
    return list(tasks[process_index::process_count])


def draw_number(local: int, process_index: int, process_count: int) -> int:
    """The run-wide number of process ``process_index``'s ``local``-th draw: ``local * P + p`` (unique
    across processes; one process: ``local``).

    >>> [draw_number(i, 1, 2) for i in range(3)]
    [1, 3, 5]
    """
    return local * process_count + process_index


@dataclasses.dataclass
class _Share:
    """One process's part of a step, gathered on every process: its chosen groups (in draw order),
    its stream's metrics, how long each chosen group waited, and the newest version its stream has
    started loading (older written weights may be released once every process is past them)."""

    groups: list[Group]
    metrics: dict[str, float]
    waits: list[float]
    loading: int


_SUMMED = (
    "async/groups_inflight",
    "async/groups_queued",
    "async/groups_dropped_stale",
    "async/groups_dropped_no_variance",
    "async/draws_pending",
    "async/draws_skipped",
    "async/rollout_tokens_per_s",
)
_AVERAGED = ("async/engine_idle_fraction", "async/inflight_updates")


def combine_stream_metrics(
    metrics: Sequence[Mapping[str, float]], waits: Sequence[Sequence[float]]
) -> dict[str, float]:
    """One row's stream metrics from every process's (process order): counts and token rates add up
    over the processes' streams, the idle fraction and in-flight updates are averaged over their
    engines, ``async/group_wait_s`` is the mean over every taken group. One process: its own values.

    >>> row = combine_stream_metrics(
    ...     [{"async/groups_queued": 1.0, "async/engine_idle_fraction": 0.5},
    ...      {"async/groups_queued": 2.0, "async/engine_idle_fraction": 0.0}],
    ...     [[1.0, 3.0], [2.0, 2.0]])
    >>> row["async/groups_queued"], row["async/engine_idle_fraction"], row["async/group_wait_s"]
    (3.0, 0.25, 2.0)
    """
    out: dict[str, float] = {}
    for key in _SUMMED:
        if any(key in m for m in metrics):
            out[key] = float(sum(m.get(key, 0.0) for m in metrics))
    for key in _AVERAGED:
        if any(key in m for m in metrics):
            out[key] = float(np.mean([m[key] for m in metrics if key in m]))
    every = [w for ws in waits for w in ws]
    out["async/group_wait_s"] = float(np.mean(every)) if every else math.nan
    return out


def _portable(group: Group) -> Group:
    """``group`` as another process needs it (pickled by the gather): its task reduced to id and env."""
    task = group.draw.task
    return dataclasses.replace(group, draw=dataclasses.replace(group.draw, task=Task(task.id, env=task.env)))


class StreamingScheduler(RolloutScheduler):
    """The rollout scheduler of ``trainer.mode = "fully_async"`` (see the module docstring).

    Same constructor as :class:`~rljax.run.scheduler.RolloutScheduler`. The stream runs on the
    rollout worker's event loop beside its FIFO jobs (evals still run as jobs); the trainer calls
    :meth:`start`, then per step :meth:`take` and :meth:`add_version`, and :meth:`close`.
    ``clock``: the time source of the stream's metrics (tests may replace it).
    """

    def __init__(
        self, cfg: Any, *args: Any, clock: Callable[[], float] = time.perf_counter, **kwargs: Any
    ) -> None:
        super().__init__(cfg, *args, **kwargs)
        p, count = self.process_index, self.process_count
        self.batch_per_process = process_batch(self.prompts_per_step, count)
        if count > 1:  # this process's own tasks (the module docstring: several processes)
            self.tasks = TaskIterator(owned_tasks(self.env_tasks.train, p, count), seed=cfg.seed)
        self.lag = 0  # one behaviour version at a time: the newest (add_version keeps no older ones)
        self.max_staleness = cfg_k = int(cfg.trainer.max_off_policy_steps)
        self.clock = clock
        self.state = StreamState(batch=self.batch_per_process, max_staleness=cfg_k, num_steps=self.num_steps)
        self.next_draw = 0  # this process's draws so far (its draw numbers: draw_number)
        self.published = -1  # the newest version add_version recorded
        self.served_version = -1  # the version the stream made the engine serve
        self.loading = -1  # the newest version the stream started loading (>= served_version)
        self._newest: tuple[int, Any] | None = None  # (version, what the engine serves): read at once
        self._retired: list[tuple[int, Any]] = []  # older written weights: files deleted when unused
        self._pump_future: Any = None
        self._engines: Mapping[str, Any] = {}
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self._frozen = frozenset(a.name for a in self.algorithms.algorithms if a.sampling == "frozen")
        self._window = _Window()
        self._counts_reported = (0, 0, 0)  # stale / no-variance drops and skipped draws reported before

    # -- versions ---------------------------------------------------------------------------------------
    @property
    def holds_served_only_once(self) -> bool:
        """Never: the stream samples a version for as long as it is the newest."""
        return False

    def needed_versions(self, step: int) -> list[int]:
        """None: a resumed stream restarts every group on the checkpoint's weights."""
        return []

    def add_version(self, version: int, params: Any) -> None:
        """Records weight ``version``; the stream serves it next (no drain: groups in flight go on).

        Older versions are forgotten (the stream holds its own reference to the one it loads); the
        files of one written for vLLM servers are deleted only once no process's stream may still
        load it (:meth:`_release_unused`, after a step's gather)."""
        from rljax.inference.vllm.weight_sync import WrittenWeights

        served = params if self.localize is None else self.localize(version, params)
        self.behavior[version], self.served[version] = params, served
        for v in [v for v in self.behavior if v < version]:
            del self.behavior[v]
            old = self.served.pop(v)
            if isinstance(old, WrittenWeights):
                self._retired.append((v, old))
        if version >= self.published:
            self._newest = (int(version), served)  # one assignment: the loop reads both or neither
            self.published = int(version)
        if self.process_count == 1:  # this process's stream alone: it loads only what it read above
            self._release_unused(self.published)
        self._call_soon(self._wakeup)

    def _release_unused(self, floor: int) -> None:
        """Forgets the retired versions below ``floor`` (no process's stream loads one any more: each
        loads only the newest published version), deleting written weights' files (process 0)."""
        keep = []
        for v, served in self._retired:
            if v < floor:
                _release(served, main=self.process_index == 0)
            else:
                keep.append((v, served))
        self._retired = keep

    async def serve(self, version: int) -> None:
        """Makes this process's policy engine serve weight ``version``. No barrier: streams do not
        serve versions in step (the module docstring: several processes)."""
        await self.engines.serve(version, self.to_model(self.served[version]))

    # -- the loop -----------------------------------------------------------------------------------------
    def _call_soon(self, fn: Callable[[], None]) -> None:
        if self._pump_future is not None:
            self.worker.loop.call_soon_threadsafe(fn)

    def _wakeup(self) -> None:
        if self._wake is not None:
            self._wake.set()
        if self._changed is not None:
            self._changed.set()

    def _run_on_loop(self, make_coro: Callable[[], Any]) -> Any:
        """Runs ``make_coro()`` on the rollout loop (beside, not behind, the worker's FIFO jobs)."""
        return asyncio.run_coroutine_threadsafe(make_coro(), self.worker.loop)

    def start(self, step: int) -> None:
        """Starts the stream at RL step ``step`` (a fresh or resumed run; the engine started on
        version ``step``)."""
        self.next_step = step
        self.state.next_step = step
        self.state.num_steps = self.num_steps
        self._engines = {
            env: self.engines.sampler_for(self.algorithms.for_env(env), self.worker)
            for env in self.env_tasks.factories
        }

        async def nothing() -> None:
            return None

        self.worker.submit(nothing).result()  # the worker's loop is running
        self._pump_future = self._run_on_loop(self._pump)

    async def _pump(self) -> None:
        self._wake, self._changed = asyncio.Event(), asyncio.Event()
        self._window.reset(self.clock(), busy=False)
        try:
            while not self._closing:
                newest = self._newest
                if newest is not None and newest[0] > self.served_version:
                    version, served = newest
                    self.loading = version
                    if self.state.running:  # counted as the switch starts, with groups in flight
                        self._window.inflight_updates += 1
                    await self.engines.serve(version, self.to_model(served))
                    self.served_version = version
                    self._changed.set()
                while not self._closing and self.served_version >= 0 and self._admit():
                    pass
                self._wake.clear()
                if self.published <= self.served_version and not self._closing:
                    await self._wake.wait()
        except Exception as e:  # surfaced to the trainer by take()
            self._error = e
            self._changed.set()

    def _new_draw(self) -> Draw:
        """This process's next draw from its task iterator, numbered (:func:`draw_number`)."""
        number = draw_number(self.next_draw, self.process_index, self.process_count)
        self.next_draw += 1
        return Draw(self.tasks.take(1)[0], number)

    def _admit(self) -> bool:
        """Starts the next group on the served version (:meth:`StreamState.start_next`); False when
        none may start now."""
        state = self.state
        was_busy = bool(state.running)
        group = state.start_next(
            self._new_draw, num_tasks=len(self.tasks.tasks), version=self.served_version, now=self.clock()
        )
        if group is None:
            return False
        if not was_busy:
            self._window.mark(self.clock(), busy=True)
        task = asyncio.get_running_loop().create_task(self._run_group(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run_group(self, group: Group) -> None:
        d = group.draw
        config = dataclasses.replace(
            self.rollout_config,
            seed=derive_seed(self.rollout_seed, d.number, d.attempt, 3),
            raise_on_all_errored=False,  # one bad group is masked; a step of only errors raises
        )
        try:
            result = await self.run_rollout([d.task], self._engines, config)  # this process's group
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._error = e
            self._wakeup()
            return
        keep = True
        if self.dynamic_sampling is not None:
            atol = self.dynamic_sampling.atol
            keep = any(informative_groups(result.batch, atol=atol, reward_mode=self.reward_modes).values())
        now = self.clock()
        # An engine that takes up a version in flight samples with it before serve() returns (and
        # served_version moves): the group finished on the newest version any of its tokens has.
        finished_on = max(self.served_version, newest_token_version(result.batch, frozen=self._frozen))
        self.state.finish(d.number, result, version=finished_on, now=now, keep=keep)
        self._window.tokens += int(result.metrics["response_tokens"])
        if not self.state.running:
            self._window.mark(now, busy=False)
        self._wakeup()

    # -- the trainer's side ---------------------------------------------------------------------------------
    def take(self, step: int) -> tuple[RolloutResult, dict[str, float]]:
        """Blocks until step ``step`` may train; returns its groups' rollout and the stream's metrics
        of the step. Several processes: every process's share (process order, each in draw order),
        the same batch and metrics on every process (call on the main thread, every process)."""
        if self._pump_future is None:
            raise RuntimeError("StreamingScheduler.take before start()")
        chosen, local, waits = self._run_on_loop(lambda: self._take(step)).result()
        mine = chosen if self.process_count == 1 else [_portable(g) for g in chosen]
        shares: list[_Share] = allgather_objects(_Share(mine, local, waits, self.loading))
        self._release_unused(min(s.loading for s in shares))
        groups = [g for s in shares for g in s.groups]
        metrics = combine_stream_metrics([s.metrics for s in shares], [s.waits for s in shares])
        result = merge_rollout_results([g.result for g in groups])
        records = result.trajectories
        if self.rollout_config.raise_on_all_errored and records and all(r.errored for r in records):
            _raise_all_errored(records)
        versions = [s.policy_version for s in result.batch if s.algorithm not in self._frozen]
        lag = step - min(versions) if versions else 0
        metrics.update(staleness_metrics(groups, step, frozen=self._frozen))
        metrics.update(
            {
                "policy_version/min": float(min(versions)) if versions else math.nan,
                "policy_version/max": float(max(versions)) if versions else math.nan,
                "policy_version/lag": float(lag),
            }
        )
        if lag > self.max_staleness:  # the rules above make this impossible; never train on it silently
            raise RuntimeError(f"step {step}: a sample is {lag} versions stale (> max_off_policy_steps)")
        self.next_step = step + 1
        return result, metrics

    async def _take(self, step: int) -> tuple[list[Group], dict[str, float], list[float]]:
        assert self._changed is not None and self._wake is not None
        while True:
            if self._error is not None:
                raise self._error
            chosen = self.state.choose(step)
            if chosen is not None:
                break
            self._changed.clear()
            await self._changed.wait()
        self.state.consume(chosen)
        chosen.sort(key=lambda g: g.draw.number)
        self._wake.set()  # capacity freed: the stream admits more on the weights it serves
        now = self.clock()
        window = self._window.close(now, busy=bool(self.state.running))
        state = self.state
        seen_stale, seen_nv, seen_skipped = self._counts_reported
        self._counts_reported = (state.dropped_stale, state.dropped_no_variance, state.draws_skipped)
        metrics = {
            "async/groups_inflight": float(len(state.running)),
            "async/groups_queued": float(len(state.ready)),
            "async/groups_dropped_stale": float(state.dropped_stale - seen_stale),
            "async/groups_dropped_no_variance": float(state.dropped_no_variance - seen_nv),
            "async/draws_pending": float(len(state.pending)),
            "async/draws_skipped": float(state.draws_skipped - seen_skipped),
            "async/engine_idle_fraction": window["idle_fraction"],
            "async/rollout_tokens_per_s": window["tokens_per_s"],
            "async/inflight_updates": window["inflight_updates"],
        }
        return chosen, metrics, [now - g.finished for g in chosen]

    def submit_eval(self, version: int) -> Any:
        """Evaluates weight ``version`` once the stream serves it (evals share the engine with the
        stream; the trainer waits for the result before it publishes the next version)."""
        config = dataclasses.replace(self.eval_config, seed=derive_seed(self.seed, 0xE7A1))

        async def job() -> RolloutResult:
            assert self._changed is not None
            while self.served_version < version and self._error is None:
                self._changed.clear()
                await self._changed.wait()
            return await self.run_rollout(self.share(self.env_tasks.eval), self.engines.policy, config)

        return self.worker.submit(job)

    # -- checkpoints --------------------------------------------------------------------------------------
    def data_state(self, step: int) -> dict[str, Any]:
        """The task iterator's position plus the draws not yet trained (taken on the loop, so the
        two agree): a resumed run draws those again first. Several processes: every process's, as
        ``{"process_count": P, "processes": [...]}`` on every process (call on the main thread)."""

        async def snapshot() -> dict[str, Any]:
            outstanding = [[d.task.id, d.number, d.attempt] for d in self.state.outstanding()]
            return {**self.tasks.state(), "next_draw": self.next_draw, "outstanding": outstanding}

        if self._pump_future is None:
            local = {**self.tasks.state(), "next_draw": self.next_draw, "outstanding": []}
        else:
            local = self._run_on_loop(snapshot).result()
        if self.process_count == 1:
            return local
        return {"process_count": self.process_count, "processes": allgather_objects(local)}

    def restore(self, data_state: Mapping[str, Any]) -> None:
        """Restores the task order and queues the checkpoint's untrained draws to start first
        (several processes: each its own, from a checkpoint of as many processes)."""
        state = self._own_state(data_state["tasks"])
        self.tasks.restore(state)
        self.next_draw = int(state.get("next_draw", 0))
        by_id = self.env_tasks.by_id()
        for task_id, number, attempt in state.get("outstanding", ()):
            if task_id not in by_id:
                raise ValueError(
                    f"the checkpoint's stream holds task {task_id!r}, which the run no longer has "
                    "(the task list changed since the checkpoint was written)"
                )
            self.state.pending.append(Draw(by_id[task_id], int(number), int(attempt)))

    def _own_state(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """This process's entry of a checkpoint's stream state (a one-process checkpoint: all of it)."""
        saved = int(state.get("process_count", 1))
        if saved != self.process_count:
            raise ValueError(
                f"--resume: the checkpoint's fully_async stream state was written by {saved} "
                f"process(es), this run has {self.process_count}; each process resumes its own task "
                f"partition and draws, so resume with {saved} process(es) (or start a new run)"
            )
        return state["processes"][self.process_index] if saved > 1 else state

    def close(self) -> None:
        """Stops the stream (groups in flight are cancelled), then the gateway."""
        if self._pump_future is not None:
            self._closing = True

            async def stop() -> None:
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                self._wakeup()

            try:
                self._run_on_loop(stop).result(timeout=60)
                self._pump_future.result(timeout=60)
            except Exception:  # closing must not mask the run's own error
                pass
            self._pump_future = None
        self._release_unused(self.published)  # the run is over: keep only the newest version's files
        super().close()


class _Window:
    """Engine busy time, generated tokens and in-flight updates between two steps' takes."""

    def __init__(self) -> None:
        self.reset(0.0, busy=False)

    def reset(self, now: float, *, busy: bool) -> None:
        self.start = self.last = now
        self.busy = busy
        self.idle_s = 0.0
        self.tokens = 0
        self.inflight_updates = 0

    def mark(self, now: float, *, busy: bool) -> None:
        if not self.busy:
            self.idle_s += now - self.last
        self.last, self.busy = now, busy

    def close(self, now: float, *, busy: bool) -> dict[str, float]:
        self.mark(now, busy=busy)
        span = now - self.start
        out = {
            "idle_fraction": self.idle_s / span if span > 0 else 0.0,
            "tokens_per_s": self.tokens / span if span > 0 else 0.0,
            "inflight_updates": float(self.inflight_updates),
        }
        self.reset(now, busy=busy)
        return out
