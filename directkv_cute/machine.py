"""What the planner knows about the GPU: its machine model (the cost model's rates) and the
facts of one step (``DeviceInfo``).

The machine model comes from the GPU's profile (``machine:`` in ``profiles/<GPU>.yaml``;
``directkv-tune machine`` measures and writes it). ``machine_problems`` is its one check, run
wherever a profile is read (the loader in ``tuning.profiles``, hence ``directkv-tune check`` and
``show``; ``MachineModel.from_dict``; ``tuning.lookup.machine_for``): every rate finite and in its
range (``RATE_RANGES``), no unknown key. A GPU without a machine model gets ``CONSERVATIVE`` and
one warning (``machine_for``): it assumes no edge for the copy engine over the SMs' reads of host
memory, so link-bound calls read in place and only compute-bound ones are staged. A GPU whose
profile has an invalid one is refused (``MachineModelError``, naming the file and the field): the
planner never plans with NaN or absurd costs.

Plain Python: ``DeviceInfo.current`` is the only function here that asks torch about the GPU,
once per step, and ``stream_capturing`` the only one that asks whether a CUDA graph is being
captured; the planner takes the frozen values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from directkv_cute import env

@dataclass(frozen=True)
class MachineModel:
    """The rates the cost model weighs (only their ratios steer a choice).

    link_gbps:            the SMs' reads of pinned host memory (the in-place kernels' ceiling)
    memcpy_gbps:          the copy engine's host-to-device rate (the staging copies)
    d2d_gbps:             device-to-device copies of pages already in HBM (read + write)
    chunked_tflops:       the multi-token (KV-outer chunk) kernel's attention rate in place
    q_tiled_tflops:       the Q-tiled kernel's attention rate
    q_tiled_read_gbps:    the Q-tiled kernel's reads of the staging buffer, where they bind
    partial_gbps:         a split's fp32 partials written and read back (a staged call's split)
    fold_gbps:            a split's fold once the copy has landed (the folds take turns)
    stage_overhead_ms:    a staged call's host work and first-piece latency beyond the model
    copy_call_ms:         one copy call of the copy engine
    flag_ms:              one ready flag written between pieces
    chunk_tail_ms:        the chunk kernel's time past the link (ramp, combine) ...
    chunk_tail_ms_per_token: ... and its growth per query token
    """

    name: str
    link_gbps: float
    memcpy_gbps: float
    d2d_gbps: float
    chunked_tflops: float
    q_tiled_tflops: float
    q_tiled_read_gbps: float
    partial_gbps: float
    fold_gbps: float
    stage_overhead_ms: float
    copy_call_ms: float
    flag_ms: float
    chunk_tail_ms: float
    chunk_tail_ms_per_token: float

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The rates, as a profile's ``machine:`` section names them."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "name")

    @classmethod
    def from_dict(cls, name: str, d) -> "MachineModel":
        """The model from a profile's ``machine:`` section: every rate, each a finite number in its
        range (``RATE_RANGES``), no other key; ``MachineModelError`` (a ValueError) naming each field
        that is not."""
        problems = machine_problems(d)
        if problems:
            raise MachineModelError("; ".join(f"{where}: {why}" for where, why in problems))
        return cls(name=name, **{k: float(d[k]) for k in cls.fields()})

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.fields()}


class MachineModelError(ValueError):
    """A machine model the planner may not plan with: a ``machine:`` section that is not a mapping
    of every rate (``MachineModel.fields()``) to a finite number in its range (``RATE_RANGES``)."""


# The range each rate may take, by its unit: (lowest, highest, unit). lowest None: the rate must
# be > 0 (the cost model divides by it); 0.0: it may be 0 (a time that costs nothing). The bounds
# lie far beyond any GPU's rates (an H200: link 51 GB/s, HBM 4.5 TB/s, 680 TFLOP/s, copy calls of
# microseconds): they catch a typo, a unit mix-up or a broken measurement, not a fast machine.
UNIT_RANGES = {"GB/s": (None, 1e5), "TFLOP/s": (None, 1e4), "ms": (0.0, 1e4)}


def _unit(rate: str) -> str:
    if rate.endswith("_gbps"):
        return "GB/s"
    if rate.endswith("_tflops"):
        return "TFLOP/s"
    if rate.endswith("_ms") or rate.endswith("_ms_per_token"):
        return "ms"
    raise AssertionError(f"machine model rate {rate!r} has no unit")  # a new field must get one


RATE_RANGES: dict[str, tuple[float | None, float, str]] = {
    k: (*UNIT_RANGES[_unit(k)], _unit(k)) for k in MachineModel.fields()}
MAX_UNKNOWN_SHOWN = 5  # unknown keys named one by one; the rest counted


def _shown(v) -> str:
    """A value for a problem's text, a long one described or cut (a hostile file cannot make the
    message huge)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**20:
        digits = len(str(abs(v))) if abs(v).bit_length() < 10000 else "thousands of"
        return f"an integer of {digits} digits"
    text = repr(v)
    return text if len(text) <= 60 else text[:60] + "..."


def machine_problems(d) -> list[tuple[str, str]]:
    """What is wrong with a profile's ``machine:`` section, as (field, why) pairs ("machine" or
    "machine.<rate>"); empty when the planner may plan with it. The one check of a machine model
    read from a profile: the loader (``directkv_cute.tuning.profiles``, so ``directkv-tune check``
    and ``show``), ``MachineModel.from_dict`` and the planner's ``tuning.lookup.machine_for`` use
    it. Each rate must be an int or a float (not a bool), finite, and in ``RATE_RANGES``; every
    rate must be there and no other key (keys of any type are named, never sorted against each other)."""
    if not isinstance(d, dict):
        return [("machine", f"must be a mapping of rate names to numbers, got {type(d).__name__}")]
    out = []
    fields = MachineModel.fields()
    missing = [k for k in fields if k not in d]
    if missing:
        out.append(("machine", f"missing rates {missing}"))
    unknown = [k for k in d if not (isinstance(k, str) and k in fields)]
    for k in unknown[:MAX_UNKNOWN_SHOWN]:
        out.append(("machine", f"unknown key {_shown(k)} (not a rate of the machine model)"))
    if len(unknown) > MAX_UNKNOWN_SHOWN:
        out.append(("machine", f"and {len(unknown) - MAX_UNKNOWN_SHOWN} more unknown keys"))
    for k in fields:
        if k not in d:
            continue
        v, (lo, hi, unit) = d[k], RATE_RANGES[k]
        where = f"machine.{k}"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            out.append((where, f"must be a number ({unit}), got {type(v).__name__} {_shown(v)}"))
        elif isinstance(v, float) and not math.isfinite(v):
            out.append((where, f"must be a finite number ({unit}), got {_shown(v)}"))
        elif lo is None and not v > 0:
            out.append((where, f"must be a positive number (> 0 {unit}), got {_shown(v)}"))
        elif lo is not None and v < lo:
            out.append((where, f"must be at least {lo:g} {unit}, got {_shown(v)}"))
        elif v > hi:
            out.append((where, f"must be at most {hi:g} {unit}, got {_shown(v)}"))
    return out


# The H200's rates, as shipped in profiles/NVIDIA_H200.yaml (``machine:``), measured on the H200
# (PCIe Gen5):
# - link_gbps, memcpy_gbps: SM reads of pinned host memory and the copy engine's H2D rate
#   (``python -m bench copy-rates``);
# - chunked_tflops: the chunk kernel in place over host pages, 221 TFLOP/s at 8k q2048 and 271 at
#   32k q2048; at 300 the model kept 8k q2048 in place (1.087 ms) where staged takes 0.815 ms;
# - q_tiled_tflops: the Q-tiled kernel (tile 128, 3 stages, pingpong, clusters of 2);
# - q_tiled_read_gbps: fitted to batch 64 over a shared 32k prompt, staged in 3.79 ms;
# - partial_gbps: 16 staged calls at 8k / 16k q2048 in 2-8 splits, about 7 us per split at q2048;
# - fold_gbps: the copy landed before the kernel started, per split about 7.6 us at q512 and 30 us
#   at q2048 over 8k-32k keys;
# - copy_call_ms: 32 MB in 1 / 4 / 16 contiguous calls 0.64 / 0.63 / 0.68 ms, in 128 calls of
#   256 KB 1.02 ms; flag_ms: 0.75-2 us per ready flag;
# - chunk_tail_ms(_per_token): the chunk kernel past the link, 0.028 / 0.026 ms at 8k / 16k q64,
#   0.09 / 0.10 at 8k / 16k q512.
# ``python -m bench prefill`` and ``python -m bench decode`` time the calls these were fitted to;
# their result files: ``git show 7747519:bench/results/``.
# ``directkv-tune machine`` measures these rates on another GPU and writes its profile's
# ``machine:`` (``directkv_cute.tuning.machine``: q_tiled_read_gbps, partial_gbps and fold_gbps
# scaled from the H200's by the measured HBM read rate).
H200 = MachineModel(
    name="NVIDIA H200", link_gbps=51.0, memcpy_gbps=54.8, d2d_gbps=1500.0, chunked_tflops=250.0,
    q_tiled_tflops=680.0, q_tiled_read_gbps=2800.0, partial_gbps=10000.0, fold_gbps=2200.0,
    stage_overhead_ms=0.03, copy_call_ms=0.0025, flag_ms=0.0015, chunk_tail_ms=0.025,
    chunk_tail_ms_per_token=1.3e-4)

# A GPU whose profile has no machine model: the copy engine is assumed no faster than the SMs'
# reads of host memory, so only calls whose compute binds are staged.
CONSERVATIVE = dataclasses.replace(H200, name="conservative default", memcpy_gbps=H200.link_gbps)

def staging_cap(total_memory: int) -> int:
    """Bytes a staging buffer may take: ``DIRECTKV_MAX_STAGING_GB``, else an eighth of the GPU."""
    cap = env.max_staging_bytes()
    return total_memory // 8 if cap is None else cap


def workspace_cap(total_memory: int) -> float:
    """Bytes the multi-token kernel's fp32 partials may take: ``DIRECTKV_MAX_WORKSPACE_GB``, else a
    quarter of the GPU."""
    cap = env.max_workspace_bytes()
    return total_memory / 4 if cap is None else float(cap)


@dataclass(frozen=True)
class DeviceInfo:
    """The facts about the GPU one plan is made for.

    name, sms, total_memory: the GPU's.
    capturing:     the plan runs inside a CUDA graph capture (no staging: its copies are planned
                   per call, and nothing may be allocated or copied from pageable memory).
    copies_ahead:  staged copies may run ahead of the current stream, each waiting only for the
                   recorded host writes to its pages (the cache records them and
                   ``DIRECTKV_STAGE_OVERLAP`` is on). Decided once per step, never from GPU timing.
    staging_cap:   bytes a staging buffer may take.
    workspace_cap: bytes the multi-token kernel's fp32 partials may take.
    """

    name: str
    sms: int
    total_memory: int
    capturing: bool = False
    copies_ahead: bool = False
    staging_cap: int = 0
    workspace_cap: float = 0.0

    def __post_init__(self):
        if not self.staging_cap:
            object.__setattr__(self, "staging_cap", staging_cap(self.total_memory))
        if not self.workspace_cap:
            object.__setattr__(self, "workspace_cap", workspace_cap(self.total_memory))

    def fits_staging(self, buffer_bytes: int, buffers: int = 1) -> bool:
        """Whether ``buffers`` staging buffers of ``buffer_bytes`` each fit the staging cap (a call
        whose copy runs ahead alternates between two)."""
        return buffers * buffer_bytes <= self.staging_cap

    @property
    def cpu(self) -> bool:
        """A CPU cache: the float32 reference runs (no kernel, nothing staged)."""
        return self.name == "cpu"

    @classmethod
    def for_cpu(cls) -> "DeviceInfo":
        return cls("cpu", 0, 0, staging_cap=1, workspace_cap=1.0)

    @classmethod
    def current(cls, device=None, cache=None) -> "DeviceInfo":
        """The current GPU (or ``device``'s), whether the current stream is capturing, and whether
        staged copies over ``cache`` may run ahead (it records its host writes, overlap on)."""
        import torch

        index = torch.device("cuda", torch.cuda.current_device()).index if device is None \
            else (torch.device(device).index or 0)
        name, sms, total = _properties(index)
        capturing = stream_capturing()
        overlap = env.stage_overlap()  # read first: a bad value is refused whatever the cache
        ahead = cache is not None and getattr(cache, "host_writes", None) is not None and overlap
        return cls(name, sms, total, capturing, ahead and not capturing)


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph: the one place that asks torch,
    once per plan (``DeviceInfo.current``) or per call (``runner.run``, ``kv_project``); the answer
    travels as a value from there."""
    import torch  # why: machine imports without torch (the profile tools read its rates)

    return torch.cuda.is_available() and bool(torch.cuda.is_current_stream_capturing())


_PROPS: dict = {}


def _properties(index: int) -> tuple[str, int, int]:
    got = _PROPS.get(index)
    if got is None:
        import torch

        p = torch.cuda.get_device_properties(index)
        got = _PROPS[index] = (torch.cuda.get_device_name(index), p.multi_processor_count, p.total_memory)
    return got
