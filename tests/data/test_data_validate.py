"""Tests of rljax.data.validate (design §2.2) and the StepBatch generator-output round trip."""

from __future__ import annotations

import math
import warnings

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from rljax.core import advantages as core_advantages
from rljax.data import StepBatch, validate
from rljax.types import Step, TrajectoryID

T = TrajectoryID


def _step(tid: TrajectoryID, **kw) -> Step:
    base = dict(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        trajectory_id=tid,
        loss_mask=[1, 1],
        response_logprobs=[-0.5, -1.0],
        reward=1.0,
        is_last_step=True,
    )
    base.update(kw)
    return Step(**base)


def _valid_batch() -> list[Step]:
    """Two groups, three trajectories; q0#0 has two turns interleaved with q0#1."""
    return [
        _step(T("q0", 0), is_last_step=False, reward=0.0),
        _step(T("q0", 1)),
        _step(
            T("q0", 0),
            prompt_ids=[1, 2, 3, 4, 5, 9],
            response_ids=[7],
            loss_mask=[1],
            response_logprobs=[-0.1],
        ),
        _step(T("q1", 0), response_logprobs=None, reward=0.0),
    ]


# --------------------------------------------------------------------------------------
# valid inputs
# --------------------------------------------------------------------------------------
def test_valid_batch_passes():
    validate.validate_steps(_valid_batch(), vocab_size=10)
    b = StepBatch(_valid_batch(), vocab_size=10)
    assert len(b) == 4


def test_valid_variants_pass():
    steps = [
        # numpy arrays, numpy ints, bool loss mask, int logprob 0, empty response
        _step(
            T("a", 0),
            prompt_ids=np.array([0, 9], np.int32),
            response_ids=[np.int64(3), 4],
            loss_mask=[True, False],
            response_logprobs=np.array([0, -2.0]),
            reward=[0.5, 0.0],
        ),
        _step(T("b", 0), response_ids=[], loss_mask=[], response_logprobs=[], reward=[]),
        _step(T("c", 0), reward=np.array([1.0, -1.0]), temperature=0.7, stop_reason="length"),
        # per-prompt-token roles: str or None (numpy strings too)
        _step(T("d", 0), prompt_roles=[None, "user", "tool"], reward=[0.0, 1.0]),
        _step(T("e", 0), prompt_roles=np.array(["system", "user", "user"]), reward=[1.0, 0.0]),
    ]
    validate.validate_steps(steps, vocab_size=10)
    validate.validate_steps([], vocab_size=3)
    # without vocab_size the upper range is not checked
    validate.validate_steps([_step(T("a", 0), response_ids=[10**9, 4])])


def test_vocab_size_boundary():
    validate.validate_steps([_step(T("a", 0), response_ids=[9, 0])], vocab_size=10)
    with pytest.raises(ValueError, match=r"response_ids\[0\] = 10 is out of range"):
        validate.validate_steps([_step(T("a", 0), response_ids=[10, 0])], vocab_size=10)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_vocab_size(bad):
    with pytest.raises(ValueError, match="vocab_size"):
        validate.validate_steps(_valid_batch(), vocab_size=bad)


# --------------------------------------------------------------------------------------
# malformed batches: (case id, mutation of _valid_batch, field, step index, trajectory)
# --------------------------------------------------------------------------------------
def _mutate(i: int, **kw):
    def f(steps):
        steps = list(steps)
        steps[i] = steps[i].replace(**kw)
        return steps

    return f


def _per_token_inf(steps):
    steps = [s.replace(reward=[0.0] * len(s.response_ids)) for s in steps]
    steps[3] = steps[3].replace(reward=[0.0, math.inf])
    return steps


def _swap_last_flags(steps):
    steps = list(steps)
    steps[0] = steps[0].replace(is_last_step=True)
    steps[2] = steps[2].replace(is_last_step=False)
    return steps


def _reorder_last_first(steps):
    # put q0#0's final turn before its first turn: the flagged step is no longer the final one
    return [steps[2], steps[1], steps[0], steps[3]]


MALFORMED = [
    (
        "mask_len",
        _mutate(1, loss_mask=[1, 1, 1]),
        "loss_mask has 3 entries but response_ids has 2",
        1,
        "q0#1",
    ),
    ("mask_short", _mutate(2, loss_mask=[]), "loss_mask has 0 entries", 2, "q0#0"),
    ("logprob_len", _mutate(3, response_logprobs=[-1.0]), "response_logprobs has 1 entries", 3, "q1#0"),
    ("token_reward_len", _mutate(1, reward=[1.0]), "reward is per-token with 1 entries", 1, "q0#1"),
    ("negative_response_id", _mutate(2, response_ids=[-1]), "response_ids[0] = -1", 2, "q0#0"),
    ("negative_prompt_id", _mutate(3, prompt_ids=[1, -5]), "prompt_ids[1] = -5", 3, "q1#0"),
    ("prompt_id_vocab", _mutate(1, prompt_ids=[1, 2, 10]), "prompt_ids[2] = 10 is out of range", 1, "q0#1"),
    ("response_id_vocab", _mutate(0, response_ids=[4, 11]), "response_ids[1] = 11", 0, "q0#0"),
    ("float_id", _mutate(1, response_ids=[4.0, 5.0]), "response_ids must hold ints", 1, "q0#1"),
    ("bool_id_among_ints", _mutate(3, prompt_ids=[1, True]), "prompt_ids must hold ints", 3, "q1#0"),
    ("all_bool_ids", _mutate(3, response_ids=[True, False]), "response_ids must hold ints", 3, "q1#0"),
    ("str_id", _mutate(0, prompt_ids=["a", "b"]), "prompt_ids must hold ints", 0, "q0#0"),
    ("huge_id", _mutate(0, prompt_ids=[2**70]), "prompt_ids must hold ints", 0, "q0#0"),
    (
        "nested_ids",
        _mutate(1, response_ids=[[4, 5]], loss_mask=[1]),
        "response_ids must be a flat list",
        1,
        "q0#1",
    ),
    ("empty_prompt", _mutate(3, prompt_ids=[]), "prompt_ids is empty", 3, "q1#0"),
    ("mask_value_2", _mutate(1, loss_mask=[1, 2]), "loss_mask[1] = 2", 1, "q0#1"),
    ("mask_negative", _mutate(2, loss_mask=[-1]), "loss_mask[0] = -1", 2, "q0#0"),
    ("mask_float", _mutate(0, loss_mask=[0.5, 1.0]), "loss_mask must hold ints 0/1", 0, "q0#0"),
    ("logprob_nan", _mutate(1, response_logprobs=[-0.1, math.nan]), "response_logprobs[1] = nan", 1, "q0#1"),
    ("logprob_neg_inf", _mutate(2, response_logprobs=[-math.inf]), "response_logprobs[0] = -inf", 2, "q0#0"),
    (
        "logprob_positive",
        _mutate(0, response_logprobs=[-0.1, 0.3]),
        "response_logprobs[1] = 0.3 > 0",
        0,
        "q0#0",
    ),
    ("reward_nan", _mutate(1, reward=math.nan), "reward is nan", 1, "q0#1"),
    ("reward_inf_token", _per_token_inf, "reward[1] = inf", 3, "q1#0"),
    ("reward_str", _mutate(3, reward="1.0"), "reward must be a real number", 3, "q1#0"),
    ("reward_bool", _mutate(1, reward=True), "reward must be a real number", 1, "q0#1"),
    (
        "mixed_reward_kinds",
        _mutate(2, reward=[0.0]),
        "rewards must be all scalars or all per-token",
        2,
        "q0#0",
    ),
    ("two_last_steps", _mutate(0, is_last_step=True), "is_last_step=True, but step 0", 2, "q0#0"),
    ("no_last_step", _mutate(3, is_last_step=False), "is_last_step is False on every step", 3, "q1#0"),
    ("last_not_final", _swap_last_flags, "is_last_step=True but step 2", 0, "q0#0"),
    ("last_not_final_order", _reorder_last_first, "is_last_step=True but step 2", 0, "q0#0"),
    ("non_bool_last", _mutate(3, is_last_step=1), "is_last_step must be a bool", 3, "q1#0"),
    ("temperature_zero", _mutate(1, temperature=0.0), "temperature must be a finite number > 0", 1, "q0#1"),
    ("temperature_nan", _mutate(2, temperature=math.nan), "temperature", 2, "q0#0"),
    ("stop_reason_none", _mutate(0, stop_reason=None), "stop_reason must be a str", 0, "q0#0"),
    ("bad_trajectory_types", _mutate(3, trajectory_id=TrajectoryID(7, 0)), "trajectory_id needs", 3, "7#0"),
    ("env_not_str", _mutate(1, env=3), "env must be a non-empty str", 1, "q0#1"),
    ("policy_version", _mutate(1, policy_version=-1), "policy_version", 1, "q0#1"),
    (
        "prompt_roles_len",
        _mutate(1, prompt_roles=[None, "user"]),
        "prompt_roles has 2 entries but prompt_ids has 3",
        1,
        "q0#1",
    ),
    ("prompt_roles_entry", _mutate(2, prompt_roles=[None] * 5 + [3]), "prompt_roles[5] = 3", 2, "q0#0"),
    ("prompt_roles_str", _mutate(3, prompt_roles="tool"), "prompt_roles must be None or a list", 3, "q1#0"),
]


@pytest.mark.parametrize(
    "mutate,expected,index,traj", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_batch_names_field_step_and_trajectory(mutate, expected, index, traj):
    steps = mutate(_valid_batch())
    with pytest.raises(ValueError) as info:
        validate.validate_steps(steps, vocab_size=10)
    msg = str(info.value)
    assert expected in msg
    assert msg.startswith(f"step {index} (trajectory {traj}): "), msg
    # the StepBatch constructor runs the same validation
    with pytest.raises(ValueError, match="step"):
        StepBatch(steps, vocab_size=10)


def test_at_least_fifteen_distinct_cases():
    assert len({c[0] for c in MALFORMED}) >= 15


def test_non_step_rejected():
    with pytest.raises(ValueError, match="step 1: expected an rljax.types.Step"):
        validate.validate_steps([_step(T("a", 0)), {"prompt_ids": [1]}])


# --------------------------------------------------------------------------------------
# property test: one corrupted token is reported at the right step and position
# --------------------------------------------------------------------------------------
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    data=st.data(),
)
def test_single_corruption_located(lengths, data):
    steps = [
        Step(
            [1],
            list(range(n)),
            T(f"q{i}", 0),
            loss_mask=[1] * n,
            response_logprobs=[-0.25] * n,
            reward=[0.0] * n,
        )
        for i, n in enumerate(lengths)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", validate.AllMaskedWarning)  # all lengths 0 is a masked batch
        validate.validate_steps(steps, vocab_size=8)
    candidates = [i for i, n in enumerate(lengths) if n > 0]
    hypothesis.assume(candidates)
    k = data.draw(st.sampled_from(candidates))
    pos = data.draw(st.integers(0, lengths[k] - 1))
    field = data.draw(st.sampled_from(["response_ids", "loss_mask", "response_logprobs", "reward"]))
    bad_value = {"response_ids": 8, "loss_mask": 3, "response_logprobs": 0.5, "reward": math.nan}[field]
    values = list(getattr(steps[k], field))
    values[pos] = bad_value
    steps[k] = steps[k].replace(**{field: values})
    with pytest.raises(ValueError) as info:
        validate.validate_steps(steps, vocab_size=8)
    field_in_msg = "reward" if field == "reward" else field
    assert str(info.value).startswith(f"step {k} (trajectory q{k}#0): {field_in_msg}[{pos}] = ")


# --------------------------------------------------------------------------------------
# all-masked warning and metrics
# --------------------------------------------------------------------------------------
def test_all_masked_warns_not_raises():
    steps = [s.replace(loss_mask=[0] * len(s.response_ids)) for s in _valid_batch()]
    with pytest.warns(validate.AllMaskedWarning, match="4 steps"):
        b = StepBatch(steps)
    assert validate.batch_metrics(b)["all_masked"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StepBatch(_valid_batch())  # one trainable token is enough: no warning
        StepBatch([])  # an empty batch trains nothing but is not a masked batch


def test_batch_metrics_hand_counted():
    steps = _valid_batch()
    steps[1] = steps[1].replace(loss_mask=[0, 1])
    m = validate.batch_metrics(steps)
    assert m == {
        "num_steps": 4,
        "num_trajectories": 3,
        "num_groups": 2,
        "prompt_tokens": 3 + 3 + 6 + 3,
        "response_tokens": 2 + 2 + 1 + 2,
        "trainable_tokens": 2 + 1 + 1 + 2,
        "trainable_fraction": 6 / 7,
        "all_masked": False,
    }
    assert validate.batch_metrics([])["all_masked"] is False


# --------------------------------------------------------------------------------------
# config-time estimator / reward-mode rule
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "estimator,mode,step_wise,ok",
    [
        ("grpo", "outcome", True, True),
        ("rloo", "per_step", True, True),
        ("max_rl", "outcome", False, True),
        ("gae", "outcome", True, False),
        ("reinforce_pp", "outcome", True, False),
        ("gae", "per_step", True, True),
        ("reinforce_pp", "per_step", True, True),
        ("gae", "outcome", False, True),
        ("reinforce_pp", "outcome", False, True),
    ],
)
def test_estimator_reward_mode(estimator, mode, step_wise, ok):
    if ok:
        core_advantages.check_estimator_reward_mode(estimator, mode, step_wise)
    else:
        with pytest.raises(ValueError, match="reward_mode='per_step'"):
            core_advantages.check_estimator_reward_mode(estimator, mode, step_wise)


@pytest.mark.parametrize(
    "args,match",
    [(("ppo", "outcome", True), "unknown estimator"), (("grpo", "turn", True), "unknown reward_mode")],
)
def test_estimator_reward_mode_unknown(args, match):
    with pytest.raises(ValueError, match=match):
        core_advantages.check_estimator_reward_mode(*args)


# --------------------------------------------------------------------------------------
# SkyRL GeneratorOutput dicts
# --------------------------------------------------------------------------------------
def _generator_dict(traj_ids):
    return {
        "prompt_token_ids": [[1, 2], [1, 2], [3]],
        "response_ids": [[5, 6], [7], [8, 9]],
        "rewards": [0.0, 1.0, 0.5],
        "loss_masks": [[1, 0], [1], [1, 1]],
        "stop_reasons": ["tool_call", "stop", "length"],
        "rollout_logprobs": [[-0.1, -0.2], None, [-1.0, -3.0]],
        "trajectory_ids": traj_ids,
        "is_last_step": [False, True, True],
    }


TRAJ_FORMS = {
    "tuples": [("g0", 0), ("g0", 0), ("g1", 3)],
    "dicts": [
        {"instance_id": "g0", "repetition_id": 0},
        {"instance_id": "g0", "repetition_id": 0},
        {"instance_id": "g1", "repetition_id": 3},
    ],
    "objects": [T("g0", 0), T("g0", 0), T("g1", 3)],
}


@pytest.mark.parametrize("form", sorted(TRAJ_FORMS))
def test_generator_output_round_trip(form):
    d = _generator_dict(TRAJ_FORMS[form])
    assert validate.check_generator_output(d) == 3
    b = StepBatch.from_generator_output(d, vocab_size=10, env="math")
    assert [s.trajectory_id for s in b] == [T("g0", 0), T("g0", 0), T("g1", 3)]
    assert b[0].stop_reason == "tool_call" and b[1].response_logprobs is None and b[2].env == "math"
    out = b.to_generator_output()
    expected = _generator_dict(TRAJ_FORMS["objects"])
    assert out == expected
    assert all(isinstance(t, TrajectoryID) for t in out["trajectory_ids"])
    again = StepBatch.from_generator_output(out, vocab_size=10, env="math")
    assert again.steps == b.steps


def test_generator_output_per_token_rewards_and_defaults():
    d = {
        "prompt_token_ids": [[1], [2]],
        "response_ids": [[3, 4], [5]],
        "rewards": [[0.0, 1.0], [2.0]],
        "loss_masks": [[1, 1], [0]],
    }
    b = StepBatch.from_generator_output(d)
    assert [s.trajectory_id for s in b] == [T("0", 0), T("1", 0)]
    assert b[0].per_token_reward and b[0].total_reward == 1.0
    out = b.to_generator_output()
    assert out["rewards"] == [[0.0, 1.0], [2.0]] and out["rollout_logprobs"] is None


def test_generator_output_vocab_range():
    d = _generator_dict(TRAJ_FORMS["tuples"])
    StepBatch.from_generator_output(d, vocab_size=10)
    with pytest.raises(
        ValueError, match=r"step 2 \(trajectory g1#3\): response_ids\[1\] = 9 is out of range"
    ):
        StepBatch.from_generator_output(d, vocab_size=9)


def _drop(key, n):
    def f(d):
        d[key] = d[key][:n]
        return d

    return f


def _set(key, i, value):
    def f(d):
        d[key] = list(d[key])
        d[key][i] = value
        return d

    return f


def _replace(key, value):
    def f(d):
        d[key] = value
        return d

    return f


GEN_MALFORMED = [
    ("missing_key", _replace("loss_masks", None), "missing required key(s) ['loss_masks']"),
    (
        "short_rewards",
        _drop("rewards", 2),
        "rewards has 2 entries but prompt_token_ids has 3: step 2 (trajectory g1#3)",
    ),
    ("short_last", _drop("is_last_step", 1), "is_last_step has 1 entries"),
    ("long_stops", _replace("stop_reasons", ["stop"] * 4), "stop_reasons has 4 entries"),
    ("extra_key_rows", _replace("rollout_expert_indices", [[0]] * 2), "rollout_expert_indices has 2 entries"),
    ("scalar_stop_reasons", _replace("stop_reasons", "stop"), "stop_reasons must be a list"),
    ("bad_traj", _set("trajectory_ids", 1, ("g0",)), "step 1: trajectory_ids entry"),
    ("bad_traj_dict", _set("trajectory_ids", 2, {"instance_id": "g1"}), "step 2: trajectory_ids entry"),
    ("scalar_mask_row", _set("loss_masks", 1, 1), "step 1 (trajectory g0#0): loss_masks entry"),
    ("str_prompt_row", _set("prompt_token_ids", 2, "hi"), "step 2 (trajectory g1#3): prompt_token_ids entry"),
    ("dict_reward_row", _set("rewards", 0, {"r": 1}), "step 0 (trajectory g0#0): rewards entry"),
    (
        "scalar_logprob_row",
        _set("rollout_logprobs", 2, -1.0),
        "step 2 (trajectory g1#3): rollout_logprobs entry",
    ),
    (
        "int_last_row",
        _set("is_last_step", 1, 1),
        "step 1 (trajectory g0#0): is_last_step entry must be a bool",
    ),
    (
        "none_stop_row",
        _set("stop_reasons", 0, None),
        "step 0 (trajectory g0#0): stop_reasons entry must be a str",
    ),
    ("mask_len_row", _set("loss_masks", 0, [1]), "step 0 (trajectory g0#0): loss_mask has 1 entries"),
    ("nan_reward_row", _set("rewards", 1, math.nan), "step 1 (trajectory g0#0): reward is nan"),
    (
        "last_not_final",
        _replace("is_last_step", [True, True, True]),
        "step 1 (trajectory g0#0): is_last_step=True",
    ),
]


@pytest.mark.parametrize("mutate,expected", [c[1:] for c in GEN_MALFORMED], ids=[c[0] for c in GEN_MALFORMED])
def test_generator_output_malformed(mutate, expected):
    d = mutate(_generator_dict(list(TRAJ_FORMS["tuples"])))
    with pytest.raises(ValueError) as info:
        StepBatch.from_generator_output(d, vocab_size=10)
    assert expected in str(info.value)


def test_generator_output_not_a_dict():
    with pytest.raises(ValueError, match="must be a dict"):
        validate.check_generator_output([[1, 2]])  # type: ignore[arg-type]
