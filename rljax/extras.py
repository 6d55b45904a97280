"""Optional parts of rljax and the pip extras that bring their dependencies.

The core (``pip install rljax``) trains, evaluates and exports. Each front door or integration
names its extra here; using one without it fails at start with one line naming what to install:

>>> EXTRAS["gateway"]
('uvicorn', 'openai')
>>> missing_modules("report", find=lambda name: name != "wandb")
['wandb']
>>> str(MissingExtraError("report", "the wandb sink", ["wandb"]))
"the wandb sink needs the 'report' extra (missing: wandb): pip install 'rljax[report]'"
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

__all__ = ["EXTRAS", "MissingExtraError", "missing_modules", "require"]

#: Each optional part (a pip extra or one tracker of one) and the modules it needs.
EXTRAS: dict[str, tuple[str, ...]] = {  # extra -> the importable modules it installs
    "gateway": ("uvicorn", "openai"),
    "tinker": ("tinker", "fastapi", "uvicorn"),
    "report": ("wandb", "mlflow"),
    "wandb": ("wandb",),  # one tracker of the report extra
    "mlflow": ("mlflow",),
    "envs": ("skyrl_gym", "reasoning_gym", "math_verify", "pyarrow", "datasets"),
    "skyrl_gym": ("skyrl_gym",),
    "reasoning_gym": ("reasoning_gym",),
    "verifiers": ("verifiers", "uvicorn", "openai"),
}
_PIP_EXTRA = {"wandb": "report", "mlflow": "report", "skyrl_gym": "envs", "reasoning_gym": "envs"}


class MissingExtraError(ImportError):
    """An optional part was used without the pip extra that installs its dependencies."""

    def __init__(self, extra: str, what: str, missing: list[str]) -> None:
        pip_extra = _PIP_EXTRA.get(extra, extra)
        super().__init__(
            f"{what} needs the {pip_extra!r} extra (missing: {', '.join(missing)}): "
            f"pip install 'rljax[{pip_extra}]'"
        )
        self.extra = pip_extra


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_modules(extra: str, *, find: Callable[[str], bool] | None = None) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (found without importing them)."""
    find = _installed if find is None else find
    return [m for m in EXTRAS[extra] if not find(m)]


def require(extra: str, what: str) -> None:
    """Raises :class:`MissingExtraError` when ``extra``'s modules are not installed; ``what`` names
    the part that needs them (``"config.envs.lookup.agent"``, ``"rljax serve"``)."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(extra, what, missing)
