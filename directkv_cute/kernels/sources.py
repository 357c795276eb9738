"""Which source files generate each kernel's code, and hashes over them.

A compiled kernel's code comes from its device module, the shared modules that module imports,
the config rules it reads at trace time (``config.py``) and the compile driver (``jit.py``: the
argument types and what the compile key keeps). :data:`CODE_FILES` lists them per compiled
kernel, from each kernel's spec (``kernels.specs``); a test checks that it is closed under the
package imports of those files.

A tuned kernel's launch runs its own kernel and, with more than one split, the split combine
(:data:`LAUNCHES`), so its profile hash (:func:`kernel_hash`) covers the code files of both.
The compiled-kernel disk cache keys on :func:`cache_fingerprint`: every code file of every
kernel, the specs (what each compile key keeps) and the cutlass-dsl version.

Plain Python with no imports beyond the standard library (and ``specs``, which has none), so
the tuner and the profile lookup can hash the sources without torch or cutlass.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from directkv_cute.kernels import specs

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the directkv_cute package

# Each kernel's files and the kernels its tuned launch runs are stated once, in its spec.
CODE_FILES: dict[str, tuple[str, ...]] = {s.name: s.files for s in specs.SPECS}

LAUNCHES: dict[str, tuple[str, ...]] = {s.name: s.launches for s in specs.SPECS if s.launches}


def tuned_kernels() -> tuple[str, ...]:
    """The kernels that have tuned profile entries."""
    return tuple(LAUNCHES)


def code_files(kernel: str) -> tuple[str, ...]:
    """Files (relative to the package) that generate the compiled kernel ``kernel``."""
    try:
        return CODE_FILES[kernel]
    except KeyError:
        raise KeyError(f"no source list for kernel {kernel!r}; known: {sorted(CODE_FILES)}") from None


def launch_files(kernel: str) -> tuple[str, ...]:
    """Files that generate every compiled kernel a launch of tuned kernel ``kernel`` runs."""
    try:
        parts = LAUNCHES[kernel]
    except KeyError:
        raise KeyError(f"kernel {kernel!r} is not tuned; tuned kernels: {sorted(LAUNCHES)}") from None
    return tuple(sorted({f for part in parts for f in code_files(part)}))


def files_digest(files, root: Path | None = None, *, label: str = "") -> str:
    """sha256 over ``label`` and each file's relative name and bytes, in sorted order."""
    base = Path(root) if root is not None else PACKAGE_DIR
    h = hashlib.sha256(label.encode() + b"\0")
    for rel in sorted(files):
        h.update(rel.encode() + b"\0")
        h.update((base / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def kernel_hash(kernel: str, root: Path | None = None) -> str:
    """The profile key of tuned kernel ``kernel``: a hash of the files that generate its launch."""
    return files_digest(launch_files(kernel), root, label=f"kernel:{kernel}")


def cutlass_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:  # metadata missing in odd installs
        return "unknown"


# What the compile keys keep of each config (the specs' codegen fields): no code of its own, but
# the disk cache's object names follow from it, so a change of it starts a new folder.
KEY_FILES = ("kernels/specs.py",)


def cache_fingerprint(root: Path | None = None) -> str:
    """The disk cache's folder name: every kernel's code files, the specs that shape the compile
    keys, and the cutlass-dsl version."""
    every = {f for files in CODE_FILES.values() for f in files} | set(KEY_FILES)
    return files_digest(every, root, label=f"cutlass-dsl:{cutlass_version()}")[:16]
