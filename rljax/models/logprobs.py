"""Per-token log-probabilities and entropies from hidden states, in chunks of tokens.

For a vocabulary of ``V`` = 150k, full ``[tokens, V]`` float32 logits of a 32k-token batch would
take 19 GB. Here the final hidden states are flattened to ``[N, hidden]`` and projected ``chunk_size``
tokens at a time inside ``lax.map``; each chunk body is wrapped in ``jax.checkpoint`` so the
backward pass recomputes a chunk's logits instead of keeping all of them alive: peak memory is
``O(chunk_size * V)`` forward and backward (the same trick as Liger / prime-rl fused linear
cross-entropy, here written with plain XLA ops).

Alignment (design §5): entry ``t`` of the output is ``log p(tokens[t] | tokens[<t])`` within its
segment, computed from the hidden state at ``t - 1`` with logits divided by the temperature of
token ``t``. Entry 0 of each row, the first token of each segment and padding (segment 0) are 0.
Prefix-tree rows (design §2.6) name the predecessor of each token explicitly (``parents``: the
column of the token's parent, whose hidden state predicts it, which for the first token of a branch
is not ``t - 1``); :func:`predecessor_columns` covers both layouts.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import chex
import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from rljax.models.decoder import Decoder, UnembeddingLoRA
    from rljax.models.moe import Routing
    from rljax.types import PackedBatch

#: Tokens per chunk of the chunked log-prob computation (bounds the ``[chunk, vocab]`` logits held).
DEFAULT_CHUNK_SIZE = 512


def token_logprobs_and_entropy(
    hidden: chex.Array,
    unembedding: chex.Array,
    targets: chex.Array,
    temperature: chex.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: jax.lax.PrecisionLike = None,
    unembedding_lora: UnembeddingLoRA | None = None,
    support_floor: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probability of ``targets`` and entropy under ``softmax(hidden @ unembedding / temperature)``.

    With ``z = h W / tau`` (float32; ``z = (h W + (alpha / r) (h A) B) / tau`` with an unembedding
    adapter, :meth:`rljax.models.Decoder.unembedding_lora`): ``logp = z[target] - logsumexp(z)`` and
    ``entropy = -sum_v softmax(z)_v log softmax(z)_v``. Computed ``chunk_size`` rows at a time
    (``lax.map`` over rematerialized chunks), so ``[N, V]`` logits never exist at once.

    Args:
      hidden: ``[N, H]`` hidden states (any float dtype).
      unembedding: ``[H, V]`` output projection.
      targets: ``int [N]`` token whose log-probability is wanted in each row, or ``int [N, K]``: K
        tokens per row (one softmax per row, K of its entries gathered).
      temperature: ``float [N]`` positive temperature of each row.
      chunk_size: rows per chunk (static).
      precision: matmul precision.
      unembedding_lora: the output projection's LoRA adapter (None: none), applied per chunk as two
        thin matmuls.
      support_floor: ``float [N]`` or None: each row's top-k / top-p support floor
        (``Step.response_support_floors``): the softmax, logprob and entropy are those of the
        distribution renormalized over ``{v : z_v >= floor}`` (the target always kept), the support
        the sampler drew the target from; ``-inf`` keeps every token. Single targets only.

    Returns:
      ``(logp, entropy)``, float32 ``[N]`` each (``logp [N, K]`` for ``[N, K]`` targets).

    >>> h = jnp.eye(2); w = jnp.log(jnp.array([[1., 3.], [1., 1.]]))
    >>> lp, ent = token_logprobs_and_entropy(h, w, jnp.array([1, 0]), jnp.ones(2), chunk_size=1)
    >>> [round(float(x), 4) for x in jnp.exp(lp)], [round(float(x), 4) for x in ent]
    ([0.75, 0.5], [0.5623, 0.6931])
    """
    chex.assert_rank([hidden, unembedding, temperature], [2, 2, 1])
    chex.assert_rank(targets, {1, 2})
    chex.assert_equal(hidden.shape[1], unembedding.shape[0])
    chex.assert_equal(hidden.shape[0], targets.shape[0])
    chex.assert_equal(hidden.shape[0], temperature.shape[0])
    multi = targets.ndim == 2
    if support_floor is not None:
        chex.assert_shape(support_floor, targets.shape)
        if multi:
            raise ValueError("support_floor applies to one target per row, not [N, K] targets")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    n = hidden.shape[0]
    if n == 0:
        return jnp.zeros(targets.shape, jnp.float32), jnp.zeros((0,), jnp.float32)
    chunk = min(chunk_size, n)
    num_chunks = -(-n // chunk)
    pad = num_chunks * chunk - n
    hidden_c = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num_chunks, chunk, hidden.shape[1])
    targets_c = jnp.pad(targets.astype(jnp.int32), ((0, pad),) + ((0, 0),) * multi).reshape(
        num_chunks, chunk, *targets.shape[1:]
    )
    temp_c = jnp.pad(temperature.astype(jnp.float32), (0, pad), constant_values=1.0).reshape(
        num_chunks, chunk
    )
    floors = jnp.full((n,), -jnp.inf, jnp.float32) if support_floor is None else support_floor
    floor_c = jnp.pad(floors.astype(jnp.float32), (0, pad), constant_values=-jnp.inf).reshape(
        num_chunks, chunk
    )
    truncated = support_floor is not None  # static: without floors, no mask is built

    @jax.checkpoint
    def one_chunk(args: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        h, tgt, tau, floor = args
        z = jnp.dot(h, unembedding.astype(h.dtype), precision=precision, preferred_element_type=jnp.float32)
        if unembedding_lora is not None:
            z = z + unembedding_lora.delta(h, precision=precision)
        z = z / tau[:, None]
        # An id outside [0, V) gives NaN (never a negative wrap-around or a clamp).
        tgt = jnp.where(tgt < 0, z.shape[-1], tgt)
        cut = None
        if truncated:  # the sampler's support: z >= floor, the target always in it
            cut = (z < floor[:, None]) & (jnp.arange(z.shape[-1])[None, :] != tgt[:, None])
            z = jnp.where(cut, -jnp.inf, z)
        lse = jax.nn.logsumexp(z, axis=-1)
        cols = tgt if multi else tgt[:, None]
        logp = jnp.take_along_axis(z, cols, axis=-1, mode="fill", fill_value=jnp.nan) - lse[:, None]
        logp = logp if multi else logp[:, 0]
        log_probs = z - lse[:, None]
        if cut is not None:  # 0 log 0 = 0 off the support (and no NaN in the gradient)
            log_probs = jnp.where(cut, 0.0, log_probs)
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(one_chunk, (hidden_c, targets_c, temp_c, floor_c))
    return logp.reshape(-1, *targets.shape[1:])[:n], entropy.reshape(-1)[:n]


def shifted_token_mask(segment_ids: chex.Array) -> chex.Array:
    """``mask[b, t] = t > 0 and seg[b, t] == seg[b, t-1] != 0``: tokens that have an in-segment predecessor.

    >>> shifted_token_mask(jnp.array([[1, 1, 2, 2, 0]])).astype(int).tolist()
    [[0, 1, 0, 1, 0]]
    """
    chex.assert_rank(segment_ids, 2)
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return jnp.concatenate([jnp.zeros_like(same[:, :1]), same], axis=1)


def predecessor_columns(segment_ids: chex.Array, parents: chex.Array | None = None) -> jax.Array:
    """int32 ``[B, L]``: the column whose hidden state predicts each token, -1 where none does.

    Plain packed rows (``parents`` None): ``t - 1`` when token ``t`` has an in-segment predecessor
    (:func:`shifted_token_mask`), else -1. Prefix-tree rows (design §2.6): ``parents`` itself (the
    column of each token's parent; -1 at a tree's root), -1 on padding (``segment_ids == 0``).

    >>> predecessor_columns(jnp.array([[1, 1, 2, 2, 0]])).tolist()
    [[-1, 0, -1, 2, -1]]
    >>> predecessor_columns(jnp.array([[1, 1, 2, 0]]), jnp.array([[-1, 0, 0, -1]])).tolist()
    [[-1, 0, 0, -1]]
    """
    chex.assert_rank(segment_ids, 2)
    segment_ids = jnp.asarray(segment_ids)
    if parents is not None:
        parents = jnp.asarray(parents).astype(jnp.int32)
        chex.assert_equal_shape([segment_ids, parents])
        return jnp.where(segment_ids != 0, parents, -1)
    t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    return jnp.where(shifted_token_mask(segment_ids), t - 1, -1)


def packing_kwargs(batch: PackedBatch) -> dict[str, jax.Array | None]:
    """The packing arguments of a forward over a :class:`rljax.types.PackedBatch`:
    ``positions``, ``segment_ids`` and, for prefix-tree rows, ``parents`` and ``subtree_end`` (None
    for plain rows), as :func:`sequence_forward` and :func:`rljax.models.value.values` take them.
    Every forward of a packed batch passes all four, so a tree batch is computed as a tree.
    """
    return dict(
        positions=batch.positions,
        segment_ids=batch.segment_ids,
        parents=getattr(batch, "parents", None),
        subtree_end=getattr(batch, "subtree_end", None),
    )


class ForwardOutput(NamedTuple):
    """What one forward pass of :func:`sequence_forward` returns (a pytree; unwanted parts are None).

    Attributes:
      logprobs: float32 ``[B, L]``, ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, <t])`` within
        the segment, at the temperature of token ``t`` (0 at ``t = 0``, segment starts, padding).
      entropy: float32 ``[B, L]`` entropy of that same distribution (same zeros), or None when
        not asked for (``with_entropy=False``).
      routing: the MoE router statistics of the forward (:class:`rljax.models.moe.Routing`:
        ``logits [B, L, M, E]``, ``experts [B, L, M, k]``, i.e. ``routed_experts`` when replaying),
        or None when not asked for (``with_routing=False``) or for a dense model.
    """

    logprobs: jax.Array
    entropy: jax.Array | None = None
    routing: Routing | None = None


@functools.partial(jax.jit, static_argnames=("chunk_size", "with_entropy", "with_routing"))
def sequence_forward(
    model: Decoder,
    tokens: chex.Array,
    *,
    positions: chex.Array | None = None,
    segment_ids: chex.Array | None = None,
    temperature: float | chex.Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    routed_experts: chex.Array | None = None,
    support_floors: chex.Array | None = None,
    with_entropy: bool = True,
    with_routing: bool = False,
    parents: chex.Array | None = None,
    subtree_end: chex.Array | None = None,
) -> ForwardOutput:
    """Per-token logprobs (and entropies, MoE routing) of a packed batch from ONE forward pass (jitted).

    ``logp[b, t] = log softmax(logits(h[b, t-1]) / tau[b, t])[tokens[b, t]]`` and ``entropy[b, t]``
    is the entropy ``-sum_v p_v log p_v`` of that same temperature-scaled distribution; both are 0
    at ``t = 0``, at the first token of every segment and on padding (``segment_ids == 0``).
    Logits are computed ``chunk_size`` tokens at a time (:func:`token_logprobs_and_entropy`).

    The flags are static: what is not asked for is None and is not computed (under ``jit`` the
    unused entropy and the stacking of the router statistics are dead code, removed before
    compilation), so ``with_routing=False`` compiles the program of a plain forward.

    Args:
      model: a :class:`rljax.models.Decoder`.
      tokens: ``int32 [B, L]`` (packed rows allowed).
      positions: ``int32 [B, L]``; default restarts at 0 in every segment.
      segment_ids: ``int32 [B, L]``, 0 = padding; default all ones.
      temperature: scalar or ``float [B, L]`` (the temperature each token was sampled with).
      chunk_size: tokens per logits chunk (memory ``O(chunk_size * vocab)``).
      routed_experts: MoE router replay, ``int32 [B, L, num_moe_layers, top_k]`` (see
        :meth:`rljax.models.Decoder.hidden_states`).
      support_floors: ``float [B, L]`` or None: token ``t``'s top-k / top-p support floor
        (``PackedBatch.support_floors``; ``-inf``: the whole distribution): its logprob and entropy
        are renormalized over the support the sampler drew it from (:func:`token_logprobs_and_entropy`).
      with_entropy: also return the entropies.
      with_routing: also return the MoE routing (feed it to
        :func:`rljax.models.moe.load_balancing_loss`, :func:`rljax.models.moe.router_z_loss`,
        :func:`rljax.models.moe.routing_metrics`, :func:`rljax.models.moe.flip_fraction`; mask
        with ``segment_ids != 0``). None for a dense model.
      parents, subtree_end: prefix-tree rows (design §2.6), ``int32 [B, L]`` both or neither: the
        column of each token's parent (-1 at a root) and of the last token of its subtree. Token
        ``t`` attends to its ancestors and ``logp[b, t]`` comes from the hidden state at
        ``parents[b, t]`` (0 where it is -1); ``positions`` must be the depths.

    Returns:
      a :class:`ForwardOutput` ``(logprobs, entropy, routing)``.

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
    >>> out = sequence_forward(model, jnp.array([[3, 4, 5, 6]]), segment_ids=jnp.array([[1, 1, 2, 2]]))
    >>> (out.logprobs[0] < 0).astype(int).tolist(), (out.entropy[0] > 0).astype(int).tolist(), out.routing
    ([0, 1, 0, 1], [0, 1, 0, 1], None)
    """
    chex.assert_rank(tokens, 2)
    batch, length = tokens.shape
    if segment_ids is None:
        segment_ids = jnp.ones_like(tokens, dtype=jnp.int32)
    if (parents is None) != (subtree_end is None):
        raise ValueError("prefix-tree rows need both parents and subtree_end (or neither, for plain rows)")
    temperature = jnp.asarray(temperature, jnp.float32)
    if temperature.ndim == 0:
        temperature = jnp.broadcast_to(temperature, tokens.shape)
    elif temperature.shape != tokens.shape:
        raise ValueError(
            f"temperature must be a scalar or shaped like tokens {tokens.shape}, got {temperature.shape}"
        )
    forward = model.hidden_states(
        tokens,
        positions=positions,
        segment_ids=segment_ids,
        routed_experts=routed_experts,
        with_routing=with_routing,
        subtree_end=subtree_end,
    )
    hidden, routing = forward.hidden, forward.routing
    if parents is not None:
        return _tree_forward_output(
            model, hidden, routing, tokens, segment_ids, parents, temperature, support_floors,
            chunk_size=chunk_size, with_entropy=with_entropy,
        )  # fmt: skip
    if length < 2:
        zeros = jnp.zeros(tokens.shape, jnp.float32)
        return ForwardOutput(zeros, zeros if with_entropy else None, routing)
    n = batch * (length - 1)
    logp, entropy = token_logprobs_and_entropy(
        hidden[:, :-1].reshape(n, hidden.shape[-1]),
        model.unembedding(),
        tokens[:, 1:].reshape(n),
        temperature[:, 1:].reshape(n),
        chunk_size=chunk_size,
        precision=model.precision,
        unembedding_lora=model.unembedding_lora(),
        support_floor=None if support_floors is None else jnp.asarray(support_floors)[:, 1:].reshape(n),
    )
    mask = shifted_token_mask(jnp.asarray(segment_ids))
    pad = jnp.zeros((batch, 1), jnp.float32)

    def unshift(x: jax.Array) -> jax.Array:  # [B * (L-1)] predictions of tokens 1.. -> [B, L]
        return jnp.where(mask, jnp.concatenate([pad, x.reshape(batch, length - 1)], axis=1), 0.0)

    return ForwardOutput(unshift(logp), unshift(entropy) if with_entropy else None, routing)


def _tree_forward_output(
    model: Decoder,
    hidden: jax.Array,
    routing: Routing | None,
    tokens: jax.Array,
    segment_ids: chex.Array,
    parents: chex.Array,
    temperature: jax.Array,
    support_floors: chex.Array | None,
    *,
    chunk_size: int,
    with_entropy: bool,
) -> ForwardOutput:
    """:func:`sequence_forward`'s logprobs of prefix-tree rows: token ``t`` from the hidden state of
    its parent (gathered per row), at its own temperature and support floor, 0 where
    :func:`predecessor_columns` is -1."""
    batch, length = tokens.shape
    cols = predecessor_columns(segment_ids, parents)
    prev = jax.vmap(lambda h, c: h[c])(hidden, jnp.maximum(cols, 0))  # [B, L, H]
    n = batch * length
    logp, entropy = token_logprobs_and_entropy(
        prev.reshape(n, hidden.shape[-1]),
        model.unembedding(),
        tokens.reshape(n),
        temperature.reshape(n),
        chunk_size=chunk_size,
        precision=model.precision,
        unembedding_lora=model.unembedding_lora(),
        support_floor=None if support_floors is None else jnp.asarray(support_floors).reshape(n),
    )
    valid = cols >= 0

    def place(x: jax.Array) -> jax.Array:
        return jnp.where(valid, x.reshape(batch, length), 0.0)

    return ForwardOutput(place(logp), place(entropy) if with_entropy else None, routing)


def sequence_logprobs(
    model: Decoder,
    tokens: chex.Array,
    *,
    positions: chex.Array | None = None,
    segment_ids: chex.Array | None = None,
    temperature: float | chex.Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    routed_experts: chex.Array | None = None,
    parents: chex.Array | None = None,
    subtree_end: chex.Array | None = None,
) -> jax.Array:
    """float32 ``[B, L]``: entry t = ``log p(tokens[t] | tokens[<t])`` within its segment (design §5).

    Same arguments as :func:`sequence_forward` (entry 0, segment starts and padding
    are 0; logits divided by the temperature of the token being predicted; prefix-tree rows with
    ``parents`` and ``subtree_end``).

    >>> from flax import nnx
    >>> from rljax.models import Decoder, ModelConfig
    >>> cfg = ModelConfig(model_type="qwen2", vocab_size=16, hidden_size=8, intermediate_size=16,
    ...                   num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4, qkv_bias=True)
    >>> lp = sequence_logprobs(Decoder(cfg, rngs=nnx.Rngs(0)), jnp.array([[1, 2, 3]]), temperature=0.7)
    >>> lp.shape, lp.dtype, float(lp[0, 0])
    ((1, 3), dtype('float32'), 0.0)
    """
    return sequence_forward(
        model,
        tokens,
        positions=positions,
        segment_ids=segment_ids,
        temperature=temperature,
        chunk_size=chunk_size,
        routed_experts=routed_experts,
        with_entropy=False,
        parents=parents,
        subtree_end=subtree_end,
    ).logprobs
