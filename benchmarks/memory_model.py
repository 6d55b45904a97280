"""The memory model of a train step, checked against XLA's compiled memory analysis.

A train step of a model with ``P`` parameters (float32 masters, AdamW) on a (micro-)batch of ``T``
tokens in rows of ``S`` tokens holds, in bytes (``docs/guides/precision_memory_export.md`` derives
each term)::

    weights + Adam moments   12 P                          (donated: updated in place)
    gradients                 4 P  (+ 4 P: the float32 sum of micro-batches' gradients)
    activations               T * A(remat)                  A per token, below
    LM head                  ~12 * c * V                    c = rows per logits chunk (<= chunk_size)

with, per token and layer (float32, ``H`` hidden, ``I`` MLP width, ``n`` heads of ``d`` dims,
``m`` key/value heads)::

    remat none:   a = 4 * (6 H + 2 n d + 4 m d + 4 I + n S)     everything the backward reads
    remat full:   a = 4 * H                                     the block's input only

    A = L * a   (+ T-independent: one block's activations recomputed in the backward for "full")

``--check`` compiles the real train step (``rljax.training.step.train_step`` /
``train_mini_batch``) on ABSTRACT weights (``jax.eval_shape``: nothing is allocated, so a 1.7B
model's step is analysed on a laptop) for SmolLM2-135M, a SmolLM2-360M shape and a SmolLM2-1.7B
shape at two batch sizes and compares the model with XLA's figures: the per-token slope of the
temporaries (activations), the T-independent part, and the total. Then it prints the largest
batch (tokens per micro-batch) each configuration fits in 24 GiB of RAM and in 80 GiB of HBM by
the model.

    python benchmarks/memory_model.py           # the model's table only (instant)
    python benchmarks/memory_model.py --check   # + XLA's analysis (a compile per row; minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

GIB = 2.0**30

#: SmolLM2 shapes (llama family, tied embeddings, vocabulary 49,152).
SHAPES = {
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3),
    "SmolLM2-360M": dict(
        hidden_size=960, intermediate_size=2560, num_layers=32, num_heads=15, num_kv_heads=5
    ),
    "SmolLM2-1.7B": dict(
        hidden_size=2048, intermediate_size=8192, num_layers=24, num_heads=32, num_kv_heads=32
    ),
}


def model_config(name: str):  # noqa: ANN201
    from rljax.models import ModelConfig

    return ModelConfig(model_type="llama", vocab_size=49152, head_dim=64, tie_word_embeddings=True,
                       rope_theta=100000.0, max_position_embeddings=8192, **SHAPES[name])  # fmt: skip


def num_params(cfg) -> int:  # noqa: ANN001
    h, i, n, m, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = h * (n * d) * 2 + h * (m * d) * 2 + 3 * h * i + 2 * h
    return cfg.num_layers * per_layer + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h


def activation_bytes_per_token(cfg, seq_len: int, remat: str) -> float:  # noqa: ANN001
    """``A``: activation bytes per token kept for the backward (module docstring)."""
    h, i, n, m, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if remat == "full":
        return 4.0 * cfg.num_layers * h
    return 4.0 * cfg.num_layers * (6 * h + 2 * n * d + 4 * m * d + 4 * i + n * seq_len)


@dataclasses.dataclass(frozen=True)
class Estimate:
    state: float  # weights + Adam moments
    gradients: float
    activations: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.state + self.gradients + self.activations + self.lm_head


def estimate(cfg, tokens: int, seq_len: int, remat: str, *, micro: bool, head_rows: int,  # noqa: ANN001
             chunk_size: int = 512) -> Estimate:  # fmt: skip
    """The model's bytes for a step on ``tokens`` tokens per (micro-)batch."""
    p = num_params(cfg)
    chunks = max(-(-head_rows // chunk_size), 1)
    rows = -(-head_rows // chunks)
    recompute = 0.0
    if remat == "full":  # the backward recomputes one block at a time
        recompute = tokens * activation_bytes_per_token(cfg, seq_len, "none") / cfg.num_layers
    return Estimate(
        state=12.0 * p,
        gradients=(8.0 if micro else 4.0) * p,
        activations=tokens * activation_bytes_per_token(cfg, seq_len, remat) + recompute,
        lm_head=12.0 * rows * cfg.vocab_size,
    )


def max_tokens(cfg, budget: float, seq_len: int, remat: str) -> int:  # noqa: ANN001
    """The largest multiple of ``seq_len`` tokens per micro-batch whose estimate fits ``budget``."""
    best = 0
    for rows in range(1, 1 << 14):
        tokens = rows * seq_len
        if estimate(cfg, tokens, seq_len, remat, micro=True, head_rows=tokens // 4).total > budget:
            break
        best = tokens
    return best


# ------------------------------------------------------------------------------------------------
# XLA's analysis of the real step on abstract weights
# ------------------------------------------------------------------------------------------------


def packed_batch(tokens: int, seq_len: int):  # noqa: ANN201
    """The smollm2_cpu shape of batch: samples of a 45-token prompt and a 16-token response, two per
    row of 128 (a quarter of the tokens carry a loss), ``tokens / seq_len`` rows."""
    from rljax.data.pack import pack
    from rljax.types import Step

    rows = tokens // seq_len
    per_row = max(seq_len // 61, 1)
    rng = np.random.default_rng(0)
    steps = [
        Step(
            rng.integers(0, 49152, 45).tolist(),
            rng.integers(0, 49152, 16).tolist(),
            (f"q{k // 8}", k % 8),
            response_logprobs=[-1.0] * 16,
        )  # fmt: skip
        for k in range(rows * per_row)
    ]
    return pack(
        steps, seq_len=seq_len, row_buckets=[rows], advantages=[np.ones(16, np.float32)] * len(steps)
    ).batch


def xla_step(cfg, tokens: int, seq_len: int, remat: str, *, loss_only: bool, micro_tokens: int = 0):  # noqa: ANN001, ANN201
    """``(compiled memory analysis, LM-head rows, compile seconds)`` of the real train step."""
    import jax
    from flax import nnx

    from rljax.core.objective import ObjectiveConfig
    from rljax.data.micro_batch import split_by_token_budget
    from rljax.models import Decoder
    from rljax.training.step import (
        TrainConfig,
        TrainState,
        mini_batch_counts,
        train_mini_batch,
        train_step,
        with_logit_capacity,
    )

    config = TrainConfig(objective=ObjectiveConfig(), loss_only_logits=loss_only)
    state = jax.eval_shape(lambda: TrainState.create(Decoder(cfg, remat=remat, rngs=nnx.Rngs(0)), config))
    batch = packed_batch(tokens, seq_len)
    fn = train_step
    if micro_tokens:
        batch, fn = split_by_token_budget(batch, micro_batch_tokens=micro_tokens), train_mini_batch
    counts = mini_batch_counts(batch, config.objective)
    start = time.perf_counter()
    analysis = fn.lower(state, batch, counts).compile().memory_analysis()
    seconds = time.perf_counter() - start
    head = int(np.size(batch.tokens))
    if loss_only:  # the loss-token buffer the step compiled with
        head = (
            int(np.prod(np.shape(batch.tokens)[:-2], dtype=int))
            * with_logit_capacity(state, batch).config.logit_capacity
        )
    return analysis, head, seconds


def check(names: Sequence[str], seq_len: int, token_counts: Sequence[int]) -> None:
    print("| model | remat | logits | T | model: act + head | XLA temp - grads | model total | XLA total |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        cfg = model_config(name)
        p = num_params(cfg)
        for remat, loss_only in (("none", False), ("none", True), ("full", True)):
            temps = []
            for tokens in token_counts:
                analysis, head, _ = xla_step(cfg, tokens, seq_len, remat, loss_only=loss_only)
                est = estimate(cfg, tokens, seq_len, remat, micro=False, head_rows=head)
                total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                         - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)  # fmt: skip
                temps.append(analysis.temp_size_in_bytes)
                print(f"| {name} | {remat} | {'loss' if loss_only else 'all'} | {tokens} | "
                      f"{(est.activations + est.lm_head) / GIB:.2f} | "
                      f"{(analysis.temp_size_in_bytes - 4.0 * p) / GIB:.2f} | {est.total / GIB:.2f} | "
                      f"{total / GIB:.2f} |", flush=True)  # fmt: skip
            slope = (temps[-1] - temps[0]) / (token_counts[-1] - token_counts[0])
            model_slope = activation_bytes_per_token(cfg, seq_len, remat)
            kib = f"{model_slope / 1024:.1f} KiB | {slope / 1024:.1f} KiB"
            print(f"|   per-token slope | {remat} | | | {kib} | | |")


def fits_table(seq_len: int) -> None:
    print("| model | params | weights + Adam + grads | remat | tokens / micro-batch in 24 GiB | in 80 GiB |")
    print("|---|---:|---:|---|---:|---:|")
    for name in SHAPES:
        cfg = model_config(name)
        p = num_params(cfg)
        for remat in ("none", "full"):
            fit = [max_tokens(cfg, budget * GIB, seq_len, remat) for budget in (24, 80)]
            cells = [f"{t:,}" if t else "does not fit" for t in fit]
            print(f"| {name} | {p / 1e6:.0f}M | {20 * p / GIB:.1f} GiB | {remat} | {cells[0]} | {cells[1]} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compile the real steps and compare (minutes)")
    p.add_argument("--models", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--tokens", default="2048,4096", help="two token counts per step (the slope)")
    args = p.parse_args(argv)
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")  # fmt: skip
    fits_table(args.seq_len)
    if args.check:
        print()
        check(args.models.split(","), args.seq_len, [int(t) for t in args.tokens.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
