"""prepare_samples: what each algorithm's tokens feed (rl / ce / ref_kl), checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from rljax.algorithms import get_algorithm
from rljax.data import StepBatch
from rljax.data.filters import make_filter
from rljax.data.prepare import load_observation_filter, prefixed, prepare_samples
from rljax.types import Step

# Two 2-turn trajectories of one prompt; turn 2 extends turn 1 with a tool message body [7, 8]
# wrapped in scaffolding [50] ... [51] (roles: None for scaffolding).
PROMPT, ROLES = [1, 2], ["user", "user"]


def _steps(rewards=(1.0, 0.0)) -> list[Step]:
    out = []
    for rep, reward in enumerate(rewards):
        r1, r2 = [10 + rep, 11], [12, 13, 14]
        p2 = [*PROMPT, *r1, 50, 7, 8, 51]
        roles2 = [*ROLES, "assistant", "assistant", None, "tool", "tool", None]
        out += [
            Step(
                PROMPT, r1, ("q", rep), response_logprobs=[-0.5, -0.5], is_last_step=False, prompt_roles=ROLES
            ),
            Step(p2, r2, ("q", rep), response_logprobs=[-0.1] * 3, reward=reward, prompt_roles=roles2),
        ]
    return out


def test_rl_advantages_merged_with_zero_gaps():
    p = prepare_samples(get_algorithm("grpo"), StepBatch(_steps()))
    assert len(p.samples) == 2 and p.rl_weights is None and p.ce_weights is None
    # grpo(norm_by_std=False) of rewards [1, 0] -> [0.5, -0.5]; the 4 gap tokens get 0
    assert p.advantages[0].tolist() == [0.5, 0.5, 0, 0, 0, 0, 0.5, 0.5, 0.5]
    assert p.advantages[1].tolist() == [-0.5, -0.5, 0, 0, 0, 0, -0.5, -0.5, -0.5]
    assert p.metrics["merge/num_samples_before_merge"] == 4


def test_echo_trains_tool_bodies_with_ce_and_actions_with_rl():
    p = prepare_samples(get_algorithm("echo", observation_ce={"tool": 0.25}), StepBatch(_steps()))
    for s, rl, ce in zip(p.samples, p.rl_weights, p.ce_weights, strict=True):
        assert s.response_ids[2:6] == [50, 7, 8, 51]
        assert list(s.loss_mask) == [1, 1, 0, 1, 1, 0, 1, 1, 1]
        assert rl.tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1]
        assert ce.tolist() == [0, 0, 0, 0.25, 0.25, 0, 0, 0, 0]
    assert p.metrics["echo/tokens"] == 4


def test_echo_filter_narrows_and_needs_merge():
    def first_body_token_only(sample, candidates):
        out = np.zeros_like(candidates)
        out[np.flatnonzero(candidates)[:1]] = True
        return out

    p = prepare_samples(get_algorithm("echo"), StepBatch(_steps()), observation_filter=first_body_token_only)
    assert [c.nonzero()[0].tolist() for c in p.ce_weights] == [[3], [3]]
    with pytest.raises(ValueError, match="set trainer.merge=True"):
        prepare_samples(get_algorithm("echo"), StepBatch(_steps()), merge=False)


def test_sft_trains_ce_on_the_trainable_tokens():
    steps = [s.replace(algorithm="sft") for s in _steps()]
    steps[1] = steps[1].replace(loss_mask=[1, 0, 1])
    p = prepare_samples(get_algorithm("sft", teacher="t"), StepBatch(steps), merge=False)
    assert [w.tolist() for w in p.ce_weights] == [[1, 1], [1, 0, 1], [1, 1], [1, 1, 1]]
    assert all(not a.any() for a in p.advantages) and p.ref_logprobs is None


def test_ref_kl_scores_each_merged_sample():
    seen = []

    def score(samples):
        seen.extend(samples)
        return [-0.1 * np.arange(1, len(s.response_ids) + 1) for s in samples]

    p = prepare_samples(get_algorithm("opd", teacher="t"), StepBatch(_steps()), score=score)
    assert [len(s.response_ids) for s in seen] == [9, 9]  # merged samples are scored, once each
    assert p.ref_logprobs[0] == pytest.approx(-0.1 * np.arange(1, 10))
    assert [w.tolist() for w in p.ref_kl_weights] == [[1, 1, 0, 0, 0, 0, 1, 1, 1]] * 2
    with pytest.raises(ValueError, match="needs score="):
        prepare_samples(get_algorithm("opd", teacher="t"), StepBatch(_steps()))
    with pytest.raises(ValueError, match="got 3 reference logprobs for 9 response tokens"):
        prepare_samples(
            get_algorithm("opd", teacher="t"), StepBatch(_steps()), score=lambda s: [[-1.0] * 3] * 2
        )
    with pytest.raises(ValueError, match="not finite or > 0"):
        prepare_samples(
            get_algorithm("opd", teacher="t"), StepBatch(_steps()), score=lambda s: [[0.5] * 9] * 2
        )


def test_advantage_filters_do_not_wipe_out_non_rl_algorithms():
    zero_adv = [make_filter("zero_advantage", mode="enforce"), make_filter("zero_variance", mode="enforce")]
    steps = [s.replace(algorithm="sft") for s in _steps(rewards=(1.0, 1.0))]
    p = prepare_samples(get_algorithm("sft", teacher="t"), StepBatch(steps), filters=zero_adv)
    assert all(w.sum() > 0 for w in p.ce_weights)
    # the same filters on an rl algorithm with equal rewards mask everything (all advantages are 0)
    p = prepare_samples(get_algorithm("grpo"), StepBatch(_steps(rewards=(1.0, 1.0))), filters=zero_adv)
    assert all(not np.any(s.loss_mask) for s in p.samples)


def test_filters_run_before_merge_and_report():
    steps = _steps()
    steps[3] = steps[3].replace(stop_reason="length")
    p = prepare_samples(
        get_algorithm("grpo"), StepBatch(steps), filters=[make_filter("overlong", mode="enforce")]
    )
    assert p.metrics["filters/overlong/flagged"] == 1
    assert list(p.samples[1].loss_mask[-3:]) == [0, 0, 0] and list(p.samples[0].loss_mask[-3:]) == [1, 1, 1]


def test_helpers():
    assert prefixed({"loss": 1}, "sft", multi=True) == {"loss/sft": 1.0}
    assert prefixed({"loss": 1}, "sft", multi=False) == {"loss": 1.0}
    assert load_observation_filter(None) is None
    with pytest.raises(ValueError, match="cannot be imported"):
        load_observation_filter("rljax.nope:fn")
