"""LoRA through the trainer (``config.lora``): adapters train, the base stays bit-identical, resume
restores the adapters. (The step-level tests are in test_lora_train.py.)"""

from __future__ import annotations

import jax
import numpy as np
from recipes import load_recipe

from rljax.train.trainer import Trainer


def test_trainer_with_config_lora_trains_adapters_only(tmp_path):
    c = load_recipe("smoke")
    c.lora = dict(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    c.trainer.update(num_steps=2, eval_every=0)
    t = Trainer(c, tmp_path)
    base = [np.array(x) for x in jax.tree.leaves(t.state.frozen)]
    adapters = [np.array(x) for x in jax.tree.leaves(t.state.params)]
    assert t.state.frozen is not None and all(a.size < 2000 for a in adapters)
    history = t.run()
    assert len(history) == 2
    for a, b in zip(jax.tree.leaves(t.state.frozen), base, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert any(
        not np.array_equal(np.asarray(a), b)
        for a, b in zip(jax.tree.leaves(t.state.params), adapters, strict=True)
    )
    # the served model applies the adapters; the checkpoint holds only them (plus optimizer state)
    t2 = Trainer(c, tmp_path, resume=True)
    t2._restore()
    for a, b in zip(jax.tree.leaves(t2.state.params), jax.tree.leaves(t.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
