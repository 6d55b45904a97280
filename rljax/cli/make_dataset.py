"""Write a dataset file of SkyRL-format rows from a task generator (so users see and edit the format).

For example::

    rljax make-dataset --source reasoning_gym:leg_counting --num 512 --out data/legs.parquet
    rljax make-dataset --source reasoning_gym:basic_arithmetic --num 64 --split test \\
        --dataset_config='{"max_terms": 3}' --out data/arith_eval.jsonl
    rljax make-dataset --source reasoning_gym:mix --num 256 --out mix.parquet \\
        --dataset_config='{"datasets": {"leg_counting": 1, "basic_arithmetic": 2}}'

Each row: ``id``, ``data_source``, ``prompt`` (chat messages), ``env_class``, ``reward_spec``
``{method, ground_truth}``, ``extra_info`` (``--format verl`` writes ``reward_model{style,
ground_truth}`` instead of ``env_class``/``reward_spec``). The file type follows ``--out``
(.parquet, .jsonl, .json); :func:`rljax.envs.load_dataset_tasks` reads it back to the same tasks.
"""

from __future__ import annotations

import json
import sys
import types

from absl import app, flags

_FLAGS = types.SimpleNamespace()  # the flag holders, once define_flags() ran


def define_flags() -> None:
    """The subcommand's absl flags, defined only when it runs: importing this module (the docs,
    tests) must not claim flag names that other subcommands define in the same process."""
    _FLAGS.source = flags.DEFINE_string(
        "source", None, "Task source, e.g. reasoning_gym:<dataset> (or a built-in env)."
    )
    _FLAGS.num = flags.DEFINE_integer("num", None, "Number of rows.")
    _FLAGS.out = flags.DEFINE_string("out", None, "Output file (.parquet, .jsonl or .json).")
    _FLAGS.seed = flags.DEFINE_integer("seed", 0, "Generator seed.")
    _FLAGS.split = flags.DEFINE_enum("split", "train", ["train", "test"], "Which split's items to write.")
    _FLAGS.format = flags.DEFINE_enum("format", "skyrl", ["skyrl", "verl"], "Row format.")
    _FLAGS.config = flags.DEFINE_string(
        "dataset_config", "{}", "JSON object of keyword arguments for the generator."
    )


def make_rows(
    source: str, num: int, *, seed: int = 0, split: str = "train", row_format: str = "skyrl", **kwargs
):
    """The rows ``rljax make-dataset`` writes (a function, for notebooks and tests)."""
    from rljax.envs import make_tasks, task_to_row

    tasks = make_tasks(source, num, seed=seed, split=split, **kwargs)
    return [task_to_row(t, format=row_format) for t in tasks]


def main(argv: list[str]) -> None:
    """Runs ``rljax make-dataset`` with the parsed flags (``argv``: what absl left, the program name only)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    for flag in (_FLAGS.source, _FLAGS.num, _FLAGS.out):
        if flag.value is None:
            raise app.UsageError(f"--{flag.name} is required")
    try:
        kwargs = json.loads(_FLAGS.config.value)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--dataset_config is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise app.UsageError("--dataset_config must be a JSON object")
    from rljax.envs import write_rows

    rows = make_rows(
        _FLAGS.source.value,
        _FLAGS.num.value,
        seed=_FLAGS.seed.value,
        split=_FLAGS.split.value,
        row_format=_FLAGS.format.value,
        **kwargs,
    )
    path = write_rows(rows, _FLAGS.out.value)
    print(f"wrote {len(rows)} {_FLAGS.format.value} rows ({_FLAGS.split.value}) to {path}", file=sys.stderr)
