"""The timeline diagnostic's instrumentation: it still applies to the kernel sources, the
instrumented kernel compiles for sm_90a with the timer reads in it, and a moved anchor is a clear
error (the GPU run itself is `python -m bench timeline`)."""

from __future__ import annotations

import os
import shutil

import pytest
from ptx_dump import compiled_ptx, dumped_ptx

from bench.timeline import InstrumentError, instrument

pytestmark = pytest.mark.compile

_COMPILE = """
import torch
from directkv_cute.config import default_prefill_config
from directkv_cute.kernels import jit
import directkv_cute
assert directkv_cute.__file__.startswith({root!r}), directkv_cute.__file__
for rows, cluster in {cases!r}:
    cfg = default_prefill_config(128, rows)
    assert cfg.q_cluster == cluster
    jit.compile_prefill(cfg, torch.bfloat16, 128, 64, 4)
"""


def test_instrumented_kernel_compiles_with_timer_reads(tmp_path):
    """The default without and with clusters (one interpreter compiles both)."""
    root = instrument(tmp_path / "copy")
    decode = (root / "directkv_cute" / "kernels" / "multi_token.py").read_text()
    assert decode.count("cute.arch.globaltimer()") == 7
    script = _COMPILE.format(root=str(root), cases=[(None, 0), (4096, 2)])
    ptxs = compiled_ptx(tmp_path, script, cwd=root, DIRECTKV_TIMELINE_ADDR=str(1 << 40))
    assert len(ptxs) == 2 and ptxs[0] != ptxs[1]
    assert all("%globaltimer" in ptx for ptx in ptxs)
    assert "multicast::cluster" not in ptxs[0] and "multicast::cluster" in ptxs[1]


def test_skipped_passes_leave_the_link_phase_only(tmp_path):
    """``--skip-passes``: the instrumented copy's consumers still wait for and release every
    chunk (its stamps remain) but run no pass, so the kernel has no WGMMA; the cluster default
    compiles that way."""
    root = instrument(tmp_path / "copy", skip_passes=True)
    decode = (root / "directkv_cute" / "kernels" / "multi_token.py").read_text()
    assert "if const_expr(False):  # bench timeline --skip-passes" in decode
    assert "if j == 0 or t_stop > c_begin:" not in decode
    script = _COMPILE.format(root=str(root), cases=[(4096, 2)])
    ptx = dumped_ptx(tmp_path, script, cwd=root, DIRECTKV_TIMELINE_ADDR=str(1 << 40))
    assert "%globaltimer" in ptx and "cp.async.bulk.tensor" in ptx
    assert "wgmma.mma_async" not in ptx


def test_child_script_builds_its_shape_with_the_breakdowns_helper():
    """The GPU child (run by ``bench timeline``) is valid Python and builds its cache with
    ``bench.breakdown.build_shape``, the same shape as ``bench breakdown``."""
    from bench import timeline

    compile(timeline._CHILD, "timeline_child.py", "exec")
    assert "cache, tables, q = build_shape(spec)" in timeline._CHILD


def test_a_moved_anchor_is_named(tmp_path):
    import directkv_cute

    src = tmp_path / "src" / "directkv_cute"
    shutil.copytree(os.path.dirname(directkv_cute.__file__), src, ignore=shutil.ignore_patterns("__pycache__"))
    kernel = src / "kernels" / "multi_token.py"
    kernel.write_text(kernel.read_text().replace("nb = rb + step", "nxt = rb + step"))
    with pytest.raises(InstrumentError, match="the start of a pass"):
        instrument(tmp_path / "copy", src_pkg=src)


def test_summary_table_and_cpu_refusal(capsys):
    from bench.__main__ import main
    from bench.timeline import format_timeline

    res = {"config": {"tile_n": 64}, "op_ms": 3.1, "ctas": 128, "span_us": 2969.0,
           "chunks": [{"chunk": 0, "ctas": 128, "ready_us": [239.4, 328.2, 427.5], "done_us": [521.2, 537.6, 657.4],
                       "busy_us_median": 216.1}],
           "passes": {"wgmma": {"n": 2048, "median_us": 2.82, "p90_us": 11.52}}}
    text = format_timeline(res)
    assert "kernel span 2969 us" in text and "  328.2" in text and "p90  11.52 us" in text
    assert "wait med/max" in text  # a summary from before the wait column shows zeros there
    res["chunks"][0]["wait_us"] = [88.8, 190.6]
    assert text.splitlines()[3].split()[-2:] == ["0.0", "0.0"]
    assert format_timeline(res).splitlines()[3].split()[-2:] == ["88.8", "190.6"]
    assert "passes skipped" not in text and "passes skipped" in format_timeline(res | {"skip_passes": True})
    if not __import__("torch").cuda.is_available():
        assert main(["timeline", "--context", "4096"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_stamp_summary_keeps_nanoseconds():
    """Absolute timer values (~1.7e18 ns) do not fit a double to the nanosecond: the summary works
    relative to the first CTA's start, and unwritten stamps (0) are left out."""
    import torch

    from bench.timeline import SLOTS, summarize_stamps

    base = 1_700_000_000_123_456_789
    t = torch.zeros(6, SLOTS, dtype=torch.int64)
    for cta in range(4):  # rows 4 and 5: CTAs that never ran
        t[cta, 0] = base + cta * 10
        for j in range(3):
            t[cta, 1 + 2 * j] = base + 1000 * (j + 1) + cta
            t[cta, 2 + 2 * j] = base + 1000 * (j + 1) + 500 + cta
        for p in range(5 if cta < 3 else 2):  # CTA 3 ran fewer passes in the traced chunk
            for k, dt in enumerate((0, 7, 20, 21)):
                t[cta, 64 + 4 * p + k] = base + 3000 + 100 * p + dt
    t[2:4, 5] = base + 2400  # CTAs 2 and 3: chunk 2 landed before they were done with chunk 1
    res = summarize_stamps(t, {"tile_n": 64}, 1.5)
    assert res["ctas"] == 4 and len(res["chunks"]) == 3
    # waits: chunk 0 from each CTA's own start (1000 - 9 * cta ns), chunk 1 from chunk 0's end
    # (500 ns), chunk 2 500 ns for CTAs 0-1 and none (not negative) for CTAs 2-3
    assert [c["wait_us"] for c in res["chunks"]] == [[0.982, 1.0], [0.5, 0.5], [0.0, 0.5]]
    assert res["chunks"][1]["ready_us"] == [2.0, 2.001, 2.003] and res["chunks"][1]["busy_us_median"] == 0.5
    assert res["span_us"] == 3.503
    assert res["passes"]["gather_reload"] == {"n": 17, "median_us": 0.007, "p90_us": 0.007}
    assert res["passes"]["wgmma"]["median_us"] == 0.013 and res["passes"]["finalize_store"]["median_us"] == 0.001


def test_child_env_keeps_wheels_but_not_a_shadowing_package(tmp_path):
    """The child must still find cutlass on PYTHONPATH (how the GPU machine provides it) while a
    folder holding another directkv_cute would shadow the instrumented copy and is dropped."""
    from bench.timeline import child_env

    wheels, shadow = tmp_path / "site", tmp_path / "repo"
    (wheels / "cutlass").mkdir(parents=True)
    (shadow / "directkv_cute").mkdir(parents=True)
    env = child_env({"PYTHONPATH": f"{wheels}:{shadow}:", "X": "1"})
    assert env["PYTHONPATH"] == str(wheels) and env["X"] == "1"
    assert "PYTHONPATH" not in child_env({"PYTHONPATH": str(shadow)})
    assert "PYTHONPATH" not in child_env({})
