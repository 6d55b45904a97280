"""One process of a multi-process run, launched by ``test_train_multihost.py`` (not a test module).

Usage::

    python multihost_worker.py MODE --port P --num_processes N --process_id I --out DIR [...]

Modes:
  train    3 train steps on a (data=2, fsdp=2, tensor=2) mesh over all processes' devices, each
           process feeding its share of the rows of ``train_fixtures.make_batch(100 + i)``; writes
           the gathered params / opt state / metrics (``train.npz``, process 0) and a checkpoint
           saved by every process (``--ckpt``); also checks the host helpers.
  restore  restores ``--ckpt`` onto the same 2-process mesh and writes the gathered arrays
           (``restore.npz``, process 0).
  fault    joins, then process ``--victim`` sleeps (to be killed by the test) while the other waits
           in a barrier (``--wait barrier``) or a collective (``--wait collective``).
  connect  joins a run whose coordinator never comes up (expects a clear initialize error).
  context  2 train steps on a (data=2, context=2, tensor=2) mesh (context parallelism, each process
           feeding its rows whole; ``--collective ring`` passes keys/values in a ring instead of
           all-gathering them); writes the gathered params and metrics (``context.npz``).
  stream   the smoke recipe's trainer in ``trainer.mode="fully_async"`` for ``--steps`` steps
           (``--out/run``, checkpoints every 2 steps; ``--resume`` continues it); every process
           writes the batches its steps trained and its rows (``stream[_resumed]_p<i>.json``).

The environment must give each process its own devices (``XLA_FLAGS`` with
``--xla_force_host_platform_device_count``) and ``JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_fixtures
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repo (rljax)

from rljax.training import distributed  # noqa: E402  (must not start JAX's backends before initialize)

NUM_STEPS = 3


def log(*args) -> None:
    print(*args, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "restore", "fault", "connect", "context", "stream"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--ckpt", type=pathlib.Path)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--wait", choices=["barrier", "collective"], default="barrier")
    parser.add_argument("--heartbeat_timeout_s", type=int, default=100)
    parser.add_argument("--initialization_timeout_s", type=int, default=120)
    parser.add_argument("--shutdown_timeout_s", type=int, default=60)
    parser.add_argument("--collective", choices=["all_gather", "ring"], default="all_gather")
    parser.add_argument("--steps", type=int, default=3, help="stream: RL steps of the run")
    parser.add_argument("--resume", action="store_true", help="stream: resume the run in --out/run")
    args = parser.parse_args()

    config = distributed.DistributedConfig(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        cpu_collectives="gloo",
        initialization_timeout_s=args.initialization_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
    )
    if args.mode == "connect":
        try:
            distributed.initialize(config)
        except RuntimeError as e:
            log(f"INIT_ERROR {e}")
            return 3
        return 0
    assert distributed.initialize(config)
    assert distributed.initialize(config)  # idempotent
    import jax

    assert jax.process_count() == args.num_processes and jax.process_index() == args.process_id
    log(f"JOINED process {jax.process_index()}/{jax.process_count()} devices {jax.device_count()}")
    if args.mode == "fault":
        return fault(args)
    if args.mode == "train":
        return train(args)
    if args.mode == "context":
        return context(args)
    if args.mode == "stream":
        return stream(args)
    return restore(args)


def fault(args) -> int:
    import jax

    distributed.agree_max(1)  # one collective: gloo is connected
    if jax.process_index() == args.victim:
        log("READY")
        time.sleep(600)
        return 0
    log("WAITING")
    start = time.monotonic()
    try:
        if args.wait == "barrier":
            distributed.barrier("fault_test", timeout_s=45)
        else:
            distributed.agree_max(2)
    except Exception as e:  # noqa: BLE001 - the test reads this line
        log(f"SURVIVOR_ERROR after {time.monotonic() - start:.1f}s: {type(e).__name__}: {e}")
        return 3
    log("UNEXPECTED: the wait returned")
    return 0


def context(args) -> int:
    import jax
    import numpy as np

    from rljax.training.sharding import make_mesh, shard_batch
    from rljax.training.step import TrainState, mini_batch_counts, train_step

    tf, config, _, _, gather = _setup()
    mesh = make_mesh(data=2, context=2, tensor=2)
    state = TrainState.create(tf.make_model(0, context_attention=args.collective), config, mesh=mesh)
    history = []
    for i in range(CONTEXT_STEPS):
        batch = tf.make_batch(100 + i)
        rows = distributed.process_share(int(batch.tokens.shape[0]))
        local = jax.tree.map(lambda x, rows=rows: np.asarray(x)[rows.start : rows.stop], batch)
        sharded = shard_batch(local, mesh)
        state, metrics = train_step(state, sharded, mini_batch_counts(sharded, config.objective))
        history.append({k: float(v) for k, v in metrics.items()})
    params = gather(state.params)
    if distributed.is_main_process():
        keys = sorted(history[0])
        np.savez(
            args.out / "context.npz",
            **{f"p{i}": x for i, x in enumerate(params)},
            metric_keys=np.array(keys),
            metrics=np.array([[m[k] for k in keys] for m in history]),
        )
    distributed.barrier("done", timeout_s=60)
    log("DONE")
    return 0


CONTEXT_STEPS = 2
STREAM_K = 1


def stream(args) -> int:
    """The trainer in fully_async mode; records what every step took on this process: per sample its
    task id, repetition, response tokens and the largest staleness of its trained tokens."""
    import json

    import jax
    import numpy as np

    from rljax.recipes import smoke
    from rljax.run.trainer import Trainer

    c = smoke.get_config()
    c.warmstart.num_steps = 0
    c.envs.lookup.num_train_tasks = 32  # one epoch of each process's 16 holds all its draws
    c.mesh.update(data=4, fsdp=2)
    c.trainer.update(
        num_steps=args.steps,
        mode="fully_async",
        max_off_policy_steps=STREAM_K,
        prompts_per_step=4,
        eval_every=2,
        checkpoint_every=2,
    )
    trainer = Trainer(c, args.out / "run", resume=args.resume)
    sched = trainer.parts.scheduler
    taken = []
    take = sched.take

    def recording_take(step):
        result, metrics = take(step)
        samples = []
        for s in result.batch:
            mask = np.asarray(s.loss_mask, bool)
            stale = step - s.token_versions()[mask]
            tid = s.trajectory_id
            samples.append([tid.instance_id, tid.repetition_id, list(map(int, s.response_ids)),
                            int(stale.max()) if stale.size else 0])  # fmt: skip
        taken.append({"step": step, "samples": samples})
        return result, metrics

    sched.take = recording_take
    history = trainer.run()
    rows = [{k: v for k, v in r.items() if k.startswith(("async/", "policy_version/", "rollout/"))}
            for r in history]  # fmt: skip
    path = args.out / f"stream{'_resumed' if args.resume else ''}_p{jax.process_index()}.json"
    train = [t.id for t in trainer.parts.env_tasks.train]
    steps = [r["step"] for r in history]
    record = {"taken": taken, "rows": rows, "steps": steps, "train": train, "seed": c.seed}
    path.write_text(json.dumps(record))
    log("DONE")
    return 0


def _setup():
    import jax
    import train_fixtures as tf
    from jax.experimental import multihost_utils

    from rljax.training.sharding import make_mesh
    from rljax.training.step import TrainState

    config = tf.TRAIN_CONFIG
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert mesh.devices.size == 8 and not all(d.process_index == 0 for d in mesh.devices.flat)
    state = TrainState.create(tf.make_model(0), config, mesh=mesh)

    def gather(tree):
        return [np_leaf for np_leaf in multihost_utils.process_allgather(jax.tree.leaves(tree), tiled=True)]

    return tf, config, mesh, state, gather


def train(args) -> int:
    import jax
    import numpy as np

    from rljax.training import checkpoint
    from rljax.training.sharding import shard_batch
    from rljax.training.step import mini_batch_counts, train_step

    tf, config, mesh, state, gather = _setup()
    me, count = jax.process_index(), jax.process_count()
    helpers = {
        "agree_max": distributed.agree_max(5 + me),
        "reduce": distributed.reduce_metrics({"x": float(me), "y": 1.0 + me}, weights=1.0 + me)["x"],
        "share": list(distributed.process_share(8)),
        "main": distributed.is_main_process(),
    }
    distributed.barrier("after_helpers", timeout_s=60)
    log(f"HELPERS {helpers}")
    metrics_history = []
    for i in range(NUM_STEPS):
        batch = tf.make_batch(100 + i)
        rows = distributed.process_share(int(batch.tokens.shape[0]))
        local = jax.tree.map(lambda x, rows=rows: np.asarray(x)[rows.start : rows.stop], batch)
        sharded = shard_batch(local, mesh)
        assert not sharded.tokens.is_fully_addressable
        state, metrics = train_step(state, sharded, mini_batch_counts(sharded, config.objective))
        metrics_history.append({k: float(v) for k, v in metrics.items()})
    params, opt_state = gather(state.params), gather(state.opt_state)
    path = checkpoint.save(
        args.ckpt,
        NUM_STEPS,
        params=state.params,
        opt_state=state.opt_state,
        data_state={"pos": NUM_STEPS},
        rng=jax.random.key(7),
        config={"processes": count},
    )
    log(f"SAVED {path}")
    hf_files = write_hf(args, state)
    if distributed.is_main_process():
        keys = sorted(metrics_history[0])
        np.savez(
            args.out / "train.npz",
            **{f"p{i}": x for i, x in enumerate(params)},
            **{f"o{i}": x for i, x in enumerate(opt_state)},
            metric_keys=np.array(keys),
            metrics=np.array([[m[k] for k in keys] for m in metrics_history]),
            helper_agree_max=helpers["agree_max"],
            helper_reduce=helpers["reduce"],
        )
    log(f"SHARE {helpers['share']} MAIN {helpers['main']} WROTE {len(hf_files)}")
    distributed.barrier("done", timeout_s=60)
    log("DONE")
    return 0


def write_hf(args, state) -> list[str]:
    """The trained model written for vLLM servers by both processes (``hf/``, one whole parameter per
    host at a time) with its probe logprobs; process 0 also writes the reference (``hf_ref.npz``: the
    single-process HF state dict and logprobs of a host copy of the same weights)."""
    import jax.numpy as jnp
    import numpy as np

    from rljax import models
    from rljax.inference.vllm import SyncConfig, write_distributed
    from rljax.training.step import merge_model

    model = merge_model(state.graphdef, state.params, state.frozen)
    written = write_distributed(model, args.out / "hf", config=SyncConfig(probe_length=16))
    log(f"HF_FILES {sorted(written.files_written)}")
    local = merge_model(
        state.graphdef, distributed.host_local_copy(state.params), distributed.host_local_copy(state.frozen)
    )
    if distributed.is_main_process():
        reference = models.to_hf_state_dict(local)
        logprobs = np.asarray(models.sequence_logprobs(local, jnp.asarray(written.probe, jnp.int32)[None])[0])
        np.savez(
            args.out / "hf_ref.npz",
            **{f"t:{k}": v for k, v in reference.items()},
            expected=written.expected,
            local_logprobs=logprobs,
        )
    return list(written.files_written)


def restore(args) -> int:
    import jax
    import numpy as np

    from rljax.training import checkpoint

    _, _, _, state, gather = _setup()
    restored = checkpoint.restore(args.ckpt, params=state.params, opt_state=state.opt_state)
    leaf = jax.tree.leaves(restored.params)[0]
    assert leaf.sharding == jax.tree.leaves(state.params)[0].sharding and not leaf.is_fully_addressable
    params, opt_state = gather(restored.params), gather(restored.opt_state)
    if distributed.is_main_process():
        np.savez(
            args.out / "restore.npz",
            **{f"p{i}": x for i, x in enumerate(params)},
            **{f"o{i}": x for i, x in enumerate(opt_state)},
            step=restored.step,
            pos=restored.data_state["pos"],
        )
    distributed.barrier("done", timeout_s=60)
    log("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
