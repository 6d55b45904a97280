"""Supervised vLLM servers: health checks, restarts with the current weights, syncs that skip the dead.

A :class:`ServerSupervisor` watches every server of a :class:`~rljax.inference.vllm.VLLMClient`
from the client's own event loop:

- every ``health_interval_s`` it checks each server in service: a launched server whose process
  exited is down at once; any server whose ``GET /health`` does not answer 200 within
  ``health_timeout_s`` on ``health_failures`` checks in a row is down (a failed request triggers a
  check at once, so a crash is seen as soon as a request meets it);
- a server that goes down is taken out of service (:meth:`VLLMClient.mark_down`): the requests and
  admin posts it holds fail at once and are retried on the servers left; new ones avoid it;
- a server rljax launched is restarted (SIGKILL of its process group, which also ends a stopped
  one, then the same command on the same port) and a server given by URL is re-checked on an
  exponential backoff; once healthy it is **restored**: the run's current weights
  (:class:`CurrentWeights`, recorded by every sync: a plain reload or an in-flight switch,
  :meth:`ServerSupervisor.sync_live`) are reloaded in place and verified with the sync's probe,
  the server is labelled with their version (:meth:`VLLMClient.relabel`: the servers of an
  :class:`~rljax.inference.vllm.pause.InFlightVLLMClient` tag every token with their label, and a
  restarted vLLM starts unlabelled), and only then is it back in service. A probe mismatch
  reloads once more, then the client stops every request with a
  :class:`~rljax.inference.vllm.WeightSyncError` carrying the mismatch figures (as a failed sync
  does);
- weight syncs (:meth:`ServerSupervisor.sync_model`, :meth:`ServerSupervisor.sync_written`, the
  in-flight switches through :meth:`ServerSupervisor.sync_live`) go to the servers in service
  only, and a server lost during a sync is dropped from it (the sync is redone on the others): it
  gets the current weights when it comes back. With no server in
  service, a sync only writes the weights.

When no server is in service for the client's ``all_down_timeout_s``, requests fail with one
:class:`~rljax.inference.vllm.AllServersDownError` naming every server, why it is out and the end of
its log (:meth:`ServerSupervisor.describe`).

>>> SupervisorConfig(health_interval_s=1.0).health_failures
2
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from rljax import knobs
from rljax.inference.vllm import weight_sync
from rljax.inference.vllm.client import ServerFaultError, VLLMClient
from rljax.inference.vllm.launcher import VLLMServer, log_tail
from rljax.knobs import knob

logger = logging.getLogger(__name__)


@knobs.section
class SupervisorConfig:
    """How servers are watched and brought back (the run config's ``engine.supervisor``)."""

    health_interval_s: float = knob(5.0, gt=0, doc="seconds between health checks of a server in service")
    health_timeout_s: float = knob(
        10.0, gt=0, doc="a ``GET /health`` not answered 200 within this fails the check"
    )
    health_failures: int = knob(
        2,
        ge=1,
        doc="failed checks in a row that take a server out of service (a launched server whose process "
        "exited is out at once)",
    )
    max_restarts: int = knob(
        5, ge=0, doc="restarts of one launched server over the run; past it the server stays out"
    )
    backoff_s: float = knob(
        2.0,
        gt=0,
        doc="first wait before re-checking a server given by URL (or retrying a failed restart); doubles "
        "up to ``backoff_max_s``",
    )
    backoff_max_s: float = knob(60.0, gt=0, doc="longest such wait")


@dataclasses.dataclass(frozen=True)
class ServedAdapter:
    """The LoRA adapter of the last adapter sync, which every server must have loaded: its served
    ``name``, its PEFT directory ``path``, and its decode probe as a verified server ran it
    (``probe_ids``: prompt then greedy continuation; ``expected``: the trainer's logprobs of the
    continuation; None: the sync did not verify), checked within ``atol``."""

    name: str
    path: str
    probe_ids: tuple[int, ...] | None = None
    expected: np.ndarray | None = None
    atol: float = weight_sync.SYNC_ATOL["float32"]


@dataclasses.dataclass(frozen=True)
class CurrentWeights:
    """The weights every server must serve: where they are written (None: the weights a server
    starts with), the probe that verifies them (None: unverified), and their weight ``version``: a
    server restored to them is labelled with it (:meth:`VLLMClient.relabel`: the servers of an
    in-flight client tag every token with their label; None leaves the label as it is). ``adapter``:
    the LoRA adapter loaded on top (adapter syncs), reloaded and verified after the base weights."""

    directory: str | None
    probe: np.ndarray | None = None
    expected: np.ndarray | None = None
    atol: float = weight_sync.SYNC_ATOL["float32"]
    version: int | None = None
    adapter: ServedAdapter | None = None


@dataclasses.dataclass
class SupervisorEvent:
    """One thing the supervisor saw or did (``kind``: "down", "restart", "restart_failed", "up",
    "mismatch"), at ``time.monotonic()`` ``at``."""

    at: float
    server: int
    kind: str
    detail: str = ""


class LiveServers:
    """The servers of a client that are in service, as a weight-sync target (``urls``,
    ``post_all``, ``post_each``, ``score`` over them only). Every post to a server fails at once
    with :class:`ServerFaultError` when the server is taken out of service meanwhile."""

    def __init__(self, client: VLLMClient, indices: Sequence[int]) -> None:
        self.client = client
        self.indices = list(indices)

    @property
    def urls(self) -> list[str]:
        """Base URLs of the servers in the view, in order."""
        return [self.client.servers[i].url for i in self.indices]

    def note_pause(self) -> None:
        """:meth:`VLLMClient.note_pause` of the view's servers."""
        self.client.note_pause(self.indices)

    async def _guarded(self, i: int, work: Awaitable[Any]) -> Any:
        lost = self.client.servers[i].lost
        task = asyncio.ensure_future(work)
        if lost is None:
            return await task
        watch = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
        if task.done() and not task.cancelled():
            return task.result()
        raise ServerFaultError(f"{self.client.servers[i].url}: taken out of service during a weight sync")

    async def post_all(self, path: str, body: dict[str, Any] | None = None) -> list[Any]:
        """POSTs to every server of the view at once; the first failure raises."""
        c = self.client
        return list(
            await asyncio.gather(
                *(self._guarded(i, c._post_json(c.servers[i].url, path, body)) for i in self.indices)
            )
        )

    async def post_each(
        self, path: str, body: dict[str, Any] | None = None, *, servers: Sequence[int] | None = None
    ) -> list[tuple[int, str] | BaseException]:
        """Like :meth:`VLLMClient.post_each` over the view (``servers``: positions in the view)."""
        c = self.client
        c._ensure_loop_state()
        chosen = self.indices if servers is None else [self.indices[j] for j in servers]

        async def one(i: int) -> tuple[int, str]:
            response = await self._guarded(i, c._http.post(c.servers[i].url + path, json=body))
            return response.status_code, response.text

        return list(await asyncio.gather(*(one(i) for i in chosen), return_exceptions=True))

    async def score(self, ids: Sequence[int], *, server: int | None = None, gated: bool = True) -> np.ndarray:
        """Scores ``ids`` with the BASE model (the weights a sync or restore verifies, whatever
        adapter requests name) on the view's server at position ``server``."""
        if server is None:
            raise ValueError("LiveServers.score needs a server (a position in the view)")
        c = self.client
        return await c.score(ids, server=self.indices[server], gated=gated, model=c.model)

    async def probe_completion(
        self, prompt_ids: Sequence[int], sampling: Any, *, model: str, server: int
    ) -> Any:
        """:meth:`VLLMClient.probe_completion` on the view's server at position ``server``."""
        return await self.client.probe_completion(
            prompt_ids, sampling, model=model, server=self.indices[server]
        )


class ServerSupervisor:
    """Watches a client's servers and brings lost ones back (see the module docstring).

    Args:
      client: the client whose servers are watched (the supervisor attaches itself to it).
      launched: per server, the :class:`VLLMServer` rljax launched for it, or None for a server
        given by URL (never restarted, only re-checked).
      config: the health checks and restarts.
    """

    def __init__(
        self,
        client: VLLMClient,
        launched: Sequence[VLLMServer | None],
        config: SupervisorConfig | None = None,
    ) -> None:
        if len(launched) != len(client.servers):
            raise ValueError(
                f"ServerSupervisor: {len(launched)} launched entries for {len(client.servers)} servers"
            )
        for server, state in zip(launched, client.servers, strict=True):
            if server is not None and server.url != state.url:
                raise ValueError(f"launched server {server.url} is not client server {state.url}")
        self.client = client
        self.launched = list(launched)
        self.config = config or SupervisorConfig()
        self.events: list[SupervisorEvent] = []
        self.restarts = [0] * len(launched)
        self.closing = False  # set from any thread before the servers are stopped: no more restarts
        self._fails = [0] * len(launched)
        self._last_error = [""] * len(launched)
        self._recovering: dict[int, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self._poke: asyncio.Event | None = None
        client.supervise(self)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the health loop on the running event loop (the client calls it)."""
        if self._task is None or self._task.done():
            self._poke = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._loop())
            for i, state in enumerate(self.client.servers):  # e.g. after the client was closed
                if state.down and i not in self._recovering and not self.closing:
                    self._recovering[i] = loop.create_task(self._recover(i))

    async def stop(self) -> None:
        """Stops the health loop and any recovery in progress (servers are left as they are)."""
        tasks = [t for t in (self._task, *self._recovering.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._recovering.clear()

    def poke(self, i: int) -> None:
        """Asks for a health check now (a request to server ``i`` just failed)."""
        if self._poke is not None:
            self._poke.set()

    def _event(self, i: int, kind: str, detail: str = "") -> None:
        self.events.append(SupervisorEvent(time.monotonic(), i, kind, detail))
        log = logger.warning if kind in ("down", "restart_failed", "mismatch") else logger.info
        log("vLLM server %s: %s %s", self.client.servers[i].url, kind, detail)

    # -- health ------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            idle = [i for i, s in enumerate(self.client.servers) if not s.down and i not in self._recovering]
            await asyncio.gather(*(self._check(i) for i in idle))
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
            # lands as the poke fires, and stop() then waits for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.health_interval_s):
                    await self._poke.wait()
            self._poke.clear()

    async def health(self, i: int) -> tuple[str | None, bool]:
        """``(None, False)`` when server ``i`` is healthy, else ``(reason, fatal)``; ``fatal``: its
        process exited (no need to ask again)."""
        server = self.launched[i]
        if server is not None:
            proc = server.process
            code = None if proc is None else proc.poll()
            if proc is None or code is not None:
                return f"process exited (code {code})", True
        url = self.client.servers[i].url
        try:
            response = await self.client._http.get(url + "/health", timeout=self.config.health_timeout_s)
        except Exception as e:  # any failure to answer is a failed check
            return f"GET /health failed: {type(e).__name__}: {e or 'no answer'}", False
        if response.status_code != 200:
            return f"GET /health answered HTTP {response.status_code}", False
        return None, False

    async def _check(self, i: int) -> None:
        reason, fatal = await self.health(i)
        if self.closing:  # the servers are being stopped on purpose
            return
        if reason is None:
            self._fails[i] = 0
            return
        self._fails[i] += 1
        self._last_error[i] = reason
        if fatal or self._fails[i] >= self.config.health_failures:
            self.take_out(i, reason)

    async def _settle(self, i: int) -> None:
        """Checks server ``i`` until its verdict is in: a check passes, or it is out of service
        (``health_failures`` failed checks in a row, or its process exited), one check every
        ``health_interval_s``. A request just failed on it, so one failed check is not an answer: a
        server killed mid-request closes its sockets before its process is seen to exit, and the
        first check then only finds the port closed."""
        while True:
            await self._check(i)
            if self.closing or self.client.servers[i].down or self._fails[i] == 0:
                return
            await asyncio.sleep(self.config.health_interval_s)

    def take_out(self, i: int, reason: str) -> None:
        """Takes server ``i`` out of service and starts bringing it back."""
        if self.client.servers[i].down and i in self._recovering:
            return
        self._event(i, "down", reason)
        self.client.mark_down(i, reason)
        self._fails[i] = 0
        if not self.closing:
            self._recovering[i] = asyncio.get_running_loop().create_task(self._recover(i))

    # -- recovery ----------------------------------------------------------------------------------
    def _backoff(self, attempt: int) -> float:
        return min(self.config.backoff_s * 2.0**attempt, self.config.backoff_max_s)

    async def _recover(self, i: int) -> None:
        try:
            attempt = 0
            while not self.closing:
                if self.launched[i] is not None:
                    if self.restarts[i] >= self.config.max_restarts:
                        self._last_error[i] += f"; gave up after {self.restarts[i]} restarts"
                        self.client.servers[i].down_reason = self._last_error[i]
                        return
                    back = await self._restart(i)
                else:
                    await asyncio.sleep(self._backoff(attempt))
                    reason, _ = await self.health(i)
                    back = reason is None
                    if not back:
                        self._last_error[i] = reason
                if back and not self.closing:
                    outcome = await self._restore(i)
                    if outcome != "retry":
                        return  # "up", or "mismatch": the client stops every request
                attempt += 1
                if self.launched[i] is not None:
                    await asyncio.sleep(self._backoff(attempt - 1))
        finally:
            self._recovering.pop(i, None)

    async def _restart(self, i: int) -> bool:
        """Kills server ``i``'s process group and starts it again; True once it answers /health."""
        server = self.launched[i]
        self.restarts[i] += 1
        self._event(i, "restart", f"restart {self.restarts[i]}")
        await asyncio.to_thread(server.kill)
        if self.closing:
            return False
        server.spawn()  # on this (long-lived) thread: die_with_parent ties the server to it
        deadline = time.monotonic() + server.config.startup_timeout_s
        while time.monotonic() < deadline and not self.closing:
            proc = server.process
            if proc is None or proc.poll() is not None:
                break
            reason, _ = await self.health(i)
            if reason is None:
                return True
            await asyncio.sleep(1.0)
        code = None if server.process is None else server.process.poll()
        tail = log_tail(server.log_path, max_lines=8)
        self._last_error[i] = f"restart failed (exit code {code}); log ends with:\n{tail}"
        self._event(i, "restart_failed", self._last_error[i])
        self.client.servers[i].down_reason = self._last_error[i]
        await asyncio.to_thread(server.kill)
        return False

    async def _restore(self, i: int) -> str:
        """Reloads the current weights on server ``i`` and verifies them: "up" when it is back in
        service, "retry" when that failed (it stays out), "mismatch" when the probe still differs
        after a second reload (the client then stops every request, ``_sync_error``)."""
        client = self.client
        client._ensure_loop_state()
        state = client.servers[i]
        async with client._sync_lock:
            state.lost = asyncio.Event()  # still out of service; a failure here aborts the restore
            current = client.current
            view = LiveServers(client, [i])
            try:
                diffs = await self._reload_verified(view, current)
                if current is not None and current.version is not None:
                    await self._relabel(view, current.version)
                if current is not None and current.adapter is not None:
                    diffs = await self._reload_adapter(view, current.adapter)
            except weight_sync.WeightSyncError as e:
                if e.diffs:
                    self._last_error[i] = f"probe mismatch after two reloads: max abs {e.diffs[0]:.3g}"
                    state.down_reason = self._last_error[i]
                    state.lost.set()
                    self._event(i, "mismatch", str(e))
                    client._sync_error = weight_sync.WeightSyncError(
                        f"server {state.url} came back but serves weights that differ from the trainer's "
                        f"after two reloads (probe max abs diff {e.diffs[0]:.3g} > {current.atol:g}): {e}",
                        diffs=e.diffs,
                    )
                    return "mismatch"
                self._last_error[i] = f"restoring the current weights failed: {e}"
                state.down_reason = self._last_error[i]
                state.lost.set()
                return "retry"
            client.mark_up(i)
        self._event(i, "up", f"probe max abs diff {diffs[0]:.3g}" if diffs else "unverified")
        return "up"

    async def _reload_verified(self, view: LiveServers, current: CurrentWeights | None) -> tuple[float, ...]:
        """Reloads ``current`` on the view and verifies it (a mismatch: one more reload first)."""
        if current is None:
            return ()
        config = dataclasses.replace(self.client.sync_config, on_mismatch="retry")
        try:
            if current.directory is not None:
                _, diffs, _ = await weight_sync.reload_and_verify(
                    view,
                    current.directory,
                    config=config if current.probe is not None else dataclasses.replace(config, verify=False),
                    probe=current.probe,
                    expected=current.expected,
                    atol=current.atol,
                )
                return diffs
            if current.probe is None:
                return ()
            return await weight_sync.verify_weights(view, current.probe, current.expected, atol=current.atol)
        except weight_sync.WeightSyncError:
            raise
        except Exception as e:
            raise weight_sync.WeightSyncError(f"{type(e).__name__}: {e}") from e

    async def _reload_adapter(self, view: LiveServers, adapter: ServedAdapter) -> tuple[float, ...]:
        """Loads ``adapter`` on the view and replays its decode probe (a mismatch: one more load)."""
        from rljax.inference.vllm import adapter_sync  # it imports this module

        for attempt in range(2):
            try:
                await adapter_sync.unload_adapter_on_servers(view, adapter.name, missing_ok=True)
                await adapter_sync.load_adapter_on_servers(view, adapter.name, adapter.path)
                if adapter.probe_ids is None or adapter.expected is None:
                    return ()
                return await adapter_sync.replay_probe(
                    view, adapter.name, adapter.probe_ids, adapter.expected, atol=adapter.atol
                )
            except weight_sync.WeightSyncError as e:
                if attempt or not e.diffs:
                    raise
                logger.warning("adapter %s on a restored server: %s; loading it once more", adapter.name, e)
            except Exception as e:
                raise weight_sync.WeightSyncError(
                    f"loading adapter {adapter.name!r}: {type(e).__name__}: {e}"
                ) from e
        raise AssertionError("unreachable")

    async def _relabel(self, view: LiveServers, version: int) -> None:
        try:
            await self.client.relabel(view, version)
        except weight_sync.WeightSyncError:
            raise
        except Exception as e:
            raise weight_sync.WeightSyncError(
                f"labelling the server as version {version} failed: {type(e).__name__}: {e}"
            ) from e

    # -- syncs that skip the servers out of service ------------------------------------------------
    async def _synced_live(
        self, first: Callable[[LiveServers], Awaitable[Any]], again: Callable[[LiveServers], Awaitable[Any]]
    ) -> Any:
        """Runs ``first`` on the servers in service; while it fails and a server of its view went
        out of service (checked at once, until each check's verdict is in), runs ``again`` on the
        servers left."""
        run = first
        while True:
            view = LiveServers(self.client, self.client.live)
            try:
                return await run(view)
            except Exception:
                still = [i for i in view.indices if not self.client.servers[i].down]
                await asyncio.gather(*(self._settle(i) for i in still))
                if not any(self.client.servers[i].down for i in view.indices):
                    raise
                run = again

    async def sync_model(
        self,
        model: Any,
        *,
        directory: str,
        reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
        version: int | None = None,
    ) -> weight_sync.SyncReport:
        """:func:`weight_sync.sync_weights` of ``model`` to the servers in service; records the
        written weights, their probe and ``version`` as :attr:`VLLMClient.current`."""
        config = self.client.sync_config
        reference = reference_logprobs or (lambda ids: weight_sync.trainer_logprobs(model, ids))
        seen: dict[str, np.ndarray] = {}

        def recorded(ids: np.ndarray) -> np.ndarray:
            seen["probe"], seen["expected"] = np.asarray(ids), np.asarray(reference(ids), np.float64)
            return seen["expected"]

        atol = config.tolerance(getattr(model, "param_dtype", np.float32))

        async def first(view: LiveServers) -> weight_sync.SyncReport:
            return await weight_sync.sync_weights(
                view, model, config=config, directory=directory, reference_logprobs=recorded
            )

        async def again(view: LiveServers) -> weight_sync.SyncReport:
            reload_s, diffs, verify_s = await weight_sync.reload_and_verify(
                view,
                directory,
                config=config,
                probe=seen.get("probe"),
                expected=seen.get("expected"),
                atol=atol,
            )
            return weight_sync.SyncReport(directory, 0.0, reload_s, verify_s, diffs)

        report = await self._synced_live(first, again)
        self.client.current = CurrentWeights(
            directory, seen.get("probe"), seen.get("expected"), atol, version
        )
        return report

    async def sync_written(
        self, written: weight_sync.WrittenWeights, *, version: int | None = None
    ) -> weight_sync.SyncReport:
        """Reloads weights already written (:func:`weight_sync.write_distributed`) on the servers in
        service and verifies them; records them and ``version`` as :attr:`VLLMClient.current`."""
        config = self.client.sync_config

        async def run(view: LiveServers) -> weight_sync.SyncReport:
            reload_s, diffs, verify_s = await weight_sync.reload_and_verify(
                view,
                written.directory,
                config=config,
                probe=written.probe,
                expected=written.expected,
                atol=config.tolerance(written.dtype),
            )
            return weight_sync.SyncReport(written.directory, written.write_s, reload_s, verify_s, diffs)

        return await self.sync_live(run, written, version=version)

    async def on_live(self, work: Callable[[LiveServers], Awaitable[Any]]) -> Any:
        """``work(view)`` on the servers in service, run again on the servers left when one of them
        is lost meanwhile (adapter syncs: :func:`.adapter_sync.sync_adapter`)."""
        return await self._synced_live(work, work)

    def record_adapter(
        self,
        name: str,
        path: str,
        probe_ids: tuple[int, ...] | None,
        expected: np.ndarray | None,
        atol: float,
    ) -> None:
        """Records the adapter of an adapter sync (:class:`ServedAdapter`) on top of the current
        weights: a server restored later loads it and replays its probe."""
        base = self.client.current or CurrentWeights(None)
        adapter = ServedAdapter(name, path, probe_ids, expected, atol)
        self.client.current = dataclasses.replace(base, adapter=adapter)

    async def sync_live(
        self,
        run: Callable[[LiveServers], Awaitable[weight_sync.SyncReport]],
        written: weight_sync.WrittenWeights,
        *,
        version: int | None,
    ) -> weight_sync.SyncReport:
        """Installs ``written`` with ``run`` (on a view of the servers in service; run again on the
        servers left when one is lost meanwhile), then records it and ``version`` as
        :attr:`VLLMClient.current`, so a server restored later gets exactly these weights and this
        label, whichever way ``run`` installed them (a reload, or an in-flight switch)."""
        report = await self._synced_live(run, run)
        atol = self.client.sync_config.tolerance(written.dtype)
        self.client.current = CurrentWeights(
            written.directory, written.probe, written.expected, atol, version
        )
        return report

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self, i: int) -> str:
        """What server ``i`` is and, for a launched one, the last lines of its log."""
        server = self.launched[i]
        if server is None:
            last = self._last_error[i] or "-"
            return f"given by URL (not launched; re-checked on a backoff); last error: {last}"
        tail = log_tail(server.log_path, max_lines=8) if server.log_path else ""
        return f"launched, {self.restarts[i]} restart(s); log {server.log_path} ends with:\n{tail}"
