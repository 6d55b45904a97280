"""LoRA on MoE expert stacks (PEFT's ``target_parameters`` on transformers' fused experts).

References are independent of rljax: ``peft`` 0.21 wraps a transformers 5 Qwen3-MoE / Qwen2-MoE
(torch, float32) whose fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` it
adapts with ``ParamWrapper``; its logprobs (float64 numpy from its logits) must equal rljax's with the
same adapter loaded from peft's own files, and an adapter rljax writes must load in peft. A fresh
adapter must leave logprobs bit-identical; training must move the adapter only (the base is the same
arrays afterwards), and sharded (expert-parallel) training must equal single-device training.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from tolerances import LOGPROB_TOL

sys.path.insert(0, os.path.dirname(__file__))
from test_models_moe_helpers import make_hf_moe, random_tokens  # noqa: E402

from rljax import models  # noqa: E402
from rljax.models import lora  # noqa: E402
from rljax.models.tiny import random_decoder, tiny_config  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _peft() -> None:
    # imported by the tests, not at collection: every xdist worker collects every module (~4 s import)
    pytest.importorskip("peft")


BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _peft_moe(
    name: str, target_modules: list[str], target_parameters: list[str], *, seed: int = 0, **patterns
):
    """A peft-wrapped transformers MoE with every adapter weight drawn at random (B = 0 would hide bugs)."""
    import peft
    import torch

    cfg = peft.LoraConfig(
        r=3,
        lora_alpha=6.0,
        target_modules=target_modules,
        target_parameters=target_parameters,
        lora_dropout=0.0,
        **patterns,
    )
    model = peft.get_peft_model(make_hf_moe(name, seed=seed), cfg).eval()
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize(
    "name, target_modules, target_parameters",
    [
        ("qwen3_moe", ["q_proj", "down_proj"], BOTH),  # dense down_proj: the mlp_only layer's MLP
        # the shared expert's gate / up; peft >= 0.22 also reads them as transformers 4's expert names
        # and adapts the fused gate_up_proj with rank 2r, alpha 2 alpha (a rank_pattern in the file)
        ("qwen2_moe", ["v_proj", "gate_proj", "up_proj"], BOTH[::-1]),
        ("qwen3_moe", [], ["mlp.experts.down_proj"]),  # one wrapper: no base_layer in the names
        ("qwen2_moe", ["o_proj"], ["gate_up_proj"]),  # a bare parameter name, as peft matches it
    ],
)
def test_peft_expert_adapter_loads_and_matches_peft(
    helpers, tmp_path, name, target_modules, target_parameters
):
    ref = _peft_moe(name, target_modules, target_parameters)
    ref.save_pretrained(tmp_path / "adapter")
    make_hf_moe(name).save_pretrained(tmp_path / "base")
    tokens = random_tokens(3, (2, 24))
    want = helpers.hf_token_logprobs(ref, tokens)
    model = models.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    assert set(model.lora_config.expert_targets) == {
        f"experts.{t.rpartition('.')[2]}" for t in target_parameters
    }
    got = np.asarray(models.sequence_logprobs(model, tokens))
    # measured max |diff| 3.3e-6 .. 4.4e-6 at |logp| <= 10.0 (the four cases)
    np.testing.assert_allclose(got, want, **LOGPROB_TOL)
    base_only = np.asarray(models.sequence_logprobs(models.from_pretrained(tmp_path / "base"), tokens))
    assert np.abs(base_only - want).max() > 1e-2  # the adapter matters: the comparison can fail


def test_peft_rank_and_alpha_patterns_load_and_round_trip(helpers, tmp_path):
    import peft

    patterns = {  # the expert stack keeps one scale (12 / 6 = 6 / 3); q_proj and lm_head get their own
        "rank_pattern": {"mlp.experts.gate_up_proj": 6, "q_proj": 5, "lm_head": 2},
        "alpha_pattern": {"mlp.experts.gate_up_proj": 12.0, "q_proj": 2.0},
    }
    ref = _peft_moe("qwen3_moe", ["q_proj", "k_proj", "lm_head"], BOTH, **patterns)
    ref.save_pretrained(tmp_path / "adapter")  # with the base lm_head (peft's save_embedding_layers)
    make_hf_moe("qwen3_moe").save_pretrained(tmp_path / "base")
    tokens = random_tokens(6, (2, 24))
    want = helpers.hf_token_logprobs(ref, tokens)
    model = models.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    cfg = model.lora_config
    assert (cfg.target_ranks, cfg.target_alphas) == (
        {"experts.gate_up_proj": 6, "q_proj": 5, "lm_head": 2},
        {"experts.gate_up_proj": 12.0, "q_proj": 2.0},
    )
    assert model.layers[0].mlp.experts.gate_up_lora_a.shape[2] == 6 and cfg.max_rank == 6
    assert model.layers[0].self_attn.q_proj.lora_scale == 2.0 / 5 and model.lm_head_lora.lora_scale == 6.0 / 2
    ours = np.asarray(models.sequence_logprobs(model, tokens))
    np.testing.assert_allclose(ours, want, **LOGPROB_TOL)

    lora.save_adapter(model, tmp_path / "again")  # and back: peft reads rljax's patterns the same way
    theirs = peft.PeftModel.from_pretrained(make_hf_moe("qwen3_moe"), tmp_path / "again").eval()
    np.testing.assert_allclose(helpers.hf_token_logprobs(theirs, tokens), want, **LOGPROB_TOL)
    equal = lora.LoRAConfig(rank=3, alpha=6.0, targets=("q_proj", "k_proj", "lm_head", "experts"))
    assert np.abs(want - np.asarray(models.sequence_logprobs(  # the patterns matter: the check can fail
        _with_peft_weights(tmp_path, equal), tokens))).max() > 1e-2  # fmt: skip

    other = tmp_path / "other_base"
    make_hf_moe("qwen3_moe", seed=1).save_pretrained(other)  # the saved lm_head is not this one's
    with pytest.raises(ValueError, match="is not this model's output projection"):
        models.from_pretrained(other, adapter=tmp_path / "adapter")
    meta = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG_FILE).read_text())
    (tmp_path / "adapter" / lora.ADAPTER_CONFIG_FILE).write_text(
        json.dumps(meta | {"rank_pattern": {"layers.0.self_attn.q_proj": 5}})
    )
    with pytest.raises(ValueError, match=r"rank_pattern gives the layers' q_proj different values \[3, 5\]"):
        models.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")


def _with_peft_weights(tmp_path, config: lora.LoRAConfig) -> nnx.Module:
    """The base with ``config``'s adapter shapes holding what the peft file's weights fit (rank-3
    slices): the same tensors read without the per-target ranks and alphas."""
    model = lora.apply_lora(models.from_pretrained(tmp_path / "base"), config, rngs=nnx.Rngs(0))
    theirs = lora.load_adapter(models.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    flat = dict(nnx.to_flat_state(lora.lora_state(theirs)))
    for path, var in nnx.to_flat_state(lora.lora_state(model)):
        src = np.asarray(flat[path][...])
        var.set_value(src[tuple(slice(0, n) for n in var.shape)])
    return model


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_rljax_expert_adapter_loads_in_peft_and_merges(helpers, tmp_path, name):
    import peft

    make_hf_moe(name, seed=2).save_pretrained(tmp_path / "base")
    model = models.from_pretrained(tmp_path / "base")
    targets = ("k_proj", "gate_proj", "up_proj", "down_proj", "experts")  # the dense MLP's too
    lora.apply_lora(model, lora.LoRAConfig(rank=2, alpha=5.0, targets=targets), rngs=nnx.Rngs(4))
    _randomize(model, scale=0.1)
    lora.save_adapter(model, tmp_path / "adapter")
    meta = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG_FILE).read_text())
    # the dense MLP by its parent: bare gate_proj / up_proj / down_proj are the experts' to peft >= 0.22
    parent = {"qwen3_moe": "mlp", "qwen2_moe": "shared_expert"}[name]  # an mlp_only layer / the shared expert
    mlp = [f"{parent}.{t}" for t in ("down_proj", "gate_proj", "up_proj")]
    assert meta["target_modules"] == ["k_proj", *mlp] and meta["target_parameters"] == BOTH
    tokens = random_tokens(4, (2, 24))
    ours = np.asarray(models.sequence_logprobs(model, tokens))
    reloaded = models.from_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")  # reads them back
    np.testing.assert_allclose(np.asarray(models.sequence_logprobs(reloaded, tokens)), ours, **LOGPROB_TOL)
    theirs = peft.PeftModel.from_pretrained(make_hf_moe(name, seed=2), tmp_path / "adapter").eval()
    wrapped = [n for n, _ in theirs.named_modules() if n.endswith("mlp.experts")]
    assert wrapped and all(type(theirs.get_submodule(n)).__name__ == "ParamWrapper" for n in wrapped)
    # measured max |diff| 2.7e-6 (qwen3_moe) / 3.3e-6 (qwen2_moe) at |logp| <= 8.8
    np.testing.assert_allclose(ours, helpers.hf_token_logprobs(theirs, tokens), **LOGPROB_TOL)
    base_only = np.asarray(models.sequence_logprobs(models.from_pretrained(tmp_path / "base"), tokens))
    assert np.abs(base_only - ours).max() > 1e-2

    merged = lora.merge_lora(model)
    assert not nnx.to_flat_state(lora.lora_state(merged)) and not hasattr(
        merged.layers[0].mlp.experts, "lora_scale"
    )
    np.testing.assert_allclose(np.asarray(models.sequence_logprobs(merged, tokens)), ours, **LOGPROB_TOL)
    models.save_pretrained(merged, tmp_path / "merged")  # plain HF weights: loads in transformers alone
    hf_merged = type(make_hf_moe(name)).from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(helpers.hf_token_logprobs(hf_merged, tokens), ours, **LOGPROB_TOL)


def _randomize(model: nnx.Module, *, scale: float, seed: int = 9) -> None:
    """Every adapter weight (A and the zero-initialised B) redrawn at ``scale``."""
    flat = nnx.to_flat_state(lora.lora_state(model))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    nnx.update(
        model,
        nnx.from_flat_state(
            [
                (p, v.replace(scale * jax.random.normal(k, v.shape, v.dtype)))
                for k, (p, v) in zip(keys, flat, strict=True)
            ]
        ),
    )


CFG = tiny_config("qwen3_moe", vocab_size=64, hidden_size=32, head_dim=8, num_layers=2)


def test_zero_init_expert_adapter_leaves_logprobs_unchanged():
    tokens = random_tokens(5, (2, 20)) % CFG.vocab_size
    want = np.asarray(models.sequence_logprobs(random_decoder(CFG, seed=1), tokens))
    model = lora.apply_lora(
        random_decoder(CFG, seed=1), lora.LoRAConfig(rank=4, targets=("experts",)), rngs=nnx.Rngs(2)
    )
    e, h, i, r = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size, 4
    experts = model.layers[0].mlp.experts
    assert experts.gate_up_lora_a.shape == (e, h, r) and experts.down_lora_a.shape == (e, i, r)
    assert (experts.gate_lora_b.shape, experts.up_lora_b.shape, experts.down_lora_b.shape) == (
        (e, r, i),
        (e, r, i),
        (e, r, h),
    )
    bound = np.abs(np.asarray(experts.gate_up_lora_a[...])).max()
    assert 0.5 / np.sqrt(h) < bound <= 1 / np.sqrt(h)  # PEFT's Kaiming-uniform, per expert fan_in
    assert len(nnx.to_flat_state(lora.lora_state(model))) == 5 * CFG.num_layers  # no dense adapters
    np.testing.assert_array_equal(np.asarray(models.sequence_logprobs(model, tokens)), want)


def test_expert_targets_config_and_errors(tmp_path):
    cfg = lora.LoRAConfig(targets=("experts", "q_proj", "mlp.experts.down_proj"))
    assert cfg.targets == ("experts.gate_up_proj", "experts.down_proj", "q_proj")
    assert cfg.module_targets == ("q_proj",) and cfg.expert_targets == lora.EXPERT_TARGETS
    with pytest.raises(ValueError, match="targets: expected a non-empty subset"):
        lora.LoRAConfig(targets=("experts.up_proj",))
    with pytest.raises(ValueError, match="name MoE expert stacks: the model has none"):
        lora.apply_lora(models.tiny_model(), lora.LoRAConfig(targets=("experts",)), rngs=nnx.Rngs(0))
    model = lora.apply_lora(
        random_decoder(CFG), lora.LoRAConfig(rank=2, targets=("experts.down_proj",)), rngs=nnx.Rngs(0)
    )
    lora.save_adapter(model, tmp_path)
    meta = json.loads((tmp_path / lora.ADAPTER_CONFIG_FILE).read_text())
    (tmp_path / lora.ADAPTER_CONFIG_FILE).write_text(
        json.dumps(meta | {"target_parameters": ["mlp.gate.weight"]})
    )
    with pytest.raises(ValueError, match="target_parameters 'mlp.gate.weight' is not supported"):
        lora.load_adapter(random_decoder(CFG), tmp_path)
    (tmp_path / lora.ADAPTER_CONFIG_FILE).write_text(json.dumps(meta | {"target_parameters": BOTH}))
    with pytest.raises(ValueError, match="adapter weights lack .*experts.base_layer.lora_A"):
        lora.load_adapter(random_decoder(CFG), tmp_path)  # the nesting is part of the names


# ------------------------------------------------------------------------------------------ training


def _batch(seed: int = 0, seq: int = 24):
    from random_steps import random_steps

    from rljax.data.pack import pack

    rng = np.random.default_rng(seed)
    steps = random_steps(rng)
    adv = [rng.normal(size=len(s.response_ids)).astype(np.float32) for s in steps]
    return pack(steps, seq_len=seq, advantages=adv, row_buckets=[8]).batch


def _lora_moe(seed: int = 0) -> nnx.Module:
    model = lora.apply_lora(
        random_decoder(CFG, seed=seed),
        lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "experts")),
        rngs=nnx.Rngs(seed + 1),
    )
    _randomize(model, scale=0.05)  # B != 0: A gets gradients from the first step
    return model


def _train_config(**kw):
    from rljax.core.objective import ObjectiveConfig
    from rljax.training.optimizer import OptimizerConfig
    from rljax.training.step import TrainConfig

    return TrainConfig(
        objective=ObjectiveConfig(), optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-6), **kw
    )


@pytest.mark.parametrize("router_replay", [False, True])
def test_train_step_moves_only_the_expert_adapter(router_replay):
    import dataclasses

    from rljax.models import moe
    from rljax.training.step import TrainState, mini_batch_counts, train_step

    model, batch = _lora_moe(), _batch()
    if router_replay:  # replay the experts of another model: the step must follow the record
        _, _, routing = models.sequence_forward(
            random_decoder(CFG, seed=7),
            batch.tokens,
            positions=batch.positions,
            segment_ids=batch.segment_ids,
            with_routing=True,
        )
        recorded = np.asarray(moe.top_k_experts(routing.logits, CFG.num_experts_per_tok))
        batch = dataclasses.replace(batch, routed_experts=recorded.astype(np.int32))
    state = TrainState.create(model, _train_config(router_replay=router_replay))
    assert {type(v) for _, v in nnx.to_flat_state(state.params)} == {lora.LoRAParam}
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state.params)}
    assert "layers.0.mlp.experts.gate_up_lora_a" in paths and "layers.1.mlp.experts.down_lora_b" in paths
    frozen = jax.tree.leaves(state.frozen)
    base_before = [np.array(x) for x in frozen]
    adapter_before = [np.array(x) for x in jax.tree.leaves(state.params)]
    state, metrics = train_step(state, batch, mini_batch_counts(batch, state.config.objective))
    assert float(metrics["update_skipped"]) == 0.0
    assert all(a is b for a, b in zip(jax.tree.leaves(state.frozen), frozen, strict=True))
    for a, b in zip(jax.tree.leaves(state.frozen), base_before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    moved = [
        not np.array_equal(np.asarray(a), b)
        for a, b in zip(jax.tree.leaves(state.params), adapter_before, strict=True)
    ]
    assert all(moved), moved


def test_expert_parallel_lora_step_equals_single_device():
    from rljax.training.sharding import make_mesh, shard_batch
    from rljax.training.step import TrainState, mini_batch_counts, train_step

    batch = _batch(1)
    counts = mini_batch_counts(batch, _train_config().objective)
    single, m1 = train_step(TrainState.create(_lora_moe(), _train_config()), batch, counts)
    mesh = make_mesh(data=2, expert=4)
    state = TrainState.create(_lora_moe(), _train_config(), mesh=mesh)
    a = state.params["layers"][0]["mlp"]["experts"]["gate_up_lora_a"].get_value()
    assert a.sharding.spec[0] == "expert"  # sharded like the stacked weights
    sharded, m2 = train_step(state, shard_batch(batch, mesh), counts)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5, atol=1e-6)
    for x, y in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
