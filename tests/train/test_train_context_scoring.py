"""Context parallelism in the run's scoring forwards (8 fake CPU devices): ``Run.forward``,
``Run.score`` (also what opsd's reference scores with) and the PPO critic's values and step split rows
over a ``context`` mesh axis like the train step, and equal the same forwards without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import LOGPROB_TOL

from rljax.data.pack import pack
from rljax.inference.scoring import score_sequences
from rljax.models import decoder as decoder_lib
from rljax.models.tiny import random_decoder, tiny_config
from rljax.models.value import ValueModel
from rljax.recipes import smoke
from rljax.run.run import Run
from rljax.training.critic import CriticConfig, critic_step, critic_values
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import make_mesh, shard_batch
from rljax.training.step import TrainConfig, TrainState
from rljax.types import Step

pytestmark = pytest.mark.slow


@pytest.fixture
def context_traces(monkeypatch):
    """The context-axis sizes the model saw while tracing (None = no context split)."""
    seen: list[int | None] = []
    real = decoder_lib.context_mesh

    def spy():
        mesh = real()
        seen.append(None if mesh is None else mesh.shape["context"])
        return mesh

    monkeypatch.setattr(decoder_lib, "context_mesh", spy)
    return seen


def _steps(vocab: int, seed: int = 0) -> list[Step]:
    rng = np.random.default_rng(seed)
    steps = []
    for i in range(8):
        n = int(rng.integers(5, 12))
        steps.append(Step(rng.integers(1, vocab, 6).tolist(), rng.integers(1, vocab, n).tolist(),
                          (f"q{i // 2}", i % 2), response_logprobs=(-rng.random(n)).tolist()))  # fmt: skip
    return steps


def test_run_forward_and_score_split_rows_over_context(tmp_path, context_traces):
    c = smoke.get_config()
    c.warmstart.num_steps = 0
    c.mesh.update(data=4, context=2)
    run = Run(c, tmp_path)
    try:
        steps = _steps(run.model_vocab)
        seqs = [s.prompt_ids + s.response_ids for s in steps]
        want = score_sequences(run.current_model(), seqs)  # no mesh in scope: one row, no split
        assert set(context_traces) == {None}
        context_traces.clear()
        got = run.score(seqs, temperature=[1.0] * len(seqs))
        assert context_traces and set(context_traces) == {2}
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, **LOGPROB_TOL)
        batch = pack(steps, seq_len=64, data_parallel=4).batch
        context_traces.clear()
        packed = run.forward(batch)
        assert context_traces and set(context_traces) == {2}
        sample = np.asarray(batch.sample_index)
        for i, w in enumerate(want):
            row, col = np.argwhere(sample == i)[0]
            np.testing.assert_allclose(packed[row, col : col + len(w)], w, **LOGPROB_TOL)
    finally:
        run.close()


def test_critic_values_and_step_with_context_equal_one_device(context_traces):
    cfg = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8, num_layers=2)
    rng = np.random.default_rng(3)
    steps = _steps(64, seed=3)
    adv = [rng.normal(size=len(s.response_ids)).astype(np.float32) for s in steps]
    batch = pack(steps, seq_len=32, advantages=adv, row_buckets=[4]).batch
    returns = jnp.asarray(rng.normal(size=batch.tokens.shape).astype(np.float32))

    def state(mesh):
        vm = ValueModel.from_policy(random_decoder(cfg, seed=0), rngs=nnx.Rngs(0))
        vm.value_kernel[...] = 0.3 * jax.random.normal(jax.random.key(1), vm.value_kernel[...].shape)
        return TrainState.create(vm, TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3)), mesh=mesh)

    one = state(None)
    want_values = np.asarray(critic_values(one, batch))
    _, want = critic_step(one, batch, jnp.asarray(want_values), returns, CriticConfig())
    mesh = make_mesh(data=2, context=4)
    sharded = shard_batch(batch, mesh)
    context_traces.clear()
    split = state(mesh)
    values = np.asarray(critic_values(split, sharded))
    _, got = critic_step(split, sharded, jnp.asarray(values), returns, CriticConfig())
    assert context_traces and set(context_traces) == {4}
    np.testing.assert_allclose(values, want_values, rtol=1e-5, atol=1e-6)
    for key in ("critic/value_loss", "critic/grad_norm", "critic/explained_variance"):
        np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-5, atol=1e-7, err_msg=key)
