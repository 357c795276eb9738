"""The wheel holds every package of the source tree: each folder of directkv_cute/ with an
``__init__.py`` is listed in pyproject.toml's packages and package-dir (a missing one installs
fine in editable mode and breaks every non-editable install)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_packaged():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(setup["packages"]), setup["package-dir"]
    found = {"directkv_cute." + p.parent.name for p in (ROOT / "directkv_cute").glob("*/__init__.py")}
    assert found and found <= packages, sorted(found - packages)
    for name in found:
        assert dirs.get(name) == name.replace(".", "/"), name


def test_the_package_and_pyproject_agree_on_the_version():
    import directkv_cute

    assert directkv_cute.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
