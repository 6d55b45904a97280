"""Checkpoint helpers shared by the launchers (no absl flags here: each launcher defines its own)."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

__all__ = ["resolve_checkpoint", "restore_params", "restore_policy", "stored_abstract"]

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


def stored_abstract(directory: pathlib.Path, step: int, item: str) -> Any:
    """``jax.ShapeDtypeStruct`` s with the structure of a stored array item (restored as host arrays)."""
    import jax
    import orbax.checkpoint as ocp

    path = directory / f"step_{step}" / item
    if not path.is_dir():
        return None
    meta = ocp.StandardCheckpointHandler().metadata(path)
    tree = meta.tree if hasattr(meta, "tree") else meta
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)


def restore_policy(trainer: Any, directory: pathlib.Path, step: int) -> Any:
    """The policy parameters of checkpoint ``step``, restored onto ``trainer.state.params``' structure,
    shardings and dtypes (a mismatch with the trainer's model is a ``ValueError``). The behaviour
    parameters and optimizer state saved beside them are read as host arrays and dropped."""
    return restore_params(trainer.state.params, directory, step)


def restore_params(
    template: Any, directory: pathlib.Path, step: int, *, item: str = "policy", missing_ok: bool = False
) -> Any:
    """The ``item`` parameters (default the policy) of checkpoint ``step`` restored onto ``template``
    (structure, shardings, dtypes); everything saved beside it (behaviour versions, a PPO critic, a
    LoRA run's base, optimizer state) is read as host arrays and dropped. ``missing_ok``: None when
    the checkpoint has no such item."""
    from rljax.train import checkpoint as ckpt

    stored = stored_abstract(directory, step, "params") or {}
    if item not in stored and missing_ok:
        return None
    restored = ckpt.restore(
        directory,
        params={**stored, item: template},
        opt_state=stored_abstract(directory, step, "opt_state"),
        step=step,
    )
    return restored.params[item]
