"""The default recipe with LoRA: adapter-only training on the embedded sampler.

    rljax train --config=lora
    rljax train --config=lora --config.lora.rank=32

Every attention and MLP projection gets a rank-16 adapter (A Kaiming-uniform, B = 0, so training
starts from the base model exactly); only the adapters get gradients and AdamW moments, the base
weights are frozen (``TrainState.frozen``). LoRA needs a larger learning rate than full training
(the update is confined to a low-rank subspace): 2e-3 here vs 2e-4 for the default recipe.
Checkpoints hold the adapters and their optimizer state; the base is rebuilt from
``model.hf_path`` / ``model.init``. ``rljax export --checkpoint=RUN --out=DIR
--adapter_only`` writes a PEFT adapter (or merged weights without the flag).
"""

from ml_collections import config_dict

from rljax.recipes import default


def get_config() -> config_dict.ConfigDict:
    """The default recipe with a LoRA adapter section (adapter-only training)."""
    c = default.get_config()
    c.lora = dict(
        rank=16,
        alpha=32.0,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        dropout=0.0,
    )
    c.optimizer.learning_rate = 2e-3
    return c
