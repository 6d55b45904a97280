"""``rljax eval`` as an absl launch script: the same flags, config, checks, errors and exit status.

    python launch/eval.py --config=configs/smoke.py --checkpoint=/tmp/run

Run it from anywhere rljax is installed (``pip install .`` or ``pip install -e .``); ``--help``
lists the flags. The work is :mod:`rljax.cli.eval`'s, through :func:`rljax.cli.main.run_subcommand`.
"""

import sys

from rljax.cli.main import run_subcommand

if __name__ == "__main__":
    sys.exit(run_subcommand("eval", sys.argv[1:]))
