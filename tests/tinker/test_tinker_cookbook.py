"""tinker-cookbook's minimal loops (``tinker_cookbook.recipes.sl_loop`` and ``rl_loop``, 0.5.8, their
code untouched) run against ``rljax serve`` with a tiny local model, a local tokenizer
directory and local datasets, with the hub switched off.

What the loops are given (nothing else changes):

* ``model_name=Qwen/Qwen3-8B-Base``: the cookbook picks the renderer from a fixed table of model
  names (``role_colon`` for this one, a plain ``User: ... Assistant: ...`` format any tokenizer can
  render) and loads the tokenizer with ``AutoTokenizer.from_pretrained(model_name)`` when
  ``model_name`` is a directory, so the loops run in a directory holding ``Qwen/Qwen3-8B-Base/``
  = the served model's tokenizer (rljax's byte-level toy ChatML tokenizer, saved), and the server
  serves its tiny random model under that name (``--base_model``);
* ``datasets.load_dataset("HuggingFaceH4/no_robots")`` and ``("openai/gsm8k", "main")`` read local
  directories of those names (JSON lines; gsm8k's README declares the ``main`` config);
* ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``, an empty ``HF_HOME`` and a dead proxy for everything
  but 127.0.0.1: any attempt to reach the hub fails the run;
* small sizes (batch, group, steps, tokens) and learning rates for a 2-layer model.

The checks: SL's train NLL (the loop's own ``train_mean_nll``) falls; RL's mean reward (the loop's
``reward/total``, gsm8k's grader on ``\\boxed{}``) rises. The test's tokenizer has ``\\boxed{0}`` ..
``\\boxed{9}`` as single tokens so that a random model answers in the graded format by chance
(~5% of samples give the right answer, 7); the RL loop runs with ``lora_rank=0`` (full fine-tuning,
which this server gives for rank 0), the fastest and most reliable learner on this 64-wide model
(LoRA rank 32 with the unembedding adapter, ``train_unembed``, measured 0.03 -> 1.0 in 6 steps at lr
3e-2, 0.03 -> 0.44 at lr 2e-2, one run each). SL runs with LoRA (the loop's default rank 32, on
attention, MLP and unembedding).

Needs tinker-cookbook's own venv (``.ci/install_tinker_cookbook.sh``; it pins transformers and
torch): FAIL under CI=true when missing, else skip.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import ci
import httpx
import pytest
from xla_flags import subprocess_env

pytestmark = [pytest.mark.integration, pytest.mark.subprocess]  # rljax.cli.serve + the cookbook's python

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = "Qwen/Qwen3-8B-Base"
KEY = "tml-cookbook-test"
RUN_TIMEOUT_S = 300


def cookbook_python() -> str:
    """tinker-cookbook's python: ``$RLJAX_TINKER_COOKBOOK_PYTHON`` or ``<repo>/.tinker-cookbook-venv``."""
    python = os.environ.get("RLJAX_TINKER_COOKBOOK_PYTHON") or str(REPO / ".tinker-cookbook-venv/bin/python")
    if os.access(python, os.X_OK):
        return python
    reason = (
        f"no tinker-cookbook venv at {python}: run .ci/install_tinker_cookbook.sh "
        "or set RLJAX_TINKER_COOKBOOK_PYTHON"
    )
    ci.missing(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_local_hub(root: pathlib.Path) -> pathlib.Path:
    """The directory the loops run in: the tokenizer and both datasets under their hub names."""
    from tokenizers import AddedToken

    from rljax.chat import toy_tokenizer

    tok = toy_tokenizer("chatml")
    tok.add_tokens([AddedToken(f"\\boxed{{{d}}}", normalized=False) for d in range(10)])
    tok.save_pretrained(root / MODEL)
    # SL: one reply template (the loop trains on the assistant turns), 256 conversations
    write_jsonl(
        root / "HuggingFaceH4/no_robots/train.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": f"Please greet guest {i}."},
                    {"role": "assistant", "content": f"Hello, guest {i}! Nice to meet you."},
                ]
            }
            for i in range(256)
        ],
    )
    # RL: every question's answer is 7 (gsm8k's "#### <answer>" format)
    questions = [
        {"question": f"What is {a} + {7 - a}?", "answer": f"{a} + {7 - a} = 7\n#### 7"} for a in range(8)
    ]
    write_jsonl(root / "openai/gsm8k/main/train.jsonl", questions * 8)
    (root / "openai/gsm8k/README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n"
        "  - split: train\n    path: main/train.jsonl\n---\n"
    )
    return root


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> pathlib.Path:
    return make_local_hub(tmp_path_factory.mktemp("local_hub"))


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory):
    """``rljax serve`` on the tiny default model with the local tokenizer, named MODEL."""
    port = free_port()
    env = subprocess_env(PYTHONPATH=str(REPO))  # one CPU device, not the tests' 8
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "rljax", "serve", "--config=tinker",
            f"--config.tokenizer.name={hub / MODEL}", f"--base_model={MODEL}", f"--port={port}",
            f"--workdir={tmp_path_factory.mktemp('workdir')}",
        ],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                tail = pathlib.Path(log.name).read_text()[-3000:]
                pytest.fail(f"rljax.cli.serve exited with {proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"rljax.cli.serve did not answer on {url}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_recipe(recipe: str, hub: pathlib.Path, log_path: pathlib.Path, url: str, *args: str) -> list[dict]:
    """Runs ``python -m tinker_cookbook.recipes.<recipe>`` (chz ``key=value`` arguments) in ``hub``
    with the hub unreachable; returns its metrics.jsonl rows."""
    python = cookbook_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XLA_", "JAX_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(log_path.parent / f"{recipe}_hf_home"),  # empty: nothing cached to fall back on
        HTTP_PROXY="http://127.0.0.1:9",  # nothing listens there: any non-local request fails
        HTTPS_PROXY="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost",
        TINKER_API_KEY=KEY,
    )
    cmd = [python, "-m", f"tinker_cookbook.recipes.{recipe}", f"base_url={url}", f"model_name={MODEL}",
           f"log_path={log_path}", *args]  # fmt: skip
    out = subprocess.run(cmd, cwd=hub, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, f"{recipe} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}"
    assert "Training completed" in out.stdout + out.stderr
    final = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert final and final[-1]["name"] == "final" and final[-1]["state_path"].startswith("tinker://")
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_sl_loop_trains_and_its_nll_falls(server, hub, tmp_path):
    steps = 16
    rows = run_recipe(  # LoRA of the loop's default rank (32)
        "sl_loop", hub, tmp_path / "sl", server,
        "batch_size=8", f"max_steps={steps}", "learning_rate=1e-2", "save_every=0",
    )  # fmt: skip
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == steps, rows
    assert all(r["num_sequences"] == 8 for r in rows if "num_sequences" in r)
    # byte-level tokens of a random 2-layer model start near log(vocab) = 5.6
    assert nll[0] > 5.0, nll
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 0.3, nll


def test_rl_loop_trains_and_its_reward_rises(server, hub, tmp_path):
    # The loop's sampling requests carry no seeds, so the server draws them in arrival order and the
    # trajectory depends on timing and on what the server ran before. Measured over 6 steps, last two
    # steps' mean reward: 0.80-0.97 in six runs (alone, under load, after the SL test), 0.31 once in
    # a whole-suite run whose reward stalled for three steps. 8 steps and the last three steps' mean
    # keep the check (a rise of more than 0.25 from ~0.08) away from such a stall.
    steps = 8
    rows = run_recipe(
        "rl_loop", hub, tmp_path / "rl", server,
        "batch_size=4", "group_size=8", f"max_steps={steps}", "max_tokens=32", "learning_rate=2e-2",
        "lora_rank=0", "save_every=0",
    )  # fmt: skip
    reward = [r["reward/total"] for r in rows if "reward/total" in r]
    assert len(reward) == steps, rows
    assert any("grad_norm:mean" in r for r in rows)  # at least one step trained (not all groups equal)
    first, last = sum(reward[:2]) / 2, sum(reward[-3:]) / 3
    assert first < 0.2, reward  # a random model rarely boxes the right digit
    assert last > first + 0.25, reward
