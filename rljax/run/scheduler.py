"""The rollout scheduler: which prompts each RL step samples, with which weights, and when.

For RL step ``n`` it draws ``prompts_per_step`` tasks (:class:`~rljax.run.tasks.TaskIterator`),
serves the behaviour weights of version ``v(n)`` on the policy engine and runs the agent loop on a
:class:`~rljax.run.worker.Worker`. Synchronous mode: ``v(n) = n`` (the rollout of step n starts
after step n - 1 trained). Asynchronous mode: ``v(n) = max(n - k, 0)`` with ``k =
max_off_policy_steps``; rollouts of steps ``n+1 .. n+k`` run while step ``n`` trains, and a sample
more than ``k`` versions stale is an error. It also runs DAPO dynamic sampling (extra rounds until
enough groups have reward variance) and held-out evaluations.

Several processes (a multi-host run): every process draws the same tasks for a step, rolls out its
own contiguous share of them (:func:`~rljax.training.distributed.process_share`; whole groups stay on one
process) on its own engine with a process-local copy of the behaviour weights, and
:meth:`RolloutScheduler.result` gathers the shares (in process order) into the step's batch on every
process, equal to a one-process rollout of all the tasks. Gathers run on the calling (main) thread,
so every process issues its collectives in the same order; the rollout thread issues none.

Determinism: request seeds derive from ``(rollout seed, step, ...)`` (``config.rollout.seed``, or
``config.seed`` when unset), extra dynamic-sampling rounds draw from a ``(seed, step, round)``
stream, and the task iterator's position is checkpointed, so resumed runs sample what the
uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rljax.algorithms import AlgorithmConfig
from rljax.chat.base import Renderer
from rljax.data.filters import DynamicSampler
from rljax.envs.base import Task
from rljax.rollout import (
    RolloutResult,
    _raise_all_errored,
    merge_rollout_results,
    rollout,
    rollout_metrics,
)
from rljax.run.config import RunConfig
from rljax.run.engines import EngineSet
from rljax.run.tasks import EnvTasks, TaskIterator
from rljax.run.worker import Worker
from rljax.training.distributed import allgather_objects, barrier, process_share

__all__ = ["PendingRollout", "RolloutScheduler", "derive_seed"]


def _release(served: Any, *, main: bool) -> None:
    """Deletes the files of a weight version written for vLLM servers once no rollout needs it
    (process 0; every server reloaded it before the rollouts that used it)."""
    from rljax.inference.vllm.weight_sync import WrittenWeights

    if main and isinstance(served, WrittenWeights):
        shutil.rmtree(served.directory, ignore_errors=True)


def derive_seed(*parts: int) -> int:
    """A 32-bit seed derived from integers (stable across processes and runs)."""
    return int(np.random.SeedSequence([int(p) % 2**32 for p in parts]).generate_state(1)[0])


@dataclasses.dataclass
class PendingRollout:
    step: int
    version: int
    future: concurrent.futures.Future
    submitted: float


class RolloutScheduler:
    """Submits the rollouts of RL steps (and evals) in order, on behaviour weights of the right version.

    Args:
      cfg: the run config.
      env_tasks: env factories and tasks.
      renderer: the chat renderer.
      engines: the run's engines (policy engine started before the first submit).
      algorithms: the validated algorithms (which env samples from which engine).
      vocab_size: the model's vocabulary (Step validation).
      worker: the worker rollouts run on.
      to_model: builds a model from parameters (served to the policy engine).
      localize: ``localize(version, params)`` turns the trainer's parameters into what this
        process's engine serves (a multi-process run: a process-local copy, or the version written
        for vLLM servers by every process; default: the parameters themselves). Called on the
        thread that calls :meth:`add_version`; what it returns is given to ``to_model``.
    """

    def __init__(
        self,
        cfg: RunConfig,
        env_tasks: EnvTasks,
        renderer: Renderer,
        engines: EngineSet,
        algorithms: AlgorithmConfig,
        *,
        vocab_size: int,
        worker: Worker,
        to_model: Callable[[Any], Any],
        localize: Callable[[int, Any], Any] | None = None,
    ) -> None:
        t = cfg.trainer
        self.num_steps = t.num_steps
        self.prompts_per_step = t.prompts_per_step
        self.lag = t.max_off_policy_steps if t.mode == "async" else 0
        self.env_tasks = env_tasks
        self.renderer = renderer
        self.engines = engines
        self.algorithms = algorithms
        self.vocab_size = vocab_size
        self.worker = worker
        self.to_model = to_model
        self.localize = localize
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.seed = cfg.seed
        rollout = cfg.rollout
        self.rollout_seed = cfg.seed if rollout.seed is None else int(rollout.seed)
        env_alg = {env: algorithms.for_env(env).name for env in env_tasks.factories}
        self.rollout_config = dataclasses.replace(  # request seeds: per step, from rollout_seed
            rollout, seed=None, algorithm=algorithms.default.name, env_algorithms=env_alg
        )
        self.eval_config = dataclasses.replace(
            self.rollout_config, group_size=cfg.eval.group_size, temperature=cfg.eval.temperature
        )
        ds = t.dynamic_sampling
        self.dynamic_sampling = ds if ds.max_rounds > 0 else None
        self.tasks = TaskIterator(env_tasks.train, seed=cfg.seed)
        self.behavior: dict[int, Any] = {}  # version -> parameters the rollouts of that version use
        self.served: dict[int, Any] = {}  # version -> those parameters as this process's engine serves them
        self.pending: list[PendingRollout] = []
        self._serves = 0
        self.next_step = 0
        self.task_states: dict[int, dict[str, Any]] = {}  # step -> iterator state before its draw
        self.gateway: Any = None  # the OpenAI-compatible gateway of agent envs (rljax.gateway.Gateway)

    # -- versions ------------------------------------------------------------------------------------
    def version_for(self, step: int) -> int:
        """The policy version the rollout of RL step ``step`` samples with."""
        return max(step - self.lag, 0)

    def needed_versions(self, step: int) -> list[int]:
        """Behaviour versions the rollouts of steps ``step .. step+lag-1`` use, other than ``step``."""
        return sorted({self.version_for(m) for m in range(step, step + self.lag)} - {step})

    def add_version(self, version: int, params: Any) -> None:
        """Records the parameters of ``version`` and forgets versions no future rollout needs."""
        self.behavior[version] = params
        self.served[version] = params if self.localize is None else self.localize(version, params)
        for v in [v for v in self.behavior if v < version - self.lag]:
            del self.behavior[v]
            _release(self.served.pop(v), main=self.process_index == 0)

    def share(self, tasks: Sequence[Task]) -> list[Task]:
        """This process's contiguous share of ``tasks`` (all of them in a one-process run)."""
        return [tasks[i] for i in process_share(len(tasks), process_index=self.process_index,
                                                process_count=self.process_count)]  # fmt: skip

    def gather(self, result: RolloutResult) -> RolloutResult:
        """Every process's share of a rollout merged in process order (call on the main thread)."""
        if self.process_count == 1:
            return result
        return merge_rollout_results(allgather_objects(result))

    @property
    def holds_served_only_once(self) -> bool:
        """One process without lag: a version is sampled by one rollout (and its eval) only, so once
        the engine serves it neither the scheduler nor, after that rollout, the engine need keep it."""
        return self.lag == 0 and self.process_count == 1

    async def serve(self, version: int) -> None:
        """Makes the policy engine serve weight ``version`` (every process's engine, in step).

        A one-process run without lag (``lag == 0``) lets go of the version's parameters once the
        engine serves them: no other rollout, and no checkpoint, needs them, and the engine holds
        its own copy (the embedded sampler's decode layout, a vLLM server's weights), so keeping
        them would hold the policy twice more than needed (a model's size of host memory)."""
        if version not in self.served:  # let go of after it was served: the engine still serves it
            if self.engines.served_version != version:
                raise RuntimeError(f"weight version {version} is no longer held and the engine serves "
                                   f"{self.engines.served_version}")  # fmt: skip
            return
        await self.engines.serve(version, self.to_model(self.served[version]))
        if self.process_count > 1:  # every process's engine holds the version before any samples it
            await asyncio.to_thread(barrier, f"rljax_serve_v{version}_{self._serves}")
        self._serves += 1
        if self.holds_served_only_once:
            del self.behavior[version]
            _release(self.served.pop(version), main=True)

    # -- rollouts --------------------------------------------------------------------------------------
    async def run_rollout(self, tasks: Sequence[Task], engine: Any, config: Any) -> RolloutResult:
        """The rollout of ``tasks``: env tasks by the env loop, agent envs' tasks
        (``config.envs.<name>.agent``) through the run's gateway (started on this loop at first
        use), both at once; one result (envs' records first, then agents')."""
        agents = self.env_tasks.agents
        env_part = [t for t in tasks if t.env not in agents]
        agent_part = [t for t in tasks if t.env in agents]
        both = bool(env_part) and bool(agent_part)
        sub = dataclasses.replace(config, raise_on_all_errored=False) if both else config
        jobs = []
        if env_part or not agent_part:
            jobs.append(
                rollout(
                    env_part,
                    engine=engine,
                    renderer=self.renderer,
                    make_env=self.env_tasks.factories,
                    config=sub,
                    vocab_size=self.vocab_size,
                )
            )
        if agent_part:
            from rljax.agents import agent_rollout
            from rljax.gateway import Gateway

            if self.gateway is None:
                self.gateway = Gateway(self.renderer)
            jobs.append(
                agent_rollout(
                    agent_part,
                    agent=agents,
                    engine=engine,
                    gateway=self.gateway,
                    config=sub,
                    agent_kwargs=self.env_tasks.agent_kwargs,
                    vocab_size=self.vocab_size,
                )
            )
        result = merge_rollout_results(await asyncio.gather(*jobs))
        records = result.trajectories
        if both and config.raise_on_all_errored and records and all(r.errored for r in records):
            _raise_all_errored(records)
        return result

    def close(self) -> None:
        """Stops the gateway (when agents started one), after the agents that hold resources on the
        rollout loop (an ``aclose`` method: verifiers envs' serving resources) released them."""
        if self.gateway is not None and self.gateway.started:
            for agent in self.env_tasks.agents.values():
                if hasattr(agent, "aclose"):
                    self.worker.submit(agent.aclose).result(timeout=30)
            self.worker.submit(self.gateway.stop).result(timeout=30)

    # -- submitting ------------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """The next submitted rollout is that of ``step`` (a fresh or resumed run)."""
        self.next_step = step

    def fill(self, limit: int) -> None:
        """Submits the rollouts of every step below ``min(limit, num_steps)`` not yet submitted."""
        while self.next_step < min(limit, self.num_steps):
            self.task_states[self.next_step] = self.tasks.state()
            self.pending.append(self._submit(self.next_step))
            self.next_step += 1

    def data_state(self, step: int) -> dict[str, Any]:
        """The task iterator's state as it was before step ``step`` drew (what a checkpoint at ``step``
        must restore), and forgets older ones."""
        state = self.task_states.get(step, self.tasks.state())
        for s in [s for s in self.task_states if s < step]:
            del self.task_states[s]
        return state

    def _submit(self, step: int) -> PendingRollout:
        version = self.version_for(step)
        tasks = self.share(self.tasks.take(self.prompts_per_step))
        config = dataclasses.replace(self.rollout_config, seed=derive_seed(self.rollout_seed, step, 1))
        engines = {
            env: self.engines.sampler_for(self.algorithms.for_env(env), self.worker)
            for env in self.env_tasks.factories
        }

        async def sample(round_tasks: Sequence[Task], round_no: int) -> RolloutResult:
            round_config = config
            if round_no:
                round_config = dataclasses.replace(config, seed=derive_seed(config.seed, round_no))
            return await self.run_rollout(round_tasks, engines, round_config)

        async def job() -> RolloutResult:
            await self.serve(version)
            result = await sample(tasks, 0)
            if self.dynamic_sampling is None:
                return result
            return await self._dynamic_sampling(result, step, len(tasks), sample)

        return PendingRollout(step, version, self.worker.submit(job), time.perf_counter())

    async def _dynamic_sampling(
        self, first: RolloutResult, step: int, num_prompts: int, sample: Callable[..., Any]
    ) -> RolloutResult:
        """DAPO dynamic sampling: more rounds until ``num_prompts`` groups have reward variance.

        Extra rounds draw prompts from a stream seeded by ``(seed, step, round)`` (not the task
        iterator), so the data position and every sample stay reproducible whatever the timing;
        their task ids get a ``#ds<step>.<round>`` suffix (a group is keyed by its task id).
        """
        ds = self.dynamic_sampling
        sampler = DynamicSampler(
            target_groups=num_prompts,
            max_rounds=ds.max_rounds,
            atol=ds.atol,
            strict=ds.strict,
            reward_mode=self.reward_modes,
        )
        train = self.env_tasks.train
        start = time.perf_counter() - first.metrics["wall_time_s"]
        done, records, round_no = sampler.add(first.batch), list(first.trajectories), 0
        while not done:
            round_no += 1
            rng = np.random.default_rng([self.seed, step, round_no, 0xD5])
            picks = rng.choice(len(train), size=min(num_prompts, len(train)), replace=False)
            extra = [
                dataclasses.replace(train[int(i)], id=f"{train[int(i)].id}#ds{step}.{round_no}")
                for i in picks
            ]
            result = await sample(extra, round_no)
            records += result.trajectories
            done = sampler.add(result.batch)
        batch, metrics = sampler.result()
        wall = time.perf_counter() - start
        return RolloutResult(batch, {**rollout_metrics(records, wall), **metrics}, records)

    @property
    def reward_modes(self) -> dict[str, str]:
        """Each algorithm's reward mode by name: what dynamic sampling's group spread compares
        (:func:`rljax.data.filters.group_reward_spread`)."""
        return {a.name: a.reward_mode for a in self.algorithms.algorithms}

    # -- results ---------------------------------------------------------------------------------------
    def result(self, step: int) -> tuple[RolloutResult, dict[str, float]]:
        """Waits for the rollout of ``step``; returns it with its staleness metrics.

        Raises when a policy sample is more than ``max_off_policy_steps`` versions stale (frozen
        samplers' samples carry version 0 and never count).
        """
        job = self.pending.pop(0)
        if job.step != step:
            raise RuntimeError(f"rollouts out of order: expected step {step}, got {job.step}")
        result = self.gather(job.future.result())
        frozen = {a.name for a in self.algorithms.algorithms if a.sampling == "frozen"}
        versions = [s.policy_version for s in result.batch if s.algorithm not in frozen]
        lag = step - min(versions) if versions else 0
        if lag > self.lag:
            raise RuntimeError(f"step {step}: a sample is {lag} versions stale (> max_off_policy_steps)")
        return result, {
            "policy_version/min": float(min(versions)) if versions else float("nan"),
            "policy_version/max": float(max(versions)) if versions else float("nan"),
            "policy_version/lag": float(lag),
        }

    # -- evaluation ------------------------------------------------------------------------------------
    def evaluates(self, step: int, eval_every: int) -> bool:
        """Whether held-out tasks are evaluated after RL step ``step`` (and after the last step)."""
        if not (eval_every and self.env_tasks.eval) or step == 0:
            return False
        return step % eval_every == 0 or step == self.num_steps

    def submit_eval(self, version: int) -> concurrent.futures.Future:
        """Evaluates the weights of ``version`` on every eval task (its own seed stream); this
        process's share of them (:meth:`gather` the result)."""
        config = dataclasses.replace(self.eval_config, seed=derive_seed(self.seed, 0xE7A1))

        async def job() -> RolloutResult:
            await self.serve(version)
            return await self.run_rollout(self.share(self.env_tasks.eval), self.engines.policy, config)

        return self.worker.submit(job)

    def restore(self, data_state: Mapping[str, Any]) -> None:
        """Restores the task order from a checkpoint's data state."""
        self.tasks.restore(data_state["tasks"])
