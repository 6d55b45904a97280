"""Shared builders for the train tests: a tiny Qwen3-shaped decoder and random packed batches."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from rljax.core.objective import ObjectiveConfig
from rljax.data.pack import pack
from rljax.models import Decoder, tiny_config
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step
from rljax.types import Step

VOCAB = 128
ROWS, SEQ_LEN = 8, 32

CONFIG = tiny_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, head_dim=16)

OBJ = ObjectiveConfig()
# The train step's config of the sharding, context, micro-batch and multi-process tests (one config:
# the same programs compile once per session, in the persistent compilation cache). Clipping is
# active; eps=1e-4 bounds Adam's amplification of float reassociation noise on near-zero gradients
# (see tests/train/test_train_step.py), so re-ordered float32 sums give the same params to rtol 1e-5
# / atol 1e-6.
TRAIN_CONFIG = TrainConfig(
    objective=OBJ,
    optimizer=OptimizerConfig(
        learning_rate=1e-3, warmup_steps=1, weight_decay=0.1, max_grad_norm=0.05, eps=1e-4
    ),
)


def make_model(seed: int = 0, **kwargs) -> Decoder:
    return Decoder(CONFIG, rngs=nnx.Rngs(seed), **kwargs)


def make_steps(seed: int, *, num_steps: int = 16) -> list[Step]:
    """Random multi-sample steps (lengths 8..16, so at most 8 rows of 32) with per-step temperatures."""
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(num_steps):
        prompt_len = int(rng.integers(2, 7))
        response_len = int(rng.integers(8, 17)) - prompt_len
        steps.append(
            Step(
                prompt_ids=rng.integers(0, VOCAB, prompt_len).tolist(),
                response_ids=rng.integers(0, VOCAB, response_len).tolist(),
                trajectory_id=(f"q{i // 4}", i % 4),
                loss_mask=(rng.random(response_len) < 0.9).astype(int).tolist(),
                # near-uniform policy probabilities (~1/128): dppo keeps every token
                response_logprobs=np.log(rng.uniform(0.002, 0.03, response_len)).tolist(),
                temperature=float(rng.choice([0.7, 1.0, 1.3])),
            )
        )
    return steps


def make_batch(seed: int, *, ce: float = 0.3, rl: float = 1.0):
    """A packed ``[8, 32]`` batch: rl (dppo) on every step, ce with weight ``ce`` on every other step."""
    steps = make_steps(seed)
    rng = np.random.default_rng(seed + 1000)
    advantages = [rng.normal(size=len(s.response_ids)).astype(np.float32) for s in steps]
    result = pack(
        steps,
        seq_len=SEQ_LEN,
        advantages=advantages,
        rl_weights=rl,
        ce_weights=[ce if i % 2 else 0.0 for i in range(len(steps))],
        row_buckets=[ROWS],
    )
    return result.batch


def params_numpy(state) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(state.params)]


def reference_steps(state: TrainState, batches, objective: ObjectiveConfig = OBJ) -> list[tuple[list, dict]]:
    """``(params, metrics)`` as numpy / floats after each of the unsharded ``train_step`` s over
    ``batches``: the single-device reference the sharded and context-parallel runs must equal."""
    history = []
    for b in batches:
        state, metrics = train_step(state, b, mini_batch_counts(b, objective))
        history.append((params_numpy(state), {k: float(v) for k, v in metrics.items()}))
    return history
