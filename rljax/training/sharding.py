"""Device mesh and shardings of the train step: batch rows over ``(data, fsdp)``, params by rule.

The mesh has axes :data:`rljax.models.MESH_AXES` = ``(data, fsdp, tensor)``. Packed batches
``[R, L]`` are split by rows over ``data * fsdp`` devices (``P(("data", "fsdp"), None)``) and
replicated over ``tensor``; stacked micro-batches ``[k, R, L]`` keep the micro-batch axis whole.
Parameters follow :mod:`rljax.models.sharding` (FSDP over the hidden dimension, tensor
parallelism over heads / MLP / vocabulary); optimizer moments are sharded like their parameters.

Axis types are ``Auto`` (XLA's sharding propagation), not the ``Explicit`` default of
``jax.make_mesh`` on jax >= 0.7: ``jax.ops.segment_sum`` of the objective does not accept
explicitly sharded operands.

Multi-host: every function here uses only ``jax.make_mesh`` (all processes' devices),
``jax.make_array_from_process_local_data`` (each process passes ITS rows of the batch) and
``jax.device_put`` onto ``NamedSharding`` s; collectives are XLA's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import chex
import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rljax import knobs
from rljax.knobs import knob
from rljax.models.context import CONTEXT_AXIS
from rljax.models.sharding import DEFAULT_RULES, Rules, param_shardings

# Row axes of a batch; "expert" exists only on expert-parallel meshes (filtered by mesh.shape).
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


@knobs.section
class MeshConfig:
    """A run's ``config.mesh``: the size of each axis of :func:`make_mesh` (``expert`` None = no
    expert axis). A product of 1 means no mesh: the run trains on one device.

    >>> MeshConfig(data=2, fsdp=2).size, MeshConfig().size
    (4, 1)
    """

    data: int = knob(1, ge=1, doc="data-parallel size (batch rows; replicated parameters)")
    fsdp: int = knob(
        1, ge=1, doc="fully sharded data-parallel size (batch rows; parameters and optimizer state sharded)"
    )
    tensor: int = knob(1, ge=1, doc="tensor-parallel size (heads and MLP columns)")
    expert: int | None = knob(None, ge=1, doc="MoE expert-parallel size (None = no expert axis)")
    context: int = knob(1, ge=1, doc="context-parallel size (each row's tokens split over devices)")

    @property
    def size(self) -> int:
        """The number of devices of the mesh (the product of its axes)."""
        return self.data * self.fsdp * self.tensor * (self.expert or 1) * self.context

    def make(self) -> Mesh:
        """:func:`make_mesh` of these axis sizes over all devices."""
        return make_mesh(**dataclasses.asdict(self))


def make_mesh(
    *,
    data: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    expert: int | None = None,
    context: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with ``Auto`` axis types over ``devices`` (default: all).

    ``expert`` (MoE expert parallelism): when given, the mesh is ``(data, fsdp, expert, tensor)``;
    experts are sharded over ``expert`` and batch rows over ``(data, fsdp, expert)``. MoE layers
    exchange tokens over it when the step runs under ``jax.set_mesh(mesh)``.
    ``context`` > 1 (context parallelism, :mod:`rljax.models.context`): a ``context`` axis before
    ``tensor``; every row's tokens are split over it (batch arrays ``P(rows, "context")``).
    Raises ``ValueError`` unless the axis sizes multiply to the number of devices.

    >>> mesh = make_mesh(data=1, devices=jax.devices()[:1])
    >>> dict(mesh.shape)
    {'data': 1, 'fsdp': 1, 'tensor': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    if expert is not None:
        sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
    if context != 1:
        sizes = {**{k: v for k, v in sizes.items() if k != "tensor"}, CONTEXT_AXIS: context, "tensor": tensor}
    for name, size in sizes.items():
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"mesh axis {name} must be a positive int, got {size!r}")
    total = int(np.prod(list(sizes.values())))
    if total != len(devices):
        raise ValueError(
            f"mesh {' x '.join(f'{k}={v}' for k, v in sizes.items())} = {total} devices, but "
            f"{len(devices)} devices are given; choose axis sizes whose product is {len(devices)}"
        )
    axes = tuple(sizes)
    return jax.make_mesh(
        tuple(sizes.values()), axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices
    )


def batch_parallelism(mesh: Mesh) -> int:
    """Number of row shards of a batch: ``data * fsdp`` (``* expert``) of ``mesh``.

    >>> batch_parallelism(make_mesh(devices=jax.devices()[:1]))
    1
    """
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.shape]))


def batch_sharding(mesh: Mesh, *, stacked: bool = False) -> NamedSharding:
    """``NamedSharding`` of per-token arrays: rows over ``(data, fsdp)``, tokens over ``context`` when
    the mesh has it; ``stacked`` adds a leading (whole) micro-batch axis.

    >>> batch_sharding(make_mesh(devices=jax.devices()[:1])).spec == PartitionSpec(("data", "fsdp"), None)
    True
    """
    rows = tuple(a for a in BATCH_AXES if a in mesh.shape)
    tokens = CONTEXT_AXIS if CONTEXT_AXIS in mesh.shape else None
    spec = PartitionSpec(None, rows, tokens) if stacked else PartitionSpec(rows, tokens)
    return NamedSharding(mesh, spec)


def context_parallelism(mesh: Mesh | None) -> int:
    """Size of the ``context`` axis of ``mesh`` (1 without one or without a mesh).

    >>> context_parallelism(make_mesh(devices=jax.devices()[:1]))
    1
    """
    return 1 if mesh is None or CONTEXT_AXIS not in mesh.shape else int(mesh.shape[CONTEXT_AXIS])


def shard_batch(batch: Any, mesh: Mesh, *, stacked: bool = False) -> Any:
    """Places a packed batch (pytree of ``[R, L]`` arrays, or ``[k, R, L]`` if ``stacked``) on ``mesh``.

    ``batch`` holds THIS process's rows (on one host: all of them); the global batch is the
    concatenation over processes in process order (``jax.make_array_from_process_local_data``).
    ``None`` fields stay ``None``. Raises ``ValueError`` when the global row count is not a
    multiple of ``data * fsdp`` (pack with ``data_parallel=batch_parallelism(mesh)``).

    >>> out = shard_batch({"tokens": np.zeros((2, 4), np.int32)}, make_mesh(devices=jax.devices()[:1]))
    >>> out["tokens"].shape, out["tokens"].sharding.spec == PartitionSpec(("data", "fsdp"), None)
    ((2, 4), True)
    """
    sharding = batch_sharding(mesh, stacked=stacked)
    row_axis = 1 if stacked else 0
    shards = batch_parallelism(mesh)
    processes = jax.process_count()

    def place(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim < row_axis + 2:  # [R, L] (+ trailing dims, e.g. MoE routing [R, L, layers, k])
            raise ValueError(
                f"batch arrays must be {'[k, R, L] (stacked)' if stacked else '[R, L]'}; got shape {x.shape}"
            )
        _check_context_split(x, row_axis + 1, mesh)
        global_shape = list(x.shape)
        global_shape[row_axis] *= processes
        if global_shape[row_axis] % shards:
            raise ValueError(
                f"the batch has {global_shape[row_axis]} rows, not a multiple of data*fsdp={shards}; "
                f"pack with data_parallel={shards} (pads with fully masked rows)"
            )
        return jax.make_array_from_process_local_data(sharding, x, tuple(global_shape))

    return jax.tree.map(place, batch)


def shard_global_batch(batch: Any, mesh: Mesh, *, stacked: bool = False) -> Any:
    """Places a packed batch that EVERY process holds whole (the global batch) on ``mesh``.

    Each process contributes exactly the slices its own devices hold
    (``jax.make_array_from_callback``), so a multi-process mesh gets every row once, in the
    order of ``batch``, whatever the mesh's device order. In one process it equals
    :func:`shard_batch`. Use it when the host preparation runs on the whole step's data in every
    process (the trainer's multi-process mode); :func:`shard_batch` when each process packed
    only its own rows.

    >>> out = shard_global_batch({"tokens": np.zeros((2, 4), np.int32)}, make_mesh(devices=jax.devices()[:1]))
    >>> out["tokens"].shape
    (2, 4)
    """
    sharding = batch_sharding(mesh, stacked=stacked)
    row_axis = 1 if stacked else 0
    shards = batch_parallelism(mesh)

    def place(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim < row_axis + 2:
            raise ValueError(
                f"batch arrays must be {'[k, R, L] (stacked)' if stacked else '[R, L]'}; got shape {x.shape}"
            )
        if x.shape[row_axis] % shards:
            raise ValueError(
                f"the batch has {x.shape[row_axis]} rows, not a multiple of data*fsdp={shards}; "
                f"pack with data_parallel={shards} (pads with fully masked rows)"
            )
        _check_context_split(x, row_axis + 1, mesh)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, batch)


def _check_context_split(x: np.ndarray, token_axis: int, mesh: Mesh) -> None:
    shards = context_parallelism(mesh)
    if shards > 1 and x.shape[token_axis] % (2 * shards):
        raise ValueError(
            f"rows of {x.shape[token_axis]} tokens cannot be split over mesh.context={shards} in "
            f"2 x {shards} load-balanced chunks; use a trainer.seq_len that is a multiple of {2 * shards}"
        )


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated ``NamedSharding`` on ``mesh``.

    >>> replicated(make_mesh(devices=jax.devices()[:1])).spec == PartitionSpec()
    True
    """
    return NamedSharding(mesh, PartitionSpec())


def params_shardings(
    graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh, *, rules: Rules = DEFAULT_RULES
) -> nnx.State:
    """``NamedSharding`` per parameter (rules of :mod:`rljax.models.sharding`); works on tracers.

    Specs are canonical as XLA reports output shardings (mesh axes of size 1 and trailing ``None``
    entries dropped), so a state placed here and a state returned by the jitted step have EQUAL
    shardings (one compile).

    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params_shardings(graphdef, params, mesh)["embed_tokens"].get_value().spec == PartitionSpec()
    True
    """
    return jax.tree.map(
        lambda s: NamedSharding(mesh, canonical_spec(s.spec, mesh)),
        param_shardings(nnx.merge(graphdef, params), mesh, rules=rules),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def canonical_spec(spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """``spec`` as XLA reports output shardings: mesh axes of size 1 and trailing ``None`` entries dropped.

    Shardings placed with canonical specs equal those the jitted steps return, so feeding a
    returned state back does not compile again.

    >>> import types
    >>> mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 1, "tensor": 4})  # only .shape is read
    >>> tuple(canonical_spec(PartitionSpec(("data", "fsdp"), "tensor", None), mesh))
    ('data', 'tensor')
    >>> tuple(canonical_spec(PartitionSpec("fsdp", ("data", "tensor")), mesh))
    (None, ('data', 'tensor'))
    """
    entries: list[Any] = []
    for entry in spec:
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def like_params_shardings(tree: chex.ArrayTree, params: nnx.State, shardings: nnx.State, mesh: Mesh) -> Any:
    """Shardings for a tree that embeds copies of the params structure (e.g. Adam's ``mu``, ``nu``).

    Every subtree whose structure equals that of ``params`` gets ``shardings``; every other leaf
    (step counts, scalars) is replicated.

    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params = {"w": np.zeros((2, 2))}
    >>> out = like_params_shardings((params, np.int32(0)), params, {"w": "W"}, mesh)
    >>> out[0], out[1].spec == PartitionSpec()
    ({'w': 'W'}, True)
    """
    structure = jax.tree.structure(params)

    def is_params_like(x: Any) -> bool:
        return jax.tree.structure(x) == structure

    return jax.tree.map(
        lambda x: shardings if is_params_like(x) else replicated(mesh), tree, is_leaf=is_params_like
    )
