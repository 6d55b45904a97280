"""Logical-axis sharding of decoder parameters onto a ``(data, fsdp, tensor)`` mesh (MoE: optionally
``(data, fsdp, expert, tensor)``).

Every parameter of :class:`rljax.models.Decoder` carries ``logical_axes`` metadata, one name per
dimension. :data:`DEFAULT_RULES` maps names to mesh axes (Megatron-style tensor parallelism over
heads / MLP width / vocabulary, ZeRO-3 style FSDP over the hidden dimension):

=========  ============  ================================================================
logical    mesh axis     used by
=========  ============  ================================================================
vocab      tensor        embedding rows, lm_head columns
embed      fsdp          hidden dim of every kernel and the embedding
heads      tensor        q_proj columns / o_proj rows (num_heads*head_dim)
kv_heads   tensor        k_proj, v_proj columns
mlp        tensor        gate/up columns, down rows
norm       (none)        RMSNorm weights (replicated)
expert     expert        leading axis of stacked MoE expert weights
moe_mlp    tensor        expert gate/up columns, down rows
batch      data, fsdp,   activations (for the train step's inputs); the expert axis also
           expert        splits rows (expert parallelism borrows from data parallelism
                         outside MoE layers)
=========  ============  ================================================================

Expert parallelism: MoE layers run under an ambient mesh (``jax.set_mesh``) with an ``expert`` axis
exchange tokens with all-to-all (:func:`rljax.models.moe.expert_parallel_ffn`).

A dimension whose size is not divisible by its mesh axes' total size is replicated instead (so tiny
test models and odd vocabularies still shard); mesh axes missing from the mesh are dropped, and a
mesh axis is used at most once per array.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: Mesh axes of a dense model's trainer mesh.
MESH_AXES = ("data", "fsdp", "tensor")
#: Mesh axes with expert parallelism (MoE models).
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "tensor")

#: Sharding rules: (logical axis, mesh axis or axes or None) pairs, as :data:`DEFAULT_RULES`.
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

#: Logical axis -> mesh axes (the table of the module docstring).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("expert", "expert"),
    ("moe_mlp", "tensor"),
)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    *,
    rules: Rules = DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array with the given logical axis names on ``mesh``.

    >>> import numpy as np
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    >>> logical_to_spec(("embed", "heads"), (64, 128), mesh) == PartitionSpec("fsdp", "tensor")
    True
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical_axes {tuple(logical_axes)} do not match the array rank {len(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, size in zip(logical_axes, shape, strict=True):
        if name is not None and name not in table:
            raise ValueError(
                f"logical axis {name!r} has no sharding rule; add it to rules (known: {sorted(table)})"
            )
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a in mesh.shape and a not in used)
        total = 1
        for a in axes:
            total *= mesh.shape[a]
        if not axes or size % total:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def param_specs(model: nnx.Module, mesh: Mesh, *, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """An ``nnx.State`` of PartitionSpecs shaped like ``nnx.state(model, nnx.Param)``.

    Parameters without ``logical_axes`` metadata are replicated.

    >>> import numpy as np
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2)
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    >>> specs = param_specs(Decoder(cfg, rngs=nnx.Rngs(0)), mesh)
    >>> specs["embed_tokens"].get_value() == PartitionSpec("tensor", "fsdp")
    True
    """
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        axes = var.get_metadata().get("logical_axes")
        spec = PartitionSpec() if axes is None else logical_to_spec(axes, shape, mesh, rules=rules)
        flat.append((path, var.replace(spec)))
    return nnx.from_flat_state(flat)


def param_shardings(model: nnx.Module, mesh: Mesh, *, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """``NamedSharding`` for every parameter, shaped like ``nnx.state(model, nnx.Param)``.

    >>> import numpy as np
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2)
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    >>> shardings = param_shardings(Decoder(cfg, rngs=nnx.Rngs(0)), mesh)
    >>> shardings["norm"]["weight"].get_value().spec == PartitionSpec(None)
    True
    """
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(model, mesh, rules=rules),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def shard_model(model: nnx.Module, mesh: Mesh, *, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Places the parameters of ``model`` on ``mesh`` (in place) and returns the model.

    >>> import numpy as np, jax.numpy as jnp
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2)
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    >>> model = shard_model(Decoder(cfg, rngs=nnx.Rngs(0)), mesh)
    >>> model.layers[0].mlp.up_proj.kernel.get_value().sharding.spec == PartitionSpec("fsdp", "tensor")
    True
    """
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(model, mesh, rules=rules)))
    return model
