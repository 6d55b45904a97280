"""The OpenAI-compatible gateway: an ASGI app in front of rljax's engine that records every call.

A :class:`Gateway` serves, on ``http://127.0.0.1:<port>/v1`` by default (loopback only)::

    POST /v1/chat/completions   OpenAI chat completions (stream or not); every call is a Step
    POST /v1/messages           Anthropic Messages (stream or not), served as a chat completion
                                (:mod:`rljax.gateway.anthropic_api`); /v1/messages/count_tokens
    GET  /v1/models             the served model name
    GET  /health                200 {"status": "ok"} to any probe (no key; nothing else revealed)
    POST /v1/rewards            {"reward": r} (the rollout's final reward) or
                                {"reward": r, "completion_id": "chatcmpl-..."} (that call's reward)
                                (also at /rl/set_reward, AReaL's name)

Every request must carry a rollout's secret key (``Authorization: Bearer <key>``, or
``x-api-key``), or use the rollout's own base URL ``/rollouts/<key>/v1`` (:meth:`Gateway.rollout_base_url`):
:meth:`Gateway.open_session` makes one key per rollout; an unknown or ended key gets 401 and
nothing is recorded. Before a byte of a body is read the key is checked (401), then the limits of
:class:`~rljax.gateway.limits.HttpLimits` (``limits``): the header block (431), the body's size
(413, ``Content-Length`` at once, a chunked body as it streams), the requests in flight per key (429)
and in all (503, both with ``Retry-After``), a JSON content type (415). Every refusal and malformed
request is a 4xx with OpenAI's error body (Anthropic's on ``/v1/messages``). For each call the gateway

1. validates the request (:mod:`rljax.gateway.protocol`; 400 with OpenAI's error body otherwise);
2. builds the prompt with the session's :class:`~rljax.recording.StepRecorder`: when the messages
   extend an earlier call of the same rollout (its messages, then the assistant message it was
   answered with, then new ones) the prompt is that call's prompt ids + completion ids + the
   renderer's bridge for the new messages, token for token; otherwise a full render with the run's
   renderer (a new sample after merging);
3. rejects a prompt of ``>= max_context_len`` tokens (400 ``context_length_exceeded``: nothing is
   recorded and the rollout goes on, so a harness can summarize and retry), and caps the completion
   at ``min(max_tokens asked, rollout.max_tokens, max_context_len - len(prompt))``;
4. samples ``engine.generate(prompt ids)`` and records the completion (exact ids, logprobs, weight
   version, routed experts, finish reason) as the call's Step; the answer is the assistant message
   parsed FROM THOSE IDS (``RecordedCall.returned`` is set to exactly what the client got; a tool
   call that does not parse comes back as text, as vLLM does, so the client sees the attempt).

Where it runs: ON THE EVENT LOOP OF THE ROLLOUTS (:meth:`Gateway.start` is awaited on it; uvicorn's
``Server.serve`` as a task). The engines' ``generate`` is a coroutine of that loop (the embedded
sampler batches requests on it; the vLLM client's HTTP pool lives on it) and agent functions run on
it too, so a call costs no thread hop and no cross-loop future; uvicorn in its own thread would add
two hops per call and GIL contention with the rollout thread for nothing. An agent that blocks the
loop (synchronous code inside ``async def``) would stall it: synchronous agent functions are run in
threads (:mod:`rljax.agents.runners`).

What a call costs (``benchmarks/gateway_bench.py``): the app is a plain ASGI callable (a dict of
routes, the body read whole, one start and one body message; no web framework), the prompt of a
call that extends an earlier one is the bridge (only the new messages are rendered and tokenized),
and uvicorn parses HTTP with ``httptools`` when it is installed (``pip install httptools``: about
0.3 ms less per call than its pure-Python ``h11``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import uvicorn

from rljax.chat.base import Renderer
from rljax.chat.tool_calls import split_reasoning
from rljax.envs.base import Task
from rljax.gateway.anthropic_api import (
    anthropic_error_body,
    message_body,
    sse_event,
    stream_events,
    to_chat_body,
)
from rljax.gateway.limits import (
    Admission,
    HttpLimits,
    Refusal,
    check_head,
    is_json_content_type,
    read_body,
    send_reply,
    uvicorn_options,
)
from rljax.gateway.protocol import (
    Answer,
    ChatRequest,
    GatewayError,
    completion_body,
    error_body,
    finish_reason_of,
    parse_chat_request,
    sse,
    stream_chunks,
    wire_message,
)
from rljax.gateway.sessions import Session, SessionRegistry
from rljax.inference.engine import Completion, Engine, SamplingParams, reports_sampling_support
from rljax.recording import StepRecorder
from rljax.rollout import RolloutConfig, request_seed

__all__ = ["Gateway"]

DEFAULT_MODEL_NAME = "rljax-policy"
_log = logging.getLogger(__name__)


class _QuietServer(uvicorn.Server):
    """uvicorn's server without its signal handlers (the run owns SIGINT / SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclasses.dataclass(frozen=True)
class _Request:
    """What a handler gets: the request's headers (names lower-cased), the key of a per-rollout
    base URL (``/rollouts/<key>/...``) or None, and the raw body."""

    headers: dict[str, str]
    path_key: str | None
    body: bytes


@dataclasses.dataclass(frozen=True)
class _Reply:
    """A response: status, body bytes, content type, extra headers."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _json_reply(obj: Any, status: int = 200) -> _Reply:
    return _Reply(status, _json_bytes(obj))


def _unauthorized(message: str = "invalid or ended API key: every rollout has its own key") -> _Reply:
    return _json_reply(error_body(message, code="invalid_api_key"), 401)


#: OpenAI's error ``type`` of each refusal status (the rest are "invalid_request_error").
_OPENAI_TYPES = {429: "rate_limit_error", 503: "server_error"}
_HEALTH = _json_bytes({"status": "ok"})


def _refusal_reply(e: Refusal, anthropic: bool) -> _Reply:
    """A refusal as OpenAI's error body (Anthropic's on its routes), with its extra headers."""
    if anthropic:
        body = anthropic_error_body(e.status, e.message)
    else:
        body = error_body(e.message, type=_OPENAI_TYPES.get(e.status, "invalid_request_error"), code=e.code)
    return _Reply(e.status, _json_bytes(body), headers=tuple(e.headers()))


class _InProcess(httpx.AsyncBaseTransport):
    """The transport of :meth:`Gateway.client` (async): a request made on the gateway's event loop
    to the gateway's own address is handed to its ASGI app directly, not written to a socket and
    parsed back (the same app, routing and credentials: only TCP and the two HTTP/1.1 codecs are
    skipped, ~3 ms of CPU per openai-SDK call). Anything else (another loop, another address, the
    gateway stopped) goes over HTTP (``fallback``).

    As over HTTP, a caller that is cancelled (``env_timeout_s``) leaves its call running to the
    end (it is then answered 401, unrecorded, when the rollout ended); the request's read timeout
    bounds the wait (``httpx.ReadTimeout``, the SDK's ``APITimeoutError``)."""

    def __init__(self, gateway: Gateway, fallback: httpx.AsyncBaseTransport) -> None:
        self.gateway = gateway
        self.fallback = fallback

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        gw, url = self.gateway, request.url
        loop = asyncio.get_running_loop()
        if not gw.started or loop is not gw._loop or (url.host, url.port) != (gw.host, gw.port):
            return await self.fallback.handle_async_request(request)
        body = await request.aread()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": url.scheme, "path": url.path, "raw_path": url.raw_path.split(b"?")[0],
            "query_string": url.query, "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "server": (gw.host, gw.port), "client": ("127.0.0.1", 0), "root_path": "",
        }  # fmt: skip
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        started: dict[str, Any] = {}
        parts: list[bytes] = []
        done = loop.create_future()

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            await done  # the app reads past the body only to wait for a disconnect
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        task = loop.create_task(gw.app(scope, receive, send))
        task.add_done_callback(lambda t: done.done() or done.set_result(None))
        timeout = (request.extensions.get("timeout") or {}).get("read")
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise httpx.ReadTimeout("the gateway did not answer in time", request=request) from None
        if not started:
            raise httpx.RemoteProtocolError("the gateway sent no response", request=request)
        return httpx.Response(started["status"], headers=started.get("headers", []), content=b"".join(parts))

    async def aclose(self) -> None:
        await self.fallback.aclose()


class Gateway:
    """An OpenAI-compatible server that records each rollout's calls (see the module docstring).

    Args:
      renderer: the run's chat renderer (prompts, bridges, parsing the sampled ids).
      host: the address it binds (default loopback only; "0.0.0.0" exposes it).
      port: the port (0: a free one, see :attr:`port` after :meth:`start`).
      model_name: what ``GET /v1/models`` lists (requests may name any model).
      limits: what one request may cost (:class:`~rljax.gateway.limits.HttpLimits`: 8 MiB bodies,
        64 requests in flight per key by default).
    """

    def __init__(
        self,
        renderer: Renderer,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = DEFAULT_MODEL_NAME,
        limits: HttpLimits | None = None,
    ) -> None:
        self.renderer = renderer
        self.limits = HttpLimits() if limits is None else limits
        self._admission = Admission(self.limits)
        self.host = host
        self.port = int(port)
        self.model_name = model_name
        self.sessions = SessionRegistry()
        self.stop_ids = tuple(int(i) for i in renderer.stop_token_ids())
        self._server: _QuietServer | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._single_token: dict[str, int | None] = {}
        self._ssl: Any = None  # one ssl.SSLContext for every client (see client())
        # path (after an optional /rollouts/<key> prefix) -> (method, handler)
        self._routes: dict[str, tuple[str, Callable[[_Request], Awaitable[_Reply]]]] = {
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/models": ("GET", self._models),
            "/v1/rewards": ("POST", self._reward),
            "/rl/set_reward": ("POST", self._reward),
            "/v1/messages": ("POST", self._messages),
            "/v1/messages/count_tokens": ("POST", self._count_tokens),
        }
        self.app = self._asgi  # what uvicorn serves

    # -- lifecycle --------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether the server is up and serving."""
        return self._server is not None and self._server.started and not self._task.done()

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://host:port/v1``)."""
        if not self.started:
            raise RuntimeError("the gateway is not started: await gateway.start() on the rollouts' loop")
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        """Starts serving on the running event loop (a no-op when already serving on it)."""
        import openai  # noqa: F401 - imported now, not by the first rollout's client (seconds)

        loop = asyncio.get_running_loop()
        if self.started:
            if loop is not self._loop:
                raise RuntimeError("the gateway serves on another event loop; stop() it there first")
            return
        if self._task is not None and not self._task.done() and loop is self._loop:
            await self._until_started()  # another first use on this loop is starting it
            return
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it (Linux): without it, a response written as headers + body
        # waited on the client's delayed ACK (Nagle), ~40 ms per call on loopback
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, interface="asgi3", lifespan="off", log_level="warning", access_log=False, backlog=4096,
            timeout_keep_alive=60, **uvicorn_options(self.limits),
        )  # fmt: skip
        self._server = _QuietServer(config)
        self._loop = loop
        self._task = loop.create_task(self._server.serve(sockets=[sock]), name="rljax-gateway")
        await self._until_started()

    async def _until_started(self) -> None:
        assert self._server is not None and self._task is not None
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise RuntimeError("the gateway stopped while starting")
            await asyncio.sleep(0.002)

    def client(
        self, session: Session, *, timeout: float | None = None, sync: bool = False, in_process: bool = True
    ) -> Any:
        """An ``openai.AsyncOpenAI`` (``sync``: ``openai.OpenAI``) bound to ``session``'s rollout:
        ``base_url`` = :attr:`base_url`, ``api_key`` = its key, no retries (a retried call would be a
        second recorded step). Each has its own small connection pool (one shared pool with hundreds
        of connections makes httpcore's per-request scan quadratic) over one shared SSL context
        (building one per client costs ~0.1 s of certificate loading). Close it when done.

        ``in_process`` (async clients): its calls made on the gateway's loop go to the app without
        a socket (:class:`_InProcess`; the same answers and records, ~3 ms less CPU per call on
        the loop that also runs the engine and the other agents). ``base_url`` / ``api_key`` stay
        the real ones, so whatever a harness builds from them talks HTTP."""
        import ssl

        import openai

        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        kwargs: dict[str, Any] = dict(base_url=self.base_url, api_key=session.key, max_retries=0,
                                      timeout=timeout or 3600.0)  # fmt: skip
        if sync:
            return openai.OpenAI(http_client=httpx.Client(verify=self._ssl, timeout=None), **kwargs)
        if in_process:
            transport = _InProcess(self, httpx.AsyncHTTPTransport(verify=self._ssl))
            return openai.AsyncOpenAI(
                http_client=httpx.AsyncClient(transport=transport, timeout=None), **kwargs
            )
        return openai.AsyncOpenAI(http_client=httpx.AsyncClient(verify=self._ssl, timeout=None), **kwargs)

    async def stop(self) -> None:
        """Stops serving (open sessions are ended first: their keys get 401 if it restarts)."""
        for session in list(self.sessions._sessions.values()):
            self.sessions.close(session)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        self._server = self._task = None

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # -- sessions ---------------------------------------------------------------------------------------
    def open_session(
        self,
        recorder: StepRecorder,
        engine: Engine,
        config: RolloutConfig,
        *,
        task: Task | None = None,
        repetition: int = 0,
    ) -> Session:
        """A new rollout: its calls (with ``session.key`` as API key) are recorded on ``recorder``,
        sampled from ``engine`` within ``config``'s budgets and default sampling."""
        return self.sessions.open(recorder, engine, config, task=task, repetition=repetition)

    def close_session(self, session: Session) -> None:
        """Ends a rollout: its key gets 401 from now on; calls in flight are answered 401, unrecorded."""
        self.sessions.close(session)

    # -- the call -----------------------------------------------------------------------------------------
    def _stop_id(self, text: str) -> int:
        if text not in self._single_token:
            ids = self.renderer.tokenizer.encode(text, add_special_tokens=False)
            self._single_token[text] = int(ids[0]) if len(ids) == 1 else None
        tid = self._single_token[text]
        if tid is None:
            raise GatewayError(
                400,
                f"stop string {text!r} is not one token; the engine stops on token ids, so only "
                "single-token stop strings are supported",
                param="stop",
            )
        return tid

    def _sampling(self, session: Session, req: ChatRequest, prompt_len: int) -> SamplingParams:
        cfg = session.config
        budget = min(req.max_tokens or cfg.max_tokens, cfg.max_tokens, cfg.max_context_len - prompt_len)
        seed = req.seed
        if seed is None and cfg.seed is not None and session.task is not None:
            seed = request_seed(cfg.seed, session.task.id, session.repetition, session.calls_started)
        try:
            sampling = SamplingParams(
                temperature=cfg.temperature if req.temperature is None else req.temperature,
                top_p=cfg.top_p if req.top_p is None else req.top_p,
                top_k=cfg.top_k if req.top_k is None else req.top_k,
                max_tokens=budget,
                stop_token_ids=(*self.stop_ids, *(self._stop_id(s) for s in req.stop)),
                seed=None if seed is None else int(seed) % 2**31,
            )
        except ValueError as e:
            raise GatewayError(400, str(e)) from None
        truncated = sampling.top_p < 1.0 or sampling.top_k is not None
        if truncated and not reports_sampling_support(session.engine):
            param = "top_p" if sampling.top_p < 1.0 else "top_k"
            raise GatewayError(
                400,
                f"{param} samples from a truncated distribution, and this engine does not report which "
                "tokens it kept, so the call could not be trained on exactly: leave top_p and top_k unset "
                "(the rollout's sampling applies), or train with the embedded sampler",
                param=param,
            )
        return sampling

    async def complete(
        self,
        session: Session,
        req: ChatRequest,
        *,
        id_prefix: str = "chatcmpl-",
        tool_id_prefix: str = "call_",
    ) -> Answer:
        """Runs one validated call of ``session``: prompt, engine, record; the answer to send (its
        id and its tool calls' ids start with ``id_prefix`` / ``tool_id_prefix``)."""
        rec = session.recorder
        cfg = session.config
        try:
            prompt = rec.prompt_for(req.messages, tools=req.tools)
        except (ValueError, TypeError, KeyError) as e:
            raise GatewayError(400, f"the messages cannot be rendered: {e}", param="messages") from None
        n = len(prompt.ids)
        if n >= cfg.max_context_len:
            raise GatewayError(
                400,
                f"the prompt is {n} tokens; the context budget (rollout.max_context_len) is "
                f"{cfg.max_context_len} tokens, prompt and completion together",
                param="messages",
                code="context_length_exceeded",
            )
        sampling = self._sampling(session, req, n)
        session.calls_started += 1
        try:
            completion = await session.engine.generate(
                list(prompt.ids), sampling, session_id=str(rec.trajectory_id)
            )
            if not isinstance(completion, Completion):
                raise TypeError(f"engine.generate returned {type(completion).__name__}, not a Completion")
            if completion.finish_reason == "abort" or not completion.ids:
                raise RuntimeError(
                    f"the engine returned finish_reason={completion.finish_reason!r} with "
                    f"{len(completion.ids)} ids"
                )
        except Exception as e:
            if session.open and session.error is None:
                session.error = ("engine", f"{type(e).__name__}: {e}")
            raise GatewayError(
                500, f"the engine failed: {e}", type="server_error", code="engine_error"
            ) from e
        if not session.open:
            raise GatewayError(401, "the rollout ended while this call was in flight; it was not recorded",
                               code="invalid_api_key")  # fmt: skip
        temperature = sampling.temperature
        call = rec.record(prompt, completion, temperature=temperature)
        reply = self._answer_of(call)
        call_ids = [f"{tool_id_prefix}{secrets.token_hex(8)}" for _ in reply.get("tool_calls") or ()]
        message = wire_message(reply, call_ids)
        call.returned = message
        rid = f"{id_prefix}{secrets.token_hex(12)}"
        session.call_ids[rid] = call.index
        texts = None
        if req.logprobs:
            texts = [self.renderer.tokenizer.decode([t]) for t in completion.ids]
        return Answer(
            id=rid,
            created=int(time.time()),
            model=req.model or self.model_name,
            message=message,
            finish_reason=finish_reason_of(completion.finish_reason, message),
            prompt_ids=prompt.ids,
            completion_ids=completion.ids,
            logprobs=completion.logprobs,
            token_texts=texts,
            weight_version=completion.weight_version,
        )

    def _answer_of(self, call: Any) -> dict[str, Any]:
        """The assistant message to answer with: the reply parsed from the sampled ids; when a
        tool call in it does not parse, vLLM's fallback: the turn's text (reasoning split off) as
        content and no tool calls, so the client sees what the model wrote (and the call extends
        from exactly that: ``RecordedCall.returned``)."""
        parsed = call.parsed
        if not parsed.errors:
            return call.reply
        ids = list(call.completion.ids)
        text = self.renderer.decode(ids[:-1] if parsed.stopped else ids)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
            message["content"] = split_reasoning(text)[1]
        return message

    # -- HTTP -------------------------------------------------------------------------------------------
    def rollout_base_url(self, session: Session) -> str:
        """``session``'s own base URL (``.../rollouts/<key>/v1``): for harnesses that can set a base
        URL but not an API key (any API key is then accepted)."""
        return f"http://{self.host}:{self.port}/rollouts/{session.key}/v1"

    async def _asgi(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        send: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        """The ASGI app: a dict lookup of the path, the key and the limits checked, the body read
        (bounded), one handler call, the response written as one start and one body message (no
        framework: routing, request and response objects and middleware layers cost more than the
        handlers on the call path)."""
        if scope["type"] != "http":  # lifespan is off; no websockets
            return
        path = scope["path"]
        key = None
        if path.startswith("/rollouts/"):  # a per-rollout base URL: /rollouts/<key>/v1/...
            key, _, rest = path[len("/rollouts/") :].partition("/")
            path = "/" + rest
        path = path.rstrip("/") or "/"
        try:
            reply = await self._serve(scope, receive, path, key)
        except Refusal as e:
            reply = _refusal_reply(e, anthropic=path.startswith("/v1/messages"))
        if reply is not None:  # None: the client left before its body arrived
            await send_reply(send, reply.status, reply.body, reply.content_type, list(reply.headers))

    async def _serve(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict[str, Any]]],
        path: str,
        key: str | None,
    ) -> _Reply | None:
        """One request through the front door (see the module docstring for the order of the checks);
        raises :class:`Refusal` for what the limits refuse."""
        method = scope["method"]
        if path == "/health" and key is None:  # a probe: no key, nothing revealed
            if method not in ("GET", "HEAD"):
                raise Refusal(405, f"/health takes GET, not {method}")
            return _Reply(200, _HEALTH)
        route = self._routes.get(path)
        if route is None:
            raise Refusal(404, f"no such endpoint: {scope['path']}")
        if method != route[0]:
            raise Refusal(405, f"{scope['path']} takes {route[0]}, not {method}")
        raw = scope["headers"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        request = _Request(headers, key, b"")
        client_key = key if key is not None else self._key_of(headers)
        if self.sessions.get(client_key) is None:  # before any of the body is read
            if path.startswith("/v1/messages"):
                message = "invalid or ended API key: every rollout has its own key"
                return _json_reply(anthropic_error_body(401, message), 401)
            return _unauthorized()
        declared = check_head(raw, self.limits)
        if route[0] == "POST":
            if not is_json_content_type(raw):
                ctype = headers["content-type"]
                raise Refusal(415, f"the body must be JSON (Content-Type: application/json), not {ctype!r}")
            if headers.get("content-encoding", "identity").strip().lower() != "identity":
                raise Refusal(
                    415,
                    f"Content-Encoding {headers['content-encoding']!r} is not accepted; send the body as is",
                )
        with self._admission.admit(client_key) as ticket:
            if route[0] == "POST":
                body = await read_body(receive, self.limits, ticket, declared)
                if body is None:
                    return None
                request = _Request(headers, key, body)
            try:
                return await route[1](request)
            except Exception as e:  # a bug: the client gets a 500 with OpenAI's error body
                _log.exception("gateway: %s %s failed", method, scope["path"])
                return _json_reply(
                    error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), 500
                )

    @staticmethod
    def _key_of(headers: dict[str, str]) -> str | None:
        """The API key a request carries (``Authorization: Bearer <key>`` or ``x-api-key``)."""
        auth = headers.get("authorization", "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key")

    def _session_of(self, request: _Request) -> Session | None:
        if request.path_key is not None:
            return self.sessions.get(request.path_key)
        return self.sessions.get(self._key_of(request.headers))

    @staticmethod
    def _json(request: _Request) -> Any:
        try:
            return json.loads(request.body)
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
            raise GatewayError(400, f"the request body is not valid JSON: {e}") from None

    async def _chat(self, request: _Request) -> _Reply:
        session = self._session_of(request)
        if session is None:
            return _unauthorized()
        try:
            req = parse_chat_request(self._json(request))
            answer = await self.complete(session, req)
        except GatewayError as e:
            return _json_reply(e.body(), e.status)
        if req.stream:  # the whole answer is known: every event in one write
            events = b"".join(sse(chunk) for chunk in stream_chunks(answer, req)) + b"data: [DONE]\n\n"
            return _Reply(200, events, "text/event-stream; charset=utf-8")
        return _json_reply(completion_body(answer, req))

    # -- Anthropic Messages ---------------------------------------------------------------------------
    async def _messages(self, request: _Request) -> _Reply:
        """``POST /v1/messages``: converted to a chat request, served and recorded like one
        (:mod:`rljax.gateway.anthropic_api`); errors as Anthropic's error body."""
        session = self._session_of(request)
        if session is None:
            return _json_reply(
                anthropic_error_body(401, "invalid or ended API key: every rollout has its own key"), 401
            )
        try:
            req = parse_chat_request(to_chat_body(self._json(request)))
            answer = await self.complete(session, req, id_prefix="msg_", tool_id_prefix="toolu_")
        except GatewayError as e:
            return _json_reply(anthropic_error_body(e.status, e.message), e.status)
        stop_sequence = None
        if req.stop and answer.finish_reason != "length":
            last = int(answer.completion_ids[-1])
            stop_sequence = next((s for s in req.stop if self._single_token.get(s) == last), None)
        if req.stream:
            events = b"".join(sse_event(name, data) for name, data in stream_events(answer, stop_sequence))
            return _Reply(200, events, "text/event-stream; charset=utf-8")
        return _json_reply(message_body(answer, stop_sequence))

    async def _count_tokens(self, request: _Request) -> _Reply:
        """``POST /v1/messages/count_tokens``: the prompt's length as this rollout's next call
        would build it (bridged or rendered; nothing is recorded)."""
        session = self._session_of(request)
        if session is None:
            return _json_reply(
                anthropic_error_body(401, "invalid or ended API key: every rollout has its own key"), 401
            )
        try:
            body = self._json(request)
            if isinstance(body, dict):
                body = {**body, "max_tokens": None, "stream": None}
            req = parse_chat_request(to_chat_body(body))
            prompt = session.recorder.prompt_for(req.messages, tools=req.tools)
        except GatewayError as e:
            return _json_reply(anthropic_error_body(e.status, e.message), e.status)
        except (ValueError, TypeError, KeyError) as e:
            return _json_reply(anthropic_error_body(400, f"the messages cannot be rendered: {e}"), 400)
        return _json_reply({"input_tokens": len(prompt.ids)})

    async def _models(self, request: _Request) -> _Reply:
        if self._session_of(request) is None:
            return _unauthorized()
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rljax"}
        return _json_reply({"object": "list", "data": [model]})

    async def _reward(self, request: _Request) -> _Reply:
        session = self._session_of(request)
        if session is None:
            return _unauthorized()
        try:
            body = self._json(request)
            if not isinstance(body, dict):
                raise GatewayError(400, "the body must be {'reward': number, 'completion_id'?: str}")
            reward = body.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward \
                    or abs(reward) == float("inf"):  # fmt: skip
                raise GatewayError(400, f"'reward' must be a finite number, got {reward!r}", param="reward")
            cid = body.get("completion_id")
            if cid is None:
                session.reward = float(reward)
            elif cid in session.call_ids:
                session.recorder.calls[session.call_ids[cid]].reward = float(reward)
            else:
                raise GatewayError(404, f"this rollout has no completion {cid!r}", param="completion_id",
                                   code="not_found")  # fmt: skip
        except GatewayError as e:
            return _json_reply(e.body(), e.status)
        return _json_reply({"ok": True})
