"""Verifiable rewards: math_verify (boxed or plain answers) agrees with the math-verify package
itself and with known equivalences; user reward functions ``module:fn``; the ``verifiable`` env
runs verl rows through the agent loop."""

import random
import threading

import pytest
from math_verify import parse, verify

from rljax.chat import ChatMLRenderer, toy_tokenizer
from rljax.envs import Task, load_dataset_tasks, make_env, rewards, write_rows
from rljax.inference.engine import Completion
from rljax.rollout import RolloutConfig, run_rollout

TOK = toy_tokenizer("chatml")
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")


KNOWN = [
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("so x = \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{72}", "72", 1.0),
    ("Therefore the final answer is $72$.", "72", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{73}", "72", 0.0),
    ("I don't know", "72", 0.0),
    ("", "72", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
]


@pytest.mark.parametrize("text, gold, want", KNOWN)
def test_math_verify_known_cases(text, gold, want):
    assert rewards.score({"method": "math_verify", "ground_truth": gold}, text) == want
    assert rewards.score({"method": "rule", "ground_truth": gold}, text) == want  # verl's style


def test_math_verify_agrees_with_the_package_over_many_items():
    rng = random.Random(0)
    seen = set()
    for _ in range(60):
        p, q = rng.randint(1, 40), rng.randint(1, 12)
        gold = f"\\frac{{{p}}}{{{q}}}" if rng.random() < 0.5 else str(p)
        value = p / q if "frac" in gold else p
        for text in (
            f"\\boxed{{{gold}}}",
            f"The result is ${value}$",
            f"\\boxed{{{p + 1}}}",
            "no answer here",
            f"\\boxed{{{gold}",
        ):
            got = rewards.score({"method": "math_verify", "ground_truth": gold}, text)
            ref = float(
                verify(
                    parse(f"${gold}$", parsing_timeout=None),
                    parse(text, parsing_timeout=None),
                    timeout_seconds=None,
                )
            )
            assert got == ref
            seen.add(got)
    assert seen == {0.0, 1.0}


def test_math_verify_works_off_the_main_thread():
    out = []
    t = threading.Thread(
        target=lambda: out.append(rewards.score({"method": "math_verify", "ground_truth": "4"}, "\\boxed{4}"))
    )
    t.start()
    t.join()
    assert out == [1.0]  # math-verify's signal-based timeouts would raise here


def test_user_reward_functions_and_errors(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    bonus = extra_info.get('bonus', 0.0)\n"
        "    return {'score': float(solution_str.strip() == ground_truth) + bonus, 'src': data_source}\n"
        "def bad(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = Task("t", data_source="mine", extra_info={"bonus": 0.25})
    spec = {"method": "my_rewards:compute_score", "ground_truth": "yes"}
    assert rewards.score(spec, " yes ", task=task) == 1.25 and rewards.score(spec, "no", task=task) == 0.25
    with pytest.raises(ValueError, match="not a finite number"):
        rewards.score({"method": "my_rewards:bad", "ground_truth": "x"}, "x")
    with pytest.raises(ValueError, match="cannot import"):
        rewards.score({"method": "no_such_module_xyz:f", "ground_truth": "x"}, "x")
    with pytest.raises(ValueError, match="unknown reward method"):
        rewards.score({"method": "fuzzy", "ground_truth": "x"}, "x")
    with pytest.raises(ValueError, match="needs a ground_truth"):
        rewards.score({"method": "math_verify"}, "x")
    # the verifiable env: per-row methods, or one reward_fn for every row
    env = make_env("verifiable", reward_fn="my_rewards:compute_score")
    env.reset(
        Task(
            "u",
            messages=[{"role": "user", "content": "?"}],
            reward_spec={"method": "rule", "ground_truth": "yes"},
        )
    )
    assert env.step("yes").reward == 1.0


class TextEngine:
    def __init__(self, script):
        self.script = script

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        ids = TOK.encode(self.script(session_id), add_special_tokens=False) + [IM_END]
        return Completion(tuple(ids), tuple([-0.1] * len(ids)), "stop", 0)


def test_verl_rows_through_the_verifiable_env(tmp_path):
    rows = [
        {
            "data_source": "lighteval/MATH",
            "prompt": [{"role": "user", "content": f"What is {i}/4 in lowest terms?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": f"\\frac{{{i}}}{{4}}"},
            "extra_info": {"index": i},
        }
        for i in range(1, 9)
    ]
    tasks = load_dataset_tasks(write_rows(rows, tmp_path / "math.parquet"), env="math")
    answer = {t.id: (i + 1) / 4 for i, t in enumerate(tasks)}
    result = run_rollout(
        tasks,
        engine=TextEngine(
            lambda sid: f"\\boxed{{{answer[sid.split('#')[0]] + (0 if sid.endswith('#0') else 1)}}}"
        ),
        renderer=ChatMLRenderer(TOK),
        make_env={"math": lambda: make_env("verifiable")},
        config=RolloutConfig(group_size=2),
    )
    rewards_by_rep = {}
    for step in result.batch:
        rewards_by_rep.setdefault(step.trajectory_id.repetition_id, []).append(step.reward)
    assert rewards_by_rep == {0: [1.0] * 8, 1: [0.0] * 8}
