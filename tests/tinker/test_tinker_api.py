"""The Tinker-compatible API driven by the real ``tinker`` SDK (0.38.0) against an in-process server.

References are independent of the server's code path: logprobs from the model's own logits
(``Decoder.logits`` of ``hidden_states`` of the UNPACKED sequence) in float64 numpy, the loss
formulas written here from the Tinker documentation, gradients by ``jax.grad`` of those formulas,
and Adam by ``optax.adamw`` with the SDK's hyperparameters.

Marked ``integration``: a real HTTP server (uvicorn in a thread, one per module) trained end to end
through the SDK.
"""

from __future__ import annotations

import dataclasses
import functools

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rljax.models import sequence_logprobs  # noqa: E402
from rljax.recipes import tinker as tinker_config  # noqa: E402
from rljax.tinker import serve_in_thread  # noqa: E402
from rljax.training.step import merge_model  # noqa: E402

pytestmark = pytest.mark.integration

BASE = "rljax/tiny"
KEY = "tml-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve_in_thread(tinker_config.get_config(), tmp_path_factory.mktemp("tinker"), max_lora_rank=16)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    sdk = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield sdk
    sdk.close("success").result()  # ends its session's heartbeats before the server stops


def _seq(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(3, 200, size=n)


def _datum(seq: np.ndarray, **inputs: np.ndarray) -> types.Datum:
    """model_input = seq[:-1], target_tokens = seq[1:] (the documented next-token alignment)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints([int(t) for t in seq[:-1]]),
        loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64), **inputs},
    )


@functools.partial(jax.jit, static_argnums=0)
def _logits_of_tokens(graphdef, params, frozen, tokens: jax.Array) -> jax.Array:
    model = merge_model(graphdef, params, frozen)
    return model.logits(model.hidden_states(tokens[None]).hidden)[0]


def _logits(graphdef, params, frozen, seq: np.ndarray) -> jax.Array:
    """float32 logits of the whole unpacked input ``seq[:-1]`` (the model's own head)."""
    return _logits_of_tokens(graphdef, params, frozen, jnp.asarray(seq[:-1], jnp.int32))


def _ref_logp(graphdef, params, frozen, seq: np.ndarray) -> np.ndarray:
    """float64 ``log softmax(logits)[target]`` at every position."""
    z = np.asarray(_logits(graphdef, params, frozen, seq), np.float64)
    z = z - z.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1))
    return z[np.arange(len(seq) - 1), seq[1:]] - lse


def _jax_logp(graphdef, params, frozen, seq: np.ndarray) -> jax.Array:
    z = jax.nn.log_softmax(_logits(graphdef, params, frozen, seq), axis=-1)
    return z[jnp.arange(len(seq) - 1), jnp.asarray(seq[1:])]


def _state(server, tc):
    m = server.service.models[tc.model_id]
    return m, m.graphdef, jax.tree.map(jnp.array, m.params), m.frozen


def _close(a, b, **kw) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def test_capabilities_and_info(server, client):
    caps = client.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    lora = client.create_lora_training_client(base_model=BASE, rank=4).result()
    info = lora.get_info()
    assert info.is_lora and info.lora_rank == 4 and info.model_data.model_name == BASE
    full = client.create_lora_training_client(base_model=BASE, rank=0).result()  # rank 0: full fine-tuning
    assert full.get_info().is_lora is False


def test_cross_entropy_and_adam_match_references(server, client):
    """CE logprobs / loss equal float64 references and rljax's sequence_logprobs; two optim_steps
    equal two hand-made optax AdamW steps on jax.grad of the CE formula."""
    rng = np.random.default_rng(0)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    m, graphdef, p0, frozen = _state(server, tc)
    seqs = [_seq(rng, 9), _seq(rng, 5)]
    weights = [rng.uniform(0, 1, len(s) - 1).astype(np.float32) for s in seqs]
    data = [_datum(s, weights=w) for s, w in zip(seqs, weights, strict=True)]
    adam = types.AdamParams(learning_rate=0.05, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.1)

    def ce(params):
        return sum(
            -(w * _jax_logp(graphdef, params, frozen, s)).sum() for s, w in zip(seqs, weights, strict=True)
        )

    tx = optax.adamw(0.05, b1=0.8, b2=0.9, eps=1e-3, weight_decay=0.1)
    grad_ce = jax.jit(jax.grad(ce))
    ref_params, opt = p0, tx.init(p0)
    for step in range(2):
        out = tc.forward_backward(data, "cross_entropy").result()
        ref = [_ref_logp(graphdef, ref_params, frozen, s) for s in seqs]
        for o, r in zip(out.loss_fn_outputs, ref, strict=True):
            np.testing.assert_allclose(o["logprobs"].to_numpy(), r, atol=2e-5)
        expected = sum(-(w * r).sum() for w, r in zip(weights, ref, strict=True))
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        if step == 0:  # rljax's own logprobs of the whole sequence (entry t: log p(x_t | x_<t))
            model = merge_model(graphdef, p0, frozen)
            lp = np.asarray(sequence_logprobs(model, jnp.asarray(seqs[0][None], jnp.int32)))[0, 1:]
            np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), lp, atol=2e-5)
        grads = grad_ce(ref_params)
        _close(m.pending, grads, atol=2e-4, rtol=1e-4)  # |g| up to ~8: float32 noise ~1e-5 relative
        tc.optim_step(adam).result()
        updates, opt = tx.update(grads, opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        # Adam divides by sqrt(v) + eps (1e-3): a gradient entry ~2e-4 (the unembedding adapter's A,
        # whose gradient is 0 at step 0 while B = 0) carries its float32 noise (~7e-6) into the update
        # at ~lr * noise / (|g| + eps): up to 1.4e-4 measured, 0.3 % of one step of lr = 0.05.
        _close(m.params, ref_params, atol=3e-4, rtol=1e-4)
    assert m.step == 2


def test_full_finetune_step_matches_adam(server, client):
    rng = np.random.default_rng(1)
    tc = client.create_lora_training_client(base_model=BASE, rank=0).result()
    m, graphdef, p0, frozen = _state(server, tc)
    seq = _seq(rng, 7)
    tc.forward_backward([_datum(seq)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=0.5)).result()
    grads = jax.jit(jax.grad(lambda p: -_jax_logp(graphdef, p, frozen, seq).sum()))(p0)
    grads = optax.clip_by_global_norm(0.5).update(grads, None)[0]
    tx = optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-12, weight_decay=0.0)  # the SDK's AdamParams defaults
    updates, _ = tx.update(grads, tx.init(p0), p0)
    _close(server.service.models[tc.model_id].params, optax.apply_updates(p0, updates), atol=2e-6, rtol=1e-4)


def _np_loss(name: str, lp: np.ndarray, q: np.ndarray, a: np.ndarray, cfg: dict) -> np.ndarray:
    """float64 per-token losses from the documented formulas."""
    r = np.exp(lp - q)
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if name == "importance_sampling":
        return -(r * a)
    if name == "ppo":
        return -np.minimum(r * a, np.clip(r, lo, hi) * a)
    if name == "cispo":
        return -(np.clip(r, lo, hi) * lp * a)
    if name == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2)
    if name == "gspo":
        s = np.exp(np.mean(lp - q))
        return -np.minimum(s * a, np.clip(s, lo, hi) * a)
    raise AssertionError(name)


def _jax_loss(name: str, lp: jax.Array, q: np.ndarray, a: np.ndarray, cfg: dict) -> jax.Array:
    """The same formulas in jax with the documented stop-gradients (for the reference gradient)."""
    sg = jax.lax.stop_gradient
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    r = jnp.exp(lp - q)
    if name == "importance_sampling":
        return -(r * a)
    if name == "ppo":
        return -jnp.minimum(r * a, jnp.clip(r, lo, hi) * a)
    if name == "cispo":
        return -(sg(jnp.clip(r, lo, hi)) * lp * a)
    if name == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2)
    if name == "gspo":
        s = jnp.exp(jnp.mean(sg(lp) - q) + lp - sg(lp))
        return -jnp.minimum(s * a, jnp.clip(s, lo, hi) * a)
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
        ("cispo", {}),
        ("dro", {"beta": 0.3}),
        ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
    ],
)
def test_policy_losses_match_formulas(server, client, name, cfg):
    rng = np.random.default_rng(7)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    _, graphdef, p0, frozen = _state(server, tc)
    seqs = [_seq(rng, 8), _seq(rng, 6)]
    ref = [_ref_logp(graphdef, p0, frozen, s) for s in seqs]
    qs = [(r + rng.uniform(-0.4, 0.4, len(r))).astype(np.float32) for r in ref]  # ratios ~ [0.67, 1.5]
    advs = [rng.normal(size=len(r)).astype(np.float32) for r in ref]
    data = [_datum(s, logprobs=q, advantages=a) for s, q, a in zip(seqs, qs, advs, strict=True)]
    out = tc.forward_backward(data, name, cfg or None).result()
    expected = sum(
        _np_loss(name, r, q.astype(np.float64), a.astype(np.float64), cfg).sum()
        for r, q, a in zip(ref, qs, advs, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)

    def loss(params):
        return sum(
            _jax_loss(name, _jax_logp(graphdef, params, frozen, s), q, a, cfg).sum()
            for s, q, a in zip(seqs, qs, advs, strict=True)
        )

    _close(server.service.models[tc.model_id].pending, jax.jit(jax.grad(loss))(p0), atol=3e-5, rtol=1e-3)


def test_custom_loss_through_the_sdk(server, client):
    """forward_backward_custom: the SDK differentiates the loss locally and sends -dC/dlogp."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    _, graphdef, p0, frozen = _state(server, tc)
    seq = _seq(rng, 7)

    def squared(data, logprobs):
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"squared": float(loss)}

    out = tc.forward_backward_custom([_datum(seq)], squared).result()
    ref = _ref_logp(graphdef, p0, frozen, seq)
    assert out.metrics["loss:sum"] == pytest.approx((ref**2).sum(), rel=1e-4)
    grads = jax.grad(lambda p: (_jax_logp(graphdef, p, frozen, seq) ** 2).sum())(p0)
    _close(server.service.models[tc.model_id].pending, grads, atol=3e-5, rtol=1e-3)
    del torch


def _paths(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}


def _np_unembed_logp(server, seq: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float):
    """float64 ``(logp of seq[1:], h, z)`` with logits ``h (W + scale A B)``: ``h`` the BASE model's
    hidden states of ``seq[:-1]`` (an adapter on the output projection alone leaves them unchanged),
    ``W`` the tied embedding's transpose."""
    base = server.service.base
    h = np.asarray(base.hidden_states(jnp.asarray(seq[None, :-1], jnp.int32)).hidden, np.float64)[0]
    w = np.asarray(base.embed_tokens[...], np.float64).T
    z = h @ (w + scale * a.astype(np.float64) @ b.astype(np.float64))
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logp[np.arange(len(seq) - 1), seq[1:]], h, logp


def test_train_unembed_trains_an_output_projection_adapter(server, client):
    """train_unembed adds a LoRA adapter on the (tied) unembedding: with train_attn / train_mlp off it
    is the only trained tensor; logprobs equal the float64 reference h (W + (alpha/r) A B), its
    gradients the analytic ones, one Adam step optax's; train_unembed=False has no such adapter; a
    sampling client on the saved weights samples with it (logprobs = compute_logprobs = reference)."""
    assert server.service.base.config.tie_word_embeddings  # the tiny default: tied embeddings
    rng = np.random.default_rng(19)
    none = client.create_lora_training_client(base_model=BASE, rank=4, seed=6, train_unembed=False).result()
    assert not any("lm_head" in k for k in _paths(server.service.models[none.model_id].params))
    every = client.create_lora_training_client(base_model=BASE, rank=4, seed=6).result()  # SDK default: on
    keys = _paths(server.service.models[every.model_id].params)
    assert {"lm_head_lora.lora_a", "lm_head_lora.lora_b"} <= set(keys) and len(keys) > 2

    tc = client.create_lora_training_client(
        base_model=BASE, rank=4, seed=6, train_attn=False, train_mlp=False, train_unembed=True
    ).result()
    m = server.service.models[tc.model_id]
    p0 = _paths(m.params)
    assert sorted(p0) == ["lm_head_lora.lora_a", "lm_head_lora.lora_b"]
    vocab, hidden = server.service.base.embed_tokens.shape
    assert p0["lm_head_lora.lora_a"].shape == (hidden, 4) and p0["lm_head_lora.lora_b"].shape == (4, vocab)
    assert not p0["lm_head_lora.lora_b"].any()  # B = 0: a fresh adapter changes nothing
    scale = server.service.options.lora_alpha / 4
    seqs = [_seq(rng, 9), _seq(rng, 6)]
    weights = [rng.uniform(0.2, 1, len(s) - 1) for s in seqs]
    data = [_datum(s, weights=w.astype(np.float32)) for s, w in zip(seqs, weights, strict=True)]
    tx = optax.adamw(0.05, b1=0.9, b2=0.95, eps=1e-12, weight_decay=0.0)
    ref = dict(p0)  # optax's Adam on the float64 reference gradients (cast to float32, as the server's)
    opt = tx.init(ref)
    for step in range(2):
        a, b = (np.asarray(ref[k], np.float64) for k in ("lm_head_lora.lora_a", "lm_head_lora.lora_b"))
        out = tc.forward_backward(data, "cross_entropy").result()
        grad_a, grad_b = np.zeros_like(a), np.zeros_like(b)
        for o, s, w in zip(out.loss_fn_outputs, seqs, weights, strict=True):
            want, h, logp = _np_unembed_logp(server, s, a, b, scale)
            np.testing.assert_allclose(o["logprobs"].to_numpy(), want, atol=2e-5)
            dz = w[:, None] * np.exp(logp)  # d(-sum w logp)/dz = -w (onehot - p)
            dz[np.arange(len(w)), s[1:]] -= w
            grad_a += scale * h.T @ dz @ b.T
            grad_b += scale * (h @ a).T @ dz
        got = _paths(m.pending)
        np.testing.assert_allclose(got["lm_head_lora.lora_b"], grad_b, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(got["lm_head_lora.lora_a"], grad_a, atol=2e-5, rtol=1e-4)
        assert (np.abs(grad_a).max() > 1e-3) == (step == 1)  # dL/dA = 0 while B = 0
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        grads = {
            "lm_head_lora.lora_a": grad_a.astype(np.float32),
            "lm_head_lora.lora_b": grad_b.astype(np.float32),
        }
        updates, opt = tx.update(grads, opt, ref)
        ref = optax.apply_updates(ref, updates)
        for k, v in _paths(m.params).items():
            np.testing.assert_allclose(v, ref[k], atol=1e-5, rtol=1e-4)
    assert np.abs(_paths(m.params)["lm_head_lora.lora_b"]).max() > 1e-2  # it trained

    # sampling from the saved adapter: the sampler's logprobs = compute_logprobs = the reference
    path = tc.save_weights_for_sampler("unembed").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    final = _paths(m.params)
    prompt = [int(t) for t in seqs[0][:4]]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    full = np.array(prompt + list(res.tokens))
    want, _, _ = _np_unembed_logp(
        server, full, final["lm_head_lora.lora_a"], final["lm_head_lora.lora_b"], scale
    )
    lps = sampler.compute_logprobs(types.ModelInput.from_ints([int(t) for t in full])).result()
    np.testing.assert_allclose(np.array(lps[1:], np.float64), want, atol=2e-5)
    np.testing.assert_allclose(res.logprobs, want[len(prompt) - 1 :], atol=2e-4)
    base_lp, _, _ = _np_unembed_logp(
        server, full, final["lm_head_lora.lora_a"], 0 * final["lm_head_lora.lora_b"], 0
    )
    assert np.abs(base_lp - want).max() > 1e-2  # the adapter matters: the comparisons can fail


def _unembed_only(client, seed: int):
    """A LoRA client whose only adapter is on the unembedding (rank 4), so gradients have a closed form."""
    return client.create_lora_training_client(
        base_model=BASE, rank=4, seed=seed, train_attn=False, train_mlp=False, train_unembed=True
    ).result()


def _set_b(server, tc, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Gives the client's unembedding adapter a non-zero B (so both A and B get gradients): (A, B, scale)."""
    m = server.service.models[tc.model_id]
    b = m.params["lm_head_lora"]["lora_b"]
    b.set_value(jnp.asarray(0.3 * np.random.default_rng(seed).normal(size=b.get_value().shape), jnp.float32))
    p = _paths(m.params)
    return p["lm_head_lora.lora_a"], p["lm_head_lora.lora_b"], server.service.options.lora_alpha / 4


def _unembed_grads(h, a, b, scale, dz) -> dict[str, np.ndarray]:
    """float64 gradient of a loss whose logit gradient is ``dz`` (``[N, V]``): logits ``h (W + s A B)``."""
    return {"lm_head_lora.lora_a": scale * h.T @ dz @ b.T, "lm_head_lora.lora_b": scale * (h @ a).T @ dz}


def test_custom_loss_on_a_target_distribution_matches_the_hand_computed_gradient(server, client):
    """forward_backward_custom with K targets per position (``target_tokens [N, K]``, the SDK's own
    example) and a target distribution P: the forward's logprobs ``[N, K]`` (ragged K across datums)
    equal the float64 reference, ``loss:sum`` is ``C = -sum P logp`` and the gradient the SDK's
    linearized backward leaves is the analytic ``dC/dz = sum_k P_k (softmax - onehot(t_k))`` pushed
    through ``h (W + s A B)``."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(23)
    tc = _unembed_only(client, 8)
    a, b, scale = _set_b(server, tc, 1)
    data, refs = [], []
    for n, k in ((7, 3), (5, 2)):
        seq = _seq(rng, n + 1)
        targets = rng.integers(3, 200, size=(n, k))
        dist = rng.dirichlet(np.ones(k), size=n).astype(np.float32)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints([int(t) for t in seq[:-1]]),
                loss_fn_inputs={
                    "target_tokens": targets.astype(np.int64),
                    "target_distribution": types.TensorData(
                        data=dist.reshape(-1).tolist(), dtype="float32", shape=[n, k]
                    ),
                },
            )
        )
        _, h, logp = _np_unembed_logp(server, seq, a, b, scale)
        refs.append((h, logp, targets, dist.astype(np.float64)))

    def custom(data, logprobs_list):
        loss = sum(
            -(d.loss_fn_inputs["target_distribution"].to_torch() * lp).sum()
            for d, lp in zip(data, logprobs_list, strict=True)
        )
        return loss, {}

    out = tc.forward_backward_custom(data, custom).result()
    want_loss, grads = 0.0, None
    for o, (h, logp, targets, dist) in zip(out.loss_fn_outputs, refs, strict=True):
        lp = np.take_along_axis(logp, targets, axis=1)
        assert list(o["logprobs"].shape) == list(targets.shape)
        np.testing.assert_allclose(o["logprobs"].to_numpy().reshape(targets.shape), lp, atol=2e-5)
        want_loss += -(dist * lp).sum()
        dz = dist.sum(1, keepdims=True) * np.exp(logp)
        np.add.at(dz, (np.arange(len(targets))[:, None], targets), -dist)
        g = _unembed_grads(h, a, b, scale, dz)
        grads = g if grads is None else {k: grads[k] + g[k] for k in g}
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)
    got = _paths(server.service.models[tc.model_id].pending)
    for k, v in grads.items():
        np.testing.assert_allclose(got[k], v, atol=2e-5, rtol=1e-4)
    assert np.abs(grads["lm_head_lora.lora_a"]).max() > 1e-2


def test_custom_loss_handle_matches_the_hand_computed_gradient(server, client):
    """A loss made by ServiceClient.create_custom_loss (traced; this server runs it client-side) reading
    an extra input: C = -sum exp(logp) A; its gradient is the analytic one, its metric is summed."""
    pytest.importorskip("torch")
    rng = np.random.default_rng(29)
    tc = _unembed_only(client, 9)
    a, b, scale = _set_b(server, tc, 2)

    def prob_reinforce(logprobs, advantages):
        return -(logprobs.exp() * advantages).sum(), {"custom/prob:sum": logprobs.exp().sum()}

    handle = client.create_custom_loss(prob_reinforce, {"logprobs": 1, "advantages": 1}).result()
    assert handle.loss_id is None  # custom_loss_server_side is off: the SDK runs it
    seqs = [_seq(rng, 8), _seq(rng, 6)]
    advs = [rng.normal(size=len(s) - 1).astype(np.float32) for s in seqs]
    out = tc.forward_backward_custom(
        [_datum(s, advantages=v) for s, v in zip(seqs, advs, strict=True)], handle
    ).result()
    want_loss = want_prob = 0.0
    grads = None
    for s, adv in zip(seqs, advs, strict=True):
        lp, h, logp = _np_unembed_logp(server, s, a, b, scale)
        want_loss += -(np.exp(lp) * adv).sum()
        want_prob += np.exp(lp).sum()
        c = -np.exp(lp) * adv  # dC/dlogp
        dz = -c[:, None] * np.exp(logp)  # dlogp_t/dz = onehot - softmax
        dz[np.arange(len(lp)), s[1:]] += c
        g = _unembed_grads(h, a, b, scale, dz)
        grads = g if grads is None else {k: grads[k] + g[k] for k in g}
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert out.metrics["custom/prob:sum"] == pytest.approx(want_prob, rel=1e-5)
    got = _paths(server.service.models[tc.model_id].pending)
    for k, v in grads.items():
        np.testing.assert_allclose(got[k], v, atol=2e-5, rtol=1e-4)


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring: one per XLA compile


def _compile_counts(server, tmp_path, min_rows: int, sizes: list[list[int]]) -> tuple[int, int, int]:
    """Serves the module's model with ``min_rows`` and sends, through the SDK, one warm-up round
    (two forward_backward, optim_step, forward) then one forward_backward + optim_step + forward per
    entry of ``sizes`` (its datums' lengths). Returns (XLA compiles, step traces) during the rounds
    after the warm-up, and the packed row counts seen, as a bit mask."""
    from rljax.tinker import TinkerServer, free_port
    from rljax.tinker.service import TinkerService
    from rljax.tinker.trainable import STEP_TRACES

    options = dataclasses.replace(server.service.options, min_rows=min_rows)
    srv = TinkerServer(TinkerService(server.service.run, tmp_path, options), "127.0.0.1", free_port())
    compiles: list[str] = []

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE:
            compiles.append(event)

    rows = 0
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        sdk = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        tc = sdk.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        rng = np.random.default_rng(41)

        def round_(lengths: list[int], warm: bool = False) -> None:
            data = [_datum(_seq(rng, n + 1)) for n in lengths]
            tc.forward_backward(data, "cross_entropy").result()
            if warm:
                tc.forward_backward(data, "cross_entropy").result()  # adds to pending gradients
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            tc.forward(data, "cross_entropy").result()

        round_([30], warm=True)
        before, traces = len(compiles), sum(STEP_TRACES.values())
        for lengths in sizes:
            round_(lengths)
            rows |= srv.service.last_packed_rows
        result = len(compiles) - before, sum(STEP_TRACES.values()) - traces, rows
        sdk.close("success").result()  # ends its heartbeats before the server stops
        return result
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
        srv.stop()


def test_requests_of_varying_sizes_reuse_a_few_compiled_steps(server, tmp_path):
    """Packed rows are a power of two >= min_rows: with min_rows=8, after one warm-up, 10 rounds of
    1..7 datums of 2..30 tokens (1 to 7 rows of 32) compile NOTHING (no XLA compile event at all, no
    trace of the step); a batch of 12 datums (16 rows) compiles the 16-row forward and
    forward_backward once, and small batches after it still compile nothing. The same rounds with
    min_rows=1 (rows 1, 2, 4, 8) recompile: the counts can fail."""
    rng = np.random.default_rng(43)
    small = [list(rng.integers(2, 31, size=int(k))) for k in [1, 3, 7, 2, 5, 1, 6, 4, 7, 2]]
    assert max(len(x) for x in small) == 7 and min(len(x) for x in small) == 1
    compiles, traces, rows = _compile_counts(server, tmp_path / "a", 8, small)
    assert (compiles, traces, rows) == (0, 0, 8)
    compiles, traces, rows = _compile_counts(server, tmp_path / "b", 8, [[30] * 12, *small[:4]])
    assert traces == 2 and compiles >= 2 and rows == 8 | 16  # the 16-row fwd + fwd/bwd, once each
    compiles, traces, rows = _compile_counts(server, tmp_path / "c", 1, small)
    assert traces >= 4 and compiles >= traces and rows == 1 | 2 | 4 | 8


def _held(svc, n: int):
    """A context: the service's worker is held busy until ``n`` more jobs are queued, so requests sent
    inside it are drained together (as concurrent clients' requests are)."""
    import contextlib
    import threading
    import time

    @contextlib.contextmanager
    def hold():
        gate, started = threading.Event(), threading.Event()

        def block() -> dict:
            started.set()
            gate.wait(120)
            return {}

        svc._submit("hold", "hold", block)
        assert started.wait(60)
        try:
            yield
            deadline = time.monotonic() + 60
            while svc._queue.qsize() < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert svc._queue.qsize() >= n
        finally:
            gate.set()

    return hold()


def test_lora_clients_queued_together_run_as_one_step(server, client):
    """forward_backward requests of two LoRA clients (equal rank) queued together run as ONE step
    (adapters stacked, the step vmapped over them) and give each client exactly what it gets alone:
    logprobs, loss and gradients equal a twin client's (same seed, same data) that ran alone, so one
    client's step never changes another's outputs. A full fine-tuning client and a client of
    another rank queued with them run on their own, also equal to their twins."""
    svc = server.service
    rng = np.random.default_rng(47)
    data = {
        k: [_datum(_seq(rng, n)) for n in ns]
        for k, ns in {"a": (9, 5), "b": (12,), "f": (7,), "r": (6, 4)}.items()
    }
    kinds = {
        "a": dict(rank=4, seed=1),
        "b": dict(rank=4, seed=2),
        "f": dict(rank=0),
        "r": dict(rank=8, seed=3),
    }
    clients = {
        k: client.create_lora_training_client(base_model=BASE, **kw).result() for k, kw in kinds.items()
    }
    twins = {k: client.create_lora_training_client(base_model=BASE, **kw).result() for k, kw in kinds.items()}
    for k in kinds:
        _close(svc.models[clients[k].model_id].params, svc.models[twins[k].model_id].params, rtol=0, atol=0)
    alone = {k: twins[k].forward_backward(data[k], "cross_entropy").result() for k in kinds}
    steps, fused = svc.steps_run, svc.fused_steps
    with _held(svc, 4):
        futures = {k: clients[k].forward_backward(data[k], "cross_entropy") for k in kinds}
    together = {k: f.result() for k, f in futures.items()}
    assert svc.fused_steps == fused + 1 and svc.steps_run == steps + 3  # a+b, f, r
    for k in kinds:
        for o, w in zip(together[k].loss_fn_outputs, alone[k].loss_fn_outputs, strict=True):
            np.testing.assert_allclose(o["logprobs"].to_numpy(), w["logprobs"].to_numpy(), atol=2e-6)
        assert together[k].metrics["loss:sum"] == pytest.approx(alone[k].metrics["loss:sum"], rel=1e-6)
        got, want = svc.models[clients[k].model_id].pending, svc.models[twins[k].model_id].pending
        _close(got, want, atol=1e-6, rtol=1e-5)
    # and the next fused step runs on the trained adapters (each its own)
    for k in ("a", "b"):
        clients[k].optim_step(types.AdamParams(learning_rate=0.05)).result()
        twins[k].optim_step(types.AdamParams(learning_rate=0.05)).result()
    with _held(svc, 2):
        futures = {k: clients[k].forward(data[k], "cross_entropy") for k in ("a", "b")}
    for k, f in futures.items():
        want = twins[k].forward(data[k], "cross_entropy").result()
        for o, w in zip(f.result().loss_fn_outputs, want.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(o["logprobs"].to_numpy(), w["logprobs"].to_numpy(), atol=2e-5)
    assert svc.fused_steps == fused + 2


def test_fusion_keeps_each_clients_order(server, client):
    """The worker's plan: a later client's forward_backward joins an earlier one's step only when
    none of its own jobs, and no barrier (a job of no model, other than sampling), lies between."""
    from rljax.tinker.service import _Job
    from rljax.tinker.wire import FwdBwdRequest

    svc = server.service
    ids = {k: client.create_lora_training_client(base_model=BASE, rank=4).result().model_id for k in "ABDE"}
    ids["C"] = client.create_lora_training_client(base_model=BASE, rank=0).result().model_id

    def fb(k: str, loss: str = "cross_entropy") -> _Job:
        return _Job("forward_backward", ids[k], None, None, FwdBwdRequest(ids[k], 0, loss, {}, False, []))

    def other(kind: str, k: str | None) -> _Job:
        return _Job(kind, ids[k] if k else None, None, None)

    jobs = [fb("A"), other("optim_step", "B"), fb("B"), fb("C"), other("sample", None), fb("E", "ppo"),
            fb("D"), other("drop", None), fb("E")]  # fmt: skip
    plan = [[jobs.index(g[0]) for g in step] for step in svc._plan(jobs)]
    assert plan == [[0, 6], [1], [2], [3], [4], [5], [7], [8]]


def test_unsupported_losses_are_refused(server, client):
    tc = client.create_lora_training_client(base_model=BASE, rank=2).result()
    seq = np.arange(3, 9)
    with pytest.raises(Exception, match="stable_reinforce"):
        tc.forward_backward(
            [_datum(seq, logprobs=np.zeros(5, np.float32), advantages=np.ones(5, np.float32))],
            "stable_reinforce",
        ).result()
    with pytest.raises(Exception, match="beta"):
        tc.forward_backward(
            [_datum(seq, logprobs=np.zeros(5, np.float32), advantages=np.ones(5, np.float32))], "dro"
        ).result()


def test_malformed_body_is_a_clear_400(server):
    r = httpx.post(
        f"{server.base_url}/api/v1/forward_backward",
        content=b"\xff\x00garbage",
        headers={"content-type": "application/x-protobuf", "x-api-key": KEY},
    )
    assert r.status_code == 400 and "malformed" in r.json()["detail"]
    r = httpx.post(f"{server.base_url}/api/v1/optim_step", content=b"{not json", headers={"x-api-key": KEY})
    assert r.status_code == 400


def _forward_logp(tc, seq: np.ndarray) -> np.ndarray:
    return tc.forward([_datum(seq)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_sample_compute_logprobs_and_forward_agree(server, client):
    rng = np.random.default_rng(5)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    seq = _seq(rng, 8)
    tc.forward_backward([_datum(seq)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()  # B != 0: the adapter matters
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [int(t) for t in seq[:5]]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, params, include_prompt_logprobs=True).result()
    assert len(res.sequences) == 2 and all(len(s.tokens) == 6 for s in res.sequences)
    assert all(s.stop_reason == "length" for s in res.sequences)
    full = np.array(prompt + list(res.sequences[0].tokens))
    fwd = _forward_logp(tc, full)
    lps = sampler.compute_logprobs(types.ModelInput.from_ints([int(t) for t in full])).result()
    assert lps[0] is None
    np.testing.assert_allclose(np.array(lps[1:], np.float64), fwd, atol=1e-6)  # same program: equal
    assert res.prompt_logprobs[0] is None
    np.testing.assert_allclose(np.array(res.prompt_logprobs[1:]), fwd[:4], atol=1e-6)
    np.testing.assert_allclose(res.sequences[0].logprobs, fwd[4:], atol=2e-4)  # the sampler's own program
    # the sampler serves a snapshot: training on does not change it
    tc.forward_backward([_datum(seq)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    again = sampler.compute_logprobs(types.ModelInput.from_ints([int(t) for t in full])).result()
    assert again == lps
    # named sampler weights on disk -> a sampling client by path serves the CURRENT weights
    path = tc.save_weights_for_sampler("now").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/now"
    by_path = client.create_sampling_client(model_path=path).result()
    now = by_path.compute_logprobs(types.ModelInput.from_ints([int(t) for t in full])).result()
    np.testing.assert_allclose(np.array(now[1:], np.float64), _forward_logp(tc, full), atol=1e-6)


def test_stop_strings_end_samples_where_the_text_first_holds_them(server, client):
    """A sample with a (multi-token) stop string is the same-seed sample without stops, cut after the
    first token whose decoded completion contains the string (kept), its logprobs unchanged."""
    tok = server.service.run.tokenizer
    sampler = client.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    free = types.SamplingParams(max_tokens=24, temperature=1.0, seed=11, stop=[])
    full = sampler.sample(prompt, 3, free).result().sequences
    stop = tok.decode(list(full[0].tokens[6:9]))  # 3 tokens of sample 0: it must stop there
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    params = types.SamplingParams(max_tokens=24, temperature=1.0, seed=11, stop=[stop])
    cut = sampler.sample(prompt, 3, params).result().sequences
    for f, c in zip(full, cut, strict=True):
        ids = list(f.tokens)
        n = next((k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k])), None)
        if n is None:
            assert list(c.tokens) == ids and c.stop_reason == "length"
        else:
            assert list(c.tokens) == ids[:n] and c.stop_reason == "stop"
        np.testing.assert_allclose(c.logprobs, f.logprobs[: len(c.tokens)], atol=1e-6)
    assert len(cut[0].tokens) <= 9 and cut[0].stop_reason == "stop"


def test_two_lora_clients_are_independent(server, client):
    rng = np.random.default_rng(11)
    a = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    b = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    seq = _seq(rng, 9)
    before_b, before_a = _forward_logp(b, seq), _forward_logp(a, seq)
    for _ in range(3):
        a.forward_backward([_datum(seq)], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=0.05)).result()
    np.testing.assert_array_equal(_forward_logp(b, seq), before_b)
    assert _forward_logp(a, seq).sum() > before_a.sum()  # a learned its sequence
    assert server.service.models[b.model_id].step == 0 and server.service.models[a.model_id].step == 3


def test_save_and_load_state_round_trip(server, client):
    rng = np.random.default_rng(13)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    seq = _seq(rng, 7)
    tc.forward_backward([_datum(seq)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    path = tc.save_state("s1").result().path
    m = server.service.models[tc.model_id]
    saved = jax.tree.map(np.array, (m.params, m.opt_state))
    tc.forward_backward([_datum(seq)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    tc.load_state_with_optimizer(path).result()
    m = server.service.models[tc.model_id]
    _close((m.params, m.opt_state), saved, rtol=0, atol=0)
    restored = client.create_training_client_from_state_with_optimizer(path).result()
    r = server.service.models[restored.model_id]
    _close((r.params, r.opt_state), saved, rtol=0, atol=0)
    assert r.step == 1 and restored.get_info().lora_rank == 4
    listed = client.create_rest_client().list_checkpoints(tc.model_id).result()
    assert [c.tinker_path for c in listed.checkpoints] == [path]
    # integrity: a damaged checkpoint is refused with a clear error
    directory = server.service.root / tc.model_id / "weights" / "s1"
    victim = max(
        (f for f in directory.rglob("*") if f.is_file() and f.name != "manifest.json"),
        key=lambda f: f.stat().st_size,
    )
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with pytest.raises(Exception, match="damaged"):
        tc.load_state(path).result()


def test_bad_input_is_a_clear_error_and_harms_no_one(server, client):
    good = client.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
    seq = np.arange(3, 10)
    before = _forward_logp(good, seq)
    with pytest.raises(Exception, match="unknown base model"):
        client.create_lora_training_client(base_model="no/such-model", rank=4).result()
    with pytest.raises(Exception, match="server's maximum"):
        client.create_lora_training_client(base_model=BASE, rank=64).result()
    bad = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(Exception, match="outside the vocabulary"):
        bad.forward_backward([_datum(np.array([3, 4, 10**6]))], "cross_entropy").result()
    bad = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(Exception, match="one value per token"):
        bad.forward_backward([_datum(seq, weights=np.ones(3, np.float32))], "cross_entropy").result()
    bad = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(Exception, match="no gradients"):
        bad.optim_step(types.AdamParams(learning_rate=0.1)).result()
    np.testing.assert_array_equal(_forward_logp(good, seq), before)
    good.forward_backward([_datum(seq)], "cross_entropy").result()
    assert good.optim_step(types.AdamParams()).result().metrics["step:max"] == 1.0


def test_requests_sent_ahead_give_what_waiting_for_each_gives(server, client):
    """The SDK sends a client's requests without waiting for their results, and the worker dispatches
    each without waiting for the device (a finisher thread resolves the futures, in order): three
    forward_backward + optim_step rounds sent ahead give the outputs, metrics and adapter of a twin
    client (same seed) that waited for every result."""
    rng = np.random.default_rng(5)
    seqs = [_seq(rng, n) for n in (9, 14, 6)]
    adam = types.AdamParams(learning_rate=0.05)
    ahead = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    twin = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    sent = [(ahead.forward_backward([_datum(s)], "cross_entropy"), ahead.optim_step(adam)) for s in seqs]
    got = [(fb.result(), opt.result()) for fb, opt in sent]
    for s, (fb, opt) in zip(seqs, got, strict=True):  # the twin after: never fused with `ahead`
        want_fb = twin.forward_backward([_datum(s)], "cross_entropy").result()
        want_opt = twin.optim_step(adam).result()
        np.testing.assert_array_equal(
            fb.loss_fn_outputs[0]["logprobs"].to_numpy(), want_fb.loss_fn_outputs[0]["logprobs"].to_numpy()
        )
        assert fb.metrics == want_fb.metrics and opt.metrics == want_opt.metrics
    svc = server.service
    _close(svc.models[ahead.model_id].params, svc.models[twin.model_id].params, rtol=0, atol=0)
    assert svc.models[ahead.model_id].step == 3


def test_a_long_poll_answers_pending_until_its_request_ends(server):
    import asyncio
    import threading

    svc = server.service
    gate = threading.Event()
    rid = svc._submit("hold", None, lambda: {"held": gate.wait(60)})
    assert asyncio.run(svc.retrieve_async(rid, timeout=0.05)) == ("pending", None)
    gate.set()
    assert asyncio.run(svc.retrieve_async(rid, timeout=60)) == ("json", {"held": True})


def test_sessions_expire_and_release_their_models(server):
    svc = server.service
    sid = svc.create_session()
    rid = svc.create_model(sid, BASE, {"rank": 2}, None)
    kind, result = svc.retrieve(rid, timeout=60)
    assert kind == "json" and result["model_id"] in svc.models
    svc.sessions[sid].last_seen -= svc.options.session_timeout_s + 1
    svc._reap_once()
    svc.retrieve(svc._submit("barrier", None, lambda: {}), timeout=60)  # the drop ran before it
    assert result["model_id"] not in svc.models and sid not in svc.sessions


def test_a_restarted_server_loads_saved_states(server, client):
    """A new service on the same workdir (fresh sessions and models) loads a checkpoint of the old one."""
    from rljax.tinker.service import TinkerService

    rng = np.random.default_rng(17)
    tc = client.create_lora_training_client(base_model=BASE, rank=2, seed=4).result()
    tc.forward_backward([_datum(_seq(rng, 6))], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    path = tc.save_state("restart").result().path
    old = server.service.models[tc.model_id]
    restarted = TinkerService(server.service.run, server.service.root.parent, server.service.options)
    try:
        sid = restarted.create_session()
        kind, result = restarted.retrieve(
            restarted.load_state(path, optimizer=True, session_id=sid, model_seq_id=0), timeout=120
        )
        assert kind == "json", result
        new = restarted.models[result["model_id"]]
        _close((new.params, new.opt_state), (old.params, old.opt_state), rtol=0, atol=0)
        assert new.step == 1 and new.lora.rank == 2
    finally:
        restarted.close()


def test_the_base_model_holds_no_optimizer_state(server):
    """The service's base model is never stepped through the run: its state has parameters and no
    Adam moments (each training client builds its own optimizer state)."""
    state = server.service.run.state
    assert state.opt_state == {}
    assert jax.tree.leaves(state.params)
