"""The old (proximal) policy's logprobs and the KL reference (design §3.4): ``trainer.old_logprobs``
chooses where they come from, the run recomputes them before a step's first update, and every
off-policy correction then acts on ``old / rollout``; a KL penalty reads a frozen reference policy.

The engine logprobs of these batches are the trainer's own plus known noise, so every ratio the
corrections see is ``exp(-noise)``, computed here independently."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tolerances import LOGPROB_TOL

from rljax.algorithms import validate_algorithm_config
from rljax.core.objective import ObjectiveConfig
from rljax.data.pack import pack
from rljax.envs.arithmetic import ArithmeticEnv
from rljax.recipes import smoke
from rljax.run.builders import check_objective, old_logprobs_choice
from rljax.run.config import parse_run_config
from rljax.run.run import REFERENCE, Run
from rljax.run.trainer import Trainer, check_rollout_logprobs
from rljax.types import Step

COEF = 0.05  # the KL penalty of the module's run


def _config():
    c = smoke.get_config()
    c.warmstart.num_steps = 0
    c.algorithm = dict(name="grpo", policy_loss="ppo_clip")
    c.objective.kl_loss_coef = COEF
    c.trainer.update(num_steps=1, checkpoint_every=0, eval_every=0)
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(_config(), tmp_path_factory.mktemp("run"))
    r.set_reference()  # the weights RL starts from
    yield r
    r.close()


def _batch(run: Run, *, noise: float, seed: int = 0):
    """4 samples of 2 groups whose engine logprobs are the trainer's plus N(0, noise) noise (kept
    <= 0), packed into one batch with advantages -1 / +1 within each group."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, run.model_vocab, 6).tolist() for _ in range(4)]
    responses = [rng.integers(1, run.model_vocab, int(rng.integers(6, 12))).tolist() for _ in range(4)]
    scored = run.score([p + r for p, r in zip(prompts, responses, strict=True)])
    steps, advantages = [], []
    for i, (p, r, lp) in enumerate(zip(prompts, responses, scored, strict=True)):
        own = np.asarray(lp[len(p) :], np.float64)
        eps = rng.normal(scale=noise, size=len(r))
        engine = np.minimum(own + eps, 0.0)
        steps.append(Step(p, r, (f"g{i // 2}", i % 2), response_logprobs=engine.tolist()))
        advantages.append(np.full(len(r), 1.0 if i % 2 else -1.0, np.float32))
    return pack(steps, seq_len=64, advantages=advantages).batch


def test_old_and_reference_logprobs_are_the_trainers_own(run):
    batch = _batch(run, noise=0.05)
    out = run.with_policy_logprobs(batch, algorithm="grpo")
    trained = np.asarray(batch.loss_mask) != 0
    own = run.forward(batch)
    np.testing.assert_allclose(np.asarray(out.old_logprobs)[trained], own[trained], **LOGPROB_TOL)
    np.testing.assert_array_equal(np.asarray(out.old_logprobs)[~trained], 0.0)
    # reference = start; only the loss tokens meet the vocabulary (trainer.loss_only_logits)
    np.testing.assert_allclose(np.asarray(out.kl_reference_logprobs)[trained], own[trained], **LOGPROB_TOL)
    np.testing.assert_array_equal(np.asarray(out.kl_reference_logprobs)[~trained], 0.0)
    # the engine's logprobs are left as sampled
    np.testing.assert_array_equal(out.inference_logprobs, batch.inference_logprobs)


def _losses(run, pairs):
    """The metrics of each (batch, objective) under the same weights (nothing applied in between)."""
    out = [run.forward_backward(batch, objective=cfg) for batch, cfg in pairs]
    run._pending = None  # the summed gradients are not applied: the weights stay as they are
    return out


def test_every_correction_acts_on_recomputed_old_logprobs(run):
    """Two packed samples whose engine logprobs differ from the trainer's: with recomputed old
    logprobs, no correction, token TIS and sequence TIS + geometric mask + [0.9, 1.1] token mask
    give three different losses and the ratio metrics of exp(-noise); with the engine's logprobs as
    the old ones, the ratio is exactly 1 and the three losses are the same."""
    batch = _batch(run, noise=0.08, seed=1)
    trained = np.asarray(batch.loss_mask) != 0
    recomputed = run.with_policy_logprobs(batch, algorithm="grpo")
    rho = np.exp(np.asarray(recomputed.old_logprobs, np.float64) - np.asarray(batch.inference_logprobs))
    base = dict(policy_loss="ppo_clip", components=("rl",))
    configs = [
        ObjectiveConfig(**base),
        ObjectiveConfig(**base, off_policy={"tis_ratio_type": "token"}),
        ObjectiveConfig(
            **base,
            off_policy={
                "tis_ratio_type": "sequence",
                "sequence_mask_metric": "geometric",
                "geo_mask_low": 0.5,
                "geo_mask_high": 2.0,
                "token_mask_is_threshold_low": 0.9,
                "token_mask_is_threshold_high": 1.1,
            },
        ),
    ]
    plain, token_tis, masked = _losses(run, [(recomputed, c) for c in configs])
    assert len({round(m["loss"], 7) for m in (plain, token_tis, masked)}) == 3
    np.testing.assert_allclose(token_tis["off_policy/is_ratio_mean"], rho[trained].mean(), rtol=1e-4)
    np.testing.assert_allclose(token_tis["off_policy/is_ratio_max"], rho[trained].max(), rtol=1e-4)
    outside = (rho[trained] < 0.9) | (rho[trained] > 1.1)
    assert 0 < outside.mean() < 1
    np.testing.assert_allclose(masked["off_policy/token_masked_frac"], outside.mean(), rtol=1e-5)
    assert plain["rl/clip_frac"] == 0.0  # the proximal policy is the current one: ratio 1, no clip

    # the engine's logprobs as the old ones (trainer.old_logprobs="inference"): every ratio is 1
    same = _losses(run, [(batch, c) for c in configs])
    assert same[1]["off_policy/is_ratio_mean"] == pytest.approx(1.0)
    assert same[2]["off_policy/token_masked_frac"] == 0.0
    assert len({round(m["loss"], 7) for m in same}) == 1


def test_gspo_with_the_papers_clip_clips_sampler_noise_but_not_the_proximal_policy(run):
    """GSPO's sequence ratio against the sampler's logprobs: 0.01 nats of noise alone push most
    sequences outside [1 - 3e-4, 1 + 4e-4] (zero gradient); against the recomputed old policy, none."""
    batch = _batch(run, noise=0.01, seed=2)
    cfg = ObjectiveConfig(policy_loss="gspo", components=("rl",))
    recomputed = run.with_policy_logprobs(batch, algorithm="grpo")
    against_sampler, against_old = _losses(run, [(batch, cfg), (recomputed, cfg)])
    assert against_sampler["rl/clip_frac"] > 0.25
    assert against_old["rl/clip_frac"] == 0.0


def test_kl_penalty_reads_the_frozen_reference_and_is_checkpointed(run, tmp_path):
    batch = _batch(run, noise=0.0, seed=3)
    start = run.with_policy_logprobs(batch, algorithm="grpo")
    m0 = run.train(start, algorithm="grpo")
    assert m0["ref_kl/reference_k3"] == pytest.approx(0.0, abs=1e-6)  # the reference is where RL starts
    for _ in range(2):
        run.train(run.with_policy_logprobs(batch, algorithm="grpo"), algorithm="grpo")
    after = run.with_policy_logprobs(batch, algorithm="grpo")
    np.testing.assert_array_equal(after.kl_reference_logprobs, start.kl_reference_logprobs)  # frozen
    lp = run.forward(batch)
    trained = np.asarray(batch.loss_mask) != 0
    d = (np.asarray(after.kl_reference_logprobs, np.float64) - lp)[trained]  # log(pi_ref / pi)
    (m,) = _losses(run, [(after, ObjectiveConfig(policy_loss="ppo_clip", components=("rl",), kl_coef=COEF))])
    k1, k3 = (-d).mean(), (np.exp(d) - d - 1).mean()
    assert k3 > 1e-6
    np.testing.assert_allclose(m["ref_kl/reference_k1"], k1, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(m["ref_kl/reference_k3"], k3, rtol=1e-3, atol=1e-8)
    np.testing.assert_allclose(m["loss/kl_penalty"], COEF * k3, rtol=1e-3, atol=1e-8)

    # the reference (the weights RL started from) is part of the checkpoint and comes back
    run.scheduler.add_version(0, run.snapshot())
    run.save(0)
    assert REFERENCE in run.state_tree({})["params"]
    other = Run(_config(), run.workdir)
    try:
        other.scheduler.add_version(0, other.snapshot())
        other.restore(allow_config_change=True)
        for a, b in zip(jax.tree.leaves(other.reference_params), jax.tree.leaves(run.reference_params),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        other.close()


# ------------------------------------------------------------------------------------------------
# Choices and refusals (no model)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss", "kwargs", "off_policy", "want"),
    [
        ("ppo_clip", {}, None, "recompute"),
        ("dual_clip", {}, None, "recompute"),
        ("gspo", {}, None, "recompute"),
        ("sapo", {}, None, "recompute"),
        ("importance_sampling", {}, None, "recompute"),
        ("clip_cov", {}, None, "recompute"),
        ("kl_cov", {}, None, "recompute"),
        ("cispo", {}, None, "recompute"),
        ("cispo", {"behavior": "inference"}, None, "inference"),
        ("dppo", {}, None, "inference"),
        ("rollout_is", {}, None, "inference"),
        ("dppo", {}, {"max_token_staleness": 1}, "inference"),  # the stale mask reads versions only
        ("dppo", {}, {"sequence_mask_metric": "geometric"}, "recompute"),
        ("dppo", {}, {"token_mask_is_threshold_high": 2.0}, "recompute"),
    ],
)
def test_auto_recomputes_exactly_when_the_objective_reads_the_old_policy(loss, kwargs, off_policy, want):
    cfg = ObjectiveConfig(
        policy_loss=loss, policy_loss_kwargs=kwargs, off_policy=off_policy, components=("rl",)
    )
    mode, why = old_logprobs_choice("auto", cfg)
    assert mode == want, why
    assert old_logprobs_choice("recompute", cfg)[0] == "recompute"
    assert old_logprobs_choice("inference", cfg)[0] == "inference"
    # sft / distillation objectives have no policy-gradient term: nothing to recompute
    assert (
        old_logprobs_choice("auto", ObjectiveConfig(policy_loss=loss, components=("ce",)))[0] == "inference"
    )


def test_corrections_that_would_be_no_ops_or_count_twice_are_refused():
    with pytest.raises(
        ValueError, match=r"^config.objective.off_policy.tis_ratio_type: .*ratio is exactly 1"
    ):
        parse_run_config(
            {
                "trainer": {"old_logprobs": "inference"},
                "objective": {"off_policy": {"tis_ratio_type": "token"}},
            }
        )
    with pytest.raises(ValueError, match=r"token_mask_is_threshold_low"):
        parse_run_config(
            {
                "trainer": {"old_logprobs": "inference"},
                "objective": {"off_policy": {"token_mask_is_threshold_low": 0.5}},
            }
        )
    # the stale-token mask reads versions, not logprobs: fine without a recompute
    parse_run_config(
        {"trainer": {"old_logprobs": "inference"}, "objective": {"off_policy": {"max_token_staleness": 1}}}
    )
    sampler_ratio = (
        "grpo",
        dict(name="grpo", policy_loss="rollout_is"),
        dict(name="grpo", policy_loss="cispo", policy_loss_kwargs={"behavior": "inference"}),
    )
    for algorithm in sampler_ratio:
        cfg = parse_run_config(
            {"algorithm": algorithm, "objective": {"off_policy": {"tis_ratio_type": "token"}}}
        )
        with pytest.raises(ValueError, match="behaviour ratio would count twice"):
            check_objective(cfg, validate_algorithm_config(cfg.algorithm, group_size=8))
    cfg = parse_run_config({"algorithm": dict(name="grpo", policy_loss="ppo_clip"),
                            "objective": {"off_policy": {"tis_ratio_type": "token"}}})  # fmt: skip
    check_objective(cfg, validate_algorithm_config(cfg.algorithm, group_size=8))
    with pytest.raises(ValueError, match=r"^config.objective.kl_reference: a LoRA run"):
        parse_run_config({"objective": {"kl_reference": "/some/hf"}, "lora": {"rank": 4}})


def test_samples_without_rollout_logprobs_are_refused_where_they_are_read():
    steps = [Step([1, 2], [3, 4], ("q", 0), response_logprobs=None)]
    dppo = ObjectiveConfig(components=("rl",))
    with pytest.raises(ValueError, match=r"have no response_logprobs .* policy loss 'dppo'"):
        check_rollout_logprobs("grpo", steps, dppo, old="recompute")
    ppo = ObjectiveConfig(policy_loss="ppo_clip", components=("rl",))
    check_rollout_logprobs("grpo", steps, ppo, old="recompute")  # its ratio is against the recompute
    with pytest.raises(ValueError, match="policy loss 'ppo_clip'"):
        check_rollout_logprobs("grpo", steps, ppo, old="inference")
    with pytest.raises(ValueError, match="tis_ratio_type"):
        tis = ObjectiveConfig(
            policy_loss="ppo_clip", components=("rl",), off_policy={"tis_ratio_type": "token"}
        )
        check_rollout_logprobs("grpo", steps, tis, old="recompute")
    check_rollout_logprobs("sft", steps, ObjectiveConfig(components=("ce",)), old="inference")
    masked = [Step([1, 2], [3, 4], ("q", 0), loss_mask=[0, 0])]
    check_rollout_logprobs("grpo", masked, dppo, old="inference")  # nothing trainable: nothing read


# ------------------------------------------------------------------------------------------------
# A whole run: a bfloat16 sampler against float32 training
# ------------------------------------------------------------------------------------------------


class LengthParity(ArithmeticEnv):
    """One turn; reward 1 for a reply of odd length: the tiny random model's groups have rewards
    that vary, so every step trains non-zero advantages."""

    def step(self, action):
        self.done = True
        return [], float(len(action) % 2), True, {}


def _run_config(off_policy):
    c = smoke.get_config()
    c.envs = {"parity": dict(env="arithmetic", num_train_tasks=8, num_eval_tasks=0)}
    c.warmstart.num_steps = 0
    c.algorithm = dict(name="grpo", policy_loss="ppo_clip")
    c.engine.dtype = "bfloat16"  # the sampler's logprobs differ from the float32 trainer's
    c.rollout.update(group_size=4, max_tokens=12)
    c.objective.off_policy = off_policy
    c.trainer.update(num_steps=1, prompts_per_step=4, checkpoint_every=0, eval_every=0)
    return c


@pytest.mark.integration
def test_a_bf16_sampler_run_with_tis_and_a_token_mask_corrects(tmp_path, capsys):
    """TIS and a token mask act in a real run (the sampler serves bfloat16 weights to a float32
    trainer): the ratio mean is not 1, the mask removes tokens, the loss differs from the same run
    (same seed, same samples) without the correction, and the start line says why it recomputed."""
    make_env = {"parity": LengthParity}
    corrected = Trainer(_run_config({"tis_ratio_type": "token", "token_mask_is_threshold_low": 0.9999,
                                     "token_mask_is_threshold_high": 1.0001}),
                        tmp_path / "tis", make_env=make_env).run()[-1]  # fmt: skip
    assert (
        "old logprobs: recompute (auto: the old policy is read by policy loss 'ppo_clip'"
        in capsys.readouterr().out
    )
    plain = Trainer(_run_config({}), tmp_path / "plain", make_env=make_env).run()[-1]
    assert corrected["reward/mean"] == plain["reward/mean"]  # the same samples
    assert 0.0 < corrected["reward/mean"] < 1.0
    assert abs(corrected["off_policy/is_ratio_mean"] - 1.0) > 1e-5
    assert corrected["off_policy/is_ratio_max"] > 1.0
    assert corrected["off_policy/token_masked_frac"] > 0.0
    assert corrected["loss"] != pytest.approx(plain["loss"], rel=1e-4)


def test_recomputing_for_stale_samples_without_an_importance_weight_says_so():
    # Recomputed old logprobs take the sampler out of ppo_clip's ratio; with stale samples and no TIS
    # nothing weighs old vs sampler any more (in the one-step-stale default recipe, one of two seeds
    # collapsed that way, benchmarks/old_logprobs_bench.py --curves): the start line says so.
    ppo = ObjectiveConfig(policy_loss="ppo_clip", components=("rl",))
    for mode in ("auto", "recompute"):
        choice, why = old_logprobs_choice(mode, ppo, stale_versions=2)
        assert choice == "recompute" and "may be 2 version(s) stale" in why and "tis_ratio_type" in why
        assert "stale" not in old_logprobs_choice(mode, ppo, stale_versions=0)[1]  # sync: nothing stale
    weighed = ObjectiveConfig(
        policy_loss="ppo_clip", components=("rl",), off_policy={"tis_ratio_type": "token"}
    )
    assert "stale" not in old_logprobs_choice("auto", weighed, stale_versions=2)[1]
    assert "stale" not in old_logprobs_choice("inference", ppo, stale_versions=2)[1]  # the ratio weighs it
