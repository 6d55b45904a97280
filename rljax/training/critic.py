"""PPO's critic on packed rows: old values, GAE advantages, and the jitted critic step (design §3).

For one PPO mini-batch ``B`` (packed rows; merged multi-turn samples, observation tokens masked)::

    V_old  = values(critic, B)                             at sampling time (before any update)
    A, R   = gae(B.token_rewards, V_old, B.loss_mask, gamma, lam, segment_ids, links)
    A      = masked_whiten(A) if whiten else R - V_old      (policy advantages; R = returns)
    policy <- train_step(policy, B | advantages = A)        (ppo_clip, the usual objective)
    critic <- AdamW(grad  sum_t m_t value_loss(V_t, V_old_t, R_t; value_clip) / sum_t m_t)

``values`` line up with the per-token streams (entry ``t`` = the critic's estimate of the return
from the state that predicts ``tokens[t]``); masked positions are not time steps of the GAE and
packed samples never bootstrap from each other (:func:`rljax.core.advantages.gae`), except along
``links`` (:func:`rljax.data.credit.turn_links`): each turn of a trajectory bootstraps from the
next turn's first trained token wherever that sits, so the returns are those of the trajectory's
trained tokens in time order, merged or not (design §2.4). Prefix-tree rows (design §2.6) are exact
too: a value comes from the hidden state of the token's parent, and the trainable tokens of a sample
are its own, in order. The value
loss has its own normaliser: the trained tokens of the whole mini-batch (``global_tokens``), so
micro-batches add up. The critic is a :class:`rljax.models.value.ValueModel` held in a
:class:`rljax.training.step.TrainState` (its own optimizer; the state's objective is unused).

Reference: Schulman et al. 2017 (PPO) and 2016 (GAE); the clipped value loss as in verl / SkyRL.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from rljax import knobs
from rljax.core.advantages import gae
from rljax.core.losses import explained_variance, value_clipped_tokens, value_loss
from rljax.knobs import knob
from rljax.models.logprobs import packing_kwargs
from rljax.models.value import values as model_values
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import TrainState, apply_gradients, context_scope
from rljax.types import PackedBatch

__all__ = ["CriticConfig", "CriticSection", "critic_step", "critic_values", "ppo_advantages"]


@knobs.section
class CriticConfig:
    """Hyperparameters of PPO's critic and advantages (hashable; static under jit).

    >>> CriticConfig(gamma=0.99).lam
    1.0
    """

    gamma: float = knob(1.0, ge=0, le=1, doc="GAE discount")
    lam: float = knob(1.0, ge=0, le=1, doc="GAE lambda")
    whiten_advantages: bool = knob(True, doc="whiten the GAE advantages over the mini-batch's trained tokens")
    value_clip: float | None = knob(
        0.2, gt=0, doc="clip range of the value loss around ``V_old`` (None = unclipped)"
    )
    warmup_steps: int = knob(0, ge=0, doc="RL steps that train only the critic (the policy is not updated)")


@knobs.section
class CriticSection(CriticConfig):
    """A run's ``config.critic``: the :class:`CriticConfig` hyperparameters plus where the critic
    starts and how it is optimized.

    ``hf_path``: a value model to start from (:func:`rljax.models.value.load_value_model`; HF
    checkpoint + ``value_head.safetensors``); empty = a copy of the policy's initial weights with a
    fresh zero head. ``learning_rate`` (None = the run's) and ``optimizer`` field overrides of
    :class:`rljax.training.optimizer.OptimizerConfig` give the critic its own AdamW.
    :meth:`hyperparameters` is the hashable :class:`CriticConfig` the jitted functions take.

    >>> CriticSection(gamma=0.99, learning_rate=1e-5).hyperparameters()
    CriticConfig(gamma=0.99, lam=1.0, whiten_advantages=True, value_clip=0.2, warmup_steps=0)
    """

    hf_path: str = knob(
        "",
        doc="a value model to start from (HF checkpoint + ``value_head.safetensors``); empty = the "
        "policy's initial weights with a fresh zero head",
    )
    learning_rate: float | None = knob(None, gt=0, doc="the critic's learning rate (None = the run's)")
    optimizer: dict = knob(
        {},
        overrides_of=OptimizerConfig,
        doc=":class:`rljax.training.optimizer.OptimizerConfig` fields of the critic's AdamW that differ "
        "from the run's ``optimizer``",
    )

    def hyperparameters(self) -> CriticConfig:
        """The hashable :class:`CriticConfig` part of the section (what the jitted functions take)."""
        return CriticConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(CriticConfig)})


def _values(params: nnx.State, graphdef: nnx.GraphDef, batch: PackedBatch) -> jax.Array:
    model = nnx.merge(graphdef, params)
    return model_values(model, batch.tokens, **packing_kwargs(batch))


@jax.jit
def critic_values(state: TrainState, batch: PackedBatch) -> jax.Array:
    """float32 ``[R, L]`` values of the critic ``state`` on a packed ``batch`` (0 on padding); rows
    split over the state's ``context`` mesh axis when it has one."""
    with context_scope(state.mesh):
        return _values(state.params, state.graphdef, batch)


def ppo_advantages(
    old_values: jax.Array, batch: PackedBatch, config: CriticConfig, links: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(advantages, returns)`` ``[R, L]`` of a packed batch by GAE over its trained tokens.

    ``old_values``: :func:`critic_values` at sampling time; rewards: ``batch.token_rewards``;
    ``links``: int32 ``[K, 2]`` from :func:`rljax.data.credit.turn_links` (None: every sample
    on its own).
    Advantages are whitened over the batch's trained tokens when ``config.whiten_advantages``,
    else ``returns - old_values``; both are 0 off the loss mask.

    >>> import numpy as np
    >>> from rljax.data.pack import pack
    >>> from rljax.types import Step
    >>> b = pack([Step([1], [2, 3], ("q", 0))], seq_len=4, token_rewards=[[0.0, 1.0]]).batch
    >>> adv, ret = ppo_advantages(jnp.zeros((1, 4)), b, CriticConfig(whiten_advantages=False))
    >>> ret.tolist()
    [[0.0, 1.0, 1.0, 0.0]]
    """
    if batch.token_rewards is None:
        raise ValueError("ppo_advantages needs batch.token_rewards (pack with token_rewards=...)")
    chex.assert_equal_shape([old_values, batch.tokens])
    mask = jnp.asarray(batch.loss_mask) != 0
    rewards = jnp.asarray(batch.token_rewards, jnp.float32)
    v = jnp.asarray(old_values, jnp.float32)
    whitened, returns = gae(rewards, v, mask, batch.segment_ids, links, gamma=config.gamma, lam=config.lam)
    raw = jnp.where(mask, returns - v, 0.0)
    return (whitened if config.whiten_advantages else raw), returns


def _critic_loss(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: PackedBatch,
    old_values: jax.Array,
    returns: jax.Array,
    global_tokens: jax.Array,
    config: CriticConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    v = _values(params, graphdef, batch)
    mask = (jnp.asarray(batch.loss_mask) != 0).astype(jnp.float32)
    per_token = value_loss(v, old_values, returns, value_clip=config.value_clip)
    denom = jnp.maximum(global_tokens, 1.0)
    loss = jnp.sum(per_token * mask) / denom
    clipped = value_clipped_tokens(v, old_values, returns, value_clip=config.value_clip)
    metrics = {
        "loss": loss,
        "critic/value_loss": loss,
        "critic/clip_frac": jnp.sum(clipped * mask) / denom,
        "critic/value_mean": jnp.sum(jax.lax.stop_gradient(v) * mask) / denom,
        "critic/explained_variance": explained_variance(jax.lax.stop_gradient(v), returns, mask),
    }
    return loss, metrics


def critic_step(
    state: TrainState,
    batch: PackedBatch,
    old_values: jax.Array,
    returns: jax.Array,
    config: CriticConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step of the critic on a packed mini-batch; ``state`` is donated.

    Metrics: ``critic/value_loss`` (mean over trained tokens), ``critic/clip_frac``,
    ``critic/value_mean`` (values before the update), ``critic/explained_variance`` (of those values
    for ``returns``), ``critic/grad_norm``, ``critic/lr``, ``critic/update_skipped``.
    """
    global_tokens = jnp.sum(jnp.asarray(batch.loss_mask) != 0).astype(jnp.float32)
    with context_scope(state.mesh):
        grads, metrics = jax.grad(_critic_loss, has_aux=True)(
            state.params, state.graphdef, batch, old_values, returns, global_tokens, config
        )
    state, out = apply_gradients(state, grads, metrics)
    out["critic/grad_norm"] = out.pop("grad_norm")
    out["critic/lr"] = out.pop("lr")
    out["critic/update_skipped"] = out.pop("update_skipped")
    for key in ("param_norm", "skipped_updates", "step", "loss"):
        out.pop(key, None)
    return state, out


critic_step = jax.jit(critic_step, donate_argnums=0, static_argnums=4)
ppo_advantages = jax.jit(ppo_advantages, static_argnums=2)
