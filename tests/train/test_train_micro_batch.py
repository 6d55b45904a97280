"""Micro-batching by a token budget: the accumulated step equals the whole mini-batch step (1 and 8
devices, budgets that divide the rows and budgets that need padding rows), and memory shrinks."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import train_fixtures as tf

from rljax.data.micro_batch import micro_batch_rows, pad_rows, split_by_token_budget
from rljax.training.memory import compiled_memory
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import TrainState, mini_batch_counts, train_mini_batch, train_step

OBJ = tf.OBJ
CONFIG = tf.TRAIN_CONFIG  # shared with the other sharded-step tests (train_fixtures)
L = tf.SEQ_LEN  # 32 tokens per row, 8 rows per batch


@pytest.fixture(scope="module")
def batches():
    return [tf.make_batch(300 + i) for i in range(3)]


@pytest.fixture(scope="module")
def whole_run(batches):
    state = TrainState.create(tf.make_model(0), CONFIG)
    metrics = []
    for batch in batches:
        state, m = train_step(state, batch, mini_batch_counts(batch, OBJ))
        metrics.append({k: float(v) for k, v in m.items()})
    return tf.params_numpy(state), metrics


def test_rows_per_micro_batch_and_padding():
    assert micro_batch_rows(seq_len=32, micro_batch_tokens=96) == 3
    assert micro_batch_rows(seq_len=32, micro_batch_tokens=96, data_parallel=2) == 6  # per shard
    assert micro_batch_rows(seq_len=32, micro_batch_tokens=16, data_parallel=4) == 4  # one row per shard
    batch = tf.make_batch(1)
    micro = split_by_token_budget(batch, micro_batch_tokens=3 * L)  # 8 rows -> 3 x 3 (1 padding row)
    assert micro.tokens.shape == (3, 3, L)
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), micro)
    np.testing.assert_array_equal(flat.tokens[:8], batch.tokens)
    assert not flat.segment_ids[8:].any() and not flat.loss_mask[8:].any()
    assert (flat.temperatures[8:] == 1.0).all()
    # padding rows change no count of the objective
    padded = pad_rows(batch, 12)
    for got, want in zip(
        jax.tree.leaves(mini_batch_counts(padded, OBJ)),
        jax.tree.leaves(mini_batch_counts(batch, OBJ)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="data_parallel=3"):
        split_by_token_budget(batch, micro_batch_tokens=L, data_parallel=3)


@pytest.mark.parametrize("rows_per_micro", [1, 3, 4])  # 8 micro-batches; 3 with padding; 2
def test_budget_micro_batches_equal_whole_batch(rows_per_micro, batches, whole_run):
    want_params, want_metrics = whole_run
    state = TrainState.create(tf.make_model(0), CONFIG)
    for batch, want in zip(batches, want_metrics, strict=True):
        micro = split_by_token_budget(batch, micro_batch_tokens=rows_per_micro * L)
        assert micro.tokens.shape[1] == rows_per_micro
        state, m = train_mini_batch(state, micro, mini_batch_counts(micro, OBJ))
        for key in ("loss", "loss/rl", "loss/ce", "grad_norm", "tokens/rl", "entropy"):
            np.testing.assert_allclose(float(m[key]), want[key], rtol=1e-5, atol=1e-7)
    for got, ref in zip(tf.params_numpy(state), want_params, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows_per_shard", [1, 3])  # 4 micro-batches of 2 rows; 2 of 6 (4 padding rows)
def test_budget_micro_batches_on_8_devices_equal_single_device(rows_per_shard, batches, whole_run):
    mesh = make_mesh(data=2, fsdp=1, tensor=4)  # rows shard over data=2
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    for batch in batches:
        micro = split_by_token_budget(batch, micro_batch_tokens=rows_per_shard * L, data_parallel=2)
        assert micro.tokens.shape[1] == 2 * rows_per_shard
        sharded = shard_batch(micro, mesh, stacked=True)
        state, _ = train_mini_batch(state, sharded, mini_batch_counts(sharded, OBJ))
    for got, ref in zip(tf.params_numpy(state), whole_run[0], strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_micro_batching_bounds_activation_memory():
    """XLA's temp bytes of the step: the micro-batched scan needs less than the whole batch."""
    batch = tf.make_batch(7)
    state = TrainState.create(tf.make_model(0), CONFIG)
    counts = mini_batch_counts(batch, OBJ)
    whole = compiled_memory(train_step, state, batch, counts)["step_temp_bytes"]
    micro = split_by_token_budget(batch, micro_batch_tokens=2 * L)
    per_2_rows = compiled_memory(train_mini_batch, state, micro, counts)["step_temp_bytes"]
    assert per_2_rows < 0.75 * whole, (per_2_rows, whole)
    # the figure is the executable's: same shapes, same bytes (deterministic)
    again = compiled_memory(train_mini_batch, dataclasses.replace(state), micro, counts)
    assert again["step_temp_bytes"] == per_2_rows


def test_appended_empty_micro_batches_change_nothing(batches, whole_run):
    """``min_micro_batches`` appends micro-batches of empty rows (a trainer keeps its compiled step
    when a mini-batch packs into fewer rows); the step skips them: the same as the whole batch."""
    want_params, want_metrics = whole_run
    state = TrainState.create(tf.make_model(0), CONFIG)
    for batch, want in zip(batches, want_metrics, strict=True):
        micro = split_by_token_budget(batch, micro_batch_tokens=4 * L, min_micro_batches=5)
        assert micro.tokens.shape[:2] == (5, 4) and not micro.segment_ids[2:].any()
        state, m = train_mini_batch(state, micro, mini_batch_counts(micro, OBJ))
        for key in ("loss", "loss/rl", "loss/ce", "grad_norm", "tokens/rl", "entropy"):
            np.testing.assert_allclose(float(m[key]), want[key], rtol=1e-5, atol=1e-7)
        for key in set(m) & set(want):  # a maximum over micro-batches ignores the skipped ones too
            assert np.isfinite(float(m[key])) == np.isfinite(want[key]), key
    for got, ref in zip(tf.params_numpy(state), want_params, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
