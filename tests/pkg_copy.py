"""A copy of the package's .py files to mutate (tests of what the source hashes and cache keys cover)."""

from __future__ import annotations

import ast
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


def package_imports(path: Path) -> set[str]:
    """Files of directkv_cute that ``path`` imports (at module level or in a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if not name.startswith("directkv_cute."):
                continue
            rel = name.removeprefix("directkv_cute.").replace(".", "/")
            if (sources.PACKAGE_DIR / f"{rel}.py").exists():
                out.add(f"{rel}.py")
    return out


# jit's cache plumbing and the kernel specs (what its keys keep): they generate no code
HOST_ONLY = {"kernels/sources.py", "kernels/specs.py", "kernels/disk_cache.py", "paths.py"}
