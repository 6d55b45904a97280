"""LoRA adapters on the NNX decoder, in PEFT's format (Hu et al. 2021, "LoRA: Low-Rank Adaptation").

A targeted :class:`~rljax.models.layers.Linear` ``y = x W (+ b)`` gains two trainable matrices::

    y = x W (+ b) + (alpha / r) * (x A) B        A: [in, r], B: [r, out]

with PEFT's initialisation: ``A`` Kaiming-uniform (``a = sqrt(5)``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``)
and ``B = 0``, so a fresh adapter leaves the model's outputs exactly unchanged. Adapter weights are
:class:`LoRAParam` variables (not ``nnx.Param``), so ``nnx.state(model, LoRAParam)`` selects exactly
the adapter and the base's HF I/O never sees it; the base can be held in another dtype (e.g.
bfloat16) while the adapter stays float32.

Files: :func:`save_adapter` / :func:`load_adapter` write and read PEFT's ``adapter_config.json`` +
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` ``[r, in]``, ``lora_B``
``[out, r]``), which ``peft`` + transformers and vLLM's LoRA support load;
:func:`merge_lora` folds an adapter into plain weights (``W + (alpha/r) A B``).

Targets are module names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``) of the dense decoder; MoE expert stacks are not targeted (yet).

>>> from rljax.models.tiny import tiny_model
>>> m = apply_lora(tiny_model(), LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
>>> sorted({p[-2] for p, _ in nnx.to_flat_state(nnx.state(m, LoRAParam))})[:3]
['down_proj', 'gate_proj', 'k_proj']
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from rljax.models.layers import Linear

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "DEFAULT_TARGETS",
    "LoRAConfig",
    "LoRAParam",
    "apply_lora",
    "load_adapter",
    "lora_state",
    "merge_lora",
    "save_adapter",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model.model."


class LoRAParam(nnx.Variable):
    """An adapter weight (``lora_a`` / ``lora_b`` of a targeted Linear): trainable, not base."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Rank ``r``, ``alpha`` (scale ``alpha / r``), target module names, dropout (only 0 is supported:
    RL recomputes the policy's logprobs, which stochastic dropout would make inconsistent)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be an int >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRAConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = sorted(set(self.targets) - set(DEFAULT_TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"LoRAConfig.targets must be a non-empty subset of {DEFAULT_TARGETS}, got {unknown}"
            )
        if self.dropout != 0.0:
            raise ValueError(
                "LoRAConfig.dropout > 0 is not supported: the trainer recomputes the policy's logprobs "
                "(old, new, reference) and stochastic dropout would make them disagree; use 0.0"
            )

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


def _targeted(model: nnx.Module, targets: Sequence[str]) -> list[tuple[tuple, Linear]]:
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


def apply_lora(
    model: nnx.Module, config: LoRAConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32
) -> nnx.Module:
    """Attaches fresh adapters (A Kaiming-uniform, B = 0) to every targeted Linear of ``model`` (in place).

    Returns ``model``. Raises ``ValueError`` when nothing matches or adapters are already attached.
    """
    found = _targeted(model, config.targets)
    if not found:
        raise ValueError(f"no Linear of the model matches the LoRA targets {config.targets}")
    for path, lin in found:
        if getattr(lin, "lora_a", None) is not None:
            raise ValueError(f"{'.'.join(map(str, path))} already has a LoRA adapter")
        fan_in, fan_out = lin.kernel.shape
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) as PEFT (torch nn.Linear default)
        a = jax.random.uniform(rngs.params(), (fan_in, config.rank), dtype, -bound, bound)
        # Sharded like the kernel's in / out dimension (rljax.models.sharding); the rank is replicated.
        axes = lin.kernel.get_metadata().get("logical_axes") or (None, None)
        lin.lora_a = LoRAParam(a, logical_axes=(axes[0], None))
        lin.lora_b = LoRAParam(jnp.zeros((config.rank, fan_out), dtype), logical_axes=(None, axes[1]))
        lin.lora_scale = config.scale
    model.lora_config = config
    return model


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
    for _, lin in _targeted(merged, DEFAULT_TARGETS):
        if getattr(lin, "lora_a", None) is None:
            continue
        delta = (lin.lora_a[...].astype(jnp.float32) @ lin.lora_b[...].astype(jnp.float32)) * lin.lora_scale
        kernel = lin.kernel[...]
        lin.kernel = lin.kernel.replace((kernel.astype(jnp.float32) + delta).astype(kernel.dtype))
        del lin.lora_a, lin.lora_b, lin.lora_scale
    if hasattr(merged, "lora_config"):
        del merged.lora_config
    return merged


# ------------------------------------------------------------------------------------------------
# PEFT files
# ------------------------------------------------------------------------------------------------


def _peft_name(path: tuple, which: str) -> str:
    return _PEFT_PREFIX + ".".join(map(str, path)) + f".lora_{which}.weight"


def save_adapter(
    model: nnx.Module, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None
) -> pathlib.Path:
    """Writes the model's adapter as a PEFT adapter directory (config + safetensors); returns it."""
    config: LoRAConfig | None = getattr(model, "lora_config", None)
    if config is None:
        raise ValueError("the model has no LoRA adapter (apply_lora or load_adapter first)")
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, lin in _targeted(model, config.targets):
        tensors[_peft_name(path, "A")] = np.ascontiguousarray(np.asarray(lin.lora_a[...], np.float32).T)
        tensors[_peft_name(path, "B")] = np.ascontiguousarray(np.asarray(lin.lora_b[...], np.float32).T)
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE))
    meta = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return out


def load_adapter(model: nnx.Module, directory: str | os.PathLike) -> nnx.Module:
    """Attaches the PEFT adapter in ``directory`` to ``model`` (in place; written by peft or rljax).

    Raises ``ValueError`` for adapter features rljax does not implement (DoRA, rsLoRA, per-module
    ranks, bias training, modules_to_save) and for weights that do not match the model.
    """
    d = pathlib.Path(directory)
    meta = json.loads((d / ADAPTER_CONFIG_FILE).read_text())
    if meta.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{d}: peft_type {meta.get('peft_type')!r} is not LORA")
    for key, ok in (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if meta.get(key, ok) != ok:
            raise ValueError(f"{d}: adapter_config {key}={meta[key]!r} is not supported (needs {ok!r})")
    if meta.get("rank_pattern") or meta.get("alpha_pattern") or meta.get("modules_to_save"):
        raise ValueError(f"{d}: per-module ranks/alphas and modules_to_save are not supported")
    targets = meta["target_modules"]
    if isinstance(targets, str):  # a regex in PEFT: keep the module names it matches
        targets = [t for t in DEFAULT_TARGETS if re.fullmatch(targets, t) or re.search(targets, f".{t}")]
    config = LoRAConfig(rank=int(meta["r"]), alpha=float(meta["lora_alpha"]), targets=tuple(targets),
                        dropout=float(meta.get("lora_dropout", 0.0) or 0.0))  # fmt: skip
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
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{d}: adapter weights for modules the model does not have: {extra[:4]}")
    return model
