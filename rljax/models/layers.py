"""The decoder's building blocks: RMSNorm, Linear (kernels stored ``[in, out]``), the SwiGLU MLP.

Shared by the dense decoder (:mod:`rljax.models.decoder`) and the mixture-of-experts blocks
(:mod:`rljax.models.moe`). Parameters are stored in ``param_dtype`` and computed in ``dtype``;
every parameter carries ``logical_axes`` metadata for :mod:`rljax.models.sharding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.panel_matmul import PANEL, pack_panels, panel_matmul
from rljax.models.panel_matmul import available as panel_matmul_available

__all__ = ["MLP", "Linear", "RMSNorm", "decode_layout"]

_INIT_STD = 0.02


class RMSNorm(nnx.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)`` over the last axis (Zhang & Sennrich 2019), in float32.

    >>> y = RMSNorm(2, eps=0.0, dtype=jnp.float32, param_dtype=jnp.float32)(jnp.array([3.0, 4.0]))
    >>> [round(float(v), 4) for v in y]
    [0.8485, 1.1314]
    """

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * self.weight[...].astype(self.dtype)


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
        kernel = self.kernel[...].astype(self.dtype)
        layout = getattr(self, "kernel_layout", "in_out")
        if layout == "out_in":  # decode_layout: kernel stored [out, in]
            y = jax.lax.dot_general(x2, kernel, _CONTRACT_LAST, precision=self.precision)
        elif layout == "panels":  # decode_layout(layout="panels"): [out / 16, in, 16], the CPU kernel
            y = panel_matmul(x2, kernel)
        else:
            y = jnp.dot(x2, kernel, precision=self.precision)
        lora_a = getattr(self, "lora_a", None)  # a LoRA adapter (rljax.models.lora): + (alpha/r) x A B
        if lora_a is not None:
            xa = jnp.dot(x2, lora_a[...].astype(self.dtype), precision=self.precision)
            delta = jnp.dot(xa, self.lora_b[...].astype(self.dtype), precision=self.precision)
            y = y + delta * self.lora_scale
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


#: ``x [M, in]`` against a kernel stored ``[out, in]``: contract the last axes of both.
_CONTRACT_LAST = (((1,), (1,)), ((), ()))


#: Linears whose kernel their owner reads as ``[in, out]`` itself (the untied output projection,
#: :meth:`rljax.models.Decoder.unembedding`; an MoE router): :func:`decode_layout` leaves them.
_READ_DIRECTLY = ("lm_head", "gate")


#: :func:`decode_layout` layouts: kernels stored transposed, or as column panels for the CPU kernel.
DECODE_LAYOUTS = ("out_in", "panels")


def decode_layout(model: nnx.Module, layout: str = "out_in") -> nnx.Module:
    """``model`` with its :class:`Linear` kernels stored for the sampler's decode loop; same outputs
    up to float rounding of the matmuls. The untied ``lm_head`` and MoE routers (``gate``), whose
    owners read their kernels directly, keep theirs.

    * ``"out_in"``: transposed, ``[out, in]`` (HF's layout). A decode step multiplies a few rows by
      every weight; XLA:CPU runs ``x [M, in] @ W^T`` with ``W`` stored ``[out, in]`` faster than
      ``x @ W`` with ``W`` stored ``[in, out]`` when ``M`` is small.
    * ``"panels"``: ``[out / 16, in, 16]`` column panels multiplied by the AVX2 kernel of
      :mod:`rljax.models.panel_matmul` (float32 Linears whose ``out`` is a multiple of 16, where the
      kernel is available; the others are stored ``"out_in"``). The decoder's output projection is
      also packed once (``unembedding_panels``, one more copy of it) and :meth:`Decoder.logits` uses it.

    ``benchmarks/generation_bench.py`` prints the weight-matmul floor of each layout. Call it inside
    the jitted program, before the loop: the copies then run once per call and the caller's model is
    untouched (it changes ``model`` in place; pass a fresh ``nnx.merge``).

    >>> from rljax.models.tiny import tiny_model
    >>> model = tiny_model(vocab_size=32, num_layers=1)
    >>> proj = model.layers[0].mlp.up_proj
    >>> shape = proj.kernel[...].shape
    >>> decode_layout(model).layers[0].mlp.up_proj.kernel[...].shape == shape[::-1]
    True
    """
    if layout not in DECODE_LAYOUTS:
        raise ValueError(f"decode_layout layout must be one of {DECODE_LAYOUTS}, got {layout!r}")
    panels = layout == "panels" and panel_matmul_available()
    for path, module in nnx.iter_graph(model):
        if path and path[-1] in _READ_DIRECTLY:
            continue
        if isinstance(module, Linear) and getattr(module, "kernel_layout", "in_out") == "in_out":
            kernel = module.kernel[...]
            if panels and _packable(kernel, module.dtype):
                module.kernel = nnx.Param(pack_panels(kernel))
                module.kernel_layout = "panels"
            else:
                module.kernel = nnx.Param(kernel.T)
                module.kernel_layout = "out_in"
    unembedding = getattr(model, "unembedding", None)
    if panels and unembedding is not None and getattr(model, "unembedding_panels", None) is None:
        weight = unembedding()
        if _packable(weight, model.dtype):
            model.unembedding_panels = nnx.Param(pack_panels(weight))
    return model


def _packable(kernel: jax.Array, dtype: jnp.dtype) -> bool:
    return kernel.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.float32 and kernel.shape[1] % PANEL == 0


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
