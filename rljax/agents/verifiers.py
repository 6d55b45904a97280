"""verifiers environments as gateway agents: ``config.envs.<name>.verifiers = "<environment id>"``.

A verifiers environment (PyPI ``verifiers`` >= 0.4, API ``verifiers.v1``: a *taskset* yields typed
tasks, a *harness* program plays each one inside a *runtime*, the task's ``@vf.reward`` /
``@vf.metric`` methods and judges score the finished trace) runs here as an rljax agent function::

    agent = VerifiersAgent("my-env", env_args={"agent": {"runtime": {"type": "subprocess"}}})
    train = agent.tasks(env_name="my_env", split="train")       # rljax Tasks, one per verifiers task
    result = await agent(train[0], client)                      # {"reward": r, "metrics": {...}}

``client`` is the ``openai.AsyncOpenAI`` the gateway binds to one rollout (its ``base_url`` and its
per-rollout ``api_key``). One call runs one verifiers *episode* of the task
(``Env.run_episode``): the harness program calls verifiers' interception server, whose eval client
relays every request, unchanged in content, to the gateway's ``POST /v1/chat/completions`` with the
rollout's key, so each model call of the episode is rendered by the run's renderer, sampled by the
run's engine and recorded token-exactly by the gateway as a Step of this rollout. The returned
reward is the episode's rubric reward: ``Trace.reward = sum_i score_i * weight_i`` over the trace's
named rewards (``@vf.reward`` methods, plugged reward functions and judges); for an env with several
agent seats, the mean of that over the traces of trainable seats. ``metrics`` holds each trace
metric under its name, each reward component under ``reward/<name>`` (its unweighted score), and
``num_turns``; several traces: per-key means.

Integration choice (ids exact on OUR side): verifiers has two model clients. Its *train* client
renders messages to token ids client-side (prime-rl's ``renderers`` package) and posts them to a
vLLM-style ``/inference/v1/generate``; its *eval* client relays OpenAI chat requests. We use the eval
client against the gateway: the one renderer is the run's (the one the trainer scores with), the
gateway's bridge extends the previous call's exact prompt + completion ids when a call continues
the conversation, and the Steps the trainer consumes are the gateway's records of what the engine
produced, never ids re-derived from messages by a second renderer. The train client would put a
second renderer (``renderers``' chat templates) in front of ours, whose prompt ids we would have to
trust or re-check, and it cannot stream.

Per-rollout credential: verifiers reads a client's API key from an environment variable named in its
config (``api_key_var``) when the interception server builds that client, one per distinct config.
Each episode therefore gets a config naming a fresh variable ``RLJAX_VF_API_KEY_<hex>`` that holds
the rollout's key for the episode's duration (the ``API_KEY`` in its name keeps verifiers' subprocess
runtime from passing it to harness programs); the episode's client is closed and dropped from the
interception server when the episode ends.

Serving: verifiers' env-level resources (the interception server pool, shared tool servers, the env's
``start``/``stop``) are held for the life of the event loop the rollouts run on (the trainer's rollout
worker keeps one loop for the run), entered by the first episode on that loop and exited on
:meth:`VerifiersAgent.aclose` (a run calls it when it closes, before stopping its gateway) or when
the loop's tasks are cancelled (the end of an ``asyncio.run``).

Errors: an episode that is not ``ok`` (a harness that raised or exited non-zero, a failed model call,
a task setup / rubric that raised, an env hook that raised) raises :class:`VerifiersEpisodeError`
naming the first error, so the gateway counts an errored trajectory (excluded from baselines).
Episode-level retries (``retries``) are not used: a retried attempt's model calls would already be
recorded in the same rollout.

Loading by id is verifiers' own (:func:`verifiers.v1.load_environment`): the id names an importable
taskset module (``verifiers.v1.tasksets.<id>`` or an installed package ``<id>``, ``-`` read as
``_``, hub ids ``owner/name@version`` as ``name``) exporting its ``Taskset`` subclass (and optionally
a ``Harness`` and an ``Env``) in ``__all__``. ``env_args`` is verifiers' env config (the ``[env]``
block / ``--env.*`` flags), e.g. ``{"taskset": {...}, "agent": {"runtime": {"type": "subprocess"},
"max_turns": 4}}``; ``env_args["id"]`` pairs a reusable ``Env`` with the taskset.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax.envs.base import Task

__all__ = ["VerifiersAgent", "VerifiersEpisodeError", "episode_result", "verifiers_agent"]

KEY_VAR_PREFIX = "RLJAX_VF_API_KEY_"
TASK_DATA_KEY = "verifiers"


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode that did not complete (``Episode.ok`` false): the message names the first
    recorded error (type, message and the tail of its traceback)."""


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _env_config_data(env_id: str, env_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """verifiers' env config data: ``env_args`` with ``taskset.id`` = ``env_id``."""
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"a verifiers environment id must be a non-empty string, got {env_id!r}")
    args = dict(env_args or {})
    taskset = args.get("taskset") or {}
    if not isinstance(taskset, Mapping):
        raise ValueError(f"env_args['taskset'] must be a dict of taskset config fields, got {taskset!r:.80}")
    given = taskset.get("id")
    if given not in (None, "", env_id):
        raise ValueError(f"env_args['taskset']['id'] = {given!r} contradicts the environment id {env_id!r}")
    args["taskset"] = {**taskset, "id": env_id}
    return args


def _message_dicts(prompt: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    """A verifiers task prompt (text or Messages) as chat message dicts, system prompt first."""
    out: list[dict[str, Any]] = []
    if system_prompt:
        out.append({"role": "system", "content": system_prompt})
    if isinstance(prompt, str):
        out.append({"role": "user", "content": prompt})
    elif prompt:
        for m in prompt:
            d = m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else dict(m)
            out.append(d)
    return out


def _describe(errors: Sequence[Any]) -> str:
    e = errors[0]
    text = f"{e.type}: {e.message}"
    tb = (getattr(e, "traceback", None) or "").strip()
    if tb:
        text += "\n" + "\n".join(tb.splitlines()[-12:])
    more = len(errors) - 1
    return text + (f"\n(+{more} more error(s))" if more else "")


def episode_result(episode: Any) -> dict[str, Any]:
    """``{"reward": r, "metrics": {...}}`` of a finished verifiers ``Episode`` (module doc).

    Raises :class:`VerifiersEpisodeError` when the episode is not ``ok`` (its first error) or has
    no trace; ``ValueError`` for a non-finite reward.
    """
    if not episode.ok:
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        if not errors:
            raise VerifiersEpisodeError("the verifiers episode did not complete (no error was recorded)")
        raise VerifiersEpisodeError(_describe(errors))
    traces = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
    if not traces:
        raise VerifiersEpisodeError("the verifiers episode has no trace")
    per_trace: list[dict[str, float]] = []
    for t in traces:
        m = {k: float(v) for k, v in t.metrics.items() if v is not None}
        m.update({f"reward/{k}": float(r.score) for k, r in t.rewards.items() if r is not None})
        m["num_turns"] = float(t.num_turns)
        per_trace.append(m)
    reward = float(np.mean([t.reward for t in traces]))
    if not np.isfinite(reward):
        raise ValueError(f"the verifiers rubric gave a non-finite reward {reward!r}")
    keys = sorted({k for m in per_trace for k in m})
    metrics = {k: float(np.mean([m[k] for m in per_trace if k in m])) for k in keys}
    return {"reward": reward, "metrics": metrics}


class _Serving:
    """``env.serving()`` held open by one task of one event loop until :meth:`stop`."""

    def __init__(self, env: Any) -> None:
        loop = asyncio.get_running_loop()
        self.env = env
        self.ready: asyncio.Future[None] = loop.create_future()
        self._stop = asyncio.Event()
        self.task = loop.create_task(self._hold(), name="rljax-verifiers-serving")

    async def _hold(self) -> None:
        try:
            async with self.env.serving():
                self.ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:
            if not self.ready.done():
                self.ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            raise

    async def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await self.task


class VerifiersAgent:
    """One verifiers environment as an rljax agent function ``await agent(task, client)`` (module doc).

    Args:
      env_id: the verifiers environment (taskset) id.
      env_args: verifiers' env config (``[env]`` block) as a dict; ``taskset.id`` is ``env_id``.
      model: the model name sent to the endpoint; None = the first id of the endpoint's
        ``GET /v1/models`` (the gateway's served model name), asked once per base URL.
      sampling: verifiers sampling overrides (``temperature``, ``top_p``, ``max_tokens``, ...) applied
        by its interception server to every request; None = the harness's own request values.
    """

    def __init__(
        self,
        env_id: str,
        env_args: Mapping[str, Any] | None = None,
        *,
        model: str | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> None:
        self.env_id = env_id
        self.env_args = dict(env_args or {})
        self._config_data = _env_config_data(env_id, env_args)
        self.model = model
        self.sampling = dict(sampling or {})
        self._env: Any = None
        self._models: dict[str, str] = {}
        self._serving: dict[asyncio.AbstractEventLoop, _Serving] = {}

    def __repr__(self) -> str:
        return f"VerifiersAgent({self.env_id!r})"

    @property
    def env(self) -> Any:
        """The loaded ``verifiers.v1.Env`` (loaded by id on first use)."""
        if self._env is None:
            self._env = self._load(self._config_data)
        return self._env

    @staticmethod
    def _load(data: Mapping[str, Any]) -> Any:
        try:
            import verifiers.v1 as vf
        except ImportError as e:  # pragma: no cover - the extra is installed in CI
            raise ImportError(
                "verifiers environments need the verifiers package: pip install 'rljax[verifiers]'"
            ) from e
        return vf.load_environment(vf.resolve_env_config(dict(data)))

    # ---- tasks -------------------------------------------------------------------------------

    def tasks(
        self,
        *,
        env_name: str,
        split: str = "train",
        taskset_args: Mapping[str, Any] | None = None,
        limit: int | None = None,
    ) -> list[Task]:
        """The taskset's tasks as rljax :class:`Task` s of env ``env_name`` and ``split``.

        ``taskset_args`` override taskset config fields for this list only (e.g. ``{"split":
        "test"}`` for held-out tasks); the agent still runs them with its own env. ``limit`` keeps
        the first N. Each Task has ``id = "<env_name>:<first 16 hex of the verifiers task key>"``,
        ``messages`` = the task's system prompt + prompt, ``data_source`` = the environment id, and
        ``data["verifiers"]`` = the verifiers task's wire data (what the episode is rebuilt from).
        """
        taskset = self.env.taskset
        if taskset_args:
            data = _deep_merge(self._config_data, {"taskset": dict(taskset_args)})
            taskset = self._load(data).taskset
        if limit is not None:
            taskset = taskset.take(int(limit))
        elif not taskset.bounded:
            raise ValueError(
                f"verifiers taskset {self.env_id!r} is infinite: "
                "set num_train_tasks / num_eval_tasks (limit=)"
            )
        out: list[Task] = []
        seen: dict[str, int] = {}
        for vf_task in taskset:
            key = vf_task.key
            tid = f"{env_name}:{key[:16]}"
            if tid in seen:
                raise ValueError(
                    f"verifiers taskset {self.env_id!r}: tasks {seen[tid]} and {vf_task.data.idx} "
                    f"share the key "
                    f"{key[:16]}...; task keys must be unique within a taskset (override Task.key)"
                )
            seen[tid] = vf_task.data.idx
            d = vf_task.data
            out.append(
                Task(
                    tid,
                    {
                        TASK_DATA_KEY: {
                            "type": type(vf_task).__name__,
                            "key": key,
                            "data": d.model_dump(mode="json"),
                        }
                    },
                    env=env_name,
                    split=split,
                    messages=_message_dicts(d.prompt, d.system_prompt) or None,
                    data_source=self.env_id,
                )
            )
        return out

    def vf_task(self, task: Task) -> Any:
        """The verifiers task an rljax Task stands for (rebuilt from its wire data, verifiers' own
        ``Task(data, config)`` contract, with the env's taskset task config)."""
        payload = (task.data or {}).get(TASK_DATA_KEY)
        if not isinstance(payload, Mapping) or "data" not in payload:
            raise ValueError(
                f"task {task.id!r} was not made by VerifiersAgent.tasks (no data['{TASK_DATA_KEY}']); "
                f"a verifiers env runs only its own tasks"
            )
        taskset = self.env.taskset
        task_cls = type(taskset).task_type()
        if payload.get("type") not in (None, task_cls.__name__):
            raise ValueError(
                f"task {task.id!r} is a {payload['type']} task; "
                f"environment {self.env_id!r} runs {task_cls.__name__}"
            )
        return task_cls(task_cls.data_type().model_validate(payload["data"]), taskset.config.task)

    # ---- one episode -------------------------------------------------------------------------

    async def _model_name(self, client: Any) -> str:
        if self.model:
            return self.model
        base = str(client.base_url)
        if base not in self._models:
            page = await client.models.list()
            ids = [m.id for m in page.data]
            if not ids:
                raise RuntimeError(f"{base}models lists no model; pass model= to VerifiersAgent")
            self._models[base] = ids[0]
        return self._models[base]

    async def _ensure_serving(self) -> None:
        loop = asyncio.get_running_loop()
        serving = self._serving.get(loop)
        if serving is None:
            # drop the entries of closed loops (a finished asyncio.run) as we go
            for old in [lp for lp in self._serving if lp.is_closed()]:
                del self._serving[old]
            serving = self._serving[loop] = _Serving(self.env)
        try:
            await asyncio.shield(serving.ready)
        except Exception:
            if self._serving.get(loop) is serving:
                del self._serving[loop]  # the next episode tries again
            raise

    async def _release_client(self, config: Any) -> None:
        """Closes and drops the interception server's client built for ``config`` (one episode's)."""
        interception = getattr(self.env, "_interception", None)
        servers = getattr(interception, "servers", None)
        if servers is None:
            servers = [interception] if interception is not None else []
        key = config.model_dump_json()
        for server in servers:
            client = getattr(server, "clients", {}).pop(key, None)
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    async def __call__(self, task: Task, client: Any) -> dict[str, Any]:
        """Runs one verifiers episode of ``task`` against ``client``'s endpoint; returns its rubric's
        ``{"reward", "metrics"}`` (module doc) or raises :class:`VerifiersEpisodeError`."""
        import verifiers.v1 as vf

        vf_task = self.vf_task(task)
        env = self.env
        model = await self._model_name(client)
        await self._ensure_serving()
        var = KEY_VAR_PREFIX + secrets.token_hex(8)
        config = vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"), api_key_var=var)
        ctx = vf.ModelContext(model=model, client=config, sampling=vf.SamplingConfig(**self.sampling))
        os.environ[var] = str(client.api_key)
        try:
            episode = await env.run_episode(vf_task, ctx)
        finally:
            os.environ.pop(var, None)
            await self._release_client(config)
        return episode_result(episode)

    async def aclose(self) -> None:
        """Exits the env's serving resources held on the running event loop."""
        serving = self._serving.pop(asyncio.get_running_loop(), None)
        if serving is not None:
            await serving.stop()


def verifiers_agent(env_id: str, env_args: Mapping[str, Any] | None = None, **kwargs: Any) -> VerifiersAgent:
    """:class:`VerifiersAgent` (``model=``, ``sampling=`` keywords); loads the env to fail fast on a
    bad id or config."""
    agent = VerifiersAgent(env_id, env_args, **kwargs)
    agent.env  # noqa: B018 - load now: a bad id or config raises here, not in the first rollout
    return agent
