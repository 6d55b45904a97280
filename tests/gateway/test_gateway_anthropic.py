"""The gateway's Anthropic Messages endpoint with the real ``anthropic`` SDK: tool use, bridging,
streaming, credentials, errors, stop sequences, token counting."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from gateway_helpers import CHATML, IM_END, TOOL_CALL, Scripted, ids_of, open_session, tool_then_answer

from rljax.gateway import Gateway
from rljax.gateway.anthropic_api import to_chat_body

if TYPE_CHECKING:
    import anthropic

SYSTEM = "Use the tool."
QUESTION = {"role": "user", "content": "What color is the zob?"}
LOOKUP = {
    "name": "lookup",
    "description": "Look up the color of an object.",
    "input_schema": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
}
# the same conversation as OpenAI-style messages, written by hand (the independent reference)
OPENAI_LOOKUP = {"type": "function", "function": {"name": "lookup", "description": LOOKUP["description"],
                                                  "parameters": LOOKUP["input_schema"]}}  # fmt: skip
OPENAI_QUESTION = [{"role": "system", "content": SYSTEM}, QUESTION]


def client(gw: Gateway, key: str, *, bearer: bool = False) -> anthropic.AsyncAnthropic:
    import anthropic  # here, not at collection: every xdist worker collects every module (~1.6 s import)

    base = gw.base_url.removesuffix("/v1")
    if bearer:  # Authorization: Bearer
        return anthropic.AsyncAnthropic(base_url=base, auth_token=key, api_key=None, max_retries=0)
    return anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0)  # x-api-key


@pytest.mark.parametrize("bearer", [False, True], ids=["x-api-key", "bearer"])
def test_tool_use_conversation_is_recorded_and_bridged(loop, gateway, bearer):
    s = open_session(gateway, Scripted(tool_then_answer))

    async def body():
        c = client(gateway, s.key, bearer=bearer)
        kw = dict(model="any", max_tokens=100, system=SYSTEM, tools=[LOOKUP])
        m1 = await c.messages.create(messages=[QUESTION], **kw)
        result = {"type": "tool_result", "tool_use_id": m1.content[0].id, "content": "red"}
        sent = [b.model_dump(exclude_none=True) for b in m1.content]
        turns = [QUESTION, {"role": "assistant", "content": sent}, {"role": "user", "content": [result]}]
        m2 = await c.messages.create(messages=turns, **kw)
        await c.close()
        return m1, m2

    m1, m2 = loop.run(body)
    assert m1.id.startswith("msg_") and m1.role == "assistant" and m1.stop_reason == "tool_use"
    [use] = m1.content
    assert (use.type, use.name, use.input) == ("tool_use", "lookup", {"key": "zob"}) and use.id.startswith(
        "toolu_"
    )
    assert m2.stop_reason == "end_turn" and [(b.type, b.text) for b in m2.content] == [("text", "It is red.")]
    c0, c1 = s.recorder.calls
    want0 = CHATML.render_ids(OPENAI_QUESTION, add_generation_prompt=True, tools=[OPENAI_LOOKUP])
    assert list(c0.prompt.ids) == want0 and list(c0.completion.ids) == [*ids_of(TOOL_CALL), IM_END]
    assert (m1.usage.input_tokens, m1.usage.output_tokens) == (len(want0), len(c0.completion.ids))
    # the second call extends the first: its prompt starts with the first's prompt + completion ids
    assert c1.prompt.parent == 0 and c1.prompt.ids[: len(want0) + len(c0.completion.ids)] == [
        *want0,
        *c0.completion.ids,
    ]
    history = [*OPENAI_QUESTION,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "lookup", "arguments": {"key": "zob"}}}]},
               {"role": "tool", "content": "red"}]  # fmt: skip
    assert list(c1.prompt.ids) == CHATML.render_ids(
        history, add_generation_prompt=True, tools=[OPENAI_LOOKUP]
    )
    gateway.close_session(s)


def test_streamed_message_equals_the_non_streamed_one(loop, gateway):
    s = open_session(
        gateway, Scripted(lambda p: "A long enough answer to take several deltas.\n" + TOOL_CALL)
    )

    async def body():
        c = client(gateway, s.key)
        kw = dict(model="m", max_tokens=200, messages=[QUESTION], tools=[LOOKUP])
        plain = await c.messages.create(**kw)
        async with c.messages.stream(**kw) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
        await c.close()
        return plain, streamed, kinds

    plain, streamed, kinds = loop.run(body)
    assert [b.type for b in plain.content] == ["text", "tool_use"]
    assert plain.content[0].text == "A long enough answer to take several deltas."
    dump = lambda m: [b.model_dump(exclude_none=True, exclude={"id"}) for b in m.content]  # noqa: E731
    assert dump(streamed) == dump(plain) and streamed.stop_reason == plain.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    gateway.close_session(s)


def test_credentials_and_bad_requests_get_anthropic_errors(loop, gateway):
    import anthropic

    engine = Scripted(lambda p: "ok")
    s = open_session(gateway, engine)

    async def body():
        errors = []
        for key, turn in (
            ("wrong", QUESTION),
            (s.key, {"role": "user", "content": [{"type": "image", "source": {}}]}),
            (s.key, {"role": "robot", "content": "hi"}),
        ):
            c = client(gateway, key)
            try:
                await c.messages.create(model="m", max_tokens=5, messages=[turn])
            except anthropic.APIStatusError as e:
                errors.append((type(e).__name__, e.status_code, e.body["type"], e.body["error"]["type"]))
            await c.close()
        c = client(gateway, s.key)
        with pytest.raises(anthropic.BadRequestError):
            await c.messages.create(model="m", max_tokens=5, messages=[QUESTION], tool_choice={"type": "any"},
                                    tools=[LOOKUP])  # fmt: skip
        ok = await c.messages.create(model="m", max_tokens=5, messages=[QUESTION])
        await c.close()
        return errors, ok

    errors, ok = loop.run(body)
    assert errors == [
        ("AuthenticationError", 401, "error", "authentication_error"),
        ("BadRequestError", 400, "error", "invalid_request_error"),
        ("BadRequestError", 400, "error", "invalid_request_error"),
    ]
    assert ok.content[0].text == "ok" and len(s.recorder.calls) == 1 and len(engine.prompts) == 1
    gateway.close_session(s)


class StopAware(Scripted):
    """Scripted, cut after the first stop id."""

    async def generate(self, prompt_ids, sampling, **kw):
        out = await super().generate(prompt_ids, sampling, **kw)
        cut = next((i for i, t in enumerate(out.ids) if t in sampling.stop_token_ids), None)
        if cut is None:
            return out
        return type(out)(out.ids[: cut + 1], out.logprobs[: cut + 1], "stop", out.weight_version)


def test_stop_sequences_max_tokens_and_count_tokens(loop, gateway):
    s = open_session(gateway, StopAware(lambda p: "ab\ncd"))

    async def body():
        c = client(gateway, s.key)
        stopped = await c.messages.create(
            model="m", max_tokens=50, messages=[QUESTION], stop_sequences=["\n"]
        )
        cut = await c.messages.create(model="m", max_tokens=1, messages=[QUESTION])
        count = await c.messages.count_tokens(model="m", messages=[QUESTION], system=SYSTEM, tools=[LOOKUP])
        await c.close()
        return stopped, cut, count

    stopped, cut, count = loop.run(body)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "\n")
    assert list(s.recorder.calls[0].completion.ids) == ids_of("ab\n")
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 1
    want = CHATML.render_ids(OPENAI_QUESTION, add_generation_prompt=True, tools=[OPENAI_LOOKUP])
    assert count.input_tokens == len(want) and len(s.recorder.calls) == 2  # counting records nothing
    gateway.close_session(s)


def test_to_chat_body_maps_blocks_in_order():
    """Tool results come before the turn's text; thinking is the reasoning; server tools and
    forced tool choices are refused."""
    body = to_chat_body({
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "one"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "two", "is_error": True},
                {"type": "text", "text": "and?"}]},
        ],
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "stop_sequences": ["x"], "temperature": 0.5, "metadata": {"user_id": "u"},
    })  # fmt: skip
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "hmm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "t2", "type": "function", "function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "two"},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    assert (body["stop"], body["temperature"], "metadata" in body) == (["x"], 0.5, False)
    from rljax.gateway import GatewayError

    for bad in (
        {"messages": [QUESTION], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"messages": [QUESTION], "tool_choice": {"type": "tool", "name": "f"}},
        {"messages": []},
    ):
        with pytest.raises(GatewayError):
            to_chat_body(bad)
