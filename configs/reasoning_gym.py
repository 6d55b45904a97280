"""Recipe: a tiny model learns a reasoning-gym task on CPU (issue 11; DRAFT, the trainer wiring of
datasets and pass@k evaluation lands separately).

Task: reasoning-gym ``basic_arithmetic`` restricted to ``a + b`` with one-digit non-negative
operands (100 items: ~80 train, ~20 held out by question hash), answered as ``<answer>n</answer>``
and scored by the dataset's own ``score_answer``. Why a tiny model can learn it: the answer space
is 19 short strings, the prompt is one short line (no system prompt: the warm start teaches the
answer format), and it is the same problem the built-in ``arithmetic`` env shows a 2-layer model
learning on 2 cores; RL then has to move the warm-started policy from the corrupted
demonstrations' answers to the dataset's.

    python -m launch.train --config=configs/reasoning_gym.py --workdir=/tmp/rljax_rg

Any reasoning-gym dataset works the same way: ``env="reasoning_gym:<dataset>"`` and its config
fields in ``task_kwargs``; a weighted mix is ``env="reasoning_gym:mix"`` with
``task_kwargs=dict(datasets={"leg_counting": 1.0, "gcd": 2.0})``. A dataset file instead
(SkyRL / verl rows, e.g. written by ``python -m launch.make_dataset``) is the commented
``dataset=`` entry below.

Keys this draft assumes (existing: ``env``, ``kwargs``, ``task_kwargs``, ``num_train_tasks``,
``num_eval_tasks``, ``eval.group_size``, ``eval.temperature``, ``warmstart.corrupt_choices``;
planned by the lead: ``envs.NAME.dataset = dict(train=PATH, eval=PATH, format="auto",
eval_fraction=None)`` and ``eval.pass_k``).
"""

from ml_collections import config_dict

from configs import default

TASK = dict(
    min_terms=2,
    max_terms=2,
    min_digits=1,
    max_digits=1,
    operators=["+"],
    allow_parentheses=False,
    allow_negation=False,
    system_prompt=None,  # rljax: no system message; the warm start teaches <answer> tags
)


def get_config() -> config_dict.ConfigDict:
    c = default.get_config()
    c.envs = config_dict.ConfigDict(
        {
            "arith": dict(
                env="reasoning_gym:basic_arithmetic",
                kwargs=dict(answer_tag="answer"),
                task_kwargs=TASK,
                num_train_tasks=64,
                num_eval_tasks=16,
                # dataset=dict(train="data/arith_train.parquet", eval="data/arith_eval.parquet"),
            )
        }
    )
    # corrupted demonstrations keep the answer format but give a wrong sum
    c.warmstart.corrupt_choices = tuple(f"<answer>{i}</answer>" for i in range(19))
    c.rollout.update(max_turns=1, max_tokens=12)
    c.eval.update(group_size=4)  # k samples per held-out task: eval/pass@1 and eval/pass@4
    return c
