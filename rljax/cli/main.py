"""The ``rljax`` console script: ``rljax <subcommand> [flags]`` (see :mod:`rljax.cli`)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import app, flags

from rljax.cli.common import (
    EXIT_USAGE,
    HELP_ARGS,
    CommandLineError,
    flag_error,
    help_text,
    one_line,
    recipe_names,
    resolve_config_args,
    underscored,
)
from rljax.extras import MissingExtraError

__all__ = ["SUBCOMMANDS", "main", "run_subcommand"]

#: The subcommands of ``rljax``: name -> (module, one-line help).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("rljax.cli.train", "run (or resume) RL post-training from a config"),
    "eval": ("rljax.cli.eval", "evaluate a checkpoint on the config's held-out tasks"),
    "serve": ("rljax.cli.serve", "serve the Tinker-compatible training API"),
    "view": ("rljax.cli.view", "write the static HTML report of a run"),
    "export": ("rljax.cli.export", "write a checkpoint's policy as a Hugging Face model directory"),
    "make-dataset": ("rljax.cli.make_dataset", "write generated task rows (parquet / jsonl) for training"),
}


def _usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return (
        "usage: rljax <subcommand> [flags]   (rljax <subcommand> --help for its flags)\n\n"
        "subcommands:\n" + "\n".join(lines) + "\n\n"
        f"--config takes a file or a shipped recipe: {', '.join(recipe_names())}\n"
        "rljax --version prints the version.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``rljax <subcommand> [flags]`` (``argv`` default ``sys.argv``); returns the exit status."""
    argv = list(sys.argv if argv is None else argv)
    args = argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage(), end="")
        return 0 if args else EXIT_USAGE
    if args[0] in ("--version", "-V", "version"):
        from importlib.metadata import version

        print(f"rljax {version('rljax')}")  # the installed distribution's (rljax.__version__ is the same)
        return 0
    if args[0] not in SUBCOMMANDS:
        print(f"rljax: unknown subcommand {args[0]!r}\n\n{_usage()}", end="", file=sys.stderr)
        return EXIT_USAGE
    return run_subcommand(args[0], args[1:])


def run_subcommand(name: str, args: Sequence[str]) -> int:
    """Runs subcommand ``name`` with its arguments ``args`` (``rljax <name> <args>`` and the scripts of
    ``launch/`` both come here); returns the exit status.

    The subcommand's absl flags exist while it runs (they are removed afterwards, so a process may run
    several); ``--help`` prints its docstring and its own flags. A mistake in the flags or the config
    (an unknown flag or key, a value of the wrong type or out of range, a missing file or recipe, a
    missing pip extra) is ONE line on stderr, ``rljax <name>: <what is wrong>``, and exit status 2;
    nothing was run or touched (``rljax train`` checks the whole config before its workdir).
    """
    prog = f"rljax {name}"
    try:
        end = args.index("--") if "--" in args else len(args)
        sub_argv = resolve_config_args([prog, *map(underscored, args[:end]), *args[end:]])
    except ValueError as e:
        print(f"{prog}: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # config files may import helpers next to them
    # transformers' advisory lines ("PyTorch was not found ...") say nothing a user of rljax acts on:
    # rljax reads tokenizers and safetensors without torch. A user's own setting wins.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    module = importlib.import_module(SUBCOMMANDS[name][0])
    with _subcommand_flags(module, sub_argv):
        if any(a in HELP_ARGS for a in sub_argv[1 : _end_of_flags(sub_argv)]):
            print(help_text(prog, module), end="")
            return 0
        try:
            app.run(_reporting(module.main), argv=sub_argv, flags_parser=_parse_flags)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except (CommandLineError, MissingExtraError) as e:
            print(f"{prog}: {one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
    return 0


def _end_of_flags(argv: Sequence[str]) -> int:
    return argv.index("--") if "--" in argv else len(argv)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (app.run's ``flags_parser``), every mistake a :class:`CommandLineError`."""
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # absl's and ml_collections' errors, and a config file's own
        raise CommandLineError(flag_error(e, argv)) from None


def _reporting(main_fn: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    """``main_fn`` with absl's usage errors as :class:`CommandLineError` (one line, not absl's usage)."""

    def run(argv: list[str]) -> Any:
        try:
            return main_fn(argv)
        except app.UsageError as e:
            raise CommandLineError(str(e)) from None

    return run


@contextlib.contextmanager
def _subcommand_flags(module: Any, argv: list[str]) -> Iterator[None]:
    """The subcommand's flags defined (and ``sys.argv`` = ``argv``: ml_collections reads the
    ``--config.<key>`` overrides there) while the block runs; afterwards both are as they were."""
    app.define_help_flags()  # absl's --helpfull etc., defined once per process
    before, saved_argv, was_parsed = set(flags.FLAGS), sys.argv, flags.FLAGS.is_parsed()
    sys.argv = list(argv)
    try:
        module.define_flags()
        yield
    finally:
        sys.argv = saved_argv
        for flag_name in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, flag_name)
        if not was_parsed:
            flags.FLAGS.unparse_flags()


if __name__ == "__main__":
    sys.exit(main())
