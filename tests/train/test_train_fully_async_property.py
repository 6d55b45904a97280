"""A property test of the fully_async stream's rules (rljax.run.streaming.StreamState) on a simulated
clock: the real task iterator (so tasks repeat at every epoch boundary), few tasks per step,
heavy-tailed group durations, one or two processes, dynamic-sampling drops and a resume mid-run.

Whatever hypothesis draws, the run must finish every step (no stall), train no group past the bound,
drop nothing for staleness, train no draw twice, and account for every draw (trained, dropped for
no reward variance, or outstanding at the end). The simulation models the stream's loop as
``StreamingScheduler`` runs it: after every event each process starts groups while
``start_next`` allows, on the version its engine serves; a process takes its share of step ``m``
as soon as its ``choose(m)`` succeeds; the step trains once every process took its share, then
publishes ``m + 1``, which each engine serves after a load delay. A resume rebuilds every process's
state from its checkpoint (iterator position, draw counter, outstanding draws) and drops the groups
in flight, as ``StreamingScheduler.restore`` does.
"""

from __future__ import annotations

import heapq
import itertools
import types

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.envs.base import Task
from rljax.run.streaming import Draw, StreamState, draw_number, owned_tasks
from rljax.run.tasks import TaskIterator

EXAMPLES = 1000
_NO_RESULT = types.SimpleNamespace(batch=[])


class _Process:
    """One process's stream: its state, its own task iterator and draw counter, its engine's version."""

    def __init__(self, tasks, index, count, *, batch, k, num_steps, seed, next_step=0, ckpt=None):
        self.index, self.count = index, count
        self.iterator = TaskIterator(owned_tasks(tasks, index, count), seed=seed)
        self.state = StreamState(batch=batch, max_staleness=k, num_steps=num_steps, next_step=next_step)
        self.next_draw, self.served = 0, next_step
        self.drawn: list[int] = []
        if ckpt is not None:  # StreamingScheduler.restore: the order, the counter, the untrained draws
            by_id = {t.id: t for t in self.iterator.tasks}
            self.iterator.restore(ckpt["tasks"])
            self.next_draw = ckpt["next_draw"]
            self.state.pending.extend(Draw(by_id[t], n, a) for t, n, a in ckpt["outstanding"])

    def new_draw(self) -> Draw:
        number = draw_number(self.next_draw, self.index, self.count)
        self.next_draw += 1
        self.drawn.append(number)
        return Draw(self.iterator.take(1)[0], number)

    def checkpoint(self) -> dict:
        outstanding = [[d.task.id, d.number, d.attempt] for d in self.state.outstanding()]
        return {"tasks": self.iterator.state(), "next_draw": self.next_draw, "outstanding": outstanding}


def _simulate(p: dict) -> dict:
    """Runs one simulated stream with the parameters ``p``; returns what the properties check."""
    rng = np.random.default_rng(p["seed"])
    batch, k, steps, count = p["batch_per_process"], p["k"], p["steps"], p["processes"]
    tasks = [Task(f"t{i}") for i in range(p["tasks_per_process"] * count)]

    def duration() -> float:  # heavy-tailed (Pareto), a fraction of the groups 10x slower still
        d = 0.05 + float(rng.pareto(p["tail"]))
        return d * 10.0 if rng.random() < p["slow_fraction"] else d

    def processes(next_step: int = 0, ckpts=None) -> list[_Process]:
        return [
            _Process(tasks, i, count, batch=batch, k=k, num_steps=steps, seed=p["seed"],
                     next_step=next_step, ckpt=None if ckpts is None else ckpts[i])
            for i in range(count)
        ]  # fmt: skip

    procs = processes()
    events: list = []  # (time, tiebreak, kind, process, payload)
    tiebreak = itertools.count()
    now, step, training, published = 0.0, 0, False, 0
    taken: dict[int, list] = {}  # process -> groups it took for the current step
    trained, dropped_nv, staleness = [], [], []
    handled, skipped = 0, 0

    def push(at: float, kind: str, proc: int, payload=None) -> None:
        heapq.heappush(events, (at, next(tiebreak), kind, proc, payload))

    def admit(i: int, pr: _Process) -> None:
        while (g := pr.state.start_next(
            pr.new_draw, num_tasks=len(pr.iterator.tasks), version=pr.served, now=now
        )) is not None:  # fmt: skip
            assert g.start_version == pr.served
            push(now + duration(), "finish", i, g.draw.number)

    def admit_and_take() -> None:
        nonlocal training
        for i, pr in enumerate(procs):
            admit(i, pr)
            if not training and step < steps and i not in taken:
                chosen = pr.state.choose(step)
                if chosen is not None:
                    assert len({g.task_id for g in chosen}) == len(chosen) == batch
                    pr.state.consume(chosen)
                    taken[i] = chosen
                    admit(i, pr)  # the room the step freed is used at once
        if not training and len(taken) == count:
            for chosen in taken.values():
                staleness.extend(step - g.start_version for g in chosen)
                trained.extend(g.draw.number for g in chosen)
            taken.clear()
            training = True
            push(now + p["train_s"], "trained", -1)

    while step < steps:
        admit_and_take()
        for pr in procs:
            assert len(pr.state.live_tasks) == pr.state.live  # a task has at most one live group
            assert len(pr.state.pending) <= 2 * len(pr.iterator.tasks)  # a bounded backlog
        if step >= steps:
            break
        if not events:
            waiting = {i: (pr.state.live, len(pr.state.ready)) for i, pr in enumerate(procs)}
            return {"stalled": True, "step": step, "waiting": waiting}
        handled += 1
        assert handled < 200_000, "the simulation does not converge"
        now, _, kind, i, payload = heapq.heappop(events)
        if kind == "finish":
            keep = rng.random() >= p["no_variance"]
            g = procs[i].state.finish(payload, _NO_RESULT, version=procs[i].served, now=now, keep=keep)
            if not keep:
                dropped_nv.append(g.draw.number)
        elif kind == "serve":
            procs[i].served = max(procs[i].served, payload)
        else:  # the step trained: publish the next version
            training, step = False, step + 1
            published = step
            if step == p["resume_at"]:  # checkpoint at this step, kill, resume from it
                drawn = {pr.index: pr.drawn for pr in procs}
                skipped += sum(pr.state.draws_skipped for pr in procs)
                ckpts = [pr.checkpoint() for pr in procs]
                procs = processes(step, ckpts)
                for pr in procs:
                    pr.drawn = drawn[pr.index]
                events.clear()  # groups in flight are lost; their draws are outstanding
                continue
            for j in range(count):
                push(now + p["load_s"], "serve", j, published)
    outstanding = [d.number for pr in procs for d in pr.state.outstanding()]
    return {
        "stalled": False,
        "trained": trained,
        "dropped_nv": dropped_nv,
        "outstanding": outstanding,
        "drawn": [n for pr in procs for n in pr.drawn],
        "staleness": staleness,
        "dropped_stale": sum(pr.state.dropped_stale for pr in procs),
        "skipped": skipped + sum(pr.state.draws_skipped for pr in procs),
    }


@st.composite
def _runs(draw) -> dict:
    processes = draw(st.sampled_from([1, 1, 2]))
    batch_per_process = draw(st.integers(1, 16 // processes))
    steps = draw(st.integers(1, 10))
    return dict(
        processes=processes,
        batch_per_process=batch_per_process,
        k=draw(st.integers(0, 3)),
        steps=steps,
        # few tasks: a task repeats while its earlier group is live (up to (k + 1) * B live groups)
        tasks_per_process=batch_per_process + draw(st.integers(0, 2 * batch_per_process)),
        tail=draw(st.sampled_from([1.1, 1.5, 3.0])),
        slow_fraction=draw(st.sampled_from([0.0, 0.25])),
        train_s=draw(st.sampled_from([0.01, 0.5, 3.0])),
        load_s=draw(st.sampled_from([0.0, 0.2])),
        no_variance=draw(st.sampled_from([0.0, 0.0, 0.3])),
        resume_at=draw(st.one_of(st.just(-1), st.integers(1, steps))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True)
@given(_runs())
def test_the_stream_never_stalls_keeps_the_bound_and_accounts_for_every_draw(p):
    out = _simulate(p)
    assert not out["stalled"], f"no feasible step {out['step']} and nothing running: {out['waiting']}"
    batch = p["batch_per_process"] * p["processes"]
    assert len(out["trained"]) == batch * p["steps"]
    assert max(out["staleness"]) <= p["k"] and min(out["staleness"]) >= 0
    assert out["dropped_stale"] == 0
    trained, dropped, outstanding = set(out["trained"]), set(out["dropped_nv"]), set(out["outstanding"])
    assert len(trained) == len(out["trained"])  # no draw trained twice
    assert not (trained & dropped) and not (trained & outstanding) and not (dropped & outstanding)
    drawn = set(out["drawn"])
    assert trained | dropped | outstanding <= drawn and len(drawn) == len(out["drawn"])
    # every draw accounted for: the rest were skipped (their task had a live group and a pending draw)
    assert len(drawn) == len(trained) + len(dropped) + len(outstanding) + out["skipped"]
