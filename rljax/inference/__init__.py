"""Generation engines: the Engine protocol, vLLM servers (rljax.inference.vllm), the embedded sampler."""

from rljax.inference.engine import Completion, Engine, SamplingParams
from rljax.inference.frozen import FrozenModel, FrozenModelConfig, frozen_models_from_config
from rljax.inference.sampler import EmbeddedSampler
from rljax.inference.scoring import score_sequences

__all__ = [
    "Completion",
    "EmbeddedSampler",
    "Engine",
    "FrozenModel",
    "FrozenModelConfig",
    "SamplingParams",
    "frozen_models_from_config",
    "score_sequences",
]
