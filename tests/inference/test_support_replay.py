"""Top-k / top-p draws train on the support they were drawn from (design §3.4, §5).

The embedded sampler records each token's support floor (the kept tokens are exactly those whose
temperature-scaled logit is at least the floor); the trainer renormalizes its own logprobs over the
same support, so a token's trainer logprob equals the sampler's processed logprob, where the full
softmax would differ by the kept mass. References: float64 numpy renormalization, and the
sampler's own logprobs."""

from __future__ import annotations

import asyncio
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.algorithms import validate_algorithm_config
from rljax.core import losses
from rljax.data.batch import StepBatch
from rljax.data.merge import merge_steps
from rljax.data.pack import pack, unpack
from rljax.inference.engine import SamplingParams
from rljax.inference.sampler import EmbeddedSampler, processed_logprobs_and_floor
from rljax.models import sequence_forward
from rljax.models.logprobs import token_logprobs_and_entropy
from rljax.run.builders import check_objective
from rljax.run.config import parse_run_config
from rljax.types import Step

VOCAB = 96


def test_the_floor_separates_kept_from_dropped_tokens():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(scale=3.0, size=(6, VOCAB)), jnp.float32)
    temperature = jnp.asarray([1.0, 0.7, 1.3, 1.0, 0.9, 1.0])
    top_k = jnp.asarray([0, 5, 0, 20, 3, 0])
    top_p = jnp.asarray([0.9, 1.0, 0.5, 0.95, 1.0, 1.0])
    logp, floor = processed_logprobs_and_floor(logits, temperature, top_k, top_p)
    z = np.asarray(logits, np.float64) / np.asarray(temperature)[:, None]
    for i in range(6):
        kept = np.isfinite(np.asarray(logp[i]))
        if kept.all():  # row 5: no filter
            assert float(floor[i]) == -math.inf
            continue
        assert z[i][kept].min() > float(floor[i]) > z[i][~kept].max()
        np.testing.assert_array_equal(z[i] >= float(floor[i]), kept)


def test_renormalized_logprobs_and_entropy_against_numpy():
    rng = np.random.default_rng(1)
    n, h = 7, 8
    hidden = rng.normal(size=(n, h)).astype(np.float32)
    w = rng.normal(size=(h, VOCAB)).astype(np.float32)
    targets = rng.integers(0, VOCAB, n)
    tau = rng.uniform(0.6, 1.4, n).astype(np.float32)
    z = (hidden.astype(np.float64) @ w) / tau[:, None]
    floor = np.sort(z, axis=1)[:, -10] - 1e-3  # keep about the top 10
    floor[0] = -np.inf  # a token drawn from the whole distribution
    floor[1] = z[1, targets[1]] + 1.0  # the target itself below the floor: kept anyway
    lp, ent = token_logprobs_and_entropy(
        hidden, w, targets, tau, chunk_size=3, support_floor=floor.astype(np.float32)
    )
    for i in range(n):
        keep = z[i] >= floor[i]
        keep[targets[i]] = True
        zz = np.where(keep, z[i], -np.inf)
        lse = np.log(np.sum(np.exp(zz - zz.max()))) + zz.max()
        p = np.exp(zz - lse)
        np.testing.assert_allclose(lp[i], z[i, targets[i]] - lse, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ent[i], -np.sum(p[keep] * np.log(p[keep])), rtol=1e-4, atol=1e-5)
    grad = jax.grad(
        lambda x: jnp.sum(
            token_logprobs_and_entropy(x, w, targets, tau, chunk_size=3, support_floor=floor)[1]
        )
    )(jnp.asarray(hidden))
    assert bool(jnp.all(jnp.isfinite(grad)))


@pytest.fixture(scope="module")
def sampled():
    """A tiny model's completions of 4 prompts with top-p 0.8 and top-k 12 (temperature 0.9)."""
    model = models.tiny_model(vocab_size=VOCAB, seed=0)
    state = jax.tree.map(lambda x: x * 20.0 if x.ndim == 2 else x, nnx.state(model))  # peaked
    nnx.update(model, state)
    sampler = EmbeddedSampler(model, batch_wait_ms=5.0, min_prompt_bucket=16, min_new_tokens_bucket=16)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    sampling = [SamplingParams(temperature=0.9, top_p=0.8, top_k=12 if i % 2 else None, max_tokens=12, seed=i)
                for i in range(4)]  # fmt: skip

    async def run():
        return await asyncio.gather(*(sampler.generate(p, s) for p, s in zip(prompts, sampling, strict=True)))

    return model, prompts, asyncio.run(run())


def test_the_trainer_scores_each_token_on_the_support_it_was_drawn_from(sampled):
    model, prompts, completions = sampled
    steps = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        assert c.support_floors is not None and len(c.support_floors) == len(c.ids)
        steps.append(Step(p, list(c.ids), ("q", i), response_logprobs=list(c.logprobs), temperature=0.9,
                          response_support_floors=list(c.support_floors)))  # fmt: skip
    batch = pack(steps, seq_len=32).batch
    trained = np.asarray(batch.loss_mask) != 0
    engine = np.asarray(batch.inference_logprobs)[trained]

    def logp(floors):
        out = sequence_forward(model, jnp.asarray(batch.tokens), positions=batch.positions,
                               segment_ids=batch.segment_ids, temperature=batch.temperatures,
                               support_floors=floors, with_entropy=False)  # fmt: skip
        return np.asarray(out.logprobs)[trained]

    on_support = logp(batch.support_floors)
    np.testing.assert_allclose(on_support, engine, **LOGPROB_TOL)
    full = logp(None)  # the full softmax: every ratio carries the kept mass
    assert np.max(engine - full) > 10 * LOGPROB_TOL["atol"]
    k3 = lambda a, b: float(np.mean(losses.kl(jnp.asarray(a), jnp.asarray(b), kind="k3")))  # noqa: E731
    mismatch_on_support, mismatch_full = k3(engine, on_support), k3(engine, full)
    assert mismatch_on_support < 1e-8 < mismatch_full


def test_floors_survive_merging_packing_and_unpacking():
    floors = [-0.5, -math.inf, 1.25]
    turns = [
        Step([1], [2, 3], ("t", 0), response_logprobs=[-0.1, -0.2], is_last_step=False),  # whole distribution
        Step(
            [1, 2, 3, 4],
            [5, 6, 7],
            ("t", 0),
            response_logprobs=[-0.3, -0.1, -0.2],
            response_support_floors=floors,
        ),  # fmt: skip
    ]
    merged = list(merge_steps(StepBatch(turns, vocab_size=16)))
    assert len(merged) == 1
    assert merged[0].response_support_floors == [-math.inf, -math.inf, -math.inf, *floors]  # gap: -inf
    result = pack(merged, seq_len=12)
    got = unpack(result.batch, result.layout)[0]["support_floors"]
    np.testing.assert_array_equal(got, np.asarray([-math.inf] * 3 + floors, np.float32))
    assert pack(turns[:1], seq_len=8).batch.support_floors is None  # nothing truncated: no stream
    with pytest.raises(ValueError, match="response_support_floors has 2 entries, response_ids 3"):
        StepBatch([Step([1], [2, 3, 4], ("t", 0), response_support_floors=[0.0, 1.0])])
    with pytest.raises(ValueError, match="finite floats or -inf"):
        StepBatch([Step([1], [2], ("t", 0), response_support_floors=[math.nan])])


def test_engines_that_do_not_report_the_support_refuse_truncated_training():
    cfg = parse_run_config({"engine": {"kind": "vllm"}, "rollout": {"top_p": 0.9}})
    with pytest.raises(ValueError, match=r"^config.rollout.top_p: 0.9 samples from a truncated distribution"):
        check_objective(cfg, validate_algorithm_config(cfg.algorithm, group_size=8))
    sft = {"name": "sft", "teacher": "http://127.0.0.1:9"}  # ce on a frozen model's samples
    cfg = parse_run_config({"engine": {"kind": "vllm"}, "rollout": {"top_k": 20}, "algorithm": sft})
    check_objective(cfg, validate_algorithm_config(cfg.algorithm, group_size=8))  # ce: no ratio
    cfg = parse_run_config({"rollout": {"top_p": 0.9}})  # the embedded sampler reports it
    check_objective(cfg, validate_algorithm_config(cfg.algorithm, group_size=8))
