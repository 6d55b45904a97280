"""One GPU: Qwen3 from a Hugging Face checkpoint, trained by JAX and sampled by a vLLM server on the same GPU.

    rljax train --config=qwen3_1gpu --workdir=/runs/qwen3_1gpu \\
        --config.model.hf_path=/ckpts/Qwen3-0.6B --config.tokenizer.name=/ckpts/Qwen3-0.6B

The GPU's memory is split up front (docs/guides/one_gpu.md): JAX preallocates half of it
(``engine.trainer_memory_fraction=0.5``, which ``rljax train`` sets as ``XLA_PYTHON_CLIENT_MEM_FRACTION``
before JAX starts) and the vLLM server, launched once the trainer holds its half, takes 0.4
(``engine.server.gpu_memory_utilization``: vLLM refuses to start unless that share is still free).
The last tenth covers the two processes' CUDA contexts. The sizes below are for Qwen3-0.6B on an
80 GB GPU (A100 / H100): float32 master weights, gradients and Adam moments take about 10 GB, and
each micro-batch is one packed 8,192-token row with full remat and bfloat16 compute.

A second GPU for vLLM instead (the trainer keeps the first, with JAX's default share)::

    rljax train --config=qwen3_1gpu ... --config.engine.server_devices="('1',)" \\
        --config.engine.trainer_memory_fraction=0 --config.engine.server.gpu_memory_utilization=0.85

Everything else (task, precision, the asynchronous loop, the off-policy correction) is
``configs/qwen3_gpu.py``'s; more GPUs: ``launch/multi_gpu.sh``, ``launch/slurm/``, ``launch/kubernetes/``.
"""

from ml_collections import config_dict

from rljax.recipes import qwen3_gpu


def get_config() -> config_dict.ConfigDict:
    """The GPU recipe on one GPU shared by the trainer and one vLLM server (edit the paths)."""
    c = qwen3_gpu.get_config()
    c.mesh.update(data=1, fsdp=1, tensor=1, context=1)  # the trainer: one device
    c.engine.update(
        num_servers=1,
        server_devices=(),  # the server sees the trainer's GPU
        trainer_memory_fraction=0.5,  # JAX's share of the GPU
    )
    c.engine.server.update(gpu_memory_utilization=0.4, max_num_seqs=128)  # vLLM's share
    c.engine.client.update(max_concurrency=128)
    c.trainer.update(prompts_per_step=32, mini_batch_prompts=8, micro_batch_tokens=8192)
    return c
