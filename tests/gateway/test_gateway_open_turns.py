"""An OpenAI-SDK agent whose turns are cut: follow-ups of turns not closed by ``<|im_end|>`` merge.

The agent asks for at most 8 tokens a turn; the fake engine's texts run past that (finish "length"),
end on a single-token stop string the agent asked for, end on the format's other stop token
``<|endoftext|>``, or abort once (the SDK retries the 500); one closed turn spells ``<think>`` byte
by byte (a tokenization the tokenizer would not produce, as models sometimes sample), so a full
render of any later history re-tokenizes it and no longer continues the sampled ids. Each
follow-up is the whole history the SDK sends back (the assistant message as it was returned, then a
user turn). Independent references: the toy tokenizer is byte-level, so the cut texts and their
ids are known by hand, and each prompt must spell the ChatML template's render of the history the
client sent (``render_ids`` equals ``apply_chat_template``, tested in tests/chat); the merge is
:func:`rljax.data.merge.plan_merge` on the recorded steps.
"""

from __future__ import annotations

import openai
import pytest
from gateway_helpers import CHATML, IM_END, TOK, ids_of, open_session

from rljax.data.merge import plan_merge
from rljax.inference.engine import Completion

pytestmark = pytest.mark.integration

ENDOFTEXT = TOK.convert_tokens_to_ids("<|endoftext|>")
# (what the engine writes, what the agent asks for): 8 bytes = 8 toy tokens
SCRIPT = [
    ("The zob is red and round.", {}),  # cut at 8: "The zob "
    ("bytes:<think>", {}),  # closed within 8 tokens, "<think>" sampled byte by byte, not as its token
    ("It rolls down the hill.", {}),
    ("Ok\nmore text after the stop", {"stop": ["\n"]}),  # ends on the stop string "\n"
    ("abort", {}),  # the engine aborts after 3 tokens; the SDK retries and gets the next text
    ("Then it stops at a tree.", {}),
    ("Done<|endoftext|>", {}),  # another stop token of the format: never written by the template
    ("A second zob is blue.", {}),
    ("Sure.", {}),
    ("Blue like the sky above.", {}),
    ("Hm\nthe rest", {"stop": ["\n"]}),
    ("It is a small zob.", {}),
    ("Small and quick to roll.", {}),
    ("Both zobs are friends.", {}),
    ("They play all day long.", {}),
    ("In the garden by the sea.", {}),
    ("No.", {}),
    ("The end of the story.", {}),
    ("Bye for now, zob.", {}),
]


class CuttingEngine:
    """Completes call ``n`` with the ids of ``SCRIPT[n]`` + ``<|im_end|>``, cut after the first stop
    id the request asks for, then at ``max_tokens`` (finish "length"); "abort" aborts after 3 ids."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, prompt_ids, sampling, *, session_id=None) -> Completion:
        text = SCRIPT[self.calls][0]
        self.calls += 1
        ids = [*ids_of(text), IM_END]
        if text.startswith("bytes:"):  # a tokenization the tokenizer would not give (ids = bytes)
            ids = [*text[len("bytes:") :].encode(), IM_END]
        if text == "abort":
            return Completion(ids[:3], [-0.25] * 3, "abort", weight_version=0)
        stop = next((j for j, t in enumerate(ids) if t in sampling.stop_token_ids), len(ids) - 1)
        ids = ids[: stop + 1][: sampling.max_tokens]
        reason = "stop" if ids[-1] in sampling.stop_token_ids else "length"
        return Completion(ids, [-0.25] * len(ids), reason, weight_version=0)


def test_follow_ups_of_cut_turns_merge_with_the_sdk(loop, gateway):
    engine = CuttingEngine()
    session = open_session(gateway, engine)
    history = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Go."}]
    sent = []  # the messages of each recorded call, as the client sent them

    async def agent():
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=1)
        while engine.calls < len(SCRIPT):
            extra = SCRIPT[engine.calls][1]
            if SCRIPT[engine.calls][0] == "abort":
                extra = SCRIPT[engine.calls + 1][1]  # the retry gets the next text
            r = await client.chat.completions.create(model="m", messages=history, max_tokens=8, **extra)
            sent.append([dict(m) for m in history])
            history.append(r.choices[0].message.model_dump(exclude_none=True))
            history.append({"role": "user", "content": "And then?"})
        await client.close()

    loop.run(agent)
    gateway.close_session(session)
    calls = session.recorder.calls
    assert session.error is not None and session.error[0] == "engine"  # the abort, answered 500
    assert len(calls) == len(SCRIPT) - 1  # the aborted call is not recorded
    # the byte-level cut: 8 tokens are the first 8 bytes of the text
    assert list(calls[0].completion.ids) == ids_of("The zob ") and calls[0].stop_reason == "length"
    assert calls[0].returned["content"] == "The zob "
    assert list(calls[3].completion.ids) == ids_of("Ok\n") and calls[3].stop_reason == "stop"
    assert list(calls[5].completion.ids) == ids_of("Done<|endoftext|>")

    plan = plan_merge(session.recorder.steps())
    sample_of = {i: k for k, idx in enumerate(plan.samples) for i in idx}
    counts = {"open": [0, 0], "closed": [0, 0]}
    rendered_since = False  # a call after the byte-spelled turn was rendered in full
    for i in range(1, len(calls)):
        prev, call = calls[i - 1], calls[i]
        closed = prev.completion.ids[-1] == IM_END
        merged = sample_of[i] == sample_of[i - 1]
        counts["closed" if closed else "open"][0] += merged
        counts["closed" if closed else "open"][1] += 1
        assert merged == (call.prompt.parent == i - 1)
        # bridged or not, the prompt spells the template's render of the history the client sent
        # (token for token up to the turn sampled byte by byte, which re-tokenizes differently)
        full = CHATML.render_ids(sent[i], add_generation_prompt=True)
        assert TOK.decode(call.prompt.ids) == TOK.decode(full)
        rendered_since |= not merged  # a full render re-tokenizes "<think>": in step again
        assert (list(call.prompt.ids) == full) == (i <= 1 or rendered_since)
        # only the turn that ended with <|endoftext|> cannot be continued token for token
        assert merged == (prev.completion.ids[-1] != ENDOFTEXT)
        if merged and not closed:  # the closing tokens: prompt tokens, not the policy's
            n = len(prev.prompt.ids) + len(prev.completion.ids)
            assert TOK.decode(call.prompt.ids[n : n + 2]) == "<|im_end|>\n"
            assert call.prompt.roles[n : n + 2] == [None, None]
    bridged = sum(
        c.prompt.parent is not None
        for c, p in zip(calls[1:], calls, strict=False)
        if p.completion.ids[-1] != IM_END
    )
    print(
        f"\nextensions after open turns bridged: {bridged} of {counts['open'][1]}, "
        f"merged: {counts['open'][0]} of {counts['open'][1]}; "
        f"after closed turns: {counts['closed'][0]} of {counts['closed'][1]}; "
        f"{plan.num_samples} samples from {len(calls)} calls"
    )
    assert counts == {"open": [13, 14], "closed": [3, 3]}
    assert plan.num_samples == 2  # a new sample only after <|endoftext|>
