"""Unit tests of the trainer's host pieces: task iterator, warm-start demonstrations, config checks."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recipes import load_recipe

from rljax import envs
from rljax.chat import make_renderer, toy_tokenizer
from rljax.data import StepBatch
from rljax.data.merge import merge_steps
from rljax.envs.base import Task
from rljax.run.trainer import TaskIterator, Trainer
from rljax.training.warmstart import WarmStartConfig, demonstration_steps

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(name: str):
    return load_recipe(name)


# -- TaskIterator -----------------------------------------------------------------------------------


def _reference_draws(n: int, seed: int, sizes: list[int]) -> list[list[int]]:
    """Independent reference: epochs are permutations of default_rng([seed, epoch]); a draw that
    crosses into a new epoch skips (defers to the end of that epoch) the tasks it already holds."""
    draws: list[list[int]] = []
    epoch, queue = 0, np.random.default_rng([seed, 0]).permutation(n).tolist()
    for size in sizes:
        draw: list[int] = []
        while len(draw) < size:
            if not queue:
                epoch += 1
                fresh = np.random.default_rng([seed, epoch]).permutation(n).tolist()
                queue = [t for t in fresh if t not in draw] + [t for t in fresh if t in draw]
            draw.append(queue.pop(0))
        draws.append(draw)
    return draws


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 7),
    seed=st.integers(0, 1000),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=8),
    cut=st.integers(0, 8),
)
def test_task_iterator_order_and_state_round_trip(n, seed, sizes, cut):
    sizes = [min(k, n) for k in sizes]
    tasks = [Task(f"t{i}") for i in range(n)]
    it = TaskIterator(tasks, seed=seed)
    got, state = [], None
    for i, k in enumerate(sizes):
        if i == cut:
            state = it.state()
        got.append([int(t.id[1:]) for t in it.take(k)])
    assert got == _reference_draws(n, seed, sizes)
    assert all(len(set(d)) == len(d) for d in got), "a task repeated within one draw (one RL step)"
    flat = [t for d in got for t in d]
    for e in range(len(flat) // n):  # every epoch visits every task exactly once
        assert sorted(flat[e * n : (e + 1) * n]) == list(range(n))
    if state is not None:
        resumed = TaskIterator(tasks, seed=seed)
        resumed.restore(__import__("json").loads(__import__("json").dumps(state)))  # JSON round trip
        assert [[int(t.id[1:]) for t in resumed.take(k)] for k in sizes[cut:]] == got[cut:]


def test_task_iterator_draws_never_repeat_across_an_epoch_boundary():
    # the failing case: 10 tasks, 8 prompts per step; step 2 crosses into epoch 1
    it = TaskIterator([Task(f"t{i}") for i in range(10)], seed=0)
    for _ in range(12):
        draw = [t.id for t in it.take(8)]
        assert len(set(draw)) == 8
    with pytest.raises(ValueError, match="distinct"):
        it.take(11)


def test_task_iterator_visits_every_task_once_per_epoch():
    it = TaskIterator([Task(f"t{i}") for i in range(5)], seed=3)
    for _ in range(3):
        assert sorted(t.id for t in it.take(5)) == [f"t{i}" for i in range(5)]


def test_task_iterator_rejects_empty():
    with pytest.raises(ValueError, match="at least one task"):
        TaskIterator([], seed=0)


# -- warm-start demonstrations ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def renderer():
    return make_renderer("chatml", toy_tokenizer("chatml"))


def test_demonstration_is_token_exact_and_merges(renderer):
    task = envs.make_tasks("lookup", 1, seed=0)[0]
    env = envs.make_env("lookup", compact=True)
    steps = demonstration_steps(task, env, renderer)
    tok = renderer.tokenizer
    # turn 1: a tool call naming the asked key; turn 2: the right color, both ending on <|im_end|>
    first = tok.decode(steps[0].response_ids)
    assert first.startswith("<tool_call>") and f'"key": "{task.data["query"]}"' in first
    assert first.endswith("<|im_end|>")
    assert tok.decode(steps[1].response_ids) == task.data["answer"] + "<|im_end|>"
    # the second prompt extends the first prompt + response (the rollout's bridge), so they merge
    full = list(steps[0].prompt_ids) + list(steps[0].response_ids)
    assert list(steps[1].prompt_ids)[: len(full)] == full
    merged = merge_steps(StepBatch(steps))
    assert len(merged) == 1 and merged[0].is_last_step
    # the observation (tool response) tokens between the turns are not trained
    gap = len(steps[1].prompt_ids) - len(full)
    assert list(merged[0].loss_mask) == [1] * len(steps[0].response_ids) + [0] * gap + [1] * len(
        steps[1].response_ids
    )


def test_demonstration_replays_through_the_env(renderer):
    """Feeding the demonstration's decoded turns to a fresh env earns the full reward."""
    from rljax.chat.session import ChatSession
    from rljax.envs.base import Action

    for task in envs.make_tasks("lookup", 3, seed=1):
        env = envs.make_env("lookup", compact=True)
        steps = demonstration_steps(task, envs.make_env("lookup", compact=True), renderer)
        session = ChatSession(renderer, env.reset(task))
        reward = None
        for s in steps:
            assert list(session.prompt_ids) == list(s.prompt_ids)  # same prompts as the rollout sees
            parsed = session.add_completion(s.response_ids)
            text = renderer.decode(list(s.response_ids)[:-1])
            messages, reward, done, _ = env.step(Action.from_parsed(text, parsed))
            if not done:
                session.add_messages(messages)
        assert reward == 1.0


def test_demonstration_corrupted_answer(renderer):
    task = envs.make_tasks("lookup", 1, seed=0)[0]
    wrong = next(c for c in envs.COLORS if c != task.data["answer"])
    steps = demonstration_steps(task, envs.make_env("lookup"), renderer, final_answer=wrong)
    assert renderer.tokenizer.decode(steps[-1].response_ids) == wrong + "<|im_end|>"


def test_demonstration_needs_solution(renderer):
    class NoSolution:
        def reset(self, task):
            return [{"role": "user", "content": "hi"}]

    with pytest.raises(ValueError, match="solution"):
        demonstration_steps(Task("x"), NoSolution(), renderer)


def test_warmstart_config_errors():
    with pytest.raises(ValueError, match="corrupt_choices"):
        WarmStartConfig(num_steps=1, corrupt_prob=0.5, corrupt_choices=("a",))
    WarmStartConfig(num_steps=0, corrupt_prob=0.5)  # disabled: nothing to corrupt
    with pytest.raises(ValueError, match="corrupt_prob"):
        WarmStartConfig(corrupt_prob=1.5, corrupt_choices=("a", "b"))
    with pytest.raises(ValueError, match="batch_size"):
        WarmStartConfig(batch_size=0)


# -- config validation (no run) -------------------------------------------------------------------
# Errors that ``parse_run_config`` raises (unknown keys, bad values, bad filters, ...) are tested
# without a model in test_train_run_config.py; here only the checks that need the built run (the
# algorithm registry, frozen models, task counts, env kwargs) and one parse error surfacing through
# the Trainer.


def test_default_and_smoke_configs_build(tmp_path):
    for name in ("default", "smoke"):
        t = Trainer(_config(name), tmp_path / name)
        assert t.parts.scheduler.rollout_config.group_size == _config(name).rollout.group_size
        assert t.parts.algorithms.default.name == "grpo"
        train, evals = t.parts.env_tasks.train, t.parts.env_tasks.eval
        assert {s.env for s in train} == {"lookup"}
        assert evals and all(s.split == "test" for s in evals)
        assert not {s.data["query"] for s in evals} & {s.data["query"] for s in train}


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.trainer.update(mode="later"), r"config.trainer.mode: expected one of"),  # parse error
        (lambda c: c.envs.lookup.update(kwargs=dict(bogus=1)), "bogus"),
        (lambda c: c.update(algorithm="no_such_algorithm"), "no_such_algorithm"),
        (lambda c: c.update(algorithm="sft"), "sampling='frozen' needs the frozen model that samples"),
        (lambda c: c.update(algorithm={"name": "opd", "teacher": "big"}), r"add config.frozen_models.big"),
        (lambda c: c.update(algorithm={"name": "opd"}), "needs a teacher"),
        (lambda c: c.update(algorithm="echo") or c.trainer.update(merge=False), "set trainer.merge=True"),
        (
            lambda c: c.update(algorithm={"name": "echo", "observation_filter": "no_such_module:fn"}),
            "cannot be imported",
        ),
        (lambda c: c.update(algorithm={"name": "echo", "observation_ce": {"assistant": 1.0}}), "'assistant'"),
        (lambda c: c.update(algorithm={"name": "grpo", "step_wise": False}), "set step_wise=True"),
        (lambda c: c.trainer.update(prompts_per_step=17), "prompts_per_step=17 exceeds the 16 train tasks"),
    ],
)
def test_config_errors_are_clear(tmp_path, edit, match):
    c = _config("smoke")
    with c.unlocked():
        edit(c)
    with pytest.raises((ValueError, TypeError), match=match):
        Trainer(c, tmp_path)


def test_opsd_needs_demonstrations(tmp_path):
    c = _config("smoke")
    c.algorithm = "opsd"
    plain = [Task(f"t{i}", {"table": {"zob": "red"}, "query": "zob", "answer": "red"}) for i in range(4)]
    with pytest.raises(ValueError, match="conditions on Task.demonstration, but none of the 4 train tasks"):
        Trainer(c, tmp_path, tasks={"lookup": (plain, [])})
    Trainer(c, tmp_path / "ok")  # the built-in lookup tasks carry demonstrations


def test_frozen_models_resolve(tmp_path):
    c = _config("smoke")
    c.algorithm = {"name": "opd", "teacher": "teacher"}
    c.frozen_models = {"teacher": {"base_url": "http://127.0.0.1:9/v1"}}
    t = Trainer(c, tmp_path)
    assert set(t.parts.engines.frozen_configs) == {"teacher"}
    c.algorithm = {"name": "opd", "teacher": "http://127.0.0.1:9"}  # a bare URL works too
    c.frozen_models = {}
    assert "http://127.0.0.1:9" in Trainer(c, tmp_path / "url").parts.engines.frozen_configs


def test_per_env_algorithms_resolve(tmp_path):
    c = _config("smoke")
    c.envs.arith = dict(env="arithmetic", kwargs={}, task_kwargs={}, num_train_tasks=8, num_eval_tasks=0)
    c.env_algorithms = {"arith": "rloo"}
    t = Trainer(c, tmp_path)
    assert dict(t.parts.scheduler.rollout_config.env_algorithms) == {"lookup": "grpo", "arith": "rloo"}
    assert set(t.parts.train_configs) == {"grpo", "rloo"}
    assert {s.env for s in t.parts.env_tasks.train} == {"lookup", "arith"}


def test_needed_behaviour_versions(tmp_path):
    c = _config("smoke")
    sched = Trainer(c, tmp_path).parts.scheduler
    assert [sched.needed_versions(s) for s in (0, 1, 5)] == [[], [], []]  # sync: none
    sched.lag = 1
    assert [sched.needed_versions(s) for s in (0, 1, 5)] == [[], [0], [4]]
    sched.lag = 2
    assert [sched.needed_versions(s) for s in (0, 1, 5)] == [[], [0], [3, 4]]


def test_without_lag_a_served_version_is_let_go_of_and_serving_it_again_is_a_no_op(tmp_path):
    """Sync mode: once the engine serves version v, no rollout or checkpoint needs the trainer's
    copy of v, so the scheduler drops it (a model's size of host memory); with lag it is kept."""
    parts = Trainer(_config("smoke"), tmp_path).parts
    sched = parts.scheduler

    def serve(version: int) -> None:
        parts.rollout_worker.submit(lambda: sched.serve(version)).result()

    try:
        parts.sync_weights(0)
        parts.start_engines(0)
        assert set(sched.served) == {0}
        serve(0)
        assert sched.served == {} and sched.behavior == {} and parts.engines.served_version == 0
        serve(0)  # the eval and the step's rollout both serve the version: the second does nothing
        parts.sync_weights(1)
        serve(1)
        assert sched.served == {} and parts.engines.served_version == 1
        with pytest.raises(RuntimeError, match="version 0 is no longer held and the engine serves 1"):
            serve(0)
        sched.lag = 1  # async: rollouts of later steps may still sample a served version
        parts.sync_weights(2)
        serve(2)
        assert set(sched.served) == {2} and set(sched.behavior) == {2}
    finally:
        parts.close()


def test_a_sync_run_trains_while_the_sampler_holds_no_weights(tmp_path):
    """Sync mode: version n is never sampled after rollout n, so the embedded sampler lets go of it
    during the train step (its decode copy: a model's size of memory) and the next serve loads
    version n + 1; an eval or rollout afterwards samples normally."""
    c = _config("smoke")
    c.trainer.update(num_steps=3, eval_every=2, checkpoint_every=0)
    t = Trainer(c, tmp_path)
    parts, held = t.parts, []
    train = parts.train

    def recording_train(*args, **kwargs):
        held.append(parts.engines.policy.holds_weights)
        return train(*args, **kwargs)

    parts.train = recording_train
    rows = t.run()
    assert held and not any(held)
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [2, 3]  # evals after release: served
    assert parts.engines.served_version == 3 and parts.engines.policy.holds_weights


def test_vllm_and_gpu_configs_load():
    v = _config("vllm_local")
    assert v.engine.kind == "vllm" and v.model.init.head_dim == 64
    g = _config("qwen3_gpu")
    assert g.engine.kind == "vllm" and g.renderer.name == "qwen3" and g.trainer.mode == "async"
    assert g.mesh.fsdp * g.mesh.data * g.mesh.tensor >= 1
