"""The run object (rljax.run.run.Run): its front-door methods against the trainer's own step, and
the defects fixed with it (prompt_mean, mini-batch fallback, advantage metric names)."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
from tolerances import LOGPROB_TOL

from rljax.data.pack import pack
from rljax.recipes import smoke
from rljax.run import trainer as trainer_lib
from rljax.run.run import Run, mini_batch_groups
from rljax.types import Step


def _config(**trainer):
    c = smoke.get_config()
    c.warmstart.num_steps = 0
    c.trainer.update(**{"num_steps": 1, "checkpoint_every": 0, "eval_every": 0, **trainer})
    return c


def _batch(run: Run, seed: int = 0):
    """A packed batch of 4 random samples of 2 prompt groups with advantages and logprobs."""
    rng = np.random.default_rng(seed)
    vocab = run.model_vocab
    steps, advantages = [], []
    for i in range(4):
        n = int(rng.integers(5, 12))
        steps.append(
            Step(
                prompt_ids=rng.integers(1, vocab, 6).tolist(),
                response_ids=rng.integers(1, vocab, n).tolist(),
                trajectory_id=(f"q{i // 2}", i % 2),
                response_logprobs=np.log(rng.uniform(0.002, 0.03, n)).tolist(),
            )
        )
        advantages.append(rng.normal(size=n).astype(np.float32))
    return steps, pack(steps, seq_len=64, advantages=advantages).batch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    made = [Run(_config(), tmp_path_factory.mktemp(f"run{i}")) for i in range(2)]
    yield made
    for r in made:
        r.close()


def test_forward_equals_scoring_each_sample_alone(runs):
    run = runs[0]
    steps, batch = _batch(run)
    packed = run.forward(batch)
    scored = run.score([s.prompt_ids + s.response_ids for s in steps])
    tokens = np.asarray(batch.tokens)
    for i, (s, ref) in enumerate(zip(steps, scored, strict=True)):
        row, col = np.argwhere(np.asarray(batch.sample_index) == i)[0]  # the sample's first token
        n = len(s.prompt_ids) + len(s.response_ids)
        assert tokens[row, col : col + n].tolist() == s.prompt_ids + s.response_ids
        np.testing.assert_allclose(packed[row, col : col + n], ref, **LOGPROB_TOL)


def test_forward_backward_then_optim_step_equals_the_fused_train_step(runs):
    fused, split = runs
    _, batch = _batch(fused, seed=1)
    before = jax.tree.leaves(jax.device_get(split.state.params))
    m_fused = fused.train(batch, algorithm="grpo")
    m_fb = split.forward_backward(batch)
    after = jax.tree.leaves(jax.device_get(split.state.params))
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))  # nothing applied yet
    m_opt = split.optim_step()
    assert m_fb["loss"] == pytest.approx(m_fused["loss"], rel=1e-5)
    assert m_opt["grad_norm"] == pytest.approx(m_fused["grad_norm"], rel=1e-4)
    assert int(split.state.step) == int(fused.state.step) == 1
    for a, b in zip(jax.tree.leaves(fused.state.params), jax.tree.leaves(split.state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no gradients"):
        split.optim_step()


def test_forward_backward_accumulates_until_optim_step(runs):
    run = runs[1]
    _, batch = _batch(run, seed=2)
    one = run.forward_backward(batch)
    two = run.forward_backward(batch)  # the same batch twice: the summed loss doubles
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    grads, summed = run._pending
    assert float(summed["loss"]) == pytest.approx(2 * one["loss"], rel=1e-6)
    run.optim_step()
    assert run._pending is None


def test_prompt_mean_reduction_trains(tmp_path):
    """Defect: --config.objective.reduction=prompt_mean died at start-up ("needs num_groups")."""
    c = _config()
    c.objective.reduction = "prompt_mean"
    history = trainer_lib.Trainer(c, tmp_path).run()
    assert np.isfinite(history[-1]["loss"]) and history[-1]["optimizer_steps"] == 1.0


def test_mini_batch_fallback_is_said():
    """Defect: a mini_batch_prompts that does not divide an algorithm's groups was replaced silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mini_batch_groups(8, 4, "grpo") == 4
        assert mini_batch_groups(6, 0, "grpo") == 6
    with pytest.warns(UserWarning, match=r"'rloo' has 6 prompt groups .*mini_batch_prompts=4"):
        assert mini_batch_groups(6, 4, "rloo") == 6


def test_advantage_metrics_have_one_name_for_every_algorithm(tmp_path):
    """Defect: grpo runs logged advantage/mean/<alg>, ppo runs advantage/mean."""
    history = trainer_lib.Trainer(_config(), tmp_path).run()
    row = history[-1]
    assert "advantage/mean" in row and "advantage/abs_mean" in row
    assert not [k for k in row if k.startswith("advantage/") and k.count("/") > 1]
    # every row carries the process's resident memory (the peak since start-up, at least today's
    # within the kernel's counter lag: tests/train/test_train_host_memory.py)
    assert row["memory/host_peak_rss_bytes"] >= row["memory/host_rss_bytes"] - 4 * 2**20 > 100 * 2**20


def test_advantage_sums_weigh_rl_tokens():
    steps = [Step([1, 2], [3, 4, 5], ("a", 0), loss_mask=[1, 0, 1]), Step([1], [6, 7], ("b", 0))]
    adv = [np.array([2.0, 9.0, -1.0], np.float32), np.array([0.5, 0.5], np.float32)]
    batch = pack(steps, seq_len=8, advantages=adv, rl_weights=[1.0, 0.0]).batch
    total = trainer_lib.advantage_sums(batch)
    np.testing.assert_allclose(total, [2.0 - 1.0, 2.0 + 1.0, 2.0])


def _flip_parameter_bytes(step_dir) -> None:
    """Flips bytes in the largest file of the checkpoint's params item (the OCDBT array data)."""
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file()]
    data_file = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(data_file.read_bytes())
    for f in (0.3, 0.5, 0.7):
        data[int(len(data) * f)] ^= 0x5A
    data_file.write_bytes(bytes(data))


def test_damaged_checkpoint_is_never_trained_from_or_served(tmp_path):
    """Flipped bytes in the newest checkpoint's parameters: --resume falls back to the newest intact
    step with a warning naming the damaged one; eval and export refuse it with a clear error."""
    from rljax.run.evaluate import evaluate_checkpoint
    from rljax.run.export import export_checkpoint
    from rljax.training import checkpoint
    from rljax.training.checkpoint import CheckpointCorruptedError

    c = _config(num_steps=2, checkpoint_every=1, keep_checkpoints=3)
    trainer_lib.Trainer(c, tmp_path).run()
    _flip_parameter_bytes(tmp_path / "checkpoints" / "step_2")
    c.trainer.num_steps = 3
    with pytest.warns(
        UserWarning, match=r"step_2 is damaged and is skipped: .*checksum mismatch.*resuming from step_1"
    ):
        history = trainer_lib.Trainer(c, tmp_path, resume=True).run()
    assert [row["step"] for row in history] == [2, 3]  # step 2 trained again from step 1's weights
    assert checkpoint.verify(tmp_path / "checkpoints", 2)  # the resumed run saved step 2 afresh
    _flip_parameter_bytes(tmp_path / "checkpoints" / "step_3")
    with pytest.raises(CheckpointCorruptedError, match=r"step_3 is damaged.*checksum mismatch"):
        evaluate_checkpoint(c, tmp_path / "checkpoints" / "step_3")
    with pytest.raises(CheckpointCorruptedError, match=r"step_3 is damaged.*checksum mismatch"):
        export_checkpoint(tmp_path / "checkpoints" / "step_3", tmp_path / "export")


def test_a_mini_batch_of_fewer_rows_reuses_the_compiled_micro_batched_step(tmp_path):
    """With ``trainer.micro_batch_tokens``, a mini-batch that packs into fewer rows than an earlier one
    (shorter responses late in a run) keeps the micro-batch count: no new compilation."""
    from rljax.training.step import train_mini_batch, train_step

    run = Run(_config(micro_batch_tokens=32, seq_len=32), tmp_path)  # one row per micro-batch
    try:
        steps, _ = _batch(run, seed=2)
        advantages = [np.linspace(-1, 1, len(s.response_ids), dtype=np.float32) for s in steps]
        wide = pack(steps, seq_len=32, advantages=advantages).batch
        narrow = jax.tree.map(lambda x: x[:1], wide)  # its first row only: whole samples
        assert np.shape(wide.tokens)[0] > 1

        def compiled() -> int:
            return train_step.jitted._cache_size() + train_mini_batch.jitted._cache_size()

        run.train(wide, algorithm="grpo")
        before = compiled()
        m = run.train(narrow, algorithm="grpo")
        assert compiled() == before
        assert m["tokens/rl"] == float(np.sum(np.asarray(narrow.loss_mask) != 0))
    finally:
        run.close()
