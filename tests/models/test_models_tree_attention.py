"""Prefix-tree attention (design §2.6) against a float64 numpy reference whose mask is the ancestor
sets walked from random parent arrays: the XLA blocks (short, blocked and long rows), the fused
wrapper's blocks, and the backends that cannot take the tree mask falling back (logged)."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import attention_backends
from rljax.models.attention import attention_mask, causal_attention
from rljax.models.attention_backends import fused_causal_attention, self_attention, tree_attention_backend


def _random_tree_rows(rng: np.random.Generator, rows: int, length: int):
    """``(segment_ids, parents, subtree_end)`` of rows holding a few random trees in depth-first
    order, then padding: each token's parent is a token on the current root-to-leaf path (or none: a
    new tree). ``subtree_end`` is derived by a reverse sweep over the parents."""
    seg = np.zeros((rows, length), np.int32)
    parents = np.full((rows, length), -1, np.int32)
    for r in range(rows):
        used = int(rng.integers(length // 2, length + 1))
        path: list[int] = []
        for c in range(used):
            depth = int(rng.integers(0, len(path) + 1))  # 0: a new tree; else the parent's depth + 1
            path = path[:depth] + [c]
            parents[r, c] = path[-2] if depth else -1
            seg[r, c] = 1 + int(rng.integers(0, 3))  # segment ids do not matter to the tree mask
    ends = np.zeros((rows, length), np.int32)
    for r in range(rows):
        real = np.flatnonzero(seg[r])
        ends[r, real] = real
        for c in real[::-1].tolist():
            if parents[r, c] >= 0:
                ends[r, parents[r, c]] = max(ends[r, parents[r, c]], ends[r, c])
    return seg, parents, ends


def _ancestor_mask(seg, parents):
    rows, length = seg.shape
    mask = np.zeros((rows, length, length), bool)
    for r in range(rows):
        for i in range(length):
            mask[r, i, i] = True
            j = parents[r, i] if seg[r, i] else -1
            while j >= 0:
                mask[r, i, j] = True
                j = parents[r, j]
    return mask


def _np_attention(q, k, v, mask):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnts,bsnd->btnd", p / p.sum(-1, keepdims=True), v)


@pytest.fixture(scope="module")
def tree_qkv():
    rng = np.random.default_rng(0)
    seg, parents, ends = _random_tree_rows(rng, rows=2, length=24)
    q = rng.normal(size=(2, 24, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 24, 2, 8)).astype(np.float32) for _ in range(2))
    return q, k, v, seg, parents, ends


def test_tree_mask_is_the_ancestor_sets(tree_qkv):
    *_, seg, parents, ends = tree_qkv
    slots = jnp.arange(seg.shape[1])
    got = np.asarray(attention_mask(seg, seg, slots, slots, ends))
    want = _ancestor_mask(seg, parents)
    real = seg != 0
    np.testing.assert_array_equal(got[real], want[real])
    assert got.any(axis=-1).all()  # padding rows see at least themselves: no empty softmax


@pytest.mark.parametrize("block", [None, 8, 4])  # one block, 3 unrolled blocks, the long-row path
def test_xla_and_fused_blocks_equal_float64_reference(tree_qkv, block):
    q, k, v, seg, parents, ends = tree_qkv
    want = _np_attention(q, k, v, _ancestor_mask(seg, parents))
    real = seg != 0
    xla = functools.partial(causal_attention, block_size=block)
    fused = functools.partial(fused_causal_attention, block_size=block, implementation="xla")
    for fn in (xla, fused) if block == 8 else (xla,):  # the fused wrapper's blocks are the same code
        got = jax.jit(lambda q, k, v, s, e, fn=fn: fn(q, k, v, segment_ids=s, subtree_end=e))(
            q, k, v, seg, ends
        )
        np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=2e-5)


def test_backends_without_the_tree_mask_fall_back_and_say_so(tree_qkv, caplog, monkeypatch):
    assert tree_attention_backend("cudnn") == ("cudnn", None)
    assert tree_attention_backend("cudnn_ragged")[0] == "cudnn"
    assert "offsets" in tree_attention_backend("cudnn_ragged")[1]
    assert tree_attention_backend("splash")[0] == "xla" and "static" in tree_attention_backend("splash")[1]
    q, k, v, seg, parents, ends = tree_qkv
    monkeypatch.setattr(attention_backends, "_logged_fallbacks", set())

    def traced(fn, **kw):  # the program, traced (not compiled): the fallback must be the XLA path itself
        return str(
            jax.make_jaxpr(lambda q, k, v: fn(q, k, v, segment_ids=seg, subtree_end=ends, **kw))(q, k, v)
        )

    with caplog.at_level(logging.WARNING, logger=attention_backends.__name__):
        splash = traced(self_attention, backend="splash", max_block_size=None)
        traced(self_attention, backend="splash", max_block_size=None)
    assert [r.getMessage() for r in caplog.records] == [
        "prefix-tree rows: attention 'splash' runs as 'xla': " + tree_attention_backend("splash")[1]
    ]
    assert splash == traced(self_attention, backend="xla", max_block_size=None)
    assert splash != traced(self_attention, backend="xla", max_block_size=8)  # the comparison can fail
