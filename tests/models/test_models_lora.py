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
from rljax.models.tiny import random_decoder

FAMILIES = ["qwen3", "qwen2", "llama3"]


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 200, size=(2, 16))


def _peft_model(helpers, name: str, *, rank: int = 4, alpha: float = 8.0, seed: int = 0, **extra):
    import peft
    import torch

    base = helpers.make_hf_model(name, tied=False, seed=seed)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(lora.DEFAULT_TARGETS), lora_dropout=0.0, **extra
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


def test_rslora_adapter_round_trips_with_peft(helpers, tmp_path):
    """Rank-stabilized LoRA (scale alpha / sqrt(r)), with a rank of its own on one target."""
    import peft

    ref = _peft_model(helpers, "qwen3", use_rslora=True, rank_pattern={"v_proj": 9})
    ref.save_pretrained(tmp_path / "adapter")
    helpers.make_hf_model("qwen3", tied=False, seed=0).save_pretrained(tmp_path / "base")
    tokens = _tokens(3)
    want = helpers.hf_token_logprobs(ref, tokens)
    model = models.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    assert model.lora_config.rslora and model.lora_config.target_ranks == {"v_proj": 9}
    attn = model.layers[0].self_attn
    assert (attn.q_proj.lora_scale, attn.v_proj.lora_scale) == (8.0 / 2.0, 8.0 / 3.0)  # alpha / sqrt(r)
    np.testing.assert_allclose(np.asarray(models.sequence_logprobs(model, tokens)), want, **LOGPROB_TOL)
    lora.save_adapter(model, tmp_path / "again")
    theirs = peft.PeftModel.from_pretrained(
        helpers.make_hf_model("qwen3", tied=False, seed=0), tmp_path / "again"
    )
    np.testing.assert_allclose(helpers.hf_token_logprobs(theirs.eval(), tokens), want, **LOGPROB_TOL)
    meta = json.loads((tmp_path / "again" / lora.ADAPTER_CONFIG_FILE).read_text())
    (tmp_path / "again" / lora.ADAPTER_CONFIG_FILE).write_text(json.dumps(meta | {"use_rslora": False}))
    plain = models.from_pretrained(tmp_path / "base", adapter=tmp_path / "again")  # alpha / r instead
    assert np.abs(np.asarray(models.sequence_logprobs(plain, tokens)) - want).max() > 1e-2  # it can fail


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
        (dict(rank=0), "rank: expected an int >= 1"),
        (dict(alpha=-1.0), "alpha: expected a number > 0"),
        (dict(targets=("nope",)), "targets: expected a non-empty subset"),
        (dict(dropout=0.1), "dropout: > 0 is not supported"),
    ],
)
def test_bad_lora_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lora.LoRAConfig(**kwargs)


def test_embedded_sampler_samples_with_the_adapter():
    model = models.tiny_model(vocab_size=64, seed=0)
    lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
    for _, var in nnx.to_flat_state(lora.lora_state(model)):
        var.set_value(var.get_value() + 0.5)  # an adapter that changes the distribution
    _assert_sampler_uses_the_adapter(model)


def _assert_sampler_uses_the_adapter(model) -> None:
    """The embedded sampler's logprobs equal the adapted model's forward, and differ from the base's."""
    import asyncio

    from rljax.inference import EmbeddedSampler
    from rljax.inference.engine import SamplingParams

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
        if getattr(lin, "lora_a", None) is not None:
            del lin.lora_a, lin.lora_b, lin.lora_scale
    if getattr(copy, "lm_head_lora", None) is not None:
        del copy.lm_head_lora
    return copy


# ------------------------------------------------------------------------------------------------
# The unembedding adapter (target "lm_head")
# ------------------------------------------------------------------------------------------------


def _unembed_model(tied: bool, *, targets=("lm_head",), seed: int = 0):
    """A peaked tiny model with an output-projection adapter whose B is non-zero (rank 3, alpha 6)."""
    import jax

    cfg = models.tiny_config(vocab_size=48, tie_word_embeddings=tied)
    model = random_decoder(cfg, seed=seed)
    lora.apply_lora(model, lora.LoRAConfig(rank=3, alpha=6.0, targets=targets), rngs=nnx.Rngs(seed + 1))
    b = model.lm_head_lora.lora_b
    b[...] = 0.7 * jax.random.normal(jax.random.key(seed + 2), b.shape)
    return model


def _np_log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("tied", [True, False])
def test_unembed_adapter_matches_a_float64_reference(tied):
    """logits = h (W_out + (alpha/r) A B) in float64 numpy (PEFT's W + s B A in its [out, in] layout)
    from the model's hidden states: Decoder.logits, sequence_logprobs and the chunked logprob
    function with several chunks agree; the gradient of sum(logp) w.r.t. A and B equals the analytic
    one, (alpha/r) h^T (onehot - p) B^T and (alpha/r) (h A)^T (onehot - p)."""
    import jax
    import jax.numpy as jnp

    model = _unembed_model(tied)
    tokens = np.random.default_rng(3).integers(0, 48, size=(1, 12))
    h = np.asarray(model.hidden_states(jnp.asarray(tokens)).hidden, np.float64)[0]
    w = (
        np.asarray(model.embed_tokens[...], np.float64).T
        if tied
        else np.asarray(model.lm_head.kernel[...], np.float64)
    )
    a = np.asarray(model.lm_head_lora.lora_a[...], np.float64)
    b = np.asarray(model.lm_head_lora.lora_b[...], np.float64)
    z = h @ (w + 2.0 * a @ b)  # scale = alpha / r = 6 / 3
    logp = _np_log_softmax(z)
    want = logp[np.arange(11), tokens[0, 1:]]
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens)))[0], z, atol=2e-5, rtol=2e-5)
    got = np.asarray(models.sequence_logprobs(model, jnp.asarray(tokens), chunk_size=4))[0, 1:]
    np.testing.assert_allclose(got, want, **LOGPROB_TOL)
    base = np.asarray(models.sequence_logprobs(_strip(model), jnp.asarray(tokens)))[0, 1:]
    assert np.abs(base - want).max() > 1e-2  # the adapter matters: the comparison can fail

    hidden = jnp.asarray(h[:-1], jnp.float32)
    targets = jnp.asarray(tokens[0, 1:])

    def total(ab):
        adapter = model.unembedding_lora()._replace(a=ab[0], b=ab[1])
        lp, _ = models.token_logprobs_and_entropy(
            hidden, model.unembedding(), targets, jnp.ones(11), chunk_size=4, unembedding_lora=adapter
        )
        return lp.sum()

    ga, gb = jax.grad(total)((jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))
    resid = -np.exp(logp[:-1])
    resid[np.arange(11), tokens[0, 1:]] += 1.0  # d sum(logp) / dz = onehot - p
    np.testing.assert_allclose(np.asarray(ga), 2.0 * h[:-1].T @ resid @ b.T, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(gb), 2.0 * (h[:-1] @ a).T @ resid, atol=1e-4, rtol=1e-4)


def test_unembed_adapter_of_a_tied_model_leaves_the_input_embedding():
    """Tied: the adapter changes the output projection only (the embedding rows the model reads are
    the base's), and merging unties the model with the same logprobs; its HF files load in
    transformers as an untied model with those logprobs."""
    import jax.numpy as jnp

    model = _unembed_model(True, seed=4)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 48, size=(2, 10)))
    stripped = _strip(model)
    np.testing.assert_array_equal(
        np.asarray(model.hidden_states(tokens).hidden), np.asarray(stripped.hidden_states(tokens).hidden)
    )
    ours = np.asarray(models.sequence_logprobs(model, tokens))
    merged = lora.merge_lora(model)
    assert merged.config.tie_word_embeddings is False and model.config.tie_word_embeddings is True
    assert merged.lm_head is not None and not nnx.to_flat_state(lora.lora_state(merged))
    np.testing.assert_array_equal(np.asarray(merged.embed_tokens[...]), np.asarray(model.embed_tokens[...]))
    np.testing.assert_allclose(np.asarray(models.sequence_logprobs(merged, tokens)), ours, **LOGPROB_TOL)


@pytest.mark.parametrize("tied", [True, False])
def test_unembed_adapter_round_trips_with_peft(helpers, tmp_path, tied):
    """An rljax adapter on q_proj + lm_head loads in peft (PEFT's ``lm_head`` module, tied or not)
    with the same logprobs, and reads back into rljax; the merged model saves as plain HF weights."""
    import jax
    import peft
    import transformers

    base_hf = helpers.make_hf_model("qwen3", tied=tied, seed=6)
    base_hf.save_pretrained(tmp_path / "base")
    model = models.from_pretrained(tmp_path / "base")
    lora.apply_lora(
        model, lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "lm_head")), rngs=nnx.Rngs(7)
    )
    for i, (_, var) in enumerate(nnx.to_flat_state(lora.lora_state(model))):
        var.set_value(var.get_value() + 0.3 * jax.random.normal(jax.random.key(i), var.get_value().shape))
    lora.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    meta = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG_FILE).read_text())
    assert sorted(meta["target_modules"]) == ["lm_head", "q_proj"]
    tokens = _tokens(3)
    ours = np.asarray(models.sequence_logprobs(model, tokens))
    theirs = peft.PeftModel.from_pretrained(
        helpers.make_hf_model("qwen3", tied=tied, seed=6), tmp_path / "adapter"
    )
    assert any("lm_head.lora_B" in n for n, _ in theirs.named_parameters())
    np.testing.assert_allclose(ours, helpers.hf_token_logprobs(theirs.eval(), tokens), **LOGPROB_TOL)
    back = models.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(models.sequence_logprobs(back, tokens)), ours, **LOGPROB_TOL)
    models.save_pretrained(lora.merge_lora(model), tmp_path / "merged")
    merged_hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged_hf.config.tie_word_embeddings is False
    np.testing.assert_allclose(helpers.hf_token_logprobs(merged_hf, tokens), ours, **LOGPROB_TOL)


def test_embedded_sampler_samples_with_the_unembed_adapter():
    model = _unembed_model(True, targets=("lm_head", "v_proj"), seed=8)
    _assert_sampler_uses_the_adapter(model)


def test_decode_layout_keeps_logits_with_adapters():
    """decode_layout (Linear kernels stored [out, in], the embedded sampler's CPU copy) gives the
    model's logits within float32 matmul rounding, LoRA adapters (which keep their own layout)
    included, with B != 0 so the adapters matter, and leaves no Linear in the old layout."""
    import jax

    from rljax.models.decode_layout import decode_layout
    from rljax.models.layers import Linear

    model = random_decoder(models.tiny_config("qwen3", vocab_size=64), seed=4)
    lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
    for _, m in nnx.iter_graph(model):
        if isinstance(m, Linear) and getattr(m, "lora_b", None) is not None:
            m.lora_b[...] = jax.random.normal(jax.random.key(0), m.lora_b[...].shape) * 0.1
    tokens = np.arange(1, 13, dtype=np.int32)[None]
    want = np.asarray(model(tokens))
    graphdef, state = nnx.split(model)
    moved = decode_layout(nnx.merge(graphdef, state))
    got = np.asarray(moved(tokens))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    layouts = {
        p[-1]: getattr(m, "kernel_layout", "in_out")
        for p, m in nnx.iter_graph(moved)
        if isinstance(m, Linear)
    }
    assert layouts.pop("lm_head", "in_out") == "in_out"  # read as [in, out] by Decoder.unembedding
    assert layouts and set(layouts.values()) == {"out_in"}
