"""Host-side validation of step batches (design §2.2).

Every rule violation raises ``ValueError`` with a message that names the field, the step
index and the trajectory, e.g. ``"step 3 (trajectory q7#1): loss_mask has 5 entries but
response_ids has 6"``. Nothing is dropped or repaired silently. The only soft rule is an
all-zero loss mask over the whole batch, which emits :class:`AllMaskedWarning` and shows up
as ``all_masked`` in :func:`batch_metrics`.

Per-token checks are vectorised: each step's lists are converted once with numpy, the
arrays of a field are concatenated, checked in one pass, and a failing token is mapped back
to its step with ``searchsorted`` over the step offsets.

Decisions design §2.2 leaves open:
  * an empty ``response_ids`` is allowed (an aborted turn that produced no token trains
    nothing); an empty ``prompt_ids`` is an error (an engine never samples from nothing).
  * ``loss_mask`` entries may be ints or bools but must be 0/1; token ids must be ints
    (Python or numpy), bools and floats are rejected even when they hold integral values.
  * rewards, logprobs and temperatures must be real numbers, not bools.
  * an empty batch is valid and does not warn.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax.types import Step, TrajectoryID

__all__ = [
    "AllMaskedWarning",
    "batch_metrics",
    "check_generator_output",
    "validate_steps",
]

_NONFINITE = "NaN/inf is an error, not a zero"
_GENERATOR_REQUIRED = ("prompt_token_ids", "response_ids", "rewards", "loss_masks")
_GENERATOR_OPTIONAL = (
    "stop_reasons",
    "rollout_logprobs",
    "trajectory_ids",
    "is_last_step",
    "rollout_expert_indices",
)


class AllMaskedWarning(UserWarning):
    """The batch has no trainable token (every loss mask entry is 0)."""


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------
def _where(i: int, tid: Any) -> str:
    return f"step {i} (trajectory {tid})"


def _is_real(x: Any) -> bool:
    """True for Python/numpy ints and floats; False for bools, strings, None, arrays."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_int_type(t: type) -> bool:
    return issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))


def _is_token_list(x: Any) -> bool:
    return isinstance(x, (list, tuple, np.ndarray)) and not (isinstance(x, np.ndarray) and x.ndim != 1)


_INT_TYPES = frozenset(
    {int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64}
)


def _to_array(values: Any, field: str, where: str, kinds: str) -> np.ndarray:
    """Converts one per-token list to a 1-D array whose dtype kind is in ``kinds``."""
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise ValueError(
            f"{where}: {field} must be a list of numbers (one per token), got {type(values).__name__}"
        )
    if len(values) == 0:
        return np.zeros((0,), np.int64 if "f" not in kinds else np.float64)
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"{where}: {field} could not be read as a flat list of numbers ({e})") from e
    if arr.ndim != 1:
        raise ValueError(f"{where}: {field} must be a flat list (one entry per token), got shape {arr.shape}")
    if arr.dtype.kind not in kinds:
        wanted = {"iu": "ints", "iub": "ints 0/1 (or bools)", "iuf": "real numbers"}[kinds]
        raise ValueError(
            f"{where}: {field} must hold {wanted}, got dtype {arr.dtype} "
            f"(first entry {values[0]!r} of type {type(values[0]).__name__})"
        )
    return arr


def _check_id_types(values: Any, field: str, where: str) -> None:
    """Rejects bools hidden among ints (numpy silently converts ``[1, True]`` to ints)."""
    if isinstance(values, np.ndarray):
        return
    types = set(map(type, values))
    if types <= _INT_TYPES:
        return
    bad_types = {t for t in types if t not in _INT_TYPES and not _is_int_type(t)}
    if bad_types:
        bad = next(v for v in values if type(v) in bad_types)
        raise ValueError(
            f"{where}: {field} must hold ints (token ids); found {bad!r} of type {type(bad).__name__}"
        )


_ROLE_TYPES = frozenset({str, type(None)})


def _check_prompt_roles(roles: Any, num_prompt: int, where: str) -> None:
    """``prompt_roles``: None, or one ``str | None`` entry per prompt token."""
    if isinstance(roles, (str, bytes)) or not isinstance(roles, (list, tuple, np.ndarray)):
        raise ValueError(
            f"{where}: prompt_roles must be None or a list with one role (str or None) per prompt "
            f"token, got {type(roles).__name__}"
        )
    if len(roles) != num_prompt:
        raise ValueError(
            f"{where}: prompt_roles has {len(roles)} entries but prompt_ids has {num_prompt}; "
            "give one role per prompt token (None for template scaffolding)"
        )
    if set(map(type, roles)) <= _ROLE_TYPES:
        return
    hit = next(((k, v) for k, v in enumerate(roles) if not (v is None or isinstance(v, str))), None)
    if hit is None:  # str subclasses (e.g. numpy strings)
        return
    pos, bad = hit
    raise ValueError(
        f"{where}: prompt_roles[{pos}] = {bad!r} of type {type(bad).__name__}; entries must be a role "
        "name (str) or None"
    )


def _check_routed_experts(
    routed: Any, num_tokens: int, where: str, expected: tuple[int, int] | None
) -> tuple[int, int]:
    """``routed_experts``: ints ``>= 0`` of shape ``[num_tokens - 1, layers, top_k]``, the same
    ``(layers, top_k)`` on every step of the batch; returns ``(layers, top_k)``."""
    a = np.asarray(routed)
    if a.ndim != 3 or a.shape[0] != num_tokens - 1 or a.dtype.kind not in "iu":
        raise ValueError(
            f"{where}: routed_experts must be ints of shape [num_tokens - 1, num_moe_layers, top_k] = "
            f"[{num_tokens - 1}, L, k] (prompt + response tokens, minus the last), got "
            f"{a.dtype.name}{list(a.shape)}"
        )
    if a.size and a.min() < 0:
        raise ValueError(f"{where}: routed_experts has a negative expert id {int(a.min())}")
    if expected is not None and a.shape[1:] != expected:
        raise ValueError(
            f"{where}: routed_experts has (layers, top_k) = {a.shape[1:]}, other steps have {expected}"
        )
    return a.shape[1], a.shape[2]


class _Flat:
    """Concatenation of one per-token field over steps, with the owning step of each token."""

    def __init__(self, arrays: list[np.ndarray], owners: list[int], dtype: Any) -> None:
        self.owners = owners
        lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros((0,), dtype)

    def locate(self, flat_index: int) -> tuple[int, int]:
        """(step index, token position within that step) of a flat token index."""
        k = int(np.searchsorted(self.offsets, flat_index, side="right")) - 1
        return self.owners[k], flat_index - int(self.offsets[k])

    def first(self, bad: np.ndarray) -> tuple[int, int, Any] | None:
        idx = np.flatnonzero(bad)
        if idx.size == 0:
            return None
        step, pos = self.locate(int(idx[0]))
        return step, pos, self.values[idx[0]].item()


# --------------------------------------------------------------------------------------
# validate_steps
# --------------------------------------------------------------------------------------
def validate_steps(steps: Sequence[Step], *, vocab_size: int | None = None) -> None:
    """Checks every rule of design §2.2 on a sequence of steps; raises ``ValueError`` on a violation.

    Rules: each Step's per-token lists (``loss_mask``, per-token ``reward``,
    ``response_logprobs``) have ``len(response_ids)`` entries; token ids are ints in
    ``[0, vocab_size)`` (``>= 0`` when the vocabulary is unknown); loss mask entries are 0/1;
    logprobs are finite and ``<= 0``; rewards are finite and either all scalars or all
    per-token; ``temperature`` is finite and ``> 0``; the prompt is non-empty; ``prompt_roles``
    is None or has one ``str | None`` entry per prompt token; each trajectory
    has exactly one ``is_last_step=True`` and it is its final step in list order (steps of
    different trajectories may interleave). An all-zero loss mask over a non-empty batch
    emits :class:`AllMaskedWarning` instead of raising.

    Args:
      steps: the steps, in batch order.
      vocab_size: vocabulary size for the token-id range check, or None.

    Raises:
      ValueError: naming the field, the step index and the trajectory of the first violation
        found (per-step structure first, then per-token values, then trajectory structure).

    >>> from rljax.types import Step, TrajectoryID
    >>> s = Step([1, 2], [3, 4], TrajectoryID("q0", 0), loss_mask=[1, 0], reward=1.0)
    >>> validate_steps([s], vocab_size=8)
    >>> try:
    ...     validate_steps([s.replace(loss_mask=[1])])
    ... except ValueError as e:
    ...     print(e)
    step 0 (trajectory q0#0): loss_mask has 1 entries but response_ids has 2
    """
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size <= 0):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence):
        raise ValueError(f"steps must be a sequence of Step, got {type(steps).__name__}")

    tids: list[Any] = []
    routing_shape: tuple[int, int] | None = None
    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    logprob_owner: list[int] = []
    token_rewards: list[np.ndarray] = []
    reward_kind: tuple[bool, int] | None = None  # (per_token, first step index)

    for i, s in enumerate(steps):
        if not isinstance(s, Step):
            raise ValueError(f"step {i}: expected an rljax.types.Step, got {type(s).__name__}")
        tid = _checked_trajectory_id(i, s)
        w = _where(i, tid)
        tids.append(tid)

        p, r, routing_shape = _checked_token_ids(s, w, routing_shape)
        n = r.shape[0]
        prompts.append(p)
        responses.append(r)

        # per-token companions ----------------------------------------------------------
        m = _to_array(s.loss_mask, "loss_mask", w, "iub")
        if m.shape[0] != n:
            raise ValueError(f"{w}: loss_mask has {m.shape[0]} entries but response_ids has {n}")
        masks.append(m)
        if s.response_logprobs is not None:
            lp = _to_array(s.response_logprobs, "response_logprobs", w, "iuf")
            if lp.shape[0] != n:
                raise ValueError(f"{w}: response_logprobs has {lp.shape[0]} entries but response_ids has {n}")
            logprobs.append(lp)
            logprob_owner.append(i)

        per_token, reward = _checked_reward(s, w, n)
        if per_token:
            token_rewards.append(reward)
        if reward_kind is None:
            reward_kind = (per_token, i)
        elif reward_kind[0] != per_token:
            first = reward_kind[1]
            raise ValueError(
                f"{w}: reward is {'per-token' if per_token else 'a scalar'} but step {first} "
                f"(trajectory {tids[first]}) has "
                f"{'per-token rewards' if reward_kind[0] else 'a scalar reward'}; "
                "rewards must be all scalars or all per-token"
            )

        _check_step_scalars(s, w)

    owners = list(range(len(tids)))
    _check_token_values(_Flat(prompts, owners, np.int64), "prompt_ids", tids, vocab_size)
    _check_token_values(_Flat(responses, owners, np.int64), "response_ids", tids, vocab_size)

    mask_flat = _check_companion_values(masks, logprobs, logprob_owner, token_rewards, tids)

    _check_trajectories(steps, tids)

    if tids and not np.any(mask_flat.values):
        warnings.warn(
            f"every loss_mask entry of the batch ({len(tids)} steps) is 0: this batch trains nothing "
            "(metric all_masked=True)",
            AllMaskedWarning,
            stacklevel=2,
        )


def _checked_token_ids(
    s: Step, w: str, routing_shape: tuple[int, int] | None
) -> tuple[np.ndarray, np.ndarray, tuple[int, int] | None]:
    """A step's prompt and response ids as arrays, their structure checked (a non-empty prompt,
    integer ids, ``prompt_roles`` and ``routed_experts`` matching them); and the routing shape the
    batch's steps must share (the first step with routing sets it)."""
    p = _to_array(s.prompt_ids, "prompt_ids", w, "iu")
    if p.shape[0] == 0:
        raise ValueError(f"{w}: prompt_ids is empty; every turn needs the prompt tokens the engine received")
    _check_id_types(s.prompt_ids, "prompt_ids", w)
    if s.prompt_roles is not None:
        _check_prompt_roles(s.prompt_roles, p.shape[0], w)
    r = _to_array(s.response_ids, "response_ids", w, "iu")
    _check_id_types(s.response_ids, "response_ids", w)
    if s.routed_experts is not None:
        routing_shape = _check_routed_experts(s.routed_experts, p.shape[0] + r.shape[0], w, routing_shape)
    return p, r, routing_shape


def _checked_trajectory_id(i: int, s: Step) -> TrajectoryID:
    """Step ``i``'s trajectory id, checked: a TrajectoryID of a non-empty str and an int >= 0."""
    tid = s.trajectory_id
    if not isinstance(tid, TrajectoryID):
        raise ValueError(f"step {i}: trajectory_id must be a TrajectoryID, got {tid!r}")
    if not isinstance(tid.instance_id, str) or not _is_int(tid.repetition_id):
        raise ValueError(
            f"{_where(i, tid)}: trajectory_id needs instance_id: str and repetition_id: int, "
            f"got {tid!r}; build it with TrajectoryID.coerce"
        )
    if not tid.instance_id or tid.repetition_id < 0:
        raise ValueError(
            f"{_where(i, tid)}: trajectory_id needs a non-empty instance_id and a repetition_id >= 0, "
            f"got {tid!r}"
        )
    return tid


def _checked_reward(s: Step, w: str, n: int) -> tuple[bool, np.ndarray | float]:
    """``(per_token, reward)``: the step's reward, checked: one finite real, or one real per response
    token (their finiteness is checked on the whole batch at once)."""
    per_token = isinstance(s.reward, (list, tuple)) or (
        isinstance(s.reward, np.ndarray) and s.reward.ndim > 0
    )
    if per_token:
        rw = _to_array(s.reward, "reward", w, "iuf")
        if rw.shape[0] != n:
            raise ValueError(f"{w}: reward is per-token with {rw.shape[0]} entries but response_ids has {n}")
        return True, rw
    else:
        rv = s.reward.item() if isinstance(s.reward, np.ndarray) else s.reward
        if not _is_real(rv):
            raise ValueError(
                f"{w}: reward must be a real number or a list with one per response token, "
                f"got {s.reward!r} of type {type(s.reward).__name__}"
            )
        if not math.isfinite(rv):
            raise ValueError(f"{w}: reward is {rv}; rewards must be finite ({_NONFINITE})")
        return False, float(rv)


def _check_step_scalars(s: Step, w: str) -> None:
    """The per-step fields: ``is_last_step``, ``stop_reason``, ``env``, ``algorithm``, ``temperature``,
    ``policy_version`` and the optional per-token versions and support floors."""
    if not isinstance(s.is_last_step, (bool, np.bool_)):
        raise ValueError(f"{w}: is_last_step must be a bool, got {s.is_last_step!r}")
    if not isinstance(s.stop_reason, str):
        raise ValueError(f"{w}: stop_reason must be a str (e.g. 'stop', 'length'), got {s.stop_reason!r}")
    if not isinstance(s.env, str) or not s.env:
        raise ValueError(f"{w}: env must be a non-empty str, got {s.env!r}")
    if not isinstance(s.algorithm, str) or not s.algorithm:
        raise ValueError(f"{w}: algorithm must be a non-empty str, got {s.algorithm!r}")
    t = s.temperature
    if not _is_real(t) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"{w}: temperature must be a finite number > 0, got {t!r}")
    if not _is_int(s.policy_version) or s.policy_version < 0:
        raise ValueError(f"{w}: policy_version must be an int >= 0, got {s.policy_version!r}")
    if s.response_versions is not None:
        _check_response_versions(s, w)
    if s.response_support_floors is not None:
        _check_support_floors(s, w)


def _check_companion_values(
    masks: list[np.ndarray],
    logprobs: list[np.ndarray],
    logprob_owner: list[int],
    token_rewards: list[np.ndarray],
    tids: list[Any],
) -> _Flat:
    """The batch's loss masks are 0/1, its logprobs finite and <= 0, its per-token rewards finite
    (one vectorized pass each; the first violation raises); returns the flat loss mask."""
    owners = list(range(len(tids)))
    mask_flat = _Flat(masks, owners, np.int64)
    hit = mask_flat.first((mask_flat.values != 0) & (mask_flat.values != 1))
    if hit is not None:
        i, pos, v = hit
        raise ValueError(f"{_where(i, tids[i])}: loss_mask[{pos}] = {v}; loss mask entries must be 0 or 1")

    lp_flat = _Flat(logprobs, logprob_owner, np.float64)
    hit = lp_flat.first(~np.isfinite(lp_flat.values))
    if hit is not None:
        i, pos, v = hit
        raise ValueError(f"{_where(i, tids[i])}: response_logprobs[{pos}] = {v}; logprobs must be finite")
    hit = lp_flat.first(lp_flat.values > 0)
    if hit is not None:
        i, pos, v = hit
        raise ValueError(
            f"{_where(i, tids[i])}: response_logprobs[{pos}] = {v} > 0; a log-probability is <= 0 "
            "(pass logprobs, not probabilities or logits)"
        )

    if token_rewards:
        rw_flat = _Flat(token_rewards, owners, np.float64)
        hit = rw_flat.first(~np.isfinite(rw_flat.values))
        if hit is not None:
            i, pos, v = hit
            raise ValueError(
                f"{_where(i, tids[i])}: reward[{pos}] = {v}; rewards must be finite ({_NONFINITE})"
            )
    return mask_flat


def _check_response_versions(s: Step, where: str) -> None:
    """Per-token versions: one int >= 0 per response token, the oldest equal to policy_version."""
    versions = list(s.response_versions)
    if len(versions) != len(s.response_ids):
        raise ValueError(
            f"{where}: response_versions has {len(versions)} entries, response_ids {len(s.response_ids)}"
        )
    if not all(_is_int(v) and v >= 0 for v in versions):
        raise ValueError(f"{where}: response_versions must be ints >= 0")
    if versions and min(versions) != s.policy_version:
        raise ValueError(
            f"{where}: policy_version ({s.policy_version}) must be the oldest of response_versions "
            f"({min(versions)})"
        )


def _check_support_floors(s: Step, where: str) -> None:
    """Support floors: one float per response token, each finite or ``-inf`` (nothing cut)."""
    floors = list(s.response_support_floors)
    if len(floors) != len(s.response_ids):
        raise ValueError(
            f"{where}: response_support_floors has {len(floors)} entries, response_ids {len(s.response_ids)}"
        )
    if not all(_is_real(x) and (math.isfinite(x) or x == -math.inf) for x in floors):
        raise ValueError(f"{where}: response_support_floors must be finite floats or -inf (nothing cut)")


def _check_token_values(flat: _Flat, field: str, tids: list[Any], vocab_size: int | None) -> None:
    hit = flat.first(flat.values < 0)
    if hit is not None:
        i, pos, v = hit
        raise ValueError(f"{_where(i, tids[i])}: {field}[{pos}] = {v} is negative; token ids must be >= 0")
    if vocab_size is not None:
        hit = flat.first(flat.values >= vocab_size)
        if hit is not None:
            i, pos, v = hit
            raise ValueError(
                f"{_where(i, tids[i])}: {field}[{pos}] = {v} is out of range; token ids must be in "
                f"[0, vocab_size={vocab_size}) (wrong tokenizer or vocab_size?)"
            )


def _check_trajectories(steps: Sequence[Step], tids: list[Any]) -> None:
    """Exactly one ``is_last_step`` per trajectory, on its final step in list order."""
    final: dict[Any, int] = {}
    flagged: dict[Any, int] = {}
    for i, (s, tid) in enumerate(zip(steps, tids, strict=True)):
        final[tid] = i
        if s.is_last_step:
            if tid in flagged:
                raise ValueError(
                    f"{_where(i, tid)}: is_last_step=True, but step {flagged[tid]} of the same trajectory "
                    "is already its last step; each trajectory needs exactly one is_last_step=True"
                )
            flagged[tid] = i
    for tid, last in final.items():
        if tid not in flagged:
            raise ValueError(
                f"{_where(last, tid)}: is_last_step is False on every step of trajectory {tid}; "
                "its final step (this one) must have is_last_step=True"
            )
        if flagged[tid] != last:
            raise ValueError(
                f"{_where(flagged[tid], tid)}: is_last_step=True but step {last} of the same trajectory "
                "comes later in the batch; only a trajectory's final step may be its last step"
            )


# --------------------------------------------------------------------------------------
# SkyRL GeneratorOutput dicts
# --------------------------------------------------------------------------------------
def check_generator_output(d: Mapping[str, Any]) -> int:
    """Checks the structure of a SkyRL-style ``GeneratorOutput`` dict; returns its number of rows.

    Required keys: ``prompt_token_ids, response_ids, rewards, loss_masks`` (lists with one
    entry per step); optional keys ``stop_reasons, rollout_logprobs, trajectory_ids,
    is_last_step`` may be absent or None. Every list-valued key (known or not, e.g.
    ``rollout_expert_indices``) must have one entry per row. Row entries must have the right
    shape (token lists are lists, rewards scalars or lists, trajectory ids coercible to
    :class:`~rljax.types.TrajectoryID`, ``is_last_step`` bools, stop reasons strings). The
    values themselves are checked afterwards by :func:`validate_steps`.

    >>> d = {"prompt_token_ids": [[1, 2]], "response_ids": [[3]], "rewards": [1.0], "loss_masks": [[1]]}
    >>> check_generator_output(d)
    1
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"generator output must be a dict, got {type(d).__name__}")
    missing = [k for k in _GENERATOR_REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(
            f"generator output is missing required key(s) {missing}; it needs {list(_GENERATOR_REQUIRED)}"
        )
    for k, v in d.items():
        if v is None or isinstance(v, (Mapping, str, bytes)) or np.isscalar(v):
            if k in _GENERATOR_REQUIRED or (k in _GENERATOR_OPTIONAL and v is not None):
                raise ValueError(
                    f"generator output field {k} must be a list with one entry per step, got {v!r}"
                )
    n = len(d["prompt_token_ids"])

    traj = d.get("trajectory_ids")
    tids: list[Any] = [f"{i}#0" for i in range(n)]  # the default ids from_generator_output assigns
    if traj is not None:
        _check_rows(d, "trajectory_ids", n, tids)
        for i in range(n):
            try:
                tids[i] = TrajectoryID.coerce(traj[i])
            except (ValueError, TypeError) as e:
                raise ValueError(f"step {i}: trajectory_ids entry {traj[i]!r} is invalid: {e}") from e

    for k, v in d.items():
        if isinstance(v, (list, tuple, np.ndarray)) and k != "trajectory_ids":
            _check_rows(d, k, n, tids)

    for i in range(n):
        w = _where(i, tids[i])
        for k in ("prompt_token_ids", "response_ids", "loss_masks"):
            if not _is_token_list(d[k][i]):
                raise ValueError(f"{w}: {k} entry must be a flat list of ints, got {d[k][i]!r}")
        rw = d["rewards"][i]
        if not (_is_token_list(rw) or np.isscalar(rw)):
            raise ValueError(
                f"{w}: rewards entry must be a number or a list of per-token numbers, got {rw!r}"
            )
        lp = d.get("rollout_logprobs")
        if lp is not None and lp[i] is not None and not _is_token_list(lp[i]):
            raise ValueError(
                f"{w}: rollout_logprobs entry must be None or a flat list of floats, got {lp[i]!r}"
            )
        last = d.get("is_last_step")
        if last is not None and not isinstance(last[i], (bool, np.bool_)):
            raise ValueError(f"{w}: is_last_step entry must be a bool, got {last[i]!r}")
        stops = d.get("stop_reasons")
        if stops is not None and not isinstance(stops[i], str):
            raise ValueError(f"{w}: stop_reasons entry must be a str, got {stops[i]!r}")
    return n


def _check_rows(d: Mapping[str, Any], key: str, n: int, tids: list[Any]) -> None:
    m = len(d[key])
    if m == n:
        return
    if m < n:
        detail = f"step {m} (trajectory {tids[m]}) has no {key} entry"
    else:
        detail = f"step {n} has a {key} entry but no prompt_token_ids entry"
    raise ValueError(
        f"generator output field {key} has {m} entries but prompt_token_ids has {n}: {detail}; "
        "every per-step list needs exactly one entry per step"
    )


# --------------------------------------------------------------------------------------
# metrics and config-time checks
# --------------------------------------------------------------------------------------
def batch_metrics(steps: Sequence[Step]) -> dict[str, float | int | bool]:
    """Counts of a (validated) batch: steps, trajectories, groups, tokens and the all-masked flag.

    ``trainable_tokens`` counts loss-mask ones; ``all_masked`` is True when a non-empty batch
    has none (the soft rule of design §2.2).

    >>> from rljax.types import Step, TrajectoryID
    >>> m = batch_metrics([Step([1], [2, 3], TrajectoryID("q", 0), loss_mask=[0, 0])])
    >>> m["num_steps"], m["trainable_tokens"], m["all_masked"]
    (1, 0, True)
    """
    tids = [s.trajectory_id for s in steps]
    prompt_tokens = sum(len(s.prompt_ids) for s in steps)
    response_tokens = sum(len(s.response_ids) for s in steps)
    trainable = int(sum(np.count_nonzero(np.asarray(s.loss_mask)) for s in steps if len(s.loss_mask)))
    return {
        "num_steps": len(tids),
        "num_trajectories": len(set(tids)),
        "num_groups": len({t.instance_id for t in tids}),
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
        "trainable_tokens": trainable,
        "trainable_fraction": trainable / response_tokens if response_tokens else 0.0,
        "all_masked": bool(tids) and trainable == 0,
    }
