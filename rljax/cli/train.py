"""Launch an RL post-training run from an ml_collections config file.

    rljax train --config=default --workdir=/tmp/run
    rljax train --config=default --config.trainer.num_steps=5
    rljax train --config=default --workdir=/tmp/run --resume   # after a crash

``--config.<key>=<value>`` overrides any config entry (ml_collections ``config_flags``): an unknown key
or a value of the wrong type is an error naming the key. ``--resume`` continues from the latest
complete checkpoint in ``<workdir>/checkpoints`` (bit-for-bit on CPU; an error when there is none, and
when the config differs from the checkpoint's in a key that changes results, unless
``--allow_config_change``); without it an existing run in ``workdir`` is refused rather than
silently overwritten, unless ``--overwrite`` is given.

Nothing is touched before the whole config is checked (:func:`rljax.run.preflight.plan_run`): a
mistake in a flag or the config (an unknown key, a wrong type, a value out of range, a missing file
or recipe, a pip extra not installed) is one line on stderr and exit status 2, and ``--overwrite``
deletes the old run only after that. ``--dry-run`` prints the resolved config and the model,
algorithms, envs, engines and devices the run would build, and exits without creating the workdir::

    rljax train --config=smoke --dry-run

Several processes (hosts): start the same command once per process, with the same config and
``--workdir`` (a filesystem every host shares), adding ``--coordinator_address=HOST0:PORT
--num_processes=N --process_id=I`` (or ``--distributed`` alone where JAX detects them: SLURM,
Open MPI, Kubernetes / GKE, Cloud TPU); ``--cpu_collectives=gloo`` for CPU-only runs::

    rljax train --config=smoke --workdir=/tmp/run --config.mesh.data=8 \\
        --coordinator_address=127.0.0.1:12345 --num_processes=2 --process_id=0 --cpu_collectives=gloo &
    rljax train --config=smoke --workdir=/tmp/run --config.mesh.data=8 \\
        --coordinator_address=127.0.0.1:12345 --num_processes=2 --process_id=1 --cpu_collectives=gloo

Flags may be spelled with dashes or underscores (``--dry-run``, ``--dry_run``).
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile
import types
from typing import Any

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_FLAGS = types.SimpleNamespace()  # the flag holders, once define_flags() ran


def define_flags() -> None:
    """The subcommand's absl flags, defined only when it runs: importing this module (the docs,
    tests) must not claim flag names that other subcommands define in the same process."""
    _FLAGS.config = config_flags.DEFINE_config_file(
        "config",
        None,
        "An ml_collections config file, or the name of a shipped recipe (configs/).",
        lock_config=True,
    )
    _FLAGS.workdir = flags.DEFINE_string(
        "workdir", None, "Run directory (metrics, plots, checkpoints). Default: a new temporary directory."
    )
    _FLAGS.resume = flags.DEFINE_bool(
        "resume", False, "Resume from the latest complete checkpoint in --workdir."
    )
    _FLAGS.overwrite = flags.DEFINE_bool(
        "overwrite",
        False,
        "Delete an existing run in --workdir and start over (only once the new config is checked).",
    )
    _FLAGS.dry_run = flags.DEFINE_bool(
        "dry_run",
        False,
        "Check the config whole, print it resolved and what the run would build, and exit (no workdir).",
    )
    _FLAGS.distributed = flags.DEFINE_bool(
        "distributed",
        False,
        "Join a multi-process run, with the coordinator / process count / process id JAX detects "
        "(SLURM, Open MPI, Kubernetes, Cloud TPU) unless the flags below give them.",
    )
    _FLAGS.coordinator = flags.DEFINE_string(
        "coordinator_address", None, "host:port of process 0's coordination service (multi-process runs)."
    )
    _FLAGS.num_processes = flags.DEFINE_integer("num_processes", None, "Number of processes of the run.")
    _FLAGS.process_id = flags.DEFINE_integer(
        "process_id", None, "This process's index in [0, num_processes)."
    )
    _FLAGS.cpu_collectives = flags.DEFINE_enum(
        "cpu_collectives", "", ["", "gloo", "mpi"], "Collectives between processes on the CPU backend."
    )
    _FLAGS.heartbeat = flags.DEFINE_integer(
        "heartbeat_timeout_s",
        60,
        "Multi-process runs: seconds without a peer's heartbeat after which every other process exits "
        "with an error (the bound on how long a survivor of a dead peer keeps waiting).",
    )
    _FLAGS.allow_config_change = flags.DEFINE_bool(
        "allow_config_change",
        False,
        "With --resume: continue even though result-changing config keys differ from the checkpoint's.",
    )


def _distributed_asked() -> bool:
    """Whether the flags ask to join a multi-process run."""
    given = [f.value is not None for f in (_FLAGS.coordinator, _FLAGS.num_processes, _FLAGS.process_id)]
    return bool(_FLAGS.distributed.value or any(given))


def _initialize_distributed() -> bool:
    """Joins a multi-process run when the flags ask for one (before anything starts JAX's backends)."""
    if not _distributed_asked():
        return False
    from rljax.training import distributed

    try:
        config = distributed.DistributedConfig(
            coordinator_address=_FLAGS.coordinator.value,
            num_processes=_FLAGS.num_processes.value,
            process_id=_FLAGS.process_id.value,
            cpu_collectives=_FLAGS.cpu_collectives.value,
            heartbeat_timeout_s=_FLAGS.heartbeat.value,
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    return distributed.initialize(config)


def _check_workdir(workdir: str | None, *, resume: bool, overwrite: bool, multi_process: bool) -> None:
    """The flag rules of ``--workdir`` (nothing is created or deleted here)."""
    if workdir is None:
        if resume:
            raise app.UsageError("--resume needs --workdir (the directory of the run to resume)")
        if multi_process:
            raise app.UsageError("a multi-process run needs --workdir (a directory every process shares)")
        return
    path = pathlib.Path(workdir)
    if path.exists() and not path.is_dir():
        raise app.UsageError(f"--workdir={workdir} is a file, not a directory")
    existing = (path / "checkpoints").exists() or (path / "metrics.jsonl").exists()
    if existing and not (resume or overwrite):
        raise app.UsageError(
            f"{path} already holds a run; pass --resume to continue it or --overwrite to start over"
        )


def _prepare_workdir(workdir: str | None, *, resume: bool, multi_process: bool = False) -> pathlib.Path:
    """The run's directory, made: a new temporary one without ``--workdir``; an existing run in it is
    deleted unless ``resume`` (only called once the whole config is checked, so ``--overwrite`` never
    deletes a run for a config that does not start)."""
    if workdir is None:
        return pathlib.Path(tempfile.mkdtemp(prefix="rljax_run_"))
    path = pathlib.Path(workdir)
    existing = (path / "checkpoints").exists() or (path / "metrics.jsonl").exists()
    main_process = True
    if multi_process:
        import jax

        main_process = jax.process_index() == 0
    if existing and not resume and main_process:  # one process deletes; the others wait below
        shutil.rmtree(path)
    if main_process:
        path.mkdir(parents=True, exist_ok=True)
    if multi_process:
        from rljax.training.distributed import barrier

        barrier("rljax_workdir_ready", timeout_s=600)
        path.mkdir(parents=True, exist_ok=True)
    return path


def _plan(config: Any) -> Any:
    """The whole config checked (:func:`rljax.run.preflight.plan_run`) on the processes and devices this
    run gets: the trainer's GPUs and memory share are set, and a multi-process run joined, first
    (before JAX starts its backend)."""
    from rljax.run.config import parse_run_config
    from rljax.run.placement import place_trainer
    from rljax.run.preflight import plan_run

    try:
        cfg = parse_run_config(config)
        place_trainer(cfg.engine)
        _initialize_distributed()
        import jax

        return plan_run(
            cfg,
            process_count=jax.process_count(),
            device_count=jax.device_count(),
            resume_from=_FLAGS.workdir.value if _FLAGS.resume.value else None,
            allow_config_change=_FLAGS.allow_config_change.value,
        )
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e)) from None


def _interrupted_line(workdir: pathlib.Path) -> str:
    """What ``rljax train`` prints when interrupted: the checkpoint a ``--resume`` continues from."""
    from rljax.training.checkpoint import latest_step

    step = latest_step(workdir / "checkpoints")  # None without one (a missing directory included)
    if step is None:
        return f"interrupted: no checkpoint was written in {workdir}"
    return (
        f"interrupted: the latest checkpoint is step_{step} in {workdir / 'checkpoints'}; the same "
        "command with --resume continues from it"
    )


def main(argv: list[str]) -> None:
    """Runs ``rljax train`` with the parsed flags (``argv``: what absl left, the program name only).

    Order: the flags, then the whole config (:func:`_plan`), and only then the workdir (created, or
    with ``--overwrite`` an old run deleted) and the run; ``--dry-run`` stops before the workdir."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config.<key>=<value> for overrides")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every file it renames at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    config = _FLAGS.config.value
    if config is None:
        raise app.UsageError("--config=<recipe name or config file> is required (e.g. --config=default)")
    resume = _FLAGS.resume.value
    multi_process = _distributed_asked()
    _check_workdir(
        _FLAGS.workdir.value, resume=resume, overwrite=_FLAGS.overwrite.value, multi_process=multi_process
    )
    plan = _plan(config)
    if _FLAGS.dry_run.value:
        print(plan.describe(), flush=True)
        print("dry run: the config is valid; nothing was created, deleted or started", flush=True)
        return
    workdir = _prepare_workdir(_FLAGS.workdir.value, resume=resume, multi_process=multi_process)
    print(f"workdir: {workdir}", flush=True)
    from rljax.run.trainer import Trainer  # import after flag parsing (fast --help)

    trainer = Trainer(
        plan.config,
        workdir,
        resume=resume,
        allow_config_change=_FLAGS.allow_config_change.value,
        tasks=plan.tasks(),
    )
    try:
        history = trainer.run()
    except FileNotFoundError as e:  # --resume of a workdir without an intact checkpoint
        raise app.UsageError(str(e)) from None
    except KeyboardInterrupt:  # Ctrl-C: one line on what is kept, no traceback
        print(_interrupted_line(workdir), file=sys.stderr, flush=True)
        sys.exit(130)
    if history:
        last = history[-1]
        print(
            f"done: step {last['step']}, reward/mean {last.get('reward/mean', float('nan')):.4f}, "
            f"elapsed {last.get('time/elapsed_s', float('nan')):.1f}s; metrics in {workdir}",
            flush=True,
        )
