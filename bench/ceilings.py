"""Bandwidth ceilings measured in the same run as the methods.

* host read: a GPU kernel streaming pinned host memory through its UVA view (a torch
  reduction; the best of a few reduction kernels, since their load widths differ);
* HBM read: the same reductions over a device buffer (bytes read, not written);
* memcpy H2D: ``cudaMemcpyAsync`` from pinned host memory (``copy_(non_blocking=True)``).

The measurements are the library's (``directkv_cute.probes``, which ``directkv-tune machine``
uses too); here they are timed with the bench's ``Timer`` (a GPU sleep ahead of each sample).
"""

from __future__ import annotations

import torch

from bench.common import GiB, Ceilings, Timer, time_calls
from directkv_cute import probes
from directkv_cute.probes import READ_KERNELS, flat_bytes  # noqa: F401 (the bench's names for them)


def _time_ms(timer: Timer, timing: dict):
    """The bench's timing as ``directkv_cute.probes`` takes it: median ms per call."""
    return lambda calls: time_calls(list(calls), timer, **timing).ms


def read_gbps(buffers: list[torch.Tensor], kernel: str, timer: Timer, **timing) -> float:
    """GB/s of a read kernel rotating over ``buffers`` (flat uint8 views of equal size)."""
    return probes.read_gbps(buffers, kernel, _time_ms(timer, timing))


def best_read(buffers: list[torch.Tensor], timer: Timer, **timing) -> tuple[str, float, dict]:
    """The fastest read kernel over ``buffers``: (name, GB/s, {name: GB/s for every kernel})."""
    return probes.best_read(buffers, _time_ms(timer, timing))


def measure_ceilings(device: str, host_bytes: int = 2 * GiB, hbm_bytes: int = 4 * GiB,
                     timer: Timer | None = None) -> tuple[Ceilings, dict]:
    """Measure the three run-level ceilings; returns (Ceilings, details for the JSON)."""
    timer = timer or Timer(device)
    timing = {"warmup": 2, "reps": 7, "max_total_s": 2.0}
    rates, details = probes.measure_bandwidths(device, host_bytes, hbm_bytes, _time_ms(timer, timing))
    details["timing"] = timing
    return Ceilings(host_read_gbps=rates["host_read_gbps"], hbm_read_gbps=rates["hbm_read_gbps"],
                    memcpy_h2d_gbps=rates["memcpy_h2d_gbps"]), details
