"""Per-token weight versions: spans on completions, steps recorded from them, merged samples."""

from __future__ import annotations

import pytest

from rljax.chat.chatml import ChatMLRenderer
from rljax.chat.toy import toy_tokenizer
from rljax.data.batch import StepBatch
from rljax.data.merge import merge_steps
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
