"""Zero, one and degenerate sizes for every public constructor and validator of the data layer.

Each case is either valid by a documented rule (and its result is checked) or a ValueError whose
message says what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

from rljax.algorithms import get_algorithm
from rljax.data import StepBatch
from rljax.data.filters import DynamicSampler, apply_filters, make_filter
from rljax.data.merge import merge_metrics, merge_steps
from rljax.data.pack import make_mini_batches, pack
from rljax.data.prepare import prepare_samples, split_by_algorithm
from rljax.data.step_advantages import compute_step_advantages
from rljax.types import Step, TrajectoryID

EMPTY_GENERATOR_OUTPUT = {"prompt_token_ids": [], "response_ids": [], "rewards": [], "loss_masks": []}


def _one(**kw) -> Step:
    return Step([1], [2], TrajectoryID("q", 0), **kw)


# -- valid by rule -------------------------------------------------------------------------------------


def test_the_empty_batch_is_valid_everywhere():
    empty = StepBatch([])
    assert len(empty) == 0 and empty.trajectory_ids == []
    assert len(StepBatch.from_generator_output(EMPTY_GENERATOR_OUTPUT)) == 0
    assert empty.to_generator_output()["prompt_token_ids"] == []
    assert compute_step_advantages(empty, "grpo") == []
    assert len(merge_steps(empty)) == 0
    assert merge_metrics(empty, empty)["num_samples_after_merge"] == 0
    assert list(make_mini_batches(empty, mini_batch_prompts=1, seq_len=8)) == []
    assert split_by_algorithm(empty) == {}
    assert prepare_samples(get_algorithm("grpo"), empty).samples == []
    batch, metrics = apply_filters(empty, [make_filter("overlong")])
    assert len(batch) == 0 and metrics["filters/overlong/flagged"] == 0
    # packing nothing: the smallest bucket of fully masked padding rows
    packed = pack(empty, seq_len=8).batch
    assert packed.shape == (1, 8) and not packed.loss_mask.any() and not packed.segment_ids.any()


def test_a_single_step_is_a_group_of_one():
    one = StepBatch([_one(reward=1.0)])
    for estimator in ("grpo", "rloo", "max_rl"):  # design §3.1 decision: a group of one gets 0
        assert [a.tolist() for a in compute_step_advantages(one, estimator)] == [[0.0]]
    assert pack(one, seq_len=2).batch.tokens.tolist() == [[1, 2]]  # exactly fits: prompt + response


def test_an_empty_response_trains_nothing_but_is_valid():
    b = StepBatch([Step([1, 2], [], TrajectoryID("q", 0))])
    assert [a.shape for a in compute_step_advantages(b, "grpo")] == [(0,)]
    packed = pack(b, seq_len=4).batch
    assert packed.tokens.tolist() == [[1, 2, 0, 0]] and not packed.loss_mask.any()
    assert [a.shape for a in compute_step_advantages(StepBatch([Step([1], [], ("q", 0), reward=[])]))] == [
        (0,)
    ]


# -- clear errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: StepBatch([Step([], [1], TrajectoryID("q", 0))]), "prompt_ids is empty"),
        (lambda: StepBatch([Step([1], [1], TrajectoryID("", 0))]), "non-empty instance_id"),
        (lambda: StepBatch([Step([1], [1], TrajectoryID("q", -1))]), "repetition_id >= 0"),
        (lambda: TrajectoryID.coerce(("a", 1, 2)), "pair or a dict"),
        (lambda: StepBatch([_one()], vocab_size=0), "vocab_size must be a positive int"),
        (lambda: StepBatch([_one(temperature=0.0)]), "temperature must be a finite number > 0"),
        (lambda: StepBatch([_one(loss_mask=[2])]), "must be 0 or 1"),
        (lambda: StepBatch([_one(reward=float("nan"))]), "NaN"),
        (lambda: StepBatch([_one(), _one()]), "is_last_step"),  # two final steps of one trajectory
        (
            lambda: StepBatch([Step([1], [1], ("a", 0), is_last_step=False), Step([1, 1, 2], [3], ("a", 0))])[
                :1
            ],
            "is_last_step is False on every step",  # a slice that cuts a trajectory is re-validated
        ),
        (
            lambda: StepBatch.from_generator_output({**EMPTY_GENERATOR_OUTPUT, "prompt_token_ids": [[1]]}),
            "has 0 entries but prompt_token_ids has 1",
        ),
        (lambda: pack([_one()], seq_len=1), "seq_len must be >= 2"),
        (lambda: pack([Step([1, 2, 3], [4], ("q", 0))], seq_len=3), "> seq_len=3"),
        (
            lambda: list(make_mini_batches([_one()], mini_batch_prompts=0, seq_len=8)),
            "mini_batch_prompts must be >= 1",
        ),
        (lambda: list(make_mini_batches([_one()], mini_batch_prompts=2, seq_len=8)), "not a multiple"),
        (lambda: pack([_one()], seq_len=8, advantage=[[1.0]]), "unknown per-step stream"),
        (lambda: DynamicSampler(target_groups=0, max_rounds=1), "target_groups must be an int >= 1"),
        (lambda: DynamicSampler(target_groups=1, max_rounds=0), "max_rounds must be an int >= 1"),
        (lambda: compute_step_advantages([_one()], "nope"), "unknown estimator"),
    ],
)
def test_degenerate_inputs_are_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_validation_runs_once_per_batch(monkeypatch):
    """Derived batches (algorithm split, filters, merge) trust their valid parent."""
    from rljax.data import batch as batch_module

    calls = []
    real = batch_module.validate_steps
    monkeypatch.setattr(
        batch_module, "validate_steps", lambda steps, **kw: (calls.append(1), real(steps, **kw))
    )
    steps = []
    for rep, r in enumerate([1.0, 0.0]):
        tid = TrajectoryID("q", rep)
        steps.append(Step([1], [2], tid, is_last_step=False))
        steps.append(Step([1, 2, 3], [4], tid, reward=r))
    b = StepBatch(steps)
    (part,) = split_by_algorithm(b).values()
    prepared = prepare_samples(get_algorithm("grpo"), part, filters=[make_filter("overlong")])
    assert len(calls) == 1 and len(prepared.samples) == 2
    assert np.allclose([a[0] for a in prepared.advantages], [0.5, -0.5])
