"""``abstract_decoder``: the same abstract model as flax's ``nnx.eval_shape`` over ``Decoder(...,
rngs=nnx.Rngs(0))`` (graph, parameter paths, shapes, dtypes, metadata) for every family, without
the per-draw tracer queries that made that path quadratic in the parameter count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src.interpreters import partial_eval

from rljax.models import Decoder, abstract_decoder, tiny_config

FAMILIES = (
    "qwen3",
    "qwen2",
    "llama",
    "qwen3_moe",
    "qwen2_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
)


def _flax_abstract(config, **kwargs) -> Decoder:
    """The reference: flax's own abstract construction with a real ``nnx.Rngs``."""
    return nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), **kwargs))


def _described(model: Decoder) -> list[tuple]:
    """Every parameter as ``(path, variable type, shape, dtype, metadata)``."""
    out = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        metadata = {k: v for k, v in var.get_metadata().items() if not callable(v)}
        out.append((path, type(var).__name__, value.shape, value.dtype, sorted(metadata.items(), key=str)))
    return out


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, remat="full")],
    ids=["default", "bf16_compute"],
)
def test_same_abstract_model_as_flax_eval_shape(model_type, kwargs):
    config = tiny_config(model_type)
    ours, reference = abstract_decoder(config, **kwargs), _flax_abstract(config, **kwargs)
    assert nnx.graphdef(ours) == nnx.graphdef(reference)
    assert _described(ours) == _described(reference)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(nnx.state(ours)))


def test_no_tracer_is_asked_for_its_origin(monkeypatch):
    """The quadratic cost: each traced rng count update asked a tracer for its ``sharding``, whose
    error message walks every operation traced so far (``_origin_msg``). The reference path does
    it (so the count below can fail); ``abstract_decoder`` never does."""
    calls = []
    plain = partial_eval.DynamicJaxprTracer._origin_msg

    def counted(self):
        calls.append(1)
        return plain(self)

    monkeypatch.setattr(partial_eval.DynamicJaxprTracer, "_origin_msg", counted)
    config = tiny_config("qwen3", num_layers=3)
    _flax_abstract(config)
    assert len(calls) > 0
    calls.clear()
    abstract_decoder(config)
    assert calls == []
