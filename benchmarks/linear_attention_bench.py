"""Gated DeltaNet vs full attention: training throughput of the same layer count at long rows.

Two decoders of the Qwen3.5 family, identical but for the token mixer of every layer: ``L`` Gated
DeltaNet layers (:mod:`rljax.models.linear_attention`: chunked delta rule, chunks of 64) or ``L`` gated
full-attention layers (rljax's XLA causal blocks). Each is timed on a training step (value and gradient
of the summed token logprobs, jitted) of one row of ``T`` tokens, for ``T`` in 4k and 16k; tokens/s
are the best of ``--repeats`` rounds, the kinds interleaved round by round. The run prints both and
their ratio (DeltaNet / attention), then where the DeltaNet layer's time goes: forward + backward of
the whole layer alone and of its parts alone (projections, the causal convolution, the chunked delta
rule and, inside it, the chunk-local UT transform; the rest of the layer is elementwise: norms,
gates, the L2 normalization), next to the full-attention core at the same length.

    python benchmarks/linear_attention_bench.py                 # L=2, hidden 256, T = 4096, 16384
    python benchmarks/linear_attention_bench.py --quick         # T = 1024, 2048 (a smoke run)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import models
from rljax.models import delta_rule
from rljax.models.attention_backends import self_attention
from rljax.models.linear_attention import GatedDeltaNet
from rljax.models.tiny import tiny_config

KINDS = ("linear_attention", "full_attention")


def make_config(kind: str, *, layers: int, hidden: int):
    heads = hidden // 64
    return tiny_config(
        "qwen3_5_text", vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=max(heads // 2, 1), head_dim=64, partial_rotary_factor=0.25,
        layer_types=(kind,) * layers, linear_num_key_heads=max(heads // 2, 1), linear_num_value_heads=heads,
        linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=1 << 16,
    )  # fmt: skip


def train_step_fn(config):
    graphdef, params = nnx.split(models.Decoder(config, rngs=nnx.Rngs(0)))

    @jax.jit
    def step(p, tokens):
        def loss(p):
            return -jnp.sum(models.sequence_logprobs(nnx.merge(graphdef, p), tokens))

        return jax.value_and_grad(loss)(p)

    return step, params


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def fwd_bwd(f, num_args: int):
    """jit of (value, grad) of ``sum(f(*args))`` w.r.t. all ``num_args`` arguments."""
    total = lambda *a: sum(jnp.sum(o) for o in jax.tree.leaves(f(*a)))  # noqa: E731
    return jax.jit(jax.value_and_grad(total, argnums=tuple(range(num_args))))


def parts(config, length: int, repeats: int) -> dict[str, float]:
    """Seconds (best of ``repeats``) of forward + backward of the DeltaNet layer's parts alone, on one
    row of ``length`` tokens, and of the full-attention core at the same length."""
    c = config
    rng = np.random.default_rng(0)
    hk, hv, dk, dv = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )
    conv_dim = 2 * hk * dk + hv * dv
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    x, w_in = f(1, length, c.hidden_size), f(c.hidden_size, conv_dim + hv * dv + 2 * hv) * 0.05
    w_out, w_conv = f(hv * dv, c.hidden_size) * 0.05, f(4, conv_dim)
    seg = jnp.ones((1, length), jnp.int32)
    q = delta_rule.l2_normalize(f(1, length, hv, dk)) * dk**-0.5
    k = delta_rule.l2_normalize(f(1, length, hv, dk))
    v, g = f(1, length, hv, dv), -jnp.abs(f(1, length, hv)) * 0.1
    beta = jax.nn.sigmoid(f(1, length, hv))
    resets = delta_rule.sample_resets(seg)
    n = length // delta_rule.DEFAULT_DELTA_CHUNK_SIZE
    a = jnp.tril(f(1, hv, n, 64, 64) * 0.05, -1)
    qa, ka, va = (
        f(1, length, c.num_heads, 64),
        f(1, length, c.num_kv_heads, 64),
        f(1, length, c.num_kv_heads, 64),
    )
    xc = x[..., :1] * f(1, 1, conv_dim)
    proj = lambda x, wi, wo: (x @ wi)[..., : hv * dv] @ wo  # noqa: E731
    conv = lambda y, w: delta_rule.causal_conv1d(y, w, seg)  # noqa: E731
    rule = lambda q, k, v, g, b: delta_rule.gated_delta_rule_chunked(q, k, v, g, b, resets)  # noqa: E731
    attn = lambda q, k, v: self_attention(q, k, v, segment_ids=seg, backend="xla", max_block_size=1024)  # noqa: E731
    layer = GatedDeltaNet(c, dtype=jnp.float32, param_dtype=jnp.float32, precision=None, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    whole = lambda p, x: nnx.merge(graphdef, p)(x, segment_ids=seg)[0]  # noqa: E731
    pieces = {
        "the whole DeltaNet layer": (fwd_bwd(whole, 2), (params, x)),
        "projections (in + out)": (fwd_bwd(proj, 3), (x, w_in, w_out)),
        "causal conv1d": (fwd_bwd(conv, 2), (xc, w_conv)),
        "UT transform (I + A)^-1": (fwd_bwd(delta_rule.unit_lower_inverse, 1), (a,)),
        "chunked delta rule (all)": (fwd_bwd(rule, 5), (q, k, v, g, beta)),
        "full-attention core": (fwd_bwd(attn, 3), (qa, ka, va)),
    }
    out = {}
    for name, (fn, args) in pieces.items():
        timed(fn, *args)  # compile
        out[name] = min(timed(fn, *args) for _ in range(repeats))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="T = 1024, 2048, 2 repeats")
    args = p.parse_args()
    lengths, repeats = ([1024, 2048], 2) if args.quick else (args.lengths, args.repeats)
    print(f"devices: {jax.devices()}; L={args.layers} layers, hidden {args.hidden}, head dims 64")
    for length in lengths:
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, length)), jnp.int32)
        steps = {
            kind: train_step_fn(make_config(kind, layers=args.layers, hidden=args.hidden)) for kind in KINDS
        }
        best = {}
        for kind, (step, params) in steps.items():
            compile_s = timed(step, params, tokens)
            print(f"T={length:6d} {kind:17s} first step (compile + run) {compile_s:7.1f} s")
        for _ in range(repeats):  # interleaved rounds: load from other processes hits both alike
            for kind, (step, params) in steps.items():
                best[kind] = min(best.get(kind, np.inf), timed(step, params, tokens))
        for kind in KINDS:
            rate = length / best[kind]
            print(f"T={length:6d} {kind:17s} train step {best[kind]:7.3f} s  {rate:9.0f} tokens/s")
        ratio = best["full_attention"] / best["linear_attention"]
        print(f"T={length:6d} throughput ratio DeltaNet / full attention = {ratio:.2f}x")
        times = parts(make_config("linear_attention", layers=1, hidden=args.hidden), length, repeats)
        per_layer = best["linear_attention"] / args.layers
        print(f"T={length:6d} where a DeltaNet layer's time goes (fwd + bwd of each part alone; "
              f"whole train step / layers = {per_layer:.3f} s):")  # fmt: skip
        for name, seconds in times.items():
            print(f"    {name:28s} {seconds:7.3f} s")


if __name__ == "__main__":
    main()
