"""Writes notebooks/advantages.ipynb from the cells below (run once after editing them)."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell(
        "# Step-wise advantages in rljax\n\n"
        "A toy multi-turn batch: 2 prompts x 4 rollouts, each rollout 1-3 turns (one `Step` per LLM turn).\n"
        "We compare the built-in group estimators and the per-step reward mode,\n"
        "and plug in a custom estimator.\n"
        "Everything here runs on the CPU in a few seconds."
    ),
    new_code_cell(
        "import jax.numpy as jnp\n"
        "import numpy as np\n\n"
        "from rljax.core import advantages as adv\n"
        "from rljax.core import segments\n"
        "from rljax.data import StepBatch\n"
        "from rljax.types import Step, TrajectoryID\n\n"
        "rng = np.random.default_rng(0)\n"
        "steps = []\n"
        "for prompt in ('q0', 'q1'):\n"
        "    for rep in range(4):\n"
        "        n_turns = int(rng.integers(1, 4))\n"
        "        for k in range(n_turns):\n"
        "            last = k == n_turns - 1\n"
        "            reward = float(rng.integers(0, 2)) if last else 0.0\n"
        "            n_tok = int(rng.integers(2, 5))\n"
        "            steps.append(Step(prompt_ids=[1, 2, 3], response_ids=list(range(10, 10 + n_tok)),\n"
        "                              trajectory_id=TrajectoryID(prompt, rep), reward=reward,\n"
        "                              is_last_step=last))\n"
        "batch = StepBatch(steps)\n"
        "batch"
    ),
    new_markdown_cell(
        "Outcome mode (SkyRL semantics): the trajectory reward is the last step's reward, the estimator\n"
        "runs per prompt group, and every step of a trajectory gets its trajectory's advantage on its own\n"
        "trainable tokens. We print the advantage of each trajectory (first token of its first step)."
    ),
    new_code_cell(
        "def per_trajectory(per_step):\n"
        "    out = {}\n"
        "    for s, a in zip(batch, per_step):\n"
        "        out.setdefault(str(s.trajectory_id), float(a[0]))\n"
        "    return out\n\n"
        "rewards = {str(s.trajectory_id): s.total_reward for s in batch if s.is_last_step}\n"
        "print('reward        ', rewards)\n"
        "table = {\n"
        "    'grpo': batch.step_advantages('grpo'),\n"
        "    'grpo (no std)': batch.step_advantages('grpo', norm_by_std=False),\n"
        "    'rloo': batch.step_advantages('rloo'),\n"
        "    'max_rl': batch.step_advantages('max_rl'),\n"
        "}\n"
        "for name, per_step in table.items():\n"
        "    print(f'{name:14s}', {k: round(v, 3) for k, v in per_trajectory(per_step).items()})"
    ),
    new_markdown_cell(
        "Sanity checks you can rely on: `grpo(norm_by_std=False)` and `rloo` sum to zero within each\n"
        "group, and the result does not depend on how the trajectories' steps are interleaved."
    ),
    new_code_cell(
        "for name in ('grpo (no std)', 'rloo'):\n"
        "    per_traj = per_trajectory(table[name])\n"
        "    for prompt in ('q0', 'q1'):\n"
        "        total = sum(v for k, v in per_traj.items() if k.startswith(prompt))\n"
        "        assert abs(total) < 1e-4, (name, prompt, total)\n"
        "# interleave trajectories randomly, keeping each trajectory's turns in order\n"
        "keys = rng.random(len(steps))\n"
        "by_traj = {}\n"
        "for i, s in enumerate(steps):\n"
        "    by_traj.setdefault(s.trajectory_id, []).append(i)\n"
        "for idx in by_traj.values():\n"
        "    keys[idx] = np.sort(keys[idx])\n"
        "perm = np.argsort(keys)\n"
        "shuffled = StepBatch([steps[i] for i in perm])\n"
        "a_shuffled = shuffled.step_advantages('grpo')\n"
        "for j, i in enumerate(perm):\n"
        "    np.testing.assert_allclose(a_shuffled[j], table['grpo'][i], rtol=1e-6)\n"
        "print('zero-sum and permutation invariance hold')"
    ),
    new_markdown_cell(
        "## Per-step rewards\n"
        "`reward_mode='per_step'` gives each turn its own return `G_jk = sum_{i>=k} gamma^(i-k) r_ji` and\n"
        "baselines it among the steps of the same prompt at the same turn index."
    ),
    new_code_cell(
        "per_step = batch.step_advantages(\n"
        "    'grpo', norm_by_std=False, reward_mode='per_step', gamma_turn=0.9)\n"
        "for s, a in list(zip(batch, per_step))[:6]:\n"
        "    print(s.trajectory_id, 'last' if s.is_last_step else '    ', np.round(a, 3))"
    ),
    new_markdown_cell(
        "## A custom estimator\n"
        "Any function `fn(rewards, group_ids, num_groups, **kwargs) -> [N]` built from the segment\n"
        "reductions plugs in (it runs under `jit`; padding entries get a group of their own). Here: a\n"
        "rank-based advantage, the centred fraction of group peers a trajectory beats."
    ),
    new_code_cell(
        "def rank_advantage(rewards, group_ids, num_groups):\n"
        "    same = group_ids[:, None] == group_ids[None, :]\n"
        "    beats = jnp.sum(same & (rewards[:, None] > rewards[None, :]), axis=1)\n"
        "    loses = jnp.sum(same & (rewards[:, None] < rewards[None, :]), axis=1)\n"
        "    n = segments.segment_count(rewards, group_ids, num_groups)[group_ids]\n"
        "    return jnp.where(n > 1, (beats - loses) / jnp.maximum(n - 1, 1), 0.0)\n\n"
        "custom = batch.step_advantages(rank_advantage)\n"
        "print('rank          ', {k: round(v, 3) for k, v in per_trajectory(custom).items()})"
    ),
]

nb = new_notebook(cells=CELLS, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                         "language": "python"}})
nbformat.write(nb, "notebooks/advantages.ipynb")
print("wrote notebooks/advantages.ipynb")
