"""Tinker API benchmark: the cost of the HTTP front door over the same work in-process.

1. training: ``forward_backward`` (cross_entropy, ``--datums`` datums of ``--len`` tokens) +
   ``optim_step`` through the real ``tinker`` SDK against an in-process server, vs the SAME jitted
   calls made directly on a :class:`~rljax.tinker.trainable.TrainableModel` (packing included).
   Goal: API / in-process <= 1.15x.
2. sampling: ``SamplingClient.sample`` (``--samples`` completions of ``--new`` tokens) through the API
   vs the embedded sampler's ``generate`` called directly on the same weights. ``--vllm``: the server
   runs ``configs/tinker_vllm.py`` (it launches one local vLLM server; the LoRA client has no
   unembedding adapter, so vLLM serves its sampling client) and the direct side sends the same
   requests straight to that vLLM server (rljax's ``VLLMClient``, the session's adapter name).

Both sides run after a warm-up (compilation excluded), ``--reps`` repetitions each, taking turns (API,
in-process, in-process, API, ...: on a shared machine a burst of load then hits both sides alike);
the best and the median of each side and their ratios are printed.

    python benchmarks/tinker_bench.py                # the tiny default model (configs/tinker.py)
    python benchmarks/tinker_bench.py --model30m     # a ~30M-parameter Qwen3-shaped model
    python benchmarks/tinker_bench.py --vllm         # sampling clients served by a local vLLM server
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np


def _interleaved(api: Callable[[], object], direct: Callable[[], object], reps: int) -> tuple[list, list]:
    """Seconds per call of ``api`` and ``direct``, after a warm-up (compilation), calls taking turns
    (ABBA: neither side always runs first)."""
    api(), direct()
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(reps):
        order = ((0, api), (1, direct)) if r % 2 == 0 else ((1, direct), (0, api))
        for side, fn in order:
            t0 = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - t0)
    return times


def _report(what: str, api: list[float], direct: list[float], name: str, goal: str = "") -> str:
    a, d = statistics.median(api), statistics.median(direct)
    return (
        f"{what}: API median {a * 1e3:.1f} ms (best {min(api) * 1e3:.1f}), {name} median "
        f"{d * 1e3:.1f} ms (best {min(direct) * 1e3:.1f}), ratio {a / d:.2f}x median, "
        f"{min(api) / min(direct):.2f}x best{goal}"
    )


MODEL30M = dict(
    hidden_size=512, intermediate_size=1536, num_layers=10, num_heads=8, num_kv_heads=4, head_dim=64
)


@contextlib.contextmanager
def _server_process(model30m: bool, port: int):
    """``rljax serve`` (same config) in its own process; yields its base URL."""
    import httpx

    repo = pathlib.Path(__file__).resolve().parents[1]
    flags = [f"--config.model.init.{k}={v}" for k, v in MODEL30M.items()] if model30m else []
    env = {**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rljax", "serve", "--config=tinker", f"--port={port}",
         f"--workdir={tempfile.mkdtemp(prefix='tinker_bench_proc_')}", *flags],
        cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"rljax.cli.serve exited with {proc.returncode}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--len", type=int, default=120)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--model30m", action="store_true", help="a ~30M-parameter model instead of the tiny one")
    ap.add_argument(
        "--server-process", action="store_true", help="the API side against rljax serve in its own process"
    )
    ap.add_argument("--vllm", action="store_true", help="serve sampling clients with a local vLLM server")
    args = ap.parse_args()
    if args.vllm and args.server_process:
        ap.error("--vllm and --server-process together would launch two vLLM servers; pick one")

    import tinker
    from tinker import types

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from rljax.inference.engine import SamplingParams
    from rljax.recipes import tinker as tinker_config
    from rljax.recipes import tinker_vllm
    from rljax.tinker import free_port, serve_in_thread
    from rljax.tinker.packing import Datum, pack_datums

    config = (tinker_vllm if args.vllm else tinker_config).get_config()
    if args.model30m:
        config.model.init.update(MODEL30M)
    srv = serve_in_thread(config, tempfile.mkdtemp(prefix="tinker_bench_"))
    stack = contextlib.ExitStack()
    try:
        url = (
            stack.enter_context(_server_process(args.model30m, free_port())) if args.server_process else None
        )
        local = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-bench")
        client = tinker.ServiceClient(base_url=url, api_key="tml-bench") if url else local
        base = srv.service.options.base_model
        lora = dict(rank=8, train_unembed=not args.vllm)  # vLLM serves no unembedding adapter
        tc = client.create_lora_training_client(base_model=base, **lora).result()
        # the in-process side's model (same seed and rank: the same adapter as the API's)
        tc_local = local.create_lora_training_client(base_model=base, **lora).result() if url else tc
        rng = np.random.default_rng(0)
        seqs = [rng.integers(3, 200, args.len + 1) for _ in range(args.datums)]
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints([int(t) for t in s[:-1]]),
                loss_fn_inputs={"target_tokens": np.asarray(s[1:], np.int64)},
            )
            for s in seqs
        ]
        adam = types.AdamParams(learning_rate=1e-4)

        def api_step() -> None:
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(adam)
            fb.result()
            opt.result()

        model = srv.service.models[tc_local.model_id]
        datums = [Datum(s[:-1].astype(np.int32), s[1:].astype(np.int32), {}) for s in seqs]

        def direct_step() -> None:
            packed = pack_datums(
                datums, float_inputs={"weights": 1.0}, min_len=srv.service.options.min_seq_len
            )
            model.forward("cross_entropy", packed.arrays, {}, packed.num_segments, backward=True)
            model.optim_step({"learning_rate": 1e-4})

        api, direct = _interleaved(api_step, direct_step, args.reps)
        where = "server process" if url else "server thread"
        what = f"[{where}] train step ({args.datums} x {args.len} tokens)"
        print(_report(what, api, direct, "in-process", " (goal <= 1.15x)"))

        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = [int(t) for t in seqs[0][:16]]
        params = types.SamplingParams(max_tokens=args.new, temperature=1.0, seed=1, stop=[])
        if url:
            tc_local.save_weights_and_get_sampling_client().result()
        session = next(
            s for s in srv.service.samplers.sessions.values() if s.model.model_id == tc_local.model_id
        )
        sp = [SamplingParams(max_tokens=args.new, temperature=1.0, seed=1 + i) for i in range(args.samples)]

        def direct_sample() -> None:
            async def run() -> None:
                await asyncio.gather(*(session.engine.generate(prompt, s) for s in sp))

            asyncio.run_coroutine_threadsafe(run(), session.loop).result()

        api_s, direct_s = _interleaved(
            lambda: sampler.sample(types.ModelInput.from_ints(prompt), args.samples, params).result(),
            direct_sample,
            args.reps,
        )
        engine = "vLLM server" if session.on_vllm else "embedded sampler"
        print(_report(f"sampling ({args.samples} x {args.new} tokens)", api_s, direct_s, engine))
    finally:
        stack.close()
        srv.stop()


if __name__ == "__main__":
    main()
