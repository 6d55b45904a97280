"""Progress reporting for long host work (rollouts, scoring, warm starts, evals).

Imports nothing from rljax, so every layer (inference clients, data tools, the trainer) can show
progress the same way.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

__all__ = ["Progress", "is_ci"]


def is_ci() -> bool:
    """True when the ``CI`` environment variable is set to something other than empty/0/false/no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


class Progress:
    """A tqdm progress bar on terminals; elsewhere (pipes, files, ``CI=true``) one final line only.

    Use as an iterator wrapper or as a context manager with :meth:`update`.

    >>> import io
    >>> out = io.StringIO()                       # not a terminal: no bar, one summary line
    >>> for _ in Progress(range(3), desc="rollout", stream=out):
    ...     pass
    >>> out.getvalue().startswith("rollout: 3/3 it in ")
    True
    """

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        enabled: bool | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and not is_ci()
        self.enabled = enabled
        self.n = 0
        self._postfix: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._closed = False
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=True)

    def update(self, n: int = 1) -> None:
        """Advances the count by ``n``."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        """Extra ``key=value`` fields shown after the bar (and in the final line)."""
        self._postfix.update(values)
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=True)

    def summary(self) -> str:
        """The final line: ``desc: n/total unit in Xs (rate unit/s) key=value ...``."""
        elapsed = time.perf_counter() - self._start
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        rate = self.n / elapsed if elapsed > 0 else float("inf")
        extra = "".join(f" {k}={v}" for k, v in self._postfix.items())
        prefix = f"{self.desc}: " if self.desc else ""
        return f"{prefix}{count} {self.unit} in {elapsed:.1f}s ({rate:.2f} {self.unit}/s){extra}"

    def close(self) -> None:
        """Ends the bar (tqdm leaves its last state) or prints :meth:`summary` when disabled."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            self.stream.write(self.summary() + "\n")
            self.stream.flush()

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise ValueError("Progress(...) needs an iterable to be iterated; use update() otherwise")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
