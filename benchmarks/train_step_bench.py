"""Train-step throughput and MFU: forward + backward + AdamW update of a random Qwen3-shaped model.

One run prints the model's parameter count, the step time and tokens/s of the jitted
:data:`rljax.training.step.train_step` (dppo objective on packed rows, per-token temperatures, chunked
logprobs), this machine's measured matmul peak, and the model FLOPs utilization with its ratio to
the goal (MFU >= 40 %); then (``--ppo``, default on) a PPO step on the same batches (critic values,
GAE, the policy step and the critic's own step) and its ratio to the grpo step (goal <= 2.2x).

Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B)::

    6 * N_matmul + 12 * n_layers * n_heads * head_dim * T

``N_matmul`` = parameters of every matmul, i.e. non-embedding parameters of the blocks (q, k, v, o,
gate, up, down; norms are negligible and excluded) PLUS the lm head ``hidden * vocab`` (counted
even when tied to the embedding: its matmul runs); ``T`` = the row length (the attention span the
implementation computes, as in PaLM; the strict figure counting only causal in-sample attention is
printed too). Recomputation (remat, the rematerialized logits chunks) is NOT model FLOPs; XLA's own
count of the compiled step (hardware FLOPs) is printed for comparison.

Peak: best of several ``jnp.dot`` of two ``n x n`` matrices (n = 2048 on CPU, 8192 on GPU) in the
compute dtype, measured in the same run before and after the timed steps: ``2 n^3 / t``. The MFU
verdict uses the best step time against that best peak (both best-case; on a shared machine the
median is also printed).

``--tunix`` instead compares the policy update with Google Tunix's (``benchmarks/tunix_peer.py`` under
the Tunix venv's python, made by ``.ci/install_tunix.sh``) on the same weights, the two taking turns
step by step (A, B, A, B, ...), and prints both tokens/s, the ratio rljax / Tunix and its verdict
against the goal (>= 1.5x). The workload (:func:`grpo_rows`) is what both sides train in a GRPO step:
``--rows`` (default 16) rows of ``--seq-len`` (default 512) tokens, each one prompt of a quarter of
the row (no loss) and one completion (the rest), no padding, one advantage per row, temperature 1.
rljax runs :data:`rljax.training.step.train_step` with the objective Tunix's ``grpo`` loss computes
(``ppo_clip``, eps 0.2, ``sequence_mean`` = Tunix's ``sequence-mean-token-mean``, rl component only,
no reference KL) and AdamW (lr 1e-6, weight decay 0.01, clip at global norm 1); Tunix runs the jitted
step of its RL ``Trainer`` with the loss its ``GRPOLearner`` installs (``beta=0``, ``num_iterations=1``)
and ``optax.chain(clip_by_global_norm(1), adamw(1e-6, weight_decay=0.01))``. What differs: rljax
computes the logprobs of every token in chunks (and the entropy, as a metric) and skips the
update if the loss or a gradient is not finite; Tunix computes the full ``[rows, tokens, vocab]``
logits and the logprobs of the completion tokens only, and reports more loss metrics.

Usage::

    python benchmarks/train_step_bench.py [--quick]                 # ~30M model, rows of 1024 tokens
    python benchmarks/train_step_bench.py --tunix                   # rljax vs Google Tunix, 16 x 512
    python benchmarks/train_step_bench.py --config qwen3-0.6b --seq-len 16384   # on a GPU

Defaults: compute dtype float32 on CPU and bfloat16 (float32 master weights) on GPU/TPU; remat off
for the small model and on for qwen3-0.6b.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.core.objective import ObjectiveConfig
from rljax.models import Decoder, ModelConfig, num_params
from rljax.models.attention import causal_block_size
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step
from rljax.types import PackedBatch

MFU_GOAL = 0.40
TUNIX_GOAL = 1.5  # trained tokens/s of the policy update, rljax / Tunix

CONFIGS: dict[str, ModelConfig] = {
    # ~29M parameters (25M non-embedding), Qwen3 layout (q/k norm, GQA 2:1, tied embeddings).
    "small": ModelConfig(
        model_type="qwen3",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    # Qwen/Qwen3-0.6B config.json shapes (random weights).
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
    ),
}


@dataclasses.dataclass(frozen=True)
class FlopCount:
    matmul_params: int
    per_token: float
    per_token_strict: float


def model_flops(cfg: ModelConfig, seq_len: int, mean_causal_span: float) -> FlopCount:
    """Model FLOPs per trained token (formula in the module docstring)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    matmul = cfg.num_layers * per_layer + h * cfg.vocab_size
    attention = 12 * cfg.num_layers * q
    return FlopCount(matmul, 6 * matmul + attention * seq_len, 6 * matmul + attention * mean_causal_span)


def random_packed_batch(rng: np.random.Generator, rows: int, seq_len: int, vocab: int) -> PackedBatch:
    """Rows filled completely by 1-4 samples each (prompt ~1/4 of a sample, masked; the rest trained)."""
    arrays: dict[str, np.ndarray] = {
        k: np.zeros((rows, seq_len), np.int32)
        for k in ("tokens", "positions", "segment_ids", "sample_index", "group_index")
    }
    for k in ("loss_mask", "advantages", "inference_logprobs", "temperatures", "rl_weights"):
        arrays[k] = np.zeros((rows, seq_len), np.float32)
    arrays["tokens"] = rng.integers(0, vocab, (rows, seq_len)).astype(np.int32)
    sample = 0
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(seq_len // 8, seq_len), rng.integers(0, 4), replace=False))
        bounds = [0, *cuts.tolist(), seq_len]
        for seg, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
            prompt = max(1, (b - a) // 4)
            arrays["positions"][r, a:b] = np.arange(b - a)
            arrays["segment_ids"][r, a:b] = seg
            arrays["sample_index"][r, a:b] = sample
            arrays["group_index"][r, a:b] = sample // 4
            arrays["loss_mask"][r, a + prompt : b] = 1.0
            arrays["advantages"][r, a + prompt : b] = rng.normal()
            arrays["temperatures"][r, a:b] = rng.choice([0.7, 1.0])
            sample += 1
    arrays["inference_logprobs"] = np.where(
        arrays["loss_mask"] > 0, np.log(rng.uniform(1e-5, 1e-3, (rows, seq_len))), 0.0
    ).astype(np.float32)
    arrays["rl_weights"] = arrays["loss_mask"].copy()
    return PackedBatch(old_logprobs=None, ref_logprobs=None, ce_weights=None, ref_kl_weights=None, **arrays)


def mean_causal_span(batch: PackedBatch) -> float:
    """Mean over tokens of (position + 1): the in-sample causal attention span actually needed."""
    return float(np.mean(np.asarray(batch.positions) + 1))


def matmul_peak(n: int, dtype: Any, repeats: int = 5) -> float:
    """Best-of-``repeats`` FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` on the default device."""
    keys = jax.random.split(jax.random.key(0))
    a = jax.random.normal(keys[0], (n, n), dtype)
    b = jax.random.normal(keys[1], (n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dtype))
    f(a, b).block_until_ready()
    best = min(_timed(lambda: f(a, b).block_until_ready()) for _ in range(repeats))
    return 2.0 * n**3 / best


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--seq-len", type=int, default=None, help="row length (default 1024; --quick 512)")
    p.add_argument("--rows", type=int, default=None, help="rows per step (default: 2 CPU, 8 GPU, 1 quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 3; --quick 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--chunk-size", type=int, default=None, help="logits chunk in tokens (default: tokens/4)")
    p.add_argument(
        "--attention-chunk",
        type=int,
        default=None,
        help="queries per attention block (Decoder attention_chunk_size; default: the model's default)",
    )
    p.add_argument("--mesh", default=None, help="data,fsdp,tensor sizes over all devices, e.g. 1,8,1")
    p.add_argument("--quick", action="store_true", help="smaller rows and fewer steps (CI smoke run)")
    p.add_argument(
        "--ppo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time a PPO step (critic + GAE) on the same batches and print ppo/grpo",
    )
    p.add_argument(
        "--tunix",
        action="store_true",
        help="compare the GRPO policy update with Google Tunix's instead (interleaved; goal >= 1.5x)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.tunix:
        compare_tunix(args)
        return
    platform = jax.default_backend()
    on_accelerator = platform != "cpu"
    cfg = CONFIGS[args.config]
    seq_len = args.seq_len or (512 if args.quick else 1024)
    rows = args.rows or (1 if args.quick else (8 if on_accelerator and args.config == "small" else 2))
    if args.config == "qwen3-0.6b" and args.rows is None:
        rows = 1
    steps = args.steps or (2 if args.quick else 3)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_accelerator else "float32"))
    remat = args.remat if args.remat is not None else args.config != "small"
    chunk = args.chunk_size or max(256, min(8192, rows * seq_len // 4))
    mesh = None
    if args.mesh:
        data, fsdp, tensor = (int(x) for x in args.mesh.split(","))
        mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)

    device = jax.devices()[0].device_kind
    print(f"device: {device} x {jax.device_count()} ({platform}); jax {jax.__version__}")
    extra = {} if args.attention_chunk is None else {"attention_chunk_size": args.attention_chunk}
    model = Decoder(cfg, dtype=dtype, param_dtype=jnp.float32, remat=remat, rngs=nnx.Rngs(0), **extra)
    total = num_params(model)
    embed = cfg.vocab_size * cfg.hidden_size
    flops = model_flops(cfg, seq_len, 0.0)
    print(
        f"model: {args.config} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
        f"{cfg.num_kv_heads}x{cfg.head_dim}, mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}); params "
        f"{total / 1e6:.2f}M total, {(total - embed) / 1e6:.2f}M non-embedding, "
        f"matmul {flops.matmul_params / 1e6:.2f}M"
    )
    print(f"step: {rows} rows x {seq_len} tokens, compute {dtype.name}, params float32, remat {remat}, "
          f"logits chunk {chunk}, attention query blocks of "
          f"{causal_block_size(seq_len, max_block_size=getattr(model, 'attention_chunk_size', None))} "
          f"(cap {getattr(model, 'attention_chunk_size', None)}), "
          f"mesh {dict(mesh.shape) if mesh else 'single device'}")  # fmt: skip

    config = TrainConfig(
        objective=ObjectiveConfig(),  # dppo, token_mean
        optimizer=OptimizerConfig(learning_rate=1e-6, weight_decay=0.01, max_grad_norm=1.0),
        chunk_size=chunk,
    )
    state = TrainState.create(model, config, mesh=mesh)
    del model
    rng = np.random.default_rng(0)
    batches = [random_packed_batch(rng, rows, seq_len, cfg.vocab_size) for _ in range(2)]
    if mesh is not None:
        batches = [shard_batch(b, mesh) for b in batches]
    counts = [mini_batch_counts(b, config.objective) for b in batches]
    flops = model_flops(cfg, seq_len, mean_causal_span(batches[0]))

    t0 = time.perf_counter()
    compiled = train_step.lower(state, batches[0], counts[0]).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float((cost or {}).get("flops", float("nan")))
    print(f"compile: {compile_s:.1f} s")

    peak_n = 8192 if on_accelerator else 2048
    scale = jax.device_count() if mesh is not None else 1
    peaks = [matmul_peak(peak_n, dtype) * scale]
    state, metrics = train_step(state, batches[0], counts[0])  # warm-up (runs the compiled step)
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = train_step(state, batches[i % 2], counts[i % 2])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
        print(f"  step {i}: {times[-1]:.3f} s  loss {loss:+.4f}  grad_norm {norm:.3f}  "
              f"skipped {int(metrics['skipped_updates'])}")  # fmt: skip
    peaks.append(matmul_peak(peak_n, dtype) * scale)
    peak = max(peaks)  # best case of the machine, measured before and after the steps
    tokens = rows * seq_len
    best_s, median_s = min(times), float(np.median(times))
    span = mean_causal_span(batches[0])
    print(f"throughput: {tokens / best_s:,.0f} tokens/s best step ({best_s:.3f} s); "
          f"{tokens / median_s:,.0f} tokens/s median ({median_s:.3f} s)")  # fmt: skip
    print(f"model FLOPs/token: {_si(flops.per_token, 'FLOP')} = 6 x {flops.matmul_params / 1e6:.2f}M + "
          f"12 x {cfg.num_layers} x {cfg.num_heads} x {cfg.head_dim} x {seq_len}; "
          f"strict (in-sample causal span {span:.0f}): {_si(flops.per_token_strict, 'FLOP')}")  # fmt: skip
    hw = xla_flops / tokens
    print(f"XLA cost-analysis FLOPs/token of the compiled step: {_si(hw, 'FLOP')} "
          f"(x{hw / flops.per_token:.2f} model FLOPs; loop bodies counted once)")  # fmt: skip
    print(f"peak ({peak_n}^3 {dtype.name} matmul x {scale} device(s), best of 2 x 5): {_si(peak, 'FLOP/s')} "
          f"(before {_si(peaks[0], 'FLOP/s')}, after {_si(peaks[1], 'FLOP/s')})")  # fmt: skip
    mfu = flops.per_token * tokens / best_s / peak
    mfu_median = flops.per_token * tokens / median_s / peak
    strict = flops.per_token_strict * tokens / best_s / peak
    print(f"achieved: {_si(flops.per_token * tokens / best_s, 'FLOP/s')} (best step)")
    verdict = "PASS" if mfu >= MFU_GOAL else "FAIL"
    print(f"MFU: {100 * mfu:.1f} % best step (median {100 * mfu_median:.1f} %, strict {100 * strict:.1f} %)"
          f"  goal >= {100 * MFU_GOAL:.0f} %, ratio MFU/goal {mfu / MFU_GOAL:.3f}  {verdict}")  # fmt: skip
    if args.ppo:
        ppo_vs_grpo(state, batches, counts, best_s, steps=steps, mesh=mesh)


def grpo_rows(rng: np.random.Generator, rows: int, prompt_len: int, completion_len: int, vocab: int
              ) -> tuple[PackedBatch, dict[str, np.ndarray]]:  # fmt: skip
    """One GRPO sample per row: ``prompt_len`` prompt tokens (no loss) then ``completion_len`` trained
    tokens, one advantage per row (groups of 4 rows), temperature 1; also the same data as arrays."""
    seq_len = prompt_len + completion_len
    prompt = rng.integers(0, vocab, (rows, prompt_len)).astype(np.int32)
    completion = rng.integers(0, vocab, (rows, completion_len)).astype(np.int32)
    advantages = rng.normal(size=rows).astype(np.float32)
    trained = np.zeros((rows, seq_len), np.float32)
    trained[:, prompt_len:] = 1.0
    logprobs = np.where(trained > 0, np.log(rng.uniform(1e-5, 1e-3, (rows, seq_len))), 0.0).astype(np.float32)
    batch = PackedBatch(
        tokens=np.concatenate([prompt, completion], axis=1),
        positions=np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy(),
        segment_ids=np.ones((rows, seq_len), np.int32),
        sample_index=np.repeat(np.arange(rows, dtype=np.int32)[:, None], seq_len, axis=1),
        group_index=np.repeat((np.arange(rows, dtype=np.int32) // 4)[:, None], seq_len, axis=1),
        loss_mask=trained,
        advantages=trained * advantages[:, None],
        inference_logprobs=logprobs,
        temperatures=np.ones((rows, seq_len), np.float32),
        rl_weights=trained.copy(),
        old_logprobs=None,
        ref_logprobs=None,
        ce_weights=None,
        ref_kl_weights=None,
    )
    return batch, {"prompt": prompt, "completion": completion, "advantages": advantages}


def _tunix_peer_module() -> Any:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_peer.py")
    spec = importlib.util.spec_from_file_location("_bench_tunix_peer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def compare_tunix(args: argparse.Namespace) -> None:
    """rljax's train step vs Tunix's GRPO trainer step on the same weights and rows, interleaved."""
    from rljax.models import save_pretrained, sequence_logprobs

    peer_lib = _tunix_peer_module()
    cfg = CONFIGS[args.config]
    rows, seq_len = args.rows or 16, args.seq_len or 512
    prompt_len = seq_len // 4
    steps = args.steps or 3
    dtype = jnp.dtype(args.dtype or "float32")
    remat = args.remat if args.remat is not None else args.config != "small"
    chunk = args.chunk_size or max(256, min(8192, rows * seq_len // 4))
    model = Decoder(cfg, dtype=dtype, param_dtype=jnp.float32, remat=remat, rngs=nnx.Rngs(0))
    print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()}; jax {jax.__version__}; model "
          f"{args.config} ({num_params(model) / 1e6:.2f}M params), compute {dtype.name}, "
          f"remat {remat}")  # fmt: skip
    print(f"workload: {rows} rows x {seq_len} tokens = one GRPO sample each ({prompt_len} prompt + "
          f"{seq_len - prompt_len} completion tokens), ppo_clip / sequence-mean-token-mean, AdamW "
          f"lr 1e-6 wd 0.01 clip 1.0; {steps} timed steps each after one warm-up, interleaved "
          f"[load average {peer_lib.load_average()}]", flush=True)  # fmt: skip
    rng = np.random.default_rng(0)
    batch, _ = grpo_rows(rng, rows, prompt_len, seq_len - prompt_len, cfg.vocab_size)
    reference = rng.integers(0, cfg.vocab_size, size=64).tolist()
    ref_logprobs = np.asarray(sequence_logprobs(model, jnp.asarray([reference], jnp.int32)))[0]
    objective = ObjectiveConfig(policy_loss="ppo_clip", reduction="sequence_mean", components=("rl",))
    config = TrainConfig(
        objective=objective,
        optimizer=OptimizerConfig(learning_rate=1e-6, weight_decay=0.01, max_grad_norm=1.0),
        chunk_size=chunk,
    )
    with tempfile.TemporaryDirectory(prefix="train_bench_tunix_") as checkpoint:
        save_pretrained(model, checkpoint)
        spec = {
            "checkpoint": checkpoint,
            "model": peer_lib.model_spec(cfg),
            "update": {"rows": rows, "prompt_len": prompt_len, "completion_len": seq_len - prompt_len,
                       "learning_rate": 1e-6, "weight_decay": 0.01, "max_grad_norm": 1.0, "group_size": 4},
            "check": {"tokens": reference, "logprobs": ref_logprobs.tolist()},
        }  # fmt: skip
        state = TrainState.create(model, config)
        del model
        counts = mini_batch_counts(batch, config.objective)
        state, metrics = train_step(state, batch, counts)  # compile + warm-up
        jax.block_until_ready(metrics)
        print(f"  tunix: starting the peer (load, logprob check, compile) "
              f"[load average {peer_lib.load_average()}]", flush=True)  # fmt: skip
        try:
            peer = peer_lib.TunixPeer(spec)
            peer.__enter__()
        except peer_lib.TunixUnavailable as e:
            print(f"  tunix: not measured ({e})", flush=True)
            return
        try:
            print(f"  tunix: {peer_lib.describe_ready(peer.ready)}", flush=True)
            ours, theirs = [], []
            for i in range(steps):
                t0 = time.perf_counter()
                state, metrics = train_step(state, batch, counts)
                jax.block_until_ready((state, metrics))
                ours.append(rows * seq_len / (time.perf_counter() - t0))
                tokens, seconds = peer.run("update")
                theirs.append(tokens / seconds)
                print(f"    step {i}: rljax {ours[-1]:,.0f}  tunix {theirs[-1]:,.0f} tokens/s "
                      f"(rljax loss {float(metrics['loss']):+.4f}) [load average {peer_lib.load_average()}]",
                      flush=True)  # fmt: skip
        finally:
            peer.__exit__(None, None, None)
    compared = peer_lib.report(ours, theirs, labels=("rljax train_step", "tunix Trainer"), goal=TUNIX_GOAL)
    # The floor: the step's model FLOPs (6 x matmul params + attention, the same for both libraries)
    # at this machine's best large-matmul rate, measured after the passes.
    peak = max(matmul_peak(2048, dtype) for _ in range(2))
    floor = peak / model_flops(cfg, seq_len, mean_causal_span(batch)).per_token
    print(f"  model-FLOPs floor ({_si(peak, 'FLOP/s')}, the best 2048^3 {dtype.name} matmul): {floor:,.0f} "
          f"tokens/s; rljax {compared['rljax'] / floor:.0%} of it, tunix {compared['tunix'] / floor:.0%}; "
          f"the goal ({TUNIX_GOAL:.1f}x tunix's best = {TUNIX_GOAL * compared['tunix']:,.0f} tokens/s) is "
          f"{TUNIX_GOAL * compared['tunix'] / floor:.0%} of it [load average {peer_lib.load_average()}]",
          flush=True)  # fmt: skip


def ppo_vs_grpo(state: Any, batches: list, counts: list, grpo_s: float, *, steps: int, mesh: Any) -> None:
    """One PPO step on the same batches: critic values -> GAE -> policy step -> critic step, against
    the grpo step timed above (its advantages are host-side and negligible). Goal <= 2.2x."""
    from rljax.models.value import ValueModel
    from rljax.training.critic import CriticConfig, critic_step, critic_values, ppo_advantages

    rng = np.random.default_rng(1)
    batches = [
        b.replace(token_rewards=np.where(np.asarray(b.loss_mask) != 0, rng.normal(size=b.tokens.shape), 0.0)
                  .astype(np.float32))
        for b in (jax.device_get(b) for b in batches)
    ]  # fmt: skip
    if mesh is not None:
        batches = [shard_batch(b, mesh) for b in batches]
    critic = TrainState.create(
        ValueModel.from_policy(state.model, rngs=nnx.Rngs(0)),
        TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-6)),
        mesh=mesh,
    )
    cc = CriticConfig()

    def one(i: int) -> None:
        nonlocal state, critic
        b = batches[i % 2]
        old = critic_values(critic, b)
        adv, ret = ppo_advantages(old, b, cc)
        state, _ = train_step(state, b.replace(advantages=adv), counts[i % 2])
        critic, m = critic_step(critic, b, old, ret, cc)
        jax.block_until_ready((state, critic, m))

    one(0)  # compile
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        one(i)
        times.append(time.perf_counter() - t0)
    ppo_s = min(times)
    ratio = ppo_s / grpo_s
    verdict = "PASS" if ratio <= 2.2 else "FAIL"
    print(
        f"ppo step (critic values + GAE + policy step + critic step): {ppo_s:.3f} s best of {steps}; "
        f"grpo step {grpo_s:.3f} s; ppo/grpo {ratio:.2f}x (goal <= 2.2x: {verdict})"
    )


if __name__ == "__main__":
    main()
