"""Test doubles for the verifiers adapter: a verifiers environment defined with verifiers' own classes
(taskset, task with a rubric, an in-process harness, local subprocess runtime; no network, no sandbox
service) registered in-process under an id, and a scripted OpenAI-compatible HTTP server (a double of
the protocol only: ``GET /v1/models``, ``POST /v1/chat/completions`` with Bearer keys, JSON or SSE).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import types
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import verifiers.v1 as vf

ENV_ID = "rljax-vf-arith"  # verifiers reads "-" as "_": module rljax_vf_arith
MODULE = "rljax_vf_arith"
FOLLOW_UP = "Reply with the number only."
LOCAL = {"agent": {"runtime": {"type": "subprocess"}}}
REPLIES: dict[tuple[int, int], list[str]] = {}  # (a, b) -> the final replies the harness received


def rubric(reply: str, answer: str) -> float:
    """The task's reward, written out independently: 2 * exact match + 0.5 / (1 + reply length)."""
    reply = reply.strip()
    return 2.0 * float(reply == answer) + 0.5 / (1.0 + len(reply))


class ArithData(vf.TaskData):
    a: int
    b: int
    answer: str
    mode: str = "ok"  # ok | stream | harness_raises | reward_raises | setup_raises | env_raises | no_call


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    """Two-turn arithmetic: the rubric is the exact match of the final reply with ``answer``."""

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        if self.data.mode == "setup_raises":
            raise KeyError("the task setup failed on purpose")

    @vf.reward(weight=2.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        if task.mode == "reward_raises":
            raise ZeroDivisionError("the rubric failed on purpose")
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithTasksetConfig(vf.TasksetConfig):
    rows: list[list[Any]] = [[2, 3, "5"], [4, 4, "8"], [1, 1, "3"]]
    system_text: str = "You add numbers."


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        for row in self.config.rows:
            a, b, answer, *mode = row
            data = ArithData(
                prompt=f"What is {a}+{b}?",
                system_prompt=self.config.system_text,
                a=a,
                b=b,
                answer=answer,
                mode=mode[0] if mode else "ok",
            )
            yield ArithTask(data, self.config.task)


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """An in-process two-turn chat loop (verifiers allows a harness to run its loop in-process as
    long as every model call goes through the interception endpoint with the rollout's secret)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        if data.mode == "harness_raises":
            raise RuntimeError("the harness failed on purpose")
        if data.mode == "no_call":
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            system, prompt = self.resolve_prompt(data)
            messages: list[dict] = [
                {"role": "system", "content": system},
                {"role": "user", "content": prompt},
            ]
            if data.mode == "stream":
                stream = await client.chat.completions.create(model=ctx.model, messages=messages, stream=True)
                first = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            else:
                first = (
                    (await client.chat.completions.create(model=ctx.model, messages=messages))
                    .choices[0]
                    .message.content
                )
            messages += [
                {"role": "assistant", "content": first},
                {"role": "user", "content": FOLLOW_UP},
            ]
            second = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8)
            REPLIES.setdefault((data.a, data.b), []).append(second.choices[0].message.content or "")
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class CheckedEnv(vf.SingleAgentEnv):
    """The single-agent env with a cross-trace check (``finalize``) that raises for ``env_raises``
    tasks: an env-level hook failing (paired with the taskset by ``env_args={"id": CHECKED_ID}``)."""

    async def finalize(self, task: vf.Task, episode: vf.Episode) -> None:
        if task.data.mode == "env_raises":
            raise RuntimeError("the env's finalize failed on purpose")


CHECKED_ID = "rljax-vf-checked"


def register_env() -> None:
    """Makes ``ENV_ID`` loadable by id: verifiers imports the module named by the id (``-`` -> ``_``)
    and takes the Taskset (and the Harness, the taskset's default) from its ``__all__``."""
    if MODULE in sys.modules:
        return
    module = types.ModuleType(MODULE)
    module.ArithTaskset = ArithTaskset
    module.ChatHarness = ChatHarness
    module.__all__ = ["ArithTaskset", "ChatHarness"]
    sys.modules[MODULE] = module
    checked = types.ModuleType("rljax_vf_checked")
    checked.CheckedEnv = CheckedEnv
    checked.__all__ = ["CheckedEnv"]
    sys.modules["rljax_vf_checked"] = checked


def scripted_reply(messages: list[dict]) -> str:
    """The script: "Let me add a and b." to the question, the sum to the follow-up."""
    question = next(m["content"] for m in messages if m["role"] == "user")
    a, b = map(int, re.findall(r"\d+", question)[:2])
    return str(a + b) if messages[-1]["content"] == FOLLOW_UP else f"Let me add {a} and {b}."


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # socketserver's default listen backlog (5) refuses concurrent clients


class ScriptedServer:
    """A scripted OpenAI-compatible server on 127.0.0.1 (a protocol double): valid keys are those
    in ``keys``; every accepted chat request is appended to ``requests`` as ``(key, body)``."""

    model = "scripted-model"

    def __init__(self, reply: Callable[[list[dict]], str] = scripted_reply) -> None:
        self.reply = reply
        self.keys: set[str] = set()
        self.requests: list[tuple[str, dict]] = []
        self.rejected = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _key(self) -> str | None:
                auth = self.headers.get("Authorization", "")
                key = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
                return key if key in server.keys else None

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/v1/models"):
                    self._send(
                        200,
                        {
                            "object": "list",
                            "data": [{"id": server.model, "object": "model", "created": 0, "owned_by": "t"}],
                        },
                    )
                else:
                    self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                key = self._key()
                if key is None:
                    server.rejected += 1
                    self._send(
                        401,
                        {
                            "error": {
                                "message": "unknown key",
                                "type": "invalid_request_error",
                                "code": "invalid_api_key",
                            }
                        },
                    )
                    return
                server.requests.append((key, body))
                text = server.reply(body["messages"])
                cid, now = f"chatcmpl-{len(server.requests)}", int(time.time())
                usage = {"prompt_tokens": 10, "completion_tokens": len(text), "total_tokens": 10 + len(text)}
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    chunks = [{"role": "assistant", "content": ""}] + [
                        {"content": c} for c in (text[:1], text[1:]) if c
                    ]
                    for i, delta in enumerate(chunks + [{}]):
                        event = {
                            "id": cid,
                            "object": "chat.completion.chunk",
                            "created": now,
                            "model": server.model,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": delta,
                                    "finish_reason": None if i < len(chunks) else "stop",
                                }
                            ],
                        }
                        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    tail = {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": now,
                        "model": server.model,
                        "choices": [],
                        "usage": usage,
                    }
                    self.wfile.write(f"data: {json.dumps(tail)}\n\ndata: [DONE]\n\n".encode())
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self._send(
                    200,
                    {
                        "id": cid,
                        "object": "chat.completion",
                        "created": now,
                        "model": server.model,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": usage,
                    },
                )

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def client(self, key: str) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` for one rollout: ``key`` becomes valid."""
        self.keys.add(key)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class InstantEngine:
    """An engine double that answers at once, by the script (:func:`scripted_reply` of the decoded
    prompt), each answer closed with the renderer's end-of-turn id; logprobs -0.1."""

    weight_version = 0

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self.end = renderer.stop_token_ids()[0]

    async def generate(self, prompt_ids: Any, sampling: Any, *, session_id: str | None = None) -> Any:
        from rljax.inference.engine import Completion

        text = self.renderer.decode(list(prompt_ids))
        a, b = map(int, re.findall(r"What is (\d+)\+(\d+)\?", text)[0])
        reply = str(a + b) if FOLLOW_UP in text else f"Let me add {a} and {b}."
        ids = (*self.renderer.tokenizer.encode(reply, add_special_tokens=False), self.end)
        ids = ids[: sampling.max_tokens]
        return Completion(ids, (-0.1,) * len(ids), "stop" if ids[-1] == self.end else "length", 0)

    async def update_weights(self, model: Any, *, version: int | None = None) -> int:
        return 0
