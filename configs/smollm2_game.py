"""Recipe: SmolLM2-135M-Instruct learns an interactive game on 2 CPU cores: find a hidden number from
the environment's higher / lower replies (the built-in ``guess_number`` env, no tools;
:mod:`rljax.envs.guess_number`).

An episode: ``"I am thinking of a number between 1 and 23. ... You have 5 guesses."``; the model
replies with a number, the environment with ``"My number is higher than 12."`` (or lower), and so
on until a guess hits (reward 1) or the guesses run out (0). The guesses allowed are those binary
search needs, so only a player that uses the replies wins every game. Held-out success
(``eval/pass@1``) counts games won among 64 ``(range, number)`` pairs never trained on.

The base model cannot play (4% of games won, measured: it comments on the game instead of
guessing), so a short warm start teaches the moves on binary-search demonstrations from
``env.solution``, whose final guess is replaced by a wrong number half the time; the warm-started
model (checkpoint ``step_0``) is the baseline, and GRPO must make it conclude from the replies.

Measured (2 CPU cores, AMD EPYC, 2026-12-05, the machine shared; held-out games won at temperature
0.7, step 0 = the warm-started model; ``python benchmarks/smollm2_agents.py --recipe smollm2_game``)::

    seed  step 0  step 5  step 10  RL time to step 10  whole run  peak RSS
    0     0.641   0.848   0.895    34.9 min            59.5 min   10.8 GiB
    1     0.645   0.680   0.848    30.1 min            58.7 min   10.8 GiB

A game takes 3.9-4.0 LLM turns; every follow-up turn merges into its game's sample (8.8k trained
tokens per step instead of 28k step-wise).

    rljax train --config=smollm2_game --workdir=/tmp/smollm2_game
    rljax eval --config=smollm2_game --checkpoint=/tmp/smollm2_game/checkpoints/step_0   # the baseline
"""

from ml_collections import config_dict

from rljax.recipes import smollm2_base


def get_config() -> config_dict.ConfigDict:
    """GRPO on the guessing game with SmolLM2-135M-Instruct and the embedded sampler."""
    c = smollm2_base.get_config()
    c.envs = config_dict.ConfigDict(
        {"guess_number": dict(env="guess_number", num_train_tasks=512, num_eval_tasks=64)}
    )
    wrong = tuple(str(k) for k in range(1, 31))
    c.warmstart.update(num_steps=30, corrupt_prob=0.5, corrupt_choices=wrong)
    c.rollout.update(max_turns=5, max_tokens=8, max_context_len=512)
    # eval_at_start: the warm-started model's held-out score is step 0 of the curve (the baseline)
    c.trainer.update(num_steps=10, eval_every=5, eval_at_start=True)  # rows of 512 tokens hold three games
    return c
