"""LoRA adapters: zero-init equals the base exactly; PEFT files round-trip with peft + transformers.

References are independent of rljax: ``peft`` wraps a transformers model (torch, float32) with a
random adapter; its logprobs (float64 numpy from its logits) must equal rljax's with the same
adapter loaded from peft's own files, and an adapter rljax writes must load in peft.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.models import lora

FAMILIES = ["qwen3", "qwen2", "llama3"]


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 200, size=(2, 16))


def _peft_model(helpers, name: str, *, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    import peft
    import torch

    base = helpers.make_hf_model(name, tied=False, seed=seed)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(lora.DEFAULT_TARGETS), lora_dropout=0.0
    )
    model = peft.get_peft_model(base, cfg).eval()
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # a non-trivial adapter: B = 0 would make the test blind
        for pname, p in model.named_parameters():
            if "lora_B" in pname or "lora_A" in pname:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_zero_init_adapter_leaves_logprobs_unchanged(helpers, hf_checkpoint, name):
    _, path = hf_checkpoint(name, False)
    base = models.from_pretrained(path)
    tokens = _tokens()
    want = np.asarray(models.sequence_logprobs(base, tokens))
    adapted = lora.apply_lora(models.from_pretrained(path), lora.LoRAConfig(rank=4), rngs=nnx.Rngs(3))
    assert len(nnx.to_flat_state(lora.lora_state(adapted))) == 2 * 7 * adapted.config.num_layers
    np.testing.assert_array_equal(np.asarray(models.sequence_logprobs(adapted, tokens)), want)


@pytest.mark.parametrize("name", FAMILIES)
def test_peft_adapter_loads_and_matches_peft(helpers, tmp_path, name):
    ref = _peft_model(helpers, name)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    ref.save_pretrained(adapter_dir)  # the adapter in peft's own format
    helpers.make_hf_model(name, tied=False, seed=0).save_pretrained(base_dir)  # the same base, alone
    tokens = _tokens(1)
    want = helpers.hf_token_logprobs(ref, tokens)
    got = np.asarray(models.sequence_logprobs(models.from_pretrained(base_dir, adapter=adapter_dir), tokens))
    np.testing.assert_allclose(got, want, **LOGPROB_TOL)
    base_only = np.asarray(models.sequence_logprobs(models.from_pretrained(base_dir), tokens))
    assert np.abs(base_only - want).max() > 1e-2  # the adapter matters: the comparison can fail


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_rljax_adapter_loads_in_peft_and_merges(helpers, tmp_path, name):
    import peft

    base_hf = helpers.make_hf_model(name, tied=False, seed=2)
    base_hf.save_pretrained(tmp_path / "base")
    model = models.from_pretrained(tmp_path / "base")
    lora.apply_lora(model, lora.LoRAConfig(rank=3, alpha=6.0, targets=("q_proj", "v_proj", "down_proj")),
                    rngs=nnx.Rngs(5))  # fmt: skip
    for _, var in nnx.to_flat_state(lora.lora_state(model)):  # give B non-zero values too
        var.set_value(var.get_value() + 0.1)
    lora.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    meta = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG_FILE).read_text())
    assert meta["r"] == 3 and meta["lora_alpha"] == 6.0 and meta["peft_type"] == "LORA"
    tokens = _tokens(2)
    ours = np.asarray(models.sequence_logprobs(model, tokens))
    theirs = peft.PeftModel.from_pretrained(
        helpers.make_hf_model(name, tied=False, seed=2), tmp_path / "adapter"
    )
    np.testing.assert_allclose(ours, helpers.hf_token_logprobs(theirs.eval(), tokens), **LOGPROB_TOL)
    merged = lora.merge_lora(model)
    assert not nnx.to_flat_state(lora.lora_state(merged))
    np.testing.assert_allclose(np.asarray(models.sequence_logprobs(merged, tokens)), ours, **LOGPROB_TOL)
    models.save_pretrained(merged, tmp_path / "merged")  # plain HF weights: no adapter names
    np.testing.assert_allclose(
        helpers.hf_token_logprobs(type(base_hf).from_pretrained(tmp_path / "merged").eval(), tokens),
        ours,
        **LOGPROB_TOL,
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "rank must be an int >= 1"),
        (dict(alpha=-1.0), "alpha must be a finite number > 0"),
        (dict(targets=("nope",)), "targets must be a non-empty subset"),
        (dict(dropout=0.1), "dropout > 0 is not supported"),
    ],
)
def test_bad_lora_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lora.LoRAConfig(**kwargs)


def test_embedded_sampler_samples_with_the_adapter():
    import asyncio

    from rljax.inference import EmbeddedSampler
    from rljax.inference.engine import SamplingParams

    model = models.tiny_model(vocab_size=64, seed=0)
    lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
    for _, var in nnx.to_flat_state(lora.lora_state(model)):
        var.set_value(var.get_value() + 0.5)  # an adapter that changes the distribution
    prompt = [1, 2, 3, 4]
    out = asyncio.run(EmbeddedSampler(model).generate(prompt, SamplingParams(max_tokens=6, seed=3)))
    seq = np.asarray([prompt + list(out.ids)])
    with_adapter = np.asarray(models.sequence_logprobs(model, seq))[0, len(prompt) :]
    np.testing.assert_allclose(out.logprobs, with_adapter, **LOGPROB_TOL)
    without = np.asarray(models.sequence_logprobs(_strip(model), seq))
    assert np.abs(without[0, len(prompt) :] - with_adapter).max() > 1e-3


def _strip(model):
    """The base model alone (adapter removed) — for the can-fail check above."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    for _, lin in lora._targeted(copy, lora.DEFAULT_TARGETS):
        del lin.lora_a, lin.lora_b, lin.lora_scale
    return copy
