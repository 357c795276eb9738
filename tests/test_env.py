"""directkv_cute.env: every DIRECTKV_* variable's good values, each class of bad value (an error
naming the variable, the value and what it accepts), and that the readers wired to it refuse a
bad value before any work."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from directkv_cute import env

ALL = sorted(env.VARIABLES)
FLAGS = [n for n, v in env.VARIABLES.items() if v.kind == "flag"]
SIZES = [n for n, v in env.VARIABLES.items() if v.kind == "size"]
FOLDERS = [n for n, v in env.VARIABLES.items() if v.kind in ("folder", "folders")]
READ = {"flag": env.flag, "choice": env.choice, "size": env.size_bytes, "folder": env.folder, "folders": env.folders}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def read(name):
    return READ[env.VARIABLES[name].kind](name)


def refused(monkeypatch, name, value, why):
    monkeypatch.setenv(name, value)
    with pytest.raises(env.EnvironmentVariableError) as ei:
        read(name)
    text = str(ei.value)
    shown = value if len(value) <= 200 else value[:200] + "..."  # a long value is shown cut
    assert text.startswith(f"{name}={shown!r}: {why}"), text
    assert f"{name} takes " in text and "\n" not in text
    assert ei.value.name == name and ei.value.value == value
    assert isinstance(ei.value, ValueError)
    return text


def _package_files():
    root = Path(env.__file__).resolve().parent.parent
    return [*root.joinpath("directkv_cute").rglob("*.py"), *root.joinpath("tuning").rglob("*.py")]


def _env_reads(tree) -> list[str]:
    """The DIRECTKV_* variables a module reads from os.environ / os.getenv: by a literal name or
    by a module constant that holds one."""
    consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def name_of(arg):
        v = arg.value if isinstance(arg, ast.Constant) else consts.get(getattr(arg, "id", None))
        return v if isinstance(v, str) and v.startswith("DIRECTKV_") else None

    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and ast.unparse(n.func) in (
                "os.environ.get", "os.getenv", "environ.get", "os.environ.pop", "os.environ.setdefault"):
            out.append(name_of(n.args[0]))
        elif isinstance(n, ast.Subscript) and ast.unparse(n.value) in ("os.environ", "environ"):
            out.append(name_of(n.slice))
    return [v for v in out if v]


def test_every_variable_the_package_names_is_declared():
    named = set()
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("DIRECTKV_"):
                named.add(node.value.split()[0].rstrip(".,:;)="))
    assert named and named <= set(ALL), sorted(named - set(ALL))
    for var in env.VARIABLES.values():
        assert var.meaning and var.default and var.accepts


def test_only_env_reads_the_variables():
    readers = {path.name: _env_reads(ast.parse(path.read_text())) for path in _package_files()
               if path.name != "env.py"}
    assert {k: v for k, v in readers.items() if v} == {}


def test_the_read_finder_finds_reads():
    tree = ast.parse('import os\nX = "DIRECTKV_A"\nos.environ.get(X, "0")\nos.environ["DIRECTKV_B"]\n'
                     'os.getenv("HOME")\n')
    assert _env_reads(tree) == ["DIRECTKV_A", "DIRECTKV_B"]


# ---- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FLAGS)
def test_flags_take_exactly_the_flag_words(monkeypatch, name):
    assert read(name) is True  # unset: both flags default on
    for value, want in [("1", True), ("0", False), ("true", True), ("FALSE", False), ("Yes", True), ("no", False),
                        ("on", True), (" Off ", False), ("", True), ("  ", True)]:
        monkeypatch.setenv(name, value)
        assert read(name) is want, value


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["of", "2", "onn", "enable", "-1", "1.0", "y", "t"])
def test_a_flag_typo_is_an_error_never_on(monkeypatch, name, value):
    text = refused(monkeypatch, name, value, "not a flag value")
    assert "1/0, true/false, yes/no or on/off" in text


# ---- DIRECTKV_REQUIRE_PROFILE ------------------------------------------------------------------


def test_require_profile_takes_the_flag_words_and_exact(monkeypatch):
    name = env.REQUIRE_PROFILE
    assert env.require_profile() == ""
    for value, want in [("1", "on"), ("on", "on"), ("TRUE", "on"), ("0", ""), ("off", ""), ("exact", "exact"),
                        (" Exact ", "exact"), ("", "")]:
        monkeypatch.setenv(name, value)
        assert env.require_profile() == want, value
    for value in ("exactly", "any", "strict", "2"):
        assert "or exact" in refused(monkeypatch, name, value, "not one of its values")


# ---- sizes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SIZES)
def test_sizes_in_gib(monkeypatch, name):
    assert read(name) is None
    for value, want in [("1", 1 << 30), ("0.5", 1 << 29), (" 2 ", 2 << 30), ("1e-9", 1), ("1e3", 1000 << 30)]:
        monkeypatch.setenv(name, value)
        assert read(name) == want, value
    for value in ("0", "0.0", "-0", ""):  # 0 (or unset): the variable's default
        monkeypatch.setenv(name, value)
        assert read(name) is None


@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize("value, why", [
    ("abc", "not a number"), ("1GB", "not a number"), ("0x10", "not a number"),
    ("inf", "not a finite number"), ("-inf", "not a finite number"), ("nan", "not a finite number"),
    ("1e400", "not a finite number"), ("9" * 400, "not a finite number"),
    ("1e300", "too large"), ("-1", "negative"), ("-0.5", "negative"), ("1e-300", "less than one byte"),
])
def test_bad_sizes_are_errors(monkeypatch, name, value, why):
    text = refused(monkeypatch, name, value, why)
    assert "finite number > 0" in text and "0 or unset:" in text and len(text) < 400


# ---- folders -----------------------------------------------------------------------------------


def test_folders(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "absent"))
    assert env.cache_dir() == tmp_path / "absent"
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    assert env.cache_dir() == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(env.CACHE_DIR, "~/c")
    assert env.cache_dir() == tmp_path / "c"
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(env.PROFILE_DIR, os.pathsep.join([str(a), "", str(b), str(a)]))
    assert env.profile_dirs() == [a, b]
    monkeypatch.setenv(env.PROFILE_DIR, "")
    assert env.profile_dirs() == []


@pytest.mark.parametrize("name", FOLDERS)
def test_a_file_where_a_folder_goes_is_an_error(monkeypatch, tmp_path, name):
    f = tmp_path / "a_file"
    f.write_text("")
    refused(monkeypatch, name, str(f), f"{f} exists and is not a folder")
    if env.VARIABLES[name].kind == "folders":  # one bad part of a list
        refused(monkeypatch, name, os.pathsep.join([str(tmp_path), str(f)]), f"{f} exists and is not a folder")


def test_check_all_names_the_first_bad_variable(monkeypatch):
    env.check_all()
    monkeypatch.setenv(env.STAGE_OVERLAP, "of")
    with pytest.raises(env.EnvironmentVariableError, match="DIRECTKV_STAGE_OVERLAP='of'"):
        env.check_all()


def test_env_imports_no_torch():
    code = ("import sys; import directkv_cute.env as e; e.check_all(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the readers refuse a bad value before any work ----------------------------------------------


def test_a_bad_disk_cache_flag_stops_a_compile_before_it_builds(monkeypatch, tmp_path):
    from directkv_cute.kernels import disk_cache, jit

    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(disk_cache, "load_or_build", lambda *a, **k: pytest.fail("reached the disk cache"))
    for name, value in ((env.DISK_CACHE, "of"), (env.CACHE_DIR, str(Path(__file__)))):
        monkeypatch.setenv(name, value)
        with pytest.raises(env.EnvironmentVariableError, match=name):
            jit._load_or_build(("test", name), lambda: pytest.fail("built"))
        monkeypatch.delenv(name) if name == env.DISK_CACHE else monkeypatch.setenv(name, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv(env.DISK_CACHE, "off")
    assert jit.disk_cache_dir() is None
    monkeypatch.setenv(env.DISK_CACHE, "false")  # was "on" when only "0" turned it off
    assert jit.disk_cache_dir() is None
    monkeypatch.setenv(env.DISK_CACHE, "yes")
    assert jit.disk_cache_dir() == tmp_path / "cache" / jit.source_fingerprint()


def test_the_profile_lookup_raises_a_bad_variable_before_reading_profiles(monkeypatch, tmp_path):
    import torch

    from directkv_cute.tuning import lookup as L
    from directkv_cute.tuning import profiles as P

    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(L, "find_profiles", lambda *a, **k: pytest.fail("read the profile folders"))
    L.clear_cache()
    kw = dict(gpu_name="Test GPU", kernel_hash="0" * 64, dtype=torch.bfloat16, head_dim=128, group=8, page_size=64,
              batch=1, context=4096, q_len=1, rows=8)
    try:
        for name, value in ((env.REQUIRE_PROFILE, "exactly"), (env.REQUIRE_PROFILE, "of"),
                            (env.PROFILE_DIR, str(Path(__file__)))):
            monkeypatch.setenv(name, value)
            for ask in (L.select_config, L.explain_config):
                with pytest.raises(env.EnvironmentVariableError, match=name):
                    ask("decode", **kw)
            monkeypatch.delenv(name) if name == env.REQUIRE_PROFILE else monkeypatch.setenv(name, str(tmp_path))
        with pytest.raises(env.EnvironmentVariableError, match=env.PROFILE_DIR):
            monkeypatch.setenv(env.PROFILE_DIR, str(Path(__file__)))
            P.profile_dirs()
    finally:
        L.clear_cache()


def test_the_tuners_folders_refuse_a_bad_variable(monkeypatch, tmp_path):
    from directkv_cute.paths import cache_root
    from directkv_cute.tuning import cli

    f = tmp_path / "a_file"
    f.write_text("")
    monkeypatch.setenv(env.CACHE_DIR, str(f))
    with pytest.raises(env.EnvironmentVariableError, match=env.CACHE_DIR):
        cache_root()
    with pytest.raises(env.EnvironmentVariableError, match=env.CACHE_DIR):
        cli.default_cache_dir()


# ---- DIRECTKV_VLLM_HBM_GB ------------------------------------------------------------------------


def test_the_vllm_hbm_budget(monkeypatch):
    name = env.VLLM_HBM_GB
    assert env.vllm_hbm_bytes() == 0  # unset: no HBM tier
    for value, want in [("0", 0), ("", 0), ("1.5", 3 << 29), (" 40 ", 40 << 30)]:
        monkeypatch.setenv(name, value)
        assert env.vllm_hbm_bytes() == want, value
    for value, why in [("-1", "negative"), ("inf", "not a finite number"), ("4GB", "not a number")]:
        text = refused(monkeypatch, name, value, why)
        assert "a finite number > 0 (0 or unset: no HBM tier)" in text
        monkeypatch.setenv(name, value)
        with pytest.raises(env.EnvironmentVariableError, match=name):
            env.vllm_hbm_bytes()
