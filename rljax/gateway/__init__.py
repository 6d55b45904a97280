"""Train any agent harness: an OpenAI-compatible gateway that records every call as an exact Step.

* :mod:`rljax.gateway.server`: :class:`Gateway`, the ASGI app (a plain ASGI router on uvicorn,
  loopback by default) serving ``/v1/chat/completions`` / ``/v1/models`` / ``/v1/rewards`` in front
  of an engine;
* :mod:`rljax.gateway.protocol`: the OpenAI request / response / server-sent-event mapping;
* :mod:`rljax.gateway.anthropic_api`: Anthropic's ``/v1/messages`` on top of the chat path;
* :mod:`rljax.gateway.sessions`: per-rollout secret keys -> step recorders;

The agents that run against it (agent functions, commands, verifiers environments) live in
:mod:`rljax.agents`. This package needs the ``gateway`` extra (``pip install 'rljax[gateway]'``).
"""

from rljax.extras import require

require("gateway", "the gateway (rljax.gateway)")  # one line naming the extra, before any import of it

from rljax.gateway.protocol import GatewayError  # noqa: E402
from rljax.gateway.server import Gateway  # noqa: E402
from rljax.gateway.sessions import Session, SessionRegistry  # noqa: E402

__all__ = [
    "Gateway",
    "GatewayError",
    "Session",
    "SessionRegistry",
]
