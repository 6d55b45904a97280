"""Key/value cache for incremental decoding: a fixed-size pytree plus prefill and one-step decode.

The cache has ``max_length`` slots per row. Every call writes its ``T`` new tokens to the same slots
``[index, index + T)`` of every row, and stores their segment ids next to the keys; attention
then uses the packed-forward mask on slots (causal in slot order, equal segment ids), so padding
(left, right or in the middle) only leaves masked holes. Positions come from the caller or, by
default, from ``lengths`` (valid tokens already in each row), so a prompt's padding never shifts
RoPE positions. Prefill followed by decode steps therefore gives exactly the logits of one full
forward (test_models_kv_cache.py checks it against :func:`rljax.models.sequence_logprobs`).

Layout (for speed): each layer's keys and values are ``[B*K, S, D]`` arrays, entry ``b*K + k`` holding
kv head ``k`` of row ``b`` (:func:`rljax.models.attention.to_cache_layout`). That is exactly the
operand of the decode attention matmuls (:func:`rljax.models.attention.cache_attention`), so a
decode step writes each layer's new keys/values with ONE ``dynamic_update_slice`` and reads the
cache without any transpose or copy; inside a ``lax.while_loop`` (or a jit with the cache donated)
XLA updates the buffers in place, and a step costs one read of the cache instead of several copies
(test_models_decode_perf.py checks the compiled program).

Capacity: ``index + T`` must stay ``<= max_length``. Under ``jit`` the index is traced and cannot be
checked (``dynamic_update_slice`` would clamp), so callers size the cache for prompt + new tokens;
outside ``jit`` it is checked and a ``ValueError`` is raised.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import chex
import flax.struct
import jax
import jax.numpy as jnp

from rljax.models.attention import from_cache_layout

if TYPE_CHECKING:
    from rljax.models.config import ModelConfig
    from rljax.models.decoder import Decoder

EMPTY_SLOT = -1  # segment id of a slot nothing has been written to: matches no query.


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values ``[B*K, S, D]`` plus the slot bookkeeping shared by all layers.

    Attributes:
      keys, values: tuples (one entry per layer) of ``[batch * num_kv_heads, max_length, head_dim]``
        arrays in the cache layout (:func:`rljax.models.attention.to_cache_layout`; use
        :meth:`layer_keys` / :meth:`layer_values` for ``[B, S, K, D]`` views).
      segment_ids: ``int32 [B, S]`` segment of each slot; ``EMPTY_SLOT`` (-1) where unwritten.
      lengths: ``int32 [B]`` valid (non-padding) tokens written per row = next default position.
      index: ``int32 []`` next slot to write (the same for every row).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    segment_ids: jax.Array
    lengths: jax.Array
    index: jax.Array

    @property
    def max_length(self) -> int:
        """Number of slots per row."""
        return self.segment_ids.shape[1]

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return self.segment_ids.shape[0]

    def layer_keys(self, layer: int) -> jax.Array:
        """Keys of one layer as ``[B, S, K, D]`` (a transposed copy; for inspection and tests)."""
        return from_cache_layout(self.keys[layer], batch_size=self.batch_size)

    def layer_values(self, layer: int) -> jax.Array:
        """Values of one layer as ``[B, S, K, D]`` (a transposed copy; for inspection and tests)."""
        return from_cache_layout(self.values[layer], batch_size=self.batch_size)

    def check_capacity(self, num_new: int) -> None:
        """Raises ``ValueError`` when ``num_new`` tokens do not fit (checked only when not traced)."""
        if num_new > self.max_length:
            raise ValueError(
                f"cannot write {num_new} tokens into a KV cache of max_length {self.max_length}; "
                "build the cache with a larger max_length"
            )
        if not isinstance(self.index, jax.core.Tracer):
            index = int(self.index)
            if index + num_new > self.max_length:
                raise ValueError(
                    f"KV cache is full: {index} slots used + {num_new} new tokens > max_length "
                    f"{self.max_length}; build the cache with a larger max_length"
                )


def init_cache(
    config: ModelConfig,
    *,
    batch_size: int,
    max_length: int,
    dtype: jnp.dtype = jnp.float32,
) -> KVCache:
    """An empty cache for ``batch_size`` rows of ``max_length`` slots (keys/values in ``dtype``).

    >>> from rljax.models.config import ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
    ...                   num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> cache = init_cache(cfg, batch_size=3, max_length=5)
    >>> (len(cache.keys), cache.keys[0].shape, cache.layer_keys(0).shape, int(cache.index))
    (2, (3, 5, 4), (3, 5, 1, 4), 0)
    """
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(f"batch_size and max_length must be positive, got {batch_size}, {max_length}")
    shape = (batch_size * config.num_kv_heads, max_length, config.head_dim)
    return KVCache(
        keys=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        segment_ids=jnp.full((batch_size, max_length), EMPTY_SLOT, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


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
    return_routing: bool = False,
) -> tuple[chex.Array, KVCache] | tuple[chex.Array, KVCache, Any]:
    """Runs the prompts through the model into a fresh cache (jitted; shape checks run eagerly).

    ``return_routing`` (MoE): also return the :class:`rljax.models.moe.Routing` of the prompt
    tokens (None for dense models).

    Args:
      model: a :class:`rljax.models.Decoder`.
      tokens: ``int32 [B, T]`` prompts, padded left or right (``segment_ids`` 0 marks padding).
      max_length: cache slots per row (prompt + every token to be decoded).
      segment_ids: ``int32 [B, T]``; default all ones (no padding).
      positions: ``int32 [B, T]``; default counts valid tokens from 0.
      cache_dtype: dtype of stored keys/values; default the model's compute dtype.

    Returns:
      ``(logits, cache)``: float32 ``[B, V]`` next-token logits after each row's last valid token.

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> prompts = jnp.array([[5, 6, 7], [8, 9, 0]]); seg = jnp.array([[1, 1, 1], [1, 1, 0]])
    >>> logits, cache = prefill(model, prompts, segment_ids=seg, max_length=6)
    >>> logits.shape, cache.lengths.tolist(), int(cache.index)
    ((2, 16), [3, 2], 3)
    """
    chex.assert_rank(tokens, 2)
    if tokens.shape[1] > max_length:
        raise ValueError(f"prompt length {tokens.shape[1]} exceeds the cache max_length {max_length}")
    if segment_ids is None:
        segment_ids = jnp.ones_like(tokens, dtype=jnp.int32)
    out = _prefill(model, tokens, segment_ids, positions, max_length=max_length, cache_dtype=cache_dtype,
                   return_routing=return_routing)  # fmt: skip
    return out if return_routing else out[:2]


@functools.partial(jax.jit, static_argnames=("max_length", "cache_dtype", "return_routing"))
def _prefill(
    model: Decoder,
    tokens: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array | None,
    *,
    max_length: int,
    cache_dtype: jnp.dtype | None,
    return_routing: bool = False,
) -> tuple[jax.Array, KVCache, Any]:
    cache = init_cache(model.config, batch_size=tokens.shape[0], max_length=max_length,
                       dtype=cache_dtype or model.dtype)  # fmt: skip
    if return_routing:
        hidden, cache, routing = model.decode(
            tokens, cache, positions=positions, segment_ids=segment_ids, return_routing=True
        )
    else:
        hidden, cache = model.decode(tokens, cache, positions=positions, segment_ids=segment_ids)
        routing = None
    last = last_valid_index(segment_ids)
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return model.logits(last_hidden), cache, routing


def decode_step(
    model: Decoder, tokens: chex.Array, cache: KVCache, *, return_routing: bool = False
) -> tuple[chex.Array, KVCache] | tuple[chex.Array, KVCache, Any]:
    """Feeds one token per row (``int32 [B]``) at position ``cache.lengths`` (jitted after a capacity check).

    The input ``cache`` is donated: its buffers become the returned cache's (each layer's keys and
    values are written in place, nothing is copied), so use only the returned cache afterwards.
    Inside a traced loop (``lax.while_loop`` carry) the same in-place update happens without donation.

    Returns:
      ``(logits, cache)``: float32 ``[B, V]`` logits for the following token, and the updated cache.

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> logits, cache = prefill(model, jnp.array([[5, 6]]), max_length=4)
    >>> next_token = jnp.argmax(logits, axis=-1)
    >>> logits, cache = decode_step(model, next_token, cache)
    >>> logits.shape, cache.lengths.tolist()
    ((1, 16), [3])
    """
    chex.assert_rank(tokens, 1)
    cache.check_capacity(1)
    if return_routing:  # MoE: also the Routing of the fed tokens ([B, 1, M, ...]; None if dense)
        return _decode_step_routing(model, tokens, cache)
    return _decode_step(model, tokens, cache)


@functools.partial(jax.jit, donate_argnames="cache")
def _decode_step(model: Decoder, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    hidden, cache = model.decode(tokens[:, None], cache)
    return model.logits(hidden[:, 0]), cache


@functools.partial(jax.jit, donate_argnames="cache")
def _decode_step_routing(model: Decoder, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache, Any]:
    hidden, cache, routing = model.decode(tokens[:, None], cache, return_routing=True)
    return model.logits(hidden[:, 0]), cache, routing
