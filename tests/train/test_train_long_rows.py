"""Long rows (trainer.seq_len 65,536): the compiled train step (remat, micro-batches) and the scoring
forward never hold a T x T array, and their memory grows linearly with the row length.

Compile-only (XLA's compiled HLO and memory analysis of a 1-layer model); nothing runs at 64k.
Bounds: a query block of ``b`` = 1024 tokens against all ``T`` keys is the largest thing attention
needs (``heads x b x T`` scores, 1/32 of ``T x T`` for 2 heads at 64k); every buffer must stay
within 2x that, and the step's temporaries from 32k to 64k within 2.3x (exactly linear = 2x;
the quadratic XLA schedule of unrolled causal blocks this replaced measured 3.7x per doubling).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.core.objective import ObjectiveConfig
from rljax.data.pack import pack
from rljax.inference.sampler import generate_tokens
from rljax.models import Decoder, tiny_config
from rljax.models.logprobs import sequence_forward
from rljax.training.step import (
    TrainConfig,
    TrainState,
    mini_batch_counts,
    split_micro_batches,
    train_mini_batch,
    train_step,
)
from rljax.types import PackedBatch, Step

CFG = tiny_config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    head_dim=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
)
pytestmark = pytest.mark.slow  # two 64k compiles: ~1-2 min on 2 shared cores
BLOCK = 1024  # the Decoder's default attention_chunk_size
_SHAPE = re.compile(r"\b(?:f32|f16|bf16|s32|pred|u32|s8|u8)\[([0-9,]+)\]")


def _row(length: int, rows: int = 1) -> PackedBatch:
    """``rows`` rows of ``length`` tokens, each 8 packed samples (prompt 1/8 of each), RL-weighted."""
    rng = np.random.default_rng(0)
    n = length // 8
    steps = [
        Step(rng.integers(1, CFG.vocab_size, n // 8).tolist(),
             rng.integers(1, CFG.vocab_size, n - n // 8).tolist(),
             (f"q{i}", 0), response_logprobs=(-rng.random(n - n // 8)).tolist())
        for i in range(8 * rows)
    ]  # fmt: skip
    adv = [rng.normal(size=n - n // 8).astype(np.float32) for _ in steps]
    return pack(steps, seq_len=length, advantages=adv, row_buckets=[rows]).batch


def _largest_buffer(compiled) -> int:
    """Elements of the largest array any instruction of the compiled HLO produces."""
    sizes = [
        int(np.prod([int(d) for d in m.group(1).split(",")])) for m in _SHAPE.finditer(compiled.as_text())
    ]
    return max(sizes)


@pytest.fixture(scope="module")
def state():
    config = TrainConfig(objective=ObjectiveConfig(), chunk_size=1024)
    return TrainState.create(Decoder(CFG, remat="full", rngs=nnx.Rngs(0)), config)


def test_64k_train_step_has_no_t_by_t_array_and_linear_memory(state):
    temps = {}
    for length in (32768, 65536):
        batch = _row(length)
        compiled = train_step.jitted.lower(
            *train_step_args(state, batch), mini_batch_counts(batch, state.config.objective)
        ).compile()
        temps[length] = compiled.memory_analysis().temp_size_in_bytes
        largest = _largest_buffer(compiled)
        assert largest <= 2 * CFG.num_heads * BLOCK * length < length * length // 4, (length, largest)
    assert temps[65536] / temps[32768] <= 2.3, temps


def test_64k_micro_batches_and_scoring_forward_have_no_t_by_t_array(state):
    length = 65536
    micro = split_micro_batches(_row(length, rows=2), 2)
    counts = mini_batch_counts(micro, state.config.objective)
    compiled = train_mini_batch.jitted.lower(*train_step_args(state, micro), counts).compile()
    assert _largest_buffer(compiled) <= 2 * CFG.num_heads * BLOCK * length
    batch = _row(length)
    forward = jax.jit(lambda m, t, s: sequence_forward(m, t, segment_ids=s).logprobs)
    compiled = forward.lower(state.model, batch.tokens, batch.segment_ids).compile()
    assert _largest_buffer(compiled) <= 2 * CFG.num_heads * BLOCK * length


def train_step_args(state, batch):
    """``(state without frozen, frozen, batch)``: the jitted step's leading arguments."""
    return dataclasses.replace(state, frozen=nnx.State({})), state.frozen, batch


def test_embedded_sampler_64k_prompt_has_no_t_by_t_array_and_linear_memory(state):
    """The embedded sampler's whole program (prefill into a 64k KV cache, then the decode loop): the
    prompt's attention runs in 1024-query blocks against the cache (chunked prefill), so no buffer
    exceeds two score blocks, and memory doubles with the prompt."""
    temps = {}
    for length in (32768, 65536):
        prompt = jnp.ones((1, length - 64), jnp.int32)
        program = jax.jit(
            lambda m, p: generate_tokens(
                m, p, jnp.ones_like(p), temperature=jnp.ones(1), top_k=jnp.zeros(1, jnp.int32),
                top_p=jnp.ones(1), max_new=jnp.full(1, 64, jnp.int32),
                stop_ids=jnp.full((1, 1), -1, jnp.int32), seeds=jnp.zeros(1, jnp.uint32), max_new_tokens=64,
            )[:2]
        )  # fmt: skip
        compiled = program.lower(state.model, prompt).compile()
        temps[length] = compiled.memory_analysis().temp_size_in_bytes
        # the KV cache (length slots) is the largest thing; scores are heads x 1024 x length
        assert _largest_buffer(compiled) <= 2 * CFG.num_heads * BLOCK * length, length
    assert temps[65536] / temps[32768] <= 2.3, temps
