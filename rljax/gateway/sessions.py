"""Per-rollout credentials: each rollout's secret API key -> its :class:`Session` (step recorder).

A rollout (one trajectory of one task) opens a session; its key (``secrets.token_urlsafe``: 192
random bits, used as the OpenAI API key) is the only thing that attributes a call to it, so calls of
256 concurrent rollouts can never be recorded on another's trajectory, and one rollout cannot post
another's reward. A call with an unknown key, or with the key of a session that has ended, gets
401 and is never recorded. The registry lives on one event loop (the gateway's); nothing here
needs a lock.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from typing import Any

from rljax.envs.base import Task
from rljax.inference.engine import Engine
from rljax.recording import StepRecorder
from rljax.rollout import RolloutConfig

__all__ = ["Session", "SessionRegistry"]

_counter = itertools.count()


@dataclasses.dataclass(eq=False)
class Session:
    """One rollout's state at the gateway.

    Attributes:
      key: the secret API key of the rollout.
      recorder: records its calls as Steps.
      engine: the engine its calls sample from (the policy engine, or a frozen sampler).
      config: token budgets and default sampling (``max_tokens``, ``max_context_len``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``) of its calls.
      task: the task it runs (request seeds derive from its id), or None.
      repetition: its repetition index within the task's group.
      open: False once ended (its key then gets 401).
      error: ``(kind, message)`` of the first engine failure of one of its calls, or None.
      reward: the final reward posted to the gateway, or None.
      call_ids: response id -> index of the recorded call (per-call rewards name it).
      calls_started: calls that reached the engine (request seeds of later calls differ).
    """

    key: str
    recorder: StepRecorder
    engine: Engine
    config: RolloutConfig
    task: Task | None = None
    repetition: int = 0
    open: bool = True
    error: tuple[str, str] | None = None
    reward: float | None = None
    call_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    calls_started: int = 0
    serial: int = dataclasses.field(default_factory=lambda: next(_counter))


class SessionRegistry:
    """Key -> open :class:`Session`."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def open(self, recorder: StepRecorder, engine: Engine, config: RolloutConfig, **kwargs: Any) -> Session:
        """A new session with a fresh secret key."""
        key = "rljax-" + secrets.token_urlsafe(24)
        session = Session(key, recorder, engine, config, **kwargs)
        self._sessions[key] = session
        return session

    def get(self, key: str | None) -> Session | None:
        """The open session of ``key``, else None (unknown or ended: the caller answers 401)."""
        if not key:
            return None
        session = self._sessions.get(key)
        return session if session is not None and session.open else None

    def close(self, session: Session) -> None:
        """Ends ``session``: its key gets 401 from now on; calls still in flight are not recorded."""
        session.open = False
        self._sessions.pop(session.key, None)

    def __len__(self) -> int:
        return len(self._sessions)
