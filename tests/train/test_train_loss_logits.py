"""The train step with logits only for loss tokens equals the step over every token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import train_fixtures as tf
from tolerances import LOGPROB_TOL

from rljax.core.objective import ObjectiveConfig
from rljax.models import sequence_logprobs
from rljax.training.step import (
    TrainState,
    mini_batch_counts,
    policy_logprobs,
    split_micro_batches,
    train_mini_batch,
    with_logit_capacity,
)

# An entropy bonus, so the LM head's entropy backward is exercised too.
OBJ = ObjectiveConfig(entropy_coef=0.01)
CONFIG = dataclasses.replace(tf.TRAIN_CONFIG, objective=OBJ)


def test_loss_only_logits_micro_batch_steps_equal_every_token():
    runs = {}
    for gather in (True, False):
        state = TrainState.create(tf.make_model(0), dataclasses.replace(CONFIG, loss_only_logits=gather))
        history = []
        for seed in (40, 41):
            batch = tf.make_batch(seed)
            micro = split_micro_batches(batch, 2)
            if gather:  # fewer logit rows than tokens: the gather is really used
                capacity = with_logit_capacity(state, micro).config.logit_capacity
                assert capacity < micro.tokens.shape[1] * micro.tokens.shape[2]
            state, metrics = train_mini_batch(state, micro, mini_batch_counts(micro, OBJ))
            history.append({k: float(v) for k, v in metrics.items()})
        runs[gather] = (tf.params_numpy(state), history)
    (got_params, got), (want_params, want) = runs[True], runs[False]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "loss/rl", "loss/ce", "loss/entropy", "entropy", "grad_norm", "rl/mismatch_kl"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-5, atol=1e-7, err_msg=key)
    for a, b in zip(got_params, want_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_policy_logprobs_are_those_of_the_loss_tokens():
    state = TrainState.create(tf.make_model(1), CONFIG)
    batch = tf.make_batch(50)
    full = sequence_logprobs(state.model, jnp.asarray(batch.tokens), positions=batch.positions,
                             segment_ids=batch.segment_ids, temperature=batch.temperatures)  # fmt: skip
    loss = np.asarray(batch.loss_mask) != 0
    got = np.asarray(policy_logprobs(state, batch))
    np.testing.assert_allclose(got[loss], np.asarray(full)[loss], **LOGPROB_TOL)
    assert not np.any(got[~loss])
    stacked = np.asarray(policy_logprobs(state, split_micro_batches(batch, 4)))
    np.testing.assert_allclose(stacked.reshape(got.shape), got, **LOGPROB_TOL)
    assert jax.tree.leaves(state.params)  # the state is not donated
