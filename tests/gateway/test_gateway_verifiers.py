"""The verifiers adapter (rljax.agents.verifiers): a verifiers environment defined here with
verifiers' own classes (tests/gateway/vf_helpers.py: a taskset, a task whose rubric is two weighted
``@vf.reward`` methods and a ``@vf.metric``, an in-process harness, the local subprocess runtime),
loaded by id, run as an agent function with a real ``openai.AsyncOpenAI`` pointed at a scripted
OpenAI-compatible server (a double of the protocol only).

Expected rewards are hand-computed from the rubric: ``correct`` (weight 2) = exact match of the final
reply with the task's answer, ``brief`` (weight 0.5) = 1 / (1 + length of the final reply); the script
answers the follow-up with the true one-digit sum, so a task whose stated answer is the sum scores
2 * 1 + 0.5 * 1/2 = 2.25 and one whose stated answer is wrong 2 * 0 + 0.5 * 1/2 = 0.25.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vf_helpers as h  # noqa: E402

from rljax.agents.verifiers import (  # noqa: E402
    KEY_VAR_PREFIX,
    VerifiersAgent,
    VerifiersEpisodeError,
    verifiers_agent,
)
from rljax.envs.base import Task  # noqa: E402


@pytest.fixture(scope="module")
def server():
    h.register_env()
    s = h.ScriptedServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def agent(server):
    return verifiers_agent(h.ENV_ID, h.LOCAL)


def _rows(*rows):
    return {**h.LOCAL, "taskset": {"rows": [list(r) for r in rows]}}


def test_tasks_are_the_tasksets_tasks(agent):
    tasks = agent.tasks(env_name="arith")
    assert [t.messages for t in tasks] == [
        ({"role": "system", "content": "You add numbers."}, {"role": "user", "content": f"What is {q}?"})
        for q in ("2+3", "4+4", "1+1")
    ]
    assert all(t.env == "arith" and t.split == "train" and t.data_source == h.ENV_ID for t in tasks)
    assert len({t.id for t in tasks}) == 3 and all(t.id.startswith("arith:") for t in tasks)
    # the episode's task is rebuilt from the wire data: same class, same data, same key
    vf_tasks = list(agent.env.taskset)
    for t, original in zip(tasks, vf_tasks, strict=True):
        rebuilt = agent.vf_task(t)
        assert type(rebuilt) is h.ArithTask and rebuilt.data == original.data and rebuilt.key == original.key
        assert t.id == f"arith:{original.key[:16]}"
    # held-out tasks from other taskset fields; limit keeps the first N
    held = agent.tasks(env_name="arith", split="test", taskset_args={"rows": [[5, 6, "11"], [7, 1, "8"]]})
    assert [t.messages[-1]["content"] for t in held] == ["What is 5+6?", "What is 7+1?"]
    assert all(t.split == "test" for t in held) and not {t.id for t in held} & {t.id for t in tasks}
    assert len(agent.tasks(env_name="arith", limit=2)) == 2


def test_episodes_return_the_rubric_reward_and_metrics(agent, server):
    tasks = agent.tasks(env_name="arith")
    keys = [f"rollout-{i}" for i in range(len(tasks))]
    before = len(server.requests)

    async def main():
        out = await asyncio.gather(*(agent(t, server.client(k)) for t, k in zip(tasks, keys, strict=True)))
        # each episode's endpoint client was closed and dropped from the interception servers
        servers = agent.env._interception.servers
        assert servers and not [c for s in servers for c in s.clients if KEY_VAR_PREFIX in c]
        await agent.aclose()
        return out

    results = asyncio.run(main())
    assert [r["reward"] for r in results] == [2.25, 2.25, 0.25]
    assert results[2]["metrics"] == {
        "num_turns": 2.0,
        "reply_chars": 1.0,
        "reward/brief": 0.5,
        "reward/correct": 0.0,
    }
    assert results[0]["metrics"]["reward/correct"] == 1.0
    # every call reached the endpoint with its own rollout's key, the served model, and the messages
    # the harness sent (the follow-up extends the first call's conversation with the reply it got)
    calls = server.requests[before:]
    assert sorted(k for k, _ in calls) == sorted(keys * 2)
    for key, task in zip(keys, tasks, strict=True):
        first, second = (b for k, b in calls if k == key)
        assert first["model"] == second["model"] == server.model
        assert first["messages"] == [dict(m) for m in task.messages]
        assert second["messages"] == [
            *first["messages"],
            {"role": "assistant", "content": h.scripted_reply(first["messages"])},
            {"role": "user", "content": h.FOLLOW_UP},
        ]
        assert second["max_tokens"] == 8
    # the per-episode key variables and interception clients are gone
    assert not [k for k in os.environ if k.startswith(KEY_VAR_PREFIX)]
    interception = agent.env._interception
    assert interception is None  # aclose exited env.serving()


def test_streamed_calls_relay_and_score():
    h.register_env()  # also when this test runs alone (it needs no scripted-server fixture)
    agent = VerifiersAgent(h.ENV_ID, _rows([3, 4, "7", "stream"]))
    s = h.ScriptedServer()
    try:
        (task,) = agent.tasks(env_name="arith")
        result = asyncio.run(agent(task, s.client("k-stream")))
        assert result["reward"] == 2.25
        assert s.requests[0][1]["stream"] is True and "stream" not in s.requests[1][1]
        assert s.requests[1][1]["messages"][2] == {"role": "assistant", "content": "Let me add 3 and 4."}
    finally:
        s.close()


def test_an_episode_whose_harness_raises_is_an_error(server):
    agent = VerifiersAgent(h.ENV_ID, _rows([1, 2, "3", "harness_raises"]))
    (task,) = agent.tasks(env_name="arith")
    with pytest.raises(VerifiersEpisodeError, match="the harness failed on purpose"):
        asyncio.run(agent(task, server.client("k-raise")))
    assert not [k for k, _ in server.requests if k == "k-raise"]


def test_an_episode_whose_rubric_fails_is_an_error(server):
    agent = VerifiersAgent(h.ENV_ID, _rows([1, 2, "3", "reward_raises"]))
    (task,) = agent.tasks(env_name="arith")
    with pytest.raises(VerifiersEpisodeError, match="ZeroDivisionError") as err:
        asyncio.run(agent(task, server.client("k-rubric")))
    assert "the rubric failed on purpose" in str(err.value)
    assert len([k for k, _ in server.requests if k == "k-rubric"]) == 2  # the calls ran, scoring failed


def test_an_episode_whose_task_setup_or_env_hook_raises_is_an_error(server):
    agent = VerifiersAgent(h.ENV_ID, _rows([1, 2, "3", "setup_raises"]))
    (task,) = agent.tasks(env_name="arith")
    with pytest.raises(VerifiersEpisodeError, match="the task setup failed on purpose"):
        asyncio.run(agent(task, server.client("k-setup")))
    assert not [k for k, _ in server.requests if k == "k-setup"]
    agent = VerifiersAgent(h.ENV_ID, {**_rows([1, 2, "3", "env_raises"], [2, 2, "4"]), "id": h.CHECKED_ID})
    assert type(agent.env).__name__ == "CheckedEnv"
    failing, fine = agent.tasks(env_name="arith")
    with pytest.raises(VerifiersEpisodeError, match="the env's finalize failed on purpose"):
        asyncio.run(agent(failing, server.client("k-env")))
    assert asyncio.run(agent(fine, server.client("k-env-ok")))["reward"] == 2.25


def test_a_rejected_key_errors_the_episode(server):
    agent = VerifiersAgent(h.ENV_ID, _rows([1, 2, "3"]))
    (task,) = agent.tasks(env_name="arith")
    rejected = server.rejected
    import openai

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="not-a-rollout-key", max_retries=0)
    with pytest.raises(VerifiersEpisodeError, match="401"):
        asyncio.run(agent(task, client))
    assert server.rejected == rejected + 1 and not [k for k, _ in server.requests if k == "not-a-rollout-key"]


def test_an_episode_without_model_calls_is_scored(server):
    agent = VerifiersAgent(h.ENV_ID, _rows([1, 2, "3", "no_call"]))
    (task,) = agent.tasks(env_name="arith")
    result = asyncio.run(agent(task, server.client("k-silent")))
    assert result == {
        "reward": 0.5,
        "metrics": {"num_turns": 0.0, "reply_chars": 0.0, "reward/brief": 1.0, "reward/correct": 0.0},
    }


def test_bad_ids_configs_and_tasks_are_refused(agent):
    with pytest.raises(ModuleNotFoundError, match="no-such-env"):
        verifiers_agent("no-such-env", h.LOCAL)
    with pytest.raises(ValueError, match="contradicts"):
        VerifiersAgent(h.ENV_ID, {"taskset": {"id": "other"}})
    with pytest.raises(ValueError, match="non-empty"):
        VerifiersAgent("", {})
    with pytest.raises(ValueError, match="not made by VerifiersAgent.tasks"):
        agent.vf_task(Task("t0", {"question": "1+1"}))
    dupes = VerifiersAgent(h.ENV_ID, _rows([1, 1, "2"], [1, 1, "2"]))
    assert len(dupes.tasks(env_name="d")) == 2  # idx is part of the data, so equal rows differ


def test_verifiers_config_errors_are_clear():
    from rljax.run.config import parse_run_config

    def envs(**spec):
        return {"envs": {"arith": {"verifiers": h.ENV_ID, **spec}}, "warmstart": {"num_steps": 0}}

    with pytest.raises(ValueError, match=r"drop \['agent'\]"):
        parse_run_config(envs(agent="m:f"))
    with pytest.raises(ValueError, match="eval_env_args"):
        parse_run_config(envs(num_eval_tasks=2))
    with pytest.raises(ValueError, match="config.warmstart.num_steps"):
        parse_run_config({"envs": {"arith": {"verifiers": h.ENV_ID}}})  # the default warm start is on
    with pytest.raises(ValueError, match="only verifiers envs"):
        parse_run_config({"envs": {"lookup": {"env_args": {"x": 1}}}})
    cfg = parse_run_config(envs(env_args=h.LOCAL, eval_env_args={"rows": [[1, 2, "3"]]}))
    assert cfg.envs["arith"].verifiers == h.ENV_ID and cfg.envs["arith"].env_args == h.LOCAL


def test_build_env_tasks_of_a_verifiers_env(server):
    from rljax.run.config import parse_run_config
    from rljax.run.tasks import build_env_tasks

    spec = {"verifiers": h.ENV_ID, "env_args": h.LOCAL, "eval_env_args": {"rows": [[5, 6, "11"]]}}
    no_ws = {"warmstart": {"num_steps": 0}}
    built = build_env_tasks(parse_run_config({"envs": {"arith": {**spec, "num_train_tasks": 2}}, **no_ws}))
    assert [t.messages[-1]["content"] for t in built.train] == ["What is 2+3?", "What is 4+4?"]
    assert [t.messages[-1]["content"] for t in built.eval] == ["What is 5+6?"]
    assert isinstance(built.agents["arith"], VerifiersAgent) and built.agent_kwargs["arith"] == {}
    with pytest.raises(ValueError, match="has no env class"):
        built.factories["arith"]()
    with pytest.raises(ValueError, match=r"config.envs.arith.verifiers: ModuleNotFoundError"):
        build_env_tasks(parse_run_config({"envs": {"arith": {"verifiers": "no-such-env"}}, **no_ws}))


@pytest.mark.integration
def test_a_verifiers_env_trains_two_steps_with_its_rubrics_reward(tmp_path):
    """The whole path: config.envs.arith.verifiers -> the run's real gateway in front of the
    embedded sampler (tiny model) -> 2 RL steps and an evaluation of the held-out taskset. Each
    trajectory's trained reward (on its last step) is the rubric of the final reply its harness
    received, recomputed here (``h.rubric``); every trajectory made both calls through the gateway."""
    from recipes import load_recipe

    from rljax.run.trainer import Trainer

    h.register_env()
    h.REPLIES.clear()
    c = load_recipe("smoke")
    c.envs = {
        "arith": dict(
            verifiers=h.ENV_ID,
            env_args=_rows([2, 3, "5"], [4, 4, "8"], [1, 1, "3"]),
            eval_env_args={"rows": [[5, 2, "7"]]},
        )
    }
    c.warmstart.num_steps = 0
    c.rollout.update(group_size=2, max_tokens=8)
    c.trainer.update(num_steps=2, prompts_per_step=2, eval_every=2, checkpoint_every=0)
    t = Trainer(c, tmp_path)
    batches, results = [], []
    train_on, run_rollout = t._train_on, t.parts.scheduler.run_rollout
    t._train_on = lambda batch: (batches.append(batch), train_on(batch))[1]

    async def capture(*args, **kwargs):
        results.append(await run_rollout(*args, **kwargs))
        return results[-1]

    t.parts.scheduler.run_rollout = capture
    history = t.run()
    assert len(history) == 2 and len(batches) == 2 and len(results) == 3  # 2 steps + 1 eval
    assert "eval/reward_mean" in history[-1] and not t.parts.scheduler.gateway.started  # stopped with the run
    tasks = {task.id: task for task in (*t.parts.env_tasks.train, *t.parts.env_tasks.eval)}
    # each episode's two model calls are its trajectory's two recorded calls: the first prompt is the
    # task's messages, the follow-up extends the first call's exact ids (the relayed conversation is
    # the one the gateway answered), and the reward is the rubric of the final reply it returned
    renderer = t.parts.scheduler.renderer
    for rec in (r for res in results for r in res.trajectories):
        assert not rec.errored and len(rec.calls) == 2, rec.error
        task = tasks[rec.trajectory_id.instance_id]
        first, second = rec.calls
        assert first.prompt.messages == [dict(m) for m in task.messages]
        returned = [c.returned or c.reply for c in rec.calls]
        # the follow-up reached the gateway as the harness sent it: the first call's messages, the
        # reply it got, the follow-up question
        n = len(first.prompt.messages)
        assert second.prompt.messages[:n] == first.prompt.messages
        assert second.prompt.messages[n]["content"] == returned[0]["content"]
        assert second.prompt.messages[n + 1 :] == [{"role": "user", "content": h.FOLLOW_UP}]
        # its prompt ids: the first call's exact ids + the bridge, or (only where the renderer cannot
        # bridge: e.g. a first turn ended by another stop token) a full render of what was sent
        follow_up, reply = second.prompt.messages[n + 1 :], second.prompt.messages[n]
        if renderer.bridge(first.prompt.ids, first.completion.ids, follow_up, reply=reply) is not None:
            head = [*first.prompt.ids, *first.completion.ids]
            assert rec.bridged == [True] and second.prompt.parent == 0
            assert list(second.prompt.ids[: len(head)]) == head
        else:
            full = renderer.render_with_roles(second.prompt.messages, add_generation_prompt=True).ids
            assert rec.bridged == [False] and second.prompt.ids == list(full)
        final = returned[1].get("content") or ""
        d = task.data["verifiers"]["data"]
        assert final in h.REPLIES[(d["a"], d["b"])]
        assert abs(rec.reward - h.rubric(final, d["answer"])) < 1e-9
    for batch in batches:
        last = [s for s in batch.steps if s.is_last_step]
        assert len(last) == 4 and len(batch.steps) == 8  # 2 prompts x 2 repetitions x 2 calls
        by_group: dict[str, list[float]] = {}
        for s in last:
            by_group.setdefault(s.trajectory_id.instance_id, []).append(float(s.reward))
        for tid, rewards in by_group.items():
            d = tasks[tid].data["verifiers"]["data"]
            expected = [h.rubric(r, d["answer"]) for r in h.REPLIES[(d["a"], d["b"])]]
            # this step's two repetitions are among the task's recorded replies (a task drawn twice
            # across the 2 steps has 4)
            assert all(any(abs(r - e) < 1e-6 for e in expected) for r in rewards), (rewards, expected)
    for row in history:  # trained on the rubric's rewards: they vary within groups, the loss is finite
        assert row["rollout/num_errored"] == 0.0 and row["reward/std"] > 0.0 and math.isfinite(row["loss"])


def test_loading_by_id_finds_an_installed_package(tmp_path, monkeypatch):
    """An environment package on the import path (as ``pip install`` puts it) loads by its id, in
    verifiers' spellings: ``-`` for ``_``, and hub ids ``owner/name@version``."""
    package = tmp_path / "rljax_vf_installed"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from vf_helpers import ArithTaskset, ChatHarness\n\n__all__ = ['ArithTaskset', 'ChatHarness']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for env_id in ("rljax-vf-installed", "someone/rljax-vf-installed@0.1.0"):
        agent = verifiers_agent(env_id, h.LOCAL)
        assert type(agent.env.taskset) is h.ArithTaskset
        assert [t.data_source for t in agent.tasks(env_name="x")] == [env_id] * 3


def test_through_the_real_gateway_every_call_is_an_exact_step():
    """The real gateway in front of an instant engine (answers closed with end-of-turn): every
    episode is one trajectory of 2 steps, the follow-up's prompt is the first call's exact prompt +
    completion ids + the renderer's bridge, and the reward sits on the last step."""
    from rljax.agents import agent_rollout
    from rljax.chat import ChatMLRenderer, toy_tokenizer
    from rljax.gateway import Gateway
    from rljax.rollout import RolloutConfig

    h.register_env()
    renderer = ChatMLRenderer(toy_tokenizer("chatml"))
    agent = VerifiersAgent(h.ENV_ID, _rows([2, 3, "5"], [4, 4, "8"], [1, 1, "3"]))
    tasks = agent.tasks(env_name="arith")
    config = RolloutConfig(group_size=2, max_tokens=32, max_context_len=512, env_timeout_s=60.0)

    async def main():
        gateway = Gateway(renderer)
        try:
            return await agent_rollout(
                tasks, agent=agent, engine=h.InstantEngine(renderer), gateway=gateway, config=config
            )
        finally:
            await agent.aclose()
            await gateway.stop()

    result = asyncio.run(main())
    assert result.metrics["num_errored"] == 0 and len(result.trajectories) == 6
    for rec in result.trajectories:
        first, second = rec.calls
        assert rec.bridged == [True] and second.prompt.parent == 0
        follow_up = [{"role": "user", "content": h.FOLLOW_UP}]
        expected = renderer.bridge(first.prompt.ids, first.completion.ids, follow_up)
        assert second.prompt.ids == expected
        assert first.prompt.ids == renderer.render_ids(
            [dict(m) for m in next(t for t in tasks if t.id == rec.trajectory_id.instance_id).messages],
            add_generation_prompt=True,
        )
    rewards = sorted(r.reward for r in result.trajectories)
    assert rewards == [0.25, 0.25, 2.25, 2.25, 2.25, 2.25]
    last = [s for s in result.batch.steps if s.is_last_step]
    assert sorted(float(s.reward) for s in last) == rewards and len(result.batch.steps) == 12
