"""Verifiable rewards for dataset rows: ``reward_spec = {"method": ..., "ground_truth": ...}``.

Methods (``score(reward_spec, response, task=...)``):

* ``"math_verify"`` (also verl's ``"rule"`` style): the ``math-verify`` package parses the gold
  answer and the response (``\\boxed{...}``, ``$...$`` or a plain expression; the last answer in
  the response counts) and checks mathematical equivalence -> 1.0 or 0.0.
* ``"exact_match"``: ``response.strip() == str(ground_truth).strip()`` -> 1.0 or 0.0.
* ``"module:fn"``: a user function with verl's ``compute_score`` signature,
  ``fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}``
  (imported once; any row may name one).

math-verify's own timeouts use ``signal.alarm``, which only works in the main thread; rljax runs
synchronous environments in worker threads, so it calls math-verify without them and relies on
the rollout's per-call env timeout (``RolloutConfig.env_timeout_s``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

from rljax.envs.loader import load_attr

__all__ = ["METHODS", "load_function", "math_verify_score", "score"]

#: The ``method`` values of a ``reward_spec`` that :func:`score` computes.
METHODS = ("math_verify", "rule", "exact_match")


@functools.cache
def load_function(spec: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:function"`` (``a.b:C.method`` works too), imported
    once; a bad name is a :class:`rljax.envs.loader.LoadError` saying what failed.

    >>> load_function("math:sqrt")(4.0)
    2.0
    """
    return load_attr(spec)


def _wrap_gold(gold: str) -> str:
    """math-verify finds answers inside math delimiters; a bare gold like ``72`` or ``x^2`` is
    wrapped so it parses as an expression."""
    text = gold.strip()
    if "\\boxed" in text or "$" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def math_verify_score(response: str, ground_truth: Any) -> float:
    """1.0 when ``response``'s final answer is mathematically equal to ``ground_truth``, else 0.0.

    >>> math_verify_score("so the answer is \\\\boxed{\\\\frac{1}{2}}", "0.5")
    1.0
    >>> math_verify_score("I think 3", "4")
    0.0
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:  # pragma: no cover - the extra is installed in CI
        raise ImportError("reward method 'math_verify' needs `pip install rljax[envs]` (math-verify)") from e
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    parsed_gold = []
    for g in golds:
        parsed_gold += parse(_wrap_gold(str(g)), parsing_timeout=None)
    if not parsed_gold:
        raise ValueError(f"math_verify cannot parse the ground truth {ground_truth!r}")
    answer = parse(response, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if verify(parsed_gold, answer, timeout_seconds=None) else 0.0


def _as_reward(value: Any, where: str) -> float:
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"{where} returned a dict without 'score': {value!r:.120}")
        value = value["score"]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{where} returned {value!r:.80}, not a finite number")
    return float(value)


def score(reward_spec: Mapping[str, Any], response: str, *, task: Any = None) -> float:
    """The reward of ``response`` under ``reward_spec`` (module docstring lists the methods).

    >>> score({"method": "exact_match", "ground_truth": "7"}, " 7 ")
    1.0
    """
    if not isinstance(reward_spec, Mapping):
        raise ValueError(
            f"reward_spec must be a dict with 'method' and 'ground_truth', got {reward_spec!r:.80}"
        )
    method = reward_spec.get("method", reward_spec.get("style"))
    if method is None:
        raise ValueError(f"reward_spec has no 'method': {reward_spec!r:.120}")
    gold = reward_spec.get("ground_truth")
    if method in ("math_verify", "rule"):
        if gold is None:
            raise ValueError(f"reward method {method!r} needs a ground_truth")
        return math_verify_score(response, gold)
    if method == "exact_match":
        if gold is None:
            raise ValueError("reward method 'exact_match' needs a ground_truth")
        return 1.0 if response.strip() == str(gold).strip() else 0.0
    if isinstance(method, str) and ":" in method:
        fn = load_function(method)
        data_source = getattr(task, "data_source", None)
        extra_info = dict(getattr(task, "extra_info", None) or {})
        return _as_reward(fn(data_source, response, gold, extra_info), f"reward function {method!r}")
    raise ValueError(f"unknown reward method {method!r}; use one of {list(METHODS)} or 'module:function'")
