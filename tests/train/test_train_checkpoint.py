"""Checkpoints: bit-exact round trips, exact resume of the train step, atomic marker, kill -9 safety."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import train_fixtures as tf
from jax.sharding import PartitionSpec as P
from xla_flags import subprocess_env

from rljax.training import checkpoint as ck
from rljax.training.optimizer import OptimizerConfig
from rljax.training.sharding import make_mesh
from rljax.training.step import TrainConfig, TrainState, mini_batch_counts, train_step

CONFIG = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3, weight_decay=0.1))


def assert_bits_equal(got, want):
    """Same pytree structure, dtypes, shapes and BITS (NaN-safe, -0.0 != 0.0)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def randomized(tree, seed: int):
    """``tree`` with every leaf replaced by random values of its shape and dtype (counts included)."""
    rng = np.random.default_rng(seed)

    def fill(x):
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 1000, size=x.shape), x.dtype)
        return jnp.asarray(rng.normal(size=x.shape), x.dtype)

    return jax.tree.map(fill, tree)


def test_train_state_round_trip_is_bit_exact(tmp_path):
    other = TrainState.create(tf.make_model(0), CONFIG)
    state = dataclasses.replace(
        other, params=randomized(other.params, 1), opt_state=randomized(other.opt_state, 2)
    )
    counts = [int(x) for x in jax.tree.leaves(state.opt_state) if x.dtype == jnp.int32]
    assert len(counts) == 2 and min(counts) > 0  # adam's and the schedule's counts are really there
    ck.save(tmp_path, 3, params=state.params, opt_state=state.opt_state)
    restored = ck.restore(tmp_path, params=other.params, opt_state=other.opt_state)
    assert restored.step == 3
    assert type(restored.params) is type(state.params)
    assert_bits_equal(restored.params, state.params)
    assert_bits_equal(restored.opt_state, state.opt_state)
    # abstract targets (jax.eval_shape) work the same
    abstract = jax.eval_shape(lambda: (other.params, other.opt_state))
    again = ck.restore(tmp_path, params=abstract[0], opt_state=abstract[1], step=3)
    assert_bits_equal(again.opt_state, state.opt_state)
    # no target: the stored tree as plain containers, same leaves
    raw = ck.restore(tmp_path)
    assert sorted(raw.params) == sorted(state.params.to_pure_dict())
    want = np.asarray(state.params["embed_tokens"].get_value())
    assert np.asarray(raw.params["embed_tokens"]["value"]).tobytes() == want.tobytes()


def test_prng_keys_and_numpy_generators_round_trip_exactly(tmp_path):
    typed = jax.random.split(jax.random.key(11))[1]
    rbg = jax.random.key(3, impl="rbg")
    raw = jax.random.PRNGKey(7)
    pcg = np.random.default_rng(5)
    pcg.normal(size=3)  # mid-stream state (has_uint32 etc.)
    pcg.integers(0, 10, size=1, dtype=np.uint32)
    mt = np.random.Generator(np.random.MT19937(9))
    mt.random(5)
    rng = {
        "typed": typed,
        "rbg": rbg,
        "raw": raw,
        "many": jax.random.split(raw, 3),
        "gens": [pcg, (mt, np.asarray([1, 2], np.uint32))],
    }
    ck.save(tmp_path, 0, params={"w": jnp.ones(1)}, opt_state={}, rng=rng)
    got = ck.restore(tmp_path).rng
    assert jax.dtypes.issubdtype(got["typed"].dtype, jax.dtypes.prng_key)
    assert str(jax.random.key_impl(got["rbg"])) == "rbg"
    for name in ("typed", "rbg"):
        assert_bits_equal(jax.random.key_data(got[name]), jax.random.key_data(rng[name]))
        assert_bits_equal(jax.random.normal(got[name], (4,)), jax.random.normal(rng[name], (4,)))
    for name in ("raw", "many"):
        assert isinstance(got[name], jax.Array) and got[name].dtype == jnp.uint32
        assert_bits_equal(got[name], rng[name])
    assert_bits_equal(jax.random.uniform(got["raw"], (3,)), jax.random.uniform(raw, (3,)))
    got_pcg, (got_mt, got_np) = got["gens"][0], got["gens"][1]
    assert isinstance(got["gens"][1], tuple) and isinstance(got_np, np.ndarray)
    assert_bits_equal(got_np, np.asarray([1, 2], np.uint32))
    # the continued streams are identical
    assert got_pcg.normal(size=5).tolist() == pcg.normal(size=5).tolist()
    assert got_mt.integers(0, 2**31, size=5).tolist() == mt.integers(0, 2**31, size=5).tolist()


def test_data_state_config_and_extra_round_trip(tmp_path):
    cfg = ml_collections.ConfigDict({"lr": 1e-6, "model": {"name": "qwen3", "layers": 2}, "tags": ["a"]})
    data_state = {"epoch": 2, "position": 1234, "order": [3, 1, 2], "done": False, "frac": 0.5, "x": None}
    ck.save(
        tmp_path,
        1,
        params={"w": jnp.ones(1)},
        opt_state={},
        data_state=data_state,
        config=cfg,
        extra={"reward/mean": 0.125, "step": 9},
    )
    got = ck.restore(tmp_path)
    assert got.data_state == data_state
    assert isinstance(got.config, ml_collections.ConfigDict)
    assert got.config.to_dict() == cfg.to_dict()
    assert ck.read_extra(tmp_path) == {"reward/mean": 0.125, "step": 9}
    # dataclass configs become dicts; a value JSON cannot hold is recorded by its repr, not a crash
    ck.save(
        tmp_path,
        2,
        params={"w": jnp.ones(1)},
        opt_state={},
        config={"opt": CONFIG.optimizer, "dtype": jnp.bfloat16},
    )
    got = ck.restore(tmp_path).config
    assert got["opt"]["learning_rate"] == 1e-3 and got["opt"]["schedule"] == "constant"
    assert isinstance(got["dtype"], str)
    assert ck.read_extra(tmp_path) == {} and ck.read_extra(tmp_path, step=1)["step"] == 9
    ck.save(tmp_path, 3, params={"w": jnp.ones(1)}, opt_state={}, config=CONFIG.optimizer)
    assert ck.restore(tmp_path).config["max_grad_norm"] == 1.0


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
    data_state=st.dictionaries(st.text(max_size=6), json_values, max_size=4), seed=st.integers(0, 2**32 - 1)
)
def test_property_host_state_round_trips(tmp_path_factory, data_state, seed):
    directory = tmp_path_factory.mktemp("prop")
    gen = np.random.default_rng(seed)
    key = jax.random.key(seed)
    ck.save(
        directory,
        0,
        params={"w": jnp.ones(1)},
        opt_state={},
        data_state=data_state,
        rng={"key": key, "gen": gen},
    )
    got = ck.restore(directory)
    assert json.dumps(got.data_state, sort_keys=True) == json.dumps(data_state, sort_keys=True)
    assert got.rng["gen"].bit_generator.state == gen.bit_generator.state
    assert_bits_equal(jax.random.key_data(got.rng["key"]), jax.random.key_data(key))


def test_resume_of_the_train_step_is_bit_for_bit(tmp_path):
    """Uninterrupted 4 steps == 2 steps, checkpoint, restore into a fresh state, 2 more steps."""
    batches = [tf.make_batch(s) for s in range(3)]
    counts = [mini_batch_counts(b, CONFIG.objective) for b in batches]

    def run(state, start, stop, key, gen):
        losses = []
        for _ in range(start, stop):  # the batch depends on BOTH rngs: a wrong rng changes the losses
            key, sub = jax.random.split(key)
            i = (int(jax.random.randint(sub, (), 0, 3)) + int(gen.integers(0, 3))) % 3
            state, metrics = train_step(state, batches[i], counts[i])
            losses.append(float(metrics["loss"]))
        return state, losses, key, gen

    ref_state, ref_losses, _, _ = run(
        TrainState.create(tf.make_model(0), CONFIG), 0, 4, jax.random.key(1), np.random.default_rng(2)
    )
    compiled = train_step.jitted._cache_size()  # other tests may have compiled other signatures before
    state, losses, key, gen = run(
        TrainState.create(tf.make_model(0), CONFIG), 0, 2, jax.random.key(1), np.random.default_rng(2)
    )
    assert losses == ref_losses[:2]
    ck.save(
        tmp_path,
        2,
        params=state.params,
        opt_state=state.opt_state,
        data_state={"next": 2},
        rng={"key": key, "gen": gen},
        extra={"step": int(state.step), "skipped": int(state.skipped)},
    )
    del state, key, gen
    fresh = TrainState.create(tf.make_model(9), CONFIG)
    r = ck.restore(tmp_path, params=fresh.params, opt_state=fresh.opt_state)
    extra = ck.read_extra(tmp_path)
    resumed = dataclasses.replace(
        fresh,
        params=r.params,
        opt_state=r.opt_state,
        step=jnp.int32(extra["step"]),
        skipped=jnp.int32(extra["skipped"]),
    )
    resumed, more, _, _ = run(resumed, r.data_state["next"], 4, r.rng["key"], r.rng["gen"])
    assert losses + more == ref_losses  # exact float equality
    assert_bits_equal(resumed.params, ref_state.params)
    assert_bits_equal(resumed.opt_state, ref_state.opt_state)
    assert int(resumed.step) == int(ref_state.step) == 4
    assert train_step.jitted._cache_size() == compiled, "restored arrays changed the compiled signature"


def test_sharded_save_and_restore_into_other_shardings(tmp_path):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    state = TrainState.create(tf.make_model(0), CONFIG, mesh=mesh)
    ck.save(tmp_path, 1, params=state.params, opt_state=state.opt_state)
    # restore into the same mesh layout: shards land where the target says
    r = ck.restore(tmp_path, params=state.params, opt_state=state.opt_state)
    for got, want in zip(jax.tree.leaves(r.params), jax.tree.leaves(state.params), strict=True):
        assert got.sharding == want.sharding
    assert_bits_equal(r.params, state.params)
    assert_bits_equal(r.opt_state, state.opt_state)
    # ... and into other layouts: params replicated on a 4-device mesh, moments on one device
    replicated = jax.sharding.NamedSharding(make_mesh(data=4, devices=jax.devices()[4:]), P())
    single = jax.sharding.SingleDeviceSharding(jax.devices()[3])

    def like(tree, sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)

    r = ck.restore(tmp_path, params=like(state.params, replicated), opt_state=like(state.opt_state, single))
    assert all(x.sharding == replicated for x in jax.tree.leaves(r.params))
    assert all(x.sharding == single for x in jax.tree.leaves(r.opt_state))
    assert_bits_equal(r.params, state.params)
    assert_bits_equal(r.opt_state, state.opt_state)


def test_marker_is_written_last_and_keep_last_k(tmp_path):
    seen = []
    for step in (0, 5, 10, 15, 20):
        ck.save(tmp_path, step, params={"w": jnp.full(3, float(step))}, opt_state={}, keep=3)
        seen.append(ck.checkpoint_steps(tmp_path))
        assert json.loads((tmp_path / "latest").read_text()) == {"step": step}
    assert seen == [[0], [0, 5], [0, 5, 10], [5, 10, 15], [10, 15, 20]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_10", "step_15", "step_20"]
    assert ck.restore(tmp_path, step=10).params["w"].tolist() == [10.0] * 3
    # keep=None keeps everything; keep=1 leaves only the new step
    ck.save(tmp_path, 25, params={"w": jnp.ones(3)}, opt_state={})
    assert ck.checkpoint_steps(tmp_path) == [10, 15, 20, 25]
    ck.save(tmp_path, 30, params={"w": jnp.ones(3)}, opt_state={}, keep=1)
    assert ck.checkpoint_steps(tmp_path) == [30]
    # steps newer than the one saved (an abandoned future after a rollback) are not deleted by keep
    ck.save(tmp_path, 12, params={"w": jnp.ones(3)}, opt_state={}, keep=1)
    assert ck.checkpoint_steps(tmp_path) == [12, 30] and ck.latest_step(tmp_path) == 12


def test_latest_step_ignores_incomplete_directories(tmp_path):
    assert ck.latest_step(tmp_path) is None and ck.latest_step(tmp_path / "missing") is None
    ck.save(tmp_path, 3, params={"w": jnp.ones(2)}, opt_state={})
    # a step_9 that was never committed (no completion file), a tmp dir, junk names
    (tmp_path / "step_9").mkdir()
    (tmp_path / "step_9" / "meta").mkdir()
    (tmp_path / "step_11.orbax-checkpoint-tmp").mkdir()
    (tmp_path / "step_x").mkdir()
    (tmp_path / "step_12.deleting-77").mkdir()
    (tmp_path / ".latest.tmp-77").write_text('{"step": 9')  # a marker write killed before its rename
    assert ck.checkpoint_steps(tmp_path) == [3]
    assert ck.latest_step(tmp_path) == 3
    (tmp_path / "latest").unlink()  # without a marker: the newest COMPLETE step
    assert ck.latest_step(tmp_path) == 3
    with pytest.raises(FileNotFoundError, match="step_9 is not a complete checkpoint"):
        ck.restore(tmp_path, step=9)
    # the next save removes stale temporaries of older steps
    ck.save(tmp_path, 13, params={"w": jnp.ones(2)}, opt_state={})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_13", "step_3", "step_9", "step_x"]
    # a marker whose step was deleted by hand falls back to the newest complete step below it
    ck._remove(tmp_path / "step_13")
    assert ck.latest_step(tmp_path) == 3
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(ValueError, match="latest is corrupt"):
        ck.latest_step(tmp_path)


def test_crash_between_commit_and_marker_keeps_previous_latest(tmp_path, monkeypatch):
    ck.save(tmp_path, 1, params={"w": jnp.full(2, 1.0)}, opt_state={}, data_state={"pos": 1})

    def killed(directory, step):
        raise KeyboardInterrupt("process died before the marker")

    monkeypatch.setattr(ck, "_write_marker", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.save(tmp_path, 2, params={"w": jnp.full(2, 2.0)}, opt_state={}, data_state={"pos": 2})
    monkeypatch.undo()
    assert ck.checkpoint_steps(tmp_path) == [1, 2]  # step_2 is complete on disk but not committed
    assert ck.latest_step(tmp_path) == 1
    assert ck.restore(tmp_path).data_state == {"pos": 1}
    # the resumed run saves step 2 again: the orphan is replaced without needing overwrite=True
    ck.save(tmp_path, 2, params={"w": jnp.full(2, 2.5)}, opt_state={}, data_state={"pos": 2})
    r = ck.restore(tmp_path)
    assert r.step == 2 and r.params["w"].tolist() == [2.5, 2.5]


def test_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ck.restore(tmp_path)
    w = {"w": jnp.ones(2)}
    ck.save(tmp_path, 1, params=w, opt_state={})
    with pytest.raises(ValueError, match="latest checkpoint; pass overwrite=True"):
        ck.save(tmp_path, 1, params=w, opt_state={})
    ck.save(tmp_path, 1, params={"w": jnp.zeros(2)}, opt_state={}, overwrite=True)
    assert ck.restore(tmp_path).params["w"].tolist() == [0.0, 0.0]
    for bad_step in (-1, True, 1.0):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            ck.save(tmp_path, bad_step, params=w, opt_state={})
    with pytest.raises(ValueError, match="keep must be None"):
        ck.save(tmp_path, 2, params=w, opt_state={}, keep=0)
    with pytest.raises(ValueError, match=r"data_state\['order'\] is a tuple.*use a list"):
        ck.save(tmp_path, 2, params=w, opt_state={}, data_state={"order": (1, 2)})
    with pytest.raises(ValueError, match=r"data_state\['pos'\] is a int64.*int\(\)"):
        ck.save(tmp_path, 2, params=w, opt_state={}, data_state={"pos": np.int64(3)})
    with pytest.raises(ValueError, match="dict keys must be str"):
        ck.save(tmp_path, 2, params=w, opt_state={}, extra={1: 2})
    with pytest.raises(ValueError, match="raw PRNG key must be a uint32 array"):
        ck.save(tmp_path, 2, params=w, opt_state={}, rng=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="unsupported RNG"):
        ck.save(tmp_path, 2, params=w, opt_state={}, rng=np.random.RandomState(0))
    assert ck.checkpoint_steps(tmp_path) == [1]  # nothing half-written by the rejected calls
    with pytest.raises(ValueError, match="must not cast.*w: stored float32, target bfloat16"):
        ck.restore(tmp_path, params={"w": jnp.ones(2, jnp.bfloat16)}, opt_state={})
    with pytest.raises(ValueError, match="not compatible with the stored shape"):
        ck.restore(tmp_path, params={"w": jnp.ones(3)}, opt_state={})
    with pytest.raises(ValueError, match="holds no opt_state arrays"):
        ck.restore(tmp_path, params=w, opt_state={"mu": jnp.ones(2)})


# ------------------------------------------------------------------------------------------------
# kill -9 in the middle of a real save, in a separate process
# ------------------------------------------------------------------------------------------------

_NUM, _SIZE = 8, 1_000_000  # 32 MB of float32 per checkpoint


def _tree(step: int) -> dict[str, np.ndarray]:
    data = np.random.default_rng(step).random((_NUM, _SIZE), dtype=np.float32)
    return {f"a{i}": data[i] for i in range(_NUM)}


_CHILD = f"""
import sys
import numpy as np
from rljax.training import checkpoint as ck
directory, step = sys.argv[1], int(sys.argv[2])
data = np.random.default_rng(step).random(({_NUM}, {_SIZE}), dtype=np.float32)
params = {{f"a{{i}}": data[i] for i in range({_NUM})}}
print("READY", flush=True)
sys.stdin.readline()
print("START", flush=True)
ck.save(directory, step, params=params, opt_state={{"count": np.int32(step)}}, data_state={{"step": step}},
        keep=2)
print("DONE", flush=True)
"""


@pytest.mark.subprocess
def test_kill_9_mid_save_leaves_the_previous_step_latest(tmp_path):
    ck.save(tmp_path, 1, params=_tree(1), opt_state={"count": np.int32(1)}, data_state={"step": 1}, keep=2)
    env = subprocess_env()
    delays = [0.0, 0.05, 0.2, 1.0]  # after orbax created the step's temporary directory
    # start every child first (imports overlap), then trigger and kill them one by one
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path), str(2 + i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for i in range(len(delays))
    ]
    target = {"params": _tree(0), "opt_state": {"count": np.int32(0)}}
    committed, interrupted_mid_write = 1, 0
    try:
        for i, (proc, delay) in enumerate(zip(children, delays, strict=True)):
            step = 2 + i
            assert proc.stdout.readline().strip() == b"READY"
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == b"START"
            tmp_dir = tmp_path / f"step_{step}.orbax-checkpoint-tmp"
            deadline = time.monotonic() + 60
            while not tmp_dir.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            latest = ck.latest_step(tmp_path)
            assert latest in (committed, step), (latest, committed, step)
            assert json.loads((tmp_path / "latest").read_text()) == {"step": latest}  # the raw marker too
            if latest == committed and tmp_dir.exists():
                interrupted_mid_write += 1  # orbax had started writing this step when it died
            committed = latest
            r = ck.restore(tmp_path, params=target["params"], opt_state=target["opt_state"])
            assert r.step == committed and r.data_state == {"step": committed}
            assert int(r.opt_state["count"]) == committed
            assert_bits_equal(jax.tree.map(np.asarray, r.params), _tree(committed))
    finally:
        for proc in children:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
    assert interrupted_mid_write >= 1, "no kill landed while orbax was writing; the test proved nothing"
    # after the crashes a normal save still works and cleans up the killed saves' temporaries
    ck.save(tmp_path, 100, params=_tree(100), opt_state={"count": np.int32(100)}, keep=2)
    assert ck.latest_step(tmp_path) == 100
    assert not [p for p in tmp_path.iterdir() if ".orbax-checkpoint-tmp" in p.name]


# ------------------------------------------------------------------------------------------------
# fault injection at the commit (RLJAX_FAULT)
# ------------------------------------------------------------------------------------------------

_FAULT_CHILD = """
import sys
import numpy as np
from rljax.training import checkpoint as ck
for step in (1, 2, 3):
    ck.save(sys.argv[1], step, params={"w": np.full(2, step, np.float32)}, opt_state={}, keep=1)
print("UNREACHED", flush=True)
"""


@pytest.mark.subprocess
def test_fault_points_kill_the_process_right_before_and_after_the_marker(tmp_path):
    points = {"kill_before_checkpoint_commit": 1, "kill_after_checkpoint_commit": 2}  # -> latest
    children = {
        point: subprocess.Popen(
            [sys.executable, "-c", _FAULT_CHILD, str(tmp_path / point)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(**{ck.FAULT_ENV: f"{point}:2"}),
        )
        for point in points
    }
    for point, latest in points.items():
        out, err = children[point].communicate(timeout=120)
        assert children[point].returncode == -signal.SIGKILL, err.decode()[-2000:]
        assert b"UNREACHED" not in out
        directory = tmp_path / point
        assert ck.latest_step(directory) == latest
        assert json.loads((directory / "latest").read_text()) == {"step": latest}
        # step_2 is sealed in both cases; keep=1 never deleted step_1: the kill came before that
        assert ck.checkpoint_steps(directory) == [1, 2] and ck.verify(directory, 2)
        assert ck.restore(directory).params["w"].tolist() == [latest, latest]


def test_a_malformed_fault_variable_fails_before_anything_is_written(tmp_path, monkeypatch):
    w = {"w": jnp.ones(2)}
    for bad in ("kill_after_commit:2", "kill_after_checkpoint_commit", "kill_after_checkpoint_commit:-1"):
        monkeypatch.setenv(ck.FAULT_ENV, bad)
        with pytest.raises(ValueError, match="RLJAX_FAULT=.*kill_before_checkpoint_commit, kill_after"):
            ck.save(tmp_path, 2, params=w, opt_state={})
    assert not tmp_path.exists() or ck.checkpoint_steps(tmp_path) == []
    monkeypatch.setenv(ck.FAULT_ENV, "kill_after_checkpoint_commit:3, kill_before_checkpoint_commit:4")
    ck.save(tmp_path, 2, params=w, opt_state={})  # other steps: an ordinary save
    assert ck.latest_step(tmp_path) == 2
