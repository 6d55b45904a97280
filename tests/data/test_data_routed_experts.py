"""MoE router replay data path: Step.routed_experts validated, converted to/from SkyRL's
``rollout_expert_indices``, merged (each position keeps the routing of the first turn that processed
it) and packed as a per-token stream (-1 where nothing was recorded)."""

from __future__ import annotations

import numpy as np
import pytest

from rljax.data import StepBatch
from rljax.data.merge import merge_steps
from rljax.data.pack import pack, unpack_responses
from rljax.types import Step

L, K = 2, 3  # MoE layers, top-k


def _routing(num_tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(num_tokens - 1, L, K))


def _trajectory(rep: int, seed: int) -> list[Step]:
    """Three turns, each prompt extending the previous full sequence (they merge into one sample)."""
    rng = np.random.default_rng(seed)
    steps, full = [], [1]
    for turn in range(3):
        prompt = full + rng.integers(10, 20, size=turn).tolist()  # observation tokens after turn 0
        response = rng.integers(20, 30, size=2).tolist()
        n = len(prompt) + len(response)
        steps.append(Step(prompt, response, ("q", rep), is_last_step=turn == 2,
                          routed_experts=_routing(n, seed * 10 + turn)))  # fmt: skip
        full = prompt + response
    return steps


def test_validation_names_the_problem():
    ok = Step([1, 2], [3], ("q", 0), routed_experts=_routing(3, 0))
    StepBatch([ok])
    with pytest.raises(ValueError, match=r"routed_experts must be ints of shape .* \[2, L, k\]"):
        StepBatch([ok.replace(routed_experts=_routing(4, 0))])
    with pytest.raises(ValueError, match="negative expert id"):
        StepBatch([ok.replace(routed_experts=-np.ones((2, L, K), int))])
    with pytest.raises(ValueError, match=r"\(layers, top_k\) = \(2, 2\), other steps have \(2, 3\)"):
        StepBatch([ok, Step([1, 2], [3], ("q", 1), routed_experts=np.zeros((2, 2, 2), int))])
    with pytest.raises(ValueError, match="must be ints"):
        StepBatch([ok.replace(routed_experts=np.zeros((2, L, K)))])  # floats


def test_skyrl_round_trip():
    steps = _trajectory(0, 1)
    b = StepBatch(steps)
    d = b.to_generator_output()
    assert np.asarray(d["rollout_expert_indices"][1]).shape == (len(steps[1].prompt_ids) + 1, L, K)
    back = StepBatch.from_generator_output(d)
    for a, s in zip(back, steps, strict=True):
        np.testing.assert_array_equal(a.routed_experts, s.routed_experts)


def test_merged_routing_keeps_the_first_turn_that_processed_each_position():
    steps = _trajectory(0, 2)
    (merged,) = merge_steps(StepBatch(steps))
    seq = list(merged.prompt_ids) + list(merged.response_ids)
    got = np.asarray(merged.routed_experts)
    assert got.shape == (len(seq) - 1, L, K)
    for p in range(len(seq) - 1):  # reference: the first turn whose (processed) tokens include p
        first = next(s for s in steps if len(s.prompt_ids) + len(s.response_ids) - 1 > p)
        np.testing.assert_array_equal(got[p], np.asarray(first.routed_experts)[p])
    # a trajectory whose turns lack routing merges without it
    plain = [s.replace(routed_experts=None) for s in steps]
    assert merge_steps(StepBatch(plain))[0].routed_experts is None


def test_packed_stream_places_rows_at_packed_positions():
    steps = [s for rep in range(3) for s in _trajectory(rep, 3 + rep)]
    merged = merge_steps(StepBatch(steps))
    res = pack(merged, seq_len=32)
    routed = res.batch.routed_experts
    assert routed.shape == (*res.batch.tokens.shape, L, K) and routed.dtype == np.int32
    seg, pos = res.batch.segment_ids, res.batch.positions
    assert np.all(routed[seg == 0] == -1)  # padding
    for k, s in enumerate(merged):
        row, start = int(res.layout.rows[k]), int(res.layout.starts[k])
        n = len(s.prompt_ids) + len(s.response_ids)
        np.testing.assert_array_equal(routed[row, start : start + n - 1], s.routed_experts)
        assert np.all(routed[row, start + n - 1] == -1)  # the last token was never processed
        assert pos[row, start] == 0
    # truncation keeps the rows of the kept tokens
    cut = pack(merged, seq_len=8, truncate=True)
    k0 = int(cut.layout.rows[0]), int(cut.layout.starts[0])
    kept = int(cut.layout.prompt_lens[0] + cut.layout.response_lens[0])
    np.testing.assert_array_equal(
        cut.batch.routed_experts[k0[0], k0[1] : k0[1] + kept], np.asarray(merged[0].routed_experts)[:kept]
    )
    assert unpack_responses(res.batch.loss_mask, res.layout)  # the other streams are untouched


def test_no_routing_no_stream():
    assert pack([Step([1, 2], [3], ("q", 0))], seq_len=4).batch.routed_experts is None
