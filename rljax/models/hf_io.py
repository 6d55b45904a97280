"""Hugging Face checkpoint I/O: ``config.json`` + safetensors (single file or sharded with an index).

The mapping between HF tensor names and rljax parameter paths is the table :data:`HF_NAME_MAP`
(``{i}`` = layer index). HF ``nn.Linear`` weights are ``[out, in]`` and rljax kernels ``[in, out]``,
so those entries are transposed on the way in and out (the Gated DeltaNet's ``conv1d.weight`` keeps
HF's ``[C, 1, K]``). MoE expert weights are stored per expert
in HF checkpoints (:data:`HF_EXPERT_NAME_MAP`, ``mlp.experts.{e}.gate_proj.weight``) and stacked
``[E, in, out]`` in rljax. What :func:`save_pretrained` writes loads
in transformers and vLLM: tied embeddings are saved once (no ``lm_head.weight``) with
``tie_word_embeddings: true`` in ``config.json``. :func:`save_tokenizer_files` and
:func:`save_generation_config` complete such a directory into one a server can chat with (the
tokenizer with its chat template, and the token ids that end a generation).

Qwen3-Next / Qwen3.5 (:mod:`rljax.models.linear_attention`): text models are loaded and saved
(``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``); a multimodal
Qwen3.5 checkpoint loads as its text model (``model.language_model.*``), its vision tower and the
multi-token-prediction heads (``mtp.*``) are not loaded, and what rljax saves is the text model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.decoder import DEFAULT_ATTENTION_CHUNK_SIZE, Decoder, abstract_decoder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

#: (HF checkpoint name, rljax parameter path, transpose). Rows whose parameter the model does not
#: have (biases, q/k norms, untied lm_head) are skipped for that model.
HF_NAME_MAP: tuple[tuple[str, str, bool], ...] = (
    ("model.embed_tokens.weight", "embed_tokens", False),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight", False),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.q_proj.kernel", True),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.self_attn.q_proj.bias", False),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.k_proj.kernel", True),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.self_attn.k_proj.bias", False),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.self_attn.v_proj.kernel", True),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.self_attn.v_proj.bias", False),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.self_attn.o_proj.kernel", True),
    ("model.layers.{i}.self_attn.o_proj.bias", "layers.{i}.self_attn.o_proj.bias", False),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.q_norm.weight", False),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.self_attn.k_norm.weight", False),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm.weight", False),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj.kernel", True),
    ("model.layers.{i}.mlp.gate_proj.bias", "layers.{i}.mlp.gate_proj.bias", False),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj.kernel", True),
    ("model.layers.{i}.mlp.up_proj.bias", "layers.{i}.mlp.up_proj.bias", False),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.kernel", True),
    ("model.layers.{i}.mlp.down_proj.bias", "layers.{i}.mlp.down_proj.bias", False),
    # MoE layers (qwen2_moe / qwen3_moe): router and, for qwen2_moe, the gated shared expert.
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.gate.kernel", True),
    (
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "layers.{i}.mlp.shared_expert.gate_proj.kernel",
        True,
    ),
    (
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        "layers.{i}.mlp.shared_expert.up_proj.kernel",
        True,
    ),
    (
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        "layers.{i}.mlp.shared_expert.down_proj.kernel",
        True,
    ),
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.kernel", True),
    # Gated DeltaNet layers (qwen3_5_text / qwen3_5_moe_text; qwen3_next fuses qkvz and ba).
    ("model.layers.{i}.linear_attn.in_proj_qkv.weight", "layers.{i}.linear_attn.in_proj_qkv.kernel", True),
    ("model.layers.{i}.linear_attn.in_proj_z.weight", "layers.{i}.linear_attn.in_proj_z.kernel", True),
    ("model.layers.{i}.linear_attn.in_proj_b.weight", "layers.{i}.linear_attn.in_proj_b.kernel", True),
    ("model.layers.{i}.linear_attn.in_proj_a.weight", "layers.{i}.linear_attn.in_proj_a.kernel", True),
    ("model.layers.{i}.linear_attn.in_proj_qkvz.weight", "layers.{i}.linear_attn.in_proj_qkvz.kernel", True),
    ("model.layers.{i}.linear_attn.in_proj_ba.weight", "layers.{i}.linear_attn.in_proj_ba.kernel", True),
    ("model.layers.{i}.linear_attn.conv1d.weight", "layers.{i}.linear_attn.conv1d.weight", False),
    ("model.layers.{i}.linear_attn.dt_bias", "layers.{i}.linear_attn.dt_bias", False),
    ("model.layers.{i}.linear_attn.A_log", "layers.{i}.linear_attn.A_log", False),
    ("model.layers.{i}.linear_attn.norm.weight", "layers.{i}.linear_attn.norm.weight", False),
    ("model.layers.{i}.linear_attn.out_proj.weight", "layers.{i}.linear_attn.out_proj.kernel", True),
    ("model.norm.weight", "norm.weight", False),
    ("lm_head.weight", "lm_head.kernel", True),
)

#: Per-expert HF tensors ``{e}`` = expert index; rljax stacks them along a leading expert axis, so the
#: rljax side names one slice ``path[e]`` of a stacked ``[E, in, out]`` parameter.
HF_EXPERT_NAME_MAP: tuple[tuple[str, str, bool], ...] = (
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "layers.{i}.mlp.experts.gate_proj[{e}]", True),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "layers.{i}.mlp.experts.up_proj[{e}]", True),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "layers.{i}.mlp.experts.down_proj[{e}]", True),
)

# Checkpoint entries that carry no parameters of their own and are skipped on load.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
#: Name prefixes of a checkpoint's parts that rljax does not load: a multimodal Qwen3.5's vision tower
#: and the multi-token-prediction heads of Qwen3-Next / Qwen3.5.
IGNORED_PREFIXES = ("model.visual.", "mtp.")
#: A multimodal Qwen3.5 stores its text model under this prefix (``model.`` in a text checkpoint).
_LANGUAGE_MODEL_PREFIX = "model.language_model."


def _text_model_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` named as a text model's: a multimodal checkpoint's ``model.language_model.``
    prefix becomes ``model.``, the vision tower and MTP heads (:data:`IGNORED_PREFIXES`) are
    dropped, and fused expert stacks (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``, transformers' in-memory layout) are split per expert.

    >>> sd = {"model.language_model.norm.weight": np.ones(2), "mtp.fc.weight": np.ones(2)}
    >>> sorted(_text_model_tensors(sd))
    ['model.norm.weight']
    """
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if name.startswith(_LANGUAGE_MODEL_PREFIX):
            name = "model." + name[len(_LANGUAGE_MODEL_PREFIX) :]
        if name.startswith(IGNORED_PREFIXES):
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            half = arr.shape[1] // 2
            for e in range(arr.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = arr[e, :half]
                out[f"{base}{e}.up_proj.weight"] = arr[e, half:]
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(arr.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = arr[e]
        else:
            out[name] = arr
    return out


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _split_expert(path: str) -> tuple[str, int | None]:
    """``"a.b[3]"`` -> ``("a.b", 3)``; a path without an index -> ``(path, None)``."""
    if path.endswith("]"):
        base, index = path[:-1].split("[")
        return base, int(index)
    return path, None


def hf_name_map(model: Decoder) -> dict[str, tuple[str, bool]]:
    """``{hf_name: (rljax_path, transpose)}`` for every parameter of ``model`` (table expanded per layer).

    Stacked expert weights appear once per expert, as ``"layers.{i}.mlp.experts.gate_proj[{e}]"``
    (slice ``e`` of the ``[E, ...]`` parameter); ``transpose`` then applies to that slice.

    >>> cfg = ModelConfig(model_type="qwen2", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, qkv_bias=True)
    >>> m = hf_name_map(abstract_decoder(cfg))
    >>> m["model.layers.0.self_attn.k_proj.weight"], "lm_head.weight" in m
    (('layers.0.self_attn.k_proj.kernel', True), True)
    """
    have = {_path_str(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out: dict[str, tuple[str, bool]] = {}
    for hf_name, path, transpose in HF_NAME_MAP:
        layers = range(model.config.num_layers) if "{i}" in hf_name else [None]
        for i in layers:
            hf_i, path_i = hf_name.format(i=i), path.format(i=i)
            if path_i in have:
                out[hf_i] = (path_i, transpose)
    for hf_name, path, transpose in HF_EXPERT_NAME_MAP:
        for i in range(model.config.num_layers):
            if _split_expert(path.format(i=i, e=0))[0] not in have:
                continue
            for e in range(model.config.num_experts):
                out[hf_name.format(i=i, e=e)] = (path.format(i=i, e=e), transpose)
    unmapped = have - {_split_expert(p)[0] for p, _ in out.values()}
    if unmapped:
        raise ValueError(f"parameters with no HF name in HF_NAME_MAP: {sorted(unmapped)}")
    return out


def to_hf_state_dict(model: Decoder, *, dtype: jnp.dtype | None = None) -> dict[str, np.ndarray]:
    """The model's parameters as ``{hf_name: numpy array}`` in HF layout (``dtype`` default: param dtype).

    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, tie_word_embeddings=True)
    >>> sd = to_hf_state_dict(Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> sd["model.layers.0.mlp.down_proj.weight"].shape, "lm_head.weight" in sd
    ((4, 8), False)
    """
    dtype = jnp.dtype(model.param_dtype if dtype is None else dtype)
    values = {_path_str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out = {}
    host: dict[str, np.ndarray] = {}
    for hf_name, (path, transpose) in hf_name_map(model).items():
        base, expert = _split_expert(path)
        if base not in host:
            host[base] = np.asarray(jax.device_get(values[base].astype(dtype)))
        arr = host[base] if expert is None else host[base][expert]
        out[hf_name] = np.ascontiguousarray(arr.T if transpose else arr)
    return out


def from_hf_state_dict(
    config: ModelConfig,
    tensors: Mapping[str, np.ndarray],
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
    """Builds a :class:`Decoder` from HF-named tensors without random initialization.

    Keyword arguments after ``dtype`` are those of :class:`rljax.models.Decoder`.

    Raises ``ValueError`` listing missing tensors, unexpected tensors and shape mismatches.

    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2)
    >>> sd = to_hf_state_dict(Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> model = from_hf_state_dict(cfg, sd)
    >>> bool(np.array_equal(model.lm_head.kernel[...], sd["lm_head.weight"].T))
    True
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    abstract = abstract_decoder(
        config,
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
        precision=precision,
        attention_chunk_size=attention_chunk_size,
        moe_impl=moe_impl,
        attention=attention,
        context_attention=context_attention,
    )
    names = hf_name_map(abstract)
    tensors = _text_model_tensors(tensors)
    ignored = {k for k in tensors if k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        ignored.add("lm_head.weight")  # transformers ties it to the embedding and ignores the stored copy
    missing = sorted(set(names) - set(tensors))
    unexpected = sorted(set(tensors) - set(names) - ignored)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the {config.model_type} config: missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    graphdef, state = nnx.split(abstract)
    by_path: dict[str, list[tuple[str, bool, int | None]]] = {}
    for hf_name, (path, transpose) in names.items():
        base, expert = _split_expert(path)
        by_path.setdefault(base, []).append((hf_name, transpose, expert))
    flat = []
    for path, var in nnx.to_flat_state(state):
        key = _path_str(path)
        if key not in by_path:
            flat.append((path, var))
            continue
        shape = var.get_value().shape
        entries = by_path[key]
        slices = []
        for hf_name, transpose, expert in sorted(entries, key=lambda t: -1 if t[2] is None else t[2]):
            arr = np.asarray(tensors[hf_name])
            arr = arr.T if transpose else arr
            want = shape if expert is None else shape[1:]
            if arr.shape != want:
                raise ValueError(
                    f"tensor {hf_name} has shape {tuple(tensors[hf_name].shape)}, but the config needs "
                    f"{want[::-1] if transpose else want}"
                )
            slices.append(arr)
        arr = slices[0] if entries[0][2] is None else np.stack(slices)
        flat.append((path, var.replace(jnp.asarray(arr, dtype=param_dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_hf_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory: ``model.safetensors`` or a sharded index.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); safetensors.numpy.save_file({"a": np.ones(2)}, f"{d}/{WEIGHTS_FILE}")
    >>> load_hf_tensors(d)["a"].tolist()
    [1.0, 1.0]
    """
    path = os.fspath(path)
    index_path = os.path.join(path, WEIGHTS_INDEX_FILE)
    single_path = os.path.join(path, WEIGHTS_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            loaded = safetensors.numpy.load_file(os.path.join(path, shard))
            tensors.update({k: v for k, v in loaded.items() if weight_map.get(k) == shard})
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise ValueError(f"{WEIGHTS_INDEX_FILE} lists tensors that are not in their shard: {absent[:8]}")
        return tensors
    if os.path.exists(single_path):
        return safetensors.numpy.load_file(single_path)
    raise ValueError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in {path!r}")


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Reads ``config.json`` of a checkpoint directory into a :class:`ModelConfig`.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, CONFIG_FILE), "w") as f:
    ...     json.dump({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8,
    ...                "num_hidden_layers": 1, "num_attention_heads": 2}, f)
    >>> cfg = load_config(d)
    >>> (cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias)
    (2, 2, True)
    """
    config_path = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.exists(config_path):
        raise ValueError(f"no {CONFIG_FILE} in {os.fspath(path)!r}; pass a HF checkpoint directory")
    with open(config_path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def from_pretrained(
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
    adapter: str | os.PathLike | None = None,
) -> Decoder:
    """Loads a HF checkpoint directory (``config.json`` + safetensors, sharded or not) as a Decoder.

    ``dtype`` is the compute dtype; parameters are stored in ``param_dtype`` (default ``dtype``);
    ``adapter``: a PEFT LoRA adapter directory to attach (:func:`rljax.models.lora.load_adapter`);
    the other keyword arguments are those of :class:`rljax.models.Decoder`.

    >>> import tempfile
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2)
    >>> d = tempfile.mkdtemp(); save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), d)
    >>> from_pretrained(d).config == cfg
    True
    """
    model = from_hf_state_dict(
        load_config(path),
        load_hf_tensors(path),
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
        precision=precision,
        attention_chunk_size=attention_chunk_size,
        moe_impl=moe_impl,
        attention=attention,
        context_attention=context_attention,
    )
    if adapter is not None:
        from rljax.models.lora import load_adapter  # lora imports the layers, not hf_io

        load_adapter(model, adapter)
    return model


def save_pretrained(
    model: Decoder,
    path: str | os.PathLike,
    *,
    dtype: jnp.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (or shards + index) that transformers/vLLM load.

    Args:
      model: the decoder.
      path: output directory (created if needed; existing weight files there are replaced).
      dtype: storage dtype (default: the model's param dtype).
      max_shard_bytes: split into ``model-0000k-of-0000n.safetensors`` files of at most this many
        bytes (a single larger tensor gets its own shard) plus ``model.safetensors.index.json``.

    >>> import tempfile
    >>> cfg = ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, qk_norm=True,
    ...                   tie_word_embeddings=True)
    >>> d = tempfile.mkdtemp(); save_pretrained(Decoder(cfg, rngs=nnx.Rngs(0)), d)
    >>> sorted(os.listdir(d))
    ['config.json', 'model.safetensors']
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive or None, got {max_shard_bytes}")
    dtype = jnp.dtype(model.param_dtype if dtype is None else dtype)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = to_hf_state_dict(model, dtype=dtype)
    shards = _split_shards(tensors, max_shard_bytes)
    for name in os.listdir(path):
        if name == WEIGHTS_INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors")):
            os.remove(os.path.join(path, name))
    metadata = {"format": "pt"}
    if len(shards) == 1:
        safetensors.numpy.save_file(shards[0], os.path.join(path, WEIGHTS_FILE), metadata=metadata)
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            safetensors.numpy.save_file(shard, os.path.join(path, file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        with open(os.path.join(path, WEIGHTS_INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(model.config.to_hf_dict(dtype=dtype.name), f, indent=2, sort_keys=True)


def _deal_by_size(sizes: list[int], num_processes: int) -> list[int]:
    """The owning process of each item: largest first, each to the least loaded process (ties: lowest
    index). Deterministic, so every process computes the same assignment.

    >>> _deal_by_size([10, 1, 7, 3], 2)
    [0, 0, 1, 1]
    """
    load = [0] * num_processes
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(num_processes), key=lambda q: (load[q], q))
        owner[i] = p
        load[p] += sizes[i]
    return owner


def save_pretrained_distributed(
    model: Decoder,
    path: str | os.PathLike,
    *,
    dtype: jnp.dtype | None = None,
    explicit_lm_head: bool = False,
) -> list[str]:
    """:func:`save_pretrained` for a model whose parameters are sharded across processes.

    Every process calls it (in the same order as its other collectives). Parameters are gathered
    whole one at a time (``multihost_utils.process_allgather``) and each is written, as its own
    ``model-k-of-n.safetensors``, by the process it is dealt to (largest first, to the least
    loaded); process 0 writes ``config.json`` and ``model.safetensors.index.json``. Host memory per
    process: one whole parameter in ``dtype`` at a time (the largest, usually the embedding), never
    the whole model. Returns once every file is written (a device sync of all processes).
    ``explicit_lm_head``: a tied model also gets ``lm_head.weight`` (= the embedding) next to the
    embedding, listed in the index (what vLLM's in-place reload needs to refresh a tied head). In
    one process it writes the same files from the one process. Returns the files this process wrote.

    >>> import tempfile
    >>> cfg = ModelConfig(model_type="qwen3", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, qk_norm=True)
    >>> m = Decoder(cfg, rngs=nnx.Rngs(0)); d = tempfile.mkdtemp()
    >>> len(save_pretrained_distributed(m, d)) == len(nnx.to_flat_state(nnx.state(m, nnx.Param)))
    True
    >>> all(np.array_equal(v, to_hf_state_dict(m)[k]) for k, v in load_hf_tensors(d).items())
    True
    """
    from jax.experimental import multihost_utils

    dtype = jnp.dtype(model.param_dtype if dtype is None else dtype)
    path = os.fspath(path)
    values = {_path_str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    by_base: dict[str, list[tuple[str, int | None, bool]]] = {}
    for hf_name, (param, transpose) in hf_name_map(model).items():
        base, expert = _split_expert(param)
        by_base.setdefault(base, []).append((hf_name, expert, transpose))
    bases = sorted(by_base)
    owners = _deal_by_size([int(np.prod(values[b].shape)) for b in bases], jax.process_count())
    me, main = jax.process_index(), jax.process_index() == 0
    files = [f"model-{k + 1:05d}-of-{len(bases):05d}.safetensors" for k in range(len(bases))]
    if main:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):  # weights of an earlier save
            if name == WEIGHTS_INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors")):
                os.remove(os.path.join(path, name))
    multihost_utils.sync_global_devices(f"rljax_save_pretrained_start:{path}")
    os.makedirs(path, exist_ok=True)
    weight_map: dict[str, str] = {}
    written: list[str] = []
    total = 0
    tied_head = explicit_lm_head and model.config.tie_word_embeddings
    for k, base in enumerate(bases):
        whole = multihost_utils.process_allgather(values[base].astype(dtype), tiled=True)
        tensors = {}
        for hf_name, expert, transpose in by_base[base]:
            arr = np.asarray(whole if expert is None else whole[expert])
            tensors[hf_name] = np.ascontiguousarray(arr.T if transpose else arr)
        if tied_head and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        weight_map.update({name: files[k] for name in tensors})
        total += sum(t.nbytes for t in tensors.values())
        if owners[k] == me:
            safetensors.numpy.save_file(tensors, os.path.join(path, files[k]), metadata={"format": "pt"})
            written.append(files[k])
        del whole, tensors
    if main:
        with open(os.path.join(path, WEIGHTS_INDEX_FILE), "w") as f:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            json.dump(index, f, indent=2, sort_keys=True)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(model.config.to_hf_dict(dtype=dtype.name), f, indent=2, sort_keys=True)
    multihost_utils.sync_global_devices(f"rljax_save_pretrained_done:{path}")
    return written


def _split_shards(tensors: dict[str, np.ndarray], max_shard_bytes: int | None) -> list[dict[str, np.ndarray]]:
    if max_shard_bytes is None:
        return [tensors]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    return shards


def generation_token_ids(
    config: ModelConfig, tokenizer: object | None = None, stop_token_ids: Sequence[int] = ()
) -> dict[str, int | list[int]]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for ``generation_config.json``.

    Each id comes from the model's config (``config.json`` / GGUF metadata keep them), else from the
    tokenizer. ``stop_token_ids`` (a chat renderer's end-of-turn tokens) are appended to the EOS ids,
    so a server that reads the file (vLLM, ``transformers.generate``) stops where the renderer does;
    ``eos_token_id`` is a list only when there is more than one.

    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2,
    ...                   extra_json='{"bos_token_id": 1, "eos_token_id": 2}')
    >>> generation_token_ids(cfg), generation_token_ids(cfg, stop_token_ids=[2, 5])["eos_token_id"]
    ({'bos_token_id': 1, 'eos_token_id': 2}, [2, 5])
    """
    extra = json.loads(config.extra_json)
    out: dict[str, int | list[int]] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = extra.get(key, getattr(tokenizer, key, None))
        if value is not None:
            out[key] = value if isinstance(value, int) else [int(v) for v in value]
    eos = out.get("eos_token_id", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    eos += [int(t) for t in stop_token_ids if int(t) not in eos]
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def save_generation_config(path: str | os.PathLike, token_ids: Mapping[str, int | list[int]]) -> None:
    """Writes ``generation_config.json``: the special token ids only (:func:`generation_token_ids`).

    No sampling defaults (temperature, top-p, ...): vLLM and ``transformers.generate`` apply those of
    this file to every request that does not set its own, and the trainer's sampling must not change
    with the server.
    """
    os.makedirs(os.fspath(path), exist_ok=True)
    with open(os.path.join(os.fspath(path), GENERATION_CONFIG_FILE), "w") as f:
        json.dump(dict(token_ids), f, indent=2, sort_keys=True)


def save_tokenizer_files(
    tokenizer: object, path: str | os.PathLike, *, model_max_length: int | None = None
) -> list[str]:
    """Writes a fast HF tokenizer (``tokenizer.json``, ``tokenizer_config.json``, the chat template)
    that transformers 4.x / 5.x, vLLM and other readers load; returns the files written.

    ``tokenizer.save_pretrained`` of transformers 5 writes the chat template to
    ``chat_template.jinja`` only and names the class ``TokenizersBackend``, which older readers do not
    know. ``tokenizer_config.json`` here also carries the template (``chat_template``), the class
    ``PreTrainedTokenizerFast`` (a name every release loads), and ``model_max_length`` (the model's
    context instead of transformers' "unbounded" 1e30).
    """
    path = os.fspath(path)
    files = [os.fspath(f) for f in tokenizer.save_pretrained(path)]
    config_path = os.path.join(path, TOKENIZER_CONFIG_FILE)
    with open(config_path) as f:
        config = json.load(f)
    if getattr(tokenizer, "is_fast", False):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return files
