"""Issue 22, "Profiles and the tuner": file modes, hostile YAML, a bad source that must not hide the
next one, leftovers of a killed save, the output folder checked first, the user profile folder,
and directkv-tune's answers to bad or unusual arguments (no tracebacks, the op's kernel)."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from directkv_cute.config import DecodeConfig, default_decode_config, default_multi_token_config
from directkv_cute.tuning import cli
from directkv_cute.tuning import lookup as L
from directkv_cute.tuning import profiles as P
from directkv_cute.tuning.space import STREAM_MAX_ROWS, op_kernel

# the fall-back warnings that follow the ones a test asserts
pytestmark = [pytest.mark.filterwarnings("ignore:directkv-cute. no tuned:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*not usable here:UserWarning")]

GPU = "Test GPU H200"  # a name no bundled profile will ever have
KH = P.current_kernel_hash("decode")
CLASS = ("decode", "bf16", 128, 8, 64)
TUNED = DecodeConfig(tile_n=32, stages=2)
DEFAULT = default_decode_config(128, 8, 64)


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Every lookup folder under tmp_path: env, user (XDG) and a stand-in for the bundled one."""
    for d in ("env", "xdg", "bundled", "cache"):
        (tmp_path / d).mkdir()
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(cli.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(P, "bundled_profile_dir", lambda: tmp_path / "bundled")
    monkeypatch.delenv(L.REQUIRE_ENV, raising=False)
    L.clear_cache()
    yield
    L.clear_cache()


def make_profile(gpu=GPU, entries=None, cls=CLASS, kernel="decode"):
    prof = P.Profile(metadata=P.make_metadata(
        {"gpu_name": gpu, "compute_capability": "9.0", "sm_count": 132, "smem_optin_bytes": 232448},
        objective="gpu"))
    for bk, cfg in (entries or {(1, 4096, 1): TUNED}).items():
        prof.set(cls, bk, {"config": cfg.to_dict(), "p50_us": 10.0, "default_p50_us": 11.0, "trials": 5,
                           "kernel_hash": P.current_kernel_hash(kernel)})
    return prof


def write_profile(d, gpu=GPU, **kw):
    path = d / P.profile_filename(gpu)
    P.save_profile(make_profile(gpu, **kw), path, merge=False)
    return path


def ask(q_len=1, gpu=GPU):
    return L.select_config("decode", gpu_name=gpu, kernel_hash=KH, dtype=torch.bfloat16, head_dim=128, group=8,
                           page_size=64, batch=1, context=4096, q_len=q_len, rows=8 * q_len)


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_exit(capsys, *argv):
    """An argument error: argparse's message and exit status 2, never a traceback."""
    with pytest.raises(SystemExit) as ei:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    assert ei.value.code == 2 and "Traceback" not in out + err
    return err


ALIAS_BOMB = textwrap.dedent("""\
    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
    g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
    h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
    i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
    schema_version: 2
""")


# ---- modes -------------------------------------------------------------------------------------


def test_a_new_profile_is_0644_and_a_resaved_one_keeps_its_mode(tmp_path):
    path = write_profile(tmp_path / "env")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600
    os.chmod(path, 0o640)
    P.save_profile(make_profile(entries={(4, 4096, 1): TUNED}), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert len(P.load_profile(path)) == 2
    os.chmod(path, 0o600)  # the mode the old writer left: re-saving keeps what the owner chose
    P.save_profile(make_profile(), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# ---- hostile YAML ------------------------------------------------------------------------------


def test_alias_bomb_is_refused_at_once(tmp_path):
    path = tmp_path / "env" / P.profile_filename(GPU)
    path.write_text(ALIAS_BOMB)
    t0 = time.perf_counter()
    with pytest.raises(P.ProfileError, match="anchors or aliases"):
        P.load_profile(path)
    assert time.perf_counter() - t0 < 1.0


def test_our_own_files_never_hold_aliases(tmp_path):
    shared = TUNED.to_dict()
    prof = make_profile()
    prof.set(CLASS, (4, 4096, 1), {"config": shared, "p50_us": 1.0, "default_p50_us": None, "trials": 1,
                                   "kernel_hash": KH, "runner_up": [{"config": shared, "p50_us": 2.0}]})
    prof.set(CLASS, (16, 4096, 1), {"config": shared, "p50_us": 1.0, "default_p50_us": None, "trials": 1,
                                    "kernel_hash": KH})
    text = prof.to_yaml()
    assert "&id" not in text and "*id" not in text
    assert len(P.parse_profile(text)) == 3


def test_a_huge_profile_is_refused_before_parsing(tmp_path, monkeypatch):
    path = tmp_path / "env" / P.profile_filename(GPU)
    with open(path, "w") as f:
        f.write("schema_version: 2\n")
        f.write(("# " + "x" * 1022 + "\n") * (P.MAX_PROFILE_BYTES // 1024 + 1))
    monkeypatch.setattr(P.yaml, "load", lambda *a, **k: pytest.fail("parsed a file over the size cap"))
    with pytest.raises(P.ProfileError, match="more than the 4194304 a profile may have"):
        P.load_profile(path)
    with pytest.raises(P.ProfileError, match="more than"):
        P.parse_profile(path.read_text())


def test_error_text_is_bounded(tmp_path):
    prof = make_profile()
    d = prof.to_doc()
    d["metadata"]["sm_count"] = "x" * 1_000_000
    d["entries"][0]["buckets"] = [dict(d["entries"][0]["buckets"][0], p50_us="y" * 100_000) for _ in range(50)]
    with pytest.raises(P.ProfileError) as ei:
        P.Profile.from_doc(d, "big.yaml")
    assert "sm_count" in str(ei.value) and len(str(ei.value)) <= P.MAX_ERROR_CHARS + 100
    with pytest.raises(P.ProfileError) as ei:
        P.parse_profile("a: [" + "x" * 2_000_000 + "\n", "corrupt.yaml")
    assert len(str(ei.value)) <= P.MAX_ERROR_CHARS + 100


def test_deep_nesting_is_a_profile_error():
    with pytest.raises(P.ProfileError, match="corrupt YAML"):
        P.parse_profile("[" * 20000 + "]" * 20000)


@pytest.mark.parametrize("kind", ["bomb", "huge", "deep", "memory", "bug"])
def test_the_ops_lookup_warns_and_falls_back_never_raises(tmp_path, monkeypatch, kind):
    path = tmp_path / "env" / P.profile_filename(GPU)
    if kind == "bomb":
        path.write_text(ALIAS_BOMB)
    elif kind == "huge":
        path.write_text("schema_version: 2\n" + "#" * (P.MAX_PROFILE_BYTES + 10) + "\n")
    elif kind == "deep":
        path.write_text("[" * 20000 + "]" * 20000)
    else:
        write_profile(tmp_path / "env")
        exc = MemoryError() if kind == "memory" else KeyError("config")
        monkeypatch.setattr(L, "load_profile", lambda *a, **k: (_ for _ in ()).throw(exc))
    t0 = time.perf_counter()
    with pytest.warns(P.ProfileWarning, match="ignoring"):
        assert ask() == (DEFAULT, "default")
    assert time.perf_counter() - t0 < 2.0
    # a failure anywhere in building the decision is a warning too
    L.clear_cache()
    monkeypatch.setattr(L, "_usable_profile", lambda gpu: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.warns(P.ProfileWarning, match="profile lookup failed: RuntimeError: boom"):
        assert ask() == (DEFAULT, "default")


# ---- a bad source does not hide the next -------------------------------------------------------


@pytest.mark.parametrize("bad", ["corrupt", "bomb", "foreign", "tune_version"])
def test_a_bad_env_profile_does_not_hide_the_bundled_one(tmp_path, bad):
    write_profile(tmp_path / "bundled")
    env_file = tmp_path / "env" / P.profile_filename(GPU)
    if bad == "corrupt":
        env_file.write_text("schema_version: 2\nmetadata: [")
    elif bad == "bomb":
        env_file.write_text(ALIAS_BOMB)
    elif bad == "foreign":
        P.atomic_write_text(env_file, make_profile(gpu="Other GPU").to_yaml())
    else:
        prof = make_profile()
        prof.metadata["tune_version"] = P.TUNE_VERSION + 1
        P.atomic_write_text(env_file, prof.to_yaml())
    with pytest.warns(P.ProfileWarning, match="ignoring"):
        assert ask() == (TUNED, "exact")
    dec = L.explain_config("decode", gpu_name=GPU, kernel_hash=KH, dtype="bf16", head_dim=128, group=8, page_size=64,
                           batch=1, context=4096, q_len=1, rows=8)
    assert dec.profile_path == tmp_path / "bundled" / P.profile_filename(GPU)
    assert L.profile_for(GPU).path == dec.profile_path


def test_every_source_bad_names_each(tmp_path):
    (tmp_path / "env" / P.profile_filename(GPU)).write_text("nope: [")
    (tmp_path / "bundled" / P.profile_filename(GPU)).write_text(ALIAS_BOMB)
    with pytest.warns(P.ProfileWarning):
        dec = L.explain_config("decode", gpu_name=GPU, kernel_hash=KH, dtype="bf16", head_dim=128, group=8,
                               page_size=64, batch=1, context=4096, q_len=1, rows=8)
    assert dec.source == "default" and "corrupt YAML" in dec.reason and "aliases" in dec.reason


# ---- leftovers of a killed save ----------------------------------------------------------------


def test_kill_9_during_a_save_leaves_nothing_that_matters(tmp_path):
    path = write_profile(tmp_path / "env")
    code = textwrap.dedent(f"""
        import os, signal
        from directkv_cute.tuning import profiles as P
        prof = P.load_profile({str(path)!r})
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed between write and rename
        P.save_profile(prof, {str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = sorted(p.name for p in path.parent.iterdir() if p.name.endswith(".tmp"))
    assert len(left) == 1 and P._writer_pid(path.parent / left[0], path) is not None  # it names its writer
    lock = P.lock_path(path)
    assert lock.exists() and lock.stat().st_size == 0
    # the next save removes the dead writer's temp file and is not blocked by the lock file
    with pytest.warns(P.ProfileWarning, match="left by an interrupted save"):
        P.save_profile(make_profile(entries={(4, 4096, 1): TUNED}), path)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert len(P.load_profile(path)) == 2
    assert stat.S_IMODE(lock.stat().st_mode) == 0o644 and lock.stat().st_size == 0


def test_stale_temp_files_by_age_and_pid(tmp_path):
    path = write_profile(tmp_path / "env")
    d = path.parent
    dead = d / f".{path.name}.999999999.abcd1234.tmp"  # a pid above any pid_max
    old = d / f".{path.name}.k2j3h4g5.tmp"  # mkstemp's old name, no pid: removed by age
    live = d / f".{path.name}.{os.getppid()}.zzzz9999.tmp"  # a live writer's fresh file: kept
    other = d / ".Other_GPU.yaml.999999999.abcd1234.tmp"  # another profile's: not ours to touch
    for p in (dead, old, live, other):
        p.write_text("partial")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    removed = P.remove_stale_temp_files(path)
    assert sorted(removed) == sorted([dead, old])
    assert live.exists() and other.exists() and not dead.exists() and not old.exists()


# ---- the output folder is checked before tuning ------------------------------------------------


def model_run(capsys, out_dir, *extra):
    return run(capsys, "run", "--objective", "model", "--shape", "64,8,128,1,4096,1", "--trials", "3",
               "--output", str(out_dir), "-q", *extra)


def test_an_unwritable_output_fails_before_tuning(capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc, out, err = model_run(capsys, blocker / "profiles")
    assert rc == 2 and "cannot write profiles to" in err and "bucket(s) of decode" not in out
    assert not list((tmp_path / "cache").iterdir())  # no journal: nothing was tuned

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(P.tempfile, "TemporaryFile", denied)
    rc, out, err = model_run(capsys, tmp_path / "ro")
    assert rc == 2 and "Permission denied" in err and "--output DIR" in err and "bucket(s)" not in out


def test_the_tuner_api_checks_its_output_before_measuring(tmp_path):
    from directkv_cute.tuning.objectives import ModelledObjective
    from directkv_cute.tuning.space import TuneShape
    from directkv_cute.tuning.tuner import TuneOptions, Tuner

    calls = []
    model = ModelledObjective(seed=0)

    def measure(cfg, shape, **kw):
        calls.append(cfg)
        return model(cfg, shape, **kw)

    measure.environment = model.environment
    (tmp_path / "a_file").write_text("")
    t = Tuner("decode", measure, options=TuneOptions(n_trials=2, progress=False),
              output_dir=tmp_path / "a_file" / "out")
    with pytest.raises(P.ProfileError, match="cannot write profiles to"):
        t.tune([TuneShape(64, 8, 128, 1, 4096, 1)])
    assert calls == []


def test_a_corrupt_profile_in_the_output_fails_before_tuning(capsys, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "Modelled_H200_PCIe5.yaml").write_text("schema_version: 2\nmetadata: [")
    rc, out, err = model_run(capsys, out_dir)
    assert rc == 2 and "cannot be merged" in err and "corrupt YAML" in err and "bucket(s)" not in out


# ---- the user folder ---------------------------------------------------------------------------


def test_lookup_order_and_default_output(tmp_path, monkeypatch):
    user = tmp_path / "xdg" / "directkv_cute" / "profiles"
    assert P.profile_dirs() == [tmp_path / "env", user, tmp_path / "bundled"]
    assert P.default_output_dir() == tmp_path / "env"
    monkeypatch.delenv(P.PROFILE_DIR_ENV)
    monkeypatch.setattr(P, "is_source_checkout", lambda: False)  # an installed wheel
    assert P.default_output_dir() == user
    monkeypatch.setattr(P, "is_source_checkout", lambda: True)  # a checkout: its profiles/ (committed)
    assert P.default_output_dir() == tmp_path / "bundled"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert P.user_profile_dir() == tmp_path / "home" / ".config" / "directkv_cute" / "profiles"


def test_a_checkout_is_recognised(tmp_path):
    assert not P.is_source_checkout()  # tmp_path/bundled: no pyproject.toml next to it
    (tmp_path / "pyproject.toml").write_text("")
    assert P.is_source_checkout()


def test_the_lookup_reads_the_user_folder_before_the_bundled_one(tmp_path, monkeypatch):
    monkeypatch.delenv(P.PROFILE_DIR_ENV)
    write_profile(tmp_path / "bundled", entries={(1, 4096, 1): DecodeConfig(tile_n=64, stages=3)})
    user = tmp_path / "xdg" / "directkv_cute" / "profiles"
    user.mkdir(parents=True)
    write_profile(user)
    assert ask() == (TUNED, "exact")


def test_the_gpu_tuner_writes_to_the_user_folder_of_an_install(capsys, tmp_path, monkeypatch):
    from directkv_cute.tuning.objectives import ModelledObjective

    monkeypatch.delenv(P.PROFILE_DIR_ENV)
    monkeypatch.setattr(P, "is_source_checkout", lambda: False)
    monkeypatch.setattr(cli, "_make_objective", lambda a: ModelledObjective(seed=0))
    rc, out, _ = run(capsys, "run", "--objective", "gpu", "--shape", "64,8,128,1,4096,1", "--trials", "2", "-q")
    want = tmp_path / "xdg" / "directkv_cute" / "profiles" / "Modelled_H200_PCIe5.yaml"
    assert rc == 0 and f"profile: {want}" in out and want.is_file()
    L.clear_cache()
    d = L.explain_config("decode", gpu_name="Modelled H200 PCIe5", kernel_hash=KH, dtype="bf16", head_dim=128,
                         group=8, page_size=64, batch=1, context=4096, q_len=1, rows=8)
    assert d.source == "exact" and d.profile_path == want


# ---- directkv-tune -----------------------------------------------------------------------------


def test_lookup_bad_dtype_page_size_and_head_dim_are_argument_errors(capsys):
    shape = "64,8,128,1,4096,1"
    assert "unsupported dtype 'fp32'" in run_exit(capsys, "lookup", "--gpu", GPU, "--shape", shape, "--dtype", "fp32")
    err = run_exit(capsys, "lookup", "--gpu", GPU, "--shape", shape, "--page-size", "48")
    assert "page size 48" in err and "16, 32, 64, 128" in err and "default" not in err  # the cause, not the default
    err = run_exit(capsys, "lookup", "--gpu", GPU, "--shape", "64,8,100,1,4096,1")
    assert "head dim D=100" in err and "64, 128" in err
    assert "page size 48" in run_exit(capsys, "run", "--dry-run", "--preset", "llama3-8b", "--page-size", "48")
    assert "must be >= 1, got -3" in run_exit(capsys, "run", "--preset", "llama3-8b", "--trials", "-3")
    assert "must be >= 1" in run_exit(capsys, "run", "--preset", "llama3-8b", "--trials", "0")
    assert "positive" in run_exit(capsys, "run", "--preset", "llama3-8b", "--time-budget", "-1")


def test_lookup_finds_the_profile_by_its_file_spelling(capsys, tmp_path):
    write_profile(tmp_path / "env")
    rc, out, _ = run(capsys, "lookup", "--gpu", P.sanitize_gpu_name(GPU), "--shape", "64,8,128,1,4096,1")
    assert rc == 0 and "source:  exact" in out and f"gpu:     {GPU}" in out


def test_op_kernel_is_the_ops_rule(monkeypatch):
    from directkv_cute import ops

    monkeypatch.setattr(ops, "_lookup", lambda kernel, *a: kernel)

    class Cache:
        dtype, head_dim, page_size = torch.bfloat16, 128, 64

    for group in (1, 4, 8, 16, 64):
        for q_len in (1, 2, 8, 16, 17, 32, 33, 128, 129, 2048):
            cfg, kernel = ops.select_config(Cache(), group, q_len, 1, 4096, None)
            assert kernel == cfg == op_kernel(group, q_len), (group, q_len)
    assert op_kernel(1, STREAM_MAX_ROWS) == "decode" and op_kernel(1, STREAM_MAX_ROWS + 1) == "multi_token"


def test_lookup_answers_with_the_kernel_the_op_runs(capsys, tmp_path):
    write_profile(tmp_path / "env")
    with pytest.warns(P.ProfileWarning, match="no tuned multi_token config"):
        rc, out, _ = run(capsys, "lookup", "--gpu", GPU, "--shape", "64,8,128,1,4096,2048")
    assert rc == 0 and "kernel:  multi_token" in out and "source:  default" in out
    assert str(default_multi_token_config(128, 8 * 2048)) in out
    rc, out, _ = run(capsys, "lookup", "--gpu", GPU, "--shape", "64,8,128,1,4096,1")
    assert rc == 0 and "kernel:  decode\n" in out and "source:  exact" in out
    with pytest.warns(P.ProfileWarning):
        rc, out, _ = run(capsys, "lookup", "--gpu", GPU, "--shape", "64,8,128,1,4096,1", "--kernel", "multi_token")
    assert rc == 0 and "the op runs decode" in out


def test_lookup_options_have_help():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "cmd").choices
    for action in sub["lookup"]._actions:
        assert action.help, f"lookup {action.option_strings} has no help"


def test_multi_token_dry_run_is_quick_and_says_it_estimates(capsys):
    t0 = time.perf_counter()
    rc, out, _ = run(capsys, "run", "--dry-run", "--kernel", "multi_token", "--preset", "llama3-8b",
                     "--q-lens", "512,2048", "--batches", "1", "--contexts", "32768")
    assert rc == 0 and time.perf_counter() - t0 < 30
    assert "2571912 points" in out and "estimated from" in out and "sampled points" in out and "2 bucket(s)" in out


def test_multi_token_preset_leaves_out_the_q_len_1_buckets(capsys):
    rc, out, err = run(capsys, "run", "--dry-run", "--kernel", "multi_token", "--preset", "llama3-8b",
                       "--q-lens", "1,512", "--batches", "1", "--contexts", "4096")
    assert rc == 0 and "1 bucket(s)" in out and "q_len=1 " not in out
    assert "left out 1 bucket(s) with q_len 1" in err and "--kernel decode" in err
    rc, out, err = run(capsys, "run", "--dry-run", "--kernel", "multi_token", "--preset", "llama3-8b")
    assert rc == 2 and "no bucket left for the multi_token kernel" in err and "--q-lens" in err
    rc, out, err = run(capsys, "run", "--dry-run", "--preset", "llama3-8b", "--q-lens", "1,64",
                       "--batches", "1", "--contexts", "4096")  # decode: q_len 64 x group 4 = 256 rows
    assert rc == 0 and "1 bucket(s)" in out and "with q_len 64" in err


def test_check_compile_compiles_multi_token_entries_too(capsys, tmp_path, monkeypatch):
    d = tmp_path / "env"
    pre = default_multi_token_config(128, 4 * 512)
    path = write_profile(d, entries={(1, 32768, 512): pre}, cls=("multi_token", "bf16", 128, 4, 64), kernel="multi_token")
    P.save_profile(make_profile(), path)  # and one decode entry
    calls = []

    def fake_compile(cfg, dtype, head_dim, page_size, group, max_q_len, split_out=True, multi_token=False):
        calls.append((cfg, group, max_q_len, multi_token))

    monkeypatch.setattr(cli, "_resolve_compile", lambda: (fake_compile, ""))
    rc, out, _ = run(capsys, "check", "--dir", str(d), "--compile")
    assert rc == 0 and "2 compiled" in out and "note" not in out
    assert sorted(calls, key=lambda c: c[3]) == [(TUNED, 8, 1, False), (pre, 4, 512, True)]


def test_check_compile_resolves_the_ops_compiler():
    from directkv_cute.kernels import jit

    fn, note = cli._resolve_compile()
    assert fn is jit.compile_decode and note == ""


def test_check_and_show_a_missing_dir_fail(capsys, tmp_path):
    rc, _, err = run(capsys, "check", "--dir", str(tmp_path / "nonexistent"))
    assert rc == 1 and "no such folder" in err
    rc, _, err = run(capsys, "show", "--dir", str(tmp_path / "nonexistent"))
    assert rc == 1 and "no such folder" in err


def test_show_for_another_gpu_says_no_profile_for_that_gpu(capsys, tmp_path):
    write_profile(tmp_path / "env")
    rc, out, _ = run(capsys, "show", "--gpu", "NVIDIA H100")
    assert rc == 0 and "no profile for GPU 'NVIDIA H100'" in out and f"profiles there are for: {GPU}" in out
    assert "no profiles found" not in out
    rc, out, _ = run(capsys, "show", "--gpu", P.sanitize_gpu_name(GPU))
    assert rc == 0 and GPU in out and "decode" in out


def test_no_warning_escapes_a_clean_lookup(tmp_path):
    write_profile(tmp_path / "env")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ask() == (TUNED, "exact")
