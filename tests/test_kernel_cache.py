"""The compiled-kernel disk cache: private folders, objects loaded only when ours and authentic,
a key over every file that generates code (config rules included), atomic writes. Compiles the
combine kernel for sm_90a (no GPU needed); ``cute.runtime.load_module`` is watched, so a test
sees every object that would have been unpickled."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import types
import warnings
from pathlib import Path

import pytest
import torch

from directkv_cute.kernels import disk_cache, jit, sources
from pkg_copy import edit, package_copy

pytestmark = pytest.mark.compile


@pytest.fixture
def root(tmp_path, monkeypatch):
    r = tmp_path / "missing" / "kc"
    monkeypatch.setenv("DIRECTKV_CACHE_DIR", str(r))
    monkeypatch.delenv("DIRECTKV_DISK_CACHE", raising=False)
    jit.clear_memory_cache()
    disk_cache.forget_warnings()
    yield r
    jit.clear_memory_cache()
    disk_cache.forget_warnings()


@pytest.fixture
def loads(monkeypatch):
    """Paths handed to cute.runtime.load_module (which still loads them)."""
    import cutlass.cute as cute

    real, seen = cute.runtime.load_module, []

    def spy(path, *a, **k):
        seen.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(cute.runtime, "load_module", spy)
    return seen


@pytest.fixture
def builds(monkeypatch):
    """Count of combine kernels compiled (not loaded from disk)."""
    real, n = jit._compile_combine, []

    def counting(*a, **k):
        n.append(a)
        return real(*a, **k)

    monkeypatch.setattr(jit, "_compile_combine", counting)
    return n


def compile_once(head_dim=64):
    jit.clear_memory_cache()
    return jit.compile_combine(head_dim, torch.bfloat16)


def objects(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def object_path(root: Path) -> Path:
    (obj,) = root.rglob("*.o")
    return obj


def cache_warnings(w) -> list[str]:
    return [str(x.message) for x in w if issubclass(x.category, disk_cache.KernelCacheWarning)]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_private_folders_and_files_and_a_load_from_disk(root, loads, builds):
    compile_once()
    assert len(builds) == 1 and not loads
    folder = jit.disk_cache_dir()
    assert folder.parent == root and folder.name == jit.source_fingerprint()
    for d in (root.parent, root, folder):
        assert mode(d) == 0o700, d
    obj = object_path(root)
    assert mode(obj) == 0o600 and mode(obj.with_name(obj.name + ".hmac")) == 0o600
    assert mode(root / disk_cache.KEY_NAME) == 0o600 and len((root / disk_cache.KEY_NAME).read_bytes()) == 32
    assert callable(compile_once())
    assert len(builds) == 1 and len(loads) == 1  # the second "process" loads the object
    assert not [p for p in folder.iterdir() if p.name.startswith((".load-", ".build-"))]


def test_object_of_another_owner_is_refused_not_loaded_not_deleted(root, loads, builds, monkeypatch):
    compile_once()
    before = objects(root)
    real = disk_cache.stat_of

    def foreign_objects(path, fd=None, *, follow=False):
        st = real(path, fd, follow=follow)
        if Path(path).suffix == ".o":
            return types.SimpleNamespace(st_mode=st.st_mode, st_uid=st.st_uid + 1000)
        return st

    monkeypatch.setattr(disk_cache, "stat_of", foreign_objects)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert callable(compile_once())
        assert callable(compile_once())
    msgs = cache_warnings(w)
    assert len(msgs) == 1, msgs
    assert str(object_path(root)) in msgs[0] and "owned by uid" in msgs[0] and "compiled in memory" in msgs[0]
    assert not loads and len(builds) == 3
    assert objects(root) == before  # neither replaced nor deleted


def test_folder_of_another_owner_is_refused(root, loads, builds, monkeypatch):
    compile_once()
    before = objects(root)
    uid = os.geteuid()
    monkeypatch.setattr(disk_cache, "current_uid", lambda: uid + 1000)
    with pytest.warns(disk_cache.KernelCacheWarning, match=f"{root}: owned by uid {uid}, not by this user"):
        compile_once()
    assert not loads and len(builds) == 2 and objects(root) == before


@pytest.mark.parametrize("where", ["root", "folder"])
def test_group_writable_folder_is_refused(root, loads, builds, where):
    compile_once()
    folder = jit.disk_cache_dir()
    path = root if where == "root" else folder
    os.chmod(path, 0o770)
    before = objects(root)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        compile_once()
        jit.compile_combine(128, torch.bfloat16)  # another kernel: no second warning
    msgs = cache_warnings(w)
    assert len(msgs) == 1, msgs
    assert f"{path}: writable by group or others (mode 0770)" in msgs[0]
    assert not loads and len(builds) == 3
    assert objects(root) == before


def test_bit_flipped_object_is_rebuilt_not_loaded(root, loads, builds):
    compile_once()
    obj = object_path(root)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error", disk_cache.KernelCacheWarning)  # ours: rebuilt without a fuss
        compile_once()
    assert not loads and len(builds) == 2
    assert obj.read_bytes() != bytes(data)  # overwritten with the rebuilt object
    compile_once()
    assert len(loads) == 1 and len(builds) == 2  # which loads again


def test_planted_object_with_a_plain_sha256_digest_is_not_loaded(root, loads, builds, tmp_path):
    compile_once()
    obj = object_path(root)
    planted = b"\x7fELF" + os.urandom(256)
    obj.write_bytes(planted)
    obj.with_name(obj.name + ".hmac").write_text(hashlib.sha256(planted).hexdigest() + "\n")
    compile_once()
    assert not loads and len(builds) == 2 and obj.read_bytes() != planted


def test_key_readable_by_others_is_refused(root, loads, builds):
    compile_once()
    os.chmod(root / disk_cache.KEY_NAME, 0o644)
    with pytest.warns(disk_cache.KernelCacheWarning, match="key: readable or writable by group or others"):
        compile_once()
    assert not loads and len(builds) == 2


def test_symlinked_object_is_refused(root, loads, builds, tmp_path):
    compile_once()
    obj = object_path(root)
    elsewhere = tmp_path / "elsewhere.o"
    shutil.move(obj, elsewhere)
    obj.symlink_to(elsewhere)
    with pytest.warns(disk_cache.KernelCacheWarning, match="a symbolic link"):
        compile_once()
    assert not loads and len(builds) == 2 and obj.is_symlink()


def test_object_then_digest_are_renamed_into_place(root, monkeypatch):
    renamed = []
    real = os.replace

    def recording(src, dst):
        renamed.append((Path(src).parent.name.startswith(".build-"), Path(dst).name))
        real(src, dst)

    monkeypatch.setattr(disk_cache.os, "replace", recording)
    compile_once()
    (name,) = {Path(n).stem for _, n in renamed if n.endswith(".o")}
    assert renamed == [(True, f"{name}.o"), (True, f"{name}.o.hmac")]


@pytest.mark.parametrize("off", ["0", "false", "No", "OFF"])
def test_disabled_cache_writes_nothing(root, loads, monkeypatch, off):
    monkeypatch.setenv("DIRECTKV_DISK_CACHE", off)
    compile_once()
    assert not root.exists() and not loads


@pytest.mark.parametrize("name, value", [("DIRECTKV_DISK_CACHE", "of"), ("DIRECTKV_DISK_CACHE", "2"),
                                         ("DIRECTKV_CACHE_DIR", "FILE")])
def test_a_bad_cache_variable_stops_the_compile_before_it_builds(root, builds, monkeypatch, tmp_path, name, value):
    if value == "FILE":
        value = str(tmp_path / "a_file")
        (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(name, value)
    from directkv_cute.env import EnvironmentVariableError

    with pytest.raises(EnvironmentVariableError, match=f"^{name}="):
        compile_once()
    assert not builds and not root.exists()


# ---- the key covers what generates code -----------------------------------------------------


def test_a_mutated_config_rule_gives_a_new_cache_key(root, tmp_path, monkeypatch, loads, builds):
    """Two copies of the package that differ only in a code-generating rule of config.py (here
    the multi-token chunk threshold) never share compiled objects."""
    compile_once()
    first = jit.disk_cache_dir()
    copy = package_copy(tmp_path)
    monkeypatch.setattr(sources, "PACKAGE_DIR", copy)
    assert jit.disk_cache_dir() == first  # an identical copy: the same key
    edit(copy / "config.py", "MULTI_TOKEN_CHUNK4_ROWS = 8192", "MULTI_TOKEN_CHUNK4_ROWS = 4096")
    second = jit.disk_cache_dir()
    assert second != first and second.parent == first.parent
    compile_once()
    assert not loads and len(builds) == 2 and list(second.glob("*.o"))


@pytest.mark.parametrize("rel, changes", [
    ("config.py", True), ("kernels/decode.py", True), ("kernels/multi_token.py", True), ("kernels/helpers.py", True),
    ("kernels/paged.py", True), ("kernels/producer.py", True), ("kernels/softmax.py", True),
    ("kernels/combine.py", True), ("kernels/jit.py", True), ("kernels/specs.py", True),
    ("ops.py", False), ("kernels/launch.py", False), ("kernels/disk_cache.py", False),
])
def test_the_cache_key_covers_every_code_file(tmp_path, monkeypatch, rel, changes):
    copy = package_copy(tmp_path)
    before = sources.cache_fingerprint(copy)
    (copy / rel).write_text((copy / rel).read_text() + "\n# edited\n")
    assert (sources.cache_fingerprint(copy) != before) == changes


def test_the_cache_key_covers_the_cutlass_version(monkeypatch):
    before = sources.cache_fingerprint()
    monkeypatch.setattr(sources, "cutlass_version", lambda: "0.0.0-other")
    assert sources.cache_fingerprint() != before


def test_one_cache_folder_honours_xdg(monkeypatch, tmp_path):
    from directkv_cute.paths import cache_root
    from directkv_cute.tuning.cli import default_cache_dir

    monkeypatch.delenv("DIRECTKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "directkv_cute"
    assert default_cache_dir() == cache_root() / "tune"
    monkeypatch.setenv("DIRECTKV_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine" and default_cache_dir() == tmp_path / "mine" / "tune"
