"""Train any agent harness: an OpenAI-compatible gateway that records every call as an exact Step.

* :mod:`rljax.gateway.server`: :class:`Gateway`, the ASGI app (a plain ASGI router on uvicorn,
  loopback by default) serving ``/v1/chat/completions`` / ``/v1/models`` / ``/v1/rewards`` in front
  of an engine;
* :mod:`rljax.gateway.protocol`: the OpenAI request / response / server-sent-event mapping;
* :mod:`rljax.gateway.anthropic_api`: Anthropic's ``/v1/messages`` on top of the chat path;
* :mod:`rljax.gateway.sessions`: per-rollout secret keys -> step recorders;
* :mod:`rljax.gateway.agents`: agent functions / commands and :func:`agent_rollout`, which
  returns the same :class:`~rljax.rollout.RolloutResult` as the env loop;
* :mod:`rljax.gateway.lookup_agent`: the built-in ``lookup`` task as an agent function;
* :mod:`rljax.gateway.verifiers`: verifiers environments as agent functions
  (``config.envs.<name>.verifiers``); imported on use (the ``verifiers`` extra).
"""

from rljax.gateway.agents import AgentFn, CommandAgent, agent_rollout, load_agent, run_agent_rollout
from rljax.gateway.protocol import GatewayError
from rljax.gateway.server import Gateway
from rljax.gateway.sessions import Session, SessionRegistry

__all__ = [
    "AgentFn",
    "CommandAgent",
    "Gateway",
    "GatewayError",
    "Session",
    "SessionRegistry",
    "agent_rollout",
    "load_agent",
    "run_agent_rollout",
]
