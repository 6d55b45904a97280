"""Tests of rljax.training.optimizer: schedules by hand and against a float64 reference, AdamW wiring."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax.training.optimizer import OptimizerConfig, decay_mask, learning_rate_schedule, make_optimizer


def reference_lr(
    step: int, *, lr: float, schedule: str, warmup: int, total: int | None, ratio: float
) -> float:
    """Independent float64 transcription of the schedule (module docstring formula)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    lo = lr * ratio
    p = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return lo + (lr - lo) * 0.5 * (1.0 + math.cos(math.pi * p))


class ScheduleTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_constant_with_warmup_by_hand(self):
        lr = self.variant(learning_rate_schedule(OptimizerConfig(learning_rate=2e-6, warmup_steps=4)))
        got = [float(lr(jnp.int32(s))) for s in (0, 1, 2, 3, 4, 100)]
        np.testing.assert_allclose(got, [5e-7, 1e-6, 1.5e-6, 2e-6, 2e-6, 2e-6], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_cosine_by_hand(self):
        # warmup 10, total 110 (decay over 100 steps), floor 0.1 * 1e-5 = 1e-6.
        cfg = OptimizerConfig(
            learning_rate=1e-5, schedule="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1
        )
        lr = self.variant(learning_rate_schedule(cfg))
        steps = [0, 9, 10, 35, 60, 85, 110, 500]
        # step 35: p = .25 -> 1e-6 + 9e-6 * (1 + cos(pi/4)) / 2 = 1e-6 + 9e-6 * 0.853553 = 8.681981e-6
        # step 60: p = .5 -> 1e-6 + 4.5e-6; step 85: p = .75 -> 1e-6 + 9e-6 * 0.146447 = 2.318019e-6
        want = [1e-6, 1e-5, 1e-5, 8.681981e-6, 5.5e-6, 2.318019e-6, 1e-6, 1e-6]
        np.testing.assert_allclose([float(lr(jnp.int32(s))) for s in steps], want, rtol=1e-5)

    def test_no_warmup_first_step_is_peak(self):
        lr = learning_rate_schedule(OptimizerConfig(learning_rate=3e-6))
        assert float(lr(0)) == pytest.approx(3e-6)


@settings(max_examples=40, deadline=None)
@given(
    lr=st.floats(1e-7, 1e-2),
    schedule=st.sampled_from(["constant", "cosine"]),
    warmup=st.integers(0, 20),
    extra=st.integers(1, 200),
    ratio=st.floats(0.0, 1.0),
    steps=st.lists(st.integers(0, 400), min_size=1, max_size=8),
)
def test_schedule_matches_float64_reference(lr, schedule, warmup, extra, ratio, steps):
    total = warmup + extra
    cfg = OptimizerConfig(
        learning_rate=lr, schedule=schedule, warmup_steps=warmup, total_steps=total, min_lr_ratio=ratio
    )
    fn = learning_rate_schedule(cfg)
    got = np.array([float(fn(s)) for s in steps])
    kw = dict(lr=lr, schedule=schedule, warmup=warmup, total=total, ratio=ratio)
    want = np.array([reference_lr(s, **kw) for s in steps])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-12)
    assert np.all(got <= lr * (1 + 1e-6)) and np.all(got >= 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(learning_rate=0.0), "OptimizerConfig.learning_rate: expected a number > 0, got 0.0"),
        (dict(schedule="linear"), "schedule: expected one of"),
        (dict(schedule="cosine"), "needs total_steps"),
        (dict(schedule="cosine", warmup_steps=10, total_steps=10), "needs total_steps"),
        (dict(warmup_steps=-1), "warmup_steps: expected an int >= 0, got -1"),
        (dict(min_lr_ratio=1.5), r"min_lr_ratio: expected a number in \[0, 1\]"),
        (dict(b2=1.0), r"b2: expected a number in \[0, 1\)"),
        (dict(max_grad_norm=0.0), "max_grad_norm: expected a number > 0 or None"),
        (dict(weight_decay=-1.0), "weight_decay: expected a number >= 0"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


def test_decay_mask_rank():
    mask = decay_mask({"k": jnp.ones((3, 2)), "e": jnp.ones((4, 2)), "b": jnp.ones(3), "s": jnp.ones(())})
    assert mask == {"b": False, "e": True, "k": True, "s": False}


def numpy_adamw(params, grads, *, cfg, steps):
    """float64 AdamW + global-norm clip reference over ``len(grads)`` updates (one grad list per step)."""
    p = [np.asarray(x, np.float64) for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t in range(steps):
        g = [np.asarray(x, np.float64) for x in grads[t]]
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in g))
        if cfg.max_grad_norm is not None and norm > cfg.max_grad_norm:
            g = [x * cfg.max_grad_norm / norm for x in g]
        lr = reference_lr(t, lr=cfg.learning_rate, schedule=cfg.schedule, warmup=cfg.warmup_steps,
                          total=cfg.total_steps, ratio=cfg.min_lr_ratio)  # fmt: skip
        for i in range(len(p)):
            m[i] = cfg.b1 * m[i] + (1 - cfg.b1) * g[i]
            v[i] = cfg.b2 * v[i] + (1 - cfg.b2) * g[i] ** 2
            mh, vh = m[i] / (1 - cfg.b1 ** (t + 1)), v[i] / (1 - cfg.b2 ** (t + 1))
            wd = cfg.weight_decay if p[i].ndim >= 2 else 0.0
            p[i] = p[i] - lr * (mh / (np.sqrt(vh) + cfg.eps) + wd * p[i])
    return p


@pytest.mark.parametrize("clip", [None, 0.5])
def test_make_optimizer_matches_numpy_adamw(clip):
    cfg = OptimizerConfig(learning_rate=0.05, schedule="cosine", warmup_steps=1, total_steps=4,
                          weight_decay=0.1, max_grad_norm=clip, min_lr_ratio=0.2)  # fmt: skip
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(3)]
    tx = make_optimizer(cfg)
    state, p = tx.init(params), jax.tree.map(jnp.asarray, params)
    for g in grads:
        updates, state = tx.update(g, state, p)
        p = jax.tree.map(lambda a, u: a + u, p, updates)
    keys = sorted(params)
    want = numpy_adamw([params[k] for k in keys], [[g[k] for k in keys] for g in grads], cfg=cfg, steps=3)
    for k, w in zip(keys, want, strict=True):
        np.testing.assert_allclose(np.asarray(p[k]), w, rtol=1e-5, atol=1e-6)
