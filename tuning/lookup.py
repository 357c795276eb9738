"""Pick a kernel config for a launch: tuned profile entry, else the nearest tuned bucket, else the
heuristic default. Never tunes; cheap after the first call.

Fallback chain (the rule recorded here is the one the code runs):

1. **exact** -- the profile for this GPU (and these kernel sources) has a bucket with the same
   kernel, dtype, head_dim, GQA group, page_size *and* the same (batch, context, q_len).
2. **nearest** -- among that class's buckets (kernel, dtype, head_dim, group, page_size must
   match exactly; configs are never borrowed across them) whose config is legal for the actual
   launch (SMEM / divisibility / consumer warpgroups for the actual query rows): the nearest
   q_len, then the nearest batch, then the nearest context, each measured in log2 space, ties
   going to the smaller tuned value. A bucket where the heuristic default won (its config is
   the default for the bucket's own query rows) lends the default for the *launch's* rows
   instead: the default's row thresholds (e.g. clusters from 2048 rows, chunks of 6 above 8192)
   were measured, and a bucket that kept it says nothing against them.
3. **default** -- ``default_config(head_dim, rows, page_size)`` of the kernel's space
   (``directkv_cute.config.default_decode_config`` for decode). A warning (once per key) names
   the profile path expected and the ``directkv-tune`` command that would produce it.

Profiles for another GPU or another tune_version are never used. A bucket tuned for other
kernel sources (its ``kernel_hash`` is not the kernel's current hash, ``current_kernel_hash``) is
*stale*: it is still used while its config is legal for the launch under the current rules, and
the first use of a stale bucket of each kernel warns once per process with the re-tune command.
``DIRECTKV_REQUIRE_PROFILE=1`` turns a fall-through to the default into a
:class:`ProfileMissError` that shows the asked key against the nearest key on disk;
``DIRECTKV_REQUIRE_PROFILE=exact`` also rejects a nearest-bucket match.

Profiles are searched in ``$DIRECTKV_PROFILE_DIR``, then the user folder
(``$XDG_CONFIG_HOME/directkv_cute/profiles``, else ``~/.config/directkv_cute/profiles``), then the
bundled ``directkv_cute.profiles`` folder (``profiles.profile_dirs``). The first *usable* file for
the GPU wins: one that is corrupt, too large, uses YAML aliases, or is for other hardware is
skipped with a warning and the next folder's is used. Nothing in the lookup raises into the op
except ``DIRECTKV_REQUIRE_PROFILE``'s miss and a value of ``DIRECTKV_REQUIRE_PROFILE`` or
``DIRECTKV_PROFILE_DIR`` that ``directkv_cute.env`` refuses (raised before any profile is read):
any failure reading a profile is a warning and the next source, in the end the default. Loaded profiles and decisions are cached (a decision per full
key in a dict); :func:`clear_cache` forgets them (call it after writing a profile in-process).

The planner's machine model of a GPU is looked up the same way (``machine_for``): the usable
profile's ``machine:`` section, else ``machine.CONSERVATIVE`` with one warning; a profile whose
section is invalid is refused.

Which profile buckets each tuned kernel's entries serve is ``tuned_buckets``.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from directkv_cute import env as envvars
from directkv_cute.machine import CONSERVATIVE, MachineModel, MachineModelError

from .profiles import (
    PROFILE_DIR_ENV,
    TUNE_COMMAND,
    Profile,
    ProfileError,
    ProfileWarning,
    clip,
    expected_profile_path,
    find_profiles,
    load_profile,
    one_line,
    profile_dirs,
)
from .space import get_space, normalize_dtype

log = logging.getLogger("directkv_cute.tuning")

REQUIRE_ENV = envvars.REQUIRE_PROFILE
_MAX_DECISIONS = 1 << 16

_LOCK = threading.Lock()
_DECISIONS: dict = {}  # full key -> (config, source)
_TABLES: dict = {}  # key without context -> _Table
_PROFILES: dict = {}  # path -> ((mtime_ns, size), Profile | ProfileError)
_WARNED: set = set()


class ProfileMissError(ProfileError):
    """DIRECTKV_REQUIRE_PROFILE is set and no (exact) tuned entry serves the launch."""


@dataclass(frozen=True)
class Decision:
    config: object
    source: str  # "exact" | "nearest" | "default"
    bucket: tuple | None  # (batch, context, q_len) of the profile entry used
    profile_path: Path | None
    expected_path: Path
    reason: str  # why not exact (empty when exact)


class _Table:
    """Everything a decision needs for one key except the context: built once, then bisected."""

    __slots__ = ("contexts", "bounds", "configs", "kept_default", "stale", "pair", "reason", "profile_path",
                 "expected_path", "default")

    def __init__(self):
        self.contexts = []
        self.bounds = []
        self.configs = []
        self.kept_default = []  # per bucket: its config is the default for its own rows
        self.stale = []  # per bucket: the kernel hash it was tuned for, if not the current one
        self.pair = None  # (q_len, batch) of the tuned buckets used
        self.reason = ""
        self.profile_path = None
        self.expected_path = None
        self.default = None


def _require_mode() -> str:
    """"", "any" or "exact" (a bad value raises envvars.EnvironmentVariableError)."""
    mode = envvars.require_profile()
    return "any" if mode == "on" else mode


_EPOCH = [0]  # bumped by clear_cache: memos built on the lookups (the op's routes) key on it


def cache_epoch() -> int:
    """How many times the lookup caches have been cleared (a key for memos of their decisions)."""
    return _EPOCH[0]


def clear_cache() -> None:
    """Forget loaded profiles, decisions and which warnings were given."""
    with _LOCK:
        _EPOCH[0] += 1
        _DECISIONS.clear()
        _TABLES.clear()
        _PROFILES.clear()
        _WARNED.clear()


def _warn_once(key, msg, category=ProfileWarning):
    if key in _WARNED:
        return
    _WARNED.add(key)
    # attribute the warning to the first caller outside this package (the op)
    here, level, f = os.path.dirname(__file__), 1, sys._getframe(0)
    while f is not None and os.path.dirname(f.f_code.co_filename) == here:
        f, level = f.f_back, level + 1
    warnings.warn(msg, category, stacklevel=level)
    log.info(msg)


def _load_cached(path: Path):
    """The profile at ``path`` (or the ProfileError it raised), re-read when the file changes."""
    try:
        st = path.stat()
        sig = (st.st_mtime_ns, st.st_size)
    except OSError as e:
        return ProfileError(f"{path}: cannot stat: {e}")
    hit = _PROFILES.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    try:
        prof = load_profile(path)
    except ProfileError as e:
        prof = e
    except Exception as e:  # MemoryError, RecursionError, a bug: never out of the op
        prof = ProfileError(f"{path}: cannot load: {type(e).__name__}: {e}")
    _PROFILES[path] = (sig, prof)
    return prof


def _usable_profile(gpu_name):
    """(path, profile, "") of the first usable profile for ``gpu_name`` in the lookup folders, or
    (None, None, why none is); each unusable file on the way is skipped with a warning."""
    skipped = []
    for path in find_profiles(gpu_name):
        prof = _load_cached(path)
        if isinstance(prof, ProfileError):
            why = f"unusable profile: {prof}"
            _warn_once(("bad", path, str(prof)), f"directkv-cute: ignoring {prof}")
        else:
            problems = prof.compat_problems(gpu_name=gpu_name)
            if not problems:
                return path, prof, ""
            why = f"{path} is not usable here: " + "; ".join(problems)
            _warn_once(("foreign", path, tuple(problems)), f"directkv-cute: ignoring {why}")
        skipped.append(why)
    if skipped:
        return None, None, " | ".join(skipped)
    expected = expected_profile_path(gpu_name)
    return None, None, f"no profile file {expected.name} in {', '.join(str(d) for d in profile_dirs())}"


def _log2_dist(a: int, b: int) -> float:
    return abs(math.log2(a) - math.log2(b))


def _build_table(kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, q_len, rows) -> _Table:
    space = get_space(kernel)
    t = _Table()
    t.default = space.default_config(head_dim, rows, page_size)
    t.expected_path = expected_profile_path(gpu_name)
    try:
        _fill_table(t, space, kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, q_len, rows)
    except Exception as e:  # a profile must never break inference: warn, use the default
        why = clip(f"{type(e).__name__}: {e}", 1000)
        t.contexts, t.bounds, t.configs, t.kept_default, t.stale, t.pair = [], [], [], [], [], None
        t.reason = f"profile lookup failed: {why}"
        _warn_once(("error", t.profile_path, why), f"directkv-cute: ignoring the profile: {t.reason}")
    return t


def _fill_table(t, space, kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, q_len, rows):
    path, prof, why = _usable_profile(gpu_name)
    t.profile_path = path
    if prof is None:
        t.reason = why
        return t
    entries = prof.entries.get((kernel, dtype, head_dim, group, page_size))
    if not entries:
        t.reason = f"{path} has no {kernel} entry for dtype={dtype} head_dim={head_dim} group={group} page_size={page_size}"
        return t
    legal = {}
    illegal = []
    tuned_for = {}
    for bk, rec in entries.items():
        try:
            cfg = space.config_from_dict(rec["config"])
        except Exception as e:  # validated on load; belt and braces
            illegal.append(f"{bk}: {e}")
            continue
        probs = space.static_problems(cfg, head_dim=head_dim, page_size=page_size, rows=rows, dtype=dtype)
        if probs:
            illegal.append(f"{bk}: {'; '.join(probs)}")
        else:
            legal[bk] = cfg
            tuned_for[bk] = rec.get("kernel_hash")
    if not legal:
        t.reason = f"{path}: no tuned config of this class is legal for rows={rows}: " + " | ".join(illegal[:3])
        return t
    pairs = {(bk[2], bk[0]) for bk in legal}
    q_best, b_best = min(pairs, key=lambda p: (_log2_dist(p[0], q_len), p[0], _log2_dist(p[1], batch), p[1]))
    t.pair = (q_best, b_best)
    picked = sorted((bk, cfg) for bk, cfg in legal.items() if bk[2] == q_best and bk[0] == b_best)
    t.contexts = [bk[1] for bk, _ in picked]
    t.configs = [cfg for _, cfg in picked]
    t.stale = [None if tuned_for[bk] == kernel_hash else tuned_for[bk] for bk, _ in picked]
    t.kept_default = [cfg == space.default_config(head_dim, group * q_best, page_size) for cfg in t.configs]
    # geometric midpoints: context x goes to contexts[i] for bounds[i-1] < x <= bounds[i]
    t.bounds = [math.sqrt(a * b) for a, b in zip(t.contexts, t.contexts[1:])]
    return t


def _asked_key(kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, context, q_len):
    return {
        "gpu_name": gpu_name, "kernel_hash": kernel_hash, "kernel": kernel, "dtype": dtype, "head_dim": head_dim,
        "group": group, "page_size": page_size, "batch": batch, "context": context, "q_len": q_len,
    }


def _key_diff(asked: dict, path: Path | None) -> str:
    """Field-by-field difference between the asked key and the closest key of the profile."""
    if path is None:
        return "  (no profile file found)"
    prof = _load_cached(path)
    if isinstance(prof, ProfileError):
        return f"  (profile unreadable: {prof})"
    best, best_score = None, None
    for ck, bk, rec in prof.records():
        k = dict(zip(("kernel", "dtype", "head_dim", "group", "page_size"), ck))
        k.update(zip(("batch", "context", "q_len"), bk))
        k["gpu_name"], k["kernel_hash"] = prof.gpu_name, rec.get("kernel_hash")
        n_diff = sum(k[f] != asked[f] for f in k if f not in ("batch", "context", "q_len", "kernel_hash"))
        dist = sum(_log2_dist(k[f], asked[f]) for f in ("batch", "context", "q_len"))
        score = (n_diff, dist)
        if best_score is None or score < best_score:
            best, best_score = k, score
    if best is None:
        return f"  ({path} has no entries)"
    lines = []
    for f in ("gpu_name", "kernel_hash", "kernel", "dtype", "head_dim", "group", "page_size", "batch", "context", "q_len"):
        a, b = asked[f], best[f]
        if f == "kernel_hash":
            a, b = str(a)[:12], str(b)[:12]
        mark = "  " if a == b else "!="
        lines.append(f"  {mark} {f:<12} asked {a!s:<24} nearest entry {b}")
    return "\n".join(lines)


def _decide(kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, context, q_len, rows,
            quiet: bool = False) -> Decision:
    dt = normalize_dtype(dtype)
    mode = _require_mode()  # the variables parsed first: a bad one raises, never a fall-back
    profile_dirs()
    where = (os.environ.get(PROFILE_DIR_ENV), os.environ.get("XDG_CONFIG_HOME"))  # which profiles are read
    tkey = (kernel, gpu_name, kernel_hash, dt, head_dim, group, page_size, batch, q_len, rows, *where)
    t = _TABLES.get(tkey)
    if t is None:
        t = _build_table(kernel, gpu_name, kernel_hash, dt, head_dim, group, page_size, batch, q_len, rows)
        _TABLES[tkey] = t
    hint = _tune_hint(kernel, dt, head_dim, group, page_size, batch, context, q_len, t.expected_path)
    if t.configs:
        i = bisect.bisect_left(t.bounds, context)
        q_b, b_b = t.pair
        bucket = (b_b, t.contexts[i], q_b)
        if t.stale[i] is not None:
            _warn_stale(kernel, t, bucket, t.stale[i], kernel_hash, hint)
        exact = bucket == (batch, context, q_len)
        if exact:
            return Decision(t.configs[i], "exact", bucket, t.profile_path, t.expected_path, "")
        if mode == "exact":
            asked = _asked_key(kernel, gpu_name, kernel_hash, dt, head_dim, group, page_size, batch, context, q_len)
            raise ProfileMissError(
                f"{REQUIRE_ENV}=exact: no exact {kernel} entry in {t.profile_path} for this launch; "
                f"the nearest bucket is batch={b_b} context={t.contexts[i]} q_len={q_b}:\n"
                + _key_diff(asked, t.profile_path)
            )
        log.debug("directkv-cute: %s uses the nearest tuned bucket %s for batch=%s context=%s q_len=%s",
                  kernel, bucket, batch, context, q_len)
        if t.kept_default[i]:
            return Decision(t.default, "nearest", bucket, t.profile_path, t.expected_path,
                            "nearest bucket kept the default: the default for this launch's rows")
        return Decision(t.configs[i], "nearest", bucket, t.profile_path, t.expected_path, "nearest bucket")
    if mode:
        asked = _asked_key(kernel, gpu_name, kernel_hash, dt, head_dim, group, page_size, batch, context, q_len)
        raise ProfileMissError(
            f"{REQUIRE_ENV} is set and no tuned {kernel} config serves this launch ({t.reason}).\n"
            f"Expected profile: {t.expected_path}\nKey difference (asked vs nearest key on disk):\n"
            + _key_diff(asked, t.profile_path)
            + f"\nProduce it with: {hint}"
        )
    # once per kernel and cache geometry: a server meets this class at every batch and chunk length
    if not quiet:
        _warn_once(
            ("miss", kernel, gpu_name, kernel_hash, dt, head_dim, group, page_size, *where),
            f"directkv-cute: no tuned {kernel} config for {gpu_name} (dtype={dt} head_dim={head_dim} group={group} "
            f"page_size={page_size}; first at batch={batch} q_len={q_len}): {t.reason}. Using the heuristic "
            f"default {t.default} (not warned again for other shapes of this class). Expected profile: "
            f"{t.expected_path}. Produce it with: {hint}",
        )
    return Decision(t.default, "default", None, t.profile_path, t.expected_path, t.reason)


def _tune_hint(kernel, dt, head_dim, group, page_size, batch, context, q_len, expected_path) -> str:
    return (
        f"{TUNE_COMMAND} run --kernel {kernel} --shape HQ,HKV,{head_dim},{batch},{context},{q_len} "
        f"--page-size {page_size} --dtype {dt} --output {expected_path.parent}   (HQ/HKV = {group}; or --preset NAME)"
    )


def _warn_stale(kernel, t: _Table, bucket, tuned_for, kernel_hash, hint) -> None:
    _warn_once(
        ("stale", kernel),
        f"directkv-cute: {t.profile_path}: using {kernel} entries tuned for other {kernel} kernel sources "
        f"(bucket batch={bucket[0]} context={bucket[1]} q_len={bucket[2]} was tuned for {str(tuned_for)[:12]}, "
        f"these are {str(kernel_hash)[:12]}); their configs are legal under the current rules, but their "
        f"timings may be out of date. Re-tune with: {hint}",
    )


def select_config(kernel: str, *, gpu_name: str, kernel_hash: str, dtype, head_dim: int, group: int, page_size: int,
                  batch: int, context: int, q_len: int, rows: int, quiet: bool = False):
    """``(config, source)`` for one launch; source is "exact", "nearest" or "default"; ``quiet``:
    no warning when no tuned entry serves it (callers that only ask what a launch would use).

    ``rows`` is the query rows per CTA (GQA group x max q_len); ``context`` the longest sequence;
    ``kernel_hash`` the kernel's current source hash (``profiles.current_kernel_hash(kernel)``).
    After the first call for a key this is one dict lookup.
    """
    key = (kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, context, q_len, rows,
           os.environ.get(PROFILE_DIR_ENV), os.environ.get("XDG_CONFIG_HOME"), os.environ.get(REQUIRE_ENV),
           quiet)  # a quiet decision cached must not silence a later call's warning
    hit = _DECISIONS.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        d = _decide(kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, context, q_len, rows,
                    quiet)
        if len(_DECISIONS) >= _MAX_DECISIONS:
            _DECISIONS.clear()
        out = (d.config, d.source)
        _DECISIONS[key] = out
    return out


def explain_config(kernel: str, *, gpu_name: str, kernel_hash: str, dtype, head_dim: int, group: int, page_size: int,
                   batch: int, context: int, q_len: int, rows: int) -> Decision:
    """Like :func:`select_config` but returns the whole :class:`Decision` (uncached, for tools)."""
    with _LOCK:
        return _decide(kernel, gpu_name, kernel_hash, dtype, head_dim, group, page_size, batch, context, q_len, rows)


def profile_for(gpu_name: str) -> Profile | None:
    """The profile the lookup would use for ``gpu_name`` (None if none is usable)."""
    with _LOCK:
        return _usable_profile(gpu_name)[1]


def machine_model(gpu_name: str) -> MachineModel | None:
    """The machine model (``directkv_cute.machine.MachineModel``) of ``gpu_name``'s usable profile,
    or None where it has none."""
    key = (gpu_name, _EPOCH[0], os.environ.get(PROFILE_DIR_ENV), os.environ.get("XDG_CONFIG_HOME"))
    if key not in _MACHINES:
        prof = profile_for(gpu_name)
        _MACHINES[key] = None if prof is None or prof.machine is None else \
            MachineModel.from_dict(gpu_name, prof.machine)
    return _MACHINES[key]


_MACHINES: dict = {}

# The in-place kernel (``kernels.specs.op_kernel``) of the calls whose profile buckets each tuned
# kernel's entries serve: the planner looks decode_fp8 up for decode-sized calls over FP8 pages
# and q_tiled for multi-token calls (staged, or over pages in HBM).
TUNED_BUCKETS = {"decode": "decode", "decode_fp8": "decode", "multi_token": "multi_token", "q_tiled": "multi_token"}


def tuned_buckets(kernel: str) -> str:
    """``op_kernel``'s answer for the buckets the planner looks ``kernel``'s tuned entries up for."""
    return TUNED_BUCKETS.get(kernel, kernel)


_WARNED: set = set()
_REFUSED: dict = {}  # (gpu_name, the lookup's cache epoch, the profile folders' variables) -> refusal or None


def machine_for(gpu_name: str) -> MachineModel:
    """The machine model of ``gpu_name``'s profile, else ``CONSERVATIVE`` (warned once per GPU).

    A profile of this GPU whose ``machine:`` section is there but invalid (``machine_problems``)
    is refused with ``MachineModelError`` naming the file and the field, when it is the profile
    the lookup would read or one before it in the lookup's folders: the planner never plans with
    its rates, nor in silence with other ones."""
    refusal = _machine_refusal(gpu_name)
    if refusal is not None:
        raise MachineModelError(refusal)
    m = machine_model(gpu_name)
    if m is not None:
        return m
    if gpu_name not in _WARNED:
        _WARNED.add(gpu_name)
        warnings.warn(f"directkv-cute: no machine model for {gpu_name} (a `machine:` section in "
                      f"{expected_profile_path(gpu_name)}); the planner uses a conservative default that stages "
                      "only compute-bound calls", ProfileWarning, stacklevel=3)
    return dataclasses.replace(CONSERVATIVE, name=f"{gpu_name} (conservative default)")


def _machine_refusal(gpu_name: str) -> str | None:
    """Why the planner may not plan for ``gpu_name`` (None: it may): the first of its profiles in
    the lookup's order, up to the one the lookup uses, that was refused for its ``machine:``
    section. Cached like the lookup's machine model (``clear_cache`` forgets it)."""
    key = (gpu_name, cache_epoch(), os.environ.get(PROFILE_DIR_ENV), os.environ.get("XDG_CONFIG_HOME"))
    if key in _REFUSED:
        return _REFUSED[key]
    refusal = None
    for path in find_profiles(gpu_name):
        try:
            prof = load_profile(path)
        except ProfileError as e:
            if any(f == "machine" or f.startswith("machine.") for f in getattr(e, "fields", ())):
                refusal = (f"directkv-cute: cannot plan for {gpu_name}: {one_line(e)} (fix the machine: "
                           "section, measure it again with `directkv-tune machine`, or delete it for the "
                           "conservative default)")
                break
            continue  # unusable for another reason: the lookup warns and reads the next folder's
        except Exception:  # noqa: BLE001 - MemoryError, a bug: the lookup warns, never the op here
            continue
        if not prof.compat_problems(gpu_name=gpu_name):
            break  # the profile the lookup uses (its machine: section, if any, is valid)
    if len(_REFUSED) > 256:
        _REFUSED.clear()
    _REFUSED[key] = refusal
    return refusal


__all__ = ["Decision", "machine_for", "machine_model", "ProfileMissError", "REQUIRE_ENV", "clear_cache",
           "explain_config", "profile_for", "select_config", "tuned_buckets"]
