"""What the subcommands share (no absl flags here: each subcommand defines its own): the shipped
recipes, and ``--config=<recipe name>`` resolved to the recipe's file."""

from __future__ import annotations

import difflib
import pathlib
import re
import types
from collections.abc import Sequence
from typing import Any

from absl import flags

from rljax.recipes import CONFIGS_DIR

__all__ = [
    "EXIT_USAGE",
    "CommandLineError",
    "RECIPES_DIR",
    "config_overrides",
    "flag_error",
    "help_text",
    "one_line",
    "recipe_names",
    "recipe_path",
    "resolve_config_args",
    "underscored",
    "unknown_override",
]

#: The folder of the shipped recipes, ``configs/`` (``--config=<name>`` names a file in it).
RECIPES_DIR = CONFIGS_DIR


def recipe_names() -> list[str]:
    """The names of the recipes that ship with rljax (``configs/<name>.py``).

    >>> {"default", "smoke"} <= set(recipe_names())
    True
    """
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))


def recipe_path(name: str) -> pathlib.Path:
    """The file of the shipped recipe ``name``; a ``ValueError`` listing the recipes otherwise.

    >>> recipe_path("smoke").name
    'smoke.py'
    """
    path = RECIPES_DIR / f"{name}.py"
    if name.startswith("_") or not path.is_file():
        names = recipe_names()
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"no recipe named {name!r}; {hint}shipped recipes: {', '.join(names)}")
    return path


def _resolved(value: str) -> str:
    """A ``--config`` value with a recipe name replaced by its file (a path, with any ``:argument``
    suffix of ml_collections config files kept). A value naming an existing file is a path; one that
    looks like a path (a ``/``, a ``.py`` ending) must exist."""
    name, sep, arg = value.partition(":")
    if pathlib.Path(name).is_file():
        return value
    if "/" in name or name.endswith(".py") or pathlib.Path(name).exists():
        raise ValueError(f"--config={value}: no config file {name!r} (give a file or a recipe's name)")
    return str(recipe_path(name)) + sep + arg


def underscored(arg: str) -> str:
    """A ``--flag-name[=value]`` argument spelled the absl way (``--flag_name``); others as given.

    >>> underscored("--dry-run"), underscored("--metrics-out=a-b.json"), underscored("--config.a=x-y")
    ('--dry_run', '--metrics_out=a-b.json', '--config.a=x-y')
    """
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg[2:].partition("=")
    return arg if "." in name else f"--{name.replace('-', '_')}{eq}{value}"


def resolve_config_args(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--config=NAME`` / ``--config NAME`` naming a shipped recipe replaced by its path.

    >>> resolve_config_args(["rljax train", "--config=smoke", "--config.trainer.num_steps=2"])[1].endswith(
    ...     "configs/smoke.py")
    True
    >>> resolve_config_args(["x", "--config=no/such_file.py"])
    Traceback (most recent call last):
    ...
    ValueError: --config=no/such_file.py: no config file 'no/such_file.py' (give a file or a recipe's name)
    """
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + _resolved(arg.removeprefix("--config="))
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = _resolved(out[i + 1])
    return out


# ------------------------------------------------------------------------------------------------
# Running a subcommand: its absl flags, --help, and every command-line or config mistake as one line
# ------------------------------------------------------------------------------------------------

#: The exit status of a mistake in the command line or the config (nothing was run or touched).
EXIT_USAGE = 2
#: The arguments that print a subcommand's help (its docstring and its own flags).
HELP_ARGS = ("-h", "--help", "-?", "--helpshort")


class CommandLineError(Exception):
    """A mistake in a subcommand's flags or config: printed as one line, exit status 2."""


def one_line(message: object) -> str:
    """``message`` on one line (its lines joined with "; ").

    >>> one_line("a\\n  b\\n")
    'a; b'
    """
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def help_text(prog: str, module: types.ModuleType) -> str:
    """``prog``'s help: the subcommand module's docstring and its own flags (not absl's)."""
    doc = (module.__doc__ or "").strip()
    own = flags.FLAGS.module_help(module.__name__).strip()
    return f"usage: {prog} [flags]\n\n{doc}\n\nflags:\n{own}\n"


def config_overrides(argv: Sequence[str], name: str = "config") -> list[str]:
    """The key paths of ``--config.<path>=<value>`` (and ``--noconfig.<path>``) arguments.

    >>> config_overrides(["x", "--config=smoke", "--config.trainer.num_steps=2", "--noconfig.trainer.merge"])
    ['trainer.num_steps', 'trainer.merge']
    """
    pattern = re.compile(rf"^--?(?:no)?{re.escape(name)}\.([^=]+)")
    return [m.group(1) for m in map(pattern.match, argv) if m]


def unknown_override(config: Any, paths: Sequence[str]) -> str | None:
    """The one-line error of the first override path that names no key of ``config`` (None if all do).

    >>> from ml_collections import ConfigDict
    >>> c = ConfigDict({"trainer": {"num_steps": 1, "seq_len": 2}, "renderer": {"kwargs": {}}})
    >>> print(unknown_override(c, ["trainer.num_stepz"]))
    config.trainer.num_stepz: unknown key; did you mean 'num_steps'? known keys of config.trainer: [...]
    >>> unknown_override(c, ["renderer.kwargs.retention"])[:82]
    'config.renderer.kwargs.retention: config.renderer.kwargs holds no keys to override'
    >>> unknown_override(ConfigDict({"engine": {"kind": "vllm"}}), ["engine.stall_timeout_s"])
    'config.engine.stall_timeout_s: moved to config.engine.client.stall_timeout_s'
    >>> unknown_override(ConfigDict({"warmstart": {"optimizer": {}}}), ["warmstart.optimizer.lr"])[:80]
    "config.warmstart.optimizer.lr: unknown key; did you mean 'learning_rate'? known "
    """
    from rljax.run.config import did_you_mean, retired_key, section_keys

    for path in paths:
        node, parts = config, path.split(".")
        for i, key in enumerate(parts):
            keys = list(node.keys()) if hasattr(node, "keys") else None
            if keys is not None and key in keys:
                node = node[key]
                continue
            where = ".".join(["config", *parts[:i]])
            full = ".".join(["config", *parts])
            known = section_keys(".".join(parts[:i])) if keys is not None else None
            set_whole = f"set it whole, e.g. --{where}=\"{{'{key}': ...}}\""
            if keys == [] and known is None:
                return f"{full}: {where} holds no keys to override; {set_whole}"
            if known is not None and key in known:  # a mapping of the keys a config sets, not this one
                held = f"only {sorted(keys)}" if keys else "none of its keys"
                return f"{full}: {where} sets {held} here; {set_whole}"
            if keys is None:
                return f"{full}: {where} is {node!r}, not a section; set {where} whole"
            named = f"{where}.{key}"
            retired = retired_key(".".join(parts[: i + 1]))
            if retired is not None:
                return f"{named}: {retired}"
            names = known if known is not None else keys
            return f"{named}: unknown key; {did_you_mean(key, names)}known keys of {where}: {sorted(names)}"
    return None


#: absl flag types -> what a value of that type looks like (for "expected ..." messages).
_EXPECTED = {"int": "an int", "float": "a number", "bool": "True or False", "string": "a string"}


def flag_error(error: BaseException, argv: Sequence[str]) -> str:
    """The one-line message of an error absl or ml_collections raised while parsing ``argv``: an
    unknown flag, a flag or ``--config.<key>`` value of the wrong type, a ``--config.<key>`` the
    config lacks, or an error of the config file itself."""
    if isinstance(error, flags.UnrecognizedFlagError):
        names = [n for n in flags.FLAGS if len(n) > 1]
        close = difflib.get_close_matches(error.flagname, names, n=1)
        hint = f"did you mean --{close[0]}? " if close else ""
        return f"unknown flag --{error.flagname}; {hint}see --help for the flags"
    text = str(error)
    override = re.match(r"flag --(config\.[^=]+)=(.*?): (.*)", text, re.DOTALL)
    if isinstance(error, flags.IllegalFlagValueError) and override:  # its type is the config's
        key, value, why = override.groups()
        kind = flags.FLAGS[key].flag_type() if key in flags.FLAGS else ""
        return f"{key}: expected {_EXPECTED.get(kind, one_line(why))}, got {value!r}"
    if "Error whilst parsing config file" in text:  # ml_collections wraps the file's own error
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        files = [line.split(", in ")[0] for line in lines if line.startswith('File "')]
        own = [f for f in files if _config_file(argv) and f'File "{_config_file(argv)}"' in f]
        return f"--config: {lines[-1]}" + (f" ({(own or files)[-1]})" if files else "")
    if isinstance(error, flags.Error):
        return one_line(text)
    if isinstance(error, (AttributeError, KeyError)):  # an override of a key the config lacks
        try:
            unknown = unknown_override(_loaded_config(argv), config_overrides(argv))
        except Exception:  # the config file itself fails: report that below
            unknown = None
        if unknown:
            return unknown
    return f"--config: {_exception_line(error, _config_file(argv))}"


def _config_value(argv: Sequence[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (None if it is not given)."""
    args = list(argv)
    value = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if value is None and "--config" in args[:-1]:
        value = args[args.index("--config") + 1]
    return value


def _config_file(argv: Sequence[str]) -> str:
    value = _config_value(argv)
    return "" if value is None else str(pathlib.Path(value.partition(":")[0]).resolve())


def _loaded_config(argv: Sequence[str]) -> Any:
    """The config ``--config`` names, loaded as ml_collections loads it (no overrides applied)."""
    from ml_collections.config_flags.config_flags import ConfigFileFlagParser

    value = _config_value(argv)
    return ConfigFileFlagParser("config", lock_config=False).parse(value) if value else {}


def _exception_line(error: BaseException, config_file: str = "") -> str:
    """``Type: message (File "...", line N)``: the line of ``config_file`` the error passed through
    last (else the innermost frame)."""
    where = ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f'File "{error.filename}", line {error.lineno}'
    else:
        frames, tb = [], error.__traceback__
        while tb is not None:
            frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
            tb = tb.tb_next
        own = [f for f in frames if config_file and str(pathlib.Path(f[0]).resolve()) == config_file]
        if own or frames:
            where = 'File "{}", line {}'.format(*(own or frames)[-1])
    message = one_line(error.msg if isinstance(error, SyntaxError) else error)
    return f"{type(error).__name__}: {message}" + (f" ({where})" if where else "")
