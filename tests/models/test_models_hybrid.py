"""The hybrid Qwen3.5 / Qwen3-Next decoder (Gated DeltaNet + gated full attention): config I/O, the
packing invariant (a packed row gives each sample the logprobs and gradients it gets alone), decoding
through the cache (prefill of prompts of different lengths + decode steps = one full forward), and
the refusal of context parallelism. References are the model's own forward on each sample alone
(design §2.6); transformers parity is in test_models_hybrid_hf.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.models.config import ModelConfig
from rljax.models.tiny import random_decoder, tiny_config
from rljax.training.sharding import make_mesh

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    """A dense Qwen3.5 (MoE models decode in tests/inference/test_inference_sampler_hybrid.py)."""
    return random_decoder(tiny_config("qwen3_5_text", vocab_size=VOCAB), seed=0)


def _hf(model_type: str, **extra) -> dict:
    return dict(model_type=model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, **extra)  # fmt: skip


def test_config_reads_and_writes_the_hybrid_fields():
    cfg = ModelConfig.from_hf_dict(
        _hf("qwen3_5_text", intermediate_size=64, rope_parameters={"rope_theta": 1e6, "rope_type": "default",
            "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    )  # fmt: skip
    # full_attention_interval defaults to 4 (transformers): layers 0-2 linear, 3 full attention
    assert cfg.mixer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.linear_layers == (
        0,
        1,
        2,
    )
    assert (cfg.rotary_dim, cfg.qk_norm, cfg.is_hybrid, cfg.is_moe) == (4, True, True, False)
    assert models.rope_inverse_frequencies(cfg).shape == (2,)
    out = cfg.to_hf_dict()
    assert out["architectures"] == ["Qwen3_5ForCausalLM"] and out["layer_types"][3] == "full_attention"
    assert out["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
    }
    assert ModelConfig.from_hf_dict(out) == cfg
    # A multimodal Qwen3.5-MoE config loads as its text model (the vision tower is not loaded).
    wrapper = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "vision_config": {"depth": 2},
               "text_config": _hf("qwen3_5_text", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=8)}  # fmt: skip
    moe = ModelConfig.from_hf_dict(wrapper)
    assert (moe.model_type, moe.tie_word_embeddings, moe.moe_layers, moe.norm_topk_prob) == (
        "qwen3_5_moe_text", True, (0, 1, 2, 3), True)  # fmt: skip
    out = moe.to_hf_dict()
    assert out["architectures"] == ["Qwen3_5MoeForCausalLM"] and "intermediate_size" not in out
    assert "vision_config" not in out and ModelConfig.from_hf_dict(out) == moe
    dense_next = ModelConfig.from_hf_dict(_hf("qwen3_next", intermediate_size=64, num_experts=0))
    assert not dense_next.is_moe and dense_next.moe_layers == ()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="layer_types must name the mixer of each of the 2 layers"):
        tiny_config("qwen3_5_text", layer_types=("linear_attention",))
    with pytest.raises(ValueError, match="linear_num_value_heads \\(3\\) must be a multiple"):
        tiny_config("qwen3_5_text", linear_num_value_heads=3)
    with pytest.raises(ValueError, match="need a hybrid model_type"):
        tiny_config("qwen3", partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor != 1 is not supported"):
        ModelConfig.from_hf_dict(dict(_hf("qwen3", intermediate_size=64), partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="attn_output_gate=false"):
        ModelConfig.from_hf_dict(_hf("qwen3_next", intermediate_size=64, attn_output_gate=False))


def test_multimodal_checkpoint_names_and_fused_experts_load_as_the_text_model():
    """A multimodal Qwen3.5-MoE checkpoint's tensors: the text model under ``model.language_model.``,
    expert stacks fused as transformers holds them (``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``), a vision tower and MTP heads (not loaded): the same parameters as the per-expert
    text checkpoint."""
    model = random_decoder(tiny_config("qwen3_5_moe_text", vocab_size=VOCAB), seed=0)
    plain = models.to_hf_state_dict(model)
    wrapped = {"model.visual.blocks.0.attn.qkv.weight": np.ones(3), "mtp.fc.weight": np.ones(2)}
    for name, arr in plain.items():
        if ".mlp.experts." not in name:
            wrapped[name.replace("model.", "model.language_model.", 1)] = arr
    for i in range(model.config.num_layers):
        e = range(model.config.num_experts)
        key = f"model.layers.{i}.mlp.experts."
        gate_up = [
            np.concatenate([plain[f"{key}{j}.gate_proj.weight"], plain[f"{key}{j}.up_proj.weight"]])
            for j in e
        ]
        wrapped[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(gate_up)
        wrapped[f"model.language_model.layers.{i}.mlp.experts.down_proj"] = np.stack(
            [plain[f"{key}{j}.down_proj.weight"] for j in e]
        )
    loaded = models.to_hf_state_dict(models.from_hf_state_dict(model.config, wrapped))
    assert sorted(loaded) == sorted(plain) and all(np.array_equal(loaded[k], plain[k]) for k in plain)


def _packed_row(rng, lengths, pad):
    samples = [rng.integers(0, VOCAB, n) for n in lengths]
    tokens = np.concatenate(samples + [np.zeros(pad, np.int64)])
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad, np.int64)])
    return samples, tokens[None], segments[None]


def test_packed_row_gives_each_sample_its_own_logprobs_and_gradients():
    """Three samples in one row of 150 tokens (the delta rule's chunks of 64 hold sample boundaries;
    the middle sample spans two chunks): the state and the conv window restart at every sample, so
    the packed forward (jitted, with remat) and its gradient equal the samples' own, up to float32
    rounding: the DeltaNet's chunks split the samples differently, which moved gradients by up to
    1.6e-5 of each parameter's largest gradient entry (measured; < 1e-6 with the mixer in float64, so
    rounding it is); bound 1e-4."""
    rng = np.random.default_rng(0)
    samples, tokens, segments = _packed_row(rng, (40, 70, 30), pad=10)
    # Qwen3-Next: MoE, and the fused projections (the forward is the same mixer as Qwen3.5's)
    model = random_decoder(tiny_config("qwen3_next", vocab_size=VOCAB), seed=0, remat="full")
    graphdef, params = nnx.split(model)

    def total(p, toks, segs):
        logp = models.sequence_logprobs(nnx.merge(graphdef, p), toks, segment_ids=segs)
        return jnp.sum(jnp.where(segs != 0, logp, 0)), logp

    grad_fn = jax.jit(jax.value_and_grad(total, has_aux=True))
    (_, packed), packed_grad = grad_fn(params, jnp.asarray(tokens), jnp.asarray(segments))
    alone_grad, start = None, 0
    for s in samples:  # each alone, padded to the packed row's length (one compiled program)
        toks = np.zeros_like(tokens)
        toks[0, : len(s)] = s
        segs = (np.arange(tokens.shape[1]) < len(s)).astype(np.int64)[None]
        (_, logp), grad = grad_fn(params, jnp.asarray(toks), jnp.asarray(segs))
        np.testing.assert_allclose(np.asarray(packed[0, start + 1 : start + len(s)]),
                                   np.asarray(logp[0, 1 : len(s)]), **LOGPROB_TOL)  # fmt: skip
        alone_grad = grad if alone_grad is None else jax.tree.map(jnp.add, alone_grad, grad)
        start += len(s)
    linear, worst = 0, 0.0
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(packed_grad), nnx.to_flat_state(alone_grad), strict=True
    ):
        got, want = np.asarray(got.get_value()), np.asarray(want.get_value())
        scale = np.abs(want).max()
        assert scale > 0 and np.abs(got - want).max() <= 1e-4 * scale, (path, np.abs(got - want).max(), scale)
        linear += "linear_attn" in map(str, path)
        worst = max(worst, np.abs(got - want).max() / scale)
    print(f"packed vs alone gradients: max |diff| / max |grad| = {worst:.2e}")
    assert linear >= 7  # the DeltaNet's parameters are compared too


def test_prefill_of_prompts_of_different_lengths_then_decode_equals_the_full_forward(model):
    """Left-padded prompts of 5, 9 and 3 tokens, then 6 sampled tokens each, one decode step at a time:
    every token's logprob equals the full forward's on prompt + generated tokens."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n) for n in (5, 9, 3)]
    width, new = 9, 6
    tokens = np.zeros((3, width), np.int64)
    segments = np.zeros((3, width), np.int64)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :], segments[i, width - len(p) :] = p, 1
    out = models.prefill(
        model, jnp.asarray(tokens), segment_ids=jnp.asarray(segments), max_length=width + new
    )
    assert len(out.cache.keys) == 1 and len(out.cache.recurrent_states) == 1  # one layer of each kind
    logits, cache, generated, logprobs = out.logits, out.cache, [], []
    for _ in range(new):
        logp = jax.nn.log_softmax(logits)
        token = jnp.argmax(logits + jnp.asarray(rng.gumbel(size=logits.shape)), axis=-1)
        generated.append(np.asarray(token))
        logprobs.append(np.asarray(jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]))
        step = models.decode_step(model, token, cache)
        logits, cache = step.logits, step.cache
    generated, logprobs = np.stack(generated, 1), np.stack(logprobs, 1)
    full = np.zeros((3, width + new), np.int64)  # each prompt + its tokens alone, right-padded
    for i, p in enumerate(prompts):
        full[i, : len(p) + new] = np.concatenate([p, generated[i]])
    lengths = np.array([len(p) + new for p in prompts])
    segs = (np.arange(width + new)[None] < lengths[:, None]).astype(np.int64)
    want = np.asarray(models.sequence_logprobs(model, jnp.asarray(full), segment_ids=jnp.asarray(segs)))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logprobs[i], want[i, len(p) : len(p) + new], **LOGPROB_TOL)


def test_context_parallelism_is_refused_with_a_clear_error(model):
    mesh = make_mesh(data=4, context=2)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="context parallelism .* is not supported"):
        model.hidden_states(jnp.ones((1, 8), jnp.int32))


def test_prefix_sharing_stays_off_for_linear_attention_layers(model):
    """A depth-first tree row would thread a Gated DeltaNet state through sibling branches: a hybrid
    model declares it cannot compute tree rows, and trainer.prefix_sharing="auto" leaves sharing off."""
    from rljax.models.tiny import tiny_model
    from rljax.run.run import resolve_prefix_sharing

    assert model.config.linear_layers and not model.prefix_tree_rows
    assert resolve_prefix_sharing("auto", model) is False
    assert tiny_model().prefix_tree_rows and resolve_prefix_sharing("auto", tiny_model()) is True
