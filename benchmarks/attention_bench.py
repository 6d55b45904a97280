"""Attention backends on the accelerator: cuDNN fused attention vs XLA, parity and speed.

Three parts, one run:

1. **Kernel parity.** Packed rows (several samples per row, padding), bfloat16 ``q, k, v`` with
   grouped-query heads: the training forward's attention (:func:`rljax.models.attention_backends.
   self_attention`) with each backend, and its gradients, against a dense float32 reference written
   here (full ``T x T`` mask, ``precision="highest"``), computed from the same bfloat16 inputs. A
   backend passes when its error is within 2x the XLA backend's own bfloat16 error (+ 1e-3).
2. **Model parity.** A Qwen3-shaped model with bfloat16 compute: per-token logprobs and the loss
   and gradient norm of one train step with ``attention="cudnn"`` and ``"cudnn_ragged"`` vs ``"xla"``
   vs a float32 model.
3. **Speed and memory.** Attention forward + backward at 4k-64k tokens per row (xla, the block-wise
   cuDNN wrapper, with ``--backends`` also ``cudnn_ragged``, and cuDNN's own dense causal kernel on
   one unpacked row as the floor), then whole train steps on one long packed row (remat "full")
   with XLA's compiled per-step memory.

On a GPU the kernel parity also runs ``cudnn_ragged`` (cuDNN's packed variable-length kernel) and
``cudnn-fallback`` (the ragged path with a bound of one run, so ``lax.cond`` takes the block path).

    python benchmarks/attention_bench.py           # on a GPU (cuDNN); ~8 min on an H200
    python benchmarks/attention_bench.py --parts attention,train --backends cudnn,cudnn_ragged \
        --attention-sizes 16384 --train-sizes 16384
    python benchmarks/attention_bench.py --quick   # CPU smoke run: the cuDNN wrapper's masks in
                                                   # JAX's reference implementation, small sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.core.objective import ObjectiveConfig
from rljax.data.pack import pack
from rljax.models import Decoder, ModelConfig, num_params
from rljax.models.attention import causal_block_size
from rljax.models.attention_backends import fused_causal_attention, packed_cudnn_attention, self_attention
from rljax.models.logprobs import sequence_logprobs
from rljax.training.memory import compiled_memory
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step
from rljax.types import Step

MODEL = ModelConfig(
    model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
    num_heads=8, num_kv_heads=4, head_dim=64, qk_norm=True, tie_word_embeddings=True,
    max_position_embeddings=65536,
)  # fmt: skip
QUICK_MODEL = dataclasses.replace(MODEL, vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip


def packed_segments(batch: int, length: int, seed: int) -> np.ndarray:
    """``int32 [B, T]``: row 0 holds 3 samples and 7% padding, the other rows random sample lengths."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, length), np.int32)
    for b in range(batch):
        pos, s = 0, 1
        end = int(length * 0.93) if b == 0 else length
        while pos < end:
            n = min(end - pos, int(rng.integers(length // 8, length // 2)))
            seg[b, pos : pos + n] = s
            pos, s = pos + n, s + 1
    return seg


def dense_reference(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
    """float32 masked attention with the whole ``T x T`` mask: ``(j <= i) & (seg_i == seg_j)``."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    t = q.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")


def attention_fn(backend: str, chunk: int) -> Callable[..., jax.Array]:
    if backend == "reference":
        return dense_reference

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        if backend == "cudnn-reference-impl":  # the cuDNN wrapper's masks in JAX's reference code (CPU)
            return fused_causal_attention(q, k, v, segment_ids=seg, block_size=chunk, implementation="xla")
        if backend == "cudnn-fallback":  # ragged with a bound of 1 run: lax.cond takes the block path
            block = causal_block_size(q.shape[1], max_block_size=chunk)
            return packed_cudnn_attention(q, k, v, segment_ids=seg, block_size=block, max_runs=1)
        return self_attention(q, k, v, segment_ids=seg, backend=backend, max_block_size=chunk)

    return fn


def value_and_grads(fn: Callable[..., jax.Array], q, k, v, seg, cot):  # noqa: ANN001, ANN201
    out, vjp = jax.vjp(lambda q_, k_, v_: fn(q_, k_, v_, seg), q, k, v)
    return (out, *vjp(cot.astype(out.dtype)))


def kernel_parity(backends: list[str], length: int, chunk: int) -> bool:
    b, n, kh, d = 2, 8, 2, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(keys[i], (b, length, h, d), jnp.bfloat16) for i, h in enumerate((n, kh, kh)))
    cot = jax.random.normal(keys[3], (b, length, n, d), jnp.float32)
    seg = jnp.asarray(packed_segments(b, length, 0))
    ref = jax.jit(lambda *a: value_and_grads(dense_reference, *a))(q, k, v, seg, cot)
    print(f"kernel parity: B={b} T={length} heads {n}/{kh} D={d} bfloat16, packed rows; max |error| vs "
          "the dense float32 reference", flush=True)  # fmt: skip
    print(f"{'backend':>22} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
    errors: dict[str, list[float]] = {}
    for backend in backends:
        fn = attention_fn(backend, chunk)
        try:
            got = jax.jit(lambda *a, fn=fn: value_and_grads(fn, *a))(q, k, v, seg, cot)
        except Exception as e:  # noqa: BLE001 (a kernel that does not run is a FAIL, reported)
            print(f"{backend:>22} {type(e).__name__}: {str(e)[:600]}", flush=True)
            errors[backend] = [float("inf")] * 4
            continue
        pairs = zip(got, ref, strict=True)
        errors[backend] = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) for g, r in pairs]
        print(f"{backend:>22} " + " ".join(f"{e:9.2e}" for e in errors[backend]), flush=True)
    ok = True
    for backend in backends:
        if backend == "xla":
            continue
        bound = [2 * e + 1e-3 for e in errors["xla"]]
        passed = all(e <= bd for e, bd in zip(errors[backend], bound, strict=True))
        ok &= passed
        print(f"{backend}: {'PASS' if passed else 'FAIL'} (each error <= 2 x xla's + 1e-3)")
    return ok


def packed_row_batch(cfg: ModelConfig, length: int, rows: int, seed: int = 0):  # noqa: ANN201
    """``rows`` rows of ``length`` tokens, each 8 packed samples (prompt 1/8 of each)."""
    rng = np.random.default_rng(seed)
    n = length // 8
    prompt = n // 8
    steps = [
        Step(rng.integers(1, cfg.vocab_size, prompt).tolist(),
             rng.integers(1, cfg.vocab_size, n - prompt).tolist(), (f"q{i}", 0),
             response_logprobs=(-rng.random(n - prompt)).tolist())
        for i in range(8 * rows)
    ]  # fmt: skip
    adv = [rng.normal(size=n - prompt).astype(np.float32) for _ in steps]
    return pack(steps, seq_len=length, advantages=adv, row_buckets=[rows]).batch


def build(
    cfg: ModelConfig, attention: str, dtype: jnp.dtype, remat: str = "none"
) -> tuple[Decoder, TrainState, TrainConfig]:
    """The model (bfloat16 or float32 compute, float32 weights) and a fresh train state."""
    model = Decoder(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32, attention=attention,
                    remat=remat)  # fmt: skip
    optimizer = OptimizerConfig(learning_rate=1e-5)
    config = TrainConfig(objective=ObjectiveConfig(), optimizer=optimizer, chunk_size=1024)
    return model, TrainState.create(model, config), config


def model_parity(cfg: ModelConfig, backends: list[str], length: int) -> bool:
    batch = packed_row_batch(cfg, length, rows=2)
    results = {}
    runs = [("float32 xla", "xla", jnp.float32), ("bf16 xla", "xla", jnp.bfloat16)]
    runs += [(f"bf16 {b}", b, jnp.bfloat16) for b in backends if b != "xla"]
    for name, attention, dtype in runs:
        model, state, config = build(cfg, attention, dtype)
        lp = sequence_logprobs(model, batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions)
        counts = mini_batch_counts(batch, config.objective)
        _, metrics = train_step(state, batch, counts)
        results[name] = (np.asarray(lp), float(metrics["loss"]), float(metrics["grad_norm"]))
    ref_lp, ref_loss, ref_gn = results["float32 xla"]
    mask = np.asarray(batch.segment_ids) > 0
    print(f"model parity: {num_params(Decoder(cfg, rngs=nnx.Rngs(0))) / 1e6:.1f}M params, 2 rows x {length} "
          "tokens (8 packed samples each); vs the float32 XLA model", flush=True)  # fmt: skip
    print(f"{'model':>14} {'max |dlogp|':>12} {'mean |dlogp|':>13} {'loss':>12} {'grad norm':>12}")
    errs = {}
    for name, (lp, loss, gn) in results.items():
        d = np.abs(lp - ref_lp)[mask]
        errs[name] = float(d.mean())
        print(f"{name:>14} {d.max():12.2e} {d.mean():13.2e} {loss:12.6f} {gn:12.6f}")
    ok = True
    for b in backends:
        passed = errs[f"bf16 {b}"] <= 2 * errs["bf16 xla"] + 1e-4
        ok &= passed
        print(
            f"bf16 {b}: {'PASS' if passed else 'FAIL'} (mean |dlogp| <= 2 x bf16 xla's + 1e-4); "
            f"loss {ref_loss:.6f} / grad norm {ref_gn:.6f} in float32"
        )
    return ok


def timed(fn: Callable[[], object], reps: int) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def attention_speed(backends: list[str], sizes: list[int], chunk: int, reps: int) -> None:
    n, kh, d = 16, 4, 128
    print(f"attention forward + backward, one row, heads {n}/{kh}, D={d}, bfloat16, 8 packed samples "
          f"(the floor: cuDNN causal on the row unpacked); ms, best of {reps}", flush=True)  # fmt: skip
    names = backends + (["cudnn causal floor"] if any(b.startswith("cudnn") for b in backends) else [])
    print(f"{'tokens':>7} " + " ".join(f"{x:>20}" for x in names))
    for t in sizes:
        keys = jax.random.split(jax.random.key(t), 4)
        q, k, v = (jax.random.normal(keys[i], (1, t, h, d), jnp.bfloat16) for i, h in enumerate((n, kh, kh)))
        cot = jax.random.normal(keys[3], (1, t, n, d), jnp.bfloat16)
        seg = jnp.asarray(np.repeat(np.arange(1, 9, dtype=np.int32), t // 8)[None])
        row = []
        for backend in names:
            if backend == "cudnn causal floor":

                def fn(q_, k_, v_, s_):  # noqa: ANN001, ANN202
                    return jax.nn.dot_product_attention(q_, k_, v_, is_causal=True, implementation="cudnn")
            else:
                fn = attention_fn(backend, chunk)
            step = jax.jit(lambda *a, fn=fn: value_and_grads(fn, *a))
            try:
                args = (q, k, v, seg, cot)
                row.append(f"{timed(lambda step=step, args=args: step(*args), reps) * 1e3:20.2f}")
            except Exception as e:  # noqa: BLE001 (report, go on with the next size)
                row.append(f"{type(e).__name__:>20}")
        print(f"{t:7d} " + " ".join(row), flush=True)


def train_speed(cfg: ModelConfig, backends: list[str], sizes: list[int], reps: int) -> None:
    params = num_params(Decoder(cfg, rngs=nnx.Rngs(0))) / 1e6
    print(f"train step, one packed row (8 samples), {params:.1f}M params, bfloat16 compute, remat full: "
          "seconds (best of reps) / compiled step MiB", flush=True)  # fmt: skip
    print(f"{'tokens':>7} " + " ".join(f"{b:>24}" for b in backends))
    for t in sizes:
        batch = packed_row_batch(cfg, t, rows=1)
        row = []
        for backend in backends:
            try:
                _, state, config = build(cfg, backend, jnp.bfloat16, remat="full")
                counts = mini_batch_counts(batch, config.objective)
                holder = [state]

                def once(holder: list[TrainState] = holder, counts: dict = counts, batch=batch) -> dict:  # noqa: ANN001
                    holder[0], metrics = train_step(holder[0], batch, counts)  # the state is donated
                    return metrics

                secs = timed(once, reps)
                mem = compiled_memory(train_step, holder[0], batch, counts)["step_bytes"] / 2**20
                row.append(f"{secs:12.3f} s {mem:8.0f} MiB")
            except Exception as e:  # noqa: BLE001
                row.append(f"{type(e).__name__:>24}")
        print(f"{t:7d} " + " ".join(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: small sizes, reference kernels")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--parts", default="kernel,model,attention,train")
    parser.add_argument(
        "--attention-sizes", default="", help="comma-separated row lengths (default per mode)"
    )
    parser.add_argument("--train-sizes", default="", help="comma-separated row lengths (default per mode)")
    parser.add_argument("--backends", default="", help="GPU: backends of the speed parts (default xla,cudnn)")
    args = parser.parse_args()
    gpu = jax.default_backend() == "gpu"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})", flush=True)
    cudnn = "cudnn" if gpu else "cudnn-reference-impl"
    parts = args.parts.split(",")
    ok = True
    if args.quick:
        cfg, parity_len, chunk = QUICK_MODEL, 512, 128
        att_sizes, train_sizes = [1024, 2048], [1024]
    else:
        cfg, parity_len, chunk = MODEL, 4096, 1024
        att_sizes, train_sizes = [4096, 8192, 16384, 32768, 65536], [16384, 32768, 65536]
    att_sizes = [int(x) for x in args.attention_sizes.split(",")] if args.attention_sizes else att_sizes
    train_sizes = [int(x) for x in args.train_sizes.split(",")] if args.train_sizes else train_sizes
    speed = args.backends.split(",") if args.backends else (["xla", "cudnn"] if gpu else ["xla"])
    if "kernel" in parts:
        ok &= kernel_parity(["xla", cudnn, "cudnn_ragged", "cudnn-fallback"] if gpu else ["xla", cudnn],
                            parity_len, chunk)  # fmt: skip
    if "model" in parts:
        ok &= model_parity(cfg, ["cudnn", "cudnn_ragged"] if gpu else ["xla"], parity_len)
    if "attention" in parts:
        attention_speed(speed, att_sizes, chunk, args.reps)
    if "train" in parts:
        train_speed(cfg, [b for b in speed if b in ("xla", "cudnn", "cudnn_ragged")], train_sizes, args.reps)
    print("parity: " + ("PASS" if ok else "FAIL"))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
