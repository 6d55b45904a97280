"""ModelConfig <-> HF config.json, RoPE frequencies against transformers, and clear config errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import modeling_rope_utils

from rljax.models import ModelConfig, rope_inverse_frequencies

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_families_from_transformers_config_dicts():
    qwen2 = ModelConfig.from_hf_dict(transformers.Qwen2Config(**BASE).to_dict())
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.head_dim) == (True, False, False, 16)
    qwen3 = ModelConfig.from_hf_dict(transformers.Qwen3Config(head_dim=32, **BASE).to_dict())
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim, qwen3.num_kv_groups) == (False, True, 32, 2)
    qwen3b = ModelConfig.from_hf_dict(transformers.Qwen3Config(attention_bias=True, **BASE).to_dict())
    assert (qwen3b.qkv_bias, qwen3b.o_bias) == (True, True)
    llama = ModelConfig.from_hf_dict(
        transformers.LlamaConfig(
            rope_scaling=dict(LLAMA3), rope_theta=5e5, tie_word_embeddings=True, **BASE
        ).to_dict()
    )
    assert llama.rope_type == "llama3" and llama.rope_theta == 5e5 and llama.tie_word_embeddings
    assert dict(llama.rope_scaling)["factor"] == 8.0
    assert (llama.qkv_bias, llama.mlp_bias, llama.qk_norm) == (False, False, False)


def test_legacy_rope_fields_are_read():
    legacy = dict(
        model_type="llama", rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0}, **BASE
    )
    cfg = ModelConfig.from_hf_dict(legacy)
    assert cfg.rope_theta == 1234.0 and cfg.rope_type == "linear" and dict(cfg.rope_scaling)["factor"] == 2.0
    plain = ModelConfig.from_hf_dict(dict(model_type="qwen2", rope_theta=77.0, rope_scaling=None, **BASE))
    assert plain.rope_theta == 77.0 and plain.rope_scaling is None and plain.rope_type == "default"


@settings(max_examples=25, deadline=None)
@given(
    model_type=st.sampled_from(["qwen2", "qwen3", "llama"]),
    kv_heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16, 32]),
    tied=st.booleans(),
    bias=st.booleans(),
    rope=st.sampled_from([None, {"rope_type": "linear", "factor": 3.0}, LLAMA3]),
    theta=st.floats(10.0, 1e6),
)
def test_hf_dict_roundtrip(model_type, kv_heads, head_dim, tied, bias, rope, theta):
    hf = dict(
        BASE,
        model_type=model_type,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tied,
        attention_bias=bias,
        rope_theta=theta,
        rope_scaling=rope,
        eos_token_id=7,
    )
    cfg = ModelConfig.from_hf_dict(hf)
    out = cfg.to_hf_dict(dtype="bfloat16")
    assert json.loads(json.dumps(out)) == out  # JSON-serializable
    assert ModelConfig.from_hf_dict(out) == cfg
    assert out["eos_token_id"] == 7 and out["torch_dtype"] == "bfloat16"
    assert out["rope_parameters"]["rope_theta"] == theta
    # transformers reads the same architecture back from what rljax writes.
    hf_cfg = transformers.AutoConfig.for_model(**out)
    assert (hf_cfg.head_dim, hf_cfg.num_key_value_heads, hf_cfg.tie_word_embeddings) == (
        head_dim,
        kv_heads,
        tied,
    )
    assert hf_cfg.rope_parameters["rope_type"] == cfg.rope_type
    if model_type != "qwen2":
        assert hf_cfg.attention_bias == bias


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.5}, LLAMA3])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_frequencies_match_transformers(rope, head_dim):
    hf_cfg = transformers.LlamaConfig(rope_theta=500000.0, rope_scaling=rope, head_dim=head_dim, **BASE)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref, scale = modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    assert scale == 1.0
    got = rope_inverse_frequencies(ModelConfig.from_hf_dict(hf_cfg.to_dict()))
    assert got.shape == (head_dim // 2,) and got.dtype == np.float64
    np.testing.assert_allclose(got, ref.double().numpy(), rtol=2e-6)
    if rope_type == "llama3":  # the three llama3 regimes are all exercised
        plain = 1.0 / (500000.0 ** (np.arange(0, head_dim, 2) / head_dim))
        ratio = got / plain
        assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 1 / 8.0))
        assert np.any((ratio > 1 / 8.0 + 1e-6) & (ratio < 1.0 - 1e-6))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(model_type="mistral"), "model_type 'mistral' is not supported"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            "rope scaling type 'yarn' is not supported",
        ),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "'dynamic' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0}), "needs field"),
        (dict(rope_scaling={"rope_type": "linear"}), r"needs field\(s\) \['factor'\]"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
        (dict(vocab_size=0), r"ModelConfig.vocab_size: expected an int >= 1, got 0"),
    ],
)
def test_unsupported_configs_raise_clear_errors(change, message):
    hf = dict(BASE, model_type="llama") | change
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_missing_required_field():
    hf = dict(BASE, model_type="qwen3")
    del hf["intermediate_size"]
    with pytest.raises(ValueError, match=r"missing required field\(s\) \['intermediate_size'\]"):
        ModelConfig.from_hf_dict(hf)


def test_config_is_hashable_and_ignores_extra_fields_in_equality():
    a = ModelConfig.from_hf_dict(dict(BASE, model_type="llama", bos_token_id=1))
    b = ModelConfig.from_hf_dict(dict(BASE, model_type="llama"))
    assert a == b and hash(a) == hash(b)
    assert json.loads(a.extra_json) == {"bos_token_id": 1}
