"""benchmarks/gateway_load.py, lean: concurrent agent rollouts through the gateway, each call
answered with its own echo and each session recording exactly its own turns; the check itself
flags a rollout's record read as another's."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gateway_load.py")


def _load():
    spec = importlib.util.spec_from_file_location("gateway_load_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_concurrent_rollouts_are_neither_lost_nor_misattributed():
    load = _load()
    out = asyncio.run(load.run_load(rollouts=96, turns=2))
    print(f"\n{out}")
    assert out["errors"] == 0 and out["misattributed_or_lost"] == 0, out["first_problems"]
    assert out["calls"] == 96 * 2 and out["p50_ms"] <= out["p99_ms"]


def test_the_record_check_flags_another_rollouts_turns():
    load = _load()
    from rljax.chat import ChatMLRenderer
    from rljax.recording import StepRecorder

    async def one_call():
        rec = StepRecorder(ChatMLRenderer(load.TOK), ("x", 0), temperature=1.0)
        prompt = rec.prompt_for([{"role": "user", "content": "rollout 3 turn 0"}])
        completion = await load.EchoEngine().generate(prompt.ids, None)
        rec.record(prompt, completion, temperature=1.0)
        return rec

    rec = asyncio.run(one_call())
    assert load._check_record(rec, 3, 1) is None
    assert "prompt holds the turns [('3', '0')]" in load._check_record(rec, 4, 1)
    assert "1 recorded calls, not 2" == load._check_record(rec, 3, 2)
