"""Tuned-config lookup: exact -> nearest bucket -> default, foreign and stale entries, REQUIRE_PROFILE,
cost."""

import subprocess
import sys
import time
import warnings

import pytest
import torch

from directkv_cute.config import DecodeConfig, default_decode_config
from directkv_cute.tuning import lookup as L
from directkv_cute.tuning import profiles as P

GPU = "Test GPU H200"  # a name no bundled profile will ever have
KH = P.current_kernel_hash("decode")
STALE = "0" * 64
CLASS = ("decode", "bf16", 128, 8, 64)
CFG = {
    (1, 4096, 1): DecodeConfig(tile_n=32, stages=2),
    (1, 32768, 1): DecodeConfig(tile_n=64, stages=3),
    (16, 4096, 1): DecodeConfig(tile_n=128, stages=2, carveout=100),
    (64, 4096, 1): DecodeConfig(tile_n=64, stages=4, num_splits=4),
}
DEFAULT = default_decode_config(128, 8, 64)


def env(gpu=GPU):
    return {"gpu_name": gpu, "compute_capability": "9.0", "sm_count": 132, "smem_optin_bytes": 232448}


def write_profile(d, *, gpu=GPU, kh=KH, entries=CFG, file_gpu=None, cls=CLASS, hashes=None):
    """A profile of ``entries``, each tuned for kernel sources ``kh`` (or ``hashes[bucket]``)."""
    prof = P.Profile(metadata=P.make_metadata(env(gpu), objective="gpu"))
    for bk, cfg in entries.items():
        prof.set(cls, bk, {"config": cfg.to_dict(), "p50_us": 10.0, "default_p50_us": 11.0, "trials": 5,
                           "kernel_hash": (hashes or {}).get(bk, kh)})
    path = d / P.profile_filename(file_gpu or gpu)
    P.save_profile(prof, path, merge=False)
    return path


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.delenv(L.REQUIRE_ENV, raising=False)
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path))
    L.clear_cache()
    yield
    L.clear_cache()


def ask(batch=1, context=4096, q_len=1, *, gpu=GPU, kh=KH, page_size=64, group=8, dtype=torch.bfloat16, rows=None):
    return L.select_config("decode", gpu_name=gpu, kernel_hash=kh, dtype=dtype, head_dim=128, group=group,
                           page_size=page_size, batch=batch, context=context, q_len=q_len,
                           rows=rows if rows is not None else group * q_len)


def test_exact(tmp_path):
    write_profile(tmp_path)
    for bk, cfg in CFG.items():
        assert ask(*bk) == (cfg, "exact")
    assert ask(1, 4096, 1, dtype="bf16") == (CFG[1, 4096, 1], "exact")


@pytest.mark.parametrize(
    "batch, context, want",
    [
        (1, 11000, (1, 4096, 1)),  # below the geometric midpoint sqrt(4096 * 32768) = 11585
        (1, 12000, (1, 32768, 1)),
        (1, 11585, (1, 4096, 1)),  # a tie goes to the smaller context
        (1, 1000, (1, 4096, 1)),
        (1, 500000, (1, 32768, 1)),
        (2, 4096, (1, 4096, 1)),  # nearest batch in log2: 1 (1 away) not 16 (3 away)
        (4, 32768, (1, 32768, 1)),  # 4 is 2 from 1 and 2 from 16: the smaller batch, then its context
        (8, 4096, (16, 4096, 1)),
        (8, 100000, (16, 4096, 1)),  # batch first, then the nearest context that batch has
        (40, 4096, (64, 4096, 1)),
    ],
)
def test_nearest_rule(tmp_path, batch, context, want):
    write_profile(tmp_path)
    cfg, source = ask(batch, context)
    assert source == "nearest"
    assert cfg == CFG[want]
    dec = L.explain_config("decode", gpu_name=GPU, kernel_hash=KH, dtype="bf16", head_dim=128, group=8,
                           page_size=64, batch=batch, context=context, q_len=1, rows=8)
    assert dec.bucket == want and dec.source == "nearest"


def test_nearest_checks_legality_for_the_actual_rows(tmp_path):
    write_profile(tmp_path)
    # q_len 16: 128 rows need two consumer warpgroups; every tuned config has one -> default
    with pytest.warns(P.ProfileWarning, match="no tuned config of this class is legal"):
        cfg, source = ask(1, 4096, q_len=16)
    assert source == "default" and cfg == default_decode_config(128, 128, 64) and cfg.consumer_wgs == 2
    # q_len 4: 32 rows, one warpgroup: the q_len-1 buckets serve it
    assert ask(1, 4096, q_len=4) == (CFG[1, 4096, 1], "nearest")


def test_default_warns_once_with_path_and_command(tmp_path):
    write_profile(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg, source = ask(page_size=16)
        again = ask(page_size=16)
        ask(page_size=16, context=9999)  # same key but the context: no second warning
    assert (cfg, source) == (default_decode_config(128, 8, 16), "default") and again == (cfg, source)
    msgs = [str(x.message) for x in w if issubclass(x.category, P.ProfileWarning)]
    assert len(msgs) == 1
    assert str(tmp_path / "Test_GPU_H200.yaml") in msgs[0]
    assert "directkv-tune run" in msgs[0] and "page_size=16" in msgs[0]


def test_missing_profile_gives_default(tmp_path):
    with pytest.warns(P.ProfileWarning, match="no profile file Test_GPU_H200.yaml"):
        assert ask() == (DEFAULT, "default")


def test_foreign_gpu_is_not_used(tmp_path):
    # a file named for this GPU but written for another one
    write_profile(tmp_path, gpu="NVIDIA H100", file_gpu=GPU)
    with pytest.warns(P.ProfileWarning, match="gpu_name"):
        assert ask() == (DEFAULT, "default")
    L.clear_cache()
    write_profile(tmp_path)
    with pytest.warns(P.ProfileWarning, match="Other_GPU.yaml"):
        assert ask(gpu="Other GPU")[1] == "default"
    assert ask()[1] == "exact"


def _profile_warnings(w):
    return [str(x.message) for x in w if issubclass(x.category, P.ProfileWarning)]


def test_stale_entry_is_used_with_one_warning_per_kernel(tmp_path):
    """Entries tuned for other kernel sources serve exact and nearest lookups while legal; the
    first use warns once for the kernel, naming the re-tune command."""
    write_profile(tmp_path, kh=STALE)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert ask() == (CFG[1, 4096, 1], "exact")
        assert ask(1, 32768) == (CFG[1, 32768, 1], "exact")
        assert ask(8, 4096) == (CFG[16, 4096, 1], "nearest")
    msgs = _profile_warnings(w)
    assert len(msgs) == 1, msgs
    assert "tuned for other decode kernel sources" in msgs[0] and STALE[:12] in msgs[0] and KH[:12] in msgs[0]
    assert "directkv-tune run --kernel decode" in msgs[0] and str(tmp_path / "Test_GPU_H200.yaml") in msgs[0]
    assert w[0].filename == __file__  # attributed to the caller

    multi = DecodeConfig(tile_n=64, stages=3, consumer_wgs=2, carveout=90, ctas_per_sm=1, chunk_tiles=2)
    prof = P.load_profile(tmp_path / "Test_GPU_H200.yaml")
    prof.set(("multi_token", "bf16", 128, 8, 64), (1, 4096, 64),
             {"config": multi.to_dict(), "p50_us": 10.0, "default_p50_us": 11.0, "trials": 5, "kernel_hash": STALE})
    P.save_profile(prof)
    L.clear_cache()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = L.select_config("multi_token", gpu_name=GPU, kernel_hash=P.current_kernel_hash("multi_token"),
                              dtype="bf16", head_dim=128, group=8, page_size=64, batch=1, context=4096, q_len=64,
                              rows=8 * 64)
        assert ask()[1] == "exact"
    assert got == (multi, "exact")
    msgs = _profile_warnings(w)
    assert len(msgs) == 2 and "multi_token" in msgs[0] and "--kernel multi_token" in msgs[0] and "decode" in msgs[1]


def test_current_entries_do_not_warn(tmp_path):
    write_profile(tmp_path, hashes={(1, 32768, 1): STALE})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ask() == (CFG[1, 4096, 1], "exact")
    with pytest.warns(P.ProfileWarning, match="tuned for other decode kernel sources"):
        assert ask(1, 32768) == (CFG[1, 32768, 1], "exact")


def test_stale_entry_illegal_under_the_current_rules_is_refused(tmp_path, monkeypatch):
    """A stale entry whose config the current rules reject (here: a smaller per-block SMEM limit)
    is never used: the nearest legal bucket serves the launch, else the default."""
    import directkv_cute.config as C

    big = DecodeConfig(tile_n=64, stages=4)
    assert not big.problems(128, 64)
    small = DecodeConfig(tile_n=64, stages=2, carveout=90)
    write_profile(tmp_path, kh=STALE, entries={(1, 4096, 1): big, (1, 32768, 1): small})
    limit = small.smem_bytes(128) + 1
    monkeypatch.setattr(C, "SM90_SMEM_PER_BLOCK_OPTIN", limit)
    assert big.problems(128, 64) and not small.problems(128, 64)
    with pytest.warns(P.ProfileWarning, match="tuned for other decode kernel sources"):
        assert ask(1, 4096) == (small, "nearest")  # the illegal exact bucket is skipped
    L.clear_cache()
    write_profile(tmp_path, kh=STALE, entries={(1, 4096, 1): big})
    with pytest.warns(P.ProfileWarning, match="no tuned config of this class is legal"):
        cfg, source = ask(1, 4096)
    assert source == "default" and cfg != big


def test_other_class_is_never_borrowed(tmp_path):
    write_profile(tmp_path)
    for kw in ({"group": 4}, {"page_size": 32}, {"dtype": torch.float16}):
        with pytest.warns(P.ProfileWarning, match="no decode entry"):
            assert ask(**kw)[1] == "default"


def test_corrupt_profile_warns_and_falls_back(tmp_path, monkeypatch):
    (tmp_path / "Test_GPU_H200.yaml").write_text("schema_version: 1\nmetadata: [")
    with pytest.warns(P.ProfileWarning, match="corrupt YAML"):
        assert ask() == (DEFAULT, "default")
    L.clear_cache()
    monkeypatch.setenv(L.REQUIRE_ENV, "1")
    with pytest.warns(P.ProfileWarning), pytest.raises(L.ProfileMissError, match="corrupt YAML"):
        ask()


def test_require_profile_shows_the_key_diff(tmp_path, monkeypatch):
    write_profile(tmp_path)
    monkeypatch.setenv(L.REQUIRE_ENV, "1")
    assert ask()[1] == "exact"
    assert ask(1, 20000)[1] == "nearest"  # "1": only a fall-through to the default is an error
    with pytest.raises(L.ProfileMissError) as ei:
        ask(page_size=16)
    msg = str(ei.value)
    assert "DIRECTKV_REQUIRE_PROFILE" in msg and str(tmp_path / "Test_GPU_H200.yaml") in msg
    line = next(x for x in msg.splitlines() if "page_size" in x and "asked" in x)
    assert line.strip().startswith("!=") and "asked 16" in line and "nearest entry 64" in line
    same = next(x for x in msg.splitlines() if " head_dim " in x)
    assert not same.strip().startswith("!=")

    monkeypatch.setenv(L.REQUIRE_ENV, "exact")
    assert ask()[1] == "exact"
    with pytest.raises(L.ProfileMissError) as ei:
        ask(1, 20000)
    lines = str(ei.value).splitlines()
    ctx = next(x for x in lines if " context " in x)
    assert ctx.strip().startswith("!=") and "asked 20000" in ctx and "nearest entry 32768" in ctx

    monkeypatch.setenv(L.REQUIRE_ENV, "0")
    with pytest.warns(P.ProfileWarning) as rec:
        assert ask(page_size=16)[1] == "default"
    assert rec[0].filename == __file__  # attributed to the caller, not to the lookup module


def test_require_profile_without_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv(L.REQUIRE_ENV, "1")
    with pytest.raises(L.ProfileMissError, match="no profile file"):
        ask()


def test_env_dir_then_bundled(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    write_profile(other, entries={(1, 4096, 1): DecodeConfig(tile_n=128, stages=2)})
    monkeypatch.setattr(P, "bundled_profile_dir", lambda: other)
    assert ask() == (DecodeConfig(tile_n=128, stages=2), "exact")  # nothing in the env dir: bundled one
    L.clear_cache()
    write_profile(tmp_path)
    assert ask() == (CFG[1, 4096, 1], "exact")  # the env dir wins


def test_profile_change_seen_after_clear_cache(tmp_path):
    write_profile(tmp_path)
    assert ask()[0] == CFG[1, 4096, 1]
    write_profile(tmp_path, entries={(1, 4096, 1): DecodeConfig(tile_n=64, stages=2)})
    L.clear_cache()
    assert ask()[0] == DecodeConfig(tile_n=64, stages=2)


def test_multi_token_kernel_lookup(tmp_path):
    from directkv_cute.config import default_multi_token_config

    def pre(**kw):
        return L.select_config("multi_token", gpu_name=GPU, kernel_hash=KH, dtype=torch.bfloat16, head_dim=128, group=8,
                               page_size=64, batch=1, context=4096, rows=8 * 64, **kw)

    with pytest.warns(P.ProfileWarning, match="no tuned multi_token config"):
        assert pre(q_len=64) == (default_multi_token_config(128, 8 * 64), "default")
    L.clear_cache()
    tuned = DecodeConfig(tile_n=64, stages=3, consumer_wgs=2, carveout=90, ctas_per_sm=1, chunk_tiles=2)
    write_profile(tmp_path, entries={(1, 4096, 64): tuned}, cls=("multi_token", "bf16", 128, 8, 64))
    assert pre(q_len=64) == (tuned, "exact")
    assert pre(q_len=128) == (tuned, "nearest")


def test_a_missing_class_is_warned_once_for_all_its_shapes(tmp_path):
    """A server meets one untuned class at every batch and chunk length: one warning names the
    first shape; another page size is another class and warns again; a quiet lookup says
    nothing and leaves the warning for the first loud one, of its own shape too."""
    def pre(q_len, batch=1, page_size=64, quiet=False):
        return L.select_config("multi_token", gpu_name=GPU, kernel_hash=KH, dtype=torch.bfloat16, head_dim=128,
                               group=8, page_size=page_size, batch=batch, context=4096, q_len=q_len,
                               rows=8 * q_len, quiet=quiet)

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert pre(64, quiet=True)[1] == "default"
        assert pre(32, quiet=True)[1] == "default"  # the loud lookup of this shape below still warns
        for q_len, batch in ((32, 1), (48, 2), (16, 3)):
            assert pre(q_len, batch)[1] == "default"
        assert pre(32, page_size=16)[1] == "default"
    msgs = [str(x.message) for x in w if issubclass(x.category, P.ProfileWarning)]
    assert len(msgs) == 2, msgs
    assert "page_size=64; first at batch=1 q_len=32" in msgs[0] and "not warned again" in msgs[0]
    assert "page_size=16; first at batch=1 q_len=32" in msgs[1]


def test_repeated_lookup_is_cheap(tmp_path):
    write_profile(tmp_path)
    ask(3, 9000)
    n = 10_000
    t0 = time.perf_counter()
    for _ in range(n):
        ask(3, 9000)
    mean_us = (time.perf_counter() - t0) / n * 1e6
    assert mean_us < 20, f"cached lookup took {mean_us:.1f} us"


def test_import_is_light():
    code = ("import sys, directkv_cute.tuning as t; t.select_config; "
            "print(sorted(m for m in ('optuna', 'torch', 'cutlass') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_a_bucket_that_kept_the_default_lends_the_default_for_the_launchs_rows(tmp_path):
    """Where the tuner kept the heuristic default, a nearby launch gets the default for *its*
    query rows (the default's row thresholds were measured), not the bucket's config: a q_len
    8192 launch next to a q_len 2048 bucket (clusters of two) runs the q 8192 default (chunks of
    6, no clusters). A bucket that found something better is still borrowed as it is."""
    from directkv_cute.config import MULTI_TOKEN_CHUNK4_ROWS, default_multi_token_config

    group = 4

    def pre(q_len, context=32768):
        return L.select_config("multi_token", gpu_name=GPU, kernel_hash=KH, dtype=torch.bfloat16, head_dim=128,
                               group=group, page_size=64, batch=1, context=context, q_len=q_len, rows=group * q_len)

    kept = default_multi_token_config(128, group * 2048)
    tuned = DecodeConfig(tile_n=64, stages=6, consumer_wgs=2, carveout=100, ctas_per_sm=1, chunk_tiles=5,
                         max_inflight=1, link_credits=16)
    assert kept.q_cluster == 2 and tuned != default_multi_token_config(128, group * 2048)
    write_profile(tmp_path, entries={(1, 32768, 2048): kept, (1, 131072, 2048): tuned},
                  cls=("multi_token", "bf16", 128, group, 64))
    assert pre(2048) == (kept, "exact")
    far = default_multi_token_config(128, group * 8192)
    assert group * 8192 > MULTI_TOKEN_CHUNK4_ROWS and far.q_cluster == 0 and far.chunk_tiles == 6
    assert pre(8192) == (far, "nearest")
    dec = L.explain_config("multi_token", gpu_name=GPU, kernel_hash=KH, dtype="bf16", head_dim=128, group=group,
                           page_size=64, batch=1, context=32768, q_len=8192, rows=group * 8192)
    assert dec.bucket == (1, 32768, 2048) and "kept the default" in dec.reason
    assert pre(8192, context=131072) == (tuned, "nearest")  # the tuned bucket's config, borrowed as is


def test_q_tiled_kernel_lookup(tmp_path):
    """The Q-tiled kernel's entries: exact, nearest (q_len, then batch, then context), a bucket that
    kept the default lends the default, other classes are never borrowed, the default otherwise;
    stale entries are used with the q_tiled re-tune command."""
    from directkv_cute.config import QTiledConfig

    kh = P.current_kernel_hash("q_tiled")
    assert kh not in (KH, P.current_kernel_hash("multi_token"))

    def q_tiled(q_len, context=32768, batch=1, group=4, page_size=64, kh=kh):
        return L.select_config("q_tiled", gpu_name=GPU, kernel_hash=kh, dtype=torch.bfloat16, head_dim=128,
                               group=group, page_size=page_size, batch=batch, context=context, q_len=q_len,
                               rows=group * q_len)

    with pytest.warns(P.ProfileWarning, match="no tuned q_tiled config"):
        assert q_tiled(2048) == (QTiledConfig(), "default")
    L.clear_cache()
    small_tiles = QTiledConfig(tile_n=64, stages=2)
    small = QTiledConfig(tile_n=64, stages=4, pingpong=0)
    write_profile(tmp_path, cls=("q_tiled", "bf16", 128, 4, 64), kh=kh,
                  entries={(1, 32768, 2048): small_tiles, (1, 8192, 512): small, (1, 131072, 8192): QTiledConfig()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert q_tiled(2048) == (small_tiles, "exact")
        assert q_tiled(512, 8192) == (small, "exact")
        assert q_tiled(3000, 20000) == (small_tiles, "nearest")
        assert q_tiled(600, 131072, batch=2) == (small, "nearest")  # q_len first: the 512 bucket
        assert q_tiled(8192, 8192) == (QTiledConfig(), "nearest")  # kept the default: the default
    for kw in ({"group": 8}, {"page_size": 16}):
        with pytest.warns(P.ProfileWarning, match="no q_tiled entry"):
            assert q_tiled(2048, **kw) == (QTiledConfig(), "default")
    L.clear_cache()
    write_profile(tmp_path, cls=("q_tiled", "bf16", 128, 4, 64), kh=STALE, entries={(1, 32768, 2048): small_tiles})
    with pytest.warns(P.ProfileWarning, match="tuned for other q_tiled kernel sources.*--kernel q_tiled"):
        assert q_tiled(2048) == (small_tiles, "exact")


def test_a_q_tiled_entry_the_kernel_cannot_run_is_never_used(tmp_path, monkeypatch):
    """Entries are checked against the kernel's current rules (its spec): a legal one in the file
    that the rules now refuse (a smaller SMEM limit) falls through to the nearest legal, then the
    default."""
    import directkv_cute.config as C
    from directkv_cute.config import QTiledConfig

    kh = P.current_kernel_hash("q_tiled")
    deep, shallow = QTiledConfig(), QTiledConfig(tile_n=64, stages=2)
    write_profile(tmp_path, cls=("q_tiled", "bf16", 128, 4, 64), kh=kh,
                  entries={(1, 32768, 2048): deep, (1, 32768, 512): shallow})
    monkeypatch.setattr(C, "SM90_SMEM_PER_BLOCK_OPTIN", 160 * 1024)
    assert deep.problems(128, 64) and not shallow.problems(128, 64)
    got = L.select_config("q_tiled", gpu_name=GPU, kernel_hash=kh, dtype="bf16", head_dim=128, group=4, page_size=64,
                          batch=1, context=32768, q_len=2048, rows=4 * 2048)
    assert got == (shallow, "nearest")
