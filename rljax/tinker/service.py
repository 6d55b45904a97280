"""The Tinker service: sessions, training clients, sampling sessions, checkpoints and futures, on
one base model built by the run object (:class:`rljax.run.run.Run`, model parts only).

Protocol facts (tinker SDK 0.38.0) this implements:

* Every mutating call (``create_model``, ``forward_backward``, ``optim_step``, ``save_weights``,
  ``load_weights``, ``save_weights_for_sampler``, ``asample``) answers at once with a future
  ``{"request_id": ...}``; the SDK polls ``retrieve_future`` until it gets the result (JSON, or
  protobuf for ``ForwardBackwardOutput`` / ``SampleResponse``), ``{"type": "try_again"}`` while it
  is pending, or ``{"error": ..., "category": "user" | "server"}`` when it failed (the SDK raises
  ``RequestFailedError`` with that message).
* A training client sends its requests one at a time in its own order (``seq_id``), so one FIFO
  queue keeps each model's order. ONE worker thread runs the queue: it drains everything pending
  and runs consecutive forward / forward_backward requests of one model with the same loss as ONE
  packed, fixed-shape jitted step (:mod:`rljax.tinker.packing`: rows padded to a power of two
  >= ``min_rows``, so requests of varying sizes reuse a few compiled programs). The worker waits
  for no device result: a finisher thread waits for each job's outputs and resolves the futures in
  queue order, while the worker dispatches the next job (a client's optim_step queues on the device
  behind its forward_backward).
* Sessions send ``session_heartbeat`` every 10 s; a session silent for ``session_timeout_s`` is
  expired: its models, gradients, optimizer states and samplers are dropped.
* Checkpoint paths: ``tinker://<model_id>/weights/<name>`` (``save_state``: parameters + Adam state,
  rljax's checkpoint format with a SHA-256 manifest, verified on load) and
  ``tinker://<model_id>/sampler_weights/<name>`` (parameters only), under
  ``workdir/tinker/<model_id>/``; the model's LoRA settings are recorded beside them, so a
  restarted server loads them into new clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import pathlib
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from rljax.models.lora import LoRAConfig
from rljax.tinker.losses import LOSS_INPUTS, SEGMENT_LOSSES, check_config
from rljax.tinker.packing import Datum, PackedDatums, pack_datums
from rljax.tinker.sampling import SamplerPool, VLLMBackend
from rljax.tinker.trainable import (
    ADAM_DEFAULTS,
    TrainableModel,
    can_fuse,
    forward_fused_async,
    make_trainable,
)
from rljax.tinker.wire import FwdBwdRequest, encode_forward_backward_output
from rljax.training import checkpoint as ckpt

__all__ = ["ServiceOptions", "TinkerService", "UserError"]

log = logging.getLogger(__name__)


class UserError(ValueError):
    """A request the client got wrong (reported with category "user")."""


@dataclasses.dataclass(frozen=True)
class ServiceOptions:
    """Server settings: ``base_model`` the name clients ask for; ``max_lora_rank``; ``lora_alpha``
    (the adapters' scale is ``alpha / rank``); ``api_keys`` (empty: any key is accepted);
    ``session_timeout_s``; ``min_seq_len`` the shortest packed row; ``min_rows`` the fewest packed rows
    of a step (rows are a power of two >= it: every batch that fits ``min_rows`` rows of one length
    runs one compiled program, whatever its number or lengths of datums); ``fuse_clients``: run the
    queued forward / backward requests of several LoRA clients of one adapter structure as one step."""

    base_model: str = "rljax/tiny"
    max_lora_rank: int = 64
    lora_alpha: float = 32.0
    api_keys: tuple[str, ...] = ()
    session_timeout_s: float = 120.0
    min_seq_len: int = 32
    min_rows: int = 8
    fuse_clients: bool = True
    long_poll_s: float = 20.0


@dataclasses.dataclass
class _Session:
    session_id: str
    last_seen: float
    models: set[str] = dataclasses.field(default_factory=set)
    samplers: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Prepared:
    """Validated forward / backward requests of one model: their datums, loss options, float inputs."""

    model: TrainableModel
    reqs: list[FwdBwdRequest]
    per_req: list[list[Datum]]
    config: dict[str, float]
    floats: dict[str, float]


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """A job's result still being computed on the device: ``wait()`` waits for it and returns it."""

    wait: Callable[[], Any]


@dataclasses.dataclass
class _Job:
    kind: str
    model_id: str | None
    run: Callable[..., Any]
    future: concurrent.futures.Future
    fwd: FwdBwdRequest | None = None


class TinkerService:
    """The state behind the HTTP app (:mod:`rljax.tinker.server`); thread-safe entry points."""

    def __init__(
        self, run: Any, workdir: str | pathlib.Path, options: ServiceOptions = ServiceOptions()
    ) -> None:
        for key in ("min_rows", "min_seq_len"):
            if getattr(options, key) < 1:
                raise ValueError(f"ServiceOptions.{key} must be >= 1, got {getattr(options, key)}")
        self.run = run
        self.options = options
        self.root = pathlib.Path(workdir).absolute() / "tinker"
        self.root.mkdir(parents=True, exist_ok=True)
        self.base = run.current_model()
        self.vocab_size = int(self.base.config.vocab_size)
        self.max_context = int(self.base.config.max_position_embeddings)
        self.models: dict[str, TrainableModel] = {}
        self.sessions: dict[str, _Session] = {}
        self.engines, vllm = self._start_vllm(run, options)
        self.samplers = SamplerPool(self.base, seed=int(run.cfg.seed), vllm=vllm)
        self.futures: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self.steps_run = 0  # jitted fwd/bwd calls (a packed batch each)
        self.requests_run = 0  # forward_backward requests they served
        self.last_packed_rows = 0  # rows of the last packed batch
        self.fused_steps = 0  # steps that ran the requests of several clients (fuse_clients)
        self._closed = False
        # (futures, a function giving their results): run in order by the finisher thread
        self._done: queue.Queue[tuple[list[concurrent.futures.Future], Callable[[], list[Any]]] | None]
        self._done = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)
        self._worker.start()
        self._finisher = threading.Thread(target=self._finish, name="tinker-finisher", daemon=True)
        self._finisher.start()
        self._reaper = threading.Thread(target=self._reap, name="tinker-sessions", daemon=True)
        self._reaper.start()

    # -- sessions ------------------------------------------------------------------------------------------
    def create_session(self) -> str:
        """Opens a client session; returns its id."""
        sid = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[sid] = _Session(sid, time.monotonic())
        return sid

    def heartbeat(self, session_id: str) -> None:
        """Keeps session ``session_id`` alive; an unknown or expired one raises ``UserError``."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:
                raise UserError(f"unknown or expired session {session_id!r}")
            s.last_seen = time.monotonic()

    def _session(self, session_id: str) -> _Session:
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:
                raise UserError(f"unknown or expired session {session_id!r}; create a new ServiceClient")
            s.last_seen = time.monotonic()
            return s

    def _reap(self) -> None:
        while not self._closed:
            time.sleep(min(5.0, self.options.session_timeout_s / 4))
            self._reap_once()

    def _reap_once(self) -> None:
        """Expires every session silent for longer than ``session_timeout_s``."""
        now = time.monotonic()
        with self._lock:
            dead = [s for s in self.sessions.values() if now - s.last_seen > self.options.session_timeout_s]
            for s in dead:
                del self.sessions[s.session_id]
        for s in dead:
            log.info(
                "session %s expired (no heartbeat for %.0f s)", s.session_id, self.options.session_timeout_s
            )
            self.finish_session(s)

    def finish_session(self, session: _Session | str) -> None:
        """Drops a session's models (parameters, gradients, Adam state) and samplers."""
        if isinstance(session, str):
            with self._lock:
                session = self.sessions.pop(session, None)
            if session is None:
                return

        def drop() -> None:
            for mid in session.models:
                self.models.pop(mid, None)
            for sid in session.samplers:
                self.samplers.drop(sid)

        self._submit("drop", None, drop)

    # -- futures -------------------------------------------------------------------------------------------
    def _submit(
        self, kind: str, model_id: str | None, fn: Callable[[], Any], fwd: FwdBwdRequest | None = None
    ) -> str:
        rid = f"req-{next(self._ids)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self.futures[rid] = fut
        self._queue.put(_Job(kind, model_id, fn, fut, fwd))
        return rid

    def retrieve(self, request_id: str, timeout: float | None = None) -> tuple[str, Any]:
        """``("pending", None)``, ``("json", dict)``, ``("proto", bytes)`` or ``("error", dict)``."""
        with self._lock:
            fut = self.futures.get(request_id)
        if fut is None:
            return "error", {"error": f"unknown request_id {request_id!r}", "category": "user"}
        try:
            fut.result(timeout=self.options.long_poll_s if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            return "pending", None
        except Exception:  # noqa: BLE001 - reported by _outcome
            pass
        return _outcome(request_id, fut)

    async def retrieve_async(self, request_id: str, timeout: float | None = None) -> tuple[str, Any]:
        """:meth:`retrieve` for the event loop: a finished request answers at once, a pending one is
        awaited on the loop (no thread held for the long poll)."""
        with self._lock:
            fut = self.futures.get(request_id)
        if fut is None:
            return "error", {"error": f"unknown request_id {request_id!r}", "category": "user"}
        if not fut.done():
            # one loop future, woken by the request's end or the long poll's (no task, no Event: the
            # answer goes out on the loop's next turn after the worker finishes)
            loop = asyncio.get_running_loop()
            woken: asyncio.Future[None] = loop.create_future()

            def wake(_: concurrent.futures.Future) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed (server stopping)
                    loop.call_soon_threadsafe(_set_once, woken)

            fut.add_done_callback(wake)
            wait = self.options.long_poll_s if timeout is None else timeout
            timer = loop.call_later(wait, _set_once, woken)
            try:
                await woken
            finally:
                timer.cancel()
            if not fut.done():
                return "pending", None
        return _outcome(request_id, fut)

    # -- the worker ----------------------------------------------------------------------------------------
    def _work(self) -> None:
        """The worker: runs the queued jobs in order, but waits for none of the device's results
        (JAX dispatches asynchronously). A forward_backward's outputs and an optim_step's metrics are
        handed to the finisher thread, which waits for them and resolves the futures, in job order;
        the worker meanwhile dispatches the next job, so a client's optim_step, sent while its
        forward_backward runs, is queued on the device behind it instead of waiting for its outputs
        to be encoded. Every job's effects on the state (gradients, parameters, models) still happen
        in queue order, so the results are those of running the jobs one after the other."""
        try:
            self._work_loop()
        finally:
            self._done.put(None)

    def _finish(self) -> None:
        while True:
            item = self._done.get()
            if item is None:
                return
            futures, results = item
            try:
                values = results()
            except Exception as e:  # noqa: BLE001 - handed to the clients through their futures
                for f in futures:
                    f.set_exception(e)
                continue
            for f, v in zip(futures, values, strict=True):
                f.set_result(v)

    def _resolve(self, futures: list[concurrent.futures.Future], results: Callable[[], list[Any]]) -> None:
        """Resolves ``futures`` with ``results()`` (one value each) on the finisher thread."""
        self._done.put((futures, results))

    def _reject(self, futures: list[concurrent.futures.Future], error: Exception) -> None:
        def fail() -> list[Any]:
            raise error

        self._resolve(futures, fail)

    def _work_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
            for step in self._plan(jobs):
                if len(step) == 1:
                    self._run_group(step[0])
                else:
                    self._run_fused(step)

    def _plan(self, jobs: list[_Job]) -> list[list[list[_Job]]]:
        """The drained jobs as steps, in order: each step a list of groups, a group the consecutive
        forward / backward requests of one model with one loss (or one other job). With
        ``fuse_clients``, a later group of ANOTHER fusable client (same loss, config, forward-only
        flag; :func:`~rljax.tinker.trainable.can_fuse`) joins a step when none of that client's
        own jobs, and no job of no model but sampling, lies between: each client's requests keep their
        order, and only independent work is overtaken."""
        groups: list[list[_Job]] = []
        i = 0
        while i < len(jobs):
            group = [jobs[i]]
            if jobs[i].fwd is not None:
                while i + len(group) < len(jobs) and _same_step(jobs[i], jobs[i + len(group)]):
                    group.append(jobs[i + len(group)])
            i += len(group)
            groups.append(group)
        steps: list[list[list[_Job]]] = []
        taken = [False] * len(groups)
        for i, group in enumerate(groups):
            if taken[i]:
                continue
            step = [group]
            if self.options.fuse_clients and group[0].fwd is not None and self._fusable(group[0], None):
                members, passed = {group[0].model_id}, set()
                for j in range(i + 1, len(groups)):
                    job = groups[j][0]
                    if taken[j]:
                        continue
                    if job.model_id is None and job.kind != "sample":
                        break  # a barrier (a session's drop, ...): nothing moves across it
                    if job.model_id not in members | passed and self._fusable(group[0], job):
                        step.append(groups[j])
                        taken[j] = True
                        members.add(job.model_id)
                    elif job.model_id is not None:
                        passed.add(job.model_id)
            steps.append(step)
        return steps

    def _fusable(self, a: _Job, b: _Job | None) -> bool:
        """Whether ``a`` (and ``b``) are forward / backward requests of LoRA clients whose steps fuse."""
        ma = self.models.get(a.model_id or "")
        if ma is None or not ma.is_lora:
            return False
        if b is None:
            return True
        fa, fb, mb = a.fwd, b.fwd, self.models.get(b.model_id or "")
        return (
            fb is not None
            and mb is not None
            and (fa.loss_fn, fa.forward_only, fa.loss_fn_config)
            == (fb.loss_fn, fb.forward_only, fb.loss_fn_config)
            and can_fuse(ma, mb)
        )

    def _run_fused(self, step: list[list[_Job]]) -> None:
        """One step of several clients' groups; a group whose datums are invalid fails alone."""
        preps, groups = [], []
        for group in step:
            try:
                preps.append(self._prepare([j.fwd for j in group]))
                groups.append(group)
            except Exception as e:  # noqa: BLE001 - handed to that client through its futures
                self._reject([j.future for j in group], e)
        if not preps:
            return
        futures = [j.future for group in groups for j in group]
        try:
            wait = self._step(preps[0]) if len(preps) == 1 else self._forward_backward_fused(preps)
        except Exception as e:  # noqa: BLE001
            self._reject(futures, e)
            return
        self._resolve(futures, wait)

    def _run_group(self, group: list[_Job]) -> None:
        futures = [j.future for j in group]
        try:
            if group[0].fwd is None:
                result = group[0].run()
                wait = result.wait if isinstance(result, _Deferred) else lambda: result
                self._resolve(futures, lambda: [wait()])
            else:
                self._resolve(futures, self._forward_backward([j.fwd for j in group]))
        except Exception as e:  # noqa: BLE001 - handed to the client through its future
            self._reject(futures, e)

    def _start_vllm(self, run: Any, options: ServiceOptions) -> tuple[Any, VLLMBackend | None]:
        """With ``engine.kind="vllm"``: the run's policy engine (servers at ``engine.urls``, or
        launched on the base weights, taking runtime LoRA adapters up to ``max_lora_rank``) as the
        sampling sessions' backend; else (None, None): the embedded sampler serves them."""
        if run.cfg.engine.kind != "vllm":
            return None, None
        engines = run.build_engines(frozen_models=False)
        client = engines.start_policy(self.base, lora_rank=options.max_lora_rank)
        return engines, VLLMBackend(client, self.root / "vllm_adapters")

    def close(self) -> None:
        """Stops the worker threads and the engines the service launched."""
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=30)
        self._finisher.join(timeout=30)
        if self.engines is not None:
            self.engines.close()  # stops the servers it launched

    # -- models --------------------------------------------------------------------------------------------
    def _check_base(self, base_model: str) -> None:
        if base_model != self.options.base_model:
            raise UserError(
                f"unknown base model {base_model!r}: this server serves {self.options.base_model!r} "
                "(get_server_capabilities lists it)"
            )

    def _lora_config(self, lora: Mapping[str, Any] | None, *, unembed: bool = True) -> LoRAConfig | None:
        """The adapter of a LoRA request (``rank``, ``train_attn`` / ``train_mlp`` / ``train_unembed``,
        each default True as in the SDK); ``unembed=False`` ignores ``train_unembed`` (checkpoints
        written before unembedding adapters existed)."""
        if lora is None:
            return None
        rank = int(lora.get("rank", 0))
        if rank == 0:
            return None  # rank 0: full fine-tuning (every weight trained)
        if rank < 0 or rank > self.options.max_lora_rank:
            raise UserError(
                f"LoRA rank {rank} is outside [1, {self.options.max_lora_rank}] (the server's maximum; "
                "rank 0 asks for full fine-tuning)"
            )
        targets: list[str] = []
        if lora.get("train_attn", True):
            targets += ["q_proj", "k_proj", "v_proj", "o_proj"]
        if lora.get("train_mlp", True):
            targets += ["gate_proj", "up_proj", "down_proj"]
        if unembed and lora.get("train_unembed", True):
            targets += ["lm_head"]
        if not targets:
            raise UserError("a LoRA client must train something: set train_attn, train_mlp or train_unembed")
        return LoRAConfig(rank=rank, alpha=self.options.lora_alpha, targets=tuple(targets))

    def create_model(
        self,
        session_id: str,
        base_model: str,
        lora: Mapping[str, Any] | None,
        optimizer: Mapping[str, Any] | None,
        model_seq_id: int | None = None,
    ) -> str:
        """Creates a trainable model (full or LoRA) on the base model in a session; returns its id."""
        session = self._session(session_id)
        self._check_base(base_model)
        if optimizer and optimizer.get("type", "adamw") != "adamw":
            raise UserError(
                f"optimizer {optimizer.get('type')!r} is not supported; this server trains with adamw"
            )
        cfg = self._lora_config(lora)
        seed = int((lora or {}).get("seed") or 0)
        model_id = _model_id(session_id, model_seq_id)

        def create() -> dict[str, Any]:
            m = make_trainable(self.base, model_id, base_model, lora=cfg, seed=seed)
            m.session_id = session_id
            m.lora_request = dict(lora or {})
            self.models[model_id] = m
            with self._lock:
                session.models.add(model_id)
            return {"model_id": model_id, "type": "create_model"}

        return self._submit("create_model", model_id, create)

    def model(self, model_id: str) -> TrainableModel:
        """The trainable model ``model_id``; an unknown one raises ``UserError``."""
        m = self.models.get(model_id)
        if m is None:
            raise UserError(f"unknown model_id {model_id!r} (never created, or its session expired)")
        return m

    def get_info(self, model_id: str) -> dict[str, Any]:
        """The ``get_info`` answer of model ``model_id``."""
        m = self.model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": self.base.config.model_type,
                "model_name": m.base_model,
                "tokenizer_id": self.options.base_model,
            },
            "is_lora": m.is_lora,
            "lora_rank": m.lora.rank if m.lora else None,
            "model_name": m.base_model,
        }

    # -- forward / backward --------------------------------------------------------------------------------
    def submit_forward_backward(self, req: FwdBwdRequest) -> str:
        """Queues a forward-backward request; returns its request id."""
        self.model(req.model_id)
        _loss_config(req.loss_fn, req.loss_fn_config)  # unknown losses fail before they queue
        if not req.data:
            raise UserError("forward_backward: no data")
        return self._submit("forward_backward", req.model_id, lambda: None, fwd=req)

    def _datums(self, req: FwdBwdRequest) -> list[Datum]:
        required, optional = LOSS_INPUTS[req.loss_fn]
        known = {"target_tokens", *required, *optional}
        out = []
        for i, (tokens, inputs) in enumerate(req.data):
            n = len(tokens)
            if n == 0:
                raise UserError(f"datum {i}: empty model_input")
            if n > self.max_context:
                raise UserError(f"datum {i}: {n} tokens exceed the model's context of {self.max_context}")
            unknown = sorted(set(inputs) - known)
            if unknown:
                raise UserError(
                    f"datum {i}: loss_fn_inputs {unknown} are not inputs of {req.loss_fn!r} "
                    f"(it takes target_tokens, {list(required) + list(optional)})"
                )
            missing = [k for k in ("target_tokens", *required) if k not in inputs]
            if missing:
                raise UserError(f"datum {i}: loss {req.loss_fn!r} needs loss_fn_inputs {missing}")
            targets = inputs["target_tokens"]
            if targets.ndim == 2 and req.loss_fn == "cross_entropy" and len(targets) == n:
                if targets.shape[1] < 1:  # K targets per position: weights, if given, alike
                    raise UserError(f"datum {i}: target_tokens has shape {list(targets.shape)} (K = 0)")
                shaped = {"target_tokens": targets.shape, "weights": targets.shape}
            else:
                shaped = {}
            for name, x in inputs.items():
                want = shaped.get(name, (n,))
                if x.shape != want:
                    per = "K values per token, as target_tokens" if len(want) == 2 else "one value per token"
                    raise UserError(
                        f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(x.shape)}, but model_input "
                        f"has {n} tokens (every input is {per}; only cross_entropy takes [N, K] "
                        "target_tokens)"
                    )
            for name, ids in (("model_input", tokens), ("target_tokens", inputs["target_tokens"])):
                bad = (ids < 0) | (ids >= self.vocab_size)
                if bad.any():
                    raise UserError(
                        f"datum {i}: {name} holds token id {int(ids[bad][0])} outside the "
                        f"vocabulary [0, {self.vocab_size})"
                    )
            floats = {k: np.asarray(v, np.float32) for k, v in inputs.items() if k != "target_tokens"}
            bad = [k for k, v in floats.items() if not np.isfinite(v).all()]
            if bad:
                raise UserError(f"datum {i}: loss_fn_inputs {bad} hold non-finite values")
            out.append(Datum(tokens.astype(np.int32), inputs["target_tokens"].astype(np.int32), floats))
        return out

    def _prepare(self, reqs: list[FwdBwdRequest]) -> _Prepared:
        """Validates the datums of requests of ONE model with one loss (UserError on a bad one)."""
        first = reqs[0]
        config = _loss_config(first.loss_fn, first.loss_fn_config)
        per_req = [self._datums(r) for r in reqs]
        defaults = {"weights": 1.0, "logprobs": 0.0, "advantages": 0.0, "sequence_ratio_mask": 1.0}
        floats = {
            k: defaults[k]
            for k in (*LOSS_INPUTS[first.loss_fn][0], *LOSS_INPUTS[first.loss_fn][1])
            if k in defaults
        }
        for k in ("clip_low_threshold", "clip_high_threshold"):
            if k in config:
                floats[k] = config[k]
        if first.loss_fn == "cross_entropy":
            floats.setdefault("weights", 1.0)
        return _Prepared(self.model(first.model_id), reqs, per_req, config, floats)

    def _pack(self, prep: _Prepared, *, rows: int = 1, length: int = 1, segments: int = 1) -> PackedDatums:
        o = self.options
        return pack_datums(
            [d for ds in prep.per_req for d in ds],
            float_inputs=prep.floats,
            min_len=max(o.min_seq_len, length),
            min_rows=max(o.min_rows, rows),
            min_segments=max(4 * o.min_rows, segments),
            target_inputs=("weights",),
        )

    def _outputs(self, prep: _Prepared, packed: PackedDatums, logp: np.ndarray) -> list[bytes]:
        """One ForwardBackwardOutput per request: its datums' logprobs and token losses (recomputed on
        the host from the outputs)."""
        per_datum = packed.per_datum(logp)
        out, k = [], 0
        loss_fn = prep.reqs[0].loss_fn
        for ds in prep.per_req:
            lps = per_datum[k : k + len(ds)]
            k += len(ds)
            loss = _host_loss(loss_fn, ds, lps, prep.config)
            outputs = [{"logprobs": lp, "elementwise_loss": el} for lp, el in zip(lps, loss, strict=True)]
            metrics = {"loss:sum": float(sum(float(np.sum(el)) for el in loss))}
            out.append(encode_forward_backward_output(outputs, metrics))
        return out

    def _forward_backward(self, reqs: list[FwdBwdRequest]) -> Callable[[], list[bytes]]:
        """Dispatches requests of ONE model with one loss as one packed batch; the returned function
        waits for it and gives one output per request."""
        return self._step(self._prepare(reqs))

    def _step(self, prep: _Prepared) -> Callable[[], list[bytes]]:
        packed = self._pack(prep)
        first = prep.reqs[0]
        # the segment bound is static: only the losses that use it compile per bound
        segments = packed.num_segments if first.loss_fn in SEGMENT_LOSSES else 0
        wait = prep.model.forward_async(
            first.loss_fn, packed.arrays, prep.config, segments, backward=not first.forward_only
        )
        self.steps_run += 1
        self.requests_run += len(prep.reqs)
        self.last_packed_rows = int(packed.arrays["tokens"].shape[0])
        return lambda: self._outputs(prep, packed, wait()[1])

    def _forward_backward_fused(self, preps: list[_Prepared]) -> Callable[[], list[bytes]]:
        """Runs the requests of several fusable LoRA clients (:func:`~rljax.tinker.trainable.can_fuse`,
        one loss, one config) as ONE step: each client's datums packed in its own rows, every batch
        padded to the largest one's shape, their adapters stacked (``forward_fused``). Batches that
        cannot share a shape (K targets per position differing) run one after the other. The returned
        function waits for them and gives every request's output, in order."""
        first = preps[0].reqs[0]
        packs = [self._pack(p) for p in preps]
        rows = max(p.arrays["tokens"].shape[0] for p in packs)
        length = max(p.arrays["tokens"].shape[1] for p in packs)
        segs = max(p.num_segments for p in packs)
        packs = [self._pack(p, rows=rows, length=length, segments=segs) for p in preps]
        shapes = {tuple((k, v.shape) for k, v in sorted(p.arrays.items())) for p in packs}
        if len(shapes) > 1:
            waits = [self._step(p) for p in preps]
            return lambda: [out for w in waits for out in w()]
        segments = packs[0].num_segments if first.loss_fn in SEGMENT_LOSSES else 0
        wait = forward_fused_async(
            [p.model for p in preps],
            first.loss_fn,
            [p.arrays for p in packs],
            preps[0].config,
            segments,
            backward=not first.forward_only,
        )
        self.steps_run += 1
        self.fused_steps += 1
        self.requests_run += sum(len(p.reqs) for p in preps)
        self.last_packed_rows = rows

        def outputs() -> list[bytes]:
            results = wait()
            return [
                out
                for p, k, (_, logp) in zip(preps, packs, results, strict=True)
                for out in self._outputs(p, k, logp)
            ]

        return outputs

    def optim_step(self, model_id: str, adam: Mapping[str, Any]) -> str:
        """Queues an Adam step with the client's parameters; returns its request id."""
        self.model(model_id)
        params = {k: float(adam.get(k, v)) for k, v in ADAM_DEFAULTS.items()}
        if params["learning_rate"] < 0 or not 0 <= params["beta1"] < 1 or not 0 <= params["beta2"] < 1:
            raise UserError(
                f"invalid AdamParams {params}: learning_rate >= 0 and betas in [0, 1) are required"
            )

        def step() -> _Deferred:
            try:
                metrics = self.model(model_id).optim_step_async(params)
            except ValueError as e:
                raise UserError(str(e)) from None
            return _Deferred(lambda: {"type": "optim_step", "metrics": metrics()})

        return self._submit("optim_step", model_id, step)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def _ckpt_dir(self, model_id: str, kind: str, name: str) -> pathlib.Path:
        if not name or "/" in name or name.startswith("."):
            raise UserError(f"invalid checkpoint name {name!r} (a plain file name)")
        return self.root / model_id / kind / name

    def save_state(
        self,
        model_id: str,
        name: str | None,
        *,
        for_sampler: bool = False,
        sampling_session_seq_id: int | None = None,
        session_id: str | None = None,
    ) -> str:
        """Queues a save of the model's weights (and optimizer state, unless ``for_sampler``); returns its
        request id."""
        m = self.model(model_id)
        kind = "sampler_weights" if for_sampler else "weights"
        ephemeral = for_sampler and name is None
        name = name or f"ephemeral-{uuid.uuid4().hex[:8]}"
        directory = self._ckpt_dir(model_id, kind, name)

        def save() -> dict[str, Any]:
            path = f"tinker://{model_id}/{kind}/{name}"
            if ephemeral:  # save_weights_and_get_sampling_client: serve a snapshot, write nothing
                sid = self.samplers.add(path, m, self.options.base_model)
                if m.session_id in self.sessions:
                    self.sessions[m.session_id].samplers.add(sid)
                return {"type": "save_weights_for_sampler", "sampling_session_id": sid, "path": path}
            opt_state = m.opt_state if not for_sampler else {}
            ckpt.save(
                directory,
                0,
                params=m.params,
                opt_state=opt_state,
                overwrite=True,
                extra={
                    "lora": m.lora_request if m.is_lora else None,
                    "lora_targets": list(m.lora.targets) if m.is_lora else None,
                    "step": m.step,
                    "base_model": m.base_model,
                    "kind": kind,
                },
            )
            return {"type": "save_weights_for_sampler" if for_sampler else "save_weights", "path": path}

        return self._submit("save", model_id, save)

    def _checkpoint_lora(self, extra: Mapping[str, Any]) -> LoRAConfig | None:
        """The adapter a checkpoint holds: its recorded request, with ``train_unembed`` honoured only
        when the checkpoint records its targets (older ones were trained without unembedding adapters,
        whatever they asked for)."""
        return self._lora_config(extra.get("lora"), unembed="lora_targets" in extra)

    def _parse_path(self, path: str) -> tuple[str, str, str]:
        if not path.startswith("tinker://"):
            raise UserError(f"invalid checkpoint path {path!r}: expected tinker://<model_id>/weights/<name>")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights"):
            raise UserError(f"invalid checkpoint path {path!r}: expected tinker://<model_id>/weights/<name>")
        return parts[0], parts[1], parts[2]

    def _read_checkpoint(
        self, path: str, template: TrainableModel | None, *, optimizer: bool
    ) -> tuple[Any, Any, dict]:
        """(params, opt_state or None, extra) of a saved checkpoint, verified against its manifest."""
        owner, kind, name = self._parse_path(path)
        directory = self._ckpt_dir(owner, kind, name)
        if not directory.is_dir() or ckpt.latest_step(directory) is None:
            raise UserError(f"no checkpoint at {path}")
        extra = ckpt.read_extra(directory)
        if template is None:
            template = make_trainable(
                self.base, "template", extra["base_model"], lora=self._checkpoint_lora(extra), seed=0
            )
        opt_target = template.opt_state if (optimizer and kind == "weights") else {}
        try:
            r = ckpt.restore(directory, params=template.params, opt_state=opt_target)
        except ckpt.CheckpointCorruptedError as e:
            raise UserError(f"checkpoint {path} is damaged: {e}") from None
        except ValueError as e:
            raise UserError(f"checkpoint {path} does not fit this model: {e}") from None
        return r.params, (r.opt_state if optimizer and kind == "weights" else None), extra

    def load_state(
        self,
        path: str,
        *,
        optimizer: bool,
        model_id: str | None = None,
        session_id: str | None = None,
        base_model: str | None = None,
        model_seq_id: int | None = None,
    ) -> str:
        """``load_state[_with_optimizer]`` into an existing model, or (``session_id``) into a new one
        created from the checkpoint's recorded LoRA settings."""
        self._parse_path(path)
        new_id = model_id or _model_id(session_id or "", model_seq_id)
        session = self._session(session_id) if model_id is None else None

        def load() -> dict[str, Any]:
            if model_id is not None:
                m = self.model(model_id)
                params, opt_state, extra = self._read_checkpoint(path, m, optimizer=optimizer)
            else:
                params, opt_state, extra = self._read_checkpoint(path, None, optimizer=optimizer)
                lora = extra.get("lora")
                m = make_trainable(
                    self.base,
                    new_id,
                    extra["base_model"],
                    lora=self._checkpoint_lora(extra),
                    seed=int((lora or {}).get("seed") or 0),
                )
                m.session_id, m.lora_request = session_id or "", dict(lora or {})
                self.models[new_id] = m
                with self._lock:
                    session.models.add(new_id)
            if jax.tree.structure(params) != jax.tree.structure(m.params):
                raise UserError(
                    f"checkpoint {path} holds other parameters than model {new_id} (LoRA settings differ)"
                )
            m.params = jax.device_put(params)
            m.pending = None
            if opt_state is not None:
                m.opt_state = jax.device_put(opt_state)
                m.step = int(extra.get("step", 0))
            return {"type": "load_weights", "path": path, "model_id": new_id}

        return self._submit("load", new_id, load)

    def list_checkpoints(self, model_id: str) -> dict[str, Any]:
        """The model's saved checkpoints (training and sampler weights) in the API's listing format."""
        out = []
        for kind, ctype in (("weights", "training"), ("sampler_weights", "sampler")):
            d = self.root / model_id / kind
            for c in sorted(d.iterdir()) if d.is_dir() else []:
                if ckpt.latest_step(c) is None:
                    continue
                size = sum(f.stat().st_size for f in c.rglob("*") if f.is_file())
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{c.name}",
                        "checkpoint_type": ctype,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.stat().st_mtime)),
                        "tinker_path": f"tinker://{model_id}/{kind}/{c.name}",
                        "size_bytes": size,
                    }
                )
        return {"checkpoints": out}

    # -- sampling --------------------------------------------------------------------------------------------
    def create_sampling_session(self, session_id: str, model_path: str | None, base_model: str | None) -> str:
        """Opens a sampling session on saved weights (``model_path``) or the base model; returns its id."""
        session = self._session(session_id)
        if model_path:
            owner, kind, _ = self._parse_path(model_path)
            params, _, extra = self._read_checkpoint(model_path, self.models.get(owner), optimizer=False)
            lora = self._checkpoint_lora(extra)
            m = make_trainable(self.base, owner, extra["base_model"], lora=lora, seed=0)
            m.params = params
            sid = self.samplers.add(model_path, m, self.options.base_model)
        else:
            self._check_base(base_model or "")
            sid = self.samplers.add(None, None, self.options.base_model)
        with self._lock:
            session.samplers.add(sid)
        return sid

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        """The base model and weights path of sampling session ``sampler_id``."""
        s = self.samplers.get(sampler_id)
        if s is None:
            raise UserError(f"unknown sampling session {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def submit_sample(self, body: Mapping[str, Any]) -> tuple[str, list[str]]:
        """Queues a sample request; returns its request id and the ids of its sampling sessions."""
        sid = body.get("sampling_session_id")
        if sid is None:
            if body.get("model_path"):
                raise UserError(
                    "sample with model_path: create a sampling client first (create_sampling_client)"
                )
            self._check_base(body.get("base_model") or "")
            sid = self.samplers.base_sampler_id(self.options.base_model)
        sampler = self.samplers.get(sid)
        if sampler is None:
            raise UserError(f"unknown sampling session {sid!r}")
        prompt = _prompt_tokens(body.get("prompt") or {})
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if not prompt:
            raise UserError("empty prompt")
        n = int(body.get("num_samples", 1))
        if n < 1:
            raise UserError(f"num_samples must be >= 1, got {n}")
        params = dict(body.get("sampling_params") or {})
        want_prompt_lp = bool(body.get("prompt_logprobs"))
        ids = [f"seq-{uuid.uuid4().hex[:12]}" for _ in range(n)]
        stops = self.samplers.stops(params.get("stop"), self.run.tokenizer)

        def sample() -> bytes:
            return sampler.sample(prompt, n, params, stops, want_prompt_lp)

        return self._submit("sample", None, sample), ids


def _set_once(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)


def _outcome(request_id: str, fut: concurrent.futures.Future) -> tuple[str, Any]:
    """A finished request's answer: ``("json", dict)``, ``("proto", bytes)`` or ``("error", dict)``."""
    e = fut.exception()
    if isinstance(e, UserError):
        return "error", {"error": str(e), "category": "user"}
    if e is not None:  # reported to the client, the server goes on
        log.error("request %s failed", request_id, exc_info=e)
        return "error", {"error": f"{type(e).__name__}: {e}", "category": "server"}
    result = fut.result()
    if isinstance(result, bytes):
        return "proto", result
    return "json", result


def _model_id(session_id: str, model_seq_id: int | None) -> str:
    """The SDK's model id of a session's ``model_seq_id``-th training client (it derives it itself
    when it creates a client from a checkpoint)."""
    if model_seq_id is None:
        return f"{session_id}:train:{uuid.uuid4().hex[:8]}"
    return f"{session_id}:train:{int(model_seq_id)}"


def _loss_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    try:
        return check_config(loss_fn, config)
    except ValueError as e:
        raise UserError(str(e)) from None


def _same_step(a: _Job, b: _Job) -> bool:
    fa, fb = a.fwd, b.fwd
    return (
        fb is not None
        and fa.model_id == fb.model_id
        and fa.loss_fn == fb.loss_fn
        and fa.forward_only == fb.forward_only
        and fa.loss_fn_config == fb.loss_fn_config
    )


def _prompt_tokens(prompt: Mapping[str, Any]) -> list[int]:
    out: list[int] = []
    for chunk in prompt.get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"only text prompt chunks are supported, got {chunk.get('type')!r}")
        out += [int(t) for t in chunk.get("tokens", [])]
    return out


def _host_loss(
    loss_fn: str, datums: list[Datum], logps: list[np.ndarray], config: Mapping[str, float]
) -> list[np.ndarray]:
    """Each token's loss in float64 from the forward's logprobs (the ``elementwise_loss`` output and
    ``loss:sum``; the gradient comes from the jitted step)."""
    out = []
    for d, lp in zip(datums, logps, strict=True):
        lp = lp.astype(np.float64)
        g = {k: np.asarray(v, np.float64) for k, v in d.inputs.items()}
        if loss_fn == "cross_entropy":
            out.append(-g.get("weights", np.ones_like(lp)) * lp)
            continue
        q, a = g["logprobs"], g["advantages"]
        ratio = np.exp(np.clip(lp - q, -20, 20))
        lo = g.get("clip_low_threshold", np.full_like(lp, config.get("clip_low_threshold", 0.8)))
        hi = g.get("clip_high_threshold", np.full_like(lp, config.get("clip_high_threshold", 1.2)))
        if loss_fn == "importance_sampling":
            out.append(-ratio * a)
        elif loss_fn == "ppo":
            out.append(-np.minimum(ratio * a, np.clip(ratio, lo, hi) * a))
        elif loss_fn == "cispo":
            out.append(-np.clip(ratio, lo, hi) * lp * a)
        elif loss_fn == "dro":
            out.append(-(lp * a - 0.5 * config["beta"] * (lp - q) ** 2))
        elif loss_fn == "gspo":
            m = g.get("sequence_ratio_mask", np.ones_like(lp)) != 0
            s = np.exp(np.mean((lp - q)[m])) if m.any() else 1.0
            out.append(-np.minimum(s * a, np.clip(s, lo, hi) * a))
        else:
            raise UserError(f"unknown loss_fn {loss_fn!r}")
    return out
