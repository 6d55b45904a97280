"""The HTTP app of the Tinker-compatible API (FastAPI), under ``/api/v1/``, for the ``tinker`` SDK.

Point the SDK at it with ``tinker.ServiceClient(base_url="http://127.0.0.1:PORT", api_key=KEY)``
(or ``TINKER_BASE_URL`` / ``TINKER_API_KEY``); the key is sent as ``X-API-Key`` and checked only
when the server has keys configured (the SDK insists on some key: any string works otherwise).

Routes (JSON unless said): ``client/config`` (the SDK's feature flags: plain API keys, no JWT, httpx
transport, uncompressed protobuf forward_backward), ``client/dynamic_config``, ``healthz``,
``get_server_capabilities``, ``create_session``, ``session_heartbeat``, ``sessions/{id}/finish``,
``create_model``, ``get_info``, ``forward_backward`` (protobuf), ``optim_step``, ``save_weights``,
``load_weights``, ``save_weights_for_sampler``, ``training_runs/{model_id}/checkpoints``,
``create_sampling_session``, ``samplers/{id}``, ``asample``, ``retrieve_future`` and ``telemetry``.

The three routes of every training step (``forward_backward``, ``optim_step``, ``retrieve_future``)
are answered by a plain ASGI handler in front of FastAPI (:class:`_FrontDoor`): FastAPI's middleware
and routing stack costs ~150 us of the GIL per request, and a step's four requests arrive while its
forward / backward runs.

Every request passes a front door (:class:`_FrontDoor`, in front of both) that checks, before a
byte of its body is read: the API key (401), the limits of :class:`~rljax.gateway.limits.HttpLimits`
(431 headers, 413 body size by ``Content-Length`` or while a chunked body streams, 429 / 503 with
``Retry-After`` for requests in flight per key / in all); it then reads the body (bounded; a
``Content-Encoding: zstd`` body is decompressed up to the same limit) and hands it on. ``healthz``
answers any probe without a key and says nothing but ``{"status": "ok"}``.

Errors: a bad request answers HTTP 4xx with ``{"detail": ...}`` when it is refused at once
(unknown model, rank over the maximum, malformed body, a field of the wrong type, an unknown route
or method); a request that fails in the queue resolves its future as
``{"error": ..., "category": "user"}``; the SDK raises both with the message. One client's bad
request never touches another's state.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from rljax.gateway.limits import (
    Admission,
    HttpLimits,
    Refusal,
    check_head,
    is_json_content_type,
    read_body,
    send_reply,
)
from rljax.tinker.service import TinkerService, UserError
from rljax.tinker.trainable import ADAM_DEFAULTS
from rljax.tinker.wire import decode_forward_backward

__all__ = ["DEFAULT_LIMITS", "make_app"]

MiB = 1 << 20
#: The Tinker API's limits: bodies up to 128 MiB (the SDK splits a forward_backward into requests of
#: about 5 MB; one long datum may be larger), and as many requests in flight per key as the SDK's
#: sampling client sends at once (2,000) plus their result polls.
DEFAULT_LIMITS = HttpLimits(
    max_body_bytes=128 * MiB,
    max_requests_per_key=4096,
    max_requests=8192,
    max_body_bytes_in_flight=1024 * MiB,
)
#: The most samples one ``asample`` request may ask for.
MAX_NUM_SAMPLES = 1024

log = logging.getLogger(__name__)
_PROTO = "application/x-protobuf"

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def _json(obj: Any) -> bytes:
    """``obj`` as JSON, encoded as Starlette's ``JSONResponse`` does."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise HTTPException(400, "malformed request body: expected a JSON object") from None
    if not isinstance(data, dict):
        raise HTTPException(400, "malformed request body: expected a JSON object")
    return data


_KINDS = {str: "a string", int: "an integer", dict: "an object", list: "a list", float: "a number"}


def _is(value: Any, kind: type) -> bool:
    """``isinstance`` as JSON means it: a bool is not a number, an int is a float."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def _need(data: dict[str, Any], *names: str, kind: type = str) -> list[Any]:
    """The fields ``names`` of a request, each required and of type ``kind`` (400 otherwise)."""
    missing = [n for n in names if data.get(n) is None]
    if missing:
        raise HTTPException(400, f"malformed request: missing fields {missing}")
    for n in names:
        _opt(data, n, kind)
    return [data[n] for n in names]


def _opt(data: Any, name: str, kind: type) -> Any:
    """The optional field ``name`` of an object (None when absent), of type ``kind`` (400 otherwise)."""
    value = data.get(name)
    if value is not None and not _is(value, kind):
        raise HTTPException(400, f"malformed request: {name!r} must be {_KINDS.get(kind, kind.__name__)}")
    return value


def _check_numbers(obj: dict[str, Any], names: Any, where: str) -> None:
    """400 unless each of ``names`` present in ``obj`` is a number."""
    for n in names:
        if obj.get(n) is not None and not _is(obj[n], float):
            raise HTTPException(400, f"malformed request: {where}.{n} must be a number")


def _check_sample(data: dict[str, Any]) -> None:
    """The fields of an ``asample`` request, typed as the service reads them (400 otherwise)."""
    for name in ("sampling_session_id", "base_model", "model_path"):
        _opt(data, name, str)
    prompt = _opt(data, "prompt", dict) or {}
    chunks = _opt(prompt, "chunks", list) or []
    for chunk in chunks:
        if not isinstance(chunk, dict) or not _is(chunk.get("type", ""), str):
            raise HTTPException(400, "malformed request: prompt.chunks must be objects with a string type")
        tokens = _opt(chunk, "tokens", list) or []
        if not all(_is(t, int) for t in tokens):
            raise HTTPException(400, "malformed request: prompt chunk tokens must be integers")
    n = _opt(data, "num_samples", int)
    if n is not None and not 1 <= n <= MAX_NUM_SAMPLES:
        raise HTTPException(400, f"malformed request: num_samples must be in [1, {MAX_NUM_SAMPLES}], got {n}")
    params = _opt(data, "sampling_params", dict) or {}
    _check_numbers(params, ("temperature", "top_p"), "sampling_params")
    for name in ("top_k", "seed", "max_tokens"):
        _opt(params, name, int)
    stop = params.get("stop")
    stops = stop if isinstance(stop, list) else [] if stop is None else [stop]
    if not all(_is(s, str) or _is(s, int) for s in stops):
        raise HTTPException(400, "malformed request: sampling_params.stop must be strings or token ids")


_KEY_ERROR = "invalid or missing API key (X-API-Key)"

#: A hot route: (request body, request headers) -> (status, content type, response body).
_Handler = Callable[[bytes, dict[bytes, bytes]], Awaitable[tuple[int, str, bytes]]]


_HEALTHZ = "/api/v1/healthz"


def _detail(
    status: int, message: str, headers: list[tuple[bytes, bytes]] = ()
) -> tuple[int, str, bytes, list]:
    return status, "application/json", _json({"detail": message}), list(headers)


def _inflate_zstd(raw: bytes, limit: int) -> bytes:
    """A ``Content-Encoding: zstd`` body, decompressed up to ``limit`` bytes (413 beyond: a small
    body may expand to any size)."""
    import zstandard

    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            while chunk := reader.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise Refusal(413, f"the decompressed request body is over {limit} bytes, the most this "
                                       "server takes")  # fmt: skip
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise Refusal(400, f"the body is not valid zstd (Content-Encoding: zstd): {e}") from None
    return b"".join(out)


class _FrontDoor:
    """ASGI, in front of everything: the probe route, the key, the limits and the bounded body read
    (see the module docstring); then POSTs to the paths of ``routes`` go straight to their handlers
    (``HTTPException`` and ``UserError`` answered as FastAPI would, with ``{"detail": ...}``) and
    everything else to ``app`` with the body already read."""

    def __init__(self, app: FastAPI, routes: dict[str, _Handler], keys: set[str], limits: HttpLimits) -> None:
        self.app = app
        self.routes = routes
        self.keys = {k.encode() for k in keys}
        self.limits = limits
        self.admission = Admission(limits)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            answer = await self._serve(scope, receive, send)
        except Refusal as e:
            answer = _detail(e.status, e.message, e.headers())
        if answer is not None:
            status, ctype, out, extra = answer
            await send_reply(send, status, out, ctype, extra)

    async def _serve(self, scope: dict[str, Any], receive: Any, send: Any) -> tuple | None:
        """One request: the answer to send, or None when it was sent (FastAPI) or the client left."""
        path, method, raw = scope["path"], scope["method"], scope["headers"]
        if path == _HEALTHZ:  # a probe: no key, nothing revealed
            if method not in ("GET", "HEAD", "POST"):
                return _detail(405, "Method Not Allowed")
            return 200, "application/json", _json({"status": "ok"}), []
        headers = dict(raw)
        key = headers.get(b"x-api-key", b"")
        if self.keys and key not in self.keys:  # before any of the body is read
            return _detail(401, _KEY_ERROR)
        handler = self.routes.get(path)
        if handler is not None and method != "POST":
            return _detail(405, "Method Not Allowed")
        declared = check_head(raw, self.limits)
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"identity", b"zstd"):
            raise Refusal(
                415, f"Content-Encoding {encoding.decode('latin-1')!r} is not accepted (zstd or none)"
            )
        if method == "POST" and path != "/api/v1/forward_backward" and not is_json_content_type(raw):
            raise Refusal(415, "the body must be JSON (Content-Type: application/json)")
        with self.admission.admit(key.decode("latin-1")) as ticket:
            body = await read_body(receive, self.limits, ticket, declared)
            if body is None:
                return None
            if encoding == b"zstd":
                body = _inflate_zstd(body, self.limits.max_body_bytes)
                ticket.reserve(len(body))
            if handler is None:
                await self.app(_replayed(scope, len(body)), _replay(body, receive), send)
                return None
            try:
                status, ctype, out = await handler(body, headers)
            except HTTPException as e:
                return _detail(e.status_code, e.detail)
            except UserError as e:
                return _detail(400, str(e))
            except Exception:  # noqa: BLE001 - as Starlette's ServerErrorMiddleware: logged, a bare 500
                log.exception("%s failed", path)
                return 500, "text/plain; charset=utf-8", b"Internal Server Error", []
            return status, ctype, out, []


def _replayed(scope: dict[str, Any], size: int) -> dict[str, Any]:
    """``scope`` for a body already read (and decompressed): its length, no encoding."""
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-encoding")]
    return {**scope, "headers": [*headers, (b"content-length", str(size).encode())]}


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that hands over ``body`` first, then waits on the connection's own."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replay


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object (a ``UserError`` when it is not one)."""
    return _json_object(await request.body())


def _future(rid: str, **extra: Any) -> dict[str, Any]:
    """A Tinker future: the request id to retrieve, with ``extra`` fields."""
    return {"request_id": rid, **extra}


def make_app(service: TinkerService, *, limits: HttpLimits | None = None) -> _FrontDoor:
    """The ASGI app serving ``service``: FastAPI, behind :class:`_FrontDoor` (the key, the ``limits``,
    default :data:`DEFAULT_LIMITS`, and a step's routes)."""
    app = FastAPI(title="rljax Tinker-compatible API")

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    _add_session_routes(app, service)
    _add_model_routes(app, service)
    _add_sampling_routes(app, service)
    routes = {f"/api/v1/{name}": fn for name, fn in _step_routes(service).items()}
    keys = set(service.options.api_keys)
    return _FrontDoor(app, routes, keys, DEFAULT_LIMITS if limits is None else limits)


def _add_session_routes(app: FastAPI, service: TinkerService) -> None:
    """The client's configuration, telemetry, the server's capabilities and sessions."""

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.api_route("/api/v1/get_server_capabilities", methods=["GET", "POST"])
    async def capabilities() -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": service.options.base_model,
                    "max_context_length": service.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    @app.post("/api/v1/create_session")
    async def create_session() -> dict[str, Any]:
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        (sid,) = _need(await _body(request), "session_id")
        try:
            service.heartbeat(sid)
        except UserError as e:
            raise HTTPException(410, str(e)) from None
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> Response:
        service.finish_session(session_id)
        return Response(status_code=200, content=b"null", media_type="application/json")


def _add_model_routes(app: FastAPI, service: TinkerService) -> None:
    """Training clients: creating one, its info, saving and loading weights, listing checkpoints."""

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        data = await _body(request)
        sid, base = _need(data, "session_id", "base_model")
        lora, optimizer = _opt(data, "lora_config", dict), _opt(data, "optimizer_config", dict)
        for name in ("rank", "seed"):
            _opt(lora or {}, name, int)
        _opt(optimizer or {}, "type", str)
        rid = service.create_model(sid, base, lora, optimizer, _opt(data, "model_seq_id", int))
        return _future(rid)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        (mid,) = _need(await _body(request), "model_id")
        return service.get_info(mid)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        data = await _body(request)
        (mid,) = _need(data, "model_id")
        return _future(service.save_state(mid, _opt(data, "path", str)), model_id=mid)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        data = await _body(request)
        (mid,) = _need(data, "model_id")
        rid = service.save_state(
            mid,
            _opt(data, "path", str),
            for_sampler=True,
            sampling_session_seq_id=_opt(data, "sampling_session_seq_id", int),
        )
        return _future(rid, model_id=mid)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        data = await _body(request)
        (path,) = _need(data, "path")
        rid = service.load_state(
            path,
            optimizer=bool(data.get("optimizer")),
            model_id=_opt(data, "model_id", str),
            session_id=_opt(data, "session_id", str),
            model_seq_id=_opt(data, "model_seq_id", int),
        )
        return _future(rid)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str) -> dict[str, Any]:
        if model_id in (".", ".."):
            raise HTTPException(400, f"invalid model id {model_id!r}")
        return service.list_checkpoints(model_id)


def _add_sampling_routes(app: FastAPI, service: TinkerService) -> None:
    """Sampling clients: creating one, its info, submitting a sample."""

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        data = await _body(request)
        (sid,) = _need(data, "session_id")
        ssid = await asyncio.to_thread(
            service.create_sampling_session, sid, _opt(data, "model_path", str), _opt(data, "base_model", str)
        )
        return {"type": "create_sampling_session", "sampling_session_id": ssid}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str) -> dict[str, Any]:
        info = service.sampler_info(sampler_id)
        if info is None:
            raise HTTPException(404, f"unknown sampler {sampler_id!r}")
        return info

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        data = await _body(request)
        _check_sample(data)
        rid, ids = service.submit_sample(data)
        return _future(rid, sample_sequence_ids=ids)


def _step_routes(service: TinkerService) -> dict[str, _Handler]:
    """The routes of a training step (forward-backward, the optimizer step, retrieving futures), by
    name: :class:`_FrontDoor` serves them on the raw body, without FastAPI's per-request work."""

    async def forward_backward(raw: bytes, headers: dict[bytes, bytes]) -> tuple[int, str, bytes]:
        try:
            req = decode_forward_backward(raw)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        rid = service.submit_forward_backward(req)
        return 200, "application/json", _json(_future(rid, model_id=req.model_id))

    async def optim_step(raw: bytes, headers: dict[bytes, bytes]) -> tuple[int, str, bytes]:
        data = _json_object(raw)
        (mid,) = _need(data, "model_id")
        adam = data.get("adam_params") or data.get("optim_params") or data.get("optimizer_params")
        if not isinstance(adam, dict):
            raise HTTPException(400, "optim_step needs adam_params")
        _check_numbers(adam, ADAM_DEFAULTS, "adam_params")
        if adam.get("type", "adam") not in ("adam", "adamw"):
            raise HTTPException(400, f"optimizer {adam.get('type')!r} is not supported (adam only)")
        return 200, "application/json", _json(_future(service.optim_step(mid, adam), model_id=mid))

    async def retrieve_future(raw: bytes, headers: dict[bytes, bytes]) -> tuple[int, str, bytes]:
        (rid,) = _need(_json_object(raw), "request_id")
        kind, result = await service.retrieve_async(rid)
        if kind == "pending":
            return (
                200,
                "application/json",
                _json({"type": "try_again", "request_id": rid, "queue_state": "active"}),
            )
        if kind == "proto":
            return 200, _PROTO, result
        return 200, "application/json", _json(result)

    return {
        "forward_backward": forward_backward,
        "optim_step": optim_step,
        "retrieve_future": retrieve_future,
    }
