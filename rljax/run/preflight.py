"""Checking a run's config whole before anything is touched: ``rljax train``'s first step.

:func:`plan_run` does every check that needs no model weights and no server: the config's own keys,
types, ranges and rules between keys (:func:`rljax.run.config.parse_run_config`), the pip extras it
needs, the vLLM client and server settings (typed sections of the config, checked when it is
parsed; the client is built here as the run builds it), the vLLM Python of launched servers, the
GPUs of ``engine.server_devices`` / ``trainer_devices``, the files it names (``model.hf_path``: its
``config.json`` or GGUF metadata only; the tokenizer), the renderer, the algorithms, the envs and
their tasks, and the rules between those parts (:func:`rljax.run.builders.check_run`: MoE router
replay, demonstrations, the mesh over the processes and devices). For ``--resume`` it also reads
the checkpoint's recorded config and refuses one that differs in a result-changing key. Every
failure is a ``ValueError`` (or :class:`rljax.extras.MissingExtraError`) whose message starts with
the config key it is about.

The :class:`RunPlan` it returns holds what it built (the tasks are handed to the trainer, so they
are made once) and describes the run for ``rljax train --dry-run`` (:meth:`RunPlan.describe`).
What still needs the weights (loading the safetensors, LoRA on the built model, the first weight
sync to vLLM) is checked when the run builds them.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

from rljax import algorithms as algos
from rljax.chat import make_renderer
from rljax.envs.base import Task
from rljax.envs.loader import LoadError
from rljax.models import ModelConfig
from rljax.run.builders import build_tokenizer, check_extras, check_run, model_config
from rljax.run.config import (
    RunConfig,
    config_differences,
    config_record,
    did_you_mean,
    parse_config_record,
    parse_run_config,
)
from rljax.run.placement import check_shared_gpus, server_device_env, trainer_placement, visible_gpus
from rljax.run.tasks import EnvTasks, build_env_tasks

__all__ = ["RunPlan", "check_resumed_config", "plan_run"]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A checked run config and what :func:`plan_run` built from it (no weights, nothing started).

    Attributes:
      config: the parsed, validated config.
      algorithms: the run's algorithms (the default and per-env ones).
      model: the policy's model config (from ``model.hf_path`` or ``model.init``).
      vocab_size: the tokenizer's number of ids.
      env_tasks: the envs and their train / eval tasks (None: a run without rollouts).
      trainer_placement: what the trainer process sets before JAX starts
        (:func:`rljax.run.placement.trainer_placement`).
      server_env: each launched vLLM server's added environment (its ``CUDA_VISIBLE_DEVICES``).
      vllm_python: the Python of the vLLM environment of launched servers ("" when none is launched).
      process_count: the run's processes.
      device_count: the devices over all processes (None: not checked).
    """

    config: RunConfig
    algorithms: algos.AlgorithmConfig
    model: ModelConfig
    vocab_size: int
    env_tasks: EnvTasks | None
    trainer_placement: dict[str, str]
    server_env: list[dict[str, str]]
    vllm_python: str = ""
    process_count: int = 1
    device_count: int | None = None

    def tasks(self) -> dict[str, tuple[tuple[Task, ...], tuple[Task, ...]]]:
        """``{env name: (train tasks, eval tasks)}``: the tasks made here, for ``Trainer(tasks=...)``."""
        if self.env_tasks is None:
            return {}
        return {
            name: (
                tuple(t for t in self.env_tasks.train if t.env == name),
                tuple(t for t in self.env_tasks.eval if t.env == name),
            )
            for name in self.config.envs
        }

    def describe(self) -> str:
        """The resolved config (every key, defaults filled in) and the parts the run builds."""
        lines = ["config:"] + [f"  {k} = {v!r}" for k, v in _flat(config_record(self.config))]
        lines += ["", "builds:"] + [f"  {line}" for line in self._parts()]
        return "\n".join(lines)

    def _parts(self) -> list[str]:
        cfg, m = self.config, self.model
        source = f"from {cfg.model.hf_path}" if cfg.model.hf_path else "fresh (model.init)"
        out = [
            f"model: {m.model_type}, {m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size} "
            f"(tokenizer: {self.vocab_size} ids), {source}; params {cfg.model.param_dtype}, compute "
            f"{cfg.model.compute_dtype}" + (f", LoRA r={cfg.lora.rank}" if cfg.lora else ""),
            f"algorithm: {_algorithm(self.algorithms.default)}",
        ]
        if self.env_tasks is not None:
            for name in cfg.envs:
                a = self.algorithms.for_env(name)
                train = sum(t.env == name for t in self.env_tasks.train)
                evals = sum(t.env == name for t in self.env_tasks.eval)
                kind = cfg.envs[name].verifiers or cfg.envs[name].agent or cfg.envs[name].env
                out.append(f"env {name}: {kind}, {train} train / {evals} eval tasks, algorithm {a.name}")
        out += self._engines()
        devices = "unchecked" if self.device_count is None else self.device_count
        mesh = "one device" if not cfg.uses_mesh else f"mesh {_mesh(cfg)}"
        processes = f"{self.process_count} process(es)"
        out.append(f"trainer: {cfg.trainer.mode}, {processes}, {devices} device(s), {mesh}")
        return out

    def _engines(self) -> list[str]:
        e = self.config.engine
        place = ", ".join(f"{k}={v}" for k, v in self.trainer_placement.items())
        out = [f"trainer placement: {place}"] if place else []
        if e.kind == "embedded":
            return [*out, f"policy engine: embedded JAX sampler (max_batch_size {e.max_batch_size})"]
        if e.urls:
            return [*out, f"policy engine: vLLM servers at {', '.join(e.urls)}"]
        out.append(f"policy engine: {e.num_servers} vLLM server(s) launched with {self.vllm_python}")
        for i, env in enumerate(self.server_env):
            gpus = env.get("CUDA_VISIBLE_DEVICES", "the trainer's GPUs")
            out.append(f"  server {i}: GPUs {gpus}, {_changed(e.server) or 'ServerConfig defaults'}")
        return out


def _changed(section: Any) -> dict[str, Any]:
    """The config keys of ``section`` (a dataclass) that differ from its class's defaults."""
    default = config_record(type(section)())
    return {k: v for k, v in config_record(section).items() if v != default[k]}


def _algorithm(a: algos.Algorithm) -> str:
    return f"{a.name} (estimator {a.estimator}, policy loss {a.policy_loss or 'none'})"


def _mesh(cfg: RunConfig) -> str:
    return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.mesh).items() if v not in (None, 1))


def _flat(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        out: list[tuple[str, Any]] = []
        for k, v in value.items():
            out += _flat(v, f"{prefix}.{k}" if prefix else k)
        return out
    return [(prefix, value)]


def _keyed(key: str, error: Exception) -> ValueError:
    """``error`` as a ValueError that starts with a config key (``key`` unless it names one)."""
    text = str(error)
    return ValueError(text if text.startswith("config.") else f"{key}: {text}")


def plan_run(
    config: Any,
    *,
    rollouts: bool = True,
    process_count: int = 1,
    device_count: int | None = None,
    resume_from: str | pathlib.Path | None = None,
    allow_config_change: bool = False,
    visible: Sequence[str] | None = None,
) -> RunPlan:
    """Checks ``config`` whole (module docstring) and returns its :class:`RunPlan`.

    Args:
      config: a ConfigDict, nested dict or :class:`RunConfig`.
      rollouts: the run rolls out (envs, engines); False: the model parts only (``rljax serve``).
      process_count, device_count: the processes and devices the run will have (``device_count``
        None: the mesh is not checked against the devices).
      resume_from: a checkpoint directory the run resumes from: its recorded config must not differ in
        a result-changing key (unless ``allow_config_change``), and it must hold a complete checkpoint.
      visible: the GPUs this process sees (default :func:`rljax.run.placement.visible_gpus`).
    """
    cfg = config if isinstance(config, RunConfig) else parse_run_config(config)
    check_extras(cfg)
    visible = visible_gpus() if visible is None else visible
    python = _check_engine(cfg)
    server_env = server_device_env(cfg.engine, visible) if python else []
    placement = trainer_placement(cfg.engine, visible)
    check_shared_gpus(cfg.engine, visible)
    name = cfg.tokenizer.name
    if name.startswith(("/", "./", "../", "~")) and not pathlib.Path(name).expanduser().exists():
        raise ValueError(
            f"config.tokenizer.name: no such file or directory {name!r} (expected an HF tokenizer "
            "directory or hub id, a .gguf file, or toy:<family>)"
        )
    try:
        tokenizer = build_tokenizer(cfg.tokenizer)
    except (OSError, ValueError) as e:
        why = _first_line(e)
        raise ValueError(f"config.tokenizer.name: cannot load {cfg.tokenizer.name!r}: {why}") from None
    try:
        renderer = make_renderer(cfg.renderer.name, tokenizer, **cfg.renderer.kwargs)
    except (LoadError, TypeError, ValueError) as e:
        raise _keyed("config.renderer", e) from None
    model = model_config(cfg.model, vocab_size=len(tokenizer))
    algorithms = _algorithms(cfg)
    env_tasks = build_env_tasks(cfg) if rollouts else None
    if rollouts and cfg.frozen_models:
        from rljax.run.engines import resolve_frozen_models

        try:
            resolve_frozen_models(cfg.frozen_models, algorithms)
        except ValueError as e:
            raise _keyed("config.frozen_models", e) from None
    if cfg.uses_mesh and device_count is not None and cfg.mesh.size != device_count:
        raise ValueError(
            f"config.mesh: {_mesh(cfg)} spans {cfg.mesh.size} devices, but the run has {device_count}; "
            "make the axis sizes multiply to the number of devices"
        )
    check_run(
        cfg,
        algorithms=algorithms,
        model_config=model,
        env_tasks=env_tasks,
        renderer=renderer,
        process_count=process_count,
        device_count=device_count or 1,
    )
    if resume_from is not None:
        _check_resume(cfg, pathlib.Path(resume_from), allow_config_change=allow_config_change)
    return RunPlan(cfg, algorithms, model, len(tokenizer), env_tasks, placement, server_env, python,
                   process_count, device_count)  # fmt: skip


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _algorithms(cfg: RunConfig) -> algos.AlgorithmConfig:
    """The run's algorithms; an unknown name gets a "did you mean"."""
    named = [("config.algorithm", cfg.algorithm)] + [
        (f"config.env_algorithms.{env}", a) for env, a in cfg.env_algorithms.items()
    ]
    for key, a in named:
        name = a if isinstance(a, str) else a.get("name") if isinstance(a, dict) else None
        if isinstance(name, str) and name not in algos.list_algorithms():
            known = algos.list_algorithms()
            hint = did_you_mean(name, known)
            raise ValueError(f"{key}: unknown algorithm {name!r}; {hint}registered: {known}")
    try:
        return algos.validate_algorithm_config(
            cfg.algorithm, env_overrides=cfg.env_algorithms, group_size=cfg.rollout.group_size
        )
    except ValueError as e:
        raise _keyed("config.algorithm", e) from None


def _check_engine(cfg: RunConfig) -> str:
    """The vLLM client's and launched servers' settings, built as the run builds them (no server is
    started, no connection made); returns the vLLM Python of launched servers ("" if none)."""
    e = cfg.engine
    if e.kind != "vllm":
        return ""
    from rljax.inference.vllm import VLLMClient, find_vllm_python

    try:  # VLLMClient checks its values when it is made; it opens no connection before a request
        VLLMClient(["http://127.0.0.1:1"], e.client, sync=e.sync)
    except (TypeError, ValueError) as err:
        raise _keyed("config.engine.client", err) from None
    if e.urls:
        return ""
    try:
        python = find_vllm_python(e.python or None)
    except (FileNotFoundError, ValueError) as err:
        raise _keyed("config.engine.python", err) from None
    if python is None:
        raise ValueError(
            "config.engine.python: no vLLM Python found for the launched servers; set it (or "
            "$RLJAX_VLLM_PYTHON) to the python of vLLM's virtual environment, or give engine.urls"
        )
    return python


def _check_resume(cfg: RunConfig, workdir: pathlib.Path, *, allow_config_change: bool) -> None:
    """A resumed run's workdir holds a complete checkpoint whose recorded config matches ``cfg``."""
    from rljax.training import checkpoint as ckpt

    directory = workdir / "checkpoints"
    step = ckpt.latest_step(directory) if directory.is_dir() else None
    if step is None:
        raise FileNotFoundError(
            f"--resume: {directory} holds no complete checkpoint, so there is nothing to resume; start a "
            "new run (drop --resume) or point --workdir at the run to continue"
        )
    if allow_config_change:
        return
    check_resumed_config(ckpt.read_config(directory, step=step), cfg, step)


def check_resumed_config(saved: Any, cfg: RunConfig, step: int) -> None:
    """Refuses to resume checkpoint ``step``, trained with config ``saved`` (as recorded), with
    ``cfg`` when they differ in a result-changing key (:data:`rljax.run.config.RESULT_NEUTRAL_KEYS`
    lists the others); nothing is checked when the checkpoint records no config."""
    if not saved:
        return
    try:
        diffs = config_differences(parse_config_record(saved), cfg)
    except ValueError as e:  # a checkpoint of an older layout: say so instead of guessing
        raise ValueError(f"--resume: the checkpoint's config does not parse ({e})") from None
    if diffs:
        raise ValueError(
            f"--resume: the config differs from the one checkpoint step {step} was trained with in keys "
            f"that change results: {'; '.join(diffs)}. Resume with the same config, start a new run, "
            "or pass --allow_config_change to continue anyway"
        )
