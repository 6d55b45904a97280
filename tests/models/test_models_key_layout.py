"""The sampler's KV-cache key layout choice (rljax.models.key_layout): the switch, the timed
comparison's decision rule and its cache, and the measurement itself on decode steps."""

from __future__ import annotations

import json

import pytest

from rljax.models import key_layout as kl


@pytest.fixture
def choice_cache(tmp_path, monkeypatch):
    """A fresh cache folder and no remembered choice (before and after the test)."""
    monkeypatch.setenv("RLJAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("RLJAX_TRANSPOSED_KEYS", raising=False)
    kl.timed_choice.cache_clear()
    yield tmp_path
    kl.timed_choice.cache_clear()


def test_the_switch_forces_either_layout_and_rejects_other_words(choice_cache, monkeypatch):
    def never():
        raise AssertionError("a forced layout must not measure")

    monkeypatch.setattr(kl, "_measure", never)
    monkeypatch.setenv("RLJAX_TRANSPOSED_KEYS", "1")
    assert kl.use_transposed_keys() is True
    monkeypatch.setenv("RLJAX_TRANSPOSED_KEYS", "0")
    assert kl.use_transposed_keys() is False
    monkeypatch.setenv("RLJAX_TRANSPOSED_KEYS", "yes")
    with pytest.raises(ValueError, match="RLJAX_TRANSPOSED_KEYS must be 0"):
        kl.use_transposed_keys()


@pytest.mark.parametrize(
    ("transposed_s", "slot_major_s", "wins"),
    [
        ([1.0, 1.0, 1.0], [1.2, 1.1, 1.3], True),  # 1.2x in the median round
        ([1.0, 1.0, 1.0], [1.04, 1.03, 2.0], False),  # 1.04x: inside the margin, the plain layout stays
        ([1.0, 2.0, 1.0], [0.9, 1.9, 0.8], False),  # slower
    ],
)
def test_auto_takes_the_transposed_keys_only_when_measured_faster(
    choice_cache, monkeypatch, transposed_s, slot_major_s, wins
):
    calls = []
    monkeypatch.setattr(kl, "_measure", lambda: calls.append(1) or (transposed_s, slot_major_s))
    assert kl.use_transposed_keys() is wins
    assert kl.use_transposed_keys() is wins and len(calls) == 1  # once per process
    (stored,) = choice_cache.glob("key_layout-*.choice.json")
    data = json.loads(stored.read_text())
    assert data["transposed"] is wins and data["transposed_s"] == transposed_s
    kl.timed_choice.cache_clear()  # a new process reads the file instead of measuring
    again = kl.timed_choice()
    assert again.cached and again.transposed is wins and len(calls) == 1
    assert ("transposed [B*K, D, S]" in again.describe()) is wins and "cached" in again.describe()


def test_a_stale_or_broken_cache_file_measures_again(choice_cache, monkeypatch):
    monkeypatch.setattr(kl, "_measure", lambda: ([1.0], [2.0]))
    first = kl.timed_choice()
    path = choice_cache / first.path.split("/")[-1]
    path.write_text(json.dumps({**json.loads(path.read_text()), "key": "another machine"}))
    kl.timed_choice.cache_clear()
    monkeypatch.setattr(kl, "_measure", lambda: ([2.0], [1.0]))
    assert kl.timed_choice().transposed is False and not kl.timed_choice().cached
    path.write_text("{not json")
    kl.timed_choice.cache_clear()
    assert kl.timed_choice().transposed is False and not kl.timed_choice().cached


def test_auto_never_transposes_off_the_cpu(choice_cache, monkeypatch):
    monkeypatch.setattr(kl, "_measure", lambda: ([1.0], [9.0]))
    monkeypatch.setattr(kl.jax, "default_backend", lambda: "gpu")
    assert kl.use_transposed_keys() is False


def test_the_measurement_times_decode_steps_in_both_layouts():
    transposed_s, slot_major_s = kl._measure(rounds=2)
    assert len(transposed_s) == len(slot_major_s) == 2
    assert all(0 < s < 60 for s in [*transposed_s, *slot_major_s])
