"""Warm-start corruption: a "corrupted" demonstration never says what the uncorrupted one would.

The reference is the environment's own scorer: every demonstration's final assistant turn, decoded
from its token ids, is replayed through a fresh env (reasoning-gym's ``score_answer``, the lookup
env's exact match), so a corrupted demonstration must score 0 and an uncorrupted one 1, and the
reported number of uncorrupted demonstrations must equal the number that score 1.
"""

from __future__ import annotations

import pytest

from rljax import envs
from rljax.chat import make_renderer, toy_tokenizer
from rljax.training.warmstart import WarmStartConfig, demonstration_batches

RG_TASK = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"],
               allow_parentheses=False, allow_negation=False, system_prompt=None)  # fmt: skip
# every possible sum, in the form the reasoning-gym env's solution answers in
RG_CHOICES = tuple(f"<answer>{i}</answer>" for i in range(21))


@pytest.fixture(scope="module")
def renderer():
    return make_renderer("chatml", toy_tokenizer("chatml"))


def _replay(renderer, task, steps, make_env) -> float:
    """Reward of the demonstration's last assistant turn in a fresh env."""
    env = make_env()
    env.reset(task)
    text = renderer.tokenizer.decode(list(steps[-1].response_ids)[:-1])  # drop <|im_end|>
    return float(env.step(text).reward)


def _check(renderer, tasks, make_env, config, seed=0):
    by_id = {t.id: t for t in tasks}
    rewards = []
    for steps, correct in demonstration_batches(tasks, lambda t: make_env(), renderer, config, seed=seed):
        last = [s for s in steps if s.is_last_step]
        assert len(last) == config.batch_size
        got = []
        for s in last:
            task = by_id[s.trajectory_id.instance_id.rsplit("/ws", 1)[0]]
            got.append(_replay(renderer, task, [s], make_env))
        assert correct == sum(r == 1.0 for r in got)
        rewards += got
    return rewards


def test_reasoning_gym_corruption_is_always_wrong(renderer):
    """The old bug: ``task.data["answer"] == "7"`` was compared with ``"<answer>7</answer>"``, so one
    "corrupted" demonstration in 21 gave the right answer (P(none in 192) < 1e-3)."""
    tasks = envs.make_tasks("reasoning_gym:basic_arithmetic", 48, seed=0, split="train", **RG_TASK)
    make = lambda: envs.make_env("reasoning_gym:basic_arithmetic")  # noqa: E731
    cfg = WarmStartConfig(num_steps=6, batch_size=32, corrupt_prob=1.0, corrupt_choices=RG_CHOICES)
    rewards = _check(renderer, tasks, make, cfg)
    assert len(rewards) == 192 and max(rewards) < 1.0


def test_uncorrupted_and_mixed_demonstrations_score_as_reported(renderer):
    tasks = envs.make_tasks("reasoning_gym:basic_arithmetic", 48, seed=0, split="train", **RG_TASK)
    make = lambda: envs.make_env("reasoning_gym:basic_arithmetic")  # noqa: E731
    clean = WarmStartConfig(num_steps=2, batch_size=16, corrupt_prob=0.0, corrupt_choices=RG_CHOICES)
    assert set(_check(renderer, tasks, make, clean)) == {1.0}
    mixed = WarmStartConfig(num_steps=4, batch_size=16, corrupt_prob=0.5, corrupt_choices=RG_CHOICES)
    rewards = _check(renderer, tasks, make, mixed)
    assert 0 < sum(r == 1.0 for r in rewards) < len(rewards)


def test_lookup_corruption_is_always_wrong(renderer):
    tasks = envs.make_tasks("lookup", 16, seed=0)
    make = lambda: envs.make_env("lookup", compact=True)  # noqa: E731
    cfg = WarmStartConfig(num_steps=3, batch_size=8, corrupt_prob=1.0, corrupt_choices=envs.COLORS)
    assert max(_check(renderer, tasks, make, cfg)) < 1.0


def test_corruption_without_a_different_choice_is_an_error(renderer):
    tasks = envs.make_tasks("reasoning_gym:basic_arithmetic", 4, seed=0, split="train", **RG_TASK)
    answer = f"<answer>{tasks[0].data['answer']}</answer>"
    choices = (answer, f" {answer} ")
    cfg = WarmStartConfig(num_steps=1, batch_size=1, corrupt_prob=1.0, corrupt_choices=choices)
    make = lambda t: envs.make_env("reasoning_gym:basic_arithmetic")  # noqa: E731
    with pytest.raises(ValueError, match="equals the demonstration's answer"):
        list(demonstration_batches(tasks[:1], make, renderer, cfg, seed=0))


def test_draws_are_seeded(renderer):
    tasks = envs.make_tasks("lookup", 16, seed=0)
    make = lambda t: envs.make_env("lookup", compact=True)  # noqa: E731
    cfg = WarmStartConfig(num_steps=2, batch_size=4, corrupt_prob=0.5, corrupt_choices=envs.COLORS)

    def ids(seed):
        return [[list(s.response_ids) for s in steps] for steps, _ in demonstration_batches(
            tasks, make, renderer, cfg, seed=seed)]  # fmt: skip

    assert ids(3) == ids(3) != ids(4)
