"""Reading GGUF files (llama.cpp's single-file model format) into the rljax :class:`Decoder`.

A GGUF file holds the architecture as metadata (``general.architecture`` and ``<arch>.*`` keys),
the tokenizer (``tokenizer.ggml.*``, ``tokenizer.chat_template``; see
:mod:`rljax.models.gguf_tokenizer`) and the tensors, each in its own storage type: float32,
float16, bfloat16 or a block quantization (Q8_0, Q4_0, Q4_1, K-quants, ...). rljax reads it with
its own reader (:mod:`rljax.models.gguf_file`), dequantizes every tensor to float32 with
``gguf.quants`` (rljax trains float32 master weights, so a quantized file is a starting point,
not a storage format it keeps), renames the tensors to their Hugging Face names
(:data:`GGUF_NAME_MAP`) and builds the model with :func:`rljax.models.hf_io.from_hf_state_dict`:
one loading path for both formats.

Two conventions of llama.cpp's converter are undone on the way in:

* tensor shapes: GGUF lists dimensions fastest-first (``ne[0]`` = the input features of a Linear);
  the numpy array the reader returns is already ``[out, in]``, HF's layout;
* rotary layout: for ``llama`` models the converter permutes the rows of the Q and K projections
  (and their biases) within each head from HF's "rotate half" order to GGML's interleaved pairs;
  :func:`unpermute_rotary` restores HF's order. Qwen2 / Qwen3 files are stored unpermuted (GGML
  runs them with its NEOX rotary mode, which is HF's order).

Supported architectures: ``llama``, ``qwen2``, ``qwen3`` (:data:`GGUF_ARCHITECTURES`). Llama-3.1
style scaled RoPE (a ``rope_freqs`` tensor) and per-layer head counts raise a ``ValueError``.

    model = from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # a float32 Decoder
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.config import ModelConfig
from rljax.models.decoder import DEFAULT_ATTENTION_CHUNK_SIZE, Decoder
from rljax.models.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf_file
from rljax.models.hf_io import from_hf_state_dict

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUF_NAME_MAP",
    "GGUFTensors",
    "dequantize_tensor",
    "from_gguf",
    "gguf_hf_config",
    "is_gguf_path",
    "load_gguf_config",
    "open_gguf",
    "permute_rotary",
    "read_gguf_metadata",
    "unpermute_rotary",
]

#: ``general.architecture`` -> the HF ``model_type`` rljax builds for it.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Architectures whose Q/K rows llama.cpp's converter permutes into GGML's interleaved rotary order.
_ROTARY_PERMUTED = ("llama",)

#: (GGUF tensor name, HF tensor name); ``{i}`` = layer index. A file's tensor with no row here is an
#: error; rows whose tensor a file lacks (biases, q/k norms, an untied ``output``) are skipped.
GGUF_NAME_MAP: tuple[tuple[str, str], ...] = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("blk.{i}.attn_output.bias", "model.layers.{i}.self_attn.o_proj.bias"),
    ("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)

_MISSING = object()


def is_gguf_path(path: str | os.PathLike) -> bool:
    """True when ``path`` names a GGUF file (by its ``.gguf`` suffix, any case).

    >>> is_gguf_path("/models/SmolLM2-135M-Instruct.Q4_1.gguf"), is_gguf_path("/models/Qwen3-0.6B")
    (True, False)
    """
    return os.fspath(path).lower().endswith(".gguf")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """A GGUF file's metadata and tensor table (:func:`rljax.models.gguf_file.read_gguf_file`;
    tensors are memory-mapped and read when they are used)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    return read_gguf_file(path)


def read_gguf_metadata(reader: GGUFFile, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every metadata entry of a GGUF file as ``{key: value}``, except the keys in ``skip``
    (e.g. the tokenizer's 150k-entry lists when only the architecture is wanted)."""
    out = {}
    for key, value in reader.metadata.items():
        if key in skip:
            continue
        if isinstance(value, list) and value and isinstance(value[0], list):
            raise ValueError(f"GGUF field {key!r} is a nested array, which rljax does not read")
        out[key] = value
    return out


_TOKENIZER_LISTS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores")  # fmt: skip


def _tensor_shapes(reader: GGUFFile) -> dict[str, tuple[int, ...]]:
    """``{name: numpy shape}`` of the file's tensors (GGUF's dimensions reversed)."""
    return {t.name: tuple(reversed(t.shape)) for t in reader.tensors}


def gguf_hf_config(
    metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The HF ``config.json`` dict of a GGUF file's model, from its metadata and tensor shapes.

    Read: ``<arch>.block_count``, ``.embedding_length``, ``.feed_forward_length``,
    ``.attention.head_count(_kv)``, ``.attention.key_length`` (default hidden / heads),
    ``.rope.freq_base``, ``.rope.scaling.*`` (linear only), ``.attention.layer_norm_rms_epsilon``,
    ``.context_length``; the vocabulary size from ``token_embd``'s rows; tied embeddings when the
    file has no ``output.weight``; a Llama attention bias when it has ``attn_q.bias``; the special
    token ids from ``tokenizer.ggml.*``.

    >>> md = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
    ...       "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
    ...       "llama.attention.head_count_kv": 2, "llama.context_length": 256,
    ...       "llama.attention.layer_norm_rms_epsilon": 1e-5}
    >>> cfg = gguf_hf_config(md, {"token_embd.weight": (320, 64)})
    >>> cfg["model_type"], cfg["vocab_size"], cfg["head_dim"], cfg["tie_word_embeddings"]
    ('llama', 320, 16, True)
    """
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF general.architecture {arch!r} is not supported; rljax reads {sorted(GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = _MISSING) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is _MISSING:
            raise ValueError(f"the GGUF file has no {arch}.{key} metadata")
        if isinstance(value, list):
            raise ValueError(f"{arch}.{key} varies per layer ({value[:4]}...); rljax needs one value")
        return value

    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError(
            "the GGUF file scales RoPE with a rope_freqs tensor (Llama 3.1 style), which rljax does not "
            "read yet; load the model's HF checkpoint instead"
        )
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("the GGUF file has no token_embd.weight tensor")
    num_heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{arch}.attention.value_length differs from key_length; rljax needs them equal")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{arch}.rope.dimension_count != head_dim {head_dim}: partial rotary is unsupported")
    hf: dict[str, Any] = dict(
        model_type=GGUF_ARCHITECTURES[arch],
        vocab_size=int(tensor_shapes["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_shapes,
    )
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{arch}.rope.scaling.type {scaling!r} is not supported (only none / linear)")
    if arch == "llama":
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    for key in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            hf["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return hf


def load_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file (metadata and tensor shapes only; no tensor is read)."""
    reader = open_gguf(path)
    return ModelConfig.from_hf_dict(gguf_hf_config(read_gguf_metadata(reader, skip=_TOKENIZER_LISTS),
                                                   _tensor_shapes(reader)))  # fmt: skip


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's row permutation of a Q or K projection (HF order -> GGML order).

    Within each head, row ``j`` of the first half and row ``j`` of the second half (HF's "rotate
    half" pairs) become rows ``2j`` and ``2j + 1`` (GGML's interleaved pairs). Works on a weight
    ``[heads * head_dim, in]`` and a bias ``[heads * head_dim]``.

    >>> permute_rotary(np.arange(8), 2).tolist()
    [0, 2, 1, 3, 4, 6, 5, 7]
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of :func:`permute_rotary`: GGML's interleaved rotary rows back to HF's order.

    >>> w = np.arange(24).reshape(12, 2)
    >>> bool(np.array_equal(unpermute_rotary(permute_rotary(w, 3), 3), w))
    True
    """
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: GGUFTensorInfo) -> np.ndarray:
    """A reader tensor's values as float32 in numpy (HF) dimension order, whatever its storage type
    (every type ``gguf.quants.dequantize`` handles: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    the K-quants, ...)."""
    from gguf import quants

    shape = tuple(reversed(tensor.shape))
    try:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the gguf package "
            "cannot dequantize"
        ) from e
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _hf_names(num_layers: int) -> dict[str, str]:
    out = {}
    for gguf_name, hf_name in GGUF_NAME_MAP:
        for i in range(num_layers) if "{i}" in gguf_name else [None]:
            out[gguf_name.format(i=i)] = hf_name.format(i=i)
    return out


class GGUFTensors(Mapping[str, np.ndarray]):
    """A GGUF file's tensors under their HF names, dequantized (and un-permuted) when accessed.

    Lazy, so building a model from it holds one tensor in float32 at a time besides the model.
    ``hf_config``: the file's :func:`gguf_hf_config` (its head counts drive the un-permutation).
    """

    def __init__(self, reader: GGUFFile, hf_config: Mapping[str, Any]) -> None:
        names = _hf_names(int(hf_config["num_hidden_layers"]))
        unknown = sorted(t.name for t in reader.tensors if t.name not in names)
        if unknown:
            more = " ..." if len(unknown) > 8 else ""
            raise ValueError(f"GGUF tensors with no HF name in GGUF_NAME_MAP: {unknown[:8]}{more}")
        self._tensors = {names[t.name]: t for t in reader.tensors}
        self._heads: dict[str, int] = {}
        if hf_config["model_type"] in _ROTARY_PERMUTED:
            for hf_name in self._tensors:
                if ".self_attn.q_proj." in hf_name:
                    self._heads[hf_name] = int(hf_config["num_attention_heads"])
                elif ".self_attn.k_proj." in hf_name:
                    self._heads[hf_name] = int(hf_config["num_key_value_heads"])

    def __getitem__(self, hf_name: str) -> np.ndarray:
        values = dequantize_tensor(self._tensors[hf_name])
        heads = self._heads.get(hf_name)
        return values if heads is None else unpermute_rotary(values, heads)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def storage_type(self, hf_name: str) -> str:
        """The GGUF storage type of a tensor (``"Q4_1"``, ``"F32"``, ...)."""
        return self._tensors[hf_name].tensor_type.name


def from_gguf(
    path: str | os.PathLike,
    *,
    dtype: jnp.dtype = jnp.float32,
    param_dtype: jnp.dtype | None = None,
    remat: bool = False,
    precision: jax.lax.PrecisionLike = None,
    attention_chunk_size: int | None = DEFAULT_ATTENTION_CHUNK_SIZE,
    moe_impl: str = "auto",
    attention: str = "auto",
    context_attention: str = "all_gather",
) -> Decoder:
    """Loads a GGUF file as a :class:`Decoder` (tensors dequantized to float32, then cast to
    ``param_dtype``, default ``dtype``). Keyword arguments are those of
    :func:`rljax.models.hf_io.from_pretrained`; the model's config keeps the file's special token
    ids, so :func:`rljax.models.save_pretrained` writes a checkpoint transformers and vLLM load."""
    reader = open_gguf(path)
    hf_config = gguf_hf_config(read_gguf_metadata(reader, skip=_TOKENIZER_LISTS), _tensor_shapes(reader))
    return from_hf_state_dict(
        ModelConfig.from_hf_dict(hf_config),
        GGUFTensors(reader, hf_config),
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
        precision=precision,
        attention_chunk_size=attention_chunk_size,
        moe_impl=moe_impl,
        attention=attention,
        context_attention=context_attention,
    )
