"""The device side of the paged KV cache: the page pools and every data movement into, out of
and between them.

* ``host_pool``: one exact-size allocation (``PinnedHostBuffer``: anonymous ``mmap``, zero-filled,
  ``cudaHostRegister``-ed, no power-of-two rounding). ``host_pool_cuda`` aliases it as a CUDA
  tensor (zero-copy, through UVA); it is what GPU kernels and GPU-side writes use.
* ``hbm_pool``: the HBM tier's pages, then the window's (mirrors), on the cache device.
* ``device="cpu"``: ``host_pool`` is an ordinary CPU tensor, ``host_pool_cuda`` is None and the
  "HBM" tier is a second CPU pool, so every path runs in CPU tests.
* FP8 pages: scale pools beside the page pools (``host_scales`` / ``host_scales_cuda`` /
  ``hbm_scales``, float32 (pages, L, Hkv, 2, page_size)); every store quantizes and stores a
  token's bytes with its scale, every page copy copies the scales, every gather dequantizes.

Stores of GPU tensors go straight into the destination pages (host pages through
``host_pool_cuda``: the GPU stores into host memory over the link), one indexed copy per pool
through the package's one store path (``cache.store``: the rows a ``StoreIndex`` names). All
data movement is enqueued on the current CUDA stream, except ``copy_back``, which the
copy engine runs on a side stream (``host_current`` orders the current stream after it). Every
host-page write is noted in ``log`` (``HostWriteLog``).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from directkv_cute._pinned import PinnedHostBuffer
from directkv_cute.cache.host_writes import HostWriteLog
from directkv_cute.cache.pages import Tier, check_tier, decode_page
from directkv_cute.cache.store import StoreIndex, store_rows
from directkv_cute.config import SUPPORTED_HEAD_DIMS
from directkv_cute.fp8 import FP8_DTYPES, SCALE_DTYPE, dequantize, quantize

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
CPU_ONLY_DTYPES = (torch.float32,)  # the reference path only (no kernel reads float32 pages)
PAGE_DTYPES = SUPPORTED_DTYPES + FP8_DTYPES  # page storage; FP8 pages take compute_dtype K/V


def page_bytes(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page of every layer costs: K and V rows, plus FP8 pages' float32 token scales."""
    rows = num_layers * num_kv_heads * 2 * page_size
    return rows * head_dim * torch.empty((), dtype=dtype).element_size() + (rows * SCALE_DTYPE.itemsize
                                                                           if dtype in FP8_DTYPES else 0)


def resolve_dtypes(dtype: torch.dtype, compute_dtype: torch.dtype | None,
                   device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(page dtype, compute dtype) after the checks: bf16/fp16 pages take K/V of their own dtype,
    FP8 pages bf16 (default) or fp16 K/V; float32 pages and K/V on device='cpu' too."""
    if dtype not in PAGE_DTYPES and not (dtype in CPU_ONLY_DTYPES and device.type == "cpu"):
        extra = f" ({', '.join(map(str, CPU_ONLY_DTYPES))} on device='cpu' too)"
        raise TypeError(f"dtype must be one of {PAGE_DTYPES}{extra}, got {dtype}")
    if dtype in FP8_DTYPES:
        compute_dtype = torch.bfloat16 if compute_dtype is None else compute_dtype
        if compute_dtype not in SUPPORTED_DTYPES and not (compute_dtype in CPU_ONLY_DTYPES and
                                                          device.type == "cpu"):
            raise TypeError(f"compute_dtype of FP8 pages must be one of {SUPPORTED_DTYPES} (float32 on "
                            f"device='cpu' too), got {compute_dtype}")
    elif compute_dtype is not None and compute_dtype != dtype:
        raise TypeError(f"compute_dtype {compute_dtype} differs from the page dtype {dtype}: only FP8 pages "
                        f"({', '.join(map(str, FP8_DTYPES))}) take K/V of another dtype")
    return dtype, dtype if compute_dtype is None else compute_dtype


def resolve_device(device: torch.device, head_dim: int) -> torch.device:
    """The cache device with its index ("cuda" -> the current device), or a clear error."""
    if device.type == "cuda":
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim}: the GPU kernels support head dims {SUPPORTED_HEAD_DIMS} "
                             "(device='cpu' runs the reference with any multiple of 8)")
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but CUDA is not available (use device='cpu')")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device.type != "cpu":
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device}")
    return device


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes (uint8, same shape): torch's indexed copies and stores do not
    all take float8 dtypes, and a byte copy is exact."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


class DevicePools:
    """The page (and FP8 scale) pools of both tiers and the window, and the stores, gathers and
    copies over them. Page indices here are physical (the page book decides them)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 capacity: dict[str, int], num_window_pages: int, dtype: torch.dtype,
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.compute_dtype, self.device = dtype, compute_dtype, device
        self.fp8 = dtype in FP8_DTYPES
        self.num_window_pages = num_window_pages
        self.num_host_pages = capacity["host"]
        # One page: (num_layers, num_kv_heads, 2, page_size, head_dim).
        self.page_shape = (num_layers, num_kv_heads, 2, page_size, head_dim)
        # FP8: one float32 scale per token per KV head per K/V, (num_layers, num_kv_heads, 2, page_size).
        self.scale_shape = self.page_shape[:-1] if self.fp8 else None
        self.page_data_bytes = math.prod(self.page_shape) * dtype.itemsize
        self.page_scale_bytes = math.prod(self.scale_shape) * SCALE_DTYPE.itemsize if self.fp8 else 0
        self.page_bytes = page_bytes(num_layers, num_kv_heads, page_size, head_dim, dtype)
        # Every size as a Python int, checked before anything is allocated: a pool no machine can
        # address is one MemoryError naming its bytes, not an overflow deep in an allocator.
        host_bytes = capacity["host"] * self.page_data_bytes
        hbm_pages = capacity["hbm"] + num_window_pages
        hbm_bytes = hbm_pages * (self.page_data_bytes + self.page_scale_bytes)
        for what, nbytes in ((f"host tier ({capacity['host']} pages of {self.page_bytes} bytes)",
                              capacity["host"] * self.page_bytes),
                             (f"HBM tier and window ({hbm_pages} pages of {self.page_bytes} bytes)", hbm_bytes)):
            if nbytes > sys.maxsize:
                raise MemoryError(f"the {what} needs {nbytes} bytes ({nbytes / 2**30:.3g} GiB), more than an "
                                  f"allocation can address ({sys.maxsize} bytes); nothing was allocated")
        cuda = device if device.type == "cuda" else None
        try:
            self._host_buffer = PinnedHostBuffer(host_bytes, cuda)
        except (OSError, MemoryError, RuntimeError) as exc:
            raise MemoryError(
                f"cannot allocate and pin {host_bytes} bytes ({host_bytes / 2**30:.1f} GiB) of host memory for "
                f"{capacity['host']} pages of {self.page_bytes} bytes: {exc}") from exc
        # (num_host_pages, L, Hkv, 2, page_size, d), CPU; pinned and mapped on CUDA.
        self.host_pool = self._host_buffer.tensor.view(dtype).view(capacity["host"], *self.page_shape)
        # Same shape, a CUDA alias of host_pool's memory (None on CPU).
        self.host_pool_cuda = (self._host_buffer.cuda_view(dtype).view(capacity["host"], *self.page_shape)
                               if cuda is not None else None)
        # (num_hbm_pages + num_window_pages, L, Hkv, 2, page_size, d) on the cache device: the HBM
        # tier, then the window that mirrors pages being written.
        self._scale_buffer = self.host_scales = self.host_scales_cuda = self.hbm_scales = None
        try:
            self.hbm_pool = torch.zeros((hbm_pages, *self.page_shape), dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            self._host_buffer.close()
            raise MemoryError(f"cannot allocate {hbm_bytes} bytes ({hbm_bytes / 2**30:.3g} GiB) on {device} for "
                              f"{hbm_pages} HBM and window pages of {self.page_bytes} bytes: {exc}") from exc
        # FP8 scales (num_pages, L, Hkv, 2, page_size) float32: host (pinned, mapped) and HBM + window.
        if self.fp8:
            scale_bytes = capacity["host"] * self.page_scale_bytes
            try:
                self._scale_buffer = PinnedHostBuffer(scale_bytes, cuda)
            except (OSError, MemoryError, RuntimeError) as exc:
                self._host_buffer.close()
                raise MemoryError(f"cannot allocate and pin {scale_bytes} bytes of host memory for the FP8 "
                                  f"scales of {capacity['host']} pages: {exc}") from exc
            self.host_scales = self._scale_buffer.tensor.view(SCALE_DTYPE).view(capacity["host"], *self.scale_shape)
            self.host_scales_cuda = (self._scale_buffer.cuda_view(SCALE_DTYPE).view(capacity["host"],
                                                                                    *self.scale_shape)
                                     if cuda is not None else None)
            try:
                self.hbm_scales = torch.zeros((hbm_pages, *self.scale_shape), dtype=SCALE_DTYPE, device=device)
            except (RuntimeError, MemoryError) as exc:
                self._host_buffer.close()
                self._scale_buffer.close()
                raise MemoryError(f"cannot allocate the FP8 scales of {hbm_pages} HBM and window pages on "
                                  f"{device}: {exc}") from exc
        self.log = HostWriteLog(device)
        self._copy_stream = self._copy_done = None
        self._copy_pending = False

    @property
    def host_pinned(self) -> bool:
        return self._host_buffer.registered

    def close(self) -> None:
        """Unpin the host pools (after any copy still landing in them)."""
        if self._copy_pending:  # no copy may land in memory that is no longer pinned
            self._copy_done.synchronize()
            self._copy_pending = False
        self.host_pool_cuda = self.host_scales_cuda = None
        self._host_buffer.close()
        if self._scale_buffer is not None:
            self._scale_buffer.close()

    # ---- pools ---------------------------------------------------------------------------
    def pool(self, tier: Tier) -> torch.Tensor:
        """The tier's pool on the cache device (``host_pool_cuda`` for host on CUDA)."""
        if check_tier(tier) == "hbm":
            return self.hbm_pool
        return self.host_pool if self.host_pool_cuda is None else self.host_pool_cuda

    def scales(self, tier: Tier) -> torch.Tensor | None:
        """The tier's FP8 scale pool on the cache device (None for bf16/fp16 pages)."""
        if check_tier(tier) == "hbm" or not self.fp8:
            return self.hbm_scales
        return self.host_scales if self.host_scales_cuda is None else self.host_scales_cuda

    # ---- stores and gathers --------------------------------------------------------------
    def check_kv(self, k: torch.Tensor, v: torch.Tensor, tail: tuple[int, ...], expected: str) -> int:
        """Validate a K/V pair of shape (n, *tail); return n."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
            if t.dtype != self.compute_dtype:
                if self.fp8:
                    raise TypeError(f"{name} has dtype {t.dtype}, the cache takes {self.compute_dtype} K/V "
                                    f"({self.dtype} pages)")
                raise TypeError(f"{name} has dtype {t.dtype}, the cache holds {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the cache is on {self.device}")
            if t.dim() != len(tail) + 1 or tuple(t.shape[1:]) != tail:
                sizes = ", ".join(map(str, tail))
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected} = (n, {sizes})")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
        return k.shape[0]

    def encode(self, k: torch.Tensor, v: torch.Tensor):
        """(K, V, K scales, V scales) as the pages store them: (n, ..., d) in the page dtype (FP8 as
        bytes, with scales (n, ...) float32 per row), else as given (scales None)."""
        k, v = k.detach(), v.detach()  # the pools never join an autograd graph
        if not self.fp8:
            return k, v, None, None
        (qk, sk), (qv, sv) = quantize(k, self.dtype), quantize(v, self.dtype)
        return _raw(qk), _raw(qv), sk, sv

    def store(self, index: StoreIndex, start: int, k: torch.Tensor, v: torch.Tensor, host_pages):
        """Store k, v at the rows ``index`` names from row ``start`` on (``store.layer_start`` of
        the layer stored; 0 for an index of every layer), HBM pages and mirrors included, and note
        the write to ``host_pages``. Returns the K that was stored, (K, K scales) as ``encode``
        gives them (the page summaries take their K from it)."""
        ke, ve, ks, vs = self.encode(k, v)
        store_rows(index, ke, ve, _raw(self.pool("host")), _raw(self.hbm_pool), start=start, k_scales=ks,
                   v_scales=vs, host_scales=self.scales("host"), hbm_scales=self.hbm_scales)
        self.log.record(host_pages)
        return ke, ks

    def gather(self, tier: Tier, pidx, lsel, off) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at pages ``pidx``, rows ``off`` of ``tier``, in the compute dtype."""
        pool = self.pool(tier)
        if not self.fp8:
            return pool[pidx, lsel, :, 0, off], pool[pidx, lsel, :, 1, off]
        raw, scales = _raw(pool), self.scales(tier)
        return tuple(dequantize(raw[pidx, lsel, :, kv, off].view(self.dtype), scales[pidx, lsel, :, kv, off],
                                self.compute_dtype) for kv in (0, 1))

    def read(self, parts, lsel, n: int, token_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (n, *token_shape) of the rows ``parts`` (``TokenSlots`` parts) name."""
        if len(parts) == 1:  # one tier: the gathers are the result
            tier, _, pidx, off = parts[0]
            return self.gather(tier, pidx, lsel, off)
        k = torch.empty((n, *token_shape), dtype=self.compute_dtype, device=self.device)  # (n, [L,] Hkv, d)
        v = torch.empty_like(k)
        for tier, tok, pidx, off in parts:
            k[tok], v[tok] = self.gather(tier, pidx, lsel, off)
        return k, v

    # ---- page copies ---------------------------------------------------------------------
    def copy_page(self, src: int, dst: int) -> None:
        """Copy a whole page (all layers; encoded entries) on the cache device, current stream.

        An indexed-copy kernel rather than ``copy_``: ``copy_`` between two CUDA tensors is a
        device-to-device memcpy, which is not specified for host memory reached through UVA;
        a kernel's loads and stores are.
        """
        (src_tier, si), (dst_tier, di) = decode_page(src), decode_page(dst)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)  # (1,)
        dst_page = _raw(self.pool(dst_tier))[di : di + 1]  # (1, L, Hkv, 2, page_size, d)
        dst_page.index_copy_(0, zero, _raw(self.pool(src_tier))[si : si + 1])
        if self.fp8:
            self.scales(dst_tier)[di : di + 1].index_copy_(0, zero, self.scales(src_tier)[si : si + 1])
        if dst_tier == "host":
            self.log.record(np.array([di], np.int64))

    def copy_back(self, layer: int, runs) -> None:
        """Copy one layer of mirrored pages into their host pages: (window page, host page, pages)
        runs, by the copy engine on the side stream after the current stream's work so far (on a
        CPU cache: now)."""
        if not runs:
            return
        if self.device.type != "cuda":
            for w, h, count in runs:
                _raw(self.host_pool)[h : h + count, layer] = _raw(self.hbm_pool)[w : w + count, layer]
                if self.fp8:
                    self.host_scales[h : h + count, layer] = self.hbm_scales[w : w + count, layer]
            return
        import cuda.bindings.runtime as rt

        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        cur = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(cur)
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        pools = [(self.host_pool, self.hbm_pool, self.page_data_bytes)]
        if self.fp8:
            pools.append((self.host_scales, self.hbm_scales, self.page_scale_bytes))
        for host_pool, hbm_pool, pitch in pools:
            width = pitch // self.num_layers  # one layer of one page
            host = host_pool.data_ptr() + layer * width
            dev = hbm_pool.data_ptr() + layer * width
            for w, h, count in runs:
                err, = rt.cudaMemcpy2DAsync(host + h * pitch, pitch, dev + w * pitch, pitch, width, count, kind,
                                            self._copy_stream.cuda_stream)
                if err != rt.cudaError_t.cudaSuccess:
                    raise RuntimeError(f"cudaMemcpy2DAsync of mirrored pages to the host failed: {err}")
        self._copy_done = torch.cuda.Event()  # a new one: the record of host writes keeps it
        self._copy_done.record(self._copy_stream)
        self._copy_pending = True
        self.log.record(np.concatenate([np.arange(h, h + count) for _, h, count in runs]), self._copy_done)

    def host_current(self) -> None:
        """Make the current stream wait for the copies ``copy_back`` queued."""
        if self._copy_pending:
            torch.cuda.current_stream(self.device).wait_event(self._copy_done)
            self._copy_pending = False
