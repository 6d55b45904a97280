"""The tests' policy for the panel kernel (``rljax.models.panel_matmul``): where it cannot be built
(no C++ compiler, another backend), its tests skip and say why; with ``RLJAX_REQUIRE_PANEL_KERNEL=1``
(CI, on machines that must build it) they fail instead. An instruction set the CPU lacks (AVX2/FMA
for the whole kernel, AVX-512 for its wide variant) always skips with the reason: CI requires the
kernel, not a CPU kind (its machines include AMD EPYCs without AVX-512 and Intel Xeons with it).
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
    if environ.get(REQUIRE_ENV, "") == "1" and reason != panel_matmul.NO_KERNEL_ISA:
        pytest.fail(f"{message} ({REQUIRE_ENV}=1 requires it)")
    pytest.skip(message)


def require_isa(isa: str) -> None:
    """Returns when this CPU runs the kernel's ``isa`` variant; else ``pytest.skip`` with the reason
    (also under ``RLJAX_REQUIRE_PANEL_KERNEL=1``). Call after :func:`require_panel_kernel`."""
    if isa not in panel_matmul.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} kernel (it runs {panel_matmul.supported_isas()})")
