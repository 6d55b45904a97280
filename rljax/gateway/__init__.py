"""Train any agent harness: an OpenAI-compatible gateway that records every call as an exact Step.

* :mod:`rljax.gateway.server`: :class:`Gateway`, the ASGI app (a plain ASGI router on uvicorn,
  loopback by default) serving ``/v1/chat/completions`` / ``/v1/models`` / ``/v1/rewards`` in front
  of an engine;
* :mod:`rljax.gateway.protocol`: the OpenAI request / response / server-sent-event mapping;
* :mod:`rljax.gateway.anthropic_api`: Anthropic's ``/v1/messages`` on top of the chat path;
* :mod:`rljax.gateway.sessions`: per-rollout secret keys -> step recorders;
* :mod:`rljax.gateway.limits`: what one request may cost a front door (body, headers, requests in
  flight), shared with the Tinker API.

The agents that run against it (agent functions, commands, verifiers environments) live in
:mod:`rljax.agents`. This package needs the ``gateway`` extra (``pip install 'rljax[gateway]'``),
checked when one of the names below is first used; :mod:`rljax.gateway.limits` needs nothing (the Tinker API,
which has its own extra, uses it).
"""

from __future__ import annotations

import importlib
from typing import Any

from rljax.extras import require

__all__ = [
    "Gateway",
    "GatewayError",
    "Session",
    "SessionRegistry",
]

_EXPORTS = {
    "Gateway": "rljax.gateway.server",
    "GatewayError": "rljax.gateway.protocol",
    "Session": "rljax.gateway.sessions",
    "SessionRegistry": "rljax.gateway.sessions",
}


def __getattr__(name: str) -> Any:
    """The package's exports, imported on first use (the server's import checks the extra)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rljax.gateway' has no attribute {name!r}")
    require("gateway", "the gateway (rljax.gateway)")  # one line naming the extra
    return getattr(importlib.import_module(_EXPORTS[name]), name)
