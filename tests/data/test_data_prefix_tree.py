"""Prefix-tree packing (design §2.6): hand cases, and properties of random step-wise batches checked
against references that do not use the packer's own arithmetic (ancestor sets walked from ``parents``,
the plain packing's ``unpack``, the steps themselves)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from random_steps import prefix_sharing_steps

from rljax.core.segments import samples_per_token
from rljax.data.batch import StepBatch
from rljax.data.merge import merge_steps
from rljax.data.micro_batch import split_by_token_budget
from rljax.data.pack import make_mini_batches, pack, prefix_tree_units, unpack
from rljax.types import Step


def test_hand_case_every_tree_column():
    # a group of two sharing prompt [1, 2, 3, 4], a third sample sharing [1, 2], and an unrelated one
    steps = [
        Step([1, 2, 3, 4], [5, 6], ("q", 0), loss_mask=[1, 0]),
        Step([1, 2, 3, 4], [7], ("q", 1)),
        Step([1, 2, 9], [8, 8], ("r", 0), temperature=0.5),
        Step([3], [4], ("s", 0)),
    ]
    r = pack(steps, seq_len=16, prefix_sharing=True, advantages=[[1.0, 2.0], [3.0], [4.0, 5.0], [6.0]])
    b = r.batch
    # depth-first: the samples sorted by prompt ([1,2,3,4] x2, [1,2,9], [3]); columns 0-5 are sample 0,
    # 6 sample 1's response, 7-9 sample 2 from depth 2, 10-11 sample 3
    assert b.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 9, 8, 8, 3, 4, 0, 0, 0, 0]]
    assert b.positions.tolist() == [[0, 1, 2, 3, 4, 5, 4, 2, 3, 4, 0, 1, 0, 0, 0, 0]]
    assert b.parents.tolist() == [[-1, 0, 1, 2, 3, 4, 3, 1, 7, 8, -1, 10, -1, -1, -1, -1]]
    assert b.subtree_end.tolist() == [[9, 9, 6, 6, 5, 5, 6, 9, 9, 9, 11, 11, 0, 0, 0, 0]]
    assert b.segment_ids.tolist() == [[1, 1, 1, 1, 1, 1, 2, 3, 3, 3, 4, 4, 0, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 0]]
    assert b.advantages.tolist() == [[0, 0, 0, 0, 1, 2, 3, 0, 4, 5, 0, 6, 0, 0, 0, 0]]
    assert b.temperatures[0, 7:10].tolist() == [0.5] * 3
    assert (r.metrics["sample_tokens"], r.metrics["real_tokens"], r.metrics["shared_prefix_tokens"]) == (
        18,
        12,
        6,
    )
    # tokens 0-1 lie on samples 0, 1, 2; tokens 2-3 on samples 0 and 1
    assert (
        np.asarray(samples_per_token(b.segment_ids, b.subtree_end))[0, :12].tolist() == [3, 3, 2, 2] + [1] * 8
    )
    out = unpack(b, r.layout)
    assert [(o["prompt_ids"].tolist(), o["response_ids"].tolist()) for o in out] == [
        (list(s.prompt_ids), list(s.response_ids)) for s in steps
    ]
    assert [o["segment_id"] for o in out] == [1, 2, 3, 4]
    assert out[2]["positions"].tolist() == [0, 1, 2, 3, 4] and out[2]["temperature"] == 0.5


def test_a_tree_longer_than_a_row_splits_into_subtrees_that_share_the_prompt():
    prompt = list(range(1, 11))  # 10 prompt tokens
    steps = [Step(prompt, [20 + i] * 5, ("q", i)) for i in range(4)]  # as one tree: 10 + 4 * 5 = 30
    r = pack(steps, seq_len=24, prefix_sharing=True)
    # two subtrees of 10 + 2 * 5 = 20 tokens, one per row; the prompt is laid out in each
    assert r.batch.shape == (2, 24) and r.metrics["real_tokens"] == 40
    for row in r.batch.tokens.tolist():
        assert row[:10] == prompt and row.count(0) == 4
    assert prefix_tree_units(np.array([15] * 4), np.array([0, 10, 10, 10]), 24) == [
        pytest.approx(np.array([0, 1])),
        pytest.approx(np.array([2, 3])),
    ]
    # trees can bin-pack worse than their samples: A, B (7 tokens, sharing 1) and C, D (3, sharing 2)
    # are trees of 7, 7 and 4 tokens (3 rows of 10), the samples 2 rows (7 + 3): each sample its own tree
    steps = [Step([1, 2], [3] * 5, ("a", i)) for i in range(2)] + [
        Step([5, 6], [7], ("c", i)) for i in range(2)
    ]
    steps[1] = steps[1].replace(prompt_ids=[1, 4])
    r = pack(steps, seq_len=10, prefix_sharing=True)
    assert r.batch.shape == (2, 10) and r.metrics["shared_prefix_tokens"] == 0
    assert r.batch.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, 5, -1, 7, 8]
    # a deeper shared prefix stays together: children of the root that share 8 more tokens
    lens, lcp = np.array([12, 12, 12, 12]), np.array([0, 2, 10, 2])
    units = prefix_tree_units(lens, lcp, capacity=16)
    assert [u.tolist() for u in units] == [[0], [1, 2], [3]]


def test_loss_tokens_and_routing_disagreement_are_never_shared():
    # the same prompt and response twice: only the prompt is shared (response tokens carry a loss)
    steps = [Step([1, 2, 3], [4, 5], ("q", i)) for i in range(2)]
    r = pack(steps, seq_len=16, prefix_sharing=True)
    assert r.batch.tokens[0, :7].tolist() == [1, 2, 3, 4, 5, 4, 5] and r.metrics["real_tokens"] == 7
    # the samplers routed prompt token 1 differently: the samples share token 0 only
    routing = [np.zeros((4, 1, 2), int), np.zeros((4, 1, 2), int)]
    routing[1][1] = [[1, 2]]
    steps = [s.replace(routed_experts=e) for s, e in zip(steps, routing, strict=True)]
    r = pack(steps, seq_len=16, prefix_sharing=True)
    assert r.metrics["real_tokens"] == 9 and r.batch.parents[0, 5].tolist() == 0
    # a prompt with no response: its last token is its own (every sample owns at least one token)
    r = pack([Step([1, 2], [], ("q", 0)), Step([1, 2], [3], ("q", 1))], seq_len=8, prefix_sharing=True)
    assert r.batch.tokens[0, :4].tolist() == [1, 2, 2, 3] and r.batch.parents[0, :4].tolist() == [-1, 0, 0, 2]


def _ancestors(parents: np.ndarray, i: int) -> list[int]:
    chain = []
    while i >= 0:
        chain.append(i)
        i = int(parents[i])
    return chain[::-1]


def _check_tree_rows(steps, r, plain):
    """Every property of a tree-packed result ``r`` against references (see the module docstring)."""
    b, layout = r.batch, r.layout
    rows, seq_len = b.shape
    par, end, seg = np.asarray(b.parents), np.asarray(b.subtree_end), np.asarray(b.segment_ids)
    # the mask j <= i <= end[j] is exactly "j is i or one of its ancestors", and positions are depths
    col = np.arange(seq_len)
    for row in range(rows):
        real = np.flatnonzero(seg[row] != 0)
        sees = (col[None, :] <= col[:, None]) & (col[:, None] <= end[row][None, :])
        ancestors = np.zeros((seq_len, seq_len), bool)
        for i in real.tolist():
            chain = _ancestors(par[row], i)
            ancestors[i, chain] = True
            assert b.positions[row, i] == len(chain) - 1
        np.testing.assert_array_equal(sees[real], ancestors[real])
        assert (par[row][seg[row] == 0] == -1).all()
    # each sample is a root-to-leaf path of its row holding exactly its tokens (prompt + kept response)
    dest, _, is_response = layout.flat_index()
    lengths = layout.lengths
    cols = np.split(dest, np.cumsum(lengths)[:-1])
    holders = np.zeros(rows * seq_len, np.int64)
    for k, c in enumerate(cols):
        row = int(c[0]) // seq_len
        assert (c // seq_len == row).all(), "a sample spans rows"
        assert _ancestors(par[row], int(c[-1]) % seq_len) == (c % seq_len).tolist()
        expect = list(steps[k].prompt_ids) + list(steps[k].response_ids)[: layout.response_lens[k]]
        assert b.tokens.reshape(-1)[c].tolist() == expect
        holders[c] += 1
        if steps[k].routed_experts is not None:
            rec = np.asarray(steps[k].routed_experts)[: len(c) - 1]
            np.testing.assert_array_equal(b.routed_experts.reshape(-1, *rec.shape[1:])[c[:-1]], rec)
    # response tokens (the only ones that can carry a loss) are never shared
    assert (holders[dest[is_response]] == 1).all()
    # (padded to one shape: one compiled program for every example)
    pad = ((0, 16 - rows), (0, 96 - seq_len))
    counts = np.asarray(samples_per_token(np.pad(seg, pad), np.pad(end, pad)))[:rows, :seq_len]
    np.testing.assert_array_equal(counts.reshape(-1), holders.astype(np.float32))
    # each sample's response is one run of a segment id no other sample of its row uses
    for k, c in enumerate(cols):
        resp = c[layout.prompt_lens[k] :]
        if resp.size:
            assert (np.diff(resp) == 1).all()
            owner = seg.reshape(-1)[resp]
            assert (owner == owner[0]).all()
            others = [
                int(seg.reshape(-1)[o[-1]])
                for j, o in enumerate(cols)
                if j != k and o[0] // seq_len == c[0] // seq_len
            ]
            assert int(owner[0]) not in others
    # unpack restores every sample and stream exactly as plain packing does
    tree_out, plain_out = unpack(b, layout), unpack(plain.batch, plain.layout)
    for t, p in zip(tree_out, plain_out, strict=True):
        for key, value in p.items():
            if key not in ("row", "segment_id"):
                np.testing.assert_array_equal(t[key], value, err_msg=key)
    assert r.metrics["sample_tokens"] == plain.metrics["real_tokens"]
    assert r.metrics["real_tokens"] == int((seg != 0).sum()) <= plain.metrics["real_tokens"]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    groups=st.integers(1, 3),
    group_size=st.integers(1, 4),
    max_turns=st.integers(1, 3),
    merged=st.booleans(),
    routed=st.booleans(),
    seq_len=st.sampled_from([24, 40, 96]),
)
def test_random_step_wise_batches(seed, groups, group_size, max_turns, merged, routed, seq_len):
    rng = np.random.default_rng(seed)
    steps = prefix_sharing_steps(
        rng, groups=groups, group_size=group_size, max_turns=max_turns, routing=(2, 2, 4) if routed else None
    )
    if merged:
        steps = list(merge_steps(StepBatch(steps)).steps)
    adv = [rng.normal(size=len(s.response_ids)) for s in steps]
    plain = pack(steps, seq_len=seq_len, truncate=True, advantages=adv)
    tree = pack(steps, seq_len=seq_len, truncate=True, advantages=adv, prefix_sharing=True)
    _check_tree_rows(steps, tree, plain)
    assert tree.batch.shape[0] <= plain.batch.shape[0]


def test_mini_batches_and_micro_batches_keep_the_trees():
    rng = np.random.default_rng(3)
    steps = prefix_sharing_steps(rng, groups=4, group_size=2, max_turns=2)
    mbs = list(make_mini_batches(steps, mini_batch_prompts=2, seq_len=40, prefix_sharing=True))
    plain = list(make_mini_batches(steps, mini_batch_prompts=2, seq_len=40))
    assert len(mbs) == 2
    for mb, ref in zip(mbs, plain, strict=True):
        _check_tree_rows([steps[i] for i in mb.layout.source_index], mb, ref)
    micro = split_by_token_budget(mbs[0].batch, micro_batch_tokens=40)
    rows = mbs[0].batch.shape[0]
    np.testing.assert_array_equal(micro.parents.reshape(-1, 40)[:rows], mbs[0].batch.parents)
    assert (micro.parents.reshape(-1, 40)[rows:] == -1).all()
