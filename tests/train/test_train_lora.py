"""LoRA through the trainer (``config.lora``): adapters train, the base stays bit-identical, resume
restores the adapters; with a warm start the base is warm-started first (full model, adapters
untouched) and carried by the checkpoints. (The step-level tests are in test_lora_train.py.)"""

from __future__ import annotations

import jax
import numpy as np
from recipes import load_recipe

from rljax.train import checkpoint as ckpt
from rljax.train.trainer import Trainer


def _leaves(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def _config(*, warm_start: int):
    c = load_recipe("smoke")
    c.lora = dict(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    c.warmstart.num_steps = warm_start
    c.trainer.update(num_steps=2, eval_every=0)
    return c


def test_trainer_with_config_lora_trains_adapters_only(tmp_path):
    c = _config(warm_start=0)
    t = Trainer(c, tmp_path)
    base, adapters = _leaves(t.state.frozen), _leaves(t.state.params)
    assert base and all(a.size < 2000 for a in adapters)
    assert len(t.run()) == 2
    for a, b in zip(_leaves(t.state.frozen), base, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(t.state.params), adapters, strict=True))
    stored = ckpt.restore(tmp_path / "checkpoints").params
    assert "lora_base" not in stored  # the base is the config's own: not saved again
    t2 = Trainer(c, tmp_path, resume=True)
    t2._restore()
    for a, b in zip(_leaves(t2.state.params), _leaves(t.state.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_lora_after_a_warm_start_keeps_the_warm_started_base(tmp_path):
    c = _config(warm_start=2)
    t = Trainer(c, tmp_path)
    init_base = _leaves(t.state.frozen)
    t.run()
    trained_base = _leaves(t.state.frozen)
    assert any(not np.array_equal(a, b) for a, b in zip(trained_base, init_base, strict=True))
    t2 = Trainer(c, tmp_path, resume=True)  # a fresh process would rebuild the untrained base
    t2._restore()
    for a, b in zip(_leaves(t2.state.frozen), trained_base, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(t2.state.params), _leaves(t.state.params), strict=True):
        np.testing.assert_array_equal(a, b)
