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

    One pytest process compiles thousands of XLA programs; each keeps code pages mapped (about 3
    memory mappings per small program, more for train steps) and memory held. Kept for the whole
    session they reached the kernel's limit of 65,530 mappings per process (vm.max_map_count) and
    ~12 GiB resident, and XLA crashed in a later compile (SIGSEGV / SIGABRT in
    backend_compile_and_load, at a different test depending on the order). Modules rarely share
    programs, so clearing costs little.
    """
    yield
    jax.clear_caches()
    gc.collect()
