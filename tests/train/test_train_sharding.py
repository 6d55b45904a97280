"""Sharded train step on 8 fake CPU devices equals the single-device step; mesh and batch placement."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import train_fixtures as tf
from jax.sharding import AxisType, PartitionSpec

from rljax.training.sharding import batch_parallelism, batch_sharding, make_mesh, shard_batch
from rljax.training.step import (
    TrainState,
    mini_batch_counts,
    split_micro_batches,
    train_mini_batch,
    train_step,
)

P = PartitionSpec
OBJ = tf.OBJ
CONFIG = tf.TRAIN_CONFIG  # shared with the other sharded-step tests (train_fixtures)
NUM_STEPS = 3


@pytest.fixture(scope="module")
def batches():
    return [tf.make_batch(100 + i) for i in range(NUM_STEPS)]


@pytest.fixture(scope="module")
def single_device_run(batches):
    """Params and metrics after each of 3 unsharded steps (the reference)."""
    return tf.reference_steps(TrainState.create(tf.make_model(0), CONFIG), batches, OBJ)


def test_make_mesh_validates_and_uses_auto_axes():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    assert batch_parallelism(mesh) == 4
    with pytest.raises(ValueError, match="= 4 devices, but 8 devices are given"):
        make_mesh(data=2, fsdp=2)
    with pytest.raises(ValueError, match="mesh axis tensor must be a positive int"):
        make_mesh(data=8, tensor=0)
    assert dict(make_mesh(fsdp=2, devices=jax.devices()[:2]).shape)["fsdp"] == 2


def test_shard_batch_places_rows_and_checks_divisibility():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    batch = tf.make_batch(1)
    sharded = shard_batch(batch, mesh)
    assert sharded.tokens.sharding.spec == P(("data", "fsdp"), None)
    assert sharded.ref_logprobs is None or sharded.ref_logprobs.shape == batch.tokens.shape
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, sharded), batch)
    # every device holds 8 / (data * fsdp) = 2 rows
    assert {s.data.shape for s in sharded.tokens.addressable_shards} == {(2, tf.SEQ_LEN)}
    stacked = shard_batch(split_micro_batches(batch, 2), mesh, stacked=True)
    assert stacked.tokens.sharding.spec == P(None, ("data", "fsdp"), None)
    assert stacked.tokens.sharding == batch_sharding(mesh, stacked=True)
    with pytest.raises(ValueError, match="not a multiple of data\\*fsdp=8; pack with data_parallel=8"):
        shard_batch(jax.tree.map(lambda x: x[:4], batch), make_mesh(data=8))
    with pytest.raises(ValueError, match="batch arrays must be"):
        shard_batch(batch, mesh, stacked=True)
    # counts of a sharded batch equal the host counts
    host = mini_batch_counts(batch, OBJ)
    jax.tree.map(np.testing.assert_allclose, mini_batch_counts(sharded, OBJ), host)


def test_train_state_create_shards_params_and_moments():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    q = state.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding.spec == P("fsdp", "tensor")
    assert state.params["embed_tokens"].get_value().sharding.spec == P("tensor", "fsdp")
    specs = {x.sharding.spec for x in jax.tree.leaves(state.opt_state) if x.ndim == 2}
    assert specs <= {P("fsdp", "tensor"), P("tensor", "fsdp")} and len(specs) == 2
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)


@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1)], ids=["d2f2t2", "d8"])
def test_sharded_steps_equal_single_device(shape, batches, single_device_run):
    data, fsdp, tensor = shape
    mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    in_shardings = [x.sharding for x in jax.tree.leaves(state.params)]
    cache_sizes = []
    for batch, (want_params, want_metrics) in zip(batches, single_device_run, strict=True):
        sharded = shard_batch(batch, mesh)
        state, metrics = train_step(state, sharded, mini_batch_counts(sharded, OBJ))
        cache_sizes.append(train_step.jitted._cache_size())
        for key in ("loss", "loss/rl", "loss/ce", "grad_norm", "lr", "entropy", "rl/mismatch_kl"):
            np.testing.assert_allclose(float(metrics[key]), want_metrics[key], rtol=1e-5, atol=1e-7)
        for got, want in zip(tf.params_numpy(state), want_params, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the step keeps the rule shardings (no layout drift, so no recompilation between steps)
    assert [x.sharding for x in jax.tree.leaves(state.params)] == in_shardings
    assert cache_sizes[0] == cache_sizes[-1]


def test_sharded_micro_batches_equal_single_device(batches, single_device_run):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    for batch, (_, want_metrics) in zip(batches, single_device_run, strict=True):
        counts = mini_batch_counts(batch, OBJ)
        micro = shard_batch(split_micro_batches(batch, 2), mesh, stacked=True)
        state, metrics = train_mini_batch(state, micro, counts)
        np.testing.assert_allclose(float(metrics["grad_norm"]), want_metrics["grad_norm"], rtol=1e-5)
        np.testing.assert_allclose(float(metrics["loss"]), want_metrics["loss"], rtol=1e-5)
    for got, want in zip(tf.params_numpy(state), single_device_run[-1][0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
