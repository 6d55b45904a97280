"""Optimizer and learning-rate schedule of the train step (design §5): AdamW, warmup, cosine or constant.

The update of one optimizer step ``s`` (``s`` = number of updates applied so far) is::

    g     <- g * min(1, max_grad_norm / ||g||_2)                 (global-norm clipping)
    m     <- b1 m + (1 - b1) g ;   v <- b2 v + (1 - b2) g^2        (Adam moments, bias-corrected)
    theta <- theta - lr(s) * (m_hat / (sqrt(v_hat) + eps) + wd * theta)     (decoupled decay)

(Kingma & Ba 2015; Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"; Pascanu et
al. 2013 for clipping). Weight decay applies to matrices only (rank >= 2: kernels, embeddings),
not to norm scales and biases, as in GPT-2 / HF Trainer practice.

Schedule, with ``W = warmup_steps``, ``T = total_steps`` and ``lr_min = min_lr_ratio * lr``::

    s <  W:  lr(s) = lr * (s + 1) / W                        (linear warmup; the first update is not 0)
    s >= W:  constant:  lr(s) = lr
             cosine:    p = clip((s - W) / max(T - W, 1), 0, 1)
                        lr(s) = lr_min + (lr - lr_min) * (1 + cos(pi p)) / 2

Decision: warmup counts ``s + 1`` (HF / optax start warmup at exactly 0, which wastes the first
update of an RL run); cosine holds ``lr_min`` after ``T``.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import optax

from rljax import knobs
from rljax.knobs import knob

SCHEDULES: tuple[str, ...] = ("constant", "cosine")


@knobs.section
class OptimizerConfig:
    """AdamW + schedule + clipping hyperparameters (frozen, hashable: usable as jit static data).

    The defaults are those of a run's ``config.optimizer`` (the default recipe trains a tiny model:
    lr 2e-4, no weight decay), with no warmup, a constant schedule, betas (0.9, 0.999) and clip
    1.0. For 1-8B models common RL post-training practice (SkyRL / prime-rl / verl) is lr 1e-6 and
    weight decay 0.01, as the GPU recipes set.

    >>> OptimizerConfig(learning_rate=3e-6, schedule="cosine", total_steps=100).schedule
    'cosine'
    >>> OptimizerConfig(b2=1.0)
    Traceback (most recent call last):
    ...
    ValueError: OptimizerConfig.b2: expected a number in [0, 1), got 1.0
    """

    learning_rate: float = knob(2e-4, gt=0, doc="peak learning rate")
    schedule: str = knob(
        "constant", choices=SCHEDULES, doc="``constant`` or ``cosine``, both after a linear warmup"
    )
    warmup_steps: int = knob(0, ge=0, doc="optimizer steps of linear warmup (0 = none)")
    total_steps: int | None = knob(
        None,
        ge=1,
        doc="optimizer steps at which cosine reaches ``min_lr_ratio * learning_rate``; required for "
        "``cosine`` (more than ``warmup_steps``)",
    )
    min_lr_ratio: float = knob(
        0.0, ge=0, le=1, doc="final lr of the cosine schedule as a fraction of the peak"
    )
    b1: float = knob(0.9, ge=0, lt=1, doc="Adam's first-moment decay")
    b2: float = knob(0.999, ge=0, lt=1, doc="Adam's second-moment decay")
    eps: float = knob(1e-8, gt=0, doc="Adam's denominator epsilon")
    weight_decay: float = knob(0.0, ge=0, doc="decoupled weight decay (matrices only)")
    max_grad_norm: float | None = knob(1.0, gt=0, doc="global-norm clipping threshold (None = no clipping)")

    def __post_init__(self) -> None:
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(
                f"OptimizerConfig.total_steps: schedule 'cosine' needs total_steps, an int > "
                f"warmup_steps={self.warmup_steps}; got {self.total_steps!r}"
            )


def learning_rate_schedule(config: OptimizerConfig) -> Callable[[chex.Numeric], jax.Array]:
    """``step -> lr(step)`` (float32, jit-safe) for ``config`` (formula in the module docstring).

    >>> lr = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, schedule="cosine",
    ...                                             warmup_steps=2, total_steps=6))
    >>> [round(float(lr(s)), 4) for s in range(8)]
    [0.5, 1.0, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    peak = float(config.learning_rate)
    warmup = int(config.warmup_steps)
    floor = peak * float(config.min_lr_ratio)
    decay_steps = max((config.total_steps or 0) - warmup, 1)

    def schedule(step: chex.Numeric) -> jax.Array:
        s = jnp.asarray(step, jnp.float32)
        warm = peak * (s + 1.0) / max(warmup, 1)
        if config.schedule == "constant":
            after = jnp.full_like(s, peak)
        else:
            progress = jnp.clip((s - warmup) / decay_steps, 0.0, 1.0)
            after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(s < warmup, warm, after)

    return schedule


def decay_mask(params: chex.ArrayTree) -> chex.ArrayTree:
    """``True`` for parameters that get weight decay: arrays of rank >= 2.

    >>> decay_mask({"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)})
    {'bias': False, 'kernel': True}
    """
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm -> adamw(schedule)`` for ``config``.

    The optax step count inside the state counts APPLIED updates, so when the train step skips a
    non-finite update (keeping the old state) the schedule does not advance.

    >>> tx = make_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.0))
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.array([3.0, -4.0])}, tx.init(params), params)
    >>> [round(float(u), 4) for u in updates["w"]]   # Adam's first step: -lr * sign(g)
    [-0.1, 0.1]
    """
    adamw = optax.adamw(
        learning_rate_schedule(config),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=decay_mask,
    )
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
