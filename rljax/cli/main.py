"""The ``rljax`` console script: ``rljax <subcommand> [flags]`` (see :mod:`rljax.cli`)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from absl import app

from rljax.cli.common import recipe_names, resolve_config_args
from rljax.extras import MissingExtraError

__all__ = ["SUBCOMMANDS", "main"]

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
    """Dispatches ``argv`` (default ``sys.argv``) to a subcommand's absl ``app.run``."""
    argv = list(sys.argv if argv is None else argv)
    args = argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage(), end="")
        return 0 if args else 2
    if args[0] in ("--version", "-V", "version"):
        from importlib.metadata import version

        print(f"rljax {version('rljax')}")  # the installed distribution's (rljax.__version__ is the same)
        return 0
    name = args[0]
    if name not in SUBCOMMANDS:
        print(f"rljax: unknown subcommand {name!r}\n\n{_usage()}", end="", file=sys.stderr)
        return 2
    try:
        sub_argv = resolve_config_args([f"rljax {name}", *args[1:]])
    except ValueError as e:
        print(f"rljax {name}: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, os.getcwd())  # config files may import helpers next to them
    # transformers' advisory lines ("PyTorch was not found ...") say nothing a user of rljax acts on:
    # rljax reads tokenizers and safetensors without torch. A user's own setting wins.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        module.define_flags()  # a subcommand's absl flags exist only in the process that runs it
        app.run(module.main, argv=sub_argv)
    except MissingExtraError as e:  # a front door without its pip extra: one line, no traceback
        print(f"rljax {name}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
