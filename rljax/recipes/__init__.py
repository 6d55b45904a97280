"""The shipped recipes: ml_collections config files, each a ``get_config()``.

Their one copy is the repository's top-level ``configs/`` directory (``configs/smoke.py``, ...): this
package only points there, so ``from rljax.recipes import smoke`` imports ``configs/smoke.py`` and
``rljax train --config=smoke`` runs it. In a checkout (or an editable install) that is the
checkout's ``configs/``; an installed wheel carries the files as data (setup.cfg ``data_files``:
``<prefix>/share/rljax/configs``). Every recipe starts from ``default`` (exactly the defaults of
:class:`rljax.run.config.RunConfig`) and changes what it needs; copy one to start your own.

>>> {"default.py", "smoke.py"} <= {p.name for p in CONFIGS_DIR.glob("*.py")}
True
"""

from __future__ import annotations

import pathlib
import sys
from importlib import metadata

__all__ = ["CONFIGS_DIR", "INSTALLED_CONFIGS", "configs_dir"]

#: Where a wheel installs the recipes, under its installation prefix (setup.cfg ``data_files``).
INSTALLED_CONFIGS = ("share", "rljax", "configs")


def configs_dir(checkout: pathlib.Path | None = None, files: list | None = None) -> pathlib.Path:
    """The directory of the recipe files: a checkout's ``configs/`` (next to the ``rljax`` package,
    beside the checkout's ``setup.cfg``), else the one among the installed distribution's ``files``
    (``importlib.metadata`` paths; a wheel's data files); ``checkout`` and ``files`` default to this
    package's."""
    checkout = pathlib.Path(__file__).resolve().parents[2] if checkout is None else checkout
    if (checkout / "configs" / "default.py").is_file() and (checkout / "setup.cfg").is_file():
        return checkout / "configs"
    if files is None:
        try:
            files = metadata.distribution("rljax").files or []
        except metadata.PackageNotFoundError:
            files = []
    for file in files:
        if tuple(file.parts[-4:-1]) == INSTALLED_CONFIGS and file.name == "default.py":
            return pathlib.Path(str(file.locate())).resolve().parent
    return pathlib.Path(sys.prefix, *INSTALLED_CONFIGS)


#: The directory of the recipe files (``--config=<name>`` names ``<name>.py`` there).
CONFIGS_DIR = configs_dir()
__path__ = [str(CONFIGS_DIR)]  # the recipes import as rljax.recipes.<name>
