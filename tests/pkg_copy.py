"""A copy of the package's .py files to mutate (tests of what the source hashes and cache keys cover)."""

from __future__ import annotations

import shutil
from pathlib import Path

from directkv_cute.kernels import sources


def package_copy(tmp_path) -> Path:
    """The package's .py files under tmp_path/pkg (the layout sources.py hashes)."""
    root = tmp_path / "pkg"
    for f in sources.PACKAGE_DIR.rglob("*.py"):
        rel = f.relative_to(sources.PACKAGE_DIR)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, root / rel)
    return root


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))
