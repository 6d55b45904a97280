"""The decoder's building blocks: RMSNorm (and the gated one of the Gated DeltaNet), Linear (kernels
stored ``[in, out]``), the SwiGLU MLP.

Shared by the dense decoder (:mod:`rljax.models.decoder`) and the mixture-of-experts blocks
(:mod:`rljax.models.moe`). Parameters are stored in ``param_dtype`` and computed in ``dtype``;
every parameter carries ``logical_axes`` metadata for :mod:`rljax.models.sharding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.config import ModelConfig

__all__ = ["MLP", "GatedRMSNorm", "Linear", "RMSNorm"]

_INIT_STD = 0.02


class RMSNorm(nnx.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)`` over the last axis (Zhang & Sennrich 2019), in float32.

    ``zero_centered`` (Qwen3-Next / Qwen3.5, Gemma): the scale is ``1 + w`` (``w`` starts at 0, as
    stored in their checkpoints), applied in float32 before the cast to the compute dtype.

    >>> y = RMSNorm(2, eps=0.0, dtype=jnp.float32, param_dtype=jnp.float32)(jnp.array([3.0, 4.0]))
    >>> [round(float(v), 4) for v in y]
    [0.8485, 1.1314]
    >>> z = RMSNorm(2, eps=0.0, dtype=jnp.float32, param_dtype=jnp.float32, zero_centered=True)
    >>> bool(jnp.array_equal(z(jnp.array([3.0, 4.0])), y))
    True
    """

    def __init__(
        self, dim: int, *, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype, zero_centered: bool = False
    ) -> None:
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.dtype = dtype
        self.zero_centered = zero_centered

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.zero_centered:
            return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)
        return y.astype(self.dtype) * self.weight[...].astype(self.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm then a SiLU gate: ``y = (w * x / sqrt(mean(x^2) + eps)) * silu(z)`` (the output norm of
    the Gated DeltaNet, Yang et al. 2024; transformers' ``Qwen3NextRMSNormGated``), gate in float32.

    >>> norm = GatedRMSNorm(2, eps=0.0, dtype=jnp.float32, param_dtype=jnp.float32)
    >>> [round(float(v), 4) for v in norm(jnp.array([3.0, 4.0]), jnp.array([0.0, 50.0]))]  # silu(50) = 50
    [0.0, 56.5685]
    """

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:  # type: ignore[override]
        y = super().__call__(x).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        return y.astype(self.dtype)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with ``kernel`` stored ``[in, out]`` (HF stores ``[out, in]``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool,
        logical_axes: tuple[str, str],
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        precision: jax.lax.PrecisionLike,
        rngs: nnx.Rngs,
    ) -> None:
        init = jax.nn.initializers.normal(_INIT_STD)
        self.kernel = nnx.Param(
            init(rngs.params(), (in_features, out_features), param_dtype), logical_axes=logical_axes
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), param_dtype), logical_axes=(logical_axes[1],))
            if use_bias
            else None
        )
        self.dtype = dtype
        self.precision = precision

    def __call__(self, x: jax.Array) -> jax.Array:
        # One 2-D matmul over the flattened leading axes: the kernel gradient then contracts a single
        # (token) axis, a plain matmul for XLA:CPU. Contracting [B, T] as two axes sent it to a slow
        # generic dot fed by a transposed copy of the output gradient (~20 % of a CPU train step).
        x2 = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        y = self.product(x2)
        lora_a = getattr(self, "lora_a", None)  # a LoRA adapter (rljax.models.lora): + (alpha/r) x A B
        if lora_a is not None:
            xa = jnp.dot(x2, lora_a[...].astype(self.dtype), precision=self.precision)
            delta = jnp.dot(xa, self.lora_b[...].astype(self.dtype), precision=self.precision)
            y = y + delta * self.lora_scale
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y

    def product(self, x2: jax.Array) -> jax.Array:
        """``x2 [M, in] @ kernel`` in compute dtype: the base matmul, before any adapter and bias.

        A subclass that stores its kernel in another layout overrides this method alone and keeps
        :meth:`__call__` (bias, adapters): the embedded sampler's decode-time copies
        (:mod:`rljax.models.decode_layout`).
        """
        return jnp.dot(x2, self.kernel[...].astype(self.dtype), precision=self.precision)


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``.

    ``intermediate_size`` default: ``config.intermediate_size`` (the qwen2_moe shared expert passes
    its own).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        precision: jax.lax.PrecisionLike,
        rngs: nnx.Rngs,
        intermediate_size: int | None = None,
    ) -> None:
        c = config
        inter = c.intermediate_size if intermediate_size is None else intermediate_size
        kw = dict(use_bias=c.mlp_bias, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.gate_proj = Linear(c.hidden_size, inter, logical_axes=("embed", "mlp"), **kw)
        self.up_proj = Linear(c.hidden_size, inter, logical_axes=("embed", "mlp"), **kw)
        self.down_proj = Linear(inter, c.hidden_size, logical_axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
