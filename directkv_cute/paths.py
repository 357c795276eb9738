"""Where directkv-cute keeps per-user files: one cache folder for compiled kernels and tuner journals."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "DIRECTKV_CACHE_DIR"


def cache_root() -> Path:
    """``$DIRECTKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/directkv_cute``, else ``~/.cache/directkv_cute``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "directkv_cute"
