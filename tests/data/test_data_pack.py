"""Tests of rljax.data.pack: FFD placement, row buckets, packed streams, unpack, mini-batches."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from rljax.data import StepBatch
from rljax.data.merge import merge_steps
from rljax.data.pack import (
    bucket_rows,
    first_fit_decreasing,
    geometric_row_buckets,
    make_mini_batches,
    pack,
    unpack,
    unpack_responses,
)
from rljax.types import PackedBatch, Step

_STREAMS = (
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "rl_weights",
    "ce_weights",
    "ref_kl_weights",
)


# ----------------------------------------------------------------------------------------
# First-fit-decreasing and buckets
# ----------------------------------------------------------------------------------------


def _naive_ffd(lengths, capacity):
    """Reference FFD with plain lists: longest first (stable), lowest row with room."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    fill, members = [], []
    rows, starts = [0] * len(lengths), [0] * len(lengths)
    for i in order:
        for r in range(len(fill)):
            if fill[r] + lengths[i] <= capacity:
                break
        else:
            r = len(fill)
            fill.append(0)
            members.append([])
        rows[i], starts[i] = r, fill[r]
        fill[r] += lengths[i]
        members[r].append(i)
    return rows, starts, len(fill)


def test_ffd_hand_case():
    # capacity 10: 7 -> row0, 6 -> row1, 4 -> row1 (row0 has 3 left), 3 -> row0, 2 -> new row2? no:
    # row0 7+3=10 full, row1 6+4=10 full -> 2 opens row2.
    rows, starts, segs, n = first_fit_decreasing([3, 7, 2, 6, 4], capacity=10)
    assert rows.tolist() == [0, 0, 2, 1, 1]
    assert starts.tolist() == [7, 0, 0, 0, 6]
    assert segs.tolist() == [2, 1, 1, 1, 2]
    assert int(n) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=40), st.integers(20, 30))
def test_ffd_matches_naive_reference(lengths, capacity):
    rows, starts, segs, n = first_fit_decreasing(lengths, capacity)
    ref_rows, ref_starts, ref_n = _naive_ffd(lengths, capacity)
    assert rows.tolist() == ref_rows
    assert starts.tolist() == ref_starts
    assert int(n) == ref_n
    for r in range(ref_n):
        members = [i for i in range(len(lengths)) if ref_rows[i] == r]
        assert sum(lengths[i] for i in members) <= capacity
        assert sorted(segs[members].tolist()) == list(range(1, len(members) + 1))


def test_ffd_rejects_items_longer_than_capacity():
    with pytest.raises(ValueError, match="capacity=4"):
        first_fit_decreasing([2, 5], capacity=4)


def test_bucket_rows():
    assert [bucket_rows(r) for r in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert bucket_rows(5, data_parallel=4) == 8
    assert bucket_rows(9, data_parallel=3) == 12
    assert bucket_rows(5, row_buckets=[8, 6, 4]) == 6
    assert bucket_rows(5, row_buckets=[4, 6, 8], data_parallel=4) == 8
    with pytest.raises(ValueError, match="larger bucket"):
        bucket_rows(9, row_buckets=[4, 8])
    with pytest.raises(ValueError, match="data_parallel must be >= 1"):
        bucket_rows(1, data_parallel=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3000), st.sampled_from([1.02, 1.05, 1.5]), st.sampled_from([1, 2, 8]))
def test_geometric_row_buckets_bound_the_padding(max_rows, ratio, dp):
    b = geometric_row_buckets(max_rows, ratio=ratio, data_parallel=dp)
    assert b[0] == dp and b[-1] >= max_rows and all(x % dp == 0 for x in b)
    assert all(y > x for x, y in zip(b, b[1:], strict=False))
    assert len(b) == 1 or b[-2] < max_rows
    # Padding r rows up to its bucket: fewer than (ratio - 1) * r + dp rows.
    for r in range(1, b[-1] + 1, max(1, b[-1] // 200)):
        pad = bucket_rows(r, row_buckets=b, data_parallel=dp) - r
        assert 0 <= pad < (ratio - 1) * r + dp, (r, pad)


def test_geometric_row_buckets_errors():
    with pytest.raises(ValueError, match="ratio must be > 1"):
        geometric_row_buckets(10, ratio=1.0)


# ----------------------------------------------------------------------------------------
# Packed streams, hand-checked
# ----------------------------------------------------------------------------------------


def _hand_steps():
    return [
        Step([1, 2], [3, 4, 5], ("a", 0), loss_mask=[1, 0, 1], response_logprobs=[-0.1, -0.2, -0.3]),
        Step([6], [7], ("b", 0), temperature=0.5, response_logprobs=[-0.7]),
        Step([8, 9, 10], [11, 12], ("a", 1)),
    ]


def test_pack_hand_case_every_stream():
    steps = _hand_steps()
    r = pack(
        steps,
        seq_len=6,
        advantages=[[1.0, 2.0, 3.0], [4.0], [5.0, 6.0]],
        ref_logprobs=[[-1.0, -1.0, -1.0], None, [-2.0, -2.0]],
        ce_weights=[0.5, 0.0, [0.25, 0.75]],
        ref_kl_weights=0.1,
    )
    b = r.batch
    assert isinstance(b, PackedBatch)
    # lengths 5, 2, 5 -> FFD: sample0 row0, sample2 row1, sample1 -> no room in row0 (1 left)... row0 has 1
    # left, row1 has 1 left -> new row2. 3 rows -> bucket 4 (powers of two).
    assert b.shape == (4, 6)
    np.testing.assert_array_equal(
        b.tokens, [[1, 2, 3, 4, 5, 0], [8, 9, 10, 11, 12, 0], [6, 7, 0, 0, 0, 0], [0] * 6]
    )
    np.testing.assert_array_equal(
        b.positions, [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 0], [0, 1, 0, 0, 0, 0], [0] * 6]
    )
    np.testing.assert_array_equal(b.segment_ids, [[1] * 5 + [0], [1] * 5 + [0], [1, 1, 0, 0, 0, 0], [0] * 6])
    np.testing.assert_array_equal(b.sample_index, [[0] * 6, [2] * 5 + [0], [1, 1, 0, 0, 0, 0], [0] * 6])
    np.testing.assert_array_equal(b.group_index, [[0] * 6, [0] * 6, [1, 1, 0, 0, 0, 0], [0] * 6])
    np.testing.assert_array_equal(
        b.loss_mask, [[0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0], [0] * 6]
    )
    np.testing.assert_array_equal(
        b.advantages, [[0, 0, 1, 2, 3, 0], [0, 0, 0, 5, 6, 0], [0, 4, 0, 0, 0, 0], [0] * 6]
    )
    lp = np.float32([-0.1, -0.2, -0.3])
    np.testing.assert_array_equal(b.inference_logprobs[0], [0, 0, *lp, 0])
    np.testing.assert_array_equal(b.inference_logprobs[1], np.zeros(6))  # step without logprobs
    np.testing.assert_array_equal(b.inference_logprobs[2], np.float32([0, -0.7, 0, 0, 0, 0]))
    np.testing.assert_array_equal(b.old_logprobs, b.inference_logprobs)
    np.testing.assert_array_equal(
        b.ref_logprobs, [[0, 0, -1, -1, -1, 0], [0, 0, 0, -2, -2, 0], [0] * 6, [0] * 6]
    )
    np.testing.assert_array_equal(b.temperatures, [[1] * 6, [1] * 6, [0.5, 0.5, 1, 1, 1, 1], [1] * 6])
    np.testing.assert_array_equal(
        b.rl_weights, [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0], [0] * 6]
    )
    np.testing.assert_array_equal(
        b.ce_weights, [[0, 0, 0.5, 0.5, 0.5, 0], [0, 0, 0, 0.25, 0.75, 0], [0] * 6, [0] * 6]
    )
    np.testing.assert_allclose(b.ref_kl_weights, np.float32(0.1) * (b.rl_weights > 0))
    assert b.tokens.dtype == np.int32 and b.loss_mask.dtype == np.float32
    assert r.group_keys == ("a", "b")
    m = r.metrics
    assert (m["num_rows"], m["used_rows"], m["padding_rows"], m["real_tokens"]) == (4, 3, 1, 12)
    assert m["packing_efficiency"] == pytest.approx(12 / 24)
    assert m["trainable_tokens"] == 5
    assert m["samples_without_logprobs"] == 1


def test_default_streams():
    b = pack(_hand_steps(), seq_len=12).batch
    response = np.zeros(b.shape, bool)
    response[0, [2, 3, 4, 8, 9, 11]] = True  # row: [1 2 | 3 4 5 || 8 9 10 | 11 12 || 6 | 7]
    np.testing.assert_array_equal(b.tokens[0], [1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 6, 7])
    np.testing.assert_array_equal(b.rl_weights, response.astype(np.float32))
    for name in ("advantages", "ref_logprobs", "ce_weights", "ref_kl_weights"):
        assert not getattr(b, name).any(), name


def test_pack_accepts_step_batch_and_row_buckets():
    b = StepBatch(_hand_steps())
    r = pack(b, seq_len=6, row_buckets=[3, 5])
    assert r.batch.shape == (3, 6)
    r = pack(b, seq_len=16, row_buckets=[2, 4], data_parallel=2)
    assert r.batch.shape == (2, 16)
    assert r.metrics["padding_rows"] == 1
    assert not r.batch.loss_mask[1].any() and not r.batch.segment_ids[1].any()


def test_pack_after_merge_masks_gap_tokens():
    steps = [
        Step([1], [2], ("a", 0), is_last_step=False, response_logprobs=[-0.5]),
        Step([1, 2, 3], [4], ("a", 0), response_logprobs=[-0.25]),
    ]
    merged = merge_steps(StepBatch(steps))
    r = pack(merged, seq_len=4, advantages=[[1.0, 0.0, 1.0]])
    np.testing.assert_array_equal(r.batch.tokens, [[1, 2, 3, 4]])
    np.testing.assert_array_equal(r.batch.loss_mask, [[0, 1, 0, 1]])
    np.testing.assert_array_equal(r.batch.inference_logprobs, [[0, -0.5, 0, -0.25]])


# ----------------------------------------------------------------------------------------
# Errors and truncation
# ----------------------------------------------------------------------------------------


def test_over_length_is_an_error_naming_the_sample():
    steps = [Step([1], [2], ("a", 0)), Step([1, 2, 3], [4, 5, 6], ("b", 7))]
    with pytest.raises(
        ValueError, match=r"sample 1 \(trajectory b#7\) has 6 tokens .* seq_len=5.*truncate=True"
    ):
        pack(steps, seq_len=5)


def test_truncate_drops_response_tail_and_reports():
    steps = [Step([1], [2], ("a", 0)), Step([1, 2, 3], [4, 5, 6], ("b", 7), response_logprobs=[-1, -2, -3])]
    r = pack(steps, seq_len=5, truncate=True, advantages=[[9.0], [1.0, 2.0, 3.0]])
    out = unpack(r.batch, r.layout)
    assert out[1]["prompt_ids"].tolist() == [1, 2, 3]
    assert out[1]["response_ids"].tolist() == [4, 5]
    assert out[1]["advantages"].tolist() == [1.0, 2.0]
    assert out[1]["inference_logprobs"].tolist() == [-1.0, -2.0]
    assert r.metrics["truncated_samples"] == 1
    assert r.metrics["truncated_tokens"] == 1
    assert [a.tolist() for a in unpack_responses(r.batch.tokens, r.layout)] == [[2], [4, 5]]
    with pytest.raises(ValueError, match="prompt >= seq_len=3"):
        pack(steps, seq_len=3, truncate=True)


def test_truncate_moves_the_cut_token_rewards_to_the_last_kept_trained_token():
    # sample b keeps 2 of 5 response tokens (mask 1, 0): the cut trained tokens' rewards (2 + 4;
    # 8 sits on a masked token and is not a time step's reward) go to the kept trained token 0
    steps = [
        Step([1], [2], ("a", 0)),
        Step([1, 2, 3], [4, 5, 6, 7, 8], ("b", 0), loss_mask=[1, 0, 1, 0, 1]),
        Step([1, 2, 3], [4, 5, 6], ("c", 0), loss_mask=[0, 0, 1]),  # nothing trained is kept
    ]
    rewards = [[3.0], [0.5, 1.0, 2.0, 8.0, 4.0], [0.0, 0.0, 1.0]]
    r = pack(steps, seq_len=5, truncate=True, token_rewards=rewards, advantages=[[9.0], [1.0] * 5, [1.0] * 3])
    out = unpack(r.batch, r.layout)
    assert [o["token_rewards"].tolist() for o in out] == [[3.0], [6.5, 1.0], [0.0, 0.0]]
    assert [o["advantages"].tolist() for o in out] == [[9.0], [1.0, 1.0], [1.0, 1.0]]  # others are cut
    scalar = pack(steps[1:2], seq_len=5, truncate=True, token_rewards=[1.0])  # one value per token
    assert unpack(scalar.batch, scalar.layout)[0]["token_rewards"].tolist() == [3.0, 1.0]


def test_empty_prompt_and_bad_streams_are_errors():
    with pytest.raises(ValueError, match="empty prompt"):
        pack([Step([], [2], ("a", 0))], seq_len=4)
    steps = _hand_steps()
    with pytest.raises(ValueError, match=r"advantages of sample 1 \(trajectory b#0\) has shape \(2,\)"):
        pack(steps, seq_len=8, advantages=[[0.0] * 3, [0.0, 0.0], [0.0] * 2])
    with pytest.raises(ValueError, match="rl_weights has 2 entries but there are 3 samples"):
        pack(steps, seq_len=8, rl_weights=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"ref_logprobs of sample 2 \(trajectory a#1\) has a non-finite"):
        pack(steps, seq_len=8, ref_logprobs=[None, None, [0.0, np.nan]])
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        pack(steps, seq_len=1)
    with pytest.raises(
        ValueError, match=r"sample 0 \(trajectory a#0\): loss_mask has 1 entries but response_ids has 2"
    ):
        pack([Step([1], [2, 3], ("a", 0), loss_mask=[1])], seq_len=8)
    with pytest.raises(ValueError, match="response_logprobs has 3 entries but response_ids has 2"):
        pack([Step([1], [2, 3], ("a", 0), response_logprobs=[-1.0] * 3)], seq_len=8)


def test_packed_batch_is_a_jax_pytree():
    import jax

    r = pack(_hand_steps(), seq_len=8)
    total = jax.jit(lambda b: (b.tokens * (b.segment_ids > 0)).sum())(r.batch)
    assert int(total) == sum(sum(s.prompt_ids) + sum(s.response_ids) for s in _hand_steps())


def test_empty_input_gives_one_padding_row():
    r = pack([], seq_len=4)
    assert r.batch.shape == (1, 4)
    assert not r.batch.segment_ids.any()
    assert unpack(r.batch, r.layout) == []


# ----------------------------------------------------------------------------------------
# Properties: every token once, unpack(pack(x)) == x, layout invariants
# ----------------------------------------------------------------------------------------


@st.composite
def _samples(draw):
    n = draw(st.integers(0, 12))
    steps, streams = [], {"advantages": [], "ref_logprobs": [], "rl_weights": [], "ce_weights": []}
    for k in range(n):
        p = draw(st.integers(1, 6))
        rl = draw(st.integers(0, 6))
        rng = np.random.default_rng(draw(st.integers(0, 2**31)))
        has_lp = draw(st.booleans())
        steps.append(
            Step(
                prompt_ids=rng.integers(0, 1000, p).tolist(),
                response_ids=rng.integers(0, 1000, rl).tolist(),
                loss_mask=rng.integers(0, 2, rl).tolist(),
                response_logprobs=(-rng.random(rl)).tolist() if has_lp else None,
                trajectory_id=(f"g{draw(st.integers(0, 3))}", k),
                temperature=float(draw(st.sampled_from([1.0, 0.7, 1.3]))),
            )
        )
        streams["advantages"].append(rng.normal(size=rl))
        streams["ref_logprobs"].append(-rng.random(rl))
        streams["rl_weights"].append(draw(st.sampled_from([None, 0.5])) if rl % 2 else rng.random(rl))
        streams["ce_weights"].append(None if k % 3 == 0 else rng.random(rl))
    return steps, streams


def _expected_response_stream(name, step, streams, k):
    n = len(step.response_ids)
    if name == "loss_mask":
        return np.asarray(step.loss_mask, np.float32)
    if name in ("inference_logprobs", "old_logprobs"):
        return (
            np.zeros(n, np.float32) if step.response_logprobs is None else np.float32(step.response_logprobs)
        )
    if name == "ref_kl_weights":
        return np.zeros(n, np.float32)
    v = streams[name][k]
    if v is None:
        return np.full(n, 1.0 if name == "rl_weights" else 0.0, np.float32)
    return np.broadcast_to(np.float32(v), (n,))


@settings(max_examples=80, deadline=None)
@given(_samples(), st.integers(12, 20), st.sampled_from([1, 2, 4]))
def test_unpack_pack_roundtrip_and_layout_invariants(data, seq_len, dp):
    steps, streams = data
    r = pack(steps, seq_len=seq_len, data_parallel=dp, **streams)
    b = r.batch
    rows, L = b.shape
    assert L == seq_len and rows % dp == 0
    # unpack(pack(x)) == x, every stream.
    out = unpack(b, r.layout)
    assert len(out) == len(steps)
    keys = {}
    for k, (s, u) in enumerate(zip(steps, out, strict=True)):
        assert u["prompt_ids"].tolist() == list(s.prompt_ids)
        assert u["response_ids"].tolist() == list(s.response_ids)
        assert u["positions"].tolist() == list(range(s.num_tokens))
        assert u["temperature"] == np.float32(s.temperature)
        assert u["sample_index"] == k and u["source_index"] == k
        keys.setdefault(s.trajectory_id.instance_id, u["group_index"])
        assert keys[s.trajectory_id.instance_id] == u["group_index"]
        for name in _STREAMS:
            np.testing.assert_array_equal(
                u[name], _expected_response_stream(name, s, streams, k), err_msg=name
            )
    assert sorted(keys.values()) == list(range(len(keys)))
    # Every token of every sample exactly once: the non-padding cells are exactly the sample tokens.
    seg = b.segment_ids
    assert int((seg > 0).sum()) == sum(s.num_tokens for s in steps)
    cells = {
        (int(b.sample_index[i, j]), int(b.positions[i, j])) for i, j in zip(*np.nonzero(seg), strict=True)
    }
    assert len(cells) == sum(s.num_tokens for s in steps)
    # Rows: segments 1..k laid out contiguously from column 0, positions restart per segment, padding at the
    # end; prompt and padding cells carry zeros in every response stream and temperature 1 on padding.
    for i in range(rows):
        row = seg[i]
        used = int((row > 0).sum())
        assert (row[used:] == 0).all()
        if used:
            change = np.flatnonzero(np.diff(row[:used])) + 1
            assert row[0] == 1 and (np.diff(row[:used]) >= 0).all() and row[used - 1] == len(change) + 1
            starts = np.concatenate([[0], change])
            assert (b.positions[i, starts] == 0).all()
    response_cell = np.zeros(b.shape, bool)
    for i, j in zip(*np.nonzero(seg), strict=True):
        s = steps[int(b.sample_index[i, j])]
        response_cell[i, j] = b.positions[i, j] >= len(s.prompt_ids)
    for name in _STREAMS:
        assert not np.asarray(getattr(b, name))[~response_cell].any(), name
    assert (b.temperatures[seg == 0] == 1.0).all()
    assert not b.tokens[seg == 0].any() and not b.positions[seg == 0].any()
    assert r.metrics["packing_efficiency"] == pytest.approx(
        sum(s.num_tokens for s in steps) / (rows * seq_len)
    )
    assert [a.tolist() for a in unpack_responses(b.advantages, r.layout)] == [
        u["advantages"].tolist() for u in out
    ]


# ----------------------------------------------------------------------------------------
# Mini-batches
# ----------------------------------------------------------------------------------------


def _group_batch(num_prompts, seed=0):
    """Prompts with 1-3 trajectories of 1-3 turns each (linear), interleaved order."""
    rng = np.random.default_rng(seed)
    steps = []
    for q in range(num_prompts):
        for rep in range(int(rng.integers(1, 4))):
            turns = int(rng.integers(1, 4))
            full = [q + 1]
            for t in range(turns):
                prompt = full + rng.integers(1, 50, int(rng.integers(0, 3))).tolist()
                resp = rng.integers(1, 50, int(rng.integers(1, 5))).tolist()
                steps.append(Step(prompt, resp, (f"p{q}", rep), is_last_step=t == turns - 1))
                full = prompt + resp
    order = rng.permutation(len(steps))
    # keep turn order within trajectories: stable sort of a random key per trajectory
    key = {}
    for i in order:
        key.setdefault(steps[i].trajectory_id, len(key))
    return StepBatch(sorted(steps, key=lambda s: key[s.trajectory_id]))


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("dp", [1, 4])
def test_mini_batches_hold_exactly_the_requested_prompts(balance, dp):
    batch = _group_batch(12)
    adv = [np.arange(len(s.response_ids), dtype=np.float32) + 10 * i for i, s in enumerate(batch)]
    mbs = list(
        make_mini_batches(
            batch, mini_batch_prompts=3, seq_len=32, advantages=adv, data_parallel=dp, balance_tokens=balance
        )
    )
    assert len(mbs) == 4  # optimizer steps = prompts / mini_batch_prompts
    seen = []
    for k, mb in enumerate(mbs):
        src = mb.layout.source_index.tolist()
        prompts = {batch[i].trajectory_id.instance_id for i in src}
        assert len(prompts) == 3 and set(mb.group_keys) == prompts
        assert mb.metrics["num_prompts"] == 3 and mb.metrics["mini_batch"] == k
        # whole groups: every step of each prompt is in this mini-batch
        assert sorted(src) == [i for i, s in enumerate(batch) if s.trajectory_id.instance_id in prompts]
        rows = mb.batch.shape[0]
        assert rows % dp == 0
        padding = mb.batch.segment_ids.sum(axis=1) == 0
        assert int(padding.sum()) == mb.metrics["padding_rows"]
        assert not mb.batch.loss_mask[padding].any() and not mb.batch.rl_weights[padding].any()
        for u in unpack(mb.batch, mb.layout):
            np.testing.assert_array_equal(u["advantages"], adv[u["source_index"]])
            assert u["response_ids"].tolist() == list(batch[u["source_index"]].response_ids)
            assert mb.group_keys[u["group_index"]] == batch[u["source_index"]].trajectory_id.instance_id
        seen += src
    assert sorted(seen) == list(range(len(batch)))


def test_mini_batches_order_shuffle_and_errors():
    batch = _group_batch(6, seed=3)
    plain = [mb.group_keys for mb in make_mini_batches(batch, mini_batch_prompts=2, seq_len=32)]
    first_seen = list(dict.fromkeys(s.trajectory_id.instance_id for s in batch))
    assert first_seen != sorted(first_seen)  # the batch interleaves prompts
    assert plain == [tuple(first_seen[0:2]), tuple(first_seen[2:4]), tuple(first_seen[4:6])]
    a = [mb.group_keys for mb in make_mini_batches(batch, mini_batch_prompts=2, seq_len=32, shuffle_seed=5)]
    b = [mb.group_keys for mb in make_mini_batches(batch, mini_batch_prompts=2, seq_len=32, shuffle_seed=5)]
    assert a == b and sorted(k for g in a for k in g) == [f"p{q}" for q in range(6)]
    with pytest.raises(ValueError, match="6 prompt groups, not a multiple of mini_batch_prompts=4"):
        make_mini_batches(batch, mini_batch_prompts=4, seq_len=32)  # raised eagerly, before iteration
    with pytest.raises(ValueError, match="advantages has 1 entries but the batch has"):
        make_mini_batches(batch, mini_batch_prompts=2, seq_len=32, advantages=[[0.0]])


def test_balance_tokens_evens_out_mini_batches():
    # Group token totals 40, 30, 20, 10: in order -> (40+30, 20+10); balanced -> (40+10, 30+20).
    steps = [Step([1] * (n - 1), [2], (f"p{k}", 0)) for k, n in enumerate([40, 30, 20, 10])]
    tokens = [
        mb.metrics["real_tokens"]
        for mb in make_mini_batches(steps, mini_batch_prompts=2, seq_len=64, balance_tokens=True)
    ]
    assert tokens == [50, 50]
    tokens = [mb.metrics["real_tokens"] for mb in make_mini_batches(steps, mini_batch_prompts=2, seq_len=64)]
    assert tokens == [70, 30]
