"""Generation throughput: the embedded JAX sampler vs a real vLLM (CPU) server on the same tiny model.

One run prints generated tokens/s of every engine and the ratio sampler / vLLM (goal >= 1.0).

Model: the tiny Qwen3 the vLLM tests serve (hidden 128, 2 layers, 2 heads / 1 kv head, head_dim 64 as
vLLM's CPU attention needs, vocab 512, tied embeddings), random-initialized with a fixed seed, or
any rljax / HF checkpoint given with ``--model-dir``. It is saved with
:func:`rljax.models.save_pretrained` (to ``--save-dir`` or a temporary directory) and the vLLM
server loads exactly those weights (float32, like the sampler).

Workload, identical for every engine (:func:`bench_engine`): ``--num-prompts`` random prompts of
``--prompt-len`` tokens (``--min-prompt-len`` < prompt-len draws lengths uniformly in between),
submitted concurrently through the :class:`rljax.inference.engine.Engine` protocol; each generates
exactly ``--max-tokens`` tokens at temperature 1 with logprobs (no stop ids; vLLM gets
``ignore_eos``); no per-request seeds (vLLM samples seeded requests one by one). ``--warmup``
untimed passes (jit compilation, vLLM's warm-up), then the best of ``--repeats`` timed passes.
tokens/s = generated tokens / wall seconds of a pass.

Engines: ``embedded`` (:class:`rljax.inference.sampler.EmbeddedSampler`, in process), ``vllm``
(a :class:`rljax.inference.vllm.VLLMServer` in vLLM's default mode, which compiles the model with
torch.compile at start-up) and ``vllm-eager`` (the same server with ``--enforce-eager``), each
reached through :class:`rljax.inference.vllm.VLLMClient`. vLLM's python is ``$RLJAX_VLLM_PYTHON`` or
``<repo>/.vllm-venv/bin/python``; without it the vLLM engines are reported as not installed and
the sampler figure is still printed.

``--tunix`` also runs the same workload in Google Tunix (``benchmarks/tunix_peer.py`` under the
Tunix venv's python, made by ``.ci/install_tunix.sh``) on the same weights, the embedded sampler and
Tunix's ``Sampler`` taking turns pass by pass (A, B, A, B, ...), and prints both figures, the ratio
rljax / Tunix and its verdict against the goal (>= 2x). With ``--tunix`` the defaults become the
issue's workload: the ~29M Qwen3 shape of ``train_step_bench.py`` (``--model small``), 32 prompts of
64 tokens, 128 new tokens; both sides return the drawn tokens and their logprobs. What differs: Tunix
draws with ``jax.random.categorical`` (a Gumbel variate per vocabulary entry, one key for the batch)
and rljax by inversion (one uniform per row, per-row seeds); Tunix takes prompt strings through its
tokenizer adapter (here space-separated ids) and returns Python lists, rljax takes token lists
through the Engine protocol (asyncio) and returns ``Completion`` records.

``--group-size G`` makes the prompts GRPO-like groups: ``--num-prompts / G`` distinct prompts, each
sent ``G`` times (the embedded sampler prefills each distinct prompt once; Tunix's sampler prefills
every row).

``--decode-slots 64,256,1024`` also prints the model's decode cost in ms per step (``--num-prompts``
rows, one :func:`rljax.models.decode_step` per step inside one jitted loop) at those cache sizes.

Floors (printed with ``--tunix``): the weight-matmul floor (the pass's weight matmuls alone, timed)
and the weight-streaming floor: a decode step reads every weight once (the output projection
included, the input embedding's few rows not) and each row's filled KV-cache slots, so a pass
cannot take less than ``sum over steps of (weight bytes + KV bytes) / bandwidth``, with the memory
bandwidth measured here (:func:`memory_bandwidth`: a jitted sum over 512 MiB, best of 10).

``--layouts auto,off,on`` measures the embedded sampler alone with its decode-time weight layout
(:func:`compare_layouts`): ``auto`` (the default, ``kernel_layout="auto"``: the panel kernel, in
its fastest instruction set, only where its timed first-use comparison found it >= 5 % faster than
XLA on this machine), ``off`` (``"out_in"``: XLA, what ``RLJAX_PANEL_MATMUL=0`` gives), ``on``
(``"panels"``: the kernel in the widest instruction set, as ``RLJAX_PANEL_MATMUL=1``), ``avx2`` /
``avx512`` (the kernel in that instruction set) and ``noshare`` (``auto`` with
``prefix_sharing=False``: with ``--group-size`` it shows what prefilling a group's prompt once
saves), ``keys_t`` / ``keys_s`` (``auto`` with the KV cache's keys transposed / slot-major,
``RLJAX_TRANSPOSED_KEYS=1`` / ``0``), interleaved pass by pass in one process; it prints which
layouts auto chose, the kernel's and the key layout's timed choices and the seconds of every pass.
With ``--layouts`` the defaults are the ``--tunix`` workload (29M Qwen3, 32 prompts x (64 + 128) tokens).

Usage::

    python benchmarks/generation_bench.py                      # embedded, vllm-eager, vllm
    python benchmarks/generation_bench.py --engines embedded --decode-slots 64,256,1024
    python benchmarks/generation_bench.py --quick              # 16 prompts x 32 new tokens
    python benchmarks/generation_bench.py --tunix              # rljax vs Google Tunix (29M, 32 x (64 + 128))
    python benchmarks/generation_bench.py --layouts auto,off,on --repeats 3   # the CPU decode kernel
    python benchmarks/generation_bench.py --layouts auto,noshare --group-size 8   # prefix sharing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.inference.engine import Completion, Engine, SamplingParams
from rljax.inference.sampler import EmbeddedSampler, bucket_size
from rljax.inference.vllm import ServerConfig, ServerStartError, VLLMClient, VLLMServer, find_vllm_python
from rljax.inference.vllm.client import completion_payload, parse_completion
from rljax.models import (
    Decoder,
    ModelConfig,
    decode_step,
    from_pretrained,
    num_params,
    prefill,
    save_pretrained,
    sequence_logprobs,
)
from rljax.models import key_layout as key_layout_lib
from rljax.models import panel_matmul as panel_matmul_lib
from rljax.models.panel_matmul import available as panel_matmul_available
from rljax.models.panel_matmul import pack_panels, panel_matmul

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


TUNIX_GOAL = 2.0  # generated tokens/s, rljax's embedded sampler / Tunix's Sampler


def _sibling(name: str) -> Any:
    """A module of this directory (the benchmarks are scripts, not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


class NotAvailable(RuntimeError):
    """An engine that cannot run here (e.g. vLLM not installed); the benchmark reports and skips it."""


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------


async def _run(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int) -> int:
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    outs = await asyncio.gather(
        *(engine.generate(p, sampling, session_id=f"bench-{i}") for i, p in enumerate(prompts))
    )
    short = [len(o.ids) for o in outs if len(o.ids) != max_tokens]
    if short:
        raise RuntimeError(
            f"{len(short)} completions stopped early (lengths {short[:5]}); the workload needs exactly "
            f"{max_tokens} tokens each"
        )
    return sum(len(o.ids) for o in outs)


def bench_engine(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> tuple[float, list[float]]:
    """Generated tokens/s of ``engine`` (best of ``repeats`` after ``warmup`` passes), and every pass's.

    All passes run in one event loop (async clients such as :class:`VLLMClient` are bound to it).
    """

    async def main() -> list[float]:
        ctx = engine if hasattr(engine, "__aenter__") else contextlib.nullcontext()
        async with ctx:
            for _ in range(warmup):  # compilation, server-side warm-up and caches
                await _run(engine, prompts, max_tokens)
            rates = []
            for _ in range(repeats):
                start = time.perf_counter()
                tokens = await _run(engine, prompts, max_tokens)
                rates.append(tokens / (time.perf_counter() - start))
            return rates

    rates = asyncio.run(main())
    return max(rates), rates


def decode_ms_per_step(model: Decoder, *, rows: int, slots: int, reps: int = 5) -> float:
    """Milliseconds per :func:`rljax.models.decode_step` of ``rows`` rows with a ``slots``-slot cache.

    Steps run inside one jitted ``fori_loop`` (greedy feedback, cache donated); the figure is
    ``(t(3n) - t(n)) / 2n`` with the best of ``reps`` timings each, so prefill and dispatch cancel out.
    """
    steps = max(1, min(32, slots // 4))
    prompt = jnp.asarray(
        np.random.default_rng(0).integers(0, model.config.vocab_size, (rows, slots - 3 * steps)), jnp.int32
    )
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=(2,))
    def loop(graphdef: Any, state: Any, cache: Any, n: int) -> Any:
        m = nnx.merge(graphdef, state)

        def body(_: jax.Array, carry: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
            logits, cache, _ = decode_step(m, carry[0], carry[1])
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, n, body, (jnp.zeros((rows,), jnp.int32), cache))

    def timed(n: int) -> float:
        cache = prefill(model, prompt, max_length=slots).cache
        jax.block_until_ready(cache)
        start = time.perf_counter()
        jax.block_until_ready(loop(graphdef, state, cache, n))
        return time.perf_counter() - start

    best = {n: float("inf") for n in (steps, 3 * steps)}
    for n in best:
        timed(n)  # compile
    for _ in range(reps):
        for n in best:
            best[n] = min(best[n], timed(n))
    return (best[3 * steps] - best[steps]) / (2 * steps) * 1e3


def weight_matmul_floor(
    cfg: ModelConfig,
    *,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    reps: int = 3,
    kernel_layout: str = "out_in",
    isa: str = "avx2",
    group_size: int = 1,
) -> float:
    """Generated tokens/s of a pass that did nothing but the model's weight matmuls (a floor on time).

    The same matmuls a generation pass runs, with the model's shapes: per layer the q / k / v / o
    projections and the gated MLP (gate, up, down), for the ``rows / group_size`` distinct prompts'
    ``prompt_len`` tokens at once (prefill, each shared by ``group_size`` rows; the unembedding for
    the last token only) and then ``new_tokens`` steps of ``rows``
    tokens each with the unembedding, in one jitted program (a ``fori_loop`` over the steps, as a
    sampler's decode loop), float32, the weights passed as arguments (as a sampler's are).
    ``kernel_layout``: the weights stored ``[in, out]`` (``x @ W``), ``[out, in]`` (``x @ W^T``;
    XLA:CPU runs few-row matmuls faster that way) or ``"panels"`` (16-column panels multiplied by
    :func:`rljax.models.panel_matmul.panel_matmul` in instruction set ``isa``, the embedded sampler's
    default on x86-64 CPUs where it measured faster than XLA).
    Attention over the cache, norms, RoPE and sampling are left out, so no sampler can beat it with
    the same matmuls; the best of ``reps`` timings after one warm-up.
    """
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 7 * cfg.num_layers + 2))

    def weight(fan_in: int, fan_out: int) -> jax.Array:
        w = jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) * fan_in**-0.5
        return {"in_out": w, "out_in": w.T.copy(), "panels": pack_panels(w)}[kernel_layout]

    def mm(x: jax.Array, w: jax.Array) -> jax.Array:
        if kernel_layout == "panels":
            return panel_matmul(x, w, isa)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))) if kernel_layout == "out_in" else x @ w

    layers = [
        [weight(h, q_dim), weight(h, kv_dim), weight(h, kv_dim), weight(q_dim, h),
         weight(h, inter), weight(h, inter), weight(inter, h)]
        for _ in range(cfg.num_layers)
    ]  # fmt: skip
    weights = (layers, weight(h, vocab))

    def blocks(layers: list, x: jax.Array) -> jax.Array:
        for wq, wk, wv, wo, wg, wu, wd in layers:
            q, k, v = mm(x, wq), mm(x, wk), mm(x, wv)
            x = x + mm(q, wo) + mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd) + (k + v).mean(-1, keepdims=True)
        return x

    @jax.jit
    def one_pass(weights: tuple, prompt: jax.Array) -> jax.Array:
        layers, unembed = weights
        x = blocks(layers, prompt).reshape(rows // group_size, prompt_len, h)[:, -1]
        x = jnp.repeat(x + mm(x, unembed)[:, :h], group_size, axis=0)

        def step(_: jax.Array, x: jax.Array) -> jax.Array:
            x = blocks(layers, x)
            return x + 1e-3 * mm(x, unembed)[:, :h]

        return jax.lax.fori_loop(0, new_tokens, step, x)

    prompt = jax.random.normal(next(keys), (rows // group_size * prompt_len, h), jnp.float32)
    jax.block_until_ready(one_pass(weights, prompt))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(one_pass(weights, prompt))
        best = min(best, time.perf_counter() - start)
    return rows * new_tokens / best


def memory_bandwidth(nbytes: int = 512 * 2**20, reps: int = 10) -> float:
    """Bytes/s this process reads from memory: a jitted sum over ``nbytes`` of float32 (far larger
    than the caches), the best of ``reps`` timings after a warm-up."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(total(x))
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def streaming_bytes(cfg: ModelConfig, *, rows: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """``(weight bytes, KV-cache bytes)`` a generation pass must read from memory, float32.

    Each of the ``new_tokens`` decode steps reads every weight once (the output projection included,
    the input embedding's few rows not) and, per layer, the keys and values of the slots each row
    has filled (``prompt_len + t`` at step ``t``); the prefill reads the weights once more.
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    per_layer = cfg.num_heads * hd * h * 2 + cfg.num_kv_heads * hd * h * 2 + 3 * h * cfg.intermediate_size
    weights = 4 * (cfg.num_layers * per_layer + cfg.vocab_size * h)
    kv_per_slot = 4 * 2 * cfg.num_layers * rows * cfg.num_kv_heads * hd
    kv = sum(kv_per_slot * (prompt_len + t) for t in range(new_tokens))
    return float(weights * (new_tokens + 1)), float(kv)


def print_floors(
    cfg: ModelConfig, prompts: list[list[int]], args: argparse.Namespace, rates: dict[str, float]
) -> float:
    """Prints the weight-matmul floor (timed, per stored layout / kernel instruction set) and the
    weight-streaming floor, and each engine's best rate as a fraction of them; returns the
    weight-matmul floor."""
    load = _sibling("tunix_peer").load_average
    shape = dict(rows=len(prompts), prompt_len=args.prompt_len, new_tokens=args.max_tokens)
    group = dict(group_size=args.group_size)  # each distinct prompt prefilled once
    floors = {
        layout: weight_matmul_floor(cfg, **shape, **group, kernel_layout=layout)
        for layout in ("in_out", "out_in")
    }
    for isa in panel_matmul_lib.supported_isas():
        floors[f"panels {isa}"] = weight_matmul_floor(cfg, **shape, **group, kernel_layout="panels", isa=isa)
    floor = max(floors.values())
    shared = "; each distinct prompt prefilled once" if args.group_size > 1 else ""
    each = ", ".join(f"{name}: {rate:,.0f}" for name, rate in floors.items())
    versus = "; ".join(f"{name} {rate / floor:.0%} of it" for name, rate in rates.items())
    print(f"  weight-matmul floor (the pass's weight matmuls alone in one jitted program{shared}): "
          f"{floor:,.0f} "
          f"tokens/s ({each}); {versus} [load average {load()}]", flush=True)  # fmt: skip
    weights, kv = streaming_bytes(cfg, **shape)
    bandwidth = memory_bandwidth()
    stream = len(prompts) * args.max_tokens / ((weights + kv) / bandwidth)
    versus = "; ".join(f"{name} {rate / stream:.0%} of it" for name, rate in rates.items())
    print(f"  weight-streaming floor: {stream:,.0f} tokens/s ({weights / 2**20:,.0f} MiB of weights and "
          f"{kv / 2**20:,.0f} MiB of KV cache read per pass at {bandwidth / 1e9:.1f} GB/s measured); "
          f"{versus} [load average {load()}]", flush=True)  # fmt: skip
    return floor


# ------------------------------------------------------------------------------------------------
# engines
# ------------------------------------------------------------------------------------------------


def make_model(model_dir: str | None, seed: int, name: str = "tiny") -> Decoder:
    """``model_dir``'s checkpoint, else a random model: ``tiny`` (:data:`TINY_QWEN3`) or ``small`` (the
    ~29M Qwen3 shape of ``train_step_bench.py``)."""
    if model_dir:
        return from_pretrained(model_dir)
    if name == "small":
        return Decoder(_sibling("train_step_bench").CONFIGS["small"], rngs=nnx.Rngs(seed))
    return Decoder(ModelConfig(**TINY_QWEN3), rngs=nnx.Rngs(seed))


def make_embedded(model: Decoder, args: argparse.Namespace, stack: contextlib.ExitStack) -> Engine:
    """The embedded sampler: all prompts in one jitted batch (one while_loop over the new tokens)."""
    return EmbeddedSampler(model, max_batch_size=args.num_prompts, batch_wait_ms=5.0, min_prompt_bucket=16)


class IgnoreEosClient(VLLMClient):
    """A :class:`VLLMClient` whose completions never stop on EOS (``"ignore_eos": true``)."""

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Completion:
        prompt = [int(t) for t in prompt_ids]
        body = {**completion_payload(prompt, sampling, model=self.model), "ignore_eos": True}
        return await self.request(
            "/v1/completions",
            body,
            session_id=session_id,
            parse=lambda answer, version: parse_completion(answer, prompt_ids=prompt, weight_version=version),
        )


def _make_vllm(
    model: Decoder, args: argparse.Namespace, stack: contextlib.ExitStack, *, eager: bool
) -> Engine:
    try:
        python = find_vllm_python()
    except FileNotFoundError as e:
        raise NotAvailable(str(e)) from e
    if python is None:
        raise NotAvailable(
            "vLLM is not installed: run .ci/install_vllm.sh (creates .vllm-venv) or set RLJAX_VLLM_PYTHON"
        )
    log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="gen_bench_vllm_logs_"))
    config = ServerConfig(
        model=args.save_dir,
        max_model_len=bucket_size(args.prompt_len + args.max_tokens),
        skip_tokenizer_init=True,
        extra_args=("--enforce-eager",) if eager else (),
        startup_timeout_s=args.vllm_startup_timeout,
        log_path=os.path.join(log_dir, "server.log"),
    )
    server = VLLMServer(config, python=python)
    mode = "--enforce-eager" if eager else "default mode"
    print(f"  starting vLLM ({mode}): {' '.join(server.command())}", flush=True)
    try:
        stack.enter_context(server)
    except ServerStartError as e:
        raise NotAvailable(f"the vLLM server did not start: {e}") from e
    print(f"  vLLM healthy after {server.startup_s:.0f} s", flush=True)
    return IgnoreEosClient([server.url], max_concurrency=max(64, args.num_prompts))


def make_vllm(model: Decoder, args: argparse.Namespace, stack: contextlib.ExitStack) -> Engine:
    """A client of a vLLM server in its default mode serving ``args.save_dir`` (stopped by ``stack``)."""
    return _make_vllm(model, args, stack, eager=False)


def make_vllm_eager(model: Decoder, args: argparse.Namespace, stack: contextlib.ExitStack) -> Engine:
    """Like :func:`make_vllm` with ``--enforce-eager`` (no torch.compile: faster start-up)."""
    return _make_vllm(model, args, stack, eager=True)


ENGINE_FACTORIES: dict[str, Callable[[Decoder, argparse.Namespace, contextlib.ExitStack], Engine]] = {
    "embedded": make_embedded,
    "vllm-eager": make_vllm_eager,
    "vllm": make_vllm,
}


# ------------------------------------------------------------------------------------------------
# rljax vs Google Tunix
# ------------------------------------------------------------------------------------------------


def compare_tunix(
    model: Decoder, prompts: list[list[int]], args: argparse.Namespace, checkpoint: str
) -> dict[str, float] | None:
    """The embedded sampler and Tunix's Sampler on the same weights and prompts, interleaved pass by pass.

    Returns ``{"rljax": best, "tunix": best, "ratio": best / best, "ratio_median": ...}``, or None
    (printed why) when Tunix is not installed.
    """
    peer_lib = _sibling("tunix_peer")
    rng = np.random.default_rng(args.seed + 1)
    reference = rng.integers(0, model.config.vocab_size, size=64).tolist()
    ref_logprobs = np.asarray(sequence_logprobs(model, jnp.asarray([reference], jnp.int32)))[0]
    spec = {
        "checkpoint": checkpoint,
        "model": peer_lib.model_spec(model.config),
        "generate": {
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "seed": args.seed,
        },
        "check": {"tokens": reference, "logprobs": ref_logprobs.tolist()},
    }
    engine = make_embedded(model, args, contextlib.ExitStack())
    print(f"  tunix: starting the peer (load, logprob check, compile) "
          f"[load average {peer_lib.load_average()}]", flush=True)  # fmt: skip
    try:
        peer = peer_lib.TunixPeer(spec)
        peer.__enter__()
    except peer_lib.TunixUnavailable as e:
        print(f"  tunix: not measured ({e})", flush=True)
        return None
    try:
        print(f"  tunix: {peer_lib.describe_ready(peer.ready)}", flush=True)
        for _ in range(max(args.warmup, 1)):  # compile the sampler's program (the peer warmed itself)
            asyncio.run(_run(engine, prompts, args.max_tokens))
        ours, theirs = [], []
        for i in range(args.repeats):
            start = time.perf_counter()
            tokens = asyncio.run(_run(engine, prompts, args.max_tokens))
            ours.append(tokens / (time.perf_counter() - start))
            tokens, seconds = peer.run("generate")
            theirs.append(tokens / seconds)
            print(f"    pass {i}: rljax {ours[-1]:,.0f}  tunix {theirs[-1]:,.0f} tokens/s  "
                  f"[load average {peer_lib.load_average()}]", flush=True)  # fmt: skip
    finally:
        peer.__exit__(None, None, None)
    compared = peer_lib.report(ours, theirs, labels=("rljax embedded", "tunix Sampler"), goal=TUNIX_GOAL)
    rates = {
        "rljax": compared["rljax"],
        "tunix": compared["tunix"],
        "the goal": TUNIX_GOAL * compared["tunix"],
    }
    floor = print_floors(model.config, prompts, args, rates)
    return {**compared, "floor": floor}


# ------------------------------------------------------------------------------------------------
# the decode-time weight layout (the CPU panel kernel or XLA)
# ------------------------------------------------------------------------------------------------

#: ``--layouts`` names -> ``(EmbeddedSampler(kernel_layout=...), RLJAX_PANEL_MATMUL at its construction
#: or None, prefix_sharing)``.
#: ``--layouts`` arms: (kernel_layout, RLJAX_PANEL_MATMUL, prefix_sharing, RLJAX_TRANSPOSED_KEYS).
LAYOUT_ARMS = {
    "auto": ("auto", None, True, None),
    "off": ("out_in", None, True, None),
    "on": ("panels", "1", True, None),
    "avx2": ("panels", "avx2", True, None),
    "avx512": ("panels", "avx512", True, None),
    "noshare": ("auto", None, False, None),
    "keys_t": ("auto", None, True, "1"),
    "keys_s": ("auto", None, True, "0"),
}


@contextlib.contextmanager
def _env_switch(name: str, value: str | None) -> Any:
    """``$name=value`` for the block (None: as it is)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def compare_layouts(
    model: Decoder, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, list[float]]:
    """Seconds per pass of the embedded sampler with each ``--layouts`` arm, interleaved pass by pass
    (the order rotating) in one process after ``--warmup`` passes each; prints which layout ``auto``
    chose, the kernel's timed choice, every pass and each arm's median against ``off``."""
    load = _sibling("tunix_peer").load_average
    samplers: dict[str, EmbeddedSampler] = {}
    for name in args.layouts:
        layout, switch, sharing, keys = LAYOUT_ARMS[name]
        if layout == "panels" and switch not in panel_matmul_lib.supported_isas() + ("1",):
            print(
                f"  {name}: not measured (the kernel runs {panel_matmul_lib.supported_isas()} here)",
                flush=True,
            )
            continue
        if layout == "panels" and not panel_matmul_available():
            print(f"  {name}: not measured ({panel_matmul_lib.unavailable_reason()})", flush=True)
            continue
        with _env_switch("RLJAX_PANEL_MATMUL", switch), _env_switch("RLJAX_TRANSPOSED_KEYS", keys):
            samplers[name] = EmbeddedSampler(
                model, max_batch_size=args.num_prompts, batch_wait_ms=5.0, min_prompt_bucket=16,
                kernel_layout=layout, prefix_sharing=sharing,
            )  # fmt: skip
    if "auto" in samplers:
        auto = samplers["auto"]
        print(
            f"  auto chose kernel_layout={auto.kernel_layout!r} (kernel_isa={auto.kernel_isa!r}, "
            f"transposed_keys={auto.transposed_keys})",
            flush=True,
        )
    if panel_matmul_available() and os.environ.get("RLJAX_PANEL_MATMUL", "auto") in ("", "auto"):
        print(f"  {panel_matmul_lib.timed_choice().describe()}", flush=True)
    if os.environ.get("RLJAX_TRANSPOSED_KEYS", "auto") in ("", "auto"):
        print(f"  {key_layout_lib.timed_choice().describe()}", flush=True)

    def one_pass(name: str) -> float:
        start = time.perf_counter()
        asyncio.run(_run(samplers[name], prompts, args.max_tokens))
        return time.perf_counter() - start

    for name in samplers:
        for _ in range(args.warmup):
            one_pass(name)
    seconds: dict[str, list[float]] = {name: [] for name in samplers}
    names = list(samplers)
    for i in range(args.repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            seconds[name].append(one_pass(name))
        print(f"    pass {i}: " + "  ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names)
              + f"  [load average {load()}]", flush=True)  # fmt: skip
    tokens = len(prompts) * args.max_tokens
    for name in names:
        median = float(np.median(seconds[name]))
        passes = "/".join(f"{t:.2f}" for t in seconds[name])
        versus = ""
        base = names[-1] if "off" not in seconds else "off"
        if name != base:
            ratio = float(np.median(np.divide(seconds[base], seconds[name])))
            versus = f"; {base} / {name}: {ratio:.2f}x (median per pass pair)"
        sampler = samplers[name]
        keys = "transposed keys" if sampler.transposed_keys else "slot-major keys"
        arm = " ".join(x for x in (sampler.kernel_layout, sampler.kernel_isa, keys) if x)
        print(f"  {name} ({arm}): {passes} s per pass, median {median:.2f} s "
              f"({tokens / median:,.0f} tokens/s){versus}", flush=True)  # fmt: skip
    return seconds


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 32 new tokens, 2 repeats")
    parser.add_argument(
        "--engines",
        default=None,
        help=f"comma list of {list(ENGINE_FACTORIES)} (default: all; with --tunix: embedded)",
    )
    parser.add_argument(
        "--tunix",
        action="store_true",
        help="also run the workload in Google Tunix, "
        "interleaved with the embedded sampler, and print the ratio (goal >= 2x)",
    )
    parser.add_argument(
        "--model",
        choices=["tiny", "small"],
        default=None,
        help="random model: tiny (default) or the ~29M shape (default with --tunix)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="default 64; 32 with --tunix")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=None, help="default: --prompt-len")
    parser.add_argument(
        "--group-size", type=int, default=1, help="each distinct prompt sent this many times (GRPO groups)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes (the best is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes first")
    parser.add_argument("--model-dir", default=None, help="load this checkpoint instead of the tiny Qwen3")
    parser.add_argument("--save-dir", default=None, help="write the served checkpoint here")
    parser.add_argument("--vllm-startup-timeout", type=float, default=1800.0)
    parser.add_argument("--decode-slots", default="", help="e.g. 64,256,1024: also print decode ms/step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layouts",
        default="",
        help=f"comma list of {list(LAYOUT_ARMS)}: the embedded sampler alone with each decode weight layout, "
        "interleaved (auto = the default, off = XLA, on = the panel kernel)",
    )
    args = parser.parse_args(argv)
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for name in args.layouts:
        if name not in LAYOUT_ARMS:
            parser.error(f"unknown layout {name!r}; choose from {list(LAYOUT_ARMS)}")
    if args.engines is None:
        args.engines = "embedded" if args.tunix else "embedded,vllm-eager,vllm"
    if args.num_prompts is None:
        args.num_prompts = 32 if args.tunix or args.layouts else 64
    if args.model is None:
        args.model = "small" if args.tunix or args.layouts else "tiny"
    if args.quick:
        args.num_prompts, args.prompt_len, args.max_tokens, args.repeats, args.warmup = 16, 32, 32, 2, 1
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    for name in names:
        if name not in ENGINE_FACTORIES:
            parser.error(f"unknown engine {name!r}; choose from {list(ENGINE_FACTORIES)}")
    min_len = args.prompt_len if args.min_prompt_len is None else args.min_prompt_len
    if not 1 <= min_len <= args.prompt_len:
        parser.error(f"--min-prompt-len must be in [1, --prompt-len={args.prompt_len}], got {min_len}")
    if args.group_size < 1 or args.num_prompts % args.group_size:
        parser.error(f"--group-size must divide --num-prompts={args.num_prompts}, got {args.group_size}")

    model = make_model(args.model_dir, args.seed, args.model)
    cfg = model.config
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(min_len, args.prompt_len + 1, size=args.num_prompts // args.group_size)
    distinct = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in lengths]
    prompts = [p for p in distinct for _ in range(args.group_size)]
    lengths = np.repeat(lengths, args.group_size)
    print(
        f"model: {cfg.model_type} hidden={cfg.hidden_size} layers={cfg.num_layers} heads={cfg.num_heads}/"
        f"{cfg.num_kv_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size} params={num_params(model):,} "
        f"float32; jax device: {jax.devices()[0].device_kind} x{jax.device_count()}, {os.cpu_count()} CPUs"
    )
    print(
        f"workload: {args.num_prompts} concurrent prompts ({len(distinct)} distinct) of "
        f"{lengths.min()}-{lengths.max()} tokens, exactly "
        f"{args.max_tokens} new tokens each (no stop ids / ignore_eos), temperature 1, logprobs on; "
        f"best of {args.repeats} passes after {args.warmup} warm-up passes [load average "
        f"{_sibling('tunix_peer').load_average()}]",
        flush=True,
    )
    for slots in [int(s) for s in args.decode_slots.split(",") if s.strip()]:
        ms = decode_ms_per_step(model, rows=args.num_prompts, slots=slots)
        print(f"  decode: {ms:.2f} ms/step at {slots} cache slots ({args.num_prompts} rows)", flush=True)
    if args.layouts:
        compare_layouts(model, prompts, args)
        return 0

    results: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        if args.save_dir is None:
            args.save_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="gen_bench_model_"))
        save_pretrained(model, args.save_dir)
        if args.tunix:  # the embedded sampler is measured there, interleaved with Tunix
            compared = compare_tunix(model, prompts, args, args.save_dir)
            if compared is None and "embedded" not in names:
                names.insert(0, "embedded")
            elif compared is not None:
                results["embedded"] = compared["rljax"]
                names = [n for n in names if n != "embedded"]
        for name in names:
            with contextlib.ExitStack() as engine_stack:  # each server is stopped before the next starts
                try:
                    engine = ENGINE_FACTORIES[name](model, args, engine_stack)
                except NotAvailable as e:
                    print(f"  {name}: not measured ({e})", flush=True)
                    continue
                best, rates = bench_engine(
                    engine, prompts, args.max_tokens, repeats=args.repeats, warmup=args.warmup
                )
            results[name] = best
            extra = ""
            if isinstance(engine, EmbeddedSampler):
                extra = f"; jit programs {engine.num_compilations()}"
            passes = ", ".join(f"{r:,.0f}" for r in rates)
            print(f"  {name}: {best:,.0f} generated tokens/s (passes: {passes}{extra}) "
                  f"[load average {_sibling('tunix_peer').load_average()}]", flush=True)  # fmt: skip
    if "embedded" in results:
        vllm_names = [n for n in results if n.startswith("vllm")]
        for name in vllm_names:
            print(f"  ratio embedded/{name}: {results['embedded'] / results[name]:.2f}x")
        if not vllm_names:
            print("  ratio embedded/vLLM: n/a (no vLLM engine measured)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
