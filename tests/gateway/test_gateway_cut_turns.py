"""Follow-ups of turns cut by ``max_tokens`` merge, whatever the cut splits (a character, a token the
tokenizer would merge otherwise), through the gateway and an OpenAI-SDK agent.

The agent asks for a few tokens a turn, sends each reply back as it came, then says "go on". A cut
reply's text is what the client holds (U+FFFD where the cut split a multi-byte character); the
follow-up merges when the sampled ids decode to that text and the template writes only its closing
after it. References, independent of the renderers: Jinja chat templates applied by the
tokenizer to the messages the client sent (each prompt must spell that text), and
:func:`rljax.data.merge.plan_merge` on the recorded steps (the merge). A template that rewrites the
cut text (here: one that replaces U+FFFD, one that strips trailing whitespace) falls back to full
renders, which then start new samples.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from gateway_helpers import open_session

from rljax.chat import ChatMLRenderer, GenericRenderer, toy_tokenizer
from rljax.chat.toy import TOY_TEMPLATES
from rljax.data.merge import plan_merge
from rljax.gateway import Gateway
from rljax.inference.engine import Completion
from rljax.rollout import RolloutConfig

pytestmark = pytest.mark.integration

FFFD = "\ufffd"
CONFIG = RolloutConfig(group_size=1, max_tokens=256, max_context_len=4096, temperature=1.0, seed=5)
# French, Japanese, emoji: characters of 2, 3 and 4 bytes
STORY = [
    "Le café coûte 3 € à Zürich.",
    "東京は晴れです。",
    "Ça va très bien 🙂 merci.",
    "Die Straße ist naß, señor.",
    "Naïve résumé: Ωmega → αβγ.",
]


class StoryEngine:
    """Completes call ``n`` with the tokens of ``texts[n]`` + ``<|im_end|>``, cut at the request's
    ``max_tokens`` (finish "length")."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.calls = tokenizer, texts, 0
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, prompt_ids, sampling, *, session_id=None) -> Completion:
        text = self.texts[self.calls]
        self.calls += 1
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.end_of_turn][
            : sampling.max_tokens
        ]
        reason = "stop" if ids[-1] == self.end_of_turn else "length"
        return Completion(ids, [-0.5] * len(ids), reason, weight_version=0)


def chat(loop, gateway, engine, budgets, *, turns_per_session):
    """Runs the go-on agent, call ``n`` asking for ``budgets[n]`` tokens, in sessions of
    ``turns_per_session`` calls; returns ``[(session, the messages of each recorded call as sent)]``."""
    out = []
    for s in range(len(budgets) // turns_per_session):
        session = open_session(gateway, engine, config=CONFIG, tid=(f"t{s}", 0))
        sent = []

        async def agent(session=session, s=s, sent=sent):
            client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
            history = [{"role": "user", "content": "Tell me something."}]
            for k in range(turns_per_session):
                budget = budgets[s * turns_per_session + k]
                r = await client.chat.completions.create(model="m", messages=history, max_tokens=budget)
                sent.append([dict(m) for m in history])
                history.append(r.choices[0].message.model_dump(exclude_none=True))
                history.append({"role": "user", "content": "go on"})
            await client.close()

        loop.run(agent)
        gateway.close_session(session)
        out.append((session, sent))
    return out


def merge_counts(runs, reference, decode):
    """``(follow-ups after cut turns that merged, such follow-ups, cuts that split a character)``;
    checks every prompt against the reference template's text of what the client sent."""
    merged = total = split = 0
    for session, sent in runs:
        calls = session.recorder.calls
        plan = plan_merge(session.recorder.steps())
        sample_of = {i: k for k, idx in enumerate(plan.samples) for i in idx}
        for i, call in enumerate(calls):
            want = reference.apply_chat_template(sent[i], add_generation_prompt=True, tokenize=False)
            assert decode(call.prompt.ids) == want  # bridged or rendered: the client's conversation
            if i == 0 or calls[i - 1].stop_reason != "length":
                continue
            prev = calls[i - 1]
            split += FFFD in prev.returned["content"]
            total += 1
            together = sample_of[i] == sample_of[i - 1]
            assert together == (call.prompt.parent == i - 1)
            merged += together
            if together:  # the sampled ids as sampled, then the template's closing: prompt tokens
                n = len(prev.prompt.ids) + len(prev.completion.ids)
                assert list(call.prompt.ids[:n]) == [*prev.prompt.ids, *prev.completion.ids]
                assert call.prompt.roles[n] is None
    return merged, total, split


class RandomBytes:
    """What the default tiny random model samples with the toy byte tokenizer: uniform random bytes
    (most of them not valid UTF-8), cut at the request's ``max_tokens``."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    async def generate(self, prompt_ids, sampling, *, session_id=None) -> Completion:
        ids = [int(i) for i in self.rng.integers(0, 256, size=sampling.max_tokens)]
        return Completion(ids, [-5.5] * len(ids), "length", weight_version=0)


def test_cut_turns_of_random_bytes_merge(loop):
    """The default tiny model's replies: random bytes; a cut reply ends mid-character or holds
    invalid UTF-8 (U+FFFD in the client's text) nearly always; their follow-ups merge."""
    tok = toy_tokenizer("chatml", chat_template="chatml")
    gateway = Gateway(ChatMLRenderer(tok))
    loop.run(gateway.start)
    try:
        runs = chat(loop, gateway, RandomBytes(seed=1), [4, 7, 5, 6, 3] * 4, turns_per_session=5)
    finally:
        loop.run(gateway.stop)
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False)
    merged, total, split = merge_counts(runs, tok, decode)
    print(f"\nrandom bytes: {merged} of {total} follow-ups after cut turns merged; {split} cuts held U+FFFD")
    assert total == 16 and split >= 12
    assert merged >= 0.9 * total


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from smollm2 import require_smollm2

    from rljax.models import gguf_tokenizer

    return gguf_tokenizer(require_smollm2())


# (text, token budget) of each call: SmolLM2 spells each of these Japanese characters, "Ç" and "©"
# with two or three byte tokens, and these budgets cut between them; the others cut between characters
SMOLLM2_CUTS = [(1, 1), (0, 4), (1, 3), (2, 1), (1, 5), (4, 8), (1, 7), (3, 3), (1, 8), (0, 2), (1, 10),
                (1, 12), (2, 5), (4, 4), (1, 1), (3, 7), (1, 3), (0, 9)]  # fmt: skip


def test_cut_turns_of_smollm2_merge_mid_character(loop, smollm2_tokenizer):
    from rljax.chat import SmolLM2Renderer

    tok = smollm2_tokenizer
    gateway = Gateway(SmolLM2Renderer(tok))
    loop.run(gateway.start)
    try:
        engine = StoryEngine(tok, [STORY[i] for i, _ in SMOLLM2_CUTS])
        runs = chat(loop, gateway, engine, [b for _, b in SMOLLM2_CUTS], turns_per_session=6)
    finally:
        loop.run(gateway.stop)
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    merged, total, split = merge_counts(runs, tok, decode)
    print(f"\nSmolLM2: {merged} of {total} follow-ups after cut turns merged; {split} cuts split a character")
    assert total == 15 and split >= 8  # the follow-ups: the 18 calls but each session's first
    assert merged >= 0.9 * total


def test_a_template_that_rewrites_the_cut_text_falls_back(loop):
    """Two templates that rewrite content: one replaces U+FFFD by "?", one strips whitespace. Only the
    cuts whose text they change fall back (a full render, a new sample); the others merge."""
    base = TOY_TEMPLATES["chatml"]
    for rewrite, changes in (
        ("m['content'] | replace('\ufffd', '?')", lambda text: FFFD in text),
        ("m['content'] | trim", lambda text: text != text.strip()),
    ):
        tok = toy_tokenizer("chatml", chat_template=base.replace("m['content']", rewrite))
        gateway = Gateway(GenericRenderer(tok))
        loop.run(gateway.start)
        try:
            engine = StoryEngine(tok, STORY + STORY[:2])
            ((session, sent),) = chat(loop, gateway, engine, [5, 4, 12, 2, 9, 3, 7], turns_per_session=7)
        finally:
            loop.run(gateway.stop)
        calls = session.recorder.calls
        decode = lambda ids, tok=tok: tok.decode(list(ids), skip_special_tokens=False)
        outcomes = []
        for i in range(1, len(calls)):
            want = tok.apply_chat_template(sent[i], add_generation_prompt=True, tokenize=False)
            assert decode(calls[i].prompt.ids) == want
            if calls[i - 1].stop_reason == "length":
                outcomes.append((changes(calls[i - 1].returned["content"]), calls[i].prompt.parent == i - 1))
        assert {rewritten for rewritten, _ in outcomes} == {True, False}, outcomes  # both kinds of cut
        assert all(bridged == (not rewritten) for rewritten, bridged in outcomes), (rewrite, outcomes)
