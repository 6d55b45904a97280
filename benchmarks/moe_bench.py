"""MoE benchmark: grouped expert compute vs a dense FFN of equal ACTIVE parameters and vs
the naive all-experts computation, forward + backward, tokens/s.

The workload is a stack of ``L`` pre-norm residual feed-forward layers (no attention, so the
feed-forward is all that is timed), ``N`` tokens of width ``H``:

* moe (grouped): router + top-k of ``E`` SwiGLU experts of width ``I`` each, through
  :func:`rljax.models.moe.moe_ffn` with ``impl`` = the backend default ("tiled" on CPU, "ragged"
  = ``jax.lax.ragged_dot`` on GPU / TPU) - only the ``N * k`` routed pairs are computed;
* dense: one SwiGLU of width ``k * I`` (the same active parameters per token, ``3 * H * k * I``);
* naive: every expert on every token (``impl="dense"``), weighted by the sparse gate matrix.

Goal: moe tokens/s >= 0.6 x dense tokens/s. Prints each figure (best of ``--repeats`` rounds, the
kinds interleaved round by round so that load from other processes hits them alike) and the ratios,
also the median of the per-round ratios (the steadier figure on a shared machine).

    python benchmarks/moe_bench.py                 # E=32, k=4 (and E=64, k=8)
    python benchmarks/moe_bench.py --quick         # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from rljax.models import moe

GOAL_RATIO = 0.6


def _rmsnorm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def make_params(key, *, layers, hidden, experts, inter, top_k, kind):
    keys = iter(jax.random.split(key, 8 * layers))
    s = 0.02
    out = []
    for _ in range(layers):
        if kind == "dense":
            w = inter * top_k
            out.append(
                dict(
                    gate=s * jax.random.normal(next(keys), (hidden, w)),
                    up=s * jax.random.normal(next(keys), (hidden, w)),
                    down=s * jax.random.normal(next(keys), (w, hidden)),
                )
            )
        else:
            out.append(
                dict(
                    router=jax.random.normal(next(keys), (hidden, experts)),
                    gate=s * jax.random.normal(next(keys), (experts, hidden, inter)),
                    up=s * jax.random.normal(next(keys), (experts, hidden, inter)),
                    down=s * jax.random.normal(next(keys), (experts, inter, hidden)),
                )
            )
    return out


def forward(params, x, *, kind, top_k):
    for p in params:
        h = _rmsnorm(x)
        if kind == "dense":
            y = (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
        else:
            ids, w = moe.route(h @ p["router"], top_k, norm_topk_prob=True)
            impl = "dense" if kind == "naive" else "auto"
            y = moe.moe_ffn(h, ids, w, p["gate"], p["up"], p["down"], impl=impl)
        x = x + y
    return x


def make_step(kind, *, tokens, hidden, experts, inter, top_k, layers):
    """A compiled fwd+bwd step of ``kind`` and its arguments (compiled and warmed up)."""
    params = make_params(jax.random.key(0), layers=layers, hidden=hidden, experts=experts, inter=inter,
                         top_k=top_k, kind=kind)  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (tokens, hidden))

    @jax.jit
    def step(params, x):
        return jax.value_and_grad(lambda p: jnp.mean(forward(p, x, kind=kind, top_k=top_k) ** 2))(params)

    jax.block_until_ready(step(params, x))
    return step, (params, x)


def time_steps(kinds, *, repeats, **sizes):
    """Seconds per step of each kind, ``repeats`` rounds INTERLEAVED (one step of each kind per
    round), so that a busy machine slows every kind alike. Returns ``{kind: [seconds per round]}``."""
    steps = {kind: make_step(kind, **sizes) for kind in kinds}
    times = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind, (step, args) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(*args))
            times[kind].append(time.perf_counter() - t0)
    return times


def run(*, tokens, hidden, experts, inter, top_k, layers, repeats, naive=True):
    sizes = dict(tokens=tokens, hidden=hidden, experts=experts, inter=inter, top_k=top_k, layers=layers)
    print(
        f"\n== {layers} layers, N={tokens} tokens, H={hidden}, E={experts} experts of I={inter}, top-{top_k} "
        f"(dense width {top_k * inter}); backend {jax.default_backend()}, moe impl {moe.default_impl()}"
    )
    times = time_steps(("moe", "dense", "naive") if naive else ("moe", "dense"), repeats=repeats, **sizes)
    tps = {kind: tokens / min(t) for kind, t in times.items()}  # best round
    moe_tps, dense_tps = tps["moe"], tps["dense"]
    print(f"moe (grouped)  fwd+bwd {moe_tps:12,.0f} tokens/s")
    print(f"dense (=active){'':4}fwd+bwd {dense_tps:12,.0f} tokens/s")
    ratio = moe_tps / dense_tps
    verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
    print(f"moe / dense    {ratio:.2f}x   (goal >= {GOAL_RATIO}x: {verdict})")
    per_round = sorted(d / m for d, m in zip(times["dense"], times["moe"], strict=True))
    print(f"moe / dense per round: median {statistics.median(per_round):.2f}x (min {per_round[0]:.2f}x, "
          f"max {per_round[-1]:.2f}x)")  # fmt: skip
    if naive:
        naive_tps = tps["naive"]
        print(f"naive all-experts fwd+bwd {naive_tps:9,.0f} tokens/s")
        print(f"moe / naive    {moe_tps / naive_tps:.2f}x")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        run(tokens=1024, hidden=128, experts=16, inter=64, top_k=2, layers=2, repeats=args.repeats)
        return
    run(tokens=4096, hidden=512, experts=32, inter=256, top_k=4, layers=4, repeats=args.repeats)
    run(tokens=4096, hidden=512, experts=64, inter=128, top_k=8, layers=4, repeats=args.repeats)


if __name__ == "__main__":
    main()
