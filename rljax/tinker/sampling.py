"""Sampling sessions of the Tinker server on the base model or on saved weights (a LoRA adapter over
the shared base, or full weights), served by one of two engines:

* the embedded JAX sampler (:class:`rljax.inference.sampler.EmbeddedSampler`), the default: every
  kind of weights, in process;
* the config's vLLM servers (``engine.kind="vllm"``; :class:`VLLMBackend`): the base model as the
  servers loaded it, and a LoRA adapter loaded into them at run time under the session's own name
  (:func:`rljax.inference.vllm.adapter_sync.load_verified_adapter`: the path LoRA training syncs
  through, probe logprobs verified against the trainer's), several adapters side by side, each
  request naming its session's adapter; token ids in, token ids and logprobs out. What vLLM cannot
  serve exactly falls back to the embedded sampler (:func:`vllm_unservable`): an adapter on the
  unembedding (vLLM has no ``lm_head`` LoRA) and full fine-tuned weights (the servers hold ONE set
  of base weights that every session and the base model share; swapping them per session would
  change the others' samples).

``SamplingParams`` of the SDK map onto rljax's: ``temperature``, ``top_p``, ``top_k`` (-1: off),
``max_tokens`` (None: 64), ``seed``, ``stop`` (token ids or strings; None: the tokenizer's EOS;
``[]``: none). A stop string ends a completion at the first token whose decoded completion text
contains it (that token kept, as the SDK's renderers expect: they split the text on the string); the
engine stops early on stop ids and on strings that are one token, and a longer string cuts the
finished completion afterwards (sampling is causal, so the kept tokens and their logprobs are exactly
those of a run that had stopped there). Prompt logprobs (``prompt_logprobs=True``, ``compute_logprobs``)
come from the SAME jitted program as the training forward
(:func:`rljax.tinker.trainable.target_logprobs` on the packed prompt), so they equal the
training client's ``forward`` logprobs on those tokens; entry 0 is None (no context).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import shutil
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.inference.engine import SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.tinker.packing import Datum, pack_datums
from rljax.tinker.trainable import TrainableModel, make_trainable, target_logprobs
from rljax.tinker.wire import encode_sample_response

__all__ = [
    "SamplerPool",
    "SamplingSession",
    "Stops",
    "VLLMBackend",
    "VLLMSessionEngine",
    "cut_at_stop_string",
    "vllm_unservable",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class VLLMBackend:
    """The config's vLLM servers as the sampling engine: ``client`` (a
    :class:`rljax.inference.vllm.VLLMClient`, used only on the pool's event loop) and ``directory``,
    where each session's adapter is written for the servers to load (they must be able to read it)."""

    client: Any
    directory: pathlib.Path


@dataclasses.dataclass(frozen=True)
class VLLMSessionEngine:
    """One session's engine on the vLLM servers: requests name ``model`` (the servers' base model or
    the session's adapter); ``adapter_dir`` is the adapter's directory (None: the base)."""

    client: Any
    model: str
    adapter_dir: pathlib.Path | None = None

    async def generate(self, prompt: list[int], sampling: SamplingParams) -> Any:
        """Samples from ``prompt`` on the vLLM servers under this session's model name."""
        return await self.client.generate(prompt, sampling, model=self.model)


def vllm_unservable(model: TrainableModel | None) -> str | None:
    """Why vLLM cannot serve ``model``'s weights exactly (None: it can: the base, or a LoRA adapter
    without an unembedding target)."""
    if model is None:
        return None
    if not model.is_lora:
        return (
            "full fine-tuned weights (the servers hold one set of base weights, shared by every "
            "session and the base model)"
        )
    if model.lora.unembed:
        return "an unembedding (lm_head) adapter (vLLM serves no lm_head LoRA)"
    return None


@dataclasses.dataclass(frozen=True)
class Stops:
    """What ends a completion: token ``ids`` (the engine stops on them) and ``strings`` (matched in
    the decoded completion text with ``tokenizer``)."""

    ids: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()
    tokenizer: Any = None


def cut_at_stop_string(ids: Sequence[int], strings: Sequence[str], tokenizer: Any) -> int | None:
    """The length of the shortest prefix of ``ids`` whose decoded text contains one of ``strings``
    (None: no prefix does). Containment only grows with the prefix, so a binary search over prefix
    lengths decodes O(log n) prefixes."""
    strings = [s for s in strings if s]

    def hit(n: int) -> bool:
        text = tokenizer.decode(list(ids[:n]))
        return any(s in text for s in strings)

    if not strings or not ids or not hit(len(ids)):
        return None
    lo, hi = 1, len(ids)  # hit(hi) holds; find the smallest such n
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclasses.dataclass
class SamplingSession:
    """One sampling session: the weights it serves (``model``) and its engine."""

    sampler_id: str
    model_path: str | None
    base_model: str
    model: TrainableModel
    engine: EmbeddedSampler | VLLMSessionEngine
    loop: asyncio.AbstractEventLoop

    @property
    def on_vllm(self) -> bool:
        """Whether the vLLM servers serve this session (else the embedded sampler)."""
        return isinstance(self.engine, VLLMSessionEngine)

    def prompt_logprobs(self, prompt: Sequence[int]) -> list[float]:
        """``[nan, log p(x1 | x0), ..., log p(x_{n-1} | x_<n-1)]`` by the training forward's program."""
        if len(prompt) < 2:
            return [float("nan")] * len(prompt)
        d = Datum(np.asarray(prompt[:-1], np.int32), np.asarray(prompt[1:], np.int32), {})
        packed = pack_datums([d], float_inputs={})
        arrays = {k: jnp.asarray(v) for k, v in packed.arrays.items()}
        m = self.model
        logp = np.asarray(_jit_target_logprobs(m.graphdef, m.params, m.frozen, arrays))
        return [float("nan")] + [float(x) for x in packed.per_datum(logp)[0]]

    def sample(
        self,
        prompt: list[int],
        n: int,
        params: dict[str, Any],
        stops: Stops,
        with_prompt_logprobs: bool,
    ) -> bytes:
        """``n`` completions of ``prompt`` (a ``SampleResponse`` protobuf)."""
        top_k = params.get("top_k", -1)
        seed = params.get("seed")
        base = dict(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=None if top_k is None or int(top_k) < 1 else int(top_k),
            max_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
            stop_token_ids=stops.ids,
        )
        sampling = [SamplingParams(**base, seed=None if seed is None else int(seed) + i) for i in range(n)]

        async def run() -> list[Any]:
            return list(await asyncio.gather(*(self.engine.generate(list(prompt), s) for s in sampling)))

        completions = asyncio.run_coroutine_threadsafe(run(), self.loop).result()
        seqs = []
        for c in completions:
            ids, logprobs = list(c.ids), list(c.logprobs)
            reason = "length" if c.finish_reason == "length" else "stop"
            cut = cut_at_stop_string(ids, stops.strings, stops.tokenizer) if stops.strings else None
            if cut is not None:
                ids, logprobs, reason = ids[:cut], logprobs[:cut], "stop"
            seqs.append((ids, logprobs, reason))
        return encode_sample_response(seqs, self.prompt_logprobs(prompt) if with_prompt_logprobs else None)


class SamplerPool:
    """Every sampling session of the server, with one event loop thread for the engines; ``vllm``:
    the vLLM servers that serve what they can (None: the embedded sampler serves every session)."""

    def __init__(self, base: Any, *, seed: int, vllm: VLLMBackend | None = None) -> None:
        self.base = base
        self.seed = seed
        self.vllm = vllm
        self.sessions: dict[str, SamplingSession] = {}
        self._base_id: str | None = None
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="tinker-sampler", daemon=True).start()

    def add(self, model_path: str | None, model: TrainableModel | None, base_model: str) -> str:
        """A new session serving ``model`` (a snapshot of its current parameters; None: the base)."""
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        unservable = None if self.vllm is None else vllm_unservable(model)
        on_vllm = self.vllm is not None and unservable is None
        if unservable is not None:
            log.warning("sampler %s (%s): the embedded sampler serves %s", sid, model_path, unservable)
        is_base = model is None
        if model is None:
            model = make_trainable(self.base, "base", base_model, lora=None, seed=0)
        snapshot = dataclasses.replace(model, pending=None, opt_state=None)
        if not on_vllm:
            engine: Any = EmbeddedSampler(snapshot.model(), seed=self.seed, min_batch_bucket=1)
        elif is_base:
            engine = VLLMSessionEngine(self.vllm.client, self.vllm.client.model)
        else:
            engine = self._load_adapter(sid, snapshot)
        with self._lock:
            self.sessions[sid] = SamplingSession(sid, model_path, base_model, snapshot, engine, self.loop)
        return sid

    def _load_adapter(self, sid: str, model: TrainableModel) -> VLLMSessionEngine:
        """Writes ``model``'s adapter (PEFT format) and loads it into every vLLM server as
        ``tinker-<sid>``, verified against the trainer's probe logprobs."""
        from rljax.inference.vllm.adapter_sync import load_verified_adapter
        from rljax.models.lora import save_adapter

        client, name = self.vllm.client, f"tinker-{sid}"
        directory = self.vllm.directory / sid
        nnx_model = model.model()
        save_adapter(nnx_model, directory, base_model_name_or_path=client.model)
        load = load_verified_adapter(client, nnx_model, name=name, path=directory, config=client.sync_config)
        try:
            asyncio.run_coroutine_threadsafe(load, self.loop).result()
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return VLLMSessionEngine(client, name, directory)

    def base_sampler_id(self, base_model: str) -> str:
        """The id of the base model's sampling session (created on first use)."""
        if self._base_id is None:
            self._base_id = self.add(None, None, base_model)
        return self._base_id

    def get(self, sampler_id: str) -> SamplingSession | None:
        """The sampling session ``sampler_id``, or None."""
        return self.sessions.get(sampler_id)

    def drop(self, sampler_id: str, *, drain_timeout_s: float = 30.0) -> None:
        """Forgets a session; its adapter (if vLLM serves one) is unloaded once no request naming it
        is pending (at most ``drain_timeout_s``) and its files are deleted."""
        with self._lock:
            session = self.sessions.pop(sampler_id, None)
        engine = None if session is None else session.engine
        if isinstance(engine, VLLMSessionEngine) and engine.adapter_dir is not None:
            from rljax.inference.vllm.adapter_sync import unload_adapter_on_servers

            async def unload() -> None:
                await engine.client.wait_for_model_idle(engine.model, timeout_s=drain_timeout_s)
                await unload_adapter_on_servers(engine.client, engine.model, missing_ok=True)

            try:
                asyncio.run_coroutine_threadsafe(unload(), self.loop).result(timeout=drain_timeout_s + 30)
            except Exception as e:  # noqa: BLE001 - a leaked adapter, not a wrong sample
                log.warning("could not unload adapter %s: %s", engine.model, e)
            shutil.rmtree(engine.adapter_dir, ignore_errors=True)

    @staticmethod
    def stops(stop: Any, tokenizer: Any) -> Stops:
        """What ends a completion (see the module docstring)."""
        if stop is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            return Stops(() if eos is None else (int(eos),))
        if isinstance(stop, (str, int)):
            stop = [stop]
        ids: list[int] = []
        strings: list[str] = []
        for s in stop:
            if isinstance(s, str):
                if not s:
                    continue
                encoded = tokenizer.encode(s, add_special_tokens=False)
                if len(encoded) == 1:
                    ids.append(int(encoded[0]))  # the engine stops on it at once
                strings.append(s)  # the text check also finds s inside longer tokens or across tokens
            else:
                ids.append(int(s))
        return Stops(tuple(ids), tuple(strings), tokenizer if strings else None)


def _target_logprobs(graphdef: Any, params: Any, frozen: Any, batch: Any) -> Any:
    return target_logprobs(graphdef, params, frozen, batch)


_jit_target_logprobs = jax.jit(_target_logprobs, static_argnums=0)
