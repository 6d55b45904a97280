"""Warm start: a short, logged next-token (SFT) phase on demonstrations before RL.

A tiny randomly initialized model cannot discover a multi-turn tool-call format by RL from
scratch in minutes. The warm start teaches the FORMAT with cross-entropy on demonstration
turns built from ``env.solution(task)`` (the ideal assistant / tool messages after
``env.reset(task)``), rendered token-for-token the way the rollout renders them
(:class:`rljax.chat.ChatSession`: the same bridges, the same stop tokens). To leave something
for RL to learn, the content of the FINAL assistant message is replaced, with probability
``corrupt_prob``, by a different entry of ``corrupt_choices`` (e.g. a wrong color): the
warm-started policy then knows the format but answers correctly only about
``1 - corrupt_prob`` of the time.

Loss of one warm-start update on a mini-batch ``B`` of demonstration samples (the trainer's
jitted :func:`rljax.training.step.train_step` with ``ce_weights = 1`` and ``rl_weights = 0``)::

    L = -(1 / N) * sum_{t in assistant tokens of B} log p_theta(x_t | x_<t),   N = #assistant tokens

Reference: the "SFT then RL" recipe of DeepSeek-R1 (cold start) and of most agent-RL stacks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rljax import knobs
from rljax.chat.base import Renderer
from rljax.chat.session import ChatSession
from rljax.data import StepBatch
from rljax.data.merge import merge_steps
from rljax.data.pack import pack
from rljax.envs.base import Task
from rljax.knobs import knob
from rljax.training.optimizer import OptimizerConfig
from rljax.types import Step

__all__ = [
    "WarmStartConfig",
    "demonstration_batches",
    "demonstration_steps",
    "has_solution",
    "run_warm_start",
]


#: OptimizerConfig fields the warm start sets itself (a constant learning rate, no warmup), with what
#: to write instead of overriding them in ``WarmStartConfig.optimizer``.
WARM_START_SET: dict[str, str] = {
    "learning_rate": "set by the warm start; use warmstart.learning_rate",
    "schedule": "the warm start's schedule is constant (no warmup)",
    "warmup_steps": "the warm start's schedule is constant (no warmup)",
    "total_steps": "the warm start's schedule is constant (no warmup)",
}


@knobs.section
class WarmStartConfig:
    """Warm-start settings: a constant learning rate (``learning_rate``) with the run's optimizer
    otherwise, whose other fields ``optimizer`` may override.

    The defaults are those of a run's ``config.warmstart`` (the default recipe's lookup task).

    >>> WarmStartConfig(num_steps=10, corrupt_choices=("red", "blue")).corrupt_prob
    0.6
    >>> WarmStartConfig(optimizer={"weight_decay": 0.1}).optimizer
    {'weight_decay': 0.1}
    """

    num_steps: int = knob(400, ge=0, doc="optimizer steps (0 disables the warm start)")
    batch_size: int = knob(32, ge=1, doc="demonstrations (trajectories) per step")
    learning_rate: float = knob(3e-3, gt=0, doc="the warm start's constant learning rate")
    corrupt_prob: float = knob(
        0.6, ge=0, le=1, doc="probability that a demonstration's final answer is replaced by a wrong one"
    )
    corrupt_choices: tuple[str, ...] = knob(
        ("red", "blue", "green", "gold"),
        doc="the answers to corrupt with (a different one than the right answer; at least two when "
        "``corrupt_prob`` > 0)",
    )
    seq_len: int = knob(256, ge=1, doc="packed row length")
    log_every: int = knob(20, ge=1, doc="steps between log lines")
    optimizer: dict = knob(
        {},
        overrides_of=OptimizerConfig,
        doc="fields of :class:`rljax.training.optimizer.OptimizerConfig` that the warm start's optimizer "
        "takes instead of the run's ``optimizer`` (not the schedule: ``learning_rate`` above, constant)",
    )

    def __post_init__(self) -> None:
        for key in self.optimizer:
            if key in WARM_START_SET:
                raise ValueError(f"WarmStartConfig.optimizer.{key}: {WARM_START_SET[key]}")
        object.__setattr__(self, "corrupt_choices", tuple(str(c) for c in self.corrupt_choices))
        if self.num_steps and self.corrupt_prob > 0 and len(self.corrupt_choices) < 2:
            raise ValueError(
                "WarmStartConfig.corrupt_choices: corrupt_prob > 0 needs at least two answers "
                f"(e.g. the env's colors); got {list(self.corrupt_choices)}"
            )


def _assistant_ids(
    renderer: Renderer,
    history: Sequence[Mapping[str, Any]],
    message: Mapping[str, Any],
    prompt: Sequence[int],
    tools: Any,
) -> list[int]:
    """Token ids the model must emit for ``message`` after ``prompt`` (up to its stop token)."""
    full = renderer.render_ids([*history, message], add_generation_prompt=False, tools=tools)
    if list(full[: len(prompt)]) != list(prompt):
        raise ValueError(
            "the renderer's full render of a demonstration does not extend its generation prompt; "
            "this renderer cannot build token-exact demonstrations"
        )
    rest = list(full[len(prompt) :])
    stops = set(int(i) for i in renderer.stop_token_ids())
    for k, t in enumerate(rest):
        if t in stops:
            return rest[: k + 1]
    raise ValueError("a rendered assistant message has no stop token; cannot cut the demonstration turn")


def has_solution(make_env: Callable[[], Any]) -> bool:
    """Whether the environments ``make_env`` builds have ``solution(task)``, which the warm start's
    demonstrations come from (a factory that cannot build an env, e.g. an agent env without an env
    class, has none).

    >>> from rljax import envs
    >>> has_solution(lambda: envs.make_env("lookup")), has_solution(lambda: object())
    (True, False)
    """
    try:
        env = make_env()
    except ValueError:
        return False
    return callable(getattr(env, "solution", None))


def _reset_and_solve(task: Task, env: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
    """``env.reset(task)``'s messages, ``env.solution(task)`` and the indices of its assistant turns."""
    if not hasattr(env, "solution"):
        raise ValueError(f"environment {type(env).__name__} has no solution(task); the warm start needs one")
    messages = list(env.reset(task))
    solution = [dict(m) for m in env.solution(task)]
    assistant_turns = [i for i, m in enumerate(solution) if m.get("role") == "assistant"]
    if not assistant_turns:
        raise ValueError(f"env.solution({task.id!r}) has no assistant message")
    return messages, solution, assistant_turns


def demonstration_steps(
    task: Task,
    env: Any,
    renderer: Renderer,
    *,
    final_answer: str | None = None,
    algorithm: str = "sft",
) -> list[Step]:
    """One Step per assistant turn of ``env.solution(task)``, token-exact like the rollout's steps.

    Args:
      task: the task; ``env.reset(task)`` gives the initial messages.
      env: a fresh environment with a ``solution(task)`` method (list of messages after reset).
      renderer: the chat format.
      final_answer: if given, replaces the content of the final assistant message.
      algorithm: recorded on the steps.

    Returns:
      the steps (loss mask 1 on every assistant token, reward 0, logprobs None).

    >>> from rljax.chat import make_renderer, toy_tokenizer
    >>> from rljax import envs
    >>> r = make_renderer("chatml", toy_tokenizer("chatml"))
    >>> task = envs.make_tasks("lookup", 1, seed=0)[0]
    >>> steps = demonstration_steps(task, envs.make_env("lookup", compact=True), r, final_answer="blue")
    >>> len(steps), r.tokenizer.decode(steps[-1].response_ids)
    (2, 'blue<|im_end|>')
    """
    messages, solution, assistant_turns = _reset_and_solve(task, env)
    if final_answer is not None:
        solution[assistant_turns[-1]]["content"] = final_answer
    return _render_demonstration(task, env, renderer, messages, solution, algorithm)


def _render_demonstration(
    task: Task,
    env: Any,
    renderer: Renderer,
    messages: Sequence[Mapping[str, Any]],
    solution: Sequence[Mapping[str, Any]],
    algorithm: str,
) -> list[Step]:
    tools = getattr(env, "tools", None)
    session = ChatSession(renderer, messages, tools=tools)
    turns: list[tuple[list[int], list[int]]] = []
    pending: list[Mapping[str, Any]] = []
    for m in solution:
        if m.get("role") != "assistant":
            pending.append(m)
            continue
        if pending:
            session.add_messages(pending)
            pending = []
        prompt = list(session.prompt_ids)
        ids = _assistant_ids(renderer, session.messages, m, prompt, tools)
        turns.append((prompt, ids))
        session.add_completion(ids)
    return [
        Step(
            prompt_ids=p,
            response_ids=r,
            trajectory_id=(task.id, 0),
            is_last_step=k == len(turns) - 1,
            env=str(getattr(env, "name", "default")),
            algorithm=algorithm,
        )
        for k, (p, r) in enumerate(turns)
    ]


def demonstration_batches(
    tasks: Sequence[Task],
    make_env: Callable[[Task], Any],
    renderer: Renderer,
    config: WarmStartConfig,
    *,
    seed: int,
) -> Iterator[tuple[list[Step], int]]:
    """The demonstrations of each warm-start step: ``(steps, number of uncorrupted demonstrations)``.

    Each step draws ``batch_size`` tasks (seeded by ``seed``); with probability ``corrupt_prob`` a
    demonstration's final assistant message is replaced by an entry of ``corrupt_choices`` that
    differs from what the demonstration would otherwise say (the content of the final assistant
    message of ``env.solution(task)``, compared after stripping whitespace). Comparing with the
    demonstration's own output, not with a task field, keeps corruption honest whatever format the
    env wraps its answer in (reasoning-gym's ``<answer>7</answer>`` vs ``task.data["answer"] == "7"``).
    Each demonstration's task id gets a ``/ws<step>.<slot>`` suffix (its own group key).
    """
    if not tasks:
        raise ValueError("the warm start needs at least one training task")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5F7]))
    for k in range(config.num_steps):
        idx = rng.choice(len(tasks), size=config.batch_size, replace=len(tasks) < config.batch_size)
        steps: list[Step] = []
        correct = 0
        for j, i in enumerate(idx.tolist()):
            task = dataclasses.replace(tasks[i], id=f"{tasks[i].id}/ws{k}.{j}")  # unique group key per demo
            env = make_env(task)
            messages, solution, assistant_turns = _reset_and_solve(task, env)
            final = solution[assistant_turns[-1]]
            if config.corrupt_prob > 0 and rng.random() < config.corrupt_prob:
                right = str(final.get("content") or "").strip()
                wrong = [c for c in config.corrupt_choices if c.strip() != right]
                if not wrong:
                    raise ValueError(
                        f"warm start: every corrupt_choices entry equals the demonstration's answer "
                        f"{right!r} of task {tasks[i].id!r}; give choices in the form the env's solution "
                        "answers in"
                    )
                final["content"] = wrong[int(rng.integers(len(wrong)))]
            else:
                correct += 1
            steps += _render_demonstration(task, env, renderer, messages, solution, "sft")
        yield steps, correct


def run_warm_start(
    state: Any,
    tasks: Sequence[Task],
    make_env: Callable[[Task], Any],
    renderer: Renderer,
    config: WarmStartConfig,
    *,
    seed: int,
    train_step: Callable[..., Any],
    counts_fn: Callable[..., Any],
    log: Callable[[dict[str, Any]], None] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Any, list[dict[str, float]]]:
    """Runs ``config.num_steps`` cross-entropy updates on (partly corrupted) demonstrations.

    Args:
      state: a :class:`rljax.training.step.TrainState` (its objective may be anything: the batches
        carry ``rl_weights = 0`` and ``ce_weights = 1``).
      tasks: training tasks; each step draws ``batch_size`` of them (seeded).
      make_env: ``task -> fresh env`` with ``solution(task)``.
      renderer: the chat format.
      config: :class:`WarmStartConfig`.
      seed: seeds the task draws and the corruptions.
      train_step: ``(state, batch, counts) -> (state, metrics)``.
      counts_fn: ``(batch, objective_config) -> Counts``.
      log: called with the metrics of every ``log_every``-th step (and the last).
      on_step: called with every step's metrics (e.g. to advance a progress bar).

    Returns:
      ``(state, metrics per step)``; metrics include ``warmstart/loss`` (mean CE per token) and
      ``warmstart/correct_fraction`` (demonstrations left uncorrupted).
    """
    history: list[dict[str, float]] = []
    start = time.perf_counter()

    def finish(k: int, metrics: Mapping[str, Any], correct: int) -> None:
        """Reads step ``k``'s metrics (waiting for its update) and reports them."""
        nonlocal start
        tokens = float(metrics["tokens/ce"]) if "tokens/ce" in metrics else 1.0
        row = {
            "warmstart/step": float(k + 1),
            "warmstart/loss": float(metrics["loss"]),
            "warmstart/ce_tokens": tokens,
            "warmstart/grad_norm": float(metrics["grad_norm"]),
            "warmstart/correct_fraction": correct / config.batch_size,
            "warmstart/step_time_s": time.perf_counter() - start,
        }
        history.append(row)
        if on_step is not None:
            on_step(row)
        if log is not None and ((k + 1) % config.log_every == 0 or k + 1 == config.num_steps):
            log(row)
        start = time.perf_counter()

    # One step in flight: step k's update is dispatched (JAX runs it asynchronously), then step k-1's
    # metrics are read, and step k+1's demonstrations are rendered and packed while step k computes.
    pending: tuple[int, Mapping[str, Any], int] | None = None
    for k, (steps, correct) in enumerate(demonstration_batches(tasks, make_env, renderer, config, seed=seed)):
        batch = merge_steps(StepBatch(steps))
        packed = pack(batch, seq_len=config.seq_len, ce_weights=1.0, rl_weights=0.0).batch
        state, metrics = train_step(state, packed, counts_fn(packed, state.config.objective))
        if pending is not None:
            finish(*pending)
        pending = (k, metrics, correct)
    if pending is not None:
        finish(*pending)
    return state, history
