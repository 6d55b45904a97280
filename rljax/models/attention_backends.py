"""Attention backends of the training forward: XLA (blocked, any platform), cuDNN (GPU), splash (TPU).

``model.attention`` picks one of :data:`ATTENTION_BACKENDS`:

``auto``
    ``cudnn_ragged`` on GPU when the compute dtype is bfloat16/float16 (cuDNN's fused attention
    has no float32 kernel), ``splash`` on TPU, ``xla`` otherwise (CPU: the path that always ran)
``xla``
    :func:`rljax.models.attention.causal_attention`: causal query blocks, XLA einsums
``cudnn``
    ``jax.nn.dot_product_attention(implementation="cudnn")``, called per causal query block
    with the boolean mask of that block (``[B, 1, block, prefix]``, never ``T x T``)
``cudnn_ragged``
    cuDNN's fused flash attention on the packed rows themselves: every run of equal segment
    ids is one variable-length sequence (cuDNN's ragged "THD" offsets, causal within it), so
    nothing masked is computed and no mask exists (:func:`packed_cudnn_attention`); a row of
    more than :data:`CUDNN_MAX_RUNS` runs takes the ``cudnn`` path (exact). On an H200: ~3.5x
    faster than ``cudnn`` at 16k tokens, a 64k-token train step 11x faster in the same memory
    (cuDNN's packed backward holds buffers that grow with the bound times the row length, which
    is why the bound is 16; see docs/guides/long_context.md)
``splash``
    Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) with a
    causal mask and ``SegmentIds``: the kernel skips fully masked ``(q, kv)`` blocks itself

Every backend computes the same function (the packing convention of design §2.6):
``out[b, i] = softmax_j(q_i . k_j / sqrt(D) + log mask[b, i, j]) v_j`` with
``mask[b, i, j] = (slot_j <= slot_i) & (seg[b, i] == seg[b, j])``, grouped-query heads
(query head ``h`` reads key/value head ``h // (N / K)``).

Prefix-tree rows (``subtree_end`` given; design §2.6) take the tree mask
``(slot_j <= slot_i <= subtree_end[b, j]) | (slot_i == slot_j)`` of
:func:`rljax.models.attention.attention_mask`, a mask that depends on the data of each row.
:func:`tree_attention_backend` says which backend computes it: ``xla`` and ``cudnn`` do (the cuDNN
wrapper hands each block's boolean mask to ``jax.nn.dot_product_attention``, which passes it to cuDNN
as an additive bias); ``cudnn_ragged`` does not (cuDNN's ragged layout describes each sequence by an
offset and a length and masks causally within it, so a prefix that several later branches read is no
such sequence; the tree mask can only reach cuDNN as a dense bias, which is what the ``cudnn`` blocks
pass) and runs ``cudnn``'s blocks instead; ``splash`` does not (its masks are numpy arrays
fixed when the kernel is built, and its only per-row input, ``SegmentIds``, tests equality) and runs
``xla`` instead. Both fallbacks are exact; :func:`self_attention` logs the reason once.

Asking for a backend on a platform without it raises ``ValueError`` naming what would work;
:func:`fused_causal_attention` with ``implementation="xla"`` runs the cuDNN wrapper's masks and
blocking on CPU (what the tests compare), and :func:`splash_causal_attention` with
``interpret=True`` runs the real splash kernel in the Pallas interpreter on CPU.
"""

from __future__ import annotations

import functools
import logging

import chex
import jax
import jax.numpy as jnp

from rljax.models.attention import attention_mask, causal_attention, causal_block_size

#: ``model.attention`` values.
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "xla", "cudnn", "cudnn_ragged", "splash")
#: Compute dtypes cuDNN's fused attention supports.
CUDNN_DTYPES: tuple[str, ...] = ("bfloat16", "float16")
_SPLASH_BLOCK = 512
#: Runs of equal segment ids per row (samples + trailing padding) the ragged cuDNN kernel is compiled
#: for; rows with more take the block path. cuDNN's packed backward memory grows with this bound.
CUDNN_MAX_RUNS = 16

_log = logging.getLogger(__name__)
_TREE_FALLBACKS = {
    "cudnn_ragged": (
        "cudnn",
        "cuDNN's ragged (THD) kernel masks by sequence offsets and lengths (causal within each), and a "
        "shared prefix read by several branches is no such sequence; the tree mask has to be a dense bias, "
        "which the cudnn blocks pass",
    ),
    "splash": (
        "xla",
        "splash attention's masks are static (built with the kernel) and its per-row SegmentIds only test "
        "equality, so the data-dependent tree mask cannot be expressed",
    ),
}
_logged_fallbacks: set[str] = set()


def tree_attention_backend(backend: str) -> tuple[str, str | None]:
    """``(backend, reason)``: the resolved backend that computes a prefix-tree mask in place of
    ``backend`` (itself for ``xla`` and ``cudnn``), and why it differs (None when it does not).

    >>> tree_attention_backend("xla"), tree_attention_backend("splash")[0]
    (('xla', None), 'xla')
    >>> tree_attention_backend("cudnn_ragged")[0]
    'cudnn'
    """
    if backend in _TREE_FALLBACKS:
        return _TREE_FALLBACKS[backend]
    if backend not in ("xla", "cudnn"):
        raise ValueError(
            f"unknown resolved attention backend {backend!r} (expected xla, cudnn, cudnn_ragged or splash)"
        )
    return backend, None


def resolve_attention(name: str, *, platform: str | None = None, dtype: jnp.dtype = jnp.float32) -> str:
    """The concrete backend (``"xla"``, ``"cudnn"``, ``"cudnn_ragged"``, ``"splash"``) of ``model.attention``.

    ``platform`` default: ``jax.default_backend()`` (``"cpu"``, ``"gpu"``, ``"tpu"``). ``auto``
    picks cuDNN's ragged kernel on GPU for bfloat16/float16 compute, splash on TPU, XLA otherwise. Raises
    ``ValueError`` for an unknown name, ``cudnn`` off GPU or with float32 compute, ``splash`` off TPU.

    >>> resolve_attention("auto", platform="cpu"), resolve_attention("auto", platform="tpu")
    ('xla', 'splash')
    >>> resolve_attention("auto", platform="gpu"), resolve_attention("auto", platform="gpu", dtype="bfloat16")
    ('xla', 'cudnn_ragged')
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention must be one of {ATTENTION_BACKENDS}, got {name!r}")
    platform = jax.default_backend() if platform is None else platform
    dtype_name = jnp.dtype(dtype).name
    if name == "auto":
        if platform == "gpu" and dtype_name in CUDNN_DTYPES:
            return "cudnn_ragged"
        return "splash" if platform == "tpu" else "xla"
    if name in ("cudnn", "cudnn_ragged"):
        if platform != "gpu":
            raise ValueError(
                f"model.attention={name!r} needs a GPU (cuDNN fused attention), but JAX runs on "
                f"{platform!r}; use 'auto' (picks per platform) or 'xla'"
            )
        if dtype_name not in CUDNN_DTYPES:
            raise ValueError(
                f"model.attention={name!r} needs compute_dtype in {CUDNN_DTYPES} (cuDNN has no {dtype_name} "
                "fused attention); set model.compute_dtype='bfloat16' or use attention='auto' / 'xla'"
            )
    if name == "splash" and platform != "tpu":
        raise ValueError(
            f"model.attention='splash' needs a TPU (Pallas Mosaic kernel), but JAX runs on {platform!r}; "
            "use 'auto' (picks per platform) or 'xla'"
        )
    return name


def dot_product_kernel(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, implementation: str
) -> jax.Array:
    """``jax.nn.dot_product_attention`` of ``q [B, T, N, D]``, ``k, v [B, S, K, D]`` under ``mask [B, T, S]``.

    The mask enters as ``[B, 1, T, S]`` (the same for every head); the scale is ``1 / sqrt(D)``.
    """
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=implementation)


def fused_causal_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    segment_ids: chex.Array,
    block_size: int | None = None,
    implementation: str = "cudnn",
    subtree_end: chex.Array | None = None,
) -> chex.Array:
    """:func:`rljax.models.attention.causal_attention` with each query block computed by
    ``jax.nn.dot_product_attention(implementation=implementation)``.

    The blocks are those of ``causal_attention`` (queries ``[s, e)`` attend to keys ``[0, e)``), so the
    mask handed to the kernel is ``[B, 1, e - s, e]``: memory ``O(block * T)`` like the XLA path.
    ``implementation="xla"`` runs the same masks and blocks with JAX's reference implementation
    (any platform).

    >>> q = jnp.zeros((1, 3, 2, 4)); kv = jnp.arange(12.).reshape(1, 3, 1, 4); seg = jnp.array([[1, 1, 2]])
    >>> out = fused_causal_attention(q, kv, kv, segment_ids=seg, block_size=2, implementation="xla")
    >>> out[0, :, 0, 0].tolist()
    [0.0, 2.0, 8.0]
    """
    kernel = functools.partial(dot_product_kernel, implementation=implementation)
    return causal_attention(
        q, k, v, segment_ids=segment_ids, block_size=block_size, kernel=kernel, subtree_end=subtree_end
    )


def segment_runs(segment_ids: chex.Array, max_runs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The runs of equal segment ids of each row, as cuDNN's ragged (THD) sequence metadata.

    Returns ``(lengths int32 [B, M], offsets int32 [B, M + 1], count int32 [B])`` with ``M =
    max_runs``: run ``r`` of row ``b`` starts at token ``offsets[b, r]`` and has ``lengths[b, r]``
    tokens; unused entries are -1 (cuDNN's convention); ``count`` is the number of runs (when it
    exceeds ``M`` the metadata covers only the first ``M`` runs: callers must check).

    Packing (design §2.6) keeps every sample contiguous and pads at the end, so the runs are the
    samples and the trailing padding, and "causal within each run" is the packing mask
    ``(j <= i) & (seg_i == seg_j)`` on every real token (padding is masked from the losses).

    >>> lengths, offsets, count = segment_runs(jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]]), 3)
    >>> lengths.tolist(), offsets.tolist(), count.tolist()
    ([[2, 3, 1], [6, -1, -1]], [[0, 2, 5, -1], [0, -1, -1, -1]], [3, 1])
    """
    chex.assert_rank(segment_ids, 2)
    b, t = segment_ids.shape
    seg = jnp.asarray(segment_ids)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    count = starts.sum(axis=1, dtype=jnp.int32)
    starts_of = jax.vmap(lambda row: jnp.nonzero(row, size=max_runs + 1, fill_value=-1)[0])
    first_and_next = starts_of(starts).astype(jnp.int32)  # one more: where the M-th run ends
    first, following = first_and_next[:, :-1], first_and_next[:, 1:]
    ends = jnp.where(following < 0, t, following)
    lengths = jnp.where(first >= 0, ends - first, -1)
    offsets = jnp.concatenate([first, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return lengths, offsets, count


def runs_mask(lengths: chex.Array, offsets: chex.Array, length: int) -> jax.Array:
    """``bool [B, T, T]``: the attention mask cuDNN's ragged causal kernel applies for this metadata
    (token ``i`` sees ``j <= i`` of its own run). A test reference for :func:`segment_runs`; never
    built by the forward.

    >>> lengths, offsets, _ = segment_runs(jnp.array([[1, 1, 2]]), 2)
    >>> runs_mask(lengths, offsets, 3).astype(int).tolist()
    [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]
    """
    tokens = jnp.arange(length)
    starts, ends = offsets[:, :-1], offsets[:, :-1] + lengths  # [B, M]
    inside = (tokens[None, :, None] >= starts[:, None]) & (tokens[None, :, None] < ends[:, None])
    member = inside & (lengths[:, None] > 0)
    run = jnp.argmax(member, axis=-1)  # [B, T]: the run of each token
    same = run[:, :, None] == run[:, None, :]
    return same & (tokens[None, None, :] <= tokens[None, :, None])


def _cudnn_ragged_kernel():  # noqa: ANN202 (JAX's private cuDNN entry point, or None)
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention
    except ImportError:
        return None
    return functools.partial(cudnn_attention, mask_type=MaskType.PADDING_CAUSAL)


def packed_cudnn_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    segment_ids: chex.Array,
    block_size: int | None,
    max_runs: int = CUDNN_MAX_RUNS,
) -> chex.Array:
    """Causal, segment-masked GQA of packed rows by cuDNN's ragged (THD) flash attention (GPU).

    Every run of equal segment ids (:func:`segment_runs`) is one causal sequence for the kernel, so
    the cost is that of the samples alone (no mask, no cross-sample scores). Rows with more than
    ``max_runs`` runs take :func:`fused_causal_attention` (exact, block-wise with a mask) through
    ``lax.cond``, so the result never depends on the bound. Needs JAX's cuDNN fused attention
    (``jax._src.cudnn.fused_attention_stablehlo``; GPU, bfloat16/float16).
    """
    kernel = _cudnn_ragged_kernel()
    if kernel is None:
        return fused_causal_attention(q, k, v, segment_ids=segment_ids, block_size=block_size)
    lengths, offsets, count = segment_runs(segment_ids, max_runs)
    scale = float(q.shape[-1]) ** -0.5

    def ragged(q_: jax.Array, k_: jax.Array, v_: jax.Array) -> jax.Array:
        return kernel(q_, k_, v_, None, None, lengths, lengths, offsets, offsets, scale=scale)

    def blocked(q_: jax.Array, k_: jax.Array, v_: jax.Array) -> jax.Array:
        return fused_causal_attention(q_, k_, v_, segment_ids=segment_ids, block_size=block_size)

    return jax.lax.cond(jnp.all(count <= max_runs), ragged, blocked, q, k, v)


def fused_packed_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    q_segment_ids: chex.Array,
    kv_segment_ids: chex.Array,
    q_slots: chex.Array,
    kv_slots: chex.Array,
    implementation: str = "cudnn",
) -> chex.Array:
    """Masked attention with explicit slots (a context shard's queries against gathered keys) by
    ``jax.nn.dot_product_attention``; the mask is :func:`rljax.models.attention.attention_mask`."""
    mask = attention_mask(q_segment_ids, kv_segment_ids, q_slots, kv_slots)
    return dot_product_kernel(q, k, v, mask, implementation=implementation)


@functools.lru_cache(maxsize=32)
def _splash_kernel(length: int, heads: int, block: int, interpret: bool):  # noqa: ANN202 (Pallas kernel)
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(heads)])
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret)


def splash_causal_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    segment_ids: chex.Array,
    block_size: int = _SPLASH_BLOCK,
    interpret: bool = False,
) -> chex.Array:
    """Causal, segment-masked GQA by Pallas splash attention (TPU; ``interpret=True`` on any platform).

    Rows are padded to a multiple of the kernel block (``min(block_size, 128 * ceil(T / 128))``)
    with segment 0 (padding, after every real token, so causality hides it from them); key/value
    heads are repeated to the query heads (HF ``repeat_kv`` order); queries are scaled by
    ``1 / sqrt(D)`` (the kernel does not scale); one kernel call per row (``vmap``).

    >>> q = jnp.zeros((1, 3, 2, 4)); kv = jnp.arange(12.).reshape(1, 3, 1, 4); seg = jnp.array([[1, 1, 2]])
    >>> out = splash_causal_attention(q, kv, kv, segment_ids=seg, interpret=True)
    >>> [round(x, 4) for x in out[0, :, 0, 0].tolist()]
    [0.0, 2.0, 8.0]
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    chex.assert_rank([q, k, v, segment_ids], [4, 4, 4, 2])
    b, t, n, d = q.shape
    groups = n // k.shape[2]
    block = min(block_size, -(-t // 128) * 128)
    pad = (-t) % block
    padded = t + pad

    def heads_first(x: jax.Array) -> jax.Array:  # [B, T, H, D] -> [B, H, T + pad, D]
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    qh = heads_first(q * jnp.asarray(d**-0.5, q.dtype))
    kh, vh = heads_first(jnp.repeat(k, groups, axis=2)), heads_first(jnp.repeat(v, groups, axis=2))
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)))
    kernel = _splash_kernel(padded, n, block, interpret)

    def one_row(q_: jax.Array, k_: jax.Array, v_: jax.Array, s: jax.Array) -> jax.Array:
        return kernel(q_, k_, v_, segment_ids=SegmentIds(q=s, kv=s))

    out = jax.vmap(one_row)(qh, kh, vh, seg)
    return out.transpose(0, 2, 1, 3)[:, :t].astype(q.dtype)


def self_attention(
    q: chex.Array,
    k: chex.Array,
    v: chex.Array,
    *,
    segment_ids: chex.Array,
    backend: str,
    max_block_size: int | None,
    precision: jax.lax.PrecisionLike = None,
    subtree_end: chex.Array | None = None,
) -> chex.Array:
    """The training forward's attention of packed rows over themselves with a resolved ``backend``
    (``"xla"``, ``"cudnn"``, ``"cudnn_ragged"``, ``"splash"``; see :func:`resolve_attention`).

    ``subtree_end`` (prefix-tree rows, design §2.6): the tree mask, computed by
    :func:`tree_attention_backend`'s backend (a fallback is logged once per backend)."""
    t = q.shape[1]
    if subtree_end is not None:
        tree_backend, reason = tree_attention_backend(backend)
        if reason is not None and backend not in _logged_fallbacks:
            _logged_fallbacks.add(backend)
            _log.warning("prefix-tree rows: attention %r runs as %r: %s", backend, tree_backend, reason)
        block = causal_block_size(t, max_block_size=max_block_size)
        if tree_backend == "cudnn":
            return fused_causal_attention(
                q, k, v, segment_ids=segment_ids, block_size=block, subtree_end=subtree_end
            )
        return causal_attention(
            q, k, v, segment_ids=segment_ids, block_size=block, precision=precision, subtree_end=subtree_end
        )
    if backend == "xla":
        block = causal_block_size(t, max_block_size=max_block_size)
        return causal_attention(q, k, v, segment_ids=segment_ids, block_size=block, precision=precision)
    if backend == "cudnn":
        block = causal_block_size(t, max_block_size=max_block_size)
        return fused_causal_attention(q, k, v, segment_ids=segment_ids, block_size=block)
    if backend == "cudnn_ragged":
        block = causal_block_size(t, max_block_size=max_block_size)
        return packed_cudnn_attention(q, k, v, segment_ids=segment_ids, block_size=block)
    if backend == "splash":
        return splash_causal_attention(q, k, v, segment_ids=segment_ids)
    raise ValueError(
        f"unknown resolved attention backend {backend!r} (expected xla, cudnn, cudnn_ragged or splash)"
    )
