"""MoE in the train step: router replay (R3), flip fraction, auxiliary losses, micro-batches.

References are independent of the step: the trainer's own top-k computed with a separate
forward (``sequence_forward(..., with_routing=True)``), hand-counted flips, and the whole-batch step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from random_steps import random_steps

from rljax.core.objective import ObjectiveConfig
from rljax.data.micro_batch import split_by_token_budget
from rljax.data.pack import pack
from rljax.models import sequence_forward, top_k_experts
from rljax.models.tiny import random_decoder, tiny_config
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import (
    TrainConfig,
    TrainState,
    loss_and_grads,
    mini_batch_counts,
    train_mini_batch,
    train_step,
)

CFG = tiny_config("qwen3_moe", vocab_size=64, hidden_size=32, head_dim=8, num_layers=2)
SEQ = 24
OPT = OptimizerConfig(learning_rate=1e-3, max_grad_norm=1.0, eps=1e-4)


def _model():
    return random_decoder(CFG, seed=0)


def _own_routing(model, batch):
    """The experts the model itself chooses for every packed token: int [R, L, M, k]."""
    _, _, routing = sequence_forward(
        model, jnp.asarray(batch.tokens), positions=batch.positions, segment_ids=batch.segment_ids,
        with_routing=True,
    )  # fmt: skip
    return np.asarray(top_k_experts(routing.logits, CFG.num_experts_per_tok))


def _batch(seed=0):
    steps = random_steps(np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    adv = [rng.normal(size=len(s.response_ids)).astype(np.float32) for s in steps]
    return pack(steps, seq_len=SEQ, advantages=adv, row_buckets=[4]).batch


def _config(**kw):
    return TrainConfig(objective=ObjectiveConfig(), optimizer=OPT, **kw)


def test_replaying_own_routing_changes_nothing_and_flips_are_counted():
    model, batch = _model(), _batch()
    own = _own_routing(model, batch)
    real = np.asarray(batch.segment_ids) != 0
    record = np.where(real[..., None, None], own, -1).astype(np.int32)
    base = dataclasses.replace(batch, routed_experts=record)
    state = TrainState.create(model, _config(router_replay=True))
    counts = mini_batch_counts(base, state.config.objective)
    g_replay, m_replay = jax.jit(loss_and_grads)(state, base, counts)
    plain = TrainState.create(model, _config(router_replay=False))
    g_plain, m_plain = jax.jit(loss_and_grads)(plain, base, counts)
    assert float(m_replay["routing/flip_fraction"]) == 0.0
    np.testing.assert_allclose(float(m_replay["loss"]), float(m_plain["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_replay), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)

    # flip the recorded experts of 5 hand-picked real tokens (layer 1: a different expert set)
    rows, cols = np.nonzero(real)
    pick = [0, 3, 7, 11, 19]
    flipped = record.copy()
    for i in pick:
        r, c = rows[i], cols[i]
        others = [e for e in range(CFG.num_experts) if e not in own[r, c, 1]]
        flipped[r, c, 1] = others[: CFG.num_experts_per_tok]
    fb = dataclasses.replace(batch, routed_experts=flipped)
    _, m = jax.jit(loss_and_grads)(state, fb, counts)
    want = len(pick) / real.sum()  # flips among recorded tokens (one micro-batch: share 1)
    np.testing.assert_allclose(float(m["routing/flip_fraction"]), want, rtol=1e-6)
    # replaying the flipped record computes another network's logprobs; not replaying ignores it
    _, m_no = jax.jit(loss_and_grads)(plain, fb, counts)
    np.testing.assert_allclose(float(m_no["loss"]), float(m_plain["loss"]), rtol=1e-6)
    # 1e3 x the relative agreement of equal programs asserted above (rtol 1e-6)
    assert abs(float(m["loss"]) - float(m_plain["loss"])) > 1e-3 * abs(float(m_plain["loss"]))


def test_aux_losses_add_their_terms_and_reach_the_router():
    model, batch = _model(), _batch(1)
    counts = mini_batch_counts(batch, ObjectiveConfig())
    off = TrainState.create(model, _config())
    on = TrainState.create(model, _config(moe_aux_loss_coef=0.5, router_z_loss_coef=0.25))
    g_off, m_off = jax.jit(loss_and_grads)(off, batch, counts)
    g_on, m_on = jax.jit(loss_and_grads)(on, batch, counts)
    aux = 0.5 * float(m_off["routing/aux_loss"]) + 0.25 * float(m_off["routing/z_loss"])
    np.testing.assert_allclose(float(m_on["loss"]) - float(m_off["loss"]), aux, rtol=1e-5)
    router_off = [np.asarray(v) for p, v in nnx.to_flat_state(g_off) if "mlp.gate" in ".".join(map(str, p))]
    router_on = [np.asarray(v) for p, v in nnx.to_flat_state(g_on) if "mlp.gate" in ".".join(map(str, p))]
    assert router_on and any(np.abs(a - b).max() > 1e-6 for a, b in zip(router_on, router_off, strict=True))


@pytest.mark.parametrize("rows_per_micro", [1, 2])
def test_moe_micro_batches_equal_whole_batch(rows_per_micro):
    """With replay and aux losses off, micro-batches equal the whole batch exactly (float noise)."""
    model = _model()
    batches = [_batch(s) for s in (2, 3)]
    record = [
        np.where((np.asarray(b.segment_ids) != 0)[..., None, None], _own_routing(model, b), -1)
        for b in batches
    ]
    batches = [
        dataclasses.replace(b, routed_experts=r.astype(np.int32))
        for b, r in zip(batches, record, strict=True)
    ]
    config = _config(router_replay=True)
    whole = TrainState.create(_model(), config)
    micro = TrainState.create(_model(), config)
    for b in batches:
        counts = mini_batch_counts(b, config.objective)
        whole, mw = train_step(whole, b, counts)
        mb = split_by_token_budget(b, micro_batch_tokens=rows_per_micro * SEQ)
        micro, mm = train_mini_batch(micro, mb, counts)
        np.testing.assert_allclose(float(mm["loss"]), float(mw["loss"]), rtol=1e-5)
        # routing metrics are token-share weighted: their micro-batch sum is close to the whole's
        np.testing.assert_allclose(float(mm["routing/entropy"]), float(mw["routing/entropy"]), rtol=0.05)
    for a, b in zip(jax.tree.leaves(micro.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_qwen3_moe_gpu_recipe_from_a_tiny_moe_checkpoint(tmp_path):
    """configs/qwen3_moe_gpu.py from a tiny bf16 Qwen3-MoE checkpoint written by transformers, the
    embedded engine swapped in, the task run as an agent through the gateway (whose recorded calls
    carry the routed experts): 2 steps on its expert-parallel mesh, with replay and routing metrics."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from recipes import load_recipe

    from rljax.chat import toy_tokenizer
    from rljax.run.trainer import Trainer

    tok = toy_tokenizer("chatml")
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok) + 7, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(hf_cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")

    c = load_recipe("qwen3_moe_gpu")
    assert c.model.router_replay == "r3" and c.mesh.expert == 4
    c.model.hf_path = c.tokenizer.name = str(tmp_path / "ckpt")
    c.engine.kind = "embedded"
    c.envs.lookup.update(num_train_tasks=8, num_eval_tasks=0)
    # the task as an agent behind the gateway (MoE with router replay through the gateway)
    c.envs.lookup.agent = "rljax.agents.lookup_agent:lookup_agent"
    c.rollout.update(group_size=2, max_turns=2, max_tokens=16, max_context_len=896)
    c.trainer.update(num_steps=2, prompts_per_step=2, mini_batch_prompts=2, seq_len=1024,
                     micro_batch_tokens=1024, eval_every=0, checkpoint_every=0, table_keys=())  # fmt: skip
    t = Trainer(c, tmp_path / "run")
    assert t.parts.train_configs["grpo"].router_replay and t.parts.mesh.shape["expert"] == 4
    history = t.run()
    assert t.parts.scheduler.gateway is not None  # the rollouts' calls went through the gateway
    for h in history:
        assert 0.0 <= h["routing/flip_fraction"] <= 1.0 and h["routing/entropy"] > 0
        assert h["update_skipped"] == 0 and h["loss/moe_aux"] > 0
        assert h["rollout/num_errored"] == 0
    print("sampler (bf16, KV cache) vs trainer routing flips:", [h["routing/flip_fraction"] for h in history])


def test_lora_on_the_experts_trains_adapters_only(tmp_path):
    """config.lora targeting the expert stacks (and attention) on a tiny Qwen3-MoE: 2 RL steps with
    router replay on the expert-parallel mesh move every adapter (B starts at 0: it moves only with a
    gradient) and leave the base bit-identical."""
    from rljax.models import tiny_config
    from rljax.models.lora import lora_state
    from rljax.run.config import default_config
    from rljax.run.trainer import Trainer

    c = default_config()
    init = dataclasses.asdict(tiny_config("qwen3_moe", num_experts=8, num_experts_per_tok=2))
    # vocab_size: the tokenizer's; extra_json: a checkpoint's (the run refuses it in model.init)
    c.model.init = {k: v for k, v in init.items() if k not in ("vocab_size", "extra_json")}
    c.model.router_replay = "r3"
    c.algorithm = "opsd"  # ref_kl toward the demonstration-conditioned policy: real gradients at once
    c.lora = dict(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "experts"))
    c.mesh.update(data=2, expert=4)
    c.warmstart.num_steps = 0
    c.envs.lookup.update(num_train_tasks=8, num_eval_tasks=0)
    c.rollout.update(group_size=2, max_turns=2, max_tokens=16)
    c.optimizer.learning_rate = 1e-2
    c.trainer.update(
        num_steps=2, prompts_per_step=2, seq_len=512, eval_every=0, checkpoint_every=0, table_keys=()
    )
    t = Trainer(c, tmp_path / "run")
    adapters0 = jax.tree.map(np.asarray, lora_state(t.parts.current_model()))
    base0 = [np.asarray(x) for x in jax.tree.leaves(t.state.frozen)]
    assert any("gate_up_lora_a" in str(p) for p, _ in jax.tree_util.tree_flatten_with_path(adapters0)[0])
    history = t.run()
    assert all(h["update_skipped"] == 0 and np.isfinite(h["loss"]) for h in history)
    adapters1 = jax.tree.map(np.asarray, lora_state(t.parts.current_model()))
    pairs = zip(jax.tree.leaves(adapters0), jax.tree.leaves(adapters1), strict=True)
    moved = [not np.array_equal(a, b) for a, b in pairs]
    assert all(moved), moved
    for a, b in zip(base0, jax.tree.leaves(t.state.frozen), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
