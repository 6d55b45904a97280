"""LoRA adapters on the NNX decoder, in PEFT's format (Hu et al. 2021, "LoRA: Low-Rank Adaptation").

A targeted :class:`~rljax.models.layers.Linear` ``y = x W (+ b)`` gains two trainable matrices::

    y = x W (+ b) + (alpha / r) * (x A) B        A: [in, r], B: [r, out]

(``alpha / sqrt(r)`` with ``rslora``, rank-stabilized LoRA, PEFT's ``use_rslora``), with PEFT's
initialisation: ``A`` Kaiming-uniform (``a = sqrt(5)``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``)
and ``B = 0``, so a fresh adapter leaves the model's outputs exactly unchanged. Adapter weights are
:class:`LoRAParam` variables (not ``nnx.Param``), so ``nnx.state(model, LoRAParam)`` selects exactly
the adapter and the base's HF I/O never sees it; the base can be held in another dtype (e.g.
bfloat16) while the adapter stays float32.

Files: :func:`save_adapter` / :func:`load_adapter` write and read PEFT's ``adapter_config.json`` +
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` ``[r, in]``, ``lora_B``
``[out, r]``), which ``peft`` + transformers and vLLM's LoRA support load;
:func:`merge_lora` folds an adapter into plain weights (``W + (alpha/r) A B``).

Targets are module names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``) of the dense projections (and, in Qwen3.5 / Qwen3-Next, ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` or Qwen3-Next's ``in_proj_qkvz``, ``in_proj_ba``, and ``out_proj`` of the
Gated DeltaNet layers; their full attention's ``q_proj`` also yields the output gate, as in HF),
``lm_head`` (the output projection, see below), and for MoE models the stacked experts
(:class:`rljax.models.moe.Experts`) by PEFT's parameter names of transformers' fused experts:
``experts.gate_up_proj`` (gate and up share one ``A``, as in the fused ``[E, 2I, H]`` HF tensor) and
``experts.down_proj``; ``experts`` means both. Per expert ``e`` (PEFT's ``ParamWrapper``)::

    W_e <- W_e + (alpha / r) A_e B_e        A_e: [in, r], B_e: [r, out], one pair per expert

computed as effective weights in the forward (:func:`expert_weights`). In the files PEFT packs the
experts along the rank: ``lora_A.weight`` ``[E r, in]`` (row ``e r + j``) and ``lora_B.weight``
``[out, r E]`` (column ``j E + e``), under ``mlp.experts.`` with one ``base_layer.`` per
ParamWrapper nested inside (``gate_up_proj`` is wrapped first, so it is the inner one when both are
targeted), and ``adapter_config.json`` lists them as ``target_parameters``.

``lm_head`` adapts the unembedding (the output projection, PEFT's ``lm_head`` module)::

    logits = h W_out + (alpha / r) (h A) B        A: [hidden, r], B: [r, vocab]

held as ``model.lm_head_lora`` (:class:`UnembedAdapter`) and applied by the decoder's logits path
(:meth:`rljax.models.Decoder.unembedding_lora`: ``Decoder.logits``, the chunked logprobs, hence the
training forward and the embedded sampler). With tied embeddings it adapts the OUTPUT projection
only, the input embedding stays the base's (as PEFT's ``lm_head`` adapter on a tied model); merging
it unties the model (an explicit ``lm_head`` = ``embed^T + (alpha / r) A B``). Files:
``base_model.model.lm_head.lora_A.weight`` ``[r, hidden]`` and ``lora_B`` ``[vocab, r]``.

>>> from rljax.models.tiny import tiny_model
>>> m = apply_lora(tiny_model(), LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
>>> sorted({p[-2] for p, _ in nnx.to_flat_state(nnx.state(m, LoRAParam))})[:3]
['down_proj', 'gate_proj', 'k_proj']
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import pathlib
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from rljax import knobs
from rljax.knobs import knob
from rljax.models.layers import Linear

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "UNEMBED_TARGET",
    "UnembedAdapter",
    "ADAPTER_WEIGHTS_FILE",
    "DEFAULT_TARGETS",
    "EXPERT_TARGETS",
    "LINEAR_ATTENTION_TARGETS",
    "MODULE_TARGETS",
    "LoRAConfig",
    "LoRAParam",
    "apply_lora",
    "expert_weights",
    "load_adapter",
    "lora_state",
    "merge_lora",
    "save_adapter",
]

#: File name of a saved adapter's config (PEFT's).
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: File name of a saved adapter's weights (PEFT's).
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: Modules that get adapters by default: every attention and MLP projection.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The Gated DeltaNet projections of Qwen3.5 (``in_proj_qkv/z/b/a``) and Qwen3-Next (``in_proj_qkvz``,
#: ``in_proj_ba``), and their output projection (:mod:`rljax.models.linear_attention`).
LINEAR_ATTENTION_TARGETS = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "in_proj_qkvz",
    "in_proj_ba",
    "out_proj",
)
#: Every Linear module target (PEFT ``target_modules``).
MODULE_TARGETS = DEFAULT_TARGETS + LINEAR_ATTENTION_TARGETS
#: PEFT ``target_parameters`` of the stacked MoE experts (transformers' fused ``Qwen*MoeExperts``), in
#: their registration order (PEFT nests the wrappers in that order); ``"experts"`` targets both.
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
EXPERTS = "experts"
#: The unembedding (output projection) target, PEFT's module name for it.
UNEMBED_TARGET = "lm_head"
_PEFT_PREFIX = "base_model.model.model."
_PEFT_UNEMBED = "base_model.model.lm_head.lora_{}.weight"


class LoRAParam(nnx.Variable):
    """An adapter weight (``lora_a`` / ``lora_b`` of a targeted Linear): trainable, not base."""


@knobs.section
class LoRAConfig:
    """Rank ``r``, ``alpha`` (scale ``alpha / r``), targets, dropout (only 0 is supported: RL recomputes
    the policy's logprobs, which stochastic dropout would make inconsistent).

    ``targets``: any of :data:`DEFAULT_TARGETS` (dense projections, incl. qwen2_moe's shared expert),
    :data:`LINEAR_ATTENTION_TARGETS` (the Gated DeltaNet projections of Qwen3.5 / Qwen3-Next),
    :data:`UNEMBED_TARGET` (``"lm_head"``: the output projection, tied or not) and
    :data:`EXPERT_TARGETS` (MoE expert stacks: ``experts.gate_up_proj`` adapts gate and up with
    one shared ``A`` per expert, ``experts.down_proj`` the down projection; ``mlp.experts.*`` as PEFT
    writes them is accepted too). ``"experts"`` expands to both expert targets. The default targets
    the dense projections only: an expert adapter has ``E`` times the parameters of a dense one.

    >>> LoRAConfig(targets=("q_proj", "experts")).targets
    ('q_proj', 'experts.gate_up_proj', 'experts.down_proj')
    """

    rank: int = knob(8, ge=1, doc="the adapters' rank ``r``")
    alpha: float = knob(16.0, gt=0, doc="the adapters' scale numerator (scale ``alpha / r``)")
    targets: tuple[str, ...] = knob(
        DEFAULT_TARGETS,
        doc="the modules that get adapters: a non-empty subset of the dense, linear-attention, "
        "``lm_head`` and expert targets (``experts`` = both expert stacks)",
    )
    dropout: float = knob(0.0, ge=0, doc="adapter dropout; only 0 is supported")
    target_ranks: dict = knob(
        {},
        doc="ranks of single targets over ``rank``, e.g. ``{'experts.gate_up_proj': 16}`` (PEFT's "
        "``rank_pattern``, by target name)",
    )
    target_alphas: dict = knob(
        {}, doc="alphas of single targets over ``alpha`` (PEFT's ``alpha_pattern``, by target name)"
    )
    rslora: bool = knob(
        False,
        doc="rank-stabilized LoRA (Kalajdzievski 2023): scale ``alpha / sqrt(r)`` instead of "
        "``alpha / r`` (PEFT's ``use_rslora``)",
    )

    def __post_init__(self) -> None:
        if not math.isfinite(self.alpha):
            raise ValueError(f"LoRAConfig.alpha: expected a finite number > 0, got {self.alpha!r}")
        object.__setattr__(self, "targets", _normalize_targets(self.targets))
        unknown = sorted(set(self.targets) - set(MODULE_TARGETS) - set(EXPERT_TARGETS) - {UNEMBED_TARGET})
        if unknown or not self.targets:
            raise ValueError(
                "LoRAConfig.targets: expected a non-empty subset of "
                f"{MODULE_TARGETS + (UNEMBED_TARGET,) + EXPERT_TARGETS} "
                f"(or {EXPERTS!r} for both expert stacks), got {unknown}"
            )
        if self.dropout != 0.0:
            raise ValueError(
                "LoRAConfig.dropout: > 0 is not supported: the trainer recomputes the policy's logprobs "
                "(old, new, reference) and stochastic dropout would make them disagree; use 0.0"
            )
        for name, integer in (("target_ranks", True), ("target_alphas", False)):
            object.__setattr__(self, name, _per_target(self, name, integer))
        scales = {self.scale_of(t) for t in self.expert_targets}
        if len(scales) > 1:
            raise ValueError(
                "LoRAConfig.target_ranks / target_alphas: the expert targets share one scale alpha / r "
                f"per stack, got { {t: self.scale_of(t) for t in self.expert_targets} }"
            )

    def __hash__(self) -> int:  # the model holds its config as a static attribute: jit hashes it
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                          for v in dataclasses.astuple(self)))  # fmt: skip

    def rank_of(self, target: str) -> int:
        """The rank of ``target``'s adapter (``target_ranks``, else ``rank``)."""
        return int(self.target_ranks.get(target, self.rank))

    def alpha_of(self, target: str) -> float:
        """The alpha of ``target``'s adapter (``target_alphas``, else ``alpha``)."""
        return float(self.target_alphas.get(target, self.alpha))

    def scale_of(self, target: str) -> float:
        """The output factor of ``target``'s adapter: its alpha over its rank (its square root with
        ``rslora``)."""
        return _scale(self.alpha_of(target), self.rank_of(target), self.rslora)

    @property
    def max_rank(self) -> int:
        """The largest rank of any target (what a server must take)."""
        return max(self.rank_of(t) for t in self.targets)

    @property
    def scale(self) -> float:
        """The factor of the adapter's output: ``alpha / rank`` (``alpha / sqrt(rank)`` with ``rslora``)."""
        return _scale(self.alpha, self.rank, self.rslora)

    @property
    def module_targets(self) -> tuple[str, ...]:
        """The dense (Linear) targets, PEFT's ``target_modules``."""
        return tuple(t for t in self.targets if t in MODULE_TARGETS)

    @property
    def unembed(self) -> bool:
        """Whether the output projection (``lm_head``) is adapted."""
        return UNEMBED_TARGET in self.targets

    @property
    def expert_targets(self) -> tuple[str, ...]:
        """The expert-stack targets in :data:`EXPERT_TARGETS` order (PEFT's nesting order)."""
        return tuple(t for t in EXPERT_TARGETS if t in self.targets)


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    return float(alpha) / (math.sqrt(rank) if rslora else rank)


def _per_target(config: LoRAConfig, name: str, integer: bool) -> dict:
    """``config.<name>`` with its keys normalized like ``targets`` (checked: targeted names, ranks
    ints >= 1, alphas finite > 0)."""
    out = {}
    for key, value in dict(getattr(config, name) or {}).items():
        for target in _normalize_targets(key):
            where = f"LoRAConfig.{name}[{key!r}]"
            if target not in config.targets:
                raise ValueError(f"{where}: not one of the targets {config.targets}")
            kind = numbers.Integral if integer else numbers.Real
            number = isinstance(value, kind) and not isinstance(value, bool)
            if not number or not (value >= 1 if integer else math.isfinite(value) and value > 0):
                raise ValueError(f"{where}: expected {'an int >= 1' if integer else 'a finite number > 0'}, "
                                 f"got {value!r}")  # fmt: skip
            out[target] = int(value) if integer else float(value)
    return out


def _normalize_targets(targets: Sequence[str] | str) -> tuple[str, ...]:
    """``"experts"`` -> both :data:`EXPERT_TARGETS`, ``"mlp.experts.x"`` -> ``"experts.x"``; order kept."""
    out: list[str] = []
    for t in (targets,) if isinstance(targets, str) else targets:
        t = str(t).removeprefix("mlp.")
        for name in EXPERT_TARGETS if t == EXPERTS else (t,):
            if name not in out:
                out.append(name)
    return tuple(out)


def _targeted(model: nnx.Module, targets: Sequence[str]) -> list[tuple[tuple, Linear]]:
    """The Linears of ``model`` named by the dense targets among ``targets`` (never ``lm_head``: its
    adapter is :class:`UnembedAdapter`)."""
    targets = [t for t in targets if t in MODULE_TARGETS]
    out = []
    for path, module in nnx.iter_graph(model):
        if (
            isinstance(module, Linear)
            and path
            and str(path[-1]) in targets
            and "experts" not in map(str, path)
        ):
            out.append((tuple(path), module))
    return out


def _expert_stacks(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """The stacked MoE experts of ``model`` (:class:`rljax.models.moe.Experts`: an ``experts`` module
    with 3-D ``gate_proj`` / ``up_proj`` ``[E, H, I]`` and ``down_proj`` ``[E, I, H]`` params)."""
    out = []
    for path, module in nnx.iter_graph(model):
        down = getattr(module, "down_proj", None)
        if path and str(path[-1]) == EXPERTS and isinstance(down, nnx.Param) and down.ndim == 3:
            out.append((tuple(path), module))
    return out


#: Expert target -> (attribute of its ``A``, ((attribute of a ``B``, the stacked weight it adapts), ...)).
#: ``experts.gate_up_proj`` shares one ``A`` between gate and up (PEFT adapts the fused HF tensor).
_EXPERT_ADAPTERS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "experts.gate_up_proj": ("gate_up_lora_a", (("gate_lora_b", "gate_proj"), ("up_lora_b", "up_proj"))),
    "experts.down_proj": ("down_lora_a", (("down_lora_b", "down_proj"),)),
}


def _kaiming_a(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype: jnp.dtype) -> jax.Array:
    """PEFT's ``A`` init: kaiming_uniform(a=sqrt(5)) = ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _attach_linear(lin: Linear, target: str, config: LoRAConfig, key: jax.Array, dtype: jnp.dtype) -> None:
    fan_in, fan_out = lin.kernel.shape
    rank = config.rank_of(target)
    # Sharded like the kernel's in / out dimension (rljax.models.sharding); the rank is replicated.
    axes = lin.kernel.get_metadata().get("logical_axes") or (None, None)
    a = _kaiming_a(key, (fan_in, rank), fan_in, dtype)
    lin.lora_a = LoRAParam(a, logical_axes=(axes[0], None))
    lin.lora_b = LoRAParam(jnp.zeros((rank, fan_out), dtype), logical_axes=(None, axes[1]))
    lin.lora_scale = config.scale_of(target)


def _attach_experts(experts: nnx.Module, target: str, config: LoRAConfig, key: jax.Array,
                    dtype: jnp.dtype) -> None:  # fmt: skip
    """Adds ``A [E, in, r]`` (Kaiming-uniform per expert, as PEFT) and ``B [E, r, out] = 0`` for one
    expert target; sharded like the stacked weights (expert axis; in / out dims), rank replicated."""
    a_name, bs = _EXPERT_ADAPTERS[target]
    if getattr(experts, a_name, None) is not None:
        raise ValueError(f"the experts already have a LoRA adapter for {target}")
    first = getattr(experts, bs[0][1])
    num_experts, fan_in, _ = first.shape
    axes = first.get_metadata().get("logical_axes") or (None, None, None)
    rank = config.rank_of(target)
    a = _kaiming_a(key, (num_experts, fan_in, rank), fan_in, dtype)
    setattr(experts, a_name, LoRAParam(a, logical_axes=(axes[0], axes[1], None)))
    for b_name, w_name in bs:
        w = getattr(experts, w_name)
        w_axes = w.get_metadata().get("logical_axes") or (None, None, None)
        b = jnp.zeros((num_experts, rank, w.shape[2]), dtype)
        setattr(experts, b_name, LoRAParam(b, logical_axes=(w_axes[0], None, w_axes[2])))
    experts.lora_scale = config.scale_of(target)  # one per stack: the config keeps the targets' equal


class UnembedAdapter(nnx.Module):
    """The LoRA adapter of the output projection (``model.lm_head_lora``): ``lora_a [hidden, r]``
    (Kaiming-uniform, as PEFT), ``lora_b [r, vocab]`` (zeros), ``lora_scale = alpha / r``; sharded
    like the unembedding (``embed`` / ``vocab`` axes), the rank replicated."""

    def __init__(self, hidden: int, vocab: int, config: LoRAConfig, key: jax.Array, dtype: jnp.dtype) -> None:
        rank = config.rank_of(UNEMBED_TARGET)
        a = _kaiming_a(key, (hidden, rank), hidden, dtype)
        self.lora_a = LoRAParam(a, logical_axes=("embed", None))
        self.lora_b = LoRAParam(jnp.zeros((rank, vocab), dtype), logical_axes=(None, "vocab"))
        self.lora_scale = config.scale_of(UNEMBED_TARGET)


def _has_unembedding(model: nnx.Module) -> bool:
    return hasattr(model, "embed_tokens") and hasattr(model, "unembedding_lora")


def apply_lora(
    model: nnx.Module, config: LoRAConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32
) -> nnx.Module:
    """Attaches fresh adapters (A Kaiming-uniform, B = 0) to every targeted Linear, for expert
    targets to every MoE expert stack, and for ``lm_head`` to the output projection of ``model``
    (in place).

    Returns ``model``. Raises ``ValueError`` when a target matches nothing (the dense targets
    together, the expert stacks, the output projection), or when adapters are already attached.
    """
    found = _targeted(model, config.targets)
    stacks = _expert_stacks(model) if config.expert_targets else []
    if config.expert_targets and not stacks:
        raise ValueError(f"LoRA targets {config.expert_targets} name MoE expert stacks: the model has none")
    if config.unembed and not _has_unembedding(model):
        raise ValueError("LoRA target 'lm_head' needs a decoder with an output projection (rljax Decoder)")
    if config.module_targets and not found:
        raise ValueError(f"no Linear of the model matches the LoRA targets {config.module_targets}")
    for path, lin in found:
        if getattr(lin, "lora_a", None) is not None:
            raise ValueError(f"{'.'.join(map(str, path))} already has a LoRA adapter")
        _attach_linear(lin, str(path[-1]), config, rngs.params(), dtype)
    for _, experts in stacks:
        for target in config.expert_targets:
            _attach_experts(experts, target, config, rngs.params(), dtype)
    if config.unembed:
        if getattr(model, "lm_head_lora", None) is not None:
            raise ValueError("the output projection (lm_head) already has a LoRA adapter")
        vocab, hidden = model.embed_tokens.shape
        model.lm_head_lora = UnembedAdapter(hidden, vocab, config, rngs.params(), dtype)
    model.lora_config = config
    return model


def _expert_delta(experts: nnx.Module, w_name: str, precision: jax.lax.PrecisionLike) -> jax.Array | None:
    """float32 ``(alpha / r) A_e B_e`` for every expert ``e`` (``[E, in, out]``) of the stacked weight
    ``w_name``, or None when it has no adapter."""
    for a_name, bs in _EXPERT_ADAPTERS.values():
        for b_name, target_w in bs:
            a = getattr(experts, a_name, None)
            if target_w == w_name and a is not None:
                b = getattr(experts, b_name)[...].astype(jnp.float32)
                ab = jnp.einsum("eir,ero->eio", a[...].astype(jnp.float32), b, precision=precision)
                return ab * experts.lora_scale
    return None


def expert_weights(
    experts: nnx.Module, dtype: jnp.dtype, precision: jax.lax.PrecisionLike = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(gate [E, H, I], up [E, H, I], down [E, I, H])`` in ``dtype`` as the MoE forward uses them.

    With an expert adapter, per expert ``e``: ``W_e + (alpha / r) A_e B_e`` (the delta in float32, cast
    to ``dtype``, then added), so the grouped expert kernels run unchanged on effective weights (one
    extra copy of the stack; the adapter gradient is ``dW_e`` contracted to rank ``r``). With none:
    the stacked weights cast to ``dtype``.
    """
    out = []
    for w_name in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(experts, w_name)[...].astype(dtype)
        delta = _expert_delta(experts, w_name, precision)
        out.append(w if delta is None else w + delta.astype(dtype))
    return out[0], out[1], out[2]


def lora_state(model: nnx.Module) -> nnx.State:
    """The adapter weights of ``model`` (``nnx.state(model, LoRAParam)``)."""
    return nnx.state(model, LoRAParam)


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with every adapter folded into its base kernel and removed (plain HF weights).

    ``model`` itself is left unchanged.

    >>> from rljax.models.tiny import tiny_model
    >>> m = apply_lora(tiny_model(), LoRAConfig(rank=2, targets=("q_proj",)), rngs=nnx.Rngs(0))
    >>> m.layers[0].self_attn.q_proj.lora_b[...] = jnp.ones_like(m.layers[0].self_attn.q_proj.lora_b[...])
    >>> merged = merge_lora(m)
    >>> before = np.asarray(tiny_model().layers[0].self_attn.q_proj.kernel[...])
    >>> bool(np.array_equal(m.layers[0].self_attn.q_proj.kernel[...], before)), hasattr(merged, "lora_config")
    (True, False)
    """
    graphdef, state = nnx.split(model)
    # A copy with its own Variables (merge alone would share them with ``model``, whose kernels an
    # in-place write would then change too).
    merged = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    for _, lin in _targeted(merged, MODULE_TARGETS):
        if getattr(lin, "lora_a", None) is None:
            continue
        delta = (lin.lora_a[...].astype(jnp.float32) @ lin.lora_b[...].astype(jnp.float32)) * lin.lora_scale
        kernel = lin.kernel[...]
        lin.kernel = lin.kernel.replace((kernel.astype(jnp.float32) + delta).astype(kernel.dtype))
        del lin.lora_a, lin.lora_b, lin.lora_scale
    for _, experts in _expert_stacks(merged):
        _merge_experts(experts)
    if getattr(merged, "lm_head_lora", None) is not None:
        _merge_unembedding(merged)
    if hasattr(merged, "lora_config"):
        del merged.lora_config
    return merged


def _merge_unembedding(model: nnx.Module) -> None:
    """Folds the output projection's adapter into it (``W_out + (alpha / r) A B``) and removes it. A
    tied model is untied: it gets an explicit ``lm_head`` (the input embedding stays the base's) and
    ``config.tie_word_embeddings=False``, so its HF files say so."""
    adapter = model.lm_head_lora
    a, b = adapter.lora_a[...].astype(jnp.float32), adapter.lora_b[...].astype(jnp.float32)
    delta = (a @ b) * adapter.lora_scale
    if model.lm_head is None:
        embed = model.embed_tokens
        vocab, hidden = embed.shape
        head = Linear(hidden, vocab, use_bias=False, logical_axes=("embed", "vocab"), dtype=model.dtype,
                       param_dtype=embed.dtype, precision=model.precision, rngs=nnx.Rngs(0))  # fmt: skip
        head.kernel = head.kernel.replace((embed[...].T.astype(jnp.float32) + delta).astype(embed.dtype))
        model.lm_head = nnx.data(head)  # None (static) until now
        model.config = dataclasses.replace(model.config, tie_word_embeddings=False)
    else:
        kernel = model.lm_head.kernel
        model.lm_head.kernel = kernel.replace((kernel[...].astype(jnp.float32) + delta).astype(kernel.dtype))
    del model.lm_head_lora


def _merge_experts(experts: nnx.Module) -> None:
    """Folds an expert adapter into the stacked weights (``W_e += (alpha / r) A_e B_e``) and removes it."""
    if getattr(experts, "lora_scale", None) is None:
        return
    for w_name in ("gate_proj", "up_proj", "down_proj"):
        delta = _expert_delta(experts, w_name, None)
        if delta is not None:
            w = getattr(experts, w_name)
            setattr(experts, w_name, w.replace((w[...].astype(jnp.float32) + delta).astype(w.dtype)))
    for a_name, bs in _EXPERT_ADAPTERS.values():
        for name in (a_name, *(b for b, _ in bs)):
            if getattr(experts, name, None) is not None:
                delattr(experts, name)
    del experts.lora_scale


# ------------------------------------------------------------------------------------------------
# PEFT files
# ------------------------------------------------------------------------------------------------


def _peft_name(path: tuple, which: str) -> str:
    return _PEFT_PREFIX + ".".join(map(str, path)) + f".lora_{which}.weight"


def _peft_expert_names(path: tuple, targets: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """PEFT's ``(A name, B name)`` of each expert target: ParamWrappers nest in :data:`EXPERT_TARGETS`
    order, the first wrapped innermost, so target ``j`` of ``k`` sits under ``k - 1 - j``
    ``base_layer.``s."""
    out = {}
    for j, target in enumerate(targets):
        inner = path + ("base_layer",) * (len(targets) - 1 - j)
        out[target] = (_peft_name(inner, "A"), _peft_name(inner, "B"))
    return out


def _experts_to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rljax ``A [E, in, r]``, ``B [E, r, out]`` -> PEFT ``lora_A [E r, in]`` (row ``e r + j``) and
    ``lora_B [out, r E]`` (column ``j E + e``)."""
    num_experts, fan_in, rank = a.shape
    peft_a = a.transpose(0, 2, 1).reshape(num_experts * rank, fan_in)
    peft_b = b.transpose(2, 1, 0).reshape(b.shape[2], rank * num_experts)
    return np.ascontiguousarray(peft_a), np.ascontiguousarray(peft_b)


def _experts_from_peft(
    peft_a: np.ndarray, peft_b: np.ndarray, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`_experts_to_peft`: ``(A [E, in, r], B [E, r, out])``."""
    if peft_a.ndim != 2 or peft_b.ndim != 2 or peft_a.shape[0] % num_experts:
        raise ValueError(f"expert LoRA shapes {peft_a.shape}, {peft_b.shape} do not fit E={num_experts}")
    rank = peft_a.shape[0] // num_experts
    a = peft_a.reshape(num_experts, rank, peft_a.shape[1]).transpose(0, 2, 1)
    b = peft_b.reshape(peft_b.shape[0], -1, num_experts).transpose(2, 1, 0)
    return a, b


def _expert_tensors(path: tuple, experts: nnx.Module, targets: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The PEFT tensors of one expert stack's adapter (gate and up ``B`` concatenated: fused HF order)."""
    tensors = {}
    for target, (name_a, name_b) in _peft_expert_names(path, targets).items():
        a_name, bs = _EXPERT_ADAPTERS[target]
        a = np.asarray(getattr(experts, a_name)[...], np.float32)
        b = np.concatenate([np.asarray(getattr(experts, b_name)[...], np.float32) for b_name, _ in bs], -1)
        tensors[name_a], tensors[name_b] = _experts_to_peft(a, b)
    return tensors


def save_adapter(
    model: nnx.Module, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> pathlib.Path:
    """Writes the model's adapter as a PEFT adapter directory (config + safetensors); returns it.

    Expert targets are written as PEFT's ``target_parameters`` (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``), the dense ones as ``target_modules``.
    """
    config: LoRAConfig | None = getattr(model, "lora_config", None)
    if config is None:
        raise ValueError("the model has no LoRA adapter (apply_lora or load_adapter first)")
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, lin in _targeted(model, config.targets):
        tensors[_peft_name(path, "A")] = np.ascontiguousarray(np.asarray(lin.lora_a[...], np.float32).T)
        tensors[_peft_name(path, "B")] = np.ascontiguousarray(np.asarray(lin.lora_b[...], np.float32).T)
    if config.expert_targets:
        for path, experts in _expert_stacks(model):
            tensors.update(_expert_tensors(path, experts, config.expert_targets))
    if config.unembed:
        adapter = model.lm_head_lora
        for which, var in (("A", adapter.lora_a), ("B", adapter.lora_b)):
            tensors[_PEFT_UNEMBED.format(which)] = np.ascontiguousarray(np.asarray(var[...], np.float32).T)
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE))
    meta = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": _file_module_targets(model, config),
        "target_parameters": [f"mlp.{t}" for t in config.expert_targets] or None,
        **_patterns(config),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": config.rslora,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return out


#: Dense targets that peft (>= 0.22) reads as transformers 4's names of the experts in a MoE model
#: (``gate_proj`` + ``up_proj`` -> the fused ``experts.gate_up_proj``, ``down_proj`` -> the experts'
#: too), so a file names them with their parent module, which peft matches as a suffix.
_PEFT_MOE_RENAMED = ("gate_proj", "up_proj", "down_proj")


def _file_module_targets(model: nnx.Module, config: LoRAConfig) -> list[str]:
    """``target_modules`` of a file: the dense targets (and ``lm_head``); in a model with expert
    stacks the MLP ones as ``<parent>.<name>`` (``mlp.gate_proj``, ``shared_expert.up_proj``) for
    peft's MoE conversion to leave them alone (it adapts the experts through them otherwise)."""
    names = set(config.module_targets) | ({UNEMBED_TARGET} if config.unembed else set())
    if _expert_stacks(model):
        renamed = {t for t in names if t in _PEFT_MOE_RENAMED}
        names = (names - renamed) | {f"{p[-2]}.{p[-1]}" for p, _ in _targeted(model, tuple(renamed))}
    return sorted(names)


def _config_targets(meta: dict, d: pathlib.Path) -> tuple[str, ...]:
    """rljax targets of a PEFT ``adapter_config``: ``target_modules`` (names, ``<parent>.<name>``
    suffixes, or a regex) and the expert ``target_parameters`` (``[mlp.]experts.gate_up_proj``,
    ``[...]down_proj``)."""
    targets = meta.get("target_modules") or []
    if isinstance(targets, str):  # a regex in PEFT: keep the module names it matches
        targets = [t for t in (*MODULE_TARGETS, UNEMBED_TARGET)
                   if re.fullmatch(targets, t) or re.search(targets, f".{t}")]  # fmt: skip
    else:  # a suffix names the module it ends in (every one of them is loaded: all must be in the file)
        targets = [t.rpartition(".")[2] if t.rpartition(".")[2] in MODULE_TARGETS and EXPERTS not in t
                   else t for t in targets]  # fmt: skip
    experts = []
    for name in meta.get("target_parameters") or []:
        last = name.rpartition(".")[2]
        target = f"{EXPERTS}.{last}"
        if target not in EXPERT_TARGETS or not (name == last or name.endswith(f"{EXPERTS}.{last}")):
            raise ValueError(f"{d}: target_parameters {name!r} is not supported (only {EXPERT_TARGETS})")
        experts.append(target)
    return tuple(targets) + tuple(experts)


def _check_meta(meta: dict, d: pathlib.Path) -> None:
    if meta.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{d}: peft_type {meta.get('peft_type')!r} is not LORA")
    for key, ok in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False),
                    ("lora_bias", False)):  # fmt: skip
        if meta.get(key, ok) != ok:
            raise ValueError(f"{d}: adapter_config {key}={meta[key]!r} is not supported (needs {ok!r})")
    if meta.get("modules_to_save"):
        raise ValueError(f"{d}: modules_to_save is not supported")


def _pattern_key(target: str) -> str:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` key of one target (PEFT and vLLM match a key as
    ``(.*\\.)?(key)$`` against module names, and for expert stacks the parameter's name)."""
    return f"mlp.{target}" if target in EXPERT_TARGETS else target


def _patterns(config: LoRAConfig) -> dict[str, dict]:
    """PEFT's ``rank_pattern`` and ``alpha_pattern`` of ``config``: none without per-target values;
    else every target, the expert stacks first (PEFT takes the first key that matches, and a dense
    ``down_proj`` key matches ``mlp.experts.down_proj`` too)."""
    if not config.target_ranks and not config.target_alphas:
        return {}
    order = config.expert_targets + tuple(t for t in config.targets if t not in EXPERT_TARGETS)
    return {
        "rank_pattern": {_pattern_key(t): config.rank_of(t) for t in order},
        "alpha_pattern": {_pattern_key(t): config.alpha_of(t) for t in order},
    }


def _sites(model: nnx.Module, targets: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(target, HF name)`` of every place ``targets`` adapt in ``model`` (``model.layers.0.self_attn
    .q_proj``, ``model.layers.0.mlp.experts.gate_up_proj``, ``lm_head``): what PEFT's patterns match."""
    out = [(str(p[-1]), "model." + ".".join(map(str, p))) for p, _ in _targeted(model, targets)]
    experts = [t for t in EXPERT_TARGETS if t in targets]
    for path, _ in _expert_stacks(model) if experts else []:
        out += [(t, "model." + ".".join(map(str, path)) + "." + t.partition(".")[2]) for t in experts]
    if UNEMBED_TARGET in targets:
        out.append((UNEMBED_TARGET, UNEMBED_TARGET))
    return out


def _per_target_values(meta: dict, model: nnx.Module, targets: tuple[str, ...],
                       d: pathlib.Path) -> dict[str, dict]:  # fmt: skip
    """``target_ranks`` / ``target_alphas`` from PEFT's ``rank_pattern`` / ``alpha_pattern`` (the
    first key that matches a name wins, as in PEFT); a target whose layers get different values is
    refused: rljax gives every layer of a target one rank and alpha."""
    out: dict[str, dict] = {"target_ranks": {}, "target_alphas": {}}
    for field, key, default in (("rank_pattern", "target_ranks", meta["r"]),
                                ("alpha_pattern", "target_alphas", meta["lora_alpha"])):  # fmt: skip
        pattern = meta.get(field) or {}
        values: dict[str, set] = {}
        for target, name in _sites(model, targets) if pattern else []:
            hit = next((v for k, v in pattern.items() if re.match(rf"(.*\.)?({k})$", name)), default)
            values.setdefault(target, set()).add(hit)
        for target, found in values.items():
            if len(found) > 1:
                raise ValueError(f"{d}: {field} gives the layers' {target} different values {sorted(found)}; "
                                 "rljax adapts every layer of a target alike")  # fmt: skip
            if found != {default}:
                out[key][target] = found.pop()
    return out


def _assign(var: nnx.Variable, value: np.ndarray, name: str, d: pathlib.Path) -> None:
    if value.shape != var.shape:
        raise ValueError(f"{d}: {name} gives shape {value.shape}, the model needs {var.shape}")
    var[...] = jnp.asarray(value, var[...].dtype)


def _load_experts(path: tuple, experts: nnx.Module, targets: tuple[str, ...], tensors: dict,
                  d: pathlib.Path) -> set[str]:  # fmt: skip
    """Fills one expert stack's adapter from PEFT tensors; returns the names used."""
    used = set()
    num_experts = experts.down_proj.shape[0]
    for target, (name_a, name_b) in _peft_expert_names(path, targets).items():
        missing = [n for n in (name_a, name_b) if n not in tensors]
        if missing:
            raise ValueError(f"{d}: adapter weights lack {missing[0]}")
        a, b = _experts_from_peft(np.asarray(tensors[name_a], np.float32),
                                  np.asarray(tensors[name_b], np.float32), num_experts)  # fmt: skip
        a_name, bs = _EXPERT_ADAPTERS[target]
        _assign(getattr(experts, a_name), a, name_a, d)
        widths = [getattr(experts, b_name).shape[2] for b_name, _ in bs]  # gate | up: fused HF order
        if b.shape[2] != sum(widths):
            raise ValueError(f"{d}: {name_b} has {b.shape[2]} outputs per expert, need {sum(widths)}")
        for (b_name, _), part in zip(bs, np.split(b, np.cumsum(widths)[:-1], axis=2), strict=True):
            _assign(getattr(experts, b_name), part, name_b, d)
        used.update((name_a, name_b))
    return used


def load_adapter(model: nnx.Module, directory: str | os.PathLike) -> nnx.Module:
    """Attaches the PEFT adapter in ``directory`` to ``model`` (in place; written by peft or rljax).

    PEFT's ``rank_pattern`` / ``alpha_pattern`` become :class:`LoRAConfig`'s ``target_ranks`` /
    ``target_alphas`` (e.g. the ``2r`` fused ``gate_up_proj`` peft >= 0.22 writes when ``gate_proj``
    and ``up_proj`` name a transformers 5 MoE's experts). Raises ``ValueError`` for adapter features
    rljax does not implement (DoRA, ranks that differ between the layers of one target, bias
    training, modules_to_save, target_parameters other than the MoE expert stacks) and for weights
    that do not match the model.
    """
    d = pathlib.Path(directory)
    meta = json.loads((d / ADAPTER_CONFIG_FILE).read_text())
    _check_meta(meta, d)
    targets = _config_targets(meta, d)
    per_target = _per_target_values(meta, model, _normalize_targets(targets), d)
    try:
        config = LoRAConfig(rank=int(meta["r"]), alpha=float(meta["lora_alpha"]), targets=targets,
                            dropout=float(meta.get("lora_dropout", 0.0) or 0.0),
                            rslora=bool(meta.get("use_rslora", False)), **per_target)  # fmt: skip
    except ValueError as e:
        raise ValueError(f"{d}: {e}") from None
    tensors = load_file(str(d / ADAPTER_WEIGHTS_FILE))
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in tensors.items()}  # fmt: skip
    apply_lora(model, config, rngs=nnx.Rngs(0))
    used = set()
    for path, lin in _targeted(model, config.targets):
        for which, attr in (("A", "lora_a"), ("B", "lora_b")):
            name = _peft_name(path, which)
            if name not in tensors:
                raise ValueError(f"{d}: adapter weights lack {name}")
            value = np.asarray(tensors[name], np.float32).T
            var = getattr(lin, attr)
            if value.shape != var.shape:
                raise ValueError(f"{d}: {name} has shape {value.T.shape}, the model needs {var.shape[::-1]}")
            var[...] = jnp.asarray(value, var[...].dtype)
            used.add(name)
    if config.expert_targets:
        for path, experts in _expert_stacks(model):
            used |= _load_experts(path, experts, config.expert_targets, tensors, d)
    if config.unembed:
        for which, attr in (("A", "lora_a"), ("B", "lora_b")):
            name = _PEFT_UNEMBED.format(which)
            if name not in tensors:
                raise ValueError(f"{d}: adapter weights lack {name}")
            _assign(getattr(model.lm_head_lora, attr), np.asarray(tensors[name], np.float32).T, name, d)
            used.add(name)
    used |= _saved_base_weights(model, tensors, d)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{d}: adapter weights for modules the model does not have: {extra[:4]}")
    return model


_PEFT_SAVED_UNEMBEDDING = "base_model.model.lm_head.base_layer.weight"


def _saved_base_weights(model: nnx.Module, tensors: dict, d: pathlib.Path) -> set[str]:
    """The base output projection peft saves beside an ``lm_head`` adapter (``save_embedding_layers``,
    on by default then): accepted when it is the model's own (in the model's dtype), refused when not
    (the adapter was trained on another base)."""
    if _PEFT_SAVED_UNEMBEDDING not in tensors or not _has_unembedding(model):
        return set()
    theirs = np.asarray(tensors[_PEFT_SAVED_UNEMBEDDING])  # [vocab, hidden], as HF's lm_head.weight
    ours = model.embed_tokens[...] if model.lm_head is None else model.lm_head.kernel[...].T  # tied or not
    if theirs.shape != ours.shape or not np.array_equal(np.asarray(jnp.asarray(theirs, ours.dtype)), ours):
        raise ValueError(f"{d}: {_PEFT_SAVED_UNEMBEDDING} (peft's save_embedding_layers) is not this "
                         "model's output projection: the adapter was saved with another base")  # fmt: skip
    return {_PEFT_SAVED_UNEMBEDDING}
