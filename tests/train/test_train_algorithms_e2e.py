"""Every named algorithm trains end to end through the real trainer (design §3.6).

A REAL vLLM (CPU) server plays the frozen teacher: a tiny random Qwen3 (head_dim 64, peaked
weights) over the toy ChatML tokenizer's vocabulary. The student is the trainer's own tiny model,
sampled by the embedded JAX sampler. Each test checks that the loss moves the way the algorithm
says, with references computed independently of the trainer:

* opd: the student's reverse KL to the teacher, ``E_{y~student}[log s(y) - log t(y)]`` per token
  on HELD-OUT prompts, both logprobs computed by rljax on the local weights, falls;
* sft: the student's NLL of the teacher's samples (drawn from the server on held-out prompts) falls;
* opsd: the gap between the student and its demonstration-conditioned self on held-out prompts falls;
* echo: the cross-entropy of the tool bodies falls while grpo still trains the actions;
* a per-env mix (grpo + echo + sft) trains every algorithm in one run, each component with its own
  token count, and frozen-model samples never count as stale.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from recipes import load_recipe

from rljax import envs, models
from rljax.chat import make_renderer, toy_tokenizer
from rljax.envs.base import Task
from rljax.inference.engine import SamplingParams
from rljax.inference.frozen import FrozenModel
from rljax.inference.sampler import EmbeddedSampler
from rljax.inference.vllm import ServerConfig, VLLMServer, write_checkpoint
from rljax.rollout import RolloutConfig, run_rollout
from rljax.run.trainer import Trainer
from rljax.training.step import TrainState

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "inference"))
import inference_helpers  # noqa: E402

pytestmark = pytest.mark.integration

TOKENIZER = toy_tokenizer("chatml")
RENDERER = make_renderer("chatml", TOKENIZER)
VOCAB = len(TOKENIZER)


def _default_config():
    return load_recipe("default")


def _peaked(model: models.Decoder, seed: int) -> models.Decoder:
    """Re-draws weights at scales that make next-token distributions peaked (a decisive teacher)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    new = []
    for key, (path, var) in zip(keys, flat, strict=True):
        value = var.get_value()
        noise = jax.random.normal(key, value.shape, jnp.float32)
        name = ".".join(str(p) for p in path)
        scale = 0.2 if "norm" in name else 0.15
        new.append((path, var.replace((1.0 + scale * noise) if "norm" in name else scale * noise)))
    nnx.update(model, nnx.from_flat_state(new))
    return model


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, vllm_python):
    """A frozen teacher: local weights (for independent references) + a real vLLM server serving them."""
    cfg = models.ModelConfig(
        model_type="qwen3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=64, qk_norm=True, tie_word_embeddings=True,
        max_position_embeddings=512,
    )  # fmt: skip
    model = _peaked(models.Decoder(cfg, rngs=nnx.Rngs(5)), seed=55)
    directory = os.fspath(tmp_path_factory.mktemp("teacher"))
    write_checkpoint(model, directory)
    server = VLLMServer(
        ServerConfig(
            model=directory,
            max_model_len=512,
            skip_tokenizer_init=True,
            extra_args=("--enforce-eager",),
            startup_timeout_s=600,
            log_path=os.fspath(tmp_path_factory.mktemp("teacher_log") / "server.log"),
        ),
        python=vllm_python,
    )
    with server:
        yield type("Teacher", (), {"model": model, "url": server.url})


def _config(*, algorithm="grpo", envs_=("arith",), steps=8, lr=3e-3, env_algorithms=None, teacher_url=None):
    c = _default_config()
    c.warmstart.num_steps = 0
    env_specs = {
        "arith": dict(env="arithmetic", kwargs={}, task_kwargs={}, num_train_tasks=64, num_eval_tasks=0),
        "lookup": dict(
            env="lookup",
            kwargs=dict(compact=True, system_prompt=""),
            task_kwargs={},
            num_train_tasks=64,
            num_eval_tasks=0,
        ),
    }
    c.envs = {e: env_specs[e] for e in envs_}
    c.algorithm = algorithm
    c.env_algorithms = env_algorithms or {}
    if teacher_url is not None:
        c.frozen_models = {"teacher": dict(base_url=teacher_url)}
    c.rollout.update(group_size=4, max_turns=3, max_tokens=16, max_context_len=256, max_concurrency=64)
    c.optimizer.learning_rate = lr
    c.trainer.update(
        num_steps=steps, prompts_per_step=4, seq_len=256, eval_every=0, checkpoint_every=0, truncate=True
    )
    return c


def _student(trainer: Trainer) -> models.Decoder:
    """A copy of the trainer's current policy (train steps donate the live buffers)."""
    params = jax.tree.map(jnp.copy, trainer.state.params)
    return nnx.merge(trainer.state.graphdef, params)


def _held_out(env: str = "arithmetic", n: int = 8):
    return envs.make_tasks(env, n, seed=123, split="test")


def _student_samples(model: models.Decoder, tasks, *, seed: int) -> list[list[int]]:
    """(prompt + response, prompt length) of the student's own samples on ``tasks`` (one turn each)."""
    kind = tasks[0].env
    result = run_rollout(
        tasks,
        engine=EmbeddedSampler(model, max_batch_size=32, seed=seed),
        renderer=RENDERER,
        make_env=lambda: envs.make_env(kind),
        config=RolloutConfig(group_size=4, max_turns=1, max_tokens=16, seed=seed),
        vocab_size=VOCAB,
    )
    return [(list(s.prompt_ids) + list(s.response_ids), len(s.prompt_ids)) for s in result.batch]


def _logprobs(model: models.Decoder, ids) -> np.ndarray:
    return inference_helpers.rljax_logprobs(model, ids)


def _mean_gap(samples, logp_a, logp_b) -> float:
    """Per-token mean of ``logp_a - logp_b`` over the response tokens of ``samples``."""
    diffs = [(logp_a(ids) - logp_b(ids))[start:] for ids, start in samples]
    return float(np.mean(np.concatenate(diffs)))


def _first_last(history, key, k=3):
    vals = [h[key] for h in history if key in h]
    return float(np.mean(vals[:k])), float(np.mean(vals[-k:]))


def test_opd_reverse_kl_to_the_teacher_falls(teacher, tmp_path):
    c = _config(algorithm={"name": "opd", "teacher": "teacher"}, teacher_url=teacher.url, steps=30, lr=1e-2)
    t = Trainer(c, tmp_path)
    tasks = _held_out()

    def reverse_kl(student):
        samples = _student_samples(student, tasks, seed=7)
        return _mean_gap(samples, lambda x: _logprobs(student, x), lambda x: _logprobs(teacher.model, x))

    before = reverse_kl(_student(t))
    history = t.run()
    after = reverse_kl(_student(t))
    print(f"opd: held-out reverse KL to the teacher {before:.3f} -> {after:.3f} nats/token")
    assert before > 0.5, before  # the student (near uniform) starts far from the teacher
    assert after < 0.85 * before, (before, after)
    first, last = _first_last(history, "ref_kl/k3")
    assert last < first, (first, last)
    assert all(h["tokens/ref_kl"] > 0 and h["tokens/rl"] == 0 and h["tokens/ce"] == 0 for h in history)


def test_sft_nll_of_teacher_samples_falls(teacher, tmp_path):
    c = _config(algorithm={"name": "sft", "teacher": "teacher"}, teacher_url=teacher.url, steps=12, lr=1e-2)
    t = Trainer(c, tmp_path)
    prompts = [RENDERER.render_ids(envs.make_env("arithmetic").reset(task), add_generation_prompt=True)
               for task in _held_out()]  # fmt: skip

    prompts = prompts * 2

    async def teacher_samples():
        async with FrozenModel.from_config({"name": "t", "base_url": teacher.url}) as frozen:
            outs = await asyncio.gather(
                *(frozen.generate(p, SamplingParams(max_tokens=16, seed=i)) for i, p in enumerate(prompts))
            )
        return [(list(p) + list(o.ids), len(p)) for p, o in zip(prompts, outs, strict=True)]

    samples = asyncio.run(teacher_samples())

    def nll(student):
        return -float(np.mean(np.concatenate([_logprobs(student, ids)[s:] for ids, s in samples])))

    before = nll(_student(t))
    history = t.run()
    after = nll(_student(t))
    print(f"sft: held-out NLL of teacher samples {before:.3f} -> {after:.3f} nats/token")
    assert after < before - 0.3, (before, after)
    first, last = _first_last(history, "loss/ce")
    assert last < first, (first, last)
    assert all(h["tokens/ce"] > 0 and h["tokens/rl"] == 0 for h in history)
    assert all(h["policy_version/lag"] == 0 for h in history)  # frozen samples never go stale


def test_opsd_gap_to_the_demonstration_conditioned_self_falls(tmp_path):
    c = _config(algorithm="opsd", steps=4)
    t = Trainer(c, tmp_path)
    # a student with peaked (context-sensitive) distributions, so the demonstration matters to it
    t.state = TrainState.create(_peaked(_student(t), seed=77), t.state.config)
    tasks = _held_out()
    hints = {task.id: RENDERER.demonstration_hint(task.demonstration) for task in tasks}
    assert all(len(h.ids) > 0 for h in hints.values())

    def gap(student):
        samples = _student_samples(student, tasks, seed=11)
        # one conditioned sequence per sample: the hint inserted into the prompt, then sliced back off
        out = []
        for (ids, start), task in zip(samples, [t_ for t_ in tasks for _ in range(4)], strict=True):
            h = hints[task.id]
            cond = ids[: h.insert_at] + list(h.ids) + ids[h.insert_at :]
            shift = len(h.ids)
            lp = _logprobs(student, ids)[start:]
            lp_cond = _logprobs(student, cond)[start + shift :]
            out.append(lp - lp_cond)
        return float(np.mean(np.concatenate(out)))

    before = gap(_student(t))
    history = t.run()
    after = gap(_student(t))
    print(f"opsd: held-out gap to the demonstration-conditioned self {before:.3f} -> {after:.3f} nats/token")
    assert abs(after) < 0.8 * abs(before), (before, after)
    assert all(h["tokens/ref_kl"] > 0 for h in history)
    assert history[0]["ref_kl/k3"] > 0.01  # the demonstration changes the policy's distribution


class NotesEnv:
    """Every turn the environment answers with a tool message (a fact about the task), 3 turns.

    The reward (did the reply mention a vowel-initial word?) only gives grpo something to do.
    """

    name = "notes"

    def reset(self, task):
        self.task, self.turn = task, 0
        return [{"role": "user", "content": f"Tell me about {task.data['key']}."}]

    def step(self, action):
        self.turn += 1
        reward = float(any(w[:1] in "aeiou" for w in str(action).lower().split()))
        done = self.turn >= 3
        return [{"role": "tool", "content": self.task.data["fact"], "name": "notes"}], reward, done, {}

    @staticmethod
    def solution(task):
        """Short replies (the warm start teaches the model to end its turns)."""
        fact = {"role": "tool", "content": task.data["fact"], "name": "notes"}
        return [{"role": "assistant", "content": "ok"}, fact, {"role": "assistant", "content": "an ok"}, fact,
                {"role": "assistant", "content": "ok"}]  # fmt: skip


def _notes_tasks(n: int):
    colors = ["red", "blue", "green", "gold"]
    keys = ["zob", "kip", "mav", "tul", "ren", "sol", "pim", "dax"]
    return [
        Task(f"notes:{i}", {"key": keys[i % 8], "fact": f"the {keys[i % 8]} is {colors[i % 4]}"}, env="notes")
        for i in range(n)
    ]


def test_echo_learns_the_tool_bodies_and_still_trains_actions(tmp_path):
    c = _config(algorithm={"name": "echo", "observation_ce": {"tool": 0.5}}, steps=10, lr=1e-3)
    c.envs = {"notes": dict(env="arithmetic", kwargs={}, task_kwargs={}, num_train_tasks=0, num_eval_tasks=0)}
    c.warmstart.update(num_steps=40, batch_size=8, learning_rate=3e-3, corrupt_prob=0.0, log_every=10)
    t = Trainer(c, tmp_path, make_env={"notes": NotesEnv}, tasks={"notes": (_notes_tasks(32), [])})
    history = t.run()
    assert all(h["tokens/ce"] > 0 and h["tokens/rl"] > 0 for h in history)
    # (which tokens echo selects is tested against independently located tool bodies in test_data_echo.py)
    first, last = _first_last(history, "loss/ce")
    assert last < 0.7 * first, (first, last)


def test_per_env_mix_trains_each_algorithm(teacher, tmp_path):
    # grpo on lookup (the default), echo on notes, sft (sampled by the frozen teacher) on arith
    c = _config(
        envs_=("arith", "lookup"),
        env_algorithms={"notes": "echo", "arith": {"name": "sft", "teacher": "teacher"}},
        teacher_url=teacher.url,
        steps=3,
        lr=1e-3,
    )
    c.envs["notes"] = dict(env="arithmetic", kwargs={}, task_kwargs={}, num_train_tasks=0, num_eval_tasks=0)
    c.trainer.prompts_per_step = 12
    c.warmstart.update(num_steps=30, batch_size=8, learning_rate=3e-3, corrupt_prob=0.0, log_every=10)
    t = Trainer(
        c,
        tmp_path,
        make_env={"notes": NotesEnv},
        tasks={"notes": (_notes_tasks(64), []), "arith": (envs.make_tasks("arithmetic", 64, seed=0), [])},
    )
    batches, train_on = [], t._train_on
    t._train_on = lambda batch: batches.append(batch) or train_on(batch)
    history = t.run()  # sync mode: a frozen sample (version 0) counted as stale at step 2 would raise
    for n, batch in enumerate(batches):  # sft envs sample from the frozen teacher (version 0), others at n
        assert {s.policy_version for s in batch if s.env == "arith"} <= {0}
        assert {s.policy_version for s in batch if s.env != "arith"} <= {n}
    assert any(s.env == "arith" for b in batches[1:] for s in b)
    trained = {name: [h for h in history if f"tokens/rl/{name}" in h] for name in ("grpo", "echo", "sft")}
    assert all(trained.values()), {k: len(v) for k, v in trained.items()}
    for h in trained["sft"]:
        assert h["tokens/ce/sft"] > 0 and h["tokens/rl/sft"] == 0 and h["tokens/ref_kl/sft"] == 0
    for h in trained["echo"]:
        assert h["tokens/rl/echo"] > 0 and h["tokens/ce/echo"] > 0 and h["echo/tokens/echo"] > 0
    for h in trained["grpo"]:
        assert h["tokens/rl/grpo"] > 0 and h["tokens/ce/grpo"] == 0
    assert all(np.isfinite(h["loss"]) and h["policy_version/lag"] == 0 for h in history)
    assert {"reward/mean/arith", "reward/mean/notes", "reward/mean/lookup"} <= set(history[-1])


def test_dynamic_sampling_trains_only_groups_whose_rewards_vary(tmp_path):
    c = _config(envs_=("lookup",), steps=2)
    c.envs.lookup.kwargs.credit = (0.02, 0.05, 0.1)  # partial credit: some groups vary, some do not
    c.trainer.dynamic_sampling = dict(max_rounds=3, atol=0.0, strict=False)
    t = Trainer(c, tmp_path)
    trained = []
    train_on = t._train_on

    def spy(batch):
        trained.append(batch)
        return train_on(batch)

    t._train_on = spy
    history = t.run()
    for h, batch in zip(history, trained, strict=True):
        rewards: dict[str, list[float]] = {}
        for s in batch:
            if s.is_last_step:
                rewards.setdefault(s.trajectory_id.instance_id, []).append(s.reward)
        assert all(max(r) > min(r) for r in rewards.values()), rewards  # every kept group varies
        assert len(rewards) == h["dynamic_sampling/groups_kept"] <= 4
        assert h["dynamic_sampling/rounds"] >= 1
        if h["dynamic_sampling/rounds"] > 1:  # extra rounds drew fresh, uniquely named groups
            assert h["dynamic_sampling/groups_seen"] > 4
    assert any(h["dynamic_sampling/groups_discarded"] > 0 for h in history)
