"""The run watchdog (rljax.run.watchdog): it fires when progress stops, not while beats come; its
report names the stuck threads, the asyncio tasks and the parts' state; in a real process it ends
the process with status 75, and its C-level backstop ends a process whose GIL is held forever."""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import sys
import threading
import time

import pytest

from rljax.run.config import parse_run_config
from rljax.run.watchdog import EXIT_STALLED, Watchdog, format_stacks
from rljax.run.worker import Worker


def _dog(timeout_s=0.3, **kw):
    fired, out = [], io.StringIO()
    dog = Watchdog(timeout_s, exit=fired.append, stream=out, poll_s=0.02, **kw)
    return dog, fired, out


def _wait(predicate, limit_s=30.0):
    """Polls until ``predicate()``; the limit only guards against a hang."""
    deadline = time.monotonic() + limit_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_beats_keep_it_quiet_and_silence_fires_it_once():
    dog, fired, out = _dog(0.3)
    dog.start()
    try:
        end = time.monotonic() + 1.0  # beats every 20 ms for over three timeouts
        while time.monotonic() < end:
            dog.beat("step 1: trained")
            time.sleep(0.02)
        assert fired == [] and dog.fired is None
        assert _wait(lambda: fired)
    finally:
        dog.stop()
    assert fired == [EXIT_STALLED] == [75]
    text = out.getvalue()
    idle = float(re.search(r"no progress for ([0-9.]+)s > trainer.stall_timeout_s=0.3", text).group(1))
    assert idle >= 0.3  # never before the timeout (how much later depends on the machine's load)
    assert "last progress: 'step 1: trained'" in text


def test_the_report_holds_parts_threads_and_asyncio_tasks(tmp_path):
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="rljax-env-step", daemon=True)
    stuck.start()
    worker = Worker("rollout-test")

    async def trajectory():
        await asyncio.sleep(60)

    async def start_one():
        asyncio.get_running_loop().create_task(trajectory(), name="trajectory lookup:7#1")

    worker.submit(start_one).result(timeout=30)

    def broken():
        raise KeyError("no engine")

    report = tmp_path / "logs" / "stall.txt"
    dog, fired, out = _dog(
        0.1,
        describe={"rollouts": lambda: {"rollout of step 3": "version 2, running"}, "engines": broken},
        loops={"rollout loop": worker.loop},
        report_path=report,
    )
    try:
        dog.start()
        assert _wait(lambda: fired)
    finally:
        dog.stop()
        release.set()
        worker.close()
    text = out.getvalue()
    assert report.read_text() == text
    assert "-- rollouts --\n  rollout of step 3: version 2, running" in text
    assert "-- engines --\n(unavailable: KeyError: 'no engine')" in text
    assert 'thread "rljax-env-step"' in text
    stuck_stack = text.split('thread "rljax-env-step"')[1].split("--- thread")[0]
    assert "in wait" in stuck_stack  # the stuck thread is shown where it waits (Event.wait)
    assert "asyncio task(s) of rollout loop" in text and "trajectory lookup:7#1" in text
    assert "await asyncio.sleep(60)" in text  # where the trajectory waits


def test_a_dead_peer_fires_at_once():
    dog, fired, out = _dog(3600.0, dead_peers=lambda: [1])
    try:
        dog.start()
        assert _wait(lambda: fired)
    finally:
        dog.stop()
    assert fired == [EXIT_STALLED] and "peer process(es) [1] died" in out.getvalue()


def test_an_unanswerable_peer_check_is_not_a_death():
    def fails():
        raise RuntimeError("coordination service gone")

    dog, fired, _ = _dog(3600.0, dead_peers=fails)
    dog.start()
    time.sleep(0.3)  # many polls
    dog.stop()
    assert fired == []


def test_format_stacks_names_threads():
    text = format_stacks()
    assert 'thread "MainThread"' in text and "test_format_stacks_names_threads" in text


@pytest.mark.parametrize("bad", [0, -1.0, True, "5"])
def test_timeout_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(bad)


def test_config_keys():
    t = parse_run_config({}).trainer
    assert (t.stall_timeout_s, t.on_save_error) == (1800.0, "stop")
    assert parse_run_config({"trainer": {"stall_timeout_s": 0}}).trainer.stall_timeout_s == 0
    with pytest.raises(ValueError, match="config.trainer.stall_timeout_s"):
        parse_run_config({"trainer": {"stall_timeout_s": -1.0}})
    with pytest.raises(ValueError, match="config.trainer.on_save_error"):
        parse_run_config({"trainer": {"on_save_error": "ignore"}})


_STALLS = """
import time
from rljax.run.watchdog import Watchdog
Watchdog({timeout}, poll_s=0.05, backstop_grace_s={grace}).start()
print("started", flush=True)
{hang}
print("not reached", flush=True)
"""


def _run_stalling(tmp_path, hang: str, *, timeout=1.0, grace=30.0):
    script = tmp_path / "stalls.py"  # a file, so that tracebacks show the source lines
    script.write_text(_STALLS.format(timeout=timeout, grace=grace, hang=hang))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess  # a real process ends
def test_a_stalled_process_exits_75_with_its_stacks(tmp_path):
    proc = _run_stalling(tmp_path, "time.sleep(3600)")
    assert proc.returncode == EXIT_STALLED, proc.stderr[-3000:]
    assert "started" in proc.stdout and "not reached" not in proc.stdout
    assert "rljax watchdog: no progress" in proc.stderr
    assert 'thread "MainThread"' in proc.stderr and "time.sleep(3600)" in proc.stderr


@pytest.mark.subprocess  # a real process ends
def test_the_backstop_ends_a_process_whose_gil_is_held(tmp_path):
    # ctypes.PyDLL calls keep the GIL: the watchdog thread cannot run, faulthandler's C thread can
    proc = _run_stalling(tmp_path, "import ctypes; ctypes.PyDLL(None).sleep(3600)", timeout=1.0, grace=1.0)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Timeout" in proc.stderr and "rljax watchdog" not in proc.stderr
    assert "not reached" not in proc.stdout


def test_no_usable_stderr_means_no_backstop_not_an_error(monkeypatch, caplog):
    monkeypatch.setattr(sys, "__stderr__", io.StringIO())  # no file descriptor (as under some captures)
    dog = Watchdog(3600.0)  # the real exit: the backstop would be armed if it could
    dog.start()
    dog.stop()
    assert dog.fired is None and "no faulthandler backstop" in caplog.text
