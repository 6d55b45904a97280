"""Tests of the single-turn arithmetic environment (rljax.envs.arithmetic)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.chat import ChatMLRenderer, Qwen3Renderer, toy_tokenizer
from rljax.envs import Action, ArithmeticEnv, Task, make_arithmetic_tasks


def task(a, op, b, answer):
    return Task(f"t{a}{op}{b}", {"a": a, "op": op, "b": b, "answer": answer})


def test_tasks_are_seeded_correct_and_split_disjointly():
    train = make_arithmetic_tasks(1000, seed=0, ops=("+", "-", "*"))
    test = make_arithmetic_tasks(1000, seed=0, split="test", ops=("+", "-", "*"))
    assert len(train) + len(test) == 300  # every problem, exactly once
    assert not {t.id for t in train} & {t.id for t in test}
    assert all(t.split == "train" for t in train) and all(t.split == "test" for t in test)
    for t in train + test:
        d = t.data
        assert d["answer"] == str(eval(f"{d['a']} {d['op']} {d['b']}"))  # independent check
        assert t.env == "arithmetic"
    assert [t.id for t in make_arithmetic_tasks(10, seed=3)] == [
        t.id for t in make_arithmetic_tasks(10, seed=3)
    ]
    assert [t.id for t in make_arithmetic_tasks(10, seed=3)] != [
        t.id for t in make_arithmetic_tasks(10, seed=4)
    ]
    assert len(make_arithmetic_tasks(5, seed=0, max_operand=3)) == 5


def test_rewards():
    env = ArithmeticEnv(format_credit=0.1)
    messages = env.reset(task(3, "+", 4, "7"))
    assert messages == [{"role": "user", "content": "What is 3 + 4? Answer with the number only."}]
    assert env.step(" 7\n") == ([], 1.0, True, {"answer": "7", "correct": True})
    for text, reward in [("8", 0.1), ("-2", 0.1), ("seven", 0.0), ("7 apples", 0.0), ("", 0.0)]:
        env.reset(task(3, "+", 4, "7"))
        assert env.step(text).reward == reward, text
    # the parsed content (reasoning removed) is what is scored
    env.reset(task(3, "+", 4, "7"))
    assert env.step(Action("<think>\nhmm\n</think>\n\n7", content="7", reasoning="hmm")).reward == 1.0


def test_last_number_rewards():
    env = ArithmeticEnv(format_credit=0.1, answer_format="last_number")
    cases = [
        ("7", 1.0),
        ("3 + 4 = 7", 1.0),
        ("The answer is 7.", 1.0),
        ("7, no wait, 8", 0.1),  # the last integer counts
        ("3 + 4 = -7", 0.1),
        ("seven", 0.0),
        ("", 0.0),
    ]
    for text, reward in cases:
        env.reset(task(3, "+", 4, "7"))
        assert env.step(text).reward == reward, text
    with pytest.raises(ValueError, match="answer_format"):
        ArithmeticEnv(answer_format="first_number")


@settings(max_examples=30, deadline=None)
@given(
    a=st.integers(0, 9), b=st.integers(0, 9), op=st.sampled_from(["+", "-", "*"]), guess=st.integers(-20, 90)
)
def test_reward_is_exact_match(a, b, op, guess):
    env = ArithmeticEnv()
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    env.reset(task(a, op, b, str(answer)))
    assert env.step(str(guess)).reward == float(guess == answer)


def test_solution_scores_one_and_renders():
    env = ArithmeticEnv(system_prompt="Be brief.")
    t = make_arithmetic_tasks(1, seed=0)[0]
    messages = env.reset(t)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    (answer,) = ArithmeticEnv.solution(t)
    assert env.step(answer["content"]).reward == 1.0
    tok = toy_tokenizer("chatml")
    for renderer in (ChatMLRenderer(tok), Qwen3Renderer(tok)):
        text = renderer.decode(renderer.render_ids(messages + [answer], add_generation_prompt=False))
        assert text.endswith(answer["content"] + "<|im_end|>\n")


def test_errors():
    env = ArithmeticEnv()
    with pytest.raises(ValueError, match="before reset"):
        env.step("1")
    env.reset(task(1, "+", 1, "2"))
    env.step("2")
    with pytest.raises(ValueError, match="episode ended"):
        env.step("2")
    with pytest.raises(ValueError, match="no 'answer'"):
        env.reset(Task("x", {"a": 1, "op": "+", "b": 2}))
    with pytest.raises(ValueError, match="format_credit"):
        ArithmeticEnv(format_credit=1.0)
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_tasks(1, seed=0, ops=("/",))
    with pytest.raises(ValueError, match="split"):
        make_arithmetic_tasks(1, seed=0, split="dev")
