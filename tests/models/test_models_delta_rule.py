"""The Gated DeltaNet math (rljax.models.delta_rule) against float64 numpy references written here:
the naive token-by-token recurrence of Yang et al. 2024 (eq. 10) and a per-sample zero-padded
convolution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import delta_rule as dr


def _naive_delta_rule(q, k, v, g, beta, resets, state):
    """``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``, state zeroed
    before each reset token: float64 loops, one head at a time."""
    b, t, h, _ = k.shape
    state = np.array(state, np.float64)
    out = np.zeros((b, t, h, v.shape[-1]))
    for i in range(b):
        for s in range(t):
            if resets[i, s]:
                state[i] = 0.0
            for j in range(h):
                prev = np.exp(g[i, s, j]) * state[i, j]
                state[i, j] = prev + beta[i, s, j] * np.outer(k[i, s, j], v[i, s, j] - prev.T @ k[i, s, j])
                out[i, s, j] = state[i, j].T @ q[i, s, j]
    return out, state


def _inputs(rng, b=2, t=37, h=3, dk=5, dv=4):
    norm = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True))  # noqa: E731
    q = norm(rng.normal(size=(b, t, h, dk))) / np.sqrt(dk)
    k = norm(rng.normal(size=(b, t, h, dk)))
    v = rng.normal(size=(b, t, h, dv))
    g = -np.abs(rng.normal(size=(b, t, h)))  # log decays <= 0
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, t, h))))
    return q, k, v, g, beta


# Row 0: three samples (10 + 20 + 7), its first continuing the state it is given; row 1: a sample of
# 5 that restarts, one of 30, then 2 padding tokens (beta = g = 0: no write, no decay).
SEGMENTS = np.array([[1] * 10 + [2] * 20 + [3] * 7, [1] * 5 + [2] * 30 + [0] * 2])
PREV_SEGMENT = np.array([1, 5])


@pytest.mark.parametrize("chunk_size", [8, 64])
def test_chunked_and_recurrent_forms_equal_the_naive_recurrence_in_float64(chunk_size):
    rng = np.random.default_rng(0)
    q, k, v, g, beta = _inputs(rng)
    valid = (SEGMENTS != 0)[..., None]
    g, beta = g * valid, beta * valid
    state0 = rng.normal(size=(2, 3, 5, 4))
    with jax.enable_x64(True):
        resets = np.asarray(dr.sample_resets(jnp.asarray(SEGMENTS), jnp.asarray(PREV_SEGMENT)))
        want_o, want_s = _naive_delta_rule(q, k, v, g, beta, resets, state0)
        args = [jnp.asarray(a) for a in (q, k, v, g, beta, resets, state0)]
        chunked = jax.jit(dr.gated_delta_rule_chunked, static_argnames="chunk_size")
        o, s = chunked(*args, chunk_size=chunk_size)
        assert o.dtype == jnp.float64 and o.shape == (2, 37, 3, 4) and s.shape == (2, 3, 5, 4)
        np.testing.assert_allclose(np.asarray(o), want_o, atol=1e-12, rtol=0)
        np.testing.assert_allclose(np.asarray(s), want_s, atol=1e-12, rtol=0)
        if chunk_size == 64:  # the decoding form, once
            o, s = jax.jit(dr.gated_delta_rule_recurrent)(*args)
            np.testing.assert_allclose(np.asarray(o), want_o, atol=1e-12, rtol=0)
            np.testing.assert_allclose(np.asarray(s), want_s, atol=1e-12, rtol=0)
    assert resets.astype(int).tolist()[0][:12] == [0] * 10 + [1, 0] and resets[1, 0] and resets[1, 5]
    assert np.abs(want_o).max() > 0.5  # non-trivial outputs


def test_chunked_gradients_equal_the_recurrences_in_float64():
    """Training differentiates the chunked form: its gradients (w.r.t. every input) are those of the
    token-by-token recurrence."""
    rng = np.random.default_rng(1)
    q, k, v, g, beta = _inputs(rng, t=21)
    seg = np.array([[1] * 9 + [2] * 12, [1] * 21])
    cot = rng.normal(size=(2, 21, 3, 4))
    with jax.enable_x64(True):
        resets = dr.sample_resets(jnp.asarray(seg))

        def loss(form, *xs):
            o, s = form(*xs, resets)
            return jnp.sum(o * cot) + jnp.sum(s**2)

        chunked = lambda *xs: dr.gated_delta_rule_chunked(*xs, chunk_size=8)  # noqa: E731
        xs = [jnp.asarray(a) for a in (q, k, v, g, beta)]
        want = jax.jit(jax.grad(lambda *a: loss(dr.gated_delta_rule_recurrent, *a), argnums=range(5)))(*xs)
        got = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=range(5)))(*xs)
    for w, o in zip(want, got, strict=True):
        np.testing.assert_allclose(np.asarray(o), np.asarray(w), atol=1e-11, rtol=0)


def test_step_restarts_a_reset_row_and_padding_leaves_the_state_unchanged():
    rng = np.random.default_rng(2)
    q, k, v, g, beta = (a[:, 0] for a in _inputs(rng, t=1))
    state = jnp.asarray(rng.normal(size=(2, 3, 5, 4)), jnp.float32)
    o, new = dr.gated_delta_rule_step(q, k, v, np.zeros_like(g), np.zeros_like(beta), state)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(state))  # beta = g = 0: a no-op token
    o, new = dr.gated_delta_rule_step(q, k, v, g, beta, state, jnp.array([True, False]))
    fresh, _ = _naive_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                 np.array([[1], [0]]), np.asarray(state))  # fmt: skip
    np.testing.assert_allclose(np.asarray(o), fresh[:, 0], atol=1e-5)


def _naive_conv(x, w, seg):
    """Each sample's own zero-padded causal convolution, float64."""
    out = np.zeros_like(x, dtype=np.float64)
    taps = w.shape[0]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for j in range(taps):
                s = t - (taps - 1) + j
                if s >= 0 and seg[b, s] == seg[b, t]:
                    out[b, t] += w[j] * x[b, s]
    return out


def test_causal_conv1d_never_crosses_a_sample_boundary_and_its_window_continues_a_row():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 12, 5)).astype(np.float32)
    w = rng.normal(size=(4, 5)).astype(np.float32)
    seg = np.array([[0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2], [1] * 6 + [2] * 2 + [0] * 4])
    conv, conv_window = jax.jit(dr.causal_conv1d), jax.jit(dr.conv_window)
    got = conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(got), _naive_conv(x, w, seg), atol=1e-5)
    # Cut row 0 after 9 tokens: the window of the first part continues the second exactly.
    window, wseg = conv_window(
        jnp.asarray(x[:, :9]), jnp.asarray(seg[:, :9]), jnp.zeros((2, 3, 5)), jnp.array([-1, -1])
    )
    assert wseg.tolist() == [2, 2]
    np.testing.assert_array_equal(np.asarray(window[0, 1:]), x[0, 7:9])  # zeros before sample 2
    assert not np.asarray(window[0, 0]).any()
    rest = conv(jnp.asarray(x[:, 9:]), jnp.asarray(w), jnp.asarray(seg[:, 9:]), window=window,
                            window_segment=wseg)  # fmt: skip
    np.testing.assert_allclose(np.asarray(rest[0]), _naive_conv(x, w, seg)[0, 9:], atol=1e-5)
    # Row 1's new tokens are padding only: it keeps the window of its last valid token.
    np.testing.assert_array_equal(np.asarray(window[1, 1:]), x[1, 6:8])
    kept, kseg = conv_window(jnp.asarray(x[:, 9:]), jnp.asarray(seg[:, 9:]), window, wseg)
    np.testing.assert_array_equal(np.asarray(kept[1]), np.asarray(window[1]))
    assert kseg.tolist() == [2, 2]
