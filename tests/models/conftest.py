"""Shared helpers for the model tests: tiny random HF (torch) models and randomized rljax decoders.

torch/transformers are test-only references. Models are tiny (hidden 64, 2 layers, vocab 320) and
their weights are re-drawn with larger scales than the HF init so the distributions are far from
uniform and a wrong detail (bias, norm, RoPE scaling) changes the logprobs visibly.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import numpy as np
import pytest
from flax import nnx

VOCAB = 320

# One tiny config per family/feature under test (HF config kwargs).
HF_CONFIGS: dict[str, dict] = {
    # qwen2: q/k/v bias, no o bias; GQA 4 heads / 2 kv heads.
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    # qwen3: per-head q/k RMSNorm and an explicit head_dim (32 != 64 / 4).
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # llama with llama3 RoPE scaling (original context 16 << test lengths, so scaling matters), GQA 4:1.
    "llama3": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=500.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # llama with linear RoPE scaling.
    "llama_linear": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=4,
        rope_theta=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.5},
    ),
}


def hf_config_dict(name: str, *, tied: bool) -> dict:
    """A full HF config dict for one of :data:`HF_CONFIGS`."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        **HF_CONFIGS[name],
    )


def make_hf_model(name: str, *, tied: bool, seed: int = 0):
    """A float32 transformers model of config ``name`` with re-drawn random weights (eager attention)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    kwargs = hf_config_dict(name, tied=tied)
    model_type = kwargs.pop("model_type")
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
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
            else:
                p.copy_(0.15 * noise)
    return model


def hf_token_logprobs(model, tokens: np.ndarray, *, temperature: float | np.ndarray = 1.0) -> np.ndarray:
    """float64 reference ``out[b, t] = log softmax(logits[b, t-1] / tau[b, t])[tokens[b, t]]``, 0 at t = 0.

    Computed in numpy from the HF model's logits, independently of rljax.
    """
    logits = hf_logits(model, tokens)
    tau = np.broadcast_to(np.asarray(temperature, np.float64), tokens.shape)
    z = logits[:, :-1] / tau[:, 1:, None]
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    out = np.zeros(tokens.shape, np.float64)
    out[:, 1:] = np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return out


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float64 copy of the HF model's float32 logits ``[B, L, V]`` (default positions, no padding)."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.double().numpy()


def random_decoder(config, *, seed: int = 0, **decoder_kwargs) -> nnx.Module:
    """An rljax Decoder with every parameter drawn at non-trivial scales (see rljax.models.tiny)."""
    from rljax.models.tiny import random_decoder as draw

    return draw(config, seed=seed, **decoder_kwargs)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Callable[[str, bool], tuple[object, str]]:
    """``hf_checkpoint(name, tied) -> (hf_model, directory)``, built once per session (saved by HF)."""
    cache: dict[tuple[str, bool], tuple[object, str]] = {}

    def get(name: str, tied: bool) -> tuple[object, str]:
        if (name, tied) not in cache:
            model = make_hf_model(name, tied=tied)
            path = os.fspath(tmp_path_factory.mktemp(f"hf_{name}_{'tied' if tied else 'untied'}"))
            model.save_pretrained(path)
            cache[(name, tied)] = (model, path)
        return cache[(name, tied)]

    return get


@pytest.fixture(scope="session")
def helpers() -> types.SimpleNamespace:
    """The helper functions of this file, for test modules (conftest is not importable by name)."""
    return types.SimpleNamespace(
        make_hf_model=make_hf_model,
        hf_config_dict=hf_config_dict,
        hf_token_logprobs=hf_token_logprobs,
        hf_logits=hf_logits,
        random_decoder=random_decoder,
    )
