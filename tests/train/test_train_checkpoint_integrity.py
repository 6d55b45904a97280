"""Checkpoint integrity: damaged files are named at verify / restore, resume falls back to an intact step.

The damage is done by hand to the files orbax wrote (bytes flipped inside array data, a file cut short,
a file deleted); the expected digests are recomputed here with hashlib, independently of the module.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_fixtures as tf

from rljax.training import checkpoint as ck
from rljax.training.optimizer import OptimizerConfig
from rljax.training.step import TrainConfig, TrainState


def _params(seed: int) -> dict[str, jax.Array]:
    """Random float32 arrays: incompressible, so zstd stores them (nearly) verbatim."""
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(128, 128)).astype(np.float32)),
        "b": jnp.asarray(rng.normal(size=(128,)).astype(np.float32)),
    }


_OPT = {
    "count": jnp.int32(7),
    "mu": jnp.asarray(np.random.default_rng(99).normal(size=(64, 64)), jnp.float32),
}


def _save(directory: pathlib.Path, step: int, **kw) -> pathlib.Path:
    return ck.save(directory, step, params=_params(step), opt_state=_OPT, data_state={"pos": step}, **kw)


def _array_data_file(step_path: pathlib.Path, item: str = "params") -> pathlib.Path:
    """The largest file orbax wrote for ``item``: the OCDBT data file holding the array chunks."""
    files = [p for p in (step_path / item).rglob("*") if p.is_file()]
    data = max(files, key=lambda p: p.stat().st_size)
    assert data.parent.name == "d" and data.stat().st_size > 10_000, data  # 16 KiB of float32 (zstd)
    return data


def _rel(path: pathlib.Path, step_path: pathlib.Path) -> str:
    return path.relative_to(step_path).as_posix()


def _flip(path: pathlib.Path, offsets=(0.4, 0.5, 0.6)) -> None:
    data = bytearray(path.read_bytes())
    for f in offsets:
        data[int(len(data) * f)] ^= 0x5A
    path.write_bytes(bytes(data))


def _assert_bits_equal(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()


def _make_legacy(step_path: pathlib.Path) -> None:
    """What a save before manifests existed left: no manifest.json, a meta item without its name."""
    (step_path / ck.MANIFEST).unlink()
    meta = step_path / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    meta.write_text(json.dumps({"format": saved["format"], "step": saved["step"]}))


def test_flipped_bytes_in_parameter_data_are_detected_and_named(tmp_path):
    path = _save(tmp_path, 1)
    data = _array_data_file(path)
    _flip(data)
    # the flips land in array values: read WITHOUT verification they come back silently wrong
    # (what every resume did before manifests existed)
    silent = ck.restore(tmp_path, params=_params(0), opt_state=_OPT, verify=False)
    assert not np.array_equal(np.asarray(silent.params["w"]), np.asarray(_params(1)["w"]))
    for check in (
        lambda: ck.verify(tmp_path, 1),
        lambda: ck.restore(tmp_path, params=_params(0), opt_state=_OPT),
    ):
        with pytest.raises(ck.CheckpointCorruptedError) as info:
            check()
        err = info.value
        assert isinstance(err, ValueError)
        assert err.path == path
        assert [rel for rel, _ in err.problems] == [_rel(data, path)]
        assert err.problems[0][1].startswith("checksum mismatch")
        assert str(path) in str(err) and _rel(data, path) in str(err) and "checksum mismatch" in str(err)


def test_truncated_parameter_file_raises_the_clear_error_not_tensorstores(tmp_path):
    path = _save(tmp_path, 1)
    data = _array_data_file(path)
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 2])
    with pytest.raises(ck.CheckpointCorruptedError) as info:
        ck.restore(tmp_path, params=_params(0), opt_state=_OPT)
    assert info.value.problems == [(_rel(data, path), f"truncated: {size // 2} of {size} bytes")]
    assert "TensorStore" not in str(info.value) and "OCDBT" not in str(info.value)
    # read without verification, TensorStore's failure is still translated (and kept as the cause)
    with pytest.raises(ck.CheckpointCorruptedError, match="OUT_OF_RANGE") as info:
        ck.restore(tmp_path, params=_params(0), opt_state=_OPT, verify=False)
    assert info.value.__cause__ is not None


def test_deleted_files_are_detected(tmp_path):
    path = _save(tmp_path, 1)
    data = _array_data_file(path, "opt_state")
    data.unlink()
    (path / "data_state" / "metadata").unlink()
    with pytest.raises(ck.CheckpointCorruptedError) as info:
        ck.verify(tmp_path, 1)
    assert info.value.problems == sorted([(_rel(data, path), "missing"), ("data_state/metadata", "missing")])
    # a deleted manifest does not turn a new checkpoint into an unverifiable "legacy" one
    path = _save(tmp_path, 2)
    (path / ck.MANIFEST).unlink()
    with pytest.raises(ck.CheckpointCorruptedError, match=r"manifest.json: missing: no manifest"):
        ck.restore(tmp_path, step=2)
    (path / ck.MANIFEST).write_text('{"format": "rljax.manifest/1", "files": ')
    with pytest.raises(ck.CheckpointCorruptedError, match=r"manifest.json: unreadable"):
        ck.verify(tmp_path, 2)


def test_latest_intact_step_skips_damaged_steps_newest_first(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step)
    assert ck.latest_intact_step(tmp_path) == (30, [])
    flipped = _array_data_file(tmp_path / "step_30")
    _flip(flipped)
    cut = _array_data_file(tmp_path / "step_20", "opt_state")
    cut.write_bytes(cut.read_bytes()[:100])
    step, skipped = ck.latest_intact_step(tmp_path)
    assert step == 10
    assert [s for s, _ in skipped] == [30, 20]
    assert skipped[0][1].startswith(f"{_rel(flipped, tmp_path / 'step_30')}: checksum mismatch")
    assert skipped[1][1].startswith(f"{_rel(cut, tmp_path / 'step_20')}: truncated: 100 of ")
    r = ck.restore(tmp_path, params=_params(0), opt_state=_OPT, step=step)
    assert r.step == 10 and r.data_state == {"pos": 10}
    _assert_bits_equal(r.params, _params(10))
    # steps newer than the marked one (an abandoned future) are not candidates, as for latest_step
    ck._write_marker(tmp_path, 20)
    assert ck.latest_intact_step(tmp_path) == (10, [(20, skipped[1][1])])
    # nothing intact: None, never a damaged step
    (tmp_path / "step_10" / "rng" / "metadata").write_text("{}")
    step, skipped = ck.latest_intact_step(tmp_path)
    assert step is None and [s for s, _ in skipped] == [20, 10]
    assert ck.latest_intact_step(tmp_path / "missing") == (None, [])


def test_a_save_killed_before_its_manifest_is_not_complete(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def killed(path, step):
        raise KeyboardInterrupt("process died while hashing")

    monkeypatch.setattr(ck, "_seal", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / "step_2" / "commit_success.txt").is_file()  # orbax committed it ...
    assert ck.checkpoint_steps(tmp_path) == [1] and ck.latest_step(tmp_path) == 1  # ... we did not
    with pytest.raises(ck.CheckpointCorruptedError, match="killed before sealing"):
        ck.restore(tmp_path, step=2)
    (tmp_path / "latest").unlink()  # without the marker it is a candidate, reported as skipped
    step, skipped = ck.latest_intact_step(tmp_path)
    assert step == 1 and [s for s, _ in skipped] == [2]
    _save(tmp_path, 2)  # the resumed run saves step 2 again
    assert ck.checkpoint_steps(tmp_path) == [1, 2] and ck.verify(tmp_path, 2) is True
    # an unsealed step the run moved past is removed by the next save (it can never be used)
    monkeypatch.setattr(ck, "_seal", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3)
    monkeypatch.undo()
    _save(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1", "step_2", "step_4"]


def test_intact_model_checkpoint_has_a_full_manifest_and_restores_bit_exactly(tmp_path):
    config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3))
    state = TrainState.create(tf.make_model(0), config)
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), state.params)
    path = ck.save(tmp_path, 4, params=params, opt_state=state.opt_state, data_state={"pos": 4})
    manifest = json.loads((path / ck.MANIFEST).read_text())
    on_disk = sorted(_rel(p, path) for p in path.rglob("*") if p.is_file() and p.name != ck.MANIFEST)
    assert sorted(manifest["files"]) == on_disk
    for rel, entry in manifest["files"].items():
        content = (path / rel).read_bytes()
        assert entry == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}, rel
    assert ck.verify(tmp_path, 4) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a verified checkpoint restores without any warning
        r = ck.restore(tmp_path, params=state.params, opt_state=state.opt_state)
    _assert_bits_equal(r.params, params)
    _assert_bits_equal(r.opt_state, state.opt_state)
    # one flipped byte in any layer's data of the model is caught too
    data = _array_data_file(path)
    _flip(data, offsets=(0.77,))
    with pytest.raises(ck.CheckpointCorruptedError, match=_rel(data, path)):
        ck.restore(tmp_path, params=state.params, opt_state=state.opt_state)


def test_legacy_checkpoint_without_manifest_restores_with_one_warning(tmp_path):
    path = _save(tmp_path, 5)
    _make_legacy(path)
    assert ck.checkpoint_steps(tmp_path) == [5] and ck.latest_step(tmp_path) == 5
    with pytest.warns(ck.UnverifiedCheckpointWarning, match="cannot be verified"):
        assert ck.verify(tmp_path, 5) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per checkpoint, not at every read
        r = ck.restore(tmp_path, params=_params(0), opt_state=_OPT)
        assert ck.latest_intact_step(tmp_path) == (5, [])
    assert r.step == 5 and r.data_state == {"pos": 5}
    _assert_bits_equal(r.params, _params(5))
    # a damaged legacy checkpoint cannot be named file by file, but it is still the clear error
    data = _array_data_file(path)
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(ck.CheckpointCorruptedError, match="no manifest, so the damaged file cannot be named"):
        ck.restore(tmp_path, params=_params(0), opt_state=_OPT)


def test_read_extra_verifies_only_the_extra_item(tmp_path):
    path = ck.save(tmp_path, 1, params=_params(1), opt_state=_OPT, extra={"reward/mean": 0.5})
    _flip(_array_data_file(path))
    assert ck.read_extra(tmp_path) == {"reward/mean": 0.5}  # the damaged arrays are not read
    (path / "extra" / "metadata").write_text('{"reward/mean": 0.9}')
    with pytest.raises(ck.CheckpointCorruptedError, match="extra/metadata: checksum mismatch"):
        ck.read_extra(tmp_path)


def test_restore_params_reads_and_verifies_only_the_parameters(tmp_path):
    path = _save(tmp_path, 1)
    _assert_bits_equal(ck.restore_params(tmp_path, params=_params(0)), _params(1))
    opt_data = _array_data_file(path, "opt_state")
    _flip(opt_data)
    with pytest.raises(ck.CheckpointCorruptedError):
        ck.restore(tmp_path, params=_params(0), opt_state=_OPT)
    # the damaged optimizer state is neither verified nor read: eval and export still serve the policy
    _assert_bits_equal(ck.restore_params(tmp_path, params=_params(0)), _params(1))
    _assert_bits_equal(ck.restore_params(tmp_path), _params(1))  # no target: the stored tree
    params_data = _array_data_file(path)
    _flip(params_data)
    with pytest.raises(ck.CheckpointCorruptedError) as info:
        ck.restore_params(tmp_path, params=_params(0))
    assert [rel for rel, _ in info.value.problems] == [_rel(params_data, path)]
    with pytest.raises(ValueError, match="target dtypes differ"):
        ck.restore_params(
            tmp_path, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params(0)), verify=False
        )


def test_overwriting_a_damaged_step_writes_a_new_manifest(tmp_path):
    path = _save(tmp_path, 1)
    _flip(_array_data_file(path))
    with pytest.raises(ck.CheckpointCorruptedError):
        ck.verify(tmp_path)
    _save(tmp_path, 1, overwrite=True)
    assert ck.verify(tmp_path) is True
    assert not [p for p in path.iterdir() if p.name.startswith(f".{ck.MANIFEST}.tmp")]
