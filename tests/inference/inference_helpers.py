"""Helpers shared by the inference tests: the tiny Qwen3, rljax reference logprobs, finding vLLM, and
read-outs of engine state that only tests need (a client's session pins and per-model request
counts, a synchronous batch call of the embedded sampler)."""

from __future__ import annotations

from collections.abc import Sequence

import ci
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import models
from rljax.inference.engine import Completion, SamplingParams
from rljax.inference.sampler import EmbeddedSampler
from rljax.inference.vllm import VLLMClient, find_vllm_python

# The tiny Qwen3 of the brief: head_dim 64 (vLLM's CPU attention rejects small heads), GQA 2:1, tied.
TINY_QWEN3 = dict(
    model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=64, qk_norm=True, tie_word_embeddings=True, max_position_embeddings=512,
    rms_norm_eps=1e-6,
)  # fmt: skip
MAX_MODEL_LEN = 512


def make_tiny_qwen3(seed: int, **overrides: object) -> models.Decoder:
    """A tiny random Qwen3 whose weights are re-drawn at scales that make its distributions peaked.

    (The default init gives nearly uniform next-token distributions, where a wrong output head or a
    missed norm changes logprobs too little to notice.)
    """
    cfg = models.ModelConfig(**{**TINY_QWEN3, **overrides})
    model = models.Decoder(cfg, rngs=nnx.Rngs(seed))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(1000 + seed), len(flat))
    new = []
    for key, (path, var) in zip(keys, flat, strict=True):
        value = var.get_value()
        noise = jax.random.normal(key, value.shape, jnp.float32)
        name = ".".join(str(p) for p in path)
        if "norm" in name:
            value = 1.0 + 0.2 * noise
        elif name == "embed_tokens":
            value = 0.5 * noise
        else:
            value = 0.15 * noise
        new.append((path, var.replace(value.astype(jnp.float32))))
    nnx.update(model, nnx.from_flat_state(new))
    return model


def rljax_logprobs(model: models.Decoder, ids, *, temperature: float = 1.0) -> np.ndarray:
    """rljax's ``log p(ids[t] | ids[:t])`` as float64 (entry 0 = 0)."""
    out = models.sequence_logprobs(model, jnp.asarray([list(ids)], jnp.int32), temperature=temperature)
    return np.asarray(out[0], np.float64)


def require_vllm_python(environ: dict[str, str] | None = None) -> str:
    """vLLM's python; without one, :func:`ci.missing` (a failure under CI, else a skip; ``environ``
    defaults to this process's)."""
    try:
        python = find_vllm_python()
    except FileNotFoundError as e:
        python, reason = None, str(e)
    else:
        reason = "no vLLM venv: run .ci/install_vllm.sh (creates .vllm-venv) or set RLJAX_VLLM_PYTHON"
    if python is None:
        ci.missing(reason, environ=environ)
    return python


def session_server(client: VLLMClient, session_id: str) -> str | None:
    """URL of the server ``client`` has pinned ``session_id`` to, if any."""
    i = client._sessions.get(session_id)
    return None if i is None else client.servers[i].url


def requests_for(client: VLLMClient, model: str) -> int:
    """generate / score calls of ``client`` naming ``model`` that have not returned yet (queued included)."""
    return client._model_requests[model]


def generate_batch(
    sampler: EmbeddedSampler,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams],
) -> list[Completion]:
    """Synchronously samples one completion per prompt with ``sampler`` (in chunks of its
    ``max_batch_size``, each one jitted call): the batches the tests choose, without the timing of
    the asynchronous request queue. Requests are checked as :meth:`EmbeddedSampler.generate` checks them.
    """
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    assert len(sampling) == len(prompts), (len(prompts), len(sampling))
    checked = [sampler._check_request(p, s) for p, s in zip(prompts, sampling, strict=True)]
    out: list[Completion] = []
    for i in range(0, len(checked), sampler.max_batch_size):
        chunk = slice(i, i + sampler.max_batch_size)
        out += sampler._run_batch(checked[chunk], list(sampling[chunk]))
    return out
