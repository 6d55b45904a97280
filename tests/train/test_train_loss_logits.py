"""The train step with logits only for loss tokens equals the step over every token, on prefix-tree
rows with top-k / top-p support floors (each loss token's hidden state read at its parent's column)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import train_fixtures as tf
from random_steps import prefix_sharing_steps
from tolerances import LOGPROB_TOL

from rljax.core.objective import ObjectiveConfig
from rljax.data.pack import pack
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


def _tree_batch(seed):
    """Prefix-tree rows ``[8, 32]`` of shared-prompt groups and multi-turn trajectories, with random
    advantages and support floors (``-inf``, a cut among the logits, or the drawn token alone)."""
    rng = np.random.default_rng(seed)
    steps = []
    for s in prefix_sharing_steps(rng, groups=3, group_size=3, max_turns=2, vocab=tf.VOCAB):
        kind = rng.integers(0, 3, len(s.response_ids))
        floors = np.where(kind == 0, -np.inf, np.where(kind == 1, 1e4, rng.normal(0, 0.05, kind.shape)))
        steps.append(s.replace(response_support_floors=floors.tolist()))
    advantages = [rng.normal(size=len(s.response_ids)) for s in steps]
    result = pack(
        steps, seq_len=tf.SEQ_LEN, row_buckets=[tf.ROWS], advantages=advantages, prefix_sharing=True
    )
    assert result.metrics["shared_prefix_tokens"] > 0 and result.batch.parents is not None
    return result.batch


def test_loss_only_logits_micro_batch_steps_equal_every_token():
    runs = {}
    for gather in (True, False):
        state = TrainState.create(tf.make_model(0), dataclasses.replace(CONFIG, loss_only_logits=gather))
        history = []
        for seed in (40, 41):
            batch = _tree_batch(seed)
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
