"""Tests of rljax.data.filters (design §3.7): each filter in both modes, composition, DAPO sampling."""

from __future__ import annotations

import math
import warnings

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from rljax.data import StepBatch
from rljax.data import filters as flt
from rljax.types import Step, TrajectoryID

T = TrajectoryID
HI = math.log(0.995)  # confident token: p > 0.99
EQ = math.log(0.99)  # exactly at the threshold: NOT confident (strict >)
LO = math.log(0.5)


def _s(q: str, r: int, resp, *, lp=None, mask=None, **kw) -> Step:
    return Step([1], list(resp), T(q, r), response_logprobs=lp, loss_mask=mask, **kw)


def _check_modes(f_enforce: flt.Filter, batch: StepBatch, expected: list[bool], advantages=None):
    """Both modes: monitor leaves the batch alone, enforce zeroes exactly the flagged steps."""
    expected = np.array(expected)
    trainable = np.array([sum(s.loss_mask) for s in batch])
    np.testing.assert_array_equal(f_enforce.flags(batch, advantages), expected)

    monitor = type(f_enforce)(**{**_fields(f_enforce), "mode": "monitor"})
    out, m = monitor(batch, advantages)
    assert out is batch
    name = f_enforce.name
    assert m[f"filters/{name}/flagged"] == expected.sum()
    assert m[f"filters/{name}/fraction"] == pytest.approx(expected.mean())
    assert m[f"filters/{name}/flagged_tokens"] == trainable[expected].sum()
    assert m["filters/masked_steps"] == 0 and m["filters/masked_tokens"] == 0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fully filtered batch warns (all-masked)
        out, m = f_enforce(batch, advantages)
    assert isinstance(out, StepBatch) and len(out) == len(batch)  # never drops steps
    for s_in, s_out, flagged in zip(batch, out, expected, strict=True):
        assert list(s_out.response_ids) == list(s_in.response_ids)
        assert list(s_out.loss_mask) == ([0] * len(s_in.response_ids) if flagged else list(s_in.loss_mask))
    assert m[f"filters/{name}/flagged"] == expected.sum()
    assert m["filters/masked_tokens"] == trainable[expected].sum()
    assert m["filters/masked_steps"] == (expected & (trainable > 0)).sum()
    return out


def _fields(f):
    import dataclasses

    return {x.name: getattr(f, x.name) for x in dataclasses.fields(f)}


# --------------------------------------------------------------------------------------
# gibberish
# --------------------------------------------------------------------------------------
def test_gibberish_boundaries():
    f = flt.GibberishFilter(vocab_size=100, id_threshold=50)
    thr = -math.log(100) - 2.0
    assert f.logprob_threshold == pytest.approx(-6.605170185988091)
    below = float(np.nextafter(thr, -np.inf))
    batch = StepBatch(
        [
            _s("a", 0, [50, 51], lp=[-10.0, thr]),  # id == threshold; logprob == threshold: clean
            _s("a", 1, [3, 51], lp=[-0.1, below]),  # just below the logprob threshold
            _s("b", 0, [99], lp=[-10.0], mask=[0]),  # not sampled (mask 0)
            _s("b", 1, [51, 3], lp=[-7.0, -0.1]),
            _s("c", 0, [], lp=[]),
        ]
    )
    _check_modes(f, batch, [False, True, False, True, False])
    # the margin moves the threshold
    assert flt.GibberishFilter(vocab_size=100, id_threshold=50, margin=0.0).flags(batch).tolist() == [
        True, True, False, True, False,
    ]  # fmt: skip


def test_gibberish_needs_logprobs():
    batch = StepBatch([_s("a", 0, [1], lp=[-1.0]), _s("a", 1, [1])])
    with pytest.raises(
        ValueError, match=r"step 1 \(trajectory a#1\): the gibberish filter needs response_logprobs"
    ):
        flt.apply_filters(batch, [flt.GibberishFilter(vocab_size=10, id_threshold=1)])


# --------------------------------------------------------------------------------------
# repetition
# --------------------------------------------------------------------------------------
def _rep_batch():
    return StepBatch(
        [
            _s("a", 0, [1] * 5, lp=[HI, HI, LO, HI, HI]),  # longest run 2
            _s("a", 1, [1] * 3, lp=[HI, HI, HI]),  # run 3
            _s("a", 2, [1] * 4, lp=[HI, HI, EQ, HI]),  # p == 0.99 breaks the run
            _s("a", 3, [1] * 5, lp=[HI] * 5, mask=[1, 1, 0, 1, 1]),  # unsampled token breaks the run
            _s("b", 0, [1] * 3, lp=[LO, HI, HI]),  # runs do not continue into the next step
            _s("b", 1, [1] * 2, lp=[HI, LO]),
            _s("b", 2, [], lp=[]),
            _s("b", 3, [1] * 4, lp=[LO, HI, HI, HI]),  # run 3 at the end
        ]
    )


@pytest.mark.parametrize(
    "window,expected",
    [
        (3, [False, True, False, False, False, False, False, True]),
        (4, [False, False, False, False, False, False, False, False]),
        (2, [True, True, True, True, True, False, False, True]),
        (1, [True, True, True, True, True, True, False, True]),
    ],
)
def test_repetition_windows(window, expected):
    _check_modes(flt.RepetitionFilter(window=window), _rep_batch(), expected)


def test_repetition_threshold_parameter():
    batch = StepBatch([_s("a", 0, [1, 1], lp=[LO, LO])])
    assert flt.RepetitionFilter(window=2, prob_threshold=0.4).flags(batch).tolist() == [True]
    assert flt.RepetitionFilter(window=2, prob_threshold=0.5).flags(batch).tolist() == [False]


def _reference_flags(batch, *, vocab_size, id_threshold, window):
    """Independent float64 loop reference of the gibberish and repetition rules."""
    gib, rep = [], []
    thr = -math.log(vocab_size) - 2.0
    for s in batch:
        g, run, longest = False, 0, 0
        for tok, lp, m in zip(s.response_ids, s.response_logprobs, s.loss_mask, strict=True):
            if m == 1 and tok > id_threshold and lp < thr:
                g = True
            run = run + 1 if (m == 1 and math.exp(lp) > 0.99) else 0
            longest = max(longest, run)
        gib.append(g)
        rep.append(longest >= window)
    return gib, rep


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    rows=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 19), st.sampled_from([HI, LO, -1e-4, -3.0, -9.0]), st.sampled_from([0, 1, 1])
            ),
            max_size=12,
        ),
        min_size=1,
        max_size=8,
    ),
    window=st.integers(1, 5),
)
def test_gibberish_and_repetition_match_reference(rows, window):
    steps = [
        _s("g", i, [t for t, _, _ in r], lp=[lp for _, lp, _ in r], mask=[m for _, _, m in r])
        for i, r in enumerate(rows)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = StepBatch(steps)
    gib, rep = _reference_flags(batch, vocab_size=20, id_threshold=9, window=window)
    assert flt.GibberishFilter(vocab_size=20, id_threshold=9).flags(batch).tolist() == gib
    assert flt.RepetitionFilter(window=window).flags(batch).tolist() == rep


# --------------------------------------------------------------------------------------
# zero advantage
# --------------------------------------------------------------------------------------
def test_zero_advantage_per_token_and_scalar():
    batch = StepBatch([_s("a", 0, [1, 2]), _s("a", 1, [1, 2]), _s("a", 2, [3]), _s("b", 0, [])])
    adv = [np.array([0.0, 0.0]), np.array([0.0, 1e-9]), np.array([-0.5]), np.zeros((0,))]
    _check_modes(flt.ZeroAdvantageFilter(), batch, [True, False, False, True], adv)
    _check_modes(flt.ZeroAdvantageFilter(), batch, [False, True, True, False], np.array([0.3, 0.0, 0.0, 2.0]))


def test_zero_advantage_errors():
    batch = StepBatch([_s("a", 0, [1, 2]), _s("a", 1, [1])])
    with pytest.raises(ValueError, match="needs advantages"):
        flt.apply_filters(batch, [flt.ZeroAdvantageFilter()])
    with pytest.raises(ValueError, match="got 1 advantage entries for 2 steps"):
        flt.apply_filters(batch, [flt.ZeroAdvantageFilter()], advantages=[np.zeros(2)])
    with pytest.raises(ValueError, match=r"step 1 \(trajectory a#1\): advantages have shape \(2,\)"):
        flt.apply_filters(batch, [flt.ZeroAdvantageFilter()], advantages=[np.zeros(2), np.zeros(2)])


# --------------------------------------------------------------------------------------
# overlong / overlong-and-unrewarded
# --------------------------------------------------------------------------------------
def test_overlong():
    reasons = ["stop", "length", "abort", "tool_call"]
    batch = StepBatch([_s("a", i, [1, 2], stop_reason=r) for i, r in enumerate(reasons)])
    _check_modes(flt.OverlongFilter(), batch, [False, True, True, True])
    _check_modes(
        flt.OverlongFilter(allowed_stop_reasons=("stop", "tool_call")), batch, [False, True, True, False]
    )
    with pytest.raises(ValueError, match="allowed_stop_reasons must be a tuple of str"):
        flt.OverlongFilter(allowed_stop_reasons="stop")


def test_overlong_unrewarded():
    batch = StepBatch(
        [
            _s("a", 0, [1, 2, 3]),  # length == L, reward 0: kept
            _s("a", 1, [1, 2, 3, 4]),  # length L+1, reward 0: flagged
            _s("a", 2, [1, 2, 3, 4], reward=1.0),  # rewarded
            _s("a", 3, [1, 2, 3, 4], reward=-0.0),  # negative zero is zero
            _s("b", 0, [1, 2, 3, 4, 5], is_last_step=False),  # earlier turn of a rewarded trajectory
            _s("b", 0, [6], reward=1.0),
            _s("b", 1, [1, 2, 3, 4, 5], is_last_step=False, reward=2.0),  # trajectory reward (last step) is 0
            _s("b", 1, [6], reward=0.0),
        ]
    )
    _check_modes(
        flt.OverlongUnrewardedFilter(max_length=3),
        batch,
        [False, True, False, True, False, False, True, False],
    )
    _check_modes(flt.OverlongUnrewardedFilter(max_length=4), batch, [False] * 4 + [False, False, True, False])


def test_overlong_unrewarded_per_token_rewards():
    batch = StepBatch([_s("a", 0, [1, 2], reward=[1.0, -1.0]), _s("a", 1, [1, 2], reward=[0.0, 0.5])])
    _check_modes(flt.OverlongUnrewardedFilter(max_length=1), batch, [True, False])


# --------------------------------------------------------------------------------------
# zero-variance groups
# --------------------------------------------------------------------------------------
def test_zero_variance_groups():
    batch = StepBatch(
        [
            _s("a", 0, [1], reward=1.0),
            _s("b", 0, [1], reward=1.0),
            _s("a", 1, [1], reward=1.0),  # a: all equal (interleaved with b)
            _s("b", 1, [1], reward=0.0),  # b: varies
            _s("c", 0, [1], reward=0.3),  # c: group of one
            _s("d", 0, [1], reward=5.0, is_last_step=False),  # d: earlier-turn rewards are ignored
            _s("d", 0, [1], reward=1.0),
            _s("d", 1, [1], reward=1.0),
            _s("e", 0, [1], reward=0.5),
            _s("e", 1, [1], reward=0.5 + 1e-9),
        ]
    )
    strict = [True, False, True, False, True, True, True, True, False, False]
    _check_modes(flt.ZeroVarianceGroupFilter(), batch, strict)
    _check_modes(flt.ZeroVarianceGroupFilter(atol=1e-6), batch, strict[:8] + [True, True])
    np.testing.assert_allclose(
        flt.group_reward_spread(batch), [0, 1, 0, 1, 0, 0, 0, 0, 1e-9, 1e-9], atol=1e-15
    )


# --------------------------------------------------------------------------------------
# composition, construction
# --------------------------------------------------------------------------------------
def test_apply_filters_composition():
    batch = StepBatch(
        [
            _s("a", 0, [1, 2], stop_reason="length", reward=1.0),  # overlong
            _s("a", 1, [1, 2, 3], reward=0.0),  # overlong_unrewarded (L=2)
            _s("b", 0, [1], reward=1.0),  # zero variance (group of one)
            _s("c", 0, [1, 2, 3], mask=[0, 1, 1], reward=1.0, stop_reason="abort"),
            _s("c", 1, [1], reward=0.0),  # zero variance: the aborted c#0 is not a peer
        ]
    )
    fs = [
        flt.OverlongFilter(),
        flt.OverlongUnrewardedFilter(max_length=2, mode="monitor"),
        flt.ZeroVarianceGroupFilter(),
    ]
    out, m = flt.apply_filters(batch, fs)
    assert [list(s.loss_mask) for s in out] == [[0, 0], [1, 1, 1], [0], [0, 0, 0], [0]]
    assert m["filters/overlong/flagged"] == 2 and m["filters/overlong/flagged_tokens"] == 4
    assert (
        m["filters/overlong_unrewarded/flagged"] == 1 and m["filters/overlong_unrewarded/flagged_tokens"] == 3
    )
    assert m["filters/zero_variance/fraction"] == pytest.approx(3 / 5)
    assert m["filters/masked_steps"] == 4 and m["filters/masked_tokens"] == 2 + 1 + 2 + 1
    out2, m2 = flt.apply_filters(batch, fs[::-1])
    assert out2.steps == out.steps and m2 == m  # every filter sees the input batch
    assert [list(s.loss_mask) for s in batch][3] == [0, 1, 1]  # input untouched
    same, m3 = flt.apply_filters(batch, [])
    assert same is batch and m3 == {"filters/masked_steps": 0, "filters/masked_tokens": 0}


def test_apply_filters_errors():
    batch = StepBatch([_s("a", 0, [1])])
    with pytest.raises(ValueError, match="listed twice"):
        flt.apply_filters(batch, [flt.OverlongFilter(), flt.OverlongFilter(mode="monitor")])
    with pytest.raises(ValueError, match="expects a StepBatch"):
        flt.apply_filters(list(batch), [flt.OverlongFilter()])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expects Filter objects"):
        flt.apply_filters(batch, ["overlong"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("overlong", {"mode": "drop"}, "mode must be one of"),
        ("ngram", {}, "unknown filter 'ngram'"),
        ("gibberish", {"vocab_size": 10}, "id_threshold"),
        ("gibberish", {"vocab_size": 0, "id_threshold": 1}, "vocab_size must be an int >= 1"),
        ("repetition", {"window": 0}, "window must be an int >= 1"),
        ("repetition", {"window": 3, "prob_threshold": 1.0}, "prob_threshold"),
        ("overlong_unrewarded", {"max_length": 2.5}, "max_length must be an int"),
        ("zero_variance", {"atol": -1.0}, "atol"),
        ("staleness", {"max_staleness": -1}, "max_staleness"),
        ("staleness", {"max_staleness": 1, "trained_version": 2.0}, "trained_version"),
    ],
)
def test_make_filter_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        flt.make_filter(name, **kwargs)


def test_make_filter_and_registry():
    assert set(flt.FILTERS) == {
        "gibberish", "repetition", "zero_advantage", "overlong", "overlong_unrewarded", "zero_variance",
        "staleness",
    }  # fmt: skip
    f = flt.make_filter("repetition", window=4, mode="monitor")
    assert isinstance(f, flt.RepetitionFilter) and f.window == 4 and f.mode == "monitor"
    assert flt.make_filter("overlong").mode == "enforce"


def test_staleness_filter_reads_the_version_of_every_trainable_token():
    # trained version 7; versions by hand. Step 0: an in-flight update crossed the turn (5 -> 7);
    # step 1: a merged sample whose observation tokens (mask 0) carry an old version; step 2: on policy.
    batch = StepBatch(
        [
            Step([1], [2, 3, 4], T("q", 0), policy_version=5, response_versions=[5, 7, 7]),
            Step(
                [1], [2, 3, 4], T("q", 1), policy_version=2, response_versions=[6, 2, 6], loss_mask=[1, 0, 1]
            ),
            Step([1], [2, 3], T("q", 2), policy_version=7),
        ]
    )
    f = flt.StalenessFilter(max_staleness=1, trained_version=7)
    assert [x.tolist() for x in f.token_staleness(batch)] == [[2, 0, 0], [1, 0, 1], [0, 0]]
    assert f.flags(batch).tolist() == [True, False, False]
    assert flt.StalenessFilter(max_staleness=2, trained_version=7).flags(batch).tolist() == [False] * 3
    out, metrics = flt.apply_filters(batch, [f])
    assert [list(s.loss_mask) for s in out] == [[0, 0, 0], [1, 0, 1], [1, 1]]
    assert metrics["filters/staleness/flagged"] == 1 and metrics["filters/masked_tokens"] == 3


# --------------------------------------------------------------------------------------
# DAPO dynamic sampling
# --------------------------------------------------------------------------------------
def _group(q, rewards, *, turns=1):
    steps = []
    for r_id, r in enumerate(rewards):
        for t in range(turns):
            last = t == turns - 1
            steps.append(_s(q, r_id, [t + 1], reward=r if last else 0.0, is_last_step=last))
    return steps


def test_dynamic_sampler_accumulates_until_target():
    ds = flt.DynamicSampler(target_groups=3, max_rounds=4)
    assert ds.add(StepBatch(_group("a", [1, 1]) + _group("b", [0, 1], turns=2))) is False
    assert ds.groups_kept == 1 and not ds.done
    assert ds.add(StepBatch(_group("c", [0, 0, 0]) + _group("d", [0.5, 0.2]))) is False
    assert ds.add(StepBatch(_group("e", [1, 0]) + _group("f", [1, 0]) + _group("g", [1, 1]))) is True
    batch, m = ds.result()
    assert [(s.trajectory_id.instance_id, s.trajectory_id.repetition_id) for s in batch] == [
        ("b", 0), ("b", 0), ("b", 1), ("b", 1), ("d", 0), ("d", 1), ("e", 0), ("e", 1),
    ]  # fmt: skip
    assert m["dynamic_sampling/rounds"] == 3
    assert m["dynamic_sampling/groups_seen"] == 7
    assert m["dynamic_sampling/groups_kept"] == 3
    assert m["dynamic_sampling/groups_discarded"] == 4  # a, c, g (zero variance) + f (surplus)
    assert m["dynamic_sampling/kept_fraction"] == pytest.approx(3 / 7)
    assert m["dynamic_sampling/exhausted"] == 0.0
    # trajectory rewards of everything seen: a 1,1  b 0,1  c 0,0,0  d .5,.2  e 1,0  f 1,0  g 1,1
    assert m["dynamic_sampling/reward_mean_seen"] == pytest.approx(7.7 / 15)
    with pytest.raises(ValueError, match="is done"):
        ds.add(StepBatch(_group("h", [0, 1])))
    ds.reset()
    assert ds.rounds == 0 and not ds.done


def test_dynamic_sampler_max_rounds():
    ds = flt.DynamicSampler(target_groups=2, max_rounds=2)
    ds.add(StepBatch(_group("a", [1, 1]) + _group("b", [1, 0])))
    assert ds.add(StepBatch(_group("c", [0, 0]))) is True  # out of rounds
    with pytest.raises(ValueError, match=r"collected 1 of 2 groups .* after 2 of max_rounds=2 rounds"):
        ds.result()
    lenient = flt.DynamicSampler(target_groups=2, max_rounds=1, strict=False)
    lenient.add(StepBatch(_group("a", [1, 0]) + _group("b", [1, 1])))
    batch, m = lenient.result()
    assert {s.trajectory_id.instance_id for s in batch} == {"a"} and m["dynamic_sampling/exhausted"] == 1.0


def test_dynamic_sampler_atol_and_errors():
    ds = flt.DynamicSampler(target_groups=1, max_rounds=3, atol=0.1)
    assert ds.add(StepBatch(_group("a", [0.0, 0.05]))) is False  # spread 0.05 <= atol
    with pytest.raises(
        ValueError, match=r"step 0 \(trajectory a#0\): instance_id 'a' was already sampled in round 1"
    ):
        ds.add(StepBatch(_group("a", [0.0, 1.0])))
    assert ds.rounds == 1  # the rejected round did not count
    assert ds.add(StepBatch(_group("b", [0.0, 1.0]))) is True
    with pytest.raises(ValueError, match="target_groups must be an int >= 1"):
        flt.DynamicSampler(target_groups=0, max_rounds=1)
    with pytest.raises(ValueError, match="max_rounds must be an int >= 1"):
        flt.DynamicSampler(target_groups=1, max_rounds=0)


# --------------------------------------------------------------------------------------
# what the estimator sees: errored trajectories, per_step returns, the trained version
# --------------------------------------------------------------------------------------
def _errored(q, r, n=2):
    """An errored trajectory as the rollout records it: loss mask 0, reward 0, stop reason "error"."""
    return _s(q, r, [5] * n, mask=[0] * n, reward=0.0, stop_reason="error")


def test_an_errored_trajectory_is_no_peer_in_the_spread():
    # 3 successes + 1 error: every advantage is 0 (the error is out of the baseline), so is the spread
    batch = StepBatch([_s("a", i, [1, 2], reward=1.0) for i in range(3)] + [_errored("a", 3)])
    assert flt.group_reward_spread(batch).tolist() == [0.0] * 4
    assert flt.ZeroVarianceGroupFilter().flags(batch).tolist() == [True] * 4
    assert flt.informative_groups(batch) == {"a": False}
    # a success and a failure stay informative next to an error; a lone survivor does not
    mixed = StepBatch([_s("b", 0, [1], reward=1.0), _s("b", 1, [1]), _errored("b", 2), _errored("c", 0)])
    mixed = StepBatch([*mixed.steps, _s("c", 1, [1], reward=1.0)])
    assert flt.group_reward_spread(mixed).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert flt.informative_groups(mixed) == {"b": True, "c": False}


def test_dynamic_sampling_discards_a_group_made_uniform_by_an_error():
    ds = flt.DynamicSampler(target_groups=1, max_rounds=3)
    ok = [_s("a", i, [1], reward=1.0) for i in range(3)]
    assert ds.add(StepBatch([*ok, _errored("a", 3)])) is False  # not informative: sample again
    assert ds.add(StepBatch([_s("b", 0, [1], reward=1.0), _s("b", 1, [1]), _errored("b", 2)])) is True
    batch, m = ds.result()
    assert {s.trajectory_id.instance_id for s in batch} == {"b"}
    assert m["dynamic_sampling/groups_discarded"] == 1
    assert m["dynamic_sampling/reward_mean_seen"] == pytest.approx(4 / 5)  # the 2 errors are no reward


def test_zero_variance_leaves_no_uniform_group_in_the_token_mean():
    """Two groups, 2 tokens per trajectory: a = 3 successes + 1 error (all advantages 0), b = a success
    and a failure. With the zero-variance filter only b's 4 tokens are in token_mean's denominator,
    so the loss is b's alone (a's 6 tokens made it 0.4 of that)."""
    import jax
    import jax.numpy as jnp

    from rljax.algorithms import get_algorithm
    from rljax.core.objective import ObjectiveConfig, global_counts, objective
    from rljax.data.pack import pack
    from rljax.data.prepare import prepare_samples

    lp = [-0.5, -0.5]
    a = [_s("a", i, [1, 2], reward=1.0, lp=lp) for i in range(3)]
    a.append(_s("a", 3, [3, 4], mask=[0, 0], lp=lp, stop_reason="error"))
    b = [_s("b", 0, [1, 2], reward=1.0, lp=lp), _s("b", 1, [1, 2], lp=lp)]
    config = ObjectiveConfig(policy_loss="ppo_clip", reduction="token_mean", components=("rl",))
    prep = prepare_samples(get_algorithm("grpo"), StepBatch(a + b), filters=[flt.ZeroVarianceGroupFilter()])
    batch = pack(prep.samples, seq_len=8, advantages=prep.advantages).batch
    counts = jax.jit(global_counts, static_argnums=1)(batch, config)
    assert float(counts.tokens[0]) == 4.0
    # logp = old + 0.1 A: ratio exp(0.1 A) inside the clip, so the token loss is -ratio * A; b has
    # A = +-0.5 on 2 tokens each: loss = -(2 e^0.05 0.5 - 2 e^-0.05 0.5) / 4
    logp = jnp.asarray(batch.inference_logprobs) + 0.1 * jnp.asarray(batch.advantages)
    loss = jax.jit(objective, static_argnums=3)(logp, batch, counts, config)[0]
    assert float(loss) == pytest.approx(-(math.exp(0.05) - math.exp(-0.05)) / 4, rel=1e-5)


def _two_turns(q, r, first, final):
    return [
        _s(q, r, [1], reward=first, is_last_step=False),
        _s(q, r, [2], reward=final),
    ]


def test_per_step_spread_reads_the_turn_returns():
    # equal final rewards, different first-turn rewards: the per_step returns at turn 0 are 1.5 vs 0.5,
    # so per_step advantages are not 0 and the group must not count as uniform
    batch = StepBatch(
        _two_turns("a", 0, 1.0, 0.5) + _two_turns("a", 1, 0.0, 0.5) + _two_turns("b", 0, 1.0, 0.5)
    )
    assert flt.group_reward_spread(batch).tolist() == [0.0] * 6  # outcome: final rewards only
    assert flt.group_reward_spread(batch, reward_mode="per_step").tolist() == [1.0] * 4 + [0.0] * 2
    assert flt.informative_groups(batch, reward_mode={"grpo": "per_step"}) == {"a": True, "b": False}
    zv = flt.ZeroVarianceGroupFilter(reward_mode="per_step")
    assert zv.flags(batch).tolist() == [False] * 4 + [True] * 2
    ds = flt.DynamicSampler(target_groups=1, max_rounds=1, reward_mode={"grpo": "per_step"})
    assert ds.add(batch) is True and {s.trajectory_id.instance_id for s in ds.result()[0]} == {"a"}
    with pytest.raises(ValueError, match="reward_mode must be one of"):
        flt.ZeroVarianceGroupFilter(reward_mode="turns")


def test_prepare_samples_applies_zero_variance_with_the_algorithms_reward_mode():
    from rljax.algorithms import get_algorithm
    from rljax.data.prepare import prepare_samples

    batch = StepBatch(_two_turns("a", 0, 1.0, 0.5) + _two_turns("a", 1, 0.0, 0.5))
    per_step = get_algorithm("grpo", reward_mode="per_step")
    prep = prepare_samples(per_step, batch, filters=[flt.ZeroVarianceGroupFilter()], merge=False)
    assert [float(a[0]) for a in prep.advantages] == [0.5, 0.0, -0.5, 0.0]  # turn 0 varies
    assert [list(s.loss_mask) for s in prep.samples] == [[1]] * 4  # so nothing is filtered
    outcome = prepare_samples(get_algorithm("grpo"), batch, filters=[flt.ZeroVarianceGroupFilter()])
    assert outcome.metrics["filters/masked_steps"] == 4  # outcome advantages are all 0 here


def test_staleness_is_measured_against_the_trained_version():
    """At RL step 5, turns sampled with versions 4 and 3 are 1 and 2 versions stale (the newest
    version in the batch, 4, would call them 0 and 1)."""
    from rljax.algorithms import get_algorithm
    from rljax.data.prepare import prepare_samples

    batch = StepBatch([_s("q", 0, [1], policy_version=4, reward=1.0), _s("q", 1, [2], policy_version=3)])
    f = flt.StalenessFilter(max_staleness=1)
    prep = prepare_samples(get_algorithm("grpo"), batch, filters=[f], trained_version=5)
    assert [list(s.loss_mask) for s in prep.samples] == [[1], [0]]
    assert prep.metrics["filters/staleness/flagged"] == 1
    bound = flt.StalenessFilter(max_staleness=1, trained_version=5)
    assert [x.tolist() for x in bound.token_staleness(batch)] == [[1], [2]]
    with pytest.raises(ValueError, match="trained_version is None"):
        f.flags(batch)  # the batch alone cannot say how stale it is
    with pytest.raises(ValueError, match="newer than trained_version=3"):
        flt.StalenessFilter(max_staleness=1, trained_version=3).flags(batch)


def test_prepare_samples_masks_errored_trajectories_that_arrive_with_a_loss_mask():
    """A source other than the rollout (a custom env loop, a dataset) may hand in an errored
    trajectory with loss mask 1: it gets advantage 0 and must not count in any normaliser either."""
    from rljax.algorithms import get_algorithm
    from rljax.data.prepare import prepare_samples

    steps = [
        _s("a", 0, [1, 2], reward=1.0),
        _s("a", 1, [1, 2]),
        _s("a", 2, [3], is_last_step=False),
        _s("a", 2, [4, 5], stop_reason="abort"),
    ]
    for name in ("grpo", "sft"):
        prep = prepare_samples(get_algorithm(name, teacher="t") if name == "sft" else get_algorithm(name),
                               StepBatch(steps), merge=False)  # fmt: skip
        assert [list(s.loss_mask) for s in prep.samples] == [[1, 1], [1, 1], [0], [0, 0]]
