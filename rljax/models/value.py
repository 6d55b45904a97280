"""A value model for PPO: the decoder with a scalar head on its final hidden states.

``values[b, t] = head(h[b, t - 1])``: the critic's estimate of the return from the state that
predicts ``tokens[t]`` (the convention of :func:`rljax.models.sequence_logprobs`: entry 0 and
padding are 0), so values line up with the per-token streams of a packed batch. The head is
``value_head`` = Linear(hidden, 1) with a bias, computed in float32.

Initialisation: from the policy's weights with a fresh head (:meth:`ValueModel.from_policy`, head
kernel 0 and bias 0, so every initial value is exactly 0), or from a saved value model.
Files: :func:`save_value_model` writes the backbone as an ordinary HF checkpoint (config.json +
safetensors, loadable by transformers as the base LM) plus ``value_head.safetensors`` holding
``value_head.weight`` ``[1, hidden]`` and ``value_head.bias`` ``[1]`` (HF's layout of a Linear);
:func:`load_value_model` reads both (a directory without the head file gets a fresh head).

>>> from rljax.models.tiny import tiny_model
>>> vm = ValueModel.from_policy(tiny_model(), rngs=nnx.Rngs(0))
>>> float(abs(values(vm, jnp.array([[1, 2, 3]]))).max())
0.0
"""

from __future__ import annotations

import os
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from rljax.models.decoder import Decoder
from rljax.models.hf_io import from_pretrained, save_pretrained
from rljax.models.logprobs import predecessor_columns

__all__ = ["VALUE_HEAD_FILE", "ValueModel", "load_value_model", "save_value_model", "values"]

#: File of a value model's head, beside its HF checkpoint.
VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(nnx.Module):
    """The backbone (a :class:`~rljax.models.Decoder`) + a value head (kernel ``[H, 1]``, bias ``[1]``)."""

    def __init__(self, backbone: Decoder, *, rngs: nnx.Rngs) -> None:
        del rngs  # the fresh head is zeros (deterministic); kept for the NNX constructor convention
        hidden = backbone.config.hidden_size
        self.backbone = backbone
        self.value_kernel = nnx.Param(jnp.zeros((hidden, 1), jnp.float32), logical_axes=("embed", None))
        self.value_bias = nnx.Param(jnp.zeros((1,), jnp.float32), logical_axes=(None,))

    @classmethod
    def from_policy(cls, policy: Decoder, *, rngs: nnx.Rngs) -> ValueModel:
        """A critic initialised from a copy of the policy's weights with a fresh (zero) head."""
        graphdef, state = nnx.split(policy)
        return cls(nnx.merge(graphdef, jax.tree.map(jnp.copy, state)), rngs=rngs)

    @property
    def config(self):  # noqa: ANN201 - the backbone's ModelConfig
        """The backbone's :class:`~rljax.models.config.ModelConfig`."""
        return self.backbone.config

    @property
    def prefix_tree_rows(self) -> bool:
        """Whether :func:`values` computes prefix-tree rows exactly: the backbone's
        ``prefix_tree_rows`` (:class:`rljax.models.Decoder` declares it)."""
        return bool(getattr(self.backbone, "prefix_tree_rows", False))


def values(
    model: ValueModel,
    tokens: chex.Array,
    *,
    positions: chex.Array | None = None,
    segment_ids: chex.Array | None = None,
    parents: chex.Array | None = None,
    subtree_end: chex.Array | None = None,
) -> jax.Array:
    """Per-token values ``[B, L]`` (float32): entry t from the hidden state at t - 1; 0 at the first
    token of every segment and on padding (``segment_ids == 0``).

    Prefix-tree rows (design §2.6; ``parents`` and ``subtree_end``, as
    :func:`rljax.models.logprobs.sequence_forward` takes them): entry t from the hidden state of
    token t's parent (:func:`rljax.models.logprobs.predecessor_columns`), 0 at a root."""
    tokens = jnp.asarray(tokens)
    if (parents is None) != (subtree_end is None):
        raise ValueError("prefix-tree rows need both parents and subtree_end (or neither, for plain rows)")
    h = model.backbone.hidden_states(
        tokens, positions=positions, segment_ids=segment_ids, subtree_end=subtree_end
    ).hidden
    v = (h.astype(jnp.float32) @ model.value_kernel[...].astype(jnp.float32))[..., 0] + model.value_bias[...][
        0
    ]
    seg = jnp.ones(tokens.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    if parents is not None:
        cols = predecessor_columns(seg, parents)
        return jnp.where(cols >= 0, jnp.take_along_axis(v, jnp.maximum(cols, 0), axis=1), 0.0)
    shifted = jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], axis=1)
    prev = jnp.concatenate([jnp.zeros_like(seg[:, :1]), seg[:, :-1]], axis=1)
    valid = (seg != 0) & (prev == seg)  # same sample as the previous token
    return jnp.where(valid, shifted, 0.0)


def save_value_model(model: ValueModel, path: str | os.PathLike) -> None:
    """Backbone as an HF checkpoint in ``path`` + the head in ``path/value_head.safetensors``."""
    out = pathlib.Path(path)
    save_pretrained(model.backbone, out)
    head = {
        "value_head.weight": np.ascontiguousarray(np.asarray(model.value_kernel[...], np.float32).T),
        "value_head.bias": np.asarray(model.value_bias[...], np.float32),
    }
    save_file(head, str(out / VALUE_HEAD_FILE))


def load_value_model(path: str | os.PathLike, **from_pretrained_kwargs) -> ValueModel:
    """A value model from ``path`` (an HF checkpoint, with or without ``value_head.safetensors``)."""
    d = pathlib.Path(path)
    model = ValueModel(from_pretrained(d, **from_pretrained_kwargs), rngs=nnx.Rngs(0))
    if (d / VALUE_HEAD_FILE).exists():
        head = load_file(str(d / VALUE_HEAD_FILE))
        w, b = head["value_head.weight"], head["value_head.bias"]
        if w.shape != (1, model.config.hidden_size) or b.shape != (1,):
            raise ValueError(
                f"{d / VALUE_HEAD_FILE}: value_head.weight {w.shape} / bias {b.shape} do not fit hidden size "
                f"{model.config.hidden_size} (expected (1, {model.config.hidden_size}) and (1,))"
            )
        model.value_kernel[...] = jnp.asarray(w.T, jnp.float32)
        model.value_bias[...] = jnp.asarray(b, jnp.float32)
    return model
