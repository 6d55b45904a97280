"""Key/value cache for incremental decoding: a fixed-size pytree of per-layer keys/values and slots.

The decode drivers that run a model over it (prefill, one decode step) are in
:mod:`rljax.models.decode`; :meth:`rljax.models.Decoder.decode` writes new tokens into it.

The cache has ``max_length`` slots per row. Every call writes its ``T`` new tokens to the same slots
``[index, index + T)`` of every row, and stores their segment ids next to the keys; attention
then uses the packed-forward mask on slots (causal in slot order, equal segment ids), so padding
(left, right or in the middle) only leaves masked holes. Positions come from the caller or, by
default, from ``lengths`` (valid tokens already in each row), so a prompt's padding never shifts
RoPE positions. Prefill followed by decode steps therefore gives exactly the logits of one full
forward (test_models_kv_cache.py checks it against :func:`rljax.models.sequence_logprobs`).

Layout (for speed): each layer's keys and values are ``[B*K, S, D]`` arrays, entry ``b*K + k`` holding
kv head ``k`` of row ``b`` (:func:`rljax.models.attention.to_cache_layout`); with ``transposed_keys``
the keys are ``[B*K, D, S]`` (faster decode attention on some CPUs: the embedded sampler measures
which, :func:`rljax.models.key_layout.use_transposed_keys`). That is exactly the
operand of the decode attention matmuls (:func:`rljax.models.attention.cache_attention`), so a
decode step writes each layer's new keys/values with ONE ``dynamic_update_slice`` and reads the
cache without any transpose or copy; inside a ``lax.while_loop`` (or a jit with the cache donated)
XLA updates the buffers in place, and a step costs one read of the cache instead of several copies
(test_models_decode_perf.py checks the compiled program).

Linear-attention layers (Qwen3-Next / Qwen3.5, :mod:`rljax.models.linear_attention`) keep no keys or
values: each keeps, per row, its recurrent state (float32 ``[B, Hv, Dk, Dv]``) and the window of its
convolution's last ``K - 1`` inputs (``[B, K - 1, C]``), whose size does not grow with the sequence;
``linear_segment`` is the segment of the last valid token they have seen (a token of another segment
restarts them). ``keys`` / ``values`` then hold the full-attention layers only, in layer order.

Capacity: ``index + T`` must stay ``<= max_length``. Under ``jit`` the index is traced and cannot be
checked (``dynamic_update_slice`` would clamp), so callers size the cache for prompt + new tokens;
outside ``jit`` it is checked and a ``ValueError`` is raised.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

from rljax.models.attention import from_cache_layout

if TYPE_CHECKING:
    from rljax.models.config import ModelConfig

EMPTY_SLOT = -1  # segment id of a slot nothing has been written to: matches no query.


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values ``[B*K, S, D]`` plus the slot bookkeeping shared by all layers.

    Attributes:
      keys, values: tuples (one entry per full-attention layer) of
        ``[batch * num_kv_heads, max_length, head_dim]`` arrays in the cache layout
        (:func:`rljax.models.attention.to_cache_layout`; use :meth:`layer_keys` /
        :meth:`layer_values` for ``[B, S, K, D]`` views); the keys are
        ``[batch * num_kv_heads, head_dim, max_length]`` with ``transposed_keys``.
      segment_ids: ``int32 [B, S]`` segment of each slot; ``EMPTY_SLOT`` (-1) where unwritten.
      lengths: ``int32 [B]`` valid (non-padding) tokens written per row = next default position.
      index: ``int32 []`` next slot to write (the same for every row).
      conv_windows, recurrent_states: tuples (one entry per linear-attention layer) of the
        convolution windows ``[B, K - 1, C]`` and the float32 recurrent states ``[B, Hv, Dk, Dv]``;
        empty for models without such layers.
      linear_segment: ``int32 [B]`` segment of the last valid token the linear layers have seen
        (``EMPTY_SLOT`` before any); None for models without them.
      transposed_keys: the keys' layout (static: part of the pytree's structure, not a leaf).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    segment_ids: jax.Array
    lengths: jax.Array
    index: jax.Array
    conv_windows: tuple[jax.Array, ...] = ()
    recurrent_states: tuple[jax.Array, ...] = ()
    linear_segment: jax.Array | None = None
    transposed_keys: bool = flax.struct.field(pytree_node=False, default=False)

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
        return from_cache_layout(
            self.keys[layer], batch_size=self.batch_size, transposed=self.transposed_keys
        )

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
    transposed_keys: bool = False,
) -> KVCache:
    """An empty cache for ``batch_size`` rows of ``max_length`` slots (keys/values in ``dtype``; the
    keys stored ``[B*K, D, S]`` with ``transposed_keys``).

    >>> from rljax.models.config import ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
    ...                   num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> cache = init_cache(cfg, batch_size=3, max_length=5)
    >>> (len(cache.keys), cache.keys[0].shape, cache.layer_keys(0).shape, int(cache.index))
    (2, (3, 5, 4), (3, 5, 1, 4), 0)
    >>> cache = init_cache(cfg, batch_size=3, max_length=5, transposed_keys=True)
    >>> cache.keys[0].shape, cache.values[0].shape, cache.layer_keys(0).shape
    ((3, 4, 5), (3, 5, 4), (3, 5, 1, 4))
    """
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(f"batch_size and max_length must be positive, got {batch_size}, {max_length}")
    shape = (batch_size * config.num_kv_heads, max_length, config.head_dim)
    key_shape = (shape[0], shape[2], shape[1]) if transposed_keys else shape
    num_linear = len(config.linear_layers)
    num_attention = config.num_layers - num_linear
    linear: dict = {}
    if num_linear:
        c = config
        channels = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        )
        window = (batch_size, c.linear_conv_kernel_dim - 1, channels)
        state = (batch_size, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        linear = dict(
            conv_windows=tuple(jnp.zeros(window, dtype) for _ in range(num_linear)),
            recurrent_states=tuple(jnp.zeros(state, jnp.float32) for _ in range(num_linear)),
            linear_segment=jnp.full((batch_size,), EMPTY_SLOT, jnp.int32),
        )
    return KVCache(
        keys=tuple(jnp.zeros(key_shape, dtype) for _ in range(num_attention)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(num_attention)),
        segment_ids=jnp.full((batch_size, max_length), EMPTY_SLOT, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
        transposed_keys=bool(transposed_keys),
        **linear,
    )


def grow_cache(cache: KVCache, max_length: int) -> KVCache:
    """``cache`` with ``max_length`` slots per row: the slots added at the end are empty (``EMPTY_SLOT``).

    Keys, values and slot segment ids are padded (one copy of the cache); ``lengths`` and ``index``
    are unchanged, so decoding goes on exactly as in a cache built with ``max_length`` slots. The
    generation loop uses it to attend only to the slots it has filled (a cache sized for the first
    decode segment, grown before each later one: :func:`rljax.inference.sampler.generate_tokens`).

    >>> from rljax.models.config import ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> cache = grow_cache(init_cache(cfg, batch_size=3, max_length=5), 8)
    >>> cache.keys[0].shape, cache.max_length, cache.segment_ids[0].tolist()
    ((3, 8, 4), 8, [-1, -1, -1, -1, -1, -1, -1, -1])
    """
    extra = max_length - cache.max_length
    if extra < 0:
        raise ValueError(f"grow_cache cannot shrink a cache of {cache.max_length} slots to {max_length}")
    if extra == 0:
        return cache
    pad = lambda x: jnp.pad(x, ((0, 0), (0, extra), (0, 0)))  # noqa: E731
    pad_keys = (lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra)))) if cache.transposed_keys else pad
    return cache.replace(
        keys=tuple(map(pad_keys, cache.keys)),
        values=tuple(map(pad, cache.values)),
        segment_ids=jnp.pad(cache.segment_ids, ((0, 0), (0, extra)), constant_values=EMPTY_SLOT),
    )


def take_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """The cache whose row ``i`` is row ``rows[i]`` of ``cache`` (rows may repeat): one gather per array.

    Keys and values gather their ``num_kv_heads`` entries per row (the cache layout); every other
    per-row array (slot segment ids, lengths, any per-row state a model keeps in the cache) gathers
    its leading axis; ``index`` (shared by all rows) is kept. The embedded sampler prefills a prompt
    prefix shared by several requests once and starts each of them from a copy
    (:func:`rljax.models.decode.prefill` with ``shared_prefix``).

    >>> from rljax.models.config import ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
    ...                   num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4)
    >>> cache = init_cache(cfg, batch_size=2, max_length=3)
    >>> keys = jnp.arange(4.0)[:, None, None] * jnp.ones((4, 3, 4))  # entry b * K + k holds b * K + k
    >>> cache = cache.replace(lengths=jnp.array([5, 7]), keys=(keys,))
    >>> out = take_rows(cache, jnp.array([1, 1, 0]))
    >>> out.lengths.tolist(), out.keys[0][:, 0, 0].tolist(), out.segment_ids.shape
    ([7, 7, 5], [2.0, 3.0, 2.0, 3.0, 0.0, 1.0], (3, 3))
    """
    rows = jnp.asarray(rows, jnp.int32)
    batch = cache.batch_size

    def gather_kv(x: jax.Array) -> jax.Array:
        heads = x.shape[0] // batch
        entries = (rows[:, None] * heads + jnp.arange(heads, dtype=jnp.int32)[None, :]).reshape(-1)
        return jnp.take(x, entries, axis=0)

    def gather_rows(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else jnp.take(x, rows, axis=0)

    fields = {}
    for field in dataclasses.fields(cache):
        value = getattr(cache, field.name)
        if field.name in ("keys", "values"):
            fields[field.name] = tuple(map(gather_kv, value))
        elif field.name != "index" and field.metadata.get("pytree_node", True):  # not the static layout
            fields[field.name] = jax.tree.map(gather_rows, value)
    return cache.replace(**fields)
