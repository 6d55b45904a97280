"""Recipe: SmolLM2-135M-Instruct learns a multi-turn tool task on 2 CPU cores: multiply numbers too
large to guess with a ``multiply`` tool (the built-in ``calculator`` env, :mod:`rljax.envs.calculator`).

An episode: ``"What is 482 * 37?"``; the model calls ``multiply`` (the ChatML family's tool
convention of the ``smollm2`` renderer: the tool's JSON schema in the system turn, a
``<tool_call>{"name": "multiply", "arguments": {"a": 482, "b": 37}}</tool_call>`` in its reply),
reads the ``tool`` message (``17834``) and answers. Reward 1 when the answer's last integer is the
product, else partial credit for the attempt (0.1), a valid call (0.2), the right numbers (0.4).
Held-out success (``eval/pass@1``) counts right answers on 48 products never trained on.

The base model never calls the tool (1 of 96 replies measured even tried; it writes code or guesses
a product), so a short warm start teaches the format on demonstrations from ``env.solution``
(call, result, answer), whose final answer is replaced by a wrong number half the time; the
warm-started model (checkpoint ``step_0``) is the baseline, and GRPO must make it copy the tool's
result instead of a memorized number. The run evaluates the warm-started model first
(``trainer.eval_at_start``: the row of step 0).

Measured (2 CPU cores, AMD EPYC, 2026-12-05; ``eval/pass@1`` on the 48 held-out products, 4 samples
each at temperature 0.7; ``benchmarks/smollm2_agents.py``)::

    seed  step 0  step 5  step 10  RL time to step 10  whole run    peak RSS
    0     0.802   -       0.990    23.2 min            45 min 18 s  11.0 GiB  (shared, load ~4; stopped at 10)
    1     0.365   0.979   0.979    14.2 min            32 min 9 s   11.3 GiB  (quiet after the warm start)

The train reward is 0.99-1.0 from step 4-5 on: the recipe's 20 steps leave room, not a need.
Train, evaluate the baseline, or train through the gateway::

    rljax train --config=smollm2_tools --workdir=/tmp/smollm2_tools
    rljax eval --config=smollm2_tools --checkpoint=/tmp/smollm2_tools/checkpoints/step_0   # the baseline
    rljax train --config=smollm2_tools \\
        --config.envs.calculator.agent=rljax.agents.calculator_agent:calculator_agent   # the gateway
"""

from ml_collections import config_dict

from rljax.recipes import smollm2_base

#: Wrong answers of the warm start's corrupted demonstrations (numbers of the products' size).
WRONG_PRODUCTS = ("1000", "4096", "12345", "20000", "31416", "54321", "65536", "99999")


def get_config() -> config_dict.ConfigDict:
    """GRPO on the calculator tool task with SmolLM2-135M-Instruct and the embedded sampler."""
    c = smollm2_base.get_config()
    # agent "": the env loop; --config.envs.calculator.agent=MODULE:FUNCTION runs the task as that agent
    # (a ConfigDict takes overrides of the keys it holds only)
    c.envs = config_dict.ConfigDict(
        {"calculator": dict(env="calculator", agent="", num_train_tasks=1024, num_eval_tasks=48)}
    )
    # a demonstration is ~270 tokens: rows of 576 hold two (rows of 512 held one, half of it padding)
    c.warmstart.update(num_steps=16, seq_len=576, corrupt_prob=0.5, corrupt_choices=WRONG_PRODUCTS)
    c.rollout.update(max_turns=3, max_tokens=48, max_context_len=512)
    # eval_at_start: the warm-started model's held-out score is step 0 of the curve (the baseline)
    c.trainer.update(num_steps=20, eval_every=5, eval_at_start=True)
    return c
