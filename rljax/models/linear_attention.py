"""The Gated DeltaNet token mixer of the Qwen3-Next / Qwen3.5 linear-attention layers (Flax NNX).

Per layer, with ``Hk`` key heads of ``Dk`` and ``Hv`` value heads of ``Dv`` (``Hv`` a multiple of
``Hk``; value head ``h`` reads key head ``h // (Hv / Hk)``)::

    q, k, v, z, b, a = projections of x                (in_proj_qkv/z/b/a; Qwen3-Next: in_proj_qkvz/ba)
    q, k, v = silu(causal_conv1d([q | k | v]))         (depthwise, K taps, cut at sample boundaries)
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated_delta_rule(l2norm(q) / sqrt(Dk), l2norm(k), v, g, beta)     (rljax.models.delta_rule)
    y = out_proj(rmsnorm(o) * w * silu(z))             (per value head)

(Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"; the Qwen3-Next model card; the math of
transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``.) Training runs the chunked form
of the recurrence; decoding keeps, per row, the recurrent state ``[Hv, Dk, Dv]`` (float32) and the
convolution's window of the last ``K - 1`` inputs (:class:`rljax.models.kv_cache.KVCache`), and feeds
one token with the recurrent step. Padding tokens (segment 0) neither write nor decay the state, and
the state and window restart at every sample's first token, so a packed row gives each sample the
outputs it gets alone, and a left-padded prompt those of the prompt alone.

Parameters mirror the HF modules (``linear_attn.in_proj_qkv.kernel`` <->
``model.layers.{i}.linear_attn.in_proj_qkv.weight``; ``conv1d.weight`` keeps HF's ``[C, 1, K]``).
Qwen3-Next fuses the input projections per key head (``in_proj_qkvz``: ``[q | k | v_group | z_group]``
per key head, ``in_proj_ba``: ``[b_group | a_group]``); they are unpacked into the Qwen3.5 layout in
the forward, so the rest of the layer is shared.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.delta_rule import (
    DEFAULT_DELTA_CHUNK_SIZE,
    causal_conv1d,
    conv_window,
    gated_delta_rule_chunked,
    gated_delta_rule_step,
    l2_normalize,
    sample_resets,
)
from rljax.models.layers import _INIT_STD, GatedRMSNorm, Linear

__all__ = ["CausalConv1d", "GatedDeltaNet", "LinearLayerCache"]

#: A linear-attention layer's decode state: ``(conv window [B, K - 1, C] in the compute dtype,
#: recurrent state float32 [B, Hv, Dk, Dv])``.
LinearLayerCache = tuple[jax.Array, jax.Array]


class CausalConv1d(nnx.Module):
    """The depthwise convolution's weight, ``[channels, 1, taps]`` as HF stores it (no bias)."""

    def __init__(self, channels: int, taps: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        init = jax.nn.initializers.normal(_INIT_STD)
        self.weight = nnx.Param(
            init(rngs.params(), (channels, 1, taps), param_dtype), logical_axes=("heads", None, None)
        )

    def taps(self, dtype: jnp.dtype) -> jax.Array:
        """The weight as ``[taps, channels]`` (:func:`rljax.models.delta_rule.causal_conv1d`)."""
        return self.weight[...][:, 0, :].T.astype(dtype)


class GatedDeltaNet(nnx.Module):
    """A Gated DeltaNet linear-attention layer (module docstring); its ``__call__`` takes the keyword
    arguments of :class:`rljax.models.decoder.Attention` (those it does not use are ignored)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        precision: jax.lax.PrecisionLike,
        rngs: nnx.Rngs,
        chunk_size: int = DEFAULT_DELTA_CHUNK_SIZE,
    ) -> None:
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.k_dim, self.v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        key_dim, value_dim = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.fused = c.model_type == "qwen3_next"
        if self.fused:
            self.in_proj_qkvz = Linear(
                c.hidden_size, 2 * key_dim + 2 * value_dim, logical_axes=("embed", "heads"), **kw
            )
            self.in_proj_ba = Linear(c.hidden_size, 2 * self.num_v_heads, logical_axes=("embed", None), **kw)
        else:
            self.in_proj_qkv = Linear(
                c.hidden_size, 2 * key_dim + value_dim, logical_axes=("embed", "heads"), **kw
            )
            self.in_proj_z = Linear(c.hidden_size, value_dim, logical_axes=("embed", "heads"), **kw)
            self.in_proj_b = Linear(c.hidden_size, self.num_v_heads, logical_axes=("embed", None), **kw)
            self.in_proj_a = Linear(c.hidden_size, self.num_v_heads, logical_axes=("embed", None), **kw)
        self.conv1d = CausalConv1d(
            2 * key_dim + value_dim, c.linear_conv_kernel_dim, param_dtype=param_dtype, rngs=rngs
        )
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), param_dtype), logical_axes=("norm",))
        self.A_log = nnx.Param(jnp.zeros((self.num_v_heads,), param_dtype), logical_axes=("norm",))
        self.norm = GatedRMSNorm(self.v_dim, eps=c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.out_proj = Linear(value_dim, c.hidden_size, logical_axes=("heads", "embed"), **kw)
        self.dtype = dtype
        self.precision = precision
        self.chunk_size = chunk_size

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(mixed [B, T, 2 Hk Dk + Hv Dv] = [q | k | v], z [B, T, Hv, Dv], b, a [B, T, Hv])``."""
        bsz, t, _ = x.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim
        if not self.fused:
            z = self.in_proj_z(x).reshape(bsz, t, hv, dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = hv // hk  # value heads per key head; the fused rows are grouped by key head
        qkvz = self.in_proj_qkvz(x).reshape(bsz, t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(bsz, t, hk, 2 * r)
        flat = lambda a: a.reshape(bsz, t, -1)  # noqa: E731
        mixed = jnp.concatenate([flat(q), flat(k), flat(v)], axis=-1)
        return mixed, z.reshape(bsz, t, hv, dv), flat(ba[..., :r]), flat(ba[..., r:])

    def __call__(
        self,
        x: jax.Array,
        *,
        segment_ids: jax.Array,
        layer_cache: LinearLayerCache | None = None,
        cache_segment: jax.Array | None = None,
        **_: Any,
    ) -> tuple[jax.Array, LinearLayerCache | None]:
        """``(y [B, T, hidden], updated layer cache or None)``.

        ``layer_cache`` (decoding): the rows' ``(conv window, recurrent state)`` after their tokens so
        far, whose last valid token was of segment ``cache_segment [B]``; a one-token call runs the
        recurrent step, a longer one the chunked form from that state.
        """
        chex.assert_rank([x, segment_ids], [3, 2])
        bsz, t, _ = x.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim
        mixed, z, b, a = self._project(x)
        window = wseg = None
        if layer_cache is not None:
            window, state = layer_cache
            wseg = cache_segment
        conv = jax.nn.silu(causal_conv1d(mixed, self.conv1d.taps(self.dtype), segment_ids, window=window,
                                         window_segment=wseg))  # fmt: skip
        q, k, v = jnp.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
        f32 = jnp.promote_types(self.dtype, jnp.float32)  # float32 math (float64 for a float64 model)
        valid = (segment_ids != 0)[..., None]
        beta = jnp.where(valid, jax.nn.sigmoid(b.astype(f32)), 0)  # padding: no write ...
        decay = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(
            a.astype(f32) + self.dt_bias[...].astype(f32)
        )
        g = jnp.where(valid, decay, 0)  # ... and no decay
        q = l2_normalize(q.reshape(bsz, t, hk, dk).astype(f32)) * dk**-0.5
        k = l2_normalize(k.reshape(bsz, t, hk, dk).astype(f32))
        q, k = (jnp.repeat(u, hv // hk, axis=2) for u in (q, k))
        v = v.reshape(bsz, t, hv, dv).astype(f32)
        resets = sample_resets(segment_ids, cache_segment)
        if layer_cache is not None and t == 1:
            o, state = gated_delta_rule_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, resets[:, 0]
            )
            o = o[:, None]
        else:
            o, state = gated_delta_rule_chunked(
                q, k, v, g, beta, resets, None if layer_cache is None else state,
                chunk_size=self.chunk_size, precision=self.precision,
            )  # fmt: skip
        y = self.norm(o.astype(self.dtype), z).reshape(bsz, t, hv * dv)
        new_cache = None
        if layer_cache is not None:
            new_window, _ = conv_window(mixed, segment_ids, window, wseg)
            new_cache = (new_window.astype(window.dtype), state)
        return self.out_proj(y), new_cache
