"""What one RL train step computes, how long it takes and how much memory it needs, side by side.

For a recipe (``smollm2_cpu``: SmolLM2-135M-Instruct, 8 prompts x 8 samples of single-turn
arithmetic; ``default``: the tiny multi-turn ``lookup`` recipe, 16 prompts x 8 samples), the train
step runs on the recipe's own prepared samples, once per variant of the trainer:

* ``every token``: ``trainer.loss_only_logits=False`` and ``trainer.prefix_sharing="off"``: plain
  rows, every packed token goes through the LM head;
* ``loss-only logits``: only the tokens that carry a loss (``loss_mask != 0``) do, in a bucketed
  buffer (:func:`rljax.models.logprobs.sequence_forward`'s ``logit_mask``), plain rows;
* ``loss-only + prefix tree``: the defaults: loss-only logits on prefix-tree rows
  (``trainer.prefix_sharing="auto"``, design §2.6: a group's shared prompt computed once);
* any ``--variant NAME=KEY=VALUE,...`` of config overrides (e.g. ``model.remat=full`` or
  ``trainer.micro_batch_tokens=1024``). A variant that changes how samples are packed needs nothing
  more: each variant packs the samples itself, from its own config (:func:`pack_mini_batches`).

The samples come from the recipe itself: ``--capture`` runs its first ``--capture-steps`` RL steps
(rollouts with the embedded sampler; the ``default`` recipe's warm start first) and pickles what
each step's trainer handed to the packer: the prepared samples and their per-step streams. Every
variant then packs and trains on exactly these samples.

``--synthetic=SHAPE`` trains on GRPO groups of random tokens instead, with a fresh model of a named
shape (random weights; ``qwen3-0.6b``: Qwen/Qwen3-0.6B's config.json shapes, bfloat16 compute, full
remat; ``tiny``: a 2-layer model for a quick check): ``--prompts`` groups of ``--group`` samples,
each a shared ``--prompt-tokens`` prompt and its own ``--completion-tokens`` completion (all with a
loss), rows of ``--seq-len`` tokens (default: room for one group's prefix tree), one row per
micro-batch. The file it writes (``--samples``) carries the shape's config overrides with the samples.
On a GPU the table adds the device's peak memory (``memory_stats()['peak_bytes_in_use']``).

Each variant runs in a process of its own (``--child``), so its peak resident memory is its own;
the variants take turns (A B A B ...) ``--repeats`` times, so a machine whose speed drifts affects
them alike. A child builds the run's model and train state (:class:`rljax.run.run.Run`, no engines),
trains once on every captured mini-batch (compilation), then times ``--steps`` rounds over all of
them with :meth:`rljax.run.run.Run.train` (the trainer's own call). Reported per variant (median
over repeats, min-max): tokens the decoder computes (packed positions, padding included), rows the
LM head computes (per optimizer step), train-step seconds (median per mini-batch) and its CPU
seconds (the process's user + system time: on a machine other work loads, the steadier figure of
the two), the first round (compilation) seconds, XLA's compiled memory of the step
(``memory/step_bytes``: arguments + outputs - donated + temporaries) and the child process's peak
RSS.

Usage::

    bash .ci/install_smollm2.sh     # smollm2_cpu only
    python benchmarks/train_tokens_bench.py --recipe=smollm2_cpu --capture=/tmp/smollm2_samples.pkl
    python benchmarks/train_tokens_bench.py --recipe=smollm2_cpu --samples=/tmp/smollm2_samples.pkl
    python benchmarks/train_tokens_bench.py --recipe=default --capture=/tmp/lookup.pkl --capture-steps=1
    python benchmarks/train_tokens_bench.py --synthetic=qwen3-0.6b --samples=/tmp/q4k.pkl \
        --prompt-tokens=1024 --completion-tokens=384 --group=8 --prompts=4     # rows of 4,096
    python benchmarks/train_tokens_bench.py --synthetic=qwen3-0.6b --samples=/tmp/q16k.pkl \
        --prompt-tokens=4096 --completion-tokens=1536 --group=8 --prompts=2    # rows of 16,384
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

#: The built-in variants: name -> config overrides (dotted keys).
VARIANTS: dict[str, dict[str, Any]] = {
    "every token": {"trainer.loss_only_logits": False, "trainer.prefix_sharing": "off"},
    "loss-only logits": {"trainer.loss_only_logits": True, "trainer.prefix_sharing": "off"},
    "loss-only + prefix tree": {"trainer.loss_only_logits": True, "trainer.prefix_sharing": "auto"},
}


def recipe_config(recipe: str, overrides: dict[str, Any]) -> Any:
    """The recipe's ConfigDict with dotted-key ``overrides`` applied."""
    import importlib

    config = importlib.import_module(f"rljax.recipes.{recipe}").get_config()
    for key, value in overrides.items():
        node, *path = key.split(".")
        target = config[node]
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
    return config


def parse_value(text: str) -> Any:
    """``true`` / ``false`` / ints / floats / anything else as a string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# ------------------------------------------------------------------------------------------------
# Capture: the prepared samples of the recipe's first RL steps
# ------------------------------------------------------------------------------------------------


class _Captured(Exception):
    """Raised once the last wanted step's samples are recorded (its training is not needed)."""


def capture(recipe: str, path: str, steps: int) -> None:
    """Runs the recipe's first ``steps`` RL steps and pickles each step's packer input (the last
    step stops at its packer: its rollouts are all that is needed)."""
    import rljax.run.trainer as trainer_module

    captured: list[dict[str, Any]] = []
    pack = trainer_module.make_mini_batches

    def recording(samples: Sequence[Any], **kwargs: Any) -> Iterator[Any]:
        streams = {k: v for k, v in kwargs.items() if k not in PACKING_KEYS}
        captured.append({"samples": list(samples), "streams": streams,
                         "mini_batch_prompts": kwargs["mini_batch_prompts"]})  # fmt: skip
        if len(captured) == steps:
            raise _Captured
        return pack(samples, **kwargs)

    trainer_module.make_mini_batches = recording
    overrides = {"trainer.num_steps": steps, "trainer.eval_every": 0, "trainer.checkpoint_every": 0}
    with tempfile.TemporaryDirectory(prefix="train_tokens_capture_") as workdir:
        try:
            trainer_module.Trainer(recipe_config(recipe, overrides), workdir).run()
        except _Captured:
            pass
    with open(path, "wb") as f:
        pickle.dump({"recipe": recipe, "steps": captured}, f)
    print(f"captured {len(captured)} step(s) of {recipe} -> {path}", flush=True)


#: Keyword arguments of ``make_mini_batches`` that are packing options (the rest are streams).
PACKING_KEYS = (
    "mini_batch_prompts", "seq_len", "row_buckets", "data_parallel", "truncate", "shuffle_seed",
    "prefix_sharing",
)  # fmt: skip


def pack_mini_batches(run: Any, captured: dict[str, Any]) -> list[Any]:
    """The packed mini-batches of one captured step, packed with ``run``'s own config (the trainer's
    call of :func:`rljax.data.pack.make_mini_batches`; a packing variant's options apply here)."""
    from rljax.data.pack import make_mini_batches

    t = run.cfg.trainer
    return [
        mb.batch
        for mb in make_mini_batches(
            captured["samples"],
            mini_batch_prompts=captured["mini_batch_prompts"],
            seq_len=t.seq_len,
            row_buckets=t.row_buckets,
            data_parallel=run.data_parallel,
            truncate=t.truncate,
            shuffle_seed=0,
            prefix_sharing=run.prefix_sharing,
            **captured["streams"],
        )
    ]


# ------------------------------------------------------------------------------------------------
# Synthetic: GRPO groups of random tokens for a fresh model of a named shape
# ------------------------------------------------------------------------------------------------

#: Named model shapes (their ``model.init`` fields, or :func:`model_init`'s) and the settings they
#: train with.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "model.init": dict(
            model_type="qwen3",
            vocab_size=4096,
            hidden_size=128,
            intermediate_size=384,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            qk_norm=True,
            tie_word_embeddings=True,
        ),  # fmt: skip
    },
    # Qwen/Qwen3-0.6B's config.json (random weights): train_step_bench's ModelConfig of that name
    "qwen3-0.6b": {
        "model.compute_dtype": "bfloat16",
        "model.remat": "full",
    },
}


def model_init(shape: str) -> dict[str, Any]:
    """``model.init`` of a named shape: its own, else every field of ``benchmarks/train_step_bench.py``'s
    ModelConfig of that name (the benchmarks are scripts, not a package: loaded from its file)."""
    if "model.init" in SHAPES[shape]:
        return SHAPES[shape]["model.init"]
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_step_bench.py")
    spec = importlib.util.spec_from_file_location("_bench_train_step_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    from rljax.run.config import RUN_SET_FIELDS

    config = module.CONFIGS[shape]
    not_keys = RUN_SET_FIELDS[type(config)]  # e.g. extra_json: read from a checkpoint, not a config key
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in not_keys}


def group_tree_tokens(prompt_tokens: int, completion_tokens: int, group: int) -> int:
    """Tokens of one group laid out as a prefix tree: the prompt once, every completion."""
    return prompt_tokens + group * completion_tokens


def synthesize(
    shape: str, path: str, *, prompt_tokens: int, completion_tokens: int, group: int, prompts: int,
    seq_len: int = 0, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Writes ``prompts`` GRPO groups of random tokens to ``path`` (the format ``--capture`` writes,
    plus ``overrides``: the shape's config, rows of ``seq_len`` (0: one group's prefix tree rounded
    up to a multiple of 1,024) and one row per micro-batch); returns what it wrote."""
    from rljax.types import Step

    rng = np.random.default_rng(seed)
    init = model_init(shape)
    vocab = init["vocab_size"]
    seq_len = seq_len or -(-group_tree_tokens(prompt_tokens, completion_tokens, group) // 1024) * 1024
    if prompt_tokens + completion_tokens > seq_len:
        raise ValueError(f"a sample of {prompt_tokens + completion_tokens} tokens exceeds rows of {seq_len}")
    uniform = np.float32(-np.log(vocab))  # a random model's logprob of any token: ratios near 1
    samples, advantages = [], []
    for p in range(prompts):
        prompt = rng.integers(1, vocab, prompt_tokens).tolist()
        rewards = rng.integers(0, 2, group).astype(np.float32)
        scaled = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for r in range(group):
            samples.append(Step(
                prompt, rng.integers(1, vocab, completion_tokens).tolist(), (f"p{p}", r),
                response_logprobs=np.full(completion_tokens, uniform).tolist(),
                reward=float(rewards[r]), is_last_step=True,
            ))  # fmt: skip
            advantages.append(np.full(completion_tokens, scaled[r], np.float32))
    overrides = {
        **{f"model.init.{k}": v for k, v in init.items()},
        **{k: v for k, v in SHAPES[shape].items() if k != "model.init"},
        "model.hf_path": "",
        "trainer.seq_len": seq_len,
        "trainer.micro_batch_tokens": seq_len,
        "trainer.row_buckets": None,
    }
    captured = {
        "recipe": "default",
        "overrides": overrides,
        "steps": [{"samples": samples, "streams": {"advantages": advantages}, "mini_batch_prompts": prompts}],
    }
    with open(path, "wb") as f:
        pickle.dump(captured, f)
    print(f"synthesized {prompts} group(s) of {group} x ({prompt_tokens} + {completion_tokens}) tokens, "
          f"{shape} shapes, rows of {seq_len} -> {path}", flush=True)  # fmt: skip
    return captured


# ------------------------------------------------------------------------------------------------
# A child: one variant's train steps
# ------------------------------------------------------------------------------------------------


def lm_head_rows(run: Any, batch: Any) -> int:
    """Rows the LM head computes for ``batch`` in one optimizer step of ``run`` (as
    :meth:`rljax.run.run.Run.train` splits it into micro-batches)."""
    from rljax.data.micro_batch import micro_batch_rows, split_by_token_budget
    from rljax.training.step import row_groups, with_logit_capacity

    rows, length = batch.tokens.shape
    budget = run.cfg.trainer.micro_batch_tokens
    if (
        budget
        and micro_batch_rows(seq_len=length, micro_batch_tokens=budget, data_parallel=run.data_parallel)
        < rows
    ):
        batch = split_by_token_budget(batch, micro_batch_tokens=budget, data_parallel=run.data_parallel)
    micro, micro_rows = np.shape(batch.tokens)[:-2], np.shape(batch.tokens)[-2]
    if not run.state.config.loss_only_logits:
        return int(np.prod(micro, dtype=int)) * micro_rows * (length - 1)
    capacity = with_logit_capacity(run.state, batch).config.logit_capacity
    return int(np.prod(micro, dtype=int)) * capacity * row_groups(run.state, micro_rows)


def child(recipe: str, samples_path: str, overrides: dict[str, Any], steps: int) -> dict[str, Any]:
    import jax

    from rljax.run.run import Run

    with open(samples_path, "rb") as f:
        captured = pickle.load(f)
    config = recipe_config(recipe, {**captured.get("overrides", {}), **overrides, "warmstart.num_steps": 0})
    with tempfile.TemporaryDirectory(prefix="train_tokens_child_") as workdir:
        run = Run(config, pathlib.Path(workdir), rollouts=False)
        algorithm = run.algorithms.default.name
        batches = [b for step in captured["steps"] for b in pack_mini_batches(run, step)]
        start = time.perf_counter()
        rows = [run.train(b, algorithm=algorithm) for b in batches]
        first_s = time.perf_counter() - start
        times, cpu = [], []
        for _ in range(steps):
            for b in batches:
                t0, c0 = time.perf_counter(), time.process_time()
                run.train(b, algorithm=algorithm)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        run.state = dataclasses.replace(run.state, config=run.train_configs[algorithm])
        head = [lm_head_rows(run, b) for b in batches]
    return {
        "batches": len(batches),
        "shapes": sorted({tuple(b.tokens.shape) for b in batches}),
        "decoder_tokens": float(np.mean([b.tokens.size for b in batches])),
        "real_tokens": float(np.mean([np.count_nonzero(b.segment_ids) for b in batches])),
        "loss_tokens": float(np.mean([np.count_nonzero(b.loss_mask) for b in batches])),
        "lm_head_rows": float(np.mean(head)),
        "step_s": float(np.median(times)),
        "step_cpu_s": float(np.median(cpu)),
        "first_s": first_s,
        "step_bytes": max(r.get("memory/step_bytes", float("nan")) for r in rows),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
        "device_peak_bytes": float((jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)),
        "loss": float(rows[0]["loss"]),
        "devices": jax.device_count(),
    }


# ------------------------------------------------------------------------------------------------
# The parent: variants in turn, the table
# ------------------------------------------------------------------------------------------------


def run_child(args: argparse.Namespace, name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--recipe", args.recipe, "--samples", args.samples,
           "--steps", str(args.steps), "--child", json.dumps(overrides)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"variant {name!r} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    v = np.asarray(values) / scale
    text = fmt.format(float(np.median(v)))
    return text if len(v) == 1 else f"{text} ({fmt.format(v.min())}-{fmt.format(v.max())})"


def column_of(rows: list[dict[str, Any]], key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return spread([r[key] for r in rows], scale, fmt)


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    first = next(iter(results.values()))[0]
    print(
        f"\nmini-batches per round {first['batches']}, shapes {first['shapes']}; per mini-batch: "
        f"{first['real_tokens']:.0f} real tokens, {first['loss_tokens']:.0f} with a loss\n"
    )
    on_device = any(r["device_peak_bytes"] > 0 for rows in results.values() for r in rows)
    header = "| variant | decoder tokens | LM-head rows | step s | step CPU s | first round s | XLA step GiB "
    print(header + "| peak RSS GiB |" + (" device peak GiB |" if on_device else ""))
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if on_device else ""))
    base = next(iter(results.values()))
    for name, rows in results.items():
        column = functools.partial(column_of, rows)
        ratio = {
            k: np.median([r[k] for r in base]) / np.median([r[k] for r in rows])
            for k in ("step_s", "step_cpu_s")
        }
        cells = [
            name,
            f"{rows[0]['decoder_tokens']:.0f}",
            f"{rows[0]['lm_head_rows']:.0f}",
            f"{column('step_s')} ({ratio['step_s']:.2f}x)",
            f"{column('step_cpu_s')} ({ratio['step_cpu_s']:.2f}x)",
            column("first_s", fmt="{:.0f}"),
            column("step_bytes", 2**30),
            column("peak_rss_bytes", 2**30),
        ] + ([column("device_peak_bytes", 2**30)] if on_device else [])
        print("| " + " | ".join(cells) + " |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="smollm2_cpu", help="a recipe of rljax.recipes")
    p.add_argument("--samples", default=None, help="captured samples (pickle) to train on")
    p.add_argument("--capture", default=None, help="capture the recipe's samples into this file first")
    p.add_argument("--capture-steps", type=int, default=1, help="RL steps to capture")
    p.add_argument(
        "--variant", action="append", default=[], help="NAME=KEY=VALUE[,KEY=VALUE...] (repeatable)"
    )
    p.add_argument("--only", default=None, help="comma list of variant names to run (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the variants, in turn")
    p.add_argument("--steps", type=int, default=2, help="timed rounds over the mini-batches per child")
    p.add_argument("--synthetic", default=None, choices=sorted(SHAPES),
                   help="random GRPO groups, a fresh model of this shape; written to --samples")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=1024, help="--synthetic: shared prompt tokens")
    p.add_argument("--completion-tokens", type=int, default=384, help="--synthetic: tokens per completion")
    p.add_argument("--group", type=int, default=8, help="--synthetic: samples per prompt")
    p.add_argument("--prompts", type=int, default=4, help="--synthetic: prompt groups (one mini-batch)")
    p.add_argument("--seq-len", type=int, default=0, help="--synthetic: row length (0: one group's tree)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.recipe, args.samples, json.loads(args.child), args.steps)), flush=True)
        return 0
    if args.capture:
        capture(args.recipe, args.capture, args.capture_steps)
        args.samples = args.samples or args.capture
    if not args.samples:
        print("give --samples (a file written by --capture or --synthetic) or --capture", file=sys.stderr)
        return 2
    if args.synthetic:
        synthesize(args.synthetic, args.samples, prompt_tokens=args.prompt_tokens,
                   completion_tokens=args.completion_tokens, group=args.group, prompts=args.prompts,
                   seq_len=args.seq_len)  # fmt: skip
    with open(args.samples, "rb") as f:
        args.recipe = pickle.load(f).get("recipe", args.recipe)
    variants = dict(VARIANTS)
    for spec in args.variant:
        name, _, pairs = spec.partition("=")
        variants[name] = {k: parse_value(v) for k, v in (p.split("=", 1) for p in pairs.split(",") if p)}
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {os.cpu_count()} logical CPUs; "
          f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, overrides in variants.items():
            results[name].append(run_child(args, name, overrides))
            row = results[name][-1]
            rss = row["peak_rss_bytes"] / 2**30
            print(f"  round {r}: {name}: step {row['step_s']:.2f} s ({row['step_cpu_s']:.1f} CPU s), first "
                  f"round {row['first_s']:.0f} s, XLA {row['step_bytes'] / 2**30:.2f} GiB, peak RSS "
                  f"{rss:.2f} GiB, loss {row['loss']:+.5f}", flush=True)  # fmt: skip
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.repeats > 0:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
