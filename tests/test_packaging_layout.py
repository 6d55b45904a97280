"""Every directory of Python modules under rljax/ is a regular package (an ``__init__.py``): the
wheel's package discovery (setuptools ``find:``) skips namespace directories, so a module there would
import from a checkout and be missing from an installed wheel. The recipes are the top-level
``configs/`` (one copy), which the wheel carries as data files and ``rljax.recipes`` imports."""

from __future__ import annotations

import configparser
import importlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rljax"


def test_every_module_directory_is_a_package():
    dirs = {p.parent for p in ROOT.rglob("*.py")}
    assert len(dirs) > 10
    missing = sorted(str(d.relative_to(ROOT.parent)) for d in dirs if not (d / "__init__.py").exists())
    assert not missing, f"directories with modules but no __init__.py: {missing}"


REPO = ROOT.parent
CONFIGS = REPO / "configs"


def test_the_recipes_are_the_top_level_configs_one_copy():
    import rljax.recipes

    assert rljax.recipes.CONFIGS_DIR == CONFIGS and rljax.recipes.__path__ == [str(CONFIGS)]
    assert sorted(p.name for p in (ROOT / "recipes").iterdir() if p.suffix == ".py") == ["__init__.py"]
    names = sorted(p.stem for p in CONFIGS.glob("*.py"))
    assert {"default", "smoke", "qwen3_gpu"} <= set(names) and not (CONFIGS / "__init__.py").exists()
    for name in names:
        module = importlib.import_module(f"rljax.recipes.{name}")
        assert pathlib.Path(module.__file__) == CONFIGS / f"{name}.py" and callable(module.get_config)


def test_the_wheel_ships_every_config_as_data():
    """setup.cfg's data_files put configs/*.py at <prefix>/share/rljax/configs, where an installed
    rljax.recipes finds them through the distribution's file list."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    ((target, pattern),) = [(k, v.strip()) for k, v in cfg["options.data_files"].items()]
    assert target == "share/rljax/configs" and pattern == "configs/*.py"
    assert sorted(REPO.glob(pattern)) == sorted(CONFIGS.glob("*.py"))


def test_an_installed_wheel_finds_its_configs(tmp_path):
    from importlib.metadata import PackagePath

    from rljax.recipes import INSTALLED_CONFIGS, configs_dir

    site = tmp_path / "lib" / "site-packages"
    data = tmp_path.joinpath(*INSTALLED_CONFIGS)
    data.mkdir(parents=True)
    (data / "default.py").write_text("")
    files = []
    for rel in ("rljax/__init__.py", "../../share/rljax/configs/default.py"):
        path = PackagePath(rel)
        path.locate = lambda rel=rel: site / rel  # as a Distribution's files locate themselves
        files.append(path)
    assert configs_dir(checkout=site, files=files) == data.resolve()
    assert configs_dir(checkout=tmp_path / "nowhere", files=[]) == pathlib.Path(
        sys.prefix, *INSTALLED_CONFIGS
    )
