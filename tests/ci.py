"""Whether the suite runs as CI, and what a test does when a component it needs is missing.

``.ci/run`` sets ``CI=true``. ``./run test`` installs every component the tests use (vLLM's venv,
Chromium, tcmalloc, uv, tinker-cookbook's venv), so under CI a missing one is a broken install and its
tests FAIL; elsewhere (a plain ``pytest`` in a checkout) they skip and say what to install.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NoReturn

import pytest


def under_ci(environ: Mapping[str, str] | None = None) -> bool:
    """``CI`` is set to a true value (1, true, yes) in ``environ`` (default: this process's)."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() in ("1", "true", "yes")


def missing(reason: str, *, environ: Mapping[str, str] | None = None) -> NoReturn:
    """Fails the test under CI (``reason``, prefixed ``CI=true but``), else skips it with ``reason``."""
    if under_ci(environ):
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)
