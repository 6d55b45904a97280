"""The cached SmolLM2-135M-Instruct GGUF file and real multi-turn conversations, shared by the tests
that run the real model.

The file is cached by ``.ci/install_smollm2.sh`` (:mod:`rljax.models.gguf_fetch`); without it those
tests skip, saying so, unless ``RLJAX_REQUIRE_SMOLLM2=1``, which makes a missing file a failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile
import time
from collections.abc import Iterator

import pytest
from xla_flags import optimized_compilation

from rljax.models import gguf_fetch

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Germany? Answer in one word."},
        {"role": "assistant", "content": "Berlin."},
    ],
    [
        {"role": "system", "content": "You are a concise math tutor."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42."},
        {"role": "user", "content": "Now multiply that by 2."},
        {"role": "assistant", "content": "42 * 2 = 84."},
    ],
    [
        {"role": "user", "content": "Write a haiku about autumn leaves."},
        {
            "role": "assistant",
            "content": "Crimson leaves descend,\nwhispering to the cold ground:\nsummer's last goodbye.",
        },
        {"role": "user", "content": "Thanks! Can you explain what a haiku is, briefly?"},
        {
            "role": "assistant",
            "content": "A haiku is a short Japanese poem of three lines with 5, 7 and 5 syllables.",
        },
    ],
]


def require_smollm2() -> pathlib.Path:
    """The cached GGUF file's path; skips the test when it is missing (fails under
    ``RLJAX_REQUIRE_SMOLLM2=1``)."""
    path = gguf_fetch.model_cache_dir() / gguf_fetch.SMOLLM2.filename
    if not path.is_file():
        reason = f"SmolLM2 GGUF file not cached at {path}: run .ci/install_smollm2.sh to fetch it (98 MB)"
        if os.environ.get("RLJAX_REQUIRE_SMOLLM2") == "1":
            pytest.fail(reason + " (RLJAX_REQUIRE_SMOLLM2=1 requires it)")
        pytest.skip(reason)
    return path


#: How many tests may hold the real model at once: two peaks fit a 24 GiB machine beside the other
#: workers' tests (the largest, one step of the agent recipes, peaks at ~8.5 GiB).
REAL_MODEL_SLOTS = 2


@contextlib.contextmanager
def real_model_slot() -> Iterator[None]:
    """Holds one of :data:`REAL_MODEL_SLOTS` machine-wide locks while a test trains or serves the real
    SmolLM2, waiting for one to free up.

    Such a test peaks at several GiB (a 135M model's weights, Adam state, activations, a vLLM
    server); ``./run test``'s workers start the longest files first, so without the slots the
    SmolLM2 files would all peak at once. The other workers go on meanwhile. Inside, programs compile
    with XLA's default optimization (:func:`xla_flags.optimized_compilation`): the real model's
    runtime outweighs its compile time.
    """
    base = os.path.join(tempfile.gettempdir(), "rljax-tests-real-model")
    while True:
        for slot in range(REAL_MODEL_SLOTS):
            with open(f"{base}.{slot}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                try:
                    with optimized_compilation():
                        yield
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
                return
        time.sleep(0.5)
