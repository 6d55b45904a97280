"""A background thread running one asyncio event loop; jobs run one at a time, in submission order.

The trainer uses one for rollouts, evals and weight syncs (so in async mode the rollout of step
n + 1 runs beside the jitted training of step n: JAX releases the GIL while XLA runs), and one for
teacher scoring (so scoring step n's samples never queues behind the next rollout).

>>> w = Worker("doc")
>>> async def answer() -> int:
...     return 42
>>> w.submit(answer).result(), w.close()
(42, None)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Worker"]


class Worker:
    """A thread with its own event loop; :meth:`submit` runs coroutine jobs in FIFO order."""

    def __init__(self, name: str = "rljax-worker") -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.thread: threading.Thread | None = None  # started by the first submit
        self._lock: asyncio.Lock | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, make_coro: Callable[[], Any]) -> concurrent.futures.Future:
        """Schedules ``make_coro()`` after every job submitted before it; returns its future."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()

        async def job() -> Any:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:  # asyncio.Lock is FIFO: jobs run one at a time, in order
                return await make_coro()

        return asyncio.run_coroutine_threadsafe(job(), self.loop)

    def close(self) -> None:
        """Stops the loop and joins the thread (jobs still queued are dropped)."""
        if self.thread is None:
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
