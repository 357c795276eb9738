"""Compile in a fresh interpreter and return the generated PTX, for tests that read the code of
another copy of the package (an instrumented one: ``cwd``). The installed package's PTX is read
in-process (tests/test_kernels_compile.py); both ask ``cute.compile`` to keep it (``--keep-ptx``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_KEEP_PTX = """
import itertools as _it, pathlib as _pl
import cutlass.cute as _cute
_real, _n = _cute.compile, _it.count()
def _compile_keeping_ptx(*args, **kwargs):
    fn = _real(*args, options="--keep-ptx --dump-dir=" + {dump!r}, **kwargs)
    _pl.Path({out!r}, "%03d.ptx" % next(_n)).write_text(fn.__ptx__)
    return fn
_cute.compile = _compile_keeping_ptx
"""


def compiled_ptx(tmp_path: Path, script: str, cwd: Path | None = None, **env: str) -> list[str]:
    """Run ``script`` and return the PTX of every kernel it compiled, in order. ``cwd`` runs it
    from a folder whose ``directkv_cute`` shadows the installed one; ``env`` adds variables."""
    out = Path(tmp_path) / "ptx"
    (out / "dump").mkdir(parents=True)
    full = dict(os.environ, DIRECTKV_DISK_CACHE="0", CUTE_DSL_ARCH="sm_90a", **env)
    full.pop("PYTHONPATH", None)
    prelude = _KEEP_PTX.format(dump=str(out / "dump"), out=str(out))
    subprocess.run([sys.executable, "-c", prelude + script], cwd=cwd, env=full, check=True, timeout=600)
    texts = [f.read_text() for f in sorted(out.glob("*.ptx"))]
    assert all(t.count(".entry") == 1 for t in texts)
    return texts


def dumped_ptx(tmp_path: Path, script: str, cwd: Path | None = None, **env: str) -> str:
    """The PTX of the one kernel ``script`` compiles (see compiled_ptx)."""
    texts = compiled_ptx(tmp_path, script, cwd, **env)
    assert len(texts) == 1, len(texts)
    return texts[0]
