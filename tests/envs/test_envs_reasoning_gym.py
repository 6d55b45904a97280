"""reasoning-gym through rljax: rewards equal each dataset's own score_answer on correct, wrong and
malformed answers over many items; splits never share an item; mixes follow their weights; the
exporter's rows load back and score identically; an embedded-sampler rollout."""

import subprocess
import sys

import pytest
import reasoning_gym  # the `envs` extra (pip install -e .[envs]); CI installs it
from reasoning_gym.utils import extract_answer

from rljax.chat import ChatMLRenderer, toy_tokenizer
from rljax.envs import load_dataset_tasks, make_env, make_tasks, task_to_row, write_rows
from rljax.envs.reasoning_gym import ReasoningGymEnv
from rljax.rollout import RolloutConfig, run_rollout

TOK = toy_tokenizer("chatml")
RENDERER = ChatMLRenderer(TOK)
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
DATASETS = ["leg_counting", "basic_arithmetic", "spell_backward", "word_sorting", "gcd"]


def candidate_texts(answer):
    return [
        f"Let me think.\n<answer>{answer}</answer>",  # correct
        f"<answer> {answer} </answer>",  # whitespace inside the tags
        f"<answer>{answer}x</answer>",  # wrong
        f"<answer>{answer}</answer> then <answer>0</answer>",  # last tag wins
        answer,  # malformed: no tags
        "<answer></answer>",  # empty
        "<answer>unclosed",  # malformed
    ]


def library_reward(name, seed, size, index, text, tag="answer"):
    ds = reasoning_gym.create_dataset(name, seed=seed, size=size)
    return ds.score_answer(extract_answer(text, tag_name=tag), ds[index])


@pytest.mark.parametrize("name", DATASETS)
def test_rewards_equal_the_datasets_own_scorer(name):
    tasks = make_tasks(f"reasoning_gym:{name}", 25, seed=3, split="train")
    assert len({t.id for t in tasks}) == 25
    values = set()
    for task in tasks:
        info = task.extra_info
        answer = task.reward_spec["ground_truth"]
        for text in candidate_texts(answer):
            env = make_env(f"reasoning_gym:{name}")
            env.reset(task)
            _, reward, done, step_info = env.step(text)
            want = library_reward(name, info["seed"], info["size"], info["index"], text)
            assert reward == want and done and step_info["correct"] == (want == 1.0)
            values.add(want)
    assert 1.0 in values and 0.0 in values


def test_splits_never_share_an_item_and_are_reproducible():
    for name in ("leg_counting", "basic_arithmetic"):
        train = make_tasks(f"reasoning_gym:{name}", 200, seed=0, split="train")
        test = make_tasks(f"reasoning_gym:{name}", 60, seed=0, split="test")
        other_seed = make_tasks(f"reasoning_gym:{name}", 60, seed=7, split="test")
        questions = lambda ts: {t.messages[-1]["content"] for t in ts}  # noqa: E731
        assert not questions(train) & questions(test) and not questions(train) & questions(other_seed)
        assert {t.split for t in test} == {"test"}
        again = make_tasks(f"reasoning_gym:{name}", 200, seed=0, split="train")
        assert [t.id for t in again] == [t.id for t in train]
    with pytest.raises(ValueError, match="no dataset"):
        make_tasks("reasoning_gym:not_a_dataset", 2, seed=0)
    with pytest.raises(ValueError, match="fewer distinct"):
        make_tasks("reasoning_gym:gcd", 50, seed=0, max_draws=20)


def test_dataset_config_answer_tag_and_custom_extraction():
    tasks = make_tasks("reasoning_gym:basic_arithmetic", 10, seed=1, min_terms=2, max_terms=2, max_digits=1)
    for task in tasks:
        assert task.extra_info["config_json"] == '{"max_digits": 1, "max_terms": 2, "min_terms": 2}'
        answer = task.reward_spec["ground_truth"]
        env = ReasoningGymEnv(answer_tag="final")
        env.reset(task)
        assert env.step(f"<final>{answer}</final>").reward == 1.0
        env = ReasoningGymEnv(answer_tag=None)
        env.reset(task)
        assert env.step(f" {answer} ").reward == 1.0
        env = ReasoningGymEnv(extract_answer="json:loads")  # any module:fn text -> answer
        env.reset(task)
        assert env.step(f'"{answer}"').reward == 1.0
    with pytest.raises(ValueError, match="this env runs"):
        make_env("reasoning_gym:gcd").reset(tasks[0])


def test_weighted_mix():
    weights = {"leg_counting": 1.0, "gcd": {"weight": 3.0, "config": {"min_value": 1, "max_value": 50}}}
    tasks = make_tasks("reasoning_gym:mix", 200, seed=0, datasets=weights)
    sources = [t.data_source for t in tasks]
    assert 0.65 < sources.count("reasoning_gym/gcd") / 200 < 0.85
    env = make_env("reasoning_gym")  # one env scores every dataset of the mix
    for task in tasks[:40]:
        env = make_env("reasoning_gym")
        env.reset(task)
        info = task.extra_info
        for text in candidate_texts(task.reward_spec["ground_truth"])[:3]:
            env.reset(task)
            want = reasoning_gym.create_dataset(
                info["dataset"],
                seed=info["seed"],
                size=info["size"],
                **__import__("json").loads(info["config_json"]),
            )
            entry = want[info["index"]]
            assert env.step(text).reward == want.score_answer(extract_answer(text), entry)
    test = make_tasks("reasoning_gym:mix", 50, seed=0, split="test", datasets=weights)
    assert not {t.id for t in test} & {t.id for t in tasks}


@pytest.mark.subprocess
@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_exported_rows_load_back_and_score_the_same(tmp_path, suffix):
    out = tmp_path / f"legs.{suffix}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rljax",
            "make-dataset",
            "--source",
            "reasoning_gym:leg_counting",
            "--num",
            "30",
            "--seed",
            "2",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    made = make_tasks("reasoning_gym:leg_counting", 30, seed=2)
    loaded = load_dataset_tasks(out)
    assert [t.id for t in loaded] == [t.id for t in made]
    for a, b in zip(made, loaded, strict=True):
        assert (a.messages, a.reward_spec, a.env, a.data_source, dict(a.extra_info)) == (
            b.messages,
            b.reward_spec,
            b.env,
            b.data_source,
            dict(b.extra_info),
        )
        assert b.data["env_class"] == "reasoning_gym"
        for text in candidate_texts(a.reward_spec["ground_truth"])[:5]:
            env_a, env_b = make_env("reasoning_gym"), make_env("reasoning_gym")
            env_a.reset(a)
            env_b.reset(b)  # regenerates the item from extra_info
            assert env_a.step(text).reward == env_b.step(text).reward
    # an edited question no longer matches its regenerated item: an error, not a wrong score
    row = task_to_row(made[0])
    row["prompt"][-1]["content"] = "edited"
    (edited,) = load_dataset_tasks(write_rows([row], tmp_path / "edited.jsonl"))
    with pytest.raises(ValueError, match="another question"):
        make_env("reasoning_gym").reset(edited)


@pytest.mark.integration
def test_embedded_sampler_rollout_with_reasoning_gym():
    from rljax.inference.sampler import EmbeddedSampler
    from rljax.models import tiny_model

    tasks = make_tasks("reasoning_gym:leg_counting", 3, seed=0, system_prompt=None)
    sampler = EmbeddedSampler(tiny_model(vocab_size=len(TOK)), min_prompt_bucket=64, min_new_tokens_bucket=16)
    result = run_rollout(
        tasks,
        engine=sampler,
        renderer=RENDERER,
        make_env={"reasoning_gym": lambda: make_env("reasoning_gym:leg_counting")},
        config=RolloutConfig(group_size=2, max_tokens=16, seed=0),
        vocab_size=len(TOK),
    )
    assert result.metrics["num_errored"] == 0 and len(result.batch) == 6
    by_id = {t.id: t for t in tasks}
    for step in result.batch:
        task = by_id[step.trajectory_id.instance_id]
        assert list(step.prompt_ids) == RENDERER.render_ids(
            [dict(m) for m in task.messages], add_generation_prompt=True
        )
        ids = list(step.response_ids)
        text = RENDERER.decode(ids[:-1] if ids[-1] == IM_END else ids)
        info = task.extra_info
        assert step.reward == library_reward("leg_counting", info["seed"], info["size"], info["index"], text)
        assert step.is_last_step and len(step.response_logprobs) == len(ids)
