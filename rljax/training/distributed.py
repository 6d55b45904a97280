"""Multi-process (multi-host) groundwork on JAX's distributed runtime.

A multi-host run starts one Python process per host (or several per host on CPU), each calling
:func:`initialize` before any JAX computation. Afterwards ``jax.devices()`` lists the devices of
ALL processes, ``jax.local_devices()`` this process's; a mesh built with
:func:`rljax.training.sharding.make_mesh` spans every process, each process feeds ITS rows of a
batch (:func:`rljax.training.sharding.shard_batch`) and XLA runs the collectives (gloo or MPI
between CPU processes, NCCL / ICI on accelerators).

Host-side coordination helpers (all are cheap no-ops in a single process):

* :func:`process_share`: this process's contiguous block of ``num_items`` whole work items
  (prompts, tasks, files);
* :func:`agree_max`: the maximum of an int over processes (e.g. rows to pack to, so every
  process contributes equally shaped local batches);
* :func:`reduce_metrics`: weighted means of host metrics, bit-identical on every process;
* :func:`barrier`: a named host barrier with a timeout; a dead or stuck peer fails it with a
  clear error instead of hanging;
* :func:`is_main_process`: process 0 owns the sinks (logs, metrics files, reports);
* :func:`allgather_objects`: every process's picklable host object (e.g. its rollout's Steps), in
  process order, on every process;
* :func:`host_local_copy`: the full value of (possibly cross-process sharded) arrays as host numpy
  arrays on every process (e.g. the weights an in-process sampler serves).

Failure model: the coordination service (run by process 0) expects a heartbeat from every
process; when one stops (``kill -9``, OOM, preemption), every survivor is told within about
``heartbeat_timeout_s`` and JAX terminates it (SIGABRT, exit status 134, logging "Terminating
process because the JAX distributed service detected fatal errors ... another task died").
A survivor waiting in :func:`barrier` gets a ``RuntimeError`` naming the barrier first.
JAX's preemption notifier catches SIGTERM in every process (to let a run checkpoint at a sync
point), so a launcher that stops workers must follow SIGTERM with SIGKILL after a grace period.

Example (one process; start two with ``num_processes=2, process_id=0 / 1`` and the same
``coordinator_address`` to run multi-process)::

    initialize(DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2,
                                 process_id=0, cpu_collectives="gloo"))

Reference: ``jax.distributed.initialize`` and ``jax.experimental.multihost_utils``; the
coordination service is XLA's (from TensorFlow's ``CoordinationService``).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import socket
import time
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = [
    "CPU_COLLECTIVES",
    "DistributedConfig",
    "agree_max",
    "allgather_objects",
    "barrier",
    "host_local_copy",
    "initialize",
    "is_main_process",
    "process_share",
    "reduce_metrics",
]

#: Accepted values of :attr:`DistributedConfig.cpu_collectives` ("" keeps JAX's default).
CPU_COLLECTIVES = ("", "gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (all ``None``: auto-detected by JAX).

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordination service (every process
        passes the same). ``None``: detected from the cluster environment (SLURM, Open MPI,
        Kubernetes / GKE, Cloud TPU) or ``JAX_COORDINATOR_ADDRESS``.
      num_processes: number of processes (``None``: detected). ``1`` means a single process:
        :func:`initialize` does nothing.
      process_id: this process's index in ``[0, num_processes)`` (``None``: detected).
      cpu_collectives: collectives between processes on the CPU backend: ``"gloo"`` (TCP, no
        extra install), ``"mpi"`` (needs an MPI library, ``MPITRAMPOLINE_LIB``) or ``""`` (JAX's
        default). Set before the CPU backend starts.
      initialization_timeout_s: seconds to wait for every process to connect.
      heartbeat_timeout_s: seconds without heartbeats after which a process counts as dead and
        the others are terminated (the upper bound on how long a survivor hangs).
      shutdown_timeout_s: seconds a process exiting normally waits at JAX's shutdown barrier for
        the others (a peer that is alive but stuck delays every exit by up to this much).

    >>> DistributedConfig(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1).process_id
    1
    >>> DistributedConfig(num_processes=2, process_id=2)
    Traceback (most recent call last):
    ...
    ValueError: process_id must be an int in [0, num_processes=2), got 2
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cpu_collectives: str = ""
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    shutdown_timeout_s: int = 300

    def __post_init__(self) -> None:
        address = self.coordinator_address
        if address is not None:
            host, sep, port = str(address).rpartition(":")
            if not (isinstance(address, str) and sep and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"coordinator_address must be 'host:port', got {address!r}")
        if self.num_processes is not None and not _positive_int(self.num_processes):
            raise ValueError(f"num_processes must be a positive int or None, got {self.num_processes!r}")
        if self.process_id is not None:
            bound = self.num_processes
            if not (
                _int(self.process_id) and self.process_id >= 0 and (bound is None or self.process_id < bound)
            ):
                raise ValueError(
                    f"process_id must be an int in [0, num_processes={bound}), got {self.process_id!r}"
                )
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise ValueError(
                f"cpu_collectives must be one of {CPU_COLLECTIVES}, got {self.cpu_collectives!r}"
            )
        for name in ("initialization_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int (seconds), got {getattr(self, name)!r}")


def _int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _positive_int(x: object) -> bool:
    return _int(x) and int(x) >= 1


def _client():
    """The coordination-service client of this process (``None`` before :func:`initialize`)."""
    from jax._src import distributed as jax_distributed  # no public accessor of the client

    return jax_distributed.global_state.client


def initialize(config: DistributedConfig) -> bool:
    """Joins the multi-process run described by ``config``; returns whether one is running.

    Sets ``jax_cpu_collectives_implementation`` (when ``config.cpu_collectives`` is set), then
    calls ``jax.distributed.initialize`` with the config's values; ``None`` values are detected
    by JAX from the cluster environment. Must run before any JAX computation (before the first
    ``jax.devices()`` / array), else ``RuntimeError``. ``num_processes == 1`` is a single process:
    nothing is initialized and ``False`` is returned.

    Idempotent: a second call with the same process id / count returns ``True``; one that
    contradicts the running setup raises ``RuntimeError``.

    Raises:
      RuntimeError: JAX already computed something, the coordinator could not be reached within
        ``initialization_timeout_s`` (probed over TCP by processes other than 0), or the run was
        initialized differently. Failures inside JAX's runtime after that (e.g. a process that
        never registers) abort the process with JAX's own ``DEADLINE_EXCEEDED`` message.

    >>> initialize(DistributedConfig(num_processes=1))
    False
    >>> jax.process_count()
    1
    """
    if not isinstance(config, DistributedConfig):
        raise ValueError(f"config must be a DistributedConfig, got {type(config).__name__}")
    if jax.distributed.is_initialized():
        state = _state()
        for name, want, got in (
            ("num_processes", config.num_processes, state.num_processes),
            ("process_id", config.process_id, state.process_id),
            ("coordinator_address", config.coordinator_address, state.coordinator_address),
        ):
            if want is not None and want != got:
                raise RuntimeError(
                    f"jax.distributed is already initialized with {name}={got!r}; cannot re-initialize "
                    f"with {name}={want!r} (the runtime cannot be restarted within one process)"
                )
        return True
    if config.num_processes == 1:
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "initialize() must run before any JAX computation, but the JAX backends already started "
            "(something called jax.devices() or created an array); call it first thing in the process"
        )
    if config.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    where = (
        f"process {config.process_id if config.process_id is not None else '?'} of "
        f"{config.num_processes or '?'}, coordinator {config.coordinator_address or '(auto-detected)'}"
    )
    hint = (
        "Check that every process was started with the same coordinator_address and num_processes, "
        "distinct process ids, that process 0 can bind the port and the others reach it within "
        f"initialization_timeout_s={config.initialization_timeout_s}s"
    )
    if config.coordinator_address is not None and config.process_id not in (None, 0):
        # JAX aborts the process (C++ fatal error) when the coordinator cannot be reached:
        # probe it first so that the common failure is a Python exception with context.
        if not _reachable(config.coordinator_address, config.initialization_timeout_s):
            raise RuntimeError(
                f"jax.distributed.initialize failed ({where}): could not reach the coordinator "
                f"{config.coordinator_address} (TCP) within {config.initialization_timeout_s}s. {hint}"
            )
    try:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
            initialization_timeout=config.initialization_timeout_s,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s,
            shutdown_timeout_seconds=config.shutdown_timeout_s,
        )
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise RuntimeError(f"jax.distributed.initialize failed ({where}): {e}. {hint}") from e
    return True


def _reachable(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds within ``timeout_s`` (retrying)."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)


def _state():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state


def is_main_process() -> bool:
    """True on process 0 (the one that writes logs, metric files, reports and the checkpoint marker).

    >>> is_main_process()
    True
    """
    return jax.process_index() == 0


def process_share(
    num_items: int, *, process_index: int | None = None, process_count: int | None = None
) -> range:
    """This process's contiguous block of ``num_items`` whole items (block sizes differ by <= 1).

    The first ``num_items % process_count`` processes get one item more; the blocks of processes
    ``0, 1, ...`` concatenate to ``range(num_items)``. Defaults: this process in this run.

    >>> [list(process_share(10, process_index=i, process_count=3)) for i in range(3)]
    [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    >>> process_share(5)
    range(0, 5)
    """
    count = jax.process_count() if process_count is None else process_count
    index = jax.process_index() if process_index is None else process_index
    if not (_int(num_items) and num_items >= 0):
        raise ValueError(f"num_items must be an int >= 0, got {num_items!r}")
    if not _positive_int(count):
        raise ValueError(f"process_count must be a positive int, got {count!r}")
    if not (_int(index) and 0 <= index < count):
        raise ValueError(f"process_index must be an int in [0, {count}), got {index!r}")
    base, extra = divmod(int(num_items), int(count))
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def agree_max(value: int) -> int:
    """The maximum of ``value`` over all processes (every process calls it; all get the same int).

    Use it for shapes every process must share, e.g. the row count local batches are padded to.
    Values must fit in int32.

    >>> agree_max(7)
    7
    """
    if not _int(value):
        raise ValueError(f"agree_max takes an int, got {value!r}")
    if not -(2**31) <= int(value) < 2**31:
        raise ValueError(f"agree_max supports int32 values, got {value}")
    if jax.process_count() == 1:
        return int(value)
    gathered = multihost_utils.process_allgather(np.asarray(int(value), np.int32))
    return int(np.max(gathered))


def reduce_metrics(metrics: Mapping[str, float], weights: float) -> dict[str, float]:
    """Weighted means over processes: ``sum_p w_p * m_p[k] / sum_p w_p`` for every key ``k``.

    Every process calls it with the same keys and its own ``weights`` (e.g. its number of rows,
    samples or tokens; ``>= 0``); all get bit-identical results (float64 values are exchanged
    exactly and reduced in process order). Processes of weight 0 do not count (their values may
    be NaN); a zero total weight gives NaN. Raises ``ValueError`` when processes disagree on
    the keys.

    >>> reduce_metrics({"reward/mean": 0.5, "loss": 2.0}, weights=3.0)
    {'loss': 2.0, 'reward/mean': 0.5}
    """
    weight = float(weights)
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"weights must be a finite float >= 0, got {weights!r}")
    keys = sorted(metrics)
    values = np.array([weight, *(float(metrics[k]) for k in keys)], np.float64)
    if jax.process_count() == 1:
        gathered = values[None]
    else:
        key_hash = np.uint32(zlib.crc32("\0".join(keys).encode()))
        words = np.concatenate([[key_hash, np.uint32(len(keys))], values.view(np.uint32)])
        all_words = multihost_utils.process_allgather(words)  # [P, 2 + 2 * (K + 1)] uint32: exact
        hashes = all_words[:, 0]
        if np.any(hashes != key_hash) or np.any(all_words[:, 1] != len(keys)):
            raise ValueError(
                f"reduce_metrics: processes pass different metric keys (this process, "
                f"{jax.process_index()}: {keys}); every process must report the same keys"
            )
        gathered = np.ascontiguousarray(all_words[:, 2:]).view(np.float64)
    counted = gathered[gathered[:, 0] > 0]  # rows of the processes with weight
    total = float(np.sum(counted[:, 0]))
    if total == 0:
        return {key: float("nan") for key in keys}
    sums = np.sum(counted[:, :1] * counted[:, 1:], axis=0)
    return {key: float(sums[i] / total) for i, key in enumerate(keys)}


def barrier(name: str, timeout_s: float = 300.0) -> None:
    """Blocks until every process reached ``barrier(name)``; a host barrier of the coordination service.

    Raises ``RuntimeError`` naming the barrier when not all processes arrive within
    ``timeout_s`` seconds or when a peer died (reported after its heartbeat timeout), instead of
    hanging. Barriers are matched by name and order, so every process must pass the same names
    in the same order. A no-op in a single process.

    >>> barrier("after_setup", timeout_s=10)
    """
    if not (isinstance(name, str) and name):
        raise ValueError(f"barrier name must be a non-empty str, got {name!r}")
    if not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if jax.process_count() == 1:
        return
    client = _client()
    if client is None:  # multi-process without jax.distributed (e.g. a custom runtime): device barrier
        multihost_utils.sync_global_devices(name)
        return
    try:
        client.wait_at_barrier(name, int(math.ceil(timeout_s * 1000)))
    except Exception as e:  # noqa: BLE001 - re-raised with context
        text = str(e)
        if "heartbeat" in text.lower() or "unhealthy" in text.lower() or "ERROR" in text:
            why = "a peer process died or failed (it stopped sending heartbeats)"
        elif "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
            why = f"not every process arrived within {timeout_s:g}s (a peer is stuck, slower, or dead)"
        else:
            why = "the coordination service reported an error"
        raise RuntimeError(
            f"barrier {name!r} failed on process {jax.process_index()} of {jax.process_count()}: {why}. "
            f"Check the other processes' logs. Cause: {text}"
        ) from e


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` in process order, on every process (every process calls it).

    ``obj`` is pickled, exchanged as bytes with ``multihost_utils.process_allgather`` (XLA's
    collectives; nothing hand-made) and unpickled: one all-gather of the lengths, one of the
    bytes padded to the longest. Use it for host data (a rollout's Steps, records), not for arrays
    that already live on devices. Call it from the thread that runs the jitted steps: collectives
    of every process must be issued in the same order.

    >>> allgather_objects({"steps": 3})
    [{'steps': 3}]
    """
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray(data.size, np.int64))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [pickle.loads(gathered[p, : int(n)].tobytes()) for p, n in enumerate(lengths)]


def host_local_copy(tree: Any) -> Any:
    """``tree`` with every array replaced by its full value as a host numpy array, on every process.

    Arrays sharded across processes are all-gathered (every process calls it, in the same order);
    arrays this process holds whole are just copied to the host. Memory: the whole tree per host.

    >>> host_local_copy({"w": jax.numpy.ones((2,))})["w"]
    array([1., 1.], dtype=float32)
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    gathered = multihost_utils.process_allgather([leaves[i] for i in arrays], tiled=True) if arrays else []
    out = list(jax.device_get([None if i in arrays else x for i, x in enumerate(leaves)]))
    for i, value in zip(arrays, gathered, strict=True):
        out[i] = np.asarray(value)
    return jax.tree.unflatten(treedef, out)
