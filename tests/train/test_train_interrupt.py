"""Ctrl-C stops a run even when the interpreter swallows the first KeyboardInterrupt."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest

from rljax.run.interrupt import InterruptLatch


def _sigint_now() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):  # the Python-level handler runs at a bytecode boundary in this loop
        pass


class _SendsSigintWhenCollected:
    def __del__(self) -> None:  # exceptions raised in __del__ are printed and ignored by Python
        _sigint_now()


def _swallowed_interrupt() -> None:
    """SIGINT delivered inside a finalizer, where Python ignores the KeyboardInterrupt (as it does
    in gc callbacks such as JAX's)."""
    obj = _SendsSigintWhenCollected()
    cycle = [obj]
    cycle.append(cycle)
    del obj, cycle
    gc.collect()


_IGNORED_IN_DEL = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_IGNORED_IN_DEL
def test_an_interrupt_swallowed_by_a_finalizer_is_raised_at_the_next_check():
    with InterruptLatch() as latch:
        _swallowed_interrupt()  # returns: the KeyboardInterrupt was ignored inside __del__
        assert latch.pending
        with pytest.raises(KeyboardInterrupt):
            latch.check()


@_IGNORED_IN_DEL
def test_without_the_latch_the_same_interrupt_is_lost():
    """The failure the latch exists for: the default handler's KeyboardInterrupt vanishes."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _swallowed_interrupt()  # no exception reaches here
    finally:
        signal.signal(signal.SIGINT, before)


def test_no_signal_no_raise_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    with InterruptLatch() as latch:
        assert signal.getsignal(signal.SIGINT) is not before
        latch.check()
    assert signal.getsignal(signal.SIGINT) is before


def test_off_the_main_thread_the_latch_installs_nothing_and_never_raises():
    seen: list[object] = []

    def worker() -> None:
        with InterruptLatch() as latch:
            seen.append(signal.getsignal(signal.SIGINT))
            latch.pending = True  # as if the main thread's handler had fired
            latch.check()  # a worker goes on; the main thread's check stops the run
            seen.append("went on")

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [before, "went on"]
