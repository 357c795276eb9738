"""Where directkv-cute keeps per-user files: one cache folder for compiled kernels and tuner journals."""

from __future__ import annotations

import os
from pathlib import Path

from directkv_cute import env

CACHE_DIR_ENV = env.CACHE_DIR


def cache_root() -> Path:
    """``$DIRECTKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/directkv_cute``, else ``~/.cache/directkv_cute``.
    A bad ``DIRECTKV_CACHE_DIR`` raises ``env.EnvironmentVariableError``."""
    mine = env.cache_dir()
    if mine is not None:
        return mine
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "directkv_cute"


def kernel_cache_root() -> Path | None:
    """The compiled-kernel disk cache's root (:func:`cache_root`), None when ``DIRECTKV_DISK_CACHE``
    turns it off. Bad values of either variable raise ``env.EnvironmentVariableError``."""
    return cache_root() if env.disk_cache_enabled() else None
