"""One training client's model on the server: its trained parameters (a LoRA adapter or the whole
model), Adam state, summed gradients and step count, over a base model shared by every client.

The jitted programs take the graph definition, the loss name and the segment bound as static
arguments and everything else (parameters, the frozen base, the packed batch, the loss options,
Adam's hyperparameters) as arrays, so a client's steps compile once per batch shape, whatever
learning rate or clip thresholds it sends. :data:`STEP_TRACES` counts how often the step was traced
(once per compiled program: a new shape, loss or model structure), per ``(loss, backward)``.

Adam (``optim_step``): ``AdamParams(learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm)``
is applied as ``optax.adamw`` (bias-corrected moments, decoupled weight decay ``lr * wd * theta``)
after clipping the gradient to global norm ``grad_clip_norm`` when it is > 0
(``g <- g * c / max(|g|, c)``), with the hyperparameters injected per step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rljax.models.logprobs import token_logprobs_and_entropy
from rljax.models.lora import LoRAConfig, LoRAParam, apply_lora
from rljax.train.step import merge_model
from rljax.train.tinker.losses import token_losses

__all__ = ["ADAM_DEFAULTS", "STEP_TRACES", "TrainableModel", "make_trainable"]

#: ``(loss name, backward)`` -> times the jitted forward / backward step was traced (= compiled).
STEP_TRACES: collections.Counter[tuple[str, bool]] = collections.Counter()

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
        return self.lora is not None

    def model(self) -> nnx.Module:
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
        arrays = {k: jnp.asarray(v) for k, v in batch.items()}
        cfg = {k: jnp.float32(v) for k, v in config.items()}
        if backward:
            (loss, logp), grads = _loss_and_grads(
                self.graphdef, loss_fn, num_segments, self.params, self.frozen, arrays, cfg
            )
            self.pending = grads if self.pending is None else _add(self.pending, grads)
        else:
            loss, logp = _loss(self.graphdef, loss_fn, num_segments, self.params, self.frozen, arrays, cfg)
        return float(loss), np.asarray(logp)

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        """One Adam update with the summed gradients (ValueError when there are none)."""
        if self.pending is None:
            raise ValueError("optim_step: this model has no gradients; call forward_backward first")
        hp = {k: jnp.float32(adam.get(k, v)) for k, v in ADAM_DEFAULTS.items()}
        self.params, self.opt_state, norm = _apply(self.params, self.opt_state, self.pending, hp)
        self.pending = None
        self.step += 1
        return {"grad_norm:mean": float(norm), "step:max": float(self.step)}


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
    def traced(graphdef, loss_fn, *args):  # noqa: ANN001, ANN202
        STEP_TRACES[(loss_fn, backward)] += 1
        return fn(graphdef, loss_fn, *args)

    return traced


_loss = jax.jit(_counted(_loss_impl, False), static_argnums=(0, 1, 2))
_loss_and_grads = jax.jit(
    _counted(jax.value_and_grad(_loss_impl, argnums=3, has_aux=True), True), static_argnums=(0, 1, 2)
)
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
