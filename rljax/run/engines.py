"""The run's inference engines: the policy engine, frozen models, weight serving, shutdown.

* The **policy engine** samples the model being trained: the in-process
  :class:`~rljax.inference.EmbeddedSampler` (default) or :class:`~rljax.inference.vllm.VLLMClient`
  against servers at ``engine.urls`` or launched locally on the initial weights. :meth:`EngineSet.serve`
  puts a weight version on it (embedded: swap references; vLLM: safetensors + reload in place).
* **Frozen models** (:class:`~rljax.inference.frozen.FrozenModel`) are endpoints rljax never
  updates: opd teachers and sft samplers, referred to by name (``config.frozen_models``) or URL.
  Each client lives on the event loop of the worker that uses it.

Nothing here does math or decides when to sample; :mod:`rljax.run.scheduler` does.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from rljax.algorithms import Algorithm, AlgorithmConfig
from rljax.inference.frozen import FrozenModel, FrozenModelConfig, frozen_models_from_config
from rljax.run.builders import DTYPE_OF
from rljax.run.config import EngineSection
from rljax.run.worker import Worker
from rljax.training.checkpoint import fault_point
from rljax.training.distributed import process_share

__all__ = [
    "EngineSet",
    "launched_server_configs",
    "lora_server_args",
    "process_urls",
    "resolve_frozen_models",
]

logger = logging.getLogger(__name__)


def resolve_frozen_models(
    frozen_models: Mapping[str, Any], algorithms: AlgorithmConfig
) -> dict[str, FrozenModelConfig]:
    """``config.frozen_models`` plus the bare URLs algorithms name as ``teacher``; unknown names raise."""
    out = dict(frozen_models_from_config(dict(frozen_models)))
    for a in algorithms.algorithms:
        ref = a.frozen_model
        if ref is None or ref in out:
            continue
        if ref.startswith(("http://", "https://")):
            out[ref] = FrozenModelConfig(name=ref.split("://", 1)[1], base_url=ref)
            continue
        raise ValueError(
            f"algorithm {a.name!r} names frozen model {ref!r} (teacher=), but config.frozen_models has "
            f"{sorted(out) or 'none'}; add config.frozen_models.{ref} = "
            "dict(base_url='http://host:port') or set teacher to the endpoint's base URL"
        )
    return out


#: ``--max-lora-rank`` values vLLM accepts.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_args(server: Any, rank: int) -> Any:
    """``server`` (a :class:`~rljax.inference.vllm.ServerConfig`) set up for runtime LoRA loading:
    ``--enable-lora --max-lora-rank R --max-loras 2`` (R: vLLM's smallest allowed rank >= ``rank``;
    two adapters coexist during a sync) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; flags already in
    ``extra_args`` are kept.

    >>> from rljax.inference.vllm import ServerConfig
    >>> lora_server_args(ServerConfig(), 4).extra_args
    ('--enable-lora', '--max-lora-rank', '8', '--max-loras', '2')
    """
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}")
    extra = tuple(server.extra_args)
    if "--enable-lora" not in extra:
        extra += ("--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", "2")
    env = {**dict(server.env), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    return dataclasses.replace(server, extra_args=extra, env=env)


def launched_server_configs(
    engine: EngineSection, model_dir: str, server: Any, *, visible: Sequence[str] | None = None
) -> list[Any]:
    """The :class:`~rljax.inference.vllm.ServerConfig` of each of the ``engine.num_servers`` servers
    launched on ``model_dir``: ``server`` (a ServerConfig), and each server's GPUs
    (``engine.server_devices`` as ``CUDA_VISIBLE_DEVICES``, :func:`rljax.run.placement.server_device_env`)
    added to its environment. ``visible``: the GPUs this process sees (default:
    :func:`rljax.run.placement.visible_gpus`).

    >>> from rljax.inference.vllm import ServerConfig
    >>> e = EngineSection(kind="vllm", num_servers=2, server_devices=("1", "2"))
    >>> configs = launched_server_configs(e, "/m", ServerConfig(env={"A": "1"}), visible=["0", "1", "2"])
    >>> [dict(c.env) for c in configs]
    [{'A': '1', 'CUDA_VISIBLE_DEVICES': '1'}, {'A': '1', 'CUDA_VISIBLE_DEVICES': '2'}]
    """
    from rljax.run.placement import server_device_env

    return [
        dataclasses.replace(server, model=model_dir, env={**dict(server.env), **devices})
        for devices in server_device_env(engine, visible)
    ]


def process_urls(urls: Sequence[str]) -> list[str]:
    """This process's share of ``engine.urls``: a multi-process run splits the servers among its
    processes (each process rolls out, syncs and verifies only its own), so there must be at least
    one per process. One process keeps them all.

    >>> process_urls(["http://a:8000", "http://b:8000"])
    ['http://a:8000', 'http://b:8000']
    """
    urls = list(urls)
    count = jax.process_count()
    if count == 1 or not urls:
        return urls
    if len(urls) < count:
        raise ValueError(
            f"config.engine.urls lists {len(urls)} servers for {count} processes; a multi-process run gives "
            "each process its own servers (at least one each), or leave urls empty to launch them per host"
        )
    return [urls[i] for i in process_share(len(urls))]


def _without_adapters(model: Any) -> Any:
    """A copy of ``model`` whose LoRA adapters are all zero: the base model's function."""
    from flax import nnx

    from rljax.models.lora import LoRAParam

    base = nnx.clone(model)
    nnx.update(base, jax.tree.map(jax.numpy.zeros_like, nnx.state(base, LoRAParam)))
    return base


def _written(model: Any) -> bool:
    from rljax.inference.vllm import WrittenWeights

    return isinstance(model, WrittenWeights)


class EngineSet:
    """The policy engine and the frozen models of a run, and their lifecycles.

    Args:
      engine: the ``config.engine`` section.
      frozen: resolved frozen models (:func:`resolve_frozen_models`).
      workdir: where a locally launched vLLM server's initial weights are written.
      seed: the embedded sampler's seed.
      engine_override: an engine object to use as the policy engine (tests, custom engines).
      dtype: the dtype the policy engine serves (``"float32"`` / ``"bfloat16"``): every model put on
        it is cast with :func:`rljax.models.cast_model` (a no-op when the model already stores and
        computes in it), so the trainer's master weights stay untouched.
    """

    def __init__(
        self,
        engine: EngineSection,
        frozen: Mapping[str, FrozenModelConfig],
        *,
        workdir: pathlib.Path,
        seed: int,
        engine_override: Any = None,
        dtype: str = "float32",
    ) -> None:
        self.config = engine
        self.dtype = dtype
        self.frozen_configs = dict(frozen)
        self.workdir = workdir
        self.seed = seed
        self.policy: Any = engine_override
        self._servers: Any = None
        self._served_version: int | None = None
        self._supervisor: Any = None
        self._frozen: dict[tuple[str, int], tuple[Worker, FrozenModel]] = {}

    # -- the policy engine -------------------------------------------------------------------------
    def start_policy(self, model: Any, *, lora_rank: int | None = None, version: int | None = None) -> Any:
        """Creates the policy engine on ``model``'s weights (unless one was given); returns it.

        ``lora_rank``: locally launched vLLM servers also take runtime LoRA adapters up to this rank
        (:func:`lora_server_args`; the Tinker API loads its clients' adapters into them).
        ``version``: the weight version ``model`` is; the embedded sampler then serves it as that
        version from the start (the first :meth:`serve` of it does nothing: no second decode copy).
        vLLM servers get their first sync regardless (it verifies them)."""
        if self.policy is not None:
            return self.policy
        if not _written(model):
            model = self.served(model)
        e = self.config
        if e.kind == "embedded":
            from rljax.inference.sampler import EmbeddedSampler

            self.policy = EmbeddedSampler(
                model,
                max_batch_size=e.max_batch_size,
                min_batch_bucket=e.min_batch_bucket,
                batch_wait_ms=e.batch_wait_ms,
                min_prompt_bucket=e.min_prompt_bucket,
                min_new_tokens_bucket=e.min_new_tokens_bucket,
                max_model_len=e.max_model_len,
                seed=self.seed,
                prefix_sharing=e.prefix_sharing == "auto",
                in_flight_updates=e.in_flight_updates != "off",
                weight_version=version or 0,
            )
            self._served_version = version
        else:
            self.policy = self._start_vllm(model, lora_rank)
        return self.policy

    def _start_vllm(self, model: Any, lora_rank: int | None = None) -> Any:
        from rljax.inference.vllm import ServerGroup, VLLMClient
        from rljax.models import save_pretrained

        e = self.config
        urls = process_urls(e.urls)
        if not urls:  # launch local servers on the initial weights (each process: its own)
            if _written(model):  # a multi-process run wrote them already (every process together)
                model_dir = model.directory
            else:
                model_dir = tempfile.mkdtemp(prefix="rljax_vllm_init_", dir=self.workdir)
                save_pretrained(model, model_dir)  # a LoRA model's base (HF I/O never sees adapters)
            server = dataclasses.replace(e.server, dtype=self.dtype)  # engine.dtype, resolved
            if not _written(model) and self._adapter_sync(model):
                server = lora_server_args(server, max(model.lora_config.max_rank, lora_rank or 0))
            elif lora_rank:
                server = lora_server_args(server, lora_rank)
            configs = launched_server_configs(e, model_dir, server)
            if e.in_flight_updates != "off":  # the version-labelled generate route
                from rljax.inference.vllm.pause import in_flight_server_config

                configs = [in_flight_server_config(cfg) for cfg in configs]
            self._servers = ServerGroup(configs, python=e.python or None).start()
            urls = self._servers.urls
        # MoE: routed experts (if the servers return them) in rljax's layout
        routed = tuple(model.config.moe_layers) or None
        if e.in_flight_updates != "off":
            from rljax.inference.vllm.pause import InFlightVLLMClient

            policy = InFlightVLLMClient(
                urls, config=e.client, sync=e.sync, routed_layers=routed, kv_cache=e.in_flight_updates
            )
        else:
            policy = VLLMClient(urls, e.client, sync=e.sync, routed_layers=routed)
        if e.supervise:
            self._supervise(policy, model)
        return policy

    def _supervise(self, client: Any, model: Any) -> None:
        """Attaches a :class:`~rljax.inference.vllm.ServerSupervisor` to ``client``: launched servers
        are restarted, servers given by URL re-checked; both restored to the initial weights
        (verified by the sync's probe) until the first sync records newer ones."""
        from rljax.inference.vllm import CurrentWeights, ServerSupervisor, weight_sync

        e = self.config
        launched = self._servers.servers if self._servers is not None else [None] * len(client.urls)
        self._supervisor = ServerSupervisor(client, launched, e.supervisor)
        probe = expected = None
        if e.sync.verify:
            probe = weight_sync.config_probe(e.sync, model.config.vocab_size)
            # the servers serve the base: adapters (adapter syncs) are loaded and verified on top
            base = model if _written(model) or not self._adapter_sync(model) else _without_adapters(model)
            expected = model.expected if _written(model) else weight_sync.trainer_logprobs(base, probe)
            probe = model.probe if _written(model) else probe
        dtype = model.dtype if _written(model) else getattr(model, "param_dtype", "float32")
        # A launched server restarts on the initial weights: nothing to reload until the first sync
        # (each sync, in-flight switches included, records its weights and version).
        client.current = CurrentWeights(None, probe, expected, e.sync.tolerance(dtype), client.weight_version)

    def served(self, model: Any) -> Any:
        """``model`` as the policy engine serves it (cast to :attr:`dtype`). A LoRA model keeps its
        adapters (the embedded sampler applies them; vLLM gets adapter-only syncs), except with
        ``engine.lora_sync="merged"``, where vLLM gets them folded into full weights."""
        from rljax.models import cast_model
        from rljax.models.lora import lora_state, merge_lora

        if (
            self.config.kind == "vllm"
            and jax.tree.leaves(lora_state(model))
            and not self._adapter_sync(model)
        ):
            model = merge_lora(model)
        return cast_model(model, DTYPE_OF[self.dtype])

    def _adapter_sync(self, model: Any) -> bool:
        from rljax.models.lora import lora_state

        return self.config.lora_sync == "adapter" and bool(jax.tree.leaves(lora_state(model)))

    def release_policy_weights(self) -> bool:
        """Lets the policy engine go of the weights it serves, where it can (the embedded sampler;
        a vLLM server keeps its own): the next :meth:`serve` loads a version again. Returns whether
        it did. For sync runs between a rollout and the next version (see the trainer)."""
        release = getattr(self.policy, "release_weights", None)
        if release is None:
            return False
        release()
        self._served_version = None
        return True

    @property
    def served_version(self) -> int | None:
        """The weight version the policy engine serves (None before the first :meth:`serve`)."""
        return self._served_version

    async def serve(self, version: int, model: Any) -> None:
        """Makes the policy engine sample with ``model`` as weight ``version`` (no-op if it does).
        ``model`` may be weights already written by every process (:class:`WrittenWeights`)."""
        if self._served_version != version and _written(model):
            fault_point("kill_during_weight_sync", version)  # RLJAX_FAULT: weights written, not loaded
            await self.policy.update_weights_from(model, version=version)
            self._served_version = version
        elif self._served_version != version:
            served = self.served(model)
            fault_point("kill_during_weight_sync", version)  # RLJAX_FAULT: weights cast, not taken
            if self.config.kind == "vllm" and self._adapter_sync(served):
                await self.policy.update_adapter(served, version=version)  # adapter only, verified
            else:
                await self.policy.update_weights(served, version=version)
            self._served_version = version

    # -- frozen models -----------------------------------------------------------------------------
    def frozen_model(self, name: str, worker: Worker) -> FrozenModel:
        """The client of frozen model ``name`` on ``worker``'s event loop (created on first use)."""
        key = (name, id(worker))
        if key not in self._frozen:
            cfg = self.frozen_configs[name]

            async def make() -> FrozenModel:
                return FrozenModel.from_config(cfg)

            self._frozen[key] = (worker, worker.submit(make).result())
        return self._frozen[key][1]

    def check_frozen_models(self, algorithms: AlgorithmConfig, worker: Worker) -> None:
        """Fails fast (before any training) when a frozen model the run needs does not answer."""
        for name in sorted({a.frozen_model for a in algorithms.algorithms if a.frozen_model}):
            model = self.frozen_model(name, worker)
            try:
                worker.submit(model.resolve_model).result()
            except Exception as e:
                raise RuntimeError(
                    f"frozen model {name!r} at {list(self.frozen_configs[name].base_url)} does not answer "
                    f"GET /v1/models; start it or fix config.frozen_models.{name}.base_url. Cause: {e}"
                ) from e

    def sampler_for(self, algorithm: Algorithm, worker: Worker) -> Any:
        """The engine that samples ``algorithm``'s rollouts: the policy, or a frozen model (sft)."""
        if algorithm.sampling == "frozen":
            return self.frozen_model(algorithm.frozen_model, worker)
        return self.policy

    # -- shutdown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Closes frozen-model clients and stops locally launched servers (errors are logged)."""
        for worker, model in self._frozen.values():
            try:
                worker.submit(model.aclose).result(timeout=30)
            except Exception as e:  # closing must not mask the run's own error
                logger.warning("closing frozen model %s failed: %s", model.name, e)
        self._frozen.clear()
        if self._supervisor is not None:
            self._supervisor.closing = True  # no restart may race the shutdown below
        if self._servers is not None:
            self._servers.stop()
            self._servers = None
