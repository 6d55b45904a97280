"""Async token-in / token-out client for one or more OpenAI-compatible vLLM servers (design §5, vLLM).

``generate`` posts ``/v1/completions`` with the prompt as token ids, ``"return_token_ids": true`` and
``"logprobs": 0``, and returns the EXACT sampled ids with one logprob each (under the
temperature-scaled distribution when the server runs ``--logprobs-mode processed_logprobs``).
``score`` posts ``"prompt_logprobs": 0, "max_tokens": 1`` and returns
``out[t] = log p(ids[t] | ids[:t])`` (``out[0] = 0``), the convention of
``rljax.models.sequence_logprobs``.

Routing over several servers:

- load balancing: a request goes to the healthy server with the fewest outstanding requests;
- sticky sessions: requests with the same ``session_id`` (a trajectory) stay on one server while it is
  healthy, so its KV prefix cache is reused turn after turn;
- bounded concurrency: at most ``max_concurrency`` requests in flight over all servers;
- retries: a transport failure, timeout or 5xx marks the server unhealthy for ``cooldown_s`` and the
  request is retried on another server after an exponential backoff
  ``min(backoff_s * 2**attempt, backoff_max_s)``; after ``max_retries`` retries it raises
  :class:`ServerUnavailableError`;
- a malformed answer (bad JSON, missing fields, ids/logprobs length mismatch, echoed prompt different
  from the one sent) raises :class:`MalformedResponseError` at once: it is never retried into data
  and never returned partly;
- a 4xx (bad request) raises :class:`RequestRejectedError` with the server's message.

Weight versions: while :meth:`VLLMClient.update_weights` runs, new requests wait; each completion
records the version its request was dispatched under, and that is the version whose weights
generated it:

- with ``SyncConfig.pause_mode="wait"`` (the default) a sync first waits until every request
  dispatched before it has been answered, and only then pauses the servers: no request can reach a
  server after the pause (vLLM would queue it and run it on the NEW weights after the resume);
- with ``"abort"`` a generation that was out while its server was paused is sent again once the
  sync is done (it may have reached the server after the pause), unless it came back aborted by
  that pause (it was running on the old weights when it was cut);
- ``"keep"`` (requests frozen and continued on the new weights) is refused: a completion here has
  one version; :class:`~rljax.inference.vllm.pause.InFlightVLLMClient` reads vLLM's per-token
  labels instead.

LoRA adapters: with ``lora_name`` set (by :meth:`VLLMClient.update_adapter`, see
:mod:`rljax.inference.vllm.adapter_sync`), requests name that adapter as their ``model``, and a
completion records the version of the adapter its request was built for.

>>> completion_payload([1, 2, 3], SamplingParams(temperature=0.7, max_tokens=4), model="m")["prompt"]
[1, 2, 3]
>>> parse_completion({"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.5]},
...                                "finish_reason": "stop"}]}, prompt_ids=[1, 2], weight_version=3)
Completion(ids=(5,), logprobs=(-0.5,), finish_reason='stop', weight_version=3)
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import dataclasses
import io
import json
import math
import shutil
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx
import numpy as np

from rljax import knobs
from rljax.inference.engine import Completion, SamplingParams
from rljax.inference.vllm import weight_sync
from rljax.knobs import knob


class VLLMClientError(RuntimeError):
    """Base class of the client's errors."""


class MalformedResponseError(VLLMClientError):
    """The server answered 200 but the body is not a complete, consistent completion (never retried)."""


class RequestRejectedError(VLLMClientError):
    """The server rejected the request (HTTP 4xx): retrying elsewhere would not help."""


class ServerUnavailableError(VLLMClientError):
    """Every attempt failed with a transport error, timeout or 5xx; the message lists them."""


class ServerFaultError(VLLMClientError):
    """One server failed one request in a way another server (or a retry) may not: it stalled (no
    token for ``stall_timeout_s``), its stream ended without a finish reason or reported an error,
    or its supervisor took it out of service. Retried like a transport failure."""


class AllServersDownError(ServerUnavailableError):
    """No server has been in service for ``all_down_timeout_s``; the message names each server, why
    it is out, and the last lines of its log."""


# vLLM's finish reasons -> ours. Anything else is a malformed response.
_FINISH_REASONS: Mapping[str | None, str] = {"stop": "stop", "length": "length", "abort": "abort"}


def completion_payload(prompt_ids: Sequence[int], sampling: SamplingParams, *, model: str) -> dict[str, Any]:
    """The JSON body of a token-in / token-out ``POST /v1/completions``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(sampling.max_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": -1 if sampling.top_k is None else int(sampling.top_k),
        "logprobs": 0,
        "return_token_ids": True,
        # Logprob entries named "token_id:<id>": needs no tokenizer (--skip-tokenizer-init) and lets
        # the parser check that logprobs and ids are aligned.
        "return_tokens_as_token_ids": True,
        "stream": False,
    }
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        body["seed"] = int(sampling.seed)
    return body


def score_payload(ids: Sequence[int], *, model: str) -> dict[str, Any]:
    """The JSON body that scores ``ids`` (prompt logprobs at temperature 1, one throw-away token)."""
    return {
        "model": model,
        "prompt": [int(t) for t in ids],
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
        "stream": False,
    }


def _first_choice(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise MalformedResponseError(f"completion response is not a JSON object: {str(body)[:200]!r}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        raise MalformedResponseError(
            f"completion response must have exactly one choice, got choices={str(choices)[:200]!r}"
        )
    return choices[0]


def _check_prompt_echo(choice: Mapping[str, Any], prompt_ids: Sequence[int]) -> None:
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and [int(t) for t in echoed] != [int(t) for t in prompt_ids]:
        raise MalformedResponseError(
            f"server echoed prompt_token_ids of length {len(echoed)} that differ from the {len(prompt_ids)} "
            "ids sent; the completion would not belong to this prompt"
        )


def decode_routed_experts(
    encoded: str, *, num_rows: int, routed_layers: Sequence[int] | None = None
) -> np.ndarray:
    """vLLM's ``routed_experts`` field -> int32 ``[num_rows, layers, top_k]`` (router replay, R3).

    vLLM (``--enable-return-routed-experts``) returns base64 of a ``.npy`` array of shape
    ``(num_tokens - 1, num_hidden_layers, top_k)``, uint8/uint16/int32: the experts every processed
    token (prompt and completion, but the last sampled token) was routed to, one row per layer of
    the model (rows of dense layers are meaningless). ``routed_layers`` keeps those layers in that
    order (rljax's layout: the model's ``config.moe_layers``); None keeps every layer.

    >>> import base64, io
    >>> buf = io.BytesIO(); np.save(buf, np.arange(12, dtype=np.uint8).reshape(2, 3, 2))
    >>> decode_routed_experts(base64.b64encode(buf.getvalue()).decode(), num_rows=2, routed_layers=[1, 2])[0]
    array([[2, 3],
           [4, 5]], dtype=int32)
    """
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, OSError, binascii.Error) as e:
        raise MalformedResponseError(f"routed_experts is not base64 of a .npy array: {e}") from None
    if array.ndim != 3 or array.shape[0] != num_rows or not np.issubdtype(array.dtype, np.integer):
        raise MalformedResponseError(
            f"routed_experts must be an int array of shape ({num_rows}, layers, top_k) (one row per "
            f"processed token but the last); got {array.dtype} {array.shape}"
        )
    if routed_layers is not None:
        layers = [int(i) for i in routed_layers]
        if layers and max(layers) >= array.shape[1]:
            raise MalformedResponseError(
                f"routed_experts has {array.shape[1]} layers; cannot select MoE layers {layers}"
            )
        array = array[:, layers]
    return array.astype(np.int32)


def parse_completion(
    body: Any,
    *,
    prompt_ids: Sequence[int],
    weight_version: int,
    routed_layers: Sequence[int] | None = None,
) -> Completion:
    """Validates a ``/v1/completions`` answer and returns its :class:`Completion`.

    Raises :class:`MalformedResponseError` when ids or logprobs are missing, of different lengths,
    not finite, or when the echoed prompt differs from ``prompt_ids``. A ``routed_experts`` field
    (MoE servers with ``--enable-return-routed-experts``) becomes ``Completion.routed_experts``
    (:func:`decode_routed_experts`, keeping ``routed_layers``).
    """
    choice = _first_choice(body)
    _check_prompt_echo(choice, prompt_ids)
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs")
    token_logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, Mapping) else None
    if not isinstance(ids, list) or not isinstance(token_logprobs, list):
        raise MalformedResponseError(
            "completion choice lacks 'token_ids' or 'logprobs.token_logprobs' (send return_token_ids=true "
            f"and logprobs=0; a vLLM new enough for token ids is required); got keys {sorted(choice)}"
        )
    if len(ids) != len(token_logprobs):
        raise MalformedResponseError(
            f"completion has {len(ids)} token ids but {len(token_logprobs)} logprobs (truncated response?)"
        )
    for i, t in enumerate(ids):
        sampled_token_id(t, i, "completion")
    values = [sampled_logprob(x, i, "completion") for i, x in enumerate(token_logprobs)]
    tokens = logprobs.get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        named = [t[len("token_id:") :] for t in tokens]
        if named != [str(t) for t in ids]:
            raise MalformedResponseError(
                f"completion logprobs are for tokens {named[:10]}... but token_ids are {ids[:10]}...: "
                "ids and logprobs are not aligned"
            )
    return Completion(
        ids=tuple(ids),
        logprobs=tuple(values),
        finish_reason=finish_reason(choice),
        weight_version=weight_version,
        routed_experts=choice_routing(choice, len(prompt_ids) + len(ids), routed_layers),
    )


def aborted_by_one_pause(completion: Completion, pauses: int) -> bool:
    """Whether a generation that was out while its server was paused ``pauses`` times keeps its
    label: only when it came back "abort" from one pause (it was running when that pause cut it,
    so every token is the old weights'); any other answer may come from a request that reached the
    server after the pause and ran on the new weights.

    >>> aborted_by_one_pause(Completion((1,), (-0.1,), "abort", 0), 1)
    True
    >>> aborted_by_one_pause(Completion((1,), (-0.1,), "length", 0), 1)
    False
    """
    return completion.finish_reason == "abort" and pauses == 1


def sampled_token_id(t: Any, position: int, what: str) -> int:
    """``t`` when it is a non-negative int; else :class:`MalformedResponseError` naming ``what``."""
    if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise MalformedResponseError(
            f"{what} token_ids must be non-negative ints, got {t!r} at position {position}"
        )
    return t


def sampled_logprob(x: Any, position: int, what: str) -> float:
    """``x`` as a float when it is a finite number <= 0 (1e-6 of rounding allowed); else
    :class:`MalformedResponseError` naming ``what``."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x <= 1e-6):
        raise MalformedResponseError(
            f"{what} logprobs must be finite numbers <= 0, got {x!r} at position {position}"
        )
    return float(x)


def finish_reason(choice: Mapping[str, Any]) -> str:
    """The choice's finish reason as a :data:`rljax.inference.engine.FINISH_REASONS` value."""
    reason = choice.get("finish_reason")
    if reason not in _FINISH_REASONS:
        raise MalformedResponseError(
            f"unknown finish_reason {reason!r}; expected one of {sorted(r for r in _FINISH_REASONS if r)}"
        )
    return _FINISH_REASONS[reason]


def choice_routing(choice: Mapping[str, Any], num_tokens: int, routed_layers: Sequence[int] | None) -> Any:
    """The choice's ``routed_experts`` (:func:`decode_routed_experts`, one row per processed token:
    ``num_tokens - 1``), or None when it has none."""
    routed = choice.get("routed_experts")
    if routed is None:
        return None
    return decode_routed_experts(routed, num_rows=num_tokens - 1, routed_layers=routed_layers)


def parse_prompt_logprobs(body: Any, *, ids: Sequence[int]) -> np.ndarray:
    """``out[t] = log p(ids[t] | ids[:t])`` from a ``prompt_logprobs`` answer; ``out[0] = 0``, float64.

    Entry t of vLLM's ``prompt_logprobs`` is None for t = 0, else a dict keyed by token id strings
    whose values carry ``"logprob"``; the entry for ``ids[t]`` must be there.
    """
    choice = _first_choice(body)
    _check_prompt_echo(choice, ids)
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        n = len(entries) if isinstance(entries, list) else None
        raise MalformedResponseError(
            f"prompt_logprobs must be a list with one entry per prompt token ({len(ids)}), got {n} "
            "(send prompt_logprobs=0)"
        )
    out = np.zeros(len(ids), np.float64)
    for t in range(1, len(ids)):
        entry = entries[t]
        value = entry.get(str(int(ids[t]))) if isinstance(entry, Mapping) else None
        value = value.get("logprob") if isinstance(value, Mapping) else value
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MalformedResponseError(
                f"prompt_logprobs[{t}] has no finite logprob for token {ids[t]}: {str(entry)[:200]!r}"
            )
        out[t] = float(value)
    return out


async def assemble_stream(
    lines: AsyncIterator[str], progress: list[float] | None = None, *, where: str = "stream"
) -> dict[str, Any]:
    """The server-sent events of a streamed one-choice ``/v1/completions`` -> the body of the same
    request unstreamed: ``token_ids``, ``logprobs.token_logprobs`` and ``logprobs.tokens``
    concatenated chunk by chunk, ``prompt_token_ids`` (first chunk) and ``finish_reason`` (last).

    ``progress[0]`` is set to ``time.monotonic()`` at every chunk (the progress deadline's clock). A
    stream that ends without a finish reason (cut mid-response) or sends an ``error`` event raises
    :class:`ServerFaultError`; a chunk that is not JSON raises :class:`MalformedResponseError`.
    """
    ids: list[int] = []
    token_logprobs: list[Any] = []
    tokens: list[Any] = []
    choice: dict[str, Any] = {"finish_reason": None}
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as e:
            raise MalformedResponseError(f"{where}: stream chunk is not JSON: {data[:200]!r}") from e
        if progress is not None:
            progress[0] = time.monotonic()
        if not isinstance(chunk, Mapping):
            raise MalformedResponseError(f"{where}: stream chunk is not an object: {data[:200]!r}")
        if "error" in chunk:
            raise ServerFaultError(f"{where}: the stream reported an error: {str(chunk['error'])[:300]}")
        for part in chunk.get("choices") or ():
            if not isinstance(part, Mapping) or part.get("index", 0) != 0:
                raise MalformedResponseError(f"{where}: stream chunk for a second choice: {data[:200]!r}")
            if part.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = part["prompt_token_ids"]
            ids += part.get("token_ids") or []
            logprobs = part.get("logprobs")
            if isinstance(logprobs, Mapping):
                token_logprobs += logprobs.get("token_logprobs") or []
                tokens += logprobs.get("tokens") or []
            if part.get("finish_reason") is not None:
                choice["finish_reason"] = part["finish_reason"]
    if choice["finish_reason"] is None:
        raise ServerFaultError(
            f"{where}: the stream ended after {len(ids)} tokens without a finish reason (cut mid-response)"
        )
    choice.update(token_ids=ids, logprobs={"token_logprobs": token_logprobs, "tokens": tokens})
    return {"choices": [choice]}


@dataclasses.dataclass
class ServerState:
    """Book-keeping for one server: outstanding requests and health."""

    url: str
    outstanding: int = 0
    unhealthy_until: float = 0.0
    failures: int = 0
    requests: int = 0
    # Supervision (rljax.inference.vllm.supervisor): a server that is down gets no requests until
    # it is back with the current weights; ``lost`` is set when it goes down, which aborts the
    # requests and admin posts it holds.
    down: bool = False
    down_reason: str = ""
    lost: asyncio.Event | None = None

    def healthy(self, now: float) -> bool:
        """True unless a recent failure put it in its cool-down."""
        return now >= self.unhealthy_until


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code in (408, 429)
    return isinstance(exc, (httpx.TransportError, asyncio.TimeoutError, ServerFaultError))


@knobs.section
class ClientConfig:
    """How a :class:`VLLMClient` routes, bounds, retries and times its requests (the run config's
    ``engine.client``).

    >>> ClientConfig(max_concurrency=4).timeout_s
    300.0
    """

    model: str = knob("rljax", doc="the ``model`` field of requests: the servers' ``served_model_name``")
    max_concurrency: int = knob(64, ge=1, doc="most requests in flight over all servers")
    timeout_s: float = knob(300.0, gt=0, doc="read timeout of one request, in seconds")
    connect_timeout_s: float = knob(5.0, gt=0, doc="connect timeout of one request, in seconds")
    max_retries: int = knob(
        3, ge=0, doc="retries of a request after a transport failure, timeout or 5xx, each on another server"
    )
    backoff_s: float = knob(0.2, ge=0, doc="wait before the first retry; doubles on each retry")
    backoff_max_s: float = knob(5.0, ge=0, doc="longest wait between retries")
    cooldown_s: float = knob(10.0, ge=0, doc="seconds a failed server gets no new requests")
    max_sessions: int = knob(
        100_000, ge=1, doc="sticky sessions remembered (trajectory -> server), the oldest forgotten first"
    )
    keepalive_s: float = knob(
        2.0,
        ge=0,
        doc="how long an idle connection stays pooled; keep it below the servers' keep-alive timeout "
        "(vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s) so no request races a server-side close",
    )
    stall_timeout_s: float | None = knob(
        120.0,
        gt=0,
        doc="per-token progress deadline: a server that sends no token of a streamed generation (a "
        "score or an unstreamed answer: no answer) for this long fails the request, which goes to "
        "another server (None: only ``timeout_s``); time while a weight sync holds requests back does "
        "not count. Keep it above the longest prefill plus queueing of one request",
    )
    all_down_timeout_s: float = knob(
        600.0,
        gt=0,
        doc="with a supervisor (:meth:`VLLMClient.supervise`): how long requests wait for a server to "
        "come back when none is in service before they fail with :class:`AllServersDownError`",
    )
    stream: bool = knob(True, doc="stream generations (the stall deadline then runs per token)")


def _checked_urls(urls: Sequence[str]) -> list[str]:
    """Server base URLs without a trailing slash: a non-empty list of distinct ones."""
    if isinstance(urls, str):
        raise ValueError("VLLMClient takes a list of server URLs, got one string; wrap it in a list")
    urls = [u.rstrip("/") for u in urls]
    if not urls:
        raise ValueError("VLLMClient needs at least one server URL")
    if len(set(urls)) != len(urls):
        raise ValueError(f"VLLMClient got duplicate server URLs: {urls}")
    return urls


class VLLMClient:
    """An :class:`rljax.inference.engine.Engine` over one or more vLLM servers.

    Use it inside the event loop that will run the requests (``async with VLLMClient(urls) as c``).
    ``routed_layers``: for MoE servers started with ``--enable-return-routed-experts``, the model's
    MoE layer indices (``config.moe_layers``): completions then carry ``routed_experts`` in rljax's
    layout ``[tokens - 1, len(routed_layers), top_k]`` (router replay); None keeps vLLM's layers.
    ``config``: the client's knobs (:class:`ClientConfig`); keyword arguments named after its fields
    override them (``VLLMClient(urls, max_retries=0)``).

    >>> client = VLLMClient(["http://127.0.0.1:8000", "http://127.0.0.1:8001/"], max_concurrency=4)
    >>> client.urls, client.weight_version
    (['http://127.0.0.1:8000', 'http://127.0.0.1:8001'], 0)
    """

    def __init__(
        self,
        urls: Sequence[str],
        config: ClientConfig | None = None,
        *,
        weight_version: int = 0,
        sync: weight_sync.SyncConfig | None = None,
        routed_layers: Sequence[int] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        lora_name: str | None = None,
        **overrides: Any,
    ) -> None:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ClientConfig)})
        if unknown:
            raise TypeError(
                f"VLLMClient got unexpected keyword arguments {unknown} (not ClientConfig fields)"
            )
        config = dataclasses.replace(config or ClientConfig(), **overrides)
        self.config = config
        urls = _checked_urls(urls)
        sync = sync or weight_sync.SyncConfig()
        if sync.pause_mode == "keep" and not getattr(self, "supports_in_flight_updates", False):
            raise ValueError(
                "VLLMClient sync.pause_mode='keep' continues the requests in flight on the new weights, "
                "but a VLLMClient completion carries one weight version; use 'wait' (default) or "
                "'abort', or InFlightVLLMClient (engine.in_flight_updates), which records vLLM's "
                "per-token versions"
            )
        self.model = config.model
        self.servers = [ServerState(u) for u in urls]
        self.max_retries = int(config.max_retries)
        self.backoff_s = float(config.backoff_s)
        self.backoff_max_s = float(config.backoff_max_s)
        self.cooldown_s = float(config.cooldown_s)
        self.max_sessions = int(config.max_sessions)
        self.weight_version = int(weight_version)
        self.sync_config = sync
        self.routed_layers = None if routed_layers is None else tuple(int(i) for i in routed_layers)
        self.last_sync: weight_sync.SyncReport | None = None
        self.lora_name = lora_name  # a LoRA adapter loaded on the servers: requests ask for it
        self.last_adapter_sync: Any = None  # adapter_sync.AdapterSyncReport of the last adapter sync
        self._model_requests: collections.Counter[str] = collections.Counter()  # in flight, per model
        self._clock = clock
        self.stall_timeout_s = None if config.stall_timeout_s is None else float(config.stall_timeout_s)
        self.all_down_timeout_s = float(config.all_down_timeout_s)
        self.stream = bool(config.stream)
        self.supervisor: Any = None  # a supervisor.ServerSupervisor, see supervise()
        self.current: Any = None  # supervisor.CurrentWeights: what a server back in service must serve
        self._init_connection_state(config, len(urls), transport)

    def _init_connection_state(
        self, config: ClientConfig, num_servers: int, transport: httpx.AsyncBaseTransport | None
    ) -> None:
        """The HTTP pool's settings and the per-loop and per-server state of requests, syncs and
        outages (the loop's objects are made on first use, in the loop that runs the requests)."""
        self._timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        # An idle pooled connection is dropped by the client well before the server's keep-alive timer
        # (uvicorn / vLLM: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE) can close it: with equal timers a request
        # sent on a connection the server is closing at that instant fails with ReadError, and admin
        # posts (weight sync, adapter load/unload) are not retried.
        keep = config.max_concurrency + 2 * num_servers  # every in-flight request + admin posts stay pooled
        self._limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=keep, keepalive_expiry=config.keepalive_s
        )
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._max_concurrency = int(config.max_concurrency)
        self._semaphore: asyncio.Semaphore | None = None
        self._open: asyncio.Event | None = None  # cleared while weights are being synced
        self._sync_lock: asyncio.Lock | None = None
        self._sync_dir: str | None = None
        self._sync_error: weight_sync.WeightSyncError | None = None
        # Gated requests sent and not yet answered (a "wait" sync pauses the servers once it is 0),
        # and per server the number of pauses posted to it (a request out across one is suspect).
        self._dispatched = 0
        self._none_dispatched: asyncio.Event | None = None
        self._draining = False
        self._pauses = [0] * num_servers
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._picks = 0
        self._all_down: AllServersDownError | None = None  # sticky once raised
        self._all_down_since = time.monotonic()
        self._up: asyncio.Event | None = None  # set while some server is in service

    # ----------------------------------------------------------------------------------------------
    # plumbing

    @property
    def urls(self) -> list[str]:
        """Server base URLs, in order."""
        return [s.url for s in self.servers]

    def _ensure_loop_state(self) -> None:
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=self._timeout, limits=self._limits, transport=self._transport
            )
            self._semaphore = asyncio.Semaphore(self._max_concurrency)
            self._open = asyncio.Event()
            self._open.set()
            self._sync_lock = asyncio.Lock()
            self._none_dispatched = asyncio.Event()
            if self._dispatched == 0:
                self._none_dispatched.set()
            self._supervision_started()

    async def aclose(self) -> None:
        """Closes the HTTP connections (the client can be used again afterwards)."""
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _sync_directory(self) -> str:
        """Where syncs write the weights: ``sync.directory`` if set, else this client's own temporary
        directory, made at the first sync and reused by every later one (each overwrites it).

        The temporary directory is removed when the client is garbage collected or the process exits
        (a 135M model's float32 weights are ~0.5 GiB; one was left in the temporary folder per run).
        The servers have read the weights by then: a sync returns once they reloaded them.
        """
        if self.sync_config.directory:
            return self.sync_config.directory
        if self._sync_dir is None:
            self._sync_dir = tempfile.mkdtemp(prefix="rljax_weight_sync_")
            weakref.finalize(self, shutil.rmtree, self._sync_dir, ignore_errors=True)
        return self._sync_dir

    async def __aenter__(self) -> VLLMClient:
        self._ensure_loop_state()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered, over all servers."""
        return sum(s.outstanding for s in self.servers)

    @property
    def served_model(self) -> str:
        """The ``model`` field of generate / score requests: ``lora_name`` if set, else ``model``.

        >>> VLLMClient(["http://h:1"], model="base").served_model
        'base'
        >>> VLLMClient(["http://h:1"], model="base", lora_name="base-lora-v3").served_model
        'base-lora-v3'
        """
        return self.model if self.lora_name is None else self.lora_name

    async def wait_for_model_idle(self, model: str, *, timeout_s: float, poll_s: float = 0.01) -> bool:
        """Waits until no generate / score call names ``model`` (True), or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self._model_requests[model] > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    # ----------------------------------------------------------------------------------------------
    # routing

    def pick_server(self, session_id: str | None = None, *, exclude: frozenset[int] = frozenset()) -> int:
        """Index of the server for the next request.

        The session's server if it has one that is healthy and not excluded; else the healthy server
        with the fewest outstanding requests (ties: least recently picked order); if none is healthy,
        the one whose cool-down ends first. The choice becomes the session's server.
        """
        now = self._clock()
        candidates = [i for i in range(len(self.servers)) if i not in exclude] or list(
            range(len(self.servers))
        )
        if session_id is not None:
            i = self._sessions.get(session_id)
            if i is not None and i in candidates and self.servers[i].healthy(now):
                self._sessions.move_to_end(session_id)
                return i
        healthy = [i for i in candidates if self.servers[i].healthy(now)]
        if healthy:
            n = len(self.servers)
            i = min(healthy, key=lambda j: (self.servers[j].outstanding, (j - self._picks) % n))
        else:
            i = min(candidates, key=lambda j: self.servers[j].unhealthy_until)
        self._picks += 1
        if session_id is not None:
            self._sessions[session_id] = i
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return i

    def end_session(self, session_id: str) -> None:
        """Forgets a session's server (call when its trajectory ends)."""
        self._sessions.pop(session_id, None)

    def _mark_failed(self, i: int) -> None:
        s = self.servers[i]
        s.failures += 1
        s.unhealthy_until = self._clock() + self.cooldown_s
        if self.supervisor is not None:
            self.supervisor.poke(i)  # check it now rather than at the next health interval

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based): ``min(b * 2**attempt, max)``."""
        return min(self.backoff_s * 2.0**attempt, self.backoff_max_s)

    # ----------------------------------------------------------------------------------------------
    # supervision and the per-token progress deadline

    def supervise(self, supervisor: Any) -> None:
        """Attaches a :class:`~rljax.inference.vllm.supervisor.ServerSupervisor`: it takes servers
        out of service (:meth:`mark_down`) and back (:meth:`mark_up`); its health loop runs on the
        event loop of this client's requests, from their first one on."""
        self.supervisor = supervisor
        if self._http is not None:
            self._supervision_started()

    def _supervision_started(self) -> None:
        for state in self.servers:
            if state.lost is None:
                state.lost = asyncio.Event()
                if state.down:
                    state.lost.set()
        self._up = asyncio.Event()
        if any(not s.down for s in self.servers):
            self._up.set()
        else:
            self._all_down_since = time.monotonic()
        if self.supervisor is not None:
            self.supervisor.start()

    def mark_down(self, i: int, reason: str) -> None:
        """Takes server ``i`` out of service: no new requests, and the requests and admin posts it
        holds fail at once (and are retried elsewhere)."""
        state = self.servers[i]
        state.down, state.down_reason = True, reason
        if state.lost is not None:
            state.lost.set()
        if all(s.down for s in self.servers) and self._http is not None:
            self._up.clear()
            self._all_down_since = time.monotonic()

    def mark_up(self, i: int) -> None:
        """Puts server ``i`` back in service (it serves :attr:`current`)."""
        state = self.servers[i]
        state.down, state.down_reason = False, ""
        state.unhealthy_until = 0.0
        state.lost = asyncio.Event() if self._http is not None else None
        if self._http is not None:
            self._up.set()

    @property
    def live(self) -> list[int]:
        """Indices of the servers in service (all of them without a supervisor)."""
        return [i for i, s in enumerate(self.servers) if not s.down]

    async def _routing_exclude(self, tried: set[int]) -> frozenset[int]:
        """Servers the next attempt must avoid: those out of service, and those this request tried
        already (unless every server in service was tried). Waits for a server when none is in
        service, up to ``all_down_timeout_s`` after the last one went down."""
        live = await self._wait_for_live_server()
        untried = [i for i in live if i not in tried]
        return frozenset(range(len(self.servers))) - frozenset(untried or live)

    async def _wait_for_live_server(self) -> list[int]:
        while True:
            if self._all_down is not None:
                raise self._all_down
            live = self.live
            if live:
                return live
            left = self._all_down_since + self.all_down_timeout_s - time.monotonic()
            if left > 0:
                with contextlib.suppress(TimeoutError):  # not wait_for: it can swallow a cancel
                    async with asyncio.timeout(left):
                        await self._up.wait()
                continue
            if not self.live:
                self._all_down = AllServersDownError(self._all_down_message())
                raise self._all_down

    def _all_down_message(self) -> str:
        describe = getattr(self.supervisor, "describe", None)
        lines = [
            f"no vLLM server in service for {self.all_down_timeout_s:g} s "
            f"(engine.client.all_down_timeout_s); the run stops. Servers:"
        ]
        for i, state in enumerate(self.servers):
            lines.append(f"- {state.url}: {state.down_reason or 'out of service'}")
            detail = describe(i) if describe is not None else ""
            if detail:
                lines.append("    " + detail.replace("\n", "\n    "))
        return "\n".join(lines)

    def _stall_exempt(self) -> bool:
        """True while a weight sync holds requests back (servers may be paused: no tokens then);
        not while it waits for the requests sent before it (the servers are not paused yet)."""
        return self._open is not None and not self._open.is_set() and not self._draining

    @property
    def draining(self) -> bool:
        """True while a sync waits for the requests dispatched before it to be answered (it pauses
        the servers only then; see the module docstring)."""
        return self._draining

    def note_pause(self, servers: Sequence[int] | None = None) -> None:
        """Records that a sync is about to pause ``servers`` (indices; None: all): a generation out
        on one of them meanwhile may reach it after the pause and run on the new weights, so it is
        sent again (``SyncConfig.pause_mode="abort"``; a "wait" sync pauses only once none is out)."""
        for i in range(len(self.servers)) if servers is None else servers:
            self._pauses[i] += 1

    def _count_dispatched(self, n: int) -> None:
        self._dispatched += n
        if self._dispatched == 0:
            self._none_dispatched.set()
        else:
            self._none_dispatched.clear()

    def _drains_before_sync(self) -> bool:
        """Whether a sync waits for the requests out before it pauses (``pause_mode="wait"``: they
        would finish on the old weights anyway, and none can then reach a paused server)."""
        return self.sync_config.pause_mode == "wait"

    async def _send(self, i: int, path: str, body: Mapping[str, Any]) -> Any:
        """POSTs ``body`` to server ``i`` under the progress deadline: it fails with
        :class:`ServerFaultError` when the server sends nothing for ``stall_timeout_s`` (sync
        holds excepted) or is taken out of service meanwhile."""
        state = self.servers[i]
        progress = [time.monotonic()]
        work = asyncio.ensure_future(self._post_body(state.url, path, body, progress))
        guards = []
        if self.stall_timeout_s is not None:
            guards.append(asyncio.ensure_future(self._watch_stall(progress, state.url)))
        if state.lost is not None:
            guards.append(asyncio.ensure_future(self._watch_lost(state)))
        if not guards:
            return await work
        try:
            await asyncio.wait([work, *guards], return_when=asyncio.FIRST_COMPLETED)
        finally:
            pending = [t for t in (work, *guards) if not t.done()]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if work.done() and not work.cancelled():
            return work.result()
        for guard in guards:
            if guard.done() and not guard.cancelled() and guard.exception() is not None:
                raise guard.exception()
        raise ServerFaultError(f"{state.url}{path}: request ended without an answer")

    async def _watch_stall(self, progress: list[float], url: str) -> None:
        stall = self.stall_timeout_s
        while True:
            now = time.monotonic()
            if self._stall_exempt():
                progress[0] = now
            left = progress[0] + stall - now
            if left <= 0:
                raise ServerFaultError(f"{url}: stalled, no token for {stall:g} s (stall_timeout_s)")
            await asyncio.sleep(min(left, 1.0))

    @staticmethod
    async def _watch_lost(state: ServerState) -> None:
        await state.lost.wait()
        raise ServerFaultError(f"{state.url}: taken out of service ({state.down_reason})")

    async def _post_body(self, url: str, path: str, body: Mapping[str, Any], progress: list[float]) -> Any:
        if body.get("stream"):
            return await self._post_stream(url, path, body, progress)
        return await self._post_json(url, path, body)

    async def _post_stream(
        self, url: str, path: str, body: Mapping[str, Any], progress: list[float]
    ) -> dict[str, Any]:
        """A streamed ``/v1/completions`` (server-sent events), assembled into the body the
        unstreamed request returns. Each chunk is progress; a stream that ends without a finish
        reason, or carries an error, raises :class:`ServerFaultError` (the request is retried
        whole, so no token is kept twice or lost). A server that answers plain JSON is parsed
        as such."""
        self._ensure_loop_state()
        async with self._http.stream("POST", url + path, json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                if response.status_code < 500 and response.status_code not in (408, 429):
                    raise RequestRejectedError(
                        f"{url}{path} rejected the request with HTTP {response.status_code}: "
                        f"{response.text[:500]}"
                    )
                response.raise_for_status()
            if "text/event-stream" not in response.headers.get("content-type", ""):
                raw = await response.aread()
                try:
                    return json.loads(raw) if raw else None
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise MalformedResponseError(
                        f"{url}{path} answered a body that is not JSON (truncated?): {raw[:200]!r}"
                    ) from e
            return await assemble_stream(response.aiter_lines(), progress, where=url + path)

    # ----------------------------------------------------------------------------------------------
    # requests

    async def _post_json(self, url: str, path: str, body: Mapping[str, Any] | None) -> Any:
        self._ensure_loop_state()
        response = await self._http.post(url + path, json=body)
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            raise RequestRejectedError(
                f"{url}{path} rejected the request with HTTP {response.status_code}: {response.text[:500]}"
            )
        response.raise_for_status()
        if not response.content:
            return None
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MalformedResponseError(
                f"{url}{path} answered HTTP {response.status_code} with a body that is not JSON "
                f"(truncated?): {response.text[:200]!r}"
            ) from e

    async def request(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        session_id: str | None = None,
        parse: Callable[[Any, int], Any],
        server: int | None = None,
        gated: bool = True,
        keep_paused: Callable[[Any, int], bool] | None = None,
    ) -> Any:
        """POSTs ``body`` to ``path`` with routing, concurrency bound, retries and failover.

        ``parse(json_body, weight_version)`` turns the answer into the result; its
        :class:`MalformedResponseError` propagates at once. ``server`` pins one server (no failover).
        ``gated=False`` does not wait for a weight sync in progress (the sync's own verification).
        ``keep_paused``: for a gated request that was out while its server was paused ``n`` times,
        ``keep_paused(result, n)`` says whether the result may be kept; if not, the request is sent
        again after the sync (not counted as a retry). None keeps every result.
        """
        self._ensure_loop_state()
        errors: list[str] = []
        tried: set[int] = set()
        attempt = 0
        async with self._semaphore:
            while True:
                i = await self._dispatch_target(server, session_id, tried, gated)
                tried.add(i)
                state = self.servers[i]
                # No await since the gate was seen open: a sync now waits for this request (or,
                # pausing in "abort" mode, counts the pause against it).
                version, pauses = self.weight_version, self._pauses[i]
                state.outstanding += 1
                state.requests += 1
                if gated:
                    self._count_dispatched(1)
                try:
                    answer = await self._send(i, path, body)
                except Exception as e:
                    if not _retryable(e):
                        raise
                    self._mark_failed(i)
                    errors.append(f"attempt {attempt + 1} on {state.url}: {type(e).__name__}: {e}")
                    if attempt >= self.max_retries:
                        break
                    await asyncio.sleep(self.backoff(attempt))
                    attempt += 1
                    continue
                finally:
                    state.outstanding -= 1
                    if gated:
                        self._count_dispatched(-1)
                result = parse(answer, version)
                crossed = self._pauses[i] - pauses
                if gated and crossed and keep_paused is not None and not keep_paused(result, crossed):
                    continue  # maybe generated after the pause, by the new weights: send it again
                return result
        raise ServerUnavailableError(
            f"{path} failed after {self.max_retries + 1} attempts:\n  " + "\n  ".join(errors)
        )

    async def _dispatch_target(
        self, server: int | None, session_id: str | None, tried: set[int], gated: bool
    ) -> int:
        """The server index of the next attempt, once a gated request may go: no sync holds
        requests (re-checked after any wait for a server in service) and the last one succeeded."""
        while True:
            if gated:
                await self._open.wait()
                if self._sync_error is not None:
                    raise weight_sync.WeightSyncError(
                        "the last weight sync failed, so the servers may not serve the trainer's "
                        f"weights; sync again before sampling. Cause: {self._sync_error}"
                    )
            exclude = frozenset() if server is not None else await self._routing_exclude(tried)
            if not gated or (self._open.is_set() and self._sync_error is None):
                return server if server is not None else self.pick_server(session_id, exclude=exclude)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        session_id: str | None = None,
        model: str | None = None,
    ) -> Completion:
        """Samples one completion of ``prompt_ids`` (token ids in, token ids + logprobs out).

        ``model`` names another served model or adapter than :attr:`served_model` (e.g. one of several
        adapters loaded side by side, as the Tinker API's sampling sessions do); its weights are fixed
        by its name, so the completion records :attr:`weight_version` as the request was built.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("generate() needs a non-empty prompt_ids")
        # A LoRA adapter's weights are fixed by its name: the completion gets the version of the
        # adapter named in the request (even if a newer one is synced while it waits to be sent).
        adapter = self.lora_name is not None or model is not None
        model, built_version = (self.served_model if model is None else model), self.weight_version
        body = completion_payload(prompt, sampling, model=model)
        # Streamed, each token is progress (the stall deadline); MoE routing comes unstreamed only.
        body["stream"] = self.stream and self.routed_layers is None
        self._model_requests[model] += 1
        try:
            return await self.request(
                "/v1/completions",
                body,
                session_id=session_id,
                parse=lambda body, version: parse_completion(
                    body,
                    prompt_ids=prompt,
                    weight_version=built_version if adapter else version,
                    routed_layers=self.routed_layers,
                ),
                keep_paused=aborted_by_one_pause,
            )
        finally:
            self._release(model)

    async def relabel(self, target: Any, version: int) -> None:
        """Makes the servers of ``target`` (this client, or a view of some of its servers) label
        what they sample as weight ``version``. Nothing to do here: this client labels each
        completion itself; :class:`~rljax.inference.vllm.pause.InFlightVLLMClient` relabels vLLM."""

    def _release(self, model: str) -> None:
        self._model_requests[model] -= 1
        if self._model_requests[model] <= 0:
            del self._model_requests[model]

    async def score(
        self,
        ids: Sequence[int],
        *,
        server: int | None = None,
        gated: bool = True,
        model: str | None = None,
    ) -> np.ndarray:
        """``out[t] = log p(ids[t] | ids[:t])`` (float64, ``out[0] = 0``) at temperature 1.

        ``server`` scores on that server index (no failover), e.g. to check each one after a sync;
        ``gated=False`` runs even while a weight sync holds new requests back. ``model`` names
        another served model or adapter than :attr:`served_model` (e.g. a new adapter before the
        client switches to it).
        """
        ids = [int(t) for t in ids]
        if len(ids) < 2:
            raise ValueError(f"score() needs at least 2 token ids, got {len(ids)}")
        model = self.served_model if model is None else model
        self._model_requests[model] += 1
        try:
            return await self.request(
                "/v1/completions",
                score_payload(ids, model=model),
                server=server,
                gated=gated,
                parse=lambda body, version: parse_prompt_logprobs(body, ids=ids),
            )
        finally:
            self._release(model)

    async def probe_completion(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, model: str, server: int
    ) -> Completion:
        """One unstreamed completion of ``prompt_ids`` by ``model`` on server index ``server``, EOS
        ignored (exactly ``sampling.max_tokens`` tokens), not waiting for a sync in progress: the
        decode probe that verifies a sync (:func:`.adapter_sync.decode_probe`)."""
        prompt = [int(t) for t in prompt_ids]
        body = {**completion_payload(prompt, sampling, model=model), "ignore_eos": True}
        return await self.request(
            "/v1/completions",
            body,
            server=server,
            gated=False,
            parse=lambda answer, version: parse_completion(answer, prompt_ids=prompt, weight_version=version),
        )

    async def post_all(self, path: str, body: Mapping[str, Any] | None = None) -> list[Any]:
        """POSTs to every server at once (admin routes: ``/pause``, ``/collective_rpc``, ...); no retries."""
        return list(await asyncio.gather(*(self._post_json(s.url, path, body) for s in self.servers)))

    async def set_step_delay(self, seconds: float) -> None:
        """Makes every server's model steps wait ``seconds`` each (0: off): a slow server on demand,
        for fault drills and for tests whose event must land while a generation decodes. Needs the
        servers rljax launches (its worker extension and ``/collective_rpc``)."""
        body = {"method": "rljax_step_delay", "kwargs": {"seconds": float(seconds)}}
        for answer in await self.post_each("/collective_rpc", body):
            if isinstance(answer, BaseException):
                raise answer
            status, text = answer
            if status != 200 or '"error"' in text:
                raise RuntimeError(f"rljax_step_delay failed: HTTP {status} {text[:300]}")

    async def post_each(
        self, path: str, body: Mapping[str, Any] | None = None, *, servers: Sequence[int] | None = None
    ) -> list[tuple[int, str] | BaseException]:
        """POSTs to every server (or the ``servers`` indices) at once and returns, per server,
        ``(status, text)`` of its answer whatever the status (or the exception of a transport
        failure); no retries, nothing raised.

        For admin routes that answer plain text (vLLM's ``/v1/load_lora_adapter``) or whose errors
        the caller tells apart (the weight sync's ``/collective_rpc``).
        """
        self._ensure_loop_state()

        async def one(url: str) -> tuple[int, str]:
            response = await self._http.post(url + path, json=body)
            return response.status_code, response.text

        urls = [s.url for s in self.servers] if servers is None else [self.servers[i].url for i in servers]
        return list(await asyncio.gather(*(one(url) for url in urls), return_exceptions=True))

    # ----------------------------------------------------------------------------------------------
    # weights

    async def update_weights(
        self,
        model: Any,
        *,
        version: int | None = None,
        reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> int:
        """Syncs ``model``'s weights to every server and verifies them (see :mod:`.weight_sync`).

        New requests wait until the sync is done; the new version is returned and recorded on every
        completion dispatched afterwards. When the sync or its verification fails this raises
        :class:`weight_sync.WeightSyncError`, and every later request raises it too until a sync
        succeeds: nothing is sampled from weights that are not the trainer's.
        """
        self._ensure_loop_state()
        directory = self._sync_directory()

        async def sync(new_version: int) -> weight_sync.SyncReport:
            if self.supervisor is not None:  # the servers in service only; records the weights
                return await self.supervisor.sync_model(
                    model,
                    directory=directory,
                    reference_logprobs=reference_logprobs,
                    version=new_version,
                )
            return await weight_sync.sync_weights(
                self,
                model,
                config=self.sync_config,
                directory=directory,
                reference_logprobs=reference_logprobs,
            )

        return await self._synced(sync, version)

    async def update_weights_from(
        self, written: weight_sync.WrittenWeights, *, version: int | None = None
    ) -> int:
        """Like :meth:`update_weights` for weights already written
        (:func:`.weight_sync.write_distributed`, e.g. by every process of a multi-process run):
        reload ``written.directory`` on every server and verify against ``written.expected``; the
        same version and error semantics."""
        self._ensure_loop_state()

        async def sync(new_version: int) -> weight_sync.SyncReport:
            if self.supervisor is not None:  # the servers in service only; records the weights
                return await self.supervisor.sync_written(written, version=new_version)
            reload_s, diffs, verify_s = await weight_sync.reload_and_verify(
                self,
                written.directory,
                config=self.sync_config,
                probe=written.probe,
                expected=written.expected,
                atol=self.sync_config.tolerance(written.dtype),
            )
            return weight_sync.SyncReport(
                directory=written.directory,
                write_s=written.write_s,
                reload_s=reload_s,
                verify_s=verify_s,
                max_abs_diff=diffs,
            )

        return await self._synced(sync, version)

    async def _synced(self, sync: Callable[[int], Any], version: int | None) -> int:
        """Runs one weight sync ``sync(new_version)`` with new requests held back (after the ones
        out were answered, :meth:`_drains_before_sync`); records the version or the error."""
        async with self._sync_lock:
            self._open.clear()
            try:
                if self._drains_before_sync():
                    self._draining = True
                    try:
                        await self._none_dispatched.wait()
                    finally:
                        self._draining = False
                new_version = self.weight_version + 1 if version is None else int(version)
                try:
                    self.last_sync = await sync(new_version)
                except weight_sync.WeightSyncError as e:
                    self._sync_error = e
                    raise
                except Exception as e:
                    self._sync_error = weight_sync.WeightSyncError(
                        f"weight sync failed: {type(e).__name__}: {e}"
                    )
                    raise self._sync_error from e
                self._sync_error = None
                self.weight_version = new_version
            finally:
                self._open.set()
        return self.weight_version

    async def update_adapter(
        self,
        model: Any,
        *,
        version: int | None = None,
        directory: str | None = None,
        base_name: str | None = None,
        reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
        unload_previous: bool = True,
    ) -> int:
        """Syncs ``model``'s LoRA adapter to every server (:func:`.adapter_sync.sync_adapter`) and
        routes later requests to it; returns the new version.

        Requests are NOT held back (the previous adapter keeps serving until the switch). Syncs are
        serialised with :meth:`update_weights`. ``directory`` (default ``sync.directory``, else a
        temporary directory) receives ``v<version>/``; ``base_name`` defaults to ``self.model``.
        When the sync or its verification fails this raises :class:`weight_sync.WeightSyncError`,
        and every later request raises it too until a sync succeeds.
        """
        from rljax.inference.vllm import adapter_sync  # adapter_sync uses this module's client

        self._ensure_loop_state()
        async with self._sync_lock:
            new_version = self.weight_version + 1 if version is None else int(version)
            try:
                await adapter_sync.sync_adapter(
                    self,
                    model,
                    version=new_version,
                    directory=directory or self._sync_directory(),
                    base_name=base_name,
                    config=self.sync_config,
                    reference_logprobs=reference_logprobs,
                    unload_previous=unload_previous,
                )
            except weight_sync.WeightSyncError as e:
                self._sync_error = e
                raise
            except Exception as e:
                self._sync_error = weight_sync.WeightSyncError(
                    f"adapter sync failed: {type(e).__name__}: {e}"
                )
                raise self._sync_error from e
            self._sync_error = None
        return self.weight_version
