"""Building a run's parts from its typed config: tokenizer, model, per-algorithm train configs, checks.

Each function takes a section of :class:`rljax.run.config.RunConfig` (already parsed and
validated) and returns a ready object; errors that need several parts at once (echo without
merging, opsd tasks without demonstrations) are raised here, before anything runs.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax.numpy as jnp
from flax import nnx

from rljax.algorithms import Algorithm, AlgorithmConfig
from rljax.chat import toy_tokenizer
from rljax.core import off_policy
from rljax.core.losses import get_policy_loss
from rljax.core.objective import ObjectiveConfig, old_policy_readers
from rljax.extras import require
from rljax.models import Decoder, ModelConfig, from_gguf, from_pretrained, gguf_tokenizer, is_gguf_path
from rljax.models.gguf_io import load_gguf_config
from rljax.models.hf_io import load_config
from rljax.run.config import ModelSection, ObjectiveSection, RunConfig, TokenizerSection
from rljax.run.tasks import EnvTasks

__all__ = [
    "DTYPE_OF",
    "build_model",
    "build_tokenizer",
    "check_extras",
    "check_objective",
    "check_run",
    "model_config",
    "objective_config",
    "old_logprobs_choice",
    "process_batch",
    "required_extras",
]

#: config.model.param_dtype / compute_dtype / engine.dtype -> jnp dtype (the dtypes a run accepts).
DTYPE_OF = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def required_extras(cfg: RunConfig) -> list[tuple[str, str]]:
    """``(extra, config key that needs it)`` for every optional part the run's config uses."""
    out = []
    for name, env in cfg.envs.items():
        key = f"config.envs.{name}"
        if env.verifiers:
            out.append(("verifiers", f"{key}.verifiers"))
        elif env.agent or env.agent_command:
            out.append(("gateway", f"{key}.agent" if env.agent else f"{key}.agent_command"))
        kind = (env.env or name).partition(":")[0]
        if kind in ("skyrl_gym", "reasoning_gym"):
            out.append((kind, f"{key}.env"))
    out += [(sink, "config.report.sinks") for sink in cfg.report.sinks if sink in ("wandb", "mlflow")]
    return out


def check_extras(cfg: RunConfig) -> None:
    """Fails before anything runs when the config uses a part whose pip extra is not installed
    (:class:`rljax.extras.MissingExtraError`, one line naming the extra)."""
    for extra, key in required_extras(cfg):
        require(extra, key)


def build_tokenizer(cfg: TokenizerSection) -> Any:
    """``"toy:<family>"`` (a byte-level toy tokenizer built in code), a ``.gguf`` file (its tokenizer
    and chat template, :func:`rljax.models.gguf_tokenizer.gguf_tokenizer`) or an HF tokenizer path."""
    if cfg.name.startswith("toy:"):
        return toy_tokenizer(cfg.name[4:])
    if is_gguf_path(cfg.name):
        return gguf_tokenizer(cfg.name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.name)


def build_model(cfg: ModelSection, *, vocab_size: int, seed: int) -> nnx.Module:
    """A Decoder from ``cfg.hf_path`` (an HF safetensors directory or a ``.gguf`` file, dequantized by
    :func:`rljax.models.gguf_io.from_gguf`) or a fresh one of ``cfg.init``.

    Parameters are held in ``cfg.param_dtype`` whatever the checkpoint stores (a bfloat16 checkpoint
    is upcast to float32 master weights by default), activations computed in ``cfg.compute_dtype``.
    """
    precision = None if cfg.matmul_precision == "default" else cfg.matmul_precision
    kw = dict(dtype=DTYPE_OF[cfg.compute_dtype], param_dtype=DTYPE_OF[cfg.param_dtype], remat=cfg.remat,
              attention=cfg.attention, context_attention=cfg.context_attention,
              precision=precision)  # fmt: skip
    if cfg.hf_path:
        return (from_gguf if is_gguf_path(cfg.hf_path) else from_pretrained)(cfg.hf_path, **kw)
    return Decoder(model_config(cfg, vocab_size=vocab_size), rngs=nnx.Rngs(seed), **kw)


def model_config(cfg: ModelSection, *, vocab_size: int) -> ModelConfig:
    """The :class:`~rljax.models.ModelConfig` of the policy :func:`build_model` builds, without any
    weight: ``cfg.hf_path``'s (its ``config.json``, or a ``.gguf`` file's metadata) or ``cfg.init``'s
    (``vocab_size`` 0 = the tokenizer's ``vocab_size``). Errors name the config key."""
    if cfg.hf_path:
        path = pathlib.Path(cfg.hf_path)
        if not path.exists():
            raise ValueError(f"config.model.hf_path: no such file or directory {cfg.hf_path!r}")
        try:
            return load_gguf_config(path) if is_gguf_path(path) else load_config(path)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(
                f"config.model.hf_path: cannot read the model config of {cfg.hf_path!r}: {e}"
            ) from None
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
    return mcfg


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
        off_policy=dataclasses.asdict(cfg.off_policy) if off_policy.is_enabled(cfg.off_policy) else None,
        entropy_coef=cfg.entropy_coef,
        components=tuple(algorithm.components),  # skip the packer's all-zero streams of other components
        kl_coef=cfg.kl_loss_coef if "rl" in algorithm.components else 0.0,
        kl_kind=cfg.kl_estimator,
    )


def old_logprobs_choice(mode: str, objective: ObjectiveConfig, *, stale_versions: int = 0) -> tuple[str, str]:
    """``("recompute" | "inference", why)``: where an algorithm's old (proximal) logprobs come from
    under ``config.trainer.old_logprobs = mode`` (design §3.4). "auto" recomputes exactly when
    something in ``objective`` reads the old policy (:func:`rljax.core.objective.old_policy_readers`).

    ``stale_versions``: how many versions behind the trained policy a sample may be (0 in sync mode).
    Recomputed old logprobs take the sampler out of the policy loss's ratio; with stale samples and
    no truncated importance sampling (``objective.off_policy.tis_ratio_type``) nothing weighs the
    gap between the old policy and the sampler any more, which ``why`` then says (the ratio against
    the sampler, as "inference" takes it, weighed it implicitly).

    >>> old_logprobs_choice("auto", ObjectiveConfig(policy_loss="ppo_clip", components=("rl",)))
    ('recompute', "auto: the old policy is read by policy loss 'ppo_clip' (its ratio and clip)")
    >>> old_logprobs_choice("auto", ObjectiveConfig(components=("rl",)))[1]
    "auto: nothing reads the old policy (policy loss 'dppo' compares with the sampler by design)"
    """
    if mode != "auto":
        choice, why = mode, "trainer.old_logprobs"
    else:
        choice, why = _auto_old_logprobs(objective)
    tis = off_policy.resolve_config(objective.off_policy)["tis_ratio_type"]
    if choice == "recompute" and stale_versions > 0 and "rl" in objective.components and tis is None:
        why += (
            f"; samples may be {stale_versions} version(s) stale and no importance weight corrects old vs "
            "sampler (objective.off_policy.tis_ratio_type is unset): set it, e.g. 'token' (design §3.4)"
        )
    return choice, why


def _auto_old_logprobs(objective: ObjectiveConfig) -> tuple[str, str]:
    readers = old_policy_readers(objective)
    if readers:
        return "recompute", f"auto: the old policy is read by {', '.join(readers)}"
    if "rl" not in objective.components:
        return "inference", "auto: no policy-gradient term"
    return "inference", (
        f"auto: nothing reads the old policy (policy loss {objective.policy_loss!r} compares with the "
        "sampler by design)"
    )


def check_objective(cfg: RunConfig, algorithms: AlgorithmConfig) -> None:
    """Objective rules that need the algorithms: a policy loss whose ratio is already taken against
    the sampler (dppo, rollout_is, cispo with ``behavior="inference"``) would apply the behaviour ratio
    twice with truncated importance sampling (SkyRL refuses the pair too); top-k / top-p sampling on an
    engine that does not report the support it drew from (vLLM) cannot be scored on that support, so
    an objective that compares train and sampler logprobs (rl, ref_kl) refuses it."""
    r = cfg.rollout
    truncated = r.top_p < 1.0 or r.top_k is not None
    compared = [a.name for a in algorithms.algorithms if {"rl", "ref_kl"} & set(a.components)]
    if truncated and cfg.engine.kind == "vllm" and compared:
        key = "top_p" if r.top_p < 1.0 else "top_k"
        raise ValueError(
            f"config.rollout.{key}: {getattr(r, key)!r} samples from a truncated distribution, and vLLM "
            "does not report which tokens it kept, so the trainer cannot score each token on the support "
            f"it was drawn from (every ratio of {compared} would carry the kept mass as a bias): use "
            "top_p=1.0 and top_k=None with vLLM, or the embedded sampler (engine.kind='embedded'), which "
            "records the support and trains on it exactly"
        )
    tis = cfg.objective.off_policy.tis_ratio_type
    if tis is None:
        return
    for a in algorithms.algorithms:
        if "rl" not in a.components:
            continue
        loss = get_policy_loss(a.policy_loss or "dppo")
        if "inference_logp" in loss.inputs_read(dict(a.policy_loss_kwargs)):
            raise ValueError(
                f"config.objective.off_policy.tis_ratio_type: {tis!r} multiplies the loss by old / rollout, "
                f"but algorithm {a.name!r}'s policy loss {a.policy_loss or 'dppo'!r} already weighs each "
                "token by the ratio to the sampler's logprobs: the behaviour ratio would count twice. "
                "Drop tis_ratio_type, or use a loss whose ratio is against the old policy (ppo_clip, "
                "gspo, cispo with behavior='old')"
            )


def process_batch(prompts_per_step: int, process_count: int) -> int:
    """``B_p``: the groups each process's ``fully_async`` stream gives a step (:mod:`rljax.run.streaming`).

    Every process trains the same batch, gathered from equal shares, so the count must divide.

    >>> process_batch(8, 2)
    4
    >>> process_batch(6, 4)
    Traceback (most recent call last):
    ...
    ValueError: config.trainer.mode='fully_async' with 4 processes ... prompts_per_step=6 does not ...
    """
    if prompts_per_step % process_count:
        multiple = -(-prompts_per_step // process_count) * process_count
        raise ValueError(
            f"config.trainer.mode='fully_async' with {process_count} processes takes prompts_per_step / "
            f"{process_count} groups from each process's stream per step; prompts_per_step="
            f"{prompts_per_step} does not divide by {process_count}: use a multiple of {process_count} "
            f"(e.g. {multiple})"
        )
    return prompts_per_step // process_count


def check_run(
    cfg: RunConfig,
    *,
    algorithms: AlgorithmConfig,
    model_config: Any,
    env_tasks: EnvTasks | None,
    renderer: Any,
    process_count: int = 1,
    device_count: int = 1,
) -> None:
    """The rules between the run's parts, in one place (each a ``ValueError`` saying what to change).

    The config's own rules (every section, and rules between keys) are checked when it is parsed
    (:func:`rljax.run.config.parse_run_config`) and the algorithms' when they are validated
    (:func:`rljax.algorithms.validate_algorithm_config`); these need the built parts: the model
    (MoE router replay), the envs and their tasks (echo needs merging; opsd needs demonstrations and
    a renderer that can place them; a step's prompts must be distinct tasks), the algorithms
    (dynamic sampling needs group-relative ones) and the processes (a multi-process run needs a
    mesh over all of them; dynamic sampling runs in one process; a fully_async step takes equal
    shares from every process's stream). ``env_tasks`` None: a run built without rollouts (export),
    whose env rules do not apply.
    """
    check_objective(cfg, algorithms)
    if cfg.model.router_replay != "off" and not model_config.moe_layers:
        raise ValueError(
            f"config.model.router_replay={cfg.model.router_replay!r} replays MoE routing, but the "
            f"model ({model_config.model_type}) has no MoE layers; set it to 'off'"
        )
    if process_count > 1 and not cfg.uses_mesh:
        n = device_count
        raise ValueError(
            f"this run has {process_count} processes ({n} devices in all) but config.mesh is one "
            f"device; set config.mesh to span all {n} devices (e.g. --config.mesh.data={n})"
        )
    if env_tasks is None:
        return
    t = cfg.trainer
    if t.mode == "fully_async" and process_count > 1:
        process_batch(t.prompts_per_step, process_count)
    if t.dynamic_sampling.max_rounds > 0:
        if process_count > 1:
            raise ValueError(
                "config.trainer.dynamic_sampling is not supported with several processes yet (its extra "
                "rounds depend on the whole step's groups); set max_rounds=0"
            )
        not_grouped = [a.name for a in algorithms.algorithms if not a.group_relative]
        if not_grouped:
            raise ValueError(
                "config.trainer.dynamic_sampling keeps groups whose rewards vary (DAPO), which only "
                f"group-relative rl algorithms need; {not_grouped} are not: set max_rounds=0"
            )
    if t.prompts_per_step > len(env_tasks.train):
        raise ValueError(
            f"config.trainer.prompts_per_step={t.prompts_per_step} exceeds the {len(env_tasks.train)} "
            "train tasks of config.envs: one step cannot draw that many distinct prompts"
        )
    for env in env_tasks.factories:
        a = algorithms.for_env(env)
        if a.observation_ce and not t.merge:
            raise ValueError(
                f"algorithm {a.name!r} (env {env!r}) trains observation tokens (echo), which are the "
                "tokens between merged turns; set trainer.merge=True"
            )
        if a.needs_demonstrations:
            tasks = [task for task in env_tasks.train if task.env == env]
            if not any(task.demonstration for task in tasks):
                raise ValueError(
                    f"algorithm {a.name!r} (env {env!r}) conditions on Task.demonstration, but none of "
                    f"the {len(tasks)} train tasks of env {env!r} has one; pass tasks with "
                    "demonstrations (Trainer(tasks=...)) or use an environment whose tasks carry them"
                )
    if algorithms.needs_demonstrations:  # a renderer that cannot place the hint fails now
        renderer.demonstration_hint(
            next(task.demonstration for task in env_tasks.train if task.demonstration)
        )
