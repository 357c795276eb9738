"""Compile in a fresh interpreter with CuTe DSL's PTX dump on, for tests that read the generated
code (the DSL reads its environment at import, so the dump cannot be switched on in-process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def dumped_ptx(tmp_path: Path, script: str, cwd: Path | None = None, **env: str) -> str:
    """Run ``script`` (which compiles exactly one kernel) and return that kernel's PTX. ``cwd``
    runs it from a folder whose ``directkv_cute`` shadows the installed one; ``env`` adds
    variables."""
    out = Path(tmp_path) / "ptx"
    out.mkdir(parents=True)  # CuTe DSL dumps nothing into a folder that does not exist
    full = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(out), DIRECTKV_DISK_CACHE="0",
                CUTE_DSL_ARCH="sm_90a", **env)
    full.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-c", script], cwd=cwd, env=full, check=True, timeout=600)
    files = list(out.rglob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()
