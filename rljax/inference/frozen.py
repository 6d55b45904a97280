"""Frozen models: OpenAI-compatible endpoints that rljax reads from but never launches or updates.

A frozen model is a name plus the base URL(s) of one or more servers that all serve the same fixed
weights (design §3.6: opd's teacher, sft's sampler). rljax uses it in two ways:

- **teacher scoring** (opd): :meth:`FrozenModel.score` is ONE prefill of the exact token ids with
  ``prompt_logprobs`` at temperature 1, returning ``out[t] = log p(ids[t] | ids[:t])`` with
  ``out[0] = 0`` -- the convention of ``rljax.models.sequence_logprobs``, so teacher and student
  logprobs line up token for token (the ``ref_logp`` of ``core.losses.ref_kl``);
- **sampling** (sft): :meth:`FrozenModel.generate` is the token-in / token-out generation of the policy
  engine (exact ids, one logprob each) and satisfies :class:`rljax.inference.engine.Engine`.

The weights never change, so every completion carries ``weight_version = 0`` and is never stale, and
:meth:`FrozenModel.update_weights` raises ``TypeError``. All HTTP, routing over several servers,
bounded concurrency, retries and response parsing are those of
:class:`rljax.inference.vllm.client.VLLMClient`; each frozen model owns its own client (its own
connection pool and concurrency bound), separate from the policy's.

Run config (``config.frozen_models``), parsed by :func:`frozen_models_from_config`::

    frozen_models = {"teacher": {"base_url": "http://127.0.0.1:8001", "model": None}}

``model`` is the OpenAI ``"model"`` field of the requests; ``None`` asks ``GET /v1/models`` once and
uses the first id listed (or the client's default name when the server has no such route).

>>> cfgs = frozen_models_from_config({"teacher": {"base_url": "http://127.0.0.1:8001/v1/"}})
>>> cfgs["teacher"].base_url, cfgs["teacher"].model
(('http://127.0.0.1:8001',), None)
>>> import asyncio
>>> async def main():
...     async with FrozenModel.from_config(cfgs["teacher"]) as teacher:
...         return teacher.weight_version, (await teacher.score([7])).tolist()
>>> asyncio.run(main())  # a 1-token sequence needs no request: log p(first token) is 0 by convention
(0, [0.0])
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import numpy as np

from rljax import knobs
from rljax.inference.engine import Completion, SamplingParams
from rljax.inference.vllm.client import (
    ClientConfig,
    MalformedResponseError,
    RequestRejectedError,
    ServerUnavailableError,
    VLLMClient,
)
from rljax.knobs import knob, knob_from
from rljax.progress import Progress

# A teacher named "policy" means the live policy (opsd, design §3.6), never a frozen endpoint.
RESERVED_NAMES: frozenset[str] = frozenset({"policy"})
# HTTP answers to GET /v1/models that mean "this server has no such route": use the default name.
_NO_MODELS_ROUTE: frozenset[int] = frozenset({404, 405})


def normalize_base_url(url: str) -> str:
    """The canonical base URL of a server: ``http(s)://host[:port][/prefix]`` without ``/`` or ``/v1``.

    Raises ``ValueError`` for anything that is not an absolute http(s) URL with a host (no query or
    fragment): requests are sent to ``<base>/v1/completions``.

    >>> normalize_base_url("http://127.0.0.1:8001/v1/")
    'http://127.0.0.1:8001'
    >>> normalize_base_url("https://example.org/api")
    'https://example.org/api'
    """
    if not isinstance(url, str):
        raise ValueError(f"a frozen model base_url must be a str like 'http://127.0.0.1:8001', got {url!r}")
    text = url.strip()
    try:
        parts = urllib.parse.urlsplit(text)
        port_ok = parts.port is None or parts.port > 0
    except ValueError as e:
        raise ValueError(
            f"frozen model base_url {url!r} is not a valid URL ({e}); use 'http://host:port'"
        ) from e
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or not port_ok:
        raise ValueError(
            f"frozen model base_url {url!r} must be an absolute http(s) URL with a host, e.g. "
            "'http://127.0.0.1:8001' or 'http://127.0.0.1:8001/v1'"
        )
    if parts.query or parts.fragment:
        raise ValueError(
            f"frozen model base_url {url!r} must not have a query or fragment; give the server root"
        )
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")].rstrip("/")
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc, path, "", ""))


@knobs.section
class FrozenModelConfig:
    """Where a frozen model is served and how to talk to it (its client's knobs are
    :class:`rljax.inference.vllm.client.ClientConfig`'s, with the same defaults).

    ``name``: how algorithms refer to it (``Algorithm.teacher = name``); not ``"policy"`` (the live
    policy), no whitespace, not a URL. In the run config it is the key of ``config.frozen_models``.

    >>> FrozenModelConfig("teacher", ["http://a:8001/v1", "http://b:8001"]).base_url
    ('http://a:8001', 'http://b:8001')
    """

    name: str = knob(doc="how algorithms refer to it (``Algorithm.teacher = name``)")
    base_url: str | Sequence[str] = knob(
        doc="one server URL or several serving the same weights, each ``http(s)://host:port`` with or "
        "without a trailing ``/v1`` (normalized to a tuple of base URLs without ``/v1``)",
    )
    model: str | None = knob(
        None, doc='the OpenAI ``"model"`` field; None asks ``GET /v1/models`` once (first id listed)'
    )
    max_concurrency: int = knob_from(
        ClientConfig, "max_concurrency", doc="most requests in flight to this model, over all its servers"
    )
    timeout_s: float = knob_from(ClientConfig, "timeout_s")
    connect_timeout_s: float = knob_from(ClientConfig, "connect_timeout_s")
    max_retries: int = knob_from(ClientConfig, "max_retries")
    backoff_s: float = knob_from(ClientConfig, "backoff_s")
    backoff_max_s: float = knob_from(ClientConfig, "backoff_max_s")
    cooldown_s: float = knob_from(ClientConfig, "cooldown_s")

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name or name != name.strip() or any(c.isspace() for c in name):
            raise ValueError(f"frozen model name must be a non-empty str without whitespace, got {name!r}")
        if name in RESERVED_NAMES:
            raise ValueError(
                f"frozen model name {name!r} is reserved (teacher='policy' means the live policy); rename it"
            )
        if "://" in name:
            raise ValueError(
                f"frozen model name {name!r} looks like a URL; give a short name and put it in base_url"
            )
        urls = [self.base_url] if isinstance(self.base_url, str) else self.base_url
        if not isinstance(urls, Sequence) or not urls:
            raise ValueError(
                "FrozenModelConfig.base_url: expected a URL or a non-empty list of URLs, "
                f"got {self.base_url!r}"
            )
        try:
            normalized = tuple(normalize_base_url(u) for u in urls)
        except ValueError as e:
            raise ValueError(f"FrozenModelConfig.base_url: {e}") from None
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"FrozenModelConfig.base_url: lists the same server twice: {list(normalized)}")
        object.__setattr__(self, "base_url", normalized)
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(
                "FrozenModelConfig.model: expected None (ask GET /v1/models) or the served model name, "
                f"got {self.model!r}"
            )

    @classmethod
    def from_mapping(cls, name: str, entry: Mapping[str, Any]) -> FrozenModelConfig:
        """The config named ``name`` from a mapping of its fields (``base_url`` required).

        >>> cfg = FrozenModelConfig.from_mapping("t", {"base_url": "http://h:1", "max_concurrency": 8})
        >>> cfg.name, cfg.max_concurrency
        ('t', 8)
        """
        if hasattr(entry, "to_dict"):  # ml_collections.ConfigDict
            entry = entry.to_dict()
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"frozen model {name!r} must be a mapping like {{'base_url': 'http://127.0.0.1:8001'}}, "
                f"got {entry!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in entry if k not in fields)
        if unknown:
            raise ValueError(
                f"frozen model {name!r} has unknown key(s) {unknown}; allowed keys: {sorted(fields)}"
            )
        if "name" in entry and entry["name"] != name:
            raise ValueError(
                f"frozen model {name!r} is listed under that name but its 'name' is {entry['name']!r}"
            )
        if entry.get("base_url") is None:
            raise ValueError(
                f"frozen model {name!r} needs a base_url, e.g. {{'base_url': 'http://127.0.0.1:8001'}}"
            )
        try:
            return cls(**{**entry, "name": name})
        except ValueError as e:  # a field's own rule: "FrozenModelConfig.<field>: why"
            text = str(e)
            if text.startswith(f"{cls.__name__}."):
                raise ValueError(f"frozen model {name!r}: {text.removeprefix(cls.__name__ + '.')}") from None
            raise


def frozen_models_from_config(
    cfg: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]] | None,
) -> dict[str, FrozenModelConfig]:
    """Parses ``config.frozen_models`` into ``{name: FrozenModelConfig}``.

    ``cfg`` is ``{name: {"base_url": ..., "model": ..., ...}}`` (or a list of such mappings that each
    carry a ``"name"``); None or empty gives ``{}``. Raises ``ValueError`` for a missing
    ``base_url``, unknown keys, a URL that is not ``http(s)://...``, and duplicate names.

    >>> sorted(frozen_models_from_config({"a": {"base_url": "http://h:1"}, "b": {"base_url": "http://h:2"}}))
    ['a', 'b']
    >>> frozen_models_from_config([{"name": "a", "base_url": "http://h:1"}, {"name": "a", "base_url": "http://h:2"}])
    Traceback (most recent call last):
    ...
    ValueError: frozen_models lists the name 'a' twice; names must be unique
    """
    if cfg is None:
        return {}
    if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict
        cfg = cfg.to_dict()
    if isinstance(cfg, Mapping):
        items = [(name, entry) for name, entry in cfg.items()]
    elif isinstance(cfg, Sequence) and not isinstance(cfg, (str, bytes)):
        items = []
        for entry in cfg:
            if isinstance(entry, FrozenModelConfig):
                items.append((entry.name, entry))
                continue
            if hasattr(entry, "to_dict"):
                entry = entry.to_dict()
            if not isinstance(entry, Mapping) or "name" not in entry:
                raise ValueError(
                    f"each entry of a frozen_models list must be a mapping with a 'name', got {entry!r}"
                )
            items.append((entry["name"], entry))
    else:
        raise ValueError(
            "frozen_models must be a mapping {name: {'base_url': ...}} (or None), got "
            f"{type(cfg).__name__}: {cfg!r}"
        )
    out: dict[str, FrozenModelConfig] = {}
    for name, entry in items:
        if not isinstance(name, str):
            raise ValueError(f"frozen model names must be str, got {name!r}")
        if name in out:
            raise ValueError(f"frozen_models lists the name {name!r} twice; names must be unique")
        if isinstance(entry, FrozenModelConfig):
            if entry.name != name:
                raise ValueError(
                    f"frozen model {name!r} is listed under that name but its name is {entry.name!r}"
                )
            out[name] = entry
        else:
            out[name] = FrozenModelConfig.from_mapping(name, entry)
    return out


def _as_ids(ids: Any, what: str) -> list[int]:
    """``ids`` as a list of non-negative ints (a 1-D sequence or array); raises ``ValueError`` otherwise."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return []
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if int(arr.min()) < 0:
        raise ValueError(f"{what} must hold non-negative token ids, got {int(arr.min())}")
    return [int(t) for t in arr]


class _FrozenClient(VLLMClient):
    """A :class:`VLLMClient` whose weights can never be synced, plus a plain ``GET`` for discovery."""

    def __init__(self, urls: Sequence[str], *, frozen_name: str, **kwargs: Any) -> None:
        super().__init__(urls, weight_version=0, **kwargs)
        self.frozen_name = frozen_name

    async def update_weights(self, *args: Any, **kwargs: Any) -> int:
        raise TypeError(
            f"frozen model {self.frozen_name!r} is never updated: rljax does not own its weights "
            "(sync the policy engine instead)"
        )

    async def get_json(self, url: str, path: str) -> Any:
        """``GET url+path`` on this client's pool; None when the route does not exist (404/405).

        Other 4xx raise :class:`RequestRejectedError`; 5xx, 408 and 429 raise ``httpx.HTTPStatusError``.
        """
        self._ensure_loop_state()
        response = await self._http.get(url + path)
        if response.status_code in _NO_MODELS_ROUTE:
            return None
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            raise RequestRejectedError(
                f"{url}{path} answered HTTP {response.status_code}: {response.text[:300]}"
            )
        response.raise_for_status()
        try:
            return response.json()
        except ValueError as e:
            raise MalformedResponseError(
                f"{url}{path} answered a body that is not JSON: {response.text[:200]!r}"
            ) from e


def _first_model_id(body: Any, url: str) -> str:
    data = body.get("data") if isinstance(body, Mapping) else None
    first = data[0] if isinstance(data, list) and data else None
    model_id = first.get("id") if isinstance(first, Mapping) else None
    if not isinstance(model_id, str) or not model_id:
        raise MalformedResponseError(
            f"{url}/v1/models lists no model id (expected {{'data': [{{'id': ...}}]}}), "
            f"got {str(body)[:200]!r}; "
            "set the frozen model's 'model' explicitly"
        )
    return model_id


class FrozenModel:
    """A frozen OpenAI-compatible endpoint: a teacher to score with, a sampler to generate from.

    Satisfies :class:`rljax.inference.engine.Engine` (``weight_version`` is always 0). Use it inside
    the event loop that runs its requests, ideally as ``async with FrozenModel.from_config(cfg) as m``.

    >>> from rljax.inference.engine import Engine
    >>> m = FrozenModel.from_config({"name": "teacher", "base_url": "http://127.0.0.1:8001/v1"})
    >>> isinstance(m, Engine), m.name, m.urls, m.version
    (True, 'teacher', ['http://127.0.0.1:8001'], 0)
    """

    def __init__(
        self, config: FrozenModelConfig, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        if not isinstance(config, FrozenModelConfig):
            raise ValueError(f"FrozenModel needs a FrozenModelConfig, got {type(config).__name__}")
        self.config = config
        kwargs: dict[str, Any] = dict(
            max_concurrency=config.max_concurrency,
            timeout_s=config.timeout_s,
            connect_timeout_s=config.connect_timeout_s,
            max_retries=config.max_retries,
            backoff_s=config.backoff_s,
            backoff_max_s=config.backoff_max_s,
            cooldown_s=config.cooldown_s,
            transport=transport,
        )
        if config.model is not None:
            kwargs["model"] = config.model
        self.client = _FrozenClient(list(config.base_url), frozen_name=config.name, **kwargs)
        self._default_model = self.client.model
        self._resolved = config.model is not None
        self._resolve_lock: asyncio.Lock | None = None

    @classmethod
    def from_config(
        cls,
        cfg: FrozenModelConfig | Mapping[str, Any],
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> FrozenModel:
        """A frozen model from its config or a mapping of its fields (``name`` and ``base_url`` required).

        ``transport`` replaces the HTTP transport (tests: ``httpx.MockTransport``).
        """
        if not isinstance(cfg, FrozenModelConfig):
            if hasattr(cfg, "to_dict"):
                cfg = cfg.to_dict()
            if not isinstance(cfg, Mapping) or "name" not in cfg:
                raise ValueError(
                    "FrozenModel.from_config needs a FrozenModelConfig or a mapping with 'name' and "
                    f"'base_url', got {cfg!r}"
                )
            cfg = FrozenModelConfig.from_mapping(cfg["name"], cfg)
        return cls(cfg, transport=transport)

    # ----------------------------------------------------------------------------------------------
    # identity

    @property
    def name(self) -> str:
        """How algorithms refer to this model."""
        return self.config.name

    @property
    def urls(self) -> list[str]:
        """Base URLs of its servers."""
        return self.client.urls

    @property
    def weight_version(self) -> int:
        """Always 0: the weights never change, so nothing sampled from them goes stale."""
        return 0

    @property
    def version(self) -> int:
        """Alias of :attr:`weight_version` (always 0)."""
        return self.weight_version

    @property
    def model(self) -> str | None:
        """The OpenAI ``model`` field sent; None until discovered when the config left it None."""
        return self.client.model if self._resolved else None

    def __repr__(self) -> str:
        return f"FrozenModel(name={self.name!r}, urls={self.urls}, model={self.model!r})"

    # ----------------------------------------------------------------------------------------------
    # model name discovery

    async def resolve_model(self) -> str:
        """The served model name: the config's, else the first id of ``GET /v1/models`` (asked once).

        Every server that answers must list the same first id (else ``ValueError``); servers without a
        ``/v1/models`` route (404/405) leave the client's default name. Transport failures are retried
        with the client's backoff, then raise :class:`ServerUnavailableError`.
        """
        if self._resolved:
            return self.client.model
        if self._resolve_lock is None:
            self._resolve_lock = asyncio.Lock()
        async with self._resolve_lock:
            if not self._resolved:
                self.client.model = await self._discover_model()
                self._resolved = True
        return self.client.model

    async def _discover_model(self) -> str:
        client = self.client
        errors: list[str] = []
        for attempt in range(client.max_retries + 1):
            answers = await asyncio.gather(
                *(client.get_json(url, "/v1/models") for url in client.urls), return_exceptions=True
            )
            found: dict[str, str] = {}
            no_route = 0
            for url, answer in zip(client.urls, answers, strict=True):
                if answer is None:
                    no_route += 1
                elif isinstance(answer, (httpx.TransportError, httpx.HTTPStatusError, asyncio.TimeoutError)):
                    errors.append(f"attempt {attempt + 1} on {url}: {type(answer).__name__}: {answer}")
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    found[url] = _first_model_id(answer, url)
            if len(set(found.values())) > 1:
                raise ValueError(
                    f"frozen model {self.name!r}: its servers serve different models {found}; list "
                    "servers of one model only, or set 'model' explicitly"
                )
            if found:
                return next(iter(found.values()))
            if no_route == len(client.urls):
                return self._default_model
            if attempt < client.max_retries:
                await asyncio.sleep(client.backoff(attempt))
        raise ServerUnavailableError(
            f"frozen model {self.name!r}: GET /v1/models failed on every server:\n  " + "\n  ".join(errors)
        )

    # ----------------------------------------------------------------------------------------------
    # sampling (Engine)

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> Completion:
        """Samples one completion: the exact ids with their logprobs, ``weight_version`` 0.

        The logprobs are those of the temperature-scaled distribution when the server runs
        ``--logprobs-mode processed_logprobs`` (identical to the raw ones at temperature 1).
        """
        await self.resolve_model()
        return await self.client.generate(prompt_ids, sampling, session_id=session_id)

    async def update_weights(self, *args: Any, **kwargs: Any) -> int:
        """Always raises ``TypeError``: rljax never updates a frozen model."""
        return await self.client.update_weights(*args, **kwargs)

    def end_session(self, session_id: str) -> None:
        """Forgets a trajectory's sticky server (call when the trajectory ends)."""
        self.client.end_session(session_id)

    # ----------------------------------------------------------------------------------------------
    # scoring (teacher)

    async def score(self, ids: Sequence[int]) -> np.ndarray:
        """``out[t] = log p(ids[t] | ids[:t])`` at temperature 1 (float64, ``out[0] = 0``): one prefill.

        A 1-token sequence needs no request (``[0.0]``); an empty one raises ``ValueError``.
        """
        seq = _as_ids(ids, "score() ids")
        if not seq:
            raise ValueError("score() needs at least one token id, got an empty sequence")
        if len(seq) == 1:
            return np.zeros(1, np.float64)
        await self.resolve_model()
        return await self.client.score(seq)

    async def score_many(self, seqs: Sequence[Sequence[int]], *, progress: bool = False) -> list[np.ndarray]:
        """:meth:`score` of every sequence, concurrently (at most ``max_concurrency`` in flight).

        Results are in the order of ``seqs``. If one fails, the others are cancelled and the error is
        raised. ``progress=True`` shows a progress bar (one summary line when not on a terminal).
        """
        checked = [_as_ids(s, f"score_many() sequence {i}") for i, s in enumerate(seqs)]
        for i, s in enumerate(checked):
            if not s:
                raise ValueError(
                    f"score_many() sequence {i} is empty; every sequence needs at least one token"
                )
        bar = None
        if progress:
            bar = Progress(total=len(checked), desc=f"score {self.name}", unit="seq")

        async def one(seq: list[int]) -> np.ndarray:
            out = await self.score(seq)
            if bar is not None:
                bar.update(1)
            return out

        if checked:
            await self.resolve_model()
        tasks = [asyncio.ensure_future(one(s)) for s in checked]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            if bar is not None:
                bar.close()

    async def response_logprobs(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> np.ndarray:
        """``log p(response[i] | prompt, response[:i])`` for each response token, at temperature 1.

        Equal to ``score(prompt + response)[len(prompt):]``; the prompt must be non-empty (the first
        response token needs a context), an empty response gives an empty array without a request.
        """
        prompt = _as_ids(prompt_ids, "response_logprobs() prompt_ids")
        response = _as_ids(response_ids, "response_logprobs() response_ids")
        if not prompt:
            raise ValueError(
                "response_logprobs() needs a non-empty prompt: the first response token needs a context"
            )
        if not response:
            return np.zeros(0, np.float64)
        return (await self.score(prompt + response))[len(prompt) :]

    # ----------------------------------------------------------------------------------------------
    # lifetime

    async def aclose(self) -> None:
        """Closes its HTTP connections."""
        await self.client.aclose()

    async def __aenter__(self) -> FrozenModel:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
