"""Writes the notebooks of docs/notebooks/ from the cells below (run once after editing them).

The notebooks are stored without outputs: the docs build and tests/test_notebooks.py execute them.

    python tools/make_notebook.py
"""

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ADVANTAGES = [
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


TINY_AGENT = [
    new_markdown_cell(
        "# Train a tiny agent in five minutes\n\n"
        "The default recipe's agent, from Python: a 2-layer Qwen3-shaped model with a byte-level toy\n"
        "tokenizer (built on the fly, no download) learns the multi-turn `lookup` task: call a `lookup`\n"
        "tool, read the tool's answer, reply with it. A short warm start on demonstrations (whose final\n"
        "answer is wrong 60% of the time) teaches the tool-call format; then GRPO with the DPPO loss\n"
        "trains on the embedded JAX sampler. Everything runs on the CPU: a few minutes on 2 cores, most\n"
        "of it the warm start and the first step's compilation.\n\n"
        "The run is `rljax train --config=default` with fewer steps (the command-line flags are the\n"
        "config keys set below)."
    ),
    new_code_cell(
        "import json\n"
        "import pathlib\n"
        "import tempfile\n\n"
        "import matplotlib.pyplot as plt\n"
        "import numpy as np\n\n"
        "from rljax.envs import make_env, make_tasks\n"
        "from rljax.recipes import default\n"
        "from rljax.run.trainer import Trainer\n\n"
        "config = default.get_config()       # every key and its default: rljax.run.config.RunConfig\n"
        "config.warmstart.num_steps = 250    # default 400\n"
        "config.trainer.update(num_steps=25, eval_every=0, checkpoint_every=0, save_rollouts_every=25)\n"
        "config.optimizer.learning_rate = 5e-4   # default 2e-4: fewer steps, larger ones\n"
        "config.report.sinks = ['jsonl']     # metrics.jsonl (the default adds TensorBoard)\n"
        "print(config.model.init)\n"
        "print('prompts per step:', config.trainer.prompts_per_step, 'x samples:', config.rollout.group_size)"
    ),
    new_markdown_cell(
        "One task of the `lookup` environment, and the demonstration the warm start trains on:"
    ),
    new_code_cell(
        "env = make_env('lookup', **config.envs.lookup.kwargs)\n"
        "task = make_tasks('lookup', 1, seed=0, split='train')[0]\n"
        "for message in [*env.reset(task), *env.solution(task)]:\n"
        "    shown = message.get('tool_calls') or message['content']   # a tool call has no text\n"
        "    print(f\"{message['role']:>9}: {shown!r}\")"
    ),
    new_markdown_cell(
        "Train. `Trainer(config, workdir).run()` is the loop `rljax train` runs; it prints the warm start's\n"
        "table, then one row per RL step, and returns the per-step metrics."
    ),
    new_code_cell(
        "workdir = pathlib.Path(tempfile.mkdtemp(prefix='tiny_agent_'))\n"
        "rows = Trainer(config, workdir).run()"
    ),
    new_markdown_cell(
        "The reward curve. `reward/mean` is the mean reward of the step's 128 trajectories (16 tasks x 8\n"
        "samples); the warm-started agent answers right about a third of the time. One step's mean\n"
        "moves by several hundredths from sampling alone, so the check fits a line through all 25\n"
        "steps: its rise over the run, and its slope in standard errors (above 2: not sampling noise)."
    ),
    new_code_cell(
        "steps = np.array([row['step'] for row in rows])\n"
        "reward = np.array([row['reward/mean'] for row in rows])\n"
        "window = 5\n"
        "smooth = np.convolve(reward, np.ones(window) / window, mode='valid')\n"
        "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
        "ax.plot(steps, reward, 'o', alpha=0.4, label='reward/mean')\n"
        "ax.plot(steps[window - 1:], smooth, label=f'mean of {window} steps')\n"
        "ax.set_xlabel('RL step')\n"
        "ax.set_ylabel('reward')\n"
        "ax.legend()\n"
        "plt.show()\n"
        "slope, intercept = np.polyfit(steps, reward, 1)\n"
        "residual = reward - (slope * steps + intercept)\n"
        "stderr = np.sqrt(residual @ residual / (len(steps) - 2) / ((steps - steps.mean()) ** 2).sum())\n"
        "rise = slope * (steps[-1] - steps[0])\n"
        "print(f'fitted rise over {len(steps)} steps: {rise:+.3f} '\n"
        "      f'(slope {slope / stderr:.1f} standard errors)')\n"
        "assert rise > 0.05 and slope > 2 * stderr, 'the agent did not learn'"
    ),
    new_markdown_cell(
        "What the agent did at the last step: `trainer.save_rollouts_every` wrote every recorded call of\n"
        "step 25 to `rollouts/step_25.jsonl` (the same records `rljax view` draws). One rewarded\n"
        "trajectory, turn by turn:"
    ),
    new_code_cell(
        "saved = workdir / 'rollouts' / 'step_25.jsonl'\n"
        "records = [json.loads(line) for line in saved.read_text().splitlines()]\n"
        "best = max(records, key=lambda r: r['trajectory_reward'])['trajectory_id']\n"
        "for record in (r for r in records if r['trajectory_id'] == best):\n"
        "    print(f\"turn {record['turn']}: {record['completion']!r}\")\n"
        "print('reward', record['trajectory_reward'])"
    ),
    new_markdown_cell(
        "Next: `rljax view --workdir=<workdir>` draws these records as an HTML report; the\n"
        "[getting started](../getting_started.md) page explains every file of the workdir, and\n"
        "[train your own agent](../guides/agents.md) trains an agent function of your own the same way."
    ),
]


def write(cells: list, name: str) -> None:
    metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "notebooks" / name
    nbformat.write(new_notebook(cells=cells, metadata=metadata), path)
    print(f"wrote {path}")


if __name__ == "__main__":
    write(ADVANTAGES, "advantages.ipynb")
    write(TINY_AGENT, "tiny_agent.ipynb")
