"""The timeline diagnostic: its stamps are a compile-time option of the multi-token kernel, so
the traced kernel compiles for sm_90a with the timer reads in it, the op's own kernels have none
and keep their code, and ``--skip-passes`` compiles the walk without passes (the GPU run itself
is `python -m bench timeline`)."""

from __future__ import annotations

import pytest
from ptx_dump import compiled_ptx

pytestmark = pytest.mark.compile

_COMPILE = """
import torch
from directkv_cute.config import default_multi_token_config
from directkv_cute.kernels import jit
from directkv_cute.kernels.trace import Trace
for rows, cluster, trace in {cases!r}:
    cfg = default_multi_token_config(128, rows)
    assert cfg.q_cluster == cluster
    jit.compile_multi_token(cfg, torch.bfloat16, 128, 64, 4, trace=trace and Trace(1 << 40, 2, trace == "skip"))
"""


def test_traced_kernels_have_timer_reads_and_the_ops_kernels_none(tmp_path):
    """One interpreter compiles the default without and with clusters, traced and not, and the
    cluster default with its passes skipped."""
    cases = [(None, 0, None), (None, 0, "trace"), (4096, 2, None), (4096, 2, "trace"), (4096, 2, "skip")]
    plain, traced, plain_c, traced_c, skipped = compiled_ptx(tmp_path, _COMPILE.format(cases=cases))
    assert "%globaltimer" not in plain and "%globaltimer" not in plain_c
    assert "%globaltimer" in traced and "%globaltimer" in traced_c
    assert "multicast::cluster" not in traced and "multicast::cluster" in traced_c
    assert "wgmma.mma_async" in traced_c
    # --skip-passes: the chunks still land and are released (stamps, TMA) but no pass runs.
    assert "%globaltimer" in skipped and "cp.async.bulk.tensor" in skipped and "wgmma.mma_async" not in skipped


def test_trace_keys_and_their_cache():
    """A trace is part of the compile key (the address is in the code) and only the multi-token
    kernel has one; ``tracing`` sets it for the block only."""
    import torch

    from directkv_cute.config import DecodeConfig
    from directkv_cute.kernels import jit
    from directkv_cute.kernels.trace import Trace, current_trace, tracing

    cfg = DecodeConfig(tile_n=64, stages=4, consumer_wgs=2, carveout=100)
    plain = jit.decode_key(cfg, torch.bfloat16, 128, 64, 4, True, True)
    t1, t2 = Trace(1 << 40), Trace(1 << 41)
    k1 = jit.decode_key(cfg, torch.bfloat16, 128, 64, 4, True, True, t1)
    assert k1 != plain and k1 != jit.decode_key(cfg, torch.bfloat16, 128, 64, 4, True, True, t2)
    assert current_trace() is None
    with tracing(t1):
        assert current_trace() == t1
    assert current_trace() is None
    with pytest.raises(ValueError, match="multi-token kernel only"):
        jit.compile_decode(cfg, torch.bfloat16, 128, 64, 4, 1, split_out=True, multi_token=False, trace=t1)


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
        assert "bench timeline needs CUDA (it has no CPU run)" in capsys.readouterr().err


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
