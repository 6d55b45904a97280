"""Decode drivers over the KV cache: prefill a batch of prompts, then feed one token per row per step.

:func:`prefill` runs left- or right-padded prompts through the model into a fresh
:class:`rljax.models.kv_cache.KVCache` and returns the next-token logits after each row's last
valid token; :func:`decode_step` feeds one token per row and returns the logits of the following
token. Both return one :class:`DecodeOutput` ``(logits, cache, routing)``; ``routing`` (the MoE
router statistics of the fed tokens) is computed only when asked for with the static flag
``with_routing``, so the plain step compiles to the same program as a dense decode step.

Shared prefixes: :func:`prefill` with a :class:`SharedPrefix` runs each distinct prompt prefix once
(``G`` rows), copies its cache to every row that starts with it (:func:`rljax.models.kv_cache.take_rows`)
and then feeds each row's remaining tokens on top: the cache and logits each row would get from
prefilling its whole prompt (what vLLM's prefix caching saves; a GRPO group's samples share their
prompt), with ``G`` instead of ``B`` rows of prefix work.

Prefill followed by decode steps gives exactly the logits of one full forward
(test_models_kv_cache.py checks it against :func:`rljax.models.sequence_logprobs`); the sampling
loop built on these drivers is :func:`rljax.inference.sampler.generate_tokens`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import chex
import jax
import jax.numpy as jnp

from rljax.models.kv_cache import KVCache, init_cache, take_rows

if TYPE_CHECKING:
    from rljax.models.decoder import Decoder
    from rljax.models.moe import Routing


class DecodeOutput(NamedTuple):
    """What :func:`prefill` and :func:`decode_step` return (a pytree).

    Attributes:
      logits: float32 ``[B, V]`` logits of the next token of every row.
      cache: the updated :class:`rljax.models.kv_cache.KVCache`.
      routing: MoE router statistics of the tokens just written (:class:`rljax.models.moe.Routing`,
        ``[B, T, M, ...]``) when asked for with ``with_routing=True``; None otherwise and for dense
        models.
    """

    logits: jax.Array
    cache: KVCache
    routing: Routing | None = None


class SharedPrefix(NamedTuple):
    """Prompt prefixes shared by rows of a :func:`prefill` batch (a pytree).

    Row ``b``'s prompt is ``tokens[rows[b]]`` (its valid tokens) followed by the row's own tokens
    given to :func:`prefill`. The prefixes are left-padded: their cache slots ``[0, Pp)`` then hold
    each prefix right before the row's own slots ``[Pp, Pp + T)``.

    Attributes:
      tokens: ``int32 [G, Pp]`` the distinct prefixes, left-padded.
      segment_ids: ``int32 [G, Pp]``; 0 marks padding (a prefix row may be all padding).
      rows: ``int32 [B]`` the prefix of each row of the batch.
    """

    tokens: jax.Array
    segment_ids: jax.Array
    rows: jax.Array


def last_valid_index(segment_ids: chex.Array) -> chex.Array:
    """Index of the last non-padding token of each row (0 for an all-padding row).

    >>> last_valid_index(jnp.array([[1, 1, 0], [0, 1, 1]])).tolist()
    [1, 2]
    """
    chex.assert_rank(segment_ids, 2)
    idx = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    return jnp.max(jnp.where(segment_ids != 0, idx[None, :], 0), axis=1)


def prefill(
    model: Decoder,
    tokens: chex.Array,
    *,
    max_length: int,
    segment_ids: chex.Array | None = None,
    positions: chex.Array | None = None,
    cache_dtype: jnp.dtype | None = None,
    with_routing: bool = False,
    shared_prefix: SharedPrefix | None = None,
    transposed_keys: bool | None = None,
) -> DecodeOutput:
    """Runs the prompts through the model into a fresh cache (jitted; shape checks run eagerly).

    Args:
      model: a :class:`rljax.models.Decoder`.
      tokens: ``int32 [B, T]`` prompts, padded left or right (``segment_ids`` 0 marks padding).
      max_length: cache slots per row (prompt + every token to be decoded).
      segment_ids: ``int32 [B, T]``; default all ones (no padding).
      positions: ``int32 [B, T]``; default counts valid tokens from 0.
      cache_dtype: dtype of stored keys/values; default the model's compute dtype.
      with_routing: MoE: also return the :class:`rljax.models.moe.Routing` of the prompt tokens.
      shared_prefix: a :class:`SharedPrefix`: row ``b``'s prompt is its prefix
        ``shared_prefix.tokens[rows[b]]`` followed by ``tokens[b]`` (which may be all padding, or
        ``T = 0``). Each prefix is prefilled once, its cache copied to its rows, then ``tokens`` fed
        on top; the cache has the prefix in slots ``[0, Pp)`` and ``tokens`` in ``[Pp, Pp + T)``,
        exactly as if ``concat(prefix, tokens)`` had been prefilled row by row (``positions`` must
        be None: they count each row's valid tokens). The routing then covers all ``Pp + T`` slots.
      transposed_keys: the cache stores keys ``[B*K, D, S]`` (:class:`rljax.models.KVCache`);
        default the model's ``transposed_keys`` attribute (the sampler's decode-time copy,
        :class:`rljax.models.decode_layout.DecodeModel`, carries its choice), else False.

    Returns:
      ``DecodeOutput(logits, cache, routing)``: float32 ``[B, V]`` next-token logits after each
      row's last valid token, the filled cache, and the routing (or None).

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> prompts = jnp.array([[5, 6, 7], [8, 9, 0]]); seg = jnp.array([[1, 1, 1], [1, 1, 0]])
    >>> logits, cache, routing = prefill(model, prompts, segment_ids=seg, max_length=6)
    >>> logits.shape, cache.lengths.tolist(), int(cache.index), routing
    ((2, 16), [3, 2], 3, None)
    """
    chex.assert_rank(tokens, 2)
    length = tokens.shape[1]
    if shared_prefix is not None:
        chex.assert_rank([shared_prefix.tokens, shared_prefix.segment_ids, shared_prefix.rows], [2, 2, 1])
        chex.assert_equal_shape([shared_prefix.tokens, shared_prefix.segment_ids])
        chex.assert_shape(shared_prefix.rows, (tokens.shape[0],))
        if positions is not None:
            raise ValueError("prefill with a shared_prefix takes no positions (they count valid tokens)")
        length += shared_prefix.tokens.shape[1]
    if length > max_length:
        raise ValueError(f"prompt length {length} exceeds the cache max_length {max_length}")
    if segment_ids is None:
        segment_ids = jnp.ones_like(tokens, dtype=jnp.int32)
    if transposed_keys is None:
        transposed_keys = bool(getattr(model, "transposed_keys", False))
    static = dict(max_length=max_length, cache_dtype=cache_dtype, with_routing=with_routing,
                  transposed_keys=bool(transposed_keys))  # fmt: skip
    if shared_prefix is not None:
        return _prefill_shared(model, tokens, segment_ids, shared_prefix, **static)
    return _prefill(model, tokens, segment_ids, positions, **static)


_STATIC = ("max_length", "cache_dtype", "with_routing", "transposed_keys")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(
    model: Decoder,
    tokens: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array | None,
    *,
    max_length: int,
    cache_dtype: jnp.dtype | None,
    with_routing: bool,
    transposed_keys: bool = False,
) -> DecodeOutput:
    cache = init_cache(model.config, batch_size=tokens.shape[0], max_length=max_length,
                       dtype=cache_dtype or model.dtype, transposed_keys=transposed_keys)  # fmt: skip
    out = model.decode(tokens, cache, positions=positions, segment_ids=segment_ids, with_routing=with_routing)
    last = last_valid_index(segment_ids)
    last_hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]
    return DecodeOutput(model.logits(last_hidden), out.cache, out.routing)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill_shared(
    model: Decoder,
    tokens: jax.Array,
    segment_ids: jax.Array,
    shared: SharedPrefix,
    *,
    max_length: int,
    cache_dtype: jnp.dtype | None,
    with_routing: bool,
    transposed_keys: bool = False,
) -> DecodeOutput:
    """:func:`prefill` with a :class:`SharedPrefix`: the prefixes once, copied to their rows, then the
    rows' own tokens on top (a row without any keeps its prefix's logits)."""
    prefix = _prefill(model, shared.tokens, shared.segment_ids, None, max_length=max_length,
                      cache_dtype=cache_dtype, with_routing=with_routing,
                      transposed_keys=transposed_keys)  # fmt: skip
    rows = shared.rows.astype(jnp.int32)
    logits = jnp.take(prefix.logits, rows, axis=0)
    cache = take_rows(prefix.cache, rows)
    routing = prefix.routing
    if routing is not None:
        routing = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), routing)
    if tokens.shape[1] == 0:
        return DecodeOutput(logits, cache, routing)
    out = model.decode(tokens, cache, segment_ids=segment_ids, with_routing=with_routing)
    last_hidden = jnp.take_along_axis(out.hidden, last_valid_index(segment_ids)[:, None, None], axis=1)[:, 0]
    own = jnp.any(segment_ids != 0, axis=1)
    logits = jnp.where(own[:, None], model.logits(last_hidden), logits)
    if routing is not None:
        routing = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), routing, out.routing)
    return DecodeOutput(logits, out.cache, routing)


def decode_step(
    model: Decoder, tokens: chex.Array, cache: KVCache, *, with_routing: bool = False
) -> DecodeOutput:
    """Feeds one token per row (``int32 [B]``) at position ``cache.lengths`` (jitted after a capacity check).

    The input ``cache`` is donated: its buffers become the returned cache's (each layer's keys and
    values are written in place, nothing is copied), so use only the returned cache afterwards.
    Inside a traced loop (``lax.while_loop`` carry) the same in-place update happens without donation.

    Returns:
      ``DecodeOutput(logits, cache, routing)``: float32 ``[B, V]`` logits for the following token,
      the updated cache, and (``with_routing``, MoE) the :class:`rljax.models.moe.Routing` of the
      fed tokens (``[B, 1, M, ...]``), else None.

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> logits, cache, _ = prefill(model, jnp.array([[5, 6]]), max_length=4)
    >>> next_token = jnp.argmax(logits, axis=-1)
    >>> out = decode_step(model, next_token, cache)
    >>> out.logits.shape, out.cache.lengths.tolist()
    ((1, 16), [3])
    """
    chex.assert_rank(tokens, 1)
    cache.check_capacity(1)
    return _decode_step(model, tokens, cache, with_routing=with_routing)


@functools.partial(jax.jit, static_argnames="with_routing", donate_argnames="cache")
def _decode_step(
    model: Decoder, tokens: jax.Array, cache: KVCache, *, with_routing: bool = False
) -> DecodeOutput:
    out = model.decode(tokens[:, None], cache, with_routing=with_routing)
    return DecodeOutput(model.logits(out.hidden[:, 0]), out.cache, out.routing)
