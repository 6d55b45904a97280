"""Tests of rljax.algorithms: the named-algorithm registry and its config-time rules (design §3.6)."""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from rljax import algorithms as alg
from rljax.algorithms import (
    Algorithm,
    LengthPenalty,
    get_algorithm,
    validate_algorithm,
    validate_algorithm_config,
)
from rljax.core import advantages as core_advantages
from rljax.core import losses as core_losses
from rljax.core.objective import ObjectiveConfig
from rljax.data.step_advantages import compute_step_advantages
from rljax.types import Step, TrajectoryID


@pytest.fixture
def clean_registry():
    saved = dict(alg._REGISTRY)
    yield
    alg._REGISTRY.clear()
    alg._REGISTRY.update(saved)


# --------------------------------------------------------------------------------------
# registry contents (the table of design §3.6)
# --------------------------------------------------------------------------------------
def test_builtin_names():
    assert {"grpo", "max_rl", "rloo", "ppo", "opd", "opsd", "sft", "echo"} <= set(alg.list_algorithms())
    assert get_algorithm().name == "grpo"


@pytest.mark.parametrize(
    "name,sampling,components,estimator,loss",
    [
        ("grpo", "policy", ("rl",), "grpo", "dppo"),
        ("max_rl", "policy", ("rl",), "max_rl", "dppo"),
        ("rloo", "policy", ("rl",), "rloo", "dppo"),
        ("ppo", "policy", ("rl",), "gae", "ppo_clip"),
        ("opd", "policy", ("ref_kl",), None, None),
        ("opsd", "policy", ("ref_kl",), None, None),
        ("sft", "frozen", ("ce",), None, None),
        ("echo", "policy", ("rl", "ce"), "grpo", "dppo"),
    ],
)
def test_builtin_table(name, sampling, components, estimator, loss):
    a = get_algorithm(name)
    assert (a.sampling, a.components, a.estimator, a.policy_loss) == (sampling, components, estimator, loss)


def test_builtin_details():
    grpo = get_algorithm("grpo")
    assert dict(grpo.estimator_kwargs) == {"norm_by_std": False}
    assert grpo.length_penalty is None and grpo.group_relative and not grpo.needs_critic
    ppo = get_algorithm("ppo")
    assert ppo.needs_critic and ppo.step_wise and ppo.reward_mode == "per_step" and not ppo.group_relative
    assert get_algorithm("opd").needs_teacher and get_algorithm("opd").teacher is None
    opsd = get_algorithm("opsd")
    assert opsd.teacher == "policy" and opsd.needs_demonstrations and not opsd.needs_teacher
    assert dict(get_algorithm("echo").observation_ce) == {"tool": 0.1}
    assert dict(get_algorithm("grpo").observation_ce) == {}
    for name in alg.list_algorithms():
        assert get_algorithm(name).reward_mode == ("per_step" if name == "ppo" else "outcome")


def test_algorithms_are_immutable_and_picklable():
    a = get_algorithm("echo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.sampling = "frozen"  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.observation_ce["tool"] = 1.0  # type: ignore[index]
    b = pickle.loads(pickle.dumps(a))
    assert b == a and hash(b) == hash(a)
    assert dict(b.observation_ce) == {"tool": 0.1}


def test_get_algorithm_overrides_merge_and_do_not_touch_registry():
    a = get_algorithm("ppo", estimator_kwargs={"lam": 0.95}, policy_loss_kwargs={"eps_high": 0.28})
    assert dict(a.estimator_kwargs) == {"gamma": 1.0, "lam": 0.95}
    assert dict(a.policy_loss_kwargs) == {"eps_high": 0.28}
    assert dict(get_algorithm("ppo").estimator_kwargs) == {"gamma": 1.0, "lam": 1.0}
    e = get_algorithm("echo", observation_ce={"user": 0.05, "tool": 0.2})
    assert dict(e.observation_ce) == {"tool": 0.2, "user": 0.05}
    # a different estimator / loss starts from its own (empty) kwargs
    assert dict(get_algorithm("grpo", estimator="rloo").estimator_kwargs) == {}
    assert dict(get_algorithm("ppo", policy_loss="dppo").policy_loss_kwargs) == {}
    assert dict(get_algorithm("grpo", estimator="grpo").estimator_kwargs) == {"norm_by_std": False}
    lp = get_algorithm("grpo", length_penalty={"w_out": 0.5})
    assert lp.length_penalty == LengthPenalty(w_out=0.5, w_in=0.1, w_turn=0.1)
    assert get_algorithm("grpo").length_penalty is None


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: get_algorithm("a2c"), "unknown algorithm 'a2c'; registered: "),
        (lambda: get_algorithm("grpo", lr=1.0), r"unknown field\(s\) \['lr'\]"),
        (
            lambda: get_algorithm("grpo", estimator_kwargs={"gamma": 1.0}),
            r"has no hyperparameter\(s\) \['gamma'\]",
        ),
        (lambda: get_algorithm("grpo", policy_loss="ppo"), "unknown policy_loss 'ppo'"),
        (lambda: get_algorithm("grpo", estimator="vtrace"), "unknown estimator 'vtrace'"),
        (lambda: get_algorithm("grpo", action_component="kl"), "action_component must be one of"),
        (lambda: get_algorithm("grpo", sampling="teacher"), "sampling must be one of"),
        (lambda: get_algorithm("grpo", reward_mode="dense"), "reward_mode must be one of"),
        (lambda: get_algorithm("echo", observation_ce={"tool": -0.1}), r"observation_ce\['tool'\]"),
        (lambda: get_algorithm("echo", observation_ce={"tool": float("nan")}), "finite weight"),
        (lambda: get_algorithm("grpo", estimator_kwargs=[1]), "must be a mapping"),
        (lambda: get_algorithm("sft", estimator_kwargs={"eps": 1.0}), "estimator is None"),
        (lambda: LengthPenalty(w_in=-1.0), "LengthPenalty.w_in"),
        (lambda: get_algorithm("grpo", step_wise="yes"), "step_wise must be a bool"),
    ],
)
def test_field_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_register_algorithm(clean_registry):
    mine = Algorithm(
        "cispo_rloo", estimator="rloo", policy_loss="cispo", policy_loss_kwargs={"eps_high": 5.0}
    )
    assert alg.register_algorithm(mine) is mine
    assert get_algorithm("cispo_rloo") == mine
    with pytest.raises(ValueError, match="already registered; pass overwrite=True"):
        alg.register_algorithm(mine)
    alg.register_algorithm(mine.replace(policy_loss="sapo", policy_loss_kwargs={}), overwrite=True)
    assert get_algorithm("cispo_rloo").policy_loss == "sapo"
    with pytest.raises(ValueError, match="expects an Algorithm"):
        alg.register_algorithm("grpo")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# config-time rules
# --------------------------------------------------------------------------------------
VALID = [
    get_algorithm("grpo"),
    get_algorithm("grpo", length_penalty=LengthPenalty()),
    get_algorithm("max_rl"),
    get_algorithm("rloo"),
    get_algorithm("ppo"),
    get_algorithm("ppo", step_wise=True, reward_mode="per_step"),
    get_algorithm("opd", teacher="http://teacher:8000"),
    get_algorithm("opsd"),
    get_algorithm("sft", teacher="teacher"),
    get_algorithm("echo"),
    get_algorithm("echo", observation_ce={"user": 0.05}, observation_filter="my_pkg.filters:only_numbers"),
    get_algorithm("grpo", estimator="reinforce_pp", step_wise=False),
]


@pytest.mark.parametrize("a", VALID, ids=lambda a: a.name)
def test_valid_algorithms(a):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_algorithm(a, group_size=4) is a


INVALID = [
    (
        "grpo_frozen",
        get_algorithm("grpo", sampling="frozen"),
        "rl component trains on the policy's own samples",
    ),
    ("echo_frozen", get_algorithm("echo", sampling="frozen"), "needs sampling='policy'"),
    ("opd_frozen", get_algorithm("opd", teacher="t", sampling="frozen"), "ref_kl component"),
    ("sft_policy", get_algorithm("sft", sampling="policy"), "sampling='frozen'"),
    ("opd_no_teacher", get_algorithm("opd"), "needs a teacher: set teacher=<frozen teacher endpoint>"),
    ("opd_policy_teacher", get_algorithm("opd", teacher="policy"), "opd needs a frozen teacher endpoint"),
    ("opsd_no_demos", get_algorithm("opsd", needs_demonstrations=False), "without demonstrations"),
    ("ppo_step_wise", get_algorithm("ppo", reward_mode="outcome"), "set reward_mode='per_step'"),
    (
        "reinforce_pp_step_wise",
        get_algorithm("grpo", estimator="reinforce_pp"),
        "per_step",
    ),
    ("rl_no_estimator", get_algorithm("grpo", estimator=None, estimator_kwargs={}), "needs an estimator"),
    ("rl_no_loss", get_algorithm("grpo", policy_loss=None), "and a policy_loss"),
    ("sft_estimator", get_algorithm("sft", estimator="grpo"), "set estimator=None and policy_loss=None"),
    ("opsd_loss", get_algorithm("opsd", policy_loss="dppo"), "rl component only"),
    ("teacher_unused", get_algorithm("grpo", teacher="http://t"), "used by the ref_kl component"),
    ("sft_no_sampler", get_algorithm("sft"), "sampling='frozen' needs the frozen model that samples"),
    (
        "sft_policy_sampler",
        get_algorithm("sft", teacher="policy"),
        "set teacher=<name in config.frozen_models",
    ),
    ("filter_without_echo", get_algorithm("grpo", observation_filter="m:f"), "set observation_ce too"),
    (
        "opd_observation_ce",
        get_algorithm("opd", teacher="t", observation_ce={"tool": 0.1}),
        "would be ignored",
    ),
    ("length_penalty_gae", get_algorithm("ppo", length_penalty=LengthPenalty()), "needs estimator in"),
]


@pytest.mark.parametrize("a,match", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_algorithms(a, match):
    with pytest.raises(ValueError, match=match) as info:
        validate_algorithm(a)
    assert str(info.value).startswith(f"algorithm {a.name!r}")
    with pytest.raises(ValueError, match=r"\(env 'B'\)"):
        validate_algorithm(a, env="B")


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"observation_ce": {"assistant": 0.1}}, "cannot train role 'assistant'"),
        ({"observation_filter": "no_colon"}, "'module:function' import path"),
    ],
)
def test_echo_field_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        get_algorithm("echo", **fields)


def test_frozen_model_reference():
    assert get_algorithm("opd", teacher="big").frozen_model == "big"
    assert get_algorithm("sft", teacher="http://t:1").frozen_model == "http://t:1"
    assert get_algorithm("opsd").frozen_model is None and get_algorithm("grpo").frozen_model is None


@pytest.mark.parametrize("name", ["grpo", "rloo", "max_rl", "echo"])
def test_group_relative_with_group_size_one_warns(name):
    with pytest.warns(UserWarning, match="group_size=1"):
        validate_algorithm(get_algorithm(name), group_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_algorithm(get_algorithm(name), group_size=2)


@pytest.mark.parametrize(
    "a", [get_algorithm("ppo"), get_algorithm("sft", teacher="t"), get_algorithm("opsd")], ids=str
)
def test_group_size_one_silent_for_non_group_estimators(a):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_algorithm(a, group_size=1)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_group_size(bad):
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        validate_algorithm(get_algorithm("grpo"), group_size=bad)


# --------------------------------------------------------------------------------------
# run config with per-env overrides
# --------------------------------------------------------------------------------------
def test_per_env_mix():
    cfg = validate_algorithm_config(
        "grpo",
        env_overrides={
            "web": "echo",
            "code": {"name": "opd", "teacher": "http://teacher"},
            "chat": get_algorithm("ppo"),
        },
        group_size=8,
    )
    assert cfg.for_env("web").name == "echo" and cfg.for_env("math").name == "grpo"
    assert cfg.for_env("code").teacher == "http://teacher"
    assert cfg.names == ("echo", "grpo", "opd", "ppo")
    assert cfg.needs_critic and cfg.needs_teacher and not cfg.needs_demonstrations
    plain = validate_algorithm_config()
    assert plain.default == get_algorithm("grpo") and dict(plain.per_env) == {}
    assert not plain.needs_critic and not plain.needs_teacher


def test_per_env_validated_per_env():
    with pytest.raises(ValueError, match=r"algorithm 'sft' \(env 'B'\): .*sampling='frozen'"):
        validate_algorithm_config(
            "grpo", env_overrides={"A": "echo", "B": {"name": "sft", "sampling": "policy"}}
        )
    with pytest.raises(
        ValueError, match=r"algorithm 'opd' \(env 'A'\): the ref_kl component needs a teacher"
    ):
        validate_algorithm_config("grpo", env_overrides={"A": "opd"})
    with pytest.raises(ValueError, match=r"env_overrides\['A'\]: an algorithm mapping needs a 'name' key"):
        validate_algorithm_config("grpo", env_overrides={"A": {"sampling": "policy"}})
    with pytest.raises(ValueError, match="env_overrides must map env name"):
        validate_algorithm_config("grpo", env_overrides=["echo"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown algorithm 'dpo'"):
        validate_algorithm_config("dpo")


def test_per_env_group_sizes():
    with pytest.warns(UserWarning, match=r"\(env 'B'\).*group_size=1") as record:
        validate_algorithm_config(
            {"name": "sft", "teacher": "t"},
            env_overrides={"B": "echo", "C": "rloo"},
            group_size={"B": 1, "C": 4},
        )
    assert len(record) == 1
    # an env trained by the default algorithm is checked with its own group size
    with pytest.warns(UserWarning, match=r"algorithm 'grpo' \(env 'math'\)"):
        validate_algorithm_config(
            "grpo", env_overrides={"web": {"name": "sft", "teacher": "t"}}, group_size={"math": 1, "web": 1}
        )


def test_same_name_different_config_rejected():
    with pytest.raises(ValueError, match="give the variant its own name"):
        validate_algorithm_config("grpo", env_overrides={"B": {"name": "grpo", "policy_loss": "cispo"}})
    # the same algorithm twice is fine
    validate_algorithm_config("grpo", env_overrides={"B": "grpo"})


def test_config_dict_inputs():
    cd = ml_collections.ConfigDict({"name": "ppo", "estimator_kwargs": {"lam": 0.9}})
    over = ml_collections.ConfigDict({"web": {"name": "echo", "observation_ce": {"user": 0.3}}})
    cfg = validate_algorithm_config(cd, env_overrides=over)
    assert dict(cfg.default.estimator_kwargs) == {"gamma": 1.0, "lam": 0.9}
    assert dict(cfg.for_env("web").observation_ce) == {"tool": 0.1, "user": 0.3}


# --------------------------------------------------------------------------------------
# the core registries: user estimators and losses work like built-in ones
# --------------------------------------------------------------------------------------
@pytest.fixture
def core_registries():
    est, loss = dict(core_advantages.ESTIMATORS), dict(core_losses.POLICY_LOSSES)
    yield
    core_advantages._ESTIMATORS._values.clear()
    core_advantages._ESTIMATORS._values.update(est)
    core_losses._POLICY_LOSSES._values.clear()
    core_losses._POLICY_LOSSES._values.update(loss)


def _scaled_centered(rewards, group_ids, num_groups, *, scale):
    """scale * (r - mean_g): a user group estimator (no degenerate-group rule)."""
    total = jax.ops.segment_sum(rewards, group_ids, num_groups)
    count = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_groups)
    return scale * (rewards - (total / jnp.maximum(count, 1.0))[group_ids])


def test_user_estimator_works_like_a_builtin(core_registries, clean_registry):
    core_advantages.register_estimator(
        "centered_test", core_advantages.Estimator(_scaled_centered, "group", {"scale": 2.0})
    )
    a = Algorithm("centered", estimator="centered_test", estimator_kwargs={"scale": 3.0})
    assert a.group_relative and not a.needs_critic
    validate_algorithm(a.replace(length_penalty=LengthPenalty()), group_size=4)  # group estimators only
    with pytest.warns(UserWarning, match="group-relative but group_size=1"):
        validate_algorithm(a, group_size=1)
    with pytest.raises(ValueError, match=r"estimator 'centered_test' has no hyperparameter\(s\) \['lam'\]"):
        a.replace(estimator_kwargs={"lam": 1.0})
    alg.register_algorithm(a)
    assert validate_algorithm_config("centered").default.estimator == "centered_test"

    # through the host step-wise path: trajectory q#0 has two steps (the last one's reward counts)
    steps = [
        Step([1], [2, 3], TrajectoryID("q", 0), loss_mask=[1, 1], reward=5.0, is_last_step=False),
        Step([1], [4], TrajectoryID("q", 1), reward=0.0),
        Step([1, 2, 3, 9], [5, 6], TrajectoryID("q", 0), loss_mask=[0, 1], reward=1.0),
        Step([1], [7], TrajectoryID("q", 2), reward=0.5),
        Step([8], [9], TrajectoryID("p", 0), reward=3.0),
    ]
    # group q: R = [1, 0, 0.5], mean 0.5 -> 2 * [0.5, -0.5, 0]; group p (one trajectory): 0
    got = compute_step_advantages(steps, "centered_test")
    want = [[1.0, 1.0], [-1.0], [0.0, 1.0], [0.0], [0.0]]
    assert [g.tolist() for g in got] == want
    got = compute_step_advantages(steps, "centered_test", scale=1.0)
    assert [g.tolist() for g in got] == [[0.5, 0.5], [-0.5], [0.0, 0.5], [0.0], [0.0]]
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['gamma'\]"):
        compute_step_advantages(steps, "centered_test", gamma=1.0)


def test_user_token_estimator_follows_the_token_rules(core_registries):
    core_advantages.register_estimator(
        "critic_test",
        core_advantages.Estimator(
            core_advantages.gae, "token", {"gamma": 1.0, "lam": 0.9}, needs_critic=True
        ),
    )
    a = Algorithm("critic", estimator="critic_test", estimator_kwargs={"lam": 0.5}, step_wise=False)
    assert a.needs_critic and not a.group_relative
    validate_algorithm(a, group_size=1)
    with pytest.raises(ValueError, match="reward_mode='per_step'"):
        validate_algorithm(a.replace(step_wise=True))
    with pytest.raises(ValueError, match="length_penalty shapes group-relative rewards"):
        validate_algorithm(a.replace(length_penalty=LengthPenalty()))
    steps = [Step([1], [2], TrajectoryID("q", 0), reward=1.0)]
    with pytest.raises(ValueError, match="critic values"):
        compute_step_advantages(steps, "critic_test", reward_mode="per_step")


def test_user_policy_loss_works_like_a_builtin(core_registries):
    def reinforce(logp, adv, mask, *, scale):
        return -scale * adv * logp * mask

    core_losses.register_policy_loss(
        "reinforce_test", core_losses.PolicyLoss(reinforce, ("logp", "adv", "mask"), {"scale": 1.0})
    )
    a = Algorithm("mine", estimator="rloo", policy_loss="reinforce_test", policy_loss_kwargs={"scale": 0.5})
    validate_algorithm(a, group_size=4)
    assert dict(get_algorithm("grpo", policy_loss="reinforce_test").policy_loss_kwargs) == {}
    match = r"policy_loss 'reinforce_test' has no hyperparameter\(s\) \['eps'\]"
    with pytest.raises(ValueError, match=match):
        a.replace(policy_loss_kwargs={"eps": 0.2})
    # the objective of such an algorithm computes it (trainer builds ObjectiveConfig from these fields)
    cfg = ObjectiveConfig(policy_loss=a.policy_loss, policy_loss_kwargs=dict(a.policy_loss_kwargs))
    assert cfg.policy_loss_kwargs == (("scale", 0.5),)


@pytest.mark.parametrize(
    "loss,kwargs",
    [
        ("clip_cov", {"clip_ratio": 0.01, "clip_cov_lb": 0.5, "clip_cov_ub": 4.0, "eps_high": 0.28}),
        ("kl_cov", {"kl_cov_frac": 0.002, "ppo_kl_coef": 0.5}),
        ("cispo", {"behavior": "inference", "eps_high": 5.0}),
    ],
)
def test_registered_losses_and_their_options(loss, kwargs):
    a = get_algorithm("grpo", policy_loss=loss, policy_loss_kwargs=kwargs)
    assert dict(validate_algorithm(a).policy_loss_kwargs) == kwargs


def test_choice_values_are_checked_at_config_time():
    match = r"algorithm 'grpo': .*behavior must be one of \('old', 'inference'\)"
    with pytest.raises(ValueError, match=match):
        get_algorithm("grpo", policy_loss="cispo", policy_loss_kwargs={"behavior": "teacher"})
    with pytest.raises(ValueError, match=r"has no hyperparameter\(s\) \['behavior'\]"):
        get_algorithm("grpo", policy_loss="ppo_clip", policy_loss_kwargs={"behavior": "old"})


def test_algorithms_reads_the_core_registries_only():
    """No estimator / loss vocabulary of its own, and nothing imported from rljax.data."""
    source = pathlib.Path(alg.__file__).read_text()
    assert "rljax.data" not in source
    for gone in ("ESTIMATOR_KWARGS", "POLICY_LOSS_KWARGS", "OUTCOME_ESTIMATORS"):
        assert not hasattr(alg, gone)
