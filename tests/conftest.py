"""Test-wide settings: 8 fake CPU devices for sharding tests, float64 available for references."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # shared helpers: tolerances

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program and cached trace after each test module.

    One pytest process compiles thousands of XLA programs; each keeps code pages mapped (measured:
    about 3 memory mappings per small program; the kernel allows 65,530 per process) and memory held
    (~12 GiB resident late in the session). Kept for the whole session, XLA crashed in a later
    compile (SIGSEGV / SIGABRT in backend_compile_and_load at test ~1430, in CI and here; the test
    passes alone); with this fixture the session stays at 1-4k mappings and ~2 GiB and does not
    crash. Modules rarely share programs, so clearing costs little.
    """
    yield
    jax.clear_caches()
    gc.collect()
