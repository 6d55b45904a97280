"""The PPO value model: alignment of per-token values, packing, save/load of the documented head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.core import losses
from rljax.models import value as value_lib


def _critic(seed: int = 0) -> value_lib.ValueModel:
    vm = value_lib.ValueModel.from_policy(models.tiny_model(vocab_size=64, seed=seed), rngs=nnx.Rngs(0))
    key = jax.random.key(seed + 1)
    vm.value_kernel[...] = 0.5 * jax.random.normal(key, vm.value_kernel.shape)
    vm.value_bias[...] = jnp.array([0.3])
    return vm


def test_fresh_head_gives_zero_values_and_keeps_the_policy_untouched():
    policy = models.tiny_model(vocab_size=64, seed=0)
    before = jax.tree.map(jnp.copy, nnx.state(policy))
    vm = value_lib.ValueModel.from_policy(policy, rngs=nnx.Rngs(0))
    assert float(jnp.abs(value_lib.values(vm, jnp.array([[5, 6, 7, 8]]))).max()) == 0.0
    vm.backbone.embed_tokens[...] = vm.backbone.embed_tokens[...] + 1.0  # the critic's copy, not the policy
    jax.tree.map(np.testing.assert_array_equal, nnx.state(policy), before)


def test_values_are_the_head_on_the_previous_hidden_state():
    vm = _critic()
    tokens = jnp.array([[3, 9, 4, 1, 7]])
    h = np.asarray(vm.backbone.hidden_states(tokens).hidden, np.float64)
    head = h @ np.asarray(vm.value_kernel[...], np.float64)[:, 0] + 0.3
    want = np.concatenate([[0.0], head[0, :-1]])
    np.testing.assert_allclose(np.asarray(value_lib.values(vm, tokens))[0], want, rtol=1e-5, atol=1e-5)


def test_packed_values_equal_each_sample_alone():
    vm = _critic(2)
    a, b = [3, 9, 4, 1], [7, 2, 5]
    packed = jnp.array([a + b + [0]])
    segs = jnp.array([[1] * 4 + [2] * 3 + [0]])
    got = np.asarray(value_lib.values(vm, packed, segment_ids=segs))[0]
    alone_a = np.asarray(value_lib.values(vm, jnp.array([a])))[0]
    alone_b = np.asarray(value_lib.values(vm, jnp.array([b])))[0]
    np.testing.assert_allclose(got, np.concatenate([alone_a, alone_b, [0.0]]), **LOGPROB_TOL)


def test_save_load_round_trip_and_gradients_reach_head_and_backbone(tmp_path):
    vm = _critic(3)
    value_lib.save_value_model(vm, tmp_path)
    assert (tmp_path / value_lib.VALUE_HEAD_FILE).exists() and (tmp_path / "config.json").exists()
    back = value_lib.load_value_model(tmp_path)
    tokens = jnp.array([[1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(
        np.asarray(value_lib.values(back, tokens)), np.asarray(value_lib.values(vm, tokens))
    )
    # the backbone alone is an ordinary checkpoint; without the head file the head is fresh
    (tmp_path / value_lib.VALUE_HEAD_FILE).unlink()
    assert float(jnp.abs(value_lib.values(value_lib.load_value_model(tmp_path), tokens)).max()) == 0.0

    graphdef, params = nnx.split(vm, nnx.Param)

    def loss(p):
        v = value_lib.values(nnx.merge(graphdef, p), tokens)
        return losses.value_loss(v, jnp.zeros_like(v), jnp.ones_like(v)).sum()

    grads = nnx.to_flat_state(jax.grad(loss)(params))
    norms = {".".join(map(str, path)): float(jnp.abs(g.get_value()).sum()) for path, g in grads}
    assert norms["value_kernel"] > 0 and norms["value_bias"] > 0
    assert norms["backbone.embed_tokens"] > 0
