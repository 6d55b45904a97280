"""The run: its typed config (:mod:`rljax.run.config`), the run object (:mod:`rljax.run.run`), the
trainer loop (:mod:`rljax.run.trainer`), the rollout scheduler, engines, tasks and reports, and the
library side of ``rljax eval`` / ``rljax export`` (:mod:`rljax.run.evaluate`, :mod:`rljax.run.export`)."""
