"""The default task trained as an environment and as an agent through the gateway (smoke sizes)."""

from __future__ import annotations

import math

import pytest
from recipes import load_recipe

from rljax.run.trainer import Trainer

AGENT = "rljax.agents.lookup_agent:lookup_agent"


@pytest.mark.integration
@pytest.mark.parametrize(
    "agent, mode",
    [("", "sync"), (AGENT, "sync"), (AGENT, "async")],
)
def test_lookup_trains_as_env_and_as_agent(tmp_path, agent, mode):
    c = load_recipe("smoke")
    c.envs.lookup.agent = agent
    c.trainer.update(num_steps=2, mode=mode, eval_every=2, checkpoint_every=0)
    trainer = Trainer(c, tmp_path)
    rows = [r for r in trainer.run() if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and r["rollout/num_errored"] == 0 and r["rollout/num_steps"] >= 4
        assert r["policy_version/lag"] <= (1 if mode == "async" else 0)
    assert "eval/reward_mean" in rows[-1]
    gateway = trainer.parts.scheduler.gateway
    if agent:  # the run's gateway served the rollouts (and eval) and was stopped with the run
        assert gateway is not None and not gateway.started
    else:
        assert gateway is None
