"""The calculator tool env (rljax.envs.calculator): tasks, rewards by hand, the ideal episode, errors."""

import pytest

from rljax.chat import ChatSession, SmolLM2Renderer, toy_tokenizer
from rljax.chat.tool_calls import make_tool_call
from rljax.envs import Action, CalculatorEnv, Task, make_calculator_tasks, make_env, make_tasks
from rljax.envs.calculator import last_integer


def task(a=482, b=37):
    return Task("t", {"a": a, "b": b, "answer": a * b}, env="calculator")


def call(name="multiply", **arguments):
    return Action("<tool_call>...</tool_call>", content="", tool_calls=[make_tool_call(name, arguments)])


def test_tasks_are_seeded_distinct_products_in_range_and_split():
    train = make_calculator_tasks(300, seed=0)
    test = make_calculator_tasks(300, seed=0, split="test")
    assert len(train) == len({t.id for t in train}) == 300 and len(test) == 300
    assert not {t.id for t in train} & {t.id for t in test}
    for t in train + test:
        d = t.data
        assert 100 <= d["a"] <= 999 and 10 <= d["b"] <= 99 and d["answer"] == d["a"] * d["b"]
    assert [t.id for t in make_calculator_tasks(5, seed=1)] == [
        t.id for t in make_calculator_tasks(5, seed=1)
    ]
    assert make_tasks("calculator", 3, seed=0) == make_calculator_tasks(3, seed=0)  # the registry's maker
    small = make_calculator_tasks(100, seed=0, a_range=(2, 3), b_range=(2, 3), test_fraction=0.0)
    assert sorted(t.id for t in small) == ["calc:2*2", "calc:2*3", "calc:3*2", "calc:3*3"]  # all there are


def test_ideal_episode_and_the_answer_forms():
    env = make_env("calculator")
    messages = env.reset(task())
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1][
        "content"
    ] == "What is 482 * 37?"
    new, reward, done, _ = env.step(call(a=482, b=37))
    assert (new, reward, done) == ([{"role": "tool", "content": "17834", "name": "multiply"}], 0.0, False)
    for answer, correct in [
        ("17834", True),
        ("482 * 37 = 17,834.", True),
        ("17835", False),
        ("no idea", False),
    ]:
        env = CalculatorEnv()
        env.reset(task())
        env.step(call(a=37, b=482))  # either order is the right call
        _, reward, done, info = env.step(answer)
        assert done and info["correct"] is correct and info["used_tool"]
        assert reward == (1.0 if correct else 0.4)  # else the credit of the right call
    assert last_integer("-12 then 7") == 7 and last_integer("") is None


@pytest.mark.parametrize(
    "action, credit, tool_reply",
    [
        (call(a=1, b=2), 0.2, "2"),  # a valid call of other numbers
        (call(a="482", b=37), 0.1, "error: multiply needs integer arguments 'a' and 'b'"),
        (call("add", a=482, b=37), 0.1, "error: unknown tool 'add'; the only tool is 'multiply'"),
        ('<tool_call>{"name": "multiply", "arguments": {"a": 4}</tool_call>', 0.1, None),  # text: parsed
    ],
)
def test_partial_credit_and_tool_errors(action, credit, tool_reply):
    env = CalculatorEnv()
    env.reset(task())
    new, reward, done, _ = env.step(action)
    assert (reward, done) == (0.0, False) and new[0]["role"] == "tool"
    if tool_reply is None:
        assert new[0]["content"].startswith("error: could not parse the tool call (invalid JSON")
    else:
        assert new[0]["content"] == tool_reply
    _, reward, done, info = env.step("12345")  # a wrong final answer keeps the credit earned
    assert (reward, done, info["correct"]) == (credit, True, False)


def test_truncated_and_cut_off_calls_end_the_episode_with_their_credit():
    env = CalculatorEnv()
    env.reset(task())
    right = make_tool_call("multiply", {"a": 482, "b": 37})
    truncated = Action("<tool_call>...", content="", tool_calls=[right], stopped=False)
    _, reward, done, info = env.step(truncated)
    assert (reward, done, info["truncated"]) == (0.4, True, True)
    env = CalculatorEnv(max_tool_calls=1)
    env.reset(task())
    env.step(call(a=1, b=1))
    _, reward, done, info = env.step(call(a=482, b=37))
    assert (reward, done, info["cut_off"]) == (0.4, True, True)
    with pytest.raises(ValueError, match="step\\(\\) after the episode ended"):
        env.step("1")


def test_the_solution_renders_token_exactly_and_wins():
    """The warm start's demonstration: a SmolLM2 session over env.solution reaches reward 1."""
    renderer = SmolLM2Renderer(toy_tokenizer("chatml"))
    env = CalculatorEnv()
    t = task(905, 12)
    session = ChatSession(renderer, env.reset(t), tools=env.tools)
    solution = CalculatorEnv.solution(t)
    assert [m["role"] for m in solution] == ["assistant", "tool", "assistant"]
    reward = None
    for m in solution:
        if m["role"] != "assistant":
            continue
        full = renderer.render_ids([*session.messages, m], add_generation_prompt=False, tools=env.tools)
        completion = full[len(session.prompt_ids) :]
        completion = completion[: completion.index(renderer.stop_token_ids()[0]) + 1]
        parsed = session.add_completion(completion)
        new, reward, done, _ = env.step(Action.from_parsed(renderer.decode(completion[:-1]), parsed))
        if not done:
            session.add_messages(new)
            assert session.bridged
    assert reward == 1.0


def test_the_recipe_switches_to_the_gateway_agent_with_its_documented_override():
    """``smollm2_tools`` documents one ``--config`` override that runs its task as the OpenAI-SDK agent;
    a ConfigDict refuses keys it lacks, so the recipe's env section must hold the key (empty: the env
    loop)."""
    import re

    from rljax.cli.common import config_overrides, unknown_override
    from rljax.recipes import smollm2_tools
    from rljax.run.config import parse_run_config

    (override,) = re.findall(r"--config\.envs\.\S+", smollm2_tools.__doc__)
    path, value = override.removeprefix("--config.").split("=")
    c = smollm2_tools.get_config()
    assert parse_run_config(c).envs["calculator"].agent == ""
    assert unknown_override(c, config_overrides([override])) is None
    c.envs.calculator.agent = value
    assert parse_run_config(c).envs["calculator"].agent == "rljax.agents.calculator_agent:calculator_agent"
