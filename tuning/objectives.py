"""What the tuner minimises: ``measure(config, shape, reps=None) -> dict``.

The returned dict has ``ok`` (bool), ``p50_us`` (median time of one call, microseconds, when ok)
and ``err`` (a message when not ok); optionally ``p20_us``, ``p80_us``, ``reps``, and ``fatal``
(True when the process can measure nothing more, e.g. a sticky CUDA error: the tuner records
the failure and stops so that the run can be resumed in a fresh process).

* :class:`ModelledObjective` -- a deterministic cost model of the decode kernel over a PCIe
  link (and, for ``kernel="q_tiled"``, a roofline of the Q-tiled kernel over HBM pages:
  :class:`QTiledModel`) plus seeded noise. For CPU tests and ``--objective model`` demos; its
  numbers are not measurements and its profiles carry ``objective: model`` and a GPU name of
  their own.
* :class:`GpuObjective` -- builds a PagedKVCache filled with random data (host pages; all pages
  in HBM for the Q-tiled kernel, which reads HBM: staged calls run the same kernel over a
  buffer of copied pages), checks the config's numerics against
  ``directkv_cute.reference.paged_attention_ref``, then times
  ``directkv_cute.paged_attention_tables(..., config=cfg)`` with CUDA events.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import statistics
import time
from dataclasses import dataclass

import directkv_cute
from directkv_cute.config import SM90_NUM_SMS, SM90_SMEM_PER_BLOCK_OPTIN

from .space import TuneShape, get_space, torch_dtype


def _quantile(sorted_vals, q):
    if not sorted_vals:
        return float("nan")
    i = (len(sorted_vals) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (i - lo)


def summarize(times_us) -> dict:
    s = sorted(times_us)
    return {"p50_us": statistics.median(s), "p20_us": _quantile(s, 0.2), "p80_us": _quantile(s, 0.8), "reps": len(s)}


# ---- cost model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareModel:
    """Parameters of the cost model (defaults: the H200 on PCIe Gen5 of the design notes)."""

    gpu_name: str = "Modelled H200 PCIe5"
    compute_capability: str = "9.0"
    sm_count: int = SM90_NUM_SMS
    smem_optin_bytes: int = SM90_SMEM_PER_BLOCK_OPTIN
    link_gbps: float = 51.2  # kernel loads from pinned host memory
    hbm_gbps: float = 4400.0
    launch_us: float = 4.0  # launch + prologue of the attention kernel
    combine_launch_us: float = 2.5  # the split-combine kernel
    host_latency_us: float = 3.0  # latency of a host read over the link (Little's law)
    sm_link_gbps: float = 1.2  # host read bandwidth one SM can sustain
    tile_overhead_us: float = 0.12  # barriers / softmax bookkeeping per KV tile per CTA
    sm_tflops: float = 7.5  # dense bf16 WGMMA per SM
    l1_penalty: float = 0.04  # slowdown with no L1 left (carveout 100)
    max_threads_per_sm: int = 2048


@dataclass(frozen=True)
class QTiledModel:
    """Constants of the Q-tiled kernel's cost model (``ModelledObjective`` with kernel "q_tiled").

    Not measurements: round numbers of the right order for an H200 (dense bf16 WGMMA of
    ``HardwareModel.sm_tflops`` per SM), chosen so that each tuned field has the effect its
    mechanism suggests:

    * a KV tile of ``tile_n`` keys costs the 128 query rows' two GEMMs (4 x 128 x tile_n x d FLOPs
      at the SM's rate), the part of the softmax (``softmax_share`` of the GEMMs) not hidden behind
      the other warpgroup's GEMMs (``pingpong_hidden`` with pingpong, ``overlap_hidden`` without),
      the pingpong handshake and a fixed ``tile_overhead_us`` (barriers, bookkeeping): larger
      tiles amortise the overhead;
    * the ring keeps ``stages - 1`` tiles loading while one is consumed; a tile's load takes
      ``load_latency_us`` plus its bytes at ``sm_feed_gbps`` (the query tiles of a KV head share
      its tiles through the L2; a cluster of two pulls each tile once for both), so a step takes the longest of the compute, the transfer, and
      the load spread over the tiles in flight;
    * each CTA adds ``cta_setup_us`` (Q load, first tile, epilogue) and its first tile's load;
    * CTAs (one per SM: 128 query rows, O in registers) are placed heaviest first (the kernel's
      launch order) on the SM that frees first; the call is the last SM's finish, at least the
      KV bytes at the HBM rate, plus the launch; a launch of more than ``max_scheduled_ctas``
      CTAs takes list scheduling's bound instead (the mean load per SM plus one heaviest CTA),
      so the model's work does not grow with the batch;
    * the carveout has no modelled effect beyond legality (the kernel's loads are TMA into SMEM).
    """

    softmax_share: float = 0.45
    pingpong_hidden: float = 0.85
    overlap_hidden: float = 0.5
    pingpong_sync_us: float = 0.03
    tile_overhead_us: float = 0.06
    load_latency_us: float = 1.0
    sm_feed_gbps: float = 80.0
    cta_setup_us: float = 2.0
    rows: int = 128  # query rows per CTA (two consumer warpgroups of 64)
    max_scheduled_ctas: int = 1 << 16  # placed one by one up to this many; beyond, the bound

    def tile_us(self, cfg, head_dim: int, sm_tflops: float) -> float:
        """Compute time of one KV tile of one CTA (microseconds)."""
        gemm = 4 * self.rows * cfg.tile_n * head_dim / (sm_tflops * 1e6)
        hidden = self.pingpong_hidden if cfg.pingpong else self.overlap_hidden
        exposed = self.softmax_share * gemm * (1.0 - hidden) + (self.pingpong_sync_us if cfg.pingpong else 0.0)
        return gemm + exposed + self.tile_overhead_us

    def step_us(self, cfg, head_dim: int, elem_bytes: int, sm_tflops: float) -> tuple[float, float]:
        """(time per KV tile in steady state, time of the first tile's load), microseconds."""
        compute = self.tile_us(cfg, head_dim, sm_tflops)
        # A cluster's CTAs pull each tile from L2 once between them (TMA multicast).
        xfer = 2 * cfg.tile_n * head_dim * elem_bytes / (self.sm_feed_gbps * 1e3) / cfg.cluster
        inflight = max(1.0, cfg.stages - 1)
        return max(compute, xfer, (self.load_latency_us + xfer) / inflight), self.load_latency_us + xfer


_CHUNK_EFF = ((256, 0.24), (1024, 0.96), (4096, 1.0))  # gathered host pages: 12.4 / 49.3 / 51 GB/s


def _chunk_efficiency(nbytes: int) -> float:
    if nbytes >= _CHUNK_EFF[-1][0]:
        return 1.0
    if nbytes <= _CHUNK_EFF[0][0]:
        return _CHUNK_EFF[0][1] * nbytes / _CHUNK_EFF[0][0]
    for (b0, e0), (b1, e1) in zip(_CHUNK_EFF, _CHUNK_EFF[1:]):
        if b0 <= nbytes <= b1:
            f = (math.log2(nbytes) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return e0 + f * (e1 - e0)
    return 1.0


class ModelledObjective:
    """Deterministic decode-time model + seeded log-normal noise (a stand-in for a GPU).

    time = launch + sum over waves of max(wave bytes / achieved bandwidth, per-CTA serial time)
           x L1 penalty(carveout) + split-combine cost,
    where a wave's bandwidth is the least of the link (scaled by the page-chunk efficiency),
    the active SMs x a per-SM cap, and Little's law on the bytes in flight (active CTAs x
    (stages - 1) x K+V tile bytes / link latency); the per-CTA serial time is the latency plus
    per-tile overhead and WGMMA work. ``kernel="q_tiled"`` models the Q-tiled kernel over HBM
    pages instead (:meth:`q_tiled_us`, constants in :class:`QTiledModel`); the other kernels use
    the model above, each judged legal by its own space.
    ``fail`` (optional) maps (config, shape) to an error message to inject failures.
    """

    name = "model"

    def __init__(self, hw: HardwareModel | None = None, *, seed: int = 0, noise: float = 0.02, reps: int = 10,
                 fail=None, kernel: str = "decode", q_tiled: QTiledModel | None = None):
        self.hw = hw or HardwareModel()
        self.q_tiled = q_tiled or QTiledModel()
        self.seed = seed
        self.noise = noise
        self.reps = reps
        self.fail = fail
        self.kernel = kernel
        self.calls = 0

    def environment(self) -> dict:
        hw = self.hw
        return {
            "gpu_name": hw.gpu_name,
            "compute_capability": hw.compute_capability,
            "sm_count": hw.sm_count,
            "smem_optin_bytes": hw.smem_optin_bytes,
            "host_link_gbps": hw.link_gbps,
            "hbm_gbps": hw.hbm_gbps,
        }

    def model_us(self, cfg, shape: TuneShape) -> float:
        """Noise-free modelled time of one call (microseconds)."""
        if self.kernel == "q_tiled":
            return self.q_tiled_us(cfg, shape)
        hw = self.hw
        d, elem = shape.head_dim, shape.elem_bytes
        splits = cfg.splits_for(shape.batch, shape.num_kv_heads, shape.context, hw.sm_count)
        n_tiles = math.ceil(shape.context / cfg.tile_n)
        tiles_per_cta = math.ceil(n_tiles / splits)
        ctas = splits * shape.num_kv_heads * shape.batch
        resident = min(cfg.resident_ctas(d, elem), hw.max_threads_per_sm // cfg.num_threads)
        if resident < 1:
            raise ValueError(f"{cfg} cannot be resident on an SM")
        slots = resident * hw.sm_count
        tile_bytes = 2 * cfg.tile_n * d * elem
        tokens = min(n_tiles * cfg.tile_n, math.ceil(shape.context / shape.page_size) * shape.page_size)
        cta_bytes = 2 * shape.num_kv_heads * shape.batch * tokens * d * elem / ctas
        chunk_eff = _chunk_efficiency(min(shape.page_size, cfg.tile_n) * d * elem)
        link = hw.link_gbps * 1e3 * chunk_eff  # bytes per microsecond
        flops_tile = 4 * cfg.rows * cfg.tile_n * d
        tile_us = hw.tile_overhead_us + flops_tile / (hw.sm_tflops * 1e6)
        cta_serial = hw.host_latency_us + cfg.stages * 0.05 + tiles_per_cta * tile_us
        # wave by wave: the link is shared by the CTAs of the wave; few CTAs cannot fill it
        # (Little's law on the bytes in flight, and a per-SM cap on host read bandwidth)
        def wave_us(active):
            sms = min(hw.sm_count, active)
            inflight = active * max(1, cfg.stages - 1) * tile_bytes
            bw = min(link, sms * hw.sm_link_gbps * 1e3, inflight / hw.host_latency_us)
            return max(active * cta_bytes / bw, cta_serial)

        full, rest = divmod(ctas, slots)  # full waves cost alike: the time does not grow with them
        t_main = full * wave_us(slots) + (wave_us(rest) if rest else 0.0)
        l1 = 1.0 + hw.l1_penalty * max(0.0, (cfg.carveout - 80) / 20) ** 2
        t = hw.launch_us + t_main * l1
        if splits > 1:
            partial = splits * shape.batch * shape.num_q_heads * shape.q_len * (d + 1) * 4
            t += hw.combine_launch_us + 2 * partial / (hw.hbm_gbps * 1e3)
        return t

    def q_tiled_us(self, cfg, shape: TuneShape) -> float:
        """Noise-free modelled time of one Q-tiled call over HBM pages (:class:`QTiledModel`):
        each sequence's last ``q_len`` tokens of ``context``, every sequence alike."""
        import heapq

        hw, m = self.hw, self.q_tiled
        d, elem = shape.head_dim, shape.elem_bytes
        per_tile = max(1, m.rows // shape.group)  # query tokens of one CTA
        q_len = min(shape.q_len, shape.context)
        step, first = m.step_us(cfg, d, elem, hw.sm_tflops)
        cta_us = []
        for j in range(math.ceil(q_len / per_tile)):
            keys = shape.context - q_len + min(q_len, (j + 1) * per_tile)  # seen by the tile's last token
            cta_us.append(m.cta_setup_us + first + math.ceil(keys / cfg.tile_n) * step)
        cta_us.sort(reverse=True)  # heaviest first, as the kernel launches them
        copies = shape.num_kv_heads * shape.batch
        if len(cta_us) * copies <= m.max_scheduled_ctas:
            free = [0.0] * hw.sm_count
            for t in cta_us:
                for _ in range(copies):
                    heapq.heapreplace(free, free[0] + t)
            busy = max(free)
        else:  # list scheduling's bound: the mean load plus at most one more CTA
            busy = sum(cta_us) * copies / hw.sm_count + (1 - 1 / hw.sm_count) * cta_us[0]
        kv_bytes = shape.kv_bytes()
        return hw.launch_us + max(busy, kv_bytes / (hw.hbm_gbps * 1e3))

    def _rng(self, cfg, shape, reps) -> random.Random:
        key = f"{self.seed}|{sorted(cfg.to_dict().items())}|{shape}|{reps}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def __call__(self, cfg, shape: TuneShape, reps: int | None = None) -> dict:
        self.calls += 1
        if self.fail is not None:
            msg = self.fail(cfg, shape)
            if msg:
                return {"ok": False, "err": str(msg)}
        problems = get_space(self.kernel).problems(cfg, shape)
        if problems:
            return {"ok": False, "err": "; ".join(problems)}
        base = self.model_us(cfg, shape)
        n = int(reps or self.reps)
        rng = self._rng(cfg, shape, n)
        times = [base * math.exp(self.noise * rng.gauss(0.0, 1.0)) for _ in range(n)]
        out = summarize(times)
        out.update(ok=True, err=None)
        return out


# ---- real measurement on the GPU -------------------------------------------------------------


def _replace_tables(tables, page_table, seq_lens):
    """A KernelTables like ``tables`` with other page_table / seq_lens (dataclass, namedtuple or
    plain); where it has host copies of them (``host_table``, ``host_seq_lens``: the staging plan
    and the Q-tiled route read those), they are replaced too."""
    extra = {}
    if getattr(tables, "host_table", None) is not None:
        extra["host_table"] = page_table.cpu().numpy()
    if getattr(tables, "host_seq_lens", None) is not None:
        extra["host_seq_lens"] = tuple(int(n) for n in seq_lens.tolist())
    if dataclasses.is_dataclass(tables):
        return dataclasses.replace(tables, page_table=page_table, seq_lens=seq_lens, **extra)
    if hasattr(tables, "_replace"):
        return tables._replace(page_table=page_table, seq_lens=seq_lens, **extra)
    return type(tables)(page_table, seq_lens)


class _Setup:
    """Cache, tables and inputs for one shape (kept while configs for that shape are measured)."""

    def __init__(self):
        self.shape = None
        self.cache_key = None
        self.cache = None
        self.tables = None
        self.seq_ids = None
        self.qs = []
        self.outs = []
        self.q_lens = None
        self.layers = 1
        self.check_rows = []  # sequence indices b checked against the reference
        self.ref = None  # (rows, reference output of layer 0 for check_rows)
        self.distinct = 0


def _cache_key(shape: TuneShape):
    # everything but the query heads: presets that differ only in GQA group share one cache
    return (shape.num_kv_heads, shape.head_dim, shape.page_size, shape.dtype, shape.batch, shape.context, shape.q_len)


class GpuObjective:
    """Time the op on the GPU (CUDA events), after a numerics check of the same launch.

    For a shape, one PagedKVCache is built per the contract: ``layers`` layers so that the
    rotated working set is >= ``l2_factor`` x L2 (each repetition reads another layer and another
    q), as many distinct sequences as fit ``max_host_bytes`` of pinned memory (beyond that the
    remaining sequences reuse those pages through page tables rotated by a fraction of the
    sequence, so concurrent CTAs still read different pages), pool contents ~ N(0, 1) written
    from the GPU through ``host_pool_cuda``. Shapes that differ only in the number of query heads
    reuse the cache (sort buckets so they are adjacent). Each new config first runs once on
    NaN-poisoned outputs: every output must be finite and the first and last distinct sequences
    must match the float32 reference within ``rtol`` (relative Frobenius error). Then ``warmup``
    calls and a number of timed calls auto-scaled to about ``target_ms`` of kernel time, within
    [min_reps, max_reps]; a ``torch.cuda._sleep`` ahead of the timed calls keeps the host's
    launch overhead out of the events. p50/p20/p80 of the per-call times are returned; ``reps``
    given (the tuner's re-benchmark) fixes the number of timed calls.

    ``kernel="q_tiled"``: every page is in the HBM tier (the kernel reads HBM; over host pages
    the op stages them into an HBM buffer and runs the same kernel), as many distinct sequences
    as fit ``max_hbm_bytes`` (default: a quarter of the GPU's memory), and the config is forced
    (an explicit ``QTiledConfig`` always runs the Q-tiled kernel; over HBM pages in one split).

    ``device="cpu"`` runs the same steps on the CPU with wall-clock timing (a smoke test of the
    harness: the op runs its reference path there); ``op`` replaces
    ``directkv_cute.paged_attention_tables``.
    """

    name = "gpu"
    RTOL = {"bf16": 2e-2, "fp16": 1e-2}

    def __init__(self, *, device=None, op=None, warmup: int = 2, min_reps: int = 3, max_reps: int = 100,
                 target_ms: float = 150.0, max_host_bytes: int = 40 << 30, l2_factor: float = 2.0, max_layers: int = 8,
                 check: bool = True, rtol: float | None = None, seed: int = 0, kernel: str = "decode",
                 max_hbm_bytes: int | None = None):
        import torch

        self.torch = torch
        self.device = torch.device(device or "cuda")
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError("GpuObjective needs a CUDA GPU (use --objective model for a CPU demo)")
        self.warmup, self.min_reps, self.max_reps = warmup, min_reps, max_reps
        self.target_ms = target_ms
        self.max_host_bytes = max_host_bytes
        self.max_hbm_bytes = max_hbm_bytes
        self.l2_factor, self.max_layers = l2_factor, max_layers
        self.check, self.rtol, self.seed, self.kernel = check, rtol, seed, kernel
        self._setup = _Setup()
        self._checked = set()
        self._env = None
        if op is None:
            op = getattr(directkv_cute, "paged_attention_tables", None)
            if op is None:
                # loads torch and the kernels: the modelled objective and the CLI import without them
                from directkv_cute.ops import paged_attention_tables as op  # clear ImportError if missing
        self.op = op

    # ---- environment -----------------------------------------------------------------------
    def environment(self) -> dict:
        if self._env is None:
            torch = self.torch
            if not self.cuda:
                import platform

                self._env = {"gpu_name": f"CPU {platform.machine()} (harness smoke test)", "compute_capability": "",
                             "sm_count": SM90_NUM_SMS, "smem_optin_bytes": SM90_SMEM_PER_BLOCK_OPTIN,
                             "l2_bytes": 60 << 20, "host_link_gbps": None, "hbm_gbps": None}
                return self._env
            props = torch.cuda.get_device_properties(self.device)
            self._env = {
                "gpu_name": torch.cuda.get_device_name(self.device),
                "compute_capability": f"{props.major}.{props.minor}",
                "sm_count": props.multi_processor_count,
                "smem_optin_bytes": int(getattr(props, "shared_memory_per_block_optin", 0) or SM90_SMEM_PER_BLOCK_OPTIN),
                "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 60 << 20),
                "host_link_gbps": self._measure_h2d_gbps(),
                "hbm_gbps": self._measure_hbm_gbps(),
            }
        return self._env

    def _time_ms(self, fn, reps=5):
        torch = self.torch
        fn()
        torch.cuda.synchronize(self.device)
        best = float("inf")
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e))
        return best

    def _measure_h2d_gbps(self, nbytes: int = 512 << 20) -> float:
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        ms = self._time_ms(lambda: dst.copy_(src, non_blocking=True))
        del src, dst
        return nbytes / (ms * 1e-3) / 1e9

    def _measure_hbm_gbps(self, nbytes: int = 2 << 30) -> float:
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        ms = self._time_ms(lambda: dst.copy_(src))
        del src, dst
        torch.cuda.empty_cache()
        return 2 * nbytes / (ms * 1e-3) / 1e9

    def _sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    # ---- per-shape setup ---------------------------------------------------------------------
    def close(self) -> None:
        """Drop the cache and inputs of the current shape (frees the pinned pool)."""
        cache = self._setup.cache
        if cache is not None and hasattr(cache, "close"):
            try:
                self._sync()
                cache.close()
            except Exception:  # freeing must not fail a run
                pass
        self._setup = _Setup()
        self._checked.clear()
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()

    def _prepare(self, shape: TuneShape) -> _Setup:
        st = self._setup
        if st.shape == shape:
            return st
        if st.cache_key != _cache_key(shape):
            self.close()
            st = self._build_cache(shape)
        self._build_inputs(st, shape)
        self._setup = st
        return st

    def _build_cache(self, shape: TuneShape) -> _Setup:
        torch = self.torch
        # loads torch: the modelled objective and the CLI import without it
        from directkv_cute.cache import PagedKVCache

        dt = torch_dtype(shape.dtype)
        env = self.environment()
        ps, d, hkv, elem = shape.page_size, shape.head_dim, shape.num_kv_heads, shape.elem_bytes
        pages_per_seq = math.ceil(shape.context / ps)
        page_bytes_layer = hkv * 2 * ps * d * elem
        layer_bytes = shape.batch * pages_per_seq * page_bytes_layer
        layers = max(1, min(self.max_layers, math.ceil(self.l2_factor * env["l2_bytes"] / layer_bytes)))
        hbm = self.kernel == "q_tiled"  # the Q-tiled kernel reads HBM pages
        budget = self._hbm_budget() if hbm else self.max_host_bytes
        seq_bytes = pages_per_seq * page_bytes_layer * layers
        distinct = max(1, min(shape.batch, budget // seq_bytes))
        if distinct < shape.batch and layers > 1:
            layers = 1
            seq_bytes = pages_per_seq * page_bytes_layer
            distinct = max(1, min(shape.batch, budget // seq_bytes))

        fp8 = self.kernel == "decode_fp8"
        page_dt = {"dtype": torch.float8_e4m3fn, "compute_dtype": dt} if fp8 else {"dtype": dt}
        n_pages = distinct * pages_per_seq
        cache = PagedKVCache(layers, hkv, d, ps, 1 if hbm else n_pages, num_hbm_pages=n_pages if hbm else 0,
                             device=str(self.device), **page_dt)
        seq_ids = []
        for _ in range(distinct):
            s = cache.add_sequence()
            if hbm:
                cache.extend(s, shape.context, tier="hbm")
            else:
                cache.extend(s, shape.context)
            seq_ids.append(s)
        # random K/V everywhere (never zeros); from the GPU through the UVA view when there is one
        if hbm:
            pool = cache.hbm_pool
        else:
            pool = cache.host_pool_cuda if getattr(cache, "host_pool_cuda", None) is not None else cache.host_pool
        gen = torch.Generator(device=pool.device)
        gen.manual_seed(self.seed)
        chunk = max(1, (256 << 20) // max(1, pool[0].numel() * elem))
        for i in range(0, pool.shape[0], chunk):
            if fp8:
                # e4m3 bytes of either sign, no NaN (0x7f / 0xff), and a scale per row
                raw = pool[i:i + chunk].view(torch.uint8)
                raw.random_(0, 254, generator=gen)
                raw.masked_fill_(raw == 0x7F, 0x7E)
            else:
                pool[i:i + chunk].normal_(generator=gen)
        if fp8:
            scales = cache.host_scales_cuda if cache.host_scales_cuda is not None else cache.host_scales
            scales.uniform_(0.5 / 448, 2.0 / 448, generator=gen)
        self._sync()

        tables = cache.kernel_tables(seq_ids)
        if distinct < shape.batch:
            base = tables.page_table
            reuse = math.ceil(shape.batch / distinct)
            step = max(1, pages_per_seq // reuse)
            rows = []
            for b in range(shape.batch):
                row = base[b % distinct].clone()
                row[:pages_per_seq] = torch.roll(row[:pages_per_seq], shifts=(b // distinct) * step)
                rows.append(row)
            page_table = torch.stack(rows)
            seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=base.device)
            tables = _replace_tables(tables, page_table, seq_lens)

        st = _Setup()
        st.cache_key, st.cache, st.tables, st.seq_ids = _cache_key(shape), cache, tables, seq_ids
        st.layers, st.distinct = layers, distinct
        st.check_rows = sorted({0, distinct - 1})
        return st

    def _hbm_budget(self) -> int:
        """Bytes of HBM pages the Q-tiled objective may allocate."""
        if self.max_hbm_bytes is not None:
            return int(self.max_hbm_bytes)
        if self.cuda:
            return self.torch.cuda.get_device_properties(self.device).total_memory // 4
        return self.max_host_bytes

    def _build_inputs(self, st: _Setup, shape: TuneShape) -> None:
        torch = self.torch
        dt = torch_dtype(shape.dtype)
        gq = torch.Generator(device=self.device)
        gq.manual_seed(self.seed + 1)
        n_q = shape.batch * shape.q_len
        st.qs = [torch.randn((n_q, shape.num_q_heads, shape.head_dim), generator=gq, device=self.device, dtype=dt)
                 for _ in range(st.layers)]
        st.outs = [torch.empty_like(q) for q in st.qs]
        st.q_lens = None if shape.q_len == 1 else [shape.q_len] * shape.batch
        st.ref = None
        st.shape = shape
        self._checked.clear()

    def _reference(self, st: _Setup):
        if st.ref is None:
            # loads torch: the modelled objective and the CLI import without it
            from directkv_cute.reference import paged_attention_ref

            torch = self.torch
            q_len = st.shape.q_len
            rows = torch.cat([torch.arange(b * q_len, (b + 1) * q_len) for b in st.check_rows]).to(self.device)
            q = st.qs[0].index_select(0, rows)
            ids = [st.seq_ids[b] for b in st.check_rows]
            q_lens = None if q_len == 1 else [q_len] * len(ids)
            out, _lse = paged_attention_ref(q, st.cache, 0, ids, q_lens=q_lens)
            st.ref = (rows, out.float())
        return st.ref

    def _call(self, st: _Setup, cfg, i: int):
        return self.op(st.qs[i], st.cache, i, st.tables, q_lens=st.q_lens, config=cfg, out=st.outs[i])

    def _numerics(self, st: _Setup, cfg) -> str | None:
        torch = self.torch
        st.outs[0].fill_(float("nan"))  # poison: rows the kernel forgets stay NaN
        res = self._call(st, cfg, 0)
        self._sync()
        out = res[0] if isinstance(res, (tuple, list)) else res
        if not isinstance(out, torch.Tensor):
            out = st.outs[0]
        if tuple(out.shape) != tuple(st.qs[0].shape):
            return f"numerics: output shape {tuple(out.shape)} != q shape {tuple(st.qs[0].shape)}"
        if not bool(torch.isfinite(out).all()):
            bad = int((~torch.isfinite(out)).sum())
            return f"numerics: {bad} non-finite output values (NaN-poisoned output not fully written?)"
        rows, ref = self._reference(st)
        got = out.index_select(0, rows).float()
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        tol = self.rtol if self.rtol is not None else self.RTOL.get(st.shape.dtype, 2e-2)
        if not err <= tol:
            return f"numerics: relative error {err:.3g} > {tol:g} against the float32 reference"
        return None

    def _timed(self, st: _Setup, cfg, n: int) -> list[float]:
        """Per-call times (microseconds) of n calls rotating over the input sets."""
        torch = self.torch
        if not self.cuda:
            times = []
            for r in range(n):
                t0 = time.perf_counter()
                self._call(st, cfg, r % st.layers)
                times.append((time.perf_counter() - t0) * 1e6)
            return times
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:  # ~100 us of GPU time per call to enqueue (2000 cycles ~ 1 us), <= 200 ms
            sleep(int(min(200_000, 100 * n) * 2000))
        for r in range(n):
            starts[r].record()
            self._call(st, cfg, r % st.layers)
            ends[r].record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    # ---- the objective -----------------------------------------------------------------------
    def __call__(self, cfg, shape: TuneShape, reps: int | None = None) -> dict:
        problems = get_space(self.kernel).problems(cfg, shape)
        if problems:
            return {"ok": False, "err": "illegal: " + "; ".join(problems)}
        try:
            st = self._prepare(shape)
        except Exception as e:  # setup problems are not the config's fault: stop the run
            return {"ok": False, "fatal": True, "err": f"setup for {shape.describe()} failed: {type(e).__name__}: {e}"}
        try:
            key = tuple(sorted(cfg.to_dict().items()))
            if self.check and key not in self._checked:
                msg = self._numerics(st, cfg)
                if msg:
                    return {"ok": False, "err": msg}
                self._checked.add(key)
            for w in range(self.warmup):
                self._call(st, cfg, w % st.layers)
            self._sync()
            t0 = time.perf_counter()
            self._call(st, cfg, 0)
            self._sync()
            est_ms = max(1e-3, (time.perf_counter() - t0) * 1e3)
            n = int(reps) if reps else min(self.max_reps, max(self.min_reps, math.ceil(self.target_ms / est_ms)))
            times = self._timed(st, cfg, n)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            if self.cuda:
                try:
                    self.torch.cuda.synchronize(self.device)
                except Exception as e2:  # sticky CUDA error: this process can measure nothing more
                    return {"ok": False, "fatal": True,
                            "err": f"{err} (CUDA context lost: {e2}; resume in a new process)"}
            return {"ok": False, "err": err}
        out = summarize(times)
        out.update(ok=True, err=None)
        return out


__all__ = ["GpuObjective", "HardwareModel", "ModelledObjective", "QTiledModel", "summarize"]
