"""The agent loop: environments <-> inference engine, token-in / token-out (design §4).

For every task and each of ``group_size`` repetitions, one trajectory runs::

    env = make_env(); messages = env.reset(task)
    recorder = StepRecorder(renderer, trajectory_id, env=..., algorithm=..., temperature=...)
    prompt = recorder.prompt_for(messages, tools=env.tools)           # full render of the prompt
    loop over turns:
        c = await engine.generate(prompt.ids, sampling, session_id="<task id>#<rep>")
        call = recorder.record(prompt, c)     # -> one Step(prompt.ids, c.ids, c.logprobs, ...)
        messages, reward, done, info = env.step(Action(decoded text, call.parsed))  # parsed FROM THE IDS
        call.reward = reward
        prompt = recorder.continue_with(messages)   # bridge: next prompt = prompt + c.ids + new ids,
                                                    # or a full render when the renderer cannot prove it
    steps = recorder.steps()

The per-call bookkeeping (prompts, bridging, the Step fields and their rules below) is the public
:class:`rljax.recording.StepRecorder`, which other front ends (an OpenAI-compatible gateway, a
token-in sampling API) use the same way. Generated text is decoded only for the environment;
the trainer sees exactly ``c.ids`` and ``c.logprobs``. Trajectories run concurrently
(``asyncio``, at most ``max_concurrency`` at a time) and the result is returned in a
deterministic order (task order, then repetition, then turn).

Decisions (design §4 leaves them open):

* **Rewards** are placed where the environment gives them: each step gets the reward ``env.step``
  returned for it (outcome environments return 0 until the last step). A trajectory's reward in
  the metrics is its last step's reward (design §2.3).
* **stop_reason** is the engine's finish reason ("stop" / "length"); tool-calling turns that ended
  on the end-of-turn token are "stop". A trajectory cut by the context limit ends with "length" on
  its last step.
* **Truncated turns** (finish "length": ``max_tokens`` or the context budget ran out) are still
  shown to the environment (``action.stopped`` is False), then the trajectory ends with that
  step's reward. Their loss mask stays 1: the ids and logprobs are exact, and design §3.7's overlong
  filter is the configurable place to mask them (DAPO-style overlong handling).
* **Errors**: an exception from the environment (reset, step, malformed messages) or the engine,
  or an engine "abort", marks the trajectory errored: all its steps get loss mask 0 and reward 0,
  the last one gets stop_reason "error" (environment) or "abort" (engine); nothing partial is
  ever trained on. With ``on_error="drop"`` its steps are left out instead. Errored trajectories
  are counted in the metrics and listed in ``RolloutResult.trajectories``; one bad trajectory never
  crashes the run. A rollout in which EVERY trajectory errored raises :class:`RolloutError`
  (chained to the first error, its traceback in the message) instead of returning nothing to
  train on (``RolloutConfig.raise_on_all_errored=False`` returns it anyway).
* **Environment execution**: every env call (``reset``, ``step``, ``get_metrics``, ``close``) has
  a time limit (``env_timeout_s``; a call past it errors its trajectory with kind
  "env_timeout"). Synchronous env calls run on daemon threads, at most ``env_workers`` at once
  (default ``max_concurrency``), so a slow env never blocks the event loop or the engine's
  batching; ``async def`` methods run on the loop. A timed-out synchronous call cannot be killed:
  its thread is abandoned (the trajectory moves on, the call's slot is freed for the next one, and
  :func:`abandoned_env_calls` counts the threads still running). The threads are daemons, so an
  env call that never returns never keeps the process from exiting (a thread pool's workers would:
  Python joins them at exit). ``close()`` is called at the end of every
  trajectory that built an env, errored ones included; ``get_metrics()`` (skyrl-gym) just before
  it, and the per-env aggregates land in the metrics as ``env/<env name>/<key>`` (the env's
  ``aggregate_metrics(list)`` when it has one, else the mean of numeric values).
* **Greedy** requests (``temperature`` 0) record ``temperature=1.0`` on their steps, matching the
  logprobs the engines return for greedy rows.
* ``max_turns`` reached without ``done``: the trajectory ends; its last step keeps its reward.
* Every Step carries ``prompt_roles`` (``Prompt.roles`` of :mod:`rljax.recording`, the same as
  ``ChatSession.full_prompt_roles``: per prompt token, the role of the message whose body it is,
  None for template scaffolding), which the echo algorithm (:mod:`rljax.data.echo`) uses to find
  the environment's tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import inspect
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from rljax import knobs
from rljax.chat.base import Renderer
from rljax.data import StepBatch
from rljax.envs.base import Action, Task, as_step_result, mean_numeric_metrics
from rljax.inference.engine import Completion, Engine, SamplingParams
from rljax.knobs import knob
from rljax.recording import RecordedCall, StepRecorder
from rljax.types import Step, TrajectoryID

__all__ = [
    "EnvTimeoutError",
    "RolloutConfig",
    "RolloutError",
    "RolloutResult",
    "TrajectoryRecord",
    "abandoned_env_calls",
    "merge_rollout_results",
    "rollout",
    "run_rollout",
]

logger = logging.getLogger(__name__)

ERROR_KINDS = ("env", "env_timeout", "engine", "prompt_too_long")


class EnvTimeoutError(TimeoutError):
    """An environment call ran past ``RolloutConfig.env_timeout_s``."""


class RolloutError(RuntimeError):
    """Every trajectory of a rollout errored (the message carries the first error's traceback)."""


#: ``RolloutConfig.on_error`` values.
ON_ERROR: tuple[str, ...] = ("mask", "drop")


@knobs.section
class RolloutConfig:
    """Rollout settings.

    The turn budget is ``min(max_tokens, max_context_len - len(prompt))``; a prompt that fills the
    context ends the trajectory with stop_reason "length". ``temperature``, ``top_p`` and ``top_k``
    follow :class:`rljax.inference.engine.SamplingParams`' rules.

    The defaults are those of a run's ``config.rollout`` (the default recipe: a tiny model on
    CPU); real models raise ``max_tokens`` and ``max_context_len``.

    >>> RolloutConfig(group_size=2).max_turns
    3
    """

    group_size: int = knob(8, ge=1, doc="repetitions per task (one GRPO group per task id)")
    max_turns: int = knob(3, ge=1, doc="most assistant turns per trajectory")
    max_tokens: int = knob(64, ge=1, doc="most tokens per assistant turn")
    max_context_len: int = knob(
        512,
        ge=1,
        doc="most tokens of prompt + completion in any turn (a prompt that fills it ends the "
        'trajectory with stop_reason "length")',
    )
    temperature: float = knob(1.0, ge=0, doc="sampling temperature (0 = greedy)")
    top_p: float = knob(1.0, gt=0, le=1, doc="nucleus mass (1 = off)")
    top_k: int | None = knob(None, ge=1, doc="keep the k most likely tokens (None = off)")
    max_concurrency: int = knob(256, ge=1, doc="most trajectories in flight at once")
    seed: int | None = knob(
        None,
        doc="when set, request ``k`` of trajectory ``(task, rep)`` uses a seed derived from ``(seed, "
        "task id, rep, turn)``, so engines with per-request seeds reproduce the rollout whatever the "
        "scheduling; None lets the engine choose",
    )
    algorithm: str = knob("grpo", doc="algorithm name recorded on the steps")
    env_algorithms: Mapping[str, str] = knob({}, doc="env name -> algorithm name, overriding ``algorithm``")
    bridge: bool = knob(
        True, doc="extend the previous prompt + completion when the renderer can (else full renders)"
    )
    on_error: str = knob(
        "mask",
        choices=ON_ERROR,
        doc="``mask`` (keep errored trajectories with loss mask 0) or ``drop`` (leave their steps out)",
    )
    env_timeout_s: float | None = knob(
        300.0, gt=0, doc="time limit of each environment call in seconds (None = none)"
    )
    env_workers: int | None = knob(
        None, ge=1, doc="threads running synchronous environment calls (None = ``max_concurrency``)"
    )
    raise_on_all_errored: bool = knob(
        True, doc="raise :class:`RolloutError` when every trajectory of a rollout errored"
    )

    def __post_init__(self) -> None:
        # The engine's own rules for temperature / top_p / top_k (a finite temperature too).
        self.sampling(max_tokens=1, seed=None)

    def sampling(
        self, *, max_tokens: int, seed: int | None, stop_token_ids: Sequence[int] = ()
    ) -> SamplingParams:
        """The SamplingParams of one request."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )


@dataclasses.dataclass
class TrajectoryRecord:
    """What happened in one trajectory (besides its steps).

    Attributes:
      trajectory_id: the trajectory.
      env: environment name.
      reward: the last step's reward (0 for errored trajectories).
      num_turns: steps emitted.
      end: "done", "length", "max_turns", "error" or "abort".
      error_kind: None, or one of "env", "env_timeout", "engine", "prompt_too_long".
      error: the exception text, when errored.
      bridged: per transition between turns, whether the next prompt extended the previous one.
      infos: the ``info`` dicts ``env.step`` returned.
      steps: the trajectory's Steps (its :class:`rljax.recording.StepRecorder`'s), errored ones
        included (masked); ``on_error="drop"`` leaves those out of the batch, not out of here.
      env_metrics: what ``env.get_metrics()`` returned (envs that have it).
      close_error: the exception text when ``env.close()`` failed (the trajectory stands).
      exception: the exception object of the error (its traceback included), when there is one.
      calls: the recorder's calls, one per step in the same order (each call's
        ``prompt.messages`` is the conversation the engine was prompted with; ``returned`` what the
        caller was answered, set by front doors that answer a client, else None and ``reply``
        stands). Rollout records (``rollouts/step_<S>.jsonl``) are written from them.
    """

    trajectory_id: TrajectoryID
    env: str = ""
    reward: float = 0.0
    num_turns: int = 0
    end: str = "done"
    error_kind: str | None = None
    error: str | None = None
    bridged: list[bool] = dataclasses.field(default_factory=list)
    infos: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    steps: list[Step] = dataclasses.field(default_factory=list, repr=False)
    env_metrics: dict[str, Any] | None = None
    close_error: str | None = None
    exception: BaseException | None = dataclasses.field(default=None, repr=False, compare=False)
    aggregate_metrics: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    calls: list[RecordedCall] = dataclasses.field(default_factory=list, repr=False, compare=False)

    @property
    def errored(self) -> bool:
        """Whether the trajectory ended on an error."""
        return self.error_kind is not None

    def fail(self, kind: str, error: BaseException | str) -> None:
        """Records that the trajectory failed with ``error`` of ``kind`` (an engine error aborts it)."""
        self.error_kind = kind
        self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.exception = None if isinstance(error, str) else error
        self.end = "abort" if kind == "engine" else "error"


class RolloutResult(NamedTuple):
    """``batch``: the validated steps; ``metrics``: floats; ``trajectories``: one record each."""

    batch: StepBatch
    metrics: dict[str, float]
    trajectories: list[TrajectoryRecord]


def request_seed(seed: int, task_id: str, repetition: int, turn: int) -> int:
    """A 31-bit seed derived from ``(seed, task id, repetition, turn)`` (stable across processes).

    >>> request_seed(0, "q", 0, 0) == request_seed(0, "q", 0, 0) != request_seed(0, "q", 1, 0)
    True
    """
    digest = hashlib.sha256(f"{seed}\x00{task_id}\x00{repetition}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


EnvFactory = Callable[[], Any]


def _for_task(value: Any, task: Task, what: str) -> Any:
    """``value[task.env]`` for a per-env mapping (``what`` names it in errors), else ``value``."""
    if isinstance(value, Mapping):
        if task.env not in value:
            raise ValueError(
                f"task {task.id!r} names env {task.env!r}, which {what} does not have "
                f"(it has {sorted(value)})"
            )
        return value[task.env]
    return value


def _factory_for(make_env: EnvFactory | Mapping[str, EnvFactory], task: Task) -> EnvFactory:
    return _for_task(make_env, task, "make_env")


def _engine_for(engine: Engine | Mapping[str, Engine], task: Task) -> Engine:
    return _for_task(engine, task, "the engine mapping")


_abandoned_lock = threading.Lock()
_abandoned = 0  # synchronous env calls past their deadline whose threads still run


def abandoned_env_calls() -> int:
    """Synchronous env calls abandoned at their deadline whose threads have not returned yet.

    >>> abandoned_env_calls()
    0
    """
    with _abandoned_lock:
        return _abandoned


def _count_abandoned(delta: int) -> None:
    global _abandoned
    with _abandoned_lock:
        _abandoned += delta


class _EnvRunner:
    """Runs environment calls: ``async def`` methods on the loop, sync ones each on a daemon thread
    (at most ``workers`` at once), each under ``timeout`` seconds."""

    def __init__(self, workers: int, timeout: float | None) -> None:
        self.slots = asyncio.Semaphore(workers)
        self.timeout = timeout
        self.seconds = 0.0  # summed durations of the calls (they overlap each other and sampling)

    async def call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            if inspect.iscoroutinefunction(fn):
                return await self._timed(fn(*args), what, start)
            async with self.slots:  # a call abandoned at its deadline frees its slot when it is left
                start = loop.time()
                return await self._timed(_on_daemon_thread(loop, fn, args, what), what, start)
        finally:
            self.seconds += loop.time() - start

    async def _timed(self, pending: Any, what: str, start: float) -> Any:
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(pending, self.timeout)
            if inspect.isawaitable(result):  # a sync function that returned an awaitable
                result = await asyncio.wait_for(result, self.timeout)
        except TimeoutError:
            if self.timeout is None or loop.time() - start < self.timeout:
                raise  # the env's own TimeoutError
            raise EnvTimeoutError(f"env.{what} took longer than env_timeout_s={self.timeout}") from None
        return result


def _on_daemon_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], args: tuple, what: str
) -> asyncio.Future:
    """A future of ``fn(*args)`` run on a new daemon thread; a call still running when its future
    is cancelled (its deadline passed) is counted by :func:`abandoned_env_calls` until it returns."""
    future = loop.create_future()
    state = {"abandoned": False, "returned": False}
    lock = threading.Lock()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting trajectory
            deliver = functools.partial(future.set_exception, e)
        else:
            deliver = functools.partial(future.set_result, value)
        with lock:
            state["returned"] = True
            if state["abandoned"]:
                _count_abandoned(-1)
                return
        try:
            loop.call_soon_threadsafe(settle, deliver)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this call
            pass

    def on_done(f: asyncio.Future) -> None:
        if f.cancelled():
            with lock:
                if not state["returned"]:
                    state["abandoned"] = True
                    _count_abandoned(1)

    thread = threading.Thread(target=run, name=f"rljax-env-{what}", daemon=True)
    future.add_done_callback(on_done)
    thread.start()
    return future


def _fail_env(rec: TrajectoryRecord, e: BaseException) -> None:
    rec.fail("env_timeout" if isinstance(e, EnvTimeoutError) else "env", e)


async def _run_trajectory(
    task: Task,
    repetition: int,
    *,
    engine: Engine,
    renderer: Renderer,
    make_env: EnvFactory | Mapping[str, EnvFactory],
    config: RolloutConfig,
    stop_ids: tuple[int, ...],
    vocab_size: int | None,
    runner: _EnvRunner,
) -> TrajectoryRecord:
    tid = TrajectoryID(task.id, repetition)
    rec = TrajectoryRecord(tid)
    try:
        env = _factory_for(make_env, task)()
    except Exception as e:  # a broken env (or its messages) must not crash the run
        rec.fail("env", e)
        return rec
    # the task's env name is the key the run's per-env algorithms and engines use
    rec.env = task.env or str(getattr(env, "name", None) or type(env).__name__)
    recorder = StepRecorder(
        renderer,
        tid,
        env=rec.env or "default",
        algorithm=config.env_algorithms.get(rec.env, config.algorithm),
        temperature=config.temperature,
        bridge=config.bridge,
    )
    try:
        await _episode(
            task,
            repetition,
            rec,
            env,
            recorder,
            engine=engine,
            config=config,
            stop_ids=stop_ids,
            vocab_size=vocab_size,
            runner=runner,
        )
    finally:
        await _finish_env(rec, env, runner)
    if rec.errored:  # get_metrics may have failed after the episode: decided only now
        recorder.fail("abort" if rec.error_kind == "engine" else "error")
    rec.steps = recorder.steps()
    rec.calls = list(recorder.calls)
    rec.num_turns = len(rec.steps)
    rec.reward = 0.0 if rec.errored or not rec.steps else float(rec.steps[-1].reward)
    return rec


async def _finish_env(rec: TrajectoryRecord, env: Any, runner: _EnvRunner) -> None:
    """``get_metrics()`` then ``close()`` (when the env has them), whatever happened before."""
    get_metrics = getattr(env, "get_metrics", None)
    if callable(get_metrics) and not rec.errored:
        try:
            metrics = await runner.call(get_metrics, what="get_metrics")
            rec.env_metrics = dict(metrics or {})
            rec.aggregate_metrics = getattr(env, "aggregate_metrics", None)
        except Exception as e:
            _fail_env(rec, e)
    close = getattr(env, "close", None)
    if callable(close):
        try:
            await runner.call(close, what="close")
        except Exception as e:  # the episode is over; its data stand
            rec.close_error = f"{type(e).__name__}: {e}"
            logger.warning("env.close() of trajectory %s failed: %s", rec.trajectory_id, rec.close_error)


async def _episode(
    task: Task,
    repetition: int,
    rec: TrajectoryRecord,
    env: Any,
    recorder: StepRecorder,
    *,
    engine: Engine,
    config: RolloutConfig,
    stop_ids: tuple[int, ...],
    vocab_size: int | None,
    runner: _EnvRunner,
) -> None:
    tid = rec.trajectory_id
    try:
        messages = await runner.call(env.reset, task, what="reset")
        prompt = recorder.prompt_for(messages, tools=getattr(env, "tools", None))
    except Exception as e:  # a broken env (or its messages) must not crash the run
        _fail_env(rec, e)
        return
    if len(prompt.ids) >= config.max_context_len:
        rec.fail("prompt_too_long", f"initial prompt has {len(prompt.ids)} tokens >= max_context_len")
        return
    for turn in range(config.max_turns):
        budget = min(config.max_tokens, config.max_context_len - len(prompt.ids))
        seed = None if config.seed is None else request_seed(config.seed, task.id, repetition, turn)
        try:
            completion = await engine.generate(
                list(prompt.ids),
                config.sampling(max_tokens=budget, seed=seed, stop_token_ids=stop_ids),
                session_id=str(tid),
            )
            if not isinstance(completion, Completion):
                raise TypeError(f"engine.generate returned {type(completion).__name__}, not a Completion")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in completion.ids):
                raise ValueError(f"engine returned a token id outside the vocabulary [0, {vocab_size})")
        except Exception as e:
            rec.fail("engine", e)
            break
        ids = list(completion.ids)
        call = recorder.record(prompt, completion) if ids else None
        if completion.finish_reason == "abort" or call is None:
            rec.fail(
                "engine", f"engine returned finish_reason={completion.finish_reason!r} with {len(ids)} ids"
            )
            break
        try:
            parsed = call.parsed
            text = recorder.renderer.decode(ids[:-1] if parsed.stopped else ids)
            action = Action.from_parsed(text, parsed)
            result = as_step_result(await runner.call(env.step, action, what="step"))
        except Exception as e:
            _fail_env(rec, e)
            break
        call.reward = result.reward
        rec.infos.append(result.info)
        if result.done:
            rec.end = "done"
            break
        if completion.finish_reason == "length":
            rec.end = "length"
            break
        if turn + 1 == config.max_turns:
            rec.end = "max_turns"
            break
        try:
            # bridged, or (config.bridge False, or the renderer cannot prove the bridge) a full
            # render of the whole history, the parsed assistant turns included
            prompt = recorder.continue_with(result.messages)
        except Exception as e:
            _fail_env(rec, e)
            break
        rec.bridged.append(prompt.extended)
        if len(prompt.ids) >= config.max_context_len:
            call.cut("length")
            rec.end = "length"
            break


def _steps_of(rec: TrajectoryRecord, config: RolloutConfig) -> list[Step]:
    """The record's steps for the batch (none for an errored one under ``on_error="drop"``)."""
    if rec.errored and config.on_error == "drop":
        return []
    return list(rec.steps)


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def rollout_metrics(records: Sequence[TrajectoryRecord], wall_time_s: float) -> dict[str, float]:
    """Counts and means over trajectories (errored ones counted, not averaged into rewards)."""
    ok = [r for r in records if not r.errored]
    rewards = [r.reward for r in ok]
    turns = [r.num_turns for r in ok]
    response_tokens = sum(len(s.response_ids) for r in records for s in r.steps)
    prompt_tokens = [len(s.prompt_ids) for r in records for s in r.steps]
    bridged = [b for r in records for b in r.bridged]
    versions = [s.policy_version for r in records for s in r.steps]
    metrics: dict[str, float] = {
        "num_trajectories": float(len(records)),
        "num_completed": float(len(ok)),
        "num_errored": float(len(records) - len(ok)),
        "reward_mean": _mean(rewards),
        "reward_std": float(np.std(rewards)) if rewards else 0.0,
        "reward_max": float(max(rewards)) if rewards else 0.0,
        "turns_mean": _mean(turns),
        "turns_max": float(max(turns)) if turns else 0.0,
        "num_steps": float(sum(r.num_turns for r in records)),
        "response_tokens": float(response_tokens),
        "response_tokens_per_turn": response_tokens / max(1, len(prompt_tokens)),
        "prompt_tokens_mean": _mean(prompt_tokens),
        "bridged_fraction": _mean([float(b) for b in bridged]),
        "end_length_fraction": _mean([float(r.end == "length") for r in records]),
        "end_max_turns_fraction": _mean([float(r.end == "max_turns") for r in records]),
        "policy_version_min": float(min(versions)) if versions else math.nan,
        "policy_version_max": float(max(versions)) if versions else math.nan,
        "wall_time_s": float(wall_time_s),
        "response_tokens_per_s": response_tokens / wall_time_s if wall_time_s > 0 else 0.0,
    }
    for kind in ERROR_KINDS:
        metrics[f"errored_{kind}"] = float(sum(r.error_kind == kind for r in records))
    metrics["env_close_errors"] = float(sum(r.close_error is not None for r in records))
    for env in sorted({r.env for r in ok}):
        metrics[f"reward_mean/{env}"] = _mean([r.reward for r in ok if r.env == env])
    metrics.update(env_metrics(records))
    return metrics


def merge_rollout_results(results: Sequence[RolloutResult]) -> RolloutResult:
    """One result from the rollouts of disjoint task shares, in the order given.

    Steps and records are concatenated (trajectories never span shares, so the batch stays
    valid: each share's batch was validated), the metrics are recomputed over all records, and
    the wall time is the slowest share's. The trainer of a multi-process run gathers every
    process's share with it, so the step's batch equals a one-process rollout of all the tasks.
    """
    if not results:
        raise ValueError("merge_rollout_results needs at least one result")
    if len(results) == 1:
        return results[0]
    records = [r for res in results for r in res.trajectories]
    metrics = rollout_metrics(records, max(res.metrics["wall_time_s"] for res in results))
    if all("env_s" in res.metrics for res in results):
        metrics["env_s"] = sum(res.metrics["env_s"] for res in results)
    steps = [s for res in results for s in res.batch]
    first = results[0].batch
    metadata = {**first.metadata, "rollout": metrics}
    batch = StepBatch._trusted(steps, vocab_size=first.vocab_size, metadata=metadata)
    return RolloutResult(batch, metrics, records)


def env_metrics(records: Sequence[TrajectoryRecord]) -> dict[str, float]:
    """``env/<env>/<key>``: each env's ``get_metrics()`` dicts aggregated over its trajectories
    (by the env's ``aggregate_metrics`` when it has one, else numeric means); non-finite and
    non-numeric aggregates are left out."""
    out: dict[str, float] = {}
    for env in sorted({r.env for r in records if r.env_metrics is not None}):
        recs = [r for r in records if r.env == env and r.env_metrics is not None]
        aggregate = next((r.aggregate_metrics for r in recs if r.aggregate_metrics is not None), None)
        episode = [r.env_metrics or {} for r in recs]
        try:
            agg = dict(aggregate(episode)) if aggregate is not None else mean_numeric_metrics(episode)
        except Exception as e:  # a broken aggregator must not lose the rollout
            logger.warning("aggregate_metrics of env %s failed (%s); using numeric means", env, e)
            agg = mean_numeric_metrics(episode)
        for key, value in agg.items():
            if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
                out[f"env/{env}/{key}"] = float(value)
    return out


def _raise_all_errored(records: Sequence[TrajectoryRecord]) -> None:
    first = records[0]
    detail = ""
    if first.exception is not None:
        detail = "\n" + "".join(
            traceback.format_exception(type(first.exception), first.exception, first.exception.__traceback__)
        )
    raise RolloutError(
        f"every trajectory of the rollout errored ({len(records)}; nothing to train on). First: "
        f"{first.trajectory_id} ({first.error_kind}): {first.error} "
        f"(RolloutConfig.raise_on_all_errored=False returns such rollouts instead){detail}"
    ) from first.exception


async def rollout(
    tasks: Sequence[Task],
    *,
    engine: Engine,
    renderer: Renderer,
    make_env: EnvFactory | Mapping[str, EnvFactory],
    config: RolloutConfig = RolloutConfig(),
    vocab_size: int | None = None,
) -> RolloutResult:
    """Runs ``group_size`` trajectories per task concurrently; returns steps, metrics and records.

    Args:
      tasks: the tasks (``Task.id`` is the group key; ids must be unique).
      engine: an :class:`rljax.inference.engine.Engine` (embedded sampler, vLLM pool, fake), or
        a mapping from ``Task.env`` to engines (e.g. sft envs sample from a frozen model).
      renderer: the chat format (:mod:`rljax.chat`); its ``stop_token_ids()`` end each turn.
      make_env: zero-argument factory of a fresh environment per trajectory, or a mapping from
        ``Task.env`` to such factories (one rollout may mix environments).
      config: :class:`RolloutConfig`.
      vocab_size: enables the token-id range check of the returned :class:`StepBatch`.

    Returns:
      :class:`RolloutResult` ``(batch, metrics, trajectories)``.
    """
    tasks = list(tasks)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"task ids must be unique (they are the group keys); {dup!r} appears twice")
    for t in tasks:
        _factory_for(make_env, t)  # fail fast on a missing env factory
        _engine_for(engine, t)
    stop_ids = tuple(int(i) for i in renderer.stop_token_ids())
    semaphore = asyncio.Semaphore(config.max_concurrency)
    runner = _EnvRunner(config.env_workers or config.max_concurrency, config.env_timeout_s)

    async def bounded(task: Task, rep: int) -> TrajectoryRecord:
        async with semaphore:
            return await _run_trajectory(
                task,
                rep,
                engine=_engine_for(engine, task),
                renderer=renderer,
                make_env=make_env,
                config=config,
                stop_ids=stop_ids,
                vocab_size=vocab_size,
                runner=runner,
            )

    start = time.perf_counter()
    records = await asyncio.gather(*(bounded(t, r) for t in tasks for r in range(config.group_size)))
    wall = time.perf_counter() - start
    for rec in records:
        if rec.errored:
            logger.warning("trajectory %s errored (%s): %s", rec.trajectory_id, rec.error_kind, rec.error)
    if records and config.raise_on_all_errored and all(r.errored for r in records):
        _raise_all_errored(records)
    steps = [s for rec in records for s in _steps_of(rec, config)]
    metrics = rollout_metrics(records, wall)
    metrics["env_s"] = runner.seconds  # summed seconds of env calls (overlapping: not a share of wall)
    return RolloutResult(
        StepBatch(steps, vocab_size=vocab_size, metadata={"rollout": metrics}), metrics, records
    )


def run_rollout(tasks: Sequence[Task], **kwargs: Any) -> RolloutResult:
    """Synchronous :func:`rollout` (``asyncio.run``); same arguments."""
    return asyncio.run(rollout(tasks, **kwargs))
