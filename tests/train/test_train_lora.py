"""LoRA training: only adapters get gradients and optimizer state; the base stays bit-identical.

References: a hand-written step (``jax.grad`` w.r.t. the adapters of the same loss, optax.adamw
applied explicitly), the base weights before training, and a full-training state for sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import train_fixtures as tf
from flax import nnx
from recipes import load_recipe

from rljax.core.objective import ObjectiveConfig
from rljax.models.lora import LoRAConfig, LoRAParam, apply_lora
from rljax.train.optim import OptimizerConfig
from rljax.train.step import TrainConfig, TrainState, _loss, mini_batch_counts, train_step
from rljax.train.trainer import Trainer

OPT = OptimizerConfig(learning_rate=1e-2, max_grad_norm=1e9, weight_decay=0.0, eps=1e-8)
CONFIG = TrainConfig(objective=ObjectiveConfig(), optimizer=OPT)


def _lora_model(rank=4, targets=("q_proj", "v_proj", "down_proj")):
    return apply_lora(tf.make_model(0), LoRAConfig(rank=rank, alpha=8.0, targets=targets), rngs=nnx.Rngs(1))


def _bytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def test_only_adapters_train_and_the_base_stays_bit_identical():
    model = _lora_model()
    base_before = [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    state = TrainState.create(model, CONFIG)
    assert {type(v) for _, v in nnx.to_flat_state(state.params)} == {LoRAParam}
    full = TrainState.create(tf.make_model(0), CONFIG)
    # Adam's two moments cover the adapters only (a few % of the full model's)
    assert _bytes(state.opt_state) < 0.1 * _bytes(full.opt_state)
    assert abs(_bytes(state.opt_state) - 2 * _bytes(state.params)) < 1024
    adapters0 = [np.array(x) for x in jax.tree.leaves(state.params)]
    for seed in range(3):
        batch = tf.make_batch(40 + seed)
        state, m = train_step(state, batch, mini_batch_counts(batch, CONFIG.objective))
        assert float(m["update_skipped"]) == 0
    for a, b in zip(jax.tree.leaves(state.frozen), base_before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    moved = [
        not np.array_equal(np.asarray(a), b)
        for a, b in zip(jax.tree.leaves(state.params), adapters0, strict=True)
    ]
    assert all(moved)


def test_lora_step_equals_the_hand_computed_update():
    model = _lora_model()
    state = TrainState.create(model, CONFIG)
    adapters0 = jax.tree.map(jnp.copy, state.params)
    batch = tf.make_batch(7)
    counts = mini_batch_counts(batch, CONFIG.objective)

    def loss_of_adapters(adapters):
        return _loss(adapters, state.graphdef, batch, counts, CONFIG, state.frozen)[0]

    grads = jax.grad(loss_of_adapters)(adapters0)
    tx = optax.adamw(OPT.learning_rate, b1=OPT.b1, b2=OPT.b2, eps=OPT.eps, weight_decay=0.0)
    updates, _ = tx.update(grads, tx.init(adapters0), adapters0)
    want = optax.apply_updates(adapters0, updates)
    new, _ = train_step(state, batch, counts)
    # Two programs (jit of the step vs the hand loss) reassociate float32 sums: gradients agree to
    # ~1e-6 relative, which Adam can turn into ~1e-7 on a near-zero gradient's update (lr 1e-2).
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_lora_on_a_mesh_is_refused_clearly():
    from rljax.train.sharding import make_mesh

    with pytest.raises(ValueError, match="LoRA training on a device mesh"):
        TrainState.create(_lora_model(), CONFIG, mesh=make_mesh(data=2, devices=jax.devices()[:2]))


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
