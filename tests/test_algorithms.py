"""Tests of rljax.algorithms: the named-algorithm registry and its config-time rules (SPEC §3.6)."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

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


@pytest.fixture
def clean_registry():
    saved = dict(alg._REGISTRY)
    yield
    alg._REGISTRY.clear()
    alg._REGISTRY.update(saved)


# --------------------------------------------------------------------------------------
# registry contents (the table of SPEC §3.6)
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
    assert ppo.needs_critic and ppo.step_wise is False and not ppo.group_relative
    assert get_algorithm("opd").needs_teacher and get_algorithm("opd").teacher is None
    opsd = get_algorithm("opsd")
    assert opsd.teacher == "policy" and opsd.needs_demonstrations and not opsd.needs_teacher
    assert dict(get_algorithm("echo").observation_ce) == {"tool": 0.1}
    assert dict(get_algorithm("grpo").observation_ce) == {}
    for name in alg.list_algorithms():
        assert get_algorithm(name).reward_mode == "outcome"


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
    ("ppo_step_wise", get_algorithm("ppo", step_wise=True), "set reward_mode='per_step'"),
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
