"""benchmarks/train_tokens_bench.py --synthetic: GRPO groups of random tokens lay out as the prefix
tree they are (the prompt once per group), and a variant's child trains on them end to end."""

import importlib.util
import os
import pickle
import types

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "train_tokens_bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_tokens_bench_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synthetic_groups_share_their_prompt(bench, tmp_path):
    path = os.fspath(tmp_path / "groups.pkl")
    bench.synthesize("tiny", path, prompt_tokens=40, completion_tokens=7, group=3, prompts=2)
    with open(path, "rb") as f:
        captured = pickle.load(f)
    assert captured["overrides"]["trainer.seq_len"] == 1024  # 40 + 3 x 7 = 61, rounded up to 1,024
    assert captured["overrides"]["model.init.hidden_size"] == 128
    (step,) = captured["steps"]
    samples = step["samples"]
    assert len(samples) == 6 and step["mini_batch_prompts"] == 2
    assert samples[0].prompt_ids == samples[2].prompt_ids != samples[3].prompt_ids
    assert {len(s.response_ids) for s in samples} == {7}
    assert {s.trajectory_id.instance_id for s in samples} == {"p0", "p1"}
    for g in range(2):  # advantages: each group's rewards standardized, constant along a completion
        adv = np.array([a[0] for a in step["streams"]["advantages"][3 * g : 3 * g + 3]])
        rewards = np.array([s.reward for s in samples[3 * g : 3 * g + 3]])
        np.testing.assert_allclose(adv, (rewards - rewards.mean()) / (rewards.std() + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(samples[0].response_logprobs, -np.log(4096), rtol=1e-6)

    def real_and_loss_tokens(prefix_sharing):  # packed as the trainer packs them (rows of 128)
        trainer = types.SimpleNamespace(seq_len=128, row_buckets=None, truncate=False)
        run = types.SimpleNamespace(cfg=types.SimpleNamespace(trainer=trainer), data_parallel=1,
                                    prefix_sharing=prefix_sharing)  # fmt: skip
        (batch,) = bench.pack_mini_batches(run, step)
        return int(np.count_nonzero(batch.segment_ids)), int(np.count_nonzero(batch.loss_mask))

    assert real_and_loss_tokens(False) == (6 * (40 + 7), 6 * 7)
    assert real_and_loss_tokens(True) == (2 * (40 + 3 * 7), 6 * 7)  # each group's prompt once


@pytest.mark.integration
@pytest.mark.subprocess
def test_a_variant_trains_on_synthetic_groups(bench, tmp_path, capsys):
    path = os.fspath(tmp_path / "groups.pkl")
    argv = ["--synthetic", "tiny", "--samples", path, "--prompt-tokens", "24", "--completion-tokens", "8",
            "--group", "4", "--prompts", "2", "--repeats", "1", "--steps", "1",
            "--only", "loss-only + prefix tree"]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    # one row of 1,024 holds both trees (2 x (24 + 4 x 8) = 112 tokens), 64 of them with a loss
    assert "per mini-batch: 112 real tokens, 64 with a loss" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| loss-only + prefix tree |")]
    assert row.split(" | ")[1] == "1024"
    (loss,) = [line.rsplit(", loss ", 1)[1] for line in out.splitlines() if ", loss " in line]
    assert np.isfinite(float(loss))
