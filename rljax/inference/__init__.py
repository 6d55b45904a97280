"""Generation engines: the Engine protocol, vLLM servers (rljax.inference.vllm), the embedded sampler."""

from rljax.inference.engine import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
