"""Per-token weight versions: spans on completions, steps recorded from them, merged samples."""

from __future__ import annotations

import numpy as np
import pytest

from rljax.chat.chatml import ChatMLRenderer
from rljax.chat.toy import toy_tokenizer
from rljax.data.batch import StepBatch
from rljax.data.merge import merge_steps
from rljax.data.micro_batch import split_by_token_budget
from rljax.data.pack import pack, unpack, with_token_staleness
from rljax.data.validate import validate_steps
from rljax.inference.engine import Completion
from rljax.recording import StepRecorder
from rljax.types import Step, VersionSpan, check_version_spans, token_versions, version_spans


def test_spans_round_trip_by_hand():
    assert version_spans([]) == ()
    assert version_spans([7]) == (VersionSpan(7, 0, 1),)
    spans = version_spans([1, 1, 1, 4, 5, 5])
    assert spans == (VersionSpan(1, 0, 3), VersionSpan(4, 3, 4), VersionSpan(5, 4, 6))
    assert token_versions(spans) == [1, 1, 1, 4, 5, 5]
    check_version_spans(spans, 6)


@pytest.mark.parametrize(
    "spans, n, message",
    [
        ([VersionSpan(1, 0, 2)], 3, "cover 2 tokens"),
        ([VersionSpan(1, 1, 3)], 3, "contiguous"),
        ([VersionSpan(1, 0, 2), VersionSpan(2, 3, 4)], 4, "contiguous"),
        ([VersionSpan(1, 0, 0), VersionSpan(2, 0, 2)], 2, "non-empty"),
        ([VersionSpan(2, 0, 1), VersionSpan(1, 1, 2)], 2, "strictly increase"),
        ([VersionSpan(-1, 0, 2)], 2, ">= 0"),
        ([VersionSpan(0, 0, 1)], 0, "cover 1 tokens"),
    ],
)
def test_bad_spans_are_refused(spans, n, message):
    with pytest.raises(ValueError, match=message):
        check_version_spans(spans, n)


def test_completion_default_span_and_explicit_spans():
    c = Completion([5, 6, 7], [-0.1, -0.2, -0.3], "length", weight_version=2)
    assert c.weight_versions == (VersionSpan(2, 0, 3),)
    assert c.token_versions() == [2, 2, 2]
    # the JSON form (SGLang's shape) is accepted and normalised
    d = Completion(
        [5, 6, 7],
        [-0.1] * 3,
        "stop",
        2,
        weight_versions=[{"version": 2, "start": 0, "end": 1}, {"version": 3, "start": 1, "end": 3}],
    )
    assert d.token_versions() == [2, 3, 3]
    assert [s.as_dict() for s in d.weight_versions] == [
        {"version": 2, "start": 0, "end": 1},
        {"version": 3, "start": 1, "end": 3},
    ]
    assert Completion([], [], "abort", 4).weight_versions == ()
    with pytest.raises(ValueError, match="first span's version"):
        Completion([5, 6], [-0.1, -0.2], "stop", 1, weight_versions=[VersionSpan(2, 0, 2)])
    with pytest.raises(ValueError, match="cover 1 tokens"):
        Completion([5, 6], [-0.1, -0.2], "stop", 2, weight_versions=[VersionSpan(2, 0, 1)])


def _recorded(completions):
    """Steps of one linear trajectory whose calls return ``completions`` (prompts as ids)."""
    rec = StepRecorder(ChatMLRenderer(toy_tokenizer("chatml")), ("q", 0), env="e")
    prompt: list[int] = [1, 2]
    for c in completions:
        p = rec.prompt_from_ids(prompt)
        rec.record(p, c)
        prompt = prompt + list(c.ids) + [9]  # the next prompt extends the last by one observation token
    return rec.finish(reward=1.0)


def test_recorded_steps_carry_token_versions_and_merge_keeps_them():
    a = Completion([3, 4], [-0.5, -0.5], "stop", 0)
    b = Completion(
        [5, 6, 7], [-0.5] * 3, "stop", 0, weight_versions=[VersionSpan(0, 0, 1), VersionSpan(2, 1, 3)]
    )
    c = Completion([8], [-0.5], "stop", 3)
    steps = _recorded([a, b, c])
    assert [s.policy_version for s in steps] == [0, 0, 3]
    assert steps[0].response_versions is None  # one version: nothing per token
    assert list(steps[1].response_versions) == [0, 2, 2]
    validate_steps(steps)
    (sample,) = merge_steps(StepBatch(steps))
    # a: [0, 0]; gap [9] takes b's policy version 0; b: [0, 2, 2]; gap [9] takes c's 3; c: [3]
    assert list(sample.response_ids) == [3, 4, 9, 5, 6, 7, 9, 8]
    assert list(sample.token_versions()) == [0, 0, 0, 0, 2, 2, 3, 3]
    assert sample.policy_version == 0
    validate_steps([sample])


def test_single_version_merge_stays_without_per_token_versions():
    steps = _recorded([Completion([3], [-0.5], "stop", 5), Completion([4], [-0.5], "stop", 5)])
    (sample,) = merge_steps(StepBatch(steps))
    assert sample.response_versions is None and list(sample.token_versions()) == [5, 5, 5]


@pytest.mark.parametrize(
    "versions, message",
    [([1, 1], "2 entries"), ([1, -1, 1], ">= 0"), ([2, 2, 3], "oldest")],
)
def test_validation_of_response_versions(versions, message):
    s = Step([1], [2, 3, 4], ("q", 0), policy_version=1, response_versions=versions)
    with pytest.raises(ValueError, match=message):
        validate_steps([s])


def test_pack_carries_every_trained_tokens_version():
    steps = [
        Step([1, 2], [3, 4, 5], ("a", 0), policy_version=4, response_versions=[4, 4, 6]),
        Step([1], [7, 8], ("b", 0), policy_version=5, loss_mask=[1, 0]),
        # truncated to seq_len: its last response token (version 9) is dropped
        Step([1], [2, 3, 4, 5, 6, 7], ("c", 0), policy_version=8, response_versions=[8, 8, 8, 8, 9, 9]),
    ]
    result = pack(steps, seq_len=6, truncate=True)
    batch = result.batch
    assert batch.token_versions.dtype.name == "int32"
    samples = unpack(batch, result.layout)
    assert [s["token_versions"].tolist() for s in samples] == [[4, 4, 6], [5, 5], [8, 8, 8, 8, 9]]
    # prompt tokens and padding hold 0
    prompt = np.zeros(batch.shape, bool)
    for s in result.layout.flat_index()[0][~result.layout.flat_index()[2]]:
        prompt.flat[s] = True
    assert not batch.token_versions[prompt].any()
    assert not batch.token_versions[np.asarray(batch.segment_ids) == 0].any()

    stale = with_token_staleness(batch, 9).token_staleness
    assert [stale.reshape(-1)[d].tolist() for d in _response_slots(result)] == [
        [5, 5, 3],
        [4, 0],  # the mask-0 token gets 0
        [1, 1, 1, 1, 0],
    ]
    with pytest.raises(ValueError, match="newer than the trained version 8"):
        with_token_staleness(batch, 8)
    # micro-batching keeps the streams and pads them with 0
    micro = split_by_token_budget(with_token_staleness(batch, 9), micro_batch_tokens=12)
    assert micro.token_versions.shape[:1] == micro.token_staleness.shape[:1]
    assert int(np.asarray(micro.token_versions).sum()) == int(np.asarray(batch.token_versions).sum())


def _response_slots(result):
    dest, _, is_response = result.layout.flat_index()
    lengths = result.layout.response_lens
    slots = dest[is_response]
    out, start = [], 0
    for n in lengths.tolist():
        out.append(slots[start : start + n])
        start += n
    return out


def test_in_flight_completion_to_packed_versions():
    """A completion an update crossed -> recorded step -> packed token_versions, span by span."""
    completion = Completion(
        ids=[5, 6, 7, 8],
        logprobs=[-0.1, -0.2, -0.3, -0.4],
        finish_reason="stop",
        weight_version=2,
        weight_versions=[VersionSpan(2, 0, 1), VersionSpan(3, 1, 4)],
    )
    step = Step(
        [1, 2],
        completion.ids,
        ("q", 0),
        response_logprobs=completion.logprobs,
        policy_version=completion.weight_version,
        response_versions=completion.token_versions(),
    )
    result = pack([step], seq_len=8)
    assert unpack(result.batch, result.layout)[0]["token_versions"].tolist() == [2, 3, 3, 3]
