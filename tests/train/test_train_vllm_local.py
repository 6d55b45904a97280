"""The ``rljax/recipes/vllm_local.py`` recipe end to end against a REAL vLLM (CPU) server.

Two synchronous RL steps of the recipe, shrunk (no warm start, 4 prompts x 4 samples, short
completions), with the trainer launching its own server. Checked, each against something the code
under test does not compute itself:

- the weight version advances on samples: step 1 samples version 0, step 2 samples version 1 (sync
  mode: ``v(n) = n``); the weights vLLM served for version n (read back from the directory the weight
  sync wrote) are exactly the trainer's step-n checkpoint, and the two versions differ;
- vLLM's logprobs are the trainer's: every sampled token's vLLM logprob equals
  ``rljax.models.sequence_logprobs`` of the weights served for that version within 1e-4 (measured:
  ~1e-6; the other version's weights are ~0.09 off), and the train step's ``rl/mismatch_kl`` is tiny;
- a complete checkpoint of step 2 is written, and every metric is finite.

The server's python comes from ``$RLJAX_VLLM_PYTHON`` or ``<repo>/.vllm-venv`` (see
``rljax.inference.vllm.find_vllm_python``); without one this test FAILS when ``CI=true`` and is
skipped with the reason otherwise. Runtime: about a minute, mostly server start-up.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax import models
from rljax.recipes import vllm_local
from rljax.run import scheduler as scheduler_mod
from rljax.run import trainer as trainer_mod
from rljax.training import checkpoint as ckpt

pytestmark = pytest.mark.integration

LOGPROB_ATOL = 1e-4  # design §5 parity bound (float32, same weights)
MISMATCH_KL_MAX = 1e-3


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


def _flat(tree) -> dict[tuple[str, ...], np.ndarray]:
    """``{path: array}`` of a parameter tree, paths without nnx's ``value`` level (checkpoint layout)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        out[tuple(k for k in keys if k != "value")] = np.asarray(leaf)
    return out


def _reference_logprobs(model: models.Decoder, step) -> np.ndarray:
    """``log p(response | prompt)`` per response token, by the trainer's own logprob function."""
    tokens = jnp.asarray([list(step.prompt_ids) + list(step.response_ids)], jnp.int32)
    out = models.sequence_logprobs(model, tokens, temperature=float(step.temperature))
    return np.asarray(out[0, len(step.prompt_ids) :], np.float64)


def test_vllm_local_recipe_two_sync_steps(tmp_path, monkeypatch, vllm_python):
    rollouts = []  # (weights directory vLLM served, rollout result), one per rollout call
    real_rollout = scheduler_mod.rollout

    async def recording_rollout(*args, **kwargs):
        # The weight sync ran just before this call: its directory holds the weights now served.
        engine = kwargs["engine"]
        engine = engine["lookup"] if isinstance(engine, Mapping) else engine  # per-env engines or one
        served = tmp_path / f"served_{len(rollouts)}"
        shutil.copytree(engine.last_sync.directory, served)
        result = await real_rollout(*args, **kwargs)
        rollouts.append((served, result))
        return result

    monkeypatch.setattr(scheduler_mod, "rollout", recording_rollout)
    workdir = tmp_path / "run"
    history = trainer_mod.Trainer(_small_config(), workdir).run()

    # Metrics: two steps, all finite, also in the JSONL file.
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        bad = {k: v for k, v in h.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
        assert not bad, f"non-finite metrics: {bad}"
        assert h["rollout/num_trajectories"] == 16 and h["rollout/num_errored"] == 0
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]

    # Weight versions: recorded on every sample, one per step in sync mode.
    assert len(rollouts) == 2
    for n, (_, result) in enumerate(rollouts):
        assert len(result.batch) > 0
        assert {s.policy_version for s in result.batch} == {n}
        assert history[n]["policy_version/min"] == history[n]["policy_version/max"] == n
    # ... and vLLM served exactly the trainer's weights of that version (its step-n checkpoint).
    served = [models.from_pretrained(os.fspath(d)) for d, _ in rollouts]
    for n, model in enumerate(served):
        saved = _flat(ckpt.restore(workdir / "checkpoints", step=n).params["policy"])
        mine = _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        assert saved.keys() == mine.keys()
        for k in saved:
            np.testing.assert_array_equal(mine[k], saved[k], err_msg=f"version {n} served {k} differs")
    v0, v1 = (models.to_hf_state_dict(m) for m in served)
    drift = max(float(np.max(np.abs(v0[k] - v1[k]))) for k in v0)
    assert drift > 0, "the weights served for version 1 equal those of version 0: no update reached vLLM"

    # vLLM's sampled-token logprobs == the trainer's logprobs of the served weights, on the samples.
    for model, (_, result) in zip(served, rollouts, strict=True):
        assert min(min(s.response_logprobs) for s in result.batch) < -0.01  # real logprobs, not zeros
        worst = 0.0
        for step in result.batch:
            got = np.asarray(step.response_logprobs, np.float64)
            assert got.shape == (len(step.response_ids),) and np.all(got <= 0)
            worst = max(worst, float(np.max(np.abs(got - _reference_logprobs(model, step)))))
        assert worst <= LOGPROB_ATOL, f"vLLM vs trainer logprobs differ by up to {worst:.3g}"
    for h in history:
        assert abs(h["rl/mismatch_kl"]) < MISMATCH_KL_MAX
        assert h["tokens/rl"] > 0

    # Checkpoint: the last step is complete and marked latest.
    assert ckpt.latest_step(workdir / "checkpoints") == 2


def test_lora_vllm_recipe_syncs_adapters_only(tmp_path, monkeypatch, vllm_python):
    """rljax/recipes/lora_vllm.py: servers on the base weights with runtime LoRA, one verified adapter
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
