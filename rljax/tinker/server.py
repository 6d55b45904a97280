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
are answered by a plain ASGI handler in front of FastAPI (:class:`_HotRoutes`): FastAPI's middleware
and routing stack costs ~150 us of the GIL per request, and a step's four requests arrive while its
forward / backward runs.

Errors: a bad request answers HTTP 400/404 with ``{"detail": ...}`` when it is refused at once
(unknown model, rank over the maximum, malformed body); a request that fails in the queue resolves
its future as ``{"error": ..., "category": "user"}``; the SDK raises both with the message. One
client's bad request never touches another's state.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from rljax.tinker.service import TinkerService, UserError
from rljax.tinker.wire import decode_forward_backward

__all__ = ["make_app"]

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
    except ValueError:
        raise HTTPException(400, "malformed request body: expected a JSON object") from None
    if not isinstance(data, dict):
        raise HTTPException(400, "malformed request body: expected a JSON object")
    return data


def _need(data: dict[str, Any], *names: str) -> list[Any]:
    missing = [n for n in names if data.get(n) is None]
    if missing:
        raise HTTPException(400, f"malformed request: missing fields {missing}")
    return [data[n] for n in names]


_KEY_ERROR = "invalid or missing API key (X-API-Key)"

#: A hot route: (request body, request headers) -> (status, content type, response body).
_Handler = Callable[[bytes, dict[bytes, bytes]], Awaitable[tuple[int, str, bytes]]]


class _HotRoutes:
    """ASGI: POSTs to the paths of ``routes`` go straight to their handlers (the API key checked
    when ``keys`` are set; ``HTTPException`` and ``UserError`` answered as FastAPI would, with
    ``{"detail": ...}``); everything else goes to ``app``."""

    def __init__(self, app: FastAPI, routes: dict[str, _Handler], keys: set[str]) -> None:
        self.app = app
        self.routes = routes
        self.keys = {k.encode() for k in keys}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys and headers.get(b"x-api-key") not in self.keys:
            status, ctype, out = 401, "application/json", _json({"detail": _KEY_ERROR})
        elif scope["method"] != "POST":
            status, ctype, out = 405, "application/json", _json({"detail": "Method Not Allowed"})
        else:
            chunks = []
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            try:
                status, ctype, out = await handler(b"".join(chunks), headers)
            except HTTPException as e:
                status, ctype, out = e.status_code, "application/json", _json({"detail": e.detail})
            except UserError as e:
                status, ctype, out = 400, "application/json", _json({"detail": str(e)})
            except Exception:  # noqa: BLE001 - as Starlette's ServerErrorMiddleware: logged, a bare 500
                log.exception("%s failed", scope["path"])
                status, ctype, out = 500, "text/plain; charset=utf-8", b"Internal Server Error"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": out})


def make_app(service: TinkerService) -> _HotRoutes:
    """The ASGI app serving ``service``: FastAPI, behind :class:`_HotRoutes` for a step's routes."""
    app = FastAPI(title="rljax Tinker-compatible API")
    keys = set(service.options.api_keys)

    if keys:  # an HTTP middleware costs every request a task hop; none when any key is accepted

        @app.middleware("http")
        async def check_key(request: Request, call_next: Any) -> Any:
            if request.headers.get("x-api-key") not in keys:
                return JSONResponse({"detail": _KEY_ERROR}, status_code=401)
            return await call_next(request)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    async def body(request: Request) -> dict[str, Any]:
        return _json_object(await request.body())

    def future(rid: str, **extra: Any) -> dict[str, Any]:
        return {"request_id": rid, **extra}

    @app.api_route("/api/v1/healthz", methods=["GET", "POST"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

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
        (sid,) = _need(await body(request), "session_id")
        try:
            service.heartbeat(sid)
        except UserError as e:
            raise HTTPException(410, str(e)) from None
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> Response:
        service.finish_session(session_id)
        return Response(status_code=200, content=b"null", media_type="application/json")

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        data = await body(request)
        sid, base = _need(data, "session_id", "base_model")
        rid = service.create_model(
            sid, base, data.get("lora_config"), data.get("optimizer_config"), data.get("model_seq_id")
        )
        return future(rid)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        (mid,) = _need(await body(request), "model_id")
        return service.get_info(mid)

    async def forward_backward(raw: bytes, headers: dict[bytes, bytes]) -> tuple[int, str, bytes]:
        if headers.get(b"content-encoding") == b"zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        try:
            req = decode_forward_backward(raw)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        rid = service.submit_forward_backward(req)
        return 200, "application/json", _json(future(rid, model_id=req.model_id))

    async def optim_step(raw: bytes, headers: dict[bytes, bytes]) -> tuple[int, str, bytes]:
        data = _json_object(raw)
        (mid,) = _need(data, "model_id")
        adam = data.get("adam_params") or data.get("optim_params") or data.get("optimizer_params")
        if not isinstance(adam, dict):
            raise HTTPException(400, "optim_step needs adam_params")
        if adam.get("type", "adam") not in ("adam", "adamw"):
            raise HTTPException(400, f"optimizer {adam.get('type')!r} is not supported (adam only)")
        return 200, "application/json", _json(future(service.optim_step(mid, adam), model_id=mid))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        data = await body(request)
        (mid,) = _need(data, "model_id")
        return future(service.save_state(mid, data.get("path")), model_id=mid)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        data = await body(request)
        (mid,) = _need(data, "model_id")
        rid = service.save_state(
            mid,
            data.get("path"),
            for_sampler=True,
            sampling_session_seq_id=data.get("sampling_session_seq_id"),
        )
        return future(rid, model_id=mid)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        data = await body(request)
        (path,) = _need(data, "path")
        rid = service.load_state(
            path,
            optimizer=bool(data.get("optimizer")),
            model_id=data.get("model_id"),
            session_id=data.get("session_id"),
            model_seq_id=data.get("model_seq_id"),
        )
        return future(rid)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str) -> dict[str, Any]:
        return service.list_checkpoints(model_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        data = await body(request)
        (sid,) = _need(data, "session_id")
        ssid = await asyncio.to_thread(
            service.create_sampling_session, sid, data.get("model_path"), data.get("base_model")
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
        rid, ids = service.submit_sample(await body(request))
        return future(rid, sample_sequence_ids=ids)

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

    hot = {"forward_backward": forward_backward, "optim_step": optim_step, "retrieve_future": retrieve_future}
    return _HotRoutes(app, {f"/api/v1/{name}": fn for name, fn in hot.items()}, keys)
