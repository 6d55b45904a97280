"""What one HTTP request may cost a front door (the gateway, the Tinker API) before it is refused.

Both servers hand every request to an ASGI app that checks, in this order and before reading a byte
of the body:

1. the header block: at most ``max_header_bytes`` (431); a ``Content-Length`` that is not one
   non-negative integer is 400, one over ``max_body_bytes`` is 413 at once;
2. the credentials (each server's own check: 401), so a client without a key never gets its body
   read;
3. admission: at most ``max_requests_per_key`` requests in flight per key (429) and ``max_requests``
   in all (503), both answered with ``Retry-After: retry_after_s``;
4. the body, read in the chunks the server delivers and counted as they come: a chunked body is cut
   at ``max_body_bytes`` (413), all bodies being read or handled at once hold at most
   ``max_body_bytes_in_flight`` (503 with ``Retry-After``), and a body that does not arrive within
   ``body_timeout_s`` is 408.

A refused body is never buffered: the answer is sent while the client is still sending, and uvicorn
(h11 and httptools alike) reads and drops the rest of that body and keeps the connection (closing it
unread would reset it, and the client could lose the answer). So a 300 MB upload costs the server
the few chunks it reads before the limit, whatever the size.

Header blocks are bounded twice: uvicorn's h11 parser is given ``max_header_bytes`` as the most it
buffers of a head still arriving (a client that trickles an endless header block is cut off with a
400; :func:`uvicorn_options`), and the app refuses a parsed block over the limit with 431 (what a
parser that holds any size, such as httptools, hands it).

>>> limits = HttpLimits(max_body_bytes=10)
>>> check_head([(b"content-length", b"11")], limits)
Traceback (most recent call last):
...
rljax.gateway.limits.Refusal: 413: the request body is 11 bytes; this server takes at most 10 bytes
>>> check_head([(b"content-length", b"3")], limits)
3
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

__all__ = [
    "Admission",
    "HttpLimits",
    "Refusal",
    "check_head",
    "is_json_content_type",
    "read_body",
    "send_reply",
    "uvicorn_options",
]

MiB = 1 << 20

#: The reason of each status a front door refuses with (the ``code`` of the error bodies).
CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
    431: "request_header_fields_too_large",
    503: "overloaded",
}

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """The limits of one front door (see the module docstring for what each one answers).

    Args:
      max_body_bytes: the largest request body (after decompression where a server accepts
        compressed bodies).
      max_header_bytes: the largest header block (names, values and their separators).
      max_requests_per_key: requests of one API key in flight at once (429 beyond).
      max_requests: requests in flight at once in all (503 beyond).
      max_connections: open connections (uvicorn's ``limit_concurrency``: its own 503 beyond).
      max_body_bytes_in_flight: bytes of all request bodies being read or handled at once (503 beyond).
      body_timeout_s: how long a body may take to arrive (408 beyond).
      retry_after_s: the ``Retry-After`` of a 429 / 503.
    """

    max_body_bytes: int = 8 * MiB
    max_header_bytes: int = 32 * 1024
    max_requests_per_key: int = 64
    max_requests: int = 4096
    max_connections: int = 8192
    max_body_bytes_in_flight: int = 512 * MiB
    body_timeout_s: float = 60.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"HttpLimits.{field.name} must be a positive number, got {value!r}")
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"HttpLimits.max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}): one largest request must fit"
            )


class Refusal(Exception):
    """A request refused by a front door: the HTTP ``status``, a message for the client, and the
    ``Retry-After`` seconds of a 429 / 503 (None otherwise)."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after

    @property
    def code(self) -> str:
        """The short reason (``request_too_large``, ``too_many_requests``, ...)."""
        return CODES.get(self.status, "bad_request")

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The extra response headers (``Retry-After`` when set)."""
        return [] if self.retry_after is None else [(b"retry-after", str(self.retry_after).encode())]


def _size(n: int) -> str:
    return f"{n} bytes" if n < MiB else f"{n / MiB:.1f} MiB"


def check_head(headers: list[tuple[bytes, bytes]], limits: HttpLimits) -> int | None:
    """Checks a request's header block (ASGI ``scope["headers"]``: lower-case names) against
    ``limits`` before any of its body is read; returns the declared ``Content-Length`` (None when
    there is none: a chunked body or none). Raises :class:`Refusal` 431 / 400 / 413."""
    size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
    if size > limits.max_header_bytes:
        raise Refusal(
            431, f"the request headers are {size} bytes; at most {limits.max_header_bytes} are read"
        )
    declared = {v.strip() for k, v in headers if k == b"content-length"}
    if not declared:
        return None
    value = declared.pop()
    if declared or not value.isdigit():
        raise Refusal(400, "the Content-Length header must be one non-negative integer")
    length = int(value)
    if length > limits.max_body_bytes:
        raise Refusal(
            413,
            f"the request body is {_size(length)}; this server takes at most {_size(limits.max_body_bytes)}",
        )
    return length


def is_json_content_type(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the body is declared JSON (``application/json`` or ``*/*+json``, any parameters) or
    not declared at all (read as JSON, as FastAPI does)."""
    for k, v in headers:
        if k == b"content-type":
            media = v.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return True


class Admission:
    """Counts the requests in flight (in all and per key) and the body bytes they hold, on one event
    loop (no locks: every count changes between two awaits)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.per_key: dict[str, int] = {}
        self.requests = 0
        self.body_bytes = 0

    def _retry(self, status: int, message: str) -> Refusal:
        return Refusal(status, message, retry_after=self.limits.retry_after_s)

    @contextlib.contextmanager
    def admit(self, key: str) -> Iterator[_Ticket]:
        """Holds one request of ``key`` for the ``with`` block (raises :class:`Refusal` 503 / 429 when
        full); the ticket reserves the body bytes it reads, released at the end."""
        lim = self.limits
        held = self.per_key.get(key, 0)
        if held >= lim.max_requests_per_key:
            raise self._retry(
                429,
                f"this key has {held} requests in flight; at most {lim.max_requests_per_key} are served "
                "at once",
            )
        if self.requests >= lim.max_requests:
            raise self._retry(503, f"the server has {self.requests} requests in flight; retry shortly")
        self.requests += 1
        self.per_key[key] = held + 1
        ticket = _Ticket(self)
        try:
            yield ticket
        finally:
            self.requests -= 1
            self.body_bytes -= ticket.reserved
            left = self.per_key[key] - 1
            if left:
                self.per_key[key] = left
            else:
                del self.per_key[key]


class _Ticket:
    """One admitted request's share of the body-bytes budget."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.reserved = 0

    def reserve(self, n: int) -> None:
        """Takes ``n`` more bytes of the budget (Refusal 503 when they do not fit)."""
        adm = self.admission
        if adm.body_bytes + n > adm.limits.max_body_bytes_in_flight:
            raise adm._retry(503, "the server holds too many request bodies at once; retry shortly")
        adm.body_bytes += n
        self.reserved += n


async def read_body(
    receive: Receive, limits: HttpLimits, ticket: _Ticket, declared: int | None = None
) -> bytes | None:
    """The request body, counted while it arrives (None when the client disconnected first).

    A ``declared`` length (already checked by :func:`check_head`) is reserved up front; a chunked
    body reserves chunk by chunk and is refused (413) as soon as it passes ``max_body_bytes``; a
    body that takes over ``body_timeout_s`` is refused with 408."""
    if declared is not None:
        ticket.reserve(declared)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise Refusal(413, f"the request body is over {_size(limits.max_body_bytes)}, the most "
                                       "this server takes")  # fmt: skip
                if declared is None:
                    ticket.reserve(len(chunk))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise Refusal(408, f"the request body did not arrive within {limits.body_timeout_s:g} s") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_reply(
    send: Send, status: int, body: bytes, content_type: str, extra: list[tuple[bytes, bytes]] = ()
) -> None:
    """Writes one whole response (a start and one body message)."""
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """``uvicorn.Config`` arguments that bound what uvicorn itself holds for ``limits``: the header
    block its h11 parser buffers (``h11_max_incomplete_event_size``) and the open connections
    (``limit_concurrency``)."""
    return {
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "limit_concurrency": limits.max_connections,
    }
