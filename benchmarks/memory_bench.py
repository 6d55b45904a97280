"""Memory of one train step vs tokens per mini-batch: remat and micro-batching bound it.

One run, a ~30M-parameter Qwen3-shaped model (float32), rows of 1024 tokens, 2k / 4k / 8k / 16k tokens
per mini-batch, three configurations:

  (a) no remat, the whole mini-batch in one step      (``train_step``)
  (b) remat ("full"), the whole mini-batch             (``train_step``)
  (c) remat + ``micro_batch_tokens=2048``              (``train_mini_batch``: 2-row micro-batches
                                                        accumulated in one jitted scan)

Memory: XLA's analysis of the compiled step (:func:`rljax.training.memory.compiled_memory`):
``temp`` = activations, gradients and workspace; ``step`` = arguments + outputs - donated + temp.
Deterministic and exact for what XLA allocates (CPU included); on a GPU the allocator's peak
(``memory/peak_bytes``) is printed too. Speed: tokens/s of one timed step after the compile.

Goals: (c) at 16k within 1.3x of (c) at 2k (memory bounded by the budget, not the mini-batch), and
(b) growing linearly in tokens (no ``[T, T]`` array anywhere: temp(16k) / temp(2k) <= 8 x 1.15).

    python benchmarks/memory_bench.py          # ~3-5 min on 2 CPU cores
    python benchmarks/memory_bench.py --quick  # 1k-4k tokens, a smaller model

Long rows (``--long``): ONE packed row of 8k / 16k / 32k / 64k tokens (8 samples each),
remat "full", a small Qwen3-shaped model, at ``mesh.context`` 1 (one device) and 4 (4 of the fake
CPU devices, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``). Memory per device is XLA's
compiled analysis (the SPMD program of one device); the fit ``step_bytes = a + b T + c T^2`` gives
the linear slope ``b`` (bytes per token) and the quadratic term ``c`` (0 when nothing ``T x T``
exists). Goal: context=4 / context=1 per-device step memory <= 0.35x at 16k. Context 4 runs once
per attention collective of ``--context-attention`` (default both: ``all_gather`` and ``ring``,
``model.context_attention``). Step time is measured for the rows up to ``--time-up-to`` tokens (CPU
attention at 64k takes minutes; the 4 fake devices share this machine's cores, so a step's time is
the sum of the 4 devices' work).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory_bench.py --long
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
from rljax.training.memory import compiled_memory, device_peak_bytes
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_mini_batch, train_step
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


LONG = ModelConfig(
    model_type="qwen3", vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=64, qk_norm=True, tie_word_embeddings=True,
    max_position_embeddings=65536,
)  # fmt: skip
LONG_SIZES = (8192, 16384, 32768, 65536)
CONTEXT_GOAL = 0.35


def _long_row(cfg: ModelConfig, length: int, seed: int = 0):
    """One row of ``length`` tokens: 8 packed samples of ``length / 8`` (prompt 1/8 of each)."""
    rng = np.random.default_rng(seed)
    n = length // 8
    prompt = n // 8
    steps = [
        Step(rng.integers(1, cfg.vocab_size, prompt).tolist(),
             rng.integers(1, cfg.vocab_size, n - prompt).tolist(),
             (f"q{i}", 0), response_logprobs=(-rng.random(n - prompt)).tolist())
        for i in range(8)
    ]  # fmt: skip
    adv = [rng.normal(size=n - prompt).astype(np.float32) for _ in steps]
    return pack(steps, seq_len=length, advantages=adv, row_buckets=[1]).batch


def measure_long_row(
    cfg: ModelConfig, length: int, context: int, *, timed: bool, collective: str = "all_gather"
) -> dict[str, float]:
    """Compiled per-device memory (and, if ``timed``, seconds of one step) of a train step on one row;
    ``collective``: how attention crosses the context axis (``model.context_attention``)."""
    model = Decoder(cfg, rngs=nnx.Rngs(0), remat="full", context_attention=collective)
    config = TrainConfig(
        objective=ObjectiveConfig(), optimizer=OptimizerConfig(learning_rate=1e-5), chunk_size=1024
    )
    mesh = None if context == 1 else make_mesh(context=context, devices=jax.devices()[:context])
    state = TrainState.create(model, config, mesh=mesh)
    batch = _long_row(cfg, length)
    if mesh is not None:
        batch = shard_batch(batch, mesh)
    counts = mini_batch_counts(batch, config.objective)
    out = dict(compiled_memory(train_step, state, batch, counts))
    if timed:
        state, m = train_step(state, batch, counts)
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        state, m = train_step(state, batch, counts)
        jax.block_until_ready(m)
        out["seconds"] = time.perf_counter() - t0
        out["loss"] = float(m["loss"])
    return out


def fit_memory(lengths: list[int], step_bytes: list[float]) -> tuple[float, float, float]:
    """Least-squares ``bytes = a + b T + c T^2``: returns ``(a, b, c)``.

    >>> a, b, c = fit_memory([1, 2, 3, 4], [3 + 2 * t for t in (1, 2, 3, 4)])
    >>> [round(x, 6) + 0.0 for x in (a, b, c)]  # + 0.0 turns a rounded -0.0 into 0.0
    [3.0, 2.0, 0.0]
    """
    c, b, a = np.polyfit(np.asarray(lengths, float), np.asarray(step_bytes, float), 2)
    return float(a), float(b), float(c)


def long_rows(sizes: tuple[int, ...], time_up_to: int, collectives: tuple[str, ...]) -> None:
    """The ``--long`` table: per-device memory and step time at context 1 and at context 4 with each
    of ``collectives`` (all-gathered or ring-passed keys/values), the fit, the ratio."""
    if len(jax.devices()) < 4:
        raise SystemExit("--long needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    params = num_params(Decoder(LONG, rngs=nnx.Rngs(0)))
    print(f"long rows: {params / 1e6:.2f}M params ({LONG.num_layers} layers, hidden {LONG.hidden_size}, "
          f"{LONG.num_heads} heads / {LONG.num_kv_heads} kv), remat full, float32; "
          f"device {jax.devices()[0].device_kind}")  # fmt: skip
    print(f"{'context':>14} {'tokens':>7} {'temp MiB':>10} {'step MiB':>10} {'step s':>8}")
    runs = [(1, "all_gather")] + [(4, c) for c in collectives]
    label = {run: str(run[0]) if run[0] == 1 else f"4 {run[1]}" for run in runs}
    results: dict[tuple[tuple[int, str], int], dict[str, float]] = {}
    for run in runs:
        for length in sizes:
            r = results[run, length] = measure_long_row(
                LONG, length, run[0], timed=length <= time_up_to, collective=run[1]
            )
            secs = f"{r['seconds']:8.2f}" if "seconds" in r else f"{'-':>8}"
            print(f"{label[run]:>14} {length:7d} {r['step_temp_bytes'] / 2**20:10.1f} "
                  f"{r['step_bytes'] / 2**20:10.1f} {secs}", flush=True)  # fmt: skip
    for run in runs:
        ys = [results[run, n]["step_bytes"] for n in sizes]
        a, b, c = fit_memory(list(sizes), ys)
        share = c * sizes[-1] ** 2 / ys[-1]
        print(
            f"context={label[run]}: step_bytes ~ {a / 2**20:.1f} MiB + {b / 1024:.2f} KiB/token * T "
            f"+ {c:.3e} B/token^2 * T^2 (quadratic share at {sizes[-1]}: {share:.1%})"
        )
    for run in runs:
        both = [n for n in sizes if "seconds" in results[run, n]]
        if both:
            print(f"context={label[run]} step time: " + ", ".join(
                f"{n}: {results[run, n]['seconds']:.2f} s" for n in both))  # fmt: skip
    if 16384 in sizes:
        for run in runs[1:]:
            ratio = results[run, 16384]["step_bytes"] / results[runs[0], 16384]["step_bytes"]
            verdict = "met" if ratio <= CONTEXT_GOAL else "NOT met"
            print(
                f"per-device step memory at 16k, context={label[run]} / context=1: {ratio:.3f}x "
                f"(goal <= {CONTEXT_GOAL}x: {verdict})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--long", action="store_true", help="long rows at context 1 and 4")
    parser.add_argument("--time-up-to", type=int, default=8192, help="--long: time steps up to this length")
    parser.add_argument("--long-sizes", type=str, default=",".join(map(str, LONG_SIZES)))
    parser.add_argument(
        "--context-attention", type=str, default="all_gather,ring",
        help="--long: the context=4 collectives to measure (comma-separated: all_gather, ring)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.long:
        collectives = tuple(args.context_attention.split(","))
        long_rows(tuple(int(x) for x in args.long_sizes.split(",")), args.time_up_to, collectives)
        return
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
    print(
        f"(b) temp at {hi} / at {sizes[0]} tokens: {linear:.2f}x for {growth}x the tokens "
        f"(linear goal <= {growth * LINEAR_SLACK:.1f}x: {verdict})"
    )
    speed = {k: results[k, hi]["tokens_per_s"] / results["a", hi]["tokens_per_s"] for k in "bc"}
    print(
        f"(a) / (c) temp at {hi} tokens: {whole:.1f}x; tokens/s at {hi} relative to (a): "
        f"(b) {speed['b']:.2f}x, (c) {speed['c']:.2f}x"
    )


if __name__ == "__main__":
    main()
