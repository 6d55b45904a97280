"""Logical-axis sharding rules and a sharded forward/backward on 8 fake CPU devices (data, fsdp, tensor)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from rljax import models

P = PartitionSpec


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    assert len(devices) == 8, "tests/conftest.py sets 8 fake CPU devices"
    return Mesh(np.array(devices).reshape(2, 2, 2), models.MESH_AXES)


def test_logical_to_spec_rules(mesh):
    spec = models.logical_to_spec
    assert spec(("vocab", "embed"), (320, 64), mesh) == P("tensor", "fsdp")
    assert spec(("embed", "heads"), (64, 64), mesh) == P("fsdp", "tensor")
    assert spec(("mlp", "embed"), (128, 64), mesh) == P("tensor", "fsdp")
    assert spec(("norm",), (64,), mesh) == P(None)
    assert spec(("batch", None), (8, 5), mesh) == P(("data", "fsdp"), None)
    # Not divisible -> replicated; a mesh axis is used once; axes absent from the mesh are dropped.
    assert spec(("vocab", "embed"), (321, 64), mesh) == P(None, "fsdp")
    assert spec(("heads", "mlp"), (64, 64), mesh) == P("tensor", None)
    small = Mesh(np.array(jax.devices()[:2]).reshape(2), ("tensor",))
    assert spec(("embed", "heads"), (64, 64), small) == P(None, "tensor")
    with pytest.raises(ValueError, match="logical axis 'experts' has no sharding rule"):
        spec(("experts",), (4,), mesh)
    with pytest.raises(ValueError, match="do not match the array rank"):
        spec(("embed",), (4, 4), mesh)


def test_sharded_model_matches_unsharded(mesh, helpers):
    cfg = models.ModelConfig.from_hf_dict(helpers.hf_config_dict("qwen2", tied=False))
    model = helpers.random_decoder(cfg, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(4, 16)))

    def loss(p, toks):
        return jnp.sum(models.sequence_logprobs(nnx.merge(graphdef, p), toks, chunk_size=16))

    ref_val, ref_grad = jax.jit(jax.value_and_grad(loss))(params, tokens)

    sharded = models.shard_model(nnx.merge(graphdef, params), mesh)
    specs = {
        ".".join(map(str, p)): v.get_value().sharding.spec
        for p, v in nnx.to_flat_state(nnx.state(sharded, nnx.Param))
    }
    assert specs["embed_tokens"] == P("tensor", "fsdp")
    assert specs["layers.0.self_attn.q_proj.kernel"] == P("fsdp", "tensor")
    assert specs["layers.0.self_attn.q_proj.bias"] == P("tensor")
    assert specs["layers.1.self_attn.o_proj.kernel"] == P("tensor", "fsdp")
    assert specs["layers.1.mlp.down_proj.kernel"] == P("tensor", "fsdp")
    assert specs["lm_head.kernel"] == P("fsdp", "tensor")
    assert specs["norm.weight"] == P(None)
    expected_specs = models.param_specs(sharded, mesh)
    assert (
        specs["layers.0.mlp.up_proj.kernel"]
        == expected_specs["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    )

    batch_sharding = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None))
    sharded_tokens = jax.device_put(tokens, batch_sharding)
    val, grad = jax.jit(jax.value_and_grad(loss))(nnx.state(sharded, nnx.Param), sharded_tokens)
    np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-4)
