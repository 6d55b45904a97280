"""GPU placement of launched vLLM servers and of the trainer (rljax.run.placement): each server's
``CUDA_VISIBLE_DEVICES`` as its process really gets it, the trainer's JAX GPU indices (the rest) and
memory share. Checked on CPU: the server is a stand-in executable that records its environment."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import stat

import pytest

from rljax.inference.vllm import ServerGroup
from rljax.run.config import EngineSection, parse_run_config
from rljax.run.engines import launched_server_configs
from rljax.run.placement import (
    MEM_FRACTION_ENV,
    MEM_FRACTION_ENV_NEW,
    check_shared_gpus,
    place_trainer,
    server_device_env,
    trainer_placement,
    visible_gpus,
)


def _engine(**kw) -> EngineSection:
    raw = {"kind": "vllm", **kw}
    return parse_run_config({"engine": raw}).engine  # validated as a config is


def test_visible_gpus_come_from_cuda_visible_devices_or_the_driver(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}) == ["GPU-a1", "GPU-b2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # set but empty: no GPU
    for i in range(3):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert visible_gpus({}, gpus_dir=tmp_path) == ["0", "1", "2"]
    assert visible_gpus({}, gpus_dir=tmp_path / "absent") is None


def test_server_devices_index_the_visible_gpus():
    e = _engine(num_servers=2, server_devices=("3", (0, 1)))
    assert server_device_env(e, ["4", "5", "6", "7"]) == [
        {"CUDA_VISIBLE_DEVICES": "7"},
        {"CUDA_VISIBLE_DEVICES": "4,5"},
    ]
    assert server_device_env(e, None) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "0,1"}]
    with pytest.raises(ValueError, match=r"server_devices\[0\]: GPU index 3 is not among the 2 GPU"):
        server_device_env(e, ["0", "1"])
    assert server_device_env(_engine(num_servers=2), ["0"]) == [{}, {}]  # no placement: inherit


def test_the_trainer_gets_the_gpus_no_server_holds():
    e = _engine(num_servers=2, server_devices=("1", "3"), trainer_memory_fraction=0.4)
    assert trainer_placement(e, ["0", "1", "2", "3"]) == {
        "jax_cuda_visible_devices": "0,2",
        MEM_FRACTION_ENV: "0.4",
    }
    shared = _engine(server_devices=("0",), trainer_devices="0")  # one GPU, shared on purpose
    assert trainer_placement(shared, ["0"]) == {"jax_cuda_visible_devices": "0"}
    assert trainer_placement(_engine(), ["0", "1"]) == {}  # nothing asked: nothing set
    with pytest.raises(ValueError, match="leaving none for the trainer"):
        trainer_placement(_engine(server_devices=("0",)), ["0"])
    with pytest.raises(ValueError, match="cannot tell which GPUs it has"):
        trainer_placement(_engine(server_devices=("0",)), None)
    with pytest.raises(ValueError, match="trainer_devices: GPU index 2 is not among the 2"):
        trainer_placement(_engine(trainer_devices="2"), ["0", "1"])


def test_place_trainer_sets_the_memory_share_and_jax_devices(monkeypatch):
    import jax

    before = jax.config.read("jax_cuda_visible_devices")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env: dict[str, str] = {}
    try:
        placement = place_trainer(_engine(server_devices=("1",), trainer_memory_fraction=0.45), env)
        assert env == {MEM_FRACTION_ENV: "0.45"} and placement["jax_cuda_visible_devices"] == "0"
        assert jax.config.read("jax_cuda_visible_devices") == "0"
    finally:
        jax.config.update("jax_cuda_visible_devices", before)
    with pytest.raises(ValueError, match=r"trainer_memory_fraction=0.45 contradicts XLA_PYTHON_CLIENT_MEM"):
        place_trainer(_engine(trainer_memory_fraction=0.45), {MEM_FRACTION_ENV: "0.9"})
    with pytest.raises(ValueError, match=r"contradicts XLA_CLIENT_MEM_FRACTION=0.9"):
        place_trainer(_engine(trainer_memory_fraction=0.45), {MEM_FRACTION_ENV_NEW: "0.9"})
    for name in (MEM_FRACTION_ENV, MEM_FRACTION_ENV_NEW):  # the same value is kept, under its own name
        same = {name: ".45"}  # (jaxlib refuses both names at once)
        place_trainer(_engine(trainer_memory_fraction=0.45), same)
        assert same == {name: ".45"}


def _env_file(path: pathlib.Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_each_launched_server_process_gets_its_gpus(tmp_path, monkeypatch):
    """The servers the engine launches (launched_server_configs -> ServerGroup -> the process): a
    stand-in "python" records the environment it was started with, per process id."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nenv > "{tmp_path}/env_$$.txt"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the GPUs of the job
    server = {"env": {"RLJAX_MARK": "kept"}, "die_with_parent": False, "log_path": str(tmp_path / "log")}
    e = _engine(num_servers=2, server_devices=("2", "0,1"), server=server)
    group = ServerGroup(launched_server_configs(e, str(tmp_path), e.server), python=str(fake))
    try:
        for s in group.servers:
            s.spawn()
        envs = []
        for s in group.servers:
            assert s.process.wait(timeout=30) == 0
            envs.append(_env_file(tmp_path / f"env_{s.process.pid}.txt"))
    finally:
        group.stop()
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["6", "4,5"]
    assert all(env["RLJAX_MARK"] == "kept" for env in envs)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # the trainer's own is unchanged


def test_a_shared_gpu_must_hold_both_shares():
    """vLLM refuses to start unless its share is free; JAX takes 75% (or more) unless told: the sum of
    the shares on a GPU the trainer and launched servers share is checked before anything starts."""
    fits = _engine(server={"gpu_memory_utilization": 0.4}, trainer_memory_fraction=0.5)
    check_shared_gpus(fits, ["0"])  # 0.9 of one GPU: fits
    with pytest.raises(ValueError, match=r"share GPU 0, which cannot hold JAX's default"):
        check_shared_gpus(_engine(server={"gpu_memory_utilization": 0.4}), ["0"])  # 0.75 + 0.4
    with pytest.raises(ValueError, match=r"cannot hold trainer_memory_fraction=0.6 plus gpu_memory_util"):
        check_shared_gpus(_engine(server={"gpu_memory_utilization": 0.4}, trainer_memory_fraction=0.6), ["0"])
    two = _engine(num_servers=2, server_devices=("0", "0"), trainer_devices="0", trainer_memory_fraction=0.3,
                  server={"gpu_memory_utilization": 0.3})  # fmt: skip
    check_shared_gpus(two, ["0"])  # 0.3 + 2 x 0.3
    with pytest.raises(ValueError, match=r"the trainer and 2 launched vLLM server\(s\) share GPU 0"):
        check_shared_gpus(dataclasses.replace(two, trainer_memory_fraction=0.4), ["0"])
    own = _engine(server_devices=("1",))  # the server on its own GPU: JAX's default is fine
    check_shared_gpus(own, ["0", "1"])
    tp = _engine(server={"tensor_parallel_size": 2})  # unplaced: GPUs 0 and 1, the trainer's too
    with pytest.raises(ValueError, match="share GPU 4, "):  # named as CUDA_VISIBLE_DEVICES names it
        check_shared_gpus(tp, ["4", "5"])
    check_shared_gpus(_engine(), None)  # GPUs unknown (a CPU machine): nothing to check
    check_shared_gpus(_engine(urls=("http://h:8000",)), ["0"])  # servers elsewhere
    check_shared_gpus(parse_run_config({}).engine, ["0"])  # the embedded sampler
