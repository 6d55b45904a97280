"""LoRA with generation on local vLLM servers and adapter-only weight syncs.

    rljax train --config=lora_vllm --config.trainer.num_steps=3

The servers start on the base weights with ``--enable-lora --max-lora-rank R --max-loras 2`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (added by the trainer). After every update only the adapter
is written (PEFT format, a few % of the model's bytes), loaded on every server under a versioned
name (``<model>-lora-v<N>``), verified by probe logprobs, and the next rollout's requests name it;
the previous version is unloaded once its requests are done. ``engine.lora_sync="merged"`` syncs
full merged weights instead (for engines without runtime LoRA).
"""

from ml_collections import config_dict

from rljax.recipes import lora, vllm_local


def get_config() -> config_dict.ConfigDict:
    """The local-vLLM recipe with the LoRA recipe's adapter section."""
    c = vllm_local.get_config()
    c.lora = lora.get_config().lora
    c.optimizer.learning_rate = lora.get_config().optimizer.learning_rate
    c.engine.lora_sync = "adapter"
    return c
