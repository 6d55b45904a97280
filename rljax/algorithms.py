"""Named algorithms (design §3.6): a registry of data-only recipes and their config-time rules.

An :class:`Algorithm` says which advantage estimator (design §3.1) and policy loss (§3.2) an
algorithm uses, which loss component the sampled action tokens feed (``rl``, ``ref_kl`` or
``ce``, §3.3/§3.5), what happens to observation tokens (echo: cross-entropy on the tokens of
configured roles, one weight per role), where samples come from (the live ``policy`` or a
``frozen`` model) and what the run must provide (a value head, a teacher endpoint,
demonstrations). It holds no code: the trainer reads these fields. Estimator and policy-loss
names, their hyperparameters and the estimator rules (group-relative or token-level, critic)
come from the registries of :mod:`rljax.core.advantages` and :mod:`rljax.core.losses`, so an
estimator or loss registered there is accepted here like a built-in one.

Built-in entries:

======== ======== ========= ==================================================================
name     sampling component notes
======== ======== ========= ==================================================================
grpo     policy   rl        grpo(norm_by_std=False) + dppo (the default), optional length penalty
max_rl   policy   rl        max_rl + dppo
rloo     policy   rl        rloo + dppo
ppo      policy   rl        gae + ppo_clip with a learned critic (rljax.training.critic), per-step rewards
opd      policy   ref_kl    needs a frozen teacher endpoint (``teacher="policy"`` is rejected)
opsd     policy   ref_kl    teacher = live policy scored on the demonstration-conditioned prompt
sft      frozen   ce        samples from a frozen model; sampling from the policy is rejected
echo     policy   rl + ce   grpo + ce on observation tokens, alpha per role (default tool=0.1)
======== ======== ========= ==================================================================

:func:`validate_algorithm_config` enforces the run-time rules (each violation a ``ValueError``
saying what to change) and resolves per-env overrides, so one run can train env A with grpo and
env B with echo.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from rljax.core import advantages as core_advantages
from rljax.core import losses as core_losses
from rljax.core.advantages import REWARD_MODES, check_estimator_reward_mode

__all__ = [
    "ACTION_COMPONENTS",
    "SAMPLING_SOURCES",
    "Algorithm",
    "AlgorithmConfig",
    "FrozenMapping",
    "LengthPenalty",
    "get_algorithm",
    "list_algorithms",
    "register_algorithm",
    "validate_algorithm",
    "validate_algorithm_config",
]

#: Loss components the action (sampled) tokens can feed (design §3.5).
ACTION_COMPONENTS: tuple[str, ...] = ("rl", "ref_kl", "ce")
#: Where rollouts are sampled from.
SAMPLING_SOURCES: tuple[str, ...] = ("policy", "frozen")
_POLICY_TEACHER = "policy"


class FrozenMapping(Mapping[str, Any]):
    """A read-only, hashable, picklable ``str -> value`` mapping (keeps Algorithm immutable).

    >>> m = FrozenMapping({"norm_by_std": False})
    >>> m["norm_by_std"], dict(m) == {"norm_by_std": False}
    (False, True)
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items())))

    def __repr__(self) -> str:
        return repr(self._data)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenMapping is read-only")

    def __getstate__(self) -> dict[str, Any]:
        return self._data

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_data", dict(state))


def _finite_nonneg(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


@dataclasses.dataclass(frozen=True)
class LengthPenalty:
    """prime-rl "linear" length shaping of the grpo family (design §3.1).

    ``frac_i = w_out*out_i/max(out) + w_in*in_i/max(in) + w_turn*turns_i/max(turns)`` (maxima
    floored at 1), ``shaped_i = r_i - mean(r)*frac_i``, ``A_i = shaped_i - mean(shaped)``.

    >>> LengthPenalty().w_out
    0.25
    """

    w_out: float = 0.25
    w_in: float = 0.1
    w_turn: float = 0.1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not _finite_nonneg(v):
                raise ValueError(f"LengthPenalty.{f.name} must be a finite number >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One named algorithm: data only, read by the trainer (design §3.6).

    Attributes:
      name: registry key (also the value of ``Step.algorithm``).
      action_component: loss component of the sampled (action) tokens: "rl", "ref_kl" or "ce".
      estimator: a registered advantage estimator (design §3.1,
        :func:`rljax.core.advantages.register_estimator`) for "rl"; None otherwise.
      estimator_kwargs: its keyword hyperparameters.
      policy_loss: a registered per-token policy loss (design §3.2,
        :func:`rljax.core.losses.register_policy_loss`) for "rl"; None otherwise.
      policy_loss_kwargs: its keyword hyperparameters (and input choices, e.g. cispo's ``behavior``).
      observation_ce: role -> alpha; observation tokens of these roles get ce weight alpha.
      sampling: "policy" (the model being trained) or "frozen" (a fixed model).
      teacher: the frozen model this algorithm learns from, by name (a key of the run's
        ``config.frozen_models``) or base URL: the ref_kl teacher that scores samples (opd), or the
        sampler whose samples ce trains on (sft); ``"policy"`` = the live policy (opsd).
      observation_filter: echo only: ``"module:function"`` narrowing the observation tokens; called
        as ``fn(sample: Step, candidates: bool[n]) -> bool[n]`` per merged sample.
      needs_demonstrations: prompts come with demonstrations (opsd conditions on them).
      length_penalty: optional prime-rl length shaping (group-relative estimators only).
      reward_mode: "outcome" (design §2.3) or "per_step" (§2.4).
      step_wise: one sample per turn (True) or one sample per trajectory (False).

    >>> a = Algorithm("mine", action_component="rl", estimator="rloo", policy_loss="cispo")
    >>> a.group_relative, a.needs_critic, a.components
    (True, False, ('rl',))
    """

    name: str
    action_component: str = "rl"
    estimator: str | None = "grpo"
    estimator_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=FrozenMapping)
    policy_loss: str | None = "dppo"
    policy_loss_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=FrozenMapping)
    observation_ce: Mapping[str, float] = dataclasses.field(default_factory=FrozenMapping)
    sampling: str = "policy"
    teacher: str | None = None
    observation_filter: str | None = None
    needs_demonstrations: bool = False
    length_penalty: LengthPenalty | None = None
    reward_mode: str = "outcome"
    step_wise: bool = True

    def __post_init__(self) -> None:
        for f in ("estimator_kwargs", "policy_loss_kwargs", "observation_ce"):
            v = getattr(self, f)
            if hasattr(v, "to_dict"):  # ml_collections.ConfigDict
                v = v.to_dict()
            if not isinstance(v, Mapping):
                raise ValueError(f"algorithm {self.name!r}: {f} must be a mapping, got {v!r}")
            object.__setattr__(self, f, FrozenMapping(v))
        self._check_fields()

    def _check_fields(self) -> None:
        """Type/name checks that hold for any use of the algorithm (run rules: validate_algorithm)."""
        p = f"algorithm {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"algorithm name must be a non-empty str, got {self.name!r}")
        if self.action_component not in ACTION_COMPONENTS:
            raise ValueError(
                f"{p}: action_component must be one of {list(ACTION_COMPONENTS)}, "
                f"got {self.action_component!r}"
            )
        if self.sampling not in SAMPLING_SOURCES:
            raise ValueError(f"{p}: sampling must be one of {list(SAMPLING_SOURCES)}, got {self.sampling!r}")
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(
                f"{p}: reward_mode must be one of {list(REWARD_MODES)}, got {self.reward_mode!r}"
            )
        _check_estimator(p, self.estimator, self.estimator_kwargs)
        _check_policy_loss(p, self.policy_loss, self.policy_loss_kwargs)
        for role, alpha in self.observation_ce.items():
            if not isinstance(role, str) or not role:
                raise ValueError(f"{p}: observation_ce keys must be role names (str), got {role!r}")
            if not _finite_nonneg(alpha):
                raise ValueError(f"{p}: observation_ce[{role!r}] must be a finite weight >= 0, got {alpha!r}")
        if self.teacher is not None and (not isinstance(self.teacher, str) or not self.teacher):
            raise ValueError(f"{p}: teacher must be None, 'policy' or an endpoint str, got {self.teacher!r}")
        if "assistant" in self.observation_ce:
            raise ValueError(
                f"{p}: observation_ce cannot train role 'assistant': those tokens are the policy's own "
                "actions (they feed the action component); use environment roles such as 'tool' or 'user'"
            )
        if self.observation_filter is not None and (
            not isinstance(self.observation_filter, str) or ":" not in self.observation_filter
        ):
            raise ValueError(
                f"{p}: observation_filter must be a 'module:function' import path, "
                f"got {self.observation_filter!r}"
            )
        if self.length_penalty is not None and not isinstance(self.length_penalty, LengthPenalty):
            raise ValueError(
                f"{p}: length_penalty must be a LengthPenalty or None, got {self.length_penalty!r}"
            )
        for f in ("needs_demonstrations", "step_wise"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{p}: {f} must be a bool, got {getattr(self, f)!r}")

    # Derived needs -------------------------------------------------------------------
    @property
    def components(self) -> tuple[str, ...]:
        """Loss components this algorithm feeds (design §3.5)."""
        extra = ("ce",) if self.observation_ce and self.action_component != "ce" else ()
        return (self.action_component, *extra)

    @property
    def group_relative(self) -> bool:
        """True when the estimator baselines within prompt groups (registered ``kind="group"``:
        grpo, rloo, max_rl, user group estimators)."""
        return self.estimator is not None and core_advantages.is_group_estimator(self.estimator)

    @property
    def needs_critic(self) -> bool:
        """A value head is needed (the registered estimator says so: gae)."""
        return self.estimator is not None and core_advantages.get_estimator(self.estimator).needs_critic

    @property
    def needs_teacher(self) -> bool:
        """A separate frozen teacher endpoint must score the samples (opd)."""
        return self.action_component == "ref_kl" and self.teacher != _POLICY_TEACHER

    @property
    def frozen_model(self) -> str | None:
        """The frozen model (name or URL) the run must reach: opd's teacher, sft's sampler."""
        if self.teacher is None or self.teacher == _POLICY_TEACHER:
            return None
        return self.teacher

    def replace(self, **changes: Any) -> Algorithm:
        """A copy with the given fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def _check_named_kwargs(
    prefix: str, what: str, name: str | None, kwargs: Mapping[str, Any], registered: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """Checks ``name`` against a core registry view and ``kwargs`` against its hyperparameters."""
    if name is None:
        if kwargs:
            raise ValueError(f"{prefix}: {what}_kwargs {dict(kwargs)} given but {what} is None; drop them")
        return None
    if not isinstance(name, str) or name not in registered:
        raise ValueError(f"{prefix}: unknown {what} {name!r}; choose one of {sorted(registered)}")
    accepted = registered[name]
    accepted = accepted.hyperparameters if isinstance(accepted, core_losses.PolicyLoss) else accepted.defaults
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"{prefix}: {what} {name!r} has no hyperparameter(s) {unknown}; "
            f"it accepts {sorted(accepted) or 'none'}"
        )
    return accepted


def _check_estimator(prefix: str, name: str | None, kwargs: Mapping[str, Any]) -> None:
    """``name`` must be registered in :data:`rljax.core.advantages.ESTIMATORS`, kwargs among its own."""
    _check_named_kwargs(prefix, "estimator", name, kwargs, core_advantages.ESTIMATORS)


def _check_policy_loss(prefix: str, name: str | None, kwargs: Mapping[str, Any]) -> None:
    """``name`` must be registered in :data:`rljax.core.losses.POLICY_LOSSES`; kwargs (and choice
    values such as cispo's ``behavior``) are checked by the registration itself."""
    if _check_named_kwargs(prefix, "policy_loss", name, kwargs, core_losses.POLICY_LOSSES) is None:
        return
    try:
        core_losses.validate_policy_loss(name, kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"{prefix}: {e}") from None


# --------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------
_REGISTRY: dict[str, Algorithm] = {}
DEFAULT_ALGORITHM = "grpo"


def register_algorithm(algorithm: Algorithm, *, overwrite: bool = False) -> Algorithm:
    """Adds ``algorithm`` to the registry under ``algorithm.name`` and returns it.

    >>> a = get_algorithm("grpo").replace(name="grpo_std", estimator_kwargs={})
    >>> _ = register_algorithm(a, overwrite=True)
    >>> get_algorithm("grpo_std").estimator_kwargs
    {}
    """
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"register_algorithm expects an Algorithm, got {type(algorithm).__name__}")
    if algorithm.name in _REGISTRY and not overwrite:
        raise ValueError(
            f"algorithm {algorithm.name!r} is already registered; pass overwrite=True to replace it"
        )
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def list_algorithms() -> list[str]:
    """Registered algorithm names, sorted.

    >>> {"grpo", "echo", "sft"} <= set(list_algorithms())
    True
    """
    return sorted(_REGISTRY)


def get_algorithm(name: str = DEFAULT_ALGORITHM, **overrides: Any) -> Algorithm:
    """The registered algorithm ``name`` with fields replaced by ``overrides``.

    Mapping fields (``estimator_kwargs``, ``policy_loss_kwargs``, ``observation_ce``) are
    merged into the registered values (so ``estimator_kwargs={"lam": 0.95}`` keeps gamma),
    except that a changed ``estimator``/``policy_loss`` starts from empty kwargs (the
    registered ones belong to the old function); other fields are replaced.

    >>> get_algorithm("ppo", estimator_kwargs={"lam": 0.95}).estimator_kwargs
    {'gamma': 1.0, 'lam': 0.95}
    >>> get_algorithm("echo", observation_ce={"user": 0.05}).observation_ce
    {'tool': 0.1, 'user': 0.05}
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; registered: {list_algorithms()}")
    base = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(Algorithm)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"algorithm {name!r}: unknown field(s) {unknown}; fields are {sorted(fields)}")
    changes = dict(overrides)
    for f, owner in (
        ("estimator_kwargs", "estimator"),
        ("policy_loss_kwargs", "policy_loss"),
        ("observation_ce", None),
    ):
        if owner is not None and owner in changes and changes[owner] != getattr(base, owner):
            changes.setdefault(f, {})  # a different estimator/loss starts from its own defaults
            continue
        if f in changes and changes[f] is not None:
            v = changes[f].to_dict() if hasattr(changes[f], "to_dict") else changes[f]
            if not isinstance(v, Mapping):
                raise ValueError(f"algorithm {name!r}: {f} must be a mapping, got {v!r}")
            changes[f] = {**getattr(base, f), **v}
    if isinstance(changes.get("length_penalty"), Mapping):
        changes["length_penalty"] = LengthPenalty(**changes["length_penalty"])
    return dataclasses.replace(base, **changes)


def _builtin() -> None:
    grpo = Algorithm("grpo", estimator="grpo", estimator_kwargs={"norm_by_std": False}, policy_loss="dppo")
    for a in (
        grpo,
        Algorithm("max_rl", estimator="max_rl", policy_loss="dppo"),
        Algorithm("rloo", estimator="rloo", policy_loss="dppo"),
        Algorithm(
            "ppo",
            estimator="gae",
            estimator_kwargs={"gamma": 1.0, "lam": 1.0},
            policy_loss="ppo_clip",
            reward_mode="per_step",  # each step's reward on its last token; GAE credits earlier turns
        ),
        Algorithm("opd", action_component="ref_kl", estimator=None, policy_loss=None),
        Algorithm(
            "opsd",
            action_component="ref_kl",
            estimator=None,
            policy_loss=None,
            teacher=_POLICY_TEACHER,
            needs_demonstrations=True,
        ),
        Algorithm("sft", action_component="ce", estimator=None, policy_loss=None, sampling="frozen"),
        grpo.replace(name="echo", observation_ce={"tool": 0.1}),
    ):
        register_algorithm(a, overwrite=True)


_builtin()


# --------------------------------------------------------------------------------------
# config-time validation
# --------------------------------------------------------------------------------------
def validate_algorithm(
    algorithm: Algorithm, *, group_size: int | None = None, env: str | None = None
) -> Algorithm:
    """Enforces the run rules of design §3.6 on one algorithm; returns it unchanged.

    Rules: ``rl``/``ref_kl`` train on the policy's own samples, so they need
    ``sampling="policy"``; ``ce`` on the policy's own samples is rejected (sft needs a frozen
    model); ``rl`` needs an estimator and a policy loss, other components use neither;
    ``ref_kl`` needs a teacher: a frozen endpoint, or ``"policy"`` only together with
    demonstrations (opsd; for opd ``teacher="policy"`` would distil the policy into itself);
    frozen sampling (sft) needs ``teacher`` = the frozen model that samples;
    non-outcome estimators step-wise need ``reward_mode="per_step"`` (so ppo/gae is
    non-step-wise or per-step); a length penalty needs a group-relative estimator; a
    group-relative estimator with ``group_size == 1`` warns (every advantage would be 0).

    >>> validate_algorithm(get_algorithm("opd", teacher="http://teacher:8000"), group_size=8).name
    'opd'
    >>> try:
    ...     validate_algorithm(get_algorithm("sft", sampling="policy"))
    ... except ValueError as e:
    ...     print(str(e)[:51])
    algorithm 'sft': the ce component on samples of the
    """
    if not isinstance(algorithm, Algorithm):
        raise ValueError(f"expected an Algorithm, got {type(algorithm).__name__}")
    a = algorithm
    p = f"algorithm {a.name!r}" + (f" (env {env!r})" if env is not None else "")
    comp = a.action_component
    if comp in ("rl", "ref_kl") and a.sampling != "policy":
        raise ValueError(
            f"{p}: the {comp} component trains on the policy's own samples and needs sampling='policy', "
            f"got sampling={a.sampling!r} (a frozen sampler only suits the ce component, e.g. sft)"
        )
    if comp == "ce" and a.sampling == "policy":
        raise ValueError(
            f"{p}: the ce component on samples of the policy being trained is not sft; sample from a frozen "
            "model (sampling='frozen') or use an rl algorithm"
        )
    if comp == "rl":
        if a.estimator is None or a.policy_loss is None:
            raise ValueError(
                f"{p}: the rl component needs an estimator and a policy_loss, got estimator={a.estimator!r}, "
                f"policy_loss={a.policy_loss!r}"
            )
        try:
            check_estimator_reward_mode(a.estimator, a.reward_mode, a.step_wise)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
    elif a.estimator is not None or a.policy_loss is not None:
        raise ValueError(
            f"{p}: estimator/policy_loss are used by the rl component only; with action_component={comp!r} "
            f"set estimator=None and policy_loss=None (got {a.estimator!r}, {a.policy_loss!r})"
        )
    if comp == "ref_kl":
        if a.teacher is None:
            raise ValueError(
                f"{p}: the ref_kl component needs a teacher: set teacher=<frozen teacher endpoint> (opd), "
                "or teacher='policy' with needs_demonstrations=True (opsd)"
            )
        if a.teacher == _POLICY_TEACHER and not a.needs_demonstrations:
            raise ValueError(
                f"{p}: teacher='policy' without demonstrations distils the policy into itself; opd needs a "
                "frozen teacher endpoint (teacher='http://host:port' or a model name), or use opsd"
            )
    elif a.sampling == "frozen":
        if a.teacher is None or a.teacher == _POLICY_TEACHER:
            raise ValueError(
                f"{p}: sampling='frozen' needs the frozen model that samples: set teacher=<name in "
                f"config.frozen_models or its base URL>, got teacher={a.teacher!r}"
            )
    elif a.teacher is not None:
        raise ValueError(
            f"{p}: teacher={a.teacher!r} is used by the ref_kl component (opd/opsd) and by frozen sampling "
            "(sft) only; set teacher=None"
        )
    if a.observation_ce and comp != "rl":
        raise ValueError(
            f"{p}: observation_ce (echo) adds ce on observation tokens to an rl algorithm; with "
            f"action_component={comp!r} it would be ignored: drop it or use echo"
        )
    if a.observation_filter is not None and not a.observation_ce:
        raise ValueError(f"{p}: observation_filter narrows echo's observation tokens; set observation_ce too")
    if a.length_penalty is not None and not a.group_relative:
        groups = [n for n in core_advantages.list_estimators() if core_advantages.is_group_estimator(n)]
        raise ValueError(
            f"{p}: length_penalty shapes group-relative rewards and needs estimator in {groups} (the "
            f"registered kind='group' estimators), got estimator={a.estimator!r}"
        )
    if group_size is not None:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"{p}: group_size must be an int >= 1, got {group_size!r}")
        if group_size == 1 and comp == "rl" and a.group_relative:
            warnings.warn(
                f"{p}: estimator {a.estimator!r} is group-relative but group_size=1: every advantage is 0 "
                "and nothing trains; raise group_size (samples per prompt)",
                UserWarning,
                stacklevel=2,
            )
    return a


def _as_algorithm(spec: Any, where: str) -> Algorithm:
    if isinstance(spec, Algorithm):
        return spec
    if isinstance(spec, str):
        return get_algorithm(spec)
    if hasattr(spec, "to_dict"):  # ml_collections.ConfigDict
        spec = spec.to_dict()
    if isinstance(spec, Mapping):
        fields = dict(spec)
        if "name" not in fields:
            raise ValueError(f"{where}: an algorithm mapping needs a 'name' key, got keys {sorted(fields)}")
        return get_algorithm(fields.pop("name"), **fields)
    raise ValueError(f"{where}: expected an algorithm name, Algorithm or mapping, got {spec!r}")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """The validated algorithm of a run: a default plus per-env overrides.

    >>> cfg = validate_algorithm_config("grpo", env_overrides={"web": "echo"})
    >>> cfg.for_env("web").name, cfg.for_env("math").name, cfg.names
    ('echo', 'grpo', ('echo', 'grpo'))
    """

    default: Algorithm
    per_env: Mapping[str, Algorithm]

    def for_env(self, env: str) -> Algorithm:
        """The algorithm that trains steps of ``env``."""
        return self.per_env.get(env, self.default)

    @property
    def algorithms(self) -> tuple[Algorithm, ...]:
        """The run's distinct algorithms (the default and the per-env ones), sorted by name."""
        seen: dict[str, Algorithm] = {}
        for a in (self.default, *self.per_env.values()):
            seen.setdefault(a.name, a)
        return tuple(seen[k] for k in sorted(seen))

    @property
    def names(self) -> tuple[str, ...]:
        """The names of :attr:`algorithms`, sorted."""
        return tuple(a.name for a in self.algorithms)

    @property
    def needs_critic(self) -> bool:
        """Whether any of the run's algorithms needs a value model (PPO's GAE)."""
        return any(a.needs_critic for a in (self.default, *self.per_env.values()))

    @property
    def needs_teacher(self) -> bool:
        """Whether any of the run's algorithms scores samples with a frozen model."""
        return any(a.needs_teacher for a in (self.default, *self.per_env.values()))

    @property
    def needs_demonstrations(self) -> bool:
        """Whether any of the run's algorithms reads the tasks' demonstrations."""
        return any(a.needs_demonstrations for a in (self.default, *self.per_env.values()))


def validate_algorithm_config(
    algorithm: Any = DEFAULT_ALGORITHM,
    *,
    env_overrides: Mapping[str, Any] | None = None,
    group_size: int | Mapping[str, int] | None = None,
) -> AlgorithmConfig:
    """Resolves and validates the run's algorithm and its per-env overrides (design §3.6).

    Args:
      algorithm: the default: a registered name, an :class:`Algorithm`, or a mapping /
        ConfigDict ``{"name": ..., **field_overrides}``.
      env_overrides: env name -> algorithm (same forms); steps of that env train with it.
      group_size: samples per prompt, one int for all envs or env name -> int (envs missing
        from the mapping skip the group-size check).

    Returns:
      An :class:`AlgorithmConfig`; each algorithm passed :func:`validate_algorithm`. Two
      different algorithms must not share a name (``Step.algorithm`` identifies them).

    >>> cfg = validate_algorithm_config({"name": "grpo", "estimator_kwargs": {"norm_by_std": True}})
    >>> cfg.default.estimator_kwargs["norm_by_std"]
    True
    """

    sizes = dict(group_size) if isinstance(group_size, Mapping) else None

    def size(env: str | None) -> int | None:
        return group_size if sizes is None else sizes.get(env)  # type: ignore[return-value]

    default = validate_algorithm(_as_algorithm(algorithm, "algorithm"), group_size=size(None))
    per_env: dict[str, Algorithm] = {}
    if env_overrides is not None:
        if hasattr(env_overrides, "to_dict"):
            env_overrides = env_overrides.to_dict()
        if not isinstance(env_overrides, Mapping):
            raise ValueError(f"env_overrides must map env name -> algorithm, got {env_overrides!r}")
        for env, spec in env_overrides.items():
            if not isinstance(env, str) or not env:
                raise ValueError(f"env_overrides keys must be env names (str), got {env!r}")
            a = _as_algorithm(spec, f"env_overrides[{env!r}]")
            per_env[env] = validate_algorithm(a, group_size=size(env), env=env)
    for env in sorted(sizes or {}):
        if env not in per_env:  # envs trained by the default algorithm
            validate_algorithm(default, group_size=size(env), env=env)
    by_name: dict[str, Algorithm] = {}
    for env, a in [(None, default), *per_env.items()]:
        other = by_name.setdefault(a.name, a)
        if other != a:
            raise ValueError(
                f"algorithm {a.name!r} (env {env!r}) differs from another algorithm of the same name in "
                "this run; give the variant its own name (Algorithm.replace(name=...)) so steps can tell "
                "them apart"
            )
    return AlgorithmConfig(default=default, per_env=FrozenMapping(per_env))
