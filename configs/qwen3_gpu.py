"""A documented GPU recipe: Qwen3 from a Hugging Face checkpoint, vLLM servers, a (data, fsdp, tensor) mesh.

Set the checkpoint directory (``config.json`` + ``*.safetensors`` + tokenizer files, e.g. a local download of
``Qwen/Qwen3-0.6B``) and the mesh for your devices, then::

    rljax train --config=qwen3_gpu \\
        --config.model.hf_path=/ckpts/Qwen3-0.6B --config.tokenizer.name=/ckpts/Qwen3-0.6B \\
        --config.mesh.data=1 --config.mesh.fsdp=8 --workdir=/runs/qwen3_lookup

Precision and memory: master weights, gradients and Adam moments in float32 (the bf16 checkpoint is
upcast on load; an lr of 1e-6 would round away in bf16), activations in bfloat16 with full remat,
log-probs / ratios / losses in float32; each mini-batch runs as micro-batches of at most
``trainer.micro_batch_tokens`` tokens accumulated in one jitted scan. vLLM serves bfloat16 weights
(``engine.dtype``) and every sync is verified against rljax's own bf16 logprobs of the same cast
weights (tolerance: ``SYNC_ATOL['bfloat16']``, see docs/guides/precision_memory_export.md).

Layout: the trainer holds the model on the mesh (parameters and Adam moments sharded by the rules of
rljax.models.sharding; batches sharded by rows over data x fsdp); generation runs on vLLM servers
(``engine.urls`` of servers you started on other GPUs, or ``engine.num_servers`` launched locally), and
weights are synced to them after every update. ``mode="async"`` overlaps generation of step n+1 with
training of step n (samples are at most ``max_off_policy_steps`` versions stale).

Off-policy training (design §3.4): the loss is PPO's clip with DAPO's clip-higher, its ratio taken
against the old (proximal) policy, whose logprobs the trainer recomputes from the weights at the start
of each step (``trainer.old_logprobs="recompute"``); token-level truncated importance sampling
(``objective.off_policy``) then weighs every token by ``min(old / rollout, 2)``, the gap between the
trainer's policy and what vLLM sampled (bf16 weights, a stale version). The start line of the run
says which old logprobs it uses; ``off_policy/is_ratio_mean`` / ``_max`` show the gap.
"""

from ml_collections import config_dict

from rljax.recipes import gpu_base


def get_config() -> config_dict.ConfigDict:
    """The GPU base recipe set up for a Qwen3 checkpoint (edit the paths and the mesh)."""
    c = gpu_base.get_config()
    c.model.hf_path = "/path/to/Qwen3-0.6B"  # HF checkpoint directory (config.json + safetensors)
    c.tokenizer.name = "/path/to/Qwen3-0.6B"  # its tokenizer (tokenizer.json, chat template)
    c.renderer.name = "qwen3"
    c.renderer.kwargs = dict(retention="tool_cycle")
    # product = number of trainer devices; context > 1 splits each row's tokens (long agent trajectories,
    # e.g. fsdp=2, context=4 for 32k-64k rows; trainer.seq_len must be a multiple of 2 * context)
    # with context > 1, model.context_attention="ring" passes K/V chunks device to device instead of
    # all-gathering them (XLA blocks instead of cuDNN; for meshes whose interconnect is the bottleneck)
    c.mesh.update(data=1, fsdp=8, tensor=1, context=1)
    # launched servers on their own GPUs, e.g. ("4", "5", "6", "7"): num_servers=4, mesh fsdp=4 (launch/)
    c.engine.server_devices = ()
    return c
