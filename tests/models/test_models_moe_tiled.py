"""The "tiled" grouped expert compute (the CPU default) and its hand-written VJPs (custom_vjp over the
tile loop, the dispatch gather and the gate-weighted combine) against ``jax.grad`` of the all-experts
reference (``impl="dense"``), in float64 so that only summation order differs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import moe

# float64 reassociation noise of these sums (|values| ~ 1e2): ~1e-13; the bound leaves room.
RTOL, ATOL = 1e-10, 1e-10


def _problem(rows=37, hidden=16, experts=6, inter=12, k=3, seed=0, dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(seed), 8)
    x = jax.random.normal(keys[0], (rows, hidden), dtype)
    w = [
        jax.random.normal(kk, s, dtype)
        for kk, s in zip(
            keys[1:4],
            [(experts, hidden, inter), (experts, hidden, inter), (experts, inter, hidden)],
            strict=True,
        )
    ]
    # ids in [-1, E]: -1 and E are "no expert" (e.g. padding in the expert-parallel exchange)
    groups = jax.random.randint(keys[4], (rows, k), -1, experts + 1)
    gates = jax.random.normal(keys[5], (rows, k), dtype)
    return x, w, groups, gates, keys[6]


@pytest.fixture(params=["loop", "batched"])
def tile_path(request, monkeypatch):
    """Both tile computations: the loop over tiles (large tiles) and the batched matmul (small)."""
    monkeypatch.setattr(moe, "LOOP_MIN_TILE_MACS", 0 if request.param == "loop" else 1 << 62)
    return request.param


def _assert_trees_close(got, ref):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tile", [None, 1, 3, 8, 64])
def test_tiled_grouped_ffn_values_and_grads_equal_reference_float64(tile, tile_path):
    with jax.enable_x64(True):
        x, w, groups, _, key = _problem()
        ct = jax.random.normal(key, (*groups.shape, x.shape[1]), jnp.float64)

        def loss(impl, tile=None):
            return lambda x, *w: jnp.sum(moe.grouped_ffn(x, groups, *w, impl=impl, tile=tile) * ct)

        ref = jax.value_and_grad(loss("dense"), argnums=(0, 1, 2, 3))(x, *w)
        got = jax.jit(jax.value_and_grad(loss("tiled", tile), argnums=(0, 1, 2, 3)))(x, *w)
        _assert_trees_close(got, ref)


@pytest.mark.parametrize("seed,k", [(0, 3), (1, 1), (2, 4)])
def test_tiled_moe_ffn_values_and_grads_equal_reference_float64(seed, k, tile_path):
    """moe_ffn's fused combine (gate-weighted gather-sum) included: grads w.r.t. x, gates and experts."""
    with jax.enable_x64(True):
        x, w, groups, gates, key = _problem(k=k, seed=seed)
        ct = jax.random.normal(key, x.shape, jnp.float64)

        def loss(impl):
            return lambda x, gates, *w: jnp.sum(moe.moe_ffn(x, groups, gates, *w, impl=impl) * ct)

        ref = jax.value_and_grad(loss("dense"), argnums=(0, 1, 2, 3, 4))(x, gates, *w)
        got = jax.jit(jax.value_and_grad(loss("tiled"), argnums=(0, 1, 2, 3, 4)))(x, gates, *w)
        _assert_trees_close(got, ref)


def test_tiled_skewed_routing_and_all_to_one_expert(tile_path):
    """Dropless under the worst case (every pair on one expert) and with most experts empty."""
    with jax.enable_x64(True):
        x, w, _, gates, _ = _problem(rows=29, k=2)
        for groups in (jnp.full((29, 2), 4), jnp.stack([jnp.full((29,), 0), jnp.arange(29) % 2], axis=1)):

            def loss(impl, groups=groups):
                return lambda x, *w: jnp.sum(jnp.sin(moe.moe_ffn(x, groups, gates, *w, impl=impl)))

            ref = jax.value_and_grad(loss("dense"), argnums=(0, 1, 2, 3))(x, *w)
            got = jax.jit(jax.value_and_grad(loss("tiled"), argnums=(0, 1, 2, 3)))(x, *w)
            _assert_trees_close(got, ref)


def test_tiled_bfloat16_grads_keep_dtypes_and_match_float32_reference(tile_path):
    """bf16 inputs: grads come back in bf16 (weight grads accumulated in float32 over the tiles)."""
    x, w, groups, gates, _ = _problem(dtype=jnp.float32)

    def loss(impl):
        return lambda x, gates, *w: jnp.sum(moe.moe_ffn(x, groups, gates, *w, impl=impl).astype(jnp.float32))

    ref = jax.grad(loss("dense"), argnums=(0, 1, 2, 3, 4))(x, gates, *w)
    bf = [a.astype(jnp.bfloat16) for a in (x, gates, *w)]
    got = jax.jit(jax.grad(loss("tiled"), argnums=(0, 1, 2, 3, 4)))(*bf)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), atol=0.05 * scale)


def test_tiled_backward_moves_rows_by_gathers_only(monkeypatch):
    """No float scatter in the looped tiled fwd+bwd (XLA's transpose of a row gather is a slow
    scatter-add)."""
    monkeypatch.setattr(moe, "LOOP_MIN_TILE_MACS", 0)
    x, w, groups, gates, _ = _problem(dtype=jnp.float32)
    groups = jnp.clip(groups, 0, 5)

    def loss(x, gates, *w):
        return jnp.sum(moe.moe_ffn(x, groups, gates, *w, impl="tiled") ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, gates, *w).compile().as_text()
    scatters = re.findall(r"= (\w+)\[[^\]]*\]\S* scatter\(", hlo)
    assert all(t.startswith(("s", "u")) for t in scatters), scatters  # int index plans only
