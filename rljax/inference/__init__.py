"""Generation engines: the Engine protocol, vLLM servers (rljax.inference.vllm), the embedded sampler."""

from rljax.inference.engine import Completion, Engine, SamplingParams
from rljax.inference.sampler import EmbeddedSampler

__all__ = ["Completion", "EmbeddedSampler", "Engine", "SamplingParams"]
