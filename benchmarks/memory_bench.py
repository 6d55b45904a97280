"""Memory of one train step vs tokens per mini-batch (issue 12): remat and micro-batching bound it.

One run, a ~30M-parameter Qwen3-shaped model (float32), rows of 1024 tokens, 2k / 4k / 8k / 16k tokens
per mini-batch, three configurations:

  (a) no remat, the whole mini-batch in one step      (``train_step``)
  (b) remat ("full"), the whole mini-batch             (``train_step``)
  (c) remat + ``micro_batch_tokens=2048``              (``train_mini_batch``: 2-row micro-batches
                                                        accumulated in one jitted scan)

Memory: XLA's analysis of the compiled step (:func:`rljax.train.memory.compiled_memory`):
``temp`` = activations, gradients and workspace; ``step`` = arguments + outputs - donated + temp.
Deterministic and exact for what XLA allocates (CPU included); on a GPU the allocator's peak
(``memory/peak_bytes``) is printed too. Speed: tokens/s of one timed step after the compile.

Goals: (c) at 16k within 1.3x of (c) at 2k (memory bounded by the budget, not the mini-batch), and
(b) growing linearly in tokens (no ``[T, T]`` array anywhere: temp(16k) / temp(2k) <= 8 x 1.15).

    python benchmarks/memory_bench.py          # ~3-5 min on 2 CPU cores
    python benchmarks/memory_bench.py --quick  # 1k-4k tokens, a smaller model
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from rljax.core.objective import ObjectiveConfig
from rljax.data.micro_batch import split_by_token_budget
from rljax.data.pack import pack
from rljax.models import Decoder, ModelConfig, num_params
from rljax.train.memory import compiled_memory, device_peak_bytes
from rljax.train.optim import OptimizerConfig
from rljax.train.step import TrainConfig, TrainState, mini_batch_counts, train_mini_batch, train_step
from rljax.types import Step

MODEL = ModelConfig(
    model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
    num_heads=8, num_kv_heads=4, head_dim=64, qk_norm=True, tie_word_embeddings=True,
    max_position_embeddings=4096,
)  # fmt: skip
QUICK = ModelConfig(
    model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, tie_word_embeddings=True,
    max_position_embeddings=4096,
)  # fmt: skip
SEQ_LEN = 1024
BUDGET = 2048
BOUNDED_GOAL, LINEAR_SLACK = 1.3, 1.15


def _batch(cfg: ModelConfig, tokens: int, seed: int = 0):
    """``tokens / SEQ_LEN`` rows, each packed with 4 samples of 256 tokens (prompt 64)."""
    rng = np.random.default_rng(seed)
    steps = [
        Step(rng.integers(1, cfg.vocab_size, 64).tolist(), rng.integers(1, cfg.vocab_size, 192).tolist(),
             (f"q{i}", 0), response_logprobs=(-rng.random(192)).tolist())
        for i in range(tokens // 256)
    ]  # fmt: skip
    adv = [rng.normal(size=192).astype(np.float32) for _ in steps]
    return pack(steps, seq_len=SEQ_LEN, advantages=adv, row_buckets=[tokens // SEQ_LEN]).batch


def _measure(cfg: ModelConfig, tokens: int, kind: str) -> dict[str, float]:
    remat = "none" if kind == "a" else "full"
    model = Decoder(cfg, rngs=nnx.Rngs(0), remat=remat)
    config = TrainConfig(
        objective=ObjectiveConfig(), optimizer=OptimizerConfig(learning_rate=1e-5), chunk_size=1024
    )
    state = TrainState.create(model, config)
    batch = _batch(cfg, tokens)
    counts = mini_batch_counts(batch, config.objective)
    if kind == "c":
        batch, fn = split_by_token_budget(batch, micro_batch_tokens=BUDGET), train_mini_batch
    else:
        fn = train_step
    mem = compiled_memory(fn, state, batch, counts)
    state, m = fn(state, batch, counts)  # compile + first run
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    state, m = fn(state, batch, counts)
    jax.block_until_ready(m)
    seconds = time.perf_counter() - t0
    out = dict(mem, tokens_per_s=tokens / seconds, loss=float(m["loss"]))
    peak = device_peak_bytes()
    if peak is not None:
        out["peak_bytes"] = peak
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cfg = QUICK if args.quick else MODEL
    sizes = (1024, 2048, 4096) if args.quick else (2048, 4096, 8192, 16384)
    params = num_params(Decoder(cfg, rngs=nnx.Rngs(0)))
    print(f"model: {params / 1e6:.1f}M params ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}), float32, rows of {SEQ_LEN}; "
          f"device {jax.devices()[0].device_kind}")  # fmt: skip
    names = {"a": "(a) no remat", "b": "(b) remat", "c": f"(c) remat + micro {BUDGET}"}
    results: dict[tuple[str, int], dict[str, float]] = {}
    print(f"{'config':24} {'tokens':>7} {'temp MiB':>10} {'step MiB':>10} {'tokens/s':>10}   loss")
    for kind in ("a", "b", "c"):
        for tokens in sizes:
            r = results[kind, tokens] = _measure(cfg, tokens, kind)
            extra = f"  peak {r['peak_bytes'] / 2**20:.0f} MiB" if "peak_bytes" in r else ""
            mib = f"{r['step_temp_bytes'] / 2**20:10.1f} {r['step_bytes'] / 2**20:10.1f}"
            print(f"{names[kind]:24} {tokens:7d} {mib} {r['tokens_per_s']:10,.0f}   {r['loss']:+.4f}{extra}")
    lo, hi = BUDGET, sizes[-1]  # (c) is bounded from the budget on; below it there is one micro-batch
    for tokens in sizes:  # the same batch, the same loss, whatever the memory strategy
        losses = [results[k, tokens]["loss"] for k in "abc"]
        assert np.allclose(losses, losses[0], rtol=1e-4, atol=1e-6), (tokens, losses)
    bounded = results["c", hi]["step_temp_bytes"] / results["c", lo]["step_temp_bytes"]
    linear = results["b", hi]["step_temp_bytes"] / results["b", sizes[0]]["step_temp_bytes"]
    growth = hi // sizes[0]
    whole = results["a", hi]["step_temp_bytes"] / results["c", hi]["step_temp_bytes"]
    print(f"(c) temp at {hi} / at {lo} tokens: {bounded:.2f}x (goal <= {BOUNDED_GOAL}x: "
          f"{'met' if bounded <= BOUNDED_GOAL else 'NOT met'})")  # fmt: skip
    verdict = "met" if linear <= growth * LINEAR_SLACK else "NOT met"
    print(f"(b) temp at {hi} / at {sizes[0]} tokens: {linear:.2f}x for {growth}x the tokens "
          f"(linear goal <= {growth * LINEAR_SLACK:.1f}x: {verdict})")
    speed = {k: results[k, hi]["tokens_per_s"] / results["a", hi]["tokens_per_s"] for k in "bc"}
    print(f"(a) / (c) temp at {hi} tokens: {whole:.1f}x; tokens/s at {hi} relative to (a): "
          f"(b) {speed['b']:.2f}x, (c) {speed['c']:.2f}x")


if __name__ == "__main__":
    main()
