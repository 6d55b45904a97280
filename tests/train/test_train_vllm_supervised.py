"""A run on two launched REAL vLLM (CPU) servers that lose them one after the other.

The ``vllm_local`` recipe, shrunk (no warm start, 4 prompts x 4 samples), on two servers with
restarts off (``engine.max_restarts=0``): server 0 is SIGKILLed right after step 1's rollout, so
step 1's weight sync meets a dead server; server 1 after step 2's. Expected:

- step 2 runs: the sync skips the dead server instead of failing the run, and every trajectory of
  step 2 is served by server 1 (none errored);
- step 3 finds no server: after ``engine.all_down_timeout_s`` the run stops with one error that
  names both servers and the end of their logs;
- the step-2 checkpoint is intact: it is the latest, and it restores.

Runtime: a few minutes, mostly the two servers' start-up.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping

import pytest

from rljax.recipes import vllm_local
from rljax.run import scheduler as scheduler_mod
from rljax.run import trainer as trainer_mod
from rljax.training import checkpoint as ckpt

pytestmark = pytest.mark.integration


def _config():
    c = vllm_local.get_config()
    c.warmstart.num_steps = 0
    c.envs.lookup.update(num_train_tasks=16, num_eval_tasks=0)
    c.rollout.update(group_size=4, max_turns=2, max_tokens=24, max_concurrency=64)
    c.trainer.update(
        num_steps=3, mode="sync", prompts_per_step=4, mini_batch_prompts=0, seq_len=256,
        eval_every=0, checkpoint_every=1, keep_checkpoints=3,
    )  # fmt: skip
    c.engine.num_servers = 2
    c.engine.max_restarts = 0
    c.engine.all_down_timeout_s = 5.0
    c.engine.health_interval_s = 1.0
    c.engine.health_timeout_s = 5.0
    c.engine.server.extra_args = (*c.engine.server.extra_args, "--enforce-eager")
    return c


def test_run_survives_a_dead_server_and_stops_cleanly_when_none_is_left(tmp_path, monkeypatch, vllm_python):
    results = []
    real_rollout = scheduler_mod.rollout

    async def rollout_then_kill(*args, **kwargs):
        engine = kwargs["engine"]
        engine = engine["lookup"] if isinstance(engine, Mapping) else engine
        result = await real_rollout(*args, **kwargs)
        results.append((result, [s.down for s in engine.servers]))
        victim = len(results) - 1
        if victim < 2:  # after step 1's rollout server 0 dies, after step 2's server 1
            os.killpg(engine.supervisor.launched[victim].process.pid, signal.SIGKILL)
        return result

    monkeypatch.setattr(scheduler_mod, "rollout", rollout_then_kill)
    workdir = tmp_path / "run"
    with pytest.raises(Exception) as info:
        trainer_mod.Trainer(_config(), workdir).run()

    # Steps 1 and 2 ran, every trajectory served; step 2 with server 0 out of service.
    assert len(results) == 2
    for result, _ in results:
        assert len(result.trajectories) == 16 and not any(t.errored for t in result.trajectories)
    assert results[1][1] == [True, False]
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]

    # One clear error: both servers, why they are out, their logs.
    message = "".join(str(e) for e in _chain(info.value))
    print(f"\nthe run stopped with: {type(info.value).__name__}: {str(info.value)[:1500]}")
    assert "no vLLM server in service for 5 s" in message
    assert message.count("process exited (code -9)") >= 2 and message.count("log ") >= 2

    # The last checkpoint is intact: step 2, and it restores.
    assert ckpt.latest_step(workdir / "checkpoints") == 2
    assert ckpt.restore(workdir / "checkpoints", step=2).params["policy"]


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__
