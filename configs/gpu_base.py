"""Base recipe for GPUs: what the GPU recipes share. Start your own GPU config from this one
(``from rljax.recipes import gpu_base``) and set the model, its chat template and the mesh.

What the values are for:

* **Precision**: float32 master weights, gradients and Adam moments (a bf16 checkpoint is upcast on
  load; an lr of 1e-6 would round away in bf16), bf16 activations with full remat; log-probs, ratios
  and losses in float32. ``model.attention="auto"``: cuDNN's ragged fused attention on a GPU with
  bf16 compute.
* **Engine**: vLLM servers serving bf16 weights (``engine.dtype``), launched locally
  (``engine.num_servers``) or yours (``engine.urls``); every weight sync verified by a probe against
  rljax's bf16 logprobs of the same cast weights, retried on a mismatch.
* **Rollouts**: groups of 16 at temperature 1.0, up to 4 turns of 1,024 tokens in 4,096 tokens of
  context; no warm start (a pretrained instruct model knows its tool-call format).
* **Off-policy training** (design §3.4): ``trainer.mode="async"`` overlaps generation of step n+1
  with training of step n (samples at most one version stale); the loss is PPO's clip with DAPO's
  clip-higher against the old (proximal) policy, whose logprobs the trainer recomputes at the start
  of each step, and token-level truncated importance sampling (``min(old / rollout, 2)``) weighs the
  gap to what vLLM sampled.
* **Trainer**: 64 prompts per step in mini-batches of 16, rows of 8,192 tokens trained in
  micro-batches of at most 16,384 tokens per data-parallel shard, AdamW at 1e-6.

Its own model path is a placeholder: ``qwen3_gpu``, ``qwen3_moe_gpu`` and ``qwen35_gpu`` start from
it.
"""

from ml_collections import config_dict

from rljax.recipes import default


def get_config() -> config_dict.ConfigDict:
    """The settings every GPU recipe shares (module docstring); the model path is a placeholder."""
    c = default.get_config()
    c.model.update(
        hf_path="/path/to/model",  # HF checkpoint directory (config.json + safetensors)
        param_dtype="float32",
        compute_dtype="bfloat16",
        remat="full",
        attention="auto",
    )
    c.tokenizer.name = "/path/to/model"  # its tokenizer (tokenizer.json, chat template)
    c.envs.lookup.update(kwargs=dict(compact=False), num_train_tasks=20000, num_eval_tasks=256)
    c.engine.update(
        kind="vllm",
        dtype="bfloat16",  # weights served (cast from the float32 master on every sync)
        urls=(),  # e.g. ("http://10.0.0.2:8000", "http://10.0.0.3:8000"); empty = launch locally
        num_servers=1,
        python="",
        server=dict(
            max_model_len=4096,
            gpu_memory_utilization=0.85,  # of each server GPU (servers on GPUs the trainer does not use)
            tensor_parallel_size=1,  # GPUs per server
            max_num_seqs=256,
            startup_timeout_s=1200.0,
        ),
        client=dict(max_concurrency=256, timeout_s=600.0),
        sync=dict(probe_length=64, on_mismatch="retry"),  # atol: the bf16 default
    )
    c.rollout.update(group_size=16, max_turns=4, max_tokens=1024, max_context_len=4096, temperature=1.0)
    c.warmstart.num_steps = 0
    c.optimizer.update(learning_rate=1e-6, schedule="constant", warmup_steps=10, weight_decay=0.01)
    clip_higher = dict(eps_low=0.2, eps_high=0.28)  # DAPO
    c.algorithm = dict(name="grpo", policy_loss="ppo_clip", policy_loss_kwargs=clip_higher)
    c.objective.off_policy.update(tis_ratio_type="token", token_tis_ratio_clip_high=2.0)
    c.trainer.update(
        old_logprobs="recompute",  # what "auto" chooses for ppo_clip + TIS, written out
        num_steps=500,
        mode="async",
        max_off_policy_steps=1,
        prompts_per_step=64,
        mini_batch_prompts=16,
        seq_len=8192,
        micro_batch_tokens=16384,  # per data-parallel shard: 2 rows of 8192 at a time
        truncate=False,
        eval_every=25,
        checkpoint_every=25,
        keep_checkpoints=3,
    )
    return c
