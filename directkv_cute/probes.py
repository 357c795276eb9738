"""GPU measurements shared by the bench (``bench.ceilings``, ``bench.copy_rates``) and the tuner's
``directkv-tune machine`` (``directkv_cute.tuning.machine``): one implementation of each.

* ``best_read`` / ``read_gbps``: streaming reads of a flat buffer by a few torch reductions (their
  load widths differ, the fastest counts): over a pinned host buffer's UVA view the SMs' read rate
  of host memory, over a device buffer the HBM read rate (bytes read, not written);
* ``measure_bandwidths``: the host-read, HBM-read and memcpy H2D ceilings (``cudaMemcpyAsync``
  from pinned host memory, ``copy_(non_blocking=True)``);
* ``copy_pattern``: the staging copies' pattern -- pages of a pinned host buffer copied into HBM
  as strided 2-D copies in pieces, optionally a ready flag (``cuStreamWriteValue32``) after each.

Each measuring function takes ``time_ms``: a callable that runs a list of calls (rotating among
them) and returns the median milliseconds per call. The bench passes its own (a GPU sleep ahead
of each sample, ``bench.common.time_calls``); ``event_time_ms`` is the plain CUDA-event one.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

import torch

from directkv_cute._pinned import PinnedHostBuffer

GB = 1e9
TimeMs = Callable[[Sequence[Callable[[], object]]], float]

# Streaming reads over a flat buffer (viewed as float32 or bfloat16: 4- or 2-byte loads).
READ_KERNELS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum_f32": lambda x: x.view(torch.float32).sum(),
    "amax_f32": lambda x: x.view(torch.float32).amax(),
    "sum_bf16": lambda x: x.view(torch.bfloat16).sum(),
}


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (for the read kernels)."""
    return t.reshape(-1).view(torch.uint8)


def read_gbps(buffers: list[torch.Tensor], kernel: str, time_ms: TimeMs) -> float:
    """GB/s of a read kernel rotating over ``buffers`` (flat uint8 views of equal size)."""
    fn = READ_KERNELS[kernel]
    ms = time_ms([lambda b=b: fn(b) for b in buffers])
    return buffers[0].numel() / (ms * 1e-3) / GB


def best_read(buffers: list[torch.Tensor], time_ms: TimeMs) -> tuple[str, float, dict]:
    """The fastest read kernel over ``buffers``: (name, GB/s, {name: GB/s for every kernel})."""
    results = {name: read_gbps(buffers, name, time_ms) for name in READ_KERNELS}
    name = max(results, key=results.get)
    return name, results[name], results


def measure_bandwidths(device: str, host_bytes: int, hbm_bytes: int, time_ms: TimeMs) -> tuple[dict, dict]:
    """The SMs' read rate of pinned host memory, the copy engine's H2D rate from it, and the HBM
    read rate: ({"host_read_gbps", "memcpy_h2d_gbps", "hbm_read_gbps"}, details). On a CPU the
    'host' buffer is ordinary memory (a smoke run)."""
    host_bytes -= host_bytes % 16
    hbm_bytes -= hbm_bytes % 16
    host = PinnedHostBuffer(host_bytes, torch.device("cuda") if device == "cuda" else None)
    try:
        src = host.tensor
        view = host.cuda_view(torch.uint8) if host.registered else src
        view.view(torch.float32).normal_()
        h_name, h_gbps, h_all = best_read([flat_bytes(view)], time_ms)
        dev = torch.empty(host_bytes, dtype=torch.uint8, device=device)
        ms = time_ms([lambda: dev.copy_(src, non_blocking=True)])
        memcpy_gbps = host_bytes / (ms * 1e-3) / GB
        pinned = bool(src.is_pinned()) if device == "cuda" else None
        del dev, view
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        host.close()
    hbm = torch.empty(hbm_bytes // 4, dtype=torch.float32, device=device).normal_()
    b_name, b_gbps, b_all = best_read([flat_bytes(hbm)], time_ms)
    del hbm
    rates = {"host_read_gbps": h_gbps, "memcpy_h2d_gbps": memcpy_gbps, "hbm_read_gbps": b_gbps}
    details = {"host_read": {"bytes": host_bytes, "kernel": h_name, "all_gbps": h_all},
               "hbm_read": {"bytes": hbm_bytes, "kernel": b_name, "all_gbps": b_all},
               "memcpy_h2d": {"bytes": host_bytes, "source_is_pinned": pinned}}
    return rates, details


def event_time_ms(calls: Sequence[Callable[[], object]], *, warmup: int = 2, reps: int = 7,
                  min_sample_ms: float = 2.0, stream=None) -> float:
    """Median milliseconds per call of ``calls`` (rotating among them), timed with CUDA events on
    ``stream`` (default the current one): ``warmup`` calls, then ``reps`` samples of back-to-back
    calls, each sample at least ``min_sample_ms`` long (a short call is repeated)."""
    n = len(calls)
    if not n:
        raise ValueError("event_time_ms needs at least one call")
    stream = stream or torch.cuda.current_stream()
    for i in range(max(1, warmup)):
        calls[i % n]()

    def sample(inner: int) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for i in range(inner):
            calls[i % n]()
        b.record(stream)
        b.synchronize()
        return a.elapsed_time(b) / inner

    est = max(sample(n), 1e-4)
    inner = n * max(1, math.ceil(min_sample_ms / est / n))
    return statistics.median(sample(inner) for _ in range(max(1, reps)))


def copy_pattern(dev: torch.Tensor, host: torch.Tensor, flags: torch.Tensor, stream, page: int, width: int,
                 pieces: int, flag: bool) -> int:
    """Enqueue on ``stream`` the copy of ``host``'s pages (``page`` bytes each) into ``dev`` as a
    staged copy head by head makes it: ``page // width`` row groups (``width`` bytes of each page,
    one ``cudaMemcpy2DAsync`` per group and piece) in ``pieces`` pieces, with a ready flag
    (``cuStreamWriteValue32`` into ``flags``) after each call when ``flag``. Returns the calls."""
    import cuda.bindings.driver as drv
    import cuda.bindings.runtime as rt

    pages = host.numel() // page
    per = pages // pieces
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    calls = 0
    for g in range(page // width):
        for p in range(pieces):
            off = p * per * page + g * width
            rt.cudaMemcpy2DAsync(dev.data_ptr() + off, page, host.data_ptr() + off, page, width, per, kind,
                                 stream.cuda_stream)
            calls += 1
            if flag:
                ptr = drv.CUdeviceptr(flags.data_ptr() + 4 * ((g * pieces + p) % flags.numel()))
                drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream), ptr, 1, 0)
    return calls


__all__ = ["GB", "READ_KERNELS", "best_read", "copy_pattern", "event_time_ms", "flat_bytes", "measure_bandwidths",
           "read_gbps"]
