"""Run any registered skyrl-gym environment, unchanged, in the rljax agent loop.

``make_env("skyrl_gym:gsm8k")`` (or ``SkyRLGymEnv("gsm8k", env_config=...)``) adapts a
``skyrl_gym.envs.base_text_env.BaseTextEnv``:

* ``reset(task)``: ``skyrl_gym.make(env_id, env_config=env_config, extras=<the task's row>)``
  (the whole dataset row, as SkyRL passes it: ``reward_spec``, ``extra_info``, ``reward_model``
  for verl-style envs like ``aime``, ...), then ``env.init(task.messages)``; its messages are the
  prompt.
* ``step(action)``: ``env.step(action_text)`` -> ``(observations, reward, done, metadata)``; every
  step keeps its own reward (turn-level rewards of multi-turn envs land on their steps, which
  rljax's ``reward_mode="per_step"`` trains on).
* ``close()``: the rollout calls it at the end of every trajectory, errored ones included.
* ``get_metrics()`` / ``aggregate_metrics(list)``: the env's episode metrics and its class's
  aggregation; the rollout reports them as ``env/<env name>/<key>``.

``make_env("skyrl_gym")`` (no id) dispatches per task on the row's ``env_class``
(``task.data["env_class"]``), so one dataset file can mix skyrl-gym environments.

Token-in / token-out: an env that returns ``postprocessed_action`` different from the sampled
text (SkyRL then continues the conversation from the rewritten text, which no sampled token
sequence produced) is refused with a ``ValueError`` naming the env. The alternative:
``on_postprocessed_action="keep_sampled"`` continues from the sampled tokens and records the
env's rewrite in ``info["postprocessed_action"]``; the usual reason for a rewrite (cutting the
action at a stop string such as ``</search>``) is better met by stopping generation there
(stop-token ids on the engine), so the sampled turn already ends where the env wants it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rljax.envs.base import StepResult, Task

__all__ = ["POSTPROCESSED_ACTION_POLICIES", "SkyRLGymEnv"]

#: What :class:`SkyRLGymEnv` does when an env rewrites the sampled action (``on_postprocessed_action``).
POSTPROCESSED_ACTION_POLICIES = ("error", "keep_sampled")


def _import_skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError as e:  # pragma: no cover - installed by the envs extra
        raise ImportError("skyrl-gym environments need `pip install rljax[envs]` (skyrl-gym)") from e
    return skyrl_gym


def _env_config(config: Any) -> Any:
    """skyrl-gym envs read their config attribute-style (an OmegaConf DictConfig in SkyRL)."""
    if config is None:
        config = {}
    if isinstance(config, Mapping):
        try:
            from omegaconf import OmegaConf
        except ImportError:  # pragma: no cover - omegaconf comes with skyrl-gym
            return dict(config)
        return OmegaConf.create(dict(config))
    return config


class SkyRLGymEnv:
    """Adapter of one skyrl-gym environment episode (module docstring).

    Args:
      env_id: a registered skyrl-gym id (``skyrl_gym.registry``); None = the task's ``env_class``.
      env_config: the env's config (dict or OmegaConf), passed as ``env_config``.
      on_postprocessed_action: "error" (default) or "keep_sampled" (module docstring).
    """

    tools = None

    def __init__(
        self,
        env_id: str | None = None,
        *,
        env_config: Any = None,
        on_postprocessed_action: str = "error",
    ) -> None:
        skyrl_gym = _import_skyrl_gym()
        if env_id is not None and env_id not in skyrl_gym.registry:
            raise ValueError(
                f"skyrl-gym has no registered env {env_id!r}; registered: {sorted(skyrl_gym.registry)}"
            )
        if on_postprocessed_action not in POSTPROCESSED_ACTION_POLICIES:
            raise ValueError(
                f"on_postprocessed_action must be one of {POSTPROCESSED_ACTION_POLICIES}, "
                f"got {on_postprocessed_action!r}"
            )
        self.env_id = env_id
        self.name = f"skyrl_gym:{env_id}" if env_id else "skyrl_gym"
        self.env_config = env_config
        self.on_postprocessed_action = on_postprocessed_action
        self.env: Any = None
        self.task: Task | None = None

    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Creates the skyrl-gym env of ``task`` (its ``env_class`` unless the env names one) and returns
        its prompt."""
        skyrl_gym = _import_skyrl_gym()
        env_id = self.env_id or (task.data or {}).get("env_class")
        if not env_id:
            raise ValueError(
                f"task {task.id!r} names no env_class; use make_env('skyrl_gym:<id>') "
                "or add env_class to its row"
            )
        if task.messages is None:
            raise ValueError(
                f"task {task.id!r} has no prompt messages (skyrl-gym envs start from the row's prompt)"
            )
        extras = dict(task.data or {})
        if task.reward_spec is not None:
            extras.setdefault("reward_spec", dict(task.reward_spec))
        extras.setdefault("extra_info", dict(task.extra_info or {}))
        if task.data_source is not None:
            extras.setdefault("data_source", task.data_source)
        self.close()
        self.env = skyrl_gym.make(env_id, env_config=_env_config(self.env_config), extras=extras)
        self.task = task
        prompt, _ = self.env.init([dict(m) for m in task.messages])
        return [dict(m) for m in prompt]

    def step(self, action: str) -> StepResult:
        """Passes the sampled text to the skyrl-gym env; returns its observations, reward, done flag and
        metadata."""
        if self.env is None:
            raise ValueError("step() before reset(task)")
        text = str(action)
        out = self.env.step(text)
        if not isinstance(out, Mapping):
            raise ValueError(f"skyrl-gym env {self.env_id!r} step returned {type(out).__name__}, not a dict")
        info = dict(out.get("metadata") or {})
        rewritten = out.get("postprocessed_action")
        if rewritten is not None and rewritten != text:
            if self.on_postprocessed_action == "error":
                raise ValueError(
                    f"skyrl-gym env {type(self.env).__name__} rewrote the action (postprocessed_action): "
                    "continuing from rewritten text would train on tokens the model never sampled. Stop "
                    "generation where the env cuts (stop strings/ids on the engine), or pass "
                    "on_postprocessed_action='keep_sampled' to continue from the sampled tokens"
                )
            info["postprocessed_action"] = rewritten
        observations = out.get("observations") or []
        return StepResult(
            [dict(m) for m in observations], float(out.get("reward", 0.0)), bool(out["done"]), info
        )

    def close(self) -> None:
        """Closes the skyrl-gym env (its metrics stay readable)."""
        if self.env is not None:
            env, self.env = self.env, None
            self._closed = env
            env.close()

    def get_metrics(self) -> dict[str, Any]:
        """The skyrl-gym env's episode metrics (empty when it has none)."""
        env = self.env if self.env is not None else getattr(self, "_closed", None)
        if env is None or not hasattr(env, "get_metrics"):
            return {}
        return dict(env.get_metrics() or {})

    def aggregate_metrics(self, metrics: list[dict[str, Any]]) -> dict[str, Any]:
        """Episode metrics aggregated by the skyrl-gym env class, else their numeric means."""
        env = self.env if self.env is not None else getattr(self, "_closed", None)
        agg = getattr(type(env), "aggregate_metrics", None) if env is not None else None
        if agg is None:
            from rljax.envs.base import mean_numeric_metrics

            return mean_numeric_metrics(metrics)
        return dict(agg(metrics))
