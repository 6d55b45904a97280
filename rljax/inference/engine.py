"""The inference-engine protocol: token ids in, token ids and logprobs out (design §4, §5).

Every engine (a pool of vLLM servers, the embedded JAX sampler, a test fake) implements
:class:`Engine`: ``await engine.generate(prompt_ids, sampling, session_id=...)`` returns a
:class:`Completion` holding the EXACT token ids the engine sampled, the logprob of each one under the
sampling distribution (logits divided by the temperature, i.e. vLLM's ``processed_logprobs``), why it
stopped, and the policy (weight) version that produced it. Text never crosses this boundary, so the
trainer trains on exactly the tokens the sampler produced.

>>> import asyncio
>>> class Echo:
...     weight_version = 0
...     async def generate(self, prompt_ids, sampling, *, session_id=None):
...         ids = list(prompt_ids)[-1:] * sampling.max_tokens
...         return Completion(ids=ids, logprobs=[0.0] * len(ids), finish_reason="length",
...                           weight_version=self.weight_version)
...     async def update_weights(self, model, *, version=None):
...         self.weight_version = self.weight_version + 1 if version is None else version
...         return self.weight_version
>>> isinstance(Echo(), Engine)
True
>>> asyncio.run(Echo().generate([5, 7], SamplingParams(max_tokens=2)))
Completion(ids=(7, 7), logprobs=(0.0, 0.0), finish_reason='length', weight_version=0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from rljax.types import VersionSpan, check_version_spans, token_versions

#: Reasons a completion ends. "abort": the engine gave up on the request (server died, request
#: cancelled); the tokens returned so far are exact but the turn is incomplete.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    Attributes:
      temperature: logits are divided by it before sampling; 0 means greedy. The returned logprobs
        are of the temperature-scaled distribution, which is what the trainer recomputes.
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; None disables it.
      max_tokens: most tokens to generate (>= 1).
      stop_token_ids: generation stops after emitting one of these (it is included in the ids).
      seed: per-request seed for reproducible sampling; None lets the engine choose.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or int(self.top_k) < 1):
            raise ValueError(f"SamplingParams.top_k must be None (disabled) or an int >= 1, got {self.top_k}")
        if isinstance(self.max_tokens, bool) or int(self.max_tokens) < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens}")
        stop = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative token ids, got {stop}")
        object.__setattr__(self, "stop_token_ids", stop)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One generated turn, exactly as the engine produced it.

    Attributes:
      ids: the sampled token ids (stop token included when generation stopped on one).
      logprobs: ``logprobs[i] = log p(ids[i] | prompt, ids[:i])`` under the temperature-scaled
        distribution; one per id, each finite and <= 0.
      finish_reason: one of :data:`FINISH_REASONS`.
      weight_version: the policy version that produced the FIRST token (the oldest version; every
        token's, unless an in-flight weight update crossed the completion).
      weight_versions: the version of every token as spans ``[start, end)`` over ``ids``
        (contiguous, strictly increasing in version, covering every token; the first span's
        version is ``weight_version``). Defaults to one span at ``weight_version``.
      routed_experts: MoE engines that record routing: int ``[len(prompt) + len(ids) - 1,
        layers, top_k]``, the experts every processed token was routed to (router replay); else None.
        After an in-flight update the embedded sampler recomputes the routing of every processed
        token with the new weights, so the routing is that of the LAST span's version throughout:
        the routing the newest tokens were sampled with.
      support_floors: engines that sample from a truncated distribution (top-k / top-p) and report
        its support: one float per id, the support floor of its draw (the token was drawn from the
        temperature-scaled logits ``z >= floor``; ``-inf`` where nothing was cut), so the trainer can
        score it on the same support. None: drawn from the whole distribution, or an engine that does
        not report the support (:func:`reports_sampling_support`).
    """

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    weight_version: int
    routed_experts: Any = dataclasses.field(default=None, repr=False, compare=False)
    weight_versions: tuple[VersionSpan, ...] = dataclasses.field(default=(), repr=False)
    support_floors: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        ids = tuple(int(t) for t in self.ids)
        logprobs = tuple(float(x) for x in self.logprobs)
        if len(ids) != len(logprobs):
            raise ValueError(
                f"Completion has {len(ids)} token ids but {len(logprobs)} logprobs; the engine must "
                "return exactly one logprob per generated token"
            )
        bad = [i for i, x in enumerate(logprobs) if not (math.isfinite(x) and x <= 1e-6)]
        if bad:
            raise ValueError(
                f"Completion logprobs must be finite and <= 0; entry {bad[0]} is {logprobs[bad[0]]}"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "logprobs", logprobs)
        object.__setattr__(self, "weight_version", int(self.weight_version))
        spans = tuple(_as_span(s) for s in self.weight_versions)
        if not spans and ids:
            spans = (VersionSpan(self.weight_version, 0, len(ids)),)
        check_version_spans(spans, len(ids))
        if spans and spans[0].version != self.weight_version:
            raise ValueError(
                f"Completion.weight_version ({self.weight_version}) must be the first span's version "
                f"({spans[0].version})"
            )
        object.__setattr__(self, "weight_versions", spans)
        if self.support_floors is not None:
            floors = tuple(float(x) for x in self.support_floors)
            if len(floors) != len(ids) or any(math.isnan(x) or x == math.inf for x in floors):
                raise ValueError(
                    f"Completion.support_floors must hold one float per id ({len(ids)}), none NaN or +inf; "
                    f"got {len(floors)} values"
                )
            object.__setattr__(self, "support_floors", floors)

    def token_versions(self) -> list[int]:
        """The weight version that sampled each token of ``ids``."""
        return token_versions(self.weight_versions)


def _as_span(span: VersionSpan | dict) -> VersionSpan:
    """A VersionSpan from itself or its JSON form ``{"version", "start", "end"}``."""
    if isinstance(span, VersionSpan):
        return span
    return VersionSpan(int(span["version"]), int(span["start"]), int(span["end"]))


@runtime_checkable
class Engine(Protocol):
    """What the rollout loop needs from an inference engine.

    ``weight_version`` is the version new requests are served with; ``update_weights`` makes the
    engine serve ``model``'s current parameters (a Flax decoder from :mod:`rljax.models`) and returns
    the new version (``version`` if given, else the old one plus one; versions only grow).

    In-flight updates. ``await engine.update_weights(model, version=v)`` may be called while
    ``generate`` calls are in flight. What happens to them depends on the optional attribute
    ``supports_in_flight_updates`` (absent means False):

    * False: completions already in flight finish with the old weights and report the old
      version (one span).
    * True: the engine applies the new weights to running sequences at its next decode segment
      or token boundary, without dropping them, and ``update_weights`` returns once they decode
      with version ``v`` (or have finished). Their completions then carry several
      :attr:`Completion.weight_versions` spans: tokens ``[start, end)`` of a span were sampled by
      that span's version. How a span's distribution relates to its weights is the engine's to
      document: the embedded sampler recomputes the running rows' KV cache, so a span's tokens are
      drawn exactly from its version's weights given the sequence so far; a vLLM server paused in
      keep mode keeps its KV cache, so the first positions' keys and values stay those of the older
      weights (PipelineRL's behaviour).

    Use :func:`supports_in_flight_updates` to read the attribute of any engine.
    """

    weight_version: int

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Completion:
        """Samples one completion of ``prompt_ids``; ``session_id`` keeps a trajectory on one replica."""
        ...

    async def update_weights(self, model: Any, *, version: int | None = None) -> int:
        """Serves ``model``'s parameters from now on; returns the new weight version."""
        ...


def supports_in_flight_updates(engine: Any) -> bool:
    """Whether ``engine`` applies weight updates to running sequences (:class:`Engine`).

    >>> class Old:
    ...     weight_version = 0
    >>> supports_in_flight_updates(Old())
    False
    """
    return bool(getattr(engine, "supports_in_flight_updates", False))


def reports_sampling_support(engine: Any) -> bool:
    """Whether ``engine`` reports the support of top-k / top-p draws (``Completion.support_floors``),
    so a truncated draw can be trained exactly (the optional attribute ``reports_sampling_support``;
    absent means False: vLLM does not report it).

    >>> class Old:
    ...     weight_version = 0
    >>> reports_sampling_support(Old())
    False
    """
    return bool(getattr(engine, "reports_sampling_support", False))
