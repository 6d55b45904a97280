"""The engine protocol's dataclasses validate their inputs; the vLLM client satisfies the protocol."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.inference.engine import FINISH_REASONS, Completion, Engine, SamplingParams
from rljax.inference.vllm import VLLMClient


def test_sampling_params_defaults_and_normalization():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (1.0, 1.0, None, 256, None)
    assert p.stop_token_ids == (3, 4)  # lists become tuples: params are hashable and immutable
    hash(p)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_sampling_params_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_completion_validation():
    c = Completion(ids=[1, 2], logprobs=[-0.5, -1.0], finish_reason="stop", weight_version=3)
    assert c.ids == (1, 2) and c.logprobs == (-0.5, -1.0) and c.weight_version == 3
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        Completion(ids=[1, 2], logprobs=[-0.5], finish_reason="stop", weight_version=0)
    with pytest.raises(ValueError, match="finite and <= 0"):
        Completion(ids=[1], logprobs=[0.5], finish_reason="stop", weight_version=0)
    with pytest.raises(ValueError, match="finite and <= 0"):
        Completion(ids=[1], logprobs=[math.inf], finish_reason="stop", weight_version=0)
    with pytest.raises(ValueError, match="finish_reason"):
        Completion(ids=[], logprobs=[], finish_reason="tool", weight_version=0)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.floats(-50, 0)), max_size=20),
    st.sampled_from(FINISH_REASONS),
)
def test_completion_round_trips_any_valid_output(pairs, reason):
    ids = [i for i, _ in pairs]
    lps = [x for _, x in pairs]
    c = Completion(ids=ids, logprobs=lps, finish_reason=reason, weight_version=1)
    assert list(c.ids) == ids and list(c.logprobs) == lps


def test_vllm_client_is_an_engine():
    assert isinstance(VLLMClient(["http://127.0.0.1:1"]), Engine)
