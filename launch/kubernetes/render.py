"""Renders ``launch/kubernetes/train.yaml`` (an Indexed Job + headless Service running ``rljax train``
on several pods) with every ``${...}`` filled, to stdout.

    python launch/kubernetes/render.py --name=rljax-qwen3 --image=registry/rljax:latest \\
        --model_path=/data/models/Qwen3-0.6B --nodes=2 --pvc=rljax-data | kubectl apply -f -

Derived values: the servers' GPUs (the last ``--vllm_gpus_per_node`` GPUs of each pod, as
``config.engine.server_devices``), the GPUs that train and the FSDP mesh over all pods. Only the
standard library and absl: it runs where ``kubectl`` does, without rljax installed.
"""

from __future__ import annotations

import pathlib
import string
import sys

from absl import app, flags

TEMPLATE = pathlib.Path(__file__).with_name("train.yaml")

_NAME = flags.DEFINE_string("name", "rljax", "Job, Service and pod name prefix (a DNS label).")
_IMAGE = flags.DEFINE_string("image", None, "Container image with rljax and a vLLM environment.")
_MODEL = flags.DEFINE_string("model_path", None, "HF checkpoint directory, as the pods see it.")
_CONFIG = flags.DEFINE_string("recipe", "qwen3_gpu", "rljax recipe name or config file (in the image).")
_NODES = flags.DEFINE_integer("nodes", 2, "Pods, one trainer process each.", lower_bound=1)
_GPUS = flags.DEFINE_integer("gpus_per_node", 8, "GPUs of each pod.", lower_bound=2)
_VLLM_GPUS = flags.DEFINE_integer(
    "vllm_gpus_per_node", 4, "GPUs of each pod that run vLLM servers (one each).", lower_bound=1
)
_PVC = flags.DEFINE_string("pvc", None, "PersistentVolumeClaim every pod mounts (models, runs).")
_MOUNT = flags.DEFINE_string("mount", "/data", "Where the volume is mounted.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory on the volume (default: <mount>/runs/<name>).")
_PORT = flags.DEFINE_integer("coordinator_port", 12355, "Port of jax.distributed's coordinator (pod 0).")
_VLLM_PYTHON = flags.DEFINE_string(
    "vllm_python", "/opt/vllm-venv/bin/python", "Python of the vLLM environment in the image."
)


def values() -> dict[str, str]:
    """The template's variables from the flags (derived ones included)."""
    train = _GPUS.value - _VLLM_GPUS.value
    if train < 1:
        raise app.UsageError(
            f"--gpus_per_node={_GPUS.value} must exceed --vllm_gpus_per_node={_VLLM_GPUS.value}"
        )
    for name, flag in (("image", _IMAGE), ("model_path", _MODEL), ("pvc", _PVC)):
        if not flag.value:
            raise app.UsageError(f"--{name} is required")
    servers = "".join(f"'{i}'," for i in range(train, _GPUS.value))
    return {
        "NAME": _NAME.value,
        "IMAGE": _IMAGE.value,
        "MODEL_PATH": _MODEL.value,
        "CONFIG": _CONFIG.value,
        "NODES": str(_NODES.value),
        "GPUS_PER_NODE": str(_GPUS.value),
        "VLLM_GPUS_PER_NODE": str(_VLLM_GPUS.value),
        "TRAIN_GPUS": str(train),
        "SERVER_DEVICES": f"({servers})",
        "MESH_FSDP": str(_NODES.value * train),
        "PVC": _PVC.value,
        "MOUNT": _MOUNT.value,
        "WORKDIR": _WORKDIR.value or f"{_MOUNT.value}/runs/{_NAME.value}",
        "COORDINATOR_PORT": str(_PORT.value),
        "VLLM_PYTHON": _VLLM_PYTHON.value,
    }


def render(variables: dict[str, str]) -> str:
    """The template with ``variables`` substituted (a variable it uses and ``variables`` lacks is an
    error; Kubernetes' own ``$(VAR)`` references are kept)."""
    text = TEMPLATE.read_text()
    missing = sorted(
        {m.group("braced") for m in string.Template.pattern.finditer(text) if m.group("braced")}
        - set(variables)
    )
    if missing:
        raise KeyError(f"{TEMPLATE.name} uses variables render.py does not set: {missing}")
    return string.Template(text).safe_substitute(variables)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    sys.stdout.write(render(values()))


if __name__ == "__main__":
    app.run(main)
