"""One training client's model on the server: its trained parameters (a LoRA adapter or the whole
model), Adam state, summed gradients and step count, over a base model shared by every client.

The jitted programs take the graph definition, the loss name and the segment bound as static
arguments and everything else (parameters, the frozen base, the packed batch, the loss options,
Adam's hyperparameters) as arrays, so a client's steps compile once per batch shape, whatever
learning rate or clip thresholds it sends. :data:`STEP_TRACES` counts how often the step was traced
(once per compiled program: a new shape, loss or model structure), per ``(loss, backward, clients)``.

:func:`forward_fused` runs the requests of SEVERAL LoRA clients of one structure (equal rank, alpha
and targets) over the same base as one program: their adapters are stacked and the per-client step
is ``jax.vmap``-ed over them (the base is not batched, so its matmuls see all clients' rows at once).
Client ``c``'s loss depends only on its own adapter and rows, so the gradient of the summed loss with
respect to adapter ``c`` is exactly client ``c``'s own gradient.

Adam (``optim_step``): ``AdamParams(learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm)``
is applied as ``optax.adamw`` (bias-corrected moments, decoupled weight decay ``lr * wd * theta``)
after clipping the gradient to global norm ``grad_clip_norm`` when it is > 0
(``g <- g * c / max(|g|, c)``), with the hyperparameters injected per step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rljax.models.logprobs import token_logprobs_and_entropy
from rljax.models.lora import LoRAConfig, LoRAParam, apply_lora
from rljax.tinker.losses import token_losses
from rljax.training.step import merge_model

__all__ = [
    "ADAM_DEFAULTS",
    "STEP_TRACES",
    "TrainableModel",
    "can_fuse",
    "forward_fused",
    "forward_fused_async",
    "make_trainable",
    "target_logprobs",
]

#: ``(loss name, backward, clients)`` -> times the jitted forward / backward step was traced (=
#: compiled); ``clients`` > 1: a fused step of that many clients (:func:`forward_fused`).
STEP_TRACES: collections.Counter[tuple[str, bool, int]] = collections.Counter()

#: The SDK's ``AdamParams`` defaults.
ADAM_DEFAULTS = dict(
    learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0
)


def _adam() -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adamw)(
        learning_rate=ADAM_DEFAULTS["learning_rate"],
        b1=ADAM_DEFAULTS["beta1"],
        b2=ADAM_DEFAULTS["beta2"],
        eps=ADAM_DEFAULTS["eps"],
        weight_decay=ADAM_DEFAULTS["weight_decay"],
    )


@dataclasses.dataclass
class TrainableModel:
    """A client's model: ``params`` trained, ``frozen`` shared base weights (empty: full training)."""

    model_id: str
    base_model: str
    lora: LoRAConfig | None
    graphdef: nnx.GraphDef
    params: nnx.State
    frozen: nnx.State
    opt_state: Any
    step: int = 0
    pending: Any = None  # summed gradients since the last optim_step
    session_id: str = ""
    lora_request: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_lora(self) -> bool:
        """Whether the model trains a LoRA adapter only."""
        return self.lora is not None

    def model(self) -> nnx.Module:
        """An NNX model holding the current parameters."""
        return merge_model(self.graphdef, self.params, self.frozen)

    def forward(
        self,
        loss_fn: str,
        batch: Mapping[str, np.ndarray],
        config: Mapping[str, float],
        num_segments: int,
        *,
        backward: bool,
    ) -> tuple[float, np.ndarray]:
        """Runs one packed batch: returns (loss sum, target logprobs ``[R, L]``); ``backward`` adds the
        gradient of the loss sum to :attr:`pending`."""
        return self.forward_async(loss_fn, batch, config, num_segments, backward=backward)()

    def forward_async(
        self,
        loss_fn: str,
        batch: Mapping[str, np.ndarray],
        config: Mapping[str, float],
        num_segments: int,
        *,
        backward: bool,
    ) -> Callable[[], tuple[float, np.ndarray]]:
        """:meth:`forward` without waiting for the device: the step is dispatched (JAX runs it
        asynchronously; :attr:`pending` already holds its gradients, so a later :meth:`optim_step`
        queues behind it) and the returned function waits for it and gives (loss sum, logprobs)."""
        arrays = {k: jnp.asarray(v) for k, v in batch.items()}
        cfg = {k: jnp.float32(v) for k, v in config.items()}
        if backward:
            (loss, logp), grads = _loss_and_grads(
                self.graphdef, loss_fn, num_segments, self.params, self.frozen, arrays, cfg
            )
            self.pending = grads if self.pending is None else _add(self.pending, grads)
        else:
            loss, logp = _loss(self.graphdef, loss_fn, num_segments, self.params, self.frozen, arrays, cfg)
        return lambda: (float(loss), np.asarray(logp))

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        """One Adam update with the summed gradients (ValueError when there are none)."""
        return self.optim_step_async(adam)()

    def optim_step_async(self, adam: Mapping[str, float]) -> Callable[[], dict[str, float]]:
        """:meth:`optim_step` without waiting for the device: the update is dispatched (the parameters
        are its results; later steps queue behind it) and the returned function waits for its
        metrics."""
        if self.pending is None:
            raise ValueError("optim_step: this model has no gradients; call forward_backward first")
        hp = {k: jnp.float32(adam.get(k, v)) for k, v in ADAM_DEFAULTS.items()}
        self.params, self.opt_state, norm = _apply(self.params, self.opt_state, self.pending, hp)
        self.pending = None
        self.step += 1
        step = self.step
        return lambda: {"grad_norm:mean": float(norm), "step:max": float(step)}


def make_trainable(
    base: nnx.Module,
    model_id: str,
    base_model: str,
    *,
    lora: LoRAConfig | None,
    seed: int,
) -> TrainableModel:
    """A fresh client model over ``base`` (its arrays are shared, never copied): LoRA adapters
    (A Kaiming-uniform from ``seed``, B = 0) trained over the frozen base, or (``lora`` None) a copy
    of every weight trained."""
    graphdef, state = nnx.split(base)
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    if lora is not None:
        apply_lora(model, lora, rngs=nnx.Rngs(seed))
        graphdef, params, frozen = nnx.split(model, LoRAParam, nnx.Param)
    else:
        graphdef, params = nnx.split(model, nnx.Param)
        params = jax.tree.map(jnp.copy, params)
        frozen = nnx.State({})
    return TrainableModel(model_id, base_model, lora, graphdef, params, frozen, _adam().init(params))


def target_logprobs(
    graphdef: nnx.GraphDef, params: Any, frozen: Any, batch: Mapping[str, jax.Array]
) -> jax.Array:
    """``logp[r, t] = log softmax(logits(x[r, <=t]))[targets[r, t]]`` (0 off the datums); with
    ``targets [R, L, K]`` (K targets per position), ``logp [R, L, K]`` from one softmax per position."""
    model = merge_model(graphdef, params, frozen)
    hidden = model.hidden_states(
        batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"]
    ).hidden
    rows, length, width = hidden.shape
    targets = batch["targets"]
    logp, _ = token_logprobs_and_entropy(
        hidden.reshape(rows * length, width),
        model.unembedding(),
        targets.reshape(rows * length, *targets.shape[2:]),
        jnp.ones((rows * length,), jnp.float32),
        precision=model.precision,
        unembedding_lora=model.unembedding_lora(),
    )
    mask = batch["mask"].reshape(rows, length, *(1,) * (targets.ndim - 2))
    return jnp.where(mask > 0, logp.reshape(targets.shape), 0.0)


def _loss_impl(graphdef, loss_fn, num_segments, params, frozen, batch, config):  # noqa: ANN001, ANN202
    logp = target_logprobs(graphdef, params, frozen, batch)
    per_token = token_losses(loss_fn, logp, batch, config, batch["segment_ids"], num_segments)
    return jnp.sum(per_token), logp


def _counted(fn, backward: bool):  # noqa: ANN001, ANN202
    """``fn`` that counts its traces in :data:`STEP_TRACES` (a Python side effect: it runs only when
    jit traces, i.e. compiles, never on a cached call)."""

    @functools.wraps(fn)
    def traced(graphdef, loss_fn, num_segments, params, *args):  # noqa: ANN001, ANN202
        clients = len(params) if isinstance(params, list) else 1
        STEP_TRACES[(loss_fn, backward, clients)] += 1
        return fn(graphdef, loss_fn, num_segments, params, *args)

    return traced


def _fused_loss_impl(graphdef, loss_fn, num_segments, params, frozen, batch, config):  # noqa: ANN001, ANN202
    """Sum over clients of their loss sums; ``params`` a list of C adapters, ``batch`` ``[C, R, L]``
    arrays. Returns ``(total, (per-client losses [C], logp [C, R, L...]))``."""

    def one(p, b):  # noqa: ANN001, ANN202
        return _loss_impl(graphdef, loss_fn, num_segments, p, frozen, b, config)

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params)
    losses, logp = jax.vmap(one)(stacked, batch)
    return jnp.sum(losses), (losses, logp)


_loss = jax.jit(_counted(_loss_impl, False), static_argnums=(0, 1, 2))
_loss_and_grads = jax.jit(
    _counted(jax.value_and_grad(_loss_impl, argnums=3, has_aux=True), True), static_argnums=(0, 1, 2)
)
_fused_loss = jax.jit(_counted(_fused_loss_impl, False), static_argnums=(0, 1, 2))
_fused_loss_and_grads = jax.jit(
    _counted(jax.value_and_grad(_fused_loss_impl, argnums=3, has_aux=True), True), static_argnums=(0, 1, 2)
)


def can_fuse(a: TrainableModel, b: TrainableModel) -> bool:
    """Whether two clients' steps can run as one :func:`forward_fused` program: both LoRA, the same
    adapter structure (graph definition: rank, alpha, targets) over the very same base arrays."""
    if not (a.is_lora and b.is_lora) or a.lora != b.lora or a.graphdef != b.graphdef:
        return False
    fa, fb = jax.tree.leaves(a.frozen), jax.tree.leaves(b.frozen)
    return len(fa) == len(fb) and all(x is y for x, y in zip(fa, fb, strict=True))


def forward_fused(
    models: list[TrainableModel],
    loss_fn: str,
    batches: list[Mapping[str, np.ndarray]],
    config: Mapping[str, float],
    num_segments: int,
    *,
    backward: bool,
) -> list[tuple[float, np.ndarray]]:
    """:meth:`TrainableModel.forward` of several clients (``can_fuse`` pairwise; one packed batch each,
    all of one shape) as ONE jitted program; ``backward`` adds each client's gradient to its own
    :attr:`~TrainableModel.pending`. Returns (loss sum, target logprobs) per client."""
    return forward_fused_async(models, loss_fn, batches, config, num_segments, backward=backward)()


def forward_fused_async(
    models: list[TrainableModel],
    loss_fn: str,
    batches: list[Mapping[str, np.ndarray]],
    config: Mapping[str, float],
    num_segments: int,
    *,
    backward: bool,
) -> Callable[[], list[tuple[float, np.ndarray]]]:
    """:func:`forward_fused` without waiting for the device (as :meth:`TrainableModel.forward_async`):
    the returned function waits and gives (loss sum, target logprobs) per client."""
    first = models[0]
    arrays = {k: jnp.asarray(np.stack([b[k] for b in batches])) for k in batches[0]}
    cfg = {k: jnp.float32(v) for k, v in config.items()}
    params = [m.params for m in models]
    if backward:
        (_, (losses, logp)), grads = _fused_loss_and_grads(
            first.graphdef, loss_fn, num_segments, params, first.frozen, arrays, cfg
        )
        for m, g in zip(models, grads, strict=True):
            m.pending = g if m.pending is None else _add(m.pending, g)
    else:
        _, (losses, logp) = _fused_loss(
            first.graphdef, loss_fn, num_segments, params, first.frozen, arrays, cfg
        )

    def finish() -> list[tuple[float, np.ndarray]]:
        host_losses, host_logp = np.asarray(losses), np.asarray(logp)
        return [(float(host_losses[c]), host_logp[c]) for c in range(len(models))]

    return finish


_add = jax.jit(functools.partial(jax.tree.map, jnp.add))


@jax.jit
def _apply(
    params: Any, opt_state: Any, grads: Any, hp: Mapping[str, jax.Array]
) -> tuple[Any, Any, jax.Array]:
    norm = optax.global_norm(grads)
    clip = hp["grad_clip_norm"]
    scale = jnp.where((clip > 0) & (norm > clip), clip / jnp.maximum(norm, 1e-30), 1.0)
    grads = jax.tree.map(lambda g: g * scale, grads)
    opt_state.hyperparams.update(
        learning_rate=hp["learning_rate"],
        b1=hp["beta1"],
        b2=hp["beta2"],
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )
    updates, opt_state = _adam().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, norm
