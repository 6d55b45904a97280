"""Default recipe: a tiny model trained on CPU on the built-in multi-turn ``lookup`` tool task.

Everything is built on the fly (no downloads): a byte-level toy ChatML tokenizer, a 2-layer Qwen3-style
decoder, the embedded JAX sampler, and the ``lookup`` environment (call a tool, read its answer, reply).
A short warm start (400 cross-entropy steps on demonstrations from ``env.solution`` whose final answer
is replaced by a wrong color 60% of the time) teaches the tool-call format; the warm-started policy
answers correctly ~35-40% of the time, and GRPO + DPPO (120 steps, 16 prompts x 8 samples) must learn
to look up the right key and copy the tool's answer.

    python -m launch.train --config=configs/default.py --workdir=/tmp/rljax_default
    python -m launch.train --config=configs/default.py --config.trainer.num_steps=5
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.seed = 0
    c.tokenizer = dict(name="toy:chatml")
    c.renderer = dict(name="chatml", kwargs={})
    c.model = dict(
        hf_path="",  # set to an HF checkpoint directory to load it instead of building `init`
        dtype="float32",
        init=dict(
            model_type="qwen3",
            vocab_size=0,  # 0 = the tokenizer's size
            hidden_size=64,
            intermediate_size=192,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            qk_norm=True,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
        ),
    )
    c.envs = dict(
        lookup=dict(
            env="lookup",
            # compact: no tool schema, no system prompt (the warm start teaches the format), small credit
            kwargs=dict(compact=True, system_prompt="", credit=(0.02, 0.05, 0.1)),
            task_kwargs={},
            num_train_tasks=2048,
            num_eval_tasks=32,
        ),
    )
    c.engine = dict(
        kind="embedded",
        max_batch_size=128,
        min_batch_bucket=8,
        batch_wait_ms=0.0,
        min_prompt_bucket=64,
        min_new_tokens_bucket=16,
    )
    c.rollout = dict(
        group_size=8,
        max_turns=3,
        max_tokens=64,
        max_context_len=512,
        temperature=1.0,
        top_p=1.0,
        max_concurrency=256,
    )
    c.eval = dict(group_size=1, temperature=1.0)  # greedy (0.0) saturates at 1.0 after the warm start
    # A name, or a dict {"name": ..., field overrides} (see rljax.algorithms), e.g.
    #   --config.algorithm=rloo    --config.algorithm="{'name': 'opd', 'teacher': 'teacher'}"
    c.algorithm = config_dict.FieldReference("grpo", field_type=object)
    # env name -> algorithm (same forms), e.g. {"lookup": "echo"}: one run mixes algorithms per env
    c.env_algorithms = config_dict.FieldReference({}, field_type=object)
    # Frozen models (OpenAI-compatible endpoints rljax never launches or updates): opd teachers and
    # sft samplers refer to them by name, e.g. {"teacher": {"base_url": "http://127.0.0.1:8001"}}.
    c.frozen_models = config_dict.FieldReference({}, field_type=object)
    c.objective = dict(reduction="token_mean", off_policy={}, entropy_coef=0.0)
    c.optimizer = dict(
        learning_rate=2e-4, schedule="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0
    )
    c.warmstart = dict(
        num_steps=400,
        batch_size=32,
        learning_rate=3e-3,
        corrupt_prob=0.6,
        corrupt_choices=("red", "blue", "green", "gold"),
        seq_len=256,
        log_every=20,
    )
    c.trainer = dict(
        num_steps=120,
        mode="sync",  # or "async": rollout of step n+1 overlaps training of step n
        max_off_policy_steps=1,
        prompts_per_step=16,
        mini_batch_prompts=0,  # 0 = all prompts of a step in one optimizer step
        seq_len=384,
        truncate=True,  # drop the tail of (rare, degenerate) over-long samples; counted in pack metrics
        merge=True,
        filters=[],  # e.g. [dict(name="overlong", mode="enforce"), dict(name="gibberish", mode="monitor")]
        # DAPO dynamic sampling: resample (up to max_rounds rounds) until every prompt slot holds a group
        # whose rewards vary (spread > atol); max_rounds=0 is off. strict=True fails when it runs out.
        dynamic_sampling=dict(max_rounds=0, atol=0.0, strict=False),
        eval_every=10,
        checkpoint_every=10,
        keep_checkpoints=3,
    )
    return c
