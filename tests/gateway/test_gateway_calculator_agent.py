"""The calculator task through the gateway (:func:`rljax.agents.calculator_agent.calculator_agent`, an
OpenAI-SDK tool loop) records the same token streams and rewards as the env loop.

One scripted policy plays both (a call then the tool's result, a call then a wrong number, a malformed
call, no call at all), SmolLM2's renderer with its tool convention on the toy tokenizer; the env
loop's steps are the reference: each agent step must have the same prompt ids, completion ids and
reward, so the two versions train on identical samples.
"""

from __future__ import annotations

import re

import pytest
from gateway_helpers import Loop

from rljax.agents import agent_rollout
from rljax.agents.calculator_agent import calculator_agent
from rljax.chat import SmolLM2Renderer, toy_tokenizer
from rljax.envs import CalculatorEnv, Task
from rljax.gateway import Gateway
from rljax.inference.engine import Completion
from rljax.rollout import RolloutConfig, rollout

pytestmark = pytest.mark.integration

TOK = toy_tokenizer("chatml")
RENDERER = SmolLM2Renderer(TOK)
END = TOK.convert_tokens_to_ids("<|im_end|>")
CONFIG = RolloutConfig(group_size=1, max_turns=3, max_tokens=200, max_context_len=4096)
CALL = '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


class Policy:
    """Answers from the prompt text: per task (by its question), a call, then the tool's result or a
    wrong number; "malformed" writes broken JSON; "chat" never calls."""

    async def generate(self, prompt_ids, sampling, *, session_id=None) -> Completion:
        text = TOK.decode(list(prompt_ids))
        a, b = map(int, re.findall(r"What is (\d+) \* (\d+)\?", text)[-1])
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
        if a == 111:
            reply = "I think it is 5000."
        elif a == 222 and not results:
            reply = '<tool_call>{"name": "multiply", "arguments": {"a": 222,}}</tool_call>'
        elif not results:
            reply = CALL.format(a=a, b=b)
        else:
            reply = results[-1] if a != 333 else "12345"
        ids = [*TOK.encode(reply, add_special_tokens=False), END][: sampling.max_tokens]
        return Completion(ids, [-0.1] * len(ids), "stop" if ids[-1] == END else "length", weight_version=0)


TASKS = [Task(f"t{a}", {"a": a, "b": 37, "answer": a * 37}, env="calculator") for a in (111, 222, 333, 482)]


def test_the_agent_records_the_env_loops_steps_and_rewards():
    env_result = Loop().run(
        lambda: rollout(TASKS, engine=Policy(), renderer=RENDERER, make_env=CalculatorEnv, config=CONFIG)
    )
    loop = Loop()
    gateway = Gateway(RENDERER)

    async def agents():
        try:
            return await agent_rollout(
                TASKS, agent=calculator_agent, engine=Policy(), gateway=gateway, config=CONFIG
            )
        finally:
            await gateway.stop()

    agent_result = loop.run(agents)
    loop.close()
    rewards = {r.trajectory_id.instance_id: r.reward for r in env_result.trajectories}
    assert rewards == {
        "t111": 0.0,
        "t222": 0.1,
        "t333": 0.4,
        "t482": 1.0,
    }  # by hand: module docstring of the env
    assert {r.trajectory_id.instance_id: r.reward for r in agent_result.trajectories} == rewards
    for env_rec, agent_rec in zip(env_result.trajectories, agent_result.trajectories, strict=True):
        assert env_rec.trajectory_id == agent_rec.trajectory_id
        assert (
            len(env_rec.steps)
            == len(agent_rec.steps)
            == (1 if env_rec.trajectory_id.instance_id == "t111" else 2)
        )
        for e, a in zip(env_rec.steps, agent_rec.steps, strict=True):
            assert list(a.prompt_ids) == list(e.prompt_ids) and list(a.response_ids) == list(e.response_ids)
            assert a.reward == e.reward and a.is_last_step == e.is_last_step
        # multi-turn: the answer's prompt extends the call's prompt + completion (one merged sample)
        assert agent_rec.bridged == env_rec.bridged == [True] * (len(env_rec.steps) - 1)
