"""``directkv-tune restamp``: re-stamp stale profile entries whose kernels still generate the same code.

A profile bucket records the hash of the sources its kernel was tuned for (``kernel_hash``,
``directkv_cute.kernels.sources.kernel_hash``). An edit of those files that changes no code (a
comment, an import path, a compatibility shim for another CuTe DSL) makes every entry of the
kernel stale although the tuned kernels are the ones the op runs today. This command proves that
with the compiler, per kernel family (decode, decode_fp8, multi_token, q_tiled) and per stale
hash the family's entries carry:

1. the sources they were tuned for: the git revision ``--against REV``, else the newest commit in
   ``git log`` over the family's source files at which ``sources.kernel_hash`` (the same function,
   over the same files, read with ``git cat-file``) gives the recorded hash. With ``--against``
   the revision must hash to it too (or, where that revision listed other files, its own
   ``kernel_hash`` must), else it is not the tuned sources;
2. a sample of the family's kernels (:func:`sample_jobs`): the compile keys of the entries (one
   per config that generates distinct code, per dtype, head dim, GQA group and page size), a
   covering sample of ``MAX_SAMPLE_CONFIGS`` of them where there are more, each in every compiled
   form the op launches (decode: with and without split partials; multi_token: partials;
   decode_fp8: e4m3 pages, both; q_tiled: the three ``specs.Q_TILED_VARIANTS``) and, for the
   families whose launch runs it, the split combine per head dim and dtype;
3. that sample compiled for sm_90a twice, in two fresh interpreters: from the revision's tree
   (``git archive REV directkv_cute`` extracted into a temporary folder, imported through
   PYTHONPATH) and from the current sources (the package this module hashes), so the two versions
   never share a process; each keeps the PTX of its kernels (``--keep-ptx``, as
   ``tests/ptx_dump.py``); the disk cache, CuTe DSL's file cache and line info are off;
4. the two PTX texts of each kernel compared byte for byte after :func:`normalize_ptx`, which
   only replaces the absolute paths of the two source trees by ``<src>`` (the PTX these kernels
   compile to holds no paths and no line info; its symbol names embed the module path, the class
   and the argument types, which are the same in both trees, and no source hash).

Where every sampled kernel's PTX is identical, the entries of that hash get the family's current
hash (an atomic write through ``profiles.save_profile``, everything else kept, and a record in
``metadata.restamped``); where any differs (or a side fails to compile, or no revision hashes to
the recorded one), they stay stale and the line names the kernels. One line per family; exit
status 0 when nothing stale is left, 1 when some entries stay stale, 2 for a user's error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from directkv_cute.kernels import sources, specs

from .profiles import Profile, load_profile, save_profile, software_versions, utc_now
from .space import get_space, kernels

MAX_SAMPLE_CONFIGS = 16  # compile keys per (family, stale hash) at most (each in every launched form)
WORKER_TIMEOUT_S = 120  # a compile worker's start-up, plus PER_KERNEL_TIMEOUT_S per kernel
PER_KERNEL_TIMEOUT_S = 90
ARCH = "sm_90a"  # the profiles' GPUs (Hopper): every kernel compiles for it without a GPU
SRC_PLACEHOLDER = "<src>"
PACKAGE_NAME = "directkv_cute"

# How a label names the Q-tiled variants the op launches ((wait_ready, fold), specs.Q_TILED_VARIANTS).
Q_TILED_FORMS = {(False, False): "hbm", (True, True): "staged-fold", (True, False): "staged"}


class RestampError(Exception):
    """A user's error (no git checkout, a bad revision): one line, exit status 2."""


# ---- the kernels compared ----------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One compiled kernel of the sample, built the same way from either tree."""

    part: str  # decode / decode_fp8 / multi_token / q_tiled / combine
    dtype: str
    head_dim: int
    page_size: int = 0
    group: int = 0
    q_len: int = 1
    config: tuple = ()  # the profile entry's config, as sorted (field, value) pairs
    options: tuple = ()  # (name, value) pairs: split_out / kv_dtype / wait_ready, fold

    def to_json(self) -> dict:
        return {"part": self.part, "dtype": self.dtype, "head_dim": self.head_dim, "page_size": self.page_size,
                "group": self.group, "q_len": self.q_len, "config": dict(self.config), "options": dict(self.options)}

    def label(self) -> str:
        if self.part == "combine":
            return f"combine {self.dtype} d{self.head_dim}"
        cfg = dict(self.config)
        fields = specs.get(self.part).codegen_fields
        code = " ".join(f"{k}={cfg[k]}" for k in fields if k in cfg)
        opts = dict(self.options)
        if self.part == "q_tiled":
            form = Q_TILED_FORMS.get((opts.get("wait_ready"), opts.get("fold")), str(opts))
        elif self.part == "decode_fp8":
            form = f"{opts.get('kv_dtype')} " + ("partials" if opts.get("split_out") else "direct")
        else:
            form = "partials" if opts.get("split_out") else "direct"
        return f"{self.part} {self.dtype} d{self.head_dim} g{self.group} p{self.page_size} {code} [{form}]"


def _forms(kernel: str) -> list[tuple]:
    """The compiled forms of ``kernel``'s own kernel the op launches, as Job options."""
    if kernel == "decode":
        return [(("split_out", True),), (("split_out", False),)]
    if kernel == "multi_token":
        return [(("split_out", True),)]
    if kernel == "decode_fp8":
        return [(("kv_dtype", "e4m3"), ("split_out", True)), (("kv_dtype", "e4m3"), ("split_out", False))]
    if kernel == "q_tiled":
        return [(("wait_ready", w), ("fold", f)) for w, f in specs.Q_TILED_VARIANTS]
    raise KeyError(kernel)


def sampled_families() -> tuple[str, ...]:
    """The tuned kernels whose entries this command can re-stamp (a PTX sample is defined)."""
    return tuple(k for k in sources.tuned_kernels() if k in ("decode", "multi_token", "decode_fp8", "q_tiled"))


def _code_key(kernel: str, ck: tuple, cfg_dict: dict) -> tuple:
    """What makes two entries compile to one kernel: dtype, head dim, page size, GQA group and the
    config as the kernel's compile key keeps it (``KernelSpec.key_values``)."""
    _k, dtype, d, group, page = ck
    cfg = get_space(kernel).config_from_dict(cfg_dict)
    return (dtype, d, page, group, specs.get(kernel).key_values(cfg, d))


def _covering_sample(keys: list, limit: int) -> list:
    """At most ``limit`` of ``keys`` (sorted, distinct), chosen greedily to cover every dtype,
    head dim, page size, GQA group and config that occurs, then the rest spread evenly."""
    keys = sorted(keys)
    if len(keys) <= limit:
        return keys

    def feats(k):
        dtype, d, page, group, code = k
        return {("dtype", dtype), ("d", d), ("page", page), ("group", group), ("code", code)}

    todo = set().union(*(feats(k) for k in keys))
    chosen = []
    while todo and len(chosen) < limit:
        best = max((k for k in keys if k not in chosen), key=lambda k: (len(feats(k) & todo), -keys.index(k)))
        chosen.append(best)
        todo -= feats(best)
    rest = [k for k in keys if k not in chosen]
    room = limit - len(chosen)
    if room > 0 and rest:
        step = len(rest) / room
        chosen += [rest[int(i * step)] for i in range(min(room, len(rest)))]
    return sorted(chosen)


def sample_jobs(kernel: str, records, limit: int = MAX_SAMPLE_CONFIGS) -> list[Job]:
    """The kernels compared for ``kernel``'s entries ``records`` ((class_key, bucket_key, record)
    each): one per compile key (a representative entry's config, the largest q_len of the
    entries sharing it), a covering sample of ``limit`` keys where there are more, each in every
    form the op launches, plus the split combine where the launch runs it."""
    reps: dict = {}
    for ck, bk, rec in records:
        key = _code_key(kernel, ck, rec["config"])
        if key not in reps:
            reps[key] = (ck, dict(rec["config"]), bk[2])
        else:
            c, cfg, q = reps[key]
            reps[key] = (c, cfg, max(q, bk[2]))
    jobs = []
    combine = set()
    for key in _covering_sample(list(reps), limit):
        (_k, dtype, d, group, page), cfg, q_len = reps[key]
        for opts in _forms(kernel):
            jobs.append(Job(kernel, dtype, d, page, group, q_len, tuple(sorted(cfg.items())), opts))
        if "combine" in sources.LAUNCHES.get(kernel, ()):
            combine.add((dtype, d))
    jobs += [Job("combine", dtype, d) for dtype, d in sorted(combine)]
    return jobs


# ---- compiling from a source tree --------------------------------------------------------------

# Runs in a fresh interpreter whose PYTHONPATH puts the tree to compile first: argv[1] the job
# file, argv[2] the output folder. It compiles through the tree's own jit entry points (the
# op's), keeping each kernel's PTX, and writes result.json (per job: ok / the error).
WORKER = r'''
import json, os, sys, traceback
spec = json.load(open(sys.argv[1]))
out = sys.argv[2]
import directkv_cute
here = os.path.realpath(os.path.dirname(directkv_cute.__file__))
result = {"package": here, "jobs": [], "hashes": {}}
def done():
    json.dump(result, open(os.path.join(out, "result.json"), "w"))
if here != os.path.realpath(spec["package"]):
    result["error"] = "imported directkv_cute from %s, not %s" % (here, spec["package"])
    done(); sys.exit(0)
try:
    from directkv_cute.kernels import sources as _src
    for k in spec["families"]:
        try:
            result["hashes"][k] = _src.kernel_hash(k)
        except Exception as e:
            result["hashes"][k] = None
except Exception:
    pass
import cutlass.cute as cute
_real = cute.compile
_ptx = []
def _compile_keeping_ptx(*args, **kwargs):
    opts = kwargs.pop("options", "")
    fn = _real(*args, options=(opts + " " if opts else "") + "--keep-ptx --dump-dir=" + os.path.join(out, "dump"),
               **kwargs)
    _ptx.append(getattr(fn, "__ptx__", None))
    return fn
cute.compile = _compile_keeping_ptx
import torch
from directkv_cute import config as C
from directkv_cute.kernels import jit
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
KV = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
def make(cls, d):
    if hasattr(cls, "from_dict"):
        return cls.from_dict(d)
    return cls(**d)
for i, job in enumerate(spec["jobs"]):
    del _ptx[:]
    rec = {"i": i, "ok": False}
    try:
        dt, d, page, g, q, o = DT[job["dtype"]], job["head_dim"], job["page_size"], job["group"], job["q_len"], job["options"]
        part = job["part"]
        if part == "combine":
            jit.compile_combine(d, dt)
        elif part == "q_tiled":
            jit.compile_q_tiled(make(C.QTiledConfig, job["config"]), dt, d, page, g, o["wait_ready"], o["fold"])
        elif part == "decode_fp8":
            jit.compile_decode_fp8(make(C.DecodeConfig, job["config"]), dt, KV[o["kv_dtype"]], d, page, g, q,
                                   o["split_out"])
        elif part in ("decode", "multi_token"):
            jit.compile_decode(make(C.DecodeConfig, job["config"]), dt, d, page, g, q, split_out=o["split_out"],
                               multi_token=part == "multi_token")
        else:
            raise ValueError("unknown part %r" % part)
        texts = [t for t in _ptx if t]
        if len(_ptx) != 1 or len(texts) != 1:
            raise RuntimeError("%d kernel(s) compiled, %d with PTX (expected one: a cache answered?)"
                               % (len(_ptx), len(texts)))
        open(os.path.join(out, "%04d.ptx" % i), "w").write(texts[0])
        rec["ok"] = True
    except Exception as e:
        rec["error"] = ("%s: %s" % (type(e).__name__, e)).splitlines()[0][:300]
    result["jobs"].append(rec)
    done()
done()
'''


@dataclass
class Compiled:
    """What one tree compiled: PTX per job index (None where it failed, with the error)."""

    ptx: dict = field(default_factory=dict)  # job index -> PTX text
    errors: dict = field(default_factory=dict)  # job index -> one line
    hashes: dict = field(default_factory=dict)  # family -> the tree's own kernel_hash (None: unknown)
    error: str | None = None  # the whole tree failed (import, start-up)


def worker_env(tree: Path, cache_dir: Path) -> dict:
    """The compile worker's environment: ``tree`` first on PYTHONPATH, the disk caches off,
    sm_90a, no line info."""
    env = dict(os.environ)
    env.update(PYTHONPATH=str(tree), CUTE_DSL_ARCH=ARCH, DIRECTKV_DISK_CACHE="0", DIRECTKV_CACHE_DIR=str(cache_dir),
               CUTE_DSL_DISABLE_FILE_CACHING="1", CUTE_DSL_LINEINFO="0", PYTHONDONTWRITEBYTECODE="1")
    for k in ("CUTE_DSL_KEEP", "CUTE_DSL_KEEP_PTX", "CUTE_DSL_DUMP_DIR"):
        env.pop(k, None)
    return env


def compile_tree(tree: Path, jobs: list[Job], workdir: Path, families=()) -> Compiled:
    """Compile ``jobs`` from the package under ``tree`` (``tree/directkv_cute``) in a fresh
    interpreter; their PTX, and the tree's own kernel hashes of ``families``."""
    tree = Path(tree)
    workdir = Path(workdir)
    (workdir / "dump").mkdir(parents=True, exist_ok=True)
    (workdir / "cache").mkdir(mode=0o700, exist_ok=True)
    job_file = workdir / "jobs.json"
    job_file.write_text(json.dumps({"package": str(tree / PACKAGE_NAME), "families": list(families),
                                    "jobs": [j.to_json() for j in jobs]}))
    timeout = WORKER_TIMEOUT_S + PER_KERNEL_TIMEOUT_S * len(jobs)
    try:
        proc = subprocess.run([sys.executable, "-c", WORKER, str(job_file), str(workdir)], cwd=tree,
                              env=worker_env(tree, workdir / "cache"), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return Compiled(error=f"compiling from {tree} took more than {timeout} s")
    res_file = workdir / "result.json"
    if not res_file.exists():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return Compiled(error=f"the compile worker for {tree} exited {proc.returncode}: {tail[0][:300]}")
    res = json.loads(res_file.read_text())
    out = Compiled(hashes=res.get("hashes", {}), error=res.get("error"))
    for rec in res.get("jobs", []):
        i = rec["i"]
        if rec.get("ok"):
            out.ptx[i] = (workdir / f"{i:04d}.ptx").read_text()
        else:
            out.errors[i] = rec.get("error", "failed")
    for i in range(len(jobs)):
        if i not in out.ptx and i not in out.errors:
            out.errors[i] = f"not compiled (the worker exited {proc.returncode})"
    return out


def normalize_ptx(text: str, roots=()) -> str:
    """The PTX with what is not code replaced: the absolute paths of the source trees (``roots``,
    the longest first) become ``<src>``. Nothing else is touched: the kernels' PTX has no line
    info (``CUTE_DSL_LINEINFO=0``), and its symbol names (module path, class, argument types) are
    the same for both trees and embed no source hash."""
    for r in sorted({str(r) for r in roots if str(r)}, key=len, reverse=True):
        text = text.replace(r, SRC_PLACEHOLDER)
    return text


# ---- git -----------------------------------------------------------------------------------------


class Git:
    """The repository that holds the package, read only (log, cat-file, rev-parse, archive)."""

    def __init__(self, package_dir: Path):
        self.package_dir = Path(package_dir).resolve()
        try:
            top = self._run(["rev-parse", "--show-toplevel"], cwd=self.package_dir).strip()
        except (OSError, subprocess.CalledProcessError):
            raise RestampError(f"{self.package_dir} is not in a git checkout: restamp reads the kernels' sources "
                               "from the history of a directkv-cute checkout") from None
        self.root = Path(top).resolve()
        try:
            self.pkg_rel = self.package_dir.relative_to(self.root).as_posix()
        except ValueError:
            raise RestampError(f"{self.package_dir} is not inside the checkout {self.root}") from None
        self._blobs: dict = {}

    def _run(self, args, *, cwd=None, binary=False, input=None):
        proc = subprocess.run(["git", *args], cwd=cwd or self.root, capture_output=True, input=input,
                              text=not binary, check=False)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, ["git", *args], proc.stdout, proc.stderr)
        return proc.stdout

    def path(self, rel: str) -> str:
        return f"{self.pkg_rel}/{rel}" if self.pkg_rel not in ("", ".") else rel

    def commit(self, rev: str) -> str:
        """The full hash of commit ``rev``, or RestampError."""
        try:
            return self._run(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"]).strip()
        except subprocess.CalledProcessError:
            raise RestampError(f"--against {rev}: not a commit of {self.root}") from None

    def log(self, rels) -> list[str]:
        """Commits that touched any of ``rels`` (package-relative), newest first, from HEAD."""
        try:
            out = self._run(["log", "--format=%H", "HEAD", "--", *(self.path(r) for r in rels)])
        except subprocess.CalledProcessError as e:
            raise RestampError(f"git log in {self.root} failed: {(e.stderr or '').strip()[:200]}") from None
        return out.split()

    def describe(self, rev: str) -> str:
        try:
            return self._run(["log", "-1", "--format=%h %s", rev]).strip()[:90]
        except subprocess.CalledProcessError:
            return rev[:12]

    def blobs(self, rev: str, rels) -> dict:
        """{rel: blob id} of the files ``rels`` that exist at ``rev``."""
        out = self._run(["ls-tree", "-r", "-z", rev, "--", *(self.path(r) for r in rels)], binary=True)
        found = {}
        for item in out.split(b"\0"):
            if not item:
                continue
            meta, name = item.split(b"\t", 1)
            _mode, kind, sha = meta.split()
            if kind == b"blob":
                p = name.decode()
                rel = p[len(self.pkg_rel) + 1:] if self.pkg_rel not in ("", ".") else p
                found[rel] = sha.decode()
        return found

    def blob(self, sha: str) -> bytes:
        if sha not in self._blobs:
            self._blobs[sha] = self._run(["cat-file", "blob", sha], binary=True)
        return self._blobs[sha]

    def extract(self, rev: str, dest: Path) -> Path:
        """``git archive REV <package> | tar -x -C dest``: the package's tree at ``rev``; returns
        the folder to put on PYTHONPATH (the one holding ``directkv_cute``)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.Popen(["git", "archive", "--format=tar", rev, self.pkg_rel], cwd=self.root,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        tar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True)
        archive.stdout.close()
        err = archive.stderr.read().decode(errors="replace")
        if archive.wait() or tar.returncode:
            raise RestampError(f"git archive {rev[:12]} {self.pkg_rel} failed: {(err or tar.stderr.decode())[:200]}")
        pkg = dest / self.pkg_rel
        if pkg.name != PACKAGE_NAME:
            raise RestampError(f"the package folder is {self.pkg_rel}, not {PACKAGE_NAME}: cannot import it")
        return pkg.parent


class SourceHashes:
    """``sources.kernel_hash`` of each family at any revision: the family's files read from git
    into a scratch folder, hashed by the same function (``kernel_hash(kernel, root=...)``)."""

    def __init__(self, git: Git, scratch: Path):
        self.git = git
        self.scratch = Path(scratch)
        self._memo: dict = {}

    def at(self, rev: str, kernel: str) -> str | None:
        """The family's hash at ``rev``; None where one of its files does not exist there."""
        rels = sources.launch_files(kernel)
        blobs = self.git.blobs(rev, rels)
        if set(blobs) != set(rels):
            return None
        key = (kernel, tuple(sorted(blobs.items())))
        if key not in self._memo:
            root = self.scratch / f"h{len(self._memo)}"
            for rel, sha in blobs.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_bytes(self.git.blob(sha))
            self._memo[key] = sources.kernel_hash(kernel, root=root)
            shutil.rmtree(root, ignore_errors=True)
        return self._memo[key]

    def find(self, kernel: str, wanted: str) -> tuple[str | None, int]:
        """(the newest commit whose ``kernel`` sources hash to ``wanted``, or None; commits examined),
        walking ``git log`` over the family's files from HEAD."""
        revs = self.git.log(sources.launch_files(kernel))
        for n, rev in enumerate(revs, 1):
            if self.at(rev, kernel) == wanted:
                return rev, n
        return None, len(revs)


# ---- the command ---------------------------------------------------------------------------------


@dataclass
class Group:
    """The entries of one family that carry one stale hash, and what became of them."""

    kernel: str
    old: str
    new: str
    keys: list  # (class_key, bucket_key)
    records: list  # (class_key, bucket_key, record)
    rev: str | None = None
    how: str = ""  # how the revision was found
    hash_at_rev: str | None = None  # the family's hash at rev (this version's function)
    jobs: list = field(default_factory=list)
    same: list = field(default_factory=list)  # labels of the kernels whose PTX is identical
    differ: list = field(default_factory=list)  # (label, the first differing line)
    failed: list = field(default_factory=list)  # (label, why)
    kept: Path | None = None  # where the differing PTX pairs are
    problem: str | None = None  # why nothing was compared
    restamped: bool = False

    @property
    def identical(self) -> bool:
        return self.problem is None and bool(self.jobs) and not self.differ and not self.failed


def _first_difference(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for n, (x, y) in enumerate(zip(la, lb), 1):
        if x != y:
            return f"line {n}: {' '.join(x.split())[:60]!r} vs {' '.join(y.split())[:60]!r}"
    return f"{len(la)} vs {len(lb)} lines"


def stale_groups(prof: Profile, current: Callable[[str], str]) -> tuple[list[Group], dict]:
    """(the stale groups of ``prof``, {family: number of current buckets})."""
    groups: dict = {}
    current_n: dict = {}
    for ck, bk, rec in prof.records():
        kernel = ck[0]
        if kernel not in sources.tuned_kernels() or kernel not in kernels():
            continue
        here = current(kernel)
        old = rec.get("kernel_hash")
        if old == here:
            current_n[kernel] = current_n.get(kernel, 0) + 1
            continue
        g = groups.setdefault((kernel, old), Group(kernel, old, here, [], []))
        g.keys.append((ck, bk))
        g.records.append((ck, bk, rec))
    return [groups[k] for k in sorted(groups)], current_n


class Restamper:
    """The command's steps, with git and the compiles replaceable (tests inject them)."""

    def __init__(self, *, package_dir: Path | None = None, git: Git | None = None,
                 compile_fn: Callable = compile_tree, workdir: Path | None = None,
                 sample_limit: int = MAX_SAMPLE_CONFIGS, log: Callable[[str], None] | None = None):
        self.package_dir = Path(package_dir or sources.PACKAGE_DIR).resolve()
        self.git = git or Git(self.package_dir)
        self.compile_fn = compile_fn
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="directkv-restamp-"))
        self.sample_limit = sample_limit
        self.log = log or (lambda msg: None)
        self.hashes = SourceHashes(self.git, self.workdir / "hash")
        self._trees: dict = {}

    def current_hash(self, kernel: str) -> str:
        return sources.kernel_hash(kernel, root=self.package_dir)

    # -- step 1: which sources ------------------------------------------------------------------
    def locate(self, groups: list[Group], against: str | None) -> None:
        rev_against = self.git.commit(against) if against else None
        for g in groups:
            if g.kernel not in sampled_families():
                g.problem = "no PTX sample is defined for this kernel"
                continue
            if rev_against:
                # the revision must be the tuned sources: its files hash to the recorded hash here,
                # or (where it listed other files) by its own kernel_hash, which its compile
                # worker reports before anything is compared
                g.rev, g.how = rev_against, "--against"
                g.hash_at_rev = self.hashes.at(rev_against, g.kernel)
                continue
            rev, n = self.hashes.find(g.kernel, g.old)
            if rev is None:
                g.problem = (f"no commit of the {n} that touched its sources hashes to {g.old[:12]} (give the "
                             "tuned revision with --against REV)")
            else:
                g.rev, g.how, g.hash_at_rev = rev, f"git log, {n} commit(s) examined", g.old

    # -- step 2 and 3: sample and compile -----------------------------------------------------------
    def tree(self, rev: str) -> Path:
        if rev not in self._trees:
            self._trees[rev] = self.git.extract(rev, self.workdir / f"src-{rev[:12]}")
        return self._trees[rev]

    def compare(self, groups: list[Group]) -> None:
        todo = [g for g in groups if g.problem is None and g.rev]
        for g in todo:
            try:
                g.jobs = sample_jobs(g.kernel, g.records, self.sample_limit)
            except Exception as e:  # a config the current rules refuse: nothing to compile it as
                g.problem = f"cannot sample its kernels: {type(e).__name__}: {e}"
        todo = [g for g in todo if g.problem is None]
        if not todo:
            return
        every = sorted({j for g in todo for j in g.jobs}, key=repr)
        index = {j: i for i, j in enumerate(every)}
        families = sorted({g.kernel for g in todo})
        current_root = self.package_dir.parent
        self.log(f"compiling {len(every)} kernel(s) from the current sources ({self.package_dir})")
        now = self.compile_fn(current_root, every, self.workdir / "ptx-current", families)
        by_rev: dict = {}
        for g in todo:
            by_rev.setdefault(g.rev, []).append(g)
        for rev, gs in by_rev.items():
            jobs = sorted({j for g in gs for j in g.jobs}, key=repr)
            tree = self.tree(rev)
            self.log(f"compiling {len(jobs)} kernel(s) from {rev[:12]} ({tree})")
            then = self.compile_fn(tree, jobs, self.workdir / f"ptx-{rev[:12]}", families)
            roots = (tree / PACKAGE_NAME, tree, self.package_dir, current_root)
            for g in gs:
                if g.hash_at_rev != g.old:
                    if then.hashes.get(g.kernel) != g.old:
                        g.problem = (f"{rev[:12]}'s {g.kernel} sources hash to {str(g.hash_at_rev)[:12]} (its own "
                                     f"kernel_hash: {str(then.hashes.get(g.kernel))[:12]}), not {g.old[:12]}: not "
                                     "the sources these entries were tuned for")
                        continue
                    g.how += ", by its own kernel_hash"
                self._compare_group(g, jobs, then, every, index, now, roots)

    def _compare_group(self, g, jobs, then, every, index, now, roots) -> None:
        if now.error or then.error:
            g.problem = "compile failed: " + "; ".join(e for e in (now.error, then.error) if e)
            return
        local = {j: i for i, j in enumerate(jobs)}
        for job in g.jobs:
            a = then.ptx.get(local[job])
            b = now.ptx.get(index[job])
            if a is None or b is None:
                why = [f"{g.rev[:12]}: {then.errors.get(local[job])}" if a is None else "",
                       f"current: {now.errors.get(index[job])}" if b is None else ""]
                g.failed.append((job.label(), "; ".join(w for w in why if w)))
                continue
            na, nb = normalize_ptx(a, roots), normalize_ptx(b, roots)
            if na == nb:
                g.same.append(job.label())
            else:
                g.differ.append((job.label(), _first_difference(na, nb)))
                keep = self.workdir / "differs"
                keep.mkdir(exist_ok=True)
                n = len(list(keep.glob("*.then.ptx")))
                (keep / f"{n:03d}.then.ptx").write_text(na)
                (keep / f"{n:03d}.now.ptx").write_text(nb)
                (keep / f"{n:03d}.txt").write_text(f"{job.label()}\nthen: {g.rev}\n")
                g.kept = keep

    # -- step 4: write ------------------------------------------------------------------------------
    def write(self, path: Path, groups: list[Group]) -> None:
        """Re-stamp the identical groups' buckets: a profile of those buckets alone, saved merged
        into the file (its other buckets, the machine model and everything else come from the file
        as it is then), after checking that each still carries the hash it was compared for."""
        ok = [g for g in groups if g.identical]
        if not ok:
            return
        fresh = load_profile(path)
        out = Profile(metadata=dict(fresh.metadata), machine=fresh.machine, path=path)
        record = list(fresh.metadata.get("restamped") or [])
        dsl = software_versions().get("cutlass_dsl")
        for g in ok:
            moved = 0
            for ck, bk in g.keys:
                rec = fresh.get(ck, bk)
                if rec is None or rec.get("kernel_hash") != g.old:
                    continue  # rewritten since it was read: leave it as it is now
                out.set(ck, bk, {**rec, "kernel_hash": g.new})
                moved += 1
            if not moved:
                continue
            g.restamped = True
            record.append({
                "kernel": g.kernel, "from": g.old, "to": g.new, "revision": g.rev, "buckets": moved,
                "ptx_kernels": len(g.same), "date": utc_now(), "cutlass_dsl": dsl, "arch": ARCH,
                "note": (f"{moved} {g.kernel} bucket(s) re-stamped from kernel hash {g.old[:12]} to {g.new[:12]} "
                         f"after a PTX comparison of {len(g.same)} kernels compiled from {g.rev[:12]} and from "
                         "the current sources: identical"),
            })
        if not len(out):
            return
        out.metadata["restamped"] = record
        save_profile(out, path, merge=True)


MAX_LISTED = 6  # kernels named in a family's line (-v lists every one)


def _listed(labels) -> str:
    more = len(labels) - MAX_LISTED
    return ", ".join(labels[:MAX_LISTED]) + (f" and {more} more (-v lists them)" if more > 0 else "")


def _family_line(kernel: str, gs: list[Group], n_current: int, dry_run: bool) -> str:
    parts = []
    for g in gs:
        head = f"{len(g.keys)} bucket(s) tuned for {g.old[:12]}"
        if g.rev:
            head += f" = {g.rev[:12]} ({g.how})"
        if g.problem:
            parts.append(f"{head}: {g.problem}; left stale")
        elif g.identical:
            verb = "would re-stamp" if dry_run else ("re-stamped" if g.restamped else "not re-stamped (rewritten "
                                                                                     "meanwhile)")
            parts.append(f"{head}: PTX of {len(g.same)} kernel(s) identical; {verb} to {g.new[:12]}")
        else:
            what = []
            if g.differ:
                what.append(f"PTX of {len(g.differ)} of {len(g.jobs)} kernel(s) differs: "
                            + _listed([label for label, _ in g.differ]))
            if g.failed:
                what.append(f"{len(g.failed)} of {len(g.jobs)} kernel(s) failed to compile: "
                            + _listed([f"{label} ({why})" for label, why in g.failed]))
            kept = f" (PTX pairs in {g.kept})" if g.kept else ""
            parts.append(f"{head}: {'; '.join(what)}; left stale{kept}")
    if n_current:
        parts.append(f"{n_current} bucket(s) current")
    return f"{kernel}: " + "; ".join(parts)


def restamp_profile(path, *, against: str | None = None, dry_run: bool = False, out=None,
                    restamper: Restamper | None = None, verbose: bool = False) -> int:
    """Re-stamp the stale entries of the profile at ``path`` whose PTX is unchanged. Prints one
    line per family; returns 0 when no stale entry is left (1 otherwise)."""
    out = out or sys.stdout
    path = Path(path)
    prof = load_profile(path)
    foreign = prof.compat_problems()
    if foreign:  # its buckets would be dropped by the merged write
        print(f"{path}: not re-stamped: " + "; ".join(foreign), file=out)
        return 1
    rs = restamper or Restamper()
    groups, current_n = stale_groups(prof, rs.current_hash)
    families = sorted({g.kernel for g in groups} | set(current_n))
    print(f"{path}: {prof.gpu_name}, {len(prof)} bucket(s), {sum(len(g.keys) for g in groups)} stale", file=out)
    if groups:
        rs.locate(groups, against)
        rs.compare(groups)
        if not dry_run:
            rs.write(path, groups)
    for kernel in families:
        gs = [g for g in groups if g.kernel == kernel]
        print(_family_line(kernel, gs, current_n.get(kernel, 0), dry_run), file=out)
        if verbose:
            for g in gs:
                for label in g.same:
                    print(f"  same     {label}", file=out)
                for label, where in g.differ:
                    print(f"  DIFFERS  {label}: {where}", file=out)
                for label, why in g.failed:
                    print(f"  FAILED   {label}: {why}", file=out)
    left = [g for g in groups if not (g.restamped or (dry_run and g.identical))]
    return 1 if left else 0


def run(profiles, *, against=None, dry_run=False, verbose=False, out=None, restamper_factory=None) -> int:
    """The command: every profile of ``profiles`` (paths). RestampError for a user's error."""
    restamper_factory = restamper_factory or Restamper
    out = out or sys.stdout
    for p in profiles:
        p = Path(p)
        if not p.is_file():
            raise RestampError(f"--profile {p}: no such file" if not p.exists() else f"--profile {p}: not a file")
    rs = restamper_factory(log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    if against:
        rs.git.commit(against)  # a bad revision is the user's error before anything is compiled
    rc = 0
    try:
        for p in profiles:
            rc = max(rc, restamp_profile(p, against=against, dry_run=dry_run, out=out, restamper=rs,
                                         verbose=verbose))
    finally:
        kept = rs.workdir / "differs"
        if kept.exists():
            for child in rs.workdir.iterdir():
                if child != kept:
                    shutil.rmtree(child, ignore_errors=True)
        else:
            shutil.rmtree(rs.workdir, ignore_errors=True)
    return rc


__all__ = ["Git", "Group", "Job", "MAX_SAMPLE_CONFIGS", "RestampError", "Restamper", "SourceHashes", "compile_tree",
           "normalize_ptx", "restamp_profile", "run", "sample_jobs", "stale_groups"]
