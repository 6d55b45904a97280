"""Tinker-compatible API recipe with sampling clients served by vLLM: ``configs/tinker.py``'s tiny
model (``head_dim`` 64: vLLM's CPU attention rejects smaller heads) with ``configs/vllm_local.py``'s
engine section::

    rljax serve --config=tinker_vllm --port=8000 --workdir=/tmp/rljax_tinker
    # attach to servers you started yourself on the same base weights (with --enable-lora
    # --max-lora-rank R, R >= --max_lora_rank, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, and
    # --served-model-name rljax, or set --config.engine.client.model) instead of launching one:
    rljax serve --config=tinker_vllm \\
        --config.engine.urls='("http://127.0.0.1:8001",)'

The server launches ``engine.num_servers`` vLLM servers on the base weights with runtime LoRA up to
``--max_lora_rank``. Base-model sampling clients and clients of LoRA adapters without an
unembedding target sample on them (each adapter loaded under its session's name and verified);
unembedding adapters and full fine-tuned weights sample on the embedded sampler. Training,
``forward`` and prompt logprobs stay on rljax's own jitted programs.
"""

from ml_collections import config_dict

from rljax.recipes import tinker, vllm_local


def get_config() -> config_dict.ConfigDict:
    """The Tinker API recipe with the local-vLLM recipe's engine section."""
    c = tinker.get_config()
    v = vllm_local.get_config()
    init = v.model.init
    c.model.init.update(head_dim=init.head_dim, max_position_embeddings=init.max_position_embeddings)
    c.engine = v.engine
    return c
