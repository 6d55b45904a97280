"""The run watchdog: a run whose step stops making progress ends itself, loudly, so it can be restarted.

A hang is the worst failure of a long run: nothing is logged, no scheduler restarts it, and the
accelerators sit idle until someone looks. The trainer therefore calls :meth:`Watchdog.beat` as
each step makes progress (rollout received, trained, weights synced, checkpoint saved). A
background thread checks the time since the last beat; when it exceeds ``trainer.stall_timeout_s``
the watchdog

1. writes a stall report to stderr and to ``<workdir>/logs/stall_<pid>.txt``: why it fired, the
   last progress it saw and how long ago, every thread's Python stack (``sys._current_frames``,
   with thread names: an env call stuck in ``rljax-env`` threads, the rollout loop, the main
   thread in a collective), the stack of every asyncio task of the rollout loop (each in-flight
   trajectory: waiting on its env, its agent or the engine), and the state of each part it was
   given (engines and their served weight version, pending rollouts and their age, envs);
2. runs the exit hooks it was given (bounded by a few seconds each; a hook that hangs is skipped);
3. ends the process with :data:`EXIT_STALLED` (75, ``EX_TEMPFAIL``: "try again"), without
   Python's shutdown (which could wait on the very thread that hangs), so a scheduler restarts it
   with ``--resume`` from the newest intact checkpoint.

The watchdog thread needs the GIL. A thread that holds it forever (a C extension stuck without
releasing it) would silence the watchdog too, so the thread also keeps :mod:`faulthandler`'s
C-level timer armed at ``stall_timeout_s + grace``: if the Python check cannot run, that timer
dumps every thread's stack and exits the process (status 1) without the GIL.

Multi-process runs: a peer that dies leaves the survivors in a collective or barrier, which is
no progress, so each survivor's watchdog ends it within ``stall_timeout_s`` (JAX's own heartbeat
check, ``--heartbeat_timeout_s``, may end it sooner). The watchdog does not ask the coordination
service which peers live: its ``get_live_nodes`` is itself a blocking collective (it returns once
every live process asked, i.e. not before the heartbeat timeout declared the dead one dead), so
it would hang the very thread meant to notice hangs. ``dead_peers`` takes a non-blocking check
where a runtime has one.

Reference: the watchdogs of large training stacks (e.g. torch elastic's timer server, Megatron's
"straggler" and hang detectors) follow the same pattern: heartbeat, dump stacks, exit non-zero,
restart from the checkpoint.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import os
import pathlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

__all__ = ["EXIT_STALLED", "Watchdog", "format_stacks", "trainer_watchdog"]

logger = logging.getLogger(__name__)

#: Exit status of a process the watchdog ended (``EX_TEMPFAIL`` of sysexits.h: retry later).
EXIT_STALLED = 75
#: Extra seconds the C-level :mod:`faulthandler` backstop waits beyond the stall timeout.
_BACKSTOP_GRACE_S = 30.0
#: Seconds each exit hook may take before the watchdog gives up on it.
_HOOK_TIMEOUT_S = 5.0


def format_stacks(loops: Mapping[str, asyncio.AbstractEventLoop] | None = None) -> str:
    """Every thread's Python stack (named), then each asyncio task's stack of each loop in ``loops``.

    Read while the threads run on (a snapshot, not a stop-the-world dump): good enough to see where
    each one waits, which is what a hang report needs.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    out = io.StringIO()
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: names.get(item[0], "")):
        daemon = next((t.daemon for t in threading.enumerate() if t.ident == ident), None)
        out.write(f'\n--- thread "{names.get(ident, "?")}" (id {ident}{", daemon" if daemon else ""}) ---\n')
        out.write("".join(traceback.format_stack(frame)))
    for name, loop in (loops or {}).items():
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError as e:  # the set changed while read from this thread: report, do not die
            out.write(f"\n--- asyncio tasks of {name}: unreadable ({e}) ---\n")
            continue
        out.write(f"\n--- {len(tasks)} asyncio task(s) of {name} ---\n")
        for task in tasks:
            try:
                chain = _await_chain(task.get_coro())
            except Exception as e:  # noqa: BLE001 - a diagnostic must not fail the report
                chain = f"  (stack unreadable: {e})\n"
            out.write(f"task {task.get_name()!r}, awaiting (outermost first):\n{chain}")
    return out.getvalue()


def _await_chain(coro: Any, limit: int = 32) -> str:
    """Where a suspended coroutine waits: its frame, then that of the coroutine it awaits, and so on
    (``Task.print_stack`` shows only the outermost frame of a suspended task)."""
    frames = []
    while coro is not None and len(frames) < limit:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append((frame, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "".join(traceback.format_list(traceback.StackSummary.extract(frames)))


class Watchdog:
    """Ends the process when no :meth:`beat` came for ``timeout_s`` seconds (see the module docstring).

    Args:
      timeout_s: seconds without progress after which the process ends (> 0).
      report_path: file the stall report is also written to (its directory is created).
      describe: ``{part name: zero-argument callable}`` returning the part's state as text or a
        dict (engines, rollouts, envs); each is called only when the watchdog fires, and one that
        raises is reported as such.
      loops: ``{name: event loop}`` whose asyncio tasks are listed with their stacks.
      dead_peers: zero-argument callable returning the process ids of dead peers (multi-process
        runs); a non-empty answer fires the watchdog at once. It must not block (it runs on the
        watchdog's thread); one that raises counts as "unknown".
      on_exit: callables run (each under a few seconds) before the process ends.
      poll_s: seconds between checks (default: ``min(timeout_s / 4, 5)``).
      backstop_grace_s: seconds past ``timeout_s`` after which the C-level backstop ends a process
        whose watchdog thread could not run (see the module docstring).
      exit: ends the process with a status (default ``os._exit``); tests pass a recorder.
      stream: where the report is printed (default ``sys.stderr``).

    >>> fired = []
    >>> dog = Watchdog(0.2, exit=fired.append, stream=io.StringIO(), poll_s=0.02)
    >>> _ = dog.start(); time.sleep(0.5); dog.stop()
    >>> fired
    [75]
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        report_path: str | os.PathLike | None = None,
        describe: Mapping[str, Callable[[], Any]] | None = None,
        loops: Mapping[str, asyncio.AbstractEventLoop] | None = None,
        dead_peers: Callable[[], Sequence[int]] | None = None,
        on_exit: Sequence[Callable[[], Any]] = (),
        poll_s: float | None = None,
        backstop_grace_s: float = _BACKSTOP_GRACE_S,
        exit: Callable[[int], Any] = os._exit,  # noqa: A002 - the process exit it calls
        stream: TextIO | None = None,
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.report_path = None if report_path is None else pathlib.Path(report_path)
        self.describe = dict(describe or {})
        self.loops = dict(loops or {})
        self.dead_peers = dead_peers
        self.on_exit = list(on_exit)
        self.poll_s = min(self.timeout_s / 4, 5.0) if poll_s is None else float(poll_s)
        self.backstop_grace_s = float(backstop_grace_s)
        self._exit = exit
        self._stream = stream
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._phase = "started"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop = False
        self._backstop_failed = False
        self.fired: str | None = None  # the reason, once it fired

    # -- progress ------------------------------------------------------------------------------------
    def beat(self, phase: str) -> None:
        """Records progress (``phase`` says which, e.g. ``"step 3: trained"``); cheap, any thread."""
        with self._lock:
            self._last = time.monotonic()
            self._phase = phase

    def last_beat(self) -> tuple[str, float]:
        """``(phase, seconds since)`` of the newest beat."""
        with self._lock:
            return self._phase, time.monotonic() - self._last

    # -- the thread ----------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Starts the watching thread (a daemon) and the faulthandler backstop; returns ``self``."""
        if self._thread is not None:
            raise RuntimeError("the watchdog was already started")
        self.beat("started")
        self._arm_backstop(self.timeout_s + self.backstop_grace_s)
        self._thread = threading.Thread(target=self._watch, name="rljax-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (the run ended or is being shut down on purpose)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 5)
        self._disarm_backstop()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            phase, idle = self.last_beat()
            self._arm_backstop(self.timeout_s - idle + self.backstop_grace_s)
            dead = self._dead_peers()
            if dead:
                self._fire(f"peer process(es) {sorted(dead)} died (the dead-peer check reported them)")
                return
            if idle > self.timeout_s:
                self._fire(f"no progress for {idle:.1f}s > trainer.stall_timeout_s={self.timeout_s:g}")
                return

    def _dead_peers(self) -> list[int]:
        if self.dead_peers is None:
            return []
        try:
            return list(self.dead_peers())
        except Exception as e:  # noqa: BLE001 - an unanswerable check is not a dead peer
            logger.debug("dead-peer check failed: %s", e)
            return []

    def _arm_backstop(self, seconds: float) -> None:
        if self._exit is not os._exit:  # a test's recorder: no process-wide timers
            return
        stream = sys.__stderr__  # the process's own stderr (a test's capture may have no file descriptor)
        try:
            faulthandler.dump_traceback_later(max(seconds, 1.0), exit=True, file=stream)
        except (AttributeError, ValueError, OSError) as e:  # no usable stderr: no backstop, say so once
            if not self._backstop_failed:
                logger.warning("rljax watchdog: no faulthandler backstop (%s)", e)
                self._backstop_failed = True
            return
        self._backstop = True

    def _disarm_backstop(self) -> None:
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()
            self._backstop = False

    # -- firing --------------------------------------------------------------------------------------
    def report(self, reason: str) -> str:
        """The stall report (see the module docstring) as text."""
        phase, idle = self.last_beat()
        lines = [
            "=" * 100,
            f"rljax watchdog: {reason}; ending process {os.getpid()} with exit status {EXIT_STALLED} "
            "(restart it with --resume)",
            f"last progress: {phase!r}, {idle:.1f}s ago",
        ]
        for name, fn in self.describe.items():
            try:
                state = fn()
            except Exception as e:  # noqa: BLE001 - a part that cannot describe itself is reported so
                state = f"(unavailable: {type(e).__name__}: {e})"
            if isinstance(state, Mapping):
                state = "\n".join(f"  {k}: {v}" for k, v in state.items())
            lines.append(f"-- {name} --\n{state}")
        lines.append(format_stacks(self.loops))
        lines.append("=" * 100)
        return "\n".join(lines) + "\n"

    def _fire(self, reason: str) -> None:
        self.fired = reason
        text = self.report(reason)
        stream = self._stream or sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - the file below still gets it
            pass
        if self.report_path is not None:
            try:
                self.report_path.parent.mkdir(parents=True, exist_ok=True)
                self.report_path.write_text(text)
            except OSError as e:
                print(f"rljax watchdog: could not write {self.report_path}: {e}", file=sys.stderr, flush=True)
        for hook in self.on_exit:
            _run_bounded(hook, _HOOK_TIMEOUT_S)
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:  # noqa: BLE001, S110 - exiting anyway
                pass
        self._disarm_backstop()
        self._exit(EXIT_STALLED)


def _run_bounded(fn: Callable[[], Any], timeout_s: float) -> None:
    """Runs ``fn`` on a daemon thread and waits at most ``timeout_s`` for it (errors are logged)."""

    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the process ends anyway
            print(f"rljax watchdog: exit hook {fn!r} failed: {e}", file=sys.stderr, flush=True)

    thread = threading.Thread(target=run, name="rljax-watchdog-hook", daemon=True)
    thread.start()
    thread.join(timeout_s)


# ------------------------------------------------------------------------------------------------
# The trainer's watchdog: what a run's parts can say about themselves
# ------------------------------------------------------------------------------------------------


def _engines_state(parts: Any) -> dict[str, str]:
    engines = getattr(parts, "engines", None)
    if engines is None:
        return {"engines": "not built"}
    out = {}
    policy = getattr(engines, "policy", None)
    version = getattr(policy, "weight_version", "?") if policy is not None else "-"
    out["policy"] = (
        f"{type(policy).__name__ if policy is not None else 'not started'}, weight_version {version}"
    )
    out["served version"] = str(getattr(engines, "_served_version", "?"))
    for (name, _), model in getattr(engines, "_frozen", {}).items():
        out[f"frozen {name}"] = type(model).__name__
    return out


def _rollouts_state(parts: Any) -> dict[str, str]:
    sched = getattr(parts, "scheduler", None)
    if sched is None:
        return {"scheduler": "not built"}
    now = time.perf_counter()
    out = {
        "next step to submit": str(sched.next_step),
        "behaviour versions held": str(sorted(sched.behavior)),
    }
    for job in sched.pending:
        state = "done" if job.future.done() else "running"
        out[f"rollout of step {job.step}"] = (
            f"version {job.version}, {state}, submitted {now - job.submitted:.1f}s ago"
        )
    if not sched.pending:
        out["pending rollouts"] = "none queued (the trainer may be waiting on one: see the last progress)"
    from rljax.rollout import abandoned_env_calls

    out["abandoned env calls (threads past env_timeout_s)"] = str(abandoned_env_calls())
    return out


def _envs_state(parts: Any) -> dict[str, str]:
    env_tasks = getattr(parts, "env_tasks", None)
    if env_tasks is None:
        return {"envs": "not built"}
    rollout = getattr(getattr(parts, "cfg", None), "rollout", None)
    sections = getattr(getattr(parts, "cfg", None), "envs", {}) or {}
    out = {}
    for name in env_tasks.factories:
        section = sections.get(name)
        kind = getattr(section, "env", "") or getattr(env_tasks.factories[name], "__name__", "?")
        agent = getattr(section, "agent", "") or getattr(section, "agent_command", "")
        out[name] = f"env {kind}" + (f", agent {agent}" if agent else "")
    if rollout is not None:
        out["env_timeout_s (per call / per agent run)"] = str(rollout.env_timeout_s)
    return out


def trainer_watchdog(trainer: Any, timeout_s: float) -> Watchdog:
    """The watchdog of a :class:`rljax.run.trainer.Trainer` (not started): it describes the run's
    engines, rollouts and envs, lists the rollout loop's tasks,
    and writes its report to ``<workdir>/logs/stall_<pid>.txt``."""
    import jax

    parts = trainer.parts
    loops = {}
    for name in ("rollout_worker", "scoring_worker"):
        worker = getattr(parts, name, None)
        if worker is not None and getattr(worker, "loop", None) is not None:
            loops[f"{name} loop"] = worker.loop
    return Watchdog(
        timeout_s,
        report_path=pathlib.Path(trainer.workdir) / "logs" / f"stall_{os.getpid()}.txt",
        describe={
            "run": lambda: {
                "workdir": trainer.workdir,
                "process": f"{jax.process_index()} of {jax.process_count()}",
                "rl step": trainer.rl_step,
            },
            "engines": lambda: _engines_state(parts),
            "rollouts": lambda: _rollouts_state(parts),
            "envs": lambda: _envs_state(parts),
        },
        loops=loops,
    )
