"""Building a run's parts from its typed config: tokenizer, model, per-algorithm train configs, checks.

Each function takes a section of :class:`rljax.train.run_config.RunConfig` (already parsed and
validated) and returns a ready object; errors that need several parts at once (echo without
merging, opsd tasks without demonstrations) are raised here, before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from rljax.algorithms import Algorithm, AlgorithmConfig
from rljax.chat import toy_tokenizer
from rljax.core.objective import ObjectiveConfig
from rljax.models import Decoder, ModelConfig, from_pretrained
from rljax.train.run_config import ModelSection, ObjectiveSection, TokenizerSection
from rljax.train.tasks import EnvTasks

__all__ = ["DTYPE_OF", "build_model", "build_tokenizer", "check_algorithm_needs", "objective_config"]

#: config.model.param_dtype / compute_dtype / engine.dtype -> jnp dtype (the dtypes a run accepts).
DTYPE_OF = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_tokenizer(cfg: TokenizerSection) -> Any:
    """``"toy:<family>"`` (a byte-level toy tokenizer built in code) or an HF tokenizer path."""
    if cfg.name.startswith("toy:"):
        return toy_tokenizer(cfg.name[4:])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.name)


def build_model(cfg: ModelSection, *, vocab_size: int, seed: int) -> nnx.Module:
    """A Decoder from ``cfg.hf_path`` (HF safetensors) or a fresh one of ``cfg.init``.

    Parameters are held in ``cfg.param_dtype`` whatever the checkpoint stores (a bfloat16 checkpoint
    is upcast to float32 master weights by default), activations computed in ``cfg.compute_dtype``.
    """
    kw = dict(dtype=DTYPE_OF[cfg.compute_dtype], param_dtype=DTYPE_OF[cfg.param_dtype], remat=cfg.remat)
    if cfg.hf_path:
        return from_pretrained(cfg.hf_path, **kw)
    fields = dict(cfg.init)
    if not fields.get("vocab_size"):
        fields["vocab_size"] = int(vocab_size)
    try:
        mcfg = ModelConfig(**fields)
    except TypeError as e:
        raise ValueError(f"config.model.init has a field ModelConfig does not know: {e}") from None
    if mcfg.vocab_size < vocab_size:
        raise ValueError(
            f"config.model.init.vocab_size={mcfg.vocab_size} is smaller than the tokenizer's {vocab_size} ids"
        )
    return Decoder(mcfg, rngs=nnx.Rngs(seed), **kw)


def objective_config(
    algorithm: Algorithm, cfg: ObjectiveSection, *, prompts_per_step: int
) -> ObjectiveConfig:
    """The objective that trains ``algorithm``'s samples (its components, loss and the run's reduction).

    ``prompts_per_step`` bounds the dense prompt-group ids of any mini-batch of one RL step: the
    static ``num_groups`` that the ``prompt_mean`` reduction segments over."""
    if not algorithm.step_wise:
        raise ValueError(
            f"algorithm {algorithm.name!r} is not step-wise (step_wise=False); the trainer trains one sample "
            "per turn (merged): set step_wise=True"
        )
    return ObjectiveConfig(
        policy_loss=algorithm.policy_loss or "dppo",  # unused unless the rl component is on
        policy_loss_kwargs=dict(algorithm.policy_loss_kwargs),
        reduction=cfg.reduction,
        max_len=cfg.max_len,
        num_groups=prompts_per_step if cfg.reduction == "prompt_mean" else None,
        off_policy=dict(cfg.off_policy) or None,
        entropy_coef=cfg.entropy_coef,
        components=tuple(algorithm.components),  # skip the packer's all-zero streams of other components
    )


def check_algorithm_needs(
    algorithms: AlgorithmConfig,
    env_tasks: EnvTasks,
    *,
    merge: bool,
    hint: Callable[[str | None], Any],
) -> None:
    """What each env's algorithm needs from the rest of the run (raises ``ValueError`` otherwise).

    Echo trains the tokens between merged turns (needs ``trainer.merge``); opsd conditions on
    ``Task.demonstration`` (needs tasks that carry one, and a renderer that can place the hint).
    """
    for env in env_tasks.factories:
        a = algorithms.for_env(env)
        if a.observation_ce and not merge:
            raise ValueError(
                f"algorithm {a.name!r} (env {env!r}) trains observation tokens (echo), which are the "
                "tokens between merged turns; set trainer.merge=True"
            )
        if a.needs_demonstrations:
            tasks = [t for t in env_tasks.train if t.env == env]
            if not any(t.demonstration for t in tasks):
                raise ValueError(
                    f"algorithm {a.name!r} (env {env!r}) conditions on Task.demonstration, but none of "
                    f"the {len(tasks)} train tasks of env {env!r} has one; pass tasks with "
                    "demonstrations (Trainer(tasks=...)) or use an environment whose tasks carry them"
                )
    if algorithms.needs_demonstrations:  # a renderer that cannot place the hint fails now
        hint(next(t.demonstration for t in env_tasks.train if t.demonstration))
