"""Dataset files train through ``config.envs.NAME.dataset`` and report eval pass@k per env and source.

Two envs on the smoke recipe: a reasoning-gym env whose train / eval files are SkyRL rows written by
``rljax make-dataset`` (parquet) and ``rljax.envs.write_rows`` (jsonl), and a skyrl-gym
``gsm8k`` env with one SkyRL jsonl file split by ``eval_fraction``. With the embedded sampler the run
trains and logs every pass@k key; with a scripted engine whose answers are right for a known subset
of the eval rows, the logged pass@k equal the fractions counted from the files (the reference).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
from recipes import load_recipe

from rljax.chat import toy_tokenizer
from rljax.envs import load_dataset_tasks, write_rows
from rljax.inference.engine import Completion
from rljax.run.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.subprocess]  # rljax.cli.make_dataset

RG_CONFIG = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"],
                 allow_parentheses=False, allow_negation=False, system_prompt=None)  # fmt: skip
RG_SOURCE = "reasoning_gym/basic_arithmetic"
GSM_SOURCE = "openai/gsm8k"
GROUP = 2  # eval samples per task: eval/pass@1 and eval/pass@2
SCOPES = ("eval", "eval/rg", "eval/gsm", f"eval/data_source/{RG_SOURCE}", f"eval/data_source/{GSM_SOURCE}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rg_train, rg_eval, gsm = d / "rg_train.parquet", d / "rg_eval.jsonl", d / "gsm.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "rljax", "make-dataset", "--source=reasoning_gym:basic_arithmetic", "--num=12",
         f"--out={rg_train}", f"--dataset_config={json.dumps(RG_CONFIG)}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    sys.path.insert(0, str(ROOT))
    try:
        from rljax.cli.make_dataset import make_rows
    finally:
        sys.path.remove(str(ROOT))
    write_rows(make_rows("reasoning_gym:basic_arithmetic", 6, seed=1, split="test", **RG_CONFIG), rg_eval)
    rows = []
    for i in range(24):
        gt = str(7 * i + 3)
        rows.append({
            "data_source": GSM_SOURCE,
            "prompt": [{"role": "user", "content": f"Problem {i}: what is {gt}? Answer after '####'."}],
            "env_class": "gsm8k",
            "reward_spec": {"method": "rule", "ground_truth": gt},
            "extra_info": {"index": i},
        })  # fmt: skip
    write_rows(rows, gsm)
    return {"rg_train": rg_train, "rg_eval": rg_eval, "gsm": gsm}


def _config(files, **trainer):
    c = load_recipe("smoke")
    c.envs = {
        "rg": dict(env="reasoning_gym:basic_arithmetic",
                   dataset=dict(train=str(files["rg_train"]), eval=str(files["rg_eval"]))),
        "gsm": dict(env="skyrl_gym:gsm8k", dataset=dict(train=str(files["gsm"]), eval_fraction=0.25)),
    }  # fmt: skip
    c.warmstart.num_steps = 0  # skyrl-gym envs have no solution() to demonstrate
    c.rollout.update(max_turns=1, max_tokens=16)
    c.eval.update(group_size=GROUP)
    c.trainer.update(num_steps=2, prompts_per_step=4, eval_every=2, **trainer)
    return c


def _rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _eval_tasks(files):
    rg = load_dataset_tasks(files["rg_eval"], env="rg")
    gsm = load_dataset_tasks(files["gsm"], env="gsm", eval_fraction=0.25, split="test")
    return rg, gsm


def test_dataset_files_train_and_log_pass_at_k_per_env_and_source(files, tmp_path):
    trainer = Trainer(_config(files), tmp_path)
    rg_eval, gsm_eval = _eval_tasks(files)
    # the run's tasks are exactly the files' rows (train: all rg rows, the gsm rows outside the fraction)
    assert sorted(t.id for t in trainer.parts.env_tasks.eval) == sorted(t.id for t in rg_eval + gsm_eval)
    gsm_train = load_dataset_tasks(files["gsm"], env="gsm", eval_fraction=0.25, split="train")
    assert len(trainer.parts.env_tasks.train) == 12 + len(gsm_train) and 0 < len(gsm_eval) < 24
    history = trainer.run()
    assert [h["step"] for h in history] == [1, 2]
    rows = _rows(tmp_path)
    assert all(r["optimizer_steps"] >= 1 and r["rollout/num_trajectories"] == 4 * 2 for r in rows)
    last = rows[-1]
    for scope in SCOPES:
        for k in (1, GROUP):
            assert 0.0 <= last[f"{scope}/pass@{k}"] <= 1.0, scope
    assert last["eval/num_tasks"] == len(rg_eval) + len(gsm_eval)
    assert last["eval/num_samples"] == GROUP * (len(rg_eval) + len(gsm_eval))
    assert "eval/pass@1" not in rows[0]  # eval_every=2


class ScriptedEngine:
    """Answers each prompt from its text: right for rg items with an even sum and gsm items with an
    even problem number, wrong otherwise (same answer for every sample)."""

    weight_version = 0

    def __init__(self):
        self.tok = toy_tokenizer("chatml")
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")

    @staticmethod
    def answer(prompt: str) -> str:
        if m := re.findall(r"Calculate (\d+) \+ (\d+)\.", prompt):
            a, b = map(int, m[-1])
            return f"<answer>{a + b if (a + b) % 2 == 0 else a + b + 1}</answer>"
        i, gt = re.findall(r"Problem (\d+): what is (\d+)\?", prompt)[-1]
        return f"#### {gt if int(i) % 2 == 0 else -1}"

    async def generate(self, prompt_ids, sampling, *, session_id=None):
        text = self.answer(self.tok.decode(list(prompt_ids)))
        ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
        return Completion(tuple(ids), tuple([-0.5] * len(ids)), "stop", self.weight_version)

    async def update_weights(self, model, *, version=None):
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return self.weight_version


def test_logged_pass_at_k_equals_the_fractions_counted_from_the_files(files, tmp_path):
    Trainer(_config(files), tmp_path, engine=ScriptedEngine()).run()
    last = _rows(tmp_path)[-1]
    rg_eval, gsm_eval = _eval_tasks(files)
    rg_right = [int(t.reward_spec["ground_truth"]) % 2 == 0 for t in rg_eval]
    gsm_right = [int(t.extra_info["index"]) % 2 == 0 for t in gsm_eval]
    assert 0 < sum(rg_right) < len(rg_right) and 0 < sum(gsm_right) < len(gsm_right)  # informative
    expected = {
        "eval/rg": sum(rg_right) / len(rg_right),
        "eval/gsm": sum(gsm_right) / len(gsm_right),
        f"eval/data_source/{RG_SOURCE}": sum(rg_right) / len(rg_right),
        f"eval/data_source/{GSM_SOURCE}": sum(gsm_right) / len(gsm_right),
        "eval": (sum(rg_right) + sum(gsm_right)) / (len(rg_right) + len(gsm_right)),
    }
    for scope, fraction in expected.items():
        for k in (1, GROUP):  # the engine answers a prompt the same way every time: pass@k = pass@1
            assert last[f"{scope}/pass@{k}"] == pytest.approx(fraction, abs=1e-12), (scope, k)
