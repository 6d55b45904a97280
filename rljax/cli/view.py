"""The run report: a static, self-contained HTML page of a run's metrics and saved rollouts.

    rljax view --workdir=/tmp/rljax_default --out=report.html

Reads ``<workdir>/metrics.jsonl`` and ``<workdir>/rollouts/step_<S>.jsonl`` (written when the run
trained with ``config.trainer.save_rollouts_every=N``) and writes one HTML file with everything
inline (data, script, style): open it from the file system, no server needed. See
:mod:`rljax.report.html` for what the page shows.
"""

from __future__ import annotations

from absl import app, flags


def define_flags() -> None:
    """The subcommand's absl flags, defined only in the process that runs it (``rljax view``)."""
    flags.DEFINE_string("workdir", None, "The run's workdir (metrics.jsonl, rollouts/).")
    flags.DEFINE_string("out", None, "The HTML file to write (default: <workdir>/report.html).")
    flags.DEFINE_integer("max_trajectories", 64, "Most trajectories shown per saved step.")
    flags.DEFINE_list("steps", None, "Saved steps to include (default: all).")


def main(argv: list[str]) -> None:
    """Runs ``rljax view`` with the parsed flags: writes the run's HTML report (``argv`` is unused)."""
    import pathlib

    from rljax.report.html import write_report

    del argv
    f = flags.FLAGS
    if not f.workdir:
        raise app.UsageError("--workdir is required")
    workdir = pathlib.Path(f.workdir)
    if not workdir.is_dir():
        raise app.UsageError(f"--workdir {workdir} is not a directory")
    out = pathlib.Path(f.out) if f.out else workdir / "report.html"
    steps = None if f.steps is None else [int(s) for s in f.steps]
    path = write_report(workdir, out, max_trajectories=f.max_trajectories, steps=steps)
    print(f"report: {path} ({path.stat().st_size / 1024:.0f} KiB); open it in a browser")
