"""The compiled-kernel disk cache: private folders, authenticated objects, atomic writes.

``cute.runtime.load_module`` unpickles an argument spec stored in the object file, so loading an
object runs whatever its writer put there. An object is loaded only when

* the cache root and the object's folder are folders owned by this user and not writable by
  group or others (the folders made here, missing parents included, are created 0700);
* the object and its digest are regular files (not links) owned by this user and not writable
  by group or others;
* the digest holds the object's HMAC-SHA256 under this user's secret key (``<root>/key``, 32
  random bytes, 0600, made on first use), so a planted object with a planted digest fails.

The checks run on the open file, before a byte of it is used, and the verified bytes are loaded
from a fresh private copy, so the file checked is the file loaded. A folder, object, digest or
key that fails a check is refused with one :class:`KernelCacheWarning` per path and reason; the
kernel is then compiled in memory and nothing there is loaded, written or deleted. Our own
object whose digest does not match (a torn write, a flipped bit) is not loaded either: the
kernel is rebuilt and the object, then its digest, are written to temporary names and renamed
over the old ones.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import os
import stat
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KEY_NAME = "key"
KEY_BYTES = 32
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_WARNED: set[tuple[str, str]] = set()


class KernelCacheWarning(RuntimeWarning):
    """A disk-cache folder or file that is not used: the kernel is compiled in memory instead."""


class Untrusted(Exception):
    """A path the cache may not use, with the reason."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


# ---- the checks ------------------------------------------------------------------------------


def current_uid() -> int:
    return os.geteuid()


def stat_of(path: Path, fd: int | None = None, *, follow: bool = False) -> os.stat_result:
    """The one place this module stats a path (of an open file when ``fd`` is given)."""
    if fd is not None:
        return os.fstat(fd)
    return os.stat(path) if follow else os.lstat(path)


def check_stat(path: Path, st, *, folder: bool, secret: bool = False) -> None:
    """Raise Untrusted unless ``st`` is a folder (or regular file) of ours that group and others
    cannot write (with ``secret``: cannot read either)."""
    if folder and not stat.S_ISDIR(st.st_mode):
        raise Untrusted(path, "not a folder")
    if not folder and not stat.S_ISREG(st.st_mode):
        raise Untrusted(path, "not a regular file")
    uid = current_uid()
    if st.st_uid != uid:
        raise Untrusted(path, f"owned by uid {st.st_uid}, not by this user (uid {uid})")
    mode = stat.S_IMODE(st.st_mode)
    if secret and mode & 0o077:
        raise Untrusted(path, f"readable or writable by group or others (mode {mode:04o})")
    if mode & 0o022:
        raise Untrusted(path, f"writable by group or others (mode {mode:04o})")


def make_private_folder(path: Path, *, follow: bool) -> None:
    """Create ``path`` and each missing parent with mode 0700, then check ``path`` (``follow``: a
    symbolic link to a folder of ours is accepted)."""
    missing = []
    p = Path(path)
    while not os.path.lexists(p) and p.parent != p:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
    check_stat(path, stat_of(path, follow=follow), folder=True)


def read_checked(path: Path, *, secret: bool = False) -> bytes | None:
    """The bytes of ``path`` once the open file passed :func:`check_stat`; None if it is absent."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(path, "a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        check_stat(path, stat_of(path, f.fileno()), folder=False, secret=secret)
        return f.read()


def refuse(path, reason: str) -> None:
    """Warn, once per path and reason in this process, that the cache is not used there."""
    key = (str(path), reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"directkv-cute: not using the compiled-kernel disk cache at {path}: {reason}. The kernel is "
        "compiled in memory instead; point DIRECTKV_CACHE_DIR at a folder only you can write, or set "
        "DIRECTKV_DISK_CACHE=0.",
        KernelCacheWarning,
        stacklevel=2,
    )


def refuse_error(e: Exception, where) -> None:
    """:func:`refuse` for an Untrusted or an OSError raised while using ``where``."""
    if isinstance(e, Untrusted):
        refuse(e.path, e.reason)
    else:
        refuse(getattr(e, "filename", None) or where, getattr(e, "strerror", None) or str(e))


# ---- the key ---------------------------------------------------------------------------------


def secret_key(root: Path) -> bytes:
    """This user's HMAC key in ``root``, made on first use."""
    path = Path(root) / KEY_NAME
    if not os.path.lexists(path):
        _create_key(path)
    data = read_checked(path, secret=True)
    if data is None or len(data) != KEY_BYTES:
        raise Untrusted(path, f"holds {0 if data is None else len(data)} bytes, not a {KEY_BYTES}-byte key")
    return data


def _create_key(path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


# ---- the store -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """Objects ``<name>.o`` and their digests ``<name>.o.hmac`` in one checked folder."""

    folder: Path
    key: bytes

    def paths(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}.o", self.folder / f"{name}.o.hmac"

    def digest(self, data: bytes) -> bytes:
        return hmac.new(self.key, data, hashlib.sha256).hexdigest().encode()

    def read(self, name: str) -> bytes | None:
        """The object's bytes if they match their digest; None if either file is absent or the
        digest does not match (ours to rebuild). Raises Untrusted for a file that fails a check."""
        obj, sig = self.paths(name)
        data = read_checked(obj)
        if data is None:
            return None
        want = read_checked(sig)
        if want is None or not hmac.compare_digest(self.digest(data), want.strip()):
            return None
        return data

    def load(self, data: bytes, loader: Callable[[str], object]):
        """``loader(path)`` on a fresh private copy of verified bytes (removed afterwards)."""
        fd, tmp = tempfile.mkstemp(prefix=".load-", suffix=".o", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return loader(tmp)
        finally:
            os.unlink(tmp)

    def write(self, name: str, export: Callable[[str], None]) -> None:
        """``export(folder)`` writes ``<name>.o`` into a private temporary folder; the object and
        then its digest are renamed over ours. Raises Untrusted, writing nothing, where an
        existing file is not ours."""
        obj, sig = self.paths(name)
        for p in (obj, sig):
            if os.path.lexists(p):
                check_stat(p, stat_of(p), folder=False)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=self.folder) as tmp:
            export(tmp)
            built = Path(tmp) / f"{name}.o"
            data = built.read_bytes()
            os.chmod(built, 0o600)
            digest = Path(tmp) / "digest"
            digest.write_bytes(self.digest(data) + b"\n")
            os.chmod(digest, 0o600)
            os.replace(built, obj)
            os.replace(digest, sig)

    @contextlib.contextmanager
    def locked(self):
        """An exclusive lock on the folder across processes."""
        fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def open_store(folder: Path) -> Store | None:
    """The store in ``folder`` (its parent is the cache root, where the key lives), creating
    both folders 0700; None, after a warning, where a check fails or the folders cannot be made."""
    folder = Path(folder)
    try:
        make_private_folder(folder.parent, follow=True)
        make_private_folder(folder, follow=False)
        return Store(folder, secret_key(folder.parent))
    except (Untrusted, OSError) as e:
        refuse_error(e, folder)
    return None


def load_or_build(folder: Path | None, name: str, build: Callable[[], object],
                  load: Callable[[str, str], object]):
    """The compiled function ``name``: ``load(path, name)`` of its verified object in ``folder``,
    else ``build()``, exported there (``export_to_c``) when the folder is ours. ``folder`` None:
    no disk cache."""
    store = None if folder is None else open_store(folder)
    if store is None:
        return build()
    with store.locked():
        try:
            data = store.read(name)
        except (Untrusted, OSError) as e:
            refuse_error(e, folder)
            return build()
        fn = None if data is None else _load_verified(store, data, name, load)
        if fn is not None:
            return fn
        fn = build()
        try:
            store.write(name, lambda tmp: fn.export_to_c(tmp, name, function_prefix=name))
        except (Untrusted, OSError) as e:
            refuse_error(e, folder)
        return fn


def _load_verified(store: Store, data: bytes, name: str, load):
    """The function in verified bytes of ours; None if they do not load (then rebuilt)."""
    try:
        return store.load(data, lambda path: load(path, name))
    except Exception:
        return None


def forget_warnings() -> None:
    """Warn again about paths already refused (tests)."""
    _WARNED.clear()
