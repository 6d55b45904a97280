"""The trainer: wiring of a run's parts and the RL step loop (design §5).

One RL step ``n`` (``theta_n`` = parameters after ``n`` RL steps; policy version ``n``)::

    batch_n = scheduler.result(n)                 rollout of step n on theta_{v(n)}, every Step records v(n)
    for each algorithm a of the run:
        S_a = prepare_samples(a, batch_n | a)     advantages, filters, merge, reference scores, streams
        for each mini-batch B of mini_batch_prompts prompt groups of S_a:
            theta <- train_step(theta, pack(B), counts(B))       (ONE jitted function)
    scheduler.add_version(n + 1, theta)           the weights the next rollouts serve
    row + rollout records -> sinks, flushed       then, every checkpoint_every steps, the checkpoint

The parts, each in its own module:

============================  ==============================================================================
:mod:`~rljax.run.run`         the run object: train state, engines + weight sync, references, the
                              checkpoint state tree (shared with rljax.cli.eval / export, front doors)
:mod:`~rljax.run.config`      the typed config, parsed once (every config error, with its key)
:mod:`~rljax.run.builders`    tokenizer, model, per-algorithm objective, cross-part checks
:mod:`~rljax.run.tasks`       env factories, train/eval tasks, the checkpointed task order
:mod:`~rljax.run.engines`     policy engine, frozen models, weight serving, shutdown
:mod:`~rljax.run.references`  ref_kl reference scores (opd teacher, opsd live policy)
:mod:`~rljax.run.scheduler`   rollouts per step: versions/staleness, dynamic sampling, evals
:mod:`rljax.data.prepare`     the host preparation pipeline (in the data layer)
:mod:`~rljax.training.step`   the jitted train step; :mod:`~rljax.training.checkpoint` orbax I/O
:mod:`~rljax.run.report`      metric rows and their sinks
============================  ==============================================================================

Determinism (resume is bit-for-bit on CPU): every random choice comes from the config seed and the
step index or from checkpointed state (task order, mini-batch shuffles, behaviour parameters of
async mode). A checkpoint at step ``n`` holds ``theta_n``, the optimizer state and counters, the
behaviour parameters still needed by rollouts ``n .. n+k-1``, the task iterator and RNG state, and
the config; resuming with a config that differs in a result-changing key is refused.

What a step produced reaches the sinks BEFORE its checkpoint commits: the step's metrics row and
rollout records are written and flushed (``fsync`` for files, synchronous calls for MLflow;
:meth:`RunSinks.flush <rljax.run.report.RunSinks.flush>`), and only then ``latest`` moves to the
step. A ``kill -9`` after the commit therefore loses nothing (``--resume`` starts at ``n + 1``, and
everything of step ``n`` is already written; W&B, whose client buffers rows and loses the buffer
to a ``kill -9``, is sent the rows it lacks again from ``metrics.jsonl``); a kill between the row
and the commit leaves rows
of steps after the checkpoint, which ``--resume`` drops or hides (JSONL lines, ``rollouts/``
files, TensorBoard's purge event) or does not send twice (W&B, MLflow): the rules of
:mod:`rljax.report.sinks`. The alternative, keeping the row and records inside the checkpoint and
writing what the sinks lack on resume, would put rollout records (every call's tokens, logprobs,
messages) into each checkpoint and its manifest, and still leave the sinks to find out what they
lack. The price of this order is that a checkpoint's own time cannot be in its step's row:
``time/checkpoint_s`` of row ``n`` is the time the checkpoint saved just BEFORE step ``n`` took (of
step ``n - 1``, or step 0's after the warm start), and the last checkpoint's time is logged
(``logging``) when the run ends. ``time/step_s`` runs from the step's start to its row.
:mod:`rljax.training.checkpoint` has fault-injection points (``RLJAX_FAULT``) right before and right
after the commit for the tests of exactly these windows.

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
import numpy as np

from rljax import algorithms as algos
from rljax.core.objective import MAX_METRICS, rollout_logprob_readers
from rljax.data.batch import StepBatch
from rljax.data.credit import turn_links
from rljax.data.filters import make_filter
from rljax.data.pack import make_mini_batches, with_token_staleness
from rljax.data.prepare import load_observation_filter, prefixed, prepare_samples, split_by_algorithm
from rljax.envs.base import Task
from rljax.report import metrics as metrics_lib
from rljax.report.records import PreparationTrace
from rljax.rollout import RolloutResult
from rljax.run.builders import build_model, build_tokenizer
from rljax.run.config import config_record
from rljax.run.interrupt import InterruptLatch
from rljax.run.report import RunSinks, eval_metrics, rollout_step_metrics
from rljax.run.run import Run, mini_batch_groups
from rljax.run.streaming import trained_tokens
from rljax.run.tasks import TaskIterator
from rljax.run.watchdog import Watchdog, trainer_watchdog
from rljax.training import checkpoint as ckpt
from rljax.training.distributed import is_main_process
from rljax.training.memory import host_memory_bytes, release_freed_host_memory
from rljax.training.step import TrainState

__all__ = ["TaskIterator", "Trainer", "build_model", "build_tokenizer", "check_rollout_logprobs", "train"]

logger = logging.getLogger(__name__)


class Trainer:
    """Runs an RL post-training job described by an ``ml_collections`` config (see configs/default.py).

    Args:
      config: the run config (a ConfigDict or nested dict; keys and defaults:
        :class:`rljax.run.config.RunConfig`). Every config error is raised here.
      workdir: where metrics (``metrics.jsonl``, TensorBoard, plot) and checkpoints (``checkpoints/``) go.
      resume: continue from the newest intact checkpoint in ``workdir`` (an error if there is none).
      make_env: optional ``{env name: zero-argument factory}`` overriding envs of ``config.envs``.
      tasks: optional ``{env name: (train tasks, eval tasks)}`` overriding envs' task makers.
      engine: optional policy engine (anything with ``generate`` / ``update_weights``).
      allow_config_change: resume even when result-changing config keys differ from the checkpoint's.

    The run's parts (train state, engines, scheduler, checkpoints) are :attr:`parts`, a
    :class:`rljax.run.run.Run`; the trainer is the loop. ``Trainer(config, workdir).run()`` returns
    the list of per-step metric dicts of this process.
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
        self.config = config
        self.workdir = pathlib.Path(workdir).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if jax.process_count() > 1:
            _log_to_process_file(self.workdir)
        self.parts = Run(config, self.workdir, make_env=make_env, tasks=tasks, engine=engine)
        self.cfg = self.parts.cfg
        self.resume = resume
        self.allow_config_change = allow_config_change
        self.filters = [make_filter(f["name"], **{k: v for k, v in f.items() if k != "name"})
                        for f in self.cfg.trainer.filters]  # fmt: skip
        self.observation_filters = {
            a.name: load_observation_filter(a.observation_filter) for a in self.parts.algorithms.algorithms
        }
        # metric keys get a /<algorithm> suffix when the run's envs train with more than one algorithm
        algorithms, envs = self.parts.algorithms, self.parts.env_tasks.factories
        self.multi_algorithm = len({algorithms.for_env(e).name for e in envs}) > 1
        self.rl_step = 0
        self.trace: PreparationTrace | None = None
        self.history: list[dict[str, Any]] = []
        self.watchdog: Watchdog | None = None  # while run() runs (trainer.stall_timeout_s > 0)
        self.interrupts = InterruptLatch()  # Ctrl-C stops the run even when a gc callback swallowed it
        self.save_errors = 0  # checkpoints that failed to save (trainer.on_save_error="continue")

    # -- the run's parts are read as ``trainer.parts.<name>`` (scheduler, engines, env_tasks, ...) ----
    @property
    def state(self) -> TrainState:
        """The train state (parameters, optimizer state, counters) of :attr:`parts`."""
        return self.parts.state

    @state.setter
    def state(self, value: TrainState) -> None:
        self.parts.state = value

    # -- one RL step's training ------------------------------------------------------------------------
    def _train_on(self, batch: StepBatch) -> dict[str, float]:
        """Trains the policy (and PPO's critic) on one RL step's rollouts.

        The batch is split by algorithm; each part is prepared (advantages, filters, merge,
        reference scores, streams: :func:`rljax.data.prepare.prepare_samples`) and packed into
        mini-batches of ``trainer.mini_batch_prompts`` whole prompt groups (shuffled by a seed from
        the checkpointed RNG). Then every mini-batch gets the logprobs of the other policies its
        objective reads (the old policy's, recomputed under the step's starting weights before any
        update, and the KL reference's: :meth:`Run.with_policy_logprobs`), and each mini-batch is
        one optimizer step (:meth:`Run.train`). Returns the step's training metrics: preparation
        metrics, advantage means, the mean of each optimizer step's metrics (``<key>/<algorithm>``
        too when the run mixes algorithms) and the number of optimizer steps.
        """
        parts, multi = self.parts, self.multi_algorithm
        metrics: dict[str, float] = {}
        critic_rows: list[dict[str, float]] = []
        shuffle_seed = int(parts.np_rng.integers(0, 2**31 - 1))
        self.trace = PreparationTrace(self.rl_step + 1)  # which sample each step trained in (records)
        planned: list[tuple[str, list[Any]]] = []
        for name, part in split_by_algorithm(batch).items():
            alg = _algorithm_named(self.parts.algorithms, name)
            prep = prepare_samples(
                alg,
                part,
                filters=self.filters,
                merge=self.cfg.trainer.merge,
                score=parts.references.for_algorithm(alg),
                observation_filter=self.observation_filters[alg.name],
                trained_version=self.rl_step,
            )
            check_rollout_logprobs(
                name, prep.samples, parts.train_configs[name].objective, old=parts.old_logprobs[name][0]
            )
            metrics.update(prefixed(prep.metrics, name, multi=multi))
            self.trace.add(part.steps, prep)
            num_groups = len({s.trajectory_id.instance_id for s in prep.samples})
            mini_batches = make_mini_batches(
                prep.samples,
                mini_batch_prompts=mini_batch_groups(num_groups, self.cfg.trainer.mini_batch_prompts, name),
                seq_len=self.cfg.trainer.seq_len,
                row_buckets=self.cfg.trainer.row_buckets,
                data_parallel=parts.data_parallel,
                truncate=self.cfg.trainer.truncate,
                shuffle_seed=shuffle_seed,
                prefix_sharing=parts.prefix_sharing,
                **prep.streams(),
            )
            if alg.needs_critic:  # GAE runs along each trajectory's turns, whichever samples hold them
                mini_batches = list(mini_batches)
                links = [turn_links(prep.samples, prep.turn_spans, mb.layout) for mb in mini_batches]
                mini_batches, rows = parts.critic_mini_batches(mini_batches, self.rl_step, links)
                critic_rows += [_suffixed(r, name if multi else None) for r in rows]
            planned.append((name, list(mini_batches)))
        # every mini-batch's old (proximal) logprobs under theta_n, before the step's first update
        start = time.perf_counter()
        planned = [(name, [self._with_policy_logprobs(mb, name) for mb in mbs]) for name, mbs in planned]
        metrics["time/policy_logprobs_s"] = time.perf_counter() - start  # old and reference logprobs
        train_rows = self._train_mini_batches(planned, metrics)
        metrics.update(_mean_rows(train_rows))
        metrics.update(_mean_rows(critic_rows))
        metrics["optimizer_steps"] = float(len(train_rows))
        if critic_rows:
            metrics["critic/optimizer_steps"] = float(len(critic_rows))
        return metrics

    def _with_policy_logprobs(self, mb: Any, algorithm: str) -> Any:
        return dataclasses.replace(mb, batch=self.parts.with_policy_logprobs(mb.batch, algorithm=algorithm))

    def _train_mini_batches(
        self, planned: Sequence[tuple[str, Sequence[Any]]], metrics: dict[str, float]
    ) -> list[dict[str, float]]:
        """One optimizer step per packed mini-batch, algorithm by algorithm; adds each algorithm's
        advantage means to ``metrics`` and returns the optimizer steps' metric rows."""
        train_rows: list[dict[str, float]] = []
        multi = self.multi_algorithm
        for name, mini_batches in planned:
            adv_sums = np.zeros(3)
            for mb in mini_batches:
                packed = mb.batch
                if self.cfg.objective.off_policy.max_token_staleness is not None:
                    # the stale-token mask needs each token's distance from the weights trained here
                    packed = with_token_staleness(packed, self.rl_step)
                row = self.parts.train(packed, algorithm=name)
                row["pack/rows"] = float(mb.batch.tokens.shape[0])
                row["pack/efficiency"] = float(mb.metrics.get("packing_efficiency", math.nan))
                row["pack/shared_prefix_tokens"] = float(mb.metrics.get("shared_prefix_tokens", 0))
                train_rows.append(_suffixed(row, name if multi else None))
                adv_sums += advantage_sums(mb.batch)
            if adv_sums[2]:
                adv = {
                    "advantage/mean": adv_sums[0] / adv_sums[2],
                    "advantage/abs_mean": adv_sums[1] / adv_sums[2],
                }
                metrics.update(_suffixed(adv, name if multi else None))
        return train_rows

    def _eval_result(self, step: int, future: concurrent.futures.Future) -> dict[str, float]:
        result: RolloutResult = self.parts.scheduler.gather(future.result())
        return eval_metrics(result, step, tasks=self.parts.env_tasks.eval, pass_k=self.cfg.eval.pass_k)

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Runs (or resumes) the job; returns this process's per-step metrics."""
        if self.cfg.trainer.stall_timeout_s > 0:
            self.watchdog = trainer_watchdog(self, self.cfg.trainer.stall_timeout_s).start()
        try:
            with self.interrupts:
                resumed = self._restore() if self.resume else None
                self.sinks = RunSinks(
                    self.workdir,
                    resume_step=resumed,
                    table_keys=self.cfg.trainer.table_keys,
                    enabled=is_main_process(),
                    report=self.cfg.report,
                    config=config_record(self.cfg),
                    resume=self.resume,
                )
                try:
                    return self._run(resumed)
                finally:
                    self.sinks.close()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.parts.close()

    def _beat(self, phase: str) -> None:
        """Tells the watchdog the run made progress (``phase`` names it in a stall report); a Ctrl-C
        that arrived since and was swallowed (see :mod:`rljax.run.interrupt`) stops the run here."""
        self.interrupts.check()
        if self.watchdog is not None:
            self.watchdog.beat(phase)

    def _restore(self) -> int:
        return self.parts.restore(allow_config_change=self.allow_config_change)

    def _save(self, step: int) -> None:
        self.parts.save(step)

    def _warm_start(self) -> None:
        ws = self.cfg.warmstart
        if ws.num_steps == 0:
            return
        shown, skipped = self.parts.demonstrated_envs()
        if skipped and is_main_process():
            what = (
                f"it demonstrates {shown} only"
                if shown
                else "skipped (config.warmstart.num_steps=0: no notice)"
            )
            print(
                f"warm start: config.envs {skipped} have no solution(task) to demonstrate; {what}", flush=True
            )
        if not shown:
            return
        start = time.perf_counter()
        show = None if is_main_process() else False
        with metrics_lib.Progress(total=ws.num_steps, desc="warm start", unit="step", enabled=show) as bar:
            hist = self.parts.warm_start(
                on_step=lambda row: (bar.update(1), self._beat("warm start step")),
                log=lambda row: self.sinks.log(int(row["warmstart/step"]), row, phase="warmstart"),
            )
        print(
            f"warm start: {ws.num_steps} steps in {time.perf_counter() - start:.1f}s, "
            f"final CE {hist[-1]['warmstart/loss']:.4f}",
            flush=True,
        )

    def _run(self, resumed: int | None) -> list[dict[str, Any]]:
        if self.cfg.trainer.mode == "fully_async":
            return self._run_stream(resumed)
        run_start = time.perf_counter()
        t = self.cfg.trainer
        parts, sched = self.parts, self.parts.scheduler
        start, checkpoint_s = self._start(resumed, run_start)
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
            self._beat(f"step {n + 1}: waiting for its rollout")
            result, version_metrics = sched.result(n)
            self._beat(f"step {n + 1}: rollout received")
            if sched.holds_served_only_once:  # nothing samples version n again: its copy goes while training
                parts.release_served_weights()
            release_freed_host_memory()  # what sampling freed goes back before the step's buffers come
            rollout_wait = time.perf_counter() - step_start
            sched.fill(n + 1 + sched.lag)  # async: rollouts n+1..n+lag start now, sampling theta_{<= n}
            train_start = time.perf_counter()
            self.rl_step = n
            metrics = self._train_on(result.batch)
            jax.block_until_ready(self.state.params)
            self._beat(f"step {n + 1}: trained")
            train_time = time.perf_counter() - train_start
            parts.sync_weights(n + 1)
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
            checkpoint_s = self._finish_step(step_no, result, metrics, (run_start, step_start), checkpoint_s)
        if checkpoint_s is not None:
            logger.info("checkpoint step_%d took %.2fs", t.num_steps, checkpoint_s)
        return self.history

    def _run_stream(self, resumed: int | None) -> list[dict[str, Any]]:
        """The step loop of ``trainer.mode = "fully_async"`` (:mod:`rljax.run.streaming`): rollouts
        stream continuously; step ``n`` takes the next complete groups the staleness bound allows,
        trains ``theta_n`` and publishes ``theta_{n+1}`` without draining the engine. Evals, rows and
        checkpoints as in the other modes (an eval runs beside the stream and is reported in its
        step's row; the next version is published after it)."""
        run_start = time.perf_counter()
        t = self.cfg.trainer
        parts, sched = self.parts, self.parts.scheduler
        start, checkpoint_s = self._start(resumed, run_start)
        for n in range(start, t.num_steps):
            step_start = time.perf_counter()
            self._beat(f"step {n + 1}: waiting for complete groups")
            result, stream_metrics = sched.take(n)
            self._beat(f"step {n + 1}: groups taken")
            rollout_wait = time.perf_counter() - step_start
            train_start = time.perf_counter()
            self.rl_step = n
            metrics = self._train_on(result.batch)
            jax.block_until_ready(self.state.params)
            self._beat(f"step {n + 1}: trained")
            train_time = time.perf_counter() - train_start
            step_no = n + 1
            parts.sync_weights(step_no)  # published: the stream serves it next, nothing drained
            if sched.evaluates(step_no, t.eval_every):  # on theta_{n+1}, before the next version
                metrics.update(self._eval_result(step_no, sched.submit_eval(step_no)))
            metrics.update(rollout_step_metrics(result))
            metrics.update(stream_metrics)
            metrics.update({"time/rollout_wait_s": rollout_wait, "time/train_s": train_time})
            checkpoint_s = self._finish_step(step_no, result, metrics, (run_start, step_start), checkpoint_s)
        if checkpoint_s is not None:
            logger.info("checkpoint step_%d took %.2fs", t.num_steps, checkpoint_s)
        return self.history

    def _start(self, resumed: int | None, run_start: float) -> tuple[int, float | None]:
        """Every mode's start: the warm start and checkpoint 0 (a fresh run) or the resumed step,
        then the engines on that step's weights (and ``trainer.eval_at_start``'s eval) and the
        scheduler. ``run_start``: ``perf_counter()`` at the run's start. Returns the first step and
        the seconds checkpoint 0 took (None: none written)."""
        parts, t = self.parts, self.cfg.trainer
        parts.engines.check_frozen_models(parts.algorithms, parts.rollout_worker)  # fails in seconds
        checkpoint_s: float | None = None
        if resumed is None:
            self._warm_start()
            start = 0
            parts.set_reference()  # the KL penalty's reference: the weights RL starts from
            parts.sync_weights(0)
            if t.checkpoint_every:
                self.sinks.flush()  # the warm start's rows
                checkpoint_s = self._timed_save(0)
        else:
            start = resumed
            print(f"resumed from step {resumed} ({parts.ckpt_dir})", flush=True)
            if not parts.reference_in_checkpoint:
                parts.set_reference()  # a reference from an HF directory (none restored)
        self._print_old_logprobs()
        parts.sync_weights(start)
        parts.start_engines(start)
        release_freed_host_memory()  # what loading, the warm start and checkpoint 0 freed
        self._beat(f"engines started on version {start}")
        if resumed is None and t.eval_at_start and parts.env_tasks.eval:
            self._eval_start(run_start)
        parts.scheduler.start(start)
        return start, checkpoint_s

    def _eval_start(self, run_start: float) -> None:
        """``trainer.eval_at_start``: the held-out tasks on the starting weights (version 0), logged as
        step 0 (the curve's starting point; the baseline a run's gain is measured from) with the
        eval's seconds and the run's elapsed seconds (the warm start's included)."""
        start = time.perf_counter()
        metrics = self._eval_result(0, self.parts.scheduler.submit_eval(0))
        metrics["time/eval_s"] = time.perf_counter() - start
        metrics["time/elapsed_s"] = time.perf_counter() - run_start
        self.history.append({"step": 0, **metrics})
        self.sinks.log(0, metrics)
        self._beat("step 0: evaluated")

    def _print_old_logprobs(self) -> None:
        """The start line that says where each algorithm's old (proximal) logprobs come from, and why."""
        choices = self.parts.old_logprobs
        parts = [f"{mode} ({why})" if len(choices) == 1 else f"{name}: {mode} ({why})"
                 for name, (mode, why) in choices.items()]  # fmt: skip
        if is_main_process():
            print(f"old logprobs: {'; '.join(parts)}", flush=True)

    def _finish_step(
        self,
        step_no: int,
        result: RolloutResult,
        metrics: dict[str, Any],
        started: tuple[float, float],
        checkpoint_s: float | None,
    ) -> float | None:
        """Every mode's end of a step: its times, the row and rollout records in the sinks, and the
        checkpoint when one is due. ``started``: ``perf_counter()`` at the run's and the step's
        start; ``checkpoint_s``: the previous checkpoint's seconds, reported in this row. Returns
        this step's checkpoint seconds (None: none written)."""
        t = self.cfg.trainer
        run_start, step_start = started
        if checkpoint_s is not None:
            metrics["time/checkpoint_s"] = checkpoint_s  # of the checkpoint before this step
        if self.save_errors:
            metrics["checkpoint/save_errors"] = float(self.save_errors)
        metrics["time/step_s"] = time.perf_counter() - step_start
        metrics["time/elapsed_s"] = time.perf_counter() - run_start
        release_freed_host_memory()  # before the reading: what the step freed is not counted as held
        metrics.update({f"memory/{k}": v for k, v in host_memory_bytes().items()})
        metrics["throughput/samples_per_s"] = metrics["rollout/num_trajectories"] / metrics["time/step_s"]
        if t.mode == "fully_async":
            metrics["async/train_tokens_per_s"] = trained_tokens(result.batch) / metrics["time/step_s"]
        self.history.append({"step": step_no, **metrics})
        every = t.save_rollouts_every
        save = bool(every) and step_no % every == 0
        self.sinks.log_rollouts(step_no, result.trajectories, self.trace, save=save)
        self.sinks.log(step_no, metrics)
        if t.checkpoint_every and (step_no % t.checkpoint_every == 0 or step_no == t.num_steps):
            self.sinks.flush()  # the step's row and records are durable before `latest` moves
            return self._timed_save(step_no)
        return None

    def _timed_save(self, step: int) -> float:
        """Checkpoints ``step``; returns the seconds it took. A failed write stops the run or, with
        ``trainer.on_save_error="continue"``, is logged and counted (``latest`` still names an intact
        older checkpoint either way)."""
        start = time.perf_counter()
        try:
            self._save(step)
        except ckpt.CheckpointSaveError as e:
            if self.cfg.trainer.on_save_error == "stop":
                raise
            self.save_errors += 1
            logger.error("%s; training goes on (trainer.on_save_error='continue')", e)
            print(f"checkpoint step_{step} NOT saved: {e}", flush=True)
        release_freed_host_memory()  # orbax's host copies of the state
        self._beat(f"checkpoint step_{step}")
        return time.perf_counter() - start


def check_rollout_logprobs(algorithm: str, samples: Sequence[Any], objective: Any, *, old: str) -> None:
    """Refuses trainable samples without the sampler's logprobs when ``objective`` reads them (packed as
    0.0, every ratio would silently become ``p``). ``old``: where the old logprobs come from
    ("recompute" or "inference"; with "inference" their readers need the sampler's logprobs too).

    >>> from rljax.core.objective import ObjectiveConfig
    >>> from rljax.types import Step
    >>> s = [Step([1], [2], ("q", 0))]  # no response_logprobs
    >>> ppo = ObjectiveConfig(policy_loss="ppo_clip", components=("rl",))
    >>> check_rollout_logprobs("a", s, ppo, old="recompute")  # ppo_clip reads the recomputed ones
    >>> check_rollout_logprobs("a", s, ObjectiveConfig(components=("rl",)), old="recompute")
    Traceback (most recent call last):
    ...
    ValueError: 1 trainable sample(s) of algorithm 'a' have no response_logprobs (...), but policy loss ...
    """
    missing = [s for s in samples if s.response_logprobs is None and any(s.loss_mask)]
    if not missing:
        return
    readers = rollout_logprob_readers(objective, old_from_rollout=old == "inference")
    if readers:
        s = missing[0]
        raise ValueError(
            f"{len(missing)} trainable sample(s) of algorithm {algorithm!r} have no response_logprobs "
            f"(e.g. trajectory {s.trajectory_id.instance_id}#{s.trajectory_id.repetition_id}), but "
            f"{', '.join(readers)} read(s) the sampler's logprobs: record them in every Step (the "
            "engines do), or use trainer.old_logprobs='recompute' with a loss whose ratio is against "
            "the old policy"
        )


def _algorithm_named(algorithms: algos.AlgorithmConfig, name: str) -> algos.Algorithm:
    for a in algorithms.algorithms:
        if a.name == name:
            return a
    raise ValueError(f"a step names algorithm {name!r}, which this run lacks ({algorithms.names})")


def _suffixed(row: Mapping[str, float], suffix: str | None) -> dict[str, float]:
    """``row`` plus, with a suffix (a run mixing algorithms), every key again as ``<key>/<suffix>``."""
    return dict(row) if suffix is None else {f"{k}/{suffix}": v for k, v in row.items()} | dict(row)


def _mean_rows(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per key, the mean over the rows that have it; the maximum for a maximum (``MAX_METRICS``, also
    with an algorithm's ``/<name>`` suffix)."""

    def reduce(key: str) -> Callable[..., Any]:
        return np.max if any(key == m or key.startswith(m + "/") for m in MAX_METRICS) else np.mean

    return {k: float(reduce(k)([r[k] for r in rows if k in r])) for k in sorted({k for r in rows for k in r})}


def advantage_sums(batch: Any) -> np.ndarray:
    """``[sum w A, sum w |A|, sum w]`` over a packed mini-batch's tokens, ``w`` = loss mask x rl
    weight: the step's ``advantage/mean`` and ``advantage/abs_mean`` are their token-weighted ratios,
    under the same keys for every algorithm (group estimators; PPO's GAE from the critic)."""
    weights = np.asarray(batch.loss_mask, np.float64)
    if batch.rl_weights is not None:
        weights = weights * np.asarray(batch.rl_weights, np.float64)
    if batch.advantages is None:
        return np.zeros(3)
    adv = np.asarray(batch.advantages, np.float64)
    return np.array([(adv * weights).sum(), (np.abs(adv) * weights).sum(), weights.sum()])


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
