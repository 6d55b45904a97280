"""Generation throughput: the embedded JAX sampler's tokens/s on a tiny model (vLLM hook included).

The model is the tiny Qwen3 the vLLM tests serve (hidden 128, 2 layers, 2 heads / 1 kv head,
head_dim 64, vocab 512, tied embeddings), random-initialized with a fixed seed, or any rljax /
HF checkpoint given with ``--model-dir``. ``--save-dir`` writes the random model as HF safetensors
so a vLLM server can load exactly the same weights.

Every engine is measured the same way by :func:`bench_engine`: ``num_prompts`` random prompts
(lengths uniform in ``[prompt_len/2, prompt_len]``) submitted concurrently through the
:class:`rljax.inference.engine.Engine` protocol with ``max_tokens`` new tokens each, no stop
tokens (every request generates exactly ``max_tokens``), temperature 1; one untimed warm-up
pass (jit compilation / server warm-up), then the best of ``--repeats`` timed passes.
tokens/s = generated tokens / wall seconds.

Plugging in vLLM: add a factory to :data:`ENGINE_FACTORIES` that returns an object with the
``Engine`` protocol (e.g. a ``VLLMClient`` attached to a server launched on ``--save-dir``) and
run with ``--engines embedded,vllm``; the script then prints the ratio of each engine to the
first one.

Usage: ``python benchmarks/generation_bench.py [--quick] [--engines embedded] [--save-dir DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from rljax.inference.engine import Engine, SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.models import Decoder, ModelConfig, from_pretrained, num_params, save_pretrained

TINY_QWEN3 = dict(
    model_type="qwen3",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)


async def _run(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, seed: int) -> int:
    outs = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(max_tokens=max_tokens, seed=seed + i), session_id=f"bench-{i}")
            for i, p in enumerate(prompts)
        )
    )
    return sum(len(o.ids) for o in outs)


def bench_engine(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, *, repeats: int = 3
) -> float:
    """Generated tokens per second of ``engine`` on ``prompts`` (best of ``repeats`` after a warm-up)."""
    asyncio.run(_run(engine, prompts, max_tokens, seed=0))  # warm-up: compilation, caches
    best = 0.0
    for r in range(repeats):
        start = time.perf_counter()
        tokens = asyncio.run(_run(engine, prompts, max_tokens, seed=1000 * (r + 1)))
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def make_model(model_dir: str | None, seed: int) -> Decoder:
    if model_dir:
        return from_pretrained(model_dir)
    return Decoder(ModelConfig(**TINY_QWEN3), rngs=nnx.Rngs(seed))


def make_embedded(model: Decoder, args: argparse.Namespace) -> Engine:
    return EmbeddedSampler(model, max_batch_size=args.num_prompts, batch_wait_ms=5.0, min_prompt_bucket=64)


def make_vllm(model: Decoder, args: argparse.Namespace) -> Engine:
    """Hook for the vLLM comparison (serve ``args.save_dir`` and return a client Engine)."""
    raise NotImplementedError(
        "the vLLM engine is not wired into this benchmark yet: return an rljax Engine serving "
        "--save-dir (same weights) from make_vllm in benchmarks/generation_bench.py"
    )


ENGINE_FACTORIES: dict[str, Callable[[Decoder, argparse.Namespace], Engine]] = {
    "embedded": make_embedded,
    "vllm": make_vllm,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    parser.add_argument("--engines", default="embedded", help=f"comma list of {sorted(ENGINE_FACTORIES)}")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model-dir", default=None, help="load this checkpoint instead of the random tiny Qwen3"
    )
    parser.add_argument("--save-dir", default=None, help="save the model here (HF safetensors) for vLLM")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.prompt_len, args.max_tokens, args.repeats = 16, 64, 32, 2

    model = make_model(args.model_dir, args.seed)
    if args.save_dir:
        save_pretrained(model, args.save_dir)
    cfg = model.config
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.prompt_len // 2, args.prompt_len + 1, size=args.num_prompts)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in lengths]
    print(
        f"model: {cfg.model_type} hidden={cfg.hidden_size} layers={cfg.num_layers} vocab={cfg.vocab_size} "
        f"params={num_params(model):,}; device: {jax.devices()[0].device_kind} x{jax.device_count()}"
    )
    print(
        f"workload: {args.num_prompts} concurrent prompts of {lengths.min()}-{lengths.max()} tokens, "
        f"{args.max_tokens} new tokens each, temperature 1, no stop tokens"
    )
    results: dict[str, float] = {}
    for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if name not in ENGINE_FACTORIES:
            parser.error(f"unknown engine {name!r}; choose from {sorted(ENGINE_FACTORIES)}")
        try:
            engine = ENGINE_FACTORIES[name](model, args)
        except NotImplementedError as e:
            print(f"  {name}: skipped ({e})")
            continue
        results[name] = bench_engine(engine, prompts, args.max_tokens, repeats=args.repeats)
        extra: dict[str, Any] = {}
        if isinstance(engine, EmbeddedSampler):
            extra["jit programs"] = engine.num_compilations()
        detail = ", ".join(f"{k} {v}" for k, v in extra.items())
        print(f"  {name}: {results[name]:,.0f} generated tokens/s" + (f" ({detail})" if detail else ""))
    if len(results) > 1:
        base_name, base = next(iter(results.items()))
        for name, value in results.items():
            print(f"  ratio {name}/{base_name}: {value / base:.3f}")
    elif "vllm" not in results:
        print("  ratio to vLLM: n/a (vLLM engine not measured; see make_vllm)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
