"""rljax: reinforcement-learning post-training of multi-turn LLM agents in JAX/Flax.

Importing ``rljax`` imports nothing else: each layer (``rljax.core``, ``rljax.data``,
``rljax.models``, ...) is imported on its own.

>>> import rljax
>>> rljax.__version__ == __import__("importlib.metadata").metadata.version("rljax")
True
"""

__version__ = "0.2.0"
