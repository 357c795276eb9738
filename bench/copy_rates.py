"""The copy engine's rates for the staging copies (``directkv_cute.staging``).

``python -m bench.copy_rates [--out-dir DIR]``: 32 MB of pages (256 KB each: Hkv 8 x K/V x 64 tokens x
d 128 in bf16) copied from pinned host memory into HBM as strided 2-D copies of 32 / 64 / 128 KB
rows (one call per group of KV heads, as a copy staged head by head) or whole pages, in 1 / 4 /
16 pieces, with and without a ready flag (``cuStreamWriteValue32``) after each piece. CUDA
events around each pattern, median of 10 after 3 warm-ups. The per-call and per-flag costs in
``plan`` (``COPY_CALL_MS``, ``FLAG_MS``, ``LINK_PIECES``) are read off this table. Writes
``<out-dir>/<gpu>-<date>-copy-rates.json`` (default ./bench-results). It needs a CUDA GPU (no CPU
run). The copy pattern is the library's (``directkv_cute.probes.copy_pattern``), which
``directkv-tune machine`` times too.
"""

from __future__ import annotations

import argparse

from bench.common import add_out_dir_argument, checked_out_dir, exit_status, require_gpu

PAGE = 256 << 10
PAGES = 128


def measure() -> dict:
    import torch

    from directkv_cute.probes import copy_pattern

    host = torch.empty(PAGES * PAGE, dtype=torch.uint8).pin_memory()
    dev = torch.empty(PAGES * PAGE, dtype=torch.uint8, device="cuda")
    flags = torch.zeros(4096, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()

    def pattern(width: int, pieces: int, flag: bool) -> None:
        copy_pattern(dev, host, flags, stream, PAGE, width, pieces, flag)

    rows = {}
    with torch.cuda.stream(stream):
        for width in (32 << 10, 64 << 10, 128 << 10, PAGE):
            for pieces in (1, 4, 16):
                for flag in (False, True):
                    for _ in range(3):
                        pattern(width, pieces, flag)
                    times = []
                    for _ in range(10):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record(stream)
                        pattern(width, pieces, flag)
                        b.record(stream)
                        b.synchronize()
                        times.append(a.elapsed_time(b))
                    ms = sorted(times)[len(times) // 2]
                    key = f"row {width >> 10}K x {PAGE // width} groups, {pieces} pieces, flags {int(flag)}"
                    rows[key] = {"ms": ms, "GBps": PAGES * PAGE / ms / 1e6, "calls": PAGE // width * pieces}
                    print(f"{key:45s} {ms:7.3f} ms {rows[key]['GBps']:6.1f} GB/s", flush=True)
    return rows


def main(argv=None) -> int:
    from bench.common import env_info, results_path, write_json

    p = argparse.ArgumentParser(prog="python -m bench.copy_rates", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_dir_argument(p, "the JSON")
    ns = p.parse_args(argv)
    require_gpu(command="python -m bench.copy_rates", cpu_run=False)
    out = results_path(checked_out_dir(ns.out_dir), env_info("cuda"), "copy-rates")
    write_json(out, {"bench": "copy-rates", "rows": measure()})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))
