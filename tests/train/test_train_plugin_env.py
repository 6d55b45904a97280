"""A user's environment, defined outside the package, trains through ``config.envs.<name>.env``
alone: no registration, no ``Trainer(make_env=..., tasks=...)``, no edit to rljax.

The environment's reward is a known function of the task (its value + a bonus from the config's
``kwargs``), whatever the policy answers, so every reward metric of the run has an exact expected
value, computed here from the episodes the environment itself recorded.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest
from recipes import load_recipe

from rljax.run import run as run_module
from rljax.run.trainer import Trainer
from rljax.training.step import train_mini_batch

pytestmark = pytest.mark.integration  # end-to-end training (seconds on the smoke model)

MODULE = "user_coin_env"
SOURCE = '''
EPISODES = []  # (task id, split, reward) of every finished episode, in order


class CoinEnv:
    """One turn; reward = task value + bonus, whatever the answer."""

    def __init__(self, bonus=0.0):
        self.bonus = bonus

    @staticmethod
    def make_tasks(num_tasks, *, seed, split, levels=8):
        return [
            {"id": f"{split}-{i}", "data": {"value": i / levels}, "split": split}
            for i in range(num_tasks)
        ]

    def reset(self, task):
        self.task = task
        return [{"role": "user", "content": f"Pick {task.id}."}]

    def step(self, action):
        reward = self.task.data["value"] + self.bonus
        EPISODES.append((self.task.id, self.task.split, reward))
        return [], reward, True, {"value": self.task.data["value"]}
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))  # outside the package, as a user's code would be
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield
    sys.modules.pop(MODULE, None)


def test_an_env_class_from_outside_the_package_trains(tmp_path, user_module, capsys):
    c = load_recipe("smoke")
    c.envs = {
        "coin": dict(
            env=f"{MODULE}:CoinEnv",
            kwargs=dict(bonus=0.5),
            task_kwargs=dict(levels=8),
            num_train_tasks=8,
            num_eval_tasks=2,
        )
    }
    # the recipe's warm start replays env.solution demonstrations; this env has none: skipped, said once
    assert c.warmstart.num_steps > 0
    c.trainer.update(num_steps=2, prompts_per_step=2, eval_every=2, checkpoint_every=0)
    history = Trainer(c, tmp_path / "run").run()
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warm start")]
    assert notices == [
        "warm start: config.envs ['coin'] have no solution(task) to demonstrate; skipped "
        "(config.warmstart.num_steps=0: no notice)"
    ]
    assert not (tmp_path / "run" / "warmstart").exists()  # no warm-start step logged

    episodes = importlib.import_module(MODULE).EPISODES
    per_step = c.trainer.prompts_per_step * c.rollout.group_size
    train = [e for e in episodes if e[1] == "train"]
    evals = [e for e in episodes if e[1] == "test"]
    assert [h["step"] for h in history] == [1, 2]
    assert len(train) == 2 * per_step and len(evals) == 2  # eval group size 1, 2 eval tasks
    for step, row in enumerate(history):
        drawn = train[step * per_step : (step + 1) * per_step]  # sync: step n's rollout precedes n+1's
        ids = sorted(e[0] for e in drawn)
        groups = Counter(ids)  # prompts_per_step tasks, each sampled group_size times
        assert sorted(groups.values()) == [c.rollout.group_size] * c.trainer.prompts_per_step
        # the reward the env's rule gives each drawn task: value i/8 of task "train-i" + bonus 0.5
        expected = [int(task_id.split("-")[1]) / 8 + 0.5 for task_id in ids]
        assert row["reward/mean"] == pytest.approx(np.mean(expected), abs=1e-6)
        assert row["reward/max"] == pytest.approx(max(expected), abs=1e-6)
        assert row["rollout/num_errored"] == 0
    eval_expected = np.mean([int(task_id.split("-")[1]) / 8 + 0.5 for task_id, *_ in evals])
    assert sorted(e[0] for e in evals) == ["test-0", "test-1"]
    assert history[-1]["eval/reward_mean"] == pytest.approx(eval_expected, abs=1e-6)  # (0 + 1/8) / 2 + 0.5


def test_the_warm_start_demonstrates_only_envs_with_solutions(tmp_path, user_module, capsys, monkeypatch):
    c = load_recipe("smoke")
    c.envs.coin = dict(env=f"{MODULE}:CoinEnv", num_train_tasks=8, num_eval_tasks=0)  # beside lookup
    c.envs.lookup.num_eval_tasks = 0
    # one row per micro-batch: the warm start's steps micro-batch as the RL steps do
    c.trainer.update(
        num_steps=1, prompts_per_step=2, eval_every=0, checkpoint_every=0, micro_batch_tokens=256
    )
    micro_batched = []

    def spy(state, batch, counts):
        micro_batched.append(np.shape(batch.tokens))
        return train_mini_batch(state, batch, counts)

    monkeypatch.setattr(run_module, "train_mini_batch", spy)
    Trainer(c, tmp_path / "run").run()  # a demonstration of a coin task would raise (no solution)
    # each warm-start step (4 demonstrations in rows of 256 tokens: 2 rows at least) in one-row
    # micro-batches (the RL step's 2 prompts fit in one row: one plain step)
    assert len(micro_batched) == c.warmstart.num_steps, micro_batched
    assert all(shape[1:] == (1, 256) and shape[0] >= 2 for shape in micro_batched), micro_batched
    out = capsys.readouterr().out
    notice = "warm start: config.envs ['coin'] have no solution(task) to demonstrate; it demonstrates"
    assert notice + " ['lookup'] only" in out
    assert f"warm start: {c.warmstart.num_steps} steps in" in out
