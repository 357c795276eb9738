"""Tuned profiles: one YAML file per GPU, ``profiles/<GPU_NAME>.yaml``.

Layout (schema_version 3)::

    schema_version: 3
    metadata:
      tune_version: 1                 # version of the tuning semantics (bumped by hand)
      gpu_name: NVIDIA H200
      compute_capability: '9.0'
      sm_count: 132
      smem_optin_bytes: 232448
      host_link_gbps: 54.3            # measured pinned host -> device copy
      hbm_gbps: 4400.0                # measured device-to-device copy
      objective: gpu                  # 'gpu' (measured) or 'model' (cost model, demos only)
      versions: {cutlass_dsl: 4.8.1, torch: 2.11.0, cuda: '13.0', optuna: 5.0.0, directkv_cute: 0.1.0}
      created: '2026-11-30T10:00:00Z'
      updated: '2026-11-30T10:42:00Z'
      machine_sources: {link_gbps: 'measured: ...', fold_gbps: scaled from H200 by HBM bandwidth, ...}
    machine: {link_gbps: 51.0, ...}   # the planner's rates (directkv_cute.machine.MachineModel)
    entries:
    - kernel: decode                  # key, part 1: kernel, dtype, head_dim, GQA group, page_size
      dtype: bf16
      head_dim: 128
      group: 8
      page_size: 64
      buckets:                        # key, part 2: the shape bucket
      - batch: 1
        context: 4096
        q_len: 1
        config: {tile_n: 64, stages: 4, num_splits: 0, ctas_per_sm: 2, carveout: 80, consumer_wgs: 1}
        p50_us: 95.1                  # tuned config, median
        default_p50_us: 120.4         # heuristic default, same run and repetitions
        trials: 40                    # configs measured
        kernel_hash: 3f5c...          # the kernel's sources when it was tuned (current_kernel_hash)

Each bucket records the hash of the sources that generate its kernel's launch
(``directkv_cute.kernels.sources.kernel_hash``: the kernel's files, the shared parts it imports,
the config rules, and the split combine), so editing one kernel leaves the others' entries
current. An entry whose hash differs is *stale*: the lookup still uses it while its config is
legal under the current rules, with a warning naming the re-tune command, and ``directkv-tune
check`` lists it. Schema 1 (one ``metadata.kernel_hash`` over every file in ``kernels/``) is
migrated on load: every bucket gets that hash, which matches no per-kernel hash, so each entry
is stale until re-tuned. Schema 2 named the multi-token kernel ``prefill``: its entries are read
as ``multi_token`` (schema 3 names each kernel as its spec does, ``directkv_cute.kernels.specs``)
and keep their hashes, taken under the old name, so they are stale until re-tuned.

Files are read with a safe YAML loader that refuses anchors and aliases (a profile never needs
them; an alias bomb would expand without bound), after a size check (``MAX_PROFILE_BYTES``), and
validated by hand (no schema dependency); a bad file raises :class:`ProfileError` naming the
file and the field, its text bounded (``MAX_ERROR_CHARS``). Writes are atomic (temp file +
``os.replace``), keep the mode of the file they replace (0644 for a new one) and are merged with
the file on disk (the new run wins per bucket).

Folders, in lookup order (:func:`profile_dirs`): ``$DIRECTKV_PROFILE_DIR`` (os.pathsep-separated),
the user folder (``$XDG_CONFIG_HOME/directkv_cute/profiles``, else
``~/.config/directkv_cute/profiles``), the bundled ``directkv_cute.profiles``. The tuner writes
to :func:`default_output_dir`: the first ``$DIRECTKV_PROFILE_DIR`` folder, else the bundled folder
of a source checkout (to be committed), else the user folder (an installed package's own folder
is wiped by a reinstall).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import datetime as _dt
import functools
import importlib.util
import math
import os
import re
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from directkv_cute import env as envvars
from directkv_cute.config import ConfigError
from directkv_cute.kernels import sources
from directkv_cute.machine import MachineModel, machine_problems
from directkv_cute.version import __version__

from .space import get_space, kernels, normalize_dtype

SCHEMA_VERSION = 3
TUNE_VERSION = 1
PROFILE_DIR_ENV = envvars.PROFILE_DIR
TUNE_COMMAND = "directkv-tune"
USER_DIR_PARTS = ("directkv_cute", "profiles")  # under $XDG_CONFIG_HOME (else ~/.config)
MAX_PROFILE_BYTES = 4 << 20  # a tuned profile is tens of KB; refuse anything larger before parsing
MAX_ERROR_CHARS = 4000  # a ProfileError's text (problems quote the file's values)
NEW_FILE_MODE = 0o644  # a new profile is readable by every user of the machine
STALE_TMP_SECONDS = 600  # a save's temp file older than this (or of a dead writer) is removed

ClassKey = tuple  # (kernel, dtype, head_dim, group, page_size)
BucketKey = tuple  # (batch, context, q_len)

CLASS_FIELDS = ("kernel", "dtype", "head_dim", "group", "page_size")
BUCKET_FIELDS = ("batch", "context", "q_len")


class ProfileError(ValueError):
    """A profile file that cannot be used: corrupt, of an unknown schema, or for other hardware.

    Its text is cut to ``MAX_ERROR_CHARS`` (a hostile file cannot make the warning huge).
    ``fields``: where each problem of an invalid profile is ("metadata.gpu_name",
    "machine.link_gbps", ...; empty for a file that could not be read as a profile at all)."""

    def __init__(self, msg="", *args, fields=()):
        super().__init__(clip(str(msg)), *args)
        self.fields = tuple(fields)


def one_line(text) -> str:
    """A message as one line (a ``ProfileError`` lists its problems on lines of their own)."""
    out = ""
    for part in (p.strip() for p in str(text).splitlines()):
        if part:
            out += part if not out else (" " if out.endswith(":") else "; ") + part
    return out


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + f" ... ({len(text) - limit} more characters)"


class ProfileWarning(UserWarning):
    """A profile (or a profile entry) that is skipped: stale, foreign, or missing."""


# ---- names and places ------------------------------------------------------------------------


def sanitize_gpu_name(name: str) -> str:
    """File-name form of a GPU name: 'NVIDIA H200' -> 'NVIDIA_H200'."""
    s = re.sub(r"[^A-Za-z0-9.+-]+", "_", str(name).strip()).strip("_.")
    if not s:
        raise ValueError(f"cannot make a file name of GPU name {name!r}")
    return s


def profile_filename(gpu_name: str) -> str:
    return sanitize_gpu_name(gpu_name) + ".yaml"


def bundled_profile_dir() -> Path:
    """The profiles shipped with the package (``directkv_cute.profiles``).

    ``tuning/`` and ``profiles/`` are siblings in every layout: the source checkout (the GPU
    machine runs ``python -m tuning.cli`` from it, uninstalled), an editable install, and an
    installed wheel (``directkv_cute/tuning`` next to ``directkv_cute/profiles``).
    """
    sibling = Path(__file__).resolve().parent.parent / "profiles"
    if sibling.is_dir():
        return sibling
    try:
        spec = importlib.util.find_spec("directkv_cute.profiles")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return sibling


def user_profile_dir() -> Path:
    """The user's profile folder: ``$XDG_CONFIG_HOME/directkv_cute/profiles``, else
    ``~/.config/directkv_cute/profiles`` (survives reinstalls of the package)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base).joinpath(*USER_DIR_PARTS)


def _env_dirs() -> list[Path]:
    return envvars.profile_dirs()  # a bad value raises envvars.EnvironmentVariableError


def is_source_checkout() -> bool:
    """Whether the bundled folder is a source checkout's ``profiles/`` (an editable install or a
    bare checkout: the repository's pyproject.toml is next to it), not an installed package's."""
    return (bundled_profile_dir().parent / "pyproject.toml").is_file()


def default_output_dir() -> Path:
    """Where the GPU tuner writes by default: the first ``$DIRECTKV_PROFILE_DIR`` folder, else the
    bundled folder of a source checkout (where tuned profiles are committed), else the user
    folder (an installed package's folder is inside site-packages, wiped by a reinstall)."""
    env = _env_dirs()
    if env:
        return env[0]
    return bundled_profile_dir() if is_source_checkout() else user_profile_dir()


def profile_dirs() -> list[Path]:
    """Where profiles are looked up, in order: $DIRECTKV_PROFILE_DIR (one folder, or several
    separated by os.pathsep), the user folder, then the bundled folder. The first usable file
    wins; an unusable one (corrupt, too large, for other hardware) is skipped with a warning."""
    out = []
    for d in _env_dirs() + [user_profile_dir(), bundled_profile_dir()]:
        if d not in out:
            out.append(d)
    return out


def find_profiles(gpu_name: str, dirs=None) -> list[Path]:
    """Every existing profile file for ``gpu_name`` in the lookup folders, in lookup order."""
    dirs = profile_dirs() if dirs is None else [Path(d) for d in dirs]
    name = profile_filename(gpu_name)
    out = []
    for d in dirs:
        p = d / name
        with contextlib.suppress(OSError):
            if p.is_file():
                out.append(p)
    return out


def expected_profile_path(gpu_name: str) -> Path:
    """Where the tuner would write the profile of ``gpu_name`` by default."""
    return default_output_dir() / profile_filename(gpu_name)


def find_profile(gpu_name: str, dirs=None) -> tuple[Path | None, Path]:
    """(first existing profile path or None, the path where the tuner writes it by default; with
    ``dirs`` given, the first of them)."""
    found = find_profiles(gpu_name, dirs)
    expected = expected_profile_path(gpu_name) if dirs is None else Path(list(dirs)[0]) / profile_filename(gpu_name)
    return (found[0] if found else None), expected


# ---- identity of the kernels and the environment ----------------------------------------------


@functools.lru_cache(maxsize=None)
def current_kernel_hash(kernel: str) -> str:
    """The profile key of tuned kernel ``kernel`` in this installation (computed once per
    process): a sha256 of the files that generate its launch."""
    return sources.kernel_hash(kernel)


def entry_hash_problem(kernel: str, record: dict) -> str | None:
    """Why a bucket of ``kernel`` is stale (tuned for other kernel sources), or None if it is
    current or its kernel is unknown here."""
    if kernel not in sources.tuned_kernels():
        return None
    here, tuned = current_kernel_hash(kernel), record.get("kernel_hash")
    if tuned == here:
        return None
    return f"tuned for {kernel} kernel sources {str(tuned)[:12]}, these are {here[:12]}"


def _dist_version(name: str):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def software_versions() -> dict:
    """Versions recorded in a profile's metadata (None where a package is absent)."""
    out = {"cutlass_dsl": _dist_version("nvidia-cutlass-dsl"), "torch": None, "cuda": None, "optuna": None}
    try:
        import torch

        out["torch"] = str(torch.__version__)  # TorchVersion is a str subclass yaml cannot dump
        out["cuda"] = None if torch.version.cuda is None else str(torch.version.cuda)
    except Exception:
        pass
    try:
        import optuna

        out["optuna"] = str(optuna.__version__)
    except Exception:
        pass
    out["directkv_cute"] = __version__
    return out


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_metadata(env: dict, *, objective: str, extra: dict | None = None) -> dict:
    """Metadata block for a run, from an objective's ``environment()`` record."""
    now = utc_now()
    md = {
        "tune_version": TUNE_VERSION,
        "gpu_name": str(env["gpu_name"]),
        "compute_capability": str(env.get("compute_capability", "")),
        "sm_count": int(env["sm_count"]),
        "smem_optin_bytes": int(env["smem_optin_bytes"]),
        "host_link_gbps": _round_or_none(env.get("host_link_gbps"), 2),
        "hbm_gbps": _round_or_none(env.get("hbm_gbps"), 1),
        "objective": objective,
        "versions": software_versions(),
        "created": now,
        "updated": now,
    }
    if extra:
        md.update(extra)
    return md


def _round_or_none(v, nd):
    return None if v is None else round(float(v), nd)


# ---- the in-memory profile -------------------------------------------------------------------


@dataclass
class Profile:
    metadata: dict
    entries: dict = field(default_factory=dict)  # ClassKey -> {BucketKey: record}
    path: Path | None = None
    schema_version: int = SCHEMA_VERSION
    migrated_from: int | None = None  # the schema of the file this was read from, if older
    # The GPU's machine model (``directkv_cute.machine.MachineModel``'s rates): what the planner's
    # cost model weighs on this GPU. None: the planner's conservative default.
    machine: dict | None = None

    @property
    def gpu_name(self) -> str:
        return self.metadata["gpu_name"]

    def set(self, class_key: ClassKey, bucket: BucketKey, record: dict) -> None:
        self.entries.setdefault(tuple(class_key), {})[tuple(bucket)] = dict(record)

    def get(self, class_key: ClassKey, bucket: BucketKey):
        return self.entries.get(tuple(class_key), {}).get(tuple(bucket))

    def records(self):
        """(class_key, bucket_key, record) for every bucket, in key order."""
        for ck in sorted(self.entries, key=_sort_key):
            for bk in sorted(self.entries[ck]):
                yield ck, bk, self.entries[ck][bk]

    def __len__(self) -> int:
        return sum(len(b) for b in self.entries.values())

    def stale(self):
        """(class_key, bucket_key, why) for every bucket tuned for other kernel sources."""
        out = []
        for ck, bk, rec in self.records():
            why = entry_hash_problem(ck[0], rec)
            if why:
                out.append((ck, bk, why))
        return out

    def compat_problems(self, *, gpu_name: str | None = None) -> list[str]:
        """Why this profile may not serve this GPU at all (empty: it may). Entries tuned for other
        kernel sources are not a reason: see :meth:`stale`."""
        out = []
        if gpu_name is not None and self.gpu_name != gpu_name:
            out.append(f"gpu_name: the profile is for {self.gpu_name!r}, this GPU is {gpu_name!r}")
        tv = self.metadata.get("tune_version")
        if tv != TUNE_VERSION:
            out.append(f"tune_version: the profile has {tv}, this directkv-cute uses {TUNE_VERSION}")
        return out

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_doc(self) -> dict:
        entries = []
        for ck in sorted(self.entries, key=_sort_key):
            buckets = []
            for bk in sorted(self.entries[ck]):
                rec = self.entries[ck][bk]
                b = dict(zip(BUCKET_FIELDS, bk))
                b.update(_ordered_record(rec))
                buckets.append(b)
            e = dict(zip(CLASS_FIELDS, ck))
            e["buckets"] = buckets
            entries.append(e)
        doc = {"schema_version": self.schema_version, "metadata": dict(self.metadata)}
        if self.machine is not None:
            doc["machine"] = dict(self.machine)
        doc["entries"] = entries
        return doc

    def to_yaml(self) -> str:
        header = (
            f"# directkv-cute tuned profile for {self.gpu_name}. Written by {TUNE_COMMAND}; "
            "edit with care (validated on load).\n"
        )
        return header + dump_yaml(self.to_doc(), default_flow_style=None, width=120)

    @classmethod
    def from_doc(cls, doc, source: str = "<profile>") -> "Profile":
        return _validate(doc, source)


class _NoAliasDumper(yaml.SafeDumper):
    """yaml.SafeDumper that writes a shared object out again instead of an anchor + alias (the
    loader refuses those)."""

    def ignore_aliases(self, data):
        return True


def dump_yaml(doc, **kw) -> str:
    """``doc`` as YAML the profile loader reads back: safe types only, no anchors or aliases."""
    return yaml.dump(doc, Dumper=_NoAliasDumper, sort_keys=False, **kw)


def _sort_key(ck):
    return tuple(str(x) if isinstance(x, str) else f"{x:012d}" for x in ck)


_RECORD_ORDER = ("config", "p50_us", "default_p50_us", "trials", "kernel_hash")


def _ordered_record(rec: dict) -> dict:
    out = {k: rec[k] for k in _RECORD_ORDER if k in rec}
    out.update({k: v for k, v in rec.items() if k not in out})
    return out


# ---- validation ------------------------------------------------------------------------------


MAX_INT = 2**63 - 1  # a profile's integers (sizes, counts, config fields) fit int64


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_in_range(v) -> bool:
    return _is_int(v) and -MAX_INT <= v <= MAX_INT


def _is_num(v) -> bool:
    """A finite number a profile may hold (an integer of any size would overflow a float)."""
    return _int_in_range(v) or (isinstance(v, float) and math.isfinite(v))


def _typed(v) -> str:
    """``v``'s type and value for a problem's text, a long value cut (a 400-digit number is
    described, not printed)."""
    if _is_int(v) and not _int_in_range(v):
        digits = len(str(abs(v))) if abs(v).bit_length() < 10000 else "thousands of"
        return f"an integer of {digits} digits"
    return f"{type(v).__name__} {clip(repr(v), 80)}"


class _V:
    """Collects schema problems with their location."""

    def __init__(self, source):
        self.source = source
        self.problems = []
        self.fields = []

    def bad(self, where, msg):
        self.problems.append(clip(f"{where}: {msg}", 300))
        self.fields.append(where)

    def _present(self, d, k, where, required, nullable=False) -> bool:
        """Whether d[k] is there to check: False when it is missing (a problem if required) or
        an allowed None."""
        if k not in d:
            if required:
                self.bad(where, f"missing {k!r}")
            return False
        return not (nullable and d[k] is None)

    def int_(self, d, k, where, *, minimum=None, required=True):
        if not self._present(d, k, where, required):
            return None
        v = d[k]
        if not _is_int(v):
            self.bad(f"{where}.{k}", f"must be an integer, got {_typed(v)}")
            return None
        if not _int_in_range(v):
            self.bad(f"{where}.{k}", f"must be an integer of at most {MAX_INT}, got {_typed(v)}")
            return None
        if minimum is not None and v < minimum:
            self.bad(f"{where}.{k}", f"must be >= {minimum}, got {v}")
        return v

    def num(self, d, k, where, *, positive=True, required=True, nullable=False):
        if not self._present(d, k, where, required, nullable):
            return None
        v = d[k]
        if not _is_num(v):
            self.bad(f"{where}.{k}", f"must be a finite number, got {_typed(v)}")
            return None
        if positive and v <= 0:
            self.bad(f"{where}.{k}", f"must be > 0, got {v}")
        return v

    def str_(self, d, k, where, *, required=True, loose=False, nullable=False):
        if not self._present(d, k, where, required, nullable):
            return None
        v = d[k]
        if loose and (_is_num(v) or isinstance(v, (_dt.date, _dt.datetime))):
            return str(v)  # hand-edited versions / timestamps that YAML typed
        if not isinstance(v, str) or not v:
            self.bad(f"{where}.{k}", f"must be a non-empty string, got {type(v).__name__} {v!r}")
            return None
        return v


_METADATA_INTS = ("tune_version", "sm_count", "smem_optin_bytes")
_KNOWN_TOP = {"schema_version", "metadata", "machine", "entries"}


_HEX64 = re.compile(r"[0-9a-f]{64}")


# Kernel names of older schemas -> the kernel's one name now (schema 2 called the multi-token
# kernel "prefill").
RENAMED_KERNELS = {"prefill": "multi_token"}


def _migrate_v1(doc: dict, source) -> dict:
    """A schema-1 document as schema 2: its one ``metadata.kernel_hash`` goes to every bucket."""
    doc = copy.deepcopy(doc)
    md = doc.get("metadata")
    old = md.pop("kernel_hash", None) if isinstance(md, dict) else None
    if not isinstance(old, str) or not _HEX64.fullmatch(old):
        raise ProfileError(f"{source}: invalid profile:\n  metadata.kernel_hash: must be a sha256 hex digest "
                           f"(schema 1), got {old!r}")
    for e in doc.get("entries") or []:
        for b in (e.get("buckets") if isinstance(e, dict) else None) or []:
            if isinstance(b, dict):
                b.setdefault("kernel_hash", old)
    doc["schema_version"] = 2
    return doc


def _migrate_v2(doc: dict) -> dict:
    """A schema-2 document as schema 3: old kernel names (``prefill``) become the kernel's one name
    (``multi_token``)."""
    doc = copy.deepcopy(doc)
    for e in doc.get("entries") or []:
        if isinstance(e, dict) and isinstance(e.get("kernel"), str):
            e["kernel"] = RENAMED_KERNELS.get(e["kernel"], e["kernel"])
    doc["schema_version"] = 3
    return doc


def _schema(doc, source) -> tuple[dict, int | None]:
    """(the document in the current schema, the older schema it was migrated from or None)."""
    if not isinstance(doc, dict):
        raise ProfileError(f"{source}: not a profile (the YAML top level is {type(doc).__name__}, not a mapping)")
    sv = doc.get("schema_version")
    if not _is_int(sv):
        raise ProfileError(f"{source}: schema_version missing or not an integer ({sv!r})")
    if sv in (1, 2):
        return _migrate_v2(_migrate_v1(doc, source) if sv == 1 else doc), sv
    if sv != SCHEMA_VERSION:
        newer = " (written by a newer directkv-cute?)" if sv > SCHEMA_VERSION else ""
        raise ProfileError(f"{source}: unknown schema_version {sv}{newer}; this version reads "
                           f"{SCHEMA_VERSION} (and migrates 1 and 2)")
    return doc, None


MAX_SOURCE_CHARS = 200  # one entry of metadata.machine_sources


def _machine_sources(v: _V, md: dict) -> None:
    """``metadata.machine_sources`` (optional): how each rate of ``machine:`` was obtained, a
    mapping of rate names (``MachineModel.fields()``) to short non-empty strings."""
    if "machine_sources" not in md:
        return
    ms, where = md["machine_sources"], "metadata.machine_sources"
    if not isinstance(ms, dict):
        v.bad(where, f"must be a mapping of rate names to strings, got {type(ms).__name__}")
        return
    unknown = sorted(clip(repr(k), 40) for k in ms if k not in MachineModel.fields())
    if unknown:
        v.bad(where, f"unknown rates {unknown[:5]}" + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    for k, val in ms.items():
        if k in MachineModel.fields() and (not isinstance(val, str) or not val or len(val) > MAX_SOURCE_CHARS):
            v.bad(f"{where}.{k}", f"must be a non-empty string of at most {MAX_SOURCE_CHARS} characters, "
                                  f"got {_typed(val)}")


def _validate(doc, source) -> Profile:
    doc, migrated_from = _schema(doc, source)
    sv = doc["schema_version"]
    v = _V(source)
    unknown = set(doc) - _KNOWN_TOP
    if unknown:
        v.bad("<top>", f"unknown keys {sorted(unknown, key=repr)}")  # keys of any type: never compared

    md = doc.get("metadata")
    if not isinstance(md, dict):
        v.bad("metadata", "missing or not a mapping")
        md = {}
    else:
        md = dict(md)
        for k in _METADATA_INTS:
            v.int_(md, k, "metadata", minimum=0)
        v.str_(md, "gpu_name", "metadata")
        cc = v.str_(md, "compute_capability", "metadata", loose=True)
        if cc is not None:
            md["compute_capability"] = cc
        for k in ("host_link_gbps", "hbm_gbps"):
            v.num(md, k, "metadata", nullable=True)
        for k in ("created", "updated"):
            s = v.str_(md, k, "metadata", loose=True)
            if s is not None:
                md[k] = s
        v.str_(md, "objective", "metadata", required=False)
        _machine_sources(v, md)
        vers = md.get("versions", {})
        if not isinstance(vers, dict):
            v.bad("metadata.versions", "must be a mapping")
        else:
            vers = dict(vers)
            for k in list(vers):
                if vers[k] is not None:
                    s = v.str_(vers, k, "metadata.versions", loose=True)
                    if s is not None:
                        vers[k] = s
            md["versions"] = vers

    prof = Profile(metadata=md, schema_version=sv, migrated_from=migrated_from)
    machine = doc.get("machine")
    if machine is not None:
        problems = machine_problems(machine)  # the one check of a machine model (the planner's too)
        for where, why in problems:
            v.bad(where, why)
        if not problems:
            prof.machine = dict(machine)
    ents = doc.get("entries")
    if ents is None:
        ents = []
    if not isinstance(ents, list):
        v.bad("entries", f"must be a list, got {type(ents).__name__}")
        ents = []
    for i, e in enumerate(ents):
        where = f"entries[{i}]"
        if not isinstance(e, dict):
            v.bad(where, "must be a mapping")
            continue
        kernel = v.str_(e, "kernel", where)
        dtype = v.str_(e, "dtype", where)
        if dtype is not None:
            try:
                dtype = normalize_dtype(dtype)
            except ValueError as err:
                v.bad(f"{where}.dtype", str(err))
                dtype = None
        nums = [v.int_(e, k, where, minimum=1) for k in ("head_dim", "group", "page_size")]
        unknown = set(e) - set(CLASS_FIELDS) - {"buckets"}
        if unknown:
            v.bad(where, f"unknown keys {sorted(unknown, key=repr)}")
        buckets = e.get("buckets")
        if not isinstance(buckets, list):
            v.bad(f"{where}.buckets", "missing or not a list")
            continue
        if kernel is None or dtype is None or None in nums:
            continue
        ck = (kernel, dtype, *nums)
        if ck in prof.entries:
            v.bad(where, f"duplicate entry for {dict(zip(CLASS_FIELDS, ck))}")
            continue
        prof.entries[ck] = {}
        space = get_space(kernel) if kernel in kernels() else None
        for j, b in enumerate(buckets):
            bw = f"{where}.buckets[{j}]"
            if not isinstance(b, dict):
                v.bad(bw, "must be a mapping")
                continue
            bk = tuple(v.int_(b, k, bw, minimum=1) for k in BUCKET_FIELDS)
            rec = {k: val for k, val in b.items() if k not in BUCKET_FIELDS}
            cfg = rec.get("config")
            if not isinstance(cfg, dict) or not cfg:
                v.bad(f"{bw}.config", "missing or not a mapping")
            else:
                for k, val in cfg.items():
                    if not isinstance(k, str) or not _int_in_range(val):
                        v.bad(f"{bw}.config.{k}", f"must be an integer of at most {MAX_INT}, got {_typed(val)}")
                if space is not None and all(_int_in_range(x) for x in cfg.values()):
                    try:
                        space.config_from_dict(cfg)
                    except (ConfigError, TypeError, ValueError) as err:
                        v.bad(f"{bw}.config", str(err))
            v.num(rec, "p50_us", bw)
            v.num(rec, "default_p50_us", bw, nullable=True)
            v.int_(rec, "trials", bw, minimum=0)
            kh = v.str_(rec, "kernel_hash", bw)
            if kh is not None and not _HEX64.fullmatch(kh):
                v.bad(f"{bw}.kernel_hash", f"must be a sha256 hex digest, got {kh!r}")
            for k in ("p20_us", "p80_us"):
                v.num(rec, k, bw, required=False, nullable=True)
            if None in bk:
                continue
            if bk in prof.entries[ck]:
                v.bad(bw, f"duplicate bucket {dict(zip(BUCKET_FIELDS, bk))}")
                continue
            prof.entries[ck][bk] = rec
    if v.problems:
        shown = v.problems[:12]
        more = f"\n  ... and {len(v.problems) - 12} more" if len(v.problems) > 12 else ""
        raise ProfileError(f"{source}: invalid profile:\n  " + "\n  ".join(shown) + more, fields=v.fields)
    return prof


# ---- files -----------------------------------------------------------------------------------


class _ProfileLoader(yaml.SafeLoader):
    """yaml.SafeLoader without anchors and aliases: a profile has no use for them, and an alias
    bomb (a few KB that expand to gigabytes) must fail at once, not exhaust memory."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            kind = "alias" if isinstance(event, yaml.AliasEvent) else "anchor"
            raise yaml.composer.ComposerError(
                None, None, f"found YAML {kind} {anchor[:40]!r}: profiles may not use anchors or aliases",
                event.start_mark)
        return super().compose_node(parent, index)


def _too_large(n: int, source) -> ProfileError:
    return ProfileError(f"{source}: {n} bytes, more than the {MAX_PROFILE_BYTES} a profile may have "
                        "(MAX_PROFILE_BYTES); not read")


def parse_profile(text: str, source: str = "<string>") -> Profile:
    if len(text) > MAX_PROFILE_BYTES:
        raise _too_large(len(text), source)
    try:
        doc = yaml.load(text, Loader=_ProfileLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ProfileError(f"{source}: corrupt YAML: {clip(str(e), 1000)}") from e
    except (ValueError, OverflowError) as e:  # a scalar the loader cannot convert (an int of 5000 digits)
        raise ProfileError(f"{source}: corrupt YAML: {clip(str(e), 300)}") from e
    except RecursionError as e:
        raise ProfileError(f"{source}: corrupt YAML: nested too deeply") from e
    if doc is None:
        raise ProfileError(f"{source}: empty file")
    return Profile.from_doc(doc, source)


def load_profile(path, *, gpu_name: str | None = None, strict: bool = False) -> Profile:
    """Read and validate a profile file (a schema-1 file is migrated in memory).

    Raises ProfileError for an unreadable, corrupt or invalid file. With ``gpu_name`` given, a
    profile for other hardware (or another tune_version) raises ProfileError when ``strict``,
    else warns (ProfileWarning) and is returned as is; the caller decides (the lookup never uses
    such entries).
    """
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; only a regular file is read
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ProfileError(f"{path}: not a regular file; not read")
            if st.st_size > MAX_PROFILE_BYTES:
                raise _too_large(st.st_size, path)
            raw = f.read(MAX_PROFILE_BYTES + 1)
        if len(raw) > MAX_PROFILE_BYTES:
            raise _too_large(len(raw), path)
        text = raw.decode("utf-8")
    except OSError as e:
        raise ProfileError(f"{path}: cannot read: {e}") from e
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path}: corrupt (not UTF-8 text): {e}") from e
    prof = parse_profile(text, str(path))
    prof.path = path
    problems = prof.compat_problems(gpu_name=gpu_name)
    if problems:
        msg = f"{path}: not usable here: " + "; ".join(problems)
        if strict:
            raise ProfileError(msg)
        warnings.warn(msg, ProfileWarning, stacklevel=2)
    return prof


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}."


def _writer_pid(tmp: Path, path: Path):
    """The pid a temp file of ours names (``.NAME.yaml.<pid>.<random>.tmp``), or None."""
    m = re.fullmatch(re.escape(_tmp_prefix(path)) + r"(\d+)\.[^.]+\.tmp", tmp.name)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def remove_stale_temp_files(path, *, max_age_s: float = STALE_TMP_SECONDS) -> list[Path]:
    """Remove the temp files an interrupted save of ``path`` left (``kill -9`` between mkstemp and
    os.replace): those whose writer pid is dead, and any older than ``max_age_s``. Called by
    :func:`save_profile` under the file lock, where no live writer of this host has one open."""
    path = Path(path)
    removed = []
    now = time.time()
    for tmp in path.parent.glob(_tmp_prefix(path) + "*.tmp"):
        pid = _writer_pid(tmp, path)
        try:
            old = now - tmp.lstat().st_mtime > max_age_s
        except OSError:
            continue
        dead = pid is not None and pid != os.getpid() and not _pid_alive(pid)
        if old or dead:
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def _target_mode(path: Path) -> int:
    """The mode the written file gets: the replaced file's, else NEW_FILE_MODE."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return NEW_FILE_MODE


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and os.replace. The file
    keeps the mode of the one it replaces (0644 for a new one), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _target_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_tmp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with contextlib.suppress(AttributeError):  # os.fchmod: POSIX only
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def lock_path(path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def _open_lock(lp: Path) -> int:
    """An fd on the (empty) lock file; read-only when it belongs to another user (flock needs
    no write access)."""
    try:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, NEW_FILE_MODE)
    except PermissionError:
        return os.open(lp, os.O_RDONLY)
    with contextlib.suppress(OSError):  # umask may have narrowed it; others must open it too
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, NEW_FILE_MODE)
    return fd


@contextlib.contextmanager
def _file_lock(path: Path):
    """flock on ``.NAME.yaml.lock``. The lock file stays after the save, on purpose: it is empty
    and holds no lock once its holder exits (the kernel drops a flock with the process, also on
    kill -9), so a leftover one never blocks; removing it would let a writer that opened the old
    file and one that creates a new file both 'hold' the lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_lock(lock_path(path))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def save_profile(profile: Profile, path=None, *, merge: bool = True) -> Profile:
    """Write ``profile`` atomically, merged with the file already at ``path``.

    Merge rule: per (kernel, dtype, head_dim, group, page_size, batch, context, q_len) the new
    profile's bucket wins; the other buckets of the file on disk are kept, each with its own
    kernel_hash, when that file has the same tune_version (else they are dropped, with a
    warning). ``created`` keeps the older date; ``updated`` is now. A corrupt or foreign file on
    disk raises ProfileError instead of being overwritten. Returns the profile written.
    """
    path = Path(path or profile.path)
    with _file_lock(path):
        for tmp in remove_stale_temp_files(path):
            warnings.warn(f"{path}: removed {tmp.name}, left by an interrupted save", ProfileWarning, stacklevel=2)
        merged = copy.deepcopy(profile)
        merged.path = path
        if merge and path.exists():
            old = load_profile(path)  # ProfileError if corrupt / unknown schema
            if old.gpu_name != profile.gpu_name:
                raise ProfileError(
                    f"{path}: holds a profile for {old.gpu_name!r}, not {profile.gpu_name!r}; "
                    "refusing to overwrite it (move it away or pick another output folder)"
                )
            stale = old.compat_problems()
            if stale:
                warnings.warn(
                    f"{path}: dropping {len(old)} bucket(s) of the old profile: " + "; ".join(stale),
                    ProfileWarning,
                    stacklevel=2,
                )
            else:
                for ck, bk, rec in old.records():
                    if merged.get(ck, bk) is None:
                        merged.set(ck, bk, rec)
            if merged.machine is None:
                merged.machine = old.machine  # the machine model is kept until one is measured anew
                if "machine_sources" in old.metadata:  # and the record of how it was obtained with it
                    merged.metadata["machine_sources"] = old.metadata["machine_sources"]
            merged.metadata["created"] = old.metadata.get("created", merged.metadata.get("created"))
        merged.metadata["updated"] = utc_now()
        text = merged.to_yaml()
        parse_profile(text, f"{path} (about to be written)")  # never write what we could not read back
        atomic_write_text(path, text)
    return merged


def list_profiles(directory) -> list[Path]:
    d = Path(directory)
    return sorted(p for p in d.glob("*.yaml") if p.is_file()) if d.is_dir() else []


def output_problem(directory, gpu_name: str | None = None) -> str | None:
    """Why the tuner could not write its profile into ``directory`` (None: it can), checked
    before any tuning: the folder can be created and written, and a profile already there for
    ``gpu_name`` can be read and merged."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d, prefix=".directkv-tune-probe."):
            pass
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            why += " (pick a writable folder with --output DIR)"
        return f"cannot write profiles to {d}: {why}"
    if gpu_name is not None:
        p = d / profile_filename(gpu_name)
        if p.exists():
            try:
                old = load_profile(p)
            except ProfileError as e:
                return f"the existing profile cannot be merged into: {e}"
            if old.gpu_name != gpu_name:
                return f"{p}: holds a profile for {old.gpu_name!r}, not {gpu_name!r}"
    return None


__all__ = [
    "PROFILE_DIR_ENV",
    "SCHEMA_VERSION",
    "TUNE_VERSION",
    "Profile",
    "ProfileError",
    "ProfileWarning",
    "atomic_write_text",
    "bundled_profile_dir",
    "current_kernel_hash",
    "entry_hash_problem",
    "default_output_dir",
    "dump_yaml",
    "expected_profile_path",
    "find_profile",
    "find_profiles",
    "is_source_checkout",
    "list_profiles",
    "lock_path",
    "output_problem",
    "remove_stale_temp_files",
    "user_profile_dir",
    "load_profile",
    "make_metadata",
    "parse_profile",
    "profile_dirs",
    "profile_filename",
    "sanitize_gpu_name",
    "save_profile",
    "software_versions",
]
