"""The trainer host loop (SPEC §5): rollout -> validate -> advantages -> filters -> merge -> pack ->
mini-batches -> jitted train steps -> weight sync -> metrics -> checkpoint.

One RL step ``n`` (``theta_n`` = parameters after ``n`` RL steps; policy version ``n``)::

    tasks_n   = next prompts of the seeded task iterator (whole prompt groups, ``group_size`` each)
    batch_n   = rollout(tasks_n, engine serving theta_{v(n)})         every Step records v(n)
    A         = step_advantages(batch_n | algorithm of each env)      (core estimators, host glue)
    batch_n   = filters(batch_n, A)  ->  merge(batch_n), A carried along the merge plan
    for each mini-batch B of ``mini_batch_prompts`` prompt groups (per algorithm):
        theta <- train_step(theta, pack(B), counts(B))                (ONE jitted function)
    engine    <- theta_{n+1}  (embedded: swap references; vLLM: safetensors + reload in place)

Synchronous mode: ``v(n) = n``. Asynchronous mode overlaps the rollout of step ``n + 1`` with
the training of step ``n``: rollouts run in a background thread (its own asyncio loop; JAX
releases the GIL while XLA runs) and ``v(n) = max(n - k, 0)`` with ``k =
max_off_policy_steps``, so no sample is more than ``k`` versions stale (checked on every step).

Determinism (resume is bit-for-bit on CPU): every random choice comes from the config seed and
the step index or from checkpointed state: the task iterator (epoch permutations of a seeded
numpy Generator, position checkpointed), per-request sampler seeds
(:func:`rljax.rollout.request_seed` of ``(seed + step, task, repetition, turn)``), mini-batch
shuffles (a checkpointed numpy Generator), and the embedded sampler batches requests by the
event loop's FIFO order (``batch_wait_ms=0``), not by wall-clock timing. A checkpoint at step
``n`` holds ``theta_n``, the optimizer state and counters, the behaviour parameters
``theta_v`` still needed by rollouts ``n .. n+k-1`` (async mode), the task iterator and RNG
state, and the config.

Reference: the SkyRL / prime-rl trainer loops (async off-policy rollouts bounded by
``max_off_policy_steps``, policy versions recorded on samples).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import pathlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import algorithms as algos
from rljax import envs as builtin_envs
from rljax.chat import make_renderer, toy_tokenizer
from rljax.core.objective import ObjectiveConfig
from rljax.data import StepBatch
from rljax.data.filters import DynamicSampler, make_filter
from rljax.data.pack import make_mini_batches
from rljax.envs.base import Task
from rljax.rollout import RolloutConfig, RolloutResult, rollout, rollout_metrics
from rljax.train import checkpoint as ckpt
from rljax.train import metrics as metrics_lib
from rljax.train import sharding as train_sharding
from rljax.train.components import load_observation_filter, prefixed, prepare_samples
from rljax.train.optim import OptimizerConfig
from rljax.train.step import TrainConfig, TrainState, mini_batch_counts, train_step
from rljax.train.warmstart import WarmStartConfig, run_warm_start
from rljax.types import Step

__all__ = ["TaskIterator", "Trainer", "build_model", "build_tokenizer", "train"]

logger = logging.getLogger(__name__)

MODES = ("sync", "async")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for dicts / ConfigDicts, ``default`` when missing or None."""
    if cfg is None:
        return default
    try:
        value = cfg[key]
    except (KeyError, AttributeError, TypeError):
        value = getattr(cfg, key, default)
    return default if value is None else value


def _plain(value: Any) -> Any:
    """ConfigDict / FrozenConfigDict -> dict (recursively handled by ``to_dict``)."""
    return value.to_dict() if hasattr(value, "to_dict") else value


def _seed(*parts: int) -> int:
    """A 32-bit seed derived from integers (stable across processes)."""
    return int(np.random.SeedSequence([int(p) % 2**32 for p in parts]).generate_state(1)[0])


# ------------------------------------------------------------------------------------------------
# Task iterator (data position is checkpointed)
# ------------------------------------------------------------------------------------------------


class TaskIterator:
    """Draws prompts epoch by epoch from a seeded permutation; its position is JSON state.

    Epoch ``e`` visits the tasks in the order ``default_rng([seed, e]).permutation(N)``; ``state()``
    is ``{"epoch": e, "position": i}`` and ``restore(state)`` continues exactly there.

    >>> it = TaskIterator([Task(f"t{i}") for i in range(3)], seed=0)
    >>> [t.id for t in it.take(4)], it.state()
    (['t2', 't0', 't1', 't2'], {'epoch': 1, 'position': 1})
    """

    def __init__(self, tasks: Sequence[Task], *, seed: int) -> None:
        if not tasks:
            raise ValueError("the task iterator needs at least one task; check the env's num_train_tasks")
        self.tasks = list(tasks)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))

    def take(self, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            if self.position == len(self.tasks):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.tasks[int(self._order[self.position])])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


# ------------------------------------------------------------------------------------------------
# Building blocks from the config
# ------------------------------------------------------------------------------------------------


def build_tokenizer(cfg: Any) -> Any:
    """``"toy:<family>"`` (a byte-level toy tokenizer built in code) or an HF tokenizer path."""
    name = str(_get(cfg, "name", "toy:chatml"))
    if name.startswith("toy:"):
        return toy_tokenizer(name[4:])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def build_model(cfg: Any, *, vocab_size: int, seed: int) -> nnx.Module:
    """A Decoder from ``cfg.hf_path`` (HF safetensors) or a fresh one from ``cfg.init`` fields."""
    from rljax.models import Decoder, ModelConfig, from_pretrained

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[str(_get(cfg, "dtype", "float32"))]
    path = str(_get(cfg, "hf_path", ""))
    if path:
        return from_pretrained(path, dtype=dtype)
    fields = dict(_plain(_get(cfg, "init", {})))
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
    return Decoder(mcfg, rngs=nnx.Rngs(seed))


def _objective_for(algorithm: algos.Algorithm, cfg: Any) -> ObjectiveConfig:
    if algorithm.needs_critic:
        raise ValueError(
            f"algorithm {algorithm.name!r} needs a value head (gae); the trainer has none yet: use a "
            "critic-free algorithm (grpo, rloo, max_rl, opd, opsd, sft, echo)"
        )
    if not algorithm.step_wise:
        raise ValueError(
            f"algorithm {algorithm.name!r} is not step-wise (step_wise=False); the trainer trains one sample "
            "per turn (merged): set step_wise=True"
        )
    off = _plain(_get(cfg, "off_policy", None))
    return ObjectiveConfig(
        policy_loss=algorithm.policy_loss or "dppo",  # unused unless the rl component is on
        policy_loss_kwargs=dict(algorithm.policy_loss_kwargs),
        reduction=str(_get(cfg, "reduction", "token_mean")),
        max_len=_get(cfg, "max_len", None),
        off_policy=off if off else None,
        entropy_coef=float(_get(cfg, "entropy_coef", 0.0)),
        components=tuple(algorithm.components),  # skip the packer's all-zero streams of other components
    )


def _optimizer_config(cfg: Any) -> OptimizerConfig:
    fields = {k: v for k, v in dict(_plain(cfg) or {}).items() if v is not None or k == "max_grad_norm"}
    try:
        return OptimizerConfig(**fields)
    except TypeError as e:
        raise ValueError(f"config.optimizer has a field OptimizerConfig does not know: {e}") from None


def _env_specs(cfg: Any) -> dict[str, dict[str, Any]]:
    specs = dict(_plain(cfg) or {})
    if not specs:
        raise ValueError("config.envs is empty; name at least one environment (e.g. 'lookup')")
    out = {}
    for name, spec in specs.items():
        spec = dict(spec or {})
        known = {"kwargs", "task_kwargs", "num_train_tasks", "num_eval_tasks", "env"}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"config.envs.{name} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        out[name] = spec
    return out


# ------------------------------------------------------------------------------------------------
# Metrics sinks
# ------------------------------------------------------------------------------------------------


class _Sinks:
    """The run's metrics: :class:`rljax.train.metrics.MetricsLogger` for RL steps (``workdir``: stdout
    table, ``metrics.jsonl``, TensorBoard, ``metrics.png``) and another for the warm start
    (``workdir/warmstart``). On resume, JSONL lines of steps after the checkpoint are dropped first,
    so the file reads as one uninterrupted run."""

    def __init__(self, workdir: pathlib.Path, *, resume_step: int | None, table_keys: Sequence[str]) -> None:
        path = workdir / metrics_lib.JSONL_NAME
        if resume_step is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a half-written line of the killed run
                if int(rec.get("step", 0)) <= resume_step:
                    kept.append(line)
            path.write_text("".join(k + "\n" for k in kept))
        elif path.exists():
            path.unlink()
        self.workdir = workdir
        self.rl = metrics_lib.MetricsLogger(workdir, table_keys=table_keys)
        self.warmstart: metrics_lib.MetricsLogger | None = None

    def log(self, step: int, metrics: Mapping[str, Any], *, phase: str = "rl") -> None:
        scalars = {k: v for k, v in metrics.items() if k not in metrics_lib.RESERVED_KEYS}
        if phase == "rl":
            self.rl.log(step, scalars)
            return
        if self.warmstart is None:
            ws_dir = self.workdir / "warmstart"
            if (ws_dir / metrics_lib.JSONL_NAME).exists():
                (ws_dir / metrics_lib.JSONL_NAME).unlink()
            self.warmstart = metrics_lib.MetricsLogger(
                ws_dir, table_keys=_WARMSTART_KEYS, plot_keys=("warmstart/loss", "warmstart/correct_fraction")
            )
        self.warmstart.log(step, scalars)

    def close(self) -> None:
        self.rl.close()
        if self.warmstart is not None:
            self.warmstart.close()


_WARMSTART_KEYS = (
    "warmstart/loss",
    "warmstart/grad_norm",
    "warmstart/correct_fraction",
    "warmstart/step_time_s",
)


# ------------------------------------------------------------------------------------------------
# Background rollouts
# ------------------------------------------------------------------------------------------------


class _RolloutWorker:
    """A thread running one asyncio loop; jobs (rollouts, evals, weight syncs) run in FIFO order."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="rljax-rollout", daemon=True)
        self.thread.start()
        self._lock: asyncio.Lock | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, make_coro: Callable[[], Any]) -> concurrent.futures.Future:
        async def job() -> Any:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:  # asyncio.Lock is FIFO: jobs run one at a time, in order
                return await make_coro()

        return asyncio.run_coroutine_threadsafe(job(), self.loop)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pending:
    step: int
    version: int
    future: concurrent.futures.Future
    submitted: float


class Trainer:
    """Runs an RL post-training job described by an ``ml_collections`` config (see configs/default.py).

    Args:
      config: the run config (a ConfigDict or nested dict with the keys of ``configs/default.py``).
      workdir: where metrics (``metrics.jsonl``, TensorBoard, plot) and checkpoints (``checkpoints/``) go.
      resume: continue from the latest complete checkpoint in ``workdir`` (if any).
      make_env: optional ``{env name: zero-argument factory}`` overriding the built-in environments.
      tasks: optional ``{env name: (train tasks, eval tasks)}`` overriding the built-in task makers.
      engine: optional inference engine (anything with ``generate`` / ``update_weights``).

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
    ) -> None:
        self.config = config
        self.workdir = pathlib.Path(workdir).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.workdir / "checkpoints"
        self.seed = int(_get(config, "seed", 0))
        tr = _get(config, "trainer", {})
        self.num_steps = int(_get(tr, "num_steps", 10))
        self.mode = str(_get(tr, "mode", "sync"))
        if self.mode not in MODES:
            raise ValueError(f"config.trainer.mode must be one of {MODES}, got {self.mode!r}")
        self.max_off_policy = int(_get(tr, "max_off_policy_steps", 1))
        if self.max_off_policy < 1:
            raise ValueError(f"config.trainer.max_off_policy_steps must be >= 1, got {self.max_off_policy}")
        self.lag = self.max_off_policy if self.mode == "async" else 0
        self.prompts_per_step = int(_get(tr, "prompts_per_step", 8))
        self.mini_batch_prompts = int(_get(tr, "mini_batch_prompts", 0))
        self.seq_len = int(_get(tr, "seq_len", 512))
        self.merge = bool(_get(tr, "merge", True))
        self.checkpoint_every = int(_get(tr, "checkpoint_every", 0))
        self.keep_checkpoints = _get(tr, "keep_checkpoints", 3)
        self.eval_every = int(_get(tr, "eval_every", 0))
        self.row_buckets = _plain(_get(tr, "row_buckets", None))
        self.truncate = bool(_get(tr, "truncate", False))

        # tokenizer / renderer / model ------------------------------------------------------------
        self.tokenizer = build_tokenizer(_get(config, "tokenizer", {}))
        rcfg = _get(config, "renderer", {})
        self.renderer = make_renderer(
            str(_get(rcfg, "name", "chatml")), self.tokenizer, **dict(_plain(_get(rcfg, "kwargs", {})))
        )
        self.vocab_size = len(self.tokenizer)
        model = build_model(_get(config, "model", {}), vocab_size=self.vocab_size, seed=self.seed)
        self.model_vocab = int(model.config.vocab_size)

        # environments and tasks ------------------------------------------------------------------
        specs = _env_specs(_get(config, "envs", {}))
        self.env_factories: dict[str, Callable[[], Any]] = {}
        train_tasks: list[Task] = []
        self.eval_tasks: list[Task] = []
        for name, spec in specs.items():
            kind = str(spec.get("env") or name)
            kwargs = dict(_plain(spec.get("kwargs")) or {})
            if make_env is not None and name in make_env:
                self.env_factories[name] = make_env[name]
            else:
                builtin_envs.make_env(kind, **kwargs)  # fail fast on bad kwargs
                self.env_factories[name] = lambda kind=kind, kwargs=kwargs: builtin_envs.make_env(
                    kind, **kwargs
                )
            if tasks is not None and name in tasks:
                tr_t, ev_t = tasks[name]
            else:
                tk = dict(_plain(spec.get("task_kwargs")) or {})
                tr_t = builtin_envs.make_tasks(
                    kind, int(spec.get("num_train_tasks", 256)), seed=self.seed, split="train", **tk
                )
                ev_t = builtin_envs.make_tasks(
                    kind, int(spec.get("num_eval_tasks", 0)), seed=self.seed + 1, split="test", **tk
                )
            train_tasks += [dataclasses.replace(t, env=name) for t in tr_t]
            self.eval_tasks += [dataclasses.replace(t, env=name) for t in ev_t]
        self.train_tasks = train_tasks
        self.tasks = TaskIterator(train_tasks, seed=self.seed)

        # algorithms and the train step --------------------------------------------------------
        rollout_cfg = dict(_plain(_get(config, "rollout", {})))
        self.group_size = int(rollout_cfg.get("group_size", 4))
        env_algorithms = dict(_plain(_get(config, "env_algorithms", {})) or {})
        unknown_envs = set(env_algorithms) - set(self.env_factories)
        if unknown_envs:
            raise ValueError(
                f"config.env_algorithms names envs {sorted(unknown_envs)} that config.envs lacks"
            )
        self.algorithms = algos.validate_algorithm_config(
            _plain(_get(config, "algorithm", "grpo")),
            env_overrides=env_algorithms,
            group_size=self.group_size,
        )
        ocfg = _get(config, "objective", {})
        self.optimizer_config = _optimizer_config(_get(config, "optimizer", {}))
        self.train_configs = {
            a.name: TrainConfig(objective=_objective_for(a, ocfg), optimizer=self.optimizer_config)
            for a in self.algorithms.algorithms
        }
        default_cfg = self.train_configs[self.algorithms.default.name]
        mesh_cfg = dict(_plain(_get(config, "mesh", {})) or {})
        self.mesh = None
        if mesh_cfg:
            unknown = set(mesh_cfg) - {"data", "fsdp", "tensor"}
            if unknown:
                raise ValueError(f"config.mesh has unknown axes {sorted(unknown)}; use data, fsdp, tensor")
            self.mesh = train_sharding.make_mesh(**{k: int(v) for k, v in mesh_cfg.items()})
        self.data_parallel = 1 if self.mesh is None else train_sharding.batch_parallelism(self.mesh)
        self.state = TrainState.create(model, default_cfg, mesh=self.mesh)
        env_alg_names = {env: self.algorithms.for_env(env).name for env in self.env_factories}
        rollout_cfg.setdefault("max_concurrency", max(64, self.prompts_per_step * self.group_size))
        rollout_cfg.pop("seed", None)
        self.rollout_config = RolloutConfig(
            **rollout_cfg, algorithm=self.algorithms.default.name, env_algorithms=env_alg_names
        )
        ecfg = dict(_plain(_get(config, "eval", {})) or {})
        self.eval_config = dataclasses.replace(
            self.rollout_config,
            group_size=int(ecfg.get("group_size", 1)),
            temperature=float(ecfg.get("temperature", 0.0)),
        )
        self._setup_references(train_tasks, specs)
        self.dynamic_sampling = dict(_plain(_get(tr, "dynamic_sampling", {})) or {})
        if int(self.dynamic_sampling.get("max_rounds", 0)) <= 0:  # max_rounds 0: off
            self.dynamic_sampling = {}
        if self.dynamic_sampling:
            unknown = set(self.dynamic_sampling) - {"max_rounds", "atol", "strict"}
            if unknown:
                raise ValueError(
                    f"config.trainer.dynamic_sampling has unknown keys {sorted(unknown)}; "
                    "known: max_rounds, atol, strict"
                )
            not_grouped = [a.name for a in self.algorithms.algorithms if not a.group_relative]
            if not_grouped:
                raise ValueError(
                    f"config.trainer.dynamic_sampling keeps groups whose rewards vary (DAPO), which only "
                    f"group-relative rl algorithms need; {not_grouped} are not: drop dynamic_sampling"
                )
        self.filters = [
            make_filter(str(f["name"]), **{k: v for k, v in dict(f).items() if k != "name"})
            for f in (_plain(_get(tr, "filters", [])) or [])
        ]
        self.np_rng = np.random.default_rng(_seed(self.seed, 0xB47C))
        self._engine = engine
        self._engine_cfg = _get(config, "engine", {})
        self._served_version: int | None = None
        self.behavior: dict[int, Any] = {}
        self.start_step = 0
        self.resume = resume
        self.history: list[dict[str, Any]] = []
        self.table_keys = list(
            _plain(_get(tr, "table_keys", None))
            or [
                "reward/mean",
                "loss",
                "grad_norm",
                "entropy",
                "policy_version/lag",
                "time/step_s",
                "eval/reward_mean",
            ]
        )

    def _setup_references(self, train_tasks: Sequence[Task], specs: Mapping[str, Any]) -> None:
        """Frozen models, echo filters and demonstrations the algorithms need (config-time checks)."""
        from rljax.inference.frozen import FrozenModelConfig, frozen_models_from_config

        self.frozen_configs = dict(frozen_models_from_config(_plain(_get(self.config, "frozen_models", {}))))
        for a in self.algorithms.algorithms:
            ref = a.frozen_model
            if ref is None or ref in self.frozen_configs:
                continue
            if ref.startswith(("http://", "https://")):
                self.frozen_configs[ref] = FrozenModelConfig(name=ref.split("://", 1)[1], base_url=ref)
                continue
            raise ValueError(
                f"algorithm {a.name!r} names frozen model {ref!r} (teacher=), but config.frozen_models has "
                f"{sorted(self.frozen_configs) or 'none'}; add config.frozen_models.{ref} = "
                "dict(base_url='http://host:port') or set teacher to the endpoint's base URL"
            )
        self.observation_filters = {
            a.name: load_observation_filter(a.observation_filter) for a in self.algorithms.algorithms
        }
        for env in self.env_factories:
            a = self.algorithms.for_env(env)
            if a.observation_ce and not self.merge:
                raise ValueError(
                    f"algorithm {a.name!r} (env {env!r}) trains observation tokens (echo), which are the "
                    "tokens between merged turns; set trainer.merge=True"
                )
            if a.needs_demonstrations:
                tasks = [t for t in train_tasks if t.env == env]
                if not any(getattr(t, "demonstration", None) for t in tasks):
                    raise ValueError(
                        f"algorithm {a.name!r} (env {env!r}) conditions on Task.demonstration, but none of "
                        f"the {len(tasks)} train tasks of env {env!r} has one; pass tasks with "
                        "demonstrations (Trainer(tasks=...)) or use an environment whose tasks carry them"
                    )
        self.task_by_id = {t.id: t for t in train_tasks}
        self._hints: dict[str | None, Any] = {}
        if self.algorithms.needs_demonstrations:  # a renderer that cannot place the hint fails now
            self._hint(next(t.demonstration for t in train_tasks if getattr(t, "demonstration", None)))
        self.frozen: dict[tuple[str, int], Any] = {}
        # metric keys get a /<algorithm> suffix when the run's envs train with more than one algorithm
        self.multi_algorithm = len({self.algorithms.for_env(e).name for e in self.env_factories}) > 1

    def _hint(self, demonstration: str | None) -> Any:
        if demonstration not in self._hints:
            self._hints[demonstration] = self.renderer.demonstration_hint(demonstration)
        return self._hints[demonstration]

    def _algorithm_named(self, name: str) -> algos.Algorithm:
        for a in self.algorithms.algorithms:
            if a.name == name:
                return a
        raise ValueError(f"a step names algorithm {name!r}, which this run lacks ({self.algorithms.names})")

    def _frozen_model(self, name: str, worker: _RolloutWorker | None = None) -> Any:
        """The client of frozen model ``name`` on ``worker``'s event loop (default: the rollout worker).

        Teachers score on their own worker (``self.scoring``), so in async mode scoring step n's
        samples never queues behind the rollout of step n + 1 on the rollout loop.
        """
        worker = self.worker if worker is None else worker
        key = (name, id(worker))
        if key not in self.frozen:
            from rljax.inference.frozen import FrozenModel

            cfg = self.frozen_configs[name]

            async def make() -> Any:
                return FrozenModel.from_config(cfg)

            self.frozen[key] = (worker, worker.submit(make).result())
        return self.frozen[key][1]

    def _check_frozen_models(self) -> None:
        """Fails fast (before any training) when a frozen model the run needs does not answer."""
        for name in sorted({a.frozen_model for a in self.algorithms.algorithms if a.frozen_model}):
            model = self._frozen_model(name)
            try:
                self.worker.submit(model.resolve_model).result()
            except Exception as e:
                raise RuntimeError(
                    f"frozen model {name!r} at {list(self.frozen_configs[name].base_url)} does not answer "
                    f"GET /v1/models; start it or fix config.frozen_models.{name}.base_url. Cause: {e}"
                ) from e

    def _rollout_engines(self) -> dict[str, Any]:
        """Env name -> the engine its algorithm samples from (the policy, or a frozen model for sft)."""
        out = {}
        for env in self.env_factories:
            a = self.algorithms.for_env(env)
            out[env] = self._frozen_model(a.frozen_model) if a.sampling == "frozen" else self.engine
        return out

    def _scorer(self, algorithm: algos.Algorithm) -> Callable[[Sequence[Step]], list[np.ndarray]] | None:
        """The ref_kl reference of ``algorithm``: a frozen teacher's prefill, or the live policy (opsd)."""
        if algorithm.action_component != "ref_kl":
            return None
        if algorithm.frozen_model is None:
            return self._score_with_demonstrations
        teacher = self._frozen_model(algorithm.frozen_model, self.scoring)

        def score(samples: Sequence[Step]) -> list[np.ndarray]:
            async def job() -> list[np.ndarray]:
                return list(
                    await asyncio.gather(
                        *(teacher.response_logprobs(s.prompt_ids, s.response_ids) for s in samples)
                    )
                )

            return self.scoring.submit(job).result()

        return score

    def _score_with_demonstrations(self, samples: Sequence[Step]) -> list[np.ndarray]:
        """opsd: the live policy's logprobs of each response, its task's demonstration in the prompt."""
        from rljax.data.demonstrations import condition_on_demonstration, slice_response
        from rljax.inference.scoring import score_sequences

        seqs, starts = [], []
        for s in samples:
            task = self.task_by_id.get(s.trajectory_id.instance_id)
            hint = self._hint(None if task is None else task.demonstration)
            ids, start = condition_on_demonstration(s.prompt_ids, s.response_ids, hint)
            seqs.append(ids)
            starts.append(start)
        model = nnx.merge(self.state.graphdef, self.state.params)
        # the reference at each sample's own temperature, like the student's logp in the objective
        scores = score_sequences(model, seqs, temperature=[float(s.temperature) for s in samples])
        return [
            slice_response(sc, st, len(s.response_ids))
            for sc, st, s in zip(scores, starts, samples, strict=True)
        ]

    # -- engine ---------------------------------------------------------------------------------
    def _make_engine(self) -> Any:
        if self._engine is not None:
            return self._engine
        kind = str(_get(self._engine_cfg, "kind", "embedded"))
        if kind == "embedded":
            from rljax.inference.sampler import EmbeddedSampler

            e = self._engine_cfg
            return EmbeddedSampler(
                self.state.model,
                max_batch_size=int(_get(e, "max_batch_size", 128)),
                min_batch_bucket=int(_get(e, "min_batch_bucket", 8)),
                batch_wait_ms=float(_get(e, "batch_wait_ms", 0.0)),
                min_prompt_bucket=int(_get(e, "min_prompt_bucket", 64)),
                min_new_tokens_bucket=int(_get(e, "min_new_tokens_bucket", 16)),
                max_model_len=_get(e, "max_model_len", None),
                seed=self.seed,
            )
        if kind == "vllm":
            return self._make_vllm_engine()
        raise ValueError(f"config.engine.kind must be 'embedded' or 'vllm', got {kind!r}")

    def _make_vllm_engine(self) -> Any:
        import tempfile

        from rljax.inference.vllm import ServerConfig, ServerGroup, VLLMClient
        from rljax.models import save_pretrained

        e = self._engine_cfg
        urls = list(_plain(_get(e, "urls", [])) or [])
        if not urls:  # launch local servers on the initial weights
            model_dir = tempfile.mkdtemp(prefix="rljax_vllm_init_", dir=self.workdir)
            save_pretrained(self.state.model, model_dir)
            n = int(_get(e, "num_servers", 1))
            server_kwargs = dict(_plain(_get(e, "server", {})) or {})
            configs = [ServerConfig(model=model_dir, **server_kwargs) for _ in range(n)]
            self._servers = ServerGroup(configs, python=_get(e, "python", None) or None).start()
            urls = self._servers.urls
        client_kwargs = dict(_plain(_get(e, "client", {})) or {})
        return VLLMClient(urls, **client_kwargs)

    async def _serve(self, version: int, params: Any) -> None:
        if self._served_version != version:
            await self.engine.update_weights(nnx.merge(self.state.graphdef, params), version=version)
            self._served_version = version

    # -- rollout jobs ---------------------------------------------------------------------------
    def _submit_rollout(self, step: int) -> _Pending:
        version = max(step - self.lag, 0)
        params = self.behavior[version]
        tasks = self.tasks.take(self.prompts_per_step)
        config = dataclasses.replace(self.rollout_config, seed=_seed(self.seed, step, 1))

        engines = self._rollout_engines()

        async def sample(round_tasks: Sequence[Task], round_no: int) -> RolloutResult:
            round_config = (
                config if round_no == 0 else dataclasses.replace(config, seed=_seed(config.seed, round_no))
            )
            return await rollout(
                round_tasks,
                engine=engines,
                renderer=self.renderer,
                make_env=self.env_factories,
                config=round_config,
                vocab_size=self.model_vocab,
            )

        async def job() -> RolloutResult:
            await self._serve(version, params)
            result = await sample(tasks, 0)
            if not self.dynamic_sampling:
                return result
            return await self._dynamic_sampling(result, step, len(tasks), sample)

        return _Pending(step, version, self.worker.submit(job), time.perf_counter())

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
            max_rounds=int(ds.get("max_rounds", 4)),
            atol=float(ds.get("atol", 0.0)),
            strict=bool(ds.get("strict", False)),
        )
        start = time.perf_counter() - first.metrics["wall_time_s"]
        done, records, round_no = sampler.add(first.batch), list(first.trajectories), 0
        while not done:
            round_no += 1
            rng = np.random.default_rng([self.seed, step, round_no, 0xD5])
            picks = rng.choice(
                len(self.train_tasks), size=min(num_prompts, len(self.train_tasks)), replace=False
            )
            extra = []
            for i in picks:
                task = self.train_tasks[int(i)]
                extra.append(dataclasses.replace(task, id=f"{task.id}#ds{step}.{round_no}"))
            result = await sample(extra, round_no)
            records += result.trajectories
            done = sampler.add(result.batch)
        batch, metrics = sampler.result()
        wall = time.perf_counter() - start
        return RolloutResult(batch, {**rollout_metrics(records, wall), **metrics}, records)

    def _submit_eval(self, version: int, params: Any) -> concurrent.futures.Future:
        config = dataclasses.replace(self.eval_config, seed=_seed(self.seed, 0xE7A1))

        async def job() -> RolloutResult:
            await self._serve(version, params)
            return await rollout(
                self.eval_tasks,
                engine=self.engine,
                renderer=self.renderer,
                make_env=self.env_factories,
                config=config,
                vocab_size=self.model_vocab,
            )

        return self.worker.submit(job)

    # -- checkpoints ----------------------------------------------------------------------------
    def _needed_versions(self, step: int) -> list[int]:
        """Behaviour versions the rollouts of steps ``step .. step+lag-1`` sample with."""
        return sorted({max(m - self.lag, 0) for m in range(step, step + self.lag)} - {step})

    def _snapshot(self) -> Any:
        return jax.tree.map(jnp.copy, self.state.params)  # train_step donates: keep our own copy

    def _save(self, step: int, data_state: Mapping[str, Any]) -> None:
        behavior = {str(v): self.behavior[v] for v in self._needed_versions(step)}
        ckpt.save(
            self.ckpt_dir,
            step,
            params={"policy": self.state.params, "behavior": behavior},
            opt_state={"opt": self.state.opt_state, "step": self.state.step, "skipped": self.state.skipped},
            data_state=dict(data_state),
            rng={"minibatch": self.np_rng},
            config=_plain(self.config),
            keep=None if not self.keep_checkpoints else int(self.keep_checkpoints),
            overwrite=True,
        )

    def _restore(self) -> int | None:
        step = ckpt.latest_step(self.ckpt_dir) if self.ckpt_dir.exists() else None
        if step is None:
            return None
        behavior = {str(v): self.state.params for v in self._needed_versions(step)}
        r = ckpt.restore(
            self.ckpt_dir,
            params={"policy": self.state.params, "behavior": behavior},
            opt_state={"opt": self.state.opt_state, "step": self.state.step, "skipped": self.state.skipped},
            step=step,
        )
        self.state = dataclasses.replace(
            self.state,
            params=r.params["policy"],
            opt_state=r.opt_state["opt"],
            step=r.opt_state["step"],
            skipped=r.opt_state["skipped"],
        )
        self.behavior = {int(v): p for v, p in r.params["behavior"].items()}
        self.tasks.restore(r.data_state["tasks"])
        self.np_rng = r.rng["minibatch"]
        return step

    # -- one training step ----------------------------------------------------------------------
    def _train_on(self, batch: StepBatch, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        by_alg: dict[str, list[Step]] = {}
        for s in batch:
            by_alg.setdefault(s.algorithm, []).append(s)
        multi = self.multi_algorithm
        train_rows: list[dict[str, float]] = []
        shuffle_seed = int(self.np_rng.integers(0, 2**31 - 1))
        for name in sorted(by_alg):
            alg = self._algorithm_named(name)
            prep = prepare_samples(
                alg,
                StepBatch(by_alg[name], vocab_size=self.model_vocab),
                filters=self.filters,
                merge=self.merge,
                score=self._scorer(alg),
                observation_filter=self.observation_filters[alg.name],
            )
            metrics.update(prefixed(prep.metrics, name, multi=multi))
            num_groups = len({s.trajectory_id.instance_id for s in prep.samples})
            per_mb = self.mini_batch_prompts or num_groups
            if num_groups % per_mb:
                per_mb = num_groups  # mixed envs: this algorithm's groups do not divide; one mini-batch
            if alg.action_component == "rl" and prep.samples:
                all_adv = np.concatenate(prep.advantages)
                weights = prep.rl_weights or [1.0] * len(prep.samples)
                rl_mask = np.concatenate(
                    [np.float32(s.loss_mask) * w for s, w in zip(prep.samples, weights, strict=True)]
                )
                if rl_mask.sum():
                    metrics[f"advantage/mean/{name}"] = float((all_adv * rl_mask).sum() / rl_mask.sum())
                    metrics[f"advantage/abs_mean/{name}"] = float(
                        (np.abs(all_adv) * rl_mask).sum() / rl_mask.sum()
                    )
            tcfg = self.train_configs[name]
            self.state = dataclasses.replace(self.state, config=tcfg)
            for mb in make_mini_batches(
                prep.samples,
                mini_batch_prompts=per_mb,
                seq_len=self.seq_len,
                row_buckets=self.row_buckets,
                data_parallel=self.data_parallel,
                truncate=self.truncate,
                shuffle_seed=shuffle_seed,
                **prep.streams(),
            ):
                packed = mb.batch if self.mesh is None else train_sharding.shard_batch(mb.batch, self.mesh)
                counts = mini_batch_counts(packed, tcfg.objective)
                self.state, m = train_step(self.state, packed, counts)
                row = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
                row["pack/rows"] = float(mb.batch.tokens.shape[0])
                row["pack/efficiency"] = float(mb.metrics.get("packing_efficiency", math.nan))
                train_rows.append({f"{k}/{name}" if multi else k: v for k, v in row.items()} | row)
        for key in sorted({k for r in train_rows for k in r}):
            vals = [r[key] for r in train_rows if key in r]
            metrics[key] = float(np.mean(vals))
        metrics["optimizer_steps"] = float(len(train_rows))
        return metrics

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Runs (or resumes) the job; returns this process's per-step metrics."""
        resumed = self._restore() if self.resume else None
        self.sinks = _Sinks(self.workdir, resume_step=resumed, table_keys=self.table_keys)
        try:
            return self._run(resumed)
        finally:
            self.sinks.close()
            for worker, model in getattr(self, "frozen", {}).values():
                try:
                    worker.submit(model.aclose).result(timeout=30)
                except Exception as e:  # closing must not mask the run's own error
                    logger.warning("closing frozen model %s failed: %s", model.name, e)
            for worker in (getattr(self, "worker", None), getattr(self, "scoring", None)):
                if worker is not None:
                    worker.close()
            servers = getattr(self, "_servers", None)
            if servers is not None:
                servers.stop()

    def _warm_start(self) -> None:
        ws = dict(_plain(_get(self.config, "warmstart", {})) or {})
        wcfg = WarmStartConfig(**{k: v for k, v in ws.items() if k not in ("learning_rate", "optimizer")})
        if wcfg.num_steps == 0:
            return
        opt = _optimizer_config(
            {
                **dict(_plain(_get(self.config, "optimizer", {}))),
                **dict(_plain(ws.get("optimizer", {})) or {}),
                **({"learning_rate": ws["learning_rate"]} if ws.get("learning_rate") else {}),
            }
        )
        opt = dataclasses.replace(opt, schedule="constant", total_steps=None, warmup_steps=0)
        ws_state = TrainState.create(
            self.state.model, TrainConfig(objective=ObjectiveConfig(), optimizer=opt)
        )
        start = time.perf_counter()

        def make(task: Task) -> Any:
            return self.env_factories[task.env]()

        with metrics_lib.Progress(total=wcfg.num_steps, desc="warm start", unit="step") as bar:
            ws_state, hist = run_warm_start(
                ws_state,
                self.train_tasks,
                make,
                self.renderer,
                wcfg,
                seed=self.seed,
                train_step=train_step,
                counts_fn=mini_batch_counts,
                on_step=lambda row: bar.update(1),
                log=lambda row: self.sinks.log(int(row["warmstart/step"]), row, phase="warmstart"),
            )
        rl_cfg = self.state.config
        self.state = TrainState.create(ws_state.model, rl_cfg, mesh=self.mesh)
        print(
            f"warm start: {wcfg.num_steps} steps in {time.perf_counter() - start:.1f}s, "
            f"final CE {hist[-1]['warmstart/loss']:.4f}",
            flush=True,
        )

    def _run(self, resumed: int | None) -> list[dict[str, Any]]:
        run_start = time.perf_counter()
        self.worker = _RolloutWorker()
        self.scoring = _RolloutWorker()  # teacher scoring, beside the rollouts
        self._check_frozen_models()  # before the warm start: an unreachable teacher fails in seconds
        if resumed is None:
            self._warm_start()
            self.start_step = 0
            self.behavior = {0: self._snapshot()}
            if self.checkpoint_every:
                self._save(0, {"tasks": self.tasks.state(), "step": 0})
        else:
            self.start_step = resumed
            print(f"resumed from step {resumed} ({self.ckpt_dir})", flush=True)
        self.behavior[self.start_step] = self._snapshot()
        self.engine = self._make_engine()
        pending: list[_Pending] = []
        task_states: dict[int, dict[str, int]] = {}
        next_submit = self.start_step
        eval_future: tuple[int, concurrent.futures.Future] | None = None
        if (
            resumed is not None
            and self._evaluates(resumed)
            and self.mode == "async"
            and resumed < self.num_steps
        ):
            # the run we resume queued this eval at step `resumed` and would report it at the next step
            eval_future = (resumed, self._submit_eval(resumed, self.behavior[resumed]))

        def fill(limit: int) -> None:
            nonlocal next_submit
            while next_submit < min(limit, self.num_steps):
                task_states[next_submit] = self.tasks.state()
                pending.append(self._submit_rollout(next_submit))
                next_submit += 1

        for n in range(self.start_step, self.num_steps):
            step_start = time.perf_counter()
            fill(n + 1)  # sync: rollout n starts now, on theta_n (async: already running)
            job = pending.pop(0)
            assert job.step == n
            result = job.future.result()
            rollout_wait = time.perf_counter() - step_start
            fill(n + 1 + self.lag)  # async: rollouts n+1..n+lag start now, sampling theta_{<= n}
            frozen_algs = {a.name for a in self.algorithms.algorithms if a.sampling == "frozen"}
            versions = [s.policy_version for s in result.batch if s.algorithm not in frozen_algs]
            lag = n - min(versions) if versions else 0
            if lag > self.lag:
                raise RuntimeError(f"step {n}: a sample is {lag} versions stale (> max_off_policy_steps)")
            train_start = time.perf_counter()
            metrics = self._train_on(result.batch, n)
            jax.block_until_ready(self.state.params)
            train_time = time.perf_counter() - train_start
            self.behavior[n + 1] = self._snapshot()
            for v in [v for v in self.behavior if v < n + 1 - self.lag]:
                del self.behavior[v]
            rm = result.metrics
            num_samples = float(rm["num_trajectories"])
            metrics.update(
                {
                    "reward/mean": rm["reward_mean"],
                    "reward/std": rm["reward_std"],
                    "reward/max": rm["reward_max"],
                    "turns/mean": rm["turns_mean"],
                    "rollout/num_trajectories": num_samples,
                    "rollout/num_steps": rm["num_steps"],
                    "rollout/num_errored": rm["num_errored"],
                    "rollout/response_tokens": rm["response_tokens"],
                    "rollout/end_length_fraction": rm["end_length_fraction"],
                    "rollout/bridged_fraction": rm["bridged_fraction"],
                    "policy_version/min": float(min(versions)) if versions else math.nan,
                    "policy_version/max": float(max(versions)) if versions else math.nan,
                    "policy_version/lag": float(lag),
                    "time/rollout_s": rm["wall_time_s"],
                    "time/rollout_wait_s": rollout_wait,
                    "time/train_s": train_time,
                }
            )
            for k, v in rm.items():
                if k.startswith("reward_mean/"):
                    metrics["reward/mean/" + k.split("/", 1)[1]] = v
                elif k.startswith("dynamic_sampling/"):
                    metrics[k] = float(v)
            infos = [i for rec in result.trajectories for i in rec.infos if "correct" in i]
            if infos:
                metrics["correct_fraction"] = float(np.mean([bool(i["correct"]) for i in infos]))
            step_no = n + 1
            if eval_future is not None:  # async: the previous step's eval ran beside this step's training
                metrics.update(self._eval_metrics(*eval_future))
                eval_future = None
            last = step_no == self.num_steps
            if self._evaluates(step_no):
                eval_future = (step_no, self._submit_eval(step_no, self.behavior[step_no]))
                if self.mode == "sync" or last:
                    metrics.update(self._eval_metrics(*eval_future))
                    eval_future = None
            if self.checkpoint_every and (step_no % self.checkpoint_every == 0 or step_no == self.num_steps):
                save_start = time.perf_counter()
                state_at = task_states.get(step_no, self.tasks.state())
                self._save(step_no, {"tasks": state_at, "step": step_no})
                metrics["time/checkpoint_s"] = time.perf_counter() - save_start
            task_states.pop(n, None)
            metrics["time/step_s"] = time.perf_counter() - step_start
            metrics["time/elapsed_s"] = time.perf_counter() - run_start
            metrics["throughput/samples_per_s"] = num_samples / metrics["time/step_s"]
            self.history.append({"step": step_no, **metrics})
            self.sinks.log(step_no, metrics)
        return self.history

    def _evaluates(self, step: int) -> bool:
        """Whether held-out tasks are evaluated after RL step ``step`` (and after the last step)."""
        if not (self.eval_every and self.eval_tasks) or step == 0:
            return False
        return step % self.eval_every == 0 or step == self.num_steps

    def _eval_metrics(self, step: int, future: concurrent.futures.Future) -> dict[str, float]:
        r: RolloutResult = future.result()
        out = {"eval/reward_mean": r.metrics["reward_mean"], "eval/step": float(step)}
        infos = [i for rec in r.trajectories for i in rec.infos if "correct" in i]
        if infos:
            out["eval/correct_fraction"] = float(np.mean([bool(i["correct"]) for i in infos]))
        return out


def train(config: Any, workdir: str | os.PathLike, *, resume: bool = False) -> list[dict[str, Any]]:
    """``Trainer(config, workdir, resume=resume).run()``."""
    return Trainer(config, workdir, resume=resume).run()
