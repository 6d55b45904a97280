"""Session fixtures for the inference tests: the fake-vLLM shim, tiny Qwen3 models, one REAL vLLM server.

The real server (about 60-120 s to become healthy on 2 CPU cores) is started once per session and
shared by every test that asks for it. Its python comes from ``$RLJAX_VLLM_PYTHON`` or
``<repo>/.vllm-venv`` (made by ``.ci/install_vllm.sh``); without one, tests that need it FAIL when
``CI=true`` and are skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import inference_fakes  # noqa: E402
import inference_helpers  # noqa: E402

from rljax.inference.vllm import ServerConfig, VLLMServer, write_checkpoint  # noqa: E402
from rljax.inference.vllm.pause import in_flight_server_config  # noqa: E402


@pytest.fixture(scope="session")
def fake_shim(tmp_path_factory) -> str:
    """Directory with a fake ``vllm.entrypoints.openai.api_server`` (put it on the server's PYTHONPATH)."""
    return inference_fakes.write_vllm_shim(os.fspath(tmp_path_factory.mktemp("fake_vllm_shim")))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of vLLM's own venv; FAIL under CI=true when missing, else skip with the reason."""
    return inference_helpers.require_vllm_python()


@pytest.fixture(scope="session")
def tiny_models() -> types.SimpleNamespace:
    """Three different tiny tied Qwen3 models (a, b, c) and helpers."""
    return types.SimpleNamespace(
        a=inference_helpers.make_tiny_qwen3(0),
        b=inference_helpers.make_tiny_qwen3(1),
        c=inference_helpers.make_tiny_qwen3(2),
        logprobs=inference_helpers.rljax_logprobs,
    )


@pytest.fixture(scope="session")
def vllm_server(vllm_python, tiny_models, tmp_path_factory):
    """ONE real vLLM server for the session, serving ``tiny_models.a`` at start.

    ``server.served`` holds the model the server currently serves (tests that sync update it; None:
    unknown). It also mounts the token-in/token-out route of in-flight updates
    (``in_flight_server_config``: routes only, the completions and the engine are unchanged), so
    the in-flight tests share it instead of starting a server of their own. A test that kills or
    stops a server must launch its own.
    """
    directory = os.fspath(tmp_path_factory.mktemp("vllm_initial"))
    write_checkpoint(tiny_models.a, directory)
    log = os.fspath(tmp_path_factory.mktemp("vllm_logs") / "server.log")
    config = ServerConfig(
        model=directory,
        max_model_len=inference_helpers.MAX_MODEL_LEN,
        skip_tokenizer_init=True,
        extra_args=("--enforce-eager",),  # no torch.compile: halves the start-up on CPU, same numerics
        startup_timeout_s=600,
        log_path=log,
    )
    with VLLMServer(in_flight_server_config(config), python=vllm_python) as server:
        server.served = tiny_models.a
        yield server
