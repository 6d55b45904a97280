"""A run on two launched REAL vLLM (CPU) servers that lose them one after the other.

The ``vllm_local`` recipe, shrunk (no warm start, 4 prompts x 4 samples), on two servers with
restarts off (``engine.supervisor.max_restarts=0``): server 0 is SIGKILLed right after step 1's rollout, so
step 1's weight sync meets a dead server; server 1 after step 2's. Expected:

- step 2 runs: the sync skips the dead server instead of failing the run, and every trajectory of
  step 2 is served by server 1 (none errored);
- step 3 finds no server: after ``engine.client.all_down_timeout_s`` the run stops with one error that
  names both servers and the end of their logs;
- the step-2 checkpoint is intact: it is the latest, and it restores.

The same run's two synchronous steps are also the recipe's end-to-end check (one launch of the
servers and the trainer for both), each against something the code under test does not compute:

- the weight version advances on samples: step 1 samples version 0, step 2 samples version 1 (sync
  mode: ``v(n) = n``); the weights vLLM served for version n (read back from the directory the weight
  sync wrote) are exactly the trainer's step-n checkpoint, and the two versions differ;
- vLLM's logprobs are the trainer's: every sampled token's vLLM logprob equals
  ``rljax.models.sequence_logprobs`` of the weights served for that version within 1e-4 (measured:
  ~1e-6; the other version's weights are ~0.09 off), and the train step's ``rl/mismatch_kl`` is tiny;
- every metric is finite.

Runtime: a few minutes, mostly the two servers' start-up.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
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
    c.engine.supervisor.update(max_restarts=0, health_interval_s=1.0, health_timeout_s=5.0)
    c.engine.client.all_down_timeout_s = 5.0
    c.engine.server.extra_args = (*c.engine.server.extra_args, "--enforce-eager")
    return c


def test_run_survives_a_dead_server_and_stops_cleanly_when_none_is_left(tmp_path, monkeypatch, vllm_python):
    results = []
    real_rollout = scheduler_mod.rollout

    async def rollout_then_kill(*args, **kwargs):
        engine = kwargs["engine"]
        engine = engine["lookup"] if isinstance(engine, Mapping) else engine
        # The weight sync ran just before this call: its directory holds the weights now served.
        served = tmp_path / f"served_{len(results)}"
        shutil.copytree(engine.last_sync.directory, served)
        result = await real_rollout(*args, **kwargs)
        results.append((result, [s.down for s in engine.servers], served))
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
    for result, _, _ in results:
        assert len(result.trajectories) == 16 and not any(t.errored for t in result.trajectories)
    assert results[1][1] == [True, False]
    history = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2]
    check_versions_weights_and_logprobs(results, history, workdir)

    # One clear error: both servers, why they are out, their logs.
    message = "".join(str(e) for e in _chain(info.value))
    print(f"\nthe run stopped with: {type(info.value).__name__}: {str(info.value)[:1500]}")
    assert "no vLLM server in service for 5 s" in message
    assert message.count("process exited (code -9)") >= 2 and message.count("log ") >= 2

    # The last checkpoint is intact: step 2, and it restores.
    assert ckpt.latest_step(workdir / "checkpoints") == 2
    assert ckpt.restore(workdir / "checkpoints", step=2).params["policy"]


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


def check_versions_weights_and_logprobs(results, history, workdir) -> None:
    """The recipe's end-to-end checks of the two steps (module docstring), on the rollouts
    ``(result, servers down, weights directory served)`` and the metrics rows of the run."""
    for h in history:
        bad = {k: v for k, v in h.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
        assert not bad, f"non-finite metrics: {bad}"
        assert h["rollout/num_trajectories"] == 16 and h["rollout/num_errored"] == 0
        assert abs(h["rl/mismatch_kl"]) < MISMATCH_KL_MAX and h["tokens/rl"] > 0
    # Weight versions: recorded on every sample, one per step in sync mode.
    for n, (result, _, _) in enumerate(results):
        assert len(result.batch) > 0
        assert {s.policy_version for s in result.batch} == {n}
        assert history[n]["policy_version/min"] == history[n]["policy_version/max"] == n
    # ... and vLLM served exactly the trainer's weights of that version (its step-n checkpoint).
    served = [models.from_pretrained(os.fspath(d)) for _, _, d in results]
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
    for model, (result, _, _) in zip(served, results, strict=True):
        assert min(min(s.response_logprobs) for s in result.batch) < -0.01  # real logprobs, not zeros
        worst = 0.0
        for step in result.batch:
            got = np.asarray(step.response_logprobs, np.float64)
            assert got.shape == (len(step.response_ids),) and np.all(got <= 0)
            worst = max(worst, float(np.max(np.abs(got - _reference_logprobs(model, step)))))
        assert worst <= LOGPROB_ATOL, f"vLLM vs trainer logprobs differ by up to {worst:.3g}"


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__
