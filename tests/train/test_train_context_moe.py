"""Context parallelism for the MoE family in the train step (8 fake CPU devices): two optimizer steps
with the auxiliary router losses on, at context 2 and 4 and composed with the expert axis, equal the
same steps on one device (loss, metrics, router statistics, updated parameters)."""

from __future__ import annotations

import numpy as np
import pytest
import train_fixtures as tf
from random_steps import random_steps

from rljax.core.objective import ObjectiveConfig
from rljax.data.pack import pack
from rljax.models.tiny import random_decoder, tiny_config
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step

pytestmark = pytest.mark.slow  # a MoE train step compiled per mesh
CFG = tiny_config("qwen3_moe", vocab_size=64, hidden_size=32, head_dim=8, num_layers=2)
SEQ = 32  # a multiple of 2 x context for context 2 and 4
OBJ = ObjectiveConfig()
CONFIG = TrainConfig(
    objective=OBJ,
    optimizer=OptimizerConfig(learning_rate=1e-3, max_grad_norm=1.0, eps=1e-4),
    moe_aux_loss_coef=0.01,
    router_z_loss_coef=0.001,
)
METRICS = ("loss", "loss/rl", "loss/moe_aux", "grad_norm", "entropy")


def _batch(seed: int):
    steps = random_steps(np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    adv = [rng.normal(size=len(s.response_ids)).astype(np.float32) for s in steps]
    return pack(steps, seq_len=SEQ, advantages=adv, row_buckets=[4]).batch


@pytest.fixture(scope="module")
def batches():
    return [_batch(seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def reference_run(batches):
    return tf.reference_steps(TrainState.create(random_decoder(CFG, seed=0), CONFIG), batches, OBJ)


@pytest.mark.parametrize(
    "axes",
    [dict(data=2, context=4), dict(data=2, expert=2, context=2)],
    ids=["d2c4", "d2e2c2"],
)
def test_moe_train_steps_with_context_equal_context_1(axes, batches, reference_run):
    mesh = make_mesh(**axes)
    state = TrainState.create(random_decoder(CFG, seed=0), CONFIG, mesh=mesh)
    for b, (want_params, want_metrics) in zip(batches, reference_run, strict=True):
        sharded = shard_batch(b, mesh)
        state, metrics = train_step(state, sharded, mini_batch_counts(sharded, OBJ))
        assert want_metrics["loss/moe_aux"] > 0
        for key in METRICS:
            got = float(metrics[key])
            np.testing.assert_allclose(got, want_metrics[key], rtol=1e-5, atol=1e-7, err_msg=key)
        for got, want in zip(tf.params_numpy(state), want_params, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
