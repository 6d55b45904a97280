"""Recipe: a tiny model learns a reasoning-gym task on 2 CPU cores.

Task: reasoning-gym ``spell_backward`` restricted to 3-letter words ("Spell this word backward
(example: sun -> nus): nix" -> ``<answer>xin</answer>``), scored by the dataset's own
``score_answer`` (1.0 for the exact reversal; partial credit per leading letter otherwise). The
1,063 distinct words are split by a hash of the question: 800 train items, 64 held-out eval items
that training never sees.

Why a tiny model (the default 2-layer, 64-wide decoder over bytes) can learn it: with a byte
tokenizer and a fixed-length word, each answer letter is a copy of a prompt token at a fixed
relative offset (letter i of the answer = letter 3-i of the word, the last prompt tokens), which
RoPE attention heads learn without knowing any words, so the skill transfers to held-out words.
The warm start (1,200 cross-entropy steps on demonstrations) teaches the answer format and the
reversal; half of its demonstrations are corrupted to one of 12 fixed wrong strings, so the
warm-started policy reverses a held-out word only part of the time. GRPO then has to move
probability from the memorized wrong strings to the reversal, and held-out pass@1 rises with it.
Measured (seed 0, 2 shared CPU cores, load average 4-6): eval pass@1 on the 64 held-out words
0.40 at step 0 (``rljax eval`` of ``step_0``) -> 0.57 (step 10) -> 0.81 (step 40) -> 0.89 (step
80); wall time 3 min 44 s for the whole run (warm start 156 s). Harder instances that were tried
and that the tiny model does NOT learn in minutes: ``basic_arithmetic`` one-digit sums (held-out
pairs) and ``color_cube_rotation`` (both stay at chance after the warm start).

    rljax train --config=reasoning_gym --workdir=/tmp/rg
    rljax eval --config=reasoning_gym --checkpoint=/tmp/rg/checkpoints/step_0

(the second evaluates the warm-started model, before RL, on the same held-out items; the run's own
``eval/pass@1`` rows in ``/tmp/rg/metrics.jsonl`` come every 10 steps.)

Any reasoning-gym dataset works the same way: ``env="reasoning_gym:<dataset>"`` and its config
fields in ``task_kwargs``; a weighted mix is ``env="reasoning_gym:mix"`` with
``task_kwargs=dict(datasets={"leg_counting": 1.0, "gcd": 2.0})``. A dataset file instead (SkyRL /
verl rows, e.g. written by ``rljax make-dataset --source reasoning_gym:spell_backward``)
is ``dataset=dict(train=PATH, eval=PATH)`` (or ``eval_fraction=``) in place of ``task_kwargs``.
"""

from ml_collections import config_dict

from rljax.recipes import default

# wrong answers of the corrupted warm-start demonstrations (never the right reversal: the warm start
# compares them with what the demonstration would say and picks another)
WRONG = ("aaa", "eee", "ooo", "the", "and", "you", "xyz", "qqq", "mmm", "sss", "abc", "zzz")


def get_config() -> config_dict.ConfigDict:
    """The default recipe on the reasoning-gym task of the module docstring."""
    c = default.get_config()
    c.envs = config_dict.ConfigDict(
        {
            "spell": dict(
                env="reasoning_gym:spell_backward",
                kwargs=dict(answer_tag="answer"),
                # no system prompt: the warm start teaches the <answer> format
                task_kwargs=dict(min_word_len=3, max_word_len=3, system_prompt=None),
                num_train_tasks=800,
                num_eval_tasks=64,
            )
        }
    )
    c.warmstart.update(
        num_steps=1200,
        corrupt_prob=0.5,
        corrupt_choices=tuple(f"<answer>{w}</answer>" for w in WRONG),
        log_every=100,
    )
    c.rollout.update(max_turns=1, max_tokens=24, max_context_len=160)
    c.eval.update(group_size=4)  # 4 samples per held-out word: eval/pass@1 and eval/pass@4
    # keep_checkpoints=0 keeps every checkpoint, step_0 (the warm-started model) included
    c.trainer.update(num_steps=80, eval_every=10, checkpoint_every=10, keep_checkpoints=0, seq_len=192)
    return c
