"""The trainer: wiring of a run's parts and the RL step loop (SPEC §5).

One RL step ``n`` (``theta_n`` = parameters after ``n`` RL steps; policy version ``n``)::

    batch_n = scheduler.result(n)                 rollout of step n on theta_{v(n)}, every Step records v(n)
    for each algorithm a of the run:
        S_a = prepare_samples(a, batch_n | a)     advantages, filters, merge, reference scores, streams
        for each mini-batch B of mini_batch_prompts prompt groups of S_a:
            theta <- train_step(theta, pack(B), counts(B))       (ONE jitted function)
    scheduler.add_version(n + 1, theta)           the weights the next rollouts serve
    metrics -> sinks; checkpoint every checkpoint_every steps

The parts, each in its own module:

================================ =============================================================
:mod:`~rljax.train.run_config`   the typed config, parsed once (every config error, with its key)
:mod:`~rljax.train.builders`     tokenizer, model, per-algorithm objective, cross-part checks
:mod:`~rljax.train.tasks`        env factories, train/eval tasks, the checkpointed task order
:mod:`~rljax.train.engines`      policy engine, frozen models, weight serving, shutdown
:mod:`~rljax.train.references`   ref_kl reference scores (opd teacher, opsd live policy)
:mod:`~rljax.train.scheduler`    rollouts per step: versions/staleness, dynamic sampling, evals
:mod:`rljax.data.prepare`        the host preparation pipeline (in the data layer)
:mod:`~rljax.train.step`         the jitted train step; :mod:`~rljax.train.checkpoint` orbax I/O
:mod:`~rljax.train.report`       metric rows and their sinks
================================ =============================================================

Determinism (resume is bit-for-bit on CPU): every random choice comes from the config seed and the
step index or from checkpointed state (task order, mini-batch shuffles, behaviour parameters of
async mode). A checkpoint at step ``n`` holds ``theta_n``, the optimizer state and counters, the
behaviour parameters still needed by rollouts ``n .. n+k-1``, the task iterator and RNG state, and
the config; resuming with a config that differs in a result-changing key is refused.

Reference: the SkyRL / prime-rl trainer loops (async off-policy rollouts bounded by
``max_off_policy_steps``, policy versions recorded on samples).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import algorithms as algos
from rljax.chat import make_renderer
from rljax.core.objective import ObjectiveConfig
from rljax.data.batch import StepBatch
from rljax.data.filters import make_filter
from rljax.data.micro_batch import micro_batch_rows, split_by_token_budget
from rljax.data.pack import make_mini_batches
from rljax.data.prepare import load_observation_filter, prefixed, prepare_samples, split_by_algorithm
from rljax.envs.base import Task
from rljax.models.lora import LoRAConfig, apply_lora, merge_lora
from rljax.models.value import ValueModel, load_value_model
from rljax.rollout import RolloutResult
from rljax.train import checkpoint as ckpt
from rljax.train import metrics as metrics_lib
from rljax.train import sharding as train_sharding
from rljax.train.builders import (
    DTYPE_OF,
    build_model,
    build_tokenizer,
    check_algorithm_needs,
    objective_config,
)
from rljax.train.critic import critic_step, critic_values, ppo_advantages
from rljax.train.distributed import host_local_copy, is_main_process
from rljax.train.engines import EngineSet, resolve_frozen_models
from rljax.train.memory import device_peak_bytes, step_memory_metrics
from rljax.train.references import ReferenceScorers
from rljax.train.report import RunSinks, eval_metrics, rollout_step_metrics
from rljax.train.run_config import config_differences, critic_config, parse_run_config
from rljax.train.scheduler import RolloutScheduler, derive_seed
from rljax.train.step import (
    TrainConfig,
    TrainState,
    merge_model,
    mini_batch_counts,
    train_mini_batch,
    train_step,
)
from rljax.train.tasks import TaskIterator, build_env_tasks
from rljax.train.warmstart import run_warm_start
from rljax.train.worker import Worker

__all__ = ["TaskIterator", "Trainer", "build_model", "build_tokenizer", "train"]

logger = logging.getLogger(__name__)


class Trainer:
    """Runs an RL post-training job described by an ``ml_collections`` config (see configs/default.py).

    Args:
      config: the run config (a ConfigDict or nested dict; keys and defaults:
        :class:`rljax.train.run_config.RunConfig`). Every config error is raised here.
      workdir: where metrics (``metrics.jsonl``, TensorBoard, plot) and checkpoints (``checkpoints/``) go.
      resume: continue from the latest complete checkpoint in ``workdir`` (an error if there is none).
      make_env: optional ``{env name: zero-argument factory}`` overriding envs of ``config.envs``.
      tasks: optional ``{env name: (train tasks, eval tasks)}`` overriding envs' task makers.
      engine: optional policy engine (anything with ``generate`` / ``update_weights``).
      allow_config_change: resume even when result-changing config keys differ from the checkpoint's.

    ``Trainer(config, workdir).run()`` returns the list of per-step metric dicts of this process.
    """

    def __init__(
        self,
        config: Any,
        workdir: str | os.PathLike,
        *,
        resume: bool = False,
        make_env: Mapping[str, Callable[[], Any]] | None = None,
        tasks: Mapping[str, tuple[Sequence[Task], Sequence[Task]]] | None = None,
        engine: Any = None,
        allow_config_change: bool = False,
    ) -> None:
        cfg = self.cfg = parse_run_config(config)
        self.config = config
        self.workdir = pathlib.Path(workdir).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.workdir / "checkpoints"
        self.resume = resume
        self.allow_config_change = allow_config_change
        self.processes = jax.process_count()
        self._frozen_local: Any = None  # a multi-process run: the frozen base, whole on this process
        if self.processes > 1:
            _check_multi_process(cfg)
            _log_to_process_file(self.workdir)

        # model, tokenizer, renderer ----------------------------------------------------------------
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.renderer = make_renderer(cfg.renderer.name, self.tokenizer, **cfg.renderer.kwargs)
        model = build_model(cfg.model, vocab_size=len(self.tokenizer), seed=cfg.seed)
        if cfg.lora:  # adapter-only training: the base is frozen (TrainState.frozen)
            apply_lora(model, LoRAConfig(**cfg.lora), rngs=nnx.Rngs(derive_seed(cfg.seed, 0x10A)))
        self.model_vocab = int(model.config.vocab_size)

        # environments, algorithms ------------------------------------------------------------------
        self.env_tasks = build_env_tasks(cfg, make_env=make_env, tasks=tasks)
        self.algorithms = algos.validate_algorithm_config(
            cfg.algorithm, env_overrides=cfg.env_algorithms, group_size=cfg.rollout["group_size"]
        )
        if cfg.model.router_replay != "off" and not model.config.moe_layers:
            raise ValueError(
                f"config.model.router_replay={cfg.model.router_replay!r} replays MoE routing, but the "
                f"model ({model.config.model_type}) has no MoE layers; set it to 'off'"
            )
        self.train_configs = {
            a.name: TrainConfig(
                objective=objective_config(a, cfg.objective),
                optimizer=cfg.optimizer_config(),
                router_replay=cfg.model.router_replay == "r3",
                moe_aux_loss_coef=cfg.objective.moe_aux_loss_coef,
                router_z_loss_coef=cfg.objective.router_z_loss_coef,
            )
            for a in self.algorithms.algorithms
        }
        self.filters = [make_filter(f["name"], **{k: v for k, v in f.items() if k != "name"}) for f in
                        cfg.trainer.filters]  # fmt: skip
        self.observation_filters = {
            a.name: load_observation_filter(a.observation_filter) for a in self.algorithms.algorithms
        }
        # metric keys get a /<algorithm> suffix when the run's envs train with more than one algorithm
        self.multi_algorithm = len({self.algorithms.for_env(e).name for e in self.env_tasks.factories}) > 1

        # train state, engines, rollouts ---------------------------------------------------------------
        self.mesh = train_sharding.make_mesh(**cfg.mesh) if cfg.uses_mesh else None
        self.data_parallel = 1 if self.mesh is None else train_sharding.batch_parallelism(self.mesh)
        default = self.train_configs[self.algorithms.default.name]
        self.critic_config = critic_config(cfg.critic)
        self.critic = self._build_critic(model) if self.algorithms.needs_critic else None
        self.state = TrainState.create(model, default, mesh=self.mesh)
        self.rl_step = 0
        self._base_in_checkpoint = bool(cfg.lora) and cfg.warmstart.num_steps > 0
        self.engines = EngineSet(
            cfg.engine,
            resolve_frozen_models(cfg.frozen_models, self.algorithms),
            workdir=self.workdir,
            seed=cfg.seed,
            engine_override=engine,
            dtype=cfg.engine_dtype,
        )
        self.rollout_worker = Worker("rljax-rollout")
        self.scoring_worker = Worker("rljax-scoring")  # teacher scoring, beside the rollouts
        self.references = ReferenceScorers(
            self.engines, self.scoring_worker, self.renderer, self.env_tasks.by_id(), self.current_model
        )
        check_algorithm_needs(
            self.algorithms, self.env_tasks, merge=cfg.trainer.merge, hint=self.references.hint
        )
        self.scheduler = RolloutScheduler(
            cfg,
            self.env_tasks,
            self.renderer,
            self.engines,
            self.algorithms,
            vocab_size=self.model_vocab,
            worker=self.rollout_worker,
            to_model=self._served_model,
            localize=self._localizer(),
        )
        self.np_rng = np.random.default_rng(derive_seed(cfg.seed, 0xB47C))
        self.history: list[dict[str, Any]] = []
        self._step_memory: dict[Any, dict[str, float]] = {}

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

    # -- small helpers ---------------------------------------------------------------------------------
    def model_of(self, params: Any) -> nnx.Module:
        return merge_model(self.state.graphdef, params, self.state.frozen)

    def current_model(self) -> nnx.Module:
        return self.model_of(self.state.params)

    def _snapshot(self) -> Any:
        return jax.tree.map(jnp.copy, self.state.params)  # train_step donates: keep our own copy

    # -- several processes -----------------------------------------------------------------------------
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
        from rljax.inference.vllm import SyncConfig, write_distributed

        model = self.engines.served(merge_model(self.state.graphdef, params, self.state.frozen))
        directory = self.workdir / "weights" / f"v{version}"
        return write_distributed(model, directory, config=SyncConfig(**dict(self.cfg.engine.sync)))

    def _served_model(self, params: Any) -> Any:
        """The model the policy engine serves for behaviour ``params`` (:attr:`RolloutScheduler.served`);
        weights already written for vLLM servers pass through."""
        from rljax.inference.vllm import WrittenWeights

        if isinstance(params, WrittenWeights):
            return params
        frozen = self.state.frozen if self.processes == 1 else self._frozen_local
        return merge_model(self.state.graphdef, params, frozen)

    def _refresh_frozen_local(self) -> None:
        if self.processes > 1:
            self._frozen_local = self._process_local(self.state.frozen)

    # -- checkpoints -----------------------------------------------------------------------------------
    def _save(self, step: int) -> None:
        behavior = {str(v): self.scheduler.behavior[v] for v in self.scheduler.needed_versions(step)}
        ckpt.save(
            self.ckpt_dir,
            step,
            params={"policy": self.state.params, "behavior": behavior, **self._extra_params()},
            opt_state={
                "opt": self.state.opt_state,
                "step": self.state.step,
                "skipped": self.state.skipped,
                **self._critic_opt_state(),
            },
            data_state={"tasks": self.scheduler.data_state(step), "step": step},
            rng={"minibatch": self.np_rng},
            config=dataclasses.asdict(self.cfg),
            keep=self.cfg.trainer.keep_checkpoints or None,
            overwrite=True,
        )

    def _restore(self) -> int:
        step = ckpt.latest_step(self.ckpt_dir) if self.ckpt_dir.exists() else None
        if step is None:
            raise FileNotFoundError(
                f"--resume: {self.ckpt_dir} holds no complete checkpoint, so there is nothing to resume; "
                "start a new run (drop --resume) or point --workdir at the run to continue"
            )
        behavior = {str(v): self.state.params for v in self.scheduler.needed_versions(step)}
        r = ckpt.restore(
            self.ckpt_dir,
            params={"policy": self.state.params, "behavior": behavior, **self._extra_params()},
            opt_state={
                "opt": self.state.opt_state,
                "step": self.state.step,
                "skipped": self.state.skipped,
                **self._critic_opt_state(),
            },
            step=step,
        )
        self._check_resumed_config(r.config, step)
        self.state = dataclasses.replace(
            self.state,
            params=r.params["policy"],
            frozen=r.params["lora_base"] if self._base_in_checkpoint else self.state.frozen,
            opt_state=r.opt_state["opt"],
            step=r.opt_state["step"],
            skipped=r.opt_state["skipped"],
        )
        if self.critic is not None:
            self.critic = dataclasses.replace(
                self.critic,
                params=r.params["critic"],
                opt_state=r.opt_state["critic_opt"],
                step=r.opt_state["critic_step"],
                skipped=r.opt_state["critic_skipped"],
            )
        for v, p in sorted(r.params["behavior"].items(), key=lambda item: int(item[0])):
            self.scheduler.add_version(int(v), p)
        self.scheduler.restore(r.data_state)
        self.np_rng = r.rng["minibatch"]
        return step

    def _extra_params(self) -> dict[str, Any]:
        """Parameter items saved beside the policy: PPO's critic; a LoRA run's base when the warm
        start trained it (then it is not the checkpoint ``model.hf_path`` / ``model.init`` gives)."""
        out = {} if self.critic is None else {"critic": self.critic.params}
        if self._base_in_checkpoint:
            out["lora_base"] = self.state.frozen
        return out

    def _critic_opt_state(self) -> dict[str, Any]:
        if self.critic is None:
            return {}
        c = self.critic
        return {"critic_opt": c.opt_state, "critic_step": c.step, "critic_skipped": c.skipped}

    def _check_resumed_config(self, saved: Any, step: int) -> None:
        if not saved or self.allow_config_change:
            return
        try:
            diffs = config_differences(parse_run_config(saved), self.cfg)
        except ValueError as e:  # a checkpoint of an older layout: say so instead of guessing
            raise ValueError(f"--resume: the checkpoint's config does not parse ({e})") from None
        if diffs:
            raise ValueError(
                f"--resume: the config differs from the one checkpoint step {step} was trained with in "
                f"keys that change results: {'; '.join(diffs)}. Resume with the same config, start a new "
                "run, or pass --allow_config_change to continue anyway"
            )

    # -- one RL step's training ------------------------------------------------------------------------
    def _train_on(self, batch: StepBatch) -> dict[str, float]:
        metrics: dict[str, float] = {}
        multi = self.multi_algorithm
        train_rows: list[dict[str, float]] = []
        critic_rows: list[dict[str, float]] = []
        shuffle_seed = int(self.np_rng.integers(0, 2**31 - 1))
        for name, part in split_by_algorithm(batch).items():
            alg = _algorithm_named(self.algorithms, name)
            prep = prepare_samples(
                alg,
                part,
                filters=self.filters,
                merge=self.cfg.trainer.merge,
                score=self.references.for_algorithm(alg),
                observation_filter=self.observation_filters[alg.name],
            )
            metrics.update(prefixed(prep.metrics, name, multi=multi))
            metrics.update(_advantage_metrics(prep, alg, name))
            num_groups = len({s.trajectory_id.instance_id for s in prep.samples})
            per_mb = self.cfg.trainer.mini_batch_prompts or num_groups
            if num_groups % per_mb:
                per_mb = num_groups  # mixed envs: this algorithm's share of the groups; one mini-batch
            tcfg = self.train_configs[name]
            self.state = dataclasses.replace(self.state, config=tcfg)
            mini_batches = make_mini_batches(
                prep.samples,
                mini_batch_prompts=per_mb,
                seq_len=self.cfg.trainer.seq_len,
                row_buckets=self.cfg.trainer.row_buckets,
                data_parallel=self.data_parallel,
                truncate=self.cfg.trainer.truncate,
                shuffle_seed=shuffle_seed,
                **prep.streams(),
            )
            if alg.needs_critic:
                mini_batches = self._with_critic(list(mini_batches), critic_rows, name if multi else None)
            for mb in mini_batches:
                step_fn, packed = self._place(mb.batch)
                counts = mini_batch_counts(packed, tcfg.objective)
                memory = self._memory_metrics(step_fn, packed, counts)
                self.state, m = step_fn(self.state, packed, counts)
                row = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
                row.update(memory)
                row["pack/rows"] = float(mb.batch.tokens.shape[0])
                row["pack/efficiency"] = float(mb.metrics.get("packing_efficiency", math.nan))
                train_rows.append({f"{k}/{name}" if multi else k: v for k, v in row.items()} | row)
        for key in sorted({k for r in train_rows for k in r}):
            metrics[key] = float(np.mean([r[key] for r in train_rows if key in r]))
        for key in sorted({k for r in critic_rows for k in r}):
            metrics[key] = float(np.mean([r[key] for r in critic_rows if key in r]))
        metrics["optimizer_steps"] = float(len(train_rows))
        if critic_rows:
            metrics["critic/optimizer_steps"] = float(len(critic_rows))
        return metrics

    def _with_critic(
        self, mini_batches: list[Any], rows: list[dict[str, float]], suffix: str | None
    ) -> list[Any]:
        """PPO: old values and GAE advantages of every mini-batch (all before any update), then one
        critic step per mini-batch; returns the mini-batches with their advantages for the policy
        steps (none during the critic warm-up)."""
        cc = self.critic_config
        staged = []
        for mb in mini_batches:
            placed = mb.batch if self.mesh is None else train_sharding.shard_global_batch(mb.batch, self.mesh)
            old_values = critic_values(self.critic, placed)
            advantages, returns = ppo_advantages(old_values, placed, cc)
            staged.append((mb, placed, old_values, advantages, returns))
        out = []
        for mb, placed, old_values, advantages, returns in staged:
            self.critic, m = critic_step(self.critic, placed, old_values, returns, cc)
            row = {k: float(v) for k, v in jax.device_get(m).items()}
            mask = np.asarray(mb.batch.loss_mask) != 0
            adv = np.asarray(host_local_copy(advantages), np.float32)
            if mask.any():
                row["advantage/mean"] = float(adv[mask].mean())
                row["advantage/abs_mean"] = float(np.abs(adv[mask]).mean())
            rows.append({f"{k}/{suffix}": v for k, v in row.items()} | row if suffix else row)
            if self.rl_step >= cc.warmup_steps:
                out.append(dataclasses.replace(mb, batch=mb.batch.replace(advantages=adv)))
        return out

    def _place(self, batch: Any) -> tuple[Callable[..., Any], Any]:
        """The jitted step for one packed mini-batch and the batch as it takes it: the whole
        ``[R, L]`` batch (``train_step``), or ``[k, r, L]`` micro-batches of at most
        ``trainer.micro_batch_tokens`` tokens per data-parallel shard, accumulated in one scan
        (``train_mini_batch``)."""
        budget = self.cfg.trainer.micro_batch_tokens
        rows, seq_len = np.shape(batch.tokens)
        stacked = (
            bool(budget)
            and micro_batch_rows(seq_len=seq_len, micro_batch_tokens=budget, data_parallel=self.data_parallel)
            < rows
        )
        if stacked:
            batch = split_by_token_budget(batch, micro_batch_tokens=budget, data_parallel=self.data_parallel)
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

    def _eval_result(self, step: int, future: concurrent.futures.Future) -> dict[str, float]:
        result: RolloutResult = self.scheduler.gather(future.result())
        return eval_metrics(result, step, tasks=self.env_tasks.eval, pass_k=self.cfg.eval.pass_k)

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Runs (or resumes) the job; returns this process's per-step metrics."""
        try:
            resumed = self._restore() if self.resume else None
            self.sinks = RunSinks(
                self.workdir,
                resume_step=resumed,
                table_keys=self.cfg.trainer.table_keys,
                enabled=is_main_process(),
            )
            try:
                return self._run(resumed)
            finally:
                self.sinks.close()
        finally:
            self.engines.close()
            self.rollout_worker.close()
            self.scoring_worker.close()

    def _warm_start(self) -> None:
        ws = self.cfg.warmstart
        if ws.num_steps == 0:
            return
        opt = self.cfg.optimizer_config(
            **ws.optimizer,
            learning_rate=ws.learning_rate,
            schedule="constant",
            total_steps=None,
            warmup_steps=0,
        )
        # the whole model learns (a LoRA run's adapters stay as they are, B = 0): LoRA then trains
        # on top of the warm-started base, which its checkpoints carry (``lora_base``)
        ws_state = TrainState.create(
            self.state.model, TrainConfig(objective=ObjectiveConfig(), optimizer=opt), trainable=nnx.Param
        )
        start = time.perf_counter()

        def make(task: Task) -> Any:
            return self.env_tasks.factories[task.env]()

        show = None if is_main_process() else False
        with metrics_lib.Progress(total=ws.num_steps, desc="warm start", unit="step", enabled=show) as bar:
            ws_state, hist = run_warm_start(
                ws_state,
                list(self.env_tasks.train),
                make,
                self.renderer,
                ws.warm_start_config(),
                seed=self.cfg.seed,
                train_step=train_step,
                counts_fn=mini_batch_counts,
                on_step=lambda row: bar.update(1),
                log=lambda row: self.sinks.log(int(row["warmstart/step"]), row, phase="warmstart"),
            )
        self.state = TrainState.create(ws_state.model, self.state.config, mesh=self.mesh)
        print(
            f"warm start: {ws.num_steps} steps in {time.perf_counter() - start:.1f}s, "
            f"final CE {hist[-1]['warmstart/loss']:.4f}",
            flush=True,
        )

    def _run(self, resumed: int | None) -> list[dict[str, Any]]:
        run_start = time.perf_counter()
        t = self.cfg.trainer
        sched = self.scheduler
        self.engines.check_frozen_models(self.algorithms, self.rollout_worker)  # fails in seconds, not later
        if resumed is None:
            self._warm_start()
            self._refresh_frozen_local()
            start = 0
            sched.add_version(0, self._snapshot())
            if t.checkpoint_every:
                self._save(0)
        else:
            start = resumed
            print(f"resumed from step {resumed} ({self.ckpt_dir})", flush=True)
        self._refresh_frozen_local()
        sched.add_version(start, self._snapshot())
        self.engines.start_policy(self._served_model(sched.served[start]))
        sched.start(start)
        eval_future: tuple[int, concurrent.futures.Future] | None = None
        if (
            resumed is not None
            and t.mode == "async"
            and sched.evaluates(resumed, t.eval_every)
            and resumed < t.num_steps
        ):
            # the run we resume queued this eval at step `resumed` and would report it at the next step
            eval_future = (resumed, sched.submit_eval(resumed))

        for n in range(start, t.num_steps):
            step_start = time.perf_counter()
            sched.fill(n + 1)  # sync: rollout n starts now, on theta_n (async: already running)
            result, version_metrics = sched.result(n)
            rollout_wait = time.perf_counter() - step_start
            sched.fill(n + 1 + sched.lag)  # async: rollouts n+1..n+lag start now, sampling theta_{<= n}
            train_start = time.perf_counter()
            self.rl_step = n
            metrics = self._train_on(result.batch)
            jax.block_until_ready(self.state.params)
            train_time = time.perf_counter() - train_start
            sched.add_version(n + 1, self._snapshot())
            metrics.update(rollout_step_metrics(result))
            metrics.update(version_metrics)
            metrics.update({"time/rollout_wait_s": rollout_wait, "time/train_s": train_time})
            step_no = n + 1
            if eval_future is not None:  # async: the previous step's eval ran beside this step's training
                metrics.update(self._eval_result(*eval_future))
                eval_future = None
            if sched.evaluates(step_no, t.eval_every):
                eval_future = (step_no, sched.submit_eval(step_no))
                if t.mode == "sync" or step_no == t.num_steps:
                    metrics.update(self._eval_result(*eval_future))
                    eval_future = None
            if t.checkpoint_every and (step_no % t.checkpoint_every == 0 or step_no == t.num_steps):
                save_start = time.perf_counter()
                self._save(step_no)
                metrics["time/checkpoint_s"] = time.perf_counter() - save_start
            metrics["time/step_s"] = time.perf_counter() - step_start
            metrics["time/elapsed_s"] = time.perf_counter() - run_start
            metrics["throughput/samples_per_s"] = metrics["rollout/num_trajectories"] / metrics["time/step_s"]
            self.history.append({"step": step_no, **metrics})
            self.sinks.log(step_no, metrics)
        return self.history


def _algorithm_named(algorithms: algos.AlgorithmConfig, name: str) -> algos.Algorithm:
    for a in algorithms.algorithms:
        if a.name == name:
            return a
    raise ValueError(f"a step names algorithm {name!r}, which this run lacks ({algorithms.names})")


def _advantage_metrics(prep: Any, alg: algos.Algorithm, name: str) -> dict[str, float]:
    """Mean and mean |A| over the rl-weighted trainable tokens of one algorithm's samples."""
    if alg.action_component != "rl" or alg.needs_critic or not prep.samples:  # ppo: from the critic
        return {}
    adv = np.concatenate(prep.advantages)
    weights = prep.rl_weights or [1.0] * len(prep.samples)
    mask = np.concatenate([np.float32(s.loss_mask) * w for s, w in zip(prep.samples, weights, strict=True)])
    if not mask.sum():
        return {}
    return {
        f"advantage/mean/{name}": float((adv * mask).sum() / mask.sum()),
        f"advantage/abs_mean/{name}": float((np.abs(adv) * mask).sum() / mask.sum()),
    }


def _check_multi_process(cfg: Any) -> None:
    """Config rules of a multi-process run (every process passes the same config)."""
    n = jax.device_count()
    if not cfg.uses_mesh:
        raise ValueError(
            f"this run has {jax.process_count()} processes ({n} devices in all) but config.mesh is one "
            f"device; set config.mesh to span all {n} devices (e.g. --config.mesh.data={n})"
        )


def _log_to_process_file(workdir: pathlib.Path) -> None:
    """Every process of a multi-process run logs to ``workdir/logs/process_<i>.log`` (process 0's
    metrics go to the usual sinks too)."""
    path = workdir / "logs" / f"process_{jax.process_index()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    if any(getattr(h, "baseFilename", None) == str(path) for h in root.handlers):
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)


def train(config: Any, workdir: str | os.PathLike, *, resume: bool = False) -> list[dict[str, Any]]:
    """``Trainer(config, workdir, resume=resume).run()``."""
    return Trainer(config, workdir, resume=resume).run()
