"""A multi-process run whose peer died: the survivor, waiting for it in a barrier, ends within
``stall_timeout_s`` (its watchdog), long before JAX's heartbeat timeout would end it.

Two real processes join with ``jax.distributed`` (heartbeat timeout 300 s, far beyond the test),
each starts a watchdog like the trainer's (stall timeout 10 s), pass a barrier, then process 1
SIGKILLs itself and process 0 waits for it at the next barrier."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest
from xla_flags import subprocess_env

from rljax.run.watchdog import EXIT_STALLED

pytestmark = pytest.mark.subprocess  # two jax.distributed processes

STALL_S = 10.0
PROCESS = """
import os, signal, sys, time
from rljax.training import distributed
from rljax.run.watchdog import Watchdog

pid, port = int(sys.argv[1]), sys.argv[2]
distributed.initialize(distributed.DistributedConfig(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid, heartbeat_timeout_s=300))
dog = Watchdog(%(stall)s, poll_s=0.5).start()
distributed.barrier("both_up", timeout_s=300)
dog.beat("both up")
if pid == 1:
    os.kill(os.getpid(), signal.SIGKILL)
print(f"waiting for the peer at {time.time():.3f}", flush=True)
distributed.barrier("never", timeout_s=3600)
print("not reached", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_survivor_of_a_dead_peer_ends_within_the_stall_timeout(tmp_path):
    script = tmp_path / "process.py"
    script.write_text(PROCESS % {"stall": STALL_S})
    port = str(free_port())
    env = subprocess_env(PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if not k.startswith("JAX_COORDINATOR")}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(i), port], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]  # fmt: skip
    try:
        out0, _ = procs[0].communicate(timeout=300)  # a hang guard only
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ended = time.time()
    assert procs[1].returncode == -9
    assert procs[0].returncode == EXIT_STALLED, out0[-3000:]
    waited_from = float(re.search(r"waiting for the peer at ([0-9.]+)", out0).group(1))
    idle = float(re.search(r"rljax watchdog: no progress for ([0-9.]+)s", out0).group(1))
    # the report prints the idle time to 0.1 s: a value just over STALL_S reads as STALL_S
    assert "not reached" not in out0 and idle >= STALL_S
    assert "in barrier" in out0  # the report shows where the survivor waited
    print(f"\nsurvivor ended {ended - waited_from:.1f}s after it began waiting for the dead peer")
