"""rljax writes checkpoints, transformers (torch float32) loads them: same logprobs, same files layout."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import transformers
from flax import nnx

from rljax import models

VOCAB = 320
ATOL = 2e-5

_logprobs = models.sequence_logprobs  # jitted by the library


def _rljax_model(helpers, name: str, tied: bool, seed: int = 0) -> models.Decoder:
    cfg = models.ModelConfig.from_hf_dict(helpers.hf_config_dict(name, tied=tied))
    return helpers.random_decoder(cfg, seed=seed)


def _params(model: models.Decoder) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _hf_load(path: str):
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf_model.eval()


@pytest.mark.parametrize("name,tied", [("qwen2", True), ("qwen3", False), ("llama3", True)])
def test_saved_checkpoint_loads_in_transformers_with_same_logprobs(name, tied, helpers, tmp_path):
    model = _rljax_model(helpers, name, tied)
    models.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    saved = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in saved) == (not tied)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] is tied and config["model_type"] == model.config.model_type
    hf_model = _hf_load(os.fspath(tmp_path))
    assert hf_model.config.tie_word_embeddings is tied
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 40))
    ref = helpers.hf_token_logprobs(hf_model, tokens)
    got = np.asarray(_logprobs(model, jnp.asarray(tokens), chunk_size=32))
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    assert np.abs(ref[:, 1:]).mean() > 1.0
    # HF reads the same RoPE as rljax from what rljax wrote.
    assert hf_model.config.rope_parameters["rope_type"] == model.config.rope_type


def test_sharded_checkpoint_roundtrip_and_transformers_load(helpers, tmp_path):
    model = _rljax_model(helpers, "qwen2", False, seed=1)
    models.save_pretrained(model, tmp_path, max_shard_bytes=60_000)
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files and len(shards) > 2
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(shards)
    loaded = models.from_pretrained(tmp_path)
    assert loaded.config == model.config
    original = _params(model)
    for key, value in _params(loaded).items():
        np.testing.assert_array_equal(value, original[key])
    hf_model = _hf_load(os.fspath(tmp_path))
    tokens = np.random.default_rng(4).integers(0, VOCAB, size=(1, 24))
    np.testing.assert_allclose(
        np.asarray(_logprobs(loaded, jnp.asarray(tokens), chunk_size=32)),
        helpers.hf_token_logprobs(hf_model, tokens),
        atol=ATOL,
        rtol=0,
    )
    # Saving again without sharding removes the stale shards and index.
    models.save_pretrained(loaded, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_bfloat16_save_and_load(helpers, tmp_path):
    model = _rljax_model(helpers, "qwen3", True, seed=2)
    models.save_pretrained(model, tmp_path, dtype=jnp.bfloat16)
    saved = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == ml_dtypes.bfloat16 for t in saved.values())
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    original = _params(model)
    loaded = models.from_pretrained(tmp_path, dtype=jnp.float32)
    for key, value in _params(loaded).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, original[key].astype(ml_dtypes.bfloat16).astype(np.float32))
    bf16 = models.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert {v.dtype for v in _params(bf16).values()} == {jnp.dtype(jnp.bfloat16)}
    _hf_load(os.fspath(tmp_path))  # transformers reads the bf16 checkpoint with every tensor matched


def test_load_errors_name_the_problem(helpers, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        models.from_pretrained(tmp_path)
    model = _rljax_model(helpers, "llama3", False)
    models.save_pretrained(model, tmp_path)
    tensors = models.load_hf_tensors(tmp_path)
    cfg = model.config
    incomplete = dict(tensors)
    del incomplete["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        models.from_hf_state_dict(cfg, incomplete)
    with pytest.raises(ValueError, match="unexpected tensors.*q_proj.bias"):
        models.from_hf_state_dict(cfg, tensors | {"model.layers.0.self_attn.q_proj.bias": np.zeros(64)})
    wrong = tensors | {"model.norm.weight": np.ones(65, np.float32)}
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(65,\)"):
        models.from_hf_state_dict(cfg, wrong)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no model.safetensors"):
        models.from_pretrained(tmp_path)


def test_tied_checkpoint_with_stored_lm_head_is_accepted(helpers, tmp_path):
    model = _rljax_model(helpers, "qwen2", True)
    tensors = models.to_hf_state_dict(model)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    loaded = models.from_hf_state_dict(model.config, tensors)
    assert loaded.lm_head is None
    np.testing.assert_array_equal(np.asarray(loaded.unembedding()), np.asarray(model.unembedding()))


def test_hf_name_map_covers_every_parameter_once(helpers):
    for name, tied in [("qwen2", False), ("qwen3", True), ("llama3", False)]:
        model = _rljax_model(helpers, name, tied)
        mapping = models.hf_name_map(model)
        paths = [p for p, _ in mapping.values()]
        assert len(paths) == len(set(paths)) == len(_params(model))
        assert all(
            transpose == hf.endswith(("proj.weight", "lm_head.weight"))
            for hf, (_, transpose) in mapping.items()
        )
