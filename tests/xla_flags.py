"""XLA flags of the test suite, for the tests' own process (``conftest.py``) and the processes they launch.

Most of the suite's time is XLA compiling small CPU programs (measured with ``jax.monitoring``'s
compile events: 65-80% of an in-process test file), so the tests compile with three flags that make
compilation cheaper; XLA's HLO passes (fusion included) run as before, so the optimized programs are
the same and only their machine code differs:

* ``--xla_backend_optimization_level=0``: LLVM does not optimize the generated code.
* ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU emits its fusions with its older LLVM IR emitters
  instead of the MLIR fusion emitters, whose pipeline dominated small compilations (results agree
  within float rounding; the one bound this exposed, ``test_train_lora``'s micro-batch test, was
  under its own measured noise with any flags and was re-derived). Measured on
  the 2-core development machine (a tiny Qwen3 / Qwen3-MoE train step compiled from scratch: 1.1-2.8
  -> 0.3-0.5 s / 2.5-6.1 -> 0.7-1.0 s; 60 eager loops of small ops 17-41 -> 10-11 s, interleaved runs
  at load 2-5; ``python benchmarks/compile_bench.py`` on a quiet machine: 0.97 -> 0.37 s, 1.66 -> 0.79 s,
  17.2 -> 10.3 s): ``tests/train/test_tinker_api.py`` 166 -> 110 s (XLA backend compile 107 -> 48 s over
  the same 716 compilations), ``tests/train/test_train_moe.py`` 165 -> 131 s,
  ``tests/models/test_models_moe.py`` 143-169 -> 117 s; the quick tier 3.3 -> 2.5 min.
* ``--xla_cpu_parallel_codegen_split_count=1``: XLA:CPU emits a program's machine code as one LLVM
  module instead of splitting it into up to 32 parts compiled by a thread pool. The suite keeps both
  cores busy with four workers, so those threads only add their own overhead (measured on one core,
  AMD EPYC, 2026-12-07: a tiny Qwen3 / Qwen3-MoE train step 0.30 -> 0.16 s / 0.62 -> 0.42-0.47 s of
  CPU; ``test_train_micro_batch.py`` + ``test_train_critic.py`` whole-process 40.0 -> 36.6 CPU-s,
  median of 4 interleaved pairs, 0.85-0.97x; the real SmolLM2 tests at XLA's full optimization:
  unchanged, 116 CPU-s either way).

The tiny models then run somewhat slower, but every test compiles far faster. Benchmarks and user runs
keep XLA's defaults, and so do the tests that train or serve the real SmolLM2-135M
(:func:`optimized_compilation`, taken with ``tests/smollm2.py``'s real-model slot): there the slower
code costs more than the cheaper compilation saves.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

#: cheaper CPU compilation of the same optimized programs (see the module docstring).
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1"
)


#: XLA's own defaults for the two debug options of FAST_COMPILE that change the machine code (the
#: codegen split count only changes how it is compiled: measured neutral for the real model).
XLA_DEFAULT_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


@contextlib.contextmanager
def optimized_compilation() -> Iterator[None]:
    """Inside, this process compiles with XLA's default optimization, whatever ``XLA_FLAGS`` says.

    XLA reads ``XLA_FLAGS`` once per process, so the per-compilation overrides go in the way
    ``jax.jit(..., compiler_options=...)`` passes them (as ``env_options_overrides`` of jax's compile
    options; a test-only patch of that one function, undone on exit). Options a call sets itself win.
    The persistent compilation cache keys on the options, so such programs are cached apart.
    """
    from jax._src import compiler

    plain = compiler.get_compile_options

    @functools.wraps(plain)
    def with_defaults(*args, env_options_overrides=None, **kwargs):
        overrides = {**XLA_DEFAULT_OPTIONS, **(env_options_overrides or {})}
        return plain(*args, env_options_overrides=overrides, **kwargs)

    compiler.get_compile_options = with_defaults
    try:
        yield
    finally:
        compiler.get_compile_options = plain


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
