"""Environments, task makers, renderers and reward functions named from outside the package.

``"module:attr"`` resolution and its errors (rljax.envs.loader), ``rljax.envs.register``, entry
points of the group ``rljax.envs`` (a temporary ``*.dist-info`` directory on ``sys.path``), and the
config path (``config.envs.<name>.env`` / ``.tasks``, ``config.renderer.name``, reward methods),
whose mistakes fail when the config is parsed or the tasks are built, naming the key.

Every user module here is written to a temporary directory outside the package and imported through
``sys.path``, as a user's code would be.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest

from rljax import envs
from rljax.chat import ChatMLRenderer, make_renderer, toy_tokenizer
from rljax.envs import registry
from rljax.envs.loader import LoadError, is_import_string, load_attr, split_import_string
from rljax.run.config import parse_run_config
from rljax.run.tasks import build_env_tasks

# A user's environment module: no rljax import needed (tasks may be dicts of Task fields).
COIN = '''
CALLS = []


class CoinEnv:
    """Reward = the task's value + bonus, after one turn."""

    def __init__(self, bonus=0.0):
        self.bonus = bonus

    @staticmethod
    def make_tasks(num_tasks, *, seed, split, levels=4):
        CALLS.append((num_tasks, seed, split, levels))
        return [{"id": f"{split}-{seed}-{i}", "data": {"value": i / levels}, "split": split}
                for i in range(levels)]

    def reset(self, task):
        self.value = task.data["value"]
        return [{"role": "user", "content": "Flip."}]

    def step(self, action):
        return [], self.value + self.bonus, True, {}


def make_env(bonus=0.0):
    return CoinEnv(bonus=bonus)


def other_tasks(num_tasks, *, seed, split):
    return [{"id": f"other-{split}-{i}", "split": split} for i in range(num_tasks)]


def not_tasks(num_tasks, *, seed, split):
    return "nope"


class NoTasks:
    def reset(self, task):
        return []

    def step(self, action):
        return [], 0.0, True, {}


LIMIT = 3
'''


def _module(tmp_path, monkeypatch, name: str, source: str) -> str:
    """Writes ``name.py`` into ``tmp_path`` (put on sys.path); it is forgotten after the test."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.fixture
def coin(tmp_path, monkeypatch):
    """The module name of a fresh copy of ``COIN`` (unique per test: no stale import)."""
    name = f"coin_{abs(hash(str(tmp_path)))}"
    yield _module(tmp_path, monkeypatch, name, COIN)
    sys.modules.pop(name, None)


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty registry of user envs for the test (the doctests register ids of their own)."""
    monkeypatch.setattr(registry, "_REGISTERED", {})


# -- "module:attr" resolution ---------------------------------------------------------------------


def test_load_attr_resolves_modules_classes_and_dotted_attributes():
    import json.decoder

    assert load_attr("json:dumps") is json.dumps
    assert load_attr("json.decoder:JSONDecoder") is json.decoder.JSONDecoder
    assert load_attr("json.decoder:JSONDecoder.decode") is json.decoder.JSONDecoder.decode
    assert load_attr("math:pi", must_call=False) == pytest.approx(3.141592653589793)
    assert split_import_string("a.b:C.d") == ("a.b", "C.d")
    assert [is_import_string(s) for s in ("a.b:C", "lookup", "a:", ":b", "a:b:c", "a b:c", 3)] == [
        True,
        False,
        False,
        False,
        False,
        False,
        False,
    ]


@pytest.mark.parametrize("spec", ["nocolon", "mod:", ":Attr", "a:b:c", "my mod:X", "a.:X", 3, None])
def test_a_malformed_string_is_a_format_error(spec):
    with pytest.raises(LoadError, match=r"^config.envs.x.env: expected an import string") as e:
        load_attr(spec, where="config.envs.x.env")
    assert e.value.reason == "format" and isinstance(e.value, ValueError)


def test_each_failure_says_what_failed(tmp_path, monkeypatch, coin):
    _module(tmp_path, monkeypatch, "needs_missing_dep", "import no_such_dependency_xyz\n")
    _module(tmp_path, monkeypatch, "raises_on_import", "raise RuntimeError('boom at import')\n")
    where = "config.envs.myenv.env"
    cases = {
        "no_such_pkg_xyz.envs:Env": ("module", "no module named 'no_such_pkg_xyz'"),
        f"{coin}.sub:Env": ("module", f"no module named '{coin}.sub'"),
        "needs_missing_dep:Env": ("import", "ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
        "raises_on_import:Env": ("import", "RuntimeError: boom at import"),
        f"{coin}:CoinEnvv": (
            "attribute",
            f"module '{coin}' has no attribute 'CoinEnvv' (did you mean 'CoinEnv'?)",
        ),
        f"{coin}:CoinEnv.make_taskz": ("attribute", f"{coin}:CoinEnv has no attribute 'make_taskz'"),
        f"{coin}:LIMIT": ("callable", f"'{coin}:LIMIT' is not callable: it names int 3"),
    }
    for spec, (reason, text) in cases.items():
        with pytest.raises(LoadError) as e:
            load_attr(spec, where=where)
        assert e.value.reason == reason, spec
        assert str(e.value).startswith(f"{where}: "), str(e.value)
        assert text in str(e.value), str(e.value)


def test_reward_functions_and_agents_share_the_resolver(coin):
    from rljax.agents.runners import load_agent
    from rljax.envs.rewards import load_function

    assert load_function(f"{coin}:other_tasks") is importlib.import_module(coin).other_tasks
    with pytest.raises(LoadError, match="has no attribute 'nope'") as e:
        load_function(f"{coin}:nope")
    assert e.value.reason == "attribute"
    with pytest.raises(ValueError, match="agent: cannot import 'no_such_pkg_xyz:f': no module named"):
        load_agent("no_such_pkg_xyz:f")


# -- rljax.envs.register --------------------------------------------------------------------------


def test_register_a_class_or_a_lazy_import_string(coin, fresh_registry):
    assert envs.register is registry.register
    envs.register("coin-lazy", entry_point=f"{coin}:make_env", tasks=f"{coin}:other_tasks")
    assert coin not in sys.modules  # registering imports nothing
    env = envs.make_env("coin-lazy", bonus=2.0)
    assert type(env).__name__ == "CoinEnv" and env.bonus == 2.0
    tasks = envs.make_tasks("coin-lazy", 2, seed=0, split="test")
    assert [t.id for t in tasks] == ["other-test-0", "other-test-1"]

    cls = importlib.import_module(coin).CoinEnv
    envs.register("coin", entry_point=cls)  # tasks: the class's make_tasks
    tasks = envs.make_tasks("coin", 3, seed=7, split="train", levels=5)
    assert [(t.id, t.data["value"], t.split) for t in tasks] == [
        ("train-7-0", 0.0, "train"),
        ("train-7-1", 0.2, "train"),
        ("train-7-2", 0.4, "train"),
    ]  # at most num_tasks of the 5 the maker returned, dicts made Tasks
    calls = importlib.import_module(coin).CALLS
    assert calls == [(3, 7, "train", 5)]
    assert envs.make_tasks("coin", 0, seed=7) == [] and len(calls) == 1  # no call for 0 tasks


def test_register_refuses_builtin_names_and_bad_ids(coin, fresh_registry):
    cls = importlib.import_module(coin).CoinEnv
    for taken in ("arithmetic", "lookup", "verifiable", "skyrl_gym", "reasoning_gym"):
        with pytest.raises(ValueError, match="built-in environment name"):
            envs.register(taken, entry_point=cls)
    for bad in ("", "a:b", " x", 3):
        with pytest.raises(ValueError, match="environment id"):
            envs.register(bad, entry_point=cls)
    with pytest.raises(ValueError, match="entry_point must be a callable or 'module:attr'"):
        envs.register("x", entry_point=3)
    with pytest.raises(LoadError, match=r"^register\('x'\) tasks: expected an import string"):
        envs.register("x", entry_point=cls, tasks="my_tasks")
    assert isinstance(envs.make_env("arithmetic"), envs.ArithmeticEnv)  # built-ins untouched


def test_registering_again_replaces_and_warns_only_for_a_different_entry_point(coin, fresh_registry):
    mod = importlib.import_module(coin)
    envs.register("coin", entry_point=mod.CoinEnv)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envs.register("coin", entry_point=mod.CoinEnv)  # a re-run notebook cell: same class, silent
    with pytest.warns(RuntimeWarning, match=f"{coin}.CoinEnv; now {coin}.NoTasks replaces it"):
        envs.register("coin", entry_point=mod.NoTasks)
    assert isinstance(envs.make_env("coin"), mod.NoTasks)


def test_task_maker_errors(coin, fresh_registry):
    mod = importlib.import_module(coin)
    envs.register("silent", entry_point=mod.NoTasks)
    with pytest.raises(ValueError, match=r"environment 'silent' \('NoTasks'\) has no task maker"):
        envs.make_tasks("silent", 1, seed=0)
    envs.register("liar", entry_point=mod.NoTasks, tasks=mod.not_tasks)
    with pytest.raises(ValueError, match="the task maker 'not_tasks' returned str, not a list of Task"):
        envs.make_tasks("liar", 1, seed=0)
    envs.register("junk", entry_point=mod.NoTasks, tasks=lambda n, *, seed, split: [{"idx": 1}])
    with pytest.raises(ValueError, match="a task dict that is not Task fields"):
        envs.make_tasks("junk", 1, seed=0)
    with pytest.raises(ValueError, match="generates no tasks"):
        envs.make_tasks("skyrl_gym", 1, seed=0)


def test_unknown_names_list_what_exists(fresh_registry, coin):
    envs.register("coin", entry_point=importlib.import_module(coin).CoinEnv)
    with pytest.raises(ValueError, match=r"unknown environment 'chess'.*registered ones \['coin'\]"):
        envs.make_env("chess")
    with pytest.raises(LoadError, match="no module named 'chess_pkg_xyz'"):
        envs.make_env("chess_pkg_xyz:Board")


# -- entry points (group rljax.envs) --------------------------------------------------------------


def _distribution(root, name: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution ``name`` in ``root``: METADATA and entry_points.txt."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[rljax.envs]\n{lines}")


def test_an_installed_package_is_found_by_entry_point(tmp_path, monkeypatch, coin, fresh_registry):
    site = tmp_path / "site"
    _distribution(site, "coin_plugin", {"coin-flip": f"{coin}:CoinEnv", "arithmetic": f"{coin}:NoTasks"})
    monkeypatch.syspath_prepend(str(site))
    assert coin not in sys.modules
    assert "coin-flip" in str(pytest.raises(ValueError, envs.make_env, "chess").value)  # listed
    assert coin not in sys.modules  # found without importing the package
    env = envs.make_env("coin-flip", bonus=1.0)
    assert type(env).__name__ == "CoinEnv" and env.bonus == 1.0
    assert [t.data["value"] for t in envs.make_tasks("coin-flip", 2, seed=0, levels=2)] == [0.0, 0.5]
    assert isinstance(envs.make_env("arithmetic"), envs.ArithmeticEnv)  # built-in names win
    envs.register("coin-flip", entry_point=importlib.import_module(coin).NoTasks)  # a registration wins too
    assert type(envs.make_env("coin-flip")).__name__ == "NoTasks"

    # the config path: the id in config.envs.<name>.env
    registry._REGISTERED.clear()
    cfg = parse_run_config({"envs": {"flip": {"env": "coin-flip", "num_train_tasks": 3}}})
    et = build_env_tasks(cfg)
    assert type(et.factories["flip"]()).__name__ == "CoinEnv" and [t.env for t in et.train] == ["flip"] * 3


def test_broken_and_ambiguous_entry_points_name_their_source(tmp_path, monkeypatch, coin, fresh_registry):
    site = tmp_path / "site"
    _distribution(site, "broken_plugin", {"broken": "no_such_pkg_xyz.envs:Env"})
    _distribution(site, "first_plugin", {"twice": f"{coin}:CoinEnv"})
    _distribution(site, "second_plugin", {"twice": f"{coin}:NoTasks"})
    monkeypatch.syspath_prepend(str(site))
    cfg = parse_run_config({"envs": {"b": {"env": "broken"}}})
    with pytest.raises(LoadError) as e:
        build_env_tasks(cfg)
    msg = str(e.value)
    assert msg.startswith("config.envs.b.env: the entry point of environment 'broken' (from the entry point")
    assert "of distribution 'broken_plugin'" in msg and "no module named 'no_such_pkg_xyz'" in msg
    assert e.value.reason == "module"
    with pytest.raises(ValueError, match="declared by several installed entry points"):
        envs.make_env("twice")


# -- the config path ------------------------------------------------------------------------------


def test_config_env_and_tasks_as_import_strings(coin):
    cfg = parse_run_config(
        {
            "seed": 5,
            "envs": {
                "coin": {
                    "env": f"{coin}:CoinEnv",
                    "kwargs": {"bonus": 0.5},
                    "task_kwargs": {"levels": 8},
                    "num_train_tasks": 6,
                    "num_eval_tasks": 2,
                },
                "other": {"env": f"{coin}:make_env", "tasks": f"{coin}:other_tasks", "num_train_tasks": 2},
            },
        }
    )
    et = build_env_tasks(cfg)
    made = et.factories["coin"]()
    assert type(made).__name__ == "CoinEnv" and made.bonus == 0.5 and made is not et.factories["coin"]()
    assert [t.id for t in et.train] == [f"train-5-{i}" for i in range(6)] + ["other-train-0", "other-train-1"]
    assert [t.id for t in et.eval] == ["test-6-0", "test-6-1"]  # eval split seeded by seed + 1
    assert [t.env for t in et.train] == ["coin"] * 6 + ["other"] * 2
    assert {t.split for t in et.eval} == {"test"}
    assert importlib.import_module(coin).CALLS == [(6, 5, "train", 8), (2, 6, "test", 8)]


def test_config_mistakes_name_their_key(coin):
    def build(env, **section):
        return build_env_tasks(parse_run_config({"envs": {"myenv": {"env": env, **section}}}))

    cases = [
        (lambda: build("no_such_pkg_xyz.envs:Env"), r"^config.envs.myenv.env: cannot import .*no module"),
        (lambda: build(f"{coin}:CoinEnvv"), r"^config.envs.myenv.env: .* has no attribute 'CoinEnvv'"),
        (lambda: build(f"{coin}:LIMIT"), rf"^config.envs.myenv.env: '{coin}:LIMIT' is not callable"),
        (lambda: build(f"{coin}:NoTasks"), r"^config.envs.myenv.env: environment .* has no task maker"),
        (
            lambda: build(f"{coin}:NoTasks", tasks=f"{coin}:no_tasks"),
            r"^config.envs.myenv.tasks: .* has no attribute 'no_tasks'",
        ),
        (lambda: build(f"{coin}:CoinEnv", kwargs={"bonnus": 1}), r"^config.envs.myenv.kwargs: .*'bonnus'"),
        (
            lambda: build(f"{coin}:NoTasks", tasks=f"{coin}:not_tasks"),
            r"^config.envs.myenv: the task maker 'not_tasks' returned str",
        ),
        (
            lambda: build("verifiable", kwargs={"reward_fn": f"{coin}:scorer"}, dataset={"train": "x.jsonl"}),
            r"^config.envs.myenv.kwargs.reward_fn: cannot import .* has no attribute 'scorer'",
        ),
        (lambda: build("nosuch"), r"^config.envs.myenv.env: unknown environment 'nosuch'"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()


def test_parse_checks_the_form_without_importing():
    def parse(**section):
        return parse_run_config({"envs": {"myenv": section}})

    with pytest.raises(ValueError, match=r"^config.envs.myenv.env: expected an import string"):
        parse(env="my_pkg.envs:")
    with pytest.raises(ValueError, match=r"^config.envs.myenv.tasks: expected an import string"):
        parse(env="lookup", tasks="make_tasks")
    with pytest.raises(ValueError, match=r"^config.envs.myenv.tasks: tasks come from the dataset"):
        parse(env="lookup", tasks="m:f", dataset={"train": "rows.jsonl"})
    with pytest.raises(ValueError, match=r"^config.renderer.name: expected an import string"):
        parse_run_config({"renderer": {"name": "my_pkg:"}})
    # well-formed strings of absent modules parse (the code may live elsewhere, e.g. for an export)
    cfg = parse(env="absent_pkg_xyz.envs:Env", tasks="absent_pkg_xyz.envs:tasks")
    assert cfg.envs["myenv"].tasks == "absent_pkg_xyz.envs:tasks"
    assert parse(env="reasoning_gym:leg_counting").envs["myenv"].env == "reasoning_gym:leg_counting"


def test_dataset_reward_functions_are_imported_when_the_tasks_are_built(tmp_path, coin):
    rows = tmp_path / "rows.jsonl"
    row = {"prompt": [{"role": "user", "content": "2+2?"}], "data_source": "toy"}
    good = {"method": f"{coin}:other_tasks", "ground_truth": "4"}  # importable: that is all checked here
    rows.write_text("\n".join(json.dumps(row | {"reward_spec": spec}) for spec in (good, good)))
    section = {"env": "verifiable", "dataset": {"train": str(rows)}}
    assert len(build_env_tasks(parse_run_config({"envs": {"v": section}})).train) == 2
    bad = {"method": f"{coin}:scorre", "ground_truth": "4"}
    rows.write_text("\n".join(json.dumps(row | {"reward_spec": spec}) for spec in (good, bad)))
    with pytest.raises(ValueError, match=r"^config.envs.v.dataset: task .* reward_spec.method: cannot imp"):
        build_env_tasks(parse_run_config({"envs": {"v": section}}))


# -- renderers ------------------------------------------------------------------------------------

RENDERER = '''
from rljax.chat import ChatMLRenderer


class ShoutingRenderer(ChatMLRenderer):
    """ChatML with every user message upper-cased."""

    def render_with_roles(self, messages, **kw):
        loud = [dict(m, content=m["content"].upper()) if m["role"] == "user" else m for m in messages]
        return super().render_with_roles(loud, **kw)


def not_a_renderer(tokenizer):
    return "text"
'''


def test_renderer_by_import_string(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "shouting_renderer", RENDERER)
    tok = toy_tokenizer("chatml")
    r = make_renderer(f"{mod}:ShoutingRenderer", tok)
    msgs = [{"role": "user", "content": "hi"}]
    want = ChatMLRenderer(tok).render_ids([{"role": "user", "content": "HI"}], add_generation_prompt=True)
    assert r.render_ids(msgs, add_generation_prompt=True) == want
    with pytest.raises(ValueError, match="built str, not an rljax.chat.Renderer"):
        make_renderer(f"{mod}:not_a_renderer", tok)
    with pytest.raises(LoadError, match="has no attribute 'Shouting'"):
        make_renderer(f"{mod}:Shouting", tok)


def test_trainer_names_the_renderer_key(tmp_path):
    from recipes import load_recipe

    from rljax.run.trainer import Trainer

    c = load_recipe("smoke")
    c.renderer.name = "no_such_pkg_xyz.chat:Renderer"
    with pytest.raises(
        ValueError, match=r"^config.renderer.name: cannot import .*no module named 'no_such_pkg"
    ):
        Trainer(c, tmp_path)
