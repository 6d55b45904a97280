"""A documented MoE GPU recipe: Qwen3-30B-A3B with GSPO, sequence-level TIS and router replay (R3).

Set the checkpoint directory (``config.json`` + ``*.safetensors`` + tokenizer files, e.g. a local download of
``Qwen/Qwen3-30B-A3B``) and the mesh for your devices, then::

    rljax train --config=qwen3_moe_gpu \\
        --config.model.hf_path=/ckpts/Qwen3-30B-A3B --config.tokenizer.name=/ckpts/Qwen3-30B-A3B \\
        --config.mesh.fsdp=2 --config.mesh.expert=4 --workdir=/runs/qwen3_moe

Why these choices:

* **GSPO** (sequence-level importance ratio, Zheng et al. 2025) with the tight clip range its paper
  uses for sequence ratios, ``eps_low=3e-4``, ``eps_high=4e-4`` (rljax's gspo default); token-level
  ratios of MoE models are too noisy (a flipped expert changes one token's probability a lot). The
  ratio is against the old (proximal) policy, whose logprobs the trainer recomputes from the weights at
  the start of each step (``trainer.old_logprobs="recompute"``, design §3.4): against vLLM's own
  logprobs, sampler noise alone would put most sequences outside so tight a clip.
* **Sequence-level TIS** (``tis_ratio_type="sequence"``) weighs each sample by ``min(old / rollout,
  5)``: the remaining sampler/trainer mismatch of whole samples.
* **Router replay (R3)**, ``model.router_replay="r3"``: the trainer dispatches every token to the
  experts the sampler chose (gates recomputed from the current router, so the router still learns).
  Without it most tokens of a 30B-A3B model route differently in the trainer and runs collapse;
  ``routing/flip_fraction`` reports the share that would have flipped. The servers must return
  their routing (vLLM ``--enable-return-routed-experts``, GPU builds); the embedded sampler always
  records it.
* **Expert parallelism**: the mesh's ``expert`` axis shards the expert stacks; tokens are exchanged
  by the sharding (``rljax.models.moe``), batch rows are sharded over ``data x fsdp x expert``.
* float32 master weights, bf16 compute with full remat, a per-shard micro-batch budget, and the
  load-balancing / z-losses as small objective terms (their metrics are logged either way).
"""

from ml_collections import config_dict

from rljax.recipes import gpu_base


def get_config() -> config_dict.ConfigDict:
    """The GPU base recipe set up for Qwen3-30B-A3B with GSPO and router replay (edit paths and mesh)."""
    c = gpu_base.get_config()
    c.model.update(
        hf_path="/path/to/Qwen3-30B-A3B",
        router_replay="r3",
        # with mesh.context > 1: "all_gather" (cuDNN blocks on the gathered keys) or "ring" (K/V passed
        # device to device, XLA blocks; for meshes whose interconnect is the bottleneck)
        context_attention="all_gather",
    )
    c.tokenizer.name = "/path/to/Qwen3-30B-A3B"
    c.renderer.name = "qwen3"
    c.renderer.kwargs = dict(retention="tool_cycle")
    c.algorithm = dict(name="grpo", policy_loss="gspo", policy_loss_kwargs=dict(eps_low=3e-4, eps_high=4e-4))
    c.trainer.old_logprobs = "recompute"  # what "auto" chooses for gspo + TIS, written out
    c.objective.update(
        off_policy=dict(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=5.0),
        reduction="sequence_mean",
        moe_aux_loss_coef=1e-3,
        router_z_loss_coef=1e-4,
    )
    # product = number of trainer devices; for 40k-token agent rows (SkyRL: CP 4 beside EP 8) add
    # context=4 (each row's tokens split over it, load-balanced; seq_len a multiple of 8)
    c.mesh.update(data=1, fsdp=2, tensor=1, expert=4, context=1)
    c.engine.server.update(
        max_model_len=8192,
        tensor_parallel_size=4,
        startup_timeout_s=1800.0,
        extra_args=("--enable-return-routed-experts", "--enable-expert-parallel"),
    )
    c.engine.client.timeout_s = 900.0
    c.rollout.update(max_tokens=2048, max_context_len=8192)
    c.trainer.seq_len = 16384
    return c
