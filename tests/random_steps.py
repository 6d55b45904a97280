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


def _routing_of(tokens: list[int], layers: int, top_k: int, experts: int) -> np.ndarray:
    """int ``[len(tokens) - 1, layers, top_k]``: a routing that depends on each token's prefix only, as
    a sampler's would (equal prefixes, equal routing)."""
    out = np.zeros((max(len(tokens) - 1, 0), layers, top_k), np.int64)
    for p in range(len(tokens) - 1):
        draw = np.random.default_rng(abs(hash(tuple(tokens[: p + 1]))) % 2**32)
        out[p] = [draw.choice(experts, top_k, replace=False) for _ in range(layers)]
    return out


def prefix_sharing_steps(
    rng: np.random.Generator,
    *,
    groups: int = 3,
    group_size: int = 3,
    max_turns: int = 2,
    vocab: int = 12,
    routing: tuple[int, int, int] | None = None,
) -> list[Step]:
    """Step-wise trajectories whose prompts share prefixes: ``groups`` prompt groups of ``group_size``
    trajectories of 1..``max_turns`` turns over a small vocabulary (so unrelated prompts share some
    tokens too). Every prompt starts with one system prefix; a group's first turns share its question;
    a later turn's prompt either extends the previous turn (``prompt + response + observation``: merging
    folds it), drops the previous response's last token (shares the previous prompt, never the
    response), or restarts from the question with a new observation (a context reset). Loss masks,
    logprobs and temperatures are random (a temperature per trajectory). ``routing=(layers, top_k,
    experts)`` adds the sampler's MoE routing, a function of each token's prefix, except that one
    trajectory in four records a different expert for one prompt token (its prefix is then shared up
    to that token only)."""

    def ids(lo: int, hi: int) -> list[int]:
        return rng.integers(1, vocab, int(rng.integers(lo, hi + 1))).tolist()

    system = ids(1, 3)
    steps = []
    for g in range(groups):
        question = system + ids(1, 5)
        for r in range(group_size):
            turns, prompt = int(rng.integers(1, max_turns + 1)), question
            temperature = float(rng.choice([0.7, 1.0, 1.3]))
            odd = routing is not None and rng.random() < 0.25
            for t in range(turns):
                response = ids(1, 4)
                routed = None
                if routing is not None:
                    routed = _routing_of(prompt + response, *routing)
                    if odd:  # another (still distinct) top-k set for one prompt token
                        p = int(rng.integers(0, len(prompt)))
                        routed[p, 0] = (routed[p, 0] + 1) % routing[2]
                steps.append(
                    Step(
                        prompt,
                        response,
                        (f"g{g}", r),
                        loss_mask=(rng.random(len(response)) < 0.8).astype(int).tolist(),
                        response_logprobs=np.log(rng.uniform(0.05, 1.0, len(response))).tolist(),
                        is_last_step=t == turns - 1,
                        temperature=temperature,
                        routed_experts=routed,
                    )
                )
                kind = int(rng.integers(3))
                if kind == 0:
                    prompt = prompt + response + ids(1, 3)
                elif kind == 1:
                    prompt = prompt + response[:-1] + ids(1, 3)
                else:
                    prompt = question + ids(1, 3)
    return steps
