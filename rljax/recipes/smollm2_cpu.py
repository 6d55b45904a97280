"""Recipe: SmolLM2-135M-Instruct (a real model, its own BPE tokenizer and chat template) gets better
at arithmetic by GRPO on 2 CPU cores.

Draft: measured figures follow.
"""

from ml_collections import config_dict

from rljax.models.gguf_fetch import SMOLLM2, model_cache_dir
from rljax.recipes import default


def smollm2_path() -> str:
    """Where ``.ci/install_smollm2.sh`` (``python -m rljax.models.gguf_fetch``) puts the GGUF file."""
    return str(model_cache_dir() / SMOLLM2.filename)


def get_config() -> config_dict.ConfigDict:
    """GRPO on arithmetic with SmolLM2-135M-Instruct and the embedded sampler."""
    c = default.get_config()
    path = smollm2_path()
    c.model.hf_path = path
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
    c.warmstart.num_steps = 0
    c.rollout.update(max_turns=1, max_tokens=24, max_context_len=128, temperature=0.7)
    c.eval.update(group_size=4, temperature=0.7)
    c.engine.update(max_batch_size=64, min_prompt_bucket=64, min_new_tokens_bucket=16)
    c.optimizer.learning_rate = 1e-5
    # keep_checkpoints=0 keeps every checkpoint: step_0 is the base model (rljax eval of it is the baseline)
    c.trainer.update(
        num_steps=16, prompts_per_step=8, seq_len=128, eval_every=4, checkpoint_every=8, keep_checkpoints=0
    )
    return c
