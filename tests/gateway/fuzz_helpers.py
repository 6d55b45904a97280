"""Malformed requests for the front-door fuzz tests (hypothesis strategies), a tally of the answers,
the memory of a process, and a gateway served in a process of its own."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from typing import Any

import httpx
from hypothesis import strategies as st

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
CHAT_FIELDS = ("model", "messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "max_tokens",
               "max_completion_tokens", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "n",
               "seed", "return_token_ids")  # fmt: skip
MESSAGES_FIELDS = ("model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                   "temperature", "top_p", "top_k", "stream", "metadata", "thinking")  # fmt: skip
PATHS = (
    "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/rewards", "/rl/set_reward",
    "/v1/models", "/health", "/v1/completions", "/", "/rollouts/x/v1/chat/completions",
    "/v1/chat/completions/x",
)  # fmt: skip

CONTENT_TYPES = ("application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", "application/problem+json", None)  # fmt: skip
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["user", "assistant", "system", "developer", "tool", "bot", ""]) | json_values
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles},
        optional={
            "content": json_values | st.text(max_size=40),
            "tool_calls": json_values,
            "tool_call_id": json_values,
            "name": json_values,
        },  # fmt: skip
    )
    | json_values,
    max_size=4,
)


@st.composite
def mutated(draw: Any, base: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """``base`` with a few of ``fields`` set to arbitrary JSON (or to malformed messages) or dropped."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        choice = draw(st.integers(0, 2))
        if choice == 0:
            body.pop(name, None)
        elif choice == 1 and name == "messages":
            body[name] = draw(messages)
        else:
            body[name] = draw(json_values)
    return body


def _encode(draw: Any, body: Any) -> bytes:
    raw = json.dumps(body, allow_nan=True).encode()
    how = draw(st.integers(0, 5))
    if how == 0:  # truncated
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    if how == 1:  # arbitrary bytes
        return draw(st.binary(max_size=64))
    return raw


@st.composite
def gateway_requests(draw: Any) -> tuple[str, str, dict[str, str], bytes, str]:
    """(method, path, headers, body, which key: "valid" / "wrong" / "none") of a gateway request."""
    path = draw(st.sampled_from(PATHS))
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]))
    if "messages" in path:
        body = draw(mutated(MESSAGES, MESSAGES_FIELDS) | json_values)
    elif "reward" in path:
        body = draw(st.fixed_dictionaries({}, optional={"reward": json_values, "completion_id": json_values}))
    else:
        body = draw(mutated(CHAT, CHAT_FIELDS) | json_values)
    headers = {}
    ctype = draw(st.sampled_from(CONTENT_TYPES))
    if ctype is not None:
        headers["content-type"] = ctype
    if draw(st.integers(0, 9)) == 0:
        headers["content-encoding"] = draw(st.sampled_from(["gzip", "identity", "zstd"]))
    return (
        method,
        path,
        headers,
        _encode(draw, body),
        draw(st.sampled_from(["valid"] * 4 + ["wrong", "none"])),
    )


class Tally:
    """Counts the statuses a fuzz run got (and each 4xx's error code)."""

    def __init__(self) -> None:
        self.statuses: collections.Counter = collections.Counter()
        self.codes: collections.Counter = collections.Counter()

    def add(self, response: httpx.Response) -> None:
        self.statuses[response.status_code] += 1
        if response.status_code >= 400:
            try:
                err = response.json()
            except ValueError:
                err = {}
            detail = err.get("error") if isinstance(err.get("error"), dict) else err
            self.codes[(response.status_code, detail.get("code") or detail.get("type") or "detail")] += 1

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)


def rss_mb(pid: int | None = None) -> tuple[float, float]:
    """(current, peak) resident memory of a process in MB (``VmRSS`` / ``VmHWM``)."""
    out = {}
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out["VmRSS"], out["VmHWM"]


SERVER = r"""
import asyncio, json, sys
sys.path.insert(0, {helpers!r})
from gateway_helpers import CHATML, Scripted, open_session
from rljax.gateway import Gateway

async def main():
    gw = Gateway(CHATML)
    await gw.start()
    engine = Scripted(lambda prompt: "ok")
    keys = [open_session(gw, engine, tid=("t", i)).key for i in range({sessions})]
    print(json.dumps({{"port": gw.port, "keys": keys}}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await gw.stop()

asyncio.run(main())
"""


class GatewayProcess:
    """A gateway (ChatML, an instant scripted engine answering "ok") in a child process, so its
    memory is measured alone: ``base``, ``keys``, ``pid``; it stops when :meth:`close` closes its stdin."""

    def __init__(self, sessions: int = 4) -> None:
        code = SERVER.format(helpers=os.path.dirname(__file__), sessions=sessions)
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=pipe, stdout=pipe, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.base = f"http://127.0.0.1:{info['port']}"
        self.keys = info["keys"]
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
