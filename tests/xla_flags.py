"""XLA flags of the test suite, for the tests' own process (``conftest.py``) and the processes they launch.

Most of the suite's time is XLA compiling small CPU programs, and most of a compilation is LLVM
optimizing the generated code. ``--xla_backend_optimization_level=0`` skips that (XLA's own HLO
passes, fusion included, still run, so the programs compute the same thing in the same order); the
tiny models then run somewhat slower, but compile far faster. Measured on the 2-core development
machine (load average 4-5): ``tests/train/test_train_step.py`` 58 -> 38 s,
``tests/models/test_models_moe.py`` 282 -> 228 s, two end-to-end learning tests 254 -> 183 s (each
pair run back to back, the file alone); the quick tier and the whole suite pass unchanged. The whole
suite's wall time did NOT measurably fall with it (37.0 min for 1,850 tests before, 37.4 min for
1,866 after, both on a quiet machine): programs compiled once are read back from the session's
compilation cache, and the slower code runs in every test. Benchmarks and user runs keep XLA's
default level.
"""

from __future__ import annotations

import os

#: LLVM's optimizations off for the generated CPU code (see the module docstring).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int = 1) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` fake CPU devices, compiling fast."""
    flags = [FAST_COMPILE]
    if devices != 1:
        flags.insert(0, f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def subprocess_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """The tests' environment for a launched Python process with ``devices`` CPU devices.

    Inherits everything else (the session's compilation cache among it) and adds ``extra``.
    """
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices), **extra}
