"""``rljax train`` as an absl launch script: the same flags, config, checks, errors and exit status.

    python launch/train.py --config=configs/smollm2_cpu.py --workdir=/tmp/smollm2

Run it from anywhere rljax is installed (``pip install .`` or ``pip install -e .``); ``--help``
lists the flags. The work is :mod:`rljax.cli.train`'s, through :func:`rljax.cli.main.run_subcommand`.
"""

import sys

from rljax.cli.main import run_subcommand

if __name__ == "__main__":
    sys.exit(run_subcommand("train", sys.argv[1:]))
