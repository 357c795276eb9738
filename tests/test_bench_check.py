"""``python -m bench check``'s output: a short summary whose counts agree with each other, every
failure in full, the long lists under --verbose. The compiler is a stand-in here (CI runs the real
check, which compiles every kernel, as a step of its own)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import bench.check as check
import directkv_cute.plan as plan
from bench.check import compile_jobs, default_targets, portfolio_targets, run_check
from bench.common import torch_dtype
from directkv_cute.config import SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES
from directkv_cute.kernels import jit


class FakeCompiler:
    """compile_decode / compile_combine that record their requests; ``fail`` names configs whose
    compile raises."""

    def __init__(self, fail=lambda cfg, **kw: False):
        self.decode, self.combine, self.fail = [], [], fail

    def compile_decode(self, cfg, dtype, head_dim, page_size, group, max_q_len=1, split_out=True, multi_token=False):
        self.decode.append(jit.decode_key(cfg, dtype, head_dim, page_size, group, split_out, multi_token=multi_token))
        if self.fail(cfg, multi_token=multi_token, split_out=split_out):
            raise RuntimeError("ptxas: boom\nsecond line")
        return object()

    def compile_combine(self, head_dim, dtype):
        self.combine.append((head_dim, dtype))
        return object()


@pytest.fixture
def fake(monkeypatch):
    def install(**kw):
        f = FakeCompiler(**kw)
        monkeypatch.setattr(check, "resolve_compiler", lambda: (f.compile_decode, f.compile_combine, jit.decode_key))
        return f

    return install


def _check(capsys, **kw) -> tuple[int, str]:
    kw.setdefault("q_tiled", False)
    kw.setdefault("fp8", False)
    rc = run_check(traffic=False, progress=False, **kw)
    return rc, capsys.readouterr().out


def test_one_count_of_kernels_each_compiled_once(fake, capsys):
    f = fake()
    rc, out = _check(capsys)
    assert rc == 0
    kernels = len(f.decode) + len(f.combine)
    assert len(set(f.decode)) == len(f.decode)  # no kernel compiled twice
    assert len(f.combine) == 2 * len(SUPPORTED_HEAD_DIMS)  # bf16 and the fp16 spot check
    head = re.search(r"^== \(b\) compile for \S+: (\d+) configs \((.*)\)$", out, re.M)
    configs = int(head[1])
    assert sum(int(part.split()[0]) for part in head[2].split(", ")) == configs  # per source
    assert configs < kernels  # decode configs with and without split outputs, and the combine kernels
    assert re.search(rf"^  {kernels} kernels in \d+ s, 0 failed \(--verbose lists them\)$", out, re.M)
    assert re.search(rf"^PASS  compile   {kernels} kernels in \d+ s, 0 failed$", out, re.M)
    assert len(out.splitlines()) <= 8, out


def test_kernels_that_share_a_compile_key_are_compiled_once():
    """Targets asking for the same kernel (a portfolio listed twice, configs differing only in
    launch fields) add no job."""
    targets = default_targets() + portfolio_targets()
    jobs = compile_jobs(targets, jit.decode_key)
    keys = [jit.decode_key(j.target.cfg, torch_dtype(j.target.dtype), j.target.head_dim, j.target.page_size,
                           j.target.group, j.split, multi_token=j.target.multi_token) for j in jobs if j.target]
    assert len(keys) == len(set(keys)) and len(keys) < 2 * len(targets)
    relaunched = [dataclasses.replace(t, cfg=dataclasses.replace(t.cfg, num_splits=7)) for t in targets]
    assert len(compile_jobs(targets + portfolio_targets() + relaunched, jit.decode_key)) == len(jobs)


def test_a_failed_compile_is_named_in_full(fake, capsys):
    f = fake(fail=lambda cfg, multi_token, split_out: multi_token and cfg.q_cluster == 2)
    rc, out = _check(capsys, profiles=False)
    assert rc == 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL ") and "boom" in ln]
    assert fails
    # each failure names the config in full (the fields that set it apart) and the error's first line
    assert all("multi-token" in ln and " q_cluster=2" in ln and ln.endswith("RuntimeError: ptxas: boom")
               for ln in fails)
    assert len(set(fails)) == len(fails)
    assert re.search(rf"^FAIL  compile   {len(f.decode) + len(f.combine)} kernels in \d+ s, {len(fails)} failed$",
                     out, re.M)


def test_verbose_lists_every_kernel(fake, capsys):
    f = fake()
    rc, out = _check(capsys, verbose=True)
    assert rc == 0
    rows = [ln for ln in out.splitlines() if ln.endswith("  ok")]
    assert len(rows) == len(f.decode) + len(f.combine)
    assert any(ln.startswith("combine: ") for ln in rows) and any("split_out=False" in ln for ln in rows)
    assert "valid," in out  # the profile notes


def test_a_log_gets_a_few_progress_lines_not_a_bar(fake, capsys):
    """Not a terminal (CI): a line at each quarter, no carriage returns."""
    fake()
    run_check(traffic=False, profiles=False, progress=True, q_tiled=False, fp8=False)
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err
    lines = [ln for ln in captured.out.splitlines() if re.fullmatch(r"  \d+/\d+ kernels, \d+ s", ln)]
    assert len(lines) == 3


def test_traffic_part_is_one_line_unless_it_fails(monkeypatch, capsys):
    import bench.traffic as traffic

    some = traffic.default_cases()[::20]  # the whole grid: tests/test_bench_traffic.py
    steps = traffic.default_step_cases()[:2]
    monkeypatch.setattr(traffic, "run_traffic_check", lambda: [traffic.check_case(c) for c in some])
    monkeypatch.setattr(traffic, "run_step_traffic_check", lambda: [traffic.check_step_case(c) for c in steps])
    assert run_check(profiles=False, compile=False, progress=False) == 0
    out = capsys.readouterr().out
    n = len(some) + len(steps)
    assert f"== (c) host-traffic model: {n}/{n} cases pass\n" in out
    assert "page  tile" not in out and len(out.splitlines()) == 3
    assert run_check(profiles=False, compile=False, progress=False, verbose=True) == 0
    assert "page  tile" in capsys.readouterr().out
    orig = plan.split_range
    monkeypatch.setattr(plan, "split_range", lambda n, s, i: (orig(n, s, i)[0], min(n, orig(n, s, i)[1] + 1)))
    assert run_check(profiles=False, compile=False, progress=False) == 1
    out = capsys.readouterr().out
    assert "FAIL lens=[" in out and "read twice" in out and "FAIL  traffic" in out and "page  tile" not in out


def test_no_profiles_is_said(capsys, tmp_path):
    assert run_check(compile=False, traffic=False, profile_dir=tmp_path, progress=False) == 0
    out = capsys.readouterr().out
    assert "== (a) profiles: 0 files, 0 buckets, 0 problems" in out and "no profiles in" in out


def test_q_tiled_part_compiles_every_routed_variant_and_names_failures(fake, monkeypatch, capsys):
    """(b2): the op's default QTiledConfig for every head dim, page size, group and (wait_ready,
    fold) the op can route to, each once; a failing one is a FAIL line and fails the check."""
    calls = []

    def fake_q_tiled(cfg, dtype, d, page, group, wait_ready, fold):
        calls.append((cfg, d, page, group, wait_ready, fold))
        if (d, page, group, wait_ready, fold) == (64, 16, 8, True, True):
            raise RuntimeError("ptxas: boom\nsecond line")
        return object()

    fake()
    monkeypatch.setattr(check, "resolve_q_tiled", lambda: fake_q_tiled)
    rc, out = _check(capsys, q_tiled=True)
    assert rc == 1
    n = len(SUPPORTED_HEAD_DIMS) * 2 * 3 * 3  # the default's variants; then the shipped profile's entries
    defaults = {(d, page, g, wr, so) for d in SUPPORTED_HEAD_DIMS for page in check.Q_TILED_PAGES
                for g in check.Q_TILED_GROUPS for wr, so in check.Q_TILED_VARIANTS}
    assert len(defaults) == n and {c[1:] for c in calls[:n]} == defaults
    assert len(calls) == len(set(calls)) >= n  # an entry that is the default's kernel is not compiled again
    assert {(wr, so) for *_, wr, so in calls} == {(False, False), (True, True), (True, False)}
    # staged calls of one query tile run without the cluster: those kernels too, staged only
    assert {c[0].cluster for c in calls if c[4]} == {1, 2} and {c[0].cluster for c in calls if not c[4]} == {2}
    head = re.search(r"^== \(b2\) Q-tiled kernel, the op's default config( and \d+ profile entries)?: (\d+) kernels", out,
                     re.M)
    assert head and int(head.group(2)) == len(calls) and "2 failed" in out  # with and without the cluster
    assert "FAIL q_tiled bfloat16 d64 page16 group8 wait_ready=True fold=True: RuntimeError: ptxas: boom" in out
    assert "second line" not in out
    assert re.search(r"^FAIL  q_tiled ", out, re.M)


def test_the_fp8_part_compiles_each_distinct_kernel_once_and_names_failures(fake, monkeypatch, capsys):
    """Part (b3): the FP8 decode kernel of every default and every profiled decode entry, as the op
    adapts it, and the dequant kernel of every format, dtype, head dim and page; a kernel that fails
    to compile is named with its config."""
    fake()
    calls = []

    def compile_fp8(cfg, dtype, kv, d, page, group, q_len, split_out):
        calls.append(jit.decode_fp8_key(cfg, dtype, kv, d, page, group, split_out))
        if kv is torch.float8_e5m2:
            raise RuntimeError("ptxas: fp8 boom")
        return object()

    deq = []

    def compile_dequant(kv, dtype, d, page):
        deq.append(jit.dequant_key(kv, dtype, d, page))
        if (kv, dtype, d, page) == (torch.float8_e5m2, torch.float16, 64, 16):
            raise RuntimeError("ptxas: dequant boom")
        return object()

    monkeypatch.setattr(jit, "compile_decode_fp8", compile_fp8)
    monkeypatch.setattr(jit, "compile_dequant", compile_dequant)
    rc, out = _check(capsys, fp8=True)
    assert rc == 1 and len(calls) == len(set(calls)) > 2 * len(SUPPORTED_HEAD_DIMS)
    assert len(deq) == len(set(deq)) == 2 * 2 * len(SUPPORTED_HEAD_DIMS) * len(SUPPORTED_PAGE_SIZES)
    targets = check.fp8_targets(check.load_shipped_profiles(None)[1])
    assert any(t[-1] != "default" for t in targets)  # the shipped profile's decode entries are covered
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL decode_fp8 float8_e5m2")]
    assert len(fails) == 1 and fails[0].endswith("RuntimeError: ptxas: fp8 boom")
    assert [ln for ln in out.splitlines() if ln.startswith("FAIL dequant")] == [
        "FAIL dequant float8_e5m2 float16 d64 page16: RuntimeError: ptxas: dequant boom"]
    assert re.search(rf"^FAIL  fp8 +{len(calls) + len(deq)} kernels in \d+ s, 2 failed$", out, re.M)
