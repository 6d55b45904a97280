"""Flax NNX decoder (Qwen2 / Qwen3 / Llama, Qwen2-MoE / Qwen3-MoE, the hybrid Qwen3.5 / Qwen3-Next
with Gated DeltaNet layers), HF safetensors and GGUF I/O, chunked logprobs, KV cache and decode
drivers (design §5).

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from rljax import models
>>> cfg = models.ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
...                          num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
>>> models.sequence_logprobs(models.Decoder(cfg, rngs=nnx.Rngs(0)), jnp.array([[1, 2, 3]])).shape
(1, 3)
"""

from rljax.models.attention import segment_positions
from rljax.models.config import ModelConfig, rope_inverse_frequencies
from rljax.models.decode import DecodeOutput, SharedPrefix, decode_step, prefill
from rljax.models.decoder import (
    REMAT_POLICIES,
    Decoder,
    DecoderOutput,
    abstract_decoder,
    cast_model,
    num_params,
)
from rljax.models.gguf_io import from_gguf, is_gguf_path, load_gguf_config
from rljax.models.gguf_tokenizer import gguf_tokenizer
from rljax.models.hf_io import (
    HF_EXPERT_NAME_MAP,
    HF_NAME_MAP,
    from_hf_state_dict,
    from_pretrained,
    hf_name_map,
    load_config,
    load_hf_tensors,
    save_pretrained,
    save_pretrained_distributed,
    to_hf_state_dict,
)
from rljax.models.kv_cache import KVCache, grow_cache, init_cache, take_rows
from rljax.models.logprobs import (
    DEFAULT_CHUNK_SIZE,
    ForwardOutput,
    lm_head_logprobs,
    logit_capacity,
    sequence_forward,
    sequence_logprobs,
    token_logprobs_and_entropy,
)
from rljax.models.moe import (
    Routing,
    expert_load,
    flip_fraction,
    load_balancing_loss,
    router_z_loss,
    routing_entropy,
    routing_metrics,
    top_k_experts,
)
from rljax.models.sharding import (
    DEFAULT_RULES,
    EXPERT_MESH_AXES,
    MESH_AXES,
    logical_to_spec,
    param_shardings,
    param_specs,
    shard_model,
)
from rljax.models.tiny import tiny_config, tiny_model

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_RULES",
    "EXPERT_MESH_AXES",
    "HF_EXPERT_NAME_MAP",
    "HF_NAME_MAP",
    "KVCache",
    "MESH_AXES",
    "DecodeOutput",
    "Decoder",
    "DecoderOutput",
    "ForwardOutput",
    "REMAT_POLICIES",
    "abstract_decoder",
    "cast_model",
    "ModelConfig",
    "Routing",
    "decode_step",
    "from_gguf",
    "gguf_tokenizer",
    "is_gguf_path",
    "load_gguf_config",
    "expert_load",
    "flip_fraction",
    "load_balancing_loss",
    "router_z_loss",
    "routing_entropy",
    "routing_metrics",
    "top_k_experts",
    "from_hf_state_dict",
    "from_pretrained",
    "hf_name_map",
    "grow_cache",
    "init_cache",
    "tiny_config",
    "tiny_model",
    "load_config",
    "load_hf_tensors",
    "logical_to_spec",
    "num_params",
    "param_shardings",
    "param_specs",
    "prefill",
    "SharedPrefix",
    "take_rows",
    "rope_inverse_frequencies",
    "save_pretrained",
    "save_pretrained_distributed",
    "segment_positions",
    "lm_head_logprobs",
    "logit_capacity",
    "sequence_logprobs",
    "sequence_forward",
    "shard_model",
    "to_hf_state_dict",
    "token_logprobs_and_entropy",
]
