"""The chunked LM head's custom VJP and the loss-token gather, against dense full-logits references.

The references are written here from the definitions: full ``[N, V]`` logits, ``log_softmax``
(over the support when a floor is given), ``-sum p log p``, differentiated by JAX's autodiff.
Tolerances: float32 programs that reorder sums (chunks, a gather) differ by ~1e-6 relative here
(measured max 2.9e-6 on gradients of size ~10); the bounds below leave a 3-10x margin.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.models.decoder import UnembeddingLoRA
from rljax.models.logprobs import (
    capacity_ladder,
    lm_head_logprobs,
    log_normalizer,
    logit_capacity,
    shifted_token_mask,
    support_mask,
    support_probabilities,
)
from rljax.models.lora import LoRAConfig, apply_lora

GRAD_TOL = dict(rtol=2e-5, atol=2e-5)


def _dense(h, w, a, b, scale, targets, tau, floor):
    """Reference ``(logp [G, C, K], entropy [G, C])``: full logits, plain log_softmax."""
    z = jnp.einsum("gch,hv->gcv", h, w)
    if a is not None:
        z = z + scale * jnp.einsum("gcr,rv->gcv", jnp.einsum("gch,hr->gcr", h, a), b)
    z = z / tau[..., None]
    support = z > -jnp.inf
    if floor is not None:  # the logits at or above the floor, and the target (it was drawn)
        drawn = jnp.arange(z.shape[-1]) == targets[..., :1]
        support = (z >= floor[..., None]) | drawn
    lse = jax.nn.logsumexp(jnp.where(support, z, -jnp.inf), axis=-1, keepdims=True)
    logq = jnp.where(support, z - lse, 0.0)
    entropy = -jnp.sum(jnp.exp(logq) * logq * support, axis=-1)
    return jnp.take_along_axis(z - lse, targets, axis=-1), entropy


def _inputs(groups=2, rows=13, hidden=8, vocab=37, rank=3, k=1, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return dict(
        h=f(groups, rows, hidden),
        w=f(hidden, vocab),
        a=f(hidden, rank),
        b=0.5 * f(rank, vocab),
        targets=jnp.asarray(rng.integers(0, vocab, size=(groups, rows, k))),
        tau=jnp.asarray(rng.uniform(0.5, 1.5, size=(groups, rows)).astype(np.float32)),
        floor=jnp.asarray(rng.normal(size=(groups, rows)).astype(np.float32)),
        coef=f(groups, rows, k),
        ent_coef=f(groups, rows),
    )


def _losses(x, lora, with_floor):
    """``(head_loss, dense_loss)``: ``sum coef * logp + ent_coef * entropy`` of (h, w, a, b)."""
    scale = 0.75
    floor = x["floor"] if with_floor else None

    def head(h, w, a, b):
        adapter = UnembeddingLoRA(a, b, scale) if lora else None
        logp, ent = lm_head_logprobs(h, w, x["targets"], x["tau"], chunk_size=4, unembedding_lora=adapter,
                                     support_floor=floor)  # fmt: skip
        return jnp.sum(x["coef"] * logp) + jnp.sum(x["ent_coef"] * ent)

    def dense(h, w, a, b):
        logp, ent = _dense(h, w, a if lora else None, b, scale, x["targets"], x["tau"], floor)
        return jnp.sum(x["coef"] * logp) + jnp.sum(x["ent_coef"] * ent)

    return head, dense


@pytest.mark.parametrize("lora, with_floor, k", [(False, False, 1), (True, False, 2), (True, True, 1)])
def test_head_values_and_gradients_equal_dense_autodiff(lora, with_floor, k):
    x = _inputs(k=k, seed=k)
    head, dense = _losses(x, lora, with_floor)
    args = (x["h"], x["w"], x["a"], x["b"])
    got_val, got = jax.jit(jax.value_and_grad(head, argnums=(0, 1, 2, 3)))(*args)
    want_val, want = jax.value_and_grad(dense, argnums=(0, 1, 2, 3))(*args)
    np.testing.assert_allclose(float(got_val), float(want_val), rtol=1e-5)
    for name, g, r in zip("hwab", got, want, strict=True):
        if name in "ab" and not lora:
            assert not np.any(np.asarray(g)), name  # no adapter: nothing reaches A and B
            continue
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **GRAD_TOL, err_msg=name)


def test_support_floor_renormalises_over_the_kept_logits_by_hand():
    # logits log([1, 2, 5]), floor log(2), target 2: the support is {1, 2}, p = (0, 2/7, 5/7).
    z = jnp.log(jnp.array([[1.0, 2.0, 5.0]]))
    support = support_mask(z, jnp.log(jnp.array([2.0])), jnp.array([[2]]))
    assert np.asarray(support).tolist() == [[False, True, True]]
    lse, e, s = log_normalizer(z, support)
    np.testing.assert_allclose(np.asarray(e[0] / s[0]), [0.0, 2 / 7, 5 / 7], rtol=1e-6)
    np.testing.assert_allclose(float(lse[0]), np.log(7.0), rtol=1e-6)
    # a floor above the maximum keeps the drawn token alone
    support = support_mask(z, jnp.array([10.0]), jnp.array([[1]]))
    lse, e, s = log_normalizer(z, support)
    np.testing.assert_allclose(np.asarray(e[0] / s[0]), [0.0, 1.0, 0.0])
    np.testing.assert_allclose(np.asarray(support_probabilities(z, lse, support)[0]), [0.0, 1.0, 0.0])
    h, w = jnp.ones((1, 1, 1)), jnp.log(jnp.array([[1.0, 2.0, 5.0]]))  # h @ w = log([1, 2, 5])
    floor = jnp.log(jnp.array([[2.0]]))
    logp, ent = lm_head_logprobs(h, w, jnp.array([[2]]), jnp.ones((1, 1)), support_floor=floor)
    p = np.array([2 / 7, 5 / 7])
    np.testing.assert_allclose(float(logp[0, 0]), np.log(5 / 7), rtol=1e-6)
    np.testing.assert_allclose(float(ent[0, 0]), -np.sum(p * np.log(p)), rtol=1e-6)
    # a drawn token below its floor stays in the support: {0, 1, 2}, p = (1, 2, 5) / 8
    below, ent = lm_head_logprobs(h, w, jnp.array([[0]]), jnp.ones((1, 1)), support_floor=floor)
    np.testing.assert_allclose(float(below[0, 0]), np.log(1 / 8), rtol=1e-6)
    p = np.array([1, 2, 5]) / 8
    np.testing.assert_allclose(float(ent[0, 0]), -np.sum(p * np.log(p)), rtol=1e-6)
    with pytest.raises(ValueError, match="one target per row"):
        lm_head_logprobs(h, w, jnp.array([[[0, 1]]]), jnp.ones((1, 1)), support_floor=floor)


def _jaxpr_shapes(fn, *args):
    """``(shapes of every equation's outputs, shapes of every scan's carry)`` in ``fn``'s jaxpr."""
    shapes, carries = [], []

    def walk(jx):
        for eqn in jx.eqns:
            shapes.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            if eqn.primitive.name == "scan":
                carries.extend(tuple(v.aval.shape) for v in eqn.outvars[: eqn.params["num_carry"]])
        for sub in jax.extend.core.subjaxprs(jx):
            walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes, carries


def test_weight_gradient_is_accumulated_not_stacked_and_skipped_when_frozen():
    x = _inputs(groups=1, rows=40, hidden=3, vocab=37)  # 10 chunks of 4 rows
    head, _ = _losses(x, lora=False, with_floor=False)
    shapes, carries = _jaxpr_shapes(jax.grad(head, argnums=(0, 1)), x["h"], x["w"], x["a"], x["b"])
    assert (3, 37) in carries  # dW: one [H, V] accumulator carried through the chunks
    assert not [s for s in shapes if len(s) > 2 and s[-2:] == (3, 37)], "a stacked per-chunk dW"
    assert max(int(np.prod(s[:-1])) for s in shapes if len(s) >= 2 and s[-1] == 37) <= 4  # [chunk, V]
    _, carries = _jaxpr_shapes(jax.grad(head, argnums=0), x["h"], x["w"], x["a"], x["b"])
    assert (3, 37) not in carries  # W not differentiated: no weight gradient computed at all


def test_entropy_backward_only_when_the_entropy_has_a_gradient():
    """Without an entropy term (its cotangent a symbolic zero) the backward has no entropy part: one
    reduction over the vocabulary fewer per chunk. Its values: the ``ent_coef=0`` case of
    :func:`test_gathered_parameter_gradients_equal_full_logits_reference`."""
    x = _inputs(groups=1, rows=8, hidden=4, vocab=37)

    def reductions(entropy_grad):
        def loss(h, w):
            logp, ent = lm_head_logprobs(h, w, x["targets"][..., 0], x["tau"], chunk_size=4)
            ent = ent if entropy_grad else jax.lax.stop_gradient(ent)
            return jnp.sum(x["coef"][..., 0] * logp) + jnp.sum(ent)

        count = 0

        def walk(jx):
            nonlocal count
            count += sum(eqn.primitive.name == "reduce_sum" for eqn in jx.eqns)
            for sub in jax.extend.core.subjaxprs(jx):
                walk(sub)

        walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x["h"], x["w"]).jaxpr)
        return count

    assert reductions(False) < reductions(True)


def test_capacity_ladder_and_choice_by_hand():
    assert capacity_ladder(100) == [16, 24, 32, 48, 64, 96, 100]
    assert capacity_ladder(16) == [16]
    assert capacity_ladder(40, min_capacity=4) == [4, 6, 8, 12, 16, 24, 32, 40]
    mask = np.zeros((4, 32), bool)
    mask[1, :20] = True  # group of rows 0-1: 20 tokens; rows 2-3: 0
    mask[3, :5] = True
    assert logit_capacity(mask) == 32  # 25 wanted tokens in one group of 128
    assert logit_capacity(mask, row_groups=2) == 24  # the fuller group holds 20
    assert logit_capacity(mask, row_groups=4) == 24
    assert logit_capacity(np.stack([mask, np.ones_like(mask)]), row_groups=2) == 64  # micro-batches: max
    assert logit_capacity(np.zeros((2, 4), bool)) == 8  # never above a group's tokens
    with pytest.raises(ValueError, match="row_groups=3 must be a positive int dividing the 4 rows"):
        logit_capacity(mask, row_groups=3)


# ---------------------------------------------------------------------------------------------
# sequence_forward with logit_mask on random decoders: equal to every token / full logits.

VOCAB = 61


def _batch(seed=0, rows=4, length=12):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (rows, length)))
    seg = np.ones((rows, length), np.int32)
    seg[0, 6:] = 2
    seg[2, 8:] = 0
    seg[3, :5], seg[3, 5:] = 3, 4
    tau = jnp.asarray(rng.uniform(0.5, 1.5, (rows, length)).astype(np.float32))
    mask = jnp.asarray(rng.random((rows, length)) < 0.45)
    return tokens, jnp.asarray(seg), tau, mask


def test_gathered_logprobs_equal_every_token_and_overflow_is_nan(helpers):
    model = helpers.random_decoder(models.tiny_config(vocab_size=VOCAB, head_dim=16), seed=0)
    tokens, seg, tau, mask = _batch()
    every = models.sequence_forward(model, tokens, segment_ids=seg, temperature=tau, chunk_size=5)
    wanted = np.asarray(mask & shifted_token_mask(seg))
    # a row group per row (one row group: the overflow check below and the bf16 test)
    capacity = logit_capacity(np.asarray(mask), row_groups=4, min_capacity=1)
    out = models.sequence_forward(
        model, tokens, segment_ids=seg, temperature=tau, chunk_size=5, logit_mask=mask,
        logit_capacity=capacity, row_groups=4,
    )  # fmt: skip
    for got, ref in ((out.logprobs, every.logprobs), (out.entropy, every.entropy)):
        np.testing.assert_allclose(np.asarray(got)[wanted], np.asarray(ref)[wanted], **LOGPROB_TOL)
        assert not np.any(np.asarray(got)[~wanted])
    # one slot short in the fullest group: that group's last wanted token is NaN, nothing else
    short = models.sequence_forward(model, tokens, segment_ids=seg, temperature=tau, logit_mask=mask,
                                    logit_capacity=int(wanted.sum()) - 1).logprobs  # fmt: skip
    flat = np.flatnonzero(wanted.reshape(-1))
    assert np.flatnonzero(np.isnan(np.asarray(short)).reshape(-1)).tolist() == [flat[-1]]


def _dense_loss(model, tokens, seg, tau, mask, ent_coef):
    """Reference: full logits of the packed batch, log_softmax, masked sum (with entropy)."""
    logits = model(tokens, segment_ids=seg)
    z = logits[:, :-1] / tau[:, 1:, None]
    logq = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logq, tokens[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
    m = (mask & shifted_token_mask(seg))[:, 1:].astype(jnp.float32)
    return jnp.sum(m * (logp + ent_coef * ent))


def _gathered_loss(model, tokens, seg, tau, mask, ent_coef, capacity, groups):
    out = models.sequence_forward(model, tokens, segment_ids=seg, temperature=tau, chunk_size=4,
                                  logit_mask=mask, logit_capacity=capacity, row_groups=groups)  # fmt: skip
    ent = out.entropy if ent_coef else jax.lax.stop_gradient(out.entropy)
    return jnp.sum(out.logprobs + ent_coef * ent)


def _lora_model(helpers, cfg, targets):
    model = apply_lora(helpers.random_decoder(cfg, seed=2), LoRAConfig(rank=2, targets=targets),
                       rngs=nnx.Rngs(1))  # fmt: skip
    graphdef, state = nnx.split(model)  # nonzero B (the init's B = 0 would hide a wrong adapter gradient)
    rng = np.random.default_rng(5)
    state = jax.tree.map(lambda x: x + 0.1 * rng.normal(size=x.shape).astype(x.dtype), state)
    return nnx.merge(graphdef, state)


# Every weight of a tied model with an entropy term; LoRA on an untied unembedding (and a projection)
# without one. MoE routing replay with LoRA on the unembedding: tests/train/test_train_prefix_tree.py.
CASES = {
    "tied": dict(cfg=dict(tie_word_embeddings=True), ent_coef=0.3),
    "lora_lm_head_untied": dict(
        cfg=dict(tie_word_embeddings=False), lora=("lm_head", "q_proj"), ent_coef=0.0
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gathered_parameter_gradients_equal_full_logits_reference(helpers, case):
    spec = CASES[case]
    cfg = models.tiny_config(spec.get("model_type", "qwen3"), vocab_size=VOCAB, head_dim=16, **spec["cfg"])
    model = _lora_model(helpers, cfg, spec["lora"]) if "lora" in spec else helpers.random_decoder(cfg, seed=2)
    trained = models.lora.LoRAParam if "lora" in spec else nnx.Param
    graphdef, params, rest = nnx.split(model, trained, ...)
    tokens, seg, tau, mask = _batch(seed=1)
    capacity = logit_capacity(np.asarray(mask), row_groups=2)

    def grads(loss, *extra):
        return jax.jit(jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), tokens, seg, tau, mask,
                                               spec["ent_coef"], *extra)))(params)  # fmt: skip

    got, want = grads(_gathered_loss, capacity, 2), grads(_dense_loss)
    for (path, g), (_, r) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want), strict=True):
        np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(r.get_value()), **GRAD_TOL,
                                   err_msg=".".join(map(str, path)))  # fmt: skip


def test_bf16_remat_gathered_equals_every_token(helpers):
    cfg = models.tiny_config(vocab_size=VOCAB, head_dim=16)
    f32 = helpers.random_decoder(cfg, seed=3)
    abstract = nnx.eval_shape(lambda: models.Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                                     remat=True, rngs=nnx.Rngs(0)))  # fmt: skip
    model = nnx.merge(nnx.graphdef(abstract), nnx.state(f32))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens, seg, tau, mask = _batch(seed=2)

    def loss(p, gather):
        out = models.sequence_forward(nnx.merge(graphdef, p), tokens, segment_ids=seg, temperature=tau,
                                      logit_mask=mask if gather else None, logit_capacity=32)  # fmt: skip
        return jnp.sum(jnp.where(mask, out.logprobs, 0.0)), out.logprobs

    (val_g, lp_g), g = jax.jit(jax.value_and_grad(lambda p: loss(p, True), has_aux=True))(params)
    (val_e, lp_e), e = jax.jit(jax.value_and_grad(lambda p: loss(p, False), has_aux=True))(params)
    wanted = np.asarray(mask & shifted_token_mask(seg))
    # the same bf16 hidden states and float32 head: equal up to float32 reordering
    np.testing.assert_allclose(np.asarray(lp_g)[wanted], np.asarray(lp_e)[wanted], **LOGPROB_TOL)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(e), strict=True):
        # bf16 activations' gradients: one rounding of 2^-8 relative where the sums reorder
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2, atol=2e-3)
