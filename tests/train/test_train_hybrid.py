"""Training a hybrid Qwen3.5 model (Gated DeltaNet + gated attention) on packed rows: the train step
on a (data, fsdp, tensor) = (2, 2, 2) mesh of 8 fake CPU devices, with remat and in micro-batches,
equals the single-device whole-batch step (parameters and metrics), as for the dense decoder
(test_train_sharding.py). The packing invariant itself is tested in
tests/models/test_models_hybrid.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import train_fixtures as tf
from flax import nnx

from rljax.models import Decoder
from rljax.models.tiny import tiny_config
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import (
    TrainState,
    mini_batch_counts,
    split_micro_batches,
    train_mini_batch,
)

OBJ = tf.OBJ
CONFIG = tf.TRAIN_CONFIG
MODEL = tiny_config("qwen3_5_text", vocab_size=tf.VOCAB, hidden_size=64, intermediate_size=128, head_dim=16)


def _model(**kwargs) -> Decoder:
    return Decoder(MODEL, rngs=nnx.Rngs(0), **kwargs)


@pytest.fixture(scope="module")
def batches():
    return [tf.make_batch(700 + i) for i in range(2)]


@pytest.fixture(scope="module")
def reference(batches):
    """Params and metrics after each of 2 unsharded whole-batch steps."""
    return tf.reference_steps(TrainState.create(_model(), CONFIG), batches, OBJ)


def _assert_equal(state, metrics, want_params, want_metrics):
    for key in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose(float(metrics[key]), want_metrics[key], rtol=1e-5, atol=1e-7)
    for got, want in zip(tf.params_numpy(state), want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sharded_micro_batched_remat_steps_equal_the_single_device_step(batches, reference):
    """On the (2, 2, 2) mesh, with full remat and each mini-batch in 2 micro-batches."""
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    state = TrainState.create(_model(remat="full"), CONFIG, mesh=mesh)
    qkv = state.params["layers"][0]["linear_attn"]["in_proj_qkv"]["kernel"].get_value()
    assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    for batch, (want_params, want_metrics) in zip(batches, reference, strict=True):
        micro = shard_batch(split_micro_batches(batch, 2), mesh, stacked=True)
        state, metrics = train_mini_batch(state, micro, mini_batch_counts(batch, OBJ))
        _assert_equal(state, metrics, want_params, want_metrics)
