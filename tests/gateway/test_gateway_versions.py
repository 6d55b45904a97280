"""Weight versions of agent calls: a turn crossed by an in-flight weight update keeps its spans in
the recorded steps (per-token ``response_versions``), through the HTTP gateway and the OpenAI SDK."""

from __future__ import annotations

import openai
from gateway_helpers import IM_END, LOOKUP, TOOL_CALL, Scripted, ids_of, open_session, tool_then_answer

from rljax.inference.engine import Completion
from rljax.types import VersionSpan

QUESTION = [{"role": "user", "content": "What color is the zob?"}]
SWITCH_AT = 5  # the first turn's tokens [0, 5) come from version 3, the rest from version 4


class Switching(Scripted):
    """The scripted policy, but the weights change from version 3 to 4 during the first call."""

    def __init__(self) -> None:
        super().__init__(tool_then_answer, weight_version=3)

    async def generate(self, prompt_ids, sampling, *, session_id=None) -> Completion:
        out = await super().generate(prompt_ids, sampling, session_id=session_id)
        if self.weight_version == 4:
            return out
        self.weight_version = 4
        n = len(out.ids)
        spans = (VersionSpan(3, 0, SWITCH_AT), VersionSpan(4, SWITCH_AT, n))
        return Completion(out.ids, out.logprobs, out.finish_reason, weight_version=3, weight_versions=spans)


def test_a_call_crossed_by_an_update_records_its_token_versions(loop, gateway):
    s = open_session(gateway, Switching())

    async def body():
        c = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=s.key, max_retries=0)
        r1 = await c.chat.completions.create(model="m", messages=QUESTION, tools=[LOOKUP])
        m1 = r1.choices[0].message
        history = [*QUESTION, m1.model_dump(exclude_none=True)]
        history.append({"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "red"})
        r2 = await c.chat.completions.create(model="m", messages=history, tools=[LOOKUP])
        await c.close()
        return r1, r2

    r1, r2 = loop.run(body)
    first, second = s.recorder.steps()
    n = len(ids_of(TOOL_CALL)) + 1  # the call's ids and <|im_end|>
    assert list(first.response_ids) == [*ids_of(TOOL_CALL), IM_END]
    assert first.policy_version == 3 and r1.model_extra["weight_version"] == 3
    assert list(first.response_versions) == [3] * SWITCH_AT + [4] * (n - SWITCH_AT)
    assert first.token_versions().tolist() == [3] * SWITCH_AT + [4] * (n - SWITCH_AT)
    # A call sampled by one version carries no per-token list (one version for all its tokens).
    assert second.policy_version == 4 and second.response_versions is None
    assert second.token_versions().tolist() == [4] * len(second.response_ids)
    assert r2.model_extra["weight_version"] == 4
    gateway.close_session(s)
