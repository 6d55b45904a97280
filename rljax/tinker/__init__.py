"""A Tinker-compatible training API on rljax: the official ``tinker`` SDK (and loops written
against it) trains and samples models served by rljax.

* :mod:`~rljax.tinker.server` -- the FastAPI app (``/api/v1/...``); ``rljax serve``
  runs it.
* :mod:`~rljax.tinker.service` -- sessions, training clients, futures, the request queue and
  its worker, checkpoints.
* :mod:`~rljax.tinker.trainable` -- one client's model (LoRA adapter or full weights), its
  jitted forward / backward and Adam step.
* :mod:`~rljax.tinker.losses` -- the SDK's loss functions (per token, summed).
* :mod:`~rljax.tinker.packing` -- datums -> packed fixed-shape batches.
* :mod:`~rljax.tinker.sampling` -- sampling sessions on the embedded sampler or the config's vLLM
  servers.
* :mod:`~rljax.tinker.wire` -- the protobuf bodies.

:func:`serve_in_thread` starts a server inside this process (tests, notebooks, benchmarks).
"""

from __future__ import annotations

import pathlib
import socket
import threading
import time
from typing import Any

from rljax.extras import require

require("tinker", "the Tinker API (rljax.tinker, rljax serve)")  # one line naming the extra

__all__ = ["TinkerServer", "build_service", "serve_in_thread"]


def build_service(config: Any, workdir: str | pathlib.Path, **options: Any) -> Any:
    """A :class:`~rljax.tinker.service.TinkerService` on the model of run config ``config``
    (built by :class:`rljax.run.run.Run` without its rollout parts and without an optimizer state:
    each training client has its own); ``options`` are
    :class:`~rljax.tinker.service.ServiceOptions` fields."""
    from rljax.run.run import Run
    from rljax.tinker.service import ServiceOptions, TinkerService

    run = Run(config, workdir, rollouts=False, optimizer=False)
    if "base_model" not in options:
        options["base_model"] = default_base_model_name(run.cfg)
    return TinkerService(run, workdir, ServiceOptions(**options))


def default_base_model_name(cfg: Any) -> str:
    """The base model's name: the HF checkpoint directory's name, else ``rljax/tiny``."""
    path = cfg.model.hf_path
    return pathlib.Path(path).name if path else "rljax/tiny"


class TinkerServer:
    """A running server (uvicorn in a daemon thread): ``base_url``, ``service``, :meth:`stop`;
    ``limits``: the :class:`~rljax.gateway.limits.HttpLimits` of its front door (default
    :data:`rljax.tinker.server.DEFAULT_LIMITS`)."""

    def __init__(self, service: Any, host: str, port: int, limits: Any = None) -> None:
        import uvicorn

        from rljax.gateway.limits import uvicorn_options
        from rljax.tinker.server import DEFAULT_LIMITS, make_app

        self.service = service
        self.base_url = f"http://{host}:{port}"
        limits = DEFAULT_LIMITS if limits is None else limits
        config = uvicorn.Config(
            make_app(service, limits=limits),
            host=host,
            port=port,
            log_level="warning",
            **uvicorn_options(limits),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="tinker-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the Tinker server did not start on {self.base_url}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stops the HTTP server and closes the service."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.service.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_in_thread(
    config: Any,
    workdir: str | pathlib.Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: Any = None,
    **options: Any,
) -> TinkerServer:
    """Builds the service for ``config`` and serves it on ``host:port`` (0: a free port) with the
    front door's ``limits`` (:class:`~rljax.gateway.limits.HttpLimits`)."""
    return TinkerServer(build_service(config, workdir, **options), host, port or free_port(), limits)
