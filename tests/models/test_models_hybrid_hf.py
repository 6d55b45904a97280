"""Parity with HF transformers (torch float32) for Qwen3.5 (dense, MoE) and Qwen3-Next (MoE): tiny
random checkpoints written by transformers load in rljax, and ones written by rljax load in
transformers, with equal logprobs on rows of 150 tokens (3 chunks of the delta rule) and on a
packed row (rljax) against each sample run alone (transformers).

References are float64 numpy log-softmaxes of the HF model's logits, never rljax's.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import lora

VOCAB = 320
LENGTH = 150
ATOL = 1e-4  # the bound; measured <= 1.9e-5 (MoE) and <= 8e-6 (dense), |logp| up to ~15

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-5,
               max_position_embeddings=512)  # fmt: skip
_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=96)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _MOE),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=96, **_MOE)),
}


def _hf_model(family: str):
    """A float32 transformers model with every weight re-drawn at a visible scale (eager attention)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**_COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * noise)  # a plain scale
            elif "norm" in name:
                p.copy_(0.2 * noise)  # zero-centered: the scale is 1 + w
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


def _hf_logprobs(model, tokens: np.ndarray) -> np.ndarray:
    """float64 ``log softmax(logits[t - 1])[tokens[t]]`` of each row alone, 0 at t = 0."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()
    z = logits[:, :-1] - logits[:, :-1].max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    out = np.zeros(tokens.shape)
    out[:, 1:] = np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return out


def _check_parity(hf_model, model) -> float:
    """Two rows of 150 tokens and one packed row of samples of 40, 70 and 30 tokens (+ 10 padding)
    through rljax (one call); each against transformers on the row / sample alone. Returns the max
    abs difference."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, VOCAB, size=(2, LENGTH))
    lengths = (40, 70, 30)
    samples = [rng.integers(0, VOCAB, n) for n in lengths]
    packed = np.concatenate(samples + [np.zeros(LENGTH - sum(lengths), np.int64)])
    seg_packed = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(10, np.int64)])
    tokens = np.concatenate([rows, packed[None]])
    segments = np.concatenate([np.ones_like(rows), seg_packed[None]])
    got = np.asarray(models.sequence_logprobs(model, jnp.asarray(tokens), segment_ids=jnp.asarray(segments)))
    want = _hf_logprobs(hf_model, rows)
    worst = np.abs(got[:2] - want).max()
    start = 0
    for s in samples:
        alone = _hf_logprobs(hf_model, s[None])[0]
        worst = max(worst, np.abs(got[2, start + 1 : start + len(s)] - alone[1:]).max())
        start += len(s)
    assert np.abs(want[:, 1:]).mean() > 1.0  # peaked, far from uniform: the check has teeth
    return float(worst)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoints_round_trip_through_transformers_with_equal_logprobs(family, tmp_path):
    """transformers saves -> rljax loads (logprob parity) -> rljax saves -> transformers loads the
    same architecture and weights (parameters bit-equal to the original's, logprob parity)."""
    import torch
    import transformers

    hf_model = _hf_model(family)
    hf_model.save_pretrained(tmp_path / "hf")
    model = models.from_pretrained(tmp_path / "hf")
    assert model.config.linear_layers == (0,) and model.config.is_moe == (family != "qwen3_5")
    worst = _check_parity(hf_model, model)
    print(f"{family}: transformers checkpoint -> rljax, max |logp diff| = {worst:.2e}")
    assert worst <= ATOL
    models.save_pretrained(model, tmp_path / "rljax")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(tmp_path / "rljax"), attn_implementation="eager"
    ).eval()
    assert type(again).__name__ == FAMILIES[family][1]
    want = dict(hf_model.named_parameters())
    got = dict(again.named_parameters())
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    worst = _check_parity(again, model)
    print(f"{family}: rljax checkpoint -> transformers, max |logp diff| = {worst:.2e}")
    assert worst <= ATOL


@pytest.mark.parametrize(
    "family, targets",
    [
        ("qwen3_5", ["q_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]),
        ("qwen3_next", ["q_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"]),
    ],
)
def test_peft_lora_on_attention_and_deltanet_projections_round_trips(family, targets, tmp_path):
    """A peft adapter (random A and B) on the attention and Gated DeltaNet projections loads in rljax
    with peft's logprobs; rljax writes it back in peft's format, which peft loads with the same
    logprobs; merged into the base it is a plain checkpoint that transformers serves the same."""
    import peft
    import torch
    import transformers

    base = _hf_model(family)
    base.save_pretrained(tmp_path / "base")
    ref = peft.get_peft_model(_hf_model(family), peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    ref.save_pretrained(tmp_path / "peft")
    tokens = np.random.default_rng(4).integers(0, VOCAB, size=(2, 80))
    want = _hf_logprobs(ref.eval(), tokens)
    model = models.from_pretrained(tmp_path / "base", adapter=tmp_path / "peft")
    got = np.asarray(models.sequence_logprobs(model, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    base_only = np.asarray(
        models.sequence_logprobs(models.from_pretrained(tmp_path / "base"), jnp.asarray(tokens))
    )
    assert np.abs(base_only - want).max() > 1e-2  # the adapter matters: the comparison can fail
    lora.save_adapter(model, tmp_path / "rljax", base_model_name_or_path=str(tmp_path / "base"))
    again = peft.PeftModel.from_pretrained(_hf_model(family), tmp_path / "rljax").eval()
    np.testing.assert_allclose(_hf_logprobs(again, tokens), want, atol=1e-6, rtol=0)
    models.save_pretrained(lora.merge_lora(model), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="eager"
    )
    np.testing.assert_allclose(_hf_logprobs(merged.eval(), tokens), want, atol=ATOL, rtol=0)
