"""Agents trained through the gateway (:mod:`rljax.gateway`): what runs them, not the HTTP room.

* :mod:`rljax.agents.runners`: agent functions / commands and :func:`agent_rollout`, which
  returns the same :class:`~rljax.rollout.RolloutResult` as the env loop;
* :mod:`rljax.agents.lookup_agent`: the built-in ``lookup`` task as an agent function;
* :mod:`rljax.agents.verifiers`: verifiers environments as agent functions
  (``config.envs.<name>.verifiers``); imported on use (the ``verifiers`` extra).

Needs the ``gateway`` extra (``pip install 'rljax[gateway]'``).
"""

from rljax.agents.runners import AgentFn, CommandAgent, agent_rollout, load_agent, run_agent_rollout

__all__ = ["AgentFn", "CommandAgent", "agent_rollout", "load_agent", "run_agent_rollout"]
