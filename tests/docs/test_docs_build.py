"""The documentation site (docs/): it builds with warnings as errors, its API reference holds every
public name of rljax with its docstring, its config reference every key of the run config, its
notebooks are executed, and its pages open in headless Chromium without console errors.

The site is built once for this file, by Sphinx in a subprocess (as ``./run docs`` builds it), into
a temporary directory. The expectations below are computed here, independently of the generator
in ``docs/_ext``: the public modules are the files under ``rljax/`` (a module is public unless a
part of its name starts with ``_``), each documented on the reference page of the package (or
module) directly in rljax that holds it (``rljax.core.losses`` on ``rljax.core``'s page), a module's
public names are its ``__all__``, else the classes and functions it defines; the config keys are
the dataclass fields of ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import functools
import html.parser
import http.server
import importlib
import inspect
import os
import pathlib
import subprocess
import sys
import threading
import time
import typing

import ci
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import browser  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.subprocess]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _missing(what: str) -> None:
    ci.missing(f"{what} is not installed (./run test installs it)")


# -- the build -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Builds the site once: ``{"html": its folder, "rc", "log", "seconds"}``."""
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
        _missing("the docs extra (sphinx, myst-nb)")
    out = tmp_path_factory.mktemp("docs")
    cmd = [
        sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
        "-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html"),
    ]  # fmt: skip
    # XLA's default flags, as `./run docs` builds: the notebooks train for minutes, where the suite's
    # fast-compiling flags (tests/xla_flags.py) cost more in slower code than they save in compiling
    # (tiny_agent.ipynb alone: 181 s / 294 CPU-s with them, 121 s / 189 CPU-s without, measured)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    start = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    return {
        "html": out / "html",
        "rc": r.returncode,
        "log": r.stdout + r.stderr,
        "seconds": time.monotonic() - start,
    }


@pytest.fixture(scope="module")
def built(site: dict) -> pathlib.Path:
    """The site's HTML folder, once the build passed."""
    if site["rc"] != 0:
        pytest.fail(f"the docs build failed (rc {site['rc']}):\n{site['log'][-6000:]}")
    return site["html"]


def test_the_docs_build_with_warnings_as_errors(site):
    assert site["rc"] == 0, site["log"][-6000:]
    lines = [line for line in site["log"].splitlines() if "WARNING" in line or "ERROR" in line]
    # the notebook kernel's own notice about its local transport is not a Sphinx warning
    lines = [line for line in lines if not line.startswith("[IPKernelApp] WARNING")]
    assert lines == [], lines


# -- what the pages hold ---------------------------------------------------------------------------


class _Page(html.parser.HTMLParser):
    """The ids, links, definitions (``<dt id>`` -> text of its ``<dd>``) and table rows of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.definitions: dict[str, str] = {}
        self.rows: list[list[str]] = []
        self._dt: str | None = None  # id of the last <dt>, until its <dd> starts
        self._dd: list[tuple[str, int, list[str]]] = []  # open descriptions: (id, depth, text)
        self._depth = 0
        self._cells: list[list[str]] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag == "dt" and a.get("id"):
            self._dt = a["id"]
        if tag == "dl":
            self._depth += 1
        if tag == "dd" and self._dt is not None:
            self._dd.append((self._dt, self._depth, []))
            self._dt = None
        if tag == "tr":
            self._cells = []
        if tag in ("td", "th") and self._cells is not None:
            self._cells.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag == "dd" and self._dd and self._dd[-1][1] == self._depth:
            name, _, text = self._dd.pop()
            self.definitions[name] = " ".join("".join(text).split())
        if tag == "dl":
            self._depth -= 1
        if tag == "tr" and self._cells is not None:
            self.rows.append([" ".join("".join(c).split()) for c in self._cells])
            self._cells = None

    def handle_data(self, data: str) -> None:
        for _, _, text in self._dd:
            text.append(data)
        if self._cells:
            self._cells[-1].append(data)


_PAGES: dict[pathlib.Path, _Page] = {}


def _page(path: pathlib.Path) -> _Page:
    if path not in _PAGES:
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        _PAGES[path] = page
    return _PAGES[path]


def _public_modules() -> list[str]:
    package = ROOT / "rljax"
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            names.append(".".join(parts))
    return names


def _public_names(module: object) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and (inspect.isclass(v) or inspect.isfunction(v))
        and v.__module__ == module.__name__
    ]


def _reference_page(module: str) -> str:
    """The name of the reference page that documents ``module``: rljax's own page, or the page of the
    package (or module) directly in rljax that holds it (``rljax.core.losses`` -> ``rljax.core``)."""
    return ".".join(module.split(".")[:2])


def _definition(page: pathlib.Path, module: str, name: str) -> tuple[_Page, str] | None:
    """Where public ``module.name`` is defined in the site: on its reference page, or at the target of
    a link on that page whose anchor names it (a re-export documented where it is defined)."""
    here = _page(page)
    if f"{module}.{name}" in here.ids:
        return here, f"{module}.{name}"
    value = getattr(sys.modules[module], name)
    last_names = {name, getattr(value, "__name__", name)}
    for href in here.links:
        file, _, anchor = href.partition("#")
        if not anchor or anchor.rpartition(".")[2] not in last_names or not anchor.startswith("rljax."):
            continue
        target = (page.parent / file).resolve() if file else page
        if target.is_file() and anchor in _page(target).ids:
            return _page(target), anchor
    return None


def test_every_public_module_and_name_is_in_the_reference_with_its_docstring(built):
    modules = _public_modules()
    assert len(modules) > 100  # the walk found the package
    missing, undocumented, names = [], [], 0
    for module in modules:
        mod = importlib.import_module(module)
        page = built / "reference" / "api" / f"{_reference_page(module)}.html"
        if not page.is_file():
            missing.append(f"{module} (no page)")
            continue
        if f"module-{module}" not in _page(page).ids:
            missing.append(f"{module} (no module entry)")
        if not (mod.__doc__ or "").strip():
            undocumented.append(module)
        for name in _public_names(mod):
            names += 1
            found = _definition(page, module, name)
            if found is None:
                missing.append(f"{module}.{name}")
            elif not found[0].definitions.get(found[1]):
                undocumented.append(f"{module}.{name} (at {found[1]})")
    assert names > 700
    assert missing == [], missing
    assert undocumented == [], undocumented


def _config_keys(cls: type, path: str) -> list[str]:
    """Every key path of the run config's dataclass ``cls`` (mapping sections by their value class)."""
    from rljax.models import ModelConfig
    from rljax.run.config import RUN_SET_FIELDS, EnvSection

    keys = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in RUN_SET_FIELDS.get(cls, ()):
            continue
        key = f"{path}.{field.name}"
        keys.append(key)
        hint = hints[field.name]
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if dataclasses.is_dataclass(inner[0]):
            keys += _config_keys(inner[0], key)
        elif key == "config.envs":
            keys += _config_keys(EnvSection, "config.envs.<name>")
        elif key == "config.model.init":  # a mapping of ModelConfig's fields
            keys += _config_keys(ModelConfig, key)
    return keys


def test_the_config_reference_lists_every_key_with_type_default_and_meaning(built):
    from rljax.run.config import RunConfig

    rows = {
        r[0]: r for r in _page(built / "reference" / "config.html").rows if r and r[0].startswith("config.")
    }
    keys = _config_keys(RunConfig, "config")
    assert len(keys) > 150
    assert [k for k in keys if k not in rows] == []
    assert [k for k in keys if len(rows[k]) != 4 or not all(rows[k])] == []  # key, type, default, meaning
    assert rows["config.trainer.seq_len"][1:3] == ["int", str(RunConfig().trainer.seq_len)]
    assert rows["config.model.compute_dtype"][2] == repr(RunConfig().model.compute_dtype)
    assert rows["config.model.init.partial_rotary_factor"][1:3] == ["float", "1.0"]


def test_the_notebooks_are_executed(built):
    pages = sorted((built / "notebooks").glob("*.html"))
    assert pages
    for page in pages:
        text = page.read_text(encoding="utf-8")
        cells, outputs = text.count('class="cell docutils container"'), text.count("cell_output")
        assert cells > 0 and outputs > 0, page.name  # every notebook has code and ran it


def test_the_site_lists_its_pages_in_the_navigation(built):
    index = _page(built / "index.html")
    for page in ("getting_started.html", "reference/config.html", "reference/index.html", "design.html"):
        assert (built / page).is_file() and any(h.split("#")[0] == page for h in index.links), page


# -- in a browser ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(built):
    """The site served over HTTP on 127.0.0.1 (as a docs host serves it: the search page fetches
    the pages it finds, which a browser refuses for file:// URLs)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(built)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize(
    "page",
    [
        "index.html",
        "reference/api/rljax.core.html",
        "reference/config.html",
        "guides/algorithms.html",
        "notebooks/advantages.html",
        "search.html?q=advantage",
    ],
)
def test_the_page_opens_in_headless_chromium_without_console_errors(built, served, page):
    chromium = browser.find_chromium()
    if chromium is None:
        _missing("chromium (.ci/install_chromium.sh)")
    assert (built / page.partition("?")[0]).is_file()
    assert browser.console_errors(chromium, f"{served}/{page}") == []


def test_the_console_error_reader_sees_errors(tmp_path):
    """The browser check can fail: a page with a missing script, an exception and console.error."""
    chromium = browser.find_chromium()
    if chromium is None:
        _missing("chromium (.ci/install_chromium.sh)")
    page = tmp_path / "broken.html"
    page.write_text(
        '<html><head><script src="missing.js"></script></head><body>'
        '<script>console.error("boom"); console.log("fine"); undefined_function();</script></body></html>'
    )
    errors = browser.console_errors(chromium, page.as_uri())
    assert len(errors) == 3, errors
    assert any("missing.js" in e for e in errors) and any("boom" in e for e in errors)
    assert any("undefined_function" in e for e in errors)
