"""One GRPO step of the shipped ``smollm2_cpu`` recipe on the real SmolLM2-135M-Instruct (GGUF file,
its BPE tokenizer and chat template), shrunk to two prompts of two samples.

What it checks that the tiny-model tests cannot: the real model's sampler logprobs agree with the
trainer's forward on the sampled tokens (``rl/mismatch_kl``, the k3 estimate of KL(sampler || trainer)
on the trained tokens, is float32 noise), the replies are scored by the recipe's reward, and one
optimizer step moves the weights.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from recipes import load_recipe
from smollm2 import require_smollm2

from rljax.run.trainer import Trainer

pytestmark = pytest.mark.integration


def test_one_grpo_step_of_the_recipe_on_the_real_model(tmp_path):
    path = require_smollm2()
    c = load_recipe("smollm2_cpu")
    assert c.model.hf_path == str(path)  # the recipe reads the cached file
    c.rollout.group_size = 2
    c.envs.arithmetic.update(num_train_tasks=2, num_eval_tasks=0)
    c.engine.update(max_batch_size=4, min_batch_bucket=4)
    c.trainer.update(num_steps=1, prompts_per_step=2, eval_every=0, checkpoint_every=0)
    t = Trainer(c, tmp_path)
    before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t.state.params))]
    (row,) = t.run()
    after = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t.state.params))]

    assert row["rollout/num_trajectories"] == 4
    assert 0.0 <= row["reward/mean"] <= 1.0 and np.isfinite(row["loss"])
    # float32 sampler vs float32 trainer on the same weights: measured ~1e-7 here; 1e-4 is the bound
    # for equivalent float32 programs with margin (logprob drift ~1e-5 per token)
    assert abs(row["rl/mismatch_kl"]) < 1e-4
    if row["reward/std"] > 0:  # a group with reward variance has a non-zero advantage: weights move
        assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
