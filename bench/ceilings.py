"""Bandwidth ceilings measured in the same run as the methods.

* host read: a GPU kernel streaming pinned host memory through its UVA view (a torch
  reduction; the best of a few reduction kernels, since their load widths differ);
* HBM read: the same reductions over a device buffer (bytes read, not written);
* memcpy H2D: ``cudaMemcpyAsync`` from pinned host memory (``copy_(non_blocking=True)``).
"""

from __future__ import annotations

from typing import Callable

import torch

from bench.common import GB, GiB, Ceilings, Timer, time_calls
from bench.hostmem import PinnedBuffer

# Streaming reads over a flat buffer (viewed as float32 or bfloat16: 4- or 2-byte loads).
READ_KERNELS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum_f32": lambda x: x.view(torch.float32).sum(),
    "amax_f32": lambda x: x.view(torch.float32).amax(),
    "sum_bf16": lambda x: x.view(torch.bfloat16).sum(),
}


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (for the read kernels)."""
    return t.reshape(-1).view(torch.uint8)


def read_gbps(buffers: list[torch.Tensor], kernel: str, timer: Timer, **timing) -> float:
    """GB/s of a read kernel rotating over ``buffers`` (flat uint8 views of equal size)."""
    fn = READ_KERNELS[kernel]
    calls = [lambda b=b: fn(b) for b in buffers]
    t = time_calls(calls, timer, **timing)
    return buffers[0].numel() / (t.ms * 1e-3) / GB


def best_read(buffers: list[torch.Tensor], timer: Timer, **timing) -> tuple[str, float, dict]:
    """The fastest read kernel over ``buffers``: (name, GB/s, {name: GB/s for every kernel})."""
    results = {name: read_gbps(buffers, name, timer, **timing) for name in READ_KERNELS}
    name = max(results, key=results.get)
    return name, results[name], results


def measure_ceilings(device: str, host_bytes: int = 2 * GiB, hbm_bytes: int = 4 * GiB,
                     timer: Timer | None = None) -> tuple[Ceilings, dict]:
    """Measure the three run-level ceilings; returns (Ceilings, details for the JSON)."""
    timer = timer or Timer(device)
    timing = {"warmup": 2, "reps": 7, "max_total_s": 2.0}
    host_bytes -= host_bytes % 16
    hbm_bytes -= hbm_bytes % 16
    host = PinnedBuffer((host_bytes,), torch.uint8, device)
    try:
        host.device_view.view(torch.float32).normal_()
        h_name, h_gbps, h_all = best_read([flat_bytes(host.device_view)], timer, **timing)
        dev = torch.empty(host_bytes, dtype=torch.uint8, device=device)
        src = host.cpu
        t = time_calls([lambda: dev.copy_(src, non_blocking=True)], timer, **timing)
        memcpy_gbps = host_bytes / (t.ms * 1e-3) / GB
        pinned = bool(src.is_pinned()) if device == "cuda" else None
        del dev
        timer.sync()
    finally:
        host.close()
    hbm = torch.empty(hbm_bytes // 4, dtype=torch.float32, device=device).normal_()
    b_name, b_gbps, b_all = best_read([flat_bytes(hbm)], timer, **timing)
    del hbm
    details = {"host_read": {"bytes": host_bytes, "kernel": h_name, "all_gbps": h_all},
               "hbm_read": {"bytes": hbm_bytes, "kernel": b_name, "all_gbps": b_all},
               "memcpy_h2d": {"bytes": host_bytes, "source_is_pinned": pinned},
               "timing": timing}
    return Ceilings(host_read_gbps=h_gbps, hbm_read_gbps=b_gbps, memcpy_h2d_gbps=memcpy_gbps), details
