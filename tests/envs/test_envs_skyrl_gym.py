"""skyrl-gym environments, unchanged, through the rljax agent loop: rewards equal skyrl-gym's own
scorers on correct, wrong and malformed answers; per-turn rewards land on their steps; close,
metrics, user-registered envs, the postprocessed_action refusal; an embedded-sampler rollout."""

import random

import pytest
import skyrl_gym  # the `envs` extra (pip install -e .[envs]); CI installs it
from skyrl_gym.envs.aime import utils as aime_utils
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.gsm8k import utils as gsm8k_utils

from rljax.chat import ChatMLRenderer, toy_tokenizer
from rljax.envs import Task, load_dataset_tasks, make_env, write_rows
from rljax.envs.skyrl_gym import SkyRLGymEnv
from rljax.inference.engine import Completion
from rljax.rollout import RolloutConfig, run_rollout

TOK = toy_tokenizer("chatml")
RENDERER = ChatMLRenderer(TOK)
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")


class TextEngine:
    """Answers ``script(session_id, turn) -> text`` (tokenized + end-of-turn); logs the ids."""

    def __init__(self, script):
        self.script, self.log = script, {}

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        calls = self.log.setdefault(session_id, [])
        ids = TOK.encode(self.script(session_id, len(calls)), add_special_tokens=False) + [IM_END]
        c = Completion(tuple(ids), tuple([-0.1] * len(ids)), "stop", 0)
        calls.append((list(prompt_ids), c))
        return c


def gsm8k_rows(n, env_class="gsm8k", seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        gt = str(rng.randint(0, 5000))
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {
                        "role": "user",
                        "content": f"Problem {i}. Think step by step, then give the answer after '####'.",
                    }
                ],
                "env_class": env_class,
                "reward_spec": {"method": "rule", "ground_truth": gt},
                "extra_info": {"index": i, "split": "train"},
            }
        )
    return rows


def answers(gt):
    """Correct, wrong, malformed and tricky answers for a gsm8k ground truth."""
    return [
        f"So the total is {gt}.\n#### {gt}",  # correct
        f"#### {int(gt) + 1}",  # wrong
        f"The answer is {gt}",  # malformed: no ####
        f"#### {int(gt):,}",  # commas are stripped by the scorer
        "",  # empty
        f"#### ${gt}",  # dollar sign
    ]


def test_gsm8k_rewards_equal_the_library_scorer(tmp_path):
    tasks = load_dataset_tasks(write_rows(gsm8k_rows(50), tmp_path / "g.parquet"))
    seen = set()
    for task in tasks:
        gt = task.reward_spec["ground_truth"]
        for text in answers(gt):
            env = make_env("skyrl_gym:gsm8k")
            assert env.reset(task) == [dict(m) for m in task.messages]
            messages, reward, done, info = env.step(text)
            want = float(gsm8k_utils.compute_score(text, gt))
            assert reward == want and done and messages == []
            seen.add(want)
            env.close()
    assert seen == {0.0, 1.0}


def test_aime_verl_rows_through_the_dispatching_adapter(tmp_path):
    rng = random.Random(1)
    rows = [
        {
            "data_source": "aime",
            "prompt": [{"role": "user", "content": f"AIME problem {i}"}],
            "env_class": "aime",
            "reward_model": {"style": "rule", "ground_truth": str(rng.randint(0, 999))},
            "extra_info": {"index": i},
        }
        for i in range(40)
    ]
    tasks = load_dataset_tasks(write_rows(rows, tmp_path / "aime.jsonl"), env="math")
    assert {t.env for t in tasks} == {"math"}  # the trainer's name; env_class stays in the row
    scores = set()
    for task in tasks:
        gt = task.data["reward_model"]["ground_truth"]
        for text in (
            f"Answer: {gt}",
            f"Answer: {int(gt) + 3}",
            f"\\boxed{{{gt}}}",
            "no idea",
            f"Answer: \\boxed{{{gt}}}",
        ):
            env = make_env("skyrl_gym")  # picks aime from the row's env_class
            env.reset(task)
            _, reward, done, info = env.step(text)
            ref = aime_utils.compute_score(text, gt)
            assert reward == ref["score"] and info["acc"] == ref["acc"] and done
            scores.add(reward)
    assert len(scores) >= 2


def test_multi_turn_rewards_arrive_on_their_steps(tmp_path):
    rows = gsm8k_rows(4, env_class="gsm8k_multi_turn", seed=3)
    for r in rows:
        r["extra_info"]["max_turns"] = 3
    tasks = load_dataset_tasks(write_rows(rows, tmp_path / "mt.jsonl"))
    gts = {t.id: t.reward_spec["ground_truth"] for t in tasks}
    # rep 0: malformed, formatted-wrong, correct; rep 1: correct at once; rep 2: never correct
    plans = {
        0: lambda gt: ["I am not sure", f"#### {int(gt) + 1}", f"#### {gt}"],
        1: lambda gt: [f"#### {gt}"],
        2: lambda gt: ["hmm", "hmm", "#### -1"],
    }

    def script(sid, turn):
        task_id, rep = sid.rsplit("#", 1)
        return plans[int(rep)](gts[task_id])[turn]

    result = run_rollout(
        tasks,
        engine=TextEngine(script),
        renderer=RENDERER,
        make_env={"gsm8k_multi_turn": lambda: make_env("skyrl_gym:gsm8k_multi_turn")},
        config=RolloutConfig(group_size=3, max_turns=8),
    )
    by_traj = {}
    for step in result.batch:
        by_traj.setdefault(str(step.trajectory_id), []).append(step)
    for task in tasks:
        gt = gts[task.id]
        for rep, plan in plans.items():
            steps = by_traj[f"{task.id}#{rep}"]
            texts = plan(gt)
            want = [
                float(gsm8k_utils.compute_score(t, gt, method="strict", format_score=0.2 / 3, score=1.0))
                for t in texts
            ]
            assert [s.reward for s in steps] == pytest.approx(want)  # per turn, on its own step
            assert [s.is_last_step for s in steps] == [False] * (len(texts) - 1) + [True]
            assert all(all(s.loss_mask) for s in steps)
    assert result.metrics["env/gsm8k_multi_turn/avg_steps"] == pytest.approx((3 + 1 + 3) / 3)
    # the env's follow-up user messages were bridged into the next prompt
    first = by_traj[f"{tasks[0].id}#0"]
    assert "tentative numeric answer" in RENDERER.decode(first[1].prompt_ids[first[0].num_tokens :])


class CountdownEnv(BaseTextEnv):
    """A user-registered env: says 'again' until the model writes 'stop'; reward 0.5 per turn."""

    closed = 0

    def __init__(self, env_config=None, extras={}):  # noqa: B006 - skyrl-gym's signature
        super().__init__()
        self.limit = int(extras["extra_info"]["limit"])
        self.rewrite = bool(getattr(env_config, "rewrite", False))

    def step(self, action):
        self.turns += 1
        done = "stop" in action or self.turns >= self.limit
        out = BaseTextEnvStepOutput(
            observations=[] if done else [{"role": "user", "content": "again"}],
            reward=0.5 * self.turns,
            done=done,
            metadata={"turn": self.turns},
        )
        if self.rewrite:
            out["postprocessed_action"] = action[:3]
        return out

    def close(self):
        CountdownEnv.closed += 1

    def get_metrics(self):
        return {"turns": self.turns}


def test_user_registered_env_close_metrics_and_postprocessed_action():
    if "rljax_test_countdown" not in skyrl_gym.registry:
        skyrl_gym.register(id="rljax_test_countdown", entry_point=CountdownEnv)
    tasks = [
        Task(
            f"c{i}", env="count", messages=[{"role": "user", "content": "count"}], extra_info={"limit": 2 + i}
        )
        for i in range(3)
    ]
    CountdownEnv.closed = 0
    result = run_rollout(
        tasks,
        engine=TextEngine(lambda sid, turn: "go on"),
        renderer=RENDERER,
        make_env={"count": lambda: make_env("skyrl_gym:rljax_test_countdown")},
        config=RolloutConfig(group_size=2, max_turns=8),  # the env ends episodes itself (up to 4 turns)
    )
    per = {}
    for step in result.batch:
        per.setdefault(str(step.trajectory_id), []).append(step.reward)
    want = {"c0": [0.5, 1.0], "c1": [0.5, 1.0, 1.5], "c2": [0.5, 1.0, 1.5, 2.0]}
    assert per == {f"{t}#{r}": v for t, v in want.items() for r in range(2)}
    assert CountdownEnv.closed == 6
    assert result.metrics["env/count/turns"] == pytest.approx(3.0)
    assert result.trajectories[0].infos == [{"turn": 1}, {"turn": 2}]
    # an env that rewrites the action is refused (the trajectory errors, with a clear message) ...
    rewriting = lambda **kw: make_env("skyrl_gym:rljax_test_countdown", env_config={"rewrite": True}, **kw)  # noqa: E731
    refused = run_rollout(
        tasks[:1],
        engine=TextEngine(lambda sid, turn: "go on"),
        renderer=RENDERER,
        make_env={"count": rewriting},
        config=RolloutConfig(group_size=1, raise_on_all_errored=False),
    )
    (rec,) = refused.trajectories
    assert rec.error_kind == "env" and "postprocessed_action" in rec.error and "keep_sampled" in rec.error
    assert list(refused.batch)[-1].stop_reason == "error"
    # ... unless the user keeps the sampled tokens: the rewrite is only recorded
    kept = run_rollout(
        tasks[:1],
        engine=TextEngine(lambda sid, turn: "go on"),
        renderer=RENDERER,
        make_env={"count": lambda: rewriting(on_postprocessed_action="keep_sampled")},
        config=RolloutConfig(group_size=1),
    )
    assert [i["postprocessed_action"] for i in kept.trajectories[0].infos] == ["go ", "go "]
    assert [s.reward for s in kept.batch] == [0.5, 1.0]
    with pytest.raises(ValueError, match="no registered env"):
        SkyRLGymEnv("no_such_env")
    with pytest.raises(ValueError, match="on_postprocessed_action"):
        SkyRLGymEnv("gsm8k", on_postprocessed_action="rewrite")
    with pytest.raises(ValueError, match="names no env_class"):
        SkyRLGymEnv().reset(Task("x", messages=[{"role": "user", "content": "q"}]))


@pytest.mark.integration
def test_embedded_sampler_rollout_with_skyrl_gym(tmp_path):
    from rljax.inference.sampler import EmbeddedSampler
    from rljax.models import tiny_model

    tasks = load_dataset_tasks(write_rows(gsm8k_rows(3), tmp_path / "g.jsonl"))
    sampler = EmbeddedSampler(tiny_model(vocab_size=len(TOK)), min_prompt_bucket=64, min_new_tokens_bucket=16)
    config = RolloutConfig(group_size=2, max_tokens=16, seed=0)
    result = run_rollout(
        tasks,
        engine=sampler,
        renderer=RENDERER,
        make_env={"gsm8k": lambda: make_env("skyrl_gym:gsm8k")},
        config=config,
        vocab_size=len(TOK),
    )
    assert result.metrics["num_errored"] == 0 and len(result.batch) == 6
    gts = {t.id: t.reward_spec["ground_truth"] for t in tasks}
    msgs = {t.id: [dict(m) for m in t.messages] for t in tasks}
    for step in result.batch:
        task_id = step.trajectory_id.instance_id
        assert list(step.prompt_ids) == RENDERER.render_ids(msgs[task_id], add_generation_prompt=True)
        ids = list(step.response_ids)
        assert len(step.response_logprobs) == len(ids) == len(step.loss_mask)
        text = RENDERER.decode(ids[:-1] if ids[-1] == IM_END else ids)
        assert step.reward == float(gsm8k_utils.compute_score(text, gts[task_id]))
        assert step.is_last_step and step.env == "gsm8k"
