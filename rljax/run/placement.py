"""Which GPUs the trainer and each launched vLLM server use, and how much memory JAX takes.

``config.engine.server_devices`` gives each launched vLLM server its GPUs, ``trainer_devices`` the
trainer's (default: every GPU no server holds) and ``trainer_memory_fraction`` the share of a GPU's
memory JAX preallocates (see :class:`rljax.run.config.EngineSection`). Device numbers are indices
into the GPUs this process sees: ``CUDA_VISIBLE_DEVICES`` when it is set (SLURM and Kubernetes set it
to the GPUs of the job), else every GPU of the machine. So with ``CUDA_VISIBLE_DEVICES=4,5,6,7``,
``server_devices=("3",)`` starts the server with ``CUDA_VISIBLE_DEVICES=7`` and the trainer keeps
indices 0-2 (GPUs 4, 5 and 6).

A server gets its GPUs in its environment (:func:`server_device_env`, applied where the servers are
launched, :mod:`rljax.run.engines`). The trainer's GPUs and memory share must be set before JAX
starts its GPU backend: ``rljax train`` calls :func:`place_trainer` right after parsing the config;
a Python program calls it before its first JAX computation.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, MutableMapping, Sequence

from rljax.run.config import EngineSection, device_list

__all__ = [
    "JAX_DEFAULT_FRACTION",
    "MEM_FRACTION_ENV",
    "MEM_FRACTION_ENV_NEW",
    "NVIDIA_GPUS_DIR",
    "SHARED_GPU_BUDGET",
    "VLLM_DEFAULT_UTILIZATION",
    "check_shared_gpus",
    "place_trainer",
    "server_device_env",
    "trainer_placement",
    "visible_gpus",
]

#: The environment variable of the share of GPU memory JAX preallocates: read by every jaxlib rljax
#: supports (newer ones also read :data:`MEM_FRACTION_ENV_NEW` and take this as its deprecated alias).
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
#: Its newer name (jaxlib refuses both names set at once).
MEM_FRACTION_ENV_NEW = "XLA_CLIENT_MEM_FRACTION"
#: JAX's default share of each GPU's memory (newer JAX may also grow past it when no share is set).
JAX_DEFAULT_FRACTION = 0.75
#: vLLM's default ``--gpu-memory-utilization``.
VLLM_DEFAULT_UTILIZATION = 0.9
#: The most of a shared GPU's memory the trainer and its servers may claim together (the rest: each
#: process's CUDA context and vLLM's startup check, which wants its whole share free).
SHARED_GPU_BUDGET = 0.95
#: One directory per GPU of the machine, written by the NVIDIA driver (Linux).
NVIDIA_GPUS_DIR = pathlib.Path("/proc/driver/nvidia/gpus")


def visible_gpus(
    environ: Mapping[str, str] | None = None, gpus_dir: pathlib.Path = NVIDIA_GPUS_DIR
) -> list[str] | None:
    """The GPUs this process sees, as CUDA names them: the entries of ``CUDA_VISIBLE_DEVICES`` if it
    is set, else ``"0" .. "N-1"`` for the N GPUs of the driver's ``/proc`` listing; None when that is
    unknown (no variable, no NVIDIA driver).

    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"})
    ['4', '5']
    >>> visible_gpus({}, gpus_dir=pathlib.Path("/nonexistent"))
    """
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [v.strip() for v in value.split(",") if v.strip()]
    if gpus_dir.is_dir():
        return [str(i) for i in range(len(list(gpus_dir.iterdir())))]
    return None


def _names(indices: Sequence[int], visible: Sequence[str] | None, path: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` naming ``indices`` of the ``visible`` GPUs (the indices themselves when
    the visible GPUs are unknown)."""
    if visible is None:
        return ",".join(str(i) for i in indices)
    missing = [i for i in indices if i >= len(visible)]
    if missing:
        raise ValueError(
            f"{path}: GPU index {missing[0]} is not among the {len(visible)} GPU(s) this process sees "
            f"(CUDA_VISIBLE_DEVICES / the driver: {','.join(visible) or 'none'})"
        )
    return ",".join(visible[i] for i in indices)


def server_device_env(engine: EngineSection, visible: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The environment each launched vLLM server adds to its own: ``{"CUDA_VISIBLE_DEVICES": ...}``
    per server with ``engine.server_devices``, else ``{}`` (the server sees the trainer's GPUs).

    >>> e = EngineSection(kind="vllm", num_servers=2, server_devices=("1", "2,3"))
    >>> server_device_env(e, visible=["4", "5", "6", "7"])
    [{'CUDA_VISIBLE_DEVICES': '5'}, {'CUDA_VISIBLE_DEVICES': '6,7'}]
    """
    if not engine.server_devices:
        return [{} for _ in range(engine.num_servers)]
    visible = visible_gpus() if visible is None else visible
    out = []
    for i, entry in enumerate(engine.server_devices):
        path = f"config.engine.server_devices[{i}]"
        out.append({"CUDA_VISIBLE_DEVICES": _names(device_list(entry, path), visible, path)})
    return out


def trainer_placement(engine: EngineSection, visible: Sequence[str] | None = None) -> dict[str, str]:
    """What the trainer process sets for ``engine``: ``jax_cuda_visible_devices`` (a JAX option, GPU
    indices) and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (an environment variable), each only when asked.

    ``trainer_devices`` empty with ``server_devices`` set: the visible GPUs no server holds, an error
    when the visible GPUs are unknown or every one is a server's.

    >>> e = EngineSection(kind="vllm", num_servers=1, server_devices=("3",), trainer_memory_fraction=0.5)
    >>> dict(trainer_placement(e, visible=["0", "1", "2", "3"]))
    {'jax_cuda_visible_devices': '0,1,2', 'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.5'}
    """
    out: dict[str, str] = {}
    if engine.trainer_devices:
        indices = device_list(engine.trainer_devices, "config.engine.trainer_devices")
        if visible is not None:
            _names(indices, visible, "config.engine.trainer_devices")
        out["jax_cuda_visible_devices"] = ",".join(str(i) for i in indices)
    elif engine.server_devices:
        visible = visible_gpus() if visible is None else visible
        if visible is None:
            raise ValueError(
                "config.engine.trainer_devices: empty means every GPU no vLLM server holds, but this "
                "process cannot tell which GPUs it has (no CUDA_VISIBLE_DEVICES, no NVIDIA driver); "
                "give the trainer's GPUs, e.g. '0'"
            )
        held = {i for k, entry in enumerate(engine.server_devices)
                for i in device_list(entry, f"config.engine.server_devices[{k}]")}  # fmt: skip
        rest = [i for i in range(len(visible)) if i not in held]
        if not rest:
            raise ValueError(
                f"config.engine.server_devices gives all {len(visible)} visible GPU(s) to vLLM servers, "
                "leaving none for the trainer; set config.engine.trainer_devices to share one"
            )
        out["jax_cuda_visible_devices"] = ",".join(str(i) for i in rest)
    if engine.trainer_memory_fraction:
        out[MEM_FRACTION_ENV] = f"{engine.trainer_memory_fraction:g}"
    return out


def place_trainer(engine: EngineSection, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Applies :func:`trainer_placement` to this process: JAX's ``jax_cuda_visible_devices`` option and
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` in ``environ`` (default ``os.environ``). Call it before JAX
    starts its GPU backend (later it has no effect). A memory share already in the environment (under
    either name) that differs from the config's is an error (one of them is a mistake); an equal one
    is kept as it is."""
    environ = os.environ if environ is None else environ
    placement = trainer_placement(engine)
    fraction = placement.get(MEM_FRACTION_ENV)
    if fraction is not None:
        given = {k: environ[k] for k in (MEM_FRACTION_ENV, MEM_FRACTION_ENV_NEW) if k in environ}
        for name, value in given.items():
            if float(value) != float(fraction):
                raise ValueError(
                    f"config.engine.trainer_memory_fraction={fraction} contradicts {name}={value} in "
                    "the environment; drop one"
                )
        if not given:
            environ[MEM_FRACTION_ENV] = fraction
    if "jax_cuda_visible_devices" in placement:
        import jax

        jax.config.update("jax_cuda_visible_devices", placement["jax_cuda_visible_devices"])
    return placement


def check_shared_gpus(engine: EngineSection, visible: Sequence[str] | None) -> None:
    """Refuses a launch whose vLLM servers and trainer share a GPU whose memory they cannot both get.

    A server without ``server_devices`` sees the trainer's GPUs and runs on the first
    ``tensor_parallel_size`` of them. On a GPU the trainer also uses, JAX preallocates
    ``trainer_memory_fraction`` (0: JAX's 75%, which newer JAX may grow past) and vLLM refuses to
    start unless its ``gpu_memory_utilization`` (default 0.9) of the GPU is free, so the shares must
    fit in :data:`SHARED_GPU_BUDGET` together; this fails before the minutes of loading a model.
    Nothing is checked without launched servers or known GPUs (a CPU machine).

    >>> from rljax.inference.vllm import ServerConfig
    >>> server = ServerConfig(gpu_memory_utilization=0.4)
    >>> e = EngineSection(kind="vllm", server=server, trainer_memory_fraction=0.5)
    >>> check_shared_gpus(e, ["0"])
    >>> check_shared_gpus(EngineSection(kind="vllm"), ["0"])
    Traceback (most recent call last):
    ...
    ValueError: config.engine.trainer_memory_fraction: the trainer and 1 launched vLLM server(s) ...
    """
    if engine.kind != "vllm" or engine.urls or not visible:
        return
    tensor_parallel = engine.server.tensor_parallel_size
    utilization = engine.server.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
    if engine.server_devices:
        servers = [
            device_list(d, f"config.engine.server_devices[{i}]") for i, d in enumerate(engine.server_devices)
        ]
    else:
        servers = [tuple(range(tensor_parallel))] * engine.num_servers
    trainer = trainer_placement(engine, visible).get("jax_cuda_visible_devices")
    trainer_gpus = set(range(len(visible))) if trainer is None else set(device_list(trainer, "trainer"))
    for gpu in sorted(trainer_gpus):
        sharing = sum(gpu in devices for devices in servers)
        if not sharing:
            continue
        jax_share = engine.trainer_memory_fraction or JAX_DEFAULT_FRACTION
        total = jax_share + sharing * utilization
        if engine.trainer_memory_fraction and total <= SHARED_GPU_BUDGET:
            continue
        jax_said = (
            f"trainer_memory_fraction={engine.trainer_memory_fraction:g}"
            if engine.trainer_memory_fraction
            else "JAX's default (75% or more; trainer_memory_fraction=0)"
        )
        raise ValueError(
            f"config.engine.trainer_memory_fraction: the trainer and {sharing} launched vLLM server(s) share "
            f"GPU {visible[gpu]}, which cannot hold {jax_said} plus gpu_memory_utilization={utilization:g} "
            f"per server (at most {SHARED_GPU_BUDGET:g} together): set engine.trainer_memory_fraction and "
            "engine.server.gpu_memory_utilization (e.g. 0.5 and 0.4), or give the servers their own GPUs "
            "with engine.server_devices"
        )
