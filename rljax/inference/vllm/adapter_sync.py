"""Push a trained LoRA adapter to running vLLM servers and prove it arrived (LoRA weight sync).

Adapter-only training (:mod:`rljax.models.lora`) changes a few MB of adapter weights per step; the
base stays as the servers loaded it. One sync (:func:`sync_adapter`) ships only the adapter:

1. write it as a PEFT adapter directory ``<directory>/v<version>/`` (:func:`rljax.models.lora.save_adapter`);
2. on every server: ``POST /v1/load_lora_adapter {"lora_name": "<base>-lora-v<version>", "lora_path": ...}``
   (servers started with ``--enable-lora --max-lora-rank R`` and
   ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``); a new name per version, so no cached KV block of an
   older adapter is ever reused and nothing serving the old one is paused;
3. verify: on EVERY server, the new adapter continues the first half of a probe sequence greedily
   (:func:`decode_probe`: a decode, since prompt scoring under LoRA breaks in a mixed batch) and the
   generated tokens' logprobs are compared with the trainer's on the same ids
   (:func:`verify_adapter`); on a mismatch the new adapter is unloaded again and
   :class:`WeightSyncError` is raised;
4. switch: the client's ``lora_name`` (the ``model`` of its generate / score requests) and
   ``weight_version`` become the new ones, in one step;
5. unload the previous adapter once no request naming it is pending (at most ``drain_timeout_s``)
   and delete the files its sync wrote.

Under a :class:`~rljax.inference.vllm.supervisor.ServerSupervisor`, steps 2, 3 and 5 reach the
servers in service only (a server lost meanwhile is dropped from the sync), and the adapter is
recorded with its decode probe as a verified server ran it
(:class:`~rljax.inference.vllm.supervisor.ServedAdapter`): a server restored later loads it and
must decode the same greedy continuation with the same logprobs (:func:`replay_probe`) before it
is back in service.

Server flags (with :class:`rljax.inference.vllm.ServerConfig`)::

    ServerConfig(..., extra_args=("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
                 env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})

(``--max-lora-rank`` is one of vLLM's 8, 16, 32, ... and at least the adapter's rank; two loaded
adapters, the previous and the new one, coexist during a sync.)

>>> adapter_name("qwen3", 7)
'qwen3-lora-v7'
>>> adapter_directory("/tmp/sync", 7).name
'v7'
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import weight_sync
from rljax.inference.vllm.weight_sync import SyncConfig, WeightSyncError

logger = logging.getLogger(__name__)

__all__ = [
    "LOAD_PATH",
    "UNLOAD_PATH",
    "AdapterSyncReport",
    "adapter_directory",
    "adapter_name",
    "decode_probe",
    "directory_bytes",
    "load_adapter_on_servers",
    "load_verified_adapter",
    "replay_probe",
    "sync_adapter",
    "unload_adapter_on_servers",
    "verify_adapter",
]

#: vLLM's route that loads a LoRA adapter at run time.
LOAD_PATH = "/v1/load_lora_adapter"
#: vLLM's route that unloads a LoRA adapter.
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclasses.dataclass(frozen=True)
class AdapterSyncReport:
    """What one adapter sync did and measured.

    Attributes:
      name: the adapter's name on the servers (requests now carry it as ``model``).
      version: the weight version it serves.
      directory: the PEFT adapter directory the servers loaded.
      adapter_bytes: bytes of that directory (config + safetensors): what one sync ships.
      write_s, load_s, verify_s: seconds to write, load on every server, verify.
      max_abs_diff: per-server ``max |server - trainer|`` logprob on the probe (empty: no verify).
      unloaded: the previous adapter's name, if it was unloaded.
      drained: False when requests naming the previous adapter were still pending at its unload.
    """

    name: str
    version: int
    directory: str
    adapter_bytes: int
    write_s: float
    load_s: float
    verify_s: float
    max_abs_diff: tuple[float, ...]
    unloaded: str | None = None
    drained: bool = True


def adapter_name(base_name: str, version: int) -> str:
    """The served name of version ``version`` of the adapter of ``base_name``."""
    return f"{base_name}-lora-v{int(version)}"


def adapter_directory(directory: str | os.PathLike, version: int) -> pathlib.Path:
    """``<directory>/v<version>``: where version ``version`` of the adapter is written."""
    return pathlib.Path(directory) / f"v{int(version)}"


def directory_bytes(directory: str | os.PathLike) -> int:
    """Total size in bytes of the files under ``directory``.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); _ = pathlib.Path(d, "a").write_bytes(b"12345")
    >>> directory_bytes(d)
    5
    """
    return sum(p.stat().st_size for p in pathlib.Path(directory).rglob("*") if p.is_file())


async def load_adapter_on_servers(client: Any, name: str, path: str | os.PathLike) -> None:
    """``POST /v1/load_lora_adapter`` of the PEFT directory ``path`` as ``name`` on every server.

    Raises :class:`WeightSyncError` naming every server that failed (a server without
    ``--enable-lora`` / ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` answers 404 here).
    """
    body = {"lora_name": name, "lora_path": os.path.abspath(path)}
    answers = await client.post_each(LOAD_PATH, body)
    bad = weight_sync.post_failures(answers, client.urls, lambda status, _: status == 200, max_chars=300)
    if bad:
        raise WeightSyncError(
            f"loading LoRA adapter {name!r} from {path} failed (servers need --enable-lora, "
            "--max-lora-rank >= the adapter's rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): " + "; ".join(bad)
        )


async def unload_adapter_on_servers(client: Any, name: str, *, missing_ok: bool = False) -> None:
    """``POST /v1/unload_lora_adapter`` of ``name`` on every server; raises :class:`WeightSyncError`
    on a failure (a server that does not know the name is one unless ``missing_ok``)."""
    answers = await client.post_each(UNLOAD_PATH, {"lora_name": name})

    def ok(status: int, _: str) -> bool:
        return status == 200 or (missing_ok and status == 404)

    bad = weight_sync.post_failures(answers, client.urls, ok, max_chars=300)
    if bad:
        raise WeightSyncError(f"unloading LoRA adapter {name!r} failed: " + "; ".join(bad))


async def decode_probe(
    client: Any, name: str, probe: np.ndarray, *, server: int
) -> tuple[list[int], np.ndarray]:
    """The adapter ``name``'s greedy continuation of the first half of ``probe`` on server ``server``
    (as many tokens as the second half; EOS ignored): ``(prompt + generated ids, generated logprobs)``.

    Generation, not prompt scoring: vLLM computes prompt logprobs with one LoRA index per request
    while it has one logit row per prompt token, so a scoring request batched with other requests
    under LoRA fails (a known vLLM bug; on vLLM 0.32 CPU an einsum size mismatch that kills the
    engine). An adapter synced while requests run (``trainer.mode="fully_async"``, the Tinker API's
    sampling sessions) would take the server down; a decode batches like any request.
    """
    half = max(len(probe) // 2, 1)
    prompt = [int(t) for t in probe[:half]]
    greedy = SamplingParams(temperature=0.0, max_tokens=max(len(probe) - half, 1))
    completion = await client.probe_completion(prompt, greedy, model=name, server=server)
    return prompt + list(completion.ids), np.asarray(completion.logprobs, np.float64)


async def verify_adapter(
    client: Any,
    name: str,
    probe: np.ndarray,
    reference: Callable[[np.ndarray], np.ndarray],
    *,
    atol: float,
    record: dict[str, Any] | None = None,
) -> tuple[float, ...]:
    """Runs :func:`decode_probe` of adapter ``name`` on every server and compares the generated
    tokens' logprobs with ``reference(ids)`` (the trainer's ``log p(ids[t] | ids[:t])``) on the same
    ids; returns the per-server max abs difference, or raises :class:`WeightSyncError` (with
    ``diffs`` when the servers answered) if one is above ``atol``. ``record`` (a dict) receives the
    first server's run: ``ids`` (prompt then continuation) and ``expected`` (the trainer's logprobs
    of the continuation), what :func:`replay_probe` checks a restored server against."""
    answers = await asyncio.gather(
        *(decode_probe(client, name, probe, server=i) for i in range(len(client.urls))),
        return_exceptions=True,
    )
    weight_sync.raise_failed_probes(client.urls, answers, f"could not run the probe of adapter {name!r}")
    diffs = []
    for ids, got in answers:
        expected = np.asarray(await asyncio.to_thread(reference, np.asarray(ids, np.int64)), np.float64)
        expected = expected[len(ids) - len(got) :]
        diffs.append(float(np.max(np.abs(got - expected))))
        if record is not None and not record:
            record.update(ids=tuple(int(t) for t in ids), expected=expected)
    return weight_sync.check_probe_diffs(
        client.urls,
        tuple(diffs),
        atol,
        after=f"after loading adapter {name!r}",
        why="; samples from them would be off-policy",
    )


async def replay_probe(
    client: Any, name: str, ids: tuple[int, ...], expected: np.ndarray, *, atol: float
) -> tuple[float, ...]:
    """Checks that adapter ``name`` on every server of ``client`` decodes the greedy continuation a
    verified server decoded (``ids``: prompt then continuation, as :func:`verify_adapter` records
    it) with logprobs within ``atol`` of ``expected`` (the trainer's); returns the per-server max abs
    difference, or raises :class:`WeightSyncError` with the differences (infinite where the
    continuation itself differs: other weights)."""
    probe = np.asarray(ids, np.int64)
    answers = await asyncio.gather(
        *(decode_probe(client, name, probe, server=i) for i in range(len(client.urls))),
        return_exceptions=True,
    )
    weight_sync.raise_failed_probes(client.urls, answers, f"could not run the probe of adapter {name!r}")
    diffs = tuple(
        float(np.max(np.abs(got - expected))) if tuple(got_ids) == tuple(ids) else float("inf")
        for got_ids, got in answers
    )
    return weight_sync.check_probe_diffs(
        client.urls,
        diffs,
        atol,
        after=f"after loading adapter {name!r} again",
        why=" (inf: its greedy continuation of the probe differs from the verified one)",
    )


async def load_verified_adapter(
    client: Any,
    model: Any,
    *,
    name: str,
    path: str | os.PathLike,
    config: SyncConfig,
    reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
    record: dict[str, Any] | None = None,
) -> tuple[float, float, tuple[float, ...]]:
    """Loads the PEFT adapter directory ``path`` (written from ``model``) as ``name`` on every server
    of ``client`` and verifies it (steps 2 and 3 of the module docstring); returns
    ``(load seconds, verify seconds, per-server max |server - trainer| probe logprob)``.

    ``config.on_mismatch`` decides what a mismatch does ("retry": load once more, "warn": keep it);
    an adapter that fails verification is unloaded again before :class:`WeightSyncError` is raised,
    so no unverified adapter stays loaded. Nothing on ``client`` changes: the caller decides which
    requests name the adapter (:func:`sync_adapter` switches the client to it; the Tinker API's
    sampling sessions name it per request, several adapters side by side). ``record``: as for
    :func:`verify_adapter`.
    """
    start = time.perf_counter()
    await unload_adapter_on_servers(client, name, missing_ok=True)  # a failed earlier try of this name
    await load_adapter_on_servers(client, name, path)
    load_s = time.perf_counter() - start
    if not config.verify:
        return load_s, 0.0, ()
    start = time.perf_counter()
    probe = weight_sync.config_probe(config, model.config.vocab_size)
    reference = reference_logprobs or (lambda ids: weight_sync.trainer_logprobs(model, ids))
    atol = config.tolerance(getattr(model, "param_dtype", np.float32))
    try:
        try:
            diffs = await verify_adapter(client, name, probe, reference, atol=atol, record=record)
        except WeightSyncError as e:
            if config.on_mismatch != "retry" or not e.diffs:
                raise
            logger.warning("adapter sync verification failed (%s); loading %s once more", e, name)
            await unload_adapter_on_servers(client, name, missing_ok=True)
            await load_adapter_on_servers(client, name, path)
            if record is not None:
                record.clear()
            diffs = await verify_adapter(client, name, probe, reference, atol=atol, record=record)
    except WeightSyncError as e:
        if config.on_mismatch != "warn" or not e.diffs:
            try:  # never leave an unverified adapter loaded
                await unload_adapter_on_servers(client, name, missing_ok=True)
            except WeightSyncError as cleanup:
                logger.warning("could not unload the unverified adapter %s: %s", name, cleanup)
            raise
        logger.warning("adapter sync verification failed; continuing (on_mismatch='warn'): %s", e)
        diffs = e.diffs
    return load_s, time.perf_counter() - start, diffs


async def sync_adapter(
    client: Any,
    model: Any,
    *,
    version: int,
    directory: str | os.PathLike,
    base_name: str | None = None,
    config: SyncConfig | None = None,
    reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
    unload_previous: bool = True,
    drain_timeout_s: float = 60.0,
) -> str:
    """Ships the LoRA adapter of ``model`` to every server of ``client`` and routes it there; returns
    the adapter's served name (see the module docstring for the steps).

    ``client``: a :class:`rljax.inference.vllm.VLLMClient` (its ``lora_name``, ``weight_version`` and
    ``last_adapter_sync`` are set). ``model``: a decoder with an adapter
    (:func:`rljax.models.lora.apply_lora` / ``TrainState.model``). ``directory`` must be readable by
    the servers. ``base_name`` (default ``client.model``) prefixes the name. ``config`` supplies the
    probe and the tolerance (``verify``, ``probe_*``, ``atol``; default :class:`SyncConfig`).
    ``reference_logprobs(probe_ids) -> [L]`` gives the trainer's logprobs of the probe; None computes
    them with ``rljax.models.sequence_logprobs`` on ``model`` (adapter applied).

    This does not serialise against other syncs nor record a failure on the client; a trainer calls
    :meth:`VLLMClient.update_adapter`, which does both. With a supervisor on ``client`` the loads,
    probes and unloads reach the servers in service only, and the adapter is recorded for the
    servers restored later (module docstring).
    """
    from rljax.models.lora import save_adapter

    config = SyncConfig() if config is None else config
    if getattr(model, "lora_config", None) is None:
        raise ValueError("sync_adapter needs a model with a LoRA adapter (rljax.models.lora.apply_lora)")
    version = int(version)
    base_name = client.model if base_name is None else base_name
    name = adapter_name(base_name, version)
    previous = client.lora_name
    if name == previous:
        raise ValueError(f"adapter {name!r} is the one being served; sync a new version")
    path = adapter_directory(directory, version)

    start = time.perf_counter()
    await asyncio.to_thread(save_adapter, model, path, base_model_name_or_path=base_name)
    write_s = time.perf_counter() - start
    size = directory_bytes(path)

    supervisor = getattr(client, "supervisor", None)

    async def on_servers(work: Callable[[Any], Any]) -> Any:
        """``work(target)`` on the servers in service (every server without a supervisor)."""
        return await (work(client) if supervisor is None else supervisor.on_live(work))

    record: dict[str, Any] = {}

    async def load(target: Any) -> tuple[float, float, tuple[float, ...]]:
        record.clear()  # a run redone on fewer servers records afresh
        return await load_verified_adapter(
            target, model, name=name, path=path, config=config, reference_logprobs=reference_logprobs,
            record=record,
        )  # fmt: skip

    load_s, verify_s, diffs = await on_servers(load)

    last = getattr(client, "last_adapter_sync", None)
    previous_dir = last.directory if isinstance(last, AdapterSyncReport) and last.name == previous else None
    client.lora_name, client.weight_version = name, version  # one step: no request sees half of it
    if supervisor is not None:
        atol = config.tolerance(getattr(model, "param_dtype", np.float32))
        supervisor.record_adapter(name, os.fspath(path), record.get("ids"), record.get("expected"), atol)

    unloaded, drained = None, True
    if unload_previous and previous is not None:
        drained = await client.wait_for_model_idle(previous, timeout_s=drain_timeout_s)
        if not drained:
            logger.warning("requests naming adapter %s still pending after %ss; unloading it anyway",
                           previous, drain_timeout_s)  # fmt: skip
        try:
            await on_servers(lambda target: unload_adapter_on_servers(target, previous, missing_ok=True))
            unloaded = previous
        except WeightSyncError as e:  # a leak, not a wrong sample: go on
            logger.warning("could not unload the previous adapter %s: %s", previous, e)
        else:
            if previous_dir is not None and pathlib.Path(previous_dir) != path:
                await asyncio.to_thread(shutil.rmtree, previous_dir, True)

    client.last_adapter_sync = AdapterSyncReport(
        name=name,
        version=version,
        directory=os.fspath(path),
        adapter_bytes=size,
        write_s=write_s,
        load_s=load_s,
        verify_s=verify_s,
        max_abs_diff=diffs,
        unloaded=unloaded,
        drained=drained,
    )
    return name
