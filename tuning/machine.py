"""``directkv-tune machine``: measure the planner's machine model on the current GPU.

The rates (``directkv_cute.machine.MachineModel``) are composed here from raw timings that a
*probe* object takes (``GpuProbes`` on a GPU; tests give fakes), so how timings become rates, the
write into the GPU's profile and the refusals run on a CPU:

* ``link_gbps``, ``memcpy_gbps``: the SMs' reads of a pinned host buffer and the copy engine's
  H2D rate from it (``directkv_cute.probes.measure_bandwidths``, the bench's ceilings);
* ``d2d_gbps``: bytes copied per second by strided 2-D device-to-device copies of whole pages
  (each byte read once and written once), as the staging copies pages already in HBM;
* ``copy_call_ms``: (128 copy calls of one 256 KB page each - one call of the same 32 MB) / 127;
  ``flag_ms``: (the 128 calls with a ready flag after each - without) / 128
  (``directkv_cute.probes.copy_pattern``, the bench's copy rates);
* ``chunked_tflops``: causal attention FLOPs / time of the multi-token kernel reading host pages in
  place, ``q_tiled_tflops``: of the Q-tiled kernel over HBM pages, both at ``KEYS`` keys x
  ``QUERIES`` queries of the Llama-3-8B head shape (bf16), each run through
  ``DirectKVAttention`` with its route forced (an explicit config, the pages' tier);
* ``chunk_tail_ms``, ``chunk_tail_ms_per_token``: the chunk kernel in place at ``TAIL_KEYS`` keys
  and q ``TAIL_QUERIES``: its time minus the link time of its bytes at ``link_gbps``, fitted as
  intercept + slope x query tokens through the two points;
* ``stage_overhead_ms``: a staged Q-tiled call (``STAGED_KEYS`` x ``STAGED_QUERIES``, pages on the
  host) timed, minus the planner's own estimate of it under the rates above with no overhead;
* ``q_tiled_read_gbps``, ``partial_gbps``, ``fold_gbps``: fitted to whole staged calls on the H200
  and bound by HBM, so scaled from the H200's values by the measured HBM read rate over the
  H200's ``H200_HBM_READ_GBPS``.

A difference that comes out below what the timing resolves (a flag cheaper than the noise) is
floored at ``FLOORS`` and said so. The profile's ``metadata.machine_sources`` records how each
rate was obtained.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from directkv_cute import plan as cm
from directkv_cute.machine import CONSERVATIVE, H200, MachineModel

from .lookup import clear_cache
from .profiles import Profile, make_metadata, profile_filename, save_profile

# The representative call shape: Llama-3-8B's heads, bf16, pages of 64 tokens.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, ELEM_BYTES = 32, 8, 128, 64, 2
KEYS, QUERIES = 32768, 2048  # the compute rates (compute-bound in place and over HBM)
TAIL_KEYS, TAIL_QUERIES = 8192, (64, 512)  # the chunk kernel's tail past the link
STAGED_KEYS, STAGED_QUERIES = 8192, 2048  # the staged call whose overhead is measured
COPY_PAGE, COPY_PAGES = 256 << 10, 128  # 32 MB of 256 KB pages (bench.copy_rates' pattern)
# The H200's HBM read rate (the bench's hbm_read ceiling) under which the scaled rates were fitted.
H200_HBM_READ_GBPS = 4475.0
SCALED = ("q_tiled_read_gbps", "partial_gbps", "fold_gbps")
SCALED_HOW = "scaled from H200 by HBM bandwidth"
# The smallest value a difference of timings is given (a rate must be positive).
FLOORS = {"copy_call_ms": 1e-4, "flag_ms": 1e-4, "chunk_tail_ms": 1e-3, "chunk_tail_ms_per_token": 1e-6,
          "stage_overhead_ms": 1e-3}


class MeasureError(RuntimeError):
    """A timing that cannot make a rate (zero, negative, not a number)."""


@dataclass(frozen=True)
class Measured:
    """The measured machine model, how each rate was obtained, and the raw timings."""

    model: MachineModel
    how: dict
    raw: dict


def flops(keys: int, queries: int) -> float:
    """Causal attention FLOPs of one sequence of ``keys`` keys whose last ``queries`` are queries."""
    return cm.causal_flops([keys], [queries], NUM_Q_HEADS, HEAD_DIM)


def kv_bytes(keys: int) -> int:
    """Bytes of K and V one layer of ``keys`` keys holds."""
    return cm.kv_bytes(keys, NUM_KV_HEADS, HEAD_DIM, ELEM_BYTES)


def _ms(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise MeasureError(f"{what}: timed {value!r} ms, not a positive time")
    return float(value)


def _rate(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise MeasureError(f"{what}: measured {value!r}, not a positive rate")
    return float(value)


def _floored(name: str, value: float, how: str, rates: dict, hows: dict) -> None:
    if value < FLOORS[name]:
        rates[name], hows[name] = FLOORS[name], f"{how}; {value:.3g} is below what the timing resolves: floored"
    else:
        rates[name], hows[name] = value, how


def measure_machine(probes, name: str, log=None) -> Measured:
    """The machine model of the GPU ``probes`` measures (see the module docstring)."""
    say = log or (lambda _msg: None)
    rates, how, raw = {}, {}, {}

    say("bandwidths: host read, memcpy H2D, HBM read")
    bw = probes.bandwidths()
    raw["bandwidths"] = dict(bw)
    rates["link_gbps"] = _rate(bw["host_read_gbps"], "host read")
    how["link_gbps"] = "measured: SMs' reads of pinned host memory (best of 3 reductions)"
    rates["memcpy_gbps"] = _rate(bw["memcpy_h2d_gbps"], "memcpy H2D")
    how["memcpy_gbps"] = "measured: copy engine, pinned host to device, one large copy"
    hbm = _rate(bw["hbm_read_gbps"], "HBM read")

    say("device-to-device page copies")
    nbytes, ms = probes.d2d()
    raw["d2d"] = {"bytes": nbytes, "ms": ms}
    rates["d2d_gbps"] = _rate(nbytes / (_ms(ms, "d2d copy") * 1e6), "d2d copy")
    how["d2d_gbps"] = "measured: strided 2-D copies of pages in HBM, bytes copied per second"

    say("copy calls and ready flags")
    c = probes.copy_calls()
    raw["copy_calls"] = dict(c)
    one, many, flagged = (_ms(c[k], f"copy pattern {k}") for k in ("one_ms", "many_ms", "flagged_ms"))
    n = int(c["many_calls"])
    if n < 2:
        raise MeasureError(f"copy pattern: {n} calls, need at least 2 for a per-call cost")
    _floored("copy_call_ms", (many - one) / (n - 1), f"measured: 32 MB in {n} calls vs 1, per extra call",
             rates, how)
    _floored("flag_ms", (flagged - many) / n, f"measured: {n} calls with vs without a ready flag each",
             rates, how)

    shape = f"{NUM_Q_HEADS}/{NUM_KV_HEADS} heads d{HEAD_DIM} bf16"
    say(f"chunk kernel in place, {KEYS} keys x {QUERIES} queries")
    ms = _ms(probes.chunk_ms(KEYS, QUERIES), "chunk kernel")
    raw["chunk_ms"] = ms
    rates["chunked_tflops"] = _rate(flops(KEYS, QUERIES) / (ms * 1e9), "chunk kernel")
    how["chunked_tflops"] = f"measured: chunk kernel in place, {KEYS // 1024}k keys x q{QUERIES}, {shape}, causal"

    say(f"Q-tiled kernel over HBM pages, {KEYS} keys x {QUERIES} queries")
    ms = _ms(probes.q_tiled_ms(KEYS, QUERIES), "Q-tiled kernel")
    raw["q_tiled_ms"] = ms
    rates["q_tiled_tflops"] = _rate(flops(KEYS, QUERIES) / (ms * 1e9), "Q-tiled kernel")
    how["q_tiled_tflops"] = f"measured: Q-tiled kernel over HBM pages, {KEYS // 1024}k keys x q{QUERIES}, {shape}"

    tails = {}
    for q in TAIL_QUERIES:
        say(f"chunk kernel in place, {TAIL_KEYS} keys x {q} queries")
        ms = _ms(probes.chunk_ms(TAIL_KEYS, q), f"chunk kernel at q{q}")
        raw[f"tail_q{q}_ms"] = ms
        tails[q] = ms - kv_bytes(TAIL_KEYS) / (rates["link_gbps"] * 1e6)
    q0, q1 = TAIL_QUERIES
    slope = (tails[q1] - tails[q0]) / (q1 - q0)
    pts = f"{TAIL_KEYS // 1024}k keys, q{q0} / q{q1}"
    _floored("chunk_tail_ms_per_token", slope, f"measured: chunk kernel past the link, slope over {pts}", rates, how)
    _floored("chunk_tail_ms", tails[q0] - q0 * rates["chunk_tail_ms_per_token"],
             f"measured: chunk kernel past the link at {pts}, intercept", rates, how)

    for k in SCALED:
        rates[k] = getattr(H200, k) * hbm / H200_HBM_READ_GBPS
        how[k] = f"{SCALED_HOW} ({hbm:.0f} / {H200_HBM_READ_GBPS:.0f} GB/s)"

    say(f"staged Q-tiled call, {STAGED_KEYS} keys x {STAGED_QUERIES} queries on the host")
    without = MachineModel(name=name, stage_overhead_ms=0.0, **rates)
    ms, estimate = probes.staged_ms(without, STAGED_KEYS, STAGED_QUERIES)
    raw["staged"] = {"ms": ms, "model_ms": estimate}
    _floored("stage_overhead_ms", _ms(ms, "staged call") - _ms(estimate, "staged estimate"),
             f"measured: staged call ({STAGED_KEYS // 1024}k keys x q{STAGED_QUERIES}) minus the model's estimate",
             rates, how)

    model = MachineModel.from_dict(name, {k: rates[k] for k in MachineModel.fields()})
    return Measured(model, {k: how[k] for k in MachineModel.fields()}, raw)


def rounded(model: MachineModel) -> dict:
    """The rates as the profile stores them: 4 significant digits."""
    return {k: float(f"{v:.4g}") for k, v in model.to_dict().items()}


def table_rows(measured: Measured) -> list[list[str]]:
    """One row per rate: its name, value and how it was obtained."""
    return [[k, f"{v:.4g}", measured.how[k]] for k, v in rounded(measured.model).items()]


def write_profile(output: Path, env: dict, measured: Measured) -> Path:
    """Write ``measured`` as the ``machine:`` section of ``env['gpu_name']``'s profile in
    ``output`` (merged with the file there: its entries kept), with ``metadata.machine_sources``."""
    bw = measured.raw.get("bandwidths", {})
    md = make_metadata({**env, "host_link_gbps": bw.get("memcpy_h2d_gbps"), "hbm_gbps": bw.get("hbm_read_gbps")},
                       objective="gpu", extra={"machine_sources": dict(measured.how)})
    path = Path(output) / profile_filename(env["gpu_name"])
    save_profile(Profile(metadata=md, path=path, machine=rounded(measured.model)), path)
    clear_cache()  # a lookup in this process sees the new machine model
    return path


# ---- the GPU probes ------------------------------------------------------------------------------


class GpuProbes:
    """The raw timings on the current CUDA GPU (CUDA events, warm-ups, medians). Refuses without
    CUDA (RuntimeError)."""

    HOST_BYTES = 1 << 30
    HBM_BYTES = 2 << 30
    D2D_BYTES = 512 << 20

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("machine: needs a CUDA GPU (torch.cuda.is_available() is False): the rates are "
                               "measured on the GPU they describe")
        self.torch = torch
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.gpu_name = torch.cuda.get_device_name()
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 60 << 20)
        self.env = {"gpu_name": self.gpu_name, "compute_capability": f"{props.major}.{props.minor}",
                    "sm_count": props.multi_processor_count,
                    "smem_optin_bytes": int(getattr(props, "shared_memory_per_block_optin", 0) or 232448)}

    def bandwidths(self) -> dict:
        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.probes import event_time_ms, measure_bandwidths

        return measure_bandwidths("cuda", self.HOST_BYTES, self.HBM_BYTES, event_time_ms)[0]

    def d2d(self) -> tuple[int, float]:
        import cuda.bindings.runtime as rt

        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.probes import event_time_ms

        torch, n = self.torch, self.D2D_BYTES
        src = torch.empty(2 * n, dtype=torch.uint8, device="cuda")  # pages of two layers: a page's pitch is 2x
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault

        def copy():
            rt.cudaMemcpy2DAsync(dst.data_ptr(), COPY_PAGE, src.data_ptr(), 2 * COPY_PAGE, COPY_PAGE, n // COPY_PAGE,
                                 kind, stream)

        ms = event_time_ms([copy])
        del src, dst
        torch.cuda.empty_cache()
        return n, ms

    def copy_calls(self) -> dict:
        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.probes import copy_pattern, event_time_ms

        torch = self.torch
        host = torch.empty(COPY_PAGES * COPY_PAGE, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device="cuda")
        flags = torch.zeros(4096, dtype=torch.int32, device="cuda")
        stream = torch.cuda.Stream()

        def time(pieces: int, flag: bool) -> float:
            return event_time_ms([lambda: copy_pattern(dev, host, flags, stream, COPY_PAGE, COPY_PAGE, pieces, flag)],
                                 warmup=3, reps=10, min_sample_ms=0.0, stream=stream)

        with torch.cuda.stream(stream):
            out = {"one_ms": time(1, False), "many_ms": time(COPY_PAGES, False),
                   "flagged_ms": time(COPY_PAGES, True), "many_calls": COPY_PAGES}
        torch.cuda.synchronize()
        return out

    # ---- the kernels, through DirectKVAttention with the route forced ----------------------------
    def _cache(self, keys: int, hbm: bool):
        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.cache import PagedKVCache

        torch = self.torch
        layer_bytes = kv_bytes(keys)
        layers = 1 if hbm else max(1, min(8, math.ceil(2 * self.l2_bytes / layer_bytes)))  # no host page from L2
        pages = math.ceil(keys / PAGE_SIZE)
        cache = PagedKVCache(layers, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, 1 if hbm else pages,
                             num_hbm_pages=pages if hbm else 0, dtype=torch.bfloat16, device="cuda")
        seq = cache.add_sequence()
        cache.extend(seq, keys, tier="hbm" if hbm else "host")
        (cache.hbm_pool if hbm else cache.host_pool_cuda).normal_()
        return cache, cache.kernel_tables([seq]), layers

    def _time(self, keys: int, queries: int, hbm: bool, config_of, machine, route: str):
        """(ms per call, plan) of one call over a fresh cache, ``config_of(cache, tables)`` its config."""
        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.attention import DirectKVAttention

        torch = self.torch
        cache, tables, layers = self._cache(keys, hbm)
        try:
            dk = DirectKVAttention(cache, machine=machine)
            plan = dk.plan(tables=tables, q_lens=[queries], num_q_heads=NUM_Q_HEADS,
                           config=config_of(cache, tables), cascade=False)
            if plan.route != route:
                raise MeasureError(f"planned route {plan.route!r}, not {route!r}: {'; '.join(plan.why)}")
            qs = [torch.randn(queries, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                  for _ in range(layers)]
            outs = [torch.empty_like(q) for q in qs]
            # loads torch: only the GPU probes need it, the rest of this module runs without it
            from directkv_cute.probes import event_time_ms

            ms = event_time_ms([lambda i=i: dk.run(qs[i], i, outs[i]) for i in range(layers)], warmup=3, reps=7)
            torch.cuda.synchronize()
            return ms, plan
        finally:
            torch.cuda.synchronize()
            cache.close()
            torch.cuda.empty_cache()

    def _configs(self):
        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.planner import ProfileConfigs

        return ProfileConfigs(self.gpu_name)

    def _shape(self, cache, tables, queries: int):
        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.planner import CallShape

        return CallShape.of(cache, tables, [queries], NUM_Q_HEADS)

    def chunk_ms(self, keys: int, queries: int) -> float:
        """The multi-token kernel reading host pages in place, with the profile's config."""
        group = NUM_Q_HEADS // NUM_KV_HEADS

        def config(cache, tables):
            return self._configs().get("multi_token", self._shape(cache, tables, queries), group, 1, keys, queries,
                                       quiet=True)[0]

        return self._time(keys, queries, False, config, CONSERVATIVE, "multi_token")[0]

    def q_tiled_ms(self, keys: int, queries: int) -> float:
        """The Q-tiled kernel over HBM pages (every page in HBM: the planner runs it), the profile's config."""
        return self._time(keys, queries, True, lambda cache, tables: None, CONSERVATIVE, "q_tiled_hbm")[0]

    def staged_ms(self, machine: MachineModel, keys: int, queries: int) -> tuple[float, float]:
        """(ms, the planner's estimate under ``machine``) of a staged Q-tiled call over host pages."""
        # loads torch: only the GPU probes need it, the rest of this module runs without it
        from directkv_cute.planner import q_tiled_config

        group = NUM_Q_HEADS // NUM_KV_HEADS

        def config(cache, tables):
            return q_tiled_config(self._configs(), self._shape(cache, tables, queries), group, 1, keys, queries)

        ms, plan = self._time(keys, queries, False, config, machine, "q_tiled_staged")
        if plan.choice is None:
            raise MeasureError("the staged plan carries no estimate")
        return ms, plan.choice.staged_ms


def gpu_probes() -> GpuProbes:
    """The current GPU's probes (RuntimeError without CUDA)."""
    return GpuProbes()


__all__ = ["FLOORS", "GpuProbes", "H200_HBM_READ_GBPS", "MeasureError", "Measured", "SCALED", "SCALED_HOW",
           "gpu_probes", "measure_machine", "rounded", "table_rows", "write_profile"]
