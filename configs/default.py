"""Default recipe: a tiny model trained on CPU on the built-in multi-turn ``lookup`` tool task.

Everything is built on the fly (no downloads): a byte-level toy ChatML tokenizer, a 2-layer Qwen3-style
decoder, the embedded JAX sampler, and the ``lookup`` environment (call a tool, read its answer, reply).
A short warm start (400 cross-entropy steps on demonstrations from ``env.solution`` whose final answer
is replaced by a wrong color 60% of the time) teaches the tool-call format; the warm-started policy
answers correctly ~35-40% of the time, and GRPO + DPPO (120 steps, 16 prompts x 8 samples) must learn
to look up the right key and copy the tool's answer.

The values are the defaults of :class:`rljax.run.config.RunConfig` (the one place that defines
every key, its type and its default; read it for what each key means). Other recipes start from this
one and change what they need.

    rljax train --config=default --workdir=/tmp/rljax_default
    rljax train --config=default --config.trainer.num_steps=5
    rljax train --config=default \
        --config.trainer.filters="[{'name': 'overlong', 'mode': 'enforce'}]"
"""

from ml_collections import config_dict

from rljax.run.config import default_config


def get_config() -> config_dict.ConfigDict:
    """The defaults of :class:`rljax.run.config.RunConfig` as a ``ConfigDict`` (see the module docstring)."""
    return default_config()
