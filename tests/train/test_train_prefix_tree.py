"""Prefix-tree packing is exact (design §2.6): on random batches of prompt groups and step-wise
multi-turn trajectories (shared prompts, turns that do not extend each other, merged samples), the
per-sample logprobs, the loss and its metrics and the parameter gradient of a tree-packed batch equal
those of plain packing (the reference: every sample laid out whole), with LoRA adapters, with a
sequence-level loss, reduction and off-policy masks, with MoE router replay and auxiliary losses, for
PPO's critic values and GAE advantages, and under context parallelism; and one RL step of a run gives
the same parameters with ``trainer.prefix_sharing`` on and off.

Tolerances: the two layouts compute the same function with float32 sums in another order (softmax
over keys in other columns, logits of other chunks). Measured over these tests on the tiny models:
logprobs within 1.1e-6, losses within 3e-7 relative, gradients within 4e-7 of their largest entry.
:data:`tolerances.LOGPROB_TOL` for logprobs, rtol 1e-5 for metrics and 1e-5 of the largest entry for
gradients keep a >= 10x margin; a wrong parent, mask or position moves them by >= 1e-2.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_steps import prefix_sharing_steps
from tolerances import LOGPROB_TOL

from rljax.algorithms import get_algorithm
from rljax.core.objective import ObjectiveConfig
from rljax.data.batch import StepBatch
from rljax.data.credit import turn_links
from rljax.data.merge import merge_steps
from rljax.data.pack import pack, unpack_responses
from rljax.data.prepare import prepare_samples
from rljax.models.logprobs import packing_kwargs, sequence_forward
from rljax.models.lora import LoRAConfig, LoRAParam, apply_lora
from rljax.models.tiny import random_decoder, tiny_config
from rljax.models.value import ValueModel
from rljax.recipes import smoke
from rljax.run import trainer as trainer_lib
from rljax.run.config import parse_run_config
from rljax.run.run import resolve_prefix_sharing
from rljax.training.critic import CriticConfig, critic_values, ppo_advantages
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import make_mesh
from rljax.training.step import TrainConfig, TrainState, loss_and_grads, mini_batch_counts, policy_logprobs

VOCAB, SEQ, ROWS = 16, 64, 8
DENSE = tiny_config("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=2)
MOE = tiny_config("qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_layers=2)
MOE_ROUTING = (len(MOE.moe_layers), MOE.num_experts_per_tok, MOE.num_experts)
OPT = OptimizerConfig(learning_rate=1e-3)

_forward = jax.jit(lambda model, tokens, temps, kw: sequence_forward(model, tokens, temperature=temps, **kw))


@jax.jit
def _grads_and_logprobs(state, batch, counts):
    """The train step's gradient and metrics, and the old-policy recompute's logprobs (the same forward
    without gradient, :func:`policy_logprobs`), in one program."""
    grads, metrics = loss_and_grads(state, batch, counts)
    return grads, metrics, policy_logprobs(state, batch)


def _place(layout, per_sample):
    """``[R, L]`` array holding each sample's per-response-token values at its response columns."""
    dest, _, is_response = layout.flat_index()
    out = np.zeros(layout.num_rows * layout.seq_len, np.float32)
    out[dest[is_response]] = np.concatenate([np.asarray(v, np.float32) for v in per_sample])
    return out.reshape(layout.num_rows, layout.seq_len)


def _with_floors(steps, rng):
    """``steps`` with top-k / top-p support floors: a third of the tokens drawn from the whole
    distribution (``-inf``), a third from a support of the drawn token alone (a floor above every
    logit: logprob and entropy exactly 0, so a floor read at the wrong token shows), a third cut
    somewhere among the logits."""
    out = []
    for s in steps:
        kind = rng.integers(0, 3, len(s.response_ids))
        floors = np.where(kind == 0, -np.inf, np.where(kind == 1, 1e4, rng.normal(0, 0.5, kind.shape)))
        out.append(s.replace(response_support_floors=floors.tolist()))
    return out


def _packings(steps, rng, **streams):
    """The plain and the tree packing of ``steps`` into the same ``[8, 64]`` shape, with random
    advantages, and old logprobs that differ from the sampler's (an off-policy gap)."""
    adv = [rng.normal(size=len(s.response_ids)) for s in steps]
    old = [
        np.minimum(np.asarray(s.response_logprobs) + rng.normal(0, 0.2, len(s.response_ids)), 0)
        for s in steps
    ]
    out = []
    for sharing in (False, True):
        r = pack(steps, seq_len=SEQ, row_buckets=[ROWS], advantages=adv, prefix_sharing=sharing, **streams)
        out.append(
            r.__class__(
                r.batch.replace(old_logprobs=_place(r.layout, old)), r.layout, r.metrics, r.group_keys
            )
        )
    return out


def _steps(seed, groups, group_size, max_turns, merged, routing=None):
    steps = prefix_sharing_steps(
        np.random.default_rng(seed), groups=groups, group_size=group_size, max_turns=max_turns,
        vocab=VOCAB, routing=routing,
    )  # fmt: skip
    return list(merge_steps(StepBatch(steps)).steps) if merged else steps


def _check_equal(state, plain, tree, objective, tree_state=None):
    """The tree packing (under ``tree_state``, default ``state``) gives the plain packing's loss tokens'
    logprobs, metrics and gradient."""
    (g_plain, m_plain, lp_plain), (g_tree, m_tree, lp_tree) = (
        _grads_and_logprobs(s, r.batch, mini_batch_counts(r.batch, objective))
        for s, r in ((state, plain), (tree_state or state, tree))
    )
    loss = np.concatenate(unpack_responses(np.asarray(plain.batch.loss_mask), plain.layout)) != 0
    np.testing.assert_array_equal(
        np.concatenate(unpack_responses(np.asarray(tree.batch.loss_mask), tree.layout)) != 0, loss
    )
    want = np.concatenate(unpack_responses(np.asarray(lp_plain), plain.layout))
    np.testing.assert_allclose(
        np.concatenate(unpack_responses(np.asarray(lp_tree), tree.layout))[loss], want[loss], **LOGPROB_TOL
    )
    if plain.batch.support_floors is not None:  # the floors act: a support of one token has logprob 0
        alone = np.concatenate(unpack_responses(np.asarray(plain.batch.support_floors), plain.layout)) > 1e3
        # log 1 up to float32 rounding of the log-normalizer (measured 2.4e-7); a cut may keep one token too
        assert np.all(np.abs(want[loss & alone]) <= 1e-6) and np.all(want[loss & ~alone] <= 1e-6)
    for key, want in m_plain.items():
        np.testing.assert_allclose(float(m_tree[key]), float(want), rtol=1e-5, atol=1e-7, err_msg=key)
    for got, want in zip(jax.tree.leaves(g_tree), jax.tree.leaves(g_plain), strict=True):
        scale = float(np.abs(want).max()) or 1.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * scale)


BATCHES = st.fixed_dictionaries(
    dict(
        seed=st.integers(0, 2**16),
        groups=st.integers(1, 3),
        group_size=st.integers(2, 3),
        max_turns=st.integers(1, 2),
        merged=st.booleans(),
    )
)


@pytest.fixture(scope="module")
def moe_lora_state():
    """A MoE model with LoRA adapters (B != 0, so they change the forward), every weight trained; router
    replay and both auxiliary losses; gspo with a sequence reduction, off-policy sequence masks, an
    entropy bonus (one program for all of it: the compile is the cost of this test)."""
    model = random_decoder(MOE, seed=1)
    apply_lora(model, LoRAConfig(rank=2, targets=("q_proj", "v_proj", "lm_head")), rngs=nnx.Rngs(2))
    rng = np.random.default_rng(3)
    for _, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        var.set_value(jnp.asarray(rng.normal(0, 0.1, var.get_value().shape), jnp.float32))
    objective = ObjectiveConfig(
        policy_loss="gspo",
        reduction="sequence_mean",
        off_policy={"tis_ratio_type": "sequence", "sequence_mask_metric": "geometric",
                    "geo_mask_low": 0.9, "geo_mask_high": 1.1},
        entropy_coef=0.01,
    )  # fmt: skip
    config = TrainConfig(
        objective=objective,
        optimizer=OPT,
        router_replay=True,
        moe_aux_loss_coef=0.01,
        router_z_loss_coef=1e-3,
    )
    return TrainState.create(model, config, trainable=nnx.Any(nnx.Param, LoRAParam))


#: The tree's loss-token buffer (fixed, so the examples share one program): a quarter of its 512 tokens.
TREE_LOGITS = 128


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=BATCHES)
def test_moe_lora_sequence_losses_and_off_policy_masks_equal_plain_packing(moe_lora_state, spec):
    """Today's path (plain rows, every token through the vocabulary) against the tree with logits for
    its loss tokens only, top-k / top-p support floors on both, old-policy recompute included."""
    rng = np.random.default_rng(spec["seed"])
    steps = _with_floors(_steps(**spec, routing=MOE_ROUTING), rng)
    ce = [0.5 if i % 3 == 0 else 0.0 for i in range(len(steps))]
    plain, tree = _packings(steps, rng, ce_weights=ce)
    assert 0 < np.count_nonzero(tree.batch.loss_mask) <= TREE_LOGITS
    every = dataclasses.replace(moe_lora_state.config, loss_only_logits=False)
    loss_only = dataclasses.replace(moe_lora_state.config, loss_only_logits=True, logit_capacity=TREE_LOGITS)
    _check_equal(
        dataclasses.replace(moe_lora_state, config=every), plain, tree, every.objective,
        tree_state=dataclasses.replace(moe_lora_state, config=loss_only),
    )  # fmt: skip


def test_critic_values_and_gae_advantages_equal_plain_packing():
    """PPO as the trainer runs it: prepared samples (merged where turns extend each other), GAE along
    each trajectory's turns across samples (``turn_links``), whitened advantages."""
    policy = random_decoder(DENSE, seed=5)
    critic = ValueModel.from_policy(policy, rngs=nnx.Rngs(0))
    critic.value_kernel[...] = jnp.asarray(np.random.default_rng(6).normal(0, 0.5, (DENSE.hidden_size, 1)))
    state = TrainState.create(critic, TrainConfig(optimizer=OPT))
    rng = np.random.default_rng(7)
    steps = [
        s.replace(reward=float(rng.normal()))
        for s in _steps(7, groups=3, group_size=3, max_turns=2, merged=False)
    ]
    prep = prepare_samples(get_algorithm("ppo"), StepBatch(steps))
    out, shared = [], []
    for sharing in (False, True):
        r = pack(prep.samples, seq_len=SEQ, row_buckets=[ROWS], prefix_sharing=sharing, **prep.streams())
        links = turn_links(prep.samples, prep.turn_spans, r.layout)
        assert (links[:, 0] >= 0).sum() > 0  # some trajectory's turns are linked across samples
        values = critic_values(state, r.batch)
        adv, ret = ppo_advantages(values, r.batch, CriticConfig(gamma=0.9, lam=0.8), links)
        out.append([np.concatenate(unpack_responses(np.asarray(x), r.layout)) for x in (values, adv, ret)])
        shared.append(r.metrics["shared_prefix_tokens"])
    assert shared[0] == 0 < shared[1]
    for got, want in zip(out[1], out[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def context_case():
    """A model, the plain and tree packings of one batch, and the plain forward (no mesh)."""
    model = random_decoder(DENSE, seed=9)
    plain, tree = _packings(
        _steps(10, groups=3, group_size=3, max_turns=2, merged=False), np.random.default_rng(0)
    )
    assert tree.metrics["shared_prefix_tokens"] > 0
    want = _forward(
        model, jnp.asarray(plain.batch.tokens), plain.batch.temperatures, packing_kwargs(plain.batch)
    )
    return model, plain, tree, want


@pytest.mark.parametrize("collective", ["all_gather", "ring"])
def test_context_parallel_tree_rows_equal_plain_packing(context_case, collective):
    model, plain, tree, want = context_case
    model.context_attention = collective
    try:
        with jax.set_mesh(make_mesh(data=4, context=2)):
            got = _forward(
                model, jnp.asarray(tree.batch.tokens), tree.batch.temperatures, packing_kwargs(tree.batch)
            )
    finally:
        model.context_attention = "all_gather"
    for field in ("logprobs", "entropy"):
        np.testing.assert_allclose(
            np.concatenate(unpack_responses(np.asarray(getattr(got, field)), tree.layout)),
            np.concatenate(unpack_responses(np.asarray(getattr(want, field)), plain.layout)),
            **LOGPROB_TOL,
        )


def test_one_rl_step_gives_the_same_parameters_with_prefix_sharing_on_and_off(tmp_path):
    """The smoke run (multi-turn lookup, groups of 2): its one RL step trains the step's rollouts the
    trainer's way (advantages, merge, mini-batches, the old policy's logprobs recomputed, the jitted
    step) with prefix sharing and loss-only logits on (the defaults), then from the same state again
    with both off (today's path: plain rows, every token through the vocabulary). An entropy bonus
    gives a gradient through every parameter (the tiny model's rewards are all 0 at step 1, so its
    advantages are); Adam's eps=1e-4 keeps the first update from amplifying float noise on near-zero
    gradients."""
    c = smoke.get_config()
    c.warmstart.num_steps = 0
    c.algorithm = dict(name="grpo", policy_loss="ppo_clip")
    c.objective.entropy_coef = 0.1
    c.optimizer.eps = 1e-4
    # prefix_sharing "auto", loss_only_logits True: the defaults
    c.trainer.update(num_steps=1, checkpoint_every=0, eval_every=0, old_logprobs="recompute")
    trainer = trainer_lib.Trainer(c, tmp_path)
    parts, train_on, recompute = trainer.parts, trainer._train_on, trainer._with_policy_logprobs
    assert parts.prefix_sharing and all(tc.loss_only_logits for tc in parts.train_configs.values())
    configs, out, old = dict(parts.train_configs), {}, {True: [], False: []}

    def recorded(mb, algorithm):  # the recomputed old logprobs of each sample's response, in order
        mb = recompute(mb, algorithm)
        old[parts.prefix_sharing] += unpack_responses(np.asarray(mb.batch.old_logprobs), mb.layout)
        return mb

    def both(batch):
        before = jax.tree.map(jnp.copy, parts.state)  # the step donates the state it trains
        for on in (True, False):
            parts.state, parts.prefix_sharing = jax.tree.map(jnp.copy, before), on
            parts.train_configs = {k: dataclasses.replace(v, loss_only_logits=on) for k, v in configs.items()}
            metrics = train_on(batch)
            out[on] = ([np.asarray(x) for x in jax.tree.leaves(parts.state.params)], metrics)
        return metrics

    trainer._train_on, trainer._with_policy_logprobs = both, recorded
    trainer.run()
    (tree, tree_row), (plain, plain_row) = out[True], out[False]
    assert tree_row["pack/shared_prefix_tokens"] > 0 == plain_row["pack/shared_prefix_tokens"]
    old_tree, old_plain = np.concatenate(old[True]), np.concatenate(old[False])
    assert np.count_nonzero(old_plain) > 0
    np.testing.assert_allclose(old_tree, old_plain, **LOGPROB_TOL)
    # an update was applied (Adam's first step moves every parameter with a gradient by about lr = 1e-3)
    assert tree_row["grad_norm"] > 1e-4 and tree_row["update_skipped"] == 0
    np.testing.assert_allclose(tree_row["loss"], plain_row["loss"], rtol=1e-5)
    for got, want in zip(tree, plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def test_prefix_sharing_key_and_the_run_decision(caplog):
    assert parse_run_config({}).trainer.prefix_sharing == "auto"
    with pytest.raises(ValueError, match=r"config.trainer.prefix_sharing.*\['auto', 'off'\].*'on'"):
        parse_run_config({"trainer": {"prefix_sharing": "on"}})
    model = random_decoder(DENSE)
    assert resolve_prefix_sharing("auto", model) and not resolve_prefix_sharing("off", model)

    class StatefulLayers:  # a model that declares nothing: its layers may carry state along the tokens
        pass

    with caplog.at_level(logging.WARNING, logger="rljax.run.run"):
        assert not resolve_prefix_sharing("auto", model, critic=StatefulLayers())
    assert "off (the critic model StatefulLayers does not compute prefix-tree rows" in caplog.text
