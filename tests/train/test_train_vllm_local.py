"""The vLLM recipes end to end against a REAL vLLM (CPU) server, the trainer launching its own.

Here: ``configs/lora_vllm.py`` (adapter syncs only) on the shrunk ``vllm_local`` config. The
``vllm_local`` recipe's own end-to-end checks (weight versions on samples, the served weights equal
to the trainer's checkpoints, vLLM's logprobs equal to the trainer's within 1e-4) run on the
two-server run of ``test_train_vllm_supervised.py``, whose first two steps are plain synchronous
steps of the recipe: one launch of servers and trainer for both.

The server's python comes from ``$RLJAX_VLLM_PYTHON`` or ``<repo>/.vllm-venv`` (see
``rljax.inference.vllm.find_vllm_python``); without one this test FAILS when ``CI=true`` and is
skipped with the reason otherwise. Runtime: about a minute, mostly server start-up.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
import pytest

from rljax.recipes import vllm_local
from rljax.run import trainer as trainer_mod

pytestmark = pytest.mark.integration


def _small_config():
    c = vllm_local.get_config()
    c.warmstart.num_steps = 0
    c.envs.lookup.update(num_train_tasks=16, num_eval_tasks=0)
    c.rollout.update(group_size=4, max_turns=2, max_tokens=24, max_concurrency=64)
    c.trainer.update(
        num_steps=2,
        mode="sync",
        prompts_per_step=4,
        mini_batch_prompts=0,
        seq_len=256,
        eval_every=0,
        checkpoint_every=1,
        keep_checkpoints=3,
    )
    # Eager mode skips vLLM's ~30 s torch.compile warm-up; the numerics stay float32.
    c.engine.server.extra_args = (*c.engine.server.extra_args, "--enforce-eager")
    return c


def test_lora_vllm_recipe_syncs_adapters_only(tmp_path, monkeypatch, vllm_python):
    """configs/lora_vllm.py: servers on the base weights with runtime LoRA, one verified adapter
    sync per step under a versioned name, samples recorded with that version; the base never moves.
    The task runs as an agent through the gateway in front of the vLLM servers."""
    import rljax.agents as agents_mod
    from rljax.recipes import lora_vllm

    c = lora_vllm.get_config()
    small = _small_config()
    for key in ("warmstart", "envs", "rollout", "trainer"):
        c[key] = small[key]
    c.envs.lookup.agent = "rljax.agents.lookup_agent:lookup_agent"
    c.engine.server.extra_args = small.engine.server.extra_args
    syncs = []
    real_rollout = agents_mod.agent_rollout

    async def recording_rollout(*args, **kwargs):
        engine = kwargs["engine"]
        engine = engine["lookup"] if isinstance(engine, Mapping) else engine
        syncs.append(engine.last_adapter_sync)
        return await real_rollout(*args, **kwargs)

    monkeypatch.setattr(agents_mod, "agent_rollout", recording_rollout)
    t = trainer_mod.Trainer(c, tmp_path / "run")
    base = [np.array(x) for x in jax.tree.leaves(t.state.frozen)]
    history = t.run()
    assert t.parts.scheduler.gateway is not None
    assert [h["step"] for h in history] == [1, 2]
    assert [s.name.rsplit("-", 1)[-1] for s in syncs] == ["v0", "v1"]
    for s in syncs:
        assert max(s.max_abs_diff) <= 1e-4  # verified against rljax's logprobs with the adapter
    full_bytes = sum(np.asarray(x).nbytes for x in base) + sum(
        np.asarray(x).nbytes for x in jax.tree.leaves(t.state.params)
    )
    assert syncs[0].adapter_bytes < 0.25 * full_bytes
    for h in history:
        assert h["rollout/num_errored"] == 0
    for a, b in zip(jax.tree.leaves(t.state.frozen), base, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
