"""LoRA (adapter-only) training: the adapter trains, the base does not move; in ``TrainState`` and
through the trainer (``config.lora``).

Step level, with references independent of the train step: the base weights as they were before
training (bit-identical afterwards, and the very same arrays: never donated), the adapter's byte count
(Adam's moments must cover exactly it), the base model's own logprobs (a fresh adapter adds an exact
zero), a hand-written step (``jax.grad`` of the objective w.r.t. the adapter on a model merged by hand,
then ``optax`` clip + AdamW applied explicitly), the adapter folded into the weights
(:func:`rljax.models.lora.merge_lora`), and the unsharded run for the sharded one.

Trainer level: adapters train, the base stays bit-identical, resume restores the adapters; with a
warm start the base is warm-started first (full model, adapters untouched) and carried by the
checkpoints.
"""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import train_fixtures as tf
from flax import nnx
from recipes import load_recipe
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.core.objective import ObjectiveConfig, objective
from rljax.inference.engine import SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.models.logprobs import sequence_forward
from rljax.models.lora import LoRAConfig, LoRAParam, apply_lora, merge_lora
from rljax.run.trainer import Trainer
from rljax.training import checkpoint as ckpt
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import (
    TrainConfig,
    TrainState,
    mini_batch_counts,
    split_micro_batches,
    train_mini_batch,
    train_step,
)

OBJ = ObjectiveConfig()
OPT = OptimizerConfig(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, eps=1e-6)
CONFIG = TrainConfig(objective=OBJ, optimizer=OPT)
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
#: With an adapter on the output projection (the unembedding; tf's model is tied) as well.
LORA_HEAD = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj", "lm_head"))
NUM_STEPS = 3


def lora_model(seed: int = 0, *, base_dtype=jnp.float32, lora: LoRAConfig = LORA) -> models.Decoder:
    base = tf.make_model(seed)
    if base_dtype != jnp.float32:
        base = models.cast_model(base, base_dtype)
    return apply_lora(base, lora, rngs=nnx.Rngs(seed + 1))


def nonzero_adapter(model: models.Decoder, seed: int = 5, scale: float = 0.05) -> models.Decoder:
    """Draws B (zero-initialised) at random, so the adapter changes the outputs."""
    flat = nnx.to_flat_state(nnx.state(model, LoRAParam))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    new = [
        (p, v.replace(scale * jax.random.normal(k, v.shape, v.dtype)))
        for k, (p, v) in zip(keys, flat, strict=True)
    ]
    nnx.update(model, nnx.from_flat_state(new))
    return model


def numpy_leaves(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def run_steps(state: TrainState, seeds) -> tuple[TrainState, list[dict]]:
    history = []
    for seed in seeds:
        batch = tf.make_batch(seed)
        state, metrics = train_step(state, batch, mini_batch_counts(batch, OBJ))
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def test_only_the_adapter_changes_and_the_base_is_the_same_arrays():
    model = lora_model()
    base_before = numpy_leaves(nnx.state(model, nnx.Param))
    state = TrainState.create(model, CONFIG)
    assert {type(v) for _, v in nnx.to_flat_state(state.params)} == {LoRAParam}
    assert {type(v) for _, v in nnx.to_flat_state(state.frozen)} == {nnx.Param}
    frozen_arrays = jax.tree.leaves(state.frozen)
    adapter_before = numpy_leaves(state.params)
    state, history = run_steps(state, range(40, 40 + NUM_STEPS))
    assert [h["update_skipped"] for h in history] == [0.0] * NUM_STEPS and int(state.step) == NUM_STEPS
    # Not donated, not copied: the state after N steps holds the caller's base arrays themselves.
    assert all(a is b for a, b in zip(jax.tree.leaves(state.frozen), frozen_arrays, strict=True))
    assert not any(a.is_deleted() for a in frozen_arrays)
    for a, b in zip(numpy_leaves(state.frozen), base_before, strict=True):
        np.testing.assert_array_equal(a, b)
    moved = [
        not np.array_equal(a, b) for a, b in zip(numpy_leaves(state.params), adapter_before, strict=True)
    ]
    assert all(moved), moved
    # state.model is the base with the trained adapter in it
    assert len(jax.tree.leaves(nnx.state(state.model, LoRAParam))) == len(adapter_before)


def test_optimizer_state_covers_only_the_adapter():
    state = TrainState.create(lora_model(), CONFIG)
    full = TrainState.create(tf.make_model(0), CONFIG)
    adapter = jax.tree.leaves(state.params)
    layers = tf.CONFIG.num_layers
    assert len(adapter) == 2 * len(LORA.targets) * layers
    # Adam's mu and nu: one copy of each adapter leaf apiece; the rest are scalar counters.
    big = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sorted(x.shape for x in big) == sorted(2 * [x.shape for x in adapter])
    assert all(x.dtype == jnp.float32 for x in big)
    scalars = nbytes(state.opt_state) - nbytes(big)
    assert nbytes(big) == 2 * nbytes(state.params) and scalars < 64
    print(
        f"\nLoRA r={LORA.rank}: trained {nbytes(state.params)} B, optimizer {nbytes(state.opt_state)} B; "
        f"full training: {nbytes(full.params)} B, optimizer {nbytes(full.opt_state)} B"
    )
    assert nbytes(state.opt_state) < 0.2 * nbytes(full.opt_state)


def test_zero_init_adapter_gives_exactly_the_base_logprobs():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, tf.VOCAB, (2, 24)), jnp.int32)
    want = np.asarray(models.sequence_logprobs(tf.make_model(0), tokens))
    state = TrainState.create(lora_model(), CONFIG)
    np.testing.assert_array_equal(np.asarray(models.sequence_logprobs(state.model, tokens)), want)


def hand_step(model: models.Decoder, batch, counts) -> nnx.State:
    """One clip + AdamW update of the adapter of ``model``, written out with jax.grad and optax."""
    graphdef, adapter, base = nnx.split(model, LoRAParam, nnx.Param)

    def loss(adapter: nnx.State) -> jax.Array:
        m = nnx.merge(graphdef, adapter, base)
        temperature = 1.0 if batch.temperatures is None else batch.temperatures
        logp, entropy, _ = sequence_forward(
            m, jnp.asarray(batch.tokens), positions=batch.positions, segment_ids=batch.segment_ids,
            temperature=temperature,
        )  # fmt: skip
        return objective(logp, batch, counts, OBJ, entropy=jax.lax.stop_gradient(entropy))[0]

    grads = jax.grad(loss)(adapter)
    tx = optax.chain(
        optax.clip_by_global_norm(OPT.max_grad_norm),
        optax.adamw(OPT.learning_rate, b1=OPT.b1, b2=OPT.b2, eps=OPT.eps, weight_decay=OPT.weight_decay),
    )
    updates, _ = tx.update(grads, tx.init(adapter), adapter)
    return optax.apply_updates(adapter, updates)


@pytest.mark.parametrize("lora", [LORA, LORA_HEAD], ids=["dense", "with_lm_head"])
def test_lora_train_step_equals_a_hand_computed_update(lora):
    model = nonzero_adapter(lora_model(lora=lora))  # B != 0: gradients reach A too
    if lora.unembed:
        assert model.lm_head_lora.lora_b.shape == (4, tf.VOCAB)
    batch = tf.make_batch(7)
    counts = mini_batch_counts(batch, OBJ)
    want = hand_step(model, batch, counts)
    state, _ = train_step(TrainState.create(model, CONFIG), batch, counts)
    # float32 reassociation between the two programs; Adam maps a ~1e-6 relative gradient
    # difference to at most ~lr * 1e-6 / eps-scaled noise in the update (lr 1e-2).
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


def test_merged_weights_match_base_plus_adapter():
    state, _ = run_steps(TrainState.create(nonzero_adapter(lora_model()), CONFIG), [11, 12])
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, tf.VOCAB, (2, 24)), jnp.int32)
    adapted = state.model
    merged = merge_lora(adapted)
    assert not jax.tree.leaves(nnx.state(merged, LoRAParam))
    with_adapter = np.asarray(models.sequence_logprobs(adapted, tokens))
    np.testing.assert_allclose(
        np.asarray(models.sequence_logprobs(merged, tokens)), with_adapter, **LOGPROB_TOL
    )
    base = np.asarray(models.sequence_logprobs(tf.make_model(0), tokens))
    assert np.max(np.abs(base - with_adapter)) > 1e-2  # the adapter matters: the test is not blind


def test_bf16_base_with_a_float32_adapter():
    model = nonzero_adapter(lora_model(base_dtype=jnp.bfloat16))
    state = TrainState.create(model, CONFIG)
    assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    base_before = numpy_leaves(state.frozen)
    state, history = run_steps(state, [21, 22])
    assert all(np.isfinite(h["loss"]) and h["update_skipped"] == 0.0 for h in history)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    for a, b in zip(numpy_leaves(state.frozen), base_before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_micro_batches_equal_the_whole_batch():
    batch = tf.make_batch(31)
    counts = mini_batch_counts(batch, OBJ)
    whole, m1 = train_step(TrainState.create(nonzero_adapter(lora_model()), CONFIG), batch, counts)
    micro = split_micro_batches(batch, 2)
    state = TrainState.create(nonzero_adapter(lora_model()), CONFIG)
    frozen_arrays = jax.tree.leaves(state.frozen)
    split, m2 = train_mini_batch(state, micro, counts)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5)
    # Adam's first step is ~lr * g / (|g| + eps): on near-zero gradient entries it amplifies the float
    # noise of summing the loss in another order by up to lr / eps = 1e4. Measured max |diff| over
    # batch seeds 31-38 (steps of ~1e-2): 3.2e-6 to 6.0e-6 under the tests' XLA flags, the older
    # ones and XLA's defaults; the bound is ~3x that (0.2% of a step).
    for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)
    assert all(a is b for a, b in zip(jax.tree.leaves(split.frozen), frozen_arrays, strict=True))


@pytest.mark.parametrize("lora", [LORA, LORA_HEAD], ids=["dense", "with_lm_head"])
def test_sharded_lora_equals_unsharded(lora):
    seeds = [51, 52]
    single, single_hist = run_steps(TrainState.create(nonzero_adapter(lora_model(lora=lora)), CONFIG), seeds)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    state = TrainState.create(nonzero_adapter(lora_model(lora=lora)), CONFIG, mesh=mesh)
    if lora.unembed:  # sharded like the unembedding: hidden over fsdp, vocab over tensor
        head = state.params["lm_head_lora"]
        assert head["lora_a"].get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp")
        assert head["lora_b"].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    q = state.frozen["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")  # the base follows the rules
    a = state.params["layers"][0]["self_attn"]["q_proj"]["lora_a"].get_value()
    b = state.params["layers"][0]["self_attn"]["q_proj"]["lora_b"].get_value()
    assert a.sharding.spec == jax.sharding.PartitionSpec("fsdp") and b.sharding.spec[1] == "tensor"
    frozen_arrays = jax.tree.leaves(state.frozen)
    for seed, want in zip(seeds, single_hist, strict=True):
        batch = shard_batch(tf.make_batch(seed), mesh)
        state, metrics = train_step(state, batch, mini_batch_counts(batch, OBJ))
        np.testing.assert_allclose(float(metrics["loss"]), want["loss"], rtol=1e-5, atol=1e-6)
    assert all(x is y for x, y in zip(jax.tree.leaves(state.frozen), frozen_arrays, strict=True))
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_trainable_filter_and_clear_errors():
    both = TrainState.create(lora_model(), CONFIG, trainable=nnx.Any(nnx.Param, LoRAParam))
    assert not jax.tree.leaves(both.frozen)  # everything trains
    plain = TrainState.create(tf.make_model(0), CONFIG)
    assert not jax.tree.leaves(plain.frozen) and len(jax.tree.leaves(plain.params)) > 0

    model = tf.make_model(0)
    model.layers[0].mlp.running_mean = nnx.BatchStat(jnp.zeros(4))
    with pytest.raises(
        ValueError, match=r"found other variables: \['layers.0.mlp.running_mean \(BatchStat\)'\]"
    ):
        TrainState.create(model, CONFIG)
    with pytest.raises(ValueError, match="selects no variable"):
        TrainState.create(tf.make_model(0), CONFIG, trainable=LoRAParam)


def test_the_embedded_sampler_applies_the_adapter():
    state, _ = run_steps(TrainState.create(nonzero_adapter(lora_model()), CONFIG), [61])
    sampler = EmbeddedSampler(state.model, max_batch_size=1, min_prompt_bucket=8, min_new_tokens_bucket=8)
    prompt = [3, 14, 15, 92, 6]
    out = asyncio.run(sampler.generate(prompt, SamplingParams(max_tokens=8, seed=3)))
    ids = jnp.asarray([prompt + list(out.ids)], jnp.int32)
    adapted = np.asarray(models.sequence_logprobs(state.model, ids))[0, len(prompt) :]
    base = np.asarray(models.sequence_logprobs(tf.make_model(0), ids))[0, len(prompt) :]
    np.testing.assert_allclose(np.asarray(out.logprobs), adapted, **LOGPROB_TOL)
    assert np.max(np.abs(base - adapted)) > 1e-3


# -- through the trainer (config.lora) --------------------------------------------------------------


def _config(*, warm_start: int):
    c = load_recipe("smoke")
    c.lora = dict(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    c.warmstart.num_steps = warm_start
    c.trainer.update(num_steps=2, eval_every=0)
    return c


def test_trainer_with_config_lora_trains_adapters_only(tmp_path):
    c = _config(warm_start=0)
    t = Trainer(c, tmp_path)
    base, adapters = numpy_leaves(t.state.frozen), numpy_leaves(t.state.params)
    assert base and all(a.size < 2000 for a in adapters)
    assert len(t.run()) == 2
    for a, b in zip(numpy_leaves(t.state.frozen), base, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(numpy_leaves(t.state.params), adapters, strict=True))
    stored = ckpt.restore(tmp_path / "checkpoints").params
    assert "lora_base" not in stored  # the base is the config's own: not saved again
    t2 = Trainer(c, tmp_path, resume=True)
    t2._restore()
    for a, b in zip(numpy_leaves(t2.state.params), numpy_leaves(t.state.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_lora_after_a_warm_start_keeps_the_warm_started_base(tmp_path):
    """Also the task run as an agent through the gateway (LoRA through the gateway)."""
    c = _config(warm_start=2)
    c.envs.lookup.agent = "rljax.agents.lookup_agent:lookup_agent"
    t = Trainer(c, tmp_path)
    init_base = numpy_leaves(t.state.frozen)
    rows = [r for r in t.run() if "loss" in r]
    assert t.parts.scheduler.gateway is not None and rows
    assert all(r["rollout/num_errored"] == 0 and r["rollout/num_steps"] > 0 for r in rows)
    trained_base = numpy_leaves(t.state.frozen)
    assert any(not np.array_equal(a, b) for a, b in zip(trained_base, init_base, strict=True))
    t2 = Trainer(c, tmp_path, resume=True)  # a fresh process would rebuild the untrained base
    t2._restore()
    for a, b in zip(numpy_leaves(t2.state.frozen), trained_base, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(numpy_leaves(t2.state.params), numpy_leaves(t.state.params), strict=True):
        np.testing.assert_array_equal(a, b)
