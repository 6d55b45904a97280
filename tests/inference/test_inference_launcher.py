"""The launcher runs the real server command line on a fake ``vllm`` module (fast, no torch).

The fake (tests/inference/inference_fakes.py) parses the same flags, serves /health, and can crash at
start, never become healthy, ignore SIGTERM or spawn a child process, so start-up errors, time-outs
and process-group shutdown are tested for real.
"""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from rljax.inference.vllm import ServerConfig, ServerGroup, ServerStartError, VLLMServer, find_vllm_python
from rljax.inference.vllm.launcher import (
    WORKER_EXTENSION_CLS,
    WORKER_EXTENSION_DIR,
    server_command,
    server_env,
)


def fake_config(fake_shim, tmp_path, **env):
    return ServerConfig(
        model=str(tmp_path / "ckpt"),
        env={"PYTHONPATH": fake_shim, **{f"FAKE_VLLM_{k}": str(v) for k, v in env.items()}},
        startup_timeout_s=30,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_command_line_and_environment(monkeypatch):
    cfg = ServerConfig(model="/m", port=8123, max_model_len=256, served_model_name="pol",
                       skip_tokenizer_init=True, extra_args=["--enforce-eager"], kv_cache_gib=2,
                       env={"EXTRA": "1"})  # fmt: skip
    cmd = server_command(cfg, python="/py")
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model"] == "/m" and flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["--dtype"] == "float32" and flags["--max-model-len"] == "256"
    assert flags["--served-model-name"] == "pol" and flags["--logprobs-mode"] == "processed_logprobs"
    assert cmd[-3:] == ["--no-enable-chunked-prefill", "--enforce-eager", "--skip-tokenizer-init"]
    assert "--no-enable-chunked-prefill" not in server_command(
        ServerConfig(model="/m", chunked_prefill=True), python="/py", port=1
    )
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env = server_env(cfg)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["EXTRA"] == "1"
    assert "XLA_FLAGS" not in env
    # vLLM parses VLLM_CPU_KVCACHE_SPACE as an int: a fraction is refused here, in one line, not by the
    # server's start-up (a pydantic error in its log); 2.0 (a config saved as a float) is 2
    with pytest.raises(
        ValueError, match=r"^ServerConfig.kv_cache_gib: expected a whole number of GiB, got 1.5$"
    ):
        ServerConfig(model="/m", kv_cache_gib=1.5)
    assert server_env(ServerConfig(model="/m", kv_cache_gib=2.0))["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_SERVER_DEV_MODE" not in server_env(ServerConfig(model="/m", dev_mode=False))
    # rljax's vLLM worker extension (the weight sync's rljax_reload_weights): flag + PYTHONPATH entry,
    # after a PYTHONPATH of config.env; a standalone file that imports neither rljax nor jax.
    assert flags["--worker-extension-cls"] == WORKER_EXTENSION_CLS == "rljax_vllm_ext.RljaxWorkerExtension"
    assert env["PYTHONPATH"] == WORKER_EXTENSION_DIR
    with open(os.path.join(WORKER_EXTENSION_DIR, "rljax_vllm_ext.py")) as f:
        source = f.read()
    assert "class RljaxWorkerExtension" in source and "def rljax_reload_weights" in source
    assert not any(w in source for w in ("import rljax", "from rljax", "import jax", "from jax"))
    mine = server_env(ServerConfig(model="/m", env={"PYTHONPATH": "/shim"}))["PYTHONPATH"]
    assert mine == os.pathsep.join(["/shim", WORKER_EXTENSION_DIR])
    plain = ServerConfig(model="/m", worker_extension=False, env={"PYTHONPATH": "/shim"})
    assert "--worker-extension-cls" not in server_command(plain, python="/py", port=1)
    assert server_env(plain)["PYTHONPATH"] == "/shim"
    with pytest.raises(ValueError, match="needs a port"):
        server_command(ServerConfig(model="/m"), python="/py")
    with pytest.raises(ValueError, match="port"):
        ServerConfig(model="/m", port=70000)
    # GPU knobs: flags only when set
    gpu = server_command(
        ServerConfig(model="/m", gpu_memory_utilization=0.85, tensor_parallel_size=2, max_num_seqs=128),
        python="/py",
        port=1,
    )
    gflags = dict(zip(gpu[3::2], gpu[4::2], strict=False))
    tail = dict(
        zip(
            gpu[gpu.index("--no-enable-chunked-prefill") + 1 :: 2],
            gpu[gpu.index("--no-enable-chunked-prefill") + 2 :: 2],
            strict=False,
        )
    )
    assert tail == {
        "--gpu-memory-utilization": "0.85",
        "--tensor-parallel-size": "2",
        "--max-num-seqs": "128",
    }
    assert "--gpu-memory-utilization" not in gflags and "--tensor-parallel-size" not in cmd
    for bad in (dict(gpu_memory_utilization=1.5), dict(tensor_parallel_size=0), dict(max_num_seqs=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(model="/m", **bad)


def test_find_vllm_python(monkeypatch, tmp_path):
    monkeypatch.setenv("RLJAX_VLLM_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"\$RLJAX_VLLM_PYTHON.*install_vllm.sh"):
        find_vllm_python()
    monkeypatch.setenv("RLJAX_VLLM_PYTHON", sys.executable)
    assert find_vllm_python() == sys.executable
    assert find_vllm_python(sys.executable) == sys.executable


def test_start_health_log_and_clean_stop(fake_shim, tmp_path):
    pidfile = tmp_path / "child.pid"
    cfg = fake_config(fake_shim, tmp_path, CHILD_PIDFILE=pidfile, START_DELAY=1.0)
    server = VLLMServer(cfg, python=sys.executable)
    with server:
        assert server.running and server.startup_s >= 1.0
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            assert r.status == 200
        pid, child = server.process.pid, int(pidfile.read_text())
        assert alive(child)
    assert not server.running and not alive(pid)
    # The child (like vLLM's engine core) is in the server's process group and is gone too.
    for _ in range(50):
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child)
    log = open(server.log_path).read()
    assert "vllm.entrypoints.openai.api_server" in log and "fake vllm ready" in log


def test_crash_at_start_reports_log_tail(fake_shim, tmp_path):
    server = VLLMServer(fake_config(fake_shim, tmp_path, CRASH=1), python=sys.executable)
    with pytest.raises(ServerStartError, match=r"exited with code 3 while starting(.|\n)*boom"):
        server.start()
    assert not server.running


def test_never_healthy_times_out_and_is_stopped(fake_shim, tmp_path):
    cfg = fake_config(fake_shim, tmp_path, MODE="unhealthy")
    server = VLLMServer(cfg, python=sys.executable)
    server.spawn()
    pid = server.process.pid
    with pytest.raises(ServerStartError, match="not healthy after"):
        server.wait_healthy(timeout_s=1.5, poll_s=0.2)
    assert not server.running and not alive(pid)


def test_stop_kills_a_server_that_ignores_sigterm(fake_shim, tmp_path):
    server = VLLMServer(fake_config(fake_shim, tmp_path, IGNORE_TERM=1), python=sys.executable).start()
    pid = server.process.pid
    t = time.monotonic()
    code = server.stop(grace_s=1.0)
    assert code == -signal.SIGKILL and 1.0 <= time.monotonic() - t < 10 and not alive(pid)


def test_group_starts_several_on_distinct_free_ports(fake_shim, tmp_path):
    cfgs = [fake_config(fake_shim, tmp_path / str(i)) for i in range(3)]
    with ServerGroup(cfgs, python=sys.executable) as group:
        assert len(group) == 3 and len(set(group.urls)) == 3
        assert all(u.startswith("http://127.0.0.1:") for u in group.urls)
        for url in group.urls:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                assert r.status == 200
        pids = [s.process.pid for s in group.servers]
    assert not any(alive(p) for p in pids)


def test_group_failure_stops_the_others(fake_shim, tmp_path):
    cfgs = [fake_config(fake_shim, tmp_path / "ok"), fake_config(fake_shim, tmp_path / "bad", CRASH=1)]
    group = ServerGroup(cfgs, python=sys.executable)
    with pytest.raises(ServerStartError, match="boom"):
        group.start()
    assert not any(s.running for s in group.servers)
    with pytest.raises(ValueError, match="ports clash"):
        ServerGroup([ServerConfig(model="/a", port=9000), ServerConfig(model="/b", port=9000)],
                    python=sys.executable)  # fmt: skip


def test_server_dies_with_its_parent(fake_shim, tmp_path):
    # A "trainer" process starts a server and is SIGKILLed: the server must not be left orphaned.
    script = (
        "import sys, time\n"
        "from rljax.inference.vllm import ServerConfig, VLLMServer\n"
        f"cfg = ServerConfig(model='m', env={{'PYTHONPATH': {fake_shim!r}}}, startup_timeout_s=30)\n"
        "s = VLLMServer(cfg, python=sys.executable).start()\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid)
        parent.kill()
        parent.wait()
        for _ in range(100):
            if not alive(pid):
                break
            time.sleep(0.1)
        assert not alive(pid)
    finally:
        parent.kill()
        parent.wait()


def test_missing_vllm_fails_under_ci_and_skips_locally(monkeypatch, tmp_path):
    from inference_helpers import require_vllm_python

    monkeypatch.setenv("RLJAX_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(pytest.fail.Exception, match="CI=true but .*does not exist"):
        require_vllm_python({"CI": "true"})
    with pytest.raises(pytest.skip.Exception, match="does not exist"):
        require_vllm_python({})
    monkeypatch.setenv("RLJAX_VLLM_PYTHON", sys.executable)
    assert require_vllm_python({"CI": "true"}) == sys.executable
