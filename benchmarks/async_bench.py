"""Trained tokens per second: sync vs async vs fully_async, on a simulated engine, in one run.

The benchmark runs the REAL trainer loop and schedulers (``rljax.run.trainer.Trainer`` with
``trainer.mode`` = ``sync``, ``async`` and ``fully_async``: task draws, rollouts through
``rljax.rollout``, weight publishing, staleness accounting) with two parts replaced so that the
figures describe the scheduling and nothing else:

* the policy engine is :class:`SimEngine`: continuous batching with a constant time per token
  (``--token_ms``; the memory-bound regime, up to ``--engine_slots`` sequences at once) and
  heavy-tailed turn lengths, ``median * lognormal(0, sigma)`` tokens, drawn from each request's
  seed (the p99 / p50 tail ratio is printed). It applies weight updates in flight (tokens after an
  update carry the new version), like engines with ``supports_in_flight_updates``;
* a train step (``Trainer._train_on``) sleeps ``--train_ms``: a fixed train-step time.

The env is one turn with a random reward. For each mode it prints trained tokens per second over
the steps after the first (``--steps`` per mode), the engine's idle fraction and the largest
staleness of a trained token, then the ratios fully_async / sync and fully_async / async next to
the goals (>= 2x and >= 1.5x). ``async`` and ``fully_async`` use the same
``--max_off_policy_steps``. Wall-clock sleeps on a shared machine: expect a few percent of noise.

    PYTHONPATH=. python benchmarks/async_bench.py --steps 20 --max_off_policy_steps 2

``--real`` runs the default recipe (tiny model, embedded sampler, the lookup task) instead, per seed:
sync for N steps, then fully_async up to 2N steps from the same warm-started weights (the recipe's
warm start runs once per seed; both runs' times count from their first RL step). It prints both
reward curves, the reward at step N (equal trained samples: every step trains prompts_per_step
groups; the trailing mean of 3 rows and a held-out eval, 32 tasks x 8), both wall times to step N,
and the wall time fully_async takes to reach sync's step-N reward.

    PYTHONPATH=. python benchmarks/async_bench.py --real --steps 40 --max_off_policy_steps 1 --seeds 0 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import pathlib
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from recipes import load_recipe  # noqa: E402

from rljax.envs.base import Task  # noqa: E402
from rljax.inference.engine import Completion  # noqa: E402
from rljax.run.trainer import Trainer  # noqa: E402
from rljax.types import VersionSpan  # noqa: E402


@dataclasses.dataclass
class SimEngine:
    """A simulated policy engine (see the module docstring); tracks its busy time."""

    token_s: float
    median: float
    sigma: float
    slots: int
    filler_id: int
    weight_version: int = 0
    supports_in_flight_updates: bool = True

    def __post_init__(self) -> None:
        self._slots: asyncio.Semaphore | None = None
        self._updates: list[tuple[float, int]] = [(-np.inf, 0)]
        self.active = 0
        self.busy_s = 0.0
        self._since = time.perf_counter()

    def reset_clock(self) -> None:
        self.busy_s, self._since = 0.0, time.perf_counter()

    def _mark(self) -> None:
        now = time.perf_counter()
        if self.active:
            self.busy_s += now - self._since
        self._since = now

    async def update_weights(self, model: Any, *, version: int | None = None) -> int:
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self._updates.append((time.perf_counter(), self.weight_version))
        return self.weight_version

    def _version_at(self, t: float) -> int:
        return next(v for when, v in reversed(self._updates) if when <= t)

    async def generate(self, prompt_ids: Any, sampling: Any, *, session_id: str | None = None) -> Completion:
        rng = np.random.default_rng(sampling.seed)
        length = int(np.clip(round(self.median * rng.lognormal(0.0, self.sigma)), 1, sampling.max_tokens))
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.slots)
        async with self._slots:
            self._mark()
            self.active += 1
            start = time.perf_counter()
            try:
                await asyncio.sleep(length * self.token_s)
            finally:
                self._mark()
                self.active -= 1
        versions = [self._version_at(start + (i + 1) * self.token_s) for i in range(length)]
        spans, first = [], 0
        for i in range(1, length + 1):
            if i == length or versions[i] != versions[first]:
                spans.append(VersionSpan(versions[first], first, i))
                first = i
        stopped = length < sampling.max_tokens
        ids = [self.filler_id] * (length - 1) + [sampling.stop_token_ids[0] if stopped else self.filler_id]
        return Completion(
            ids=ids,
            logprobs=[-1.0] * length,
            finish_reason="stop" if stopped else "length",
            weight_version=versions[0],
            weight_versions=tuple(spans),
        )


class CoinEnv:
    """One turn; reward 0 or 1 by a coin (groups have reward variance most of the time)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng()

    def reset(self, task: Task) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"question {task.id}"}]

    def step(self, action: Any) -> tuple[list, float, bool, dict]:
        return [], float(self.rng.random() < 0.5), True, {}


def _config(args: argparse.Namespace, mode: str) -> Any:
    c = load_recipe("smoke")
    c.warmstart.num_steps = 0
    c.rollout.update(
        group_size=args.group_size, max_turns=1, max_tokens=args.max_tokens, max_context_len=4096
    )
    c.trainer.update(
        mode=mode,
        num_steps=args.steps,
        prompts_per_step=args.prompts,
        max_off_policy_steps=args.max_off_policy_steps,
        eval_every=0,
        checkpoint_every=0,
        seq_len=4096,
    )
    c.engine.max_model_len = 8192
    return c


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, float]:
    """One run of ``mode``; trained tokens/s etc. over the steps after the first."""
    engine = SimEngine(
        token_s=args.token_ms / 1000,
        median=args.median_tokens,
        sigma=args.sigma,
        slots=args.engine_slots,
        filler_id=args.filler_id,
    )
    train_s = args.train_ms / 1000

    marks: list[tuple[float, float]] = []  # (time, engine busy seconds) as each step starts training

    def train_on(self: Trainer, batch: Any) -> dict[str, float]:
        engine._mark()
        marks.append((time.perf_counter(), engine.busy_s))
        time.sleep(train_s)
        return {"optimizer_steps": 1.0}

    tasks = [Task(f"q{i}") for i in range(args.tasks)]
    with tempfile.TemporaryDirectory() as wd:
        trainer = Trainer(
            _config(args, mode),
            wd,
            make_env={"lookup": CoinEnv},
            tasks={"lookup": (tasks, [])},
            engine=engine,
        )
        trainer._train_on = train_on.__get__(trainer)  # a fixed train-step time
        history = trainer.run()
    # steps 2..N were taken between the first step's training start and the last one's
    rows = history[1:]
    wall = marks[-1][0] - marks[0][0]
    busy = marks[-1][1] - marks[0][1]
    tokens = sum(r["rollout/response_tokens"] for r in rows)  # one turn, loss mask 1: all are trained
    stale = max(r.get("async/staleness_max", r["policy_version/lag"]) for r in rows)
    return {"tokens_per_s": tokens / wall, "idle": 1.0 - busy / wall, "staleness_max": stale}


def _trailing(rows: list[dict], i: int, window: int = 3) -> float:
    return float(np.mean([r["reward/mean"] for r in rows[max(0, i - window + 1) : i + 1]]))


@contextlib.contextmanager
def shared_warm_start() -> Iterator[list[float]]:
    """Runs the recipe's warm start once per seed and hands its weights to every later run of that
    seed (the warm start is a function of the seed alone, and takes minutes): both modes of a seed
    start RL from the same weights. Yields the list of each run's warm-start seconds (to leave out
    of its elapsed times)."""
    from flax import nnx

    from rljax.run.run import Run
    from rljax.training.step import TrainState

    original = Run.warm_start
    cache: dict[int, tuple[Any, Any, list[dict]]] = {}

    spent: list[float] = []

    def warm_start(self: Run, *, on_step: Any, log: Any) -> list[dict]:
        start = time.perf_counter()
        seed = self.cfg.seed
        if seed not in cache:
            history = original(self, on_step=on_step, log=log)
            graph, weights = nnx.split(self.state.model)
            cache[seed] = (graph, jax.tree.map(np.asarray, weights), history)
        graph, weights, history = cache[seed]
        model = nnx.merge(graph, jax.tree.map(jnp.asarray, weights))
        self.state = TrainState.create(model, self.state.config, mesh=self.mesh)
        spent.append(time.perf_counter() - start)
        return history

    Run.warm_start = warm_start
    try:
        yield spent
    finally:
        Run.warm_start = original


def run_real(args: argparse.Namespace) -> None:
    """The default recipe on the embedded sampler, sync vs fully_async, per seed: the wall time
    fully_async takes to reach sync's reward at step N (trailing mean of 3 rows), and both rewards at
    step N (equal trained samples: every step trains prompts_per_step groups). Elapsed times count
    from the first RL step (the shared warm start is left out)."""
    with shared_warm_start() as spent:
        _run_real(args, spent)


def _train(
    args: argparse.Namespace, mode: str, seed: int, steps: int, warm_start_s: list[float], *, eval_every: int
) -> list[dict]:
    c = load_recipe("default")
    c.seed = seed
    c.trainer.update(
        mode=mode,
        num_steps=steps,
        max_off_policy_steps=args.max_off_policy_steps,
        eval_every=eval_every,  # the weights after N steps on the held-out tasks
        checkpoint_every=0,
    )
    c.eval.group_size = 8
    with tempfile.TemporaryDirectory() as wd:
        rows = Trainer(c, wd).run()
    for r in rows:  # RL time alone
        r["time/elapsed_s"] -= warm_start_s[-1]
    return rows


def _run_real(args: argparse.Namespace, warm_start_s: list[float]) -> None:
    n = args.steps
    for mode in ("sync", "fully_async"):  # compiles the programs both modes use, uncounted
        _train(args, mode, args.seeds[0], 2, warm_start_s, eval_every=2)
    finals: dict[str, list[tuple[float, float]]] = {"sync": [], "fully_async": []}
    for seed in args.seeds:
        sync = _train(args, "sync", seed, n, warm_start_s, eval_every=n)
        # fully_async goes on past step N (up to 2N) to find when it reaches sync's reward at N
        fa = _train(args, "fully_async", seed, 2 * n, warm_start_s, eval_every=n)
        target = _trailing(sync, n - 1)
        reach = next((r["time/elapsed_s"] for i, r in enumerate(fa) if _trailing(fa, i) >= target), None)
        reach_step = next((r["step"] for i, r in enumerate(fa) if _trailing(fa, i) >= target), None)
        for mode, rows in (("sync", sync), ("fully_async", fa)):
            finals[mode].append((_trailing(rows, n - 1), rows[n - 1]["eval/reward_mean"]))
            curve = " ".join(f"{r['reward/mean']:.2f}" for r in rows)
            print(f"seed {seed} {mode:>11} reward by step: {curve}", flush=True)
        sync_s, fa_s = sync[n - 1]["time/elapsed_s"], fa[n - 1]["time/elapsed_s"]
        reached = (
            "never" if reach is None else f"{reach:.0f}s (step {reach_step}, {sync_s / reach:.2f}x faster)"
        )
        print(
            f"seed {seed}: at step {n} (equal trained samples): sync reward {target:.3f} "
            f"(held-out {sync[n - 1]['eval/reward_mean']:.3f}) in {sync_s:.0f}s; fully_async reward "
            f"{_trailing(fa, n - 1):.3f} (held-out {fa[n - 1]['eval/reward_mean']:.3f}) in {fa_s:.0f}s "
            f"({sync_s / fa_s:.2f}x faster); fully_async reached sync's step-{n} reward in {reached}",
            flush=True,
        )
    for mode, rows in finals.items():
        train_r, held_out = np.mean(rows, axis=0)
        print(
            f"mean over seeds {args.seeds}: {mode} reward at step {n} {train_r:.3f}, held-out {held_out:.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts_per_step")
    p.add_argument("--group_size", type=int, default=4)
    p.add_argument("--tasks", type=int, default=256)
    p.add_argument("--max_off_policy_steps", type=int, default=2)
    p.add_argument("--token_ms", type=float, default=2.0)
    p.add_argument("--median_tokens", type=float, default=24.0)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of turn lengths")
    p.add_argument("--max_tokens", type=int, default=1024)
    p.add_argument("--train_ms", type=float, default=150.0)
    p.add_argument("--engine_slots", type=int, default=256)
    p.add_argument("--filler_id", type=int, default=100)
    p.add_argument("--real", action="store_true", help="the default recipe on the embedded sampler")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = p.parse_args()
    if args.real:
        run_real(args)
        return
    from scipy.stats import norm

    tail = float(np.exp(args.sigma * norm.ppf(0.99)))
    print(
        f"turn lengths: median {args.median_tokens:g} tokens x lognormal(0, {args.sigma:g}) "
        f"(p99/p50 tail ratio {tail:.1f}), {args.token_ms:g} ms/token, train step {args.train_ms:g} ms, "
        f"{args.prompts} prompts x {args.group_size} per step, "
        f"max_off_policy_steps {args.max_off_policy_steps}",
        flush=True,
    )
    results = {}
    for mode in ("sync", "async", "fully_async"):
        r = results[mode] = run_mode(args, mode)
        print(
            f"{mode:>12}: {r['tokens_per_s']:8.0f} trained tokens/s   engine idle {r['idle']:.2f}   "
            f"staleness max {r['staleness_max']:g}",
            flush=True,
        )
    fa = results["fully_async"]["tokens_per_s"]
    print(
        f"fully_async / sync  = {fa / results['sync']['tokens_per_s']:.2f}x (goal >= 2x)\n"
        f"fully_async / async = {fa / results['async']['tokens_per_s']:.2f}x (goal >= 1.5x)\n"
        f"fully_async staleness max {results['fully_async']['staleness_max']:g} <= "
        f"max_off_policy_steps {args.max_off_policy_steps}: "
        f"{results['fully_async']['staleness_max'] <= args.max_off_policy_steps}"
    )


if __name__ == "__main__":
    main()
