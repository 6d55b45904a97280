"""The gateway with real clients: exact records, bridging, streaming, LiteLLM, credentials, bad input."""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import jax
import numpy as np
import openai
import pytest
from gateway_helpers import (
    CHATML,
    IM_END,
    LOOKUP,
    TOOL_CALL,
    Scripted,
    ids_of,
    open_session,
    tool_then_answer,
)
from tolerances import LOGPROB_TOL

from rljax.gateway import Gateway
from rljax.inference.sampler import EmbeddedSampler
from rljax.inference.scoring import score_sequences
from rljax.models.tiny import tiny_model
from rljax.rollout import RolloutConfig

QUESTION = [
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "What color is the zob?"},
]


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)


def test_openai_sdk_tool_calls_are_recorded_exactly(loop, gateway):
    engine = Scripted(tool_then_answer)
    s = open_session(gateway, engine)

    async def body():
        c = client(gateway, s.key)
        r1 = await c.chat.completions.create(
            model="any",
            messages=QUESTION,
            tools=[LOOKUP],
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        m1 = r1.choices[0].message
        history = [*QUESTION, m1.model_dump(exclude_none=True)]
        history.append({"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "red"})
        r2 = await c.chat.completions.create(model="any", messages=history, tools=[LOOKUP])
        models = await c.models.list()
        await c.close()
        return r1, r2, history, models

    r1, r2, history, models = loop.run(body)
    assert [m.id for m in models.data] == ["rljax-policy"]
    c0, c1 = s.recorder.calls
    # what the client got: exactly the call written in the scripted ids (independent reference)
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    got = [(t.function.name, json.loads(t.function.arguments)) for t in m1.tool_calls]
    assert got == [("lookup", {"key": "zob"})]
    assert list(c0.completion.ids) == [*ids_of(TOOL_CALL), IM_END]
    assert c0.returned["tool_calls"][0]["function"]["arguments"] == m1.tool_calls[0].function.arguments
    # prompt ids: the renderer's render of the messages sent; extras and logprobs as recorded
    assert list(c0.prompt.ids) == CHATML.render_ids(QUESTION, add_generation_prompt=True, tools=[LOOKUP])
    assert r1.model_extra["prompt_token_ids"] == list(c0.prompt.ids)
    assert r1.choices[0].model_extra["token_ids"] == list(c0.completion.ids)
    assert [t.logprob for t in r1.choices[0].logprobs.content] == [-0.25] * len(c0.completion.ids)
    assert r1.usage.prompt_tokens == len(c0.prompt.ids)
    assert r1.usage.completion_tokens == len(c0.completion.ids)
    # the second call extends the first: previous prompt + completion + the bridge, token for token
    assert c1.prompt.parent == 0
    n = len(c0.prompt.ids) + len(c0.completion.ids)
    assert list(c1.prompt.ids[:n]) == [*c0.prompt.ids, *c0.completion.ids]
    norm = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in history]
    call = {"function": {"name": "lookup", "arguments": {"key": "zob"}}}
    norm[2] = {"role": "assistant", "content": "", "tool_calls": [call]}
    assert list(c1.prompt.ids) == CHATML.render_ids(norm, add_generation_prompt=True, tools=[LOOKUP])
    assert r2.choices[0].message.content == "It is red." and r2.choices[0].finish_reason == "stop"
    assert [s.prompt_ids for s in s.recorder.steps()] == [list(c0.prompt.ids), list(c1.prompt.ids)]
    gateway.close_session(s)


def test_streaming_gives_the_same_record_and_message(loop, gateway):
    engine = Scripted(lambda p: "<think>\nlong enough reasoning to span chunks\n</think>\n\n" + TOOL_CALL)
    plain, streamed = open_session(gateway, engine), open_session(gateway, engine)

    async def body():
        c = client(gateway, plain.key)
        r = await c.chat.completions.create(model="m", messages=QUESTION, tools=[LOOKUP])
        c2 = client(gateway, streamed.key)
        stream = await c2.chat.completions.create(
            model="m", messages=QUESTION, tools=[LOOKUP], stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
        await c.close(), await c2.close()
        return r, chunks

    r, chunks = loop.run(body)
    content, calls, finish, usage = "", {}, None, None
    for ch in chunks:
        usage = ch.usage or usage
        for choice in ch.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                slot["arguments"] += tc.function.arguments or ""
    m = r.choices[0].message
    assert content == m.content and finish == r.choices[0].finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in m.tool_calls
    ]
    assert len(chunks) > 4  # reasoning, tool-call name and argument deltas came in pieces
    assert usage.completion_tokens == r.usage.completion_tokens
    a, b = plain.recorder.steps()[0], streamed.recorder.steps()[0]
    assert (a.prompt_ids, a.response_ids) == (b.prompt_ids, b.response_ids)
    assert a.response_logprobs == b.response_logprobs

    def without_ids(m: dict) -> dict:  # tool-call ids are fresh per call
        return {**m, "tool_calls": [{**tc, "id": None} for tc in m["tool_calls"]]}

    assert without_ids(plain.recorder.calls[0].returned) == without_ids(streamed.recorder.calls[0].returned)


def test_a_malformed_tool_call_comes_back_as_text_and_still_extends(loop, gateway):
    bad = "Let me look.\n<tool_call>\n{oops}\n</tool_call>"
    engine = Scripted(lambda p: "fine" if "again" in p else bad)
    s = open_session(gateway, engine)

    async def body():
        c = client(gateway, s.key)
        r = await c.chat.completions.create(model="m", messages=QUESTION, tools=[LOOKUP])
        msgs = [
            *QUESTION,
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "again"},
        ]
        await c.chat.completions.create(model="m", messages=msgs, tools=[LOOKUP])
        await c.close()
        return r

    r = loop.run(body)
    m = r.choices[0].message
    assert m.content == bad and not m.tool_calls and r.choices[0].finish_reason == "stop"
    c0, c1 = s.recorder.calls
    assert c0.parsed.errors and c0.returned == {"role": "assistant", "content": bad}
    assert c1.prompt.parent == 0  # the text the client got extends the call
    gateway.close_session(s)


def _stopping_model(vocab: int):
    """Random tiny decoder that ends turns often (only <|im_end|> reads a large embedding coordinate)."""
    model = tiny_model(vocab_size=vocab, num_layers=1)
    model.embed_tokens[...] = model.embed_tokens[...].at[:, 0].set(5.0)
    kernel = (model.lm_head.kernel[...] * 40.0).at[0, :].set(0.0).at[0, IM_END].set(0.65)
    model.lm_head.kernel[...] = kernel
    return model


def test_logprobs_equal_a_rescore_by_the_policy(loop, gateway):
    vocab = len(CHATML.tokenizer)
    model = _stopping_model(vocab)
    engine = EmbeddedSampler(model, min_prompt_bucket=64, min_new_tokens_bucket=16, min_batch_bucket=1)
    config = RolloutConfig(group_size=1, max_tokens=24, max_context_len=256, temperature=0.8)
    s = open_session(gateway, engine, config=config)

    async def body():
        c = client(gateway, s.key)
        r = await c.chat.completions.create(model="m", messages=QUESTION, logprobs=True, seed=3)
        await c.close()
        return r

    r = loop.run(body)
    call = s.recorder.calls[0]
    prompt, ids = list(call.prompt.ids), list(call.completion.ids)
    ref = score_sequences(model, [prompt + ids], temperature=0.8)[0][len(prompt) :]
    got = np.asarray(call.completion.logprobs)
    np.testing.assert_allclose(got, np.asarray(ref, np.float64), **LOGPROB_TOL)
    assert [t.logprob for t in r.choices[0].logprobs.content] == list(call.completion.logprobs)
    assert r.choices[0].message.content == CHATML.parse_response(ids).content
    assert s.recorder.steps()[0].temperature == 0.8
    jax.clear_caches()


def test_litellm_call_is_recorded(loop, gateway):
    import litellm

    engine = Scripted(lambda p: "blue")
    s = open_session(gateway, engine)

    async def body():
        return await litellm.acompletion(
            model="openai/policy",
            api_base=gateway.base_url,
            api_key=s.key,
            messages=[{"role": "user", "content": "color?"}],
            extra_body={"return_token_ids": True},
        )

    r = loop.run(body)
    call = s.recorder.calls[0]
    assert r.choices[0].message.content == "blue"
    assert list(call.completion.ids) == [*ids_of("blue"), IM_END]
    sent = [{"role": "user", "content": "color?"}]
    assert list(call.prompt.ids) == CHATML.render_ids(sent, add_generation_prompt=True)


def _post(gw: Gateway, path: str, key: str | None, body: bytes | dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers["content-type"] = "application/json"
    return httpx.post(gw.base_url + path, content=content, headers=headers)


def test_credentials_loopback_and_reward_isolation(loop, gateway):
    engine = Scripted(lambda p: "ok")
    a, b = open_session(gateway, engine, tid=("a", 0)), open_session(gateway, engine, tid=("b", 0))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert gateway.host == "127.0.0.1"
    bound = {sock.getsockname()[0] for srv in gateway._server.servers for sock in srv.sockets}
    assert bound == {"127.0.0.1"}
    for key in (None, "wrong", a.key + "x"):
        r = _post(gateway, "/chat/completions", key, chat)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    rb = _post(gateway, "/chat/completions", b.key, chat).json()
    # b's own base URL works without a key; a wrong one is refused
    url = gateway.rollout_base_url(b)
    assert httpx.post(url + "/chat/completions", json=chat).status_code == 200 and len(b.recorder.calls) == 2
    assert httpx.post(url.replace(b.key, "nope") + "/chat/completions", json=chat).status_code == 401
    ra = _post(gateway, "/chat/completions", a.key, chat).json()
    # a cannot put a reward on b's call; its own call and its final reward are fine
    assert _post(gateway, "/rewards", a.key, {"reward": 5.0, "completion_id": rb["id"]}).status_code == 404
    assert _post(gateway, "/rewards", a.key, {"reward": 0.5, "completion_id": ra["id"]}).status_code == 200
    assert _post(gateway, "/rewards", a.key, {"reward": 1.0}).status_code == 200
    assert _post(gateway, "/rewards", a.key, {"reward": "much"}).status_code == 400
    assert _post(gateway, "/rewards", a.key, {"reward": 1.0, "completion_id": [ra["id"]]}).status_code == 400
    assert [c.reward for c in b.recorder.calls] == [0.0, 0.0] and b.reward is None
    assert [c.reward for c in a.recorder.calls] == [0.5] and a.reward == 1.0
    gateway.close_session(a)
    r = _post(gateway, "/chat/completions", a.key, chat)
    assert r.status_code == 401 and len(a.recorder.calls) == 1  # ended: refused, not recorded
    with pytest.raises(openai.AuthenticationError):
        loop.run(lambda: client(gateway, a.key).chat.completions.create(**chat))
    gateway.close_session(b)


HI = [{"role": "user", "content": "hi"}]


def req(messages: list | None = None, **extra: object) -> dict:
    return {"model": "m", "messages": HI if messages is None else messages, **extra}


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}


@pytest.mark.parametrize(
    "body, param, code",
    [
        (b'{"model": "m", "messages": [', None, None),
        (req([]), "messages", None),
        (req([{"role": "user", "content": "x" * 2100}]), "messages", "context_length_exceeded"),
        (req(n=2), "n", None),
        (req(tools=[{"type": "function"}]), "tools[0]", "invalid_tool"),
        (req(tools=[BAD_TOOL]), "tools[0]", "invalid_tool"),
        (req(tool_choice="required"), "tool_choice", None),
        (req(stop=["two tokens"]), "stop", None),
        (req(temperature=-1), "temperature", None),
        (req([{"role": "robot", "content": "hi"}]), "messages[0]", None),
        (req([{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content", None),
    ],
)
def test_bad_requests_get_openai_errors_and_are_not_recorded(gateway, body, param, code):
    engine = Scripted(lambda p: "ok")
    s = open_session(gateway, engine)
    r = _post(gateway, "/chat/completions", s.key, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    assert s.recorder.calls == () and engine.prompts == []
    # the rollout goes on: a good call afterwards is recorded
    ok = _post(gateway, "/chat/completions", s.key, req())
    assert ok.status_code == 200 and len(s.recorder.calls) == 1
    gateway.close_session(s)


def test_budget_single_token_stop_and_engine_failure(gateway):
    engine = Scripted(lambda p: "abcdefgh")
    s = open_session(gateway, engine, config=RolloutConfig(group_size=1, max_tokens=5, max_context_len=512))
    r = _post(gateway, "/chat/completions", s.key, req(max_tokens=50)).json()
    # rollout.max_tokens caps what a call asks for
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
    r = _post(gateway, "/chat/completions", s.key, req(max_completion_tokens=3)).json()
    assert r["usage"]["completion_tokens"] == 3
    _post(gateway, "/chat/completions", s.key, req(stop=["\n"]))  # a one-token stop string: a stop id
    assert engine.samplings[-1].stop_token_ids == (*CHATML.stop_token_ids(), *ids_of("\n"))

    class Broken(Scripted):
        async def generate(self, *a, **k):
            raise ConnectionError("server died")

    t = open_session(gateway, Broken(lambda p: ""))
    r = _post(gateway, "/chat/completions", t.key, req())
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert t.recorder.calls == () and t.error[0] == "engine"
    gateway.close_session(s), gateway.close_session(t)


def test_routing_unknown_paths_methods_and_internal_errors(gateway, monkeypatch):
    """The plain ASGI router: 404 / 405 with OpenAI error bodies, a trailing slash is the same
    endpoint, and a bug in a handler answers 500 (server_error) instead of dropping the connection."""
    s = open_session(gateway, Scripted(lambda p: "ok"))
    auth = {"Authorization": f"Bearer {s.key}"}
    root = gateway.base_url.removesuffix("/v1")
    r = httpx.post(root + "/v1/embeddings", json={"input": "x"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(gateway.base_url + "/chat/completions", headers=auth)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(gateway.base_url + "/chat/completions/", json=req(), headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    r = httpx.get(gateway.rollout_base_url(s) + "/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == gateway.model_name

    def broken(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway, "_answer_of", broken)
    r = httpx.post(gateway.base_url + "/chat/completions", json=req(), headers=auth)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "a bug" in r.json()["error"]["message"]
    gateway.close_session(s)


def test_in_process_client_answers_and_records_as_http(loop, gateway, monkeypatch):
    """Gateway.client's calls on the gateway's loop go to the app without a socket: the same
    answers (streamed too) and the same records as the same calls over HTTP; used from another
    event loop, the client talks HTTP."""
    direct = []
    app = gateway.app  # uvicorn serves this one; the in-process transport calls gateway.app

    async def spy(scope, receive, send):
        direct.append(scope["path"])
        await app(scope, receive, send)

    monkeypatch.setattr(gateway, "app", spy)

    async def conversation(c: openai.AsyncOpenAI) -> list:
        r1 = await c.chat.completions.create(model="m", messages=QUESTION, tools=[LOOKUP])
        m1 = r1.choices[0].message
        history = [*QUESTION, m1.model_dump(exclude_none=True)]
        history.append({"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "red"})
        stream = await c.chat.completions.create(model="m", messages=history, tools=[LOOKUP], stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        await c.close()
        return [
            [(t.function.name, t.function.arguments) for t in m1.tool_calls],
            r1.choices[0].finish_reason,
            text,
        ]

    runs = {}
    for in_process in (True, False):
        s = open_session(gateway, Scripted(tool_then_answer))
        make = functools.partial(gateway.client, s, in_process=in_process)
        runs[in_process] = loop.run(lambda make=make: conversation(make())), s
    (got, a), (want, b) = runs[True], runs[False]
    assert got == want == [[("lookup", '{"key": "zob"}')], "tool_calls", "It is red."]
    for ca, cb in zip(a.recorder.calls, b.recorder.calls, strict=True):
        assert (ca.prompt.ids, list(ca.completion.ids)) == (cb.prompt.ids, list(cb.completion.ids))
    assert direct == ["/v1/chat/completions"] * 2 and a.recorder.calls[1].prompt.parent == 0
    # the same kind of client driven from another event loop (a thread's): over HTTP
    c = loop.run(lambda: _make_client(gateway, b))
    r = asyncio.run(c.chat.completions.create(model="m", messages=HI))
    assert r.choices[0].finish_reason == "tool_calls"
    assert direct == ["/v1/chat/completions"] * 2 and len(b.recorder.calls) == 3
    gateway.close_session(a), gateway.close_session(b)


async def _make_client(gateway: Gateway, session) -> openai.AsyncOpenAI:
    return gateway.client(session)


def test_in_process_client_cancelled_or_timed_out_calls(loop, gateway):
    """Like over HTTP: a cancelled caller leaves its call running (recorded while the rollout is
    open); the request's timeout is the SDK's APITimeoutError."""
    s = open_session(gateway, Scripted(lambda p: "slow", delay=0.3))

    async def cancelled() -> None:
        c = gateway.client(s)
        call = asyncio.ensure_future(c.chat.completions.create(model="m", messages=HI))
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.sleep(0.5)
        await c.close()

    loop.run(cancelled)
    assert [list(c.completion.ids) for c in s.recorder.calls] == [[*ids_of("slow"), IM_END]]

    async def timed_out() -> None:
        c = gateway.client(s, timeout=0.05)
        try:
            with pytest.raises(openai.APITimeoutError):
                await c.chat.completions.create(model="m", messages=HI)
        finally:
            await c.close()

    loop.run(timed_out)
    gateway.close_session(s)


def test_weight_version_and_routed_experts_are_recorded_per_call(gateway):
    """Each call carries the weight version that served it (async training) and the engine's MoE
    routing (router replay), unchanged."""
    import asyncio

    class Versioned(Scripted):
        async def generate(self, prompt_ids, sampling, *, session_id=None):
            version = self.weight_version
            await asyncio.sleep(0.01)
            c = await super().generate(prompt_ids, sampling, session_id=session_id)
            routing = np.full((len(prompt_ids) + len(c.ids) - 1, 1, 2), version, np.int32)
            return type(c)(c.ids, c.logprobs, c.finish_reason, version, routed_experts=routing)

    engine = Versioned(lambda p: "ok", weight_version=3)
    s = open_session(gateway, engine)
    _post(gateway, "/chat/completions", s.key, req())
    engine.weight_version = 4
    r = _post(gateway, "/chat/completions", s.key, req()).json()
    assert r["weight_version"] == 4
    steps = s.recorder.steps()
    assert [st.policy_version for st in steps] == [3, 4]
    assert [int(st.routed_experts[0, 0, 0]) for st in steps] == [3, 4]
    assert steps[0].routed_experts.shape == (len(steps[0].prompt_ids) + len(steps[0].response_ids) - 1, 1, 2)
    gateway.close_session(s)


def test_concurrent_first_uses_start_one_server():
    """Rollouts that start together (the streaming mode runs each prompt group on its own) all call
    ``start``: one server binds, the others wait for it and use it."""
    from gateway_helpers import CHATML as renderer

    async def body() -> None:
        gw = Gateway(renderer)
        await asyncio.gather(*(gw.start() for _ in range(4)))
        try:
            assert gw.started
            async with httpx.AsyncClient() as c:
                assert (await c.get(gw.base_url.removesuffix("/v1") + "/health")).status_code == 200
        finally:
            await gw.stop()

    asyncio.run(body())
