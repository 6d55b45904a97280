"""Random two-sample-group :class:`rljax.types.Step` lists for model and trainer tests."""

from __future__ import annotations

import numpy as np

from rljax.types import Step


def random_steps(rng: np.random.Generator, n: int = 6, *, vocab: int = 64) -> list[Step]:
    """``n`` steps in groups of two (``(f"q{i // 2}", i % 2)``), prompts of 3-7 and responses of 3-8
    random token ids in ``[1, vocab)``, with sampling logprobs in ``(-1, 0]``."""
    steps = []
    for i in range(n):
        p, r = int(rng.integers(3, 8)), int(rng.integers(3, 9))
        steps.append(
            Step(
                rng.integers(1, vocab, p).tolist(),
                rng.integers(1, vocab, r).tolist(),
                (f"q{i // 2}", i % 2),
                response_logprobs=(-rng.random(r)).tolist(),
            )
        )
    return steps
