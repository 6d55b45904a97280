"""The tests' policy for the AVX2 panel kernel (``rljax.models.panel_matmul``): where it cannot be built
(no C++ compiler, a CPU without AVX2/FMA, another backend), its tests skip and say why; with
``RLJAX_REQUIRE_PANEL_KERNEL=1`` (CI, on machines that must build it) they fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from rljax.models import panel_matmul

#: Set to 1 where the kernel must build: an unbuildable kernel then fails its tests instead of skipping.
REQUIRE_ENV = "RLJAX_REQUIRE_PANEL_KERNEL"


def require_panel_kernel(environ: Mapping[str, str] = os.environ) -> None:
    """Returns when the kernel is available; else ``pytest.fail`` when ``RLJAX_REQUIRE_PANEL_KERNEL=1``,
    ``pytest.skip`` with the reason otherwise."""
    reason = panel_matmul.unavailable_reason()
    if reason is None:
        return
    message = f"the panel_matmul kernel is not available here: {reason}"
    if environ.get(REQUIRE_ENV, "") == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1 requires it)")
    pytest.skip(message)
