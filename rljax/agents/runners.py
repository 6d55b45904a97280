"""Agents as users write them, run against the gateway: the agent rollout.

An **agent function** is what ``config.envs.<name>.agent = "module:function"`` names::

    async def function(task: rljax.envs.Task, client: openai.AsyncOpenAI, **kwargs) -> float | dict

It gets the task and an ``openai.AsyncOpenAI`` bound to ITS rollout (``client.base_url`` and
``client.api_key`` work in any framework: LiteLLM, LangGraph, smolagents, a subprocess) and
returns the reward, or ``{"reward": r, "metrics": {...}}``, or None when it posted the reward to the
gateway (``POST /v1/rewards``). ``kwargs`` are ``config.envs.<name>.kwargs`` (none by default). A
plain ``def`` runs in a thread and gets a synchronous ``openai.OpenAI`` instead.
An **agent command** (``agent_command = "..."``, :class:`CommandAgent`) is an external process run
by the shell with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set for its rollout and the task as JSON
in ``RLJAX_TASK``; its reward is its last stdout line as JSON (a number or the dict above), or posted.

:func:`agent_rollout` runs ``group_size`` rollouts of each task, exactly like the env loop
(:func:`rljax.rollout.rollout`): at most ``max_concurrency`` at a time, each under
``env_timeout_s``, the same :class:`~rljax.rollout.TrajectoryRecord` / :class:`~rljax.rollout.RolloutResult`.
Every call through the gateway is one Step of the trajectory (``calls`` holds them, with
``returned`` = what the client got); the reward goes on the last call (per-call rewards posted with a
``completion_id`` stay on their calls). Errors, counted in the metrics and masked (loss mask 0, reward
0, never in a baseline): the agent raised or returned a bad reward (kind "env"), ran past
``env_timeout_s`` ("env_timeout"), made no call ("env"), or a call's engine request failed
("engine"). ``TrajectoryRecord.env_metrics`` holds the returned metrics (aggregated as
``env/<env>/<key>``), ``end`` is "length" when the last call ran out of tokens, else "done".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import math
import os
import pickle
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rljax.data import StepBatch
from rljax.envs.base import Task
from rljax.envs.rewards import load_function
from rljax.gateway.server import Gateway
from rljax.inference.engine import Engine
from rljax.recording import StepRecorder
from rljax.rollout import (
    EnvTimeoutError,
    RolloutConfig,
    RolloutResult,
    TrajectoryRecord,
    _on_daemon_thread,
    _raise_all_errored,
    rollout_metrics,
)
from rljax.types import TrajectoryID

__all__ = [
    "AgentFn",
    "CommandAgent",
    "agent_rollout",
    "load_agent",
    "parse_agent_result",
    "run_agent_rollout",
]

#: An agent function: ``async def agent(task, client, **kwargs)`` with an ``openai.AsyncOpenAI``
#: client bound to its rollout's gateway session (:func:`load_agent` imports one by name).
AgentFn = Callable[..., Any]


def load_agent(spec: str | AgentFn) -> AgentFn:
    """The agent function of ``"module:function"`` (dotted attributes allowed), or ``spec`` itself
    when it is already callable.

    >>> load_agent("rljax.agents.lookup_agent:lookup_agent").__name__
    'lookup_agent'
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"an agent is named 'module:function', got {spec!r}")
    try:
        return load_function(spec)  # the loader reward functions use (rljax.envs.rewards)
    except ValueError as e:
        raise ValueError(f"agent: {e}") from None


def parse_agent_result(value: Any) -> tuple[float | None, dict[str, Any]]:
    """``(reward, metrics)`` of what an agent returned (a number, ``{"reward", "metrics"}``, or None).

    >>> parse_agent_result(1), parse_agent_result({"reward": 0.5, "metrics": {"turns": 2}})
    ((1.0, {}), (0.5, {'turns': 2}))
    """
    metrics: dict[str, Any] = {}
    if isinstance(value, Mapping):
        metrics = dict(value.get("metrics") or {})
        value = value.get("reward")
    if value is None:
        return None, metrics
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the agent's reward must be a finite number, got {value!r}")
    return float(value), metrics


class CommandAgent:
    """An external agent process (``config.envs.<name>.agent_command``), run per rollout by the shell.

    Environment: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the rollout's), ``RLJAX_TASK`` (the task
    as JSON: id, data, messages, reward_spec, data_source, extra_info), ``RLJAX_AGENT_KWARGS``.
    Result: the last non-empty stdout line parsed as JSON (see :func:`parse_agent_result`), or
    None when it is not JSON (the reward must then have been posted). A non-zero exit is an error
    (its stderr's tail in the message). A cancelled rollout (time limit) kills the process.
    ``RLJAX_ROLLOUT_BASE_URL`` is the rollout's own base URL (for tools that take no API key).
    """

    def __init__(self, command: str, *, cwd: str | None = None) -> None:
        if not isinstance(command, str) or not command.strip():
            raise ValueError("agent_command must be a non-empty shell command")
        self.command = command
        self.cwd = cwd
        self.__name__ = "agent_command"

    async def __call__(self, task: Task, client: Any, **kwargs: Any) -> Any:
        env = dict(os.environ)
        env.update(
            OPENAI_BASE_URL=str(client.base_url).rstrip("/"),
            OPENAI_API_KEY=str(client.api_key),
            RLJAX_TASK=json.dumps(_task_json(task), default=str),
            RLJAX_AGENT_KWARGS=json.dumps(kwargs, default=str),
            RLJAX_ROLLOUT_BASE_URL=str(client.base_url).rstrip("/").removesuffix("/v1")
            + f"/rollouts/{client.api_key}/v1",
        )
        proc = await asyncio.create_subprocess_shell(
            self.command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=self.cwd,
            start_new_session=True,  # its own process group: the kill below reaches its children too
        )
        try:
            out, err = await proc.communicate()
        finally:
            _kill_group(proc.pid)  # the shell, and whatever it started that still runs
            if proc.returncode is None:
                await proc.wait()
        if proc.returncode:
            tail = err.decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"agent_command exited with {proc.returncode}: {tail}")
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except ValueError:
            return None


def _kill_group(pgid: int) -> None:
    """SIGKILLs process group ``pgid`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _task_json(task: Task) -> dict[str, Any]:
    return {
        "id": task.id,
        "data": dict(task.data),
        "env": task.env,
        "messages": None if task.messages is None else [dict(m) for m in task.messages],
        "reward_spec": None if task.reward_spec is None else dict(task.reward_spec),
        "data_source": task.data_source,
        "extra_info": None if task.extra_info is None else dict(task.extra_info),
    }


def _for_task(value: Any, task: Task, what: str) -> Any:
    if isinstance(value, Mapping):
        if task.env not in value:
            raise ValueError(f"task {task.id!r} names env {task.env!r}, which {what} does not have")
        return value[task.env]
    return value


async def _call_agent(
    fn: AgentFn, task: Task, gateway: Gateway, session: Any, config: RolloutConfig, kwargs: Mapping[str, Any]
) -> Any:
    timeout = config.env_timeout_s
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        client = gateway.client(session, timeout=timeout)
        try:
            return await fn(task, client, **kwargs)
        finally:
            await client.close()
    sync_client = gateway.client(session, timeout=timeout, sync=True)
    try:
        # a daemon thread: an agent that never returns is abandoned at its deadline and never keeps
        # the process from exiting (a thread pool's workers are joined at exit)
        result = await _on_daemon_thread(
            asyncio.get_running_loop(), functools.partial(fn, task, sync_client, **kwargs), (), "agent"
        )
    finally:
        sync_client.close()
    if inspect.isawaitable(result):
        result = await result
    return result


async def _run_agent_trajectory(
    task: Task,
    repetition: int,
    *,
    agent: AgentFn,
    kwargs: Mapping[str, Any],
    gateway: Gateway,
    engine: Engine,
    config: RolloutConfig,
) -> TrajectoryRecord:
    tid = TrajectoryID(task.id, repetition)
    env_name = task.env or "agent"
    rec = TrajectoryRecord(tid, env=env_name)
    recorder = StepRecorder(
        gateway.renderer,
        tid,
        env=env_name,
        algorithm=config.env_algorithms.get(env_name, config.algorithm),
        temperature=config.temperature,
        bridge=config.bridge,
    )
    session = gateway.open_session(recorder, engine, config, task=task, repetition=repetition)
    loop = asyncio.get_running_loop()
    start = loop.time()
    value: Any = None
    try:
        value = await asyncio.wait_for(
            _call_agent(agent, task, gateway, session, config, kwargs), config.env_timeout_s
        )
    except TimeoutError as e:
        ran_out = config.env_timeout_s is not None and loop.time() - start >= config.env_timeout_s
        if ran_out:
            rec.fail(
                "env_timeout",
                EnvTimeoutError(f"the agent took longer than env_timeout_s={config.env_timeout_s}"),
            )
        else:
            rec.fail("env", e)
    except Exception as e:  # the agent's failure errors its trajectory, never the run
        rec.fail("env", e)
    finally:
        gateway.close_session(session)
    if session.error is not None:  # an engine failure explains whatever the agent did next
        rec.fail("engine", session.error[1])
    reward: float | None = None
    if not rec.errored:
        try:
            reward, metrics = parse_agent_result(value)
            if reward is None:
                reward = session.reward
            if reward is None:
                raise ValueError("the agent returned no reward and posted none (POST /v1/rewards)")
            rec.env_metrics = metrics
            rec.infos.append(metrics)
        except ValueError as e:
            rec.fail("env", e)
    if not rec.errored and not recorder.calls:
        rec.fail("env", "the agent made no LLM call through the gateway: there is nothing to train on")
    if rec.errored:
        recorder.fail("abort" if rec.error_kind == "engine" else "error")
    if rec.exception is not None and not _picklable(rec.exception):  # records cross processes
        rec.exception = RuntimeError(rec.error)
    calls = recorder.calls
    rec.steps = recorder.finish(reward if (calls and not rec.errored) else None)
    rec.calls = list(calls)
    rec.num_turns = len(rec.steps)
    rec.bridged = [c.prompt.extended for c in calls[1:]]
    rec.reward = 0.0 if rec.errored or not rec.steps else float(rec.steps[-1].reward)
    if not rec.errored:
        rec.end = "length" if calls[-1].stop_reason == "length" else "done"
    return rec


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


async def agent_rollout(
    tasks: Sequence[Task],
    *,
    agent: AgentFn | str | Mapping[str, AgentFn | str],
    engine: Engine | Mapping[str, Engine],
    gateway: Gateway,
    config: RolloutConfig | None = None,
    agent_kwargs: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
) -> RolloutResult:
    """Runs ``group_size`` rollouts of an agent per task through ``gateway``; like
    :func:`rljax.rollout.rollout` (same result, metrics and error rules; see the module docstring).

    Args:
      tasks: the tasks (unique ids: the group keys).
      agent: an agent function (or ``"module:function"``), or a mapping ``Task.env`` -> agent.
      engine: the engine the calls sample from, or a mapping ``Task.env`` -> engine.
      gateway: the :class:`Gateway` (started here on the running loop if it is not serving).
      config: group size, budgets, sampling defaults, concurrency, ``env_timeout_s``.
      agent_kwargs: keyword arguments for the agent, or a mapping ``Task.env`` -> them.
      vocab_size: enables the token-id range check of the batch.
    """
    config = RolloutConfig() if config is None else config
    tasks = list(tasks)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("task ids must be unique (they are the group keys)")
    agents = {k: load_agent(v) for k, v in agent.items()} if isinstance(agent, Mapping) else load_agent(agent)
    kwargs_of = agent_kwargs or {}
    for t in tasks:
        _for_task(agents, t, "the agent mapping")
        _for_task(engine, t, "the engine mapping")
    await gateway.start()
    semaphore = asyncio.Semaphore(config.max_concurrency)

    async def bounded(task: Task, rep: int) -> TrajectoryRecord:
        kw = kwargs_of.get(task.env, {}) if isinstance(agent, Mapping) else kwargs_of
        async with semaphore:
            return await _run_agent_trajectory(
                task,
                rep,
                agent=_for_task(agents, task, "the agent mapping"),
                kwargs=kw or {},
                gateway=gateway,
                engine=_for_task(engine, task, "the engine mapping"),
                config=config,
            )

    start = time.perf_counter()
    records = list(await asyncio.gather(*(bounded(t, r) for t in tasks for r in range(config.group_size))))
    wall = time.perf_counter() - start
    if records and config.raise_on_all_errored and all(r.errored for r in records):
        _raise_all_errored(records)
    steps = [s for r in records if not (r.errored and config.on_error == "drop") for s in r.steps]
    metrics = rollout_metrics(records, wall)
    return RolloutResult(
        StepBatch(steps, vocab_size=vocab_size, metadata={"rollout": metrics}), metrics, records
    )


def run_agent_rollout(tasks: Sequence[Task], *, gateway: Gateway, **kwargs: Any) -> RolloutResult:
    """Synchronous :func:`agent_rollout` (``asyncio.run``; the gateway serves for its duration)."""

    async def main() -> RolloutResult:
        try:
            return await agent_rollout(tasks, gateway=gateway, **kwargs)
        finally:
            await gateway.stop()

    return asyncio.run(main())
