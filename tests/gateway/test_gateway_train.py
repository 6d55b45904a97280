"""The default task trained as an environment and as an agent through the gateway (smoke sizes)."""

from __future__ import annotations

import math

import pytest
from recipes import load_recipe

from rljax.report.records import ROLLOUTS_DIR, read_rollout_records
from rljax.run.trainer import Trainer

AGENT = "rljax.agents.lookup_agent:lookup_agent"


@pytest.mark.integration
@pytest.mark.parametrize(
    "agent, mode",
    [("", "sync"), (AGENT, "sync"), (AGENT, "async"), (AGENT, "fully_async")],
)
def test_lookup_trains_as_env_and_as_agent(tmp_path, agent, mode):
    c = load_recipe("smoke")
    c.envs.lookup.agent = agent
    c.trainer.update(num_steps=2, mode=mode, eval_every=2, checkpoint_every=0, save_rollouts_every=1)
    if mode == "fully_async":  # agent turns may cross a weight update mid-decode
        c.engine.in_flight_updates = "recompute"
    trainer = Trainer(c, tmp_path)
    rows = [r for r in trainer.run() if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and r["rollout/num_errored"] == 0 and r["rollout/num_steps"] >= 4
        assert r["policy_version/lag"] <= (0 if mode == "sync" else 1)
    lag = 0 if mode == "sync" else 1
    for step in (1, 2):  # every recorded call's tokens carry valid version spans within the bound
        for record in read_rollout_records(tmp_path / ROLLOUTS_DIR / f"step_{step}.jsonl"):
            spans = record["weight_versions"]
            assert spans[0]["start"] == 0 and spans[-1]["end"] == len(record["completion_ids"])
            for a, b in zip(spans, spans[1:], strict=False):
                assert a["end"] == b["start"] and a["version"] < b["version"]
            assert all(step - 1 - lag <= v["version"] <= step - 1 for v in spans), spans
    assert "eval/reward_mean" in rows[-1]
    gateway = trainer.parts.scheduler.gateway
    if agent:  # the run's gateway served the rollouts (and eval) and was stopped with the run
        assert gateway is not None and not gateway.started
    else:
        assert gateway is None
