"""The environment variables directkv-cute reads: one declaration each, one parser per kind.

Every variable is read when it is used (never cached at import), so a change takes effect on the
next call. An empty value is the same as an unset one. A value that does not parse raises
:class:`EnvironmentVariableError`, naming the variable, the value and what it accepts, before the
call that reads it does any work; nothing falls back silently.

Kinds:

* ``flag`` -- exactly 1/0, true/false, yes/no, on/off (any case, surrounding blanks ignored).
* ``size`` -- GiB (2**30 bytes), a finite decimal number >= 0; 0 means the variable's default; a
  positive size must come to at least one byte.
* ``folder`` -- a folder path (``~`` is expanded); it need not exist, but an existing path must be
  a folder.
* ``folders`` -- folder paths separated by ``os.pathsep``, each as ``folder``.
* ``choice`` -- the flag values, or one of the variable's named modes.
* ``budget`` -- a sparse decode budget as ``sparse.parse_budget`` reads it: a fraction of the
  pages (``1/8``, ``0.125``) or a page count (``256p``).

Plain Python (no torch; ``sparse_budget`` is plain Python too): host code and tests read it on any
machine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from directkv_cute.sparse_budget import SparseBudget, parse_budget

GIB = 1 << 30
FLAG_TRUE = ("1", "true", "yes", "on")
FLAG_FALSE = ("0", "false", "no", "off")
_SHOWN_CHARS = 200  # of a bad value, in the error


class EnvironmentVariableError(ValueError):
    """An environment variable holds a value its parser does not accept."""

    def __init__(self, name: str, value: str, why: str, accepts: str):
        shown = value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "..."
        super().__init__(f"{name}={shown!r}: {why}; {name} takes {accepts}")
        self.name, self.value = name, value


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # "flag" | "size" | "folder" | "folders" | "choice" | "budget"
    default: str  # what an unset (or empty) variable means, in words
    meaning: str
    modes: tuple = ()  # a choice's named modes beyond the flag values

    @property
    def accepts(self) -> str:
        flags = "1/0, true/false, yes/no or on/off"
        if self.kind == "flag":
            return flags
        if self.kind == "choice":
            return f"{flags}, or {' / '.join(self.modes)}"
        if self.kind == "size":
            return f"a size in GiB, a finite number > 0 (0 or unset: {self.default})"
        if self.kind == "folder":
            return "a folder path (absent: created when needed)"
        if self.kind == "budget":
            return "a fraction of the pages in (0, 1] (1/8, 0.125) or a page count >= 1 (256p)"
        return f"folder paths separated by {os.pathsep!r}"


DISK_CACHE = "DIRECTKV_DISK_CACHE"
CACHE_DIR = "DIRECTKV_CACHE_DIR"
PROFILE_DIR = "DIRECTKV_PROFILE_DIR"
REQUIRE_PROFILE = "DIRECTKV_REQUIRE_PROFILE"
MAX_STAGING_GB = "DIRECTKV_MAX_STAGING_GB"
STAGE_OVERLAP = "DIRECTKV_STAGE_OVERLAP"
MAX_WORKSPACE_GB = "DIRECTKV_MAX_WORKSPACE_GB"
VLLM_HBM_GB = "DIRECTKV_VLLM_HBM_GB"
VLLM_SPARSE_BUDGET = "DIRECTKV_VLLM_SPARSE_BUDGET"

VARIABLES = {v.name: v for v in (
    Variable(DISK_CACHE, "flag", "on", "keep compiled kernels on disk (off: compile in memory only)"),
    Variable(CACHE_DIR, "folder", "$XDG_CACHE_HOME/directkv_cute, else ~/.cache/directkv_cute",
             "the per-user cache folder: compiled kernels and tuner journals"),
    Variable(PROFILE_DIR, "folders", "none (the user folder, then the bundled profiles)",
             "tuned-profile folders searched first; the tuner writes to the first"),
    Variable(REQUIRE_PROFILE, "choice", "off",
             "on: a launch no tuned profile entry serves is an error; exact: a nearest-bucket match is too",
             modes=("exact",)),
    Variable(MAX_STAGING_GB, "size", "an eighth of the GPU's memory",
             "the most HBM the staging buffers of staged calls may take"),
    Variable(STAGE_OVERLAP, "flag", "on", "staged calls may copy ahead of the current stream"),
    Variable(MAX_WORKSPACE_GB, "size", "a quarter of the GPU's memory",
             "the most HBM the multi-token kernel's fp32 partials may take"),
    Variable(VLLM_HBM_GB, "size", "no HBM tier",
             "the HBM the vLLM backend gives HBM copies of KV blocks, over all its layers"),
    Variable(VLLM_SPARSE_BUDGET, "budget", "exact decode (every page read)",
             "the vLLM backend's decode rows read only their best pages under this budget"),
)}


def _raw(name: str) -> str | None:
    """The variable's value, None when unset or empty (blanks only)."""
    v = os.environ.get(name)
    return v if v is not None and v.strip() else None


def _declared(name: str, *kinds: str) -> Variable:
    var = VARIABLES[name]
    if var.kind not in kinds:
        raise TypeError(f"{name} is a {var.kind} variable, not {' or '.join(kinds)}")
    return var


def _flag_value(raw: str) -> bool | None:
    v = raw.strip().lower()
    if v in FLAG_TRUE:
        return True
    if v in FLAG_FALSE:
        return False
    return None


def flag(name: str) -> bool:
    """A ``flag`` variable: its declared default ("on" / "off") when unset or empty."""
    var = _declared(name, "flag")
    raw = _raw(name)
    if raw is None:
        return var.default == "on"
    v = _flag_value(raw)
    if v is None:
        raise EnvironmentVariableError(name, raw, "not a flag value", var.accepts)
    return v


def choice(name: str) -> str:
    """A ``choice`` variable: "" (unset, empty or a false flag value), "on" (a true flag value) or
    one of its modes, lower-cased."""
    var = _declared(name, "choice")
    raw = _raw(name)
    if raw is None:
        return ""
    v = _flag_value(raw)
    if v is not None:
        return "on" if v else ""
    mode = raw.strip().lower()
    if mode in var.modes:
        return mode
    raise EnvironmentVariableError(name, raw, "not one of its values", var.accepts)


def size_bytes(name: str) -> int | None:
    """A ``size`` variable in bytes; None when unset, empty or 0 (the caller's default)."""
    var = _declared(name, "size")
    raw = _raw(name)
    if raw is None:
        return None
    try:
        gb = float(raw.strip())
    except ValueError:
        raise EnvironmentVariableError(name, raw, "not a number", var.accepts) from None
    if not math.isfinite(gb):
        raise EnvironmentVariableError(name, raw, "not a finite number", var.accepts)
    if gb < 0:
        raise EnvironmentVariableError(name, raw, "negative", var.accepts)
    if gb == 0:
        return None
    nbytes = gb * GIB
    if not math.isfinite(nbytes):
        raise EnvironmentVariableError(name, raw, "too large", var.accepts)
    if nbytes < 1:
        raise EnvironmentVariableError(name, raw, "less than one byte", var.accepts)
    return int(nbytes)


def _folder(var: Variable, raw: str, text: str) -> Path:
    p = Path(os.path.expanduser(text))
    if os.path.lexists(p) and not p.is_dir():
        raise EnvironmentVariableError(var.name, raw, f"{p} exists and is not a folder", var.accepts)
    return p


def folder(name: str) -> Path | None:
    """A ``folder`` variable; None when unset or empty."""
    var = _declared(name, "folder")
    raw = _raw(name)
    return None if raw is None else _folder(var, raw, raw)


def folders(name: str) -> list[Path]:
    """A ``folders`` variable, in order, duplicates kept out; [] when unset or empty."""
    var = _declared(name, "folders")
    raw = _raw(name)
    out = []
    for part in ([] if raw is None else raw.split(os.pathsep)):
        if part.strip():
            p = _folder(var, raw, part)
            if p not in out:
                out.append(p)
    return out


def budget(name: str) -> SparseBudget | None:
    """A ``budget`` variable (``sparse.parse_budget``); None when unset or empty."""
    var = _declared(name, "budget")
    raw = _raw(name)
    if raw is None:
        return None
    try:
        return parse_budget(raw)
    except ValueError:
        raise EnvironmentVariableError(name, raw, "not a sparse budget", var.accepts) from None


_PARSERS = {"flag": flag, "choice": choice, "size": size_bytes, "folder": folder, "folders": folders,
            "budget": budget}


def check_all() -> None:
    """Parse every declared variable (for a tool to refuse a bad one before it starts work)."""
    for var in VARIABLES.values():
        _PARSERS[var.kind](var.name)


# ---- the variables, one reader each --------------------------------------------------------------


def disk_cache_enabled() -> bool:
    """``DIRECTKV_DISK_CACHE``: whether compiled kernels are kept on disk (default on)."""
    return flag(DISK_CACHE)


def cache_dir() -> Path | None:
    """``DIRECTKV_CACHE_DIR``, or None (the caller's default folder)."""
    return folder(CACHE_DIR)


def profile_dirs() -> list[Path]:
    """``DIRECTKV_PROFILE_DIR``'s folders, in order ([] when unset)."""
    return folders(PROFILE_DIR)


def require_profile() -> str:
    """``DIRECTKV_REQUIRE_PROFILE``: "" (off, the default), "on" or "exact"."""
    return choice(REQUIRE_PROFILE)


def max_staging_bytes() -> int | None:
    """``DIRECTKV_MAX_STAGING_GB`` in bytes, or None (unset or 0: an eighth of the GPU's memory)."""
    return size_bytes(MAX_STAGING_GB)


def stage_overlap() -> bool:
    """``DIRECTKV_STAGE_OVERLAP``: whether staged calls may copy ahead (default on)."""
    return flag(STAGE_OVERLAP)


def max_workspace_bytes() -> int | None:
    """``DIRECTKV_MAX_WORKSPACE_GB`` in bytes, or None (unset or 0: a quarter of the GPU's memory)."""
    return size_bytes(MAX_WORKSPACE_GB)


def vllm_hbm_bytes() -> int:
    """``DIRECTKV_VLLM_HBM_GB`` in bytes: the vLLM backend's HBM for block mirrors over all its
    layers; 0 (unset or 0) keeps every block in host memory only."""
    return size_bytes(VLLM_HBM_GB) or 0


def vllm_sparse_budget() -> SparseBudget | None:
    """``DIRECTKV_VLLM_SPARSE_BUDGET``: the ``SparseBudget`` the vLLM backend's decode rows read
    under, or None (unset or empty: exact decode)."""
    return budget(VLLM_SPARSE_BUDGET)


__all__ = ["EnvironmentVariableError", "VARIABLES", "Variable", "budget", "cache_dir", "check_all", "choice",
           "disk_cache_enabled", "flag", "folder", "folders", "max_staging_bytes", "max_workspace_bytes",
           "profile_dirs", "require_profile", "size_bytes", "stage_overlap", "vllm_hbm_bytes",
           "vllm_sparse_budget"]
