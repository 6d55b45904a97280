"""Tests of the jitted train step (single device): gradients, AdamW wiring, accumulation, skipping."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_fixtures as tf
from flax import nnx

from rljax.core.objective import ObjectiveConfig
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import (
    TrainConfig,
    TrainState,
    loss_and_grads,
    mini_batch_counts,
    split_micro_batches,
    stack_micro_batches,
    train_mini_batch,
    train_step,
    with_logit_capacity,
)

OBJ = ObjectiveConfig()
# One optimizer config for (almost) every test, so the step compiles once per shape. Clipping is
# active (gradient norms are ~0.3), warmup then cosine. eps=1e-4 bounds Adam's amplification of
# float reassociation noise on near-zero gradients (|update error| <= lr * |grad error| / (4 eps)),
# so re-ordered sums (micro-batches) give the same params to rtol 1e-5 / atol 1e-6.
OPT = OptimizerConfig(
    learning_rate=1e-3,
    schedule="cosine",
    warmup_steps=2,
    total_steps=6,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    max_grad_norm=0.05,
    eps=1e-4,
)
CONFIG = TrainConfig(objective=OBJ, optimizer=OPT)
# lr of updates 0..7 by hand: warmup (s+1)/2 * 1e-3, then 1e-4 + 9e-4 * (1 + cos(pi p)) / 2 with
# p = (s - 2) / 4: p = 0, .25, .5, .75, 1, 1 -> 1e-3, 8.681981e-4, 5.5e-4, 2.318019e-4, 1e-4, 1e-4.
LRS = [5e-4, 1e-3, 1e-3, 8.681981e-4, 5.5e-4, 2.318019e-4, 1e-4, 1e-4]

_grads = jax.jit(loss_and_grads)


def reference_ce_loss(model, batch) -> jax.Array:
    """Independent ce-only loss: full [R, L, V] logits, per-token temperatures, token-mean over weights."""
    logits = model(batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids)
    z = logits[:, :-1] / batch.temperatures[:, 1:, None]
    logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), batch.tokens[:, 1:, None], axis=-1)[..., 0]
    w = batch.loss_mask[:, 1:] * batch.ce_weights[:, 1:]
    return -jnp.sum(w * logp) / jnp.sum(w != 0)


def test_ce_gradient_matches_full_logits_reference():
    batch = tf.make_batch(3, rl=0.0, ce=1.0)
    model = tf.make_model(1)
    state = TrainState.create(model, CONFIG)
    grads, metrics = _grads(state, batch, mini_batch_counts(batch, OBJ))
    graphdef = state.graphdef
    ref = jax.jit(jax.value_and_grad(lambda p, b: reference_ce_loss(nnx.merge(graphdef, p), b)))
    ref_loss, ref_grads = ref(state.params, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss/ce"]), float(ref_loss), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


def numpy_adamw_step(p, g, m, v, *, t, lr, cfg):
    """float64 AdamW step ``t`` (0-based) with global-norm clipping over lists of arrays."""
    g = [np.asarray(x, np.float64) for x in g]
    norm = math.sqrt(sum(float(np.sum(x * x)) for x in g))
    scale = min(1.0, cfg.max_grad_norm / norm)
    out_p, out_m, out_v = [], [], []
    for pi, gi, mi, vi in zip(p, g, m, v, strict=True):
        gi = gi * scale
        mi = cfg.b1 * mi + (1 - cfg.b1) * gi
        vi = cfg.b2 * vi + (1 - cfg.b2) * gi * gi
        mh, vh = mi / (1 - cfg.b1 ** (t + 1)), vi / (1 - cfg.b2 ** (t + 1))
        wd = cfg.weight_decay if pi.ndim >= 2 else 0.0
        out_p.append(pi - lr * (mh / (np.sqrt(vh) + cfg.eps) + wd * pi))
        out_m.append(mi)
        out_v.append(vi)
    return out_p, out_m, out_v, norm


def test_steps_match_numpy_adamw_with_clip_schedule_and_decay():
    batch = tf.make_batch(4)
    counts = mini_batch_counts(batch, OBJ)
    state = TrainState.create(tf.make_model(2), CONFIG)
    p = [np.asarray(x, np.float64) for x in tf.params_numpy(state)]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t in range(4):
        grads, _ = _grads(state, batch, counts)  # at the current params (= the reference's, to fp32)
        p, m, v, norm = numpy_adamw_step(p, jax.tree.leaves(grads), m, v, t=t, lr=LRS[t], cfg=OPT)
        assert norm > OPT.max_grad_norm  # clipping is active
        state, metrics = train_step(state, batch, counts)
        np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)
        np.testing.assert_allclose(float(metrics["lr"]), LRS[t], rtol=1e-6)
        assert int(metrics["step"]) == t + 1 and int(metrics["skipped_updates"]) == 0
        for got, want in zip(tf.params_numpy(state), p, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_micro_batches_equal_whole_batch():
    batches = [tf.make_batch(10), tf.make_batch(11), tf.make_batch(12)]
    whole = TrainState.create(tf.make_model(0), CONFIG)
    micro = TrainState.create(tf.make_model(0), CONFIG)
    for batch in batches:
        counts = mini_batch_counts(batch, OBJ)
        whole, m_whole = train_step(whole, batch, counts)
        stacked = split_micro_batches(batch, 4)
        assert stacked.tokens.shape == (4, 2, tf.SEQ_LEN)
        # Independently packed micro-batches stack the same way (here: the row pairs).
        pairs = [jax.tree.map(lambda x, i=i: x[2 * i : 2 * i + 2], batch) for i in range(4)]
        jax.tree.map(np.testing.assert_array_equal, stack_micro_batches(pairs), stacked)
        np.testing.assert_array_equal(mini_batch_counts(stacked, OBJ).tokens, counts.tokens)
        micro, m_micro = train_mini_batch(micro, stacked, counts)
        # grad_norm and loss are scale-sensitive (Adam's update is nearly scale-free).
        for key in ("loss", "loss/rl", "loss/ce", "grad_norm", "tokens/rl", "rl/clip_frac", "entropy"):
            np.testing.assert_allclose(float(m_micro[key]), float(m_whole[key]), rtol=1e-5, atol=1e-7)
    for a, b in zip(tf.params_numpy(micro), tf.params_numpy(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_non_finite_batch_skips_update_and_counts_it():
    state = TrainState.create(tf.make_model(0), CONFIG)
    good = tf.make_batch(30)
    counts = mini_batch_counts(good, OBJ)
    state, _ = train_step(state, good, counts)
    before = tf.params_numpy(state)
    opt_before = [np.array(x) for x in jax.tree.leaves(state.opt_state)]

    adv = good.advantages.copy()
    r, c = np.argwhere(good.loss_mask > 0)[0]
    adv[r, c] = np.inf
    state, metrics = train_step(state, good.replace(advantages=adv), counts)
    assert not np.isfinite(float(metrics["loss"]))
    assert float(metrics["update_skipped"]) == 1.0
    assert int(metrics["skipped_updates"]) == 1 and int(state.skipped) == 1
    assert int(metrics["step"]) == 1 and int(state.step) == 1
    np.testing.assert_allclose(float(metrics["lr"]), LRS[1], rtol=1e-6)  # the update it would have been
    for x, y in zip(tf.params_numpy(state), before, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(state.opt_state), opt_before, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)

    # A NaN from the data (temperature 0 -> inf logits) is caught the same way.
    bad_t = good.temperatures.copy()
    bad_t[r, c] = 0.0
    state, metrics = train_step(state, good.replace(temperatures=bad_t), counts)
    assert int(state.skipped) == 2 and int(state.step) == 1

    # The next finite batch trains again, at the schedule step of applied updates.
    state, metrics = train_step(state, good, counts)
    assert float(metrics["update_skipped"]) == 0.0 and int(state.step) == 2 and int(state.skipped) == 2
    np.testing.assert_allclose(float(metrics["lr"]), LRS[1], rtol=1e-6)
    assert all(np.all(np.isfinite(x)) for x in tf.params_numpy(state))
    assert any(not np.array_equal(x, y) for x, y in zip(tf.params_numpy(state), before, strict=True))


def test_loss_decreases_when_overfitting_sft():
    config = TrainConfig(objective=OBJ, optimizer=OptimizerConfig(learning_rate=1e-2, weight_decay=0.0))
    batch = tf.make_batch(40, rl=0.0, ce=1.0)
    counts = mini_batch_counts(batch, OBJ)
    state = TrainState.create(tf.make_model(0), config)
    losses = []
    for _ in range(20):
        state, metrics = train_step(state, batch, counts)
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(math.log(tf.VOCAB), rel=0.05)  # near-uniform init
    assert losses[-1] < 0.5 * losses[0], losses
    assert sum(b < a for a, b in zip(losses, losses[1:], strict=False)) >= 17, losses


def test_bf16_compute_with_remat_keeps_float32_master_weights():
    """bf16 activations/matmuls + rematerialized blocks: fp32 params, grads and moments; same loss.

    (remat == no-remat gradients is tested with the model, tests/models/test_models_logprobs.py.)
    """
    batch = tf.make_batch(70, rl=0.0, ce=1.0)
    counts = mini_batch_counts(batch, OBJ)
    _, m_ref = _grads(TrainState.create(tf.make_model(0), CONFIG), batch, counts)
    model = tf.make_model(0, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=True)
    state = TrainState.create(model, CONFIG)
    state, metrics = train_step(state, batch, counts)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    assert float(metrics["update_skipped"]) == 0.0 and np.isfinite(float(metrics["grad_norm"]))
    np.testing.assert_allclose(float(metrics["loss"]), float(m_ref["loss"]), rtol=2e-2)


def test_config_and_helper_errors():
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        TrainConfig(chunk_size=0)
    with pytest.raises(ValueError, match="objective must be an ObjectiveConfig"):
        TrainConfig(objective={"policy_loss": "dppo"})
    batch = tf.make_batch(0)
    with pytest.raises(ValueError, match="must be a positive int dividing the 8 rows"):
        split_micro_batches(batch, 3)
    other = jax.tree.map(lambda x: x[:4], batch)
    with pytest.raises(ValueError, match="must share one"):
        stack_micro_batches([batch, other])
    with pytest.raises(ValueError, match="at least one batch"):
        stack_micro_batches([])
    with pytest.raises(ValueError, match=r"\[R, L\] or \[k, R, L\]"):
        mini_batch_counts(jax.tree.map(lambda x: x[0], batch), OBJ)


def test_no_recompile_across_steps():
    # One program per loss-token buffer size (a few per run), never one per step.
    state = TrainState.create(tf.make_model(0), CONFIG)
    batch = tf.make_batch(80)
    counts = mini_batch_counts(batch, OBJ)
    state, _ = train_step(state, batch, counts)
    size = train_step.jitted._cache_size()
    capacities = {with_logit_capacity(state, batch).config.logit_capacity}
    for seed in (81, 82):
        b = tf.make_batch(seed)
        state, _ = train_step(state, b, mini_batch_counts(b, OBJ))
        capacities.add(with_logit_capacity(state, b).config.logit_capacity)
        assert state.config == CONFIG  # the step hands back the caller's config
    assert train_step.jitted._cache_size() == size + len(capacities) - 1
