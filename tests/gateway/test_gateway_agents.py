"""Agent rollouts through the gateway: context management, 256 concurrent rollouts, errors,
posted rewards, agent commands, and the run config of agent envs."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest
from gateway_helpers import CHATML, TOK, TOOL_CALL, Loop, Scripted

from rljax.agents import CommandAgent, agent_rollout, load_agent
from rljax.chat.qwen3 import Qwen3Renderer
from rljax.data.merge import plan_merge
from rljax.envs.base import Task
from rljax.gateway import Gateway
from rljax.inference.sampler import EmbeddedSampler
from rljax.models.tiny import tiny_model
from rljax.rollout import RolloutConfig
from rljax.run.config import parse_run_config
from rljax.run.tasks import build_env_tasks

CONFIG = RolloutConfig(group_size=1, max_tokens=256, max_context_len=2048, env_timeout_s=60.0)


def run(loop: Loop, tasks, agent, engine, *, renderer=CHATML, config=CONFIG, **kw):
    gateway = Gateway(renderer)

    async def main():
        try:
            return await agent_rollout(
                tasks, agent=agent, engine=engine, gateway=gateway, config=config, **kw
            )
        finally:
            await gateway.stop()

    return loop.run(main), gateway


def texts(rec) -> list[str]:
    return [TOK.decode(list(s.prompt_ids)) for s in rec.steps]


# -- context management: sample counts after merging --------------------------------------------


async def drops_reasoning(task, client):
    """A tool loop that sends its replies back WITHOUT their reasoning (as many harnesses do)."""
    msgs = [{"role": "user", "content": "What color is the zob?"}]
    seen = []
    for _ in range(4):
        r = await client.chat.completions.create(model="m", messages=msgs)
        m = r.choices[0].message
        seen.append(m.model_extra.get("reasoning_content"))
        if not m.tool_calls:
            break
        msgs.append(
            {"role": "assistant", "content": m.content, "tool_calls": [t.model_dump() for t in m.tool_calls]}
        )
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "red"})
    return {"reward": 1.0, "metrics": {"reasoning_seen": float(all(seen))}}


def test_dropped_reasoning_still_extends_one_sample(loop):
    def script(prompt: str) -> str:
        calls = prompt.count("<tool_response>")
        return "<think>\nplan\n</think>\n\n" + (TOOL_CALL if calls < 2 else "red")

    result, _ = run(loop, [Task("q")], drops_reasoning, Scripted(script), renderer=Qwen3Renderer(TOK))
    (rec,) = result.trajectories
    assert not rec.errored and rec.num_turns == 3 and rec.env_metrics == {"reasoning_seen": 1.0}
    assert rec.bridged == [True, True]
    assert plan_merge(rec.steps).samples == ((0, 1, 2),)  # one sample: the sampled reasoning kept
    assert all("plan" in TOK.decode(list(s.response_ids)) for s in rec.steps)


async def summarizes(task, client):
    """Two turns, then the history is replaced by a summary, then two more turns."""
    msgs = [{"role": "user", "content": "first question"}]
    for turn in range(4):
        if turn == 2:
            msgs = [{"role": "user", "content": "summary of the talk so far; next question"}]
        r = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"more {turn}"},
        ]
    return 0.5


async def with_sub_agent(task, client):
    """The main agent delegates to a sub-agent (its own conversation, two calls), then goes on."""
    main = [{"role": "system", "content": "MAIN agent"}, {"role": "user", "content": "main task"}]
    r0 = await client.chat.completions.create(model="m", messages=main)
    sub = [{"role": "user", "content": "SUB task"}]
    r1 = await client.chat.completions.create(model="m", messages=sub)
    sub += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "SUB more"}]
    r2 = await client.chat.completions.create(model="m", messages=sub)
    main += [r0.choices[0].message.model_dump(exclude_none=True)]
    main += [{"role": "user", "content": "sub-agent says " + r2.choices[0].message.content}]
    await client.chat.completions.create(model="m", messages=main)
    return 1.0


@pytest.mark.parametrize(
    "agent, samples",
    [(summarizes, ((0, 1), (2, 3))), (with_sub_agent, ((1, 2), (0, 3)))],
)
def test_summary_and_sub_agent_samples(loop, agent, samples):
    result, _ = run(loop, [Task("q")], agent, Scripted(lambda p: "ok"))
    (rec,) = result.trajectories
    assert not rec.errored and rec.num_turns == 4
    plan = plan_merge(rec.steps)
    assert plan.samples == samples
    # no sample mixes two histories: every step of a sample starts with its first step's prompt
    for idx in plan.samples:
        head = rec.steps[idx[0]].prompt_ids
        assert all(list(rec.steps[i].prompt_ids[: len(head)]) == list(head) for i in idx)
    if agent is with_sub_agent:
        t = texts(rec)
        assert all("SUB" in t[i] and "MAIN" not in t[i] for i in (1, 2))
        assert all("MAIN" in t[i] and "SUB task" not in t[i] for i in (0, 3))


# -- many concurrent rollouts ----------------------------------------------------------------------


async def two_calls(task, client):
    msgs = [{"role": "user", "content": f"id <{task.id}>"}]
    r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
    msgs += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": f"again <{task.id}>"},
    ]
    await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
    return {"reward": float(task.data["n"]), "metrics": {"n": task.data["n"]}}


class Counting:
    def __init__(self, engine):
        self.engine, self.calls, self.weight_version = engine, 0, 0

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        self.calls += 1
        return await self.engine.generate(prompt_ids, sampling, session_id=session_id)


def test_256_concurrent_rollouts_no_call_lost_or_misattributed(loop):
    engine = Counting(
        EmbeddedSampler(
            tiny_model(vocab_size=len(TOK), num_layers=1),
            max_batch_size=64,
            min_batch_bucket=64,
            min_prompt_bucket=64,
            min_new_tokens_bucket=4,
            batch_wait_ms=5.0,
        )  # fmt: skip
    )
    tasks = [Task(f"t{i}", {"n": i}) for i in range(128)]
    config = RolloutConfig(group_size=2, max_tokens=3, max_context_len=256, max_concurrency=256, seed=0)
    result, gateway = run(loop, tasks, two_calls, engine, config=config)
    assert len(result.trajectories) == 256 and result.metrics["num_errored"] == 0
    assert engine.calls == 512 and len(result.batch) == 512 and len(gateway.sessions) == 0
    for rec in result.trajectories:
        tid = rec.trajectory_id.instance_id
        assert rec.reward == float(tid[1:]) and len(rec.calls) == 2
        assert [s.trajectory_id for s in rec.steps] == [rec.trajectory_id] * 2
        assert rec.calls[0].prompt.messages[0]["content"] == f"id <{tid}>"
        assert rec.calls[1].prompt.messages[-1]["content"] == f"again <{tid}>"
        first, second = texts(rec)
        assert f"id <{tid}>" in first and f"again <{tid}>" in second


# -- errors, rewards, sync agents ------------------------------------------------------------------


async def good(task, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return 1.0


async def raises(task, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the harness broke")


async def silent(task, client):
    return 1.0


async def slow(task, client):
    await asyncio.sleep(600)
    return 1.0


async def bad_reward(task, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return "lots"


async def posts(task, client):
    """Posts a per-call reward on its first call and its final reward; returns None."""
    msgs = [{"role": "user", "content": "hi"}]
    r = await client.chat.completions.create(model="m", messages=msgs)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
    await client.chat.completions.create(model="m", messages=msgs)
    url, auth = str(client.base_url).rstrip("/"), {"Authorization": f"Bearer {client.api_key}"}
    async with httpx.AsyncClient() as http:
        await http.post(url + "/rewards", json={"reward": 0.25, "completion_id": r.id}, headers=auth)
        await http.post(url + "/rewards", json={"reward": 0.75}, headers=auth)


def sync_agent(task, client, *, bonus):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return len(r.choices[0].message.content) + bonus


def test_agent_errors_are_counted_masked_and_the_rollout_goes_on(loop):
    agents = dict(good=good, raises=raises, silent=silent, bad=bad_reward, posts=posts, sync=sync_agent)
    tasks = [Task(f"task-{name}", env=name) for name in agents]
    config = RolloutConfig(group_size=1, max_tokens=16, max_context_len=512, env_timeout_s=300.0)
    result, gateway = run(loop, tasks, agents, Scripted(lambda p: "ok"), config=config,
                          agent_kwargs={"sync": {"bonus": 0.5}})  # fmt: skip
    recs = {r.env: r for r in result.trajectories}
    m = result.metrics
    assert (m["num_errored"], m["errored_env"]) == (3, 3)
    assert "the harness broke" in recs["raises"].error
    assert "no LLM call" in recs["silent"].error and recs["silent"].steps == []
    for name in ("raises", "bad"):  # their recorded calls stay, masked with reward 0
        (step,) = recs[name].steps
        assert set(step.loss_mask) == {0} and step.reward == 0.0 and step.stop_reason == "error"
    assert [s.reward for s in recs["posts"].steps] == [0.25, 0.75] and recs["posts"].reward == 0.75
    assert recs["good"].reward == 1.0 and recs["sync"].reward == 2.5  # len("ok") + bonus
    assert m["reward_mean"] == pytest.approx((1.0 + 0.75 + 2.5) / 3)  # errored ones left out
    assert len(gateway.sessions) == 0
    assert recs["good"].calls[0].returned == {"role": "assistant", "content": "ok"}


def test_an_agent_past_env_timeout_errors_its_trajectory(loop):
    config = RolloutConfig(group_size=2, max_tokens=16, max_context_len=512, env_timeout_s=0.5,
                           raise_on_all_errored=False)  # fmt: skip
    result, gateway = run(loop, [Task("a")], slow, Scripted(lambda p: "ok"), config=config)
    assert result.metrics["errored_env_timeout"] == 2 and len(gateway.sessions) == 0
    assert all("env_timeout_s=0.5" in r.error and r.steps == [] for r in result.trajectories)


def test_an_agent_rollout_where_every_trajectory_errors_raises(loop):
    from rljax.rollout import RolloutError

    with pytest.raises(RolloutError, match="the harness broke"):
        run(loop, [Task("a")], raises, Scripted(lambda p: "ok"))


@pytest.mark.subprocess
def test_agent_command(loop, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, openai\n"
        "task = json.loads(os.environ['RLJAX_TASK'])\n"
        "msgs = [{'role': 'user', 'content': task['id']}]\n"
        "r = openai.OpenAI().chat.completions.create(model='m', messages=msgs)\n"
        "print('some log line')\n"
        "print(json.dumps({'reward': float(r.choices[0].message.content == 'ok'), 'metrics': {'k': 1}}))\n"
    )
    agent = CommandAgent(f"{sys.executable} {script}")
    config = RolloutConfig(group_size=2, max_tokens=16, max_context_len=512, env_timeout_s=120.0)
    result, _ = run(loop, [Task("x"), Task("y")], agent, Scripted(lambda p: "ok"), config=config)
    assert [r.reward for r in result.trajectories] == [1.0] * 4
    assert [r.calls[0].prompt.messages for r in result.trajectories][0] == [{"role": "user", "content": "x"}]
    failing = CommandAgent(f"{sys.executable} -c 'import sys; sys.exit(3)'")
    config = RolloutConfig(group_size=1, max_tokens=16, max_context_len=512, raise_on_all_errored=False)
    result, _ = run(loop, [Task("z")], failing, Scripted(lambda p: "ok"), config=config)
    assert "exited with 3" in result.trajectories[0].error


# -- the run config ------------------------------------------------------------------------------


def test_agent_env_config(tmp_path):
    assert load_agent("rljax.agents.lookup_agent:lookup_agent").__name__ == "lookup_agent"
    for bad in ("no_colon", "rljax.gateway:nope"):
        with pytest.raises(ValueError, match="agent"):
            build_env_tasks(parse_run_config({"envs": {"a": {"env": "lookup", "agent": bad}}}))
    with pytest.raises(ValueError, match="not both"):
        parse_run_config({"envs": {"a": {"agent": "m:f", "agent_command": "run"}}})
    with pytest.raises(ValueError, match="task maker"):
        build_env_tasks(
            parse_run_config({"envs": {"mine": {"agent": "rljax.agents.lookup_agent:lookup_agent"}}})
        )
    rows = tmp_path / "rows.jsonl"
    row = {"prompt": [{"role": "user", "content": "2+2?"}], "reward_spec": {"method": "exact_match",
           "ground_truth": "4"}, "env_class": "ignored", "data_source": "toy"}  # fmt: skip
    rows.write_text("\n".join(json.dumps(row | {"extra_info": {"i": i}}) for i in range(3)))
    cfg = parse_run_config(
        {"envs": {"mine": {"agent_command": "my-agent", "dataset": {"train": str(rows)}, "kwargs": {"k": 1}}}}
    )
    et = build_env_tasks(cfg)
    assert [t.env for t in et.train] == ["mine"] * 3 and et.train[0].messages[0]["content"] == "2+2?"
    assert isinstance(et.agents["mine"], CommandAgent) and et.agent_kwargs == {"mine": {"k": 1}}
    with pytest.raises(ValueError, match="agent"):
        et.factories["mine"]()
    cfg = parse_run_config({"envs": {"lookup": {"agent": "rljax.agents.lookup_agent:lookup_agent",
                                                "num_train_tasks": 4}}})  # fmt: skip
    et = build_env_tasks(cfg)
    assert len(et.train) == 4 and type(et.factories["lookup"]()).__name__ == "ToolLookupEnv"
