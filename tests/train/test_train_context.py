"""Context parallelism (mesh.context) on 8 fake CPU devices: the load-balanced split, masks that never
leak across packed samples or chunk boundaries, and logprobs / loss / gradients / a few optimizer
steps that equal the context = 1 run.

Tolerances: context = 2 / 4 / 8 changes only the order of float32 reductions (attention rows are
computed against gathered keys, gradients of the keys are reduce-scattered). Measured on this
machine over 2 steps of the tiny model: metrics within 1.5e-6 relative, parameters within 1.2e-7
absolute, logprobs within 1e-6. The bounds below (rtol 1e-5 on metrics, atol 1e-6 + rtol 1e-5 on
parameters, :data:`tolerances.LOGPROB_TOL` on logprobs) keep a >= 5x margin over that noise and
are far below what a wrong mask or a misplaced chunk gives (>= 1e-2 on logprobs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_fixtures as tf
from jax.sharding import PartitionSpec
from tolerances import LOGPROB_TOL

from rljax.models.context import context_attention, load_balance, unbalance
from rljax.models.logprobs import sequence_forward
from rljax.training.sharding import MeshConfig, make_mesh, shard_batch
from rljax.training.step import (
    TrainState,
    mini_batch_counts,
    split_micro_batches,
    train_mini_batch,
    train_step,
)

P = PartitionSpec
OBJ = tf.OBJ
CONFIG = tf.TRAIN_CONFIG  # shared with the other sharded-step tests (train_fixtures)
NUM_STEPS = 2
METRICS = ("loss", "loss/rl", "loss/ce", "grad_norm", "entropy", "rl/mismatch_kl")


def test_load_balanced_split_gives_device_i_chunks_i_and_2c_minus_1_minus_i():
    for shards in (1, 2, 4):
        length = 4 * shards * 3  # chunks of 6 tokens... any multiple of 2C
        m = length // (2 * shards)
        order = np.asarray(load_balance(jnp.arange(length)[None], shards))[0]
        for i in range(shards):
            part = order[i * 2 * m : (i + 1) * 2 * m].tolist()
            want = list(range(i * m, (i + 1) * m)) + list(
                range((2 * shards - 1 - i) * m, (2 * shards - i) * m)
            )
            assert part == want
        np.testing.assert_array_equal(unbalance(order[None], shards)[0], np.arange(length))
    with pytest.raises(ValueError, match="divisible by 2 \\* shards = 8"):
        load_balance(jnp.arange(12)[None], 4)


def test_mesh_config_and_batch_sharding_have_the_context_axis():
    mesh = MeshConfig(data=2, context=4).make()
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    assert MeshConfig(data=2, context=4).size == 8
    with pytest.raises(ValueError, match="context: expected an int >= 1"):
        MeshConfig(context=0)
    batch = shard_batch(tf.make_batch(1), mesh)
    assert batch.tokens.sharding.spec == P(("data", "fsdp"), "context")
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_batch({"tokens": np.zeros((2, 20), np.int32)}, mesh)
    assert dict(make_mesh(data=8).shape) == {"data": 8, "fsdp": 1, "tensor": 1}  # context 1: no axis


def _context_attention(mesh, q, k, v, seg, chunk_size=None, collective="all_gather"):
    shards = mesh.shape["context"]

    @jax.jit
    def run(q, k, v, seg):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            bal = [load_balance(a, shards) for a in (q, k, v, seg)]
            out = context_attention(
                *bal[:3],
                segment_ids=bal[3],
                mesh=mesh.abstract_mesh,
                chunk_size=chunk_size,
                collective=collective,
            )
            return unbalance(out, shards)

    with jax.set_mesh(mesh):  # concrete devices for the un-placed numpy inputs
        return np.asarray(run(q, k, v, seg))


def _packed_segments(rows: int, length: int, seed: int) -> np.ndarray:
    """Rows of several packed samples of random lengths (some crossing chunk boundaries), then padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, length), np.int32)
    for r in range(rows):
        t, s = 0, 1
        while t < length - 3:
            n = int(rng.integers(1, length // 2))
            seg[r, t : t + n] = s
            t, s = t + n, s + 1
    return seg


COLLECTIVES = pytest.mark.parametrize("collective", ["all_gather", "ring"])


@COLLECTIVES
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_context_attention_mask_never_leaks(shards, collective):
    """q = 0 gives uniform weights over the allowed keys; v = one-hot of the key index reads them off:
    out[b, i, :, j] must be 1 / #{j' <= i, same sample} on allowed keys and exactly 0 elsewhere, so a
    leak across packed samples or across a chunk boundary (any wrong slot offset) fails."""
    rows, length = 2, 32
    seg = _packed_segments(rows, length, seed=shards)
    mesh = make_mesh(data=8 // shards, context=shards)
    q = np.zeros((rows, length, 2, length), np.float32)
    v = np.broadcast_to(np.eye(length, dtype=np.float32)[None, :, None], (rows, length, 1, length))
    k = np.ones((rows, length, 1, length), np.float32)
    out = _context_attention(mesh, q, k, np.ascontiguousarray(v), seg, chunk_size=3, collective=collective)
    causal = np.arange(length)[None, :] <= np.arange(length)[:, None]
    for b in range(rows):
        allowed = causal & (seg[b][:, None] == seg[b][None, :])
        want = allowed / allowed.sum(-1, keepdims=True)
        for h in range(2):
            np.testing.assert_allclose(out[b, :, h], want, atol=1e-6)
            assert np.all(out[b, :, h][~allowed] == 0.0)


@COLLECTIVES
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_context_attention_equals_float64_reference(shards, collective):
    rows, length, heads, kv_heads, d = 2, 32, 4, 2, 8
    seg = _packed_segments(rows, length, seed=7)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((rows, length, heads, d)).astype(np.float32)
    k, v = (rng.standard_normal((rows, length, kv_heads, d)).astype(np.float32) for _ in range(2))
    mesh = make_mesh(data=8 // shards, context=shards)
    out = _context_attention(mesh, q, k, v, seg, chunk_size=3, collective=collective)
    want = np.zeros((rows, length, heads, d))
    for b in range(rows):
        for h in range(heads):
            s = q[b, :, h].astype(np.float64) @ k[b, :, h // 2].astype(np.float64).T / np.sqrt(d)
            mask = (np.arange(length)[None] <= np.arange(length)[:, None]) & (seg[b][:, None] == seg[b][None])
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            want[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // 2]
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shards", [2, 4])
def test_ring_gradients_equal_unsharded_attention(shards):
    """Gradients of q, k, v through the ring (ppermute's transpose, the merge of partial softmaxes)
    equal those of the one-device causal attention."""
    from rljax.models.attention import causal_attention

    rows, length, heads, kv_heads, d = 2, 32, 4, 2, 8
    seg = _packed_segments(rows, length, seed=3)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((rows, length, heads, d)).astype(np.float32)
    k, v = (rng.standard_normal((rows, length, kv_heads, d)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((rows, length, heads, d)).astype(np.float32)
    mesh = make_mesh(data=8 // shards, context=shards)

    def ring_loss(q, k, v):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            bal = [load_balance(a, shards) for a in (q, k, v, seg)]
            out = context_attention(*bal[:3], segment_ids=bal[3], mesh=mesh.abstract_mesh, collective="ring")
            return jnp.sum(unbalance(out, shards) * w)

    def plain_loss(q, k, v):
        return jnp.sum(causal_attention(q, k, v, segment_ids=jnp.asarray(seg)) * w)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(plain_loss, argnums=(0, 1, 2)))(q, k, v)
    for g, x in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(x), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    return tf.make_model(0)


@pytest.fixture(scope="module")
def batch():
    return tf.make_batch(100)


@pytest.mark.parametrize(
    ("shards", "collective"), [(2, "all_gather"), (4, "all_gather"), (8, "all_gather"), (4, "ring")]
)
def test_scoring_forward_logprobs_equal_context_1(model, batch, shards, collective):
    """sequence_forward under a mesh with a context axis (the scoring forward) equals context = 1;
    rows of 33 tokens are padded to a multiple of 2C inside the model and cut back."""
    tokens, seg = np.asarray(batch.tokens), np.asarray(batch.segment_ids)
    tokens, seg = np.pad(tokens, ((0, 0), (0, 1))), np.pad(seg, ((0, 0), (0, 1)))
    forward = jax.jit(lambda m, t, s: sequence_forward(m, t, segment_ids=s, chunk_size=64))
    want = forward(model, tokens, seg)
    mesh = make_mesh(data=8 // shards, context=shards)
    model.context_attention = collective
    try:
        with jax.set_mesh(mesh):
            got = forward(model, tokens, seg)
    finally:
        model.context_attention = "all_gather"
    np.testing.assert_allclose(got.logprobs, want.logprobs, **LOGPROB_TOL)
    np.testing.assert_allclose(got.entropy, want.entropy, **LOGPROB_TOL)


@pytest.fixture(scope="module")
def batches():
    return [tf.make_batch(100 + i) for i in range(NUM_STEPS)]


@pytest.fixture(scope="module")
def reference_run(batches):
    """Params and metrics after each unsharded step (context = 1, one device)."""
    return tf.reference_steps(TrainState.create(tf.make_model(0), CONFIG), batches, OBJ)


def _check(state, metrics, want_params, want_metrics):
    for key in METRICS:
        np.testing.assert_allclose(float(metrics[key]), want_metrics[key], rtol=1e-5, atol=1e-7)
    for got, want in zip(tf.params_numpy(state), want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("axes", "collective"),
    [
        (dict(data=4, context=2), "all_gather"),
        (dict(fsdp=2, context=4), "all_gather"),
        (dict(data=2, context=2, tensor=2), "all_gather"),
        (dict(fsdp=2, context=4), "ring"),
    ],
    ids=["d4c2", "f2c4", "d2c2t2", "f2c4-ring"],
)
def test_train_steps_with_context_equal_context_1(axes, collective, batches, reference_run):
    """Loss, metrics, gradients (through the updated params) of 2 steps on packed multi-sample rows."""
    mesh = make_mesh(**axes)
    state = TrainState.create(tf.make_model(0, context_attention=collective), CONFIG, mesh=mesh)
    for b, (want_params, want_metrics) in zip(batches, reference_run, strict=True):
        sharded = shard_batch(b, mesh)
        state, metrics = train_step(state, sharded, mini_batch_counts(sharded, OBJ))
        _check(state, metrics, want_params, want_metrics)


@pytest.mark.slow
def test_context_with_remat_and_micro_batches_equals_context_1(batches, reference_run):
    mesh = make_mesh(data=2, context=4)
    state = TrainState.create(tf.make_model(0, remat="full"), CONFIG, mesh=mesh)
    for b, (want_params, want_metrics) in zip(batches, reference_run, strict=True):
        counts = mini_batch_counts(b, OBJ)
        micro = shard_batch(split_micro_batches(b, 2), mesh, stacked=True)
        assert micro.tokens.sharding.spec == P(None, ("data", "fsdp"), "context")
        state, metrics = train_mini_batch(state, micro, counts)
        _check(state, metrics, want_params, want_metrics)


def test_run_config_mesh_context_and_attention_keys():
    from rljax.run.builders import build_model
    from rljax.run.config import parse_run_config

    cfg = parse_run_config({"mesh": {"data": 2, "context": 4}, "trainer": {"seq_len": 1024}})
    assert cfg.mesh.context == 4 and cfg.mesh.size == 8
    assert parse_run_config({}).mesh.context == 1 and parse_run_config({}).model.attention == "auto"
    with pytest.raises(ValueError, match="config.mesh.context.*multiple of 2 x context = 8"):
        parse_run_config({"mesh": {"data": 2, "context": 4}, "trainer": {"seq_len": 1028}})
    with pytest.raises(ValueError, match="config.model.attention"):
        parse_run_config({"model": {"attention": "flash"}})
    assert parse_run_config({}).model.context_attention == "all_gather"
    with pytest.raises(ValueError, match="config.model.context_attention"):
        parse_run_config({"model": {"context_attention": "tree"}})
    with pytest.raises(ValueError, match="config.model.context_attention.*cuDNN"):
        parse_run_config({"model": {"context_attention": "ring", "attention": "cudnn"}})
    ring = parse_run_config({"model": {"context_attention": "ring"}}).model
    assert build_model(ring, vocab_size=300, seed=0).context_attention == "ring"
    section = parse_run_config({"model": {"attention": "xla"}}).model
    assert build_model(section, vocab_size=300, seed=0).attention == "xla"


@pytest.mark.slow
@pytest.mark.parametrize("shards", [2, 4])
def test_moe_forward_and_routing_equal_context_1(shards):
    """The MoE family: logprobs and the router's per-token statistics return in natural token order."""
    from flax import nnx

    from rljax.models import Decoder, tiny_config

    cfg = tiny_config("qwen3_moe", vocab_size=64, hidden_size=32, head_dim=8, num_layers=2)
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(shards)
    tokens = rng.integers(0, 64, (2, 32)).astype(np.int32)
    seg = _packed_segments(2, 32, seed=11)
    forward = jax.jit(lambda m, t, s: sequence_forward(m, t, segment_ids=s, with_routing=True))
    want = forward(model, tokens, seg)
    with jax.set_mesh(make_mesh(data=8 // shards, context=shards)):
        got = forward(model, tokens, seg)
    np.testing.assert_allclose(got.logprobs, want.logprobs, **LOGPROB_TOL)
    np.testing.assert_allclose(got.routing.logits, want.routing.logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got.routing.experts, want.routing.experts)


@pytest.mark.slow
def test_checkpoint_moves_between_context_sizes(batches, reference_run, tmp_path):
    """Saved from a context=4 mesh after one step, restored bit-equal onto context=2 and onto one
    device; the restored state's next step equals the reference's second step."""
    from rljax.training import checkpoint

    mesh = make_mesh(data=2, context=4)
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    sharded = shard_batch(batches[0], mesh)
    state, _ = train_step(state, sharded, mini_batch_counts(sharded, OBJ))
    checkpoint.save(tmp_path / "ckpt", 1, params=state.params, opt_state=state.opt_state)
    saved = tf.params_numpy(state)
    for target_mesh in (make_mesh(fsdp=2, context=2, tensor=2), None):
        target = TrainState.create(tf.make_model(1), CONFIG, mesh=target_mesh)
        restored = checkpoint.restore(tmp_path / "ckpt", params=target.params, opt_state=target.opt_state)
        for got, want in zip(jax.tree.leaves(restored.params), saved, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        if target_mesh is not None:
            assert jax.tree.leaves(restored.params)[0].sharding == jax.tree.leaves(target.params)[0].sharding
    resumed = dataclasses.replace(
        target, params=restored.params, opt_state=restored.opt_state, step=restored.step
    )
    resumed = dataclasses.replace(resumed, step=jnp.asarray(restored.step, jnp.int32))
    resumed, metrics = train_step(resumed, batches[1], mini_batch_counts(batches[1], OBJ))
    _check(resumed, metrics, *reference_run[1])
