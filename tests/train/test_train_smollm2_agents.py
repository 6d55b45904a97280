"""The shipped SmolLM2 recipes on the real SmolLM2-135M-Instruct (GGUF file, BPE tokenizer, chat template
with the ChatML family's tool convention), in one run to pay for one model load and one compilation:
``smollm2_tools``' config with four envs, its ``calculator`` task in the env loop, the same task as
the OpenAI-SDK agent through the gateway (``calculator_agent``, its responses recorded by the
client), ``smollm2_game``'s ``guess_number`` env and ``smollm2_cpu``'s ``arithmetic`` env; one GRPO
step of one prompt per env (a group of two samples each).

What it checks that the tiny-model tests cannot: the sampler's logprobs agree with the trainer's
forward on the real model's sampled tokens of tool and game turns (``rl/mismatch_kl``), every call
of the gateway agent is recorded with exactly the ids its client got (prompt and completion, from
``return_token_ids``) and answered with the message parsed from them, and the update moves the
weights when a group's rewards differ.
"""

from __future__ import annotations

import json

import gateway_capture
import jax
import numpy as np
import pytest
from recipes import load_recipe
from smollm2 import real_model_slot, require_smollm2

from rljax.chat import make_renderer
from rljax.models import gguf_tokenizer
from rljax.run.trainer import Trainer

pytestmark = pytest.mark.integration


def test_one_step_of_the_smollm2_recipes_env_loop_and_gateway(tmp_path):
    path = require_smollm2()
    c = load_recipe("smollm2_tools")
    assert c.model.hf_path == str(path)  # the recipes read the cached file
    c.envs.guess_number = load_recipe("smollm2_game").envs.guess_number
    c.envs.arithmetic = load_recipe("smollm2_cpu").envs.arithmetic
    c.envs.calculator_agent = dict(
        env="calculator",
        agent="gateway_capture:capturing_calculator_agent",
        task_kwargs=dict(a_range=(500, 999)),  # other products than the env loop's (task ids are group keys)
    )
    c.envs.calculator.task_kwargs = dict(a_range=(100, 499))
    for env in c.envs.values():
        env.update(num_train_tasks=1, num_eval_tasks=0)
    c.rollout.group_size = 2
    c.warmstart.num_steps = 0  # demonstrations rendered with tools: tests/chat (real tokenizer), tests/envs
    c.engine.update(max_batch_size=16, min_batch_bucket=16)
    c.trainer.update(num_steps=1, prompts_per_step=4, eval_every=0, checkpoint_every=0, save_rollouts_every=1)
    gateway_capture.RESPONSES.clear()
    with real_model_slot():
        t = Trainer(c, tmp_path)
        before = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t.state.params))]
        (row,) = t.run()
        after = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t.state.params))]

    assert row["rollout/num_trajectories"] == 8 and row["rollout/num_errored"] == 0
    assert 0.0 <= row["reward/mean"] <= 1.0 and np.isfinite(row["loss"])
    # float32 sampler vs float32 trainer on the same weights; 1e-4 is the bound for equivalent float32
    # programs with margin (logprob drift ~1e-5 per token)
    assert abs(row["rl/mismatch_kl"]) < 1e-4
    if row["reward/std"] > 0:  # a group with reward variance has a non-zero advantage: weights move
        assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    # the gateway agent: each call recorded with exactly the ids its client got, and the reply it got
    records = [json.loads(line) for line in (tmp_path / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert {r["env"] for r in records} == set(c.envs)  # a prompt of every env
    agent_calls = [r for r in records if r["env"] == "calculator_agent"]
    got = gateway_capture.RESPONSES
    assert len(agent_calls) == len(got) >= 2  # 1 task x 2 samples, one call at least each
    recorded = sorted((r["prompt_ids"], r["completion_ids"], _said(r["reply"])) for r in agent_calls)
    assert recorded == sorted((g["prompt_ids"], g["completion_ids"], _said(g["message"])) for g in got)
    renderer = make_renderer("smollm2", gguf_tokenizer(path))
    for g in got:  # the message is the one parsed from those ids (or their text, when a call is malformed)
        parsed = renderer.parse_response(g["completion_ids"])
        if not parsed.errors:
            assert _said(g["message"]) == _said(parsed.to_message())


def _said(message):
    """What a reply says: its text and its calls' names and arguments (as JSON text)."""
    calls = []
    for call in message.get("tool_calls") or []:
        args = call["function"]["arguments"]
        calls.append((call["function"]["name"], args if isinstance(args, str) else json.dumps(args)))
    return message.get("content") or "", tuple(
        (n, json.dumps(json.loads(a), sort_keys=True)) for n, a in calls
    )
