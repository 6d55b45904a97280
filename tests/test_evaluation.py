"""pass@k / pass^k / mean@k against the closed form and brute-force enumeration, and the
trajectory-record -> eval metrics helper."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from rljax.evaluation import eval_metrics, mean_at_k, pass_at_k, pass_hat_k
from rljax.rollout import TrajectoryRecord
from rljax.types import TrajectoryID


def brute_force(n, c, k):
    """Exact expectations over every k-subset of n samples (c of them correct)."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    any_ok = Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))
    all_ok = Fraction(sum(all(samples[i] for i in s) for s in subsets), len(subsets))
    mean = Fraction(sum(sum(samples[i] for i in s) for s in subsets), len(subsets) * k)
    return float(any_ok), float(all_ok), float(mean)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_against_brute_force_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            any_ok, all_ok, mean = brute_force(n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(any_ok, abs=1e-12)
            assert pass_hat_k(n, c, k) == pytest.approx(all_ok, abs=1e-12)
            assert mean_at_k(n, c, k) == pytest.approx(mean, abs=1e-12)


def test_against_closed_form_large_n_and_arrays():
    rng = np.random.default_rng(0)
    n = rng.integers(50, 200, size=40)
    c = (rng.random(40) * n).astype(int)
    for k in (1, 5, 20):
        got = pass_at_k(n, c, k)
        want = [1 - math.comb(int(ni - ci), k) / math.comb(int(ni), k) for ni, ci in zip(n, c, strict=True)]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(
            pass_hat_k(n, c, k),
            [math.comb(int(ci), k) / math.comb(int(ni), k) for ni, ci in zip(n, c, strict=True)],
            rtol=1e-10,
        )
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain accuracy
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 200, 100) == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="exceeds"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k must"):
        pass_at_k(3, 1, 0)


class FakeTask:
    def __init__(self, id, data_source):
        self.id, self.data_source = id, data_source


def record(task, rep, env, reward, correct=None, errored=False):
    rec = TrajectoryRecord(TrajectoryID(task, rep), env=env, reward=reward)
    if correct is not None:
        rec.infos = [{"correct": correct}]
    if errored:
        rec.fail("env", "boom")
        rec.reward = 0.0
    return rec


def test_eval_metrics_per_env_and_data_source():
    # task a (env x, source s1): 2/4 correct; task b (env x, s2): 0/4; task c (env y, s1): 4/4
    recs = [record("a", i, "x", float(i < 2)) for i in range(4)]
    recs += [record("b", i, "x", 0.5, correct=False) for i in range(4)]
    recs += [record("c", i, "y", 0.3, correct=True) for i in range(3)]
    recs += [record("c", 3, "y", 1.0, errored=True)]  # errored: a wrong sample, counted
    tasks = [FakeTask("a", "s1"), FakeTask("b", "s2"), FakeTask("c", "s1")]
    m = eval_metrics(recs, tasks)
    pa = {"a": (4, 2), "b": (4, 0), "c": (4, 3)}
    for k in (1, 4):
        per = {t: pass_at_k(n, c, k) for t, (n, c) in pa.items()}
        assert m[f"eval/pass@{k}"] == pytest.approx(np.mean(list(per.values())))
        assert m[f"eval/x/pass@{k}"] == pytest.approx((per["a"] + per["b"]) / 2)
        assert m[f"eval/y/pass@{k}"] == pytest.approx(per["c"])
        assert m[f"eval/data_source/s1/pass@{k}"] == pytest.approx((per["a"] + per["c"]) / 2)
        assert m[f"eval/data_source/s2/pass@{k}"] == 0.0
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert m["eval/pass^4"] == 0.0 and m["eval/mean@4"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert m["eval/num_tasks"] == 3 and m["eval/num_samples"] == 12 and m["eval/num_errored"] == 1
    # explicit ks; tasks with fewer samples than k are left out of that k
    m2 = eval_metrics(recs[:4] + recs[8:9], ks=[1, 2], prefix="val")
    assert m2["val/pass@2"] == pytest.approx(pass_at_k(4, 2, 2))
    assert m2["val/pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert eval_metrics([]) == {}
