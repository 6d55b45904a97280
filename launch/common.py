"""What the launchers share (no absl flags here: each launcher defines its own): the checkpoint
path forms of ``--checkpoint``. Reading and restoring a checkpoint is the run object's
(:class:`rljax.train.run.Run`)."""

from __future__ import annotations

import os
import pathlib
import re

__all__ = ["resolve_checkpoint"]

_STEP_DIR = re.compile(r"step_(\d+)")


def resolve_checkpoint(path: str | os.PathLike, step: int | None = None) -> tuple[pathlib.Path, int]:
    """``(checkpoint directory, step)`` of a workdir, a checkpoint directory or a ``step_N`` directory.

    Raises ``FileNotFoundError`` when there is no complete checkpoint there (or not the asked step).
    """
    from rljax.train import checkpoint as ckpt

    p = pathlib.Path(path).absolute()
    match = _STEP_DIR.fullmatch(p.name)
    if match:
        if step is not None and step != int(match.group(1)):
            raise ValueError(f"--step={step} contradicts --checkpoint={p}")
        root, step = p.parent, int(match.group(1))
    else:
        root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        if step is None:
            step = ckpt.latest_step(root)
    if step is None or step not in ckpt.checkpoint_steps(root):
        what = "complete checkpoint" if step is None else f"complete step_{step}"
        raise FileNotFoundError(
            f"{p} holds no {what} (complete steps in {root}: {ckpt.checkpoint_steps(root)}); pass a run's "
            "workdir, its checkpoints/ directory or a checkpoints/step_N directory"
        )
    return root, step
