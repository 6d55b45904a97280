"""The run configuration: typed, frozen, parsed once from an ml_collections config.

:func:`parse_run_config` turns the ``ConfigDict`` of a recipe (``configs/*.py``, overridden by
``--config.<key>=<value>`` flags) into a :class:`RunConfig` of frozen dataclasses. It is the ONE
place that knows the keys, their types and their defaults: a missing key takes the default of its
dataclass field below, and every mistake (an unknown key, a wrong type, a value out of range, a
key no component reads) is a ``ValueError`` naming the key's path, e.g. ``config.trainer.seq_len:
expected an int >= 1, got 'long'``. :func:`default_config` renders the same defaults as a
``ConfigDict``; ``configs/default.py`` is exactly that, and the other recipes start from it.

The trainer's parts read only these typed values, never the raw config.

The sections of the run's components ARE those components' own typed configs, each validating
itself: ``rollout`` is a :class:`rljax.rollout.RolloutConfig`, ``optimizer`` an
:class:`rljax.training.optimizer.OptimizerConfig`, ``warmstart`` a
:class:`rljax.training.warmstart.WarmStartConfig`,
``critic`` a :class:`rljax.training.critic.CriticSection` (a ``CriticConfig``), ``lora`` a
:class:`rljax.models.lora.LoRAConfig` (or None: full training), ``mesh`` a
:class:`rljax.training.sharding.MeshConfig`, ``engine.sync`` a :class:`rljax.inference.vllm.SyncConfig`;
their class defaults are the run's defaults (one default per knob). Cross-field rules are in
:func:`_validate`.

>>> cfg = parse_run_config({"trainer": {"num_steps": 3}})
>>> cfg.trainer.num_steps, cfg.trainer.seq_len, cfg.rollout.group_size
(3, 384, 8)
>>> try:
...     parse_run_config({"trainer": {"num_stpes": 3}})
... except ValueError as e:
...     print(str(e)[:64])
config.trainer.num_stpes: unknown key; did you mean 'num_steps'?
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from rljax.core import off_policy
from rljax.core.losses import KL_KINDS
from rljax.core.objective import REDUCTIONS
from rljax.data.filters import make_filter
from rljax.envs.loader import split_import_string
from rljax.envs.registry import LIBRARIES
from rljax.inference.frozen import frozen_models_from_config
from rljax.inference.vllm.launcher import ServerConfig
from rljax.inference.vllm.weight_sync import SyncConfig
from rljax.models.attention_backends import ATTENTION_BACKENDS
from rljax.models.context import CONTEXT_COLLECTIVES
from rljax.models.lora import LoRAConfig
from rljax.report.config import ReportConfig
from rljax.rollout import RolloutConfig
from rljax.training.critic import CriticSection
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import MeshConfig
from rljax.training.warmstart import WarmStartConfig

__all__ = [
    "CLIENT_KEYS_SET_ELSEWHERE",
    "DTYPES",
    "DynamicSamplingSection",
    "ENGINE_DTYPES",
    "EngineSection",
    "EnvSection",
    "EvalSection",
    "MATMUL_PRECISIONS",
    "ModelSection",
    "OLD_LOGPROBS",
    "ObjectiveSection",
    "REMAT_POLICIES",
    "RESULT_NEUTRAL_KEYS",
    "ROUTER_REPLAY",
    "RendererSection",
    "RunConfig",
    "SYNC_ON_MISMATCH",
    "TokenizerSection",
    "TrainerSection",
    "client_keys",
    "config_differences",
    "config_record",
    "default_config",
    "device_list",
    "did_you_mean",
    "parse_run_config",
]

#: Model dtypes a run accepts (compute and parameter storage).
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
#: Weight dtypes an engine can serve: a dtype, or "auto" (= model.compute_dtype).
ENGINE_DTYPES: tuple[str, ...] = ("auto", *DTYPES)
#: Remat policies of ``model.remat`` (see :class:`rljax.models.Decoder`).
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots_saveable")
#: ``model.router_replay`` values (MoE models).
ROUTER_REPLAY: tuple[str, ...] = ("off", "r3")
#: ``config.model.matmul_precision`` values (``jax.lax.Precision`` names; "default" = the platform's).
MATMUL_PRECISIONS: tuple[str, ...] = ("default", "high", "highest")
#: What a failed weight-sync verification does (:class:`rljax.inference.vllm.SyncConfig`).
SYNC_ON_MISMATCH: tuple[str, ...] = ("raise", "retry", "warn")
MODES: tuple[str, ...] = ("sync", "async", "fully_async")
#: ``config.trainer.old_logprobs`` values (design §3.4).
OLD_LOGPROBS: tuple[str, ...] = ("auto", "recompute", "inference")
ENGINE_KINDS: tuple[str, ...] = ("embedded", "vllm")
DATASET_KEYS: tuple[str, ...] = ("train", "eval", "format", "eval_fraction")


def _field(default: Any) -> Any:
    """A dataclass field whose default is a (copied) mutable value."""
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: _copy(default))
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: default)
    return dataclasses.field(default=default)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------------
# Sections (defaults = the default recipe: a tiny Qwen3-shaped model on the multi-turn lookup task)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenizerSection:
    """The tokenizer.

    Attributes:
      name: ``"toy:<family>"`` (a byte-level toy tokenizer built in code) or an HF tokenizer path.
    """

    name: str = "toy:chatml"


@dataclasses.dataclass(frozen=True)
class RendererSection:
    """The renderer: the chat template as a token stream (:func:`rljax.chat.make_renderer`).

    Attributes:
      name: a built-in name (``chatml``, ``qwen2.5``, ``qwen3``, ``llama3``, ``generic``) or
        ``"my_pkg.chat:MyRenderer"`` (a Renderer subclass or factory, called with the tokenizer).
      kwargs: keyword arguments of the renderer.
    """

    name: str = "chatml"
    kwargs: dict = _field({})


DEFAULT_INIT = dict(
    model_type="qwen3",
    vocab_size=0,  # 0 = the tokenizer's size
    hidden_size=64,
    intermediate_size=192,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy model: where it comes from, its precision, memory and attention kernels.

    Attributes:
      hf_path: an HF checkpoint directory to load; empty = a fresh model of ``init``.
      param_dtype: dtype of the master weights, their gradients and the optimizer state, one of
        :data:`DTYPES` (float32 by default, whatever the checkpoint's dtype: a bf16 checkpoint is upcast
        on load).
      compute_dtype: dtype of activations and matmuls, one of :data:`DTYPES` (logits, log-probs, ratios
        and every loss stay float32).
      remat: activation recomputation of each block in the backward pass, one of
        :data:`REMAT_POLICIES`: ``none``, ``full`` (save only block inputs), ``dots_saveable`` (also
        keep matmul outputs without batch dims).
      router_replay: MoE models: ``"r3"`` replays the experts the sampler routed every token to in the
        train forward (gates recomputed from the current router); ``"off"`` routes afresh. The share of
        tokens whose trainer top-k differs from the sampler's (``routing/flip_fraction``) is logged
        either way.
      attention: the training forward's attention kernel: ``auto`` (cuDNN's ragged kernel on GPU with
        bfloat16 compute, splash on TPU, XLA on CPU), ``xla``, ``cudnn``, ``cudnn_ragged`` (cuDNN's packed
        variable-length kernel) or ``splash`` (:mod:`rljax.models.attention_backends`).
      context_attention: how attention crosses ``mesh.context`` when it is > 1: ``all_gather`` (each
        device gathers the row's keys/values; the cuDNN kernels apply) or ``ring`` (key/value chunks
        passed around the devices, partial softmaxes merged; XLA blocks), see :mod:`rljax.models.context`.
      matmul_precision: the precision of every matmul of the model (trainer and embedded sampler), one
        of :data:`MATMUL_PRECISIONS`; ``"default"`` lets the platform choose (on NVIDIA GPUs float32
        matmuls then run as TF32, and the sampler's float32 logprobs differ from the trainer's by ~1e-4
        instead of ~1e-6); ``"highest"`` keeps float32 matmuls float32.
      init: :class:`rljax.models.config.ModelConfig` fields of a fresh model (``vocab_size`` 0 = the
        tokenizer's size).
    """

    hf_path: str = ""
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    router_replay: str = "off"
    attention: str = "auto"
    context_attention: str = "all_gather"
    matmul_precision: str = "default"
    init: dict = _field(DEFAULT_INIT)


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """One environment of the run: ``env`` is its kind (default: the section's name; e.g. "lookup",
    "skyrl_gym:gsm8k", "reasoning_gym:leg_counting"), ``kwargs`` go to its constructor.

    Your own env class: ``env = "my_pkg.envs:MyEnv"`` (a class, or a factory called with ``kwargs``),
    or an id given to :func:`rljax.envs.register` or declared as an entry point of the group
    ``rljax.envs`` by an installed package (:mod:`rljax.envs.registry`).

    Tasks come from the env's task maker (``task_kwargs``; train split seeded by ``seed``, eval split
    by ``seed + 1``; ``num_train_tasks`` default 256, ``num_eval_tasks`` default 0): ``tasks =
    "module:function"`` (``function(num_tasks, *, seed, split, **task_kwargs) -> list[Task]``), else
    the env's own (a built-in's, the ``tasks=`` of its registration, its ``make_tasks`` attribute); or, when
    ``dataset`` is set, from dataset files (:func:`rljax.envs.load_dataset_tasks`):
    ``dataset=dict(train=PATH, eval=PATH, format="auto", eval_fraction=None)`` (``eval`` a separate
    file, or ``eval_fraction`` a held-out share of ``train``); then ``num_*_tasks`` (if set) keep the
    first N rows of each split.

    An agent instead of an environment class (:mod:`rljax.gateway`): ``agent = "module:function"``
    (``async def function(task, client, **kwargs)`` with an ``openai.AsyncOpenAI`` bound to its
    rollout; ``kwargs`` are this section's ``kwargs``) or ``agent_command = "..."`` (an external
    process with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set per rollout). Its calls go through the
    run's gateway; its tasks come from ``dataset`` or from the task maker ``env`` names (e.g.
    ``env="lookup"``), whose env class the agent does not use (only the warm start does).

    A verifiers environment (:mod:`rljax.agents.verifiers`, the ``verifiers`` extra):
    ``verifiers = "<environment id>"`` runs its episodes as the agent (its rubric's reward);
    ``env_args`` is verifiers' env config (its ``[env]`` block: ``taskset`` fields, ``agent.runtime``,
    ...); train tasks are its taskset's, eval tasks those of the taskset with ``eval_env_args``
    (taskset fields, e.g. ``{"split": "test"}``) applied; ``num_*_tasks`` keep the first N.

    Attributes:
      env: the environment's kind (default: the section's name): a built-in, a library env
        (``skyrl_gym:<id>``, ``reasoning_gym:<id>``), ``"module:attr"`` or a registered id.
      kwargs: keyword arguments of the environment's constructor (of the agent function for ``agent``).
      tasks: ``"module:function"``, the task maker (else the env's own).
      task_kwargs: keyword arguments of the task maker.
      num_train_tasks: train tasks to make (default 256), or the first N rows of a dataset.
      num_eval_tasks: held-out tasks to make (default 0), or the first N rows of a dataset.
      dataset: dataset files of the tasks: ``dict(train=PATH, eval=PATH, format="auto",
        eval_fraction=None)``.
      agent: ``"module:function"``, an agent function that plays the episodes through the gateway.
      agent_command: an external agent process run per rollout (with ``OPENAI_BASE_URL`` /
        ``OPENAI_API_KEY`` set).
      verifiers: a verifiers environment id, run as the agent.
      env_args: the verifiers environment's config (its ``[env]`` block).
      eval_env_args: taskset fields applied for the verifiers environment's eval tasks.
    """

    env: str = ""
    kwargs: dict = _field({})
    tasks: str = ""
    task_kwargs: dict = _field({})
    num_train_tasks: int | None = None
    num_eval_tasks: int | None = None
    dataset: dict = _field({})
    agent: str = ""
    agent_command: str = ""
    verifiers: str = ""
    env_args: dict = _field({})
    eval_env_args: dict = _field({})


DEFAULT_ENVS = {
    "lookup": dict(
        env="lookup",
        dataset={},
        # compact: no tool schema, no system prompt (the warm start teaches the format), small credit
        kwargs=dict(compact=True, system_prompt="", credit=(0.02, 0.05, 0.1)),
        task_kwargs={},
        num_train_tasks=2048,
        num_eval_tasks=32,
    )
}


@dataclasses.dataclass(frozen=True)
class EngineSection:
    """The policy's inference engine: the in-process JAX sampler or vLLM servers.

    Attributes:
      kind: ``"embedded"`` (the in-process JAX sampler) or ``"vllm"``.
      dtype: the dtype weights are served in (cast from the master weights on every sync); ``"auto"``
        = ``model.compute_dtype``. A launched vLLM server gets it as ``--dtype`` unless ``server.dtype``
        is set.
      max_batch_size: embedded: most requests per jitted sampling call.
      min_batch_bucket: embedded: smallest number of rows of a sampling call (fewer shapes to compile).
      batch_wait_ms: embedded: how long the first queued request waits for others to join its batch.
      min_prompt_bucket: embedded: smallest padded prompt length (buckets are powers of two above it).
      min_new_tokens_bucket: embedded: smallest loop bound for new tokens.
      max_model_len: embedded: longest prompt + completion (None = the model's
        ``max_position_embeddings``).
      prefix_sharing: embedded: prefill a prompt prefix shared by requests of one batch once (a
        GRPO group's samples; turns whose histories start alike) and start each from a copy of its
        KV cache; the same tokens and logprobs (within float32 rounding) as without it.
      urls: vllm: servers to use (started by you on the same initial weights).
      num_servers: vllm: servers to launch locally when ``urls`` is empty.
      python: vllm: the Python of the vLLM virtual environment for launched servers (empty: found
        automatically).
      server: vllm: :class:`rljax.inference.vllm.ServerConfig` fields of launched servers.
      client: vllm: keyword arguments of :class:`rljax.inference.vllm.VLLMClient`.
      sync: vllm: the weight sync (:class:`rljax.inference.vllm.SyncConfig` fields: probe length and
        seed, ``atol`` override of the per-dtype tolerance, ``on_mismatch`` = "raise" | "retry" |
        "warn").
      lora_sync: LoRA runs on vLLM: ``"adapter"`` loads each version's adapter at run time
        (``--enable-lora`` is added to launched servers), ``"merged"`` syncs full merged weights.
      supervise: vllm: watch the servers (:mod:`rljax.inference.vllm.supervisor`): a launched server
        that exits or stops answering is restarted with the current weights (verified), one given by
        URL is re-checked on a backoff; weight syncs skip servers out of service.
      health_interval_s: vllm: seconds between ``GET /health`` checks of each server.
      health_timeout_s: vllm: a health check not answered within this fails; ``health_failures``
        failures in a row take the server out of service (an exited process at once).
      health_failures: vllm: see ``health_timeout_s``.
      stall_timeout_s: vllm: per-token progress deadline of a request (no token for this long: it
        goes to another server); keep it above the longest prefill plus queueing.
      all_down_timeout_s: vllm: with no server in service for this long the run stops with one
        error naming the servers and the end of their logs.
      max_restarts: vllm: restarts of one launched server over the run.
      in_flight_updates: whether a weight update reaches sequences already decoding (their
        completions then carry several version spans): ``"off"`` (they finish on the weights they
        started with), ``"recompute"`` (they switch at the next decode segment, their KV cache
        recomputed with the new weights: every token exactly from its version; embedded sampler and
        vLLM) or ``"keep"`` (vLLM only: pause in keep mode with the old KV cache kept, PipelineRL's
        behaviour; tokens after the switch attend to old-weights keys and values). Meant for
        ``trainer.mode="fully_async"``. LoRA with ``lora_sync="adapter"`` on vLLM takes ``"off"``
        only: a request keeps the adapter it names, so each turn is sampled by one adapter version.
      server_devices: vllm, launched servers: the GPUs of each server, one entry per server (e.g.
        ``("1",)`` or ``("4,5", "6,7")``: indices into the GPUs this process sees), given to it as
        ``CUDA_VISIBLE_DEVICES``; empty = every server sees the trainer's GPUs
        (:mod:`rljax.run.placement`).
      trainer_devices: the trainer's GPUs (``"0"``, ``"0,1,2,3"``; indices as above), set as JAX's
        ``jax_cuda_visible_devices`` by ``rljax train`` before JAX starts; empty = every GPU no
        launched server holds (all of them without ``server_devices``).
      trainer_memory_fraction: the share of each GPU's memory JAX preallocates
        (``XLA_PYTHON_CLIENT_MEM_FRACTION``, set by ``rljax train`` before JAX starts); 0 = JAX's
        default (75%). Lower it when a vLLM server shares the trainer's GPU, so that
        ``server.gpu_memory_utilization`` of the GPU is still free when the server starts.
    """

    kind: str = "embedded"
    dtype: str = "auto"
    max_batch_size: int = 128
    min_batch_bucket: int = 8
    batch_wait_ms: float = 0.0
    min_prompt_bucket: int = 64
    min_new_tokens_bucket: int = 16
    max_model_len: int | None = None
    prefix_sharing: bool = True
    urls: tuple = ()
    num_servers: int = 1
    python: str = ""
    server: dict = _field({})
    client: dict = _field({})
    sync: SyncConfig = _field(SyncConfig())
    lora_sync: str = "adapter"
    supervise: bool = True
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0
    health_failures: int = 2
    stall_timeout_s: float = 120.0
    all_down_timeout_s: float = 600.0
    max_restarts: int = 5
    in_flight_updates: str = "off"
    server_devices: tuple = ()
    trainer_devices: str = ""
    trainer_memory_fraction: float = 0.0


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation.

    Attributes:
      group_size: samples per eval task.
      temperature: sampling temperature of the evaluation (0 = greedy; greedy saturates at 1.0 after
        the default warm start).
      pass_k: the k of the ``eval/pass@k`` metrics (default ``(1, group_size)``).
    """

    group_size: int = 1
    temperature: float = 1.0  # greedy (0.0) saturates at 1.0 after the default warm start
    pass_k: tuple = ()


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    """The objective's reduction, off-policy correction and extra terms (design §3.4, §3.5).

    Attributes:
      reduction: how per-token losses reduce to a scalar, one of
        :data:`rljax.core.objective.REDUCTIONS`.
      off_policy: the off-policy correction, SkyRL's keys and defaults
        (:func:`rljax.core.off_policy.resolve_config`); empty = none.
      entropy_coef: coefficient of the entropy bonus (0 = none).
      max_len: the constant of the ``seq_mean_token_sum_norm`` reduction (required for it).
      moe_aux_loss_coef: coefficient of the Switch load-balancing loss of MoE routers (0 = off; the
        metric is logged anyway).
      router_z_loss_coef: coefficient of the router z-loss of MoE routers (0 = off; the metric is logged
        anyway).
      kl_loss_coef: weight of a KL penalty to a frozen reference policy on the rl tokens, added to the
        loss (verl's and SkyRL's ``use_kl_loss`` with ``kl_loss_coef``; 0 = none). Logged as
        ``loss/kl_penalty``, ``ref_kl/reference_k1`` and ``ref_kl/reference_k3``.
      kl_estimator: the penalty's per-token estimator of ``KL(pi || pi_ref)``, one of ``k1``, ``k2``,
        ``k3`` (verl's ``low_var_kl``, the default) or ``abs`` (:func:`rljax.core.losses.kl`).
      kl_reference: the reference policy: ``""`` (default) = the policy's own weights when RL starts
        (after the warm start), held by the trainer and checkpointed with the run; or an HF checkpoint
        directory (full training only: a LoRA run's reference is its base with the initial adapter).
    """

    reduction: str = "token_mean"
    off_policy: dict = _field({})
    entropy_coef: float = 0.0
    max_len: int | None = None
    moe_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_reference: str = ""


@dataclasses.dataclass(frozen=True)
class DynamicSamplingSection:
    """DAPO dynamic sampling: resample until every prompt slot holds a group whose rewards differ.

    Attributes:
      max_rounds: most resampling rounds (0 = off).
      atol: a group is kept when its rewards spread more than this.
      strict: fail when the rounds run out (else train on what was kept).
    """

    max_rounds: int = 0
    atol: float = 0.0
    strict: bool = False


#: Values of ``config.trainer.on_save_error``.
ON_SAVE_ERROR = ("stop", "continue")
#: ``trainer.prefix_sharing``: "auto" packs samples that share a prompt prefix as prefix trees (design
#: §2.6) wherever that computes exactly what plain packing does; "off" never does.
PREFIX_SHARING = ("auto", "off")

DEFAULT_TABLE_KEYS = (
    "reward/mean",
    "loss",
    "grad_norm",
    "entropy",
    "policy_version/lag",
    "time/step_s",
    "eval/reward_mean",
)


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """The RL loop: steps, batches, packing, evaluation, checkpoints.

    Attributes:
      num_steps: RL steps to run (0: the warm start only, and a step-0 checkpoint).
      mode: ``"sync"``; ``"async"``: the rollout of step n+1 overlaps training of step n; or
        ``"fully_async"``: rollouts stream continuously and each step trains the next
        ``prompts_per_step`` complete prompt groups (:mod:`rljax.run.streaming`; several processes:
        a stream each, ``prompts_per_step / process count`` groups from each per step).
      max_off_policy_steps: async modes: how many policy versions a sample may be stale (fully_async:
        between the weights a group started on and the weights it trains against).
      prompts_per_step: prompt groups per RL step.
      mini_batch_prompts: prompt groups per mini-batch, a divisor of ``prompts_per_step`` (0 = one
        mini-batch).
      seq_len: tokens per packed row.
      truncate: drop the tail of (rare) over-long samples (counted in the pack metrics) instead of
        failing.
      merge: merge the turns of a trajectory whose prompts extend each other into one sample (design
        §2.5).
      old_logprobs: where the old (proximal) policy's logprobs of an RL step come from (design §3.4):
        ``"recompute"``: the trainer's own, from the weights at the start of the step (one forward
        without gradients over every mini-batch before the first update); ``"inference"``: the
        sampler's (then every off-policy correction that weighs old / rollout would be a no-op, and
        configuring one is an error); ``"auto"`` (default): recompute exactly when something in an
        algorithm's objective reads the old policy (a ratio-based correction, or a policy loss whose
        ratio is taken against the old policy: ppo_clip, dual_clip, gspo, sapo, cispo, ...), not for
        losses that compare with the sampler by design (dppo, rollout_is). The run prints what it
        chose, and why, when it starts.
      filters: sample filters, e.g. ``(dict(name="overlong", mode="enforce"), dict(name="gibberish"))``
        (:data:`rljax.data.filters.FILTERS`).
      dynamic_sampling: DAPO dynamic sampling (:class:`DynamicSamplingSection`).
      row_buckets: allowed numbers of packed rows (None: data-parallel size x powers of two), see
        :func:`rljax.data.pack.bucket_rows`.
      micro_batch_tokens: tokens per micro-batch, accumulated in one jitted scan (a multiple of
        ``seq_len``; 0 = no micro-batching).
      loss_only_logits: True (the default): the train step, the old-policy recompute and the KL
        reference's scoring project only the tokens that carry a loss (``loss_mask != 0``, the only
        ones the objective and its metrics read) through the vocabulary, gathered into a bucketed
        buffer (design §5); False: every packed token, prompts and tool outputs included. The same
        logprobs and gradients within float32 rounding either way; on is faster and needs less
        memory wherever tokens carry no loss (measured: docs/results.md).
      prefix_sharing: ``"auto"`` packs the samples of a mini-batch that share a prompt prefix (a GRPO
        group's prompt, turns whose prompts share a prefix without extending each other) as prefix
        trees, each shared token computed once (design §2.6), whenever the policy model computes
        tree rows exactly (logged at the start); ``"off"``: plain packing.
      eval_every: RL steps between held-out evaluations (and after the last step; 0 = never).
      checkpoint_every: RL steps between checkpoints (and after the last step; 0 = never).
      keep_checkpoints: checkpoints to keep, the latest ones (0 = all).
      table_keys: metrics of the printed table.
      save_rollouts_every: N: ``rollouts/step_<S>.jsonl`` and a sample table every N steps (0 = never).
      stall_timeout_s: the run watchdog (:mod:`rljax.run.watchdog`): when the run makes no progress
        (no rollout received, no step trained, no weight sync or checkpoint done) for this many
        seconds, it prints every thread's stack and the state of the engines, rollouts and envs, and
        exits with status 75 so a scheduler restarts it with ``--resume`` (0 = no watchdog). Cover
        the slowest legitimate phase: the first step's compilation, a whole rollout, a checkpoint.
      on_save_error: when writing a checkpoint fails (a full disk, an I/O error): ``"stop"`` ends
        the run with the error (``latest`` still names an intact older checkpoint), ``"continue"``
        logs it, counts it (``checkpoint/save_errors``) and trains on, saving again at the next
        checkpoint step.
    """

    num_steps: int = 120
    mode: str = "sync"
    max_off_policy_steps: int = 1
    prompts_per_step: int = 16
    mini_batch_prompts: int = 0
    seq_len: int = 384
    truncate: bool = True  # drop the tail of (rare) over-long samples; counted in pack metrics
    merge: bool = True
    old_logprobs: str = "auto"
    filters: tuple = ()  # e.g. (dict(name="overlong", mode="enforce"), dict(name="gibberish"))
    dynamic_sampling: DynamicSamplingSection = _field(DynamicSamplingSection())
    row_buckets: Any = None
    micro_batch_tokens: int = 0
    loss_only_logits: bool = True
    prefix_sharing: str = "auto"  # "auto": shared prompt prefixes packed as trees where exact; "off"
    eval_every: int = 10
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    table_keys: tuple = DEFAULT_TABLE_KEYS
    save_rollouts_every: int = 0  # N: rollouts/step_<S>.jsonl + a sample table every N steps (0 = never)
    stall_timeout_s: float = 1800.0  # the watchdog: no progress this long ends the run, status 75 (0 = off)
    on_save_error: str = "stop"  # a checkpoint write failed: "stop" the run, or "continue" without it


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run reads, typed and validated (see :mod:`rljax.run.config`).

    Attributes:
      seed: the seed of every random choice of the run (tasks, sampling, initialization, shuffles).
      tokenizer: the tokenizer (:class:`TokenizerSection`).
      renderer: the chat template (:class:`RendererSection`).
      model: the policy model (:class:`ModelSection`).
      envs: the environments, by name (each an :class:`EnvSection`).
      engine: the policy's inference engine (:class:`EngineSection`).
      rollout: the rollouts (:class:`rljax.rollout.RolloutConfig`; its algorithm fields are set by the
        run).
      eval: held-out evaluation (:class:`EvalSection`).
      algorithm: a registered algorithm name or a dict ``{"name": ..., <field overrides>}``
        (:mod:`rljax.algorithms`).
      env_algorithms: env name -> algorithm (same forms), for envs trained with another algorithm.
      frozen_models: frozen models by name (opd teachers, sft samplers): FrozenModelConfig fields.
      objective: the objective (:class:`ObjectiveSection`).
      optimizer: the optimizer (:class:`rljax.training.optimizer.OptimizerConfig`).
      warmstart: the supervised warm start on demonstrations
        (:class:`rljax.training.warmstart.WarmStartConfig`).
      critic: PPO's critic (:class:`rljax.training.critic.CriticSection`).
      lora: LoRA adapters (:class:`rljax.models.lora.LoRAConfig`); None or empty = full training.
      trainer: the RL loop (:class:`TrainerSection`).
      report: metric sinks: jsonl, tensorboard, wandb, mlflow (:class:`rljax.report.config.ReportConfig`).
      mesh: the trainer's device mesh (:class:`rljax.training.sharding.MeshConfig`; size 1 = one device).
    """

    seed: int = 0
    tokenizer: TokenizerSection = _field(TokenizerSection())
    renderer: RendererSection = _field(RendererSection())
    model: ModelSection = _field(ModelSection())
    envs: dict = _field(DEFAULT_ENVS)  # name -> EnvSection (parsed)
    engine: EngineSection = _field(EngineSection())
    rollout: RolloutConfig = _field(RolloutConfig())  # its algorithm fields are set by the run
    eval: EvalSection = _field(EvalSection())
    # a registered name or a dict {"name": ..., field overrides}; see rljax.algorithms
    algorithm: Any = "grpo"
    env_algorithms: dict = _field({})  # env name -> algorithm (same forms)
    frozen_models: dict = _field({})  # name -> FrozenModelConfig fields (opd teachers, sft samplers)
    objective: ObjectiveSection = _field(ObjectiveSection())
    optimizer: OptimizerConfig = _field(OptimizerConfig())
    warmstart: WarmStartConfig = _field(WarmStartConfig())
    critic: CriticSection = _field(CriticSection())
    lora: LoRAConfig | None = None  # None (or an empty mapping) = full training
    trainer: TrainerSection = _field(TrainerSection())
    report: ReportConfig = _field(ReportConfig())  # sinks: jsonl, tensorboard, wandb, mlflow
    mesh: MeshConfig = _field(MeshConfig())  # size 1 = no mesh (one device)

    @property
    def engine_dtype(self) -> str:
        """The dtype the policy engine serves: ``engine.dtype``, "auto" = ``model.compute_dtype``."""
        return self.model.compute_dtype if self.engine.dtype == "auto" else self.engine.dtype

    def optimizer_config(self, **overrides: Any) -> OptimizerConfig:
        """``optimizer`` with field ``overrides`` (validated as any OptimizerConfig is)."""
        return dataclasses.replace(self.optimizer, **overrides)

    def critic_optimizer_config(self) -> OptimizerConfig:
        """The run's optimizer with the critic's overrides (``critic.optimizer``, ``learning_rate``)."""
        lr = {} if self.critic.learning_rate is None else {"learning_rate": self.critic.learning_rate}
        return self.optimizer_config(**{**self.critic.optimizer, **lr})

    @property
    def uses_mesh(self) -> bool:
        """Whether the trainer runs on a device mesh (``mesh.size > 1``)."""
        return self.mesh.size > 1


# ------------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """ConfigDict / FieldReference / FrozenConfigDict -> plain Python values (recursively)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if hasattr(value, "get") and type(value).__name__ == "FieldReference":
        value = value.get()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


#: Filter fields a run sets itself (filter name -> (field, where its value comes from)).
_RUN_SET_FILTER_KEYS: dict[str, tuple[str, str]] = {
    "zero_variance": ("reward_mode", "each algorithm's reward_mode"),
    "staleness": ("trained_version", "the RL step being trained"),
}


def _fail(path: str, message: str) -> ValueError:
    return ValueError(f"{path}: {message}")


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked against the type ``hint`` of a section field (light conversions only)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        (inner,) = [a for a in args if a is not type(None)]
        if value is None and type(None) in args:
            return None
        if dataclasses.is_dataclass(inner) and isinstance(value, Mapping) and not value:
            return None  # an empty section of an optional component: off (e.g. lora={})
        return _coerce(value, inner, path)
    if origin is tuple:
        return _coerce(value, tuple, path)
    if origin in (dict, Mapping) or hint is Mapping:
        return _coerce(value, dict, path)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise _fail(
                path,
                f"expected a mapping of {sorted(f.name for f in dataclasses.fields(hint))}, got {value!r}",
            )
        return _parse_section(hint, value, path)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail(path, f"expected True or False, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"expected an int, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _fail(path, f"expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _fail(path, f"expected a string, got {value!r}")
        return value
    if hint is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise _fail(path, f"expected a list or tuple, got {value!r}")
        return tuple(value)
    if hint is dict:
        if not isinstance(value, Mapping):
            raise _fail(path, f"expected a mapping, got {value!r}")
        return dict(value)
    raise TypeError(f"{path}: no coercion for {hint!r}")  # a bug in this module, not in the config


#: Keys that were replaced, with what to write instead (an error, not a silent default).
RENAMED_KEYS: Mapping[str, Mapping[str, str]] = {
    "config.model": {
        "dtype": "was split into model.param_dtype (master weights + optimizer state, default float32) "
        "and model.compute_dtype (activations); e.g. compute_dtype='bfloat16' for bf16 compute",
    },
}


#: Fields of a component config that the run sets itself (never config keys).
RUN_SET_FIELDS: Mapping[type, tuple[str, ...]] = {
    RolloutConfig: ("algorithm", "env_algorithms"),  # from config.algorithm / config.env_algorithms
}


def section_fields(cls: type) -> list[str]:
    """The config keys of a section class: its dataclass fields less those the run sets."""
    run_set = RUN_SET_FIELDS.get(cls, ())
    return [f.name for f in dataclasses.fields(cls) if f.name not in run_set]


def _parse_section(cls: type, value: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = section_fields(cls)
    for key in value:
        if key in RENAMED_KEYS.get(path, {}):
            raise _fail(f"{path}.{key}", RENAMED_KEYS[path][key])
        if key in RUN_SET_FIELDS.get(cls, ()):
            raise _fail(f"{path}.{key}", "set by the run (config.algorithm / config.env_algorithms)")
        if key not in names:
            raise _fail(
                f"{path}.{key}", f"unknown key; {did_you_mean(key, names)}known keys of {path}: {names}"
            )
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}") for k, v in value.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # the component's own validation, with the key path
        field, sep, rest = str(e).partition(": ")
        if sep and field in names:  # "<field>: why" names its key
            raise _fail(f"{path}.{field}", rest) from None
        raise _fail(path, str(e)) from None


def did_you_mean(key: str, known: Any) -> str:
    """``"did you mean 'x'? "`` for the known name closest to a mistyped ``key`` (empty if none is close).

    >>> did_you_mean("num_stpes", ["num_steps", "seq_len"])
    "did you mean 'num_steps'? "
    >>> did_you_mean("zzz", ["num_steps"])
    ''
    """
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _check_known(path: str, mapping: Mapping[str, Any], known: Any, what: str) -> None:
    for key in mapping:
        if key not in known:
            raise _fail(
                f"{path}.{key}", f"unknown key; {did_you_mean(key, known)}{what} accepts {sorted(known)}"
            )


def _dataclass_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _at_least(path: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise _fail(path, f"expected an int >= {low}, got {value!r}")


def _one_of(path: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _fail(path, f"expected one of {list(choices)}, got {value!r}")


#: Keyword arguments of :class:`rljax.inference.vllm.VLLMClient` that ``config.engine.client`` may not
#: set, with where the run takes them from.
CLIENT_KEYS_SET_ELSEWHERE: Mapping[str, str] = {
    "urls": "config.engine.urls (or engine.num_servers launched servers)",
    "sync": "config.engine.sync (SyncConfig fields)",
    "stall_timeout_s": "config.engine.stall_timeout_s",
    "all_down_timeout_s": "config.engine.all_down_timeout_s",
    "kv_cache": "config.engine.in_flight_updates",
    "transport": "nothing: the run's client talks HTTP to the servers",
    "clock": "nothing: the run's client uses the monotonic clock",
}


def client_keys() -> list[str]:
    """The keys ``config.engine.client`` accepts: :class:`~rljax.inference.vllm.VLLMClient`'s keyword
    arguments less those the run sets (:data:`CLIENT_KEYS_SET_ELSEWHERE`)."""
    from rljax.inference.vllm.client import VLLMClient

    params = inspect.signature(VLLMClient.__init__).parameters
    return sorted(
        k for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in CLIENT_KEYS_SET_ELSEWHERE
    )


def _check_client(client: Mapping[str, Any]) -> None:
    """``config.engine.client``'s keys (typos fail here, not after the vLLM servers started)."""
    known = client_keys()
    for key in client:
        if key in CLIENT_KEYS_SET_ELSEWHERE:
            raise _fail(
                f"config.engine.client.{key}", f"set by the run; use {CLIENT_KEYS_SET_ELSEWHERE[key]}"
            )
        if key not in known:
            raise _fail(
                f"config.engine.client.{key}",
                f"unknown key; {did_you_mean(key, known)}VLLMClient accepts {known}",
            )


def device_list(value: Any, path: str) -> tuple[int, ...]:
    """GPU indices of a ``server_devices`` entry or of ``trainer_devices``: ``"0,1"``, ``1``, ``(0, 1)``.

    >>> device_list("4, 5", "x"), device_list(3, "x"), device_list((0, 1), "x")
    ((4, 5), (3,), (0, 1))
    """
    items = str(value).split(",") if isinstance(value, (str, int)) else value
    try:
        out = tuple(int(str(i).strip()) for i in items)
    except (TypeError, ValueError):
        out = ()
    if isinstance(value, bool) or not out or min(out) < 0 or len(set(out)) != len(out):
        raise _fail(path, f"expected distinct GPU indices >= 0 such as '0' or '0,1', got {value!r}")
    return out


def _check_placement(e: EngineSection) -> None:
    """``engine.server_devices`` / ``trainer_devices`` / ``trainer_memory_fraction`` (rljax.run.placement)."""
    if e.trainer_devices:
        device_list(e.trainer_devices, "config.engine.trainer_devices")
    if not 0 <= e.trainer_memory_fraction < 1:
        raise _fail(
            "config.engine.trainer_memory_fraction",
            f"expected a share in [0, 1) (0 = JAX's default), got {e.trainer_memory_fraction!r}",
        )
    if not e.server_devices:
        return
    key = "config.engine.server_devices"
    if e.kind != "vllm" or e.urls:
        raise _fail(key, "places launched vLLM servers: it needs engine.kind='vllm' and no engine.urls")
    if len(e.server_devices) != e.num_servers:
        raise _fail(
            key,
            f"has {len(e.server_devices)} entries for engine.num_servers={e.num_servers}: one per server",
        )
    if "CUDA_VISIBLE_DEVICES" in dict(e.server.get("env") or {}):
        raise _fail("config.engine.server.env", "sets CUDA_VISIBLE_DEVICES; give engine.server_devices only")
    tensor_parallel = e.server.get("tensor_parallel_size", 1)
    for i, entry in enumerate(e.server_devices):
        devices = device_list(entry, f"{key}[{i}]")
        if isinstance(tensor_parallel, int) and len(devices) < tensor_parallel:
            raise _fail(
                f"{key}[{i}]",
                f"{entry!r} holds {len(devices)} GPU(s); engine.server.tensor_parallel_size="
                f"{tensor_parallel} needs that many",
            )


def critic_config(section: CriticSection) -> Any:
    """The hashable :class:`rljax.training.critic.CriticConfig` of ``config.critic``."""
    return section.hyperparameters()


def _check_import_strings(name: str, env: EnvSection) -> None:
    """The form of the env's ``module:attr`` strings (imported when the trainer is built, so a config
    can be read where the code is absent)."""
    if ":" in env.env and env.env.partition(":")[0] not in LIBRARIES:
        split_import_string(env.env, where=f"config.envs.{name}.env")
    if env.tasks:
        split_import_string(env.tasks, where=f"config.envs.{name}.tasks")
        if env.dataset:
            raise _fail(f"config.envs.{name}.tasks", "tasks come from the dataset; drop one of them")


def _check_old_logprobs(cfg: RunConfig) -> None:
    """``trainer.old_logprobs`` and the objective's KL penalty keys."""
    t, o = cfg.trainer, cfg.objective
    _one_of("config.trainer.old_logprobs", t.old_logprobs, OLD_LOGPROBS)
    stages = off_policy.ratio_stages(o.off_policy) if o.off_policy else ()
    if t.old_logprobs == "inference" and stages:
        raise _fail(
            f"config.objective.off_policy.{stages[0].partition('=')[0]}",
            f"{stages[0]} weighs old / rollout logprobs, but trainer.old_logprobs='inference' makes the old "
            "logprobs the rollout ones (the ratio is exactly 1, the correction never acts): set "
            "trainer.old_logprobs='recompute' (or 'auto'), or drop the key",
        )
    if o.kl_loss_coef < 0:
        raise _fail("config.objective.kl_loss_coef", f"must be >= 0 (0 = none), got {o.kl_loss_coef}")
    _one_of("config.objective.kl_estimator", o.kl_estimator, KL_KINDS)
    if o.kl_reference and cfg.lora is not None:
        raise _fail(
            "config.objective.kl_reference",
            "a LoRA run's KL reference is its base model with the initial adapter (its weights when RL "
            "starts): leave kl_reference empty",
        )


def _validate(cfg: RunConfig) -> RunConfig:
    """Cross-field rules and the value ranges of every section (each error names its key)."""
    t = cfg.trainer
    if ":" in cfg.renderer.name:
        split_import_string(cfg.renderer.name, where="config.renderer.name")
    _one_of("config.model.param_dtype", cfg.model.param_dtype, DTYPES)
    _one_of("config.model.compute_dtype", cfg.model.compute_dtype, DTYPES)
    _one_of("config.model.remat", cfg.model.remat, REMAT_POLICIES)
    _one_of("config.model.router_replay", cfg.model.router_replay, ROUTER_REPLAY)
    _one_of("config.model.attention", cfg.model.attention, ATTENTION_BACKENDS)
    _one_of("config.model.context_attention", cfg.model.context_attention, CONTEXT_COLLECTIVES)
    _one_of("config.model.matmul_precision", cfg.model.matmul_precision, MATMUL_PRECISIONS)
    if cfg.model.context_attention == "ring" and cfg.model.attention in ("cudnn", "cudnn_ragged"):
        raise _fail(
            "config.model.context_attention",
            f"'ring' merges partial softmaxes in XLA blocks; attention={cfg.model.attention!r} names a cuDNN "
            "kernel, which returns no log-normalizer to merge: use context_attention='all_gather' with it, "
            "or attention='auto' / 'xla' with the ring",
        )
    if cfg.mesh.context > 1 and t.seq_len % (2 * cfg.mesh.context):
        raise _fail(
            "config.mesh.context",
            f"trainer.seq_len={t.seq_len} must be a multiple of 2 x context = {2 * cfg.mesh.context} "
            "(each device holds two load-balanced chunks of every row)",
        )
    for key in ("moe_aux_loss_coef", "router_z_loss_coef"):
        if getattr(cfg.objective, key) < 0:
            raise _fail(f"config.objective.{key}", f"must be >= 0, got {getattr(cfg.objective, key)}")
    _one_of("config.engine.dtype", cfg.engine.dtype, ENGINE_DTYPES)
    _one_of("config.engine.lora_sync", cfg.engine.lora_sync, ("adapter", "merged"))
    _one_of("config.engine.in_flight_updates", cfg.engine.in_flight_updates, ("off", "recompute", "keep"))
    if cfg.engine.in_flight_updates == "keep" and cfg.engine.kind != "vllm":
        raise _fail("config.engine.in_flight_updates", "'keep' needs vLLM servers (engine.kind='vllm')")
    _check_client(cfg.engine.client)
    _check_placement(cfg.engine)
    _at_least("config.trainer.micro_batch_tokens", t.micro_batch_tokens, 0)
    if t.micro_batch_tokens and t.micro_batch_tokens < t.seq_len:
        raise _fail(
            "config.trainer.micro_batch_tokens",
            f"{t.micro_batch_tokens} is smaller than one packed row (trainer.seq_len={t.seq_len}); a "
            "micro-batch holds whole rows: use a multiple of seq_len, or 0 for no micro-batching",
        )
    _one_of("config.trainer.mode", t.mode, MODES)
    _one_of("config.engine.kind", cfg.engine.kind, ENGINE_KINDS)
    if cfg.lora is not None and cfg.lora.unembed and cfg.engine.kind != "embedded":
        raise _fail(
            "config.lora.targets",
            "'lm_head' (a LoRA adapter on the unembedding) runs with the embedded sampler only: syncing it "
            "to vLLM (as an adapter or merged into a tied model's output projection) is untested; drop "
            "'lm_head' or use engine.kind='embedded'",
        )
    if (
        cfg.lora is not None
        and cfg.engine.kind == "vllm"
        and cfg.engine.lora_sync == "adapter"
        and cfg.engine.in_flight_updates != "off"
    ):
        # A vLLM request names its adapter (a versioned name per sync) for its whole life, so no
        # adapter sync reaches a request in flight; only the base weights could switch under it.
        raise _fail(
            "config.engine.in_flight_updates",
            f"{cfg.engine.in_flight_updates!r} cannot switch a running vLLM request to a new LoRA adapter "
            "(a request keeps the adapter it names): use in_flight_updates='off' with "
            "lora_sync='adapter' (each turn is sampled by one adapter version, the next turn names the "
            "newest), or lora_sync='merged' to switch full merged weights in flight",
        )
    _one_of("config.objective.reduction", cfg.objective.reduction, REDUCTIONS)
    _check_old_logprobs(cfg)
    for key in ("prompts_per_step", "seq_len", "max_off_policy_steps"):
        _at_least(f"config.trainer.{key}", getattr(t, key), 1)
    # num_steps=0: the warm start only (and a step-0 checkpoint)
    for key in (
        "num_steps",
        "mini_batch_prompts",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "save_rollouts_every",
    ):
        _at_least(f"config.trainer.{key}", getattr(t, key), 0)
    _at_least("config.trainer.dynamic_sampling.max_rounds", t.dynamic_sampling.max_rounds, 0)
    if not t.stall_timeout_s >= 0:
        raise _fail(
            "config.trainer.stall_timeout_s", f"expected seconds >= 0 (0 = off), got {t.stall_timeout_s!r}"
        )
    _one_of("config.trainer.on_save_error", t.on_save_error, ON_SAVE_ERROR)
    _one_of("config.trainer.prefix_sharing", t.prefix_sharing, PREFIX_SHARING)
    if t.mini_batch_prompts and t.prompts_per_step % t.mini_batch_prompts:
        raise _fail(
            "config.trainer.mini_batch_prompts",
            f"{t.mini_batch_prompts} does not divide trainer.prompts_per_step={t.prompts_per_step}; every "
            "mini-batch holds exactly mini_batch_prompts whole prompt groups (design §2.6): pick a divisor",
        )
    for i, f in enumerate(t.filters):
        if not isinstance(f, Mapping) or "name" not in f:
            raise _fail(f"config.trainer.filters[{i}]", f"expected dict(name=..., mode=...), got {f!r}")
        try:
            make_filter(str(f["name"]), **{k: v for k, v in f.items() if k != "name"})
        except (TypeError, ValueError) as e:
            raise _fail(f"config.trainer.filters[{i}]", str(e)) from None
        run_set = _RUN_SET_FILTER_KEYS.get(str(f["name"]))
        if run_set is not None and run_set[0] in f:
            raise _fail(
                f"config.trainer.filters[{i}].{run_set[0]}",
                f"set by the run ({run_set[1]}); remove it, got {f[run_set[0]]!r}",
            )
    for path, overrides in (
        ("config.warmstart.optimizer", cfg.warmstart.optimizer),
        ("config.critic.optimizer", cfg.critic.optimizer),
    ):
        _check_known(path, overrides, _dataclass_fields(OptimizerConfig), "OptimizerConfig")
    try:
        cfg.critic_optimizer_config()
    except (TypeError, ValueError) as e:
        raise _fail("config.critic", str(e)) from None
    try:
        cfg.optimizer_config(**cfg.warmstart.optimizer)
    except (TypeError, ValueError) as e:
        raise _fail("config.warmstart.optimizer", str(e)) from None
    _check_known(
        "config.engine.server",
        cfg.engine.server,
        set(_dataclass_fields(ServerConfig)) - {"model"},
        "ServerConfig",
    )
    if not cfg.envs:
        raise _fail("config.envs", "empty; name at least one environment (e.g. 'lookup')")
    for name, env in cfg.envs.items():
        _check_known(f"config.envs.{name}.dataset", env.dataset, DATASET_KEYS, "a dataset section")
        if env.dataset and not env.dataset.get("train"):
            raise _fail(f"config.envs.{name}.dataset.train", "a dataset section needs the train file(s)")
        if env.dataset.get("eval") and env.dataset.get("eval_fraction"):
            raise _fail(f"config.envs.{name}.dataset", "give eval (a file) or eval_fraction, not both")
        if env.dataset and env.task_kwargs:
            raise _fail(f"config.envs.{name}.task_kwargs", "tasks come from the dataset; drop task_kwargs")
        _check_import_strings(name, env)
        if env.agent and env.agent_command:
            raise _fail(f"config.envs.{name}", "give agent (a function) or agent_command, not both")
        if env.agent and (env.agent.count(":") != 1 or not all(env.agent.split(":"))):
            raise _fail(f"config.envs.{name}.agent", f"expected 'module:function', got {env.agent!r}")
        if env.verifiers:
            other = ("agent", "agent_command", "dataset", "tasks", "task_kwargs", "kwargs")
            other = [k for k in other if getattr(env, k)]
            if other:
                raise _fail(f"config.envs.{name}", f"a verifiers env has its own tasks, agent: drop {other}")
            if cfg.warmstart.num_steps:
                raise _fail(
                    "config.warmstart.num_steps",
                    f"the warm start replays env demonstrations (env.solution); verifiers env {name!r} has "
                    "none: set it to 0",
                )
            if env.num_eval_tasks and not env.eval_env_args:
                raise _fail(
                    f"config.envs.{name}.num_eval_tasks",
                    "a verifiers env's eval tasks need eval_env_args (the held-out taskset's fields)",
                )
        elif env.env_args or env.eval_env_args:
            raise _fail(f"config.envs.{name}.env_args", "only verifiers envs (verifiers=<id>) take it")
        for key in ("num_train_tasks", "num_eval_tasks"):
            _at_least(f"config.envs.{name}.{key}", getattr(env, key), 0)
    for k in cfg.eval.pass_k:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg.eval.group_size:
            raise _fail("config.eval.pass_k", f"each k must be an int in [1, eval.group_size], got {k!r}")
    _at_least("config.eval.group_size", cfg.eval.group_size, 1)
    try:
        frozen_models_from_config(cfg.frozen_models)
    except ValueError as e:
        raise _fail("config.frozen_models", str(e)) from None
    unknown = sorted(set(cfg.env_algorithms) - set(cfg.envs))
    if unknown:
        raise _fail(
            "config.env_algorithms", f"names envs {unknown} that config.envs lacks ({sorted(cfg.envs)})"
        )
    return cfg


def parse_run_config(config: Any) -> RunConfig:
    """The :class:`RunConfig` of an ml_collections config (or nested dict); missing keys take defaults."""
    raw = _plain(config) if config is not None else {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"config: expected a ConfigDict or mapping, got {type(config).__name__}")
    raw = dict(raw)
    envs = raw.pop("envs", None)
    cfg = _parse_section(RunConfig, raw, "config")
    if envs is not None:
        if not isinstance(envs, Mapping):
            raise _fail("config.envs", f"expected a mapping env name -> dict(env=..., ...), got {envs!r}")
        parsed = {}
        for name, spec in envs.items():
            spec = {} if spec is None else spec
            env = _coerce(spec, EnvSection, f"config.envs.{name}")
            parsed[str(name)] = env if env.env else dataclasses.replace(env, env=str(name))
        cfg = dataclasses.replace(cfg, envs=parsed)
    else:
        cfg = dataclasses.replace(cfg, envs={k: EnvSection(**v) for k, v in DEFAULT_ENVS.items()})
    return _validate(cfg)


# ------------------------------------------------------------------------------------------------
# The defaults as a ConfigDict (configs/default.py) and the comparison used by --resume
# ------------------------------------------------------------------------------------------------

#: Fields that can be given object values on the command line (lists, dicts, None-or-value).
_OBJECT_FIELDS = {
    "algorithm",
    "env_algorithms",
    "frozen_models",
    "trainer.filters",
    "trainer.row_buckets",
    "trainer.table_keys",
    "report.sinks",
    "report.wandb.tags",
    "engine.urls",
    "engine.server_devices",
    "engine.max_model_len",
    "objective.max_len",
    "rollout.top_k",
    "rollout.seed",
    "rollout.env_workers",
}


def _to_config(value: Any, path: str) -> Any:
    from ml_collections import config_dict

    if dataclasses.is_dataclass(value):
        value = {name: getattr(value, name) for name in section_fields(type(value))}
    parts = path.split(".")
    env_dataset = len(parts) == 3 and parts[0] == "envs" and parts[2] == "dataset"
    if path in _OBJECT_FIELDS or value is None or env_dataset:
        return config_dict.FieldReference(value, field_type=object)
    if isinstance(value, Mapping):
        c = config_dict.ConfigDict()
        for k, v in value.items():
            c[k] = _to_config(v, f"{path}.{k}" if path else k)
        return c
    return value


def default_config() -> Any:
    """The defaults of :class:`RunConfig` as an ml_collections ``ConfigDict`` (``configs/default.py``).

    Fields whose values are lists, dicts or None (``algorithm``, ``trainer.filters``, ...) are object
    fields, so ``--config.trainer.filters="[{'name': 'overlong', 'mode': 'enforce'}]"`` works (a Python
    literal: ml_collections parses the value with ``ast.literal_eval``, so ``dict(...)`` calls stay a string).
    """
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, envs={k: EnvSection(**v) for k, v in DEFAULT_ENVS.items()})
    return _to_config(cfg, "")


#: Keys whose change does not change the numbers a resumed run produces (anything else that differs
#: from the checkpoint's config refuses the resume): how long to run, how often to evaluate, save and
#: print, where the servers are.
RESULT_NEUTRAL_KEYS: tuple[str, ...] = (
    "trainer.num_steps",
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.table_keys",
    "trainer.save_rollouts_every",
    "trainer.stall_timeout_s",
    "trainer.on_save_error",
    "report",
    "engine.urls",
    "engine.python",
    "engine.num_servers",
    "engine.client",
    "engine.supervise",
    "engine.health_interval_s",
    "engine.health_timeout_s",
    "engine.health_failures",
    "engine.stall_timeout_s",
    "engine.all_down_timeout_s",
    "engine.max_restarts",
    "engine.server_devices",
    "engine.trainer_devices",
    "engine.trainer_memory_fraction",
    "engine.server.log_path",
    "engine.server.startup_timeout_s",
    "engine.server.port",
    "frozen_models",
)


def config_record(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as plain nested dicts of its config keys (what checkpoints record; it parses back)."""
    if dataclasses.is_dataclass(cfg):
        return {name: config_record(getattr(cfg, name)) for name in section_fields(type(cfg))}
    if isinstance(cfg, Mapping):
        return {k: config_record(v) for k, v in cfg.items()}
    return cfg


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(value):
        value = {name: getattr(value, name) for name in section_fields(type(value))}
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, (list, tuple)):
        value = tuple(_flatten_leaf(v) for v in value)
    return {prefix: value}


def _flatten_leaf(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple(sorted((k, _flatten_leaf(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_flatten_leaf(x) for x in v)
    return v


def config_differences(saved: RunConfig, current: RunConfig) -> list[str]:
    """``"key: saved -> current"`` for every result-changing key that differs (see RESULT_NEUTRAL_KEYS)."""
    a, b = _flatten(saved), _flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == n or key.startswith(n + ".") for n in RESULT_NEUTRAL_KEYS):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            out.append(f"{key}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return out
