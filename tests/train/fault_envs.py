"""Environments that misbehave on purpose, for the fault tests of launched runs (``rljax train``
imports them by name: ``--config.envs.lookup.env=fault_envs:FlakyLookup``, with this directory on
``PYTHONPATH``).

Each is the built-in lookup task (:class:`rljax.envs.tool_lookup.ToolLookupEnv`) with faults drawn
from a hash of (task id, call), so a run misbehaves identically every time, whatever the timing.
"""

from __future__ import annotations

import hashlib
import os
import time

from rljax.envs.tool_lookup import ToolLookupEnv

#: Fraction of calls that hang, and the same fraction again that raise (FlakyLookup).
FAULT_RATE = 0.10
#: How long a hanging call sleeps: far past any deadline of the tests (an hour).
HANG_S = 3600.0


def _draw(*key: object) -> float:
    """A uniform number in [0, 1) fixed by ``key``."""
    digest = hashlib.sha256("\x00".join(map(str, key)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class FlakyLookup(ToolLookupEnv):
    """Lookup, except that FAULT_RATE of the calls (``reset`` and each ``step``) hang for an hour and
    FAULT_RATE raise. ``RLJAX_FAULT_ENV_LOG`` (a file) gets one ``<kind> <task id> <call>`` line per
    injected fault, so a test knows which episodes misbehaved."""

    def _maybe_fail(self, call: str) -> None:
        u = _draw(self._task_id, call)
        if u >= 2 * FAULT_RATE:
            return
        kind = "hang" if u < FAULT_RATE else "raise"
        log = os.environ.get("RLJAX_FAULT_ENV_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{kind} {self._task_id} {call}\n")
        if kind == "hang":
            time.sleep(HANG_S)
        raise RuntimeError(f"flaky env: injected failure in {call} of {self._task_id}")

    def reset(self, task):
        self._task_id, self._calls = task.id, 0
        self._maybe_fail("reset")
        return super().reset(task)

    def step(self, action):
        self._calls += 1
        self._maybe_fail(f"step{self._calls}")
        return super().step(action)


class HangingLookup(ToolLookupEnv):
    """Lookup whose first ``step`` call hangs for an hour (a run with no env deadline stalls)."""

    def step(self, action):
        time.sleep(HANG_S)
        return super().step(action)
