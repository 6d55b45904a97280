"""The embedded sampler's decode-time copy of a model: its Linear kernels stored for few-row matmuls.

A decode step multiplies a few rows (one per sequence) by every weight, so the layout the weights
are stored in decides its speed on a CPU. :func:`decode_layout` builds that copy from a
:class:`rljax.models.Decoder`: each :class:`~rljax.models.layers.Linear` is replaced by a
decode-time subclass that stores its kernel in the chosen layout and overrides only
:meth:`~rljax.models.layers.Linear.product` (bias and LoRA adapters are kept as they are), and the
model is wrapped in a :class:`DecodeModel` that may hold its own packed copy of the output
projection. The training model's layers know nothing of these layouts; the sampler
(:class:`rljax.inference.sampler.EmbeddedSampler`, ``kernel_layout``) picks one and builds the copy.

* ``"out_in"`` (:class:`TransposedLinear`): kernels transposed, ``[out, in]`` (HF's layout).
  XLA:CPU runs ``x [M, in] @ W^T`` with ``W`` stored ``[out, in]`` faster than ``x @ W`` with ``W``
  stored ``[in, out]`` when ``M`` is small.
* ``"panels"`` (:class:`PanelLinear`): ``[out / 16, in, 16]`` column panels multiplied by the
  kernel of :mod:`rljax.models.panel_matmul` in one of its instruction sets (AVX2 or AVX-512; the
  fastest here by default, :func:`rljax.models.panel_matmul.kernel_isa`) (float32 Linears whose
  ``out`` is a multiple of 16, where the kernel is available; the others are stored ``"out_in"``),
  and one packed copy of the output projection (:attr:`DecodeModel.unembedding_panels`).

Outputs equal the model's up to float rounding of the matmuls (the sampler's tests check tokens and
logprobs in every layout). The untied ``lm_head`` and MoE routers (``gate``), whose owners read their
kernels directly, keep theirs.

>>> from rljax.models.tiny import tiny_model
>>> model = tiny_model(vocab_size=32, num_layers=1)
>>> shape = model.layers[0].mlp.up_proj.kernel[...].shape
>>> proj = decode_layout(model).decoder.layers[0].mlp.up_proj
>>> type(proj).__name__, proj.kernel_layout, proj.kernel[...].shape == shape[::-1]
('TransposedLinear', 'out_in', True)
"""

from __future__ import annotations

from typing import Any, ClassVar

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.decoder import Decoder
from rljax.models.layers import Linear
from rljax.models.panel_matmul import PANEL, kernel_isa, pack_panels, panel_matmul
from rljax.models.panel_matmul import available as panel_matmul_available

__all__ = ["DECODE_LAYOUTS", "DecodeModel", "PanelLinear", "TransposedLinear", "decode_layout"]

#: :func:`decode_layout` layouts: kernels stored transposed, or as column panels for the CPU kernel.
DECODE_LAYOUTS = ("out_in", "panels")

#: Linears whose kernel their owner reads as ``[in, out]`` itself (the untied output projection,
#: :meth:`rljax.models.Decoder.unembedding`; an MoE router): :func:`decode_layout` leaves them.
_READ_DIRECTLY = ("lm_head", "gate")

#: ``x [M, in]`` against a kernel stored ``[out, in]``: contract the last axes of both.
_CONTRACT_LAST = (((1,), (1,)), ((), ()))


class _RelaidLinear(Linear):
    """A :class:`Linear` whose kernel is stored in another layout: built from a Linear, it keeps that
    Linear's every attribute (bias, dtypes, precision, a LoRA adapter) but the kernel."""

    #: The layout name (``EmbeddedSampler(kernel_layout=...)``); plain Linears store ``"in_out"``.
    kernel_layout: ClassVar[str]

    def __init__(self, base: Linear, kernel: jax.Array) -> None:  # no Linear.__init__: no new weights
        for name, value in vars(base).items():
            if not name.startswith("_"):  # nnx's own bookkeeping starts with "_"
                setattr(self, name, value)
        self.kernel = nnx.Param(kernel)


class TransposedLinear(_RelaidLinear):
    """A decode-time :class:`Linear` with its kernel stored ``[out, in]``."""

    kernel_layout = "out_in"

    def product(self, x2: jax.Array) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        return jax.lax.dot_general(x2, kernel, _CONTRACT_LAST, precision=self.precision)


class PanelLinear(_RelaidLinear):
    """A decode-time float32 :class:`Linear` with its kernel stored as ``[out / 16, in, 16]`` panels
    (:func:`rljax.models.panel_matmul.pack_panels`), multiplied by the kernel in instruction set
    ``isa`` (static: part of the graph definition)."""

    kernel_layout = "panels"

    def __init__(self, base: Linear, kernel: jax.Array, isa: str = "avx2") -> None:
        super().__init__(base, kernel)
        self.isa = isa

    def product(self, x2: jax.Array) -> jax.Array:
        return panel_matmul(x2, self.kernel[...], self.isa)


class DecodeModel(nnx.Module):
    """A :class:`rljax.models.Decoder` served for decoding: what :func:`rljax.models.prefill`,
    :func:`rljax.models.decode_step` and the sampler's loop call (``config``, ``dtype``,
    :meth:`decode`, :meth:`logits`, a full forward), with the decoder's Linears relaid by
    :func:`decode_layout` and, for ``"panels"``, a packed copy of the output projection.

    Attributes:
      decoder: the decoder, its Linears replaced by :class:`TransposedLinear` / :class:`PanelLinear`.
      unembedding_panels: ``decoder.unembedding()`` as ``[vocab / 16, hidden, 16]`` panels (an
        ``nnx.Param``), multiplied by the kernel (instruction set ``isa``) in :meth:`logits`; None
        keeps the decoder's own output matmul.
      isa: the kernel's instruction set for ``unembedding_panels``.
      transposed_keys: the KV caches :func:`rljax.models.prefill` makes for this model store the keys
        transposed (:class:`rljax.models.KVCache`).
    """

    def __init__(
        self,
        decoder: Decoder,
        unembedding_panels: nnx.Param | None = None,
        isa: str = "avx2",
        transposed_keys: bool = False,
    ) -> None:
        self.decoder = decoder
        self.unembedding_panels = unembedding_panels
        self.isa = isa
        self.transposed_keys = bool(transposed_keys)

    @property
    def config(self) -> Any:
        return self.decoder.config

    @property
    def dtype(self) -> jnp.dtype:
        return self.decoder.dtype

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`rljax.models.Decoder.decode`."""
        return self.decoder.decode(*args, **kwargs)

    def logits(self, hidden: chex.Array) -> jax.Array:
        """:meth:`rljax.models.Decoder.logits`, through the packed output projection when there is one."""
        if self.unembedding_panels is None:
            return self.decoder.logits(hidden)
        panels = self.unembedding_panels[...]
        return self.decoder.logits(hidden, unembed=lambda flat: panel_matmul(flat, panels, self.isa))

    def __call__(self, tokens: chex.Array, **kwargs: Any) -> jax.Array:
        """Full float32 logits ``[B, L, vocab]`` (:meth:`rljax.models.Decoder.__call__`)."""
        return self.logits(self.decoder.hidden_states(tokens, **kwargs).hidden)


def decode_layout(
    model: Decoder, layout: str = "out_in", isa: str | None = None, *, transposed_keys: bool = False
) -> DecodeModel:
    """``model`` with its :class:`Linear` kernels stored for the sampler's decode loop (see the module
    docstring for the layouts), as a :class:`DecodeModel`; same outputs up to float rounding.

    It rebuilds ``model``'s Linears in place (pass a fresh ``nnx.merge``). Call it inside the jitted
    program that makes the copy: the relaid kernels are then new arrays made once per weight update
    (``rljax.inference.sampler.to_decode_layout``). ``"panels"`` where the kernel is not available
    (:func:`rljax.models.panel_matmul.available`) stores every kernel ``"out_in"``; ``isa`` is the
    kernel's instruction set (default :func:`rljax.models.panel_matmul.kernel_isa`);
    ``transposed_keys``: the KV-cache key layout of the copy (:attr:`DecodeModel.transposed_keys`).
    """
    if layout not in DECODE_LAYOUTS:
        raise ValueError(f"decode_layout layout must be one of {DECODE_LAYOUTS}, got {layout!r}")
    panels = layout == "panels" and panel_matmul_available()
    if panels and isa is None:
        isa = kernel_isa()
    linears = [
        (path, module)
        for path, module in nnx.iter_graph(model)
        if type(module) is Linear and path and path[-1] not in _READ_DIRECTLY
    ]
    for path, linear in linears:
        kernel = linear.kernel[...]
        if panels and _packable(kernel, linear.dtype):
            relaid: Linear = PanelLinear(linear, pack_panels(kernel), isa)
        else:
            relaid = TransposedLinear(linear, kernel.T)
        _replace(model, path, relaid)
    unembedding = None
    if panels:
        weight = model.unembedding()
        if _packable(weight, model.dtype):
            unembedding = nnx.Param(pack_panels(weight))
    return DecodeModel(model, unembedding, isa or "avx2", transposed_keys)


def _replace(root: nnx.Module, path: tuple, node: nnx.Module) -> None:
    """Puts ``node`` at ``path`` (attribute names and list indices) under ``root``."""
    parent = root
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = node
    else:
        setattr(parent, path[-1], node)


def _packable(kernel: jax.Array, dtype: jnp.dtype) -> bool:
    return kernel.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.float32 and kernel.shape[1] % PANEL == 0
