"""Console errors of a page in headless Chromium, read over the DevTools protocol.

Chromium is started with ``--remote-debugging-pipe``: it reads NUL-terminated JSON commands on file
descriptor 3 and writes replies and events on descriptor 4, so no port, websocket client or network
is involved. An error is what a person would see in the browser's console: an uncaught exception
(``Runtime.exceptionThrown``), a ``console.error`` / ``console.assert`` call
(``Runtime.consoleAPICalled``), or a browser log entry of level ``error`` (``Log.entryAdded``: a
resource that failed to load, a blocked request, ...).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--remote-debugging-pipe",
)  # fmt: skip


def find_chromium() -> str | None:
    """The Chromium binary on PATH (Debian names it ``chromium``), or None."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    return None


class _Pipe:
    """The two ends of the DevTools pipe and a reader of its messages."""

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd, self.buffer, self.next_id = write_fd, read_fd, b"", 0

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> int:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        return self.next_id

    def receive(self, deadline: float) -> dict[str, Any] | None:
        """The next message, or None when ``deadline`` (a ``time.monotonic()``) passes first."""
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                return None
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, params: dict[str, Any] | None, session: str | None, events: list) -> dict:
        """Sends a command and waits for its reply (events that arrive meanwhile go to ``events``)."""
        wanted = self.send(method, params, session)
        deadline = time.monotonic() + 60
        while True:
            message = self.receive(deadline)
            if message is None:
                raise TimeoutError(f"no reply to {method}")
            if message.get("id") == wanted:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            events.append(message)


def _describe(event: dict[str, Any]) -> str | None:
    """The console error an event reports, or None."""
    method, params = event.get("method"), event.get("params", {})
    if method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        return "exception: " + details.get("exception", {}).get("description", details.get("text", ""))
    if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
        return f"console.{params['type']}: {args}"
    if method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        entry = params["entry"]
        return f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip()
    return None


def _high_fd(fd: int) -> int:
    """A duplicate of ``fd`` numbered 10 or more (so that moving it to 3 or 4 clobbers nothing)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def console_errors(chromium: str, url: str, *, settle_s: float = 1.5, timeout_s: float = 60) -> list[str]:
    """The console errors of ``url`` from loading it until ``settle_s`` after its load event."""
    to_browser_r, to_browser_w = (_high_fd(fd) for fd in os.pipe())
    from_browser_r, from_browser_w = (_high_fd(fd) for fd in os.pipe())
    profile = tempfile.mkdtemp(prefix="rljax_chromium_")
    # the shell puts the pipe ends on descriptors 3 (commands in) and 4 (messages out)
    script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
    proc = subprocess.Popen(
        ["bash", "-c", script, chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(to_browser_r)
    os.close(from_browser_w)
    pipe, events = _Pipe(to_browser_w, from_browser_r), []
    try:
        target = pipe.call("Target.createTarget", {"url": "about:blank"}, None, events)["targetId"]
        session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True}, None, events)
        session_id = session["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            pipe.call(f"{domain}.enable", {}, session_id, events)
        pipe.call("Page.navigate", {"url": url}, session_id, events)
        deadline, loaded = time.monotonic() + timeout_s, False
        while True:
            if not loaded and any(e.get("method") == "Page.loadEventFired" for e in events):
                loaded, deadline = True, time.monotonic() + settle_s
            message = pipe.receive(deadline)
            if message is None:
                if not loaded:
                    raise TimeoutError(f"{url} did not finish loading in {timeout_s} s")
                break
            events.append(message)
        try:
            pipe.send("Browser.close")
        except OSError:
            pass
    finally:
        os.close(to_browser_w)
        os.close(from_browser_r)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    return [d for d in map(_describe, events) if d is not None]
