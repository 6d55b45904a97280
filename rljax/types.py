"""Data model of rljax: host-side steps and batches, device-side packed batches.

A :class:`Step` is one LLM turn exactly as the engine saw it (token ids in, token
ids and logprobs out). A :class:`PackedBatch` is the fixed-shape pytree of per-token
arrays the jitted train step consumes (see design §2.6). These are plain records: this
module imports nothing from rljax. The validated batch of steps,
:class:`rljax.data.batch.StepBatch`, lives in the data layer with its validation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

Reward = float | list[float]

#: Stop reasons that mark a trajectory as errored: the rollout gives its steps loss mask 0 and
#: reward 0 and ends it with "error" (environment exception or timeout) or "abort" (engine abort).
#: Errored trajectories are counted, never trained on, and left out of group baselines.
ERROR_STOP_REASONS: tuple[str, ...] = ("error", "abort")


@dataclasses.dataclass(frozen=True, order=True)
class TrajectoryID:
    """Identity of a trajectory: ``instance_id`` is the prompt (group) key.

    A record: batch validation (:mod:`rljax.data.validate`) requires ``instance_id`` to be a non-empty
    str and ``repetition_id`` an int >= 0.
    """

    instance_id: str
    repetition_id: int

    @classmethod
    def coerce(cls, value: Any) -> TrajectoryID:
        """Accepts a TrajectoryID, an ``(instance_id, repetition_id)`` pair or a dict."""
        if isinstance(value, TrajectoryID):
            return value
        if isinstance(value, Mapping):
            try:
                return cls(str(value["instance_id"]), int(value["repetition_id"]))
            except KeyError as e:
                raise ValueError(
                    f"trajectory_id dict needs keys 'instance_id' and 'repetition_id', got {sorted(value)}"
                ) from e
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(str(value[0]), int(value[1]))
        raise ValueError(
            "trajectory_id must be a TrajectoryID, an (instance_id, repetition_id) pair or a dict "
            f"with those keys; got {value!r}"
        )

    def __str__(self) -> str:
        return f"{self.instance_id}#{self.repetition_id}"


@dataclasses.dataclass(frozen=True)
class VersionSpan:
    """Tokens ``[start, end)`` of a completion were sampled with weight version ``version``.

    A completion that an in-flight weight update crossed carries several spans (SGLang's per-request
    ``[{"version", "start", "end"}]``); the spans of one completion are contiguous, their versions
    strictly increase, and together they cover every token (:func:`check_version_spans`).
    """

    version: int
    start: int
    end: int

    def as_dict(self) -> dict[str, int]:
        """The JSON form written to rollout records: ``{"version": v, "start": i, "end": j}``."""
        return {"version": self.version, "start": self.start, "end": self.end}


def check_version_spans(spans: Sequence[VersionSpan], num_tokens: int) -> None:
    """Raises ValueError unless ``spans`` are contiguous, strictly increasing in version, cover
    ``[0, num_tokens)`` and are non-empty each (no spans at all for ``num_tokens == 0``).

    >>> check_version_spans([VersionSpan(3, 0, 2), VersionSpan(5, 2, 4)], 4)
    >>> check_version_spans([VersionSpan(3, 0, 2), VersionSpan(3, 2, 4)], 4)
    Traceback (most recent call last):
    ...
    ValueError: weight version spans must strictly increase in version; span 1 has version 3 after 3
    """
    pos = 0
    for i, span in enumerate(spans):
        if span.start != pos or span.end <= span.start:
            raise ValueError(
                f"weight version spans must be contiguous and non-empty from 0 to {num_tokens}; span {i} is "
                f"[{span.start}, {span.end}) after position {pos}"
            )
        if span.version < 0:
            raise ValueError(f"weight version spans need versions >= 0; span {i} has {span.version}")
        if i and span.version <= spans[i - 1].version:
            raise ValueError(
                "weight version spans must strictly increase in version; "
                f"span {i} has version {span.version} after {spans[i - 1].version}"
            )
        pos = span.end
    if pos != num_tokens:
        raise ValueError(f"weight version spans cover {pos} tokens, the completion has {num_tokens}")


def version_spans(token_versions: Sequence[int]) -> tuple[VersionSpan, ...]:
    """Run-length spans of a per-token version list (the inverse of :func:`token_versions`).

    >>> version_spans([2, 2, 3, 3, 3])
    (VersionSpan(version=2, start=0, end=2), VersionSpan(version=3, start=2, end=5))
    """
    spans: list[VersionSpan] = []
    start = 0
    versions = [int(v) for v in token_versions]
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            spans.append(VersionSpan(versions[start], start, i))
            start = i
    return tuple(spans)


def token_versions(spans: Sequence[VersionSpan]) -> list[int]:
    """The version of each token, from spans that start at 0 and are contiguous.

    >>> token_versions([VersionSpan(2, 0, 2), VersionSpan(3, 2, 5)])
    [2, 2, 3, 3, 3]
    """
    out: list[int] = []
    for span in spans:
        out.extend([int(span.version)] * (span.end - span.start))
    return out


@dataclasses.dataclass(frozen=True)
class Step:
    """One LLM turn (one training sample before merging). See design §2.1.

    Attributes:
      prompt_ids: exact token ids the engine received for this turn.
      response_ids: exact token ids the engine returned (never re-tokenized).
      response_logprobs: engine logprob of each response token, or None.
      loss_mask: 1 = trainable; one entry per response token.
      reward: step reward (scalar) or per-token rewards (one per response token).
      trajectory_id: which trajectory (and group, via ``instance_id``) this turn belongs to.
      is_last_step: True on the final step of its trajectory.
      stop_reason: "stop", "length", "abort", "tool_call", ...
      env: name of the environment that produced the step.
      algorithm: name of the algorithm (design §3.6) that trains it.
      temperature: sampling temperature; the trainer divides logits by it.
      policy_version: weight version of the policy that sampled the step: the OLDEST version
        among its tokens when an in-flight weight update crossed the turn.
      response_versions: optional, one weight version per response token (a turn that an
        in-flight weight update crossed, or a merged sample of turns sampled with different
        versions); None means every response token has ``policy_version``
        (:meth:`token_versions`).
      prompt_roles: optional, one entry per prompt token: the role of the message whose BODY
        the token is (e.g. "tool", "user"), None for template scaffolding; the rollout records
        it from the renderer, and the echo algorithm reads it (:mod:`rljax.data.echo`).
      routed_experts: optional, MoE router replay (R3): int ``[num_tokens - 1, num_moe_layers,
        top_k]`` with ``num_tokens = len(prompt_ids) + len(response_ids)`` (vLLM's layout): row p
        holds the experts the sampler routed token p to in each MoE layer (the last token was
        never processed). SkyRL's ``rollout_expert_indices``.
      response_support_floors: optional, one float per response token: the support floor of its
        top-k / top-p draw (the token was drawn from the temperature-scaled logits ``z >= floor``;
        ``-inf``: from the whole distribution). The trainer renormalizes its logprobs over the same
        support (``Completion.support_floors``); None: every token was drawn from the whole
        distribution.
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    trajectory_id: TrajectoryID
    loss_mask: Sequence[int] | None = None
    response_logprobs: Sequence[float] | None = None
    reward: Reward = 0.0
    is_last_step: bool = True
    stop_reason: str = "stop"
    env: str = "default"
    algorithm: str = "grpo"
    temperature: float = 1.0
    policy_version: int = 0
    prompt_roles: Sequence[str | None] | None = None
    routed_experts: Any = None
    response_versions: Sequence[int] | None = None
    response_support_floors: Sequence[float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectory_id", TrajectoryID.coerce(self.trajectory_id))
        if self.loss_mask is None:
            object.__setattr__(self, "loss_mask", [1] * len(self.response_ids))

    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    def token_versions(self) -> np.ndarray:
        """int64 ``[len(response_ids)]``: the weight version that sampled each response token."""
        if self.response_versions is None:
            return np.full(len(self.response_ids), int(self.policy_version), np.int64)
        return np.asarray(self.response_versions, np.int64).reshape(len(self.response_versions))

    @property
    def per_token_reward(self) -> bool:
        """Whether ``reward`` is an array over the response tokens (else a scalar)."""
        return not np.isscalar(self.reward) and not isinstance(self.reward, (int, float))

    @property
    def total_reward(self) -> float:
        """Scalar reward: the step reward, or the sum of per-token rewards."""
        return float(np.sum(self.reward)) if self.per_token_reward else float(self.reward)

    def replace(self, **changes: Any) -> Step:
        """A copy with the given fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def _register_dataclass(cls):
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Fixed-shape ``[rows, seq_len]`` per-token arrays (design §2.6). A jax pytree.

    ``segment_ids`` is 0 on padding and 1..k for the k samples in a row; ``positions``
    restart at 0 for each sample; ``sample_index`` is a global sample id (0 on
    padding, where loss_mask is 0) used for sequence-level math across rows;
    ``group_index`` is the dense prompt-group id of that sample. ``old_logprobs``
    are the trainer's logprobs before this batch's first update (equal to
    ``inference_logprobs`` until the trainer recomputes them: ``trainer.old_logprobs``). Entry ``t`` of the
    per-token streams refers to predicting ``tokens[t]`` from ``tokens[<t]``: the
    loss mask is 0 on prompt tokens and padding. ``routed_experts`` (MoE router replay, or None):
    int32 ``[rows, seq_len, num_moe_layers, top_k]``, the experts the sampler routed each token to,
    -1 where none was recorded (padding, the last token of a sample). ``token_rewards`` (PPO, or
    None): float32 rewards per token (a step's reward on its last response token), 0 elsewhere.
    ``token_versions``: int32 policy (weight) version that sampled each response token
    (:meth:`Step.token_versions`), 0 on prompt tokens and padding; None for batches built by hand.
    ``token_staleness`` (or None): int32 ``trained_version - token_versions`` on response tokens, 0
    elsewhere, set by the trainer for the version it trains
    (:func:`rljax.data.pack.with_token_staleness`); the off-policy correction's staleness mask reads it.
    ``support_floors`` (or None): float32 top-k / top-p support floor of each response token
    (``Step.response_support_floors``), ``-inf`` elsewhere; the trainer renormalizes each token's
    logprob over the logits ``z >= floor`` (the support the sampler drew it from). None when no
    sample of the batch was drawn from a truncated distribution.
    ``kl_reference_logprobs`` (or None): float32 logprobs of the loss tokens (0 elsewhere: the penalty
    reads no other) under the frozen reference policy of the objective's KL penalty
    (``objective.kl_loss_coef``), set by the trainer. (Not to be
    confused with ``ref_logprobs``: the teacher of the ``ref_kl`` distillation component.)

    Prefix-tree rows (``rljax.data.pack.pack(..., prefix_sharing=True)``; None for plain rows): samples
    that share a prompt prefix are laid out as a tree in depth-first order, each shared token once.
    ``parents``: int32 column of each token's parent in its row (-1 at a tree's root and on padding):
    entry ``t`` of every per-token stream then refers to predicting ``tokens[t]`` from its ancestors,
    from the hidden state at ``parents[t]``. ``subtree_end``: int32 column of the last token of each
    token's subtree (``j`` is an ancestor of ``i`` iff ``j <= i <= subtree_end[j]``; 0 on padding).
    ``positions`` are depths; ``segment_ids`` name the sample that owns each token (a shared token
    belongs to the first sample through it, and every token of a sample that no earlier sample
    shares, its response included, is one contiguous run of its segment).
    """

    tokens: Any
    positions: Any
    segment_ids: Any
    sample_index: Any
    group_index: Any
    loss_mask: Any
    advantages: Any
    inference_logprobs: Any
    old_logprobs: Any
    ref_logprobs: Any
    temperatures: Any
    rl_weights: Any
    ce_weights: Any
    ref_kl_weights: Any
    routed_experts: Any = None
    token_rewards: Any = None
    token_versions: Any = None
    token_staleness: Any = None
    kl_reference_logprobs: Any = None
    support_floors: Any = None
    parents: Any = None
    subtree_end: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """``(rows, seq_len)`` of the packed tokens."""
        return tuple(np.shape(self.tokens))

    def replace(self, **changes: Any) -> PackedBatch:
        """A copy with the given fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
