"""Sphinx configuration of rljax's documentation site (``./run docs`` builds it into docs/_build/html).

Markdown pages are MyST, notebooks (``notebooks/*.ipynb``) are executed by MyST-NB at every build,
and the API reference is generated from the code's docstrings (``_ext/rljax_reference.py``). The
build runs with warnings as errors, so a broken cross-reference fails it; it fetches nothing from
the network (no intersphinx inventories, the theme's assets are local).
"""

from __future__ import annotations

import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # this checkout's rljax, installed or not

import rljax  # noqa: E402

project = "rljax"
author = "the rljax authors"
copyright = "the rljax authors"  # noqa: A001 (Sphinx's name)
release = version = rljax.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "rljax_reference",  # the generated reference; it also sets up sphinx.ext.napoleon
]

root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "jupyter_execute"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

# -- cross-references: every one must resolve -----------------------------------------------------
nitpicky = True
# Names of other packages (no inventories are fetched) and typing forms that Sphinx renders from
# signatures; references to rljax itself are never ignored.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|np|numpy|optax|flax|nnx|chex|ml_collections|transformers|tokenizers)(\..*)?"),
    (r"py:.*", r"(safetensors|orbax|httpx|openai|fastapi|uvicorn|tinker|wandb|mlflow|tensorboardX)(\..*)?"),
    (r"py:.*", r"(datasets|pyarrow|verifiers|skyrl_gym|reasoning_gym|math_verify|concurrent|asyncio)(\..*)?"),
    (r"py:.*", r"(typing|collections|types|pathlib|threading|queue|subprocess|dataclasses|enum|abc)(\..*)?"),
    (r"py:.*", r"(logging|io|os|json|argparse|contextlib|functools|random|socket|http|email)(\..*)?"),
    (r"py:class", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Literal|Protocol|NamedTuple|Path)"),
    (r"py:class", r"(int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|type|None|Ellipsis)"),
    (r"py:class", r"(Exception|ValueError|TypeError|RuntimeError|KeyError|ImportError|BaseException)"),
]

# -- MyST and notebooks ---------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath", "amsmath", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "force"  # every build runs every notebook: their outputs are always current
nb_execution_timeout = 600
nb_execution_raise_on_error = True  # a failing cell fails the build
nb_execution_show_tb = True
nb_merge_streams = True

# -- API reference ----------------------------------------------------------------------------------
autosummary_generate = False  # the pages are written by rljax_reference, one per package of rljax
# A page's table of contents lists its modules' sections, not every documented object: the objects
# of a whole package would crowd it, and the navigation (resolved for every page) would be many
# times slower to build.
toc_object_entries = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = True
autodoc_default_options = {"show-inheritance": True}
add_module_names = False
python_use_unqualified_type_names = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False  # "Attributes:" entries are attribute entries (targets of :attr: references)
napoleon_use_rtype = False

# -- HTML ---------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"rljax {release}"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"
html_show_sourcelink = False
html_copy_source = False
