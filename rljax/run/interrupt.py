"""Ctrl-C that always stops a run.

Python's default SIGINT handler raises :class:`KeyboardInterrupt` in whatever the main thread runs
at that moment. When that is a garbage-collection callback (JAX registers one) or an object's
``__del__``, Python prints "Exception ignored in ..." and carries on: the interrupt is lost and
the run keeps training. :class:`InterruptLatch` raises at once as before *and* remembers the
signal, so the trainer's next progress point (:meth:`InterruptLatch.check`, called with each
watchdog beat) raises again if the first one was swallowed. A run therefore stops within one
phase of a step after Ctrl-C, whatever the interpreter was doing when it arrived.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["InterruptLatch"]


class InterruptLatch:
    """While entered (``with InterruptLatch() as latch``), SIGINT raises ``KeyboardInterrupt`` and
    is remembered until :meth:`check` (main thread) raises it again.

    Installs its handler only when entered on the main thread (the only one Python delivers
    signals to); elsewhere it is inert. The previous handler is restored on exit.

    >>> import os, signal
    >>> with InterruptLatch() as latch:
    ...     try:
    ...         os.kill(os.getpid(), signal.SIGINT)
    ...         for _ in range(1000):  # the handler runs at the next bytecode boundary
    ...             pass
    ...     except KeyboardInterrupt:
    ...         print("raised; still pending:", latch.pending)
    raised; still pending: True
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> InterruptLatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raises ``KeyboardInterrupt`` if SIGINT arrived since entering (on the main thread only:
        a worker thread that calls this goes on, the main thread's next check stops the run)."""
        if self.pending and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
