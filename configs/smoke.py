"""Smoke recipe: the default recipe shrunk to seconds (tests, CI, trying a change quickly).

rljax train --config=smoke
"""

from ml_collections import config_dict

from rljax.recipes import default


def get_config() -> config_dict.ConfigDict:
    """The default recipe shrunk to a run of seconds."""
    c = default.get_config()
    c.model.init.update(
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=256,
    )
    c.envs.lookup.update(num_train_tasks=16, num_eval_tasks=2)
    c.engine.update(max_batch_size=8, min_batch_bucket=8, min_prompt_bucket=64, min_new_tokens_bucket=16)
    c.rollout.update(group_size=2, max_turns=2, max_tokens=16, max_context_len=192)
    c.warmstart.update(num_steps=2, batch_size=4, seq_len=256, log_every=1)
    c.optimizer.learning_rate = 1e-3
    c.trainer.update(
        num_steps=3, prompts_per_step=2, seq_len=256, eval_every=2, checkpoint_every=1, keep_checkpoints=2
    )
    return c
