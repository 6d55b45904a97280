"""Each knob declared once (:mod:`rljax.knobs`), and nothing a user sees changed by it.

* every recipe resolves to the config it resolved to before the knobs moved onto their fields:
  ``data/recipe_records_0173738.json`` holds each recipe's ``config_record`` written by main at
  0173738 (the default recipe whole, the others as the keys they set or unset against it), and the
  defaults main's components used for the keys the recipes left out of the then-free dicts; the
  recorded values are checked against what the recipe files state (their literal assignments);
* a checkpoint's config recorded in that layout is read back as the same run;
* every declared range or set of values, in every section of the run config, refuses a value
  outside it with one line naming the key's path; unknown keys of the typed sections are refused
  with a "did you mean"; keys that moved or that the run sets say where to set them.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import pathlib
import typing

import pytest
from recipes import load_recipe

from rljax import knobs
from rljax.cli.common import recipe_names
from rljax.run.config import (
    DEFAULT_INIT,
    MOVED_KEYS,
    RunConfig,
    config_differences,
    config_record,
    parse_config_record,
    parse_run_config,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BEFORE = json.loads((pathlib.Path(__file__).parent / "data" / "recipe_records_0173738.json").read_text())
#: The recipes the records hold (recipes added later have no earlier layout to compare with).
RECORDED = sorted({"default", *BEFORE["recipes"]} & set(recipe_names()))
#: The free dicts of the earlier layout that are typed sections now (their keys: a component's fields).
TYPED_NOW = ("objective.off_policy", "engine.server", "engine.client", "model.init")
#: Keys added after the record, with the defaults every recipe resolves them to.
ADDED_KEYS = {"trainer.loss_only_logits": True, "trainer.eval_at_start": False}
#: Keys added since the record to a section that only LoRA recipes have, with their defaults.
ADDED_LORA_KEYS = {"lora.target_ranks": {}, "lora.target_alphas": {}, "lora.rslora": False}
#: Keys whose values are spelled differently since the record, on purpose: the embedded sampler's
#: prefix sharing takes the trainer's "auto" / "off" (the same idea on the sampler's side).
RESPELLED = {"engine.prefix_sharing": {True: "auto", False: "off"}}


@pytest.fixture(autouse=True)
def _model_cache(monkeypatch):
    monkeypatch.setenv("RLJAX_MODEL_CACHE", "/MODEL_CACHE")  # the smollm2 recipes' path, as recorded


def _json(value):
    """``value`` as the fixture holds it (tuples as lists)."""
    return json.loads(json.dumps(value))


def _flat(value, prefix=""):
    if isinstance(value, dict) and value:
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _unflat(flat):
    out = {}
    for key, value in flat.items():
        node, *parts = out, *key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = copy.deepcopy(value)
    return out


#: Keys recipes changed on purpose after the record, with their new values: the SmolLM2 recipes start
#: from ``smollm2_base`` now, whose warm-start values they inherit (their warm start stays off).
_SMOLLM2_BASE_WARMSTART = {
    "warmstart.log_every": 5,
    "warmstart.batch_size": 16,
    "warmstart.learning_rate": 3e-05,
    "warmstart.seq_len": 512,
}
_GONE = object()  # a key a recipe no longer sets
CHANGED_SINCE_RECORD = {
    # measured: rows of 128 two at a time are as fast as the whole step and hold 2.9 GiB less
    "smollm2_cpu": {**_SMOLLM2_BASE_WARMSTART, "trainer.micro_batch_tokens": 256},
    "smollm2_vllm": {**_SMOLLM2_BASE_WARMSTART, "trainer.micro_batch_tokens": 256},  # smollm2_cpu's
    # qwen35_gpu takes qwen3_gpu's off-policy setup (its TIS under dppo was refused at parse time)
    "qwen35_gpu": {
        "algorithm": _GONE,
        "algorithm.name": "grpo",
        "algorithm.policy_loss": "ppo_clip",
        "algorithm.policy_loss_kwargs.eps_low": 0.2,
        "algorithm.policy_loss_kwargs.eps_high": 0.28,
        "trainer.old_logprobs": "recompute",
    },
}


def _before(name):
    """The flattened config record of recipe ``name`` on main, with the changes made on purpose since."""
    flat = dict(BEFORE["default"])
    if name != "default":
        flat.update(BEFORE["recipes"][name]["set"])
        for key in BEFORE["recipes"][name]["unset"]:
            del flat[key]
    for key, value in CHANGED_SINCE_RECORD.get(name, {}).items():
        if value is _GONE:
            del flat[key]
        else:
            flat[key] = value
    return flat


def _now(name):
    return _json(_flat(config_record(parse_run_config(load_recipe(name)))))


def _expected_now(before):
    """The record ``before`` (earlier layout) as this layout writes it, built from the fixture alone:
    moved keys at their new paths, the launched server's dtype from ``engine.dtype``, and each
    formerly free dict of :data:`TYPED_NOW` whole (main's component defaults under its values)."""
    flat = dict(before)
    for old, new in MOVED_KEYS.items():
        flat[new] = flat.pop(old)
    served = flat["model.compute_dtype"] if flat["engine.dtype"] == "auto" else flat["engine.dtype"]
    assert flat.pop("engine.server.dtype", served) == served  # it only ever restated engine.dtype
    defaults = BEFORE["component_defaults"]
    for prefix in (*TYPED_NOW, "engine.supervisor"):
        given = {k: v for k, v in flat.items() if k.startswith(prefix + ".")}
        flat.pop(prefix, None)  # an empty dict was one leaf
        for key, value in defaults[prefix].items():
            if prefix == "engine.server" and key == "dtype":
                continue
            flat.setdefault(f"{prefix}.{key}", value)
        flat.update(given)
    for key, spellings in RESPELLED.items():
        flat[key] = spellings[flat[key]]
    lora = ADDED_LORA_KEYS if any(k.startswith("lora.") for k in flat) else {}
    return {**flat, **ADDED_KEYS, **lora}


@pytest.mark.parametrize("name", RECORDED)
def test_every_recipe_resolves_as_it_did_before(name):
    assert _now(name) == _expected_now(_before(name))


@pytest.mark.parametrize("name", RECORDED)
def test_a_checkpoint_config_of_the_earlier_layout_resumes(name):
    before = _unflat(_before(name))
    for typed in TYPED_NOW:  # as the earlier layout recorded a free dict nobody set: empty
        section, key = typed.split(".")
        if typed != "model.init" and not any(k.startswith(typed + ".") for k in _before(name)):
            before[section][key] = {}
    saved = parse_config_record(before)
    current = parse_run_config(load_recipe(name))
    assert config_differences(saved, current) == []
    assert _json(_flat(config_record(saved))) == _now(name)  # result-neutral keys too


# -- the fixture against what the recipe files state ---------------------------------------------


class _NotLiteral(Exception):
    pass


def _literal(node, names):
    """A recipe expression's value when it is a literal (``dict(...)`` and known local names too)."""
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dict"
        and not node.args
    ):
        return {k.arg: _literal(k.value, names) for k in node.keywords}
    if (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "config_dict.ConfigDict"
        and len(node.args) == 1
    ):
        return _literal(node.args[0], names)
    if isinstance(node, ast.Dict):
        return {_literal(k, names): _literal(v, names) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_literal(e, names) for e in node.elts]
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise _NotLiteral from None


def _stated(name):
    """The flattened keys a recipe file's ``get_config`` sets to literals (``c.x.y = v`` and
    ``c.x.update(y=v)``), the last statement winning."""
    tree = ast.parse((ROOT / "configs" / f"{name}.py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_config").body
    names, out = {}, {}
    for stmt in body:
        pairs = []
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = ast.unparse(stmt.targets[0])
            if target.startswith("c."):
                pairs = [(target[2:], stmt.value)]
            else:
                try:
                    names[target] = _literal(stmt.value, names)
                except _NotLiteral:
                    pass
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            func = ast.unparse(stmt.value.func)
            if func.startswith("c.") and func.endswith(".update"):
                section = func[2:].removesuffix(".update")
                pairs = [(f"{section}.{k.arg}", k.value) for k in stmt.value.keywords]
        for path, node in pairs:
            try:
                value = _literal(node, names)
            except _NotLiteral:
                continue
            out = {k: v for k, v in out.items() if not (k == path or k.startswith(path + "."))}
            out.update(_flat(value, path))
    return _json(out)


@pytest.mark.parametrize("name", RECORDED)
def test_the_recorded_configs_hold_what_the_recipe_files_state(name):
    stated = _stated(name)
    if name not in ("default", "tinker", "lora_vllm", "smollm2_vllm", "tinker_vllm"):
        assert len(stated) >= 2, stated  # the scan reads the file
    before, now = _before(name), _now(name)
    assert {k: before.get(k, "<unset>") for k in stated} == stated
    assert {k: now.get(k, "<unset>") for k in stated} == stated


# -- the declared constraints -----------------------------------------------------------------------


def _sections(cls=RunConfig, path="config"):
    """(path, class) of every dataclass section reachable from RunConfig (``envs`` and
    ``frozen_models`` by one name each)."""
    from rljax.inference.frozen import FrozenModelConfig
    from rljax.run.config import EnvSection

    yield path, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        spec = knobs.knob_of(f)
        if spec is not None and spec.fields_of is not None:  # model.init: ModelConfig's fields
            yield f"{path}.{f.name}", spec.fields_of
        elif spec is not None and spec.overrides_of is not None:  # e.g. warmstart.optimizer
            yield f"{path}.{f.name}", spec.overrides_of
        elif dataclasses.is_dataclass(inner[0]):
            yield from _sections(inner[0], f"{path}.{f.name}")
    if cls is RunConfig:
        yield "config.envs.lookup", EnvSection
        yield "config.frozen_models.teacher", FrozenModelConfig


def _bad_values(field, hint):
    """A value just outside each constraint the field declares, with the words of its error."""
    k = knobs.knob_of(field)
    if k is None:
        return []
    if k.choices is not None:
        return [("not-one-of-them", "expected one of")]
    is_int = int in (typing.get_args(hint) or (hint,))
    cast = int if is_int else float
    out = []
    for bound, delta in ((k.ge, -1), (k.gt, 0), (k.le, 1), (k.lt, 0)):
        if bound is not None:
            out.append((cast(bound + delta), "expected " + ("an int " if is_int else "a number ")))
    return out


def _constraint_cases():
    cases = []
    for path, cls in _sections():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            for value, words in _bad_values(field, hints[field.name]):
                if (path, field.name, value) == ("config.model.init", "vocab_size", 0):
                    value = -1  # model.init's vocab_size 0 is the tokenizer's size
                cases.append((f"{path}.{field.name}", value, words))
    return cases


CONSTRAINTS = _constraint_cases()


def _raw(key, value):
    """A raw config setting ``key`` (``config.a.b``) to ``value``; a key of ``model.init`` is set in
    the default recipe's ``init`` (a fresh model needs its shape whole), one of a frozen model next
    to its (required) ``base_url``."""
    raw = {}
    node, *parts = raw, *key.split(".")[1:]
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if parts[:-1] == ["model", "init"]:
        node.update(DEFAULT_INIT)
    if parts[0] == "frozen_models" and len(parts) == 3:
        node["base_url"] = "http://127.0.0.1:8001"
    node[parts[-1]] = value
    return raw


def test_the_sections_declare_their_constraints():
    keys = {key for key, _, _ in CONSTRAINTS}
    assert len(keys) > 60  # the run's own sections and the components it holds
    for key in ("trainer.seq_len", "engine.client.max_concurrency", "engine.server.port",
                "engine.supervisor.health_failures", "objective.off_policy.tis_ratio_type",
                "engine.trainer_memory_fraction", "trainer.prefix_sharing", "trainer.old_logprobs",
                "objective.kl_loss_coef", "objective.kl_estimator",
                "model.init.model_type", "model.init.partial_rotary_factor",
                "model.init.linear_num_value_heads", "rollout.top_p", "rollout.on_error",
                "optimizer.learning_rate", "optimizer.b2", "warmstart.corrupt_prob",
                "warmstart.optimizer.weight_decay", "critic.gamma", "critic.optimizer.eps",
                "lora.rank", "mesh.fsdp", "report.wandb.mode",
                "frozen_models.teacher.timeout_s"):  # fmt: skip
        assert f"config.{key}" in keys, key


@pytest.mark.parametrize("key, value, words", CONSTRAINTS, ids=[f"{k}={v!r}" for k, v, _ in CONSTRAINTS])
def test_a_value_outside_a_declared_constraint_is_one_line_naming_the_key(key, value, words):
    with pytest.raises(ValueError) as e:
        parse_run_config(_raw(key, value))
    message = str(e.value)
    assert message.startswith(f"{key}: {words}") and message.endswith(f"got {value!r}"), message
    assert "\n" not in message


INIT = DEFAULT_INIT


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("engine.server.port", 70000, "expected an int in [1, 65535] or None, got 70000"),
        ("engine.client.stall_timeout_s", 0.0, "expected a number > 0 or None, got 0.0"),
        ("engine.trainer_memory_fraction", 1.0, "expected a number in [0, 1), got 1.0"),
        ("objective.off_policy.tis_ratio_type", "tokens",
         "expected one of [None, 'token', 'sequence'], got 'tokens'"),
        ("objective.off_policy.geo_mask_low", 1.5,
         "off-policy correction needs geo_mask_low <= geo_mask_high"),
        ("engine.client.max_retries", "3", "expected an int, got '3'"),
        ("model.init.num_heads", "2", "expected an int, got '2'"),
        ("model.init", {**INIT, "num_kv_heads": 3}, "num_heads (2) must be a multiple of num_kv_heads (3)"),
        ("model.init", {"model_type": "qwen3"},
         "a fresh model (no hf_path) needs ModelConfig's ['hidden_size'"),
    ],
)  # fmt: skip
def test_typed_sections_refuse_bad_values_with_the_key_path(key, value, says):
    with pytest.raises(ValueError) as e:
        parse_run_config(_raw(f"config.{key}", value))
    message = str(e.value)
    assert message.startswith(f"config.{key}: {says}") and "\n" not in message, message


def test_optional_values_and_allowed_none_are_accepted():
    cfg = parse_run_config(
        {
            "engine": {
                "server": {"gpu_memory_utilization": None, "port": 8000},
                "client": {"stall_timeout_s": None},
            },
            "objective": {"off_policy": {"tis_ratio_type": "token", "max_token_staleness": 0}},
            "model": {"init": {**DEFAULT_INIT, "rope_theta": 5e5}, "hf_path": ""},
        }
    )
    assert cfg.engine.client.stall_timeout_s is None and cfg.engine.server.port == 8000
    assert cfg.objective.off_policy.tis_ratio_type == "token" and cfg.model.init["rope_theta"] == 5e5
    # a checkpoint's model ignores init: an incomplete one is fine with hf_path
    assert (
        parse_run_config({"model": {"hf_path": "/m", "init": {"model_type": "llama"}}}).model.hf_path == "/m"
    )


@pytest.mark.parametrize(
    "section, typo, close",
    [
        ("engine.client", "timeot_s", "timeout_s"),
        ("engine.server", "max_num_seq", "max_num_seqs"),
        ("engine.supervisor", "health_intervall_s", "health_interval_s"),
        ("objective.off_policy", "tis_ratio", "tis_ratio_type"),
        ("model.init", "hidden_sise", "hidden_size"),
        ("rollout", "group_sise", "group_size"),
        ("optimizer", "lr", "learning_rate"),
        ("warmstart.optimizer", "lr", "learning_rate"),
        ("critic.optimizer", "weight_decy", "weight_decay"),
        ("mesh", "fsdb", "fsdp"),
        ("report.wandb", "projet", "project"),
        ("frozen_models.teacher", "timout_s", "timeout_s"),
    ],
)
def test_unknown_keys_of_the_typed_sections_are_refused_with_did_you_mean(section, typo, close):
    with pytest.raises(ValueError) as e:
        parse_run_config(_raw(f"config.{section}.{typo}", 1))
    assert str(e.value).startswith(
        f"config.{section}.{typo}: unknown key; did you mean {close!r}? known keys of config.{section}: ["
    ), str(e.value)


@pytest.mark.parametrize(
    "key, says",
    [
        ("engine.health_failures", "moved to config.engine.supervisor.health_failures"),
        ("engine.stall_timeout_s", "moved to config.engine.client.stall_timeout_s"),
        ("engine.server.dtype", "set by the run; use config.engine.dtype"),
        ("engine.server.model", "set by the run (the policy's weights)"),
        ("model.init.extra_json", "read from a checkpoint's config.json (model.hf_path)"),
        ("rollout.algorithm", "set by the run; use config.algorithm"),
    ],
)
def test_keys_that_moved_or_that_the_run_sets_say_where_to_set_them(key, says):
    with pytest.raises(ValueError) as e:
        parse_run_config(_raw(f"config.{key}", "x"))
    assert str(e.value) == f"config.{key}: {says}"


def test_a_recorded_config_of_the_earlier_layout_reads_its_moved_keys():
    engine = {"stall_timeout_s": 30.0, "max_restarts": 0, "client": {"timeout_s": 9.0}}
    engine["server"] = {"dtype": "float32"}  # what engine.dtype ("auto": model.compute_dtype) serves
    saved = parse_config_record({"engine": engine})
    assert (saved.engine.client.stall_timeout_s, saved.engine.client.timeout_s) == (30.0, 9.0)
    assert saved.engine.supervisor.max_restarts == 0
    engine["server"]["dtype"] = "bfloat16"  # not what engine.dtype ("auto": float32) serves
    with pytest.raises(ValueError, match="config.engine.server.dtype: set by the run"):
        parse_config_record({"engine": engine})


def test_numpy_scalars_are_numbers_and_an_int_knob_refuses_a_float():
    import numpy as np

    from rljax.models import ModelConfig

    shape = dict(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_heads=2,
                 num_kv_heads=1, head_dim=4)  # fmt: skip
    cfg = ModelConfig(**shape, num_layers=np.int64(2), rms_norm_eps=np.float32(1e-5))  # e.g. read from a file
    assert (cfg.num_layers, cfg.rms_norm_eps) == (2, np.float32(1e-5))
    with pytest.raises(ValueError, match=r"^ModelConfig.num_layers: expected an int >= 1, got 2.0$"):
        ModelConfig(**shape, num_layers=2.0)


# -- the component sections: overrides of another section's fields, frozen models, old spellings --


@pytest.mark.parametrize("key", ["learning_rate", "schedule", "warmup_steps", "total_steps"])
def test_the_warm_start_refuses_overrides_of_what_it_sets_itself(key):
    # the warm start passes its own learning rate and a constant schedule next to these overrides: an
    # override of one of them was accepted here and then failed inside the warm start (a repeated
    # keyword argument of the optimizer's config)
    value = {"learning_rate": 1e-3, "schedule": "constant", "warmup_steps": 1, "total_steps": 10}[key]
    with pytest.raises(ValueError) as e:
        parse_run_config({"warmstart": {"optimizer": {key: value}}})
    assert str(e.value).startswith(f"config.warmstart.optimizer.{key}: "), str(e.value)
    if key == "learning_rate":
        assert str(e.value).endswith("use warmstart.learning_rate")
    # the critic's optimizer takes every field (its learning_rate too); each value is checked
    cfg = parse_run_config({"critic": {"optimizer": {key: value}, "learning_rate": None}})
    assert cfg.critic.optimizer == {key: value}


def test_overrides_of_the_optimizer_are_typed_and_combined_with_the_run_optimizer():
    cfg = parse_run_config({"warmstart": {"optimizer": {"weight_decay": 0, "max_grad_norm": None}}})
    assert cfg.warmstart.optimizer == {"weight_decay": 0.0, "max_grad_norm": None}
    assert isinstance(cfg.warmstart.optimizer["weight_decay"], float)
    # a rule between fields of the combination: cosine over the run's total_steps=None
    with pytest.raises(ValueError, match=r"^config.critic.optimizer: OptimizerConfig.total_steps: schedule"):
        parse_run_config({"critic": {"optimizer": {"schedule": "cosine"}}})


@pytest.mark.parametrize(
    "entry, says",
    [
        ({"model": "m"}, "config.frozen_models.teacher.base_url: required"),
        ({"base_url": "ftp://h:1"}, "config.frozen_models.teacher.base_url: frozen model base_url"),
        ({"base_url": 8001}, "config.frozen_models.teacher.base_url: expected a string or a list or tuple"),
        ({"base_url": "http://h:1", "max_retries": -1},
         "config.frozen_models.teacher.max_retries: expected an int >= 0, got -1"),
        ({"base_url": "http://h:1", "name": "other"}, "config.frozen_models.teacher.name: set by the run"),
        ("http://h:1", "config.frozen_models.teacher: expected a mapping of FrozenModelConfig fields"),
    ],
)  # fmt: skip
def test_a_frozen_model_mistake_names_its_key(entry, says):
    with pytest.raises(ValueError) as e:
        parse_run_config({"frozen_models": {"teacher": entry}})
    assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def test_frozen_models_are_kept_as_given_and_take_the_client_defaults():
    from rljax.inference.frozen import FrozenModelConfig, frozen_models_from_config
    from rljax.inference.vllm.client import ClientConfig

    entry = {"base_url": "http://h:1/v1", "name": "teacher", "max_concurrency": 4}
    cfg = parse_run_config({"frozen_models": {"teacher": entry}})
    assert cfg.frozen_models == {"teacher": entry}
    built = frozen_models_from_config(cfg.frozen_models)["teacher"]
    assert built.base_url == ("http://h:1",) and built.max_concurrency == 4
    client = ClientConfig()
    for name in ("timeout_s", "connect_timeout_s", "max_retries", "backoff_s", "backoff_max_s", "cooldown_s"):
        assert (
            getattr(built, name)
            == getattr(client, name)
            == getattr(FrozenModelConfig("t", "http://h:1"), name)
        )


def test_engine_prefix_sharing_takes_the_trainers_values_and_its_old_bools():
    from rljax.run.config import default_config

    assert parse_run_config({}).engine.prefix_sharing == "auto"
    assert parse_run_config({"engine": {"prefix_sharing": False}}).engine.prefix_sharing == "off"
    assert parse_run_config({"engine": {"prefix_sharing": True}}).engine.prefix_sharing == "auto"
    c = default_config()  # a config file of the earlier layout assigns a bool
    c.engine.prefix_sharing = False
    assert parse_run_config(c).engine.prefix_sharing == "off"
    with pytest.raises(ValueError, match=r"^config.engine.prefix_sharing: expected one of \['auto', 'off'\]"):
        parse_run_config({"engine": {"prefix_sharing": "on"}})
    with pytest.raises(ValueError, match=r"^config.engine.prefix_sharing: expected a string, got 1$"):
        parse_run_config({"engine": {"prefix_sharing": 1}})  # only the bools are old spellings
