"""The run object: a run's parts apart from its loop, shared by every front door.

A :class:`Run` is built once from the parsed config (:func:`rljax.run.config.parse_run_config`).
It owns

* the policy :class:`~rljax.training.step.TrainState` (a LoRA run's frozen base inside it), PPO's
  critic state, the tokenizer and renderer;
* the engines (:class:`~rljax.run.engines.EngineSet`) with their weight sync, the rollout
  scheduler (behaviour versions, task order) and the reference scorers (opd / opsd);
* ONE checkpoint state tree (:meth:`Run.state_tree`): what :meth:`Run.save`, :meth:`Run.restore`,
  ``rljax eval`` (:meth:`Run.load_policy`) and ``rljax export`` read and write, with the item
  names of :data:`POLICY`, :data:`LORA_BASE`, :data:`CRITIC` and :data:`BEHAVIOR` stated here once.

Its public methods are what a front door needs: :meth:`Run.forward` (logprobs of a packed batch),
:meth:`Run.forward_backward` + :meth:`Run.optim_step` (gradients accumulated over calls, one update),
:meth:`Run.train` (the fused jitted step the trainer loop uses), :meth:`Run.sample`,
:meth:`Run.score`, :meth:`Run.sync_weights`, :meth:`Run.save` / :meth:`Run.restore`. The RL loop
itself (rollout -> prepare -> train -> sync -> report -> checkpoint) is
:class:`rljax.run.trainer.Trainer`; an OpenAI-compatible gateway or a training API sits on a
``Run`` the same way.

Model of the split: Tunix's RL cluster (models, engines, weight sync) vs its learner (the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import pathlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import algorithms as algos
from rljax.chat import make_renderer
from rljax.core.objective import ObjectiveConfig, combine_metrics
from rljax.data.micro_batch import micro_batch_rows, split_by_token_budget
from rljax.data.pack import PackResult
from rljax.envs.base import Task
from rljax.envs.loader import LoadError
from rljax.inference.engine import Completion, SamplingParams
from rljax.models.lora import apply_lora, merge_lora
from rljax.models.value import ValueModel, load_value_model
from rljax.run.builders import (
    DTYPE_OF,
    build_model,
    build_tokenizer,
    check_extras,
    check_run,
    objective_config,
    old_logprobs_choice,
)
from rljax.run.config import (
    RunConfig,
    config_record,
    critic_config,
    parse_run_config,
)
from rljax.run.engines import EngineSet, resolve_frozen_models
from rljax.run.references import ReferenceScorers
from rljax.run.scheduler import RolloutScheduler, derive_seed
from rljax.run.streaming import StreamingScheduler
from rljax.run.tasks import build_env_tasks
from rljax.run.worker import Worker
from rljax.training import checkpoint as ckpt
from rljax.training import sharding as train_sharding
from rljax.training.critic import critic_step, critic_values, ppo_advantages
from rljax.training.distributed import host_local_copy
from rljax.training.memory import device_peak_bytes, step_memory_metrics
from rljax.training.step import (
    TrainConfig,
    TrainState,
    apply_gradients,
    loss_and_grads,
    merge_model,
    mini_batch_counts,
    policy_logprobs,
    train_mini_batch,
    train_step,
    with_logit_capacity,
)

__all__ = [
    "BEHAVIOR",
    "CRITIC",
    "LORA_BASE",
    "POLICY",
    "REFERENCE",
    "Run",
    "mini_batch_groups",
    "resolve_prefix_sharing",
]

logger = logging.getLogger(__name__)


#: Checkpoint items of the state tree (``params/<item>``): the trained policy parameters (a LoRA
#: run: its adapters), a LoRA run's base when the warm start trained it, PPO's critic, the
#: behaviour parameters async rollouts still need (``behavior/<version>``), and the KL penalty's
#: reference policy when it is the run's own initial weights.
POLICY, LORA_BASE, CRITIC, BEHAVIOR, REFERENCE = "policy", "lora_base", "critic", "behavior", "reference"


def resolve_prefix_sharing(setting: str, model: Any, *, critic: Any = None) -> bool:
    """Whether ``trainer.prefix_sharing=setting`` packs this run's mini-batches as prefix trees (design
    §2.6), logged with the reason: ``"auto"`` does when the policy (and PPO's critic, a
    :class:`rljax.models.value.ValueModel`) declare that
    they compute tree rows exactly (``prefix_tree_rows``, :class:`rljax.models.Decoder`); an attention
    backend that cannot take the tree mask runs the exact one that can
    (:func:`rljax.models.attention_backends.tree_attention_backend`), which is logged too.

    >>> from rljax.models.tiny import tiny_model
    >>> resolve_prefix_sharing("auto", tiny_model()), resolve_prefix_sharing("off", tiny_model())
    (True, False)
    """
    from rljax.models.attention_backends import resolve_attention, tree_attention_backend

    if setting == "off":
        return False
    for name, m in (("policy", model), ("critic", critic)):
        if m is not None and not getattr(m, "prefix_tree_rows", False):
            logger.warning(
                "trainer.prefix_sharing=%r: off (the %s model %s does not compute prefix-tree rows; its "
                "layers may carry state along the token order)", setting, name, type(m).__name__,
            )  # fmt: skip
            return False
    backend = resolve_attention(
        getattr(model, "attention", "auto"), dtype=getattr(model, "dtype", jnp.float32)
    )
    tree_backend, reason = tree_attention_backend(backend)
    if reason is None:
        logger.info("trainer.prefix_sharing=%r: on (attention %r)", setting, backend)
    else:
        logger.warning(
            "trainer.prefix_sharing=%r: on; tree rows run attention %r instead of %r: %s",
            setting, tree_backend, backend, reason,
        )  # fmt: skip
    return True


def mini_batch_groups(num_groups: int, mini_batch_prompts: int, algorithm: str) -> int:
    """Prompt groups per mini-batch for an algorithm's ``num_groups`` groups of one RL step.

    ``mini_batch_prompts`` (0 = one mini-batch) divides ``trainer.prompts_per_step`` (checked at
    parse time), but a run that mixes algorithms over envs gives each algorithm only its share of a
    step's groups, which it may not divide; that share then trains as ONE mini-batch, and a warning
    says so (it changes the number of optimizer steps).

    >>> mini_batch_groups(8, 4, "grpo"), mini_batch_groups(8, 0, "grpo")
    (4, 8)
    """
    per_mb = mini_batch_prompts or num_groups
    if num_groups % per_mb:
        warnings.warn(
            f"algorithm {algorithm!r} has {num_groups} prompt groups this step, which "
            f"trainer.mini_batch_prompts={mini_batch_prompts} does not divide (a run mixing algorithms "
            "gives each its share of the step's groups); they train as one mini-batch",
            stacklevel=2,
        )
        return num_groups
    return per_mb


class Run:
    """The parts of a run, built once from its config (see the module docstring).

    Args:
      config: the run config (a ConfigDict, a nested dict or a parsed :class:`RunConfig`).
      workdir: the run's directory (checkpoints in ``checkpoints/``; a launched vLLM server's initial
        weights, multi-process weight versions).
      make_env: optional ``{env name: zero-argument factory}`` overriding envs of ``config.envs``.
      tasks: optional ``{env name: (train tasks, eval tasks)}`` overriding envs' task makers.
      engine: optional policy engine (anything with ``generate`` / ``update_weights``).
      rollouts: build the envs, engines, scheduler and references (False: the model parts only,
        enough to restore and export a checkpoint's weights).
      optimizer: hold the policy's optimizer state (False: parameters only, for a holder that never
        trains through this run, such as the Tinker API's base model).
    """

    def __init__(
        self,
        config: Any,
        workdir: str | pathlib.Path,
        *,
        make_env: Mapping[str, Callable[[], Any]] | None = None,
        tasks: Mapping[str, tuple[Sequence[Task], Sequence[Task]]] | None = None,
        engine: Any = None,
        rollouts: bool = True,
        optimizer: bool = True,
    ) -> None:
        cfg = self.cfg = config if isinstance(config, RunConfig) else parse_run_config(config)
        check_extras(cfg)
        self.workdir = pathlib.Path(workdir).absolute()
        self.ckpt_dir = self.workdir / "checkpoints"
        self.processes = jax.process_count()
        self._frozen_local: Any = None  # a multi-process run: the frozen base, whole on this process
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        try:
            self.renderer = make_renderer(cfg.renderer.name, self.tokenizer, **cfg.renderer.kwargs)
        except LoadError as e:  # a "module:attr" name that does not import
            raise ValueError(f"config.renderer.name: {e}") from None
        model = build_model(cfg.model, vocab_size=len(self.tokenizer), seed=cfg.seed)
        if cfg.lora:  # adapter-only training: the base is frozen (TrainState.frozen)
            apply_lora(model, cfg.lora, rngs=nnx.Rngs(derive_seed(cfg.seed, 0x10A)))
        self.model_vocab = int(model.config.vocab_size)
        self.env_tasks = build_env_tasks(cfg, make_env=make_env, tasks=tasks) if rollouts else None
        self.algorithms = algos.validate_algorithm_config(
            cfg.algorithm,
            env_overrides=cfg.env_algorithms,
            group_size=cfg.rollout.group_size,
        )
        check_run(  # the rules between the parts, before anything expensive is built
            cfg,
            algorithms=self.algorithms,
            model_config=model.config,
            env_tasks=self.env_tasks,
            renderer=self.renderer,
            process_count=self.processes,
            device_count=jax.device_count(),
        )
        self.train_configs = {a.name: self._train_config(a) for a in self.algorithms.algorithms}
        #: algorithm -> ("recompute" | "inference", why): where its old (proximal) logprobs come from
        stale = 0 if cfg.trainer.mode == "sync" else cfg.trainer.max_off_policy_steps
        self.old_logprobs = {
            name: old_logprobs_choice(cfg.trainer.old_logprobs, tc.objective, stale_versions=stale)
            for name, tc in self.train_configs.items()
        }
        #: the KL penalty's frozen reference policy (structured like the state's params), once set
        self.reference_params: Any = None
        self.reference_in_checkpoint = (
            any(tc.objective.kl_coef for tc in self.train_configs.values()) and not cfg.objective.kl_reference
        )
        self.mesh = cfg.mesh.make() if cfg.uses_mesh else None
        self.data_parallel = 1 if self.mesh is None else train_sharding.batch_parallelism(self.mesh)
        self.critic_config = critic_config(cfg.critic)
        self.critic = self._build_critic(model) if self.algorithms.needs_critic else None
        self.prefix_sharing = resolve_prefix_sharing(
            cfg.trainer.prefix_sharing, model, critic=None if self.critic is None else self.critic.model
        )
        self.state = TrainState.create(
            model, self.train_configs[self.algorithms.default.name], mesh=self.mesh, with_optimizer=optimizer
        )
        self.base_in_checkpoint = bool(cfg.lora) and cfg.warmstart.num_steps > 0
        self.np_rng = np.random.default_rng(derive_seed(cfg.seed, 0xB47C))  # mini-batch shuffles
        self._pending: tuple[Any, dict[str, Any]] | None = None  # forward_backward's summed grads
        self._step_memory: dict[Any, dict[str, float]] = {}
        self._most_micro_batches: dict[int, int] = {}  # per row length: the most micro-batches of a step
        self.engines: EngineSet | None = None
        self.scheduler: RolloutScheduler | None = None
        if rollouts:
            self._build_rollout_parts(engine)

    def _train_config(self, algorithm: algos.Algorithm) -> TrainConfig:
        c = self.cfg
        return TrainConfig(
            objective=objective_config(algorithm, c.objective, prompts_per_step=c.trainer.prompts_per_step),
            optimizer=c.optimizer_config(),
            router_replay=c.model.router_replay == "r3",
            moe_aux_loss_coef=c.objective.moe_aux_loss_coef,
            router_z_loss_coef=c.objective.router_z_loss_coef,
            loss_only_logits=c.trainer.loss_only_logits,
        )

    def build_engines(self, *, frozen_models: bool = True, engine: Any = None) -> EngineSet:
        """The run's engines as ``config.engine`` describes them (nothing started yet: the policy
        engine starts with :meth:`EngineSet.start_policy`). ``frozen_models``: with the config's
        frozen models (False: the policy engine only, as the Tinker API serves it); ``engine``: a
        policy engine object to use instead of building one."""
        cfg = self.cfg
        return EngineSet(
            cfg.engine,
            resolve_frozen_models(cfg.frozen_models, self.algorithms) if frozen_models else {},
            workdir=self.workdir,
            seed=cfg.seed,
            engine_override=engine,
            dtype=cfg.engine_dtype,
        )

    def _build_rollout_parts(self, engine: Any) -> None:
        cfg = self.cfg
        self.engines = self.build_engines(engine=engine)
        self.rollout_worker = Worker("rljax-rollout")
        self.scoring_worker = Worker("rljax-scoring")  # teacher scoring, beside the rollouts
        self.references = ReferenceScorers(
            self.engines, self.scoring_worker, self.renderer, self.env_tasks.by_id(), self.score
        )
        scheduler = StreamingScheduler if cfg.trainer.mode == "fully_async" else RolloutScheduler
        self.scheduler = scheduler(
            cfg,
            self.env_tasks,
            self.renderer,
            self.engines,
            self.algorithms,
            vocab_size=self.model_vocab,
            worker=self.rollout_worker,
            to_model=self.served_model,
            localize=self._localizer(),
        )

    def _build_critic(self, policy: nnx.Module) -> TrainState:
        """PPO's critic: ``critic.hf_path`` or the policy's initial weights with a zero value head."""
        c = self.cfg
        if c.critic.hf_path:
            vm = load_value_model(
                c.critic.hf_path,
                dtype=DTYPE_OF[c.model.compute_dtype],
                param_dtype=DTYPE_OF[c.model.param_dtype],
                remat=c.model.remat,
            )
        else:  # a full critic (a LoRA policy's adapters are folded into its copy)
            vm = ValueModel.from_policy(merge_lora(policy) if c.lora else policy, rngs=nnx.Rngs(c.seed))
        return TrainState.create(vm, TrainConfig(optimizer=c.critic_optimizer_config()), mesh=self.mesh)

    # -- models ------------------------------------------------------------------------------------------
    def model_of(self, params: Any) -> nnx.Module:
        """A fresh NNX model of ``params`` with the state's frozen weights (a LoRA run's base)."""
        return merge_model(self.state.graphdef, params, self.state.frozen)

    def current_model(self) -> nnx.Module:
        """An NNX model holding the current policy parameters."""
        return self.model_of(self.state.params)

    def snapshot(self) -> Any:
        """A copy of the policy parameters (the jitted steps donate the state's own arrays)."""
        return jax.tree.map(jnp.copy, self.state.params)

    # -- several processes -------------------------------------------------------------------------------
    def _localizer(self) -> Callable[[int, Any], Any] | None:
        """What a multi-process run's engine serves for a version's parameters
        (:attr:`RolloutScheduler.served`): full-weight vLLM syncs get the version written once by
        every process together (:meth:`_write_for_servers`); the embedded sampler and LoRA adapter
        syncs get a process-local copy (:meth:`_process_local`). One process: the parameters."""
        if self.processes == 1:
            return None
        e = self.cfg.engine
        if e.kind == "vllm" and not (self.cfg.lora and e.lora_sync == "adapter"):
            return self._write_for_servers
        return lambda version, params: self._process_local(params)

    @staticmethod
    def _process_local(tree: Any) -> Any:
        """A copy of (cross-process sharded) arrays whole on this process's first device: what its
        engine serves. Memory: the whole tree per host. Main thread only (it all-gathers)."""
        return jax.device_put(host_local_copy(tree), jax.local_devices()[0])

    def _write_for_servers(self, version: int, params: Any) -> Any:
        """Writes weight ``version`` for the vLLM servers of every process (``workdir/weights/v<N>``,
        each host holding one whole parameter at a time) with the probe logprobs its syncs verify."""
        from rljax.inference.vllm import write_distributed

        model = self.engines.served(merge_model(self.state.graphdef, params, self.state.frozen))
        directory = self.workdir / "weights" / f"v{version}"
        return write_distributed(model, directory, config=self.cfg.engine.sync)

    def served_model(self, params: Any) -> Any:
        """The model the policy engine serves for behaviour ``params`` (:attr:`RolloutScheduler.served`);
        weights already written for vLLM servers pass through."""
        from rljax.inference.vllm import WrittenWeights

        if isinstance(params, WrittenWeights):
            return params
        frozen = self.state.frozen if self.processes == 1 else self._frozen_local
        return merge_model(self.state.graphdef, params, frozen)

    def _refresh_frozen_local(self) -> None:
        """A multi-process run: a process-local copy of the frozen base (what its engine serves)."""
        if self.processes > 1:
            self._frozen_local = self._process_local(self.state.frozen)

    # -- the state tree and checkpoints ----------------------------------------------------------------
    def state_tree(self, behavior: Mapping[int, Any]) -> dict[str, Any]:
        """The ``params`` and ``opt_state`` items of a checkpoint: THE tree :meth:`save` writes and
        :meth:`restore` reads (with ``behavior`` = templates of the versions to restore)."""
        params = {POLICY: self.state.params, BEHAVIOR: {str(v): p for v, p in behavior.items()}}
        opt_state = {"opt": self.state.opt_state, "step": self.state.step, "skipped": self.state.skipped}
        if self.critic is not None:
            params[CRITIC] = self.critic.params
            opt_state.update(critic_opt=self.critic.opt_state, critic_step=self.critic.step,
                             critic_skipped=self.critic.skipped)  # fmt: skip
        if self.base_in_checkpoint:  # the warm start trained the base: not what the config builds
            params[LORA_BASE] = self.state.frozen
        if self.reference_in_checkpoint:  # the policy at RL step 0: nothing else can rebuild it
            params[REFERENCE] = self.state.params if self.reference_params is None else self.reference_params
        return {"params": params, "opt_state": opt_state}

    def _load_state_tree(self, params: Mapping[str, Any], opt_state: Mapping[str, Any]) -> None:
        if self.reference_in_checkpoint:
            self.reference_params = params[REFERENCE]
        self.state = dataclasses.replace(
            self.state,
            params=params[POLICY],
            frozen=params[LORA_BASE] if self.base_in_checkpoint else self.state.frozen,
            opt_state=opt_state["opt"],
            step=opt_state["step"],
            skipped=opt_state["skipped"],
        )
        if self.critic is not None:
            self.critic = dataclasses.replace(
                self.critic,
                params=params[CRITIC],
                opt_state=opt_state["critic_opt"],
                step=opt_state["critic_step"],
                skipped=opt_state["critic_skipped"],
            )

    def save(self, step: int) -> None:
        """Checkpoint ``step``: the state tree, the behaviour versions rollouts of steps ``step ..``
        still need, the task order, the mini-batch RNG and the config."""
        sched = self.scheduler
        behavior = {v: sched.behavior[v] for v in sched.needed_versions(step)}
        ckpt.save(
            self.ckpt_dir,
            step,
            **self.state_tree(behavior),
            data_state={"tasks": sched.data_state(step), "step": step},
            rng={"minibatch": self.np_rng},
            config=config_record(self.cfg),
            keep=self.cfg.trainer.keep_checkpoints or None,
            overwrite=True,
        )

    def restore(self, *, allow_config_change: bool = False) -> int:
        """Restores the newest intact checkpoint of :attr:`ckpt_dir`; returns its step.

        A damaged checkpoint (checksums that do not match, missing or truncated files) is never
        trained from: it is skipped with a warning naming it and why, and the next older intact
        one is used. A config that differs from the checkpoint's in a result-changing key is an
        error (``allow_config_change`` overrides)."""
        step, damaged = ckpt.latest_intact_step(self.ckpt_dir) if self.ckpt_dir.exists() else (None, [])
        for bad, why in damaged:
            warnings.warn(
                f"--resume: checkpoint {self.ckpt_dir / f'step_{bad}'} is damaged and is skipped: {why}"
                + ("" if step is None else f"; resuming from step_{step}"),
                stacklevel=2,
            )
        if step is None:
            found = f" that is intact (damaged: {[f'step_{s}' for s, _ in damaged]})" if damaged else ""
            raise FileNotFoundError(
                f"--resume: {self.ckpt_dir} holds no complete checkpoint{found}, so there is nothing "
                "to resume; start a new run (drop --resume) or point --workdir at the run to continue"
            )
        behavior = {v: self.state.params for v in self.scheduler.needed_versions(step)}
        stored = stored_abstract(self.ckpt_dir, step, "params") or {}
        if self.reference_in_checkpoint and REFERENCE not in stored:
            raise ValueError(
                f"--resume: checkpoint step_{step} holds no KL reference policy (it was trained without "
                "objective.kl_loss_coef), so the penalty's reference (the weights when RL started) is "
                "gone; set objective.kl_reference to an HF checkpoint directory, or start a new run"
            )
        r = ckpt.restore(self.ckpt_dir, **self.state_tree(behavior), step=step, verify=False)  # verified
        if not allow_config_change:
            self._check_resumed_config(r.config, step)
        self._load_state_tree(r.params, r.opt_state)
        for v, p in sorted(r.params[BEHAVIOR].items(), key=lambda item: int(item[0])):
            self.scheduler.add_version(int(v), p)
        self.scheduler.restore(r.data_state)
        self.np_rng = r.rng["minibatch"]
        return step

    def _check_resumed_config(self, saved: Any, step: int) -> None:
        from rljax.run.preflight import check_resumed_config

        check_resumed_config(saved, self.cfg, step)

    def load_policy(self, directory: str | pathlib.Path, step: int, *, verify: bool = True) -> None:
        """Puts the policy weights of checkpoint ``step`` of ``directory`` into this run (the state's
        parameters; a LoRA run's saved base too): what eval and export serve. Shapes and dtypes must
        match this run's model (use the training config). Only the parameter files are verified and
        read (:func:`rljax.training.checkpoint.restore_params`), not the optimizer state; the other
        stored parameters (a warm start's reference, behaviour versions) are read as host arrays and
        dropped. Damaged parameter files raise
        :class:`rljax.training.checkpoint.CheckpointCorruptedError` (``verify=False``: the caller
        has just verified them)."""
        directory = pathlib.Path(directory)
        stored = stored_abstract(directory, step, "params") or {}
        target = {**stored, POLICY: self.state.params}
        if LORA_BASE in stored:
            target[LORA_BASE] = self.state.frozen
        params = ckpt.restore_params(directory, params=target, step=step, verify=verify)
        frozen = params[LORA_BASE] if LORA_BASE in stored else self.state.frozen
        self.state = dataclasses.replace(self.state, params=params[POLICY], frozen=frozen)

    # -- training --------------------------------------------------------------------------------------
    def train(self, batch: Any, *, algorithm: str) -> dict[str, float]:
        """One optimizer step of the policy on a packed mini-batch (``[R, L]`` host arrays) with
        ``algorithm``'s objective: the jitted :func:`~rljax.training.step.train_step`, or
        :func:`~rljax.training.step.train_mini_batch` over micro-batches of at most
        ``trainer.micro_batch_tokens`` tokens. Returns the step's scalar metrics (``memory/*`` too)."""
        tcfg = self.train_configs[algorithm]
        self.state = dataclasses.replace(self.state, config=tcfg)
        step_fn, packed = self._place(batch)
        counts = mini_batch_counts(packed, tcfg.objective)
        memory = self._memory_metrics(step_fn, packed, counts)
        self.state, m = step_fn(self.state, packed, counts)
        row = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
        row.update(memory)
        return row

    def with_policy_logprobs(self, batch: Any, *, algorithm: str) -> Any:
        """``batch`` (a packed mini-batch of host arrays) with the logprobs ``algorithm``'s objective
        reads from other policies than the one being trained: ``old_logprobs`` recomputed under the
        current weights when the algorithm recomputes them (:attr:`old_logprobs`; call it for every
        mini-batch of an RL step BEFORE the step's first update, so they are the proximal policy's,
        design §3.4) and ``kl_reference_logprobs`` under :attr:`reference_params` with a KL penalty.
        Each is one jitted forward without gradients, micro-batched and sharded like the train step.
        Both are the trainable tokens' only (0 elsewhere, as the packer writes old logprobs): the
        objective reads no other, and with ``trainer.loss_only_logits`` no other meets the vocabulary."""
        tcfg = self.train_configs[algorithm]
        recompute = self.old_logprobs[algorithm][0] == "recompute"
        penalty = tcfg.objective.kl_coef != 0.0
        if not (recompute or penalty):
            return batch
        if penalty and self.reference_params is None:
            raise ValueError("the KL penalty's reference policy is not set (Run.set_reference)")
        self.state = dataclasses.replace(self.state, config=tcfg)
        _, placed = self._place(batch)
        rows, length = np.shape(batch.tokens)

        def host(logp: Any) -> np.ndarray:  # micro-batches (padded with empty rows) back to [R, L]
            return np.asarray(host_local_copy(logp), np.float32).reshape(-1, length)[:rows]

        changes = {}
        with self._context_scope():
            if recompute:
                trained = np.asarray(batch.loss_mask) != 0
                changes["old_logprobs"] = np.where(trained, host(policy_logprobs(self.state, placed)), 0.0)
            if penalty:
                ref = policy_logprobs(self.state, placed, self.reference_params)
                changes["kl_reference_logprobs"] = host(ref)
        return batch.replace(**changes)

    def set_reference(self) -> None:
        """Fixes the KL penalty's reference policy (when an algorithm has one): the current weights
        (``objective.kl_reference`` empty: call it when RL starts) or the HF checkpoint it names, placed
        like the policy's parameters."""
        if not any(tc.objective.kl_coef for tc in self.train_configs.values()):
            return
        path = self.cfg.objective.kl_reference
        if not path:
            self.reference_params = self.snapshot()
            return
        model = build_model(dataclasses.replace(self.cfg.model, hf_path=path), vocab_size=self.model_vocab,
                            seed=self.cfg.seed)  # fmt: skip
        params = nnx.state(model, nnx.Param)
        same = jax.tree.structure(self.state.params) == jax.tree.structure(params) and [
            np.shape(x) for x in jax.tree.leaves(self.state.params)
        ] == [np.shape(x) for x in jax.tree.leaves(params)]
        if not same:
            raise ValueError(
                f"config.objective.kl_reference={path!r}: its weights do not have the policy's structure "
                "and shapes (a reference must be the same architecture as the policy)"
            )
        shardings = jax.tree.map(lambda x: x.sharding, self.state.params)
        self.reference_params = jax.device_put(jax.tree.map(jnp.asarray, params), shardings)

    def forward_backward(
        self, batch: Any, *, algorithm: str | None = None, objective: ObjectiveConfig | None = None
    ) -> dict[str, float]:
        """Gradients of an objective on a packed batch, ADDED to those of earlier calls since the
        last :meth:`optim_step` (each call's objective divides by its own token counts); returns the
        call's scalar metrics. The objective is ``algorithm``'s (default: the run's default
        algorithm) or ``objective`` (any loss of :mod:`rljax.core.losses`, reductions, components).
        Nothing is updated until :meth:`optim_step`."""
        tcfg = self.train_configs[algorithm or self.algorithms.default.name]
        if objective is not None:
            tcfg = dataclasses.replace(tcfg, objective=objective)
        self.state = with_logit_capacity(dataclasses.replace(self.state, config=tcfg), batch)
        packed = self._shard(batch)
        counts = mini_batch_counts(packed, self.state.config.objective)
        grads, metrics = _jit_loss_and_grads(self.state, packed, counts)
        pending = (grads, metrics)
        if self._pending is not None:
            total, summed = self._pending
            pending = (jax.tree.map(jnp.add, total, grads), combine_metrics(summed, metrics))
        self._pending = pending
        return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}

    def optim_step(self) -> dict[str, float]:
        """Applies the gradients summed by :meth:`forward_backward` (one AdamW update, skipped when
        not finite); an error when there are none."""
        if self._pending is None:
            raise ValueError("optim_step: no gradients; call forward_backward first")
        grads, metrics = self._pending
        self._pending = None
        self.state, m = _jit_apply_gradients(self.state, grads, metrics)
        return {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}

    def forward(self, batch: Any) -> np.ndarray:
        """Per-token logprobs of the current policy on a packed batch (``[R, L]``; 0 at each sample's
        first token and on padding), logits divided by ``batch.temperatures``."""
        packed = self._shard(batch)
        with self._context_scope():
            out = _jit_packed_logprobs(self.state.graphdef, self.state.params, self.state.frozen, packed)
        return np.asarray(host_local_copy(out), np.float32)

    def critic_mini_batches(
        self, mini_batches: list[PackResult], rl_step: int, links: Sequence[np.ndarray] | None = None
    ) -> tuple[list[PackResult], list[dict[str, float]]]:
        """PPO: old values and GAE advantages of every mini-batch (all before any update), then one
        critic step per mini-batch. ``links``: per mini-batch, the links of its trajectories' turns
        (:func:`rljax.data.credit.turn_links`; None: none). Returns the mini-batches carrying their
        advantages for the policy steps (none during the critic warm-up, ``rl_step <
        critic.warmup_steps``) and the critic steps' metric rows."""
        cc = self.critic_config
        staged = []
        for k, mb in enumerate(mini_batches):
            placed = self._shard(mb.batch)
            old_values = critic_values(self.critic, placed)
            advantages, returns = ppo_advantages(old_values, placed, cc, None if links is None else links[k])
            staged.append((mb, placed, old_values, advantages, returns))
        out, rows = [], []
        for mb, placed, old_values, advantages, returns in staged:
            self.critic, m = critic_step(self.critic, placed, old_values, returns, cc)
            row = {k: float(v) for k, v in jax.device_get(m).items()}
            rows.append(row)
            adv = np.asarray(host_local_copy(advantages), np.float32)
            if rl_step >= cc.warmup_steps:
                out.append(dataclasses.replace(mb, batch=mb.batch.replace(advantages=adv)))
        return out, rows

    def _shard(self, batch: Any) -> Any:
        return batch if self.mesh is None else train_sharding.shard_global_batch(batch, self.mesh)

    def _place(self, batch: Any) -> tuple[Callable[..., Any], Any]:
        """The jitted step for one packed mini-batch and the batch as it takes it: the whole
        ``[R, L]`` batch (``train_step``), or ``[k, r, L]`` micro-batches of at most
        ``trainer.micro_batch_tokens`` tokens per data-parallel shard, accumulated in one scan
        (``train_mini_batch``)."""
        budget = self.cfg.trainer.micro_batch_tokens
        rows, seq_len = np.shape(batch.tokens)
        dp = self.data_parallel
        r = micro_batch_rows(seq_len=seq_len, micro_batch_tokens=budget, data_parallel=dp) if budget else 0
        # as many micro-batches as the most this row length had so far: a mini-batch that packs into
        # fewer rows reuses the compiled step (the empty micro-batches are skipped) instead of compiling
        most = self._most_micro_batches.get(seq_len, 0)
        stacked = bool(budget) and (r < rows or most > 0)
        if stacked:
            batch = split_by_token_budget(
                batch, micro_batch_tokens=budget, data_parallel=dp, min_micro_batches=most
            )
            self._most_micro_batches[seq_len] = int(np.shape(batch.tokens)[0])
        # the loss-token buffer's size, from the host rows (every process holds them all)
        self.state = with_logit_capacity(self.state, batch)
        if self.mesh is not None:
            # every process holds the whole mini-batch and feeds the rows of its own devices
            batch = train_sharding.shard_global_batch(batch, self.mesh, stacked=stacked)
        return (train_mini_batch if stacked else train_step), batch

    def _memory_metrics(self, step_fn: Callable[..., Any], batch: Any, counts: Any) -> dict[str, float]:
        """``memory/*`` of this step (XLA's estimate per shape, cached; the device peak where reported)."""
        key = (step_fn is train_mini_batch, self.state.config, jax.tree.map(np.shape, batch))
        if key not in self._step_memory:
            self._step_memory[key] = step_memory_metrics(step_fn, self.state, batch, counts)
        out = {k: v for k, v in self._step_memory[key].items() if k != "memory/peak_bytes"}
        peak = device_peak_bytes()
        if peak is not None:
            out["memory/peak_bytes"] = peak
        return out

    def demonstrated_envs(self) -> tuple[list[str], list[str]]:
        """``(names of the envs whose environments have solution(task), names of those without)``:
        the warm start demonstrates the tasks of the first only."""
        from rljax.training.warmstart import has_solution

        found = {name: has_solution(make) for name, make in self.env_tasks.factories.items()}
        return sorted(n for n, ok in found.items() if ok), sorted(n for n, ok in found.items() if not ok)

    def warm_start(self, *, on_step: Callable[[dict], None], log: Callable[[dict], None]) -> list[dict]:
        """Cross-entropy warm start of the whole model on env demonstrations (``config.warmstart``) of
        the train tasks of :meth:`demonstrated_envs`; a LoRA run's adapters stay as they are (B = 0):
        LoRA then trains on top of the warm-started base, which its checkpoints carry
        (:data:`LORA_BASE`). Returns the warm start's metric rows."""
        from rljax.training.warmstart import run_warm_start

        ws = self.cfg.warmstart
        opt = self.cfg.optimizer_config(
            **ws.optimizer,
            learning_rate=ws.learning_rate,
            schedule="constant",
            total_steps=None,
            warmup_steps=0,
        )

        def make(task: Task) -> Any:
            return self.env_tasks.factories[task.env]()

        demonstrated = set(self.demonstrated_envs()[0])
        budget = self.cfg.trainer.micro_batch_tokens

        def step(state: TrainState, batch: Any, counts: Any) -> tuple[TrainState, Any]:
            # micro-batched as the RL steps are: a whole batch's logits at once are most of the memory
            rows, seq_len = np.shape(batch.tokens)
            if (
                budget
                and micro_batch_rows(seq_len=seq_len, micro_batch_tokens=budget, data_parallel=1) < rows
            ):
                split = split_by_token_budget(batch, micro_batch_tokens=budget, data_parallel=1)
                return train_mini_batch(state, split, counts)
            return train_step(state, batch, counts)

        model, config = self.state.model, self.state.config
        self.state = None  # the run's Adam moments are made afresh after the warm start: freed meanwhile
        try:
            ws_state = TrainState.create(
                model, TrainConfig(objective=ObjectiveConfig(), optimizer=opt), trainable=nnx.Param
            )
            ws_state, history = run_warm_start(
                ws_state,
                [t for t in self.env_tasks.train if t.env in demonstrated],
                make,
                self.renderer,
                ws,
                seed=self.cfg.seed,
                train_step=step,
                counts_fn=mini_batch_counts,
                on_step=on_step,
                log=log,
            )
            model = ws_state.model
        finally:
            self.state = TrainState.create(model, config, mesh=self.mesh)
        return history

    # -- engines ---------------------------------------------------------------------------------------
    def start_engines(self, version: int) -> None:
        """Starts the policy engine on the weights of ``version`` (recorded with :meth:`sync_weights`)."""
        self._refresh_frozen_local()
        self.engines.start_policy(self.served_model(self.scheduler.served[version]), version=version)

    def sync_weights(self, version: int, *, wait: bool = False) -> None:
        """Records the current policy as weight ``version``: rollouts of that version sample it (the
        scheduler syncs the engine in order, before them). ``wait``: make the policy engine serve it
        now (blocking; the sync is verified as every sync is)."""
        self.scheduler.add_version(version, self.snapshot())
        if wait:
            self.rollout_worker.submit(lambda: self.scheduler.serve(version)).result()

    def release_served_weights(self) -> bool:
        """Lets the policy engine go of the version it serves, where it can (the embedded sampler);
        the scheduler's next serve loads one again. Returns whether it did. A sync run calls this
        between a rollout and its train step: that version is never sampled again."""

        async def job() -> bool:
            return self.engines.release_policy_weights()

        return self.rollout_worker.submit(job).result()

    def sample(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """Completions of token-id ``prompts`` from the policy engine (what it serves now)."""

        async def job() -> list[Completion]:
            engine = self.engines.policy
            return list(await asyncio.gather(*(engine.generate(list(p), sampling) for p in prompts)))

        return self.rollout_worker.submit(job).result()

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        temperature: float | Sequence[float] = 1.0,
        score_from: Sequence[int] | None = None,
    ) -> list[np.ndarray]:
        """Per-token logprobs of whole token sequences under the current policy (entry t =
        log p(seq[t] | seq[:t]); entry 0 is 0), at one temperature or one per sequence; with
        ``score_from``, only from each sequence's given position on (0 before it). With a
        ``context`` mesh axis the rows are split over it (long trajectories)."""
        from rljax.inference.scoring import score_sequences

        with self._context_scope():
            return score_sequences(
                self.current_model(), sequences, temperature=temperature, score_from=score_from
            )

    def _context_scope(self) -> contextlib.AbstractContextManager:
        """``jax.set_mesh`` of the policy's mesh when it has a ``context`` axis (the scoring forwards
        then split rows over it, as the train step does); a no-op otherwise."""
        mesh = self.state.mesh
        if train_sharding.context_parallelism(mesh) == 1:
            return contextlib.nullcontext()
        return jax.set_mesh(mesh)

    def close(self) -> None:
        """Stops the engines (launched servers, frozen-model clients) and the workers."""
        if self.engines is not None:
            self.scheduler.close()
            supervisor = getattr(self.engines.policy, "supervisor", None)
            if supervisor is not None:  # its health loop runs on the rollout loop: stop it there
                try:
                    self.rollout_worker.submit(supervisor.stop).result(timeout=30)
                except Exception as e:  # closing must not mask the run's own error
                    logger.warning("stopping the vLLM server supervisor failed: %s", e)
            self.engines.close()
            self.rollout_worker.close()
            self.scoring_worker.close()


def stored_abstract(directory: pathlib.Path, step: int, item: str) -> Any:
    """``jax.ShapeDtypeStruct`` s with the structure of checkpoint ``step``'s array item ``item``
    (``"params"`` or ``"opt_state"``; restored with it, they come back as host arrays); None when
    the checkpoint has no such item."""
    import orbax.checkpoint as ocp

    path = pathlib.Path(directory) / f"step_{step}" / item
    if not path.is_dir():
        return None
    meta = ocp.StandardCheckpointHandler().metadata(path)
    tree = meta.tree if hasattr(meta, "tree") else meta
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)


_jit_loss_and_grads = jax.jit(loss_and_grads)
_jit_apply_gradients = jax.jit(apply_gradients)


@functools.partial(jax.jit, static_argnums=0)
def _jit_packed_logprobs(graphdef: nnx.GraphDef, params: Any, frozen: Any, batch: Any) -> jax.Array:
    from rljax.models import sequence_logprobs
    from rljax.models.logprobs import packing_kwargs

    model = merge_model(graphdef, params, frozen)
    return sequence_logprobs(model, batch.tokens, temperature=batch.temperatures, **packing_kwargs(batch))
