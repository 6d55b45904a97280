"""Attention backends (model.attention): platform resolution and errors, the cuDNN wrapper's masks and
blocks (run with JAX's XLA implementation on CPU), the splash kernel in the Pallas interpreter, all
against a float64 numpy reference and the existing XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models import Decoder, attention_backends, tiny_config
from rljax.models.attention import attention_mask, causal_attention, grouped_attention
from rljax.models.attention_backends import (
    fused_causal_attention,
    packed_cudnn_attention,
    resolve_attention,
    runs_mask,
    segment_runs,
    splash_causal_attention,
)

B, T, N, K, D = 2, 40, 4, 2, 8


def reference_attention(q, k, v, seg) -> np.ndarray:
    """float64 numpy: ``out[b,i,h] = softmax_j(q.k/sqrt(D) masked by (j<=i) & same seg) v``, GQA."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    seg = np.asarray(seg)
    b, t, n, d = q.shape
    groups = n // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for h in range(n):
            s = q[bi, :, h] @ k[bi, :, h // groups].T / np.sqrt(d)
            mask = (np.arange(t)[None] <= np.arange(t)[:, None]) & (seg[bi][:, None] == seg[bi][None])
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[bi, :, h] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, h // groups]
    return out


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, N, D)).astype(np.float32)
    k = rng.standard_normal((B, T, K, D)).astype(np.float32)
    v = rng.standard_normal((B, T, K, D)).astype(np.float32)
    seg = np.zeros((B, T), np.int32)
    seg[0, :13], seg[0, 13:31], seg[0, 31:] = 1, 2, 3  # three packed samples
    seg[1, :25], seg[1, 25:34] = 1, 2  # two samples and 6 padding tokens
    return q, k, v, jnp.asarray(seg)


def test_resolve_attention_per_platform_and_clear_errors():
    assert resolve_attention("auto", platform="cpu") == "xla"
    assert resolve_attention("auto", platform="gpu", dtype=jnp.bfloat16) == "cudnn_ragged"
    assert resolve_attention("auto", platform="gpu", dtype=jnp.float32) == "xla"  # no fp32 cuDNN kernel
    assert resolve_attention("auto", platform="tpu") == "splash"
    assert resolve_attention("xla", platform="tpu") == "xla"
    assert resolve_attention("cudnn", platform="gpu", dtype=jnp.float16) == "cudnn"
    assert resolve_attention("cudnn_ragged", platform="gpu", dtype=jnp.bfloat16) == "cudnn_ragged"
    with pytest.raises(ValueError, match="'cudnn_ragged' needs a GPU"):
        resolve_attention("cudnn_ragged", platform="cpu")
    assert resolve_attention("splash", platform="tpu") == "splash"
    with pytest.raises(ValueError, match="'cudnn' needs a GPU.*runs on 'cpu'"):
        resolve_attention("cudnn", platform="cpu", dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="needs compute_dtype in"):
        resolve_attention("cudnn", platform="gpu", dtype=jnp.float32)
    with pytest.raises(ValueError, match="'splash' needs a TPU.*runs on 'gpu'"):
        resolve_attention("splash", platform="gpu")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_attention("flash", platform="cpu")
    assert resolve_attention("auto") == "xla"  # this test machine is CPU


@pytest.mark.parametrize("block_size", [None, 16])
def test_fused_wrapper_masks_equal_xla_path_and_float64_reference(qkv, block_size):
    q, k, v, seg = qkv
    fused = jax.jit(fused_causal_attention, static_argnames=("block_size", "implementation"))(
        q, k, v, segment_ids=seg, block_size=block_size, implementation="xla"
    )
    existing = jax.jit(causal_attention, static_argnames="block_size")(
        q, k, v, segment_ids=seg, block_size=block_size
    )
    assert fused.shape == existing.shape == (B, T, N, D)
    # two float32 programs of the same math (rounding only): 1e-5 is > 10x their measured gap (~6e-7)
    np.testing.assert_allclose(fused, existing, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(fused, reference_attention(q, k, v, seg), atol=1e-5, rtol=1e-5)


def test_fused_wrapper_gradients_equal_xla_path(qkv):
    q, k, v, seg = qkv
    w = np.random.default_rng(5).standard_normal((B, T, N, D)).astype(np.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)

    fused = grads(lambda q, k, v: fused_causal_attention(q, k, v, segment_ids=seg, block_size=16,
                                                         implementation="xla"))  # fmt: skip
    existing = grads(lambda q, k, v: causal_attention(q, k, v, segment_ids=seg, block_size=16))
    for a, b in zip(fused, existing, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_splash_kernel_in_interpret_mode_equals_reference(qkv):
    """The real Pallas splash kernel (interpreted on CPU): 40 tokens padded to one 128 block."""
    q, k, v, seg = qkv
    w = np.random.default_rng(6).standard_normal((B, T, N, D)).astype(np.float32)

    def splash_loss(q):
        out = splash_causal_attention(q, k, v, segment_ids=seg, interpret=True)
        return jnp.sum(out * w), out

    (_, out), g_splash = jax.jit(jax.value_and_grad(splash_loss, has_aux=True))(q)
    assert out.shape == (B, T, N, D)
    np.testing.assert_allclose(out, reference_attention(q, k, v, seg), atol=1e-5, rtol=1e-5)
    g_xla = jax.jit(jax.grad(lambda q: jnp.sum(causal_attention(q, k, v, segment_ids=seg) * w)))(q)
    np.testing.assert_allclose(g_splash, g_xla, atol=2e-5, rtol=1e-5)


def test_decoder_attention_option():
    cfg = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8, num_layers=1)
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 64
    forward = nnx.jit(lambda model, tokens: model(tokens))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert model.attention == "auto"
    auto = forward(model, tokens)
    model.attention = "xla"
    np.testing.assert_array_equal(auto, forward(model, tokens))  # auto on CPU is the unchanged XLA path
    for name, error in (("cudnn", "'cudnn' needs a GPU"), ("splash", "'splash' needs a TPU")):
        model.attention = name
        with pytest.raises(ValueError, match=error):
            forward(model, tokens)
    with pytest.raises(ValueError, match="attention must be one of"):
        Decoder(cfg, attention="flash", rngs=nnx.Rngs(0))


def test_segment_runs_are_the_packed_samples_as_cudnn_ragged_metadata(qkv):
    seg = qkv[3]
    lengths, offsets, count = segment_runs(seg, 4)
    # hand-computed from the fixture: row 0 = 13 + 18 + 9 tokens; row 1 = 25 + 9 + 6 padding
    assert lengths.tolist() == [[13, 18, 9, -1], [25, 9, 6, -1]]
    assert offsets.tolist() == [[0, 13, 31, -1, -1], [0, 25, 34, -1, -1]]
    assert count.tolist() == [3, 3]
    # the mask cuDNN's ragged causal kernel applies is the packing mask on every token
    slots = jnp.arange(T)
    np.testing.assert_array_equal(runs_mask(lengths, offsets, T), attention_mask(seg, seg, slots, slots))


def test_segment_runs_reports_rows_over_the_bound():
    seg = jnp.array([[1, 2, 3, 4, 0, 0]])
    lengths, offsets, count = segment_runs(seg, 3)
    assert count.tolist() == [5]  # more than 3: the caller must not use the (truncated) metadata
    assert lengths.tolist() == [[1, 1, 1]] and offsets.tolist() == [[0, 1, 2, -1]]


def ragged_reference_kernel(q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale):
    """Stands in for cuDNN's ragged causal kernel on CPU: attention under the mask its metadata means."""
    assert bias is None and mask is None and scale == pytest.approx(D**-0.5)
    assert q_seqlen is kv_seqlen and q_offsets is kv_offsets  # self-attention: one set of runs
    return grouped_attention(q, k, v, runs_mask(q_seqlen, q_offsets, q.shape[1]), precision="highest")


@pytest.mark.parametrize("max_runs", [3, 2])  # 2 < the fixture's 3 runs per row: the exact block path
def test_packed_cudnn_path_equals_reference_and_falls_back_over_the_bound(qkv, monkeypatch, max_runs):
    q, k, v, seg = qkv
    calls = []

    def kernel_factory():
        def kernel(*args, **kwargs):
            calls.append(max_runs)
            return ragged_reference_kernel(*args, **kwargs)

        return kernel

    monkeypatch.setattr(attention_backends, "_cudnn_ragged_kernel", kernel_factory)
    blocked = []
    real_fused = attention_backends.fused_causal_attention

    def fused_xla(q_, k_, v_, *, segment_ids, block_size):  # the block path with JAX's reference kernel
        blocked.append(max_runs)
        return real_fused(q_, k_, v_, segment_ids=segment_ids, block_size=block_size, implementation="xla")

    monkeypatch.setattr(attention_backends, "fused_causal_attention", fused_xla)
    out = jax.jit(lambda q_, k_, v_: packed_cudnn_attention(q_, k_, v_, segment_ids=seg, block_size=16,
                                                           max_runs=max_runs))(q, k, v)  # fmt: skip
    assert calls and blocked  # lax.cond traces both branches
    np.testing.assert_allclose(np.asarray(out), reference_attention(q, k, v, seg), atol=2e-5)
