"""Test-wide settings: 8 fake CPU devices for sharding tests, float64 available for references; the
tiers of the suite (markers registered in setup.cfg, see README "Tests").

* ``vllm``: the test needs a real vLLM server; applied here to every test that uses the
  ``vllm_python`` fixture (directly or through a server fixture built on it);
* ``subprocess``: the test launches Python processes (marked in the test files);
* ``integration``: real servers, launched processes, end-to-end training; every ``vllm`` and
  ``subprocess`` test is one too (added here), so ``-m "not integration"`` leaves them all out;
* ``slow``: a unit test with large compiles (more than ~15 s on 2 CPU cores).

Quick development tier: ``python -m pytest tests -q -m "not integration and not slow"``.
"""

import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)  # shared helpers: tolerances, recipes, random_steps

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


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of vLLM's own venv; FAIL under CI=true when missing, else skip with the reason."""
    sys.path.insert(0, os.path.join(HERE, "inference"))
    from inference_helpers import require_vllm_python

    return require_vllm_python()


def pytest_collection_modifyitems(config, items):
    """Applies the tier markers that follow from what a test uses (see the module docstring)."""
    for item in items:
        if "vllm_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("vllm") or item.get_closest_marker("subprocess"):
            if not item.get_closest_marker("integration"):
                item.add_marker(pytest.mark.integration)
