"""Tinker-compatible API recipe: the tiny default model (toy byte-level tokenizer, 2-layer Qwen3-style
decoder, built on the fly) served on CPU for the ``tinker`` SDK.

    rljax serve --config=tinker --port=8000 --workdir=/tmp/rljax_tinker

Serve a real model by pointing ``model.hf_path`` (and ``tokenizer``) at an HF checkpoint directory:

    rljax serve --config=tinker --config.model.hf_path=/models/Qwen3-0.6B \\
        --config.tokenizer.name=/models/Qwen3-0.6B
"""

from ml_collections import config_dict

from rljax.recipes import default


def get_config() -> config_dict.ConfigDict:
    """The default recipe's model served by ``rljax serve`` (no warm start: clients train it)."""
    c = default.get_config()
    c.warmstart.num_steps = 0  # the API trains what its clients ask for, nothing else
    return c
