"""The run configuration: typed, frozen, parsed once from an ml_collections config.

:func:`parse_run_config` turns the ``ConfigDict`` of a recipe (``configs/*.py``, overridden by
``--config.<key>=<value>`` flags) into a :class:`RunConfig` of frozen dataclasses. It is the ONE
place that knows the keys, their types and their defaults: a missing key takes the default of its
field, and every mistake (an unknown key, a wrong type, a value out of range, a key no component
reads) is a ``ValueError`` naming the key's path, e.g. ``config.trainer.seq_len: expected an int >=
1, got 0``. :func:`default_config` renders the same defaults as a ``ConfigDict``;
``configs/default.py`` is exactly that, and the other recipes start from it.

The trainer's parts read only these typed values, never the raw config.

**Each knob is declared once**, on its field (:mod:`rljax.knobs`): its type, default, allowed range
or values and one-line meaning. Adding a key is one line in its section::

    seq_len: int = knob(384, ge=1, doc="tokens per packed row")

The section checks the value when it is made, the parser reports it under the key's path, the
config reference (``docs/reference/config.md``) lists it, and ``--config.trainer.seq_len=512``
sets it. Rules between several keys are explicit functions here (:func:`_validate`).

The sections of the run's components ARE those components' own typed configs, each validating
itself: ``rollout`` is a :class:`rljax.rollout.RolloutConfig`, ``optimizer`` an
:class:`rljax.training.optimizer.OptimizerConfig`, ``warmstart`` a
:class:`rljax.training.warmstart.WarmStartConfig`, ``critic`` a
:class:`rljax.training.critic.CriticSection` (a ``CriticConfig``), ``lora`` a
:class:`rljax.models.lora.LoRAConfig` (or None: full training), ``mesh`` a
:class:`rljax.training.sharding.MeshConfig`, ``objective.off_policy`` a
:class:`rljax.core.off_policy.OffPolicyConfig`, and the vLLM engine's ``engine.server`` a
:class:`rljax.inference.vllm.ServerConfig`, ``engine.client`` a
:class:`rljax.inference.vllm.ClientConfig`, ``engine.supervisor`` a
:class:`rljax.inference.vllm.SupervisorConfig` and ``engine.sync`` a
:class:`rljax.inference.vllm.SyncConfig`: a knob that belongs to a component is declared by it, and
the run holds it (:data:`RUN_SET_FIELDS` lists the component fields the run fills in itself).
``model.init`` holds :class:`rljax.models.ModelConfig` fields, each typed and defaulted by it;
``warmstart.optimizer`` and ``critic.optimizer`` overrides of ``optimizer``'s fields, each checked by
its declaration; ``frozen_models.<name>`` the fields of a
:class:`rljax.inference.frozen.FrozenModelConfig` (checked when the config is parsed).
Free-form mappings stay free where the keys belong to user code or another library: the renderer's
and the envs' constructor arguments, the task makers' ``task_kwargs``, verifiers' ``env_args``.

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
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from rljax import knobs
from rljax.core import off_policy
from rljax.core.losses import KL_KINDS
from rljax.core.objective import REDUCTIONS
from rljax.core.off_policy import OffPolicyConfig
from rljax.data.filters import make_filter
from rljax.envs.loader import split_import_string
from rljax.envs.registry import LIBRARIES
from rljax.inference.frozen import FrozenModelConfig
from rljax.inference.vllm.client import ClientConfig
from rljax.inference.vllm.launcher import ServerConfig
from rljax.inference.vllm.supervisor import SupervisorConfig
from rljax.inference.vllm.weight_sync import SyncConfig
from rljax.knobs import did_you_mean, knob
from rljax.models.attention_backends import ATTENTION_BACKENDS
from rljax.models.config import ModelConfig
from rljax.models.context import CONTEXT_COLLECTIVES
from rljax.models.decoder import REMAT_POLICIES
from rljax.models.lora import LoRAConfig
from rljax.report.config import ReportConfig
from rljax.rollout import RolloutConfig
from rljax.training.critic import CriticSection
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import MeshConfig
from rljax.training.warmstart import WarmStartConfig

__all__ = [
    "DTYPES",
    "DynamicSamplingSection",
    "ENGINE_DTYPES",
    "EngineSection",
    "EnvSection",
    "EvalSection",
    "MATMUL_PRECISIONS",
    "MOVED_KEYS",
    "ModelSection",
    "OLD_LOGPROBS",
    "ObjectiveSection",
    "REMAT_POLICIES",
    "RESULT_NEUTRAL_KEYS",
    "ROUTER_REPLAY",
    "RUN_SET_FIELDS",
    "RendererSection",
    "RunConfig",
    "TokenizerSection",
    "TrainerSection",
    "config_differences",
    "config_record",
    "default_config",
    "device_list",
    "did_you_mean",
    "parse_config_record",
    "retired_key",
    "parse_run_config",
]

#: Model dtypes a run accepts (compute and parameter storage).
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
#: Weight dtypes an engine can serve: a dtype, or "auto" (= model.compute_dtype).
ENGINE_DTYPES: tuple[str, ...] = ("auto", *DTYPES)
#: ``model.router_replay`` values (MoE models).
ROUTER_REPLAY: tuple[str, ...] = ("off", "r3")
#: ``config.model.matmul_precision`` values (``jax.lax.Precision`` names; "default" = the platform's).
MATMUL_PRECISIONS: tuple[str, ...] = ("default", "high", "highest")
#: ``config.trainer.mode`` values.
MODES: tuple[str, ...] = ("sync", "async", "fully_async")
#: ``config.trainer.old_logprobs`` values (design §3.4).
OLD_LOGPROBS: tuple[str, ...] = ("auto", "recompute", "inference")
#: ``config.engine.kind`` values.
ENGINE_KINDS: tuple[str, ...] = ("embedded", "vllm")
#: ``config.engine.lora_sync`` values.
LORA_SYNC: tuple[str, ...] = ("adapter", "merged")
#: ``config.engine.in_flight_updates`` values.
IN_FLIGHT_UPDATES: tuple[str, ...] = ("off", "recompute", "keep")
#: The keys of ``config.envs.<name>.dataset``.
DATASET_KEYS: tuple[str, ...] = ("train", "eval", "format", "eval_fraction")
#: Values of ``config.trainer.on_save_error``.
ON_SAVE_ERROR: tuple[str, ...] = ("stop", "continue")
#: ``trainer.prefix_sharing`` and ``engine.prefix_sharing``: "auto" computes a prompt prefix that
#: several samples share once wherever that gives what computing it for each would (the trainer: prefix
#: trees, design §2.6; the embedded sampler: one prefill of the prefix); "off" never does.
PREFIX_SHARING: tuple[str, ...] = ("auto", "off")


# ------------------------------------------------------------------------------------------------
# Sections (defaults = the default recipe: a tiny Qwen3-shaped model on the multi-turn lookup task)
# ------------------------------------------------------------------------------------------------


@knobs.section
class TokenizerSection:
    """The tokenizer."""

    name: str = knob(
        "toy:chatml",
        doc='``"toy:<family>"`` (a byte-level toy tokenizer built in code) or an HF tokenizer path',
    )


@knobs.section
class RendererSection:
    """The renderer: the chat template as a token stream (:func:`rljax.chat.make_renderer`)."""

    name: str = knob(
        "chatml",
        doc="a built-in name (``chatml``, ``qwen2.5``, ``qwen3``, ``llama3``, ``generic``) or "
        '``"my_pkg.chat:MyRenderer"`` (a Renderer subclass or factory, called with the tokenizer)',
    )
    kwargs: dict = knob({}, doc="keyword arguments of the renderer (free-form: the renderer's own)")


def _init_defaults(**values: Any) -> dict[str, Any]:
    """``model.init``: every :class:`~rljax.models.ModelConfig` field, ``values`` over its defaults."""
    out = {}
    for f in dataclasses.fields(ModelConfig):
        if f.name in values:
            out[f.name] = values[f.name]
        elif f.name not in RUN_SET_FIELDS.get(ModelConfig, {}) and f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


#: Fields of a component config that are not config keys: the run sets them (or they come from
#: elsewhere), with what to write instead.
RUN_SET_FIELDS: Mapping[type, Mapping[str, str]] = {
    RolloutConfig: {
        "algorithm": "set by the run; use config.algorithm",
        "env_algorithms": "set by the run; use config.env_algorithms",
    },
    ServerConfig: {
        "model": "set by the run (the policy's weights)",
        "dtype": "set by the run; use config.engine.dtype",
    },
    ModelConfig: {"extra_json": "read from a checkpoint's config.json (model.hf_path)"},
    FrozenModelConfig: {"name": "set by the run: the frozen model's key in config.frozen_models"},
}

#: ``model.init`` of the default recipe.
DEFAULT_INIT: Mapping[str, Any] = _init_defaults(
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


@knobs.section
class ModelSection:
    """The policy model: where it comes from, its precision, memory and attention kernels."""

    hf_path: str = knob(
        "", doc="an HF checkpoint directory (or ``.gguf`` file) to load; empty = a fresh model of ``init``"
    )
    param_dtype: str = knob(
        "float32",
        choices=DTYPES,
        doc="dtype of the master weights, their gradients and the optimizer state (float32 by default, "
        "whatever the checkpoint's dtype: a bf16 checkpoint is upcast on load)",
    )
    compute_dtype: str = knob(
        "float32",
        choices=DTYPES,
        doc="dtype of activations and matmuls (logits, log-probs, ratios and every loss stay float32)",
    )
    remat: str = knob(
        "none",
        choices=REMAT_POLICIES,
        doc="activation recomputation of each block in the backward pass: ``none``, ``full`` (save only "
        "block inputs), ``dots_saveable`` (also keep matmul outputs without batch dims)",
    )
    router_replay: str = knob(
        "off",
        choices=ROUTER_REPLAY,
        doc='MoE models: ``"r3"`` replays the experts the sampler routed every token to in the train '
        'forward (gates recomputed from the current router); ``"off"`` routes afresh. The share of '
        "tokens whose trainer top-k differs from the sampler's (``routing/flip_fraction``) is logged "
        "either way",
    )
    attention: str = knob(
        "auto",
        choices=ATTENTION_BACKENDS,
        doc="the training forward's attention kernel: ``auto`` (cuDNN's ragged kernel on GPU with "
        "bfloat16 compute, splash on TPU, XLA on CPU), ``xla``, ``cudnn``, ``cudnn_ragged`` (cuDNN's "
        "packed variable-length kernel) or ``splash`` (:mod:`rljax.models.attention_backends`)",
    )
    context_attention: str = knob(
        "all_gather",
        choices=CONTEXT_COLLECTIVES,
        doc="how attention crosses ``mesh.context`` when it is > 1: ``all_gather`` (each device gathers "
        "the row's keys/values; the cuDNN kernels apply) or ``ring`` (key/value chunks passed around "
        "the devices, partial softmaxes merged; XLA blocks), see :mod:`rljax.models.context`",
    )
    matmul_precision: str = knob(
        "default",
        choices=MATMUL_PRECISIONS,
        doc='the precision of every matmul of the model (trainer and embedded sampler); ``"default"`` '
        "lets the platform choose (on NVIDIA GPUs float32 matmuls then run as TF32, and the sampler's "
        'float32 logprobs differ from the trainer\'s by ~1e-4 instead of ~1e-6); ``"highest"`` keeps '
        "float32 matmuls float32",
    )
    init: dict = knob(
        DEFAULT_INIT,
        fields_of=ModelConfig,
        doc=":class:`rljax.models.config.ModelConfig` fields of a fresh model, each typed and defaulted "
        "by it (``vocab_size`` 0 = the tokenizer's size); read when ``hf_path`` is empty",
    )

    def __post_init__(self) -> None:
        if "vocab_size" not in self.init:
            object.__setattr__(self, "init", {**self.init, "vocab_size": 0})
        if self.hf_path:
            return
        missing = [
            f.name
            for f in dataclasses.fields(ModelConfig)
            if f.default is dataclasses.MISSING and f.name not in self.init
        ]
        if missing:
            raise ValueError(
                f"ModelSection.init: a fresh model (no hf_path) needs ModelConfig's {missing}; set them "
                "or model.hf_path"
            )
        try:
            ModelConfig(**{**self.init, "vocab_size": self.init["vocab_size"] or 1})
        except (TypeError, ValueError) as e:
            # a field's own constraint names the field: "ModelConfig.<field>: why"
            field, sep, why = str(e).partition(": ")
            if sep and field.startswith("ModelConfig.") and field.count(".") == 1:
                raise ValueError(f"ModelSection.init.{field.removeprefix('ModelConfig.')}: {why}") from None
            raise ValueError(f"ModelSection.init: {e}") from None


@knobs.section
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
    """

    env: str = knob(
        "",
        doc="the environment's kind (default: the section's name): a built-in, a library env "
        '(``skyrl_gym:<id>``, ``reasoning_gym:<id>``), ``"module:attr"`` or a registered id',
    )
    kwargs: dict = knob(
        {}, doc="keyword arguments of the environment's constructor (of the agent function for ``agent``)"
    )
    tasks: str = knob("", doc='``"module:function"``, the task maker (else the env\'s own)')
    task_kwargs: dict = knob({}, doc="keyword arguments of the task maker")
    num_train_tasks: int | None = knob(
        None, ge=0, doc="train tasks to make (default 256), or the first N rows of a dataset"
    )
    num_eval_tasks: int | None = knob(
        None, ge=0, doc="held-out tasks to make (default 0), or the first N rows of a dataset"
    )
    dataset: dict = knob(
        {},
        doc='dataset files of the tasks: ``dict(train=PATH, eval=PATH, format="auto", eval_fraction=None)``',
    )
    agent: str = knob(
        "", doc='``"module:function"``, an agent function that plays the episodes through the gateway'
    )
    agent_command: str = knob(
        "",
        doc="an external agent process run per rollout (with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set)",
    )
    verifiers: str = knob("", doc="a verifiers environment id, run as the agent")
    env_args: dict = knob({}, doc="the verifiers environment's config (its ``[env]`` block)")
    eval_env_args: dict = knob({}, doc="taskset fields applied for the verifiers environment's eval tasks")


#: ``config.envs`` of the default recipe.
DEFAULT_ENVS: Mapping[str, EnvSection] = {
    "lookup": EnvSection(
        env="lookup",
        # compact: no tool schema, no system prompt (the warm start teaches the format), small credit
        kwargs=dict(compact=True, system_prompt="", credit=(0.02, 0.05, 0.1)),
        num_train_tasks=2048,
        num_eval_tasks=32,
    )
}


@knobs.section
class EngineSection:
    """The policy's inference engine: the in-process JAX sampler or vLLM servers. Keys marked
    "embedded:" apply to the JAX sampler, "vllm:" to vLLM servers."""

    kind: str = knob(
        "embedded", choices=ENGINE_KINDS, doc='``"embedded"`` (the in-process JAX sampler) or ``"vllm"``'
    )
    dtype: str = knob(
        "auto",
        choices=ENGINE_DTYPES,
        doc='the dtype weights are served in (cast from the master weights on every sync); ``"auto"`` '
        "= ``model.compute_dtype``. A launched vLLM server gets it as ``--dtype``",
    )
    max_batch_size: int = knob(128, ge=1, doc="embedded: most requests per jitted sampling call")
    min_batch_bucket: int = knob(
        8, ge=1, doc="embedded: smallest number of rows of a sampling call (fewer shapes to compile)"
    )
    batch_wait_ms: float = knob(
        0.0, ge=0, doc="embedded: how long the first queued request waits for others to join its batch"
    )
    min_prompt_bucket: int = knob(
        64, ge=1, doc="embedded: smallest padded prompt length (buckets are powers of two above it)"
    )
    min_new_tokens_bucket: int = knob(16, ge=1, doc="embedded: smallest loop bound for new tokens")
    max_model_len: int | None = knob(
        None,
        ge=1,
        doc="embedded: longest prompt + completion (None = the model's ``max_position_embeddings``)",
    )
    prefix_sharing: str = knob(
        "auto",
        choices=PREFIX_SHARING,
        doc='embedded: ``"auto"`` prefills a prompt prefix shared by requests of one batch once (a GRPO '
        "group's samples; turns whose histories start alike; identical prompts only for models with "
        "linear-attention layers) wherever that prefills fewer tokens, and starts each request from a "
        'copy of its KV cache: the same tokens and logprobs (within float32 rounding); ``"off"`` '
        "prefills each prompt whole. The sampler's side of ``trainer.prefix_sharing`` (True / False "
        'of earlier configs read as "auto" / "off")',
    )
    urls: tuple = knob((), doc="vllm: servers to use (started by you on the same initial weights)")
    num_servers: int = knob(1, ge=1, doc="vllm: servers to launch locally when ``urls`` is empty")
    python: str = knob(
        "",
        doc="vllm: the Python of the vLLM virtual environment for launched servers (empty: found "
        "automatically)",
    )
    server: ServerConfig = knob(ServerConfig(), doc="vllm: how each launched server runs")
    client: ClientConfig = knob(
        ClientConfig(), doc="vllm: how requests are routed, bounded, retried and timed"
    )
    supervisor: SupervisorConfig = knob(
        SupervisorConfig(), doc="vllm: how servers are watched and brought back (with ``supervise``)"
    )
    sync: SyncConfig = knob(
        SyncConfig(),
        doc="vllm: the weight sync (probe length and seed, ``atol`` override of the per-dtype "
        'tolerance, ``on_mismatch`` = "raise" | "retry" | "warn")',
    )
    lora_sync: str = knob(
        "adapter",
        choices=LORA_SYNC,
        doc='vllm, LoRA runs: ``"adapter"`` syncs only the adapters (PEFT files loaded at runtime; '
        '``--enable-lora`` is added to launched servers), ``"merged"`` syncs full merged weights',
    )
    supervise: bool = knob(
        True,
        doc="vllm: watch the servers (:mod:`rljax.inference.vllm.supervisor`, ``supervisor``): a "
        "launched server that exits or stops answering is restarted with the current weights "
        "(verified), one given by URL is re-checked on a backoff; weight syncs skip servers out of "
        "service",
    )
    in_flight_updates: str = knob(
        "off",
        choices=IN_FLIGHT_UPDATES,
        doc="whether a weight update reaches sequences already decoding (their completions then carry "
        'several version spans): ``"off"`` (they finish on the weights they started with), '
        '``"recompute"`` (they switch at the next decode segment, their KV cache recomputed with the '
        'new weights: every token exactly from its version; embedded sampler and vLLM) or ``"keep"`` '
        "(vLLM only: pause in keep mode with the old KV cache kept, PipelineRL's behaviour; tokens after "
        'the switch attend to old-weights keys and values). Meant for ``trainer.mode="fully_async"``. '
        'LoRA with ``lora_sync="adapter"`` on vLLM takes ``"off"`` only: a request keeps the '
        "adapter it names, so each turn is sampled by one adapter version",
    )
    server_devices: tuple = knob(
        (),
        doc='vllm, launched servers: the GPUs of each server, one entry per server (e.g. ``("1",)`` or '
        '``("4,5", "6,7")``: indices into the GPUs this process sees), given to it as '
        "``CUDA_VISIBLE_DEVICES``; empty = every server sees the trainer's GPUs "
        "(:mod:`rljax.run.placement`)",
    )
    trainer_devices: str = knob(
        "",
        doc='the trainer\'s GPUs (``"0"``, ``"0,1,2,3"``; indices as above), set as JAX\'s '
        "``jax_cuda_visible_devices`` by ``rljax train`` before JAX starts; empty = every GPU no "
        "launched server holds (all of them without ``server_devices``)",
    )
    trainer_memory_fraction: float = knob(
        0.0,
        ge=0,
        lt=1,
        doc="the share of each GPU's memory JAX preallocates (``XLA_PYTHON_CLIENT_MEM_FRACTION``, set "
        "by ``rljax train`` before JAX starts); 0 = JAX's default (75%). Lower it when a vLLM server "
        "shares the trainer's GPU, so that ``server.gpu_memory_utilization`` of the GPU is still free "
        "when the server starts",
    )


@knobs.section
class EvalSection:
    """Held-out evaluation."""

    group_size: int = knob(1, ge=1, doc="samples per eval task")
    temperature: float = knob(
        1.0,
        ge=0,
        doc="sampling temperature of the evaluation (0 = greedy; greedy saturates at 1.0 after the "
        "default warm start)",
    )
    pass_k: tuple = knob((), doc="the k of the ``eval/pass@k`` metrics (default ``(1, group_size)``)")


@knobs.section
class ObjectiveSection:
    """The objective's reduction, off-policy correction and extra terms (design §3.4, §3.5)."""

    reduction: str = knob("token_mean", choices=REDUCTIONS, doc="how per-token losses reduce to a scalar")
    off_policy: OffPolicyConfig = knob(
        OffPolicyConfig(),
        doc="the off-policy correction between the old policy and the rollout engine, SkyRL's keys and "
        "defaults (:mod:`rljax.core.off_policy`); every stage off by default",
    )
    entropy_coef: float = knob(0.0, doc="coefficient of the entropy bonus (0 = none)")
    max_len: int | None = knob(
        None, ge=1, doc="the constant of the ``seq_mean_token_sum_norm`` reduction (required for it)"
    )
    moe_aux_loss_coef: float = knob(
        0.0,
        ge=0,
        doc="coefficient of the Switch load-balancing loss of MoE routers (0 = off; the metric is "
        "logged anyway)",
    )
    router_z_loss_coef: float = knob(
        0.0,
        ge=0,
        doc="coefficient of the router z-loss of MoE routers (0 = off; the metric is logged anyway)",
    )
    kl_loss_coef: float = knob(
        0.0,
        ge=0,
        doc="weight of a KL penalty to a frozen reference policy on the rl tokens, added to the loss "
        "(verl's and SkyRL's ``use_kl_loss`` with ``kl_loss_coef``; 0 = none). Logged as "
        "``loss/kl_penalty``, ``ref_kl/reference_k1`` and ``ref_kl/reference_k3``",
    )
    kl_estimator: str = knob(
        "k3",
        choices=KL_KINDS,
        doc="the penalty's per-token estimator of ``KL(pi || pi_ref)``: ``k1``, ``k2``, ``k3`` (verl's "
        "``low_var_kl``, the default) or ``abs`` (:func:`rljax.core.losses.kl`)",
    )
    kl_reference: str = knob(
        "",
        doc='the reference policy: ``""`` (default) = the policy\'s own weights when RL starts (after '
        "the warm start), held by the trainer and checkpointed with the run; or an HF checkpoint "
        "directory (full training only: a LoRA run's reference is its base with the initial adapter)",
    )


@knobs.section
class DynamicSamplingSection:
    """DAPO dynamic sampling: resample until every prompt slot holds a group whose rewards differ."""

    max_rounds: int = knob(0, ge=0, doc="most resampling rounds (0 = off)")
    atol: float = knob(0.0, ge=0, doc="a group is kept when its rewards spread more than this")
    strict: bool = knob(False, doc="fail when the rounds run out (else train on what was kept)")


DEFAULT_TABLE_KEYS = (
    "reward/mean",
    "loss",
    "grad_norm",
    "entropy",
    "policy_version/lag",
    "time/step_s",
    "eval/reward_mean",
)


@knobs.section
class TrainerSection:
    """The RL loop: steps, batches, packing, evaluation, checkpoints."""

    num_steps: int = knob(120, ge=0, doc="RL steps to run (0: the warm start only, and a step-0 checkpoint)")
    mode: str = knob(
        "sync",
        choices=MODES,
        doc='``"sync"``; ``"async"``: the rollout of step n+1 overlaps training of step n; or '
        '``"fully_async"``: rollouts stream continuously and each step trains the next '
        "``prompts_per_step`` complete prompt groups (:mod:`rljax.run.streaming`; several processes: "
        "a stream each, ``prompts_per_step / process count`` groups from each per step)",
    )
    max_off_policy_steps: int = knob(
        1,
        ge=1,
        doc="async modes: how many policy versions a sample may be stale (fully_async: between the "
        "weights a group started on and the weights it trains against)",
    )
    prompts_per_step: int = knob(16, ge=1, doc="prompt groups per RL step")
    mini_batch_prompts: int = knob(
        0, ge=0, doc="prompt groups per mini-batch, a divisor of ``prompts_per_step`` (0 = one mini-batch)"
    )
    seq_len: int = knob(384, ge=1, doc="tokens per packed row")
    truncate: bool = knob(
        True, doc="drop the tail of (rare) over-long samples (counted in the pack metrics) instead of failing"
    )
    merge: bool = knob(
        True,
        doc="merge the turns of a trajectory whose prompts extend each other into one sample (design §2.5)",
    )
    old_logprobs: str = knob(
        "auto",
        choices=OLD_LOGPROBS,
        doc="where the old (proximal) policy's logprobs of an RL step come from (design §3.4): "
        '``"recompute"``: the trainer\'s own, from the weights at the start of the step (one forward '
        'without gradients over every mini-batch before the first update); ``"inference"``: the '
        "sampler's (then every off-policy correction that weighs old / rollout would be a no-op, and "
        'configuring one is an error); ``"auto"`` (default): recompute exactly when something in an '
        "algorithm's objective reads the old policy (a ratio-based correction, or a policy loss whose "
        "ratio is taken against the old policy: ppo_clip, dual_clip, gspo, sapo, cispo, ...), not for "
        "losses that compare with the sampler by design (dppo, rollout_is). The run prints what it "
        "chose, and why, when it starts",
    )
    filters: tuple = knob(
        (),
        doc='sample filters, e.g. ``(dict(name="overlong", mode="enforce"), dict(name="gibberish"))`` '
        "(:data:`rljax.data.filters.FILTERS`)",
    )
    dynamic_sampling: DynamicSamplingSection = knob(
        DynamicSamplingSection(), doc="DAPO dynamic sampling (:class:`DynamicSamplingSection`)"
    )
    row_buckets: Any = knob(
        None,
        doc="allowed numbers of packed rows (None: data-parallel size x powers of two), see "
        ":func:`rljax.data.pack.bucket_rows`",
    )
    micro_batch_tokens: int = knob(
        0,
        ge=0,
        doc="tokens per micro-batch, accumulated in one jitted scan (a multiple of ``seq_len``; 0 = no "
        "micro-batching)",
    )
    loss_only_logits: bool = knob(
        True,
        doc="True: the train step, the old-policy recompute and the KL reference's scoring project only "
        "the tokens that carry a loss (``loss_mask != 0``, the only ones the objective and its metrics "
        "read) through the vocabulary, gathered into a bucketed buffer (design §5); False: every packed "
        "token, prompts and tool outputs included. The same logprobs and gradients within float32 "
        "rounding either way; on is faster wherever tokens carry no loss (measured: docs/results.md)",
    )
    prefix_sharing: str = knob(
        "auto",
        choices=PREFIX_SHARING,
        doc='the trainer\'s side of ``engine.prefix_sharing``: ``"auto"`` packs the samples of a '
        "mini-batch that share a prompt prefix (a GRPO group's prompt, turns whose prompts share a "
        "prefix without extending each other) as prefix trees, each shared token computed once "
        "(design §2.6), whenever the policy model computes tree rows exactly (logged at the start); "
        '``"off"``: plain packing',
    )
    eval_every: int = knob(
        10, ge=0, doc="RL steps between held-out evaluations (and after the last step; 0 = never)"
    )
    eval_at_start: bool = knob(
        False,
        doc="evaluate the held-out tasks once before the first RL step of a fresh run (after the warm "
        "start): the curve's starting point, logged as step 0",
    )
    checkpoint_every: int = knob(
        10, ge=0, doc="RL steps between checkpoints (and after the last step; 0 = never)"
    )
    keep_checkpoints: int = knob(3, ge=0, doc="checkpoints to keep, the latest ones (0 = all)")
    table_keys: tuple = knob(DEFAULT_TABLE_KEYS, doc="metrics of the printed table")
    save_rollouts_every: int = knob(
        0, ge=0, doc="N: ``rollouts/step_<S>.jsonl`` and a sample table every N steps (0 = never)"
    )
    stall_timeout_s: float = knob(
        1800.0,
        ge=0,
        doc="the run watchdog (:mod:`rljax.run.watchdog`): when the run makes no progress (no rollout "
        "received, no step trained, no weight sync or checkpoint done) for this many seconds, it prints "
        "every thread's stack and the state of the engines, rollouts and envs, and exits with status 75 "
        "so a scheduler restarts it with ``--resume`` (0 = no watchdog). Cover the slowest legitimate "
        "phase: the first step's compilation, a whole rollout, a checkpoint",
    )
    on_save_error: str = knob(
        "stop",
        choices=ON_SAVE_ERROR,
        doc='when writing a checkpoint fails (a full disk, an I/O error): ``"stop"`` ends the run with '
        'the error (``latest`` still names an intact older checkpoint), ``"continue"`` logs it, counts '
        "it (``checkpoint/save_errors``) and trains on, saving again at the next checkpoint step",
    )


@knobs.section
class RunConfig:
    """Everything a run reads, typed and validated (see :mod:`rljax.run.config`)."""

    seed: int = knob(
        0, doc="the seed of every random choice of the run (tasks, sampling, initialization, shuffles)"
    )
    tokenizer: TokenizerSection = knob(TokenizerSection(), doc="the tokenizer (:class:`TokenizerSection`)")
    renderer: RendererSection = knob(RendererSection(), doc="the chat template (:class:`RendererSection`)")
    model: ModelSection = knob(ModelSection(), doc="the policy model (:class:`ModelSection`)")
    envs: dict = knob(DEFAULT_ENVS, doc="the environments, by name (each an :class:`EnvSection`)")
    engine: EngineSection = knob(
        EngineSection(), doc="the policy's inference engine (:class:`EngineSection`)"
    )
    rollout: RolloutConfig = knob(
        RolloutConfig(),
        doc="the rollouts (:class:`rljax.rollout.RolloutConfig`; its algorithm fields are set by the run)",
    )
    eval: EvalSection = knob(EvalSection(), doc="held-out evaluation (:class:`EvalSection`)")
    algorithm: Any = knob(
        "grpo",
        doc='a registered algorithm name or a dict ``{"name": ..., <field overrides>}`` '
        "(:mod:`rljax.algorithms`)",
    )
    env_algorithms: dict = knob(
        {}, doc="env name -> algorithm (same forms), for envs trained with another algorithm"
    )
    frozen_models: dict = knob(
        {},
        doc="frozen models by name (opd teachers, sft samplers), each a mapping of "
        ":class:`rljax.inference.frozen.FrozenModelConfig` fields",
    )
    objective: ObjectiveSection = knob(ObjectiveSection(), doc="the objective (:class:`ObjectiveSection`)")
    optimizer: OptimizerConfig = knob(
        OptimizerConfig(), doc="the optimizer (:class:`rljax.training.optimizer.OptimizerConfig`)"
    )
    warmstart: WarmStartConfig = knob(
        WarmStartConfig(),
        doc="the supervised warm start on demonstrations (:class:`rljax.training.warmstart.WarmStartConfig`)",
    )
    critic: CriticSection = knob(
        CriticSection(), doc="PPO's critic (:class:`rljax.training.critic.CriticSection`)"
    )
    lora: LoRAConfig | None = knob(
        None, doc="LoRA adapters (:class:`rljax.models.lora.LoRAConfig`); None or empty = full training"
    )
    trainer: TrainerSection = knob(TrainerSection(), doc="the RL loop (:class:`TrainerSection`)")
    report: ReportConfig = knob(
        ReportConfig(),
        doc="metric sinks: jsonl, tensorboard, wandb, mlflow (:class:`rljax.report.config.ReportConfig`)",
    )
    mesh: MeshConfig = knob(
        MeshConfig(),
        doc="the trainer's device mesh (:class:`rljax.training.sharding.MeshConfig`; size 1 = one device)",
    )

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
        inner = [a for a in args if a is not type(None)]
        if value is None and type(None) in args:
            return None
        if len(inner) > 1:  # e.g. ``str | Sequence[str]``: the first type that takes the value
            expected = []
            for each in inner:
                try:
                    return _coerce(value, each, path)
                except ValueError as e:
                    expected.append(str(e).removeprefix(f"{path}: expected ").rpartition(", got ")[0])
            raise _fail(path, f"expected {' or '.join(expected)}, got {value!r}")
        if dataclasses.is_dataclass(inner[0]) and isinstance(value, Mapping) and not value:
            return None  # an empty section of an optional component: off (e.g. lora={})
        return _coerce(value, inner[0], path)
    if origin in (tuple, list, Sequence):
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


#: Keys that moved to the section of the component that reads them: old path -> new path. A
#: config that sets the old one is refused with the new one named; a checkpoint's recorded config
#: of the earlier layout is read with them moved (:func:`parse_config_record`).
MOVED_KEYS: Mapping[str, str] = {
    "engine.stall_timeout_s": "engine.client.stall_timeout_s",
    "engine.all_down_timeout_s": "engine.client.all_down_timeout_s",
    "engine.health_interval_s": "engine.supervisor.health_interval_s",
    "engine.health_timeout_s": "engine.supervisor.health_timeout_s",
    "engine.health_failures": "engine.supervisor.health_failures",
    "engine.max_restarts": "engine.supervisor.max_restarts",
}

#: Keys that were replaced, with what to write instead (an error, not a silent default).
RENAMED_KEYS: Mapping[str, Mapping[str, str]] = {
    "config.model": {
        "dtype": "was split into model.param_dtype (master weights + optimizer state, default float32) "
        "and model.compute_dtype (activations); e.g. compute_dtype='bfloat16' for bf16 compute",
    },
    "config.engine": {old.rpartition(".")[2]: f"moved to config.{new}" for old, new in MOVED_KEYS.items()},
}


#: Values a key took in earlier layouts, read as their current spelling (in config files, overrides and
#: the configs checkpoints recorded): key path -> ((old value, current value), ...).
OLD_VALUES: Mapping[str, tuple[tuple[Any, Any], ...]] = {
    "engine.prefix_sharing": ((True, "auto"), (False, "off")),
}


def _current_value(path: str, value: Any) -> Any:
    """``value`` of the key ``path`` (``config.a.b``) in its current spelling (:data:`OLD_VALUES`).

    >>> key = "config.engine.prefix_sharing"
    >>> _current_value(key, False), _current_value(key, 0), _current_value(key, "auto")
    ('off', 0, 'auto')
    """
    for old, new in OLD_VALUES.get(path.removeprefix("config."), ()):
        if type(value) is type(old) and value == old:
            return new
    return value


#: Mappings of the run config whose keys are names, each value a section of this class.
NAMED_SECTIONS: Mapping[str, type] = {"envs": EnvSection, "frozen_models": FrozenModelConfig}


def section_class(path: str) -> type | None:
    """The class whose fields are the keys of the config section at ``path`` (``"trainer"``,
    ``"warmstart.optimizer"``, ``"frozen_models.teacher"``; ``""`` = the run config), None when its
    keys are free-form or ``path`` is no section.

    >>> section_class("warmstart.optimizer").__name__, section_class("envs.lookup").__name__
    ('OptimizerConfig', 'EnvSection')
    >>> section_class("renderer.kwargs") is None
    True
    """
    cls: Any = RunConfig
    parts = path.split(".") if path else []
    while parts:
        part = parts.pop(0)
        if cls is RunConfig and part in NAMED_SECTIONS and parts:
            cls = NAMED_SECTIONS[part]
            parts.pop(0)
            continue
        field = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if field is None:
            return None
        spec = knobs.knob_of(field)
        if spec is not None and (spec.fields_of or spec.overrides_of):
            cls = spec.fields_of or spec.overrides_of
            continue
        hint = typing.get_type_hints(cls)[part]
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if not dataclasses.is_dataclass(inner[0]):
            return None
        cls = inner[0]
    return cls


def section_keys(path: str) -> list[str] | None:
    """The config keys of the section at ``path`` (:func:`section_class`; None: free-form or none).

    >>> section_keys("mesh")
    ['data', 'fsdp', 'tensor', 'expert', 'context']
    """
    cls = section_class(path)
    return None if cls is None else section_fields(cls)


def retired_key(path: str) -> str | None:
    """Why the config key ``path`` (``"engine.server.dtype"``) is not set here: it moved, was
    renamed, or the run sets it (None: it is not such a key).

    >>> retired_key("engine.server.dtype"), retired_key("trainer.seq_len")
    ('set by the run; use config.engine.dtype', None)
    """
    if path in MOVED_KEYS:
        return f"moved to config.{MOVED_KEYS[path]}"
    *parents, key = path.split(".")
    cls = section_class(".".join(parents))
    if cls is None:
        return None
    section = ".".join(["config", *parents])
    return RENAMED_KEYS.get(section, {}).get(key) or RUN_SET_FIELDS.get(cls, {}).get(key)


def section_fields(cls: type) -> list[str]:
    """The config keys of a section class: its dataclass fields less those the run sets."""
    run_set = RUN_SET_FIELDS.get(cls, {})
    return [f.name for f in dataclasses.fields(cls) if f.name not in run_set]


def _check_keys(cls: type, value: Mapping[str, Any], path: str) -> list[str]:
    """``cls``'s config keys; a key of ``value`` that is not one of them is an error naming it."""
    names = section_fields(cls)
    run_set = RUN_SET_FIELDS.get(cls, {})
    for key in value:
        if key in RENAMED_KEYS.get(path, {}):
            raise _fail(f"{path}.{key}", RENAMED_KEYS[path][key])
        if key in run_set:
            raise _fail(f"{path}.{key}", run_set[key])
        if key not in names:
            raise _fail(
                f"{path}.{key}", f"unknown key; {did_you_mean(key, names)}known keys of {path}: {names}"
            )
    return names


def _fields_of(cls: type, value: Any, path: str, *, defaults: bool = True) -> dict[str, Any]:
    """A mapping of ``cls``'s fields (``model.init``; ``defaults=False``: overrides of some of them,
    e.g. ``warmstart.optimizer``): each given key checked and typed by ``cls``, with ``defaults`` the
    others at ``cls``'s defaults (a field without one stays absent)."""
    if not isinstance(value, Mapping):
        raise _fail(path, f"expected a mapping of {cls.__name__} fields, got {value!r}")
    names = _check_keys(cls, value, path)
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in value:
            out[f.name] = _coerce(value[f.name], hints[f.name], f"{path}.{f.name}")
        elif defaults and f.name in names and f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def _parse_section(
    cls: type, value: Mapping[str, Any], path: str, run_set: Mapping[str, Any] | None = None
) -> Any:
    """The ``cls`` instance of the config section ``value`` at ``path`` (``run_set``: values of the
    fields the run sets); every mistake a ``ValueError`` naming its key."""
    names = _check_keys(cls, value, path)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = dict(run_set or {})
    for k, v in value.items():
        spec = knobs.knob_of(fields[k])
        v = _current_value(f"{path}.{k}", v)
        if spec is not None and spec.fields_of is not None:
            kwargs[k] = _fields_of(spec.fields_of, v, f"{path}.{k}")
        elif spec is not None and spec.overrides_of is not None:
            kwargs[k] = _fields_of(spec.overrides_of, v, f"{path}.{k}", defaults=False)
        else:
            kwargs[k] = _coerce(v, hints[k], f"{path}.{k}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # the component's own validation, with the key path
        field, sep, rest = str(e).partition(": ")
        field = field.removeprefix(f"{cls.__name__}.")
        if sep and field.partition(".")[0] in names:  # "[<Class>.]<field>[.<key>]: why" names its key
            raise _fail(f"{path}.{field}", rest) from None
        raise _fail(path, str(e)) from None


def _check_known(path: str, mapping: Mapping[str, Any], known: Any, what: str) -> None:
    for key in mapping:
        if key not in known:
            raise _fail(
                f"{path}.{key}", f"unknown key; {did_you_mean(key, known)}{what} accepts {sorted(known)}"
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
    if "CUDA_VISIBLE_DEVICES" in e.server.env:
        raise _fail("config.engine.server.env", "sets CUDA_VISIBLE_DEVICES; give engine.server_devices only")
    tensor_parallel = e.server.tensor_parallel_size
    for i, entry in enumerate(e.server_devices):
        devices = device_list(entry, f"{key}[{i}]")
        if len(devices) < tensor_parallel:
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
    stages = off_policy.ratio_stages(o.off_policy)
    if t.old_logprobs == "inference" and stages:
        raise _fail(
            f"config.objective.off_policy.{stages[0].partition('=')[0]}",
            f"{stages[0]} weighs old / rollout logprobs, but trainer.old_logprobs='inference' makes the old "
            "logprobs the rollout ones (the ratio is exactly 1, the correction never acts): set "
            "trainer.old_logprobs='recompute' (or 'auto'), or drop the key",
        )
    if o.kl_reference and cfg.lora is not None:
        raise _fail(
            "config.objective.kl_reference",
            "a LoRA run's KL reference is its base model with the initial adapter (its weights when RL "
            "starts): leave kl_reference empty",
        )


def _validate(cfg: RunConfig) -> RunConfig:
    """The rules between keys (each error names its key); a single key's type, range or allowed
    values are declared on its field and checked when its section is made."""
    if ":" in cfg.renderer.name:
        split_import_string(cfg.renderer.name, where="config.renderer.name")
    _check_model(cfg)
    _check_engine(cfg)
    _check_trainer(cfg)
    _check_old_logprobs(cfg)
    try:  # each key is checked by its section; their combination with the run's optimizer here
        cfg.critic_optimizer_config()
    except (TypeError, ValueError) as e:
        raise _fail("config.critic.optimizer", str(e)) from None
    try:
        cfg.optimizer_config(**cfg.warmstart.optimizer)
    except (TypeError, ValueError) as e:
        raise _fail("config.warmstart.optimizer", str(e)) from None
    _check_envs(cfg)
    for k in cfg.eval.pass_k:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= cfg.eval.group_size:
            raise _fail("config.eval.pass_k", f"each k must be an int in [1, eval.group_size], got {k!r}")
    unknown = sorted(set(cfg.env_algorithms) - set(cfg.envs))
    if unknown:
        raise _fail(
            "config.env_algorithms", f"names envs {unknown} that config.envs lacks ({sorted(cfg.envs)})"
        )
    return cfg


def _check_model(cfg: RunConfig) -> None:
    """The attention kernels against the context collective and the mesh."""
    if cfg.model.context_attention == "ring" and cfg.model.attention in ("cudnn", "cudnn_ragged"):
        raise _fail(
            "config.model.context_attention",
            f"'ring' merges partial softmaxes in XLA blocks; attention={cfg.model.attention!r} names a cuDNN "
            "kernel, which returns no log-normalizer to merge: use context_attention='all_gather' with it, "
            "or attention='auto' / 'xla' with the ring",
        )
    if cfg.mesh.context > 1 and cfg.trainer.seq_len % (2 * cfg.mesh.context):
        raise _fail(
            "config.mesh.context",
            f"trainer.seq_len={cfg.trainer.seq_len} must be a multiple of 2 x context = "
            f"{2 * cfg.mesh.context} (each device holds two load-balanced chunks of every row)",
        )


def _check_engine(cfg: RunConfig) -> None:
    """The engine's kind against in-flight updates, LoRA and the placement of launched servers."""
    e = cfg.engine
    if e.in_flight_updates == "keep" and e.kind != "vllm":
        raise _fail("config.engine.in_flight_updates", "'keep' needs vLLM servers (engine.kind='vllm')")
    if e.kind == "vllm" and e.in_flight_updates == "off" and e.sync.pause_mode == "keep":
        # VLLMClient refuses it too, but only once the servers run
        raise _fail(
            "config.engine.sync.pause_mode",
            "'keep' continues the requests in flight on the new weights, but without in-flight "
            "updates a completion carries one weight version: use 'wait' (default) or 'abort', or set "
            "engine.in_flight_updates ('recompute' or 'keep'), which records per-token versions",
        )
    if e.kind == "vllm" and e.in_flight_updates != "off" and e.sync.on_mismatch != "raise":
        raise _fail(
            "config.engine.sync.on_mismatch",
            f"in-flight updates (engine.in_flight_updates={e.in_flight_updates!r}) support 'raise' "
            f"only, got {e.sync.on_mismatch!r}",
        )
    _check_placement(e)
    if cfg.lora is not None and cfg.lora.unembed and e.kind != "embedded":
        raise _fail(
            "config.lora.targets",
            "'lm_head' (a LoRA adapter on the unembedding) runs with the embedded sampler only: syncing it "
            "to vLLM (as an adapter or merged into a tied model's output projection) is untested; drop "
            "'lm_head' or use engine.kind='embedded'",
        )
    if (
        cfg.lora is not None
        and e.kind == "vllm"
        and e.lora_sync == "adapter"
        and e.in_flight_updates != "off"
    ):
        # A vLLM request names its adapter (a versioned name per sync) for its whole life, so no
        # adapter sync reaches a request in flight; only the base weights could switch under it.
        raise _fail(
            "config.engine.in_flight_updates",
            f"{e.in_flight_updates!r} cannot switch a running vLLM request to a new LoRA adapter "
            "(a request keeps the adapter it names): use in_flight_updates='off' with "
            "lora_sync='adapter' (each turn is sampled by one adapter version, the next turn names the "
            "newest), or lora_sync='merged' to switch full merged weights in flight",
        )


def _check_trainer(cfg: RunConfig) -> None:
    """Micro-batches against rows, mini-batches against the step, the filters."""
    t = cfg.trainer
    if t.micro_batch_tokens and t.micro_batch_tokens < t.seq_len:
        raise _fail(
            "config.trainer.micro_batch_tokens",
            f"{t.micro_batch_tokens} is smaller than one packed row (trainer.seq_len={t.seq_len}); a "
            "micro-batch holds whole rows: use a multiple of seq_len, or 0 for no micro-batching",
        )
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


def _check_envs(cfg: RunConfig) -> None:
    """Each env's sources of tasks and of episodes (one of each), and the warm start's demonstrations."""
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


def parse_run_config(config: Any) -> RunConfig:
    """The :class:`RunConfig` of an ml_collections config (or nested dict); missing keys take defaults."""
    raw = _plain(config) if config is not None else {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"config: expected a ConfigDict or mapping, got {type(config).__name__}")
    raw = dict(raw)
    envs = raw.pop("envs", None)
    frozen = raw.pop("frozen_models", None)
    cfg = _parse_section(RunConfig, raw, "config")
    if frozen is not None:
        cfg = dataclasses.replace(cfg, frozen_models=_parse_frozen_models(frozen))
    if envs is not None:
        if not isinstance(envs, Mapping):
            raise _fail("config.envs", f"expected a mapping env name -> dict(env=..., ...), got {envs!r}")
        parsed = {}
        for name, spec in envs.items():
            spec = {} if spec is None else spec
            env = _coerce(spec, EnvSection, f"config.envs.{name}")
            parsed[str(name)] = env if env.env else dataclasses.replace(env, env=str(name))
        cfg = dataclasses.replace(cfg, envs=parsed)
    return _validate(cfg)


def _parse_frozen_models(value: Any) -> dict[str, Any]:
    """``config.frozen_models``: each entry checked as the :class:`FrozenModelConfig` named by its key
    (a mistake names ``config.frozen_models.<name>.<field>``); the entries are kept as given."""
    path = "config.frozen_models"
    if not isinstance(value, Mapping):
        raise _fail(path, f"expected a mapping name -> dict(base_url=..., ...), got {value!r}")
    out = {}
    for name, entry in value.items():
        where = f"{path}.{name}"
        if not isinstance(entry, Mapping):
            raise _fail(
                where,
                "expected a mapping of FrozenModelConfig fields such as "
                f"dict(base_url='http://127.0.0.1:8001'), got {entry!r}",
            )
        given = {k: v for k, v in entry.items() if not (k == "name" and v == name)}
        _check_keys(FrozenModelConfig, given, where)
        if given.get("base_url") is None:
            raise _fail(f"{where}.base_url", "required: the server's URL, e.g. 'http://127.0.0.1:8001'")
        _parse_section(FrozenModelConfig, given, where, run_set={"name": str(name)})
        out[str(name)] = dict(entry)
    return out


def parse_config_record(record: Mapping[str, Any]) -> RunConfig:
    """The :class:`RunConfig` of a config as a checkpoint recorded it (:func:`config_record`), of
    this layout or an earlier one: keys that moved (:data:`MOVED_KEYS`) are read at their new path,
    and an ``engine.server.dtype`` that restates the dtype ``engine.dtype`` serves is dropped (the
    run sets it now; a different one is refused: it served another dtype than this layout would).

    >>> parse_config_record({"engine": {"stall_timeout_s": 30.0}}).engine.client.stall_timeout_s
    30.0
    """
    raw = _plain(record)
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if isinstance(raw.get(section), Mapping) and key in raw[section]:
            value = raw[section].pop(key)
            node = raw
            *parents, leaf = new.split(".")
            for part in parents:
                node[part] = dict(node.get(part) or {})
                node = node[part]
            node.setdefault(leaf, value)
    server = raw.get("engine", {}).get("server")
    if isinstance(server, Mapping) and "dtype" in server:
        engine, model = RunConfig().engine, RunConfig().model
        kind = raw["engine"].get("dtype", engine.dtype)
        compute = (raw.get("model") or {}).get("compute_dtype", model.compute_dtype)
        served = compute if kind == "auto" else kind
        if server["dtype"] == served:
            raw["engine"]["server"] = {k: v for k, v in server.items() if k != "dtype"}
    return parse_run_config(raw)


# ------------------------------------------------------------------------------------------------
# The defaults as a ConfigDict (configs/default.py) and the comparison used by --resume
# ------------------------------------------------------------------------------------------------


def _object_field(hint: Any) -> bool:
    """Whether a field of type ``hint`` is an object field of the ConfigDict: one whose values may be
    None, a list or tuple, or of any type (``--config.<key>=<Python literal>`` sets it whole)."""
    if hint is Any or hint in (tuple, list):
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return True
    return origin in (tuple, list)


def _to_config(value: Any, path: str, hint: Any = None) -> Any:
    """``value`` (of a field typed ``hint``; None: an entry of a free mapping) as a ConfigDict entry:
    sections and mappings as nested ConfigDicts, object fields (:func:`_object_field`) and None as
    ``FieldReference(field_type=object)``."""
    from ml_collections import config_dict

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = typing.get_type_hints(type(value))
        section = config_dict.ConfigDict()
        for name in section_fields(type(value)):
            section[name] = _to_config(getattr(value, name), f"{path}.{name}" if path else name, hints[name])
        return section
    parts = path.split(".")
    env_dataset = len(parts) == 3 and parts[0] == "envs" and parts[2] == "dataset"  # set whole
    # a key of OLD_VALUES takes its earlier values too (True / False of a bool that is a string now)
    if value is None or env_dataset or path in OLD_VALUES or (hint is not None and _object_field(hint)):
        return config_dict.FieldReference(value, field_type=object)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # the ConfigDict's type of the key is its field's: 1.0 may be set later
    if isinstance(value, Mapping):
        c = config_dict.ConfigDict()
        for k, v in value.items():
            c[k] = _to_config(v, f"{path}.{k}" if path else k)
        return c
    return value


def default_config() -> Any:
    """The defaults of :class:`RunConfig` as an ml_collections ``ConfigDict`` (``configs/default.py``).

    Every section is a nested ConfigDict, so any key is set by ``--config.<path>=<value>`` (e.g.
    ``--config.objective.off_policy.tis_ratio_type=token``). Fields whose values are lists, tuples, None
    or of any type (``algorithm``, ``trainer.filters``, ...) are object fields, so
    ``--config.trainer.filters="[{'name': 'overlong', 'mode': 'enforce'}]"`` works (a Python literal:
    ml_collections parses the value with ``ast.literal_eval``, so ``dict(...)`` calls stay a string).
    """
    return _to_config(RunConfig(), "")


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
    "engine.supervisor",
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
