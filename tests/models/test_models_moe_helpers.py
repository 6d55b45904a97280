"""Helpers (no tests) for test_models_moe*.py: tiny random Qwen2-MoE / Qwen3-MoE models
(transformers is the test-only reference)."""

from __future__ import annotations

import numpy as np

VOCAB = 320

#: HF config kwargs of the tiny MoE variants under test (hidden 64, 3 layers).
MOE_CONFIGS: dict[str, dict] = {
    # qwen3_moe, top-2 of 8, renormalized gates, layer 1 dense (mlp_only_layers).
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # qwen3_moe, top-3 of 6, raw softmax gates, every second layer sparse (decoder_sparse_step=2).
    "qwen3_moe_step2_nonorm": dict(
        model_type="qwen3_moe",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
    # qwen2_moe: q/k/v bias, gated shared expert, raw softmax gates.
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
    ),
    # qwen2_moe with renormalized gates, layer 0 dense.
    "qwen2_moe_norm": dict(
        model_type="qwen2_moe",
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
}


def hf_config_dict(name: str, *, tied: bool = False) -> dict:
    """A full HF config dict for one of :data:`MOE_CONFIGS`."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        **MOE_CONFIGS[name],
    )


def make_hf_moe(name: str, *, tied: bool = False, seed: int = 0):
    """A float32 transformers MoE model with re-drawn weights at visible scales (eager attention)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    kwargs = hf_config_dict(name, tied=tied)
    model_type = kwargs.pop("model_type")
    config_cls, model_cls = {
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[model_type]
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * noise)
            elif pname.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in pname:
                p.copy_(0.5 * noise)
            elif pname.endswith("mlp.gate.weight"):
                p.copy_(0.3 * noise)  # router: clearly separated top-k choices
            else:
                p.copy_(0.15 * noise)
    return model


def random_tokens(seed: int, shape: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=shape).astype(np.int32)
