"""The jitted train step: packed batch -> logprobs -> objective -> gradients -> AdamW (design §5).

One optimizer step on a mini-batch ``B`` split into micro-batches ``B_1..B_k`` (rows)::

    counts = global_counts(B)                                  (once per mini-batch)
    logp_i, H_i = sequence_forward(model, B_i.tokens, positions, segment_ids,
                                   temperature = B_i.temperatures)   (chunked, packed)
    g = sum_i grad_theta objective(logp_i, B_i, counts)        (= grad of the whole mini-batch,
                                                                because every normalizer is global)
    theta, opt <- AdamW(clip(g))       if loss and ||g|| are finite
    theta, opt <- theta, opt           otherwise (skipped; ``skipped`` += 1)

Everything device-side is pure: :class:`TrainState` is a pytree whose data are the trained
parameters, the optax state, two counters and the frozen weights, and whose static metadata are
the NNX graph definition, the :class:`TrainConfig`, and the mesh + sharding rules.
:data:`train_step` and :data:`train_mini_batch` are ``jax.jit`` functions of
``(state, batch, counts)`` that DONATE ``state`` except ``state.frozen`` (use the returned one).

Adapter-only training (LoRA, :mod:`rljax.models.lora`): for a model with ``LoRAParam`` variables,
``TrainState.create`` trains only those (``params``: gradients and optimizer state cover the adapter
alone) and keeps the base weights in ``state.frozen``: an input of the jitted step that is neither
differentiated, updated nor donated (the returned state holds the very same arrays, so they may be
shared, e.g. with a reference policy). The base may be bfloat16 while the adapter is float32.

With a mesh, parameters and optimizer moments are constrained to the rule shardings of
:mod:`rljax.models.sharding` and batches are sharded by rows (:func:`rljax.training.sharding.shard_batch`);
XLA inserts the collectives, so sharded results equal single-device results up to float
reassociation.

Memory / speed options live on the model: ``Decoder(..., remat=True)`` recomputes each block in
the backward pass; ``Decoder(..., dtype=jnp.bfloat16, param_dtype=jnp.float32)`` computes in
bfloat16 with float32 master weights, gradients and optimizer state (logits, softmax, norms
and the objective stay float32).

Reference: the loop follows SkyRL / prime-rl trainers (global token-count normalization across
micro-batches; skip non-finite updates as in ``optax.apply_if_finite``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax.core.objective import MAX_METRICS, Counts, ObjectiveConfig, global_counts, objective
from rljax.core.segments import samples_per_token
from rljax.models.logprobs import (
    DEFAULT_CHUNK_SIZE,
    ForwardOutput,
    logit_capacity,
    packing_kwargs,
    sequence_forward,
)
from rljax.models.lora import LoRAParam
from rljax.models.moe import flip_fraction, routing_metrics, top_k_experts
from rljax.models.sharding import DEFAULT_RULES, Rules, logical_to_spec
from rljax.training import sharding as train_sharding
from rljax.training.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from rljax.types import PackedBatch

__all__ = [
    "WEIGHT_TYPES",
    "TrainConfig",
    "TrainState",
    "apply_gradients",
    "loss_and_grads",
    "merge_model",
    "mini_batch_counts",
    "policy_logprobs",
    "split_micro_batches",
    "stack_micro_batches",
    "train_mini_batch",
    "train_step",
    "variable_shardings",
    "with_logit_capacity",
]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static configuration of the train step (hashable).

    Attributes:
      objective: the loss (:class:`rljax.core.objective.ObjectiveConfig`).
      optimizer: AdamW / schedule / clipping (:class:`rljax.training.optimizer.OptimizerConfig`).
      chunk_size: tokens (per data-parallel shard) per logits chunk of the chunked LM head (memory
        ``O(chunk * vocab)``).
      loss_only_logits: compute logits only for the tokens that carry a loss (``loss_mask != 0``:
        every objective term and metric reads only those), gathered into a fixed-size buffer
        (:func:`rljax.models.logprobs.sequence_forward`'s ``logit_mask``); False: every token.
        Logprobs and gradients are the same either way (within float32 rounding).
      logit_capacity: slots per data-parallel shard of that buffer (static). None (the usual):
        :data:`train_step` / :data:`train_mini_batch` choose it on the host from each batch's loss
        mask (:func:`with_logit_capacity`, a few sizes per run); a fixed value too small for a batch
        gives a NaN loss (the update is skipped), never a silent drop.
      router_replay: MoE models: dispatch every token to the experts recorded in
        ``batch.routed_experts`` (R3; gates recomputed from the current router). Rows of -1 (no
        record) route afresh.
      moe_aux_loss_coef: weight of the Switch load-balancing loss in the objective (MoE; 0 = off).
      router_z_loss_coef: weight of the router z-loss in the objective (MoE; 0 = off).

    MoE models always report ``routing/*`` metrics (expert load, router entropy, both auxiliary
    losses) over the real tokens of the batch and, when the batch records the sampler's routing,
    ``routing/flip_fraction``: the share of recorded tokens whose trainer top-k set differs from
    the sampler's (computed from the trainer's own router, replay or not). Micro-batches combine
    them (and the auxiliary losses) weighted by their share of the mini-batch's trained tokens.

    >>> TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-5)).optimizer.learning_rate
    1e-05
    """

    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    router_replay: bool = False
    moe_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    loss_only_logits: bool = True
    logit_capacity: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.objective, ObjectiveConfig):
            raise ValueError(f"objective must be an ObjectiveConfig, got {type(self.objective).__name__}")
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ValueError(f"optimizer must be an OptimizerConfig, got {type(self.optimizer).__name__}")
        if not (isinstance(self.chunk_size, int) and self.chunk_size > 0):
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if self.logit_capacity is not None and not (
            isinstance(self.logit_capacity, int) and self.logit_capacity > 0
        ):
            raise ValueError(f"logit_capacity must be a positive int or None, got {self.logit_capacity!r}")


def _zero() -> jax.Array:
    return jnp.zeros((), jnp.int32)  # a fresh buffer each call (donated buffers must be distinct)


def _no_frozen() -> nnx.State:
    return nnx.State({})


#: The variable types a :class:`TrainState` holds (trained or frozen); anything else is refused.
WEIGHT_TYPES = (nnx.Param, LoRAParam)


def _variable_report(state: nnx.State) -> list[str]:
    return sorted(f"{'.'.join(map(str, p))} ({type(v).__name__})" for p, v in nnx.to_flat_state(state))


def variable_shardings(tree: nnx.State, mesh: Mesh, *, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """``NamedSharding`` per variable of ``tree`` from its ``logical_axes`` metadata (replicated
    without); the specs are canonical like :func:`rljax.training.sharding.params_shardings`.

    Works for any variable type (``nnx.Param``, ``LoRAParam``) and on tracers.

    >>> from rljax.models.tiny import tiny_model
    >>> from rljax.training.sharding import make_mesh
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> out = variable_shardings(nnx.state(tiny_model(), nnx.Param), mesh)
    >>> out["embed_tokens"].get_value().spec == PartitionSpec()
    True
    """
    flat = []
    for path, var in nnx.to_flat_state(tree):
        axes = var.get_metadata().get("logical_axes")
        shape = np.shape(var.get_value())
        spec = PartitionSpec() if axes is None else logical_to_spec(axes, shape, mesh, rules=rules)
        flat.append((path, var.replace(NamedSharding(mesh, train_sharding.canonical_spec(spec, mesh)))))
    return nnx.from_flat_state(flat)


def _params_shardings(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State, mesh: Mesh,
                      rules: Rules) -> nnx.State:  # fmt: skip
    if not jax.tree.leaves(frozen):  # full training: exactly the shardings it always had
        return train_sharding.params_shardings(graphdef, params, mesh, rules=rules)
    return variable_shardings(params, mesh, rules=rules)


def merge_model(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None = None) -> nnx.Module:
    """``nnx.merge(graphdef, params, frozen)``; ``frozen`` None or empty (full training) is left out.

    The model gets its own Variable objects (holding the same arrays), so writing into it
    (``var[...] = x``) does not change ``params`` / ``frozen``.

    Traceable: the jitted steps build the model from the state's trained and frozen weights with it.

    >>> from rljax.models.tiny import tiny_model
    >>> graphdef, params = nnx.split(tiny_model(), nnx.Param)
    >>> type(merge_model(graphdef, params, nnx.State({}))).__name__
    'Decoder'
    """
    fresh = functools.partial(jax.tree.map, lambda x: x)  # own Variables: not shared with the states
    if frozen is None or not jax.tree.leaves(frozen):
        return nnx.merge(graphdef, fresh(params))
    return nnx.merge(graphdef, fresh(params), fresh(frozen))


def _place(tree: nnx.State, shardings: nnx.State) -> nnx.State:
    if jax.process_count() > 1:  # every process holds the same full copy: place it from host memory
        tree = jax.tree.map(np.asarray, tree)
    return jax.device_put(tree, shardings)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters, optimizer state and counters of a run (a pytree; metadata is static).

    Attributes:
      params: ``nnx.State`` of the trained variables (all ``nnx.Param`` of the model; for a LoRA
        model only its ``LoRAParam`` adapter).
      opt_state: optax state of :func:`rljax.training.optimizer.make_optimizer` (covers ``params`` only).
      step: int32, optimizer updates applied so far (the schedule's step).
      skipped: int32, updates skipped because the loss or a gradient was not finite.
      graphdef: the model's NNX graph definition (static).
      config: :class:`TrainConfig` (static).
      mesh: the device mesh, or None for unsharded single-device training (static).
      rules: logical-axis sharding rules of the parameters (static).
      frozen: ``nnx.State`` of the weights that are not trained (empty for full training; the
        base ``nnx.Param`` weights of a LoRA model). The jitted steps pass it through unchanged and
        do not donate it: the returned state holds the same arrays.
    """

    params: nnx.State
    opt_state: Any
    step: jax.Array
    skipped: jax.Array
    graphdef: nnx.GraphDef = dataclasses.field(metadata=dict(static=True))
    config: TrainConfig = dataclasses.field(metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    rules: Rules = dataclasses.field(default=DEFAULT_RULES, metadata=dict(static=True))
    frozen: nnx.State = dataclasses.field(default_factory=_no_frozen)

    @classmethod
    def create(
        cls,
        model: nnx.Module,
        config: TrainConfig | None = None,
        *,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
        trainable: nnx.filterlib.Filter | None = None,
        with_optimizer: bool = True,
    ) -> TrainState:
        """Splits ``model`` into graph + trained params + frozen weights, places them (and fresh
        Adam moments of the trained params) on ``mesh``.

        ``with_optimizer=False`` leaves the optimizer state empty (``{}``: no Adam moments, a third
        of a full state's memory), for holders of a model that is never stepped through this state
        (the Tinker API's base model: each training client has its own state).

        ``trainable`` selects the trained variables (an NNX filter); the other ``nnx.Param`` /
        ``LoRAParam`` variables become ``frozen``. Default: ``LoRAParam`` when the model has a LoRA
        adapter (:func:`rljax.models.lora.apply_lora`), else ``nnx.Param`` (full training). Raises
        ``ValueError`` when the model holds other variable types (e.g. batch statistics, RNG
        state) or when ``trainable`` selects nothing.

        >>> from rljax.models import Decoder, ModelConfig
        >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
        ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
        >>> state = TrainState.create(Decoder(cfg, rngs=nnx.Rngs(0)))
        >>> int(state.step), int(state.skipped), len(jax.tree.leaves(state.frozen))
        (0, 0, 0)

        A LoRA model trains its adapter only (here: q_proj and v_proj of the one layer):

        >>> from rljax.models.lora import LoRAConfig, apply_lora
        >>> lora = LoRAConfig(rank=2, targets=("q_proj", "v_proj"))
        >>> model = apply_lora(Decoder(cfg, rngs=nnx.Rngs(0)), lora, rngs=nnx.Rngs(1))
        >>> state = TrainState.create(model)
        >>> len(jax.tree.leaves(state.params)), len(jax.tree.leaves(state.frozen))
        (4, 12)
        """
        config = TrainConfig() if config is None else config
        rules = tuple((name, target) for name, target in rules)
        if trainable is None:
            trainable = LoRAParam if jax.tree.leaves(nnx.state(model, LoRAParam)) else nnx.Param
        graphdef, params, frozen, rest = nnx.split(model, trainable, nnx.Any(*WEIGHT_TYPES), ...)
        # Own Variables (same arrays): later in-place writes into ``model`` do not reach the state.
        params, frozen = jax.tree.map(lambda x: x, (params, frozen))
        if jax.tree.leaves(rest):
            raise ValueError(
                "TrainState needs a model whose state is nnx.Param (and LoRAParam adapter) variables only; "
                f"found other variables: {_variable_report(rest)}"
            )
        unknown = [(p, v) for p, v in nnx.to_flat_state(params) if not isinstance(v, WEIGHT_TYPES)]
        if unknown:
            raise ValueError(
                f"trainable={trainable!r} selects variables that are not nnx.Param / LoRAParam: "
                f"{_variable_report(nnx.from_flat_state(unknown))}"
            )
        if not jax.tree.leaves(params):
            raise ValueError(f"trainable={trainable!r} selects no variable of the model: nothing to train")
        tx = make_optimizer(config.optimizer)
        init = tx.init if with_optimizer else (lambda _: {})
        if mesh is None:
            return cls(params, init(params), _zero(), _zero(), graphdef, config, None, rules, frozen)
        shardings = _params_shardings(graphdef, params, frozen, mesh, rules)
        params = _place(params, shardings)
        frozen = _place(frozen, variable_shardings(frozen, mesh, rules=rules))
        opt_shapes = jax.eval_shape(init, params)
        opt_shardings = train_sharding.like_params_shardings(opt_shapes, params, shardings, mesh)
        opt_state = jax.jit(init, out_shardings=opt_shardings)(params) if with_optimizer else {}
        step, skipped = jax.device_put((_zero(), _zero()), train_sharding.replicated(mesh))
        return cls(params, opt_state, step, skipped, graphdef, config, mesh, rules, frozen)

    def model_of(self, params: nnx.State | None = None) -> nnx.Module:
        """A fresh NNX model of ``params`` (default: the state's) and the state's frozen weights.

        >>> from rljax.models.tiny import tiny_model
        >>> state = TrainState.create(tiny_model())
        >>> type(state.model_of(state.params)).__name__
        'Decoder'
        """
        return merge_model(self.graphdef, self.params if params is None else params, self.frozen)

    @property
    def model(self) -> nnx.Module:
        """A fresh NNX model holding the current parameters (and the frozen weights: for a LoRA
        state, the base with its adapter; :func:`rljax.models.lora.merge_lora` folds it in)."""
        return self.model_of(self.params)


# ------------------------------------------------------------------------------------------------
# Pure pieces (traceable; the jitted entry points below compose them)
# ------------------------------------------------------------------------------------------------


def _constrain(state: TrainState, tree: Any, *, like: str) -> Any:
    """Pins ``tree`` (params-shaped or opt-state-shaped) to the state's rule shardings on its mesh."""
    if state.mesh is None:
        return tree
    shardings = _params_shardings(state.graphdef, state.params, state.frozen, state.mesh, state.rules)
    if like == "opt_state":
        shardings = train_sharding.like_params_shardings(tree, state.params, shardings, state.mesh)
    return jax.lax.with_sharding_constraint(tree, shardings)


def row_groups(state: TrainState, rows: int) -> int:
    """Row groups of a ``rows``-row (micro-)batch whose loss tokens are gathered separately: the
    data-parallel shards of the state's mesh (1 without one, or when they do not divide ``rows``)."""
    groups = 1 if state.mesh is None else train_sharding.batch_parallelism(state.mesh)
    return groups if rows % groups == 0 else 1


def with_logit_capacity(state: TrainState, batch: PackedBatch) -> TrainState:
    """Host: ``state`` whose config carries the loss-token buffer size for ``batch`` (``[R, L]`` or
    stacked ``[k, R, L]``; :func:`rljax.models.logprobs.logit_capacity` of its loss mask per
    data-parallel shard). Unchanged when the config does not gather, already fixes a capacity, or the
    loss mask cannot be read here (traced, or rows on other processes: then the jitted step holds
    every token, correct but not faster; read the host batch before sharding it).

    >>> from rljax.data.pack import pack
    >>> from rljax.models.tiny import tiny_model
    >>> from rljax.types import Step
    >>> batch = pack([Step([1, 2, 3], [4, 5], ("q", 0))], seq_len=64).batch
    >>> with_logit_capacity(TrainState.create(tiny_model()), batch).config.logit_capacity
    16
    """
    config = state.config
    mask = batch.loss_mask
    if not config.loss_only_logits or config.logit_capacity is not None or isinstance(mask, jax.core.Tracer):
        return state
    if not getattr(mask, "is_fully_addressable", True):
        return state
    mask = np.asarray(mask)
    capacity = logit_capacity(mask, row_groups=row_groups(state, mask.shape[-2]))
    return dataclasses.replace(state, config=dataclasses.replace(config, logit_capacity=capacity))


def _policy_forward(
    model: nnx.Module,
    batch: PackedBatch,
    config: TrainConfig,
    groups: int,
    *,
    with_entropy: bool,
    with_routing: bool,
) -> ForwardOutput:
    """The policy's :func:`~rljax.models.logprobs.sequence_forward` of one (micro-)batch, exactly as
    the train step computes it: logprobs of its loss tokens (every token without
    ``loss_only_logits``), temperature-scaled, over each token's support, router replay when
    configured, prefix-tree rows as trees."""
    tokens = jnp.asarray(batch.tokens)
    chex.assert_rank(tokens, 2)
    moe = bool(getattr(model.config, "moe_layers", ()))  # static: MoE models report routing
    gather = config.loss_only_logits
    return sequence_forward(
        model,
        tokens,
        temperature=1.0 if batch.temperatures is None else batch.temperatures,
        chunk_size=config.chunk_size,
        routed_experts=batch.routed_experts if moe and config.router_replay else None,
        support_floors=batch.support_floors,  # top-k / top-p draws: the support they came from
        with_entropy=with_entropy,
        with_routing=with_routing and moe,
        logit_mask=batch.loss_mask if gather else None,
        logit_capacity=config.logit_capacity if gather else None,
        row_groups=groups,
        **packing_kwargs(batch),  # prefix-tree rows: the tree mask, each token from its parent
    )


def _loss(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: PackedBatch,
    counts: Counts,
    config: TrainConfig,
    frozen: nnx.State | None = None,
    groups: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective of ``batch`` for the model ``graphdef`` + ``params`` (+ ``frozen``: no gradient)."""
    model = merge_model(graphdef, params, frozen)
    logp, entropy, routing = _policy_forward(
        model, batch, config, groups, with_entropy=True, with_routing=True
    )
    if config.objective.entropy_coef == 0.0:
        entropy = jax.lax.stop_gradient(entropy)  # metric only: the LM head skips its backward
    loss, metrics = objective(logp, batch, counts, config.objective, entropy=entropy)
    if routing is not None:
        loss, metrics = _add_routing(loss, metrics, routing, batch, counts, model.config, config)
    return loss, metrics


def _add_routing(
    loss: jax.Array,
    metrics: dict[str, jax.Array],
    routing: Any,
    batch: PackedBatch,
    counts: Counts,
    model_config: Any,
    config: TrainConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """MoE auxiliary losses and routing metrics of one (micro-)batch, weighted by its share of the
    mini-batch's trained tokens (so micro-batch sums are token-weighted averages). Each token counts
    once per sample that holds it (:func:`rljax.core.segments.samples_per_token`), so prefix-tree rows
    give the averages of plain rows."""
    real = samples_per_token(batch.segment_ids, getattr(batch, "subtree_end", None))
    share = jnp.sum(jnp.asarray(batch.loss_mask) != 0) / jnp.maximum(counts.loss_tokens, 1.0)
    share = share.astype(jnp.float32)
    stats = routing_metrics(routing, real)
    aux = (
        config.moe_aux_loss_coef * stats["routing/aux_loss"]
        + config.router_z_loss_coef * stats["routing/z_loss"]
    )
    out = dict(metrics)
    out.update({k: jax.lax.stop_gradient(v) * share for k, v in stats.items()})
    if batch.routed_experts is not None:
        recorded = jnp.asarray(batch.routed_experts)
        has_record = real * jnp.all(recorded >= 0, axis=(-2, -1))
        chosen = top_k_experts(jax.lax.stop_gradient(routing.logits), model_config.num_experts_per_tok)
        flips = flip_fraction(chosen, recorded, has_record)
        out["routing/flip_fraction"] = flips * share
    out["loss"] = metrics["loss"] + jax.lax.stop_gradient(aux) * share
    out["loss/moe_aux"] = jax.lax.stop_gradient(aux) * share
    return loss + aux * share, out


def loss_and_grads(
    state: TrainState, batch: PackedBatch, counts: Counts
) -> tuple[nnx.State, dict[str, jax.Array]]:
    """Gradient of the objective of one (micro-)batch w.r.t. ``state.params``, and its metrics
    (``state.frozen`` enters the forward pass only).

    ``counts`` are the :func:`mini_batch_counts` of the whole mini-batch, so gradients and metrics
    of the micro-batches of a mini-batch ADD UP to those of the whole mini-batch.

    >>> from rljax.data.pack import pack
    >>> from rljax.models import Decoder, ModelConfig
    >>> from rljax.types import Step
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> state = TrainState.create(Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> batch = pack([Step([1, 2], [3, 4], ("q", 0))], seq_len=8, ce_weights=1.0, rl_weights=0.0).batch
    >>> grads, metrics = loss_and_grads(state, batch, mini_batch_counts(batch, ObjectiveConfig()))
    >>> grads["embed_tokens"].shape, float(metrics["tokens/ce"])
    ((16, 8), 2.0)
    """
    groups = row_groups(state, np.shape(batch.tokens)[0])
    with context_scope(state.mesh):
        grads, metrics = jax.grad(_loss, has_aux=True)(
            state.params, state.graphdef, batch, counts, state.config, state.frozen, groups
        )
    return _constrain(state, grads, like="params"), metrics


def policy_logprobs(state: TrainState, batch: PackedBatch, params: nnx.State | None = None) -> jax.Array:
    """Per-token logprobs of a packed (mini-)batch under ``params`` (default: the state's), computed
    exactly as :func:`train_step` computes the logprobs it trains (the same forward, temperatures,
    support floors, router replay, prefix-tree layout, mesh and context split, and with
    ``loss_only_logits`` the same gathered LM head: the loss tokens' logprobs, 0 elsewhere) but
    without gradients: the old (proximal) policy's logprobs of an RL step (design §3.4), or a
    reference policy's. ``params`` must have the structure of ``state.params`` (the state's frozen
    weights complete the model).

    ``batch`` is ``[R, L]`` or ``[k, R, L]`` stacked micro-batches (one micro-batch of activations
    alive at a time, as in :func:`train_mini_batch`); the result has ``batch.tokens``' shape.
    Jitted; nothing is donated. The loss-token buffer's size is chosen from ``batch`` on the host
    (:func:`with_logit_capacity`).

    >>> from rljax.data.pack import pack
    >>> from rljax.models import Decoder, ModelConfig
    >>> from rljax.types import Step
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> state = TrainState.create(Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> batch = pack([Step([1, 2], [3, 4], ("q", 0))], seq_len=8).batch
    >>> logp = policy_logprobs(state, batch)
    >>> logp.shape, (np.asarray(logp[0]) < 0).astype(int).tolist()
    ((1, 8), [0, 0, 1, 1, 0, 0, 0, 0])
    """
    params = state.params if params is None else params
    return _policy_logprobs(with_logit_capacity(state, batch), batch, params)


@jax.jit
def _policy_logprobs(state: TrainState, batch: PackedBatch, params: nnx.State) -> jax.Array:
    def one(micro: PackedBatch) -> jax.Array:
        groups = row_groups(state, np.shape(micro.tokens)[0])
        with context_scope(state.mesh):
            model = state.model_of(params)
            out = _policy_forward(model, micro, state.config, groups, with_entropy=False, with_routing=False)
            return out.logprobs

    if jnp.ndim(batch.tokens) == 3:
        return jax.lax.map(one, batch)
    return one(batch)


def context_scope(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """The state's mesh as the ambient (abstract) mesh while tracing when it has a ``context`` axis,
    so the model splits rows over it (:mod:`rljax.models.context`); a no-op otherwise. Used inside
    the jitted steps (train, critic); host code calling a jitted forward enters ``jax.set_mesh``."""
    if train_sharding.context_parallelism(mesh) == 1:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def apply_gradients(
    state: TrainState, grads: nnx.State, metrics: dict[str, jax.Array]
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW update of ``state`` with ``grads``, or none when ``metrics["loss"]`` or a gradient is
    not finite (then params / opt_state are returned unchanged and ``skipped`` grows by one).

    Adds metrics ``grad_norm`` (before clipping), ``lr`` (of this update), ``param_norm`` (after),
    ``update_skipped`` (0/1), ``skipped_updates`` (running total) and ``step`` (updates applied).

    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> state = TrainState.create(Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> nan_grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), state.params)
    >>> new, metrics = apply_gradients(state, nan_grads, {"loss": jnp.float32(1.0)})
    >>> same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), new.params, state.params)
    >>> int(new.step), int(new.skipped), all(jax.tree.leaves(same))
    (0, 1, True)
    """
    tx = make_optimizer(state.config.optimizer)
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    params = _constrain(state, _select(ok, new_params, state.params), like="params")
    opt_state = _constrain(state, _select(ok, new_opt_state, state.opt_state), like="opt_state")
    skipped_now = jnp.logical_not(ok).astype(jnp.int32)
    new_state = dataclasses.replace(
        state,
        params=params,
        opt_state=opt_state,
        step=state.step + (1 - skipped_now),
        skipped=state.skipped + skipped_now,
    )
    out = dict(metrics)
    out.update(
        grad_norm=grad_norm,
        lr=learning_rate_schedule(state.config.optimizer)(state.step),
        param_norm=optax.global_norm(params),
        update_skipped=skipped_now.astype(jnp.float32),
        skipped_updates=new_state.skipped,
        step=new_state.step,
    )
    return new_state, out


def train_step(
    state: TrainState, batch: PackedBatch, counts: Counts
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``train_step(state, batch, counts) -> (state, metrics)``: one jitted optimizer step.

    ``batch`` is a :class:`rljax.types.PackedBatch` of ``[R, L]`` arrays (numpy, or sharded with
    :func:`rljax.training.sharding.shard_batch`); ``counts`` = :func:`mini_batch_counts` of it. ``state``
    is donated. Metrics: the objective's (``loss``, ``loss/rl``, ``loss/ce``, ``loss/ref_kl``,
    ``rl/clip_frac``, ``entropy``, ...) plus ``grad_norm``, ``lr``, ``param_norm``,
    ``update_skipped``, ``skipped_updates``, ``step``.

    >>> from rljax.data.pack import pack
    >>> from rljax.models import Decoder, ModelConfig
    >>> from rljax.types import Step
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> batch = pack([Step([1, 2], [3, 4], ("q", 0))], seq_len=8, ce_weights=1.0, rl_weights=0.0).batch
    >>> config = TrainConfig(objective=ObjectiveConfig(), optimizer=OptimizerConfig(learning_rate=1e-2))
    >>> state = TrainState.create(Decoder(cfg, rngs=nnx.Rngs(0)), config)
    >>> state, metrics = train_step(state, batch, mini_batch_counts(batch, config.objective))
    >>> int(state.step), bool(metrics["loss"] > 0), round(float(metrics["lr"]), 6)
    (1, True, 0.01)
    """
    grads, metrics = loss_and_grads(state, batch, counts)
    return apply_gradients(state, grads, metrics)


def train_mini_batch(
    state: TrainState, micro_batches: PackedBatch, counts: Counts
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``train_mini_batch(state, micro_batches, counts) -> (state, metrics)``.

    One optimizer step on a mini-batch given as ``k`` stacked micro-batches (a PackedBatch of
    ``[k, R, L]`` arrays, see :func:`split_micro_batches` / :func:`stack_micro_batches`): gradients
    of the micro-batches are summed in float32 (``lax.scan``, one micro-batch of activations alive at
    a time), then applied once. ``counts`` are the :func:`mini_batch_counts` of the whole mini-batch;
    the result equals :data:`train_step` on the unsplit batch. Metrics are summed over micro-batches
    (the objective's metrics are additive). ``state`` is donated. Micro-batches of empty rows only
    are skipped (``lax.cond``): a caller may append them to keep ``k``, and so the compiled program,
    the same when a mini-batch packs into fewer rows (:class:`rljax.run.run.Run` does).

    >>> from rljax.data.pack import pack
    >>> from rljax.models import Decoder, ModelConfig
    >>> from rljax.types import Step
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> steps = [Step([1, 2], [3, 4, 5, 6], ("q", i)) for i in range(4)]
    >>> batch = pack(steps, seq_len=8, ce_weights=1.0, rl_weights=0.0).batch
    >>> micro = split_micro_batches(batch, 2)
    >>> micro.tokens.shape
    (2, 2, 8)
    >>> state = TrainState.create(Decoder(cfg, rngs=nnx.Rngs(0)))
    >>> state, metrics = train_mini_batch(state, micro, mini_batch_counts(micro, state.config.objective))
    >>> int(state.step), float(metrics["tokens/ce"])
    (1, 16.0)
    """
    chex.assert_rank(micro_batches.tokens, 3)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    zeros = _constrain(state, zeros, like="params")

    def accumulate(total: nnx.State, micro: PackedBatch) -> tuple[nnx.State, dict[str, jax.Array]]:
        grads, metrics = loss_and_grads(state, micro, counts)
        total = jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, grads)
        return _constrain(state, total, like="params"), metrics

    metric_shapes = jax.eval_shape(accumulate, zeros, jax.tree.map(lambda x: x[0], micro_batches))[1]

    def skip(total: nnx.State, micro: PackedBatch) -> tuple[nnx.State, dict[str, jax.Array]]:
        # neutral for the reductions below: 0 for sums, -inf for maxima
        neutral = {k: -jnp.inf if k in MAX_METRICS else 0.0 for k in metric_shapes}
        return total, {k: jnp.full(m.shape, neutral[k], m.dtype) for k, m in metric_shapes.items()}

    def step(total: nnx.State, micro: PackedBatch) -> tuple[nnx.State, dict[str, jax.Array]]:
        # a micro-batch of empty rows only (padding: see rljax.data.micro_batch) adds nothing: skipped
        return jax.lax.cond(jnp.any(micro.segment_ids != 0), accumulate, skip, total, micro)

    total, stacked = jax.lax.scan(step, zeros, micro_batches)
    grads = jax.tree.map(lambda t, p: t.astype(p.dtype), total, state.params)
    # objective metrics are additive over micro-batches, except the maxima (MAX_METRICS)
    metrics = {k: (jnp.max if k in MAX_METRICS else jnp.sum)(m, axis=0) for k, m in stacked.items()}
    return apply_gradients(state, grads, metrics)


def _jit_keeping_frozen(fn: Any) -> Any:
    """``jax.jit(fn, donate_argnums=0)`` for ``fn(state, batch, *args) -> (state, aux)``, except that
    ``state.frozen`` is a separate, NOT donated argument that is no output: the returned state holds
    the caller's frozen arrays themselves (no copy, still valid). The loss-token buffer size is
    chosen from ``batch`` on the host (:func:`with_logit_capacity`). ``.lower(state, batch, *args)``
    lowers the underlying jitted function, which is ``.jitted``."""

    def inner(state: TrainState, frozen: nnx.State, *args: Any) -> tuple[TrainState, Any]:
        new, aux = fn(dataclasses.replace(state, frozen=frozen), *args)
        return dataclasses.replace(new, frozen=_no_frozen()), aux

    jitted = jax.jit(inner, donate_argnums=0)

    def split(state: TrainState) -> tuple[TrainState, nnx.State]:
        return dataclasses.replace(state, frozen=_no_frozen()), state.frozen

    @functools.wraps(fn)
    def call(state: TrainState, batch: PackedBatch, *args: Any) -> tuple[TrainState, Any]:
        new, aux = jitted(*split(with_logit_capacity(state, batch)), batch, *args)
        # the caller's config back: the buffer size was this batch's (the next one chooses its own)
        return dataclasses.replace(new, frozen=state.frozen, config=state.config), aux

    call.lower = lambda state, batch, *args: jitted.lower(
        *split(with_logit_capacity(state, batch)), batch, *args
    )
    call.jitted = jitted
    return call


train_step = _jit_keeping_frozen(train_step)
train_mini_batch = _jit_keeping_frozen(train_mini_batch)


# ------------------------------------------------------------------------------------------------
# Counts and micro-batches
# ------------------------------------------------------------------------------------------------


def _flatten_rows(batch: PackedBatch) -> PackedBatch:
    """``[k, R, L]`` -> ``[k * R, L]`` (rows stay rows, so sample identities are kept)."""
    return jax.tree.map(lambda x: jnp.reshape(x, (-1, x.shape[-1])), batch)


@functools.partial(jax.jit, static_argnums=1)
def _counts(batch: PackedBatch, config: ObjectiveConfig) -> Counts:
    return global_counts(batch, config)


def mini_batch_counts(batch: PackedBatch, config: ObjectiveConfig) -> Counts:
    """:func:`rljax.core.objective.global_counts` of a whole mini-batch (jitted), given as ``[R, L]``
    arrays or ``[k, R, L]`` stacked micro-batches; works on sharded arrays.

    >>> from rljax.data.pack import pack
    >>> from rljax.types import Step
    >>> batch = pack([Step([1, 2], [3, 4], ("q", 0))], seq_len=8).batch
    >>> mini_batch_counts(batch, ObjectiveConfig()).tokens.tolist()
    [2.0, 0.0, 0.0]
    """
    if np.ndim(batch.tokens) == 3:
        batch = _flatten_rows(batch)
    elif np.ndim(batch.tokens) != 2:
        raise ValueError(f"batch.tokens must be [R, L] or [k, R, L]; got shape {np.shape(batch.tokens)}")
    addressable = all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(batch))
    if config.num_groups is not None and addressable:  # host-side group_index range check (concrete)
        global_counts(jax.tree.map(np.asarray, batch), config)
    return _counts(batch, config)


def split_micro_batches(batch: PackedBatch, num_micro_batches: int) -> PackedBatch:
    """Host: ``[R, L]`` -> ``[k, R / k, L]`` (consecutive rows per micro-batch) as numpy arrays.

    Raises ``ValueError`` unless ``k`` divides ``R``.

    >>> from rljax.data.pack import pack
    >>> from rljax.types import Step
    >>> batch = pack([Step([1], [2], ("q", i)) for i in range(4)], seq_len=2).batch
    >>> split_micro_batches(batch, 2).tokens.tolist()
    [[[1, 2], [1, 2]], [[1, 2], [1, 2]]]
    """
    rows = int(np.shape(batch.tokens)[0])
    if not (isinstance(num_micro_batches, int) and num_micro_batches >= 1) or rows % num_micro_batches:
        raise ValueError(
            f"num_micro_batches={num_micro_batches!r} must be a positive int dividing the {rows} rows; "
            "pack with row_buckets / data_parallel that make rows a multiple of it"
        )
    k = num_micro_batches
    return jax.tree.map(lambda x: np.asarray(x).reshape(k, rows // k, *np.shape(x)[1:]), batch)


def stack_micro_batches(batches: Sequence[PackedBatch]) -> PackedBatch:
    """Host: stacks equally shaped ``[R, L]`` packed batches into ``[k, R, L]`` numpy arrays.

    All batches must have the same shape and the same set of ``None`` fields (``ValueError``).

    >>> from rljax.data.pack import pack
    >>> from rljax.types import Step
    >>> b = pack([Step([1], [2], ("q", 0))], seq_len=4).batch
    >>> stack_micro_batches([b, b, b]).tokens.shape
    (3, 1, 4)
    """
    if not batches:
        raise ValueError("stack_micro_batches needs at least one batch")
    shapes = {tuple(np.shape(b.tokens)) for b in batches}
    if len(shapes) != 1:
        raise ValueError(
            f"micro-batches must share one [R, L] shape to be stacked; got {sorted(shapes)} "
            "(pack them with the same row_buckets, or pad with fully masked rows)"
        )
    structures = {jax.tree.structure(b) for b in batches}
    if len(structures) != 1:
        raise ValueError("micro-batches must have the same fields set (None in all or in none)")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)
