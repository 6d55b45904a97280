"""Sampling sessions of the Tinker server: the embedded JAX sampler
(:class:`rljax.inference.sampler.EmbeddedSampler`) on the base model or on saved weights (a LoRA
adapter over the shared base, or full weights).

``SamplingParams`` of the SDK map onto rljax's: ``temperature``, ``top_p``, ``top_k`` (-1: off),
``max_tokens`` (None: 64), ``seed``, ``stop`` (token ids or strings; None: the tokenizer's EOS;
``[]``: none). A stop string ends a completion at the first token whose decoded completion text
contains it (that token kept, as the SDK's renderers expect: they split the text on the string); the
engine stops early on stop ids and on strings that are one token, and a longer string cuts the
finished completion afterwards (sampling is causal, so the kept tokens and their logprobs are exactly
those of a run that had stopped there). Prompt logprobs (``prompt_logprobs=True``, ``compute_logprobs``)
come from the SAME jitted program as the training forward
(:func:`rljax.train.tinker.trainable.target_logprobs` on the packed prompt), so they equal the
training client's ``forward`` logprobs on those tokens; entry 0 is None (no context).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax.inference.engine import SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.train.tinker.packing import Datum, pack_datums
from rljax.train.tinker.trainable import TrainableModel, make_trainable, target_logprobs
from rljax.train.tinker.wire import encode_sample_response

__all__ = ["SamplerPool", "SamplingSession", "Stops", "cut_at_stop_string"]

DEFAULT_MAX_TOKENS = 64


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
    engine: EmbeddedSampler
    loop: asyncio.AbstractEventLoop

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
    """Every sampling session of the server, with one event loop thread for the samplers."""

    def __init__(self, base: Any, *, seed: int) -> None:
        self.base = base
        self.seed = seed
        self.sessions: dict[str, SamplingSession] = {}
        self._base_id: str | None = None
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="tinker-sampler", daemon=True).start()

    def add(self, model_path: str | None, model: TrainableModel | None, base_model: str) -> str:
        """A new session serving ``model`` (a snapshot of its current parameters; None: the base)."""
        if model is None:
            model = make_trainable(self.base, "base", base_model, lora=None, seed=0)
        snapshot = dataclasses.replace(model, pending=None, opt_state=None)
        engine = EmbeddedSampler(snapshot.model(), seed=self.seed, min_batch_bucket=1)
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[sid] = SamplingSession(sid, model_path, base_model, snapshot, engine, self.loop)
        return sid

    def base_sampler_id(self, base_model: str) -> str:
        if self._base_id is None:
            self._base_id = self.add(None, None, base_model)
        return self._base_id

    def get(self, sampler_id: str) -> SamplingSession | None:
        return self.sessions.get(sampler_id)

    def drop(self, sampler_id: str) -> None:
        with self._lock:
            self.sessions.pop(sampler_id, None)

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
