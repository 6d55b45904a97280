"""Optional parts need their pip extras: a run that uses one without it fails before anything runs,
with one line naming the extra."""

from __future__ import annotations

import pytest
from recipes import load_recipe

from rljax import extras
from rljax.run.builders import check_extras, required_extras
from rljax.run.config import parse_run_config


def _cfg(**envs):
    c = load_recipe("smoke")
    for name, section in envs.items():
        c.envs[name] = section
    return c


def test_the_default_recipes_need_no_extra():
    for name in ("default", "smoke"):
        assert required_extras(parse_run_config(load_recipe(name))) == []


def test_each_optional_part_names_its_extra():
    c = _cfg(agent_env=dict(env="lookup", agent="my_agents:solve"),
             vf=dict(verifiers="wordle"),
             rg=dict(env="reasoning_gym:leg_counting"),
             sk=dict(env="skyrl_gym:gsm8k"))  # fmt: skip
    c.report.sinks = ("jsonl", "wandb", "mlflow")
    c.warmstart.num_steps = 0  # a verifiers env has no demonstrations
    got = set(required_extras(parse_run_config(c)))
    assert got == {
        ("gateway", "config.envs.agent_env.agent"),
        ("verifiers", "config.envs.vf.verifiers"),
        ("reasoning_gym", "config.envs.rg.env"),
        ("skyrl_gym", "config.envs.sk.env"),
        ("wandb", "config.report.sinks"),
        ("mlflow", "config.report.sinks"),
    }


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setattr(extras, "_installed", lambda name: name not in ("uvicorn", "wandb"))
    c = _cfg(agent_env=dict(env="lookup", agent_command="python agent.py"))
    with pytest.raises(extras.MissingExtraError) as e:
        check_extras(parse_run_config(c))
    assert str(e.value) == (
        "config.envs.agent_env.agent_command needs the 'gateway' extra (missing: uvicorn): "
        "pip install 'rljax[gateway]'"
    )
    assert "\n" not in str(e.value)
    c = load_recipe("smoke")
    c.report.sinks = ("jsonl", "wandb")
    with pytest.raises(extras.MissingExtraError, match=r"pip install 'rljax\[report\]'"):
        check_extras(parse_run_config(c))


def test_every_extra_module_is_installed_in_the_test_environment():
    """The suite installs rljax[all]: nothing is missing here (so the checks above are the only
    place a missing extra is simulated)."""
    for extra in extras.EXTRAS:
        assert extras.missing_modules(extra) == [], extra
