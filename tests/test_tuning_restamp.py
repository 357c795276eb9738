"""Shipped profiles carry their kernels' current hashes; ``directkv-tune restamp`` re-stamps stale
entries only after a PTX comparison (tuning/restamp.py).

The restamp logic runs on a small git repository made here (the kernels' real source files,
then a comment-only commit and a code commit) with the compile step injected: a fake "PTX" made
of the compiled kernel's source lines without comments. One test compiles for real (the split
combine, from an extracted ``git archive`` of this checkout and from the working tree)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.kernels import sources
from directkv_cute.machine import H200
from directkv_cute.tuning import cli
from directkv_cute.tuning import profiles as P
from directkv_cute.tuning import restamp as R

ROOT = Path(__file__).resolve().parent.parent
GPU = "Test GPU H200"


# ---- the shipped profiles --------------------------------------------------------------------------


def test_shipped_profiles_carry_the_current_kernel_hashes():
    """Every entry of every shipped profile was tuned for (or re-stamped to) the sources of its
    kernel as they are now: an edit of a kernel's files that leaves a shipped profile stale makes
    every lookup of that kernel warn, so it fails here instead of silently."""
    paths = P.list_profiles(ROOT / "profiles")
    assert paths, "no shipped profiles in profiles/"
    stale, kernels = [], set()
    for path in paths:
        prof = P.load_profile(path)
        for ck, bk, rec in prof.records():
            if ck[0] in sources.tuned_kernels() and rec["kernel_hash"] != P.current_kernel_hash(ck[0]):
                stale.append(f"{path.name} {ck} {bk}: {P.entry_hash_problem(ck[0], rec)}")
                kernels.add(ck[0])
    assert not stale, (
        f"{len(stale)} shipped profile bucket(s) tuned for other kernel sources (kernels {', '.join(sorted(kernels))}), e.g.\n  "
        + "\n  ".join(stale[:5])
        + "\nIf the kernels' code did not change, run `directkv-tune restamp` (it re-stamps a family only where "
          "the PTX compiled from the tuned sources and from these is identical) and commit the profile; "
          "otherwise re-tune them on the GPU (directkv-tune run --kernel KERNEL ...).")


# ---- a small git repository of the kernels' sources -------------------------------------------------

FILES = sorted({f for k in sources.tuned_kernels() for f in sources.launch_files(k)})
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **GIT_ENV}, check=True,
                          capture_output=True, text=True).stdout.strip()


def commit(repo, msg) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    """A git repository with directkv_cute/ holding the tuned kernels' source files. Commits:
    ``a`` (the real files), ``b`` (a comment added to kernels/helpers.py: every family's hash
    changes, no code does), ``c`` (a line of code added to kernels/q_tiled.py)."""
    root = tmp_path / "repo"
    pkg = root / "directkv_cute"
    for rel in FILES:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sources.PACKAGE_DIR / rel, pkg / rel)
    git(root, "init", "-q")
    revs = {"a": commit(root, "a")}
    with open(pkg / "kernels/helpers.py", "a") as f:
        f.write("# a comment: no code\n")
    revs["b"] = commit(root, "b: comment")
    with open(pkg / "kernels/q_tiled.py", "a") as f:
        f.write("RESTAMP_TEST_CODE = 1\n")
    revs["c"] = commit(root, "c: code")
    return pkg, revs


def fake_ptx(tree: Path, job: R.Job) -> str:
    """A stand-in for the PTX of ``job`` compiled from ``tree``: its label and the code lines (no
    comments) of the files that generate it."""
    part = job.part
    lines = [job.label()]
    for rel in sorted(sources.code_files(part)):
        p = Path(tree) / "directkv_cute" / rel
        if p.exists():
            lines += [ln for ln in p.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return "\n".join(lines)


def fake_compile(calls=None, fail_in=None):
    def compile_fn(tree, jobs, workdir, families=()):
        if calls is not None:
            calls.append((Path(tree), list(jobs)))
        out = R.Compiled()
        for i, job in enumerate(jobs):
            if fail_in and fail_in in str(tree) and job.part != "combine":
                out.errors[i] = "TypeError: an old API"
            else:
                out.ptx[i] = fake_ptx(tree, job)
        return out

    return compile_fn


def hash_at(pkg, rev, kernel, tmp) -> str:
    """The family's hash at ``rev``, from a checkout of it (an independent way to get it)."""
    wt = tmp / f"wt-{rev[:8]}"
    if not wt.exists():
        git(pkg.parent, "worktree", "add", "-q", "--detach", str(wt), rev)
    return sources.kernel_hash(kernel, root=wt / "directkv_cute")


DECODE = ("decode", "bf16", 128, 4, 64)
MULTI = ("multi_token", "bf16", 128, 4, 64)
QT = [("q_tiled", "bf16", 128, g, p) for g in (4, 8) for p in (16, 64)]


def write_profile(path, hashes) -> Path:
    """A profile with decode, multi_token and q_tiled entries tuned for ``hashes[kernel]``."""
    prof = P.Profile(metadata=P.make_metadata({"gpu_name": GPU, "compute_capability": "9.0", "sm_count": 132,
                                               "smem_optin_bytes": 232448}, objective="gpu"),
                     machine=H200.to_dict())
    rec = lambda cfg, k: {"config": cfg.to_dict(), "p50_us": 10.0, "default_p50_us": 12.0, "trials": 3,  # noqa: E731
                          "kernel_hash": hashes[k], "seed": 0}
    for b in (1, 4, 16):
        prof.set(DECODE, (b, 4096, 1), rec(DecodeConfig(tile_n=64, stages=5, ctas_per_sm=b % 3 + 1), "decode"))
    multi = DecodeConfig(tile_n=64, stages=7, carveout=100, consumer_wgs=2, chunk_tiles=4, max_inflight=1)
    prof.set(MULTI, (1, 8192, 512), rec(multi, "multi_token"))
    for ck in QT:
        prof.set(ck, (1, 8192, 2048), rec(QTiledConfig(tile_n=128, stages=3), "q_tiled"))
        prof.set(ck, (1, 32768, 2048), rec(QTiledConfig(tile_n=64, stages=4), "q_tiled"))
    P.save_profile(prof, path, merge=False)
    return path


def restamper(pkg, tmp, **kw):
    kw.setdefault("compile_fn", fake_compile())
    return R.Restamper(package_dir=pkg, workdir=tmp / "work", **kw)


def run_restamp(path, rs, capsys, **kw):
    rc = R.restamp_profile(path, restamper=rs, **kw)
    return rc, capsys.readouterr().out


@pytest.fixture
def setup(repo, tmp_path):
    """The repository, a profile whose decode and q_tiled entries were tuned at ``a`` and whose
    multi_token entry is current, and the hashes."""
    pkg, revs = repo
    old = {k: hash_at(pkg, revs["a"], k, tmp_path) for k in ("decode", "q_tiled")}
    now = {k: sources.kernel_hash(k, root=pkg) for k in ("decode", "multi_token", "q_tiled")}
    assert old["decode"] != now["decode"] and old["q_tiled"] != now["q_tiled"]
    path = write_profile(tmp_path / "prof" / P.profile_filename(GPU), {**old, "multi_token": now["multi_token"]})
    return pkg, revs, path, old, now


# ---- finding the tuned sources ------------------------------------------------------------------


def test_the_hash_at_a_revision_is_kernel_hash_of_its_files(repo, tmp_path):
    pkg, revs = repo
    sh = R.SourceHashes(R.Git(pkg), tmp_path / "scratch")
    for rev in revs.values():
        for kernel in ("decode", "q_tiled"):
            assert sh.at(rev, kernel) == hash_at(pkg, rev, kernel, tmp_path)
    assert sh.at(revs["c"], "multi_token") == sources.kernel_hash("multi_token", root=pkg)


def test_the_walk_finds_the_newest_commit_with_the_recorded_hash(repo, tmp_path):
    pkg, revs = repo
    sh = R.SourceHashes(R.Git(pkg), tmp_path / "scratch")
    want = hash_at(pkg, revs["a"], "decode", tmp_path)
    assert sh.find("decode", want) == (revs["a"], 2)  # b, then a (c touched no decode file)
    assert sh.find("q_tiled", hash_at(pkg, revs["a"], "q_tiled", tmp_path)) == (revs["a"], 3)
    assert sh.find("decode", "0" * 64) == (None, 2)


def test_git_refuses_what_is_no_checkout_and_no_commit(repo, tmp_path):
    pkg, _revs = repo
    (tmp_path / "plain" / "directkv_cute").mkdir(parents=True)
    with pytest.raises(R.RestampError, match="not in a git checkout"):
        R.Git(tmp_path / "plain" / "directkv_cute")
    with pytest.raises(R.RestampError, match="--against nope: not a commit"):
        R.Git(pkg).commit("nope")


# ---- the sample -----------------------------------------------------------------------------------


def test_the_sample_holds_one_kernel_per_compile_key_in_every_launched_form(setup):
    _pkg, _revs, path, _old, _now = setup
    prof = P.load_profile(path)
    recs = lambda k: [r for r in prof.records() if r[0][0] == k]  # noqa: E731
    decode = R.sample_jobs("decode", recs("decode"))
    # three buckets whose configs differ only in ctas_per_sm (a launch field): one kernel, with
    # and without split partials, and the combine
    assert [(j.part, dict(j.options).get("split_out")) for j in decode] == [
        ("decode", True), ("decode", False), ("combine", None)]
    multi = R.sample_jobs("multi_token", recs("multi_token"))
    assert [j.part for j in multi] == ["multi_token", "combine"]
    qt = R.sample_jobs("q_tiled", recs("q_tiled"))
    assert len(qt) == 8 * 3 and all(j.part == "q_tiled" for j in qt)  # 8 keys x the 3 variants, no combine
    forms = {(dict(j.options)["wait_ready"], dict(j.options)["fold"]) for j in qt}
    assert forms == {(False, False), (True, True), (True, False)}
    assert "[staged-fold]" in {j.label()[-13:] for j in qt}


def test_a_large_family_is_sampled_covering_every_group_page_and_config(setup):
    _pkg, _revs, path, _old, _now = setup
    prof = P.load_profile(path)
    qt = R.sample_jobs("q_tiled", [r for r in prof.records() if r[0][0] == "q_tiled"], limit=3)
    keys = {(j.group, j.page_size, dict(j.config)["tile_n"]) for j in qt}
    assert len(keys) == 3
    assert {g for g, _p, _t in keys} == {4, 8} and {p for _g, p, _t in keys} == {16, 64}
    assert {t for _g, _p, t in keys} == {64, 128}
    assert R.sample_jobs("q_tiled", [r for r in prof.records() if r[0][0] == "q_tiled"], limit=3) == qt


def test_normalisation_replaces_only_the_source_trees_paths():
    ptx = "// /tmp/x/src-abc/directkv_cute/kernels/q_tiled.py\n\tmov.u32 %r1, 7;\n.file 1 \"/work/m/directkv_cute/a.py\"\n"
    got = R.normalize_ptx(ptx, ["/tmp/x/src-abc", "/tmp/x/src-abc/directkv_cute", "/work/m"])
    assert got == "// <src>/kernels/q_tiled.py\n\tmov.u32 %r1, 7;\n.file 1 \"<src>/directkv_cute/a.py\"\n"
    assert R.normalize_ptx(ptx) == ptx


# ---- the command ----------------------------------------------------------------------------------


def test_restamp_writes_only_the_families_whose_ptx_is_identical(setup, tmp_path, capsys):
    pkg, revs, path, old, now = setup
    before = P.load_profile(path)
    calls = []
    rs = restamper(pkg, tmp_path, compile_fn=fake_compile(calls))
    rc, out = run_restamp(path, rs, capsys)
    assert rc == 1, out  # q_tiled stays stale
    lines = out.splitlines()
    assert len(lines) == 4, out  # the file, then one line per family
    dec = next(ln for ln in lines if ln.startswith("decode: "))
    assert f"tuned for {old['decode'][:12]} = {revs['a'][:12]}" in dec and "git log, 2 commit(s)" in dec
    assert "PTX of 3 kernel(s) identical; re-stamped to " + now["decode"][:12] in dec
    qt = next(ln for ln in lines if ln.startswith("q_tiled: "))
    assert "PTX of 24 of 24 kernel(s) differs" in qt and "left stale" in qt and "[staged-fold]" in qt
    assert next(ln for ln in lines if ln.startswith("multi_token: ")) == "multi_token: 1 bucket(s) current"
    # two compile runs: the current sources and the extracted revision a
    assert [c[0] for c in calls] == [pkg.parent, tmp_path / "work" / f"src-{revs['a'][:12]}"]
    assert (calls[1][0] / "directkv_cute" / "kernels" / "q_tiled.py").exists()

    after = P.load_profile(path)
    assert after.machine == before.machine and after.metadata["created"] == before.metadata["created"]
    for (ck, bk, a), (ck2, bk2, b) in zip(before.records(), after.records(), strict=True):
        assert (ck, bk) == (ck2, bk2)
        if ck[0] == "decode":
            assert b == {**a, "kernel_hash": now["decode"]}
        else:
            assert b == a
    (rec,) = after.metadata["restamped"]
    assert rec["kernel"] == "decode" and rec["from"] == old["decode"] and rec["to"] == now["decode"]
    assert rec["revision"] == revs["a"] and rec["buckets"] == 3 and rec["ptx_kernels"] == 3
    assert "after a PTX comparison of 3 kernels" in rec["note"]
    assert [g.kernel for g in R.stale_groups(after, rs.current_hash)[0]] == ["q_tiled"]


def test_dry_run_compares_and_writes_nothing(setup, tmp_path, capsys):
    pkg, _revs, path, _old, _now = setup
    text = path.read_bytes()
    rc, out = run_restamp(path, restamper(pkg, tmp_path), capsys, dry_run=True)
    assert rc == 1 and "identical; would re-stamp to" in out and path.read_bytes() == text


def test_against_the_tuned_revision_and_against_another(setup, tmp_path, capsys):
    pkg, revs, path, old, now = setup
    text = path.read_bytes()
    rc, out = run_restamp(path, restamper(pkg, tmp_path), capsys, against=revs["b"], dry_run=True)
    assert rc == 1 and path.read_bytes() == text
    assert "not the sources these entries were tuned for" in out and "identical" not in out
    rc, out = run_restamp(path, restamper(pkg, tmp_path), capsys, against=revs["a"][:10])
    assert rc == 1 and f"= {revs['a'][:12]} (--against)" in out and "re-stamped to " + now["decode"][:12] in out
    with pytest.raises(R.RestampError, match="not a commit"):
        R.restamp_profile(path, restamper=restamper(pkg, tmp_path), against="no-such-rev")


def test_against_a_revision_that_listed_other_files_is_taken_by_its_own_kernel_hash(setup, tmp_path, capsys):
    """A revision given with --against whose files hash otherwise under this version's file lists is
    still the tuned one when its own ``kernel_hash`` (the compile worker reports it) is the entries'."""
    pkg, revs, path, old, now = setup
    plain = fake_compile()

    def compile_fn(tree, jobs, workdir, families=()):
        out = plain(tree, jobs, workdir, families)
        if "src-" in str(tree):
            out.hashes = {"decode": old["decode"]}
        return out

    rc, out = run_restamp(path, restamper(pkg, tmp_path, compile_fn=compile_fn), capsys, against=revs["b"])
    dec = next(ln for ln in out.splitlines() if ln.startswith("decode: "))
    assert "(--against, by its own kernel_hash)" in dec and "re-stamped to " + now["decode"][:12] in dec
    assert "not the sources these entries were tuned for" in next(ln for ln in out.splitlines()
                                                                   if ln.startswith("q_tiled: "))


def test_no_revision_with_the_hash_leaves_the_entries_stale(setup, tmp_path, capsys):
    pkg, _revs, path, _old, now = setup
    write_profile(path, {"decode": "1" * 64, "multi_token": now["multi_token"], "q_tiled": now["q_tiled"]})
    text = path.read_bytes()
    calls = []
    rc, out = run_restamp(path, restamper(pkg, tmp_path, compile_fn=fake_compile(calls)), capsys)
    assert rc == 1 and path.read_bytes() == text and not calls
    assert "decode: 3 bucket(s) tuned for 111111111111: no commit of the 2 that touched its sources hashes to " \
           "111111111111 (give the tuned revision with --against REV); left stale" in out
    assert "q_tiled: 8 bucket(s) current" in out


def test_a_kernel_that_fails_to_compile_leaves_its_family_stale(setup, tmp_path, capsys):
    pkg, revs, path, _old, _now = setup
    text = path.read_bytes()
    rs = restamper(pkg, tmp_path, compile_fn=fake_compile(fail_in=f"src-{revs['a'][:12]}"))
    rc, out = run_restamp(path, rs, capsys)
    assert rc == 1 and path.read_bytes() == text
    dec = next(ln for ln in out.splitlines() if ln.startswith("decode: "))
    assert "2 of 3 kernel(s) failed to compile" in dec and "TypeError: an old API" in dec and "left stale" in dec


def test_everything_identical_exits_0_and_a_second_run_has_nothing_to_do(setup, tmp_path, capsys):
    pkg, revs, path, _old, now = setup
    git(pkg.parent, "revert", "--no-edit", revs["c"])  # q_tiled's code change undone: only comments differ
    now["q_tiled"] = sources.kernel_hash("q_tiled", root=pkg)
    rc, out = run_restamp(path, restamper(pkg, tmp_path), capsys)
    assert rc == 0 and out.count("re-stamped to") == 2, out
    prof = P.load_profile(path)
    assert [r["kernel"] for r in prof.metadata["restamped"]] == ["decode", "q_tiled"]
    assert R.stale_groups(prof, lambda k: sources.kernel_hash(k, root=pkg))[0] == []
    calls = []
    rc, out = run_restamp(path, restamper(pkg, tmp_path, compile_fn=fake_compile(calls)), capsys)
    assert rc == 0 and not calls and "decode: 3 bucket(s) current" in out


def test_a_bucket_rewritten_meanwhile_is_left_as_it_is(setup, tmp_path, capsys, monkeypatch):
    pkg, _revs, path, old, now = setup
    rs = restamper(pkg, tmp_path)
    compare = rs.compare

    def compare_then_retune(groups):
        compare(groups)  # a tuner rewrites one decode bucket while the kernels compile
        prof = P.load_profile(path)
        rec = prof.get(DECODE, (1, 4096, 1))
        prof.set(DECODE, (1, 4096, 1), {**rec, "p50_us": 9.0, "kernel_hash": now["decode"]})
        P.save_profile(prof, path)

    monkeypatch.setattr(rs, "compare", compare_then_retune)
    run_restamp(path, rs, capsys)
    prof = P.load_profile(path)
    assert prof.get(DECODE, (1, 4096, 1))["p50_us"] == 9.0
    assert all(prof.get(DECODE, (b, 4096, 1))["kernel_hash"] == now["decode"] for b in (1, 4, 16))
    assert prof.metadata["restamped"][0]["buckets"] == 2


def test_cli_restamp(setup, tmp_path, capsys, monkeypatch):
    pkg, _revs, path, _old, now = setup
    real = R.Restamper
    monkeypatch.setattr(R, "Restamper", lambda log: real(package_dir=pkg, workdir=tmp_path / "w",
                                                         compile_fn=fake_compile(), log=log))
    rc = cli.main(["restamp", "--profile", str(path), "--dry-run", "-v"])
    out, err = capsys.readouterr()
    assert rc == 1 and "would re-stamp" in out and "  same     decode bf16 d128 g4 p64 tile_n=64" in out
    assert "  DIFFERS  q_tiled bf16" in out and "compiling" in err
    rc = cli.main(["restamp", "--profile", str(tmp_path / "none.yaml")])
    out, err = capsys.readouterr()
    assert rc == 2 and err.strip().count("\n") == 0 and "restamp: --profile" in err and "no such file" in err
    rc = cli.main(["restamp", "--profile", str(path), "--against", "no-such-rev"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.strip() == f"directkv-tune: restamp: --against no-such-rev: not a commit of {pkg.parent}"
    assert not out


# ---- a real compile -------------------------------------------------------------------------------


def test_a_real_compile_from_an_extracted_revision_and_from_the_working_tree(tmp_path):
    """The worker compiles in a fresh interpreter from the tree it is given (checked: it refuses
    another package), keeps the PTX, and the split combine of HEAD's archive and of the working
    tree is identical (its files are unchanged: the test is skipped where they are not)."""
    try:
        g = R.Git(sources.PACKAGE_DIR)
        head = g.commit("HEAD")
    except R.RestampError:
        pytest.skip("not a git checkout")
    if g.blobs(head, ["kernels/combine.py"]) != {"kernels/combine.py": git(g.root, "hash-object",
                                                                             str(sources.PACKAGE_DIR / "kernels/combine.py"))}:
        pytest.skip("kernels/combine.py differs from HEAD's")
    tree = g.extract(head, tmp_path / "src")
    assert (tree / "directkv_cute" / "kernels" / "combine.py").exists()
    jobs = [R.Job("combine", "bf16", 128)]
    then = R.compile_tree(tree, jobs, tmp_path / "then", ("decode",))
    now = R.compile_tree(sources.PACKAGE_DIR.parent, jobs, tmp_path / "now", ("decode",))
    assert not then.error and not now.error and not then.errors and not now.errors
    assert then.ptx[0].count(".entry") == 1 and "SplitCombine" in then.ptx[0]
    assert R.normalize_ptx(then.ptx[0], [tree]) == R.normalize_ptx(now.ptx[0], [sources.PACKAGE_DIR.parent])
    assert then.hashes["decode"] == sources.kernel_hash("decode", root=tree / "directkv_cute")
    (tmp_path / "empty").mkdir()
    wrong = R.compile_tree(tmp_path / "empty", jobs, tmp_path / "wrong")
    assert wrong.error and "imported directkv_cute from" in wrong.error
