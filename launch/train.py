"""Launch an RL post-training run from an ml_collections config file.

    python -m launch.train --config=configs/default.py --workdir=/tmp/run
    python -m launch.train --config=configs/default.py --config.trainer.num_steps=5
    python -m launch.train --config=configs/default.py --workdir=/tmp/run --resume   # after a crash

``--config.<key>=<value>`` overrides any config entry (ml_collections ``config_flags``): an unknown key
or a value of the wrong type is an error naming the key. ``--resume`` continues from the latest
complete checkpoint in ``<workdir>/checkpoints`` (bit-for-bit on CPU; an error when there is none, and
when the config differs from the checkpoint's in a key that changes results, unless
``--allow_config_change``); without it an existing run in ``workdir`` is refused rather than
silently overwritten, unless ``--overwrite`` is given.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to an ml_collections config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (metrics, plots, checkpoints). Default: a new temporary directory."
)
_RESUME = flags.DEFINE_bool("resume", False, "Resume from the latest complete checkpoint in --workdir.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Delete an existing run in --workdir and start over.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "With --resume: continue even though result-changing config keys differ from the checkpoint's.",
)


def _prepare_workdir(workdir: str | None, *, resume: bool, overwrite: bool) -> pathlib.Path:
    if workdir is None:
        if resume:
            raise app.UsageError("--resume needs --workdir (the directory of the run to resume)")
        return pathlib.Path(tempfile.mkdtemp(prefix="rljax_run_"))
    path = pathlib.Path(workdir)
    existing = (path / "checkpoints").exists() or (path / "metrics.jsonl").exists()
    if existing and not resume:
        if not overwrite:
            raise app.UsageError(
                f"{path} already holds a run; pass --resume to continue it or --overwrite to start over"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config.<key>=<value> for overrides")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every file it renames at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/<recipe>.py is required")
    workdir = _prepare_workdir(_WORKDIR.value, resume=_RESUME.value, overwrite=_OVERWRITE.value)
    print(f"workdir: {workdir}", flush=True)
    from rljax.train.trainer import Trainer  # import after flag parsing (fast --help)

    trainer = Trainer(config, workdir, resume=_RESUME.value, allow_config_change=_ALLOW_CONFIG_CHANGE.value)
    try:
        history = trainer.run()
    except FileNotFoundError as e:  # --resume of a workdir without a complete checkpoint
        raise app.UsageError(str(e)) from None
    if history:
        last = history[-1]
        print(
            f"done: step {last['step']}, reward/mean {last.get('reward/mean', float('nan')):.4f}, "
            f"elapsed {last.get('time/elapsed_s', float('nan')):.1f}s; metrics in {workdir}",
            flush=True,
        )


def run() -> None:
    """Console entry point."""
    sys.path.insert(0, os.getcwd())  # config files may import helpers next to them
    app.run(main)


if __name__ == "__main__":
    run()
