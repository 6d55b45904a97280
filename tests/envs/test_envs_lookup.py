"""Tests of the multi-turn tool-use lookup environment (rljax.envs.tool_lookup)."""

import asyncio
import json

import pytest

from rljax.chat import ChatSession, Qwen3Renderer, Qwen25Renderer, toy_tokenizer
from rljax.chat.tool_calls import make_tool_call
from rljax.envs import COLORS, Action, Task, ToolLookupEnv, make_lookup_tasks, tool_lookup

TABLE = {"zob": "red", "kip": "blue", "mun": "gold"}


def lookup_task(query="zob"):
    return Task("t", {"table": TABLE, "query": query, "answer": TABLE[query]}, env="lookup")


def call_action(name="lookup", **arguments):
    return Action("<tool_call>...</tool_call>", content="", tool_calls=[make_tool_call(name, arguments)])


def test_tasks_are_seeded_and_split_by_object_name():
    train = make_lookup_tasks(200, seed=0, num_entries=4)
    test = make_lookup_tasks(200, seed=0, split="test", num_entries=4)
    train_names = {k for t in train for k in t.data["table"]}
    test_names = {k for t in test for k in t.data["table"]}
    assert not train_names & test_names
    for t in train + test:
        d = t.data
        assert len(d["table"]) == 4 and d["query"] in d["table"] and d["answer"] == d["table"][d["query"]]
        assert set(d["table"].values()) <= set(COLORS)
    assert len({t.id for t in train}) == 200
    assert [t.data for t in make_lookup_tasks(5, seed=1)] == [t.data for t in make_lookup_tasks(5, seed=1)]
    assert [t.data for t in make_lookup_tasks(5, seed=1)] != [t.data for t in make_lookup_tasks(5, seed=2)]
    answers = [t.data["answer"] for t in train]
    assert all(answers.count(c) > 20 for c in COLORS)  # a balanced small answer vocabulary


def test_ideal_episode():
    env = ToolLookupEnv()
    messages = env.reset(lookup_task())
    assert messages[-1] == {"role": "user", "content": "What color is the zob?"}
    assert env.tools[0]["function"]["name"] == "lookup"
    new, reward, done, info = env.step(call_action(key="zob"))
    assert (new, reward, done) == ([{"role": "tool", "content": "red", "name": "lookup"}], 0.0, False)
    assert env.step(Action("Red.", content="Red.")) == ([], 1.0, True, {"answer": "red", "correct": True})


@pytest.mark.parametrize(
    "calls, final, reward",
    [
        ([], "red", 1.0),  # a right answer without the tool still counts
        ([], "blue", 0.0),
        (["<tool_call>\n{broken\n</tool_call>"], "blue", 0.1),  # attempted a call
        ([call_action("search", key="zob")], "blue", 0.1),  # wrong tool
        ([call_action(key="kip")], "blue", 0.2),  # right tool, wrong key
        ([call_action(key="kip"), call_action(key=" ZOB ")], "blue", 0.4),  # right key (normalized)
        ([call_action(key="zob")], "red", 1.0),
        ([call_action(key="zob")], "", 0.4),
    ],
)
def test_partial_credit(calls, final, reward):
    env = ToolLookupEnv()
    env.reset(lookup_task())
    for c in calls:
        new, r, done, _ = env.step(c)
        assert r == 0.0 and not done and len(new) == 1 and new[0]["role"] == "tool"
    _, r, done, info = env.step(final)
    assert done and r == pytest.approx(reward)
    assert info["correct"] == (reward == 1.0)


def test_tool_messages_for_bad_calls():
    env = ToolLookupEnv()
    env.reset(lookup_task())
    assert "unknown tool" in env.step(call_action("search", key="zob")).messages[0]["content"]
    env.reset(lookup_task())
    assert "no object named 'abc'" in env.step(call_action(key="abc")).messages[0]["content"]
    env.reset(lookup_task())
    assert "string argument 'key'" in env.step(call_action(name="lookup", k=1)).messages[0]["content"]
    env.reset(lookup_task())
    # plain text actions are parsed as Hermes tool calls
    text = '<tool_call>\n{"name": "lookup", "arguments": {"key": "mun"}}\n</tool_call>'
    assert env.step(text).messages[0]["content"] == "gold"
    env.reset(lookup_task())
    assert "could not parse" in env.step("<tool_call>\n{nope\n</tool_call>").messages[0]["content"]


def test_truncated_turns_end_the_episode_with_the_credit_earned():
    env = ToolLookupEnv()
    env.reset(lookup_task())
    call = make_tool_call("lookup", {"key": "zob"})
    cut = Action('<tool_call>\n{"name": "lookup", "arguments": {"key": "zob"}}\n</tool_call>xx', content="xx",
                 tool_calls=[call], stopped=False)  # fmt: skip
    assert env.step(cut) == (
        [],
        pytest.approx(0.4),
        True,
        {"answer": "red", "truncated": True, "correct": False},
    )
    env.reset(lookup_task())
    assert env.step(Action("<tool_call>\n{", content="", stopped=False)).reward == pytest.approx(0.1)
    env.reset(lookup_task())
    assert env.step(Action("blue blue", stopped=False)) == (
        [],
        0.0,
        True,
        {"answer": "red", "correct": False},
    )


def test_tool_call_budget_cuts_the_episode_off():
    env = ToolLookupEnv(max_tool_calls=2)
    env.reset(lookup_task())
    assert not env.step(call_action(key="zob")).done
    assert not env.step(call_action(key="zob")).done
    _, reward, done, info = env.step(call_action(key="zob"))
    assert done and reward == pytest.approx(0.4) and info["cut_off"]
    with pytest.raises(ValueError, match="episode ended"):
        env.step("red")


def test_solution_through_renderers_from_ids():
    """The ideal turns, tokenized as a model would sample them, parsed from ids, score 1."""
    tok = toy_tokenizer("chatml")
    task = make_lookup_tasks(1, seed=5)[0]
    for renderer in (Qwen3Renderer(tok), Qwen25Renderer(tok)):
        for compact in (False, True):
            env = ToolLookupEnv(compact=compact)
            session = ChatSession(renderer, env.reset(task), tools=env.tools)
            solution = ToolLookupEnv.solution(task)
            history = list(session.messages)
            rewards = []
            for turn in (solution[0], solution[2]):
                prompt = renderer.render_ids(history, add_generation_prompt=True, tools=env.tools)
                full = renderer.render_ids([*history, turn], add_generation_prompt=False, tools=env.tools)
                assert full[: len(prompt)] == prompt
                completion = full[len(prompt) : -1]  # drop the trailing "\n" after <|im_end|>
                parsed = session.add_completion(completion)
                stopped = completion[:-1]
                action = Action.from_parsed(renderer.decode(stopped), parsed)
                new, reward, done, _ = env.step(action)
                rewards.append(reward)
                if not done:
                    assert new == [solution[1]]
                    session.add_messages(new)
                    assert session.bridged
                    history = [*history, turn, *new]
            assert rewards == [0.0, 1.0]
            if compact:
                assert env.tools is None and "lookup" in session.messages[0]["content"]


def test_async_wrapping_and_errors():
    class AsyncLookup(ToolLookupEnv):
        async def step(self, action):  # environments may be async
            await asyncio.sleep(0)
            return super().step(action)

    env = AsyncLookup()
    env.reset(lookup_task())
    assert asyncio.run(env.step("red")).reward == 1.0
    with pytest.raises(ValueError, match="no 'query'"):
        ToolLookupEnv().reset(Task("x", {"table": {}, "answer": "red"}))
    with pytest.raises(ValueError, match="credit"):
        ToolLookupEnv(credit=(0.1, 0.2))
    with pytest.raises(ValueError, match="split"):
        make_lookup_tasks(1, seed=0, split="dev")
    assert json.dumps(tool_lookup.LOOKUP_TOOL)  # a JSON-serializable tool spec
