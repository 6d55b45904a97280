"""The ``rljax`` command: one console script with a subcommand per front door.

    rljax train --config=default --workdir=/tmp/run          # an RL run (rljax.cli.train)
    rljax eval --config=reasoning_gym --checkpoint=/tmp/rg    # a checkpoint on held-out tasks
    rljax serve --config=tinker --port=8000                   # the Tinker-compatible training API
    rljax view --workdir=/tmp/run                             # the static HTML run report
    rljax export --checkpoint=/tmp/run --out=/tmp/hf          # a checkpoint as an HF directory
    rljax make-dataset --source=reasoning_gym:basic_arithmetic --num=100 --out=rows.parquet

``--config`` takes a file path or the name of a shipped recipe (``configs/``); each subcommand
keeps its absl flags (``rljax train --help`` lists them). A mistake in the flags or the config is one
line on stderr and exit status 2 (:func:`rljax.cli.main.run_subcommand`). ``python -m rljax`` and
the scripts of ``launch/`` (``python launch/train.py ...``) are the same command.
"""
