"""Makes ``gateway_helpers.py`` importable by the gateway tests; LiteLLM uses its bundled cost map
(no network). Fixtures: ``loop`` (a background event loop per module) and ``gateway`` (a started
gateway on it, ChatML renderer)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from gateway_helpers import CHATML, Loop  # noqa: E402 (after the path insert)

from rljax.gateway import Gateway  # noqa: E402


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def gateway(loop):
    gw = Gateway(CHATML)
    loop.run(gw.start)
    yield gw
    loop.run(gw.stop)
