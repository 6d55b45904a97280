"""The fully asynchronous mode's rules (rljax.run.streaming): admission, earliest-deadline
consumption and the staleness bound, by hand-computed cases and against a simulated clock."""

from __future__ import annotations

import asyncio
import heapq
import types

import numpy as np
import pytest

from rljax.envs.base import Task
from rljax.rollout import RolloutConfig
from rljax.run.builders import process_batch
from rljax.run.streaming import (
    Draw,
    Group,
    StreamingScheduler,
    StreamState,
    _Window,
    combine_stream_metrics,
    draw_number,
    owned_tasks,
    staleness_metrics,
)
from rljax.types import Step


def _draw(n: int, task: str | None = None) -> Draw:
    return Draw(Task(task or f"t{n}"), n)


def _result(steps=()) -> types.SimpleNamespace:
    return types.SimpleNamespace(batch=list(steps))


def test_admission_room_is_arreal_capacity_rule():
    s = StreamState(batch=2, max_staleness=1, num_steps=10)
    # (v + k + 1 - m) * B - live: on version 0 with no step consumed, 4 groups
    assert s.admission_room(version=0) == 4
    for n in range(4):
        s.admit(_draw(n), version=0, now=0.0)
    assert s.admission_room(version=0) == 0
    with pytest.raises(RuntimeError, match="capacity rule"):
        s.admit(_draw(9), version=0, now=0.0)
    for n in range(4):
        s.finish(n, _result(), version=0, now=1.0 + n)
    chosen = s.choose(0)
    assert [g.draw.number for g in chosen] == [0, 1]
    s.consume(chosen)
    # step 0 taken, still on version 0: (0 + 1 + 1 - 1) * 2 - 2 live = 0; on version 1: 2
    assert s.admission_room(version=0) == 0 and s.admission_room(version=1) == 2
    # the end of the run: no more than the remaining steps train
    end = StreamState(batch=2, max_staleness=3, num_steps=1)
    assert end.admission_room(version=0) == 2


def test_choose_waits_for_a_group_due_now_and_prefers_earliest_deadlines():
    s = StreamState(batch=2, max_staleness=1, num_steps=10)
    for n in range(4):  # a, b, c, d on version 0: deadline 1
        s.admit(_draw(n), version=0, now=0.0)
    s.finish(2, _result(), version=0, now=1.0)
    s.finish(3, _result(), version=0, now=2.0)
    step0 = s.choose(0)
    assert [g.draw.number for g in step0] == [2, 3]  # nothing is due at step 0: the first finished
    s.consume(step0)
    for n in (4, 5):  # on version 1: deadline 2
        s.admit(_draw(n), version=1, now=3.0)
    s.finish(4, _result(), version=1, now=4.0)
    s.finish(5, _result(), version=1, now=5.0)
    # groups 0 and 1 are due at step 1 and still running: the newer finished ones must wait
    assert s.choose(1) is None
    s.finish(0, _result(), version=1, now=6.0)
    assert s.choose(1) is None  # one of the two due groups is still running
    s.finish(1, _result(), version=1, now=7.0)
    assert [g.draw.number for g in s.choose(1)] == [0, 1]
    assert s.dropped_stale == 0


def test_a_repeated_task_never_blocks_a_step():
    """Batch 2, bound 1: the iterator hands out a, b, c, then c again (the epoch boundary) while the
    first c is live. Both c groups would be due at step 1, and one step trains one group per task:
    the second c is deferred instead, and every step finds its groups."""
    s = StreamState(batch=2, max_staleness=1, num_steps=10)
    started = [s.admit(_draw(n, task), version=0, now=0.0) for n, task in enumerate("abcc")]
    for g in started:
        if g is not None:
            s.finish(g.draw.number, _result(), version=0, now=float(g.draw.number))
    step0 = s.choose(0)
    assert [g.task_id for g in step0] == ["a", "b"]
    s.consume(step0)
    for n, task in [(4, "d"), (5, "e")]:  # on version 1
        s.admit(_draw(n, task), version=1, now=5.0)
        s.finish(n, _result(), version=1, now=6.0)
    step1 = s.choose(1)
    assert step1 is not None, "step 1 has no feasible choice: the stream would wait forever"
    assert [g.task_id for g in step1] == ["c", "d"]  # c is due at step 1, then the earliest finished
    s.consume(step1)
    assert started[3] is None and [d.number for d in s.pending] == [3]  # the second c waited
    assert s.next_pending() == _draw(3, "c")  # and starts first now that the first c trained
    assert s.dropped_stale == 0


def test_start_next_defers_a_live_task_once_skips_it_after_and_draws_on():
    tasks = [Task(t) for t in "abc"]
    order = iter(["a", "b", "a", "c", "b", "a", "b"])  # the iterator's next tasks (a and b repeat)
    numbers = iter(range(100))

    def new_draw():
        return Draw(Task(next(order)), next(numbers))

    s = StreamState(batch=1, max_staleness=3, num_steps=10)
    start = dict(num_tasks=len(tasks), version=0, now=0.0)
    assert s.start_next(new_draw, **start).task_id == "a"
    assert s.start_next(new_draw, **start).task_id == "b"
    third = s.start_next(new_draw, **start)  # a is live: deferred, the next draw (c) starts
    assert (third.task_id, third.draw.number) == ("c", 3)
    assert [d.number for d in s.pending] == [2]
    assert s.start_next(new_draw, **start) is None  # every task live: nothing starts, nothing drawn
    assert next(order) == "b"
    s.finish(1, _result(), version=0, now=1.0)
    s.consume(s.choose(0))  # b trains; the next draws: a (live, one already pending: skipped), b
    fourth = s.start_next(new_draw, **{**start, "version": 1})
    assert (fourth.task_id, fourth.draw.number, fourth.start_version) == ("b", 5, 1)
    assert s.draws_skipped == 1 and [d.number for d in s.pending] == [2]
    s.finish(0, _result(), version=1, now=2.0)
    s.consume(s.choose(1))  # a trains: its deferred draw starts first, on the served version
    fifth = s.start_next(new_draw, **{**start, "version": 2})
    assert (fifth.task_id, fifth.draw.number, fifth.start_version) == ("a", 2, 2)
    # a checkpoint's outstanding draws are the pending, running and finished ones, in draw order
    s.admit(_draw(9, "b"), version=2, now=3.0)  # b is live: pending
    assert [d.number for d in s.outstanding()] == [2, 3, 5, 9]
    with pytest.raises(RuntimeError, match="capacity rule"):
        StreamState(batch=1, max_staleness=0, num_steps=0).admit(_draw(0), version=0, now=0.0)


def test_a_group_past_its_deadline_is_dropped_and_drawn_again():
    s = StreamState(batch=1, max_staleness=0, num_steps=10)
    s.admit(_draw(0), version=0, now=0.0)
    s.next_step = 1  # the step it was due at passed (a broken schedule: the safety net)
    s.finish(0, _result(), version=1, now=1.0)
    assert s.dropped_stale == 1 and not s.ready
    assert s.outstanding() == [Draw(Task("t0"), 0, 1)]


def _simulate(*, k: int, batch: int, steps: int, train_s: float, sigma: float, seed: int, edf: bool):
    """A discrete-event run of the stream: group durations lognormal(0, sigma), a train step of
    ``train_s``, weights served the moment they are published. ``edf=False`` consumes the first
    finished groups instead (AReaL's capacity rule alone). Returns (staleness per trained group,
    draws trained, stale drops, the most groups live at once)."""
    rng = np.random.default_rng(seed)
    s = StreamState(batch=batch, max_staleness=k, num_steps=steps)
    now, version, next_draw, most_live = 0.0, 0, 0, 0
    events: list[tuple[float, int, int]] = []  # (time, kind 0 = finish / 1 = trained, group number)
    staleness, trained = [], []
    training = False
    while s.next_step < steps or training:
        while s.admission_room(version=version) > 0:
            s.admit(_draw(next_draw), version=version, now=now)
            heapq.heappush(events, (now + float(rng.lognormal(0.0, sigma)), 0, next_draw))
            next_draw += 1
        most_live = max(most_live, s.live)
        if not training and s.next_step < steps:
            if edf:
                chosen = s.choose(s.next_step)
            else:
                ready = sorted(s.ready, key=lambda g: g.finished)
                chosen = ready[:batch] if len(ready) >= batch else None
            if chosen is not None:
                staleness += [s.next_step - g.start_version for g in chosen]
                trained += [g.draw.number for g in chosen]
                if edf:
                    s.consume(chosen)
                else:
                    for g in chosen:
                        s.ready.remove(g)
                    s.next_step += 1
                training = True
                heapq.heappush(events, (now + train_s, 1, -1))
                continue
        now, kind, number = heapq.heappop(events)
        if kind == 0:
            s.finish(number, _result(), version=version, now=now)
        else:
            training, version = False, version + 1
    return np.array(staleness), trained, s.dropped_stale, most_live


@pytest.mark.parametrize("k", [1, 2, 4])
def test_simulated_stream_keeps_the_bound_and_trains_every_draw_once(k):
    batch, steps = 4, 60
    staleness, trained, dropped, most_live = _simulate(
        k=k, batch=batch, steps=steps, train_s=0.5, sigma=1.5, seed=k, edf=True
    )
    assert dropped == 0
    assert staleness.max() <= k and staleness.min() >= 0
    assert len(trained) == batch * steps and len(set(trained)) == len(trained)
    assert most_live <= (k + 1) * batch
    # the stream does use its room: some groups train stale, out of draw order
    assert staleness.max() >= 1 and trained != sorted(trained)


def test_capacity_rule_alone_lets_slow_groups_go_stale():
    """The same clock and durations, consuming the first finished groups: groups overtaken by newer
    ones miss their deadline and are dropped (which is why consumption follows deadlines)."""
    staleness, trained, dropped, _ = _simulate(
        k=1, batch=4, steps=60, train_s=0.5, sigma=1.5, seed=1, edf=False
    )
    assert dropped > 0 and staleness.max() <= 1


def test_staleness_metrics_over_trained_tokens():
    steps = [
        # tokens of versions 3, 3, 4 (an in-flight update); the middle one is not trained
        Step([1], [5, 6, 7], ("a", 0), loss_mask=[1, 0, 1], response_versions=[3, 3, 4], policy_version=3),
        Step([1], [5, 6], ("a", 1), policy_version=4),
        Step([1], [5], ("s", 0), policy_version=0, algorithm="sft"),  # a frozen sampler: left out
    ]
    group = Group(
        _draw(0), start_version=3, started=0.0, finish_version=4, finished=1.0, result=_result(steps)
    )
    m = staleness_metrics([group], 5, frozen=frozenset({"sft"}))
    # trained tokens: versions 3, 4, 4, 4 at step 5 -> staleness 2, 1, 1, 1
    assert m["async/staleness_mean"] == pytest.approx(5 / 4)
    assert (m["async/staleness_min"], m["async/staleness_max"]) == (1.0, 2.0)
    # finished on version 4: in flight 1, 0, 0, 0; in the queue 1 each
    assert m["async/staleness_inflight_mean"] == pytest.approx(1 / 4)
    assert m["async/staleness_queue_mean"] == pytest.approx(1.0)


def test_a_group_an_in_flight_switch_reached_never_has_negative_inflight_staleness():
    """With in-flight updates the embedded sampler samples with a published version at once, then
    waits inside ``serve()`` until its running batches switched; the stream records the version as
    served only when ``serve()`` returns. A group finishing in that wait has tokens of the new
    version: it finished on that version, not the one recorded as served."""
    steps = [
        Step([1], [5, 6, 7], ("a", 0), response_versions=[1, 1, 2], policy_version=1),
        Step([1], [5], ("s", 0), policy_version=7, algorithm="sft"),  # a frozen sampler's label
    ]
    state = StreamState(batch=1, max_staleness=1, num_steps=10, next_step=1)
    group = state.admit(_draw(0), version=1, now=0.0)

    async def run_rollout(tasks, engines, config):
        return types.SimpleNamespace(batch=steps, metrics={"response_tokens": 4})

    stream = types.SimpleNamespace(
        rollout_config=RolloutConfig(), rollout_seed=0, run_rollout=run_rollout, _engines={},
        dynamic_sampling=None, clock=lambda: 1.0, served_version=1, _frozen=frozenset({"sft"}),
        state=state, _window=_Window(), _wakeup=lambda: None, _error=None,
    )  # fmt: skip
    asyncio.run(StreamingScheduler._run_group(stream, group))
    assert group.finish_version == 2 and state.ready == [group]
    m = staleness_metrics([group], 2, frozen=frozenset({"sft"}))
    # at step 2 the tokens of versions 1, 1, 2 are 1, 1, 0 stale: all of it in flight (finished on 2)
    assert m["async/staleness_mean"] == pytest.approx(2 / 3)
    assert m["async/staleness_inflight_mean"] == pytest.approx(2 / 3)
    assert m["async/staleness_queue_mean"] == 0.0


def test_process_batch_owned_tasks_and_draw_numbers_split_the_stream():
    assert process_batch(8, 1) == 8 and process_batch(8, 2) == 4
    with pytest.raises(
        ValueError, match="prompts_per_step=6 does not divide by 4: use a multiple of 4 \\(e.g. 8\\)"
    ):
        process_batch(6, 4)
    tasks = [Task(f"t{i}") for i in range(7)]
    parts = [owned_tasks(tasks, p, 3) for p in range(3)]
    assert [[t.id for t in part] for part in parts] == [["t0", "t3", "t6"], ["t1", "t4"], ["t2", "t5"]]
    assert owned_tasks(tasks, 0, 1) == tasks
    # draw numbers: unique across processes, each process's in its own residue class
    numbers = [draw_number(i, p, 3) for p in range(3) for i in range(5)]
    assert sorted(numbers) == list(range(15))
    assert [draw_number(i, 0, 1) for i in range(3)] == [0, 1, 2]


def test_combine_stream_metrics_adds_counts_and_averages_engines():
    a = {"async/groups_inflight": 2.0, "async/groups_queued": 1.0, "async/groups_dropped_stale": 0.0,
         "async/groups_dropped_no_variance": 1.0, "async/rollout_tokens_per_s": 100.0,
         "async/engine_idle_fraction": 0.2, "async/inflight_updates": 1.0}  # fmt: skip
    b = {**a, "async/groups_inflight": 3.0, "async/rollout_tokens_per_s": 50.0,
         "async/engine_idle_fraction": 0.6, "async/inflight_updates": 0.0}  # fmt: skip
    row = combine_stream_metrics([a, b], [[1.0], [2.0, 6.0]])
    assert row["async/groups_inflight"] == 5.0 and row["async/groups_queued"] == 2.0
    assert row["async/groups_dropped_no_variance"] == 2.0 and row["async/rollout_tokens_per_s"] == 150.0
    assert row["async/engine_idle_fraction"] == pytest.approx(0.4) and row["async/inflight_updates"] == 0.5
    assert row["async/group_wait_s"] == 3.0  # (1 + 2 + 6) / 3 groups, not the mean of the means
    assert combine_stream_metrics([a], [[1.0, 2.0]]) == {**a, "async/group_wait_s": 1.5}


def test_a_stream_resumes_only_with_the_process_count_of_its_checkpoint():
    one = {"epoch": 0, "position": 3, "next_draw": 3, "outstanding": []}
    two = {"process_count": 2, "processes": [{**one, "next_draw": 1}, {**one, "next_draw": 2}]}

    def own(state, index, count):
        me = types.SimpleNamespace(process_index=index, process_count=count)
        return StreamingScheduler._own_state(me, state)

    assert own(one, 0, 1) is one
    assert own(two, 1, 2)["next_draw"] == 2
    with pytest.raises(ValueError, match="written by 2 process\\(es\\), this run has 1"):
        own(two, 0, 1)
    with pytest.raises(ValueError, match="written by 1 process\\(es\\), this run has 2"):
        own(one, 1, 2)


@pytest.mark.slow  # builds the smoke model and tasks
def test_check_run_refuses_a_fully_async_batch_that_does_not_split_over_the_processes():
    from recipes import load_recipe

    from rljax.algorithms import validate_algorithm_config
    from rljax.run.builders import build_model, build_tokenizer, check_run
    from rljax.run.config import parse_run_config
    from rljax.run.tasks import build_env_tasks

    c = load_recipe("smoke")
    c.mesh.data = 2
    c.trainer.update(mode="fully_async", prompts_per_step=3, mini_batch_prompts=0)
    cfg = parse_run_config(c)
    model = build_model(cfg.model, vocab_size=len(build_tokenizer(cfg.tokenizer)), seed=0)
    parts = dict(
        algorithms=validate_algorithm_config(cfg.algorithm, group_size=cfg.rollout.group_size),
        model_config=model.config,
        env_tasks=build_env_tasks(cfg),
        renderer=None,
        device_count=2,
    )
    check_run(cfg, process_count=1, **parts)  # one process: any batch
    with pytest.raises(ValueError, match="with 2 processes .* prompts_per_step=3 does not divide by 2"):
        check_run(cfg, process_count=2, **parts)
    check_run(parse_run_config({**c.to_dict(), "trainer": {**c.trainer.to_dict(), "prompts_per_step": 4}}),
              process_count=2, **parts)  # fmt: skip
