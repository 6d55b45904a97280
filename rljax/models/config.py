"""Architecture configuration of the rljax decoder, read from and written to HF ``config.json``.

:class:`ModelConfig` holds exactly what the forward pass needs for the Qwen2, Qwen3 and Llama
families (GQA, RoPE with optional scaling, RMSNorm, q/k-norm, biases, tied embeddings). It is built
from a Hugging Face ``config.json`` dict with :meth:`ModelConfig.from_hf_dict` and written back with
:meth:`ModelConfig.to_hf_dict`, so a checkpoint saved by rljax loads in transformers and vLLM.

Both RoPE spellings are read: the transformers<5 ``rope_theta`` + ``rope_scaling`` fields and the
transformers>=5 ``rope_parameters`` dict; both are written. Features the decoder does not implement
(sliding-window layers, yarn/dynamic RoPE, partial rotary outside the hybrid families, activations
other than SiLU) raise a ``ValueError`` instead of silently computing something else.

The hybrid families (:data:`HYBRID_MODEL_TYPES`: Qwen3-Next, Qwen3.5 dense and MoE text models) add
``layer_types`` (which layers are Gated DeltaNet linear attention), the DeltaNet shapes
(``linear_*``) and ``partial_rotary_factor``; a multimodal Qwen3.5 ``config.json`` is read as its
``text_config``.

The config is a frozen, hashable dataclass so it can live as static metadata of an NNX module
(jit caches on it). Fields of the original ``config.json`` that the forward pass does not use
(token ids, ``architectures``, ...) are kept verbatim in ``extra_json`` and written back on save.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from rljax import knobs
from rljax.knobs import knob

SUPPORTED_MODEL_TYPES = (
    "qwen2",
    "qwen3",
    "llama",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
)
#: Families with Gated DeltaNet linear-attention layers next to gated full attention (Qwen3-Next,
#: Qwen3.5 dense and MoE text models): :mod:`rljax.models.linear_attention`.
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
#: Families whose MLPs may be sparse MoE blocks (qwen3_next: when ``num_experts > 0``).
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
#: Families whose MoE layers also have a sigmoid-gated shared expert.
SHARED_EXPERT_MODEL_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
#: Multimodal wrappers whose ``text_config`` rljax loads as the text model (vision tower dropped).
MULTIMODAL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
#: ``layer_types`` entry of a (gated) full-attention layer.
FULL_ATTENTION = "full_attention"
#: ``layer_types`` entry of a Gated DeltaNet (linear-attention) layer.
LINEAR_ATTENTION = "linear_attention"

_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}

# Keys that ModelConfig owns: they are re-derived on save and never copied from ``extra_json``.
_OWNED_KEYS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "torch_dtype",
        "dtype",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "shared_expert_intermediate_size",
        "full_attention_interval",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    }
)


@knobs.section
class ModelConfig:
    """Decoder architecture (one of the Qwen2 / Qwen3 / Llama families, their MoE variants, or the
    hybrid Qwen3-Next / Qwen3.5 families). Each field is a knob (:mod:`rljax.knobs`: type, default,
    allowed values and meaning on the field); the rules between fields are checked here.

    >>> cfg = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64,
    ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "head_dim": 32})
    >>> (cfg.head_dim, cfg.qk_norm, cfg.qkv_bias, cfg.num_kv_groups)
    (32, True, False, 2)
    """

    model_type: str = knob(
        choices=SUPPORTED_MODEL_TYPES, doc="the architecture family: ``config.json``'s ``model_type``"
    )
    vocab_size: int = knob(ge=1, doc="rows of the token embedding and of the output head")
    hidden_size: int = knob(ge=1, doc="width of the residual stream")
    intermediate_size: int = knob(ge=1, doc="width of a dense SwiGLU MLP")
    num_layers: int = knob(ge=1, doc="decoder layers: ``config.json``'s ``num_hidden_layers``")
    num_heads: int = knob(ge=1, doc="query heads of an attention layer")
    num_kv_heads: int = knob(
        ge=1, doc="key / value heads, a divisor of ``num_heads`` (grouped-query attention shares each)"
    )
    head_dim: int = knob(ge=1, doc="width of one attention head; even, as RoPE rotates pairs of dims")
    rope_theta: float = knob(10000.0, gt=0, doc="RoPE base frequency, finite")
    rope_scaling: tuple[tuple[str, Any], ...] | None = knob(
        None,
        doc="None (plain RoPE) or sorted ``(key, value)`` pairs (hashable): ``rope_type`` (``linear`` or "
        "``llama3``) and that type's parameters",
    )
    rms_norm_eps: float = knob(1e-6, gt=0, doc="epsilon of every RMSNorm")
    tie_word_embeddings: bool = knob(False, doc="the output head is the token embedding's transpose")
    qkv_bias: bool = knob(False, doc="biases on the query / key / value projections")
    o_bias: bool = knob(False, doc="a bias on the attention output projection")
    mlp_bias: bool = knob(False, doc="biases on the MLP projections (Llama's ``mlp_bias``)")
    qk_norm: bool = knob(False, doc="an RMSNorm on every query and key head before RoPE (Qwen3)")
    max_position_embeddings: int = knob(32768, ge=1, doc="the longest context the checkpoint declares")
    num_experts: int = knob(0, ge=0, doc="experts of an MoE layer; 0 (dense MLPs) outside the MoE families")
    num_experts_per_tok: int = knob(0, ge=0, doc="experts each token is routed to: the router's top-k")
    moe_intermediate_size: int = knob(0, ge=0, doc="width of one expert's SwiGLU MLP")
    norm_topk_prob: bool = knob(False, doc="renormalize the top-k routing weights to sum to 1")
    decoder_sparse_step: int = knob(
        1, ge=1, doc="every this many layers has an MoE block (Qwen2/3-MoE); 1: every layer"
    )
    mlp_only_layers: tuple[int, ...] = knob((), doc="layers of an MoE model that keep a dense MLP")
    shared_expert_intermediate_size: int = knob(
        0,
        ge=0,
        doc="width of the sigmoid-gated shared expert of every MoE layer in ``qwen2_moe``, ``qwen3_next`` "
        "and ``qwen3_5_moe_text``; 0 elsewhere",
    )
    layer_types: tuple[str, ...] = knob(
        (),
        doc="hybrid families: the mixer of every layer, ``full_attention`` (gated attention) or "
        "``linear_attention`` (Gated DeltaNet); empty elsewhere (every layer full attention)",
    )
    partial_rotary_factor: float = knob(
        1.0,
        gt=0,
        le=1,
        doc="the share of each head's dims that RoPE rotates; below 1 in the hybrid families only",
    )
    linear_conv_kernel_dim: int = knob(0, ge=0, doc="Gated DeltaNet: width of the causal convolution")
    linear_key_head_dim: int = knob(0, ge=0, doc="Gated DeltaNet: width of a key (and query) head")
    linear_value_head_dim: int = knob(0, ge=0, doc="Gated DeltaNet: width of a value head")
    linear_num_key_heads: int = knob(0, ge=0, doc="Gated DeltaNet: key (and query) heads")
    linear_num_value_heads: int = knob(
        0, ge=0, doc="Gated DeltaNet: value heads, a multiple of ``linear_num_key_heads``"
    )
    extra_json: str = dataclasses.field(default="{}", compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not math.isfinite(self.rope_theta):
            raise ValueError(f"ModelConfig.rope_theta: expected a finite number, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            _check_rope_scaling(dict(self.rope_scaling))
        self._check_moe()
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        if not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
        linear = (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        )
        if self.model_type not in HYBRID_MODEL_TYPES:
            if any(getattr(self, n) for n in linear) or self.partial_rotary_factor != 1.0:
                raise ValueError(
                    "linear_* fields and partial_rotary_factor need a hybrid model_type "
                    f"{HYBRID_MODEL_TYPES}, got {self.model_type!r}"
                )
            if any(t != FULL_ATTENTION for t in self.layer_types):
                raise ValueError(
                    f"layer_types other than {FULL_ATTENTION!r} need a hybrid model_type {HYBRID_MODEL_TYPES}"
                )
            return
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"ModelConfig.layer_types must name the mixer of each of the {self.num_layers} layers, "
                f"got {self.layer_types!r}"
            )
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise ValueError(
                f"layer_types entries must be {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}, got {bad}"
            )
        if LINEAR_ATTENTION in self.layer_types:
            for name in linear:
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise ValueError(
                        f"ModelConfig.{name} must be a positive int for {self.model_type}, got {value!r}"
                    )
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                    f"linear_num_key_heads ({self.linear_num_key_heads})"
                )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor!r} must give an even rotary dim in "
                f"(0, head_dim={self.head_dim}], got {self.rotary_dim}"
            )

    def _check_moe(self) -> None:
        if not isinstance(self.mlp_only_layers, tuple):
            object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.model_type == "qwen3_next" and not self.num_experts:  # a dense Qwen3-Next
            if self.shared_expert_intermediate_size or self.mlp_only_layers:
                raise ValueError(
                    "a dense qwen3_next (num_experts=0) takes no shared_expert_intermediate_size or "
                    "mlp_only_layers"
                )
            return
        if self.model_type not in MOE_MODEL_TYPES:
            if self.num_experts or self.shared_expert_intermediate_size:
                raise ValueError(
                    "num_experts / shared_expert_intermediate_size need an MoE model_type "
                    f"{MOE_MODEL_TYPES}, "
                    f"got {self.model_type!r}"
                )
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"ModelConfig.{name} must be a positive int for {self.model_type}, got {value!r}"
                )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                f"({self.num_experts})"
            )
        if self.model_type in SHARED_EXPERT_MODEL_TYPES and self.shared_expert_intermediate_size <= 0:
            raise ValueError(
                f"{self.model_type} needs shared_expert_intermediate_size > 0 (every MoE layer has a shared "
                "expert)"
            )
        if self.model_type == "qwen3_5_moe_text" and (
            self.mlp_only_layers or self.decoder_sparse_step != 1 or not self.norm_topk_prob
        ):
            raise ValueError(
                "qwen3_5_moe_text has an MoE block in every layer with normalized top-k weights: "
                "mlp_only_layers=(), decoder_sparse_step=1, norm_topk_prob=True"
            )
        if self.model_type == "qwen3_moe" and self.shared_expert_intermediate_size:
            raise ValueError("qwen3_moe has no shared expert; shared_expert_intermediate_size must be 0")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are outside [0, num_layers={self.num_layers})")

    @property
    def is_moe(self) -> bool:
        """True for the mixture-of-experts families (``qwen2_moe``, ``qwen3_moe``,
        ``qwen3_5_moe_text``, and ``qwen3_next`` with experts)."""
        return self.model_type in MOE_MODEL_TYPES and self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        """True for the families with Gated DeltaNet layers (:data:`HYBRID_MODEL_TYPES`): their full
        attention has an output gate, partial RoPE and zero-centered q/k norms, and every RMSNorm
        outside the DeltaNet scales by ``1 + weight``."""
        return self.model_type in HYBRID_MODEL_TYPES

    @property
    def mixer_types(self) -> tuple[str, ...]:
        """The token mixer of every layer (``"full_attention"`` / ``"linear_attention"``).

        >>> cfg = ModelConfig(model_type="qwen3_5_text", vocab_size=8, hidden_size=8,
        ...     intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
        ...     qk_norm=True, partial_rotary_factor=0.5, layer_types=("linear_attention", "full_attention"),
        ...     linear_conv_kernel_dim=4, linear_key_head_dim=4, linear_value_head_dim=4,
        ...     linear_num_key_heads=1, linear_num_value_heads=2)
        >>> cfg.mixer_types, cfg.linear_layers, cfg.rotary_dim
        (('linear_attention', 'full_attention'), (0,), 4)
        """
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet (linear-attention) layers."""
        return tuple(i for i, t in enumerate(self.mixer_types) if t == LINEAR_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of every attention head that RoPE rotates (``head_dim * partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers whose MLP is a sparse MoE block (HF's rule:
        ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``).

        >>> cfg = ModelConfig(model_type="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8,
        ...     num_layers=4, num_heads=2, num_kv_heads=1, head_dim=4, qk_norm=True, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=4, mlp_only_layers=(1,))
        >>> cfg.moe_layers
        (0, 2, 3)
        """
        if not self.is_moe:
            return ()
        return tuple(
            i
            for i in range(self.num_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_type(self) -> str:
        """``"default"``, ``"linear"`` or ``"llama3"``."""
        return "default" if self.rope_scaling is None else dict(self.rope_scaling)["rope_type"]

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face ``config.json`` dict (qwen2 / qwen3 / llama and their MoE
        variants; qwen3_next, qwen3_5_text, qwen3_5_moe_text; a multimodal ``qwen3_5`` /
        ``qwen3_5_moe`` wrapper gives its ``text_config``: the vision tower is not loaded).

        Raises ``ValueError`` naming the offending field for anything the decoder cannot run exactly.
        """
        hf = _text_config(dict(hf))
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; rljax runs {SUPPORTED_MODEL_TYPES}"
            )
        hybrid = model_type in HYBRID_MODEL_TYPES
        if model_type == "qwen3_5_moe_text":  # every layer is MoE: no dense MLP width of its own
            hf.setdefault("intermediate_size", hf.get("moe_intermediate_size"))
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {missing}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(
                f"hidden_act {act!r} is not supported; the decoder implements SwiGLU ('silu') only"
            )
        if not hybrid:
            _check_no_sliding_window(hf)
            if hf.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
                raise ValueError(
                    "partial_rotary_factor != 1 is not supported; remove it or use a full-rotary model"
                )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling, partial = _read_rope(hf, hybrid=hybrid)
        attention_bias = bool(hf.get("attention_bias", False))
        if model_type == "qwen2":
            # Qwen2 hard-codes bias on q/k/v and none on o_proj (transformers ignores attention_bias).
            qkv_bias, o_bias, qk_norm = True, False, False
        elif model_type == "qwen2_moe":
            # Qwen2-MoE: q/k/v bias from ``qkv_bias`` (default true), never an o_proj bias.
            qkv_bias, o_bias, qk_norm = bool(hf.get("qkv_bias", True)), False, False
        elif model_type in ("qwen3", "qwen3_moe") or hybrid:
            qkv_bias, o_bias, qk_norm = attention_bias, attention_bias, True
        else:
            qkv_bias, o_bias, qk_norm = attention_bias, attention_bias, False
        mlp_bias = bool(hf.get("mlp_bias", False)) if model_type == "llama" else False
        extra = {k: v for k, v in hf.items() if k not in _OWNED_KEYS}
        moe: dict[str, Any] = {}
        if model_type in MOE_MODEL_TYPES:
            extra.pop("qkv_bias", None)
            moe = dict(
                # transformers >= 5 writes num_local_experts (its attribute_map alias of num_experts)
                num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
                num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(hf.get("moe_intermediate_size", 0)),
                # Qwen3.5-MoE's router always renormalizes its top-k weights
                norm_topk_prob=model_type == "qwen3_5_moe_text" or bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0))
                if model_type in SHARED_EXPERT_MODEL_TYPES
                else 0,
            )
            if model_type == "qwen3_next" and not moe["num_experts"]:
                moe.update(shared_expert_intermediate_size=0, mlp_only_layers=())
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            extra_json=json.dumps(extra, sort_keys=True),
            **moe,
            **(_read_hybrid(hf, partial) if hybrid else {}),
        )

    def to_hf_dict(self, *, dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` dict transformers and vLLM read for this architecture.

        ``dtype`` is the name of the dtype the weights are stored in ("float32", "bfloat16", ...).
        """
        out: dict[str, Any] = json.loads(self.extra_json)
        out.setdefault("architectures", [_ARCHITECTURES[self.model_type]])
        rope_parameters = {"rope_type": self.rope_type, "rope_theta": self.rope_theta} | (
            {} if self.rope_scaling is None else dict(self.rope_scaling)
        )
        out.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=None if self.rope_scaling is None else dict(self.rope_scaling),
            rope_parameters=rope_parameters,
            torch_dtype=dtype,
        )
        if self.model_type == "qwen2":
            out.update(use_sliding_window=False)
            if not (self.qkv_bias and not self.o_bias):
                raise ValueError(
                    "a qwen2 config must have qkv_bias=True and o_bias=False (transformers fixes them)"
                )
        elif self.model_type == "qwen2_moe":
            if self.o_bias:
                raise ValueError(
                    "a qwen2_moe config must have o_bias=False (transformers has no o_proj bias)"
                )
            out.update(use_sliding_window=False, qkv_bias=self.qkv_bias)
        else:
            if self.qkv_bias != self.o_bias:
                raise ValueError(
                    f"{self.model_type} has one attention_bias flag for q/k/v/o; got qkv_bias={self.qkv_bias}"
                    f", o_bias={self.o_bias}"
                )
            out.update(attention_bias=self.qkv_bias)
        if self.model_type == "llama":
            out.update(mlp_bias=self.mlp_bias)
        if self.is_hybrid:
            self._hybrid_to_hf(out)
        if self.is_moe:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
            )
            if self.model_type != "qwen3_5_moe_text":  # its config class has none of these fields
                out.update(
                    norm_topk_prob=self.norm_topk_prob,
                    decoder_sparse_step=self.decoder_sparse_step,
                    mlp_only_layers=list(self.mlp_only_layers),
                )
            if self.model_type in SHARED_EXPERT_MODEL_TYPES:
                out.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        elif self.model_type == "qwen3_next":  # dense: no MoE block in any layer
            out.update(num_experts=0, mlp_only_layers=[])
        return out

    def _hybrid_to_hf(self, out: dict[str, Any]) -> None:
        """The hybrid families' fields of ``config.json`` (layer types, DeltaNet shapes, partial RoPE)."""
        out.update(
            layer_types=list(self.mixer_types),
            partial_rotary_factor=self.partial_rotary_factor,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim or 4,
            linear_key_head_dim=self.linear_key_head_dim or 128,
            linear_value_head_dim=self.linear_value_head_dim or 128,
            linear_num_key_heads=self.linear_num_key_heads or 16,
            linear_num_value_heads=self.linear_num_value_heads or 32,
        )
        out["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        out.pop("rope_scaling")
        out.pop("rope_theta")
        if self.model_type == "qwen3_5_moe_text":
            out.pop("intermediate_size")


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies ``[rotary_dim // 2]`` (float64 numpy; a static constant of the model;
    ``rotary_dim = head_dim`` but in the hybrid families' partial RoPE).

    Default (Su et al. 2021, RoFormer): ``inv_freq_i = theta^(-2i/d)``.
    ``linear`` (position interpolation, Chen et al. 2023): ``inv_freq / factor``.
    ``llama3`` (Llama 3.1 report): wavelength ``w = 2 pi / inv_freq``; with ``L`` the original
    context, ``lo = L / low_freq_factor``, ``hi = L / high_freq_factor``: keep ``inv_freq`` where
    ``w < hi``, divide by ``factor`` where ``w > lo``, otherwise interpolate with
    ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``:
    ``(1 - s) inv_freq / factor + s inv_freq``.

    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=100.0)
    >>> rope_inverse_frequencies(cfg).tolist()
    [1.0, 0.1]
    """
    d = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if config.rope_scaling is None:
        return inv_freq
    params = dict(config.rope_scaling)
    factor = float(params["factor"])
    if params["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params.get("original_max_position_embeddings", config.max_position_embeddings))
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


def _read_rope(
    hf: Mapping[str, Any], *, hybrid: bool = False
) -> tuple[float, tuple[tuple[str, Any], ...] | None, float]:
    """Reads ``(rope_theta, rope_scaling, partial_rotary_factor)`` from either the legacy or the
    transformers>=5 fields. Hybrid families: partial rotary (default 0.25, as transformers') and
    the multimodal RoPE sections of Qwen3.5 are accepted; with the text's single position per token
    every section rotates by the same position, which is plain RoPE."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict or null, got {params!r}")
    params = dict(params)
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported (all layers must share one RoPE)")
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    default_partial = hf.get("partial_rotary_factor", 0.25 if hybrid else 1.0)
    partial = float(params.pop("partial_rotary_factor", default_partial) or 1.0)
    if hybrid:
        params.pop("mrope_section", None)
        params.pop("mrope_interleaved", None)
    elif partial != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported; remove it or use a full-rotary model")
    if rope_type == "default":
        return theta, None, partial
    scaling = {"rope_type": rope_type, **params}
    _check_rope_scaling(scaling)
    return theta, tuple(sorted(scaling.items())), partial


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's (:data:`MULTIMODAL_WRAPPERS`) ``text_config`` as a text model's config
    (its tied-embedding flag and special token ids inherited); any other dict unchanged."""
    wrapper = hf.get("model_type")
    if wrapper not in MULTIMODAL_WRAPPERS:
        return hf
    if not isinstance(hf.get("text_config"), Mapping):
        raise ValueError(f"a {wrapper} config.json needs a text_config dict, got {hf.get('text_config')!r}")
    text = dict(hf["text_config"])
    text["model_type"] = MULTIMODAL_WRAPPERS[wrapper]
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in hf and key not in text:
            text[key] = hf[key]
    return text


def _read_hybrid(hf: Mapping[str, Any], partial: float) -> dict[str, Any]:
    """The hybrid families' ModelConfig fields: layer types (``layer_types``, else every
    ``full_attention_interval``-th layer full attention, as transformers), DeltaNet shapes."""
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    if hf.get("attn_output_gate", True) is False:
        raise ValueError("attn_output_gate=false is not supported; Qwen3-Next / Qwen3.5 attention is gated")
    defaults = dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
    )
    return dict(
        layer_types=tuple(str(t) for t in layer_types),
        partial_rotary_factor=partial,
        **{k: int(hf.get(k) or v) for k, v in defaults.items()},
    )


def _check_rope_scaling(scaling: Mapping[str, Any]) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES[1:]:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES} "
            "(or remove rope_scaling for plain RoPE)"
        )
    required = ("factor",) if rope_type == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"rope scaling type {rope_type!r} needs field(s) {missing}")
    if float(scaling["factor"]) <= 0:
        raise ValueError(f"rope scaling factor must be > 0, got {scaling['factor']!r}")
    if rope_type == "llama3" and float(scaling["high_freq_factor"]) <= float(scaling["low_freq_factor"]):
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    if "attention_factor" in scaling and float(scaling["attention_factor"]) != 1.0:
        raise ValueError("rope attention_factor != 1 is not supported")


def _check_no_sliding_window(hf: Mapping[str, Any]) -> None:
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true is not supported; rljax runs full attention in every layer")
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types must all be 'full_attention'; got {sorted(set(layer_types))}")
