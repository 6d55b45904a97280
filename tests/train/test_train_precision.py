"""The real-model path on CPU: a bf16 HF checkpoint trains with float32 master weights.

* the ``configs/qwen3_gpu.py`` recipe, built from a tiny bf16 Qwen3 checkpoint written by
  transformers (shrunk, the embedded engine swapped in for vLLM), trains 2 steps at lr 1e-6: every
  parameter tensor moves away from the checkpoint, the run uses micro-batches and reports memory,
  and the saved weights load in transformers with the logits rljax computes;
* the same 3 updates on bf16 master weights change (almost) nothing: the updates round away;
* bf16 compute logprobs vs float32 logprobs on the same weights stay within the documented bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_fixtures as tf
from flax import nnx
from recipes import load_recipe

from rljax import models
from rljax.chat import toy_tokenizer
from rljax.core.objective import ObjectiveConfig
from rljax.models.tiny import random_decoder, tiny_config
from rljax.run.trainer import Trainer
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# bf16 compute vs float32 compute on the same weights, max |logprob difference| over 48-token rows
# of random tiny models with peaked distributions (random_decoder), 5 seeds per family (measured
# 2026-11-24): dense llama/qwen2/qwen3 <= 0.084 (mean 0.010-0.016); MoE <= 0.33 (a token whose
# top-k flips under bf16 routes to other experts; mean <= 0.04). bf16 keeps 8 mantissa bits
# (relative rounding 2^-9 per op). Documented bounds (docs/guides/precision_memory_export.md): 2-3x
# the measured max.
BF16_COMPUTE_LOGPROB_ATOL = {"dense": 0.2, "moe": 1.0}
BF16_COMPUTE_LOGPROB_MEAN_ATOL = 0.1


def _write_bf16_qwen3(path) -> None:
    """A tiny random Qwen3 saved by transformers in bfloat16, with a toy ChatML tokenizer."""
    tok = toy_tokenizer("chatml")
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok) + 7,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def _recipe(ckpt, **trainer):
    c = load_recipe("qwen3_gpu")
    c.model.hf_path = str(ckpt)
    c.tokenizer.name = str(ckpt)
    c.engine.kind = "embedded"  # the vLLM servers of the recipe swapped for the in-process sampler
    c.envs.lookup.update(num_train_tasks=8, num_eval_tasks=0)
    c.rollout.update(group_size=2, max_turns=2, max_tokens=16, max_context_len=896)  # prompts: ~620 tokens
    c.trainer.update(
        num_steps=2, prompts_per_step=2, mini_batch_prompts=2, seq_len=1024, micro_batch_tokens=1024,
        eval_every=0, checkpoint_every=0, table_keys=(),
    )  # fmt: skip
    c.trainer.update(**trainer)
    # A random model earns no reward (all advantages 0): the entropy bonus gives every parameter a
    # real gradient, so "did the update survive" is tested on ordinary-sized updates.
    c.objective.entropy_coef = 1e-2
    c.optimizer.warmup_steps = 0
    return c


def test_qwen3_gpu_recipe_from_a_bf16_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    _write_bf16_qwen3(ckpt)
    c = _recipe(ckpt)
    assert c.mesh.fsdp == 8 and c.optimizer.learning_rate == 1e-6  # the recipe's own mesh and lr
    t = Trainer(c, tmp_path / "run")
    hf_state = models.to_hf_state_dict(t.parts.current_model())
    start = {k: np.asarray(v, np.float32) for k, v in hf_state.items()}
    loaded = models.load_hf_tensors(ckpt)
    for name, value in start.items():  # the bf16 checkpoint is upcast exactly
        np.testing.assert_array_equal(value, np.asarray(loaded[name], np.float32), err_msg=name)
    assert {x.dtype for x in jax.tree.leaves(t.state.params)} == {jnp.dtype(jnp.float32)}
    assert t.parts.current_model().dtype == jnp.bfloat16 and t.parts.current_model().remat == "full"

    history = t.run()
    assert len(history) == 2 and all(h["update_skipped"] == 0 for h in history)
    assert all(h["memory/step_bytes"] > 0 for h in history)
    end = models.to_hf_state_dict(t.parts.current_model())
    for name, value in start.items():  # lr 1e-6 on float32 masters: every tensor moved
        changed = np.mean(np.asarray(end[name], np.float32) != value)
        assert changed > 0.9, (name, changed)

    # the trained weights, saved as bf16 HF, load in transformers and give rljax's logits
    out = tmp_path / "export"
    models.save_pretrained(t.parts.current_model(), out, dtype=jnp.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    ids = np.random.default_rng(0).integers(0, hf.config.vocab_size, size=(1, 24))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    ours = models.cast_model(models.from_pretrained(out), jnp.float32)
    got = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bf16_master_weights_lose_small_updates():
    """3 AdamW updates at lr 1e-6: float32 masters move every tensor, bf16 masters almost none."""
    batches = [tf.make_batch(500 + i) for i in range(3)]
    config = TrainConfig(objective=ObjectiveConfig(), optimizer=OptimizerConfig(learning_rate=1e-6))
    changed = {}
    for master in ("float32", "bfloat16"):
        model = tf.make_model(0, dtype=jnp.bfloat16, param_dtype=jnp.dtype(master))
        before = [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx_params(model))]
        state = TrainState.create(model, config)
        for batch in batches:
            state, m = train_step(state, batch, mini_batch_counts(batch, config.objective))
            assert float(m["update_skipped"]) == 0
        after = [np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
        changed[master] = [float(np.mean(a != b)) for a, b in zip(after, before, strict=True)]
    assert min(changed["float32"]) > 0.9, changed["float32"]
    total = sum(changed["bfloat16"]) / len(changed["bfloat16"])
    assert total < 0.05, changed["bfloat16"]  # only weights within ~1e-4 of zero can move


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


@functools.partial(jax.jit, static_argnums=0)
def _logprobs_of_state(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array) -> jax.Array:
    """One compiled forward per (graph, dtype), reused across seeds (eager forwards re-dispatch
    every op: 126 s for this file's 30 forwards before)."""
    return models.sequence_logprobs(nnx.merge(graphdef, state), tokens)


def _jitted_logprobs(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    return _logprobs_of_state(*nnx.split(model), tokens)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_bf16_compute_logprob_error_is_bounded(model_type):
    errors, means = [], []
    for seed in range(3):
        cfg = tiny_config(model_type=model_type, vocab_size=256, hidden_size=64, head_dim=16)
        model = random_decoder(cfg, seed=seed)
        tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=(2, 48)), jnp.int32)
        f32 = _jitted_logprobs(model, tokens)
        bf16 = _jitted_logprobs(models.cast_model(model, jnp.bfloat16), tokens)
        errors.append(float(jnp.max(jnp.abs(f32 - bf16))))
        means.append(float(jnp.mean(jnp.abs(f32 - bf16)[:, 1:])))
    assert max(errors) <= BF16_COMPUTE_LOGPROB_ATOL["moe" if "moe" in model_type else "dense"], errors
    assert max(means) <= BF16_COMPUTE_LOGPROB_MEAN_ATOL, means
    assert max(errors) > 1e-3, errors  # bf16 was really used (float32 would agree to ~1e-6)
