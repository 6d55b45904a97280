"""The decode-attention kernel (``rljax.models.panel_matmul.decode_attention``) against float64 numpy,
and the decode steps that run it (keys stored transposed on the CPU) against the XLA path.

Reference bound (first order, a priori: it holds on any machine): a score is a float32 dot product of
length D, off by at most ``D eps32 scale (|q| . |k|)`` (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., eq. 3.5); the softmax moves its weights by at most twice the largest score
error in sum (plus a few ulp of the exp), and the output, a convex combination of S value rows, adds
``(S + 8) eps32 max|v|``: ``|out - ref| <= max|v| (2 D eps32 scale max(|q| . |k|) + (S + 8) eps32)``,
doubled as a margin. A wrong slot, head, mask or thread split gives errors of the size of the
outputs themselves.

Tests that run the kernel skip, with the reason, where it cannot be built, and fail there instead
under ``RLJAX_REQUIRE_PANEL_KERNEL=1`` (``tests/panel_kernel.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from panel_kernel import require_panel_kernel
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.models import panel_matmul as pm

EPS32 = float(np.finfo(np.float32).eps)

# (B, K, G, D, S): one and several kv heads and queries per kv head (the pairs of queries the kernel
# takes together and a single one left over), head dims of 8 / 64 / 128 (the 64-wide value blocks
# and a partial one), slot counts below, at and past a multiple of 8 and of the 1,024-slot tile, and
# caches large enough to be shared with XLA's thread pool (the last three).
SHAPES = [
    (1, 1, 1, 8, 1),
    (2, 2, 2, 8, 5),
    (2, 3, 3, 64, 37),
    (3, 1, 1, 128, 70),
    (1, 2, 5, 24, 17),
    (4, 4, 2, 64, 256),
    (2, 2, 2, 64, 1100),
    (8, 3, 3, 64, 300),
]


def _reference(q, keys, values, valid, scale):
    """float64: q [C, G, D], keys [C, D, S], values [C, S, D], valid [B, S]."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    c = q.shape[0]
    ok = np.repeat(np.asarray(valid) != 0, c // valid.shape[0], axis=0)  # [C, S]
    scores = np.einsum("cgd,cds->cgs", q, keys) * scale
    scores = np.where(ok[:, None, :], scores, -np.inf)
    none = ~ok.any(axis=1)
    scores[none] = 0.0  # no slot to attend: a uniform average (the XLA path's finite mask value)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("cgs,csd->cgd", p, values)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_numpy(shape, jit):
    require_panel_kernel()
    b, k, g, d, s = shape
    rng = np.random.default_rng(sum(shape))
    q = rng.standard_normal((b * k, g, d)).astype(np.float32)
    keys = rng.standard_normal((b * k, d, s)).astype(np.float32)
    values = rng.standard_normal((b * k, s, d)).astype(np.float32)
    valid = (rng.random((b, s)) < 0.7).astype(np.int32)
    valid[0, :] = 0  # row 0 attends to nothing: the uniform average
    if b > 1:
        valid[1, :] = 1
    fn = jax.jit(pm.decode_attention, static_argnames="scale") if jit else pm.decode_attention
    got = np.asarray(
        fn(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(valid), scale=d**-0.5)
    )
    want = _reference(q, keys, values, valid, d**-0.5)
    qk = (np.abs(q).astype(np.float64) @ np.abs(keys).astype(np.float64)).max()  # max |q| . |k| (batched)
    bound = 2 * np.abs(values).max() * (2 * d * EPS32 * d**-0.5 * qk + (s + 8) * EPS32)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    # a wrong slot or head is caught: the bound is well below the size of the outputs
    assert bound < 0.1 * np.abs(want).max()


def test_bad_operands_raise_clear_errors():
    require_panel_kernel()
    q, keys, values = jnp.zeros((4, 2, 8)), jnp.zeros((4, 8, 5)), jnp.zeros((4, 5, 8))
    valid = jnp.ones((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="do not match"):
        pm.decode_attention(q, values, values, valid, scale=1.0)  # keys not transposed
    with pytest.raises(ValueError, match="do not match"):
        pm.decode_attention(q, keys, values, jnp.ones((3, 5), jnp.int32), scale=1.0)  # 4 entries, 3 rows
    with pytest.raises(ValueError, match="do not match"):
        pm.decode_attention(
            jnp.zeros((4, 2, 6)), jnp.zeros((4, 6, 5)), jnp.zeros((4, 5, 6)), valid, scale=1.0
        )


@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_decode_steps_with_the_kernel_match_the_xla_path(helpers, num_kv_heads):
    """Prefill + decode steps with keys stored transposed (the kernel runs each step on the CPU)
    give the logits of the plain layout (XLA's attention), left-padded rows and grown caches included."""
    require_panel_kernel()
    cfg = models.tiny_config(
        vocab_size=61, hidden_size=48, num_heads=6, num_kv_heads=num_kv_heads, head_dim=16
    )
    model = helpers.random_decoder(cfg, seed=5)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 61, (3, 9)), jnp.int32)
    seg = jnp.asarray(np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9, [0] * 8 + [1]], np.int32))
    runs = {}
    for transposed in (False, True):
        logits, cache, _ = models.prefill(
            model, tokens, segment_ids=seg, max_length=12, transposed_keys=transposed
        )
        seen = [logits]
        for j in range(6):
            if j == 3:
                cache = models.grow_cache(cache, 16)
            logits, cache, _ = models.decode_step(
                model, jnp.argmax(seen[-1], axis=-1).astype(jnp.int32), cache
            )
            seen.append(logits)
        runs[transposed] = jax.nn.log_softmax(jnp.stack(seen), axis=-1)
    hlo = jax.jit(models.decode._decode_step.__wrapped__).lower(model, tokens[:, 0], cache).as_text()
    assert pm.DECODE_ATTENTION_TARGET in hlo  # the transposed cache's step runs the kernel
    np.testing.assert_allclose(runs[True], runs[False], **LOGPROB_TOL)
