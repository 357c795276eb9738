"""directkv_cute.tuning: search spaces, model presets, YAML profiles, the config lookup and the
Optuna tuner behind ``directkv-tune``.

Installed as ``directkv_cute.tuning`` (pyproject maps the top-level ``tuning/`` folder there);
in a bare source checkout it also imports as ``tuning`` (``python -m tuning.cli``).

Importing this package is cheap (no torch, optuna or cutlass): the op only needs
:func:`select_config`. The tuner (optuna) loads on first use of its names.
"""

from __future__ import annotations

from .lookup import Decision, ProfileMissError, clear_cache, explain_config, select_config
from .presets import PRESETS, ModelPreset, get_preset
from .profiles import (
    Profile,
    ProfileError,
    ProfileWarning,
    current_kernel_hash,
    default_output_dir,
    find_profile,
    find_profiles,
    load_profile,
    profile_dirs,
    profile_filename,
    sanitize_gpu_name,
    save_profile,
    user_profile_dir,
)
from .space import DecodeSpace, KernelSpace, TuneShape, get_space, register_space, space_hash

_LAZY = {
    "Tuner": "tuner",
    "TuneOptions": "tuner",
    "BucketResult": "tuner",
    "TunerAbort": "tuner",
    "tune": "tuner",
    "format_results": "tuner",
    "ModelledObjective": "objectives",
    "GpuObjective": "objectives",
    "HardwareModel": "objectives",
    "QTiledModel": "objectives",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


__all__ = [
    "PRESETS", "BucketResult", "Decision", "DecodeSpace", "GpuObjective", "HardwareModel", "KernelSpace",
    "ModelPreset", "ModelledObjective", "Profile", "QTiledModel", "ProfileError", "ProfileMissError", "ProfileWarning",
    "TuneOptions", "TuneShape", "Tuner", "TunerAbort", "clear_cache", "current_kernel_hash", "default_output_dir",
    "explain_config", "find_profile", "find_profiles", "format_results", "get_preset", "get_space", "load_profile", "profile_dirs",
    "profile_filename", "register_space", "sanitize_gpu_name", "save_profile", "select_config", "space_hash",
    "tune", "user_profile_dir",
]
