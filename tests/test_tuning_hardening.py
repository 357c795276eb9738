"""Profiles and the tuner under bad input: file modes, hostile YAML, a bad source that must not hide
the next one, leftovers of a killed save, the output folder checked first, the user profile
folder, corrupt numbers, and directkv-tune's answers to every failure a user can cause (one line
on stderr, exit status 2, nothing written, before any tuning)."""

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

# the fall-back warnings that follow the ones a test asserts; every lookup folder under tmp_path
pytestmark = [pytest.mark.filterwarnings("ignore:directkv-cute. no tuned:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*not usable here:UserWarning"),
              pytest.mark.usefixtures("isolated_profiles")]

GPU = "Test GPU H200"  # a name no bundled profile will ever have
KH = P.current_kernel_hash("decode")
CLASS = ("decode", "bf16", 128, 8, 64)
TUNED = DecodeConfig(tile_n=32, stages=2)
DEFAULT = default_decode_config(128, 8, 64)


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
    assert rc == 2 and f"--output {blocker / 'profiles'}: {blocker} is not a folder" in err
    assert err.count("\n") == 1 and "bucket(s) of decode" not in out
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


def test_op_kernel_is_the_planners_in_place_rule():
    """``directkv-tune lookup`` names the kernel ``op_kernel`` gives; it is the one the planner
    runs in place (a capture plans in place) for every GQA group and query length."""
    from directkv_cute.machine import H200, DeviceInfo
    from directkv_cute.planner import CallShape, DefaultConfigs, plan_attention

    device = DeviceInfo("H", 132, 2**37, capturing=True)
    for group in (1, 4, 8, 16, 64):
        for q_len in (1, 2, 8, 16, 17, 32, 33, 128, 129, 2048):
            shape = CallShape.example([4096], [q_len], num_q_heads=group, num_kv_heads=1)
            kernel = plan_attention(shape, device, H200, DefaultConfigs()).kernel
            assert kernel == op_kernel(group, q_len), (group, q_len, kernel)
    assert op_kernel(1, STREAM_MAX_ROWS) == "decode" and op_kernel(1, STREAM_MAX_ROWS + 1) == "multi_token"


def test_lookup_answers_with_the_kernel_the_op_runs(capsys, tmp_path):
    write_profile(tmp_path / "env")
    with pytest.warns(P.ProfileWarning, match="no tuned multi_token config"):
        rc, out, _ = run(capsys, "lookup", "--gpu", GPU, "--shape", "64,8,128,1,4096,2048")
    assert rc == 0 and "kernel:  multi_token" in out and "source:  default" in out
    assert str(default_multi_token_config(128, 8 * 2048)) in out
    rc, out, _ = run(capsys, "lookup", "--gpu", GPU, "--shape", "64,8,128,1,4096,1")
    assert rc == 0 and "kernel:  decode\n" in out and "source:  exact" in out
    with warnings.catch_warnings(record=True) as w:  # the class's miss was said above, once
        warnings.simplefilter("always")
        rc, out, _ = run(capsys, "lookup", "--gpu", GPU, "--shape", "64,8,128,1,4096,1", "--kernel", "multi_token")
    assert rc == 0 and "the op runs decode" in out and "source:  default" in out
    assert not [x for x in w if issubclass(x.category, P.ProfileWarning)]


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
    assert err.count("\n") == 1 and "--kernel decode" in err  # a failure is one line
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
    assert rc == 2 and "no such folder" in err
    rc, _, err = run(capsys, "show", "--dir", str(tmp_path / "nonexistent"))
    assert rc == 2 and "no such folder" in err


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


# ---- directkv-tune: every failure a user can cause is one line, exit status 2, nothing written --------


def one_line_exit(capsys, *argv) -> str:
    """A CLI failure: exit status 2 (returned, or argparse's SystemExit), one line on stderr."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in out + err and "usage:" not in err
    return err


def tree(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


MODEL = ("run", "--objective", "model", "--shape", "64,8,128,1,4096,1", "--trials", "2", "-q")


@pytest.mark.parametrize("argv, says", [
    (("--seed", "-1"), "argument --seed: must be >= 0, got -1"),
    (("--seed", str(2**32)), "must be < 4294967296"),
    (("--seed", "x"), "expected an integer, got 'x'"),
    (("--time-budget", "1e-300"), "too short to measure anything"),
    (("--time-budget", "nan"), "must be a positive number"),
    (("--max-host-gib", "1e300"), "more memory than a machine addresses"),
    (("--trials", "0"), "must be >= 1"),
])
def test_bad_run_arguments(capsys, tmp_path, argv, says):
    err = one_line_exit(capsys, *MODEL, "--output", str(tmp_path / "out"), *argv)
    assert says in err and err.startswith("directkv-tune run: error: ") and "--help" in err
    assert tree(tmp_path) == ["bundled", "cache", "env", "xdg"]  # nothing written


@pytest.mark.parametrize("gpu", ["", "  ", "///", "\u00e9\u00e8"])
def test_a_gpu_name_without_letters_or_digits_is_an_argument_error(capsys, gpu):
    assert "has no letters or digits" in one_line_exit(capsys, "lookup", "--gpu", gpu, "--shape", "64,8,128,1,4096,1")
    assert "has no letters or digits" in one_line_exit(capsys, "show", "--gpu", gpu)


def test_journal_and_cache_paths_that_cannot_be_used(capsys, tmp_path, monkeypatch):
    a_file, a_dir = tmp_path / "a_file", tmp_path / "a_dir"
    a_file.write_text("")
    a_dir.mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    out = tmp_path / "out"
    cases = [
        (("--storage", str(a_dir)), f"--storage {a_dir}: not a regular file"),
        (("--storage", str(a_file / "j.journal")), f"{a_file} is not a folder"),
        (("--storage", str(tmp_path / "dangling" / "j")), "is a broken symbolic link"),
        (("--cache-dir", str(a_file)), f"--cache-dir {a_file}: {a_file} is not a folder"),
        (("--cache-dir", str(a_file / "sub")), f"{a_file} is not a folder"),
    ]
    before = tree(tmp_path)
    for argv, says in cases:
        err = one_line_exit(capsys, *MODEL, "--output", str(out), *argv)
        assert says in err, err
    # the default journal's folder, from DIRECTKV_CACHE_DIR
    monkeypatch.setenv(cli.CACHE_DIR_ENV, str(a_file / "sub"))
    assert f"journal folder {a_file / 'sub' / 'tune'}: {a_file} is not a folder" in one_line_exit(
        capsys, *MODEL, "--output", str(out))
    monkeypatch.setenv(cli.CACHE_DIR_ENV, str(a_file))
    assert f"DIRECTKV_CACHE_DIR={str(a_file)!r}: {a_file} exists and is not a folder" in one_line_exit(
        capsys, *MODEL, "--output", str(out))
    assert tree(tmp_path) == before  # no journal, no output folder


@pytest.mark.parametrize("text, says", [
    (b"garbage{\n", "line 1 is not JSON"),
    (b'{"op_code": 0}\n\xff\xfe\n', "line 2 is not JSON"),
    (b'{"op_code": 0}\n{"op_co', "line 2 is cut short"),
    (b"[1, 2]\n", "line 1 is not an Optuna journal record"),
])
def test_a_storage_file_that_is_no_journal(capsys, tmp_path, text, says):
    j = tmp_path / "mine.journal"
    j.write_bytes(text)
    err = one_line_exit(capsys, *MODEL, "--output", str(tmp_path / "out"), "--storage", str(j))
    assert f"journal {j}: {says}" in err
    assert j.read_bytes() == text and not (tmp_path / "out").exists()


def test_a_real_journal_is_accepted(capsys, tmp_path):
    j = tmp_path / "mine.journal"
    assert run(capsys, *MODEL, "--storage", str(j))[0] == 0
    assert cli._journal_records_problem(j) is None
    assert run(capsys, *MODEL, "--storage", str(j), "--trials", "3")[0] == 0


def test_show_of_a_fifo_a_folder_or_nothing_never_blocks(tmp_path):
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    for target, says in ((fifo, "not a regular file"), (tmp_path, "a folder"), (tmp_path / "no.yaml", "no such file")):
        proc = subprocess.run([sys.executable, "-m", "directkv_cute.tuning.cli", "show", str(target)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
        assert proc.stdout == ""


def test_load_profile_refuses_a_fifo_without_opening_it_for_good(tmp_path):
    import threading

    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    got = []
    t = threading.Thread(target=lambda: got.append(pytest.raises(P.ProfileError, P.load_profile, fifo)), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # blocked in open(): a writer lets it go
        with open(fifo, "w"):
            pass
        pytest.fail("load_profile blocked on a FIFO")
    assert got and "not a regular file" in str(got[0].value)


def test_an_absurd_bucket_is_refused_before_tuning(capsys, tmp_path):
    from directkv_cute.tuning import tuner as T

    for shape, says in (("64,8,128,100000000000,4096,1", "batch 100000000000 is over the tuner's 65536"),
                        ("64,8,128,1,100000000000,1", "context 100000000000 is over the tuner's 16777216"),
                        ("64,8,128,1,4096,100000000", "q_len 100000000 is over"),
                        ("64,8,128,65536,16777216,1", "pages of 64 tokens, over the op's 2147483647")):
        t0 = time.perf_counter()
        err = one_line_exit(capsys, "run", "--objective", "model", "--shape", shape, "--output", str(tmp_path / "o"))
        assert says in err and time.perf_counter() - t0 < 5
        one_line_exit(capsys, "run", "--dry-run", "--shape", shape)
    assert "batch 65537 is over" in one_line_exit(capsys, "run", "--dry-run", "--preset", "llama3-8b", "--batches",
                                                  str(T.MAX_BATCH + 1))
    assert not (tmp_path / "o").exists()
    # the tuner's API refuses them too, before measuring
    from directkv_cute.tuning.objectives import ModelledObjective
    from directkv_cute.tuning.space import TuneShape

    model = ModelledObjective()
    t = T.Tuner("decode", lambda *a, **k: pytest.fail("measured"), options=T.TuneOptions(progress=False),
                environment=model.environment())
    with pytest.raises(ValueError, match="batch 65537 is over"):
        t.tune([TuneShape(64, 8, 128, T.MAX_BATCH + 1, 4096, 1)])
    t.opt.seed = -1
    with pytest.raises(ValueError, match="seed -1"):
        t.tune([TuneShape(64, 8, 128, 1, 4096, 1)])


def test_the_decode_models_time_does_not_loop_over_waves():
    """The modelled decode time in closed form equals the wave-by-wave sum it replaces (written out
    here), and the largest bucket the tuner takes costs no more to model than a small one."""
    import math as m

    from directkv_cute.config import DecodeConfig
    from directkv_cute.tuning.objectives import ModelledObjective, _chunk_efficiency
    from directkv_cute.tuning.space import TuneShape
    from directkv_cute.tuning import tuner as T

    obj = ModelledObjective()
    hw = obj.hw
    for cfg in (DecodeConfig(tile_n=64, stages=4), DecodeConfig(tile_n=32, stages=2, num_splits=8)):
        for batch in (1, 7, 300, 4096):
            s = TuneShape(64, 8, 128, batch, 4096, 1)
            d, elem = s.head_dim, s.elem_bytes
            splits = cfg.splits_for(s.batch, s.num_kv_heads, s.context, hw.sm_count)
            n_tiles = m.ceil(s.context / cfg.tile_n)
            ctas = splits * s.num_kv_heads * s.batch
            slots = min(cfg.resident_ctas(d, elem), hw.max_threads_per_sm // cfg.num_threads) * hw.sm_count
            tile_bytes = 2 * cfg.tile_n * d * elem
            tokens = min(n_tiles * cfg.tile_n, m.ceil(s.context / s.page_size) * s.page_size)
            cta_bytes = 2 * s.num_kv_heads * s.batch * tokens * d * elem / ctas
            link = hw.link_gbps * 1e3 * _chunk_efficiency(min(s.page_size, cfg.tile_n) * d * elem)
            tile_us = hw.tile_overhead_us + 4 * cfg.rows * cfg.tile_n * d / (hw.sm_tflops * 1e6)
            serial = hw.host_latency_us + cfg.stages * 0.05 + m.ceil(n_tiles / splits) * tile_us
            want, left = 0.0, ctas
            while left > 0:
                active = min(left, slots)
                bw = min(link, min(hw.sm_count, active) * hw.sm_link_gbps * 1e3,
                         active * max(1, cfg.stages - 1) * tile_bytes / hw.host_latency_us)
                want += max(active * cta_bytes / bw, serial)
                left -= active
            want = hw.launch_us + want * (1.0 + hw.l1_penalty * max(0.0, (cfg.carveout - 80) / 20) ** 2)
            if splits > 1:
                want += hw.combine_launch_us + 2 * splits * s.batch * s.num_q_heads * (d + 1) * 4 / (hw.hbm_gbps * 1e3)
            assert obj.model_us(cfg, s) == pytest.approx(want, rel=1e-12), (cfg, batch)
    t0 = time.perf_counter()
    big = TuneShape(64, 8, 128, T.MAX_BATCH, 4096, 1)
    assert T.shape_problem(big) is None and obj.model_us(DecodeConfig(), big) > 0
    assert time.perf_counter() - t0 < 0.5


def test_the_q_tiled_models_bound_brackets_its_schedule():
    """Above ``max_scheduled_ctas`` the Q-tiled model takes list scheduling's bound: never below
    the CTA-by-CTA schedule, at most one CTA above it."""
    import dataclasses

    from directkv_cute.config import QTiledConfig
    from directkv_cute.tuning.objectives import ModelledObjective, QTiledModel
    from directkv_cute.tuning.space import TuneShape
    from directkv_cute.tuning import tuner as T

    cfg = QTiledConfig()
    for s in (TuneShape(32, 8, 128, 4, 32768, 2048), TuneShape(64, 8, 128, 16, 8192, 512)):
        exact = ModelledObjective(kernel="q_tiled")
        bound = ModelledObjective(kernel="q_tiled", q_tiled=dataclasses.replace(QTiledModel(), max_scheduled_ctas=0))
        m = exact.q_tiled
        step, first = m.step_us(cfg, s.head_dim, s.elem_bytes, exact.hw.sm_tflops)
        longest = m.cta_setup_us + first + -(-s.context // cfg.tile_n) * step
        assert exact.q_tiled_us(cfg, s) <= bound.q_tiled_us(cfg, s) <= exact.q_tiled_us(cfg, s) + longest
    t0 = time.perf_counter()
    big = TuneShape(64, 8, 128, T.MAX_BATCH, 65536, 8192)
    assert T.shape_problem(big) is None and ModelledObjective(kernel="q_tiled").q_tiled_us(cfg, big) > 0
    assert time.perf_counter() - t0 < 2


def test_a_run_that_finishes_no_bucket_says_it_wrote_no_profile(capsys, tmp_path, monkeypatch):
    """A time budget used up before the first bucket: no profile is written, and the run says so
    (it printed the path of a file it never wrote)."""
    import itertools
    import types

    from directkv_cute.tuning import tuner as T

    clock = itertools.count(step=1000.0)  # each look at the clock: 1000 s later
    monkeypatch.setattr(T, "time", types.SimpleNamespace(monotonic=lambda: next(clock), perf_counter=time.perf_counter))
    out_dir = tmp_path / "out"
    rc, out, _ = run(capsys, *MODEL, "--output", str(out_dir), "--time-budget", "5")
    want = out_dir / "Modelled_H200_PCIe5.yaml"
    assert rc == 0 and "skipped (time budget used up)" in out and not want.exists()
    assert f"profile: not written (no bucket finished; {want} is unchanged)" in out and f"profile: {want}" not in out
    assert "1 bucket(s) not reached within the time budget" in out


def test_a_bad_variable_stops_the_cli_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIRECTKV_STAGE_OVERLAP", "of")
    err = one_line_exit(capsys, *MODEL, "--output", str(tmp_path / "out"))
    assert err.startswith("directkv-tune: DIRECTKV_STAGE_OVERLAP='of': not a flag value")
    assert not (tmp_path / "out").exists() and not list((tmp_path / "cache").iterdir())
    monkeypatch.delenv("DIRECTKV_STAGE_OVERLAP")
    monkeypatch.setenv("DIRECTKV_REQUIRE_PROFILE", "exactly")
    assert "DIRECTKV_REQUIRE_PROFILE='exactly'" in one_line_exit(capsys, "lookup", "--gpu", GPU, "--shape",
                                                                  "64,8,128,1,4096,1")
    monkeypatch.delenv("DIRECTKV_REQUIRE_PROFILE")
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "a_file"))
    for argv in (("show",), ("check",), ("lookup", "--gpu", GPU, "--shape", "64,8,128,1,4096,1")):
        assert "DIRECTKV_PROFILE_DIR=" in one_line_exit(capsys, *argv)


def test_a_bad_variable_ends_the_run_not_the_config():
    """A measurement that meets a bad variable stops the tuner (every config would fail alike);
    it is never recorded as that config's failure."""
    from directkv_cute.env import EnvironmentVariableError
    from directkv_cute.tuning.objectives import ModelledObjective
    from directkv_cute.tuning.space import TuneShape
    from directkv_cute.tuning.tuner import TuneOptions, Tuner

    def measure(cfg, shape, **kw):
        raise EnvironmentVariableError("DIRECTKV_STAGE_OVERLAP", "of", "not a flag value", "1/0")

    measure.environment = ModelledObjective().environment
    t = Tuner("decode", measure, options=TuneOptions(n_trials=3, progress=False))
    with pytest.raises(EnvironmentVariableError, match="DIRECTKV_STAGE_OVERLAP"):
        t.tune([TuneShape(64, 8, 128, 1, 4096, 1)])


# ---- numbers a profile cannot hold -------------------------------------------------------------


def _with_number(tmp_path, where, value):
    """A valid profile file with one field replaced by the YAML scalar ``value``."""
    path = write_profile(tmp_path / "env")
    text = path.read_text()
    import re

    new, n = re.subn(rf"(\b{where}: )[^,}}\n]+", lambda m: m.group(1) + value, text, count=1)
    assert n == 1, where
    path.write_text(new)
    return path


@pytest.mark.parametrize("where, value, says", [
    ("p50_us", "9" * 400, "p50_us: must be a finite number, got an integer of 400 digits"),
    ("default_p50_us", "-" + "9" * 400, "default_p50_us: must be a finite number, got an integer of 400 digits"),
    ("p50_us", "1.0e+400", "p50_us: must be a finite number, got float inf"),
    ("p50_us", ".nan", "p50_us: must be a finite number, got float nan"),
    ("trials", "9" * 400, "trials: must be an integer of at most"),
    ("batch", str(2**63), "batch: must be an integer of at most"),
    ("tile_n", "9" * 400, "config.tile_n: must be an integer of at most"),
    ("sm_count", "9" * 400, "metadata.sm_count: must be an integer of at most"),
    ("head_dim", "9" * 400, "head_dim: must be an integer of at most"),
    ("p50_us", "9" * 5000, "corrupt YAML"),  # past Python's int conversion limit
])
def test_a_number_no_profile_holds_is_a_clear_error(capsys, tmp_path, monkeypatch, where, value, says):
    path = _with_number(tmp_path, where, value)
    with pytest.raises(P.ProfileError) as ei:
        P.load_profile(path)
    assert str(path) in str(ei.value) and says in str(ei.value) and len(str(ei.value)) < 1000
    # check: INVALID with the file and the key; show FILE: one line, 2; show: one line, 1; run: one line, 2
    rc, out, err = run(capsys, "check", "--dir", str(path.parent))
    assert rc == 1 and f"INVALID {path}" in out and says in out and "Traceback" not in out + err
    err = one_line_exit(capsys, "show", str(path))
    assert str(path) in err and says in err
    rc, out, err = run(capsys, "show", "--dir", str(path.parent))
    assert rc == 1 and err.count("\n") == 1 and says in err and out == ""
    prof = make_profile()
    env = {**prof.metadata, "host_link_gbps": None, "hbm_gbps": None}
    from directkv_cute.tuning.objectives import ModelledObjective

    class Named(ModelledObjective):
        def environment(self):
            return env

    monkeypatch.setattr(cli, "_make_objective", lambda a: Named())  # tunes for the profile's GPU
    err = one_line_exit(capsys, *MODEL, "--output", str(path.parent))
    assert "cannot be merged" in err and says in err and not list((tmp_path / "cache").iterdir())
    # the op's lookup: a warning and the default, as for any unusable profile
    L.clear_cache()
    with pytest.warns(P.ProfileWarning, match="ignoring"):
        assert ask() == (DEFAULT, "default")
