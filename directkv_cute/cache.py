"""Paged KV cache in pinned host memory, with an optional HBM tier (see docs/CONTRACT.md).

Layout
------
A *page* holds ``page_size`` consecutive tokens of one sequence for every layer and KV head. Each
tier is one pool tensor of shape ``(num_pages, num_layers, num_kv_heads, 2, page_size, head_dim)``
(``2`` = K then V), so for one (page, layer, kv_head) the K rows and then the V rows form one
contiguous piece of ``2 * page_size * head_dim * elem`` bytes -- at least 4 KB for the kernel
shapes (page 16, d 64), the size from which randomly ordered host pages stream over PCIe at full
speed. Pieces start at multiples of their size from a page-aligned base, hence 16-byte aligned.

* ``host_pool``: one exact-size allocation (``PinnedHostBuffer``: anonymous ``mmap``, zero-filled,
  ``cudaHostRegister``-ed, no power-of-two rounding). ``host_pool_cuda`` aliases it as a CUDA
  tensor (zero-copy, through UVA); it is what GPU kernels and GPU-side writes use.
* ``hbm_pool``: ``num_hbm_pages`` pages (possibly 0) on the cache device.
* ``device="cpu"`` (no CUDA): ``host_pool`` is an ordinary CPU tensor, ``host_pool_cuda`` is None
  and the "HBM" tier is a second CPU pool, so every code path -- mixed tiers included -- runs in
  CPU tests.

Page tables
-----------
Each sequence has a list of page-table entries in logical order; ``e >= 0`` is host page ``e``,
``e < 0`` is HBM page ``-e - 1`` (``encode_page`` / ``decode_page``). Pages are reference-counted
per tier; a page with refcount 0 is on its tier's free list, and a page never appears twice in
one table. A sequence of length ``n`` owns exactly ``ceil(n / page_size)`` pages.

Design choices
--------------
* **Fork** shares the full pages (refcount + 1) and copies the partial last page *immediately*,
  so the last page of every sequence -- the one appends and fused kernels write to -- is always
  private and writers that bypass this class (kernels) cannot leak into a fork. Any later
  ``write`` into a page that is still shared first gives the writer its own copy of that page
  (copy-on-write), so sharers never see each other's writes.
* **move_pages** moves the *physical* page: the data is copied once to a new page of the target
  tier, every sequence sharing the page is repointed to it (sharing and refcount carry over),
  and the old page returns to its free list. Nobody's view of the data changes.
* **set_hbm_fraction** places ``floor(fraction * num_pages + 0.5)`` pages of a sequence in HBM and the
  rest in host memory, either the most recent pages (``"recent"``) or evenly spread pages
  (``"strided"``, which gives every split of the kernel a share of both tiers).
* **Capacity**: every operation computes how many free pages it needs per tier and raises
  ``CacheCapacityError`` before it modifies anything.
* **Window mirrors** (``num_window_pages``): pages a step is writing can get an HBM copy, a
  *mirror*, from a window of extra pages at the end of ``hbm_pool`` (``mirror``). Every write to a
  mirrored page goes to both (write-through), and the kernel tables name the mirror while the
  host page is private, so the attention reads the step's own new K/V from HBM and each new token
  crosses the link once, host-bound. ``release_mirrors`` drops the mirrors of full pages (their
  host copies are current); a sequence's partial last page keeps its mirror from step to step, so
  after the first step nothing is copied into the window. Structural changes (fork, truncate,
  move, free) keep the mirrors consistent or drop them.
* **Writes** of GPU tensors go straight into the destination pages -- host pages through
  ``host_pool_cuda`` (the GPU stores into host memory over the link), no staging buffer -- as a
  few advanced-index stores covering all touched pages. All data movement (writes, copies,
  moves) is enqueued on the current CUDA stream; host-side reads of ``host_pool`` must
  synchronise first (``read`` works on the device and needs no care).
* **Host writes are recorded** (``host_writes``): every write path notes the host pages it
  enqueues a write to, so that a staged attention call (``directkv_cute.staging``) copies a host
  page only after the writes recorded for it, and the rest of its copy need not wait for the
  current stream (it overlaps the previous layer's kernel). A caller that writes host pages by
  other means (``kv_project`` into ``kv_proj.cache_destinations``, a kernel of its own) calls
  ``note_host_write`` after enqueueing the write, on the same stream.

FP8 pages
---------
``dtype=torch.float8_e4m3fn`` (or ``float8_e5m2``) stores the pages in FP8 (``directkv_cute.fp8``
states the format): K/V are written and read in ``compute_dtype`` (bf16 by default) and quantized
as they are stored, one float32 scale per token per KV head per K/V. The scales live in scale
pools beside the page pools, ``host_scales`` (pinned and mapped like ``host_pool``;
``host_scales_cuda`` its CUDA alias) and ``hbm_scales`` (the HBM tier and the window), of shape
``(num_pages, num_layers, num_kv_heads, 2, page_size)``: for one (page, layer, kv_head) the K
scales then the V scales form one contiguous piece of ``8 * page_size`` bytes. Every write path
stores a token's bytes and its scale together (a mirror and its host page get the same bytes),
every page copy (fork, copy-on-write, move, mirror set-up and copy-back) copies the scales with
the page, and ``read`` dequantizes. ``page_bytes`` counts the scales.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from directkv_cute._pinned import PinnedHostBuffer
from directkv_cute.config import SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES
from directkv_cute.fp8 import FP8_DTYPES, SCALE_DTYPE, dequantize, quantize

MAX_HOST_WRITES = 256  # recorded host writes kept apart; more are merged into one
Tier = Literal["host", "hbm"]
TIERS: tuple[Tier, ...] = ("host", "hbm")
PLACEMENTS = ("recent", "strided")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
CPU_ONLY_DTYPES = (torch.float32,)  # the reference path only (no kernel reads float32 pages)
PAGE_DTYPES = SUPPORTED_DTYPES + FP8_DTYPES  # page storage; FP8 pages take compute_dtype K/V
_MAX_PAGES = 2**31 - 1  # page ids must fit int32 entries


class CacheCapacityError(ValueError):
    """A tier has too few free pages for the operation; the cache was left unchanged."""


class StaleTablesError(ValueError):
    """Kernel tables from another cache, or built before pages they name were freed or moved."""


class UnknownSequenceError(KeyError):
    """The sequence id is not (or no longer) in the cache."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


def encode_page(tier: Tier, index: int) -> int:
    """Page-table entry of page ``index`` of ``tier``: host -> index, HBM -> -index - 1."""
    return index if tier == "host" else -index - 1


def decode_page(entry: int) -> tuple[Tier, int]:
    """Inverse of ``encode_page``: (tier, page index)."""
    return ("host", entry) if entry >= 0 else ("hbm", -entry - 1)


class KernelTables(NamedTuple):
    """Per-batch page tables for the kernels, on the cache device.

    page_table: int32 (B, max_pages) -- encoded entries; past a sequence's pages, its last page
                repeats (a valid page, so a stray read is harmless).
    seq_lens:   int32 (B,)
    """

    page_table: torch.Tensor  # int32 (B, max_pages)
    seq_lens: torch.Tensor  # int32 (B,)
    cache_id: int = 0  # id() of the cache that built them (0: unknown, not checked)
    generation: int = -1  # the cache's page generation when they were built (-1: not checked)
    host_seq_lens: tuple | None = None  # the lengths on the host, for checks without a device read
    host_table: object = None  # numpy int32 (B, max_pages): page_table on the host (staging plans)
    # Calls over these tables come back to back in long runs (a model step's layers): a staged
    # chunk called while the previous staged call still runs is planned for its copy running
    # ahead (``ops._pipelined``), which pays one kernel's time once per run to fill the pipeline.
    back_to_back: bool = False

    @property
    def is_hbm(self) -> torch.Tensor:
        """bool (B, max_pages): True where the entry is an HBM page."""
        return self.page_table < 0

    def num_pages(self, page_size: int) -> torch.Tensor:
        """int32 (B,): pages each sequence owns, ``ceil(seq_len / page_size)``."""
        return torch.div(self.seq_lens + (page_size - 1), page_size, rounding_mode="floor")


@dataclass(frozen=True)
class TokenSlots:
    """Destinations of a batch of token rows, by tier (see ``PagedKVCache.token_slots``).

    parts: (tier, tok, pidx, off) per destination: ``tok`` int64 (m,) the rows it takes, or None
    when all rows go there; ``pidx`` int64 (m,) their pages; ``off`` int64 (m,) their rows within
    the page. All on the cache device. A token whose page has a window mirror goes to the mirror
    (a part of tier "hbm") and to its host page, the part in ``mirrored``; ``runs`` (window page,
    host page, pages) cover those pages, for copying them instead (``write_slots(defer_host=True)``).
    """

    total: int
    parts: tuple
    mirrored: tuple = ()
    runs: tuple = ()
    host_pages: np.ndarray | None = None  # int64: the distinct host pages the rows go to (mirrored ones too)

    @staticmethod
    def build(entry: np.ndarray, off: np.ndarray, device, mirror: np.ndarray | None = None) -> "TokenSlots":
        """From per-token page entries and rows (``token_entries``); ``mirror`` int64 (total,):
        each token's HBM window page (``mirror_entries``, -1: none) -- a second destination."""
        total = len(entry)
        in_hbm = entry < 0
        mirrored = np.zeros(total, bool) if mirror is None else mirror >= 0
        plain, mir = np.flatnonzero(~in_hbm & ~mirrored), np.flatnonzero(mirrored)
        hbm = np.flatnonzero(in_hbm)
        # (tier, tokens, their pages): host pages, HBM pages, window mirrors, then the mirrored
        # tokens' host pages (the part ``defer_host`` leaves to the copy engine).
        groups = [g for g in (("host", plain, entry[plain]), ("hbm", hbm, -entry[hbm] - 1),
                              ("hbm", mir, mirror[mir] if len(mir) else mir), ("host", mir, entry[mir])) if len(g[1])]
        host_pages = np.unique(entry[~in_hbm]).astype(np.int64)
        if not groups:
            return TokenSlots(0, (), host_pages=host_pages)
        dev = torch.from_numpy(np.concatenate([a for _, tok, pidx in groups for a in (tok, pidx, off[tok])]))
        dev = dev.to(device, non_blocking=True)  # staged by the driver before it returns; no wait for the GPU
        parts, at = [], 0
        for tier, tok, _ in groups:
            m = len(tok)
            parts.append((tier, None if m == total else dev[at : at + m], dev[at + m : at + 2 * m],
                          dev[at + 2 * m : at + 3 * m]))
            at += 3 * m
        if not len(mir):
            return TokenSlots(total, tuple(parts), host_pages=host_pages)
        runs: list[list[int]] = []  # (window page, host page, pages) over the distinct pairs, in order
        for w, h in dict.fromkeys(zip(mirror[mir].tolist(), entry[mir].tolist())):
            if runs and runs[-1][0] + runs[-1][2] == w and runs[-1][1] + runs[-1][2] == h:
                runs[-1][2] += 1
            else:
                runs.append([w, h, 1])
        return TokenSlots(total, tuple(parts[:-1]), (parts[-1],), tuple(map(tuple, runs)), host_pages)


@dataclass(frozen=True)
class CacheState:
    """A deep snapshot of the cache's bookkeeping (not its data), comparable with ``==``."""

    seq_lens: dict[int, int]
    page_tables: dict[int, tuple[int, ...]]
    refcounts: dict[str, tuple[int, ...]]  # tier -> refcount of every page
    free_lists: dict[str, tuple[int, ...]]  # tier -> free page ids, in allocation (pop) order
    mirrors: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # seq -> (logical page, window page)
    free_window: tuple[int, ...] = ()


@dataclass
class _Sequence:
    """One sequence: its page-table entries and token count, plus a cached int32 copy."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    _table: np.ndarray | None = None  # int32 (len(pages),), rebuilt after a change
    mirrors: dict[int, int] = field(default_factory=dict)  # logical page -> its HBM window page

    def set_entry(self, index: int, entry: int) -> None:
        self.pages[index] = entry
        self._table = None

    def add_entries(self, entries: list[int]) -> None:
        self.pages.extend(entries)
        self._table = None

    def table(self) -> np.ndarray:
        if self._table is None:
            self._table = np.asarray(self.pages, dtype=np.int32)
        return self._table


def _locked(method):
    """Run a cache method under the cache's lock: every operation is atomic for concurrent callers,
    and runs after the host copies ``write_slots(defer_host=True)`` queued (current stream order)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            self._host_current()
            return method(self, *args, **kwargs)

    return run


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes (uint8, same shape): torch's indexed copies and stores do not
    all take float8 dtypes, and a byte copy is exact."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def page_bytes(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page of every layer costs: K and V rows, plus FP8 pages' float32 token scales."""
    rows = num_layers * num_kv_heads * 2 * page_size
    return rows * head_dim * torch.empty((), dtype=dtype).element_size() + (rows * SCALE_DTYPE.itemsize
                                                                           if dtype in FP8_DTYPES else 0)


def _check_int(value: object, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class PagedKVCache:
    """Whole-model paged KV cache: host tier in pinned memory, optional HBM tier.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (head_dim a multiple of 8, so that every
            row is 16-byte aligned).
        page_size: tokens per page, one of 16, 32, 64, 128.
        num_host_pages: capacity of the host tier (>= 1); allocated and pinned once, exactly.
        num_hbm_pages: capacity of the HBM tier (may be 0).
        dtype: the page dtype: torch.bfloat16 or torch.float16, or torch.float8_e4m3fn /
            torch.float8_e5m2 (FP8 pages with per-token scales; see "FP8 pages" above).
        compute_dtype: the dtype of the K/V that ``write``/``append``/``write_slots`` take and
            ``read`` returns: ``dtype`` for bf16/fp16 pages (the default; nothing else is
            accepted), bf16 (default) or fp16 (float32 on device='cpu' too) for FP8 pages.
        device: "cuda" / "cuda:N" (pinned, GPU-mapped host pool; HBM pool on that GPU) or "cpu"
            (everything in ordinary CPU tensors).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_host_pages: int,
        num_hbm_pages: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
        num_window_pages: int = 0,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_layers = _check_int(num_layers, "num_layers", 1)
        self.num_kv_heads = _check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = _check_int(head_dim, "head_dim", 8)
        if self.head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 (16-byte rows), got {head_dim}")
        self.page_size = _check_int(page_size, "page_size", 1)
        if self.page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
        capacity = {
            "host": _check_int(num_host_pages, "num_host_pages", 1),
            "hbm": _check_int(num_hbm_pages, "num_hbm_pages", 0),
        }
        window = _check_int(num_window_pages, "num_window_pages", 0)
        for tier, n in capacity.items():
            if n + (window if tier == "hbm" else 0) > _MAX_PAGES:
                raise ValueError(f"{tier} tier: {n} pages do not fit int32 page-table entries")
        device = torch.device(device)
        if dtype not in PAGE_DTYPES and not (dtype in CPU_ONLY_DTYPES and device.type == "cpu"):
            extra = f" ({', '.join(map(str, CPU_ONLY_DTYPES))} on device='cpu' too)"
            raise TypeError(f"dtype must be one of {PAGE_DTYPES}{extra}, got {dtype}")
        self.fp8 = dtype in FP8_DTYPES
        if self.fp8:
            compute_dtype = torch.bfloat16 if compute_dtype is None else compute_dtype
            if compute_dtype not in SUPPORTED_DTYPES and not (compute_dtype in CPU_ONLY_DTYPES and
                                                              device.type == "cpu"):
                raise TypeError(f"compute_dtype of FP8 pages must be one of {SUPPORTED_DTYPES} (float32 on "
                                f"device='cpu' too), got {compute_dtype}")
        elif compute_dtype is not None and compute_dtype != dtype:
            raise TypeError(f"compute_dtype {compute_dtype} differs from the page dtype {dtype}: only FP8 pages "
                            f"({', '.join(map(str, FP8_DTYPES))}) take K/V of another dtype")
        self.dtype = dtype
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        if device.type == "cuda":
            if self.head_dim not in SUPPORTED_HEAD_DIMS:
                raise ValueError(f"head_dim {self.head_dim}: the GPU kernels support head dims {SUPPORTED_HEAD_DIMS} "
                                 "(device='cpu' runs the reference with any multiple of 8)")
            if not torch.cuda.is_available():
                raise RuntimeError("device='cuda' but CUDA is not available (use device='cpu')")
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        elif device.type != "cpu":
            raise ValueError(f"device must be a CUDA device or 'cpu', got {device}")
        self.device = device

        # One page: (num_layers, num_kv_heads, 2, page_size, head_dim).
        self.page_shape = (self.num_layers, self.num_kv_heads, 2, self.page_size, self.head_dim)
        # FP8: one float32 scale per token per KV head per K/V, (num_layers, num_kv_heads, 2, page_size).
        self.scale_shape = self.page_shape[:-1] if self.fp8 else None
        self.page_data_bytes = math.prod(self.page_shape) * dtype.itemsize
        self.page_scale_bytes = math.prod(self.scale_shape) * SCALE_DTYPE.itemsize if self.fp8 else 0
        self.page_bytes = page_bytes(self.num_layers, self.num_kv_heads, self.page_size, self.head_dim, dtype)
        host_bytes = capacity["host"] * self.page_data_bytes
        try:
            self._host_buffer = PinnedHostBuffer(host_bytes, device if device.type == "cuda" else None)
        except (OSError, MemoryError, RuntimeError) as exc:
            raise MemoryError(
                f"cannot allocate and pin {host_bytes} bytes ({host_bytes / 2**30:.1f} GiB) of host memory for "
                f"{capacity['host']} pages of {self.page_bytes} bytes: {exc}") from exc
        # (num_host_pages, L, Hkv, 2, page_size, d), CPU; pinned and mapped on CUDA.
        self.host_pool = self._host_buffer.tensor.view(dtype).view(capacity["host"], *self.page_shape)
        # Same shape, a CUDA alias of host_pool's memory (None on CPU).
        self.host_pool_cuda = (
            self._host_buffer.cuda_view(dtype).view(capacity["host"], *self.page_shape)
            if device.type == "cuda"
            else None
        )
        # (num_hbm_pages + num_window_pages, L, Hkv, 2, page_size, d) on the cache device: the HBM
        # tier, then the window that mirrors pages being written.
        self.hbm_pool = torch.zeros((capacity["hbm"] + window, *self.page_shape), dtype=dtype, device=device)
        # FP8 scales (num_pages, L, Hkv, 2, page_size) float32: host (pinned, mapped) and HBM + window.
        self._scale_buffer = self.host_scales = self.host_scales_cuda = self.hbm_scales = None
        if self.fp8:
            scale_bytes = capacity["host"] * self.page_scale_bytes
            try:
                self._scale_buffer = PinnedHostBuffer(scale_bytes, device if device.type == "cuda" else None)
            except (OSError, MemoryError, RuntimeError) as exc:
                self._host_buffer.close()
                raise MemoryError(f"cannot allocate and pin {scale_bytes} bytes of host memory for the FP8 "
                                  f"scales of {capacity['host']} pages: {exc}") from exc
            self.host_scales = self._scale_buffer.tensor.view(SCALE_DTYPE).view(capacity["host"], *self.scale_shape)
            self.host_scales_cuda = (self._scale_buffer.cuda_view(SCALE_DTYPE).view(capacity["host"], *self.scale_shape)
                                     if device.type == "cuda" else None)
            self.hbm_scales = torch.zeros((capacity["hbm"] + window, *self.scale_shape), dtype=SCALE_DTYPE,
                                          device=device)
        self.num_window_pages = window

        self._capacity = capacity
        self._lock = threading.RLock()
        self._generation = 0  # bumped whenever existing pages change owner or meaning
        self._refs = {tier: np.zeros(n, dtype=np.int32) for tier, n in capacity.items()}
        # Free lists are stacks popped from the end, so pages are handed out in increasing order.
        self._free = {tier: list(range(n - 1, -1, -1)) for tier, n in capacity.items()}
        self._free_window = list(range(capacity["hbm"] + window - 1, capacity["hbm"] - 1, -1))
        self._copy_stream = self._copy_done = None
        self._copy_pending = False
        # Host writes not known to be done: [event (None: enqueued on the current stream, no
        # event yet), host pages (int64 ndarray; None: every page)] (``host_writes``).
        self._host_writes: list[list] = []
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self._closed = False

    @classmethod
    def for_model(cls, config, *, host_bytes: int, hbm_bytes: int = 0, page_size: int = 64,
                  dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                  compute_dtype: torch.dtype | None = None) -> "PagedKVCache":
        """A cache sized by bytes for a model config (a transformers config or anything with
        ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` /
        ``hidden_size``): ``host_bytes`` of pinned host pages, ``hbm_bytes`` of HBM pages (FP8
        pages: their scales counted in)."""
        get = getattr(config, "get_text_config", None)
        config = get() if get is not None else config
        layers, hq = config.num_hidden_layers, config.num_attention_heads
        hkv = getattr(config, "num_key_value_heads", None) or hq
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
        one = page_bytes(layers, hkv, page_size, head_dim, dtype)
        host = _check_int(host_bytes, "host_bytes") // one
        if host < 1:
            raise ValueError(f"host_bytes={host_bytes} holds no page of {one} bytes ({page_size} tokens)")
        return cls(layers, hkv, head_dim, page_size, num_host_pages=host,
                   num_hbm_pages=_check_int(hbm_bytes, "hbm_bytes") // one, dtype=dtype, device=device,
                   compute_dtype=compute_dtype)

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Unpin the host pool now (idempotent). The cache, and CUDA views of it, are unusable after."""
        if self._copy_pending:  # no copy may land in memory that is no longer pinned
            self._copy_done.synchronize()
            self._copy_pending = False
        self._closed = True
        self.host_pool_cuda = self.host_scales_cuda = None
        self._host_buffer.close()
        if self._scale_buffer is not None:
            self._scale_buffer.close()

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"page_size={self.page_size}, dtype={self.dtype}, "
            f"{f'compute_dtype={self.compute_dtype}, ' if self.fp8 else ''}device={self.device}, "
            f"host {self.free_pages('host')}/{self._capacity['host']} free, "
            f"hbm {self.free_pages('hbm')}/{self._capacity['hbm']} free, {len(self._seqs)} sequences)"
        )

    @property
    def host_pinned(self) -> bool:
        """True while the host pool is page-locked and mapped for the GPU."""
        return self._host_buffer.registered

    # ---- queries ---------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        """Ids of the live sequences, in creation order."""
        return list(self._seqs)

    def num_pages(self, tier: Tier = "host") -> int:
        """Capacity of ``tier`` in pages."""
        return self._capacity[self._check_tier(tier)]

    @_locked
    def free_pages(self, tier: Tier = "host") -> int:
        """Free pages of ``tier``."""
        return len(self._free[self._check_tier(tier)])

    @_locked
    def free_window_pages(self) -> int:
        """Free pages of the HBM window (``mirror``)."""
        return len(self._free_window)

    @_locked
    def mirrored_pages(self, seq_id: int) -> dict[int, int]:
        """The sequence's mirrors: logical page -> HBM window page (a copy)."""
        return dict(self._seq(seq_id).mirrors)

    @_locked
    def seq_len(self, seq_id: int) -> int:
        """Tokens of the sequence (allocated by ``extend``/``append``)."""
        return self._seq(seq_id).length

    @_locked
    def page_table(self, seq_id: int) -> list[int]:
        """The sequence's encoded page-table entries in logical order (a copy)."""
        return list(self._seq(seq_id).pages)

    @_locked
    def page_counts(self, seq_id: int) -> dict[str, int]:
        """Pages of the sequence per tier, e.g. ``{"host": 30, "hbm": 2}``."""
        table = self._seq(seq_id).table()
        hbm = int(np.count_nonzero(table < 0))
        return {"host": len(table) - hbm, "hbm": hbm}

    @_locked
    def page_hbm(self, seq_ids: Sequence[int]) -> list[list[bool]]:
        """Per sequence, per logical page: whether it lives in HBM (``plan.decode_traffic`` input)."""
        return [(self._seq(s).table() < 0).tolist() for s in seq_ids]

    @_locked
    def state(self) -> CacheState:
        """A deep snapshot of the bookkeeping, for invariant checks and tests."""
        return CacheState(
            seq_lens={i: s.length for i, s in self._seqs.items()},
            page_tables={i: tuple(s.pages) for i, s in self._seqs.items()},
            refcounts={t: tuple(int(r) for r in self._refs[t]) for t in TIERS},
            free_lists={t: tuple(self._free[t]) for t in TIERS},
            mirrors={i: tuple(sorted(s.mirrors.items())) for i, s in self._seqs.items() if s.mirrors},
            free_window=tuple(self._free_window),
        )

    def device_pool(self, tier: Tier) -> torch.Tensor:
        """The tier's pool as a tensor on the cache device (``host_pool_cuda`` for host on CUDA).

        Shape (num_pages, num_layers, num_kv_heads, 2, page_size, head_dim).
        """
        self._check_open()
        if self._check_tier(tier) == "hbm":
            return self.hbm_pool
        return self.host_pool if self.host_pool_cuda is None else self.host_pool_cuda

    def device_scales(self, tier: Tier) -> torch.Tensor | None:
        """The tier's FP8 scale pool on the cache device (None for bf16/fp16 pages).

        Shape (num_pages, num_layers, num_kv_heads, 2, page_size), float32.
        """
        self._check_open()
        if self._check_tier(tier) == "hbm" or not self.fp8:
            return self.hbm_scales
        return self.host_scales if self.host_scales_cuda is None else self.host_scales_cuda

    def _encode(self, k: torch.Tensor, v: torch.Tensor):
        """(k, v, k scales, v scales) as the pages store them: FP8 with per-row scales, else as
        given (scales None)."""
        k, v = k.detach(), v.detach()  # the pools never join an autograd graph
        if not self.fp8:
            return k, v, None, None
        (qk, sk), (qv, sv) = quantize(k, self.dtype), quantize(v, self.dtype)
        return qk, qv, sk, sv

    def _put(self, tier: Tier, pidx, lsel, off, tok, enc) -> None:
        """Store encoded rows (``_encode``; ``tok`` selects them, None: all) at pages ``pidx``,
        rows ``off`` of layer(s) ``lsel`` of ``tier`` (and their scales)."""
        pool, scales = _raw(self.device_pool(tier)), self.device_scales(tier)
        for kv, (data, scale) in enumerate(((_raw(enc[0]), enc[2]), (_raw(enc[1]), enc[3]))):
            pool[pidx, lsel, :, kv, off] = data if tok is None else data[tok]
            if scale is not None:
                scales[pidx, lsel, :, kv, off] = scale if tok is None else scale[tok]

    def _gather(self, tier: Tier, pidx, lsel, off) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at pages ``pidx``, rows ``off`` of ``tier``, in the compute dtype."""
        pool = self.device_pool(tier)
        if not self.fp8:
            return pool[pidx, lsel, :, 0, off], pool[pidx, lsel, :, 1, off]
        raw, scales = _raw(pool), self.device_scales(tier)
        return tuple(dequantize(raw[pidx, lsel, :, kv, off].view(self.dtype), scales[pidx, lsel, :, kv, off],
                                self.compute_dtype) for kv in (0, 1))

    # ---- sequence operations ---------------------------------------------------------------
    @_locked
    def add_sequence(self) -> int:
        """Create an empty sequence and return its id (ids are never reused)."""
        self._check_open()
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = _Sequence()
        return seq_id

    @_locked
    def extend(self, seq_id: int, n: int, tier: Tier = "host") -> int:
        """Reserve ``n`` more tokens (all layers); new pages come from ``tier``. Returns the start position."""
        seq = self._seq(seq_id)
        n = _check_int(n, "n")
        self._check_tier(tier)
        need = self._pages_for(seq.length + n) - len(seq.pages)
        self._require({tier: need}, f"extend sequence {seq_id} by {n} tokens")
        start = seq.length
        seq.add_entries([encode_page(tier, self._alloc(tier)) for _ in range(need)])
        seq.length += n
        return start

    @_locked
    def write(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens ``[start, start + n)`` of one layer; the tokens must be allocated.

        k, v: (n, num_kv_heads, head_dim), cache dtype, on the cache device. Pages still shared
        with a fork are copied first (copy-on-write).
        """
        seq = self._seq(seq_id)
        layer = self._check_layer(layer)
        n = self._check_kv(k, v, (self.num_kv_heads, self.head_dim), "(n, num_kv_heads, head_dim)")
        start = _check_int(start, "start")
        if start + n > seq.length:
            raise ValueError(
                f"write of tokens [{start}, {start + n}) past the end of sequence {seq_id} "
                f"(length {seq.length}; extend it first)"
            )
        if n == 0:
            return
        shared = self._shared_pages(seq, start, start + n)
        what = f"copy-on-write of {len(shared)} shared pages of sequence {seq_id}"
        self._require(self._tier_counts(seq, shared), what)
        self._unshare(seq, shared)
        self._store(seq, layer, start, k, v)

    @_locked
    def append(self, seq_id: int, k: torch.Tensor, v: torch.Tensor, tier: Tier = "host") -> int:
        """Extend by n tokens and write them for all layers. Returns the start position.

        k, v: (n, num_layers, num_kv_heads, head_dim), cache dtype, on the cache device.
        """
        seq = self._seq(seq_id)
        n = self._check_kv(
            k, v, (self.num_layers, self.num_kv_heads, self.head_dim), "(n, num_layers, num_kv_heads, head_dim)"
        )
        # The new tokens land in the partial last page, which is never shared (fork copies it),
        # and in new pages: extend's capacity check covers everything.
        start = self.extend(seq_id, n, tier)
        if n:
            try:
                self._store(seq, None, start, k, v)
            except BaseException:
                self.truncate(seq_id, start)
                raise
        return start

    @_locked
    def token_slots(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> "TokenSlots":
        """Where tokens ``[starts[i], starts[i] + counts[i])`` of ``seq_ids[i]`` live, for
        ``write_slots``: one host-to-device copy for the whole batch, reused by every layer.

        The tokens must be allocated (``extend``). Pages in the range that are still shared with
        a fork get private copies first (copy-on-write), for every sequence, before anything is
        returned; the capacity for those copies is checked before any is made.
        """
        entry, off = self.token_entries(seq_ids, starts, counts)
        return TokenSlots.build(entry, off, self.device, self.mirror_entries(seq_ids, starts, counts))

    @_locked
    def mirror_entries(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
        """int64 (total,): the HBM window page mirroring each token's page (-1: none), in
        ``token_entries`` order, for ``TokenSlots.build``."""
        out = [self._mirror_of(self._seq(sid), start, n) for sid, start, n in zip(seq_ids, starts, counts)]
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    @_locked
    def mirror(self, seq_id: int, start: int, n: int) -> int:
        """Give the host pages holding tokens ``[start, start + n)`` (allocated) an HBM mirror
        from the window, first page first, as far as free window pages go; a page already holding
        tokens before ``start`` is copied into its mirror first (all layers). Pages in the HBM
        tier, and pages already mirrored, are left as they are. Returns the pages mirrored now.

        From then on every write to such a page goes to both copies, and ``kernel_tables`` names
        the mirror while the host page is private (a shared page is read where its sharers read
        it, so a cascade still finds it)."""
        seq = self._seq(seq_id)
        start, n = _check_int(start, "start"), _check_int(n, "n")
        if start + n > seq.length:
            raise ValueError(f"mirror of tokens [{start}, {start + n}) past the end of sequence {seq_id} "
                             f"(length {seq.length}; extend it first)")
        if n == 0:
            return 0
        made = 0
        for lp in range(start // self.page_size, (start + n - 1) // self.page_size + 1):
            if lp in seq.mirrors or seq.pages[lp] < 0:
                continue
            if not self._free_window:
                break
            w = self._free_window.pop()
            seq.mirrors[lp] = w
            if lp * self.page_size < start:  # history in the page: the mirror starts as its copy
                self._copy_page(seq.pages[lp], encode_page("hbm", w))
            made += 1
        seq._table = None
        return made

    @_locked
    def release_mirrors(self, seq_id: int, keep_partial: bool = True) -> int:
        """Drop the sequence's mirrors (their host pages are current: writes went to both),
        except, with ``keep_partial``, the partial last page's. Returns the pages released."""
        seq = self._seq(seq_id)
        full = seq.length // self.page_size
        drop = [lp for lp in seq.mirrors if not (keep_partial and lp >= full)]
        self._drop_mirrors(seq, drop)
        return len(drop)

    @_locked
    def token_entries(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]):
        """``token_slots`` as host arrays: (page entry, row in page) int64 (total,) per token, after
        the same copy-on-write. Entries of several calls concatenate into one ``TokenSlots.build``
        (a step that forks sequences between them: the forks then share what the first call's
        tokens write)."""
        self._check_open()
        if not (len(seq_ids) == len(starts) == len(counts)):
            raise ValueError("seq_ids, starts and counts must have one entry per sequence")
        seqs = [self._seq(s) for s in seq_ids]
        spans = []
        for sid, seq, start, n in zip(seq_ids, seqs, starts, counts):
            start, n = _check_int(start, "start"), _check_int(n, "count")
            if start + n > seq.length:
                raise ValueError(f"tokens [{start}, {start + n}) past the end of sequence {sid} (length {seq.length})")
            spans.append((seq, start, n))
        shared = [(seq, self._shared_pages(seq, start, start + n)) for seq, start, n in spans]
        needs: dict[str, int] = {}
        for seq, lps in shared:
            for tier, m in self._tier_counts(seq, lps).items():
                needs[tier] = needs.get(tier, 0) + m
        self._require(needs, "copy-on-write of shared pages before a batched write")
        for seq, lps in shared:
            self._unshare(seq, lps)
        got = [self._entries(seq, start, n) for seq, start, n in spans]
        entry = np.concatenate([e for e, _ in got]) if got else np.zeros(0, np.int64)  # (total,)
        off = np.concatenate([o for _, o in got]) if got else np.zeros(0, np.int64)  # (total,)
        return entry, off

    @_locked
    def write_slots(self, slots: "TokenSlots", layer: int, k: torch.Tensor, v: torch.Tensor,
                    defer_host: bool = False) -> None:
        """Store K/V rows ``k[i]``, ``v[i]`` ((total, num_kv_heads, head_dim), cache dtype, on the
        cache device) of one layer at the positions ``slots`` (from ``token_slots``) names.

        ``defer_host``: tokens whose page has a mirror are stored in the mirror only, and the copy
        engine then copies this layer of those pages into their host pages on a side stream
        (ordered after this write), off the current stream's path; every later operation of the
        cache that reads host pages, and every ``kernel_tables`` call, waits for it first."""
        layer = self._check_layer(layer)
        n = self._check_kv(k, v, (self.num_kv_heads, self.head_dim), "(n, num_kv_heads, head_dim)")
        if n != slots.total:
            raise ValueError(f"{n} K/V rows for {slots.total} slots")
        enc = self._encode(k, v)
        for tier, tok, pidx, off in slots.parts + (() if defer_host else slots.mirrored):
            self._put(tier, pidx, layer, off, tok, enc)
        self._wrote_host(slots.host_pages)
        if defer_host:
            self._copy_back(layer, slots.runs)

    @_locked
    def copy_mirrors_to_host(self, slots: "TokenSlots", layer: int) -> None:
        """The host half of ``write_slots(defer_host=True)`` for a writer that stored the slots'
        mirrored tokens itself (``kv_project``): queue the copies of this layer of their pages."""
        self._copy_back(self._check_layer(layer), slots.runs)

    def note_host_write(self, pages=None) -> None:
        """Record that work already enqueued on the current stream writes host pages ``pages``
        (a ``TokenSlots``, host page indices, or None: any page). The cache's own writes are
        recorded; call this after a write by other means (``kv_project`` into
        ``kv_proj.cache_destinations``), so that staged attention calls copy those pages after it."""
        if isinstance(pages, TokenSlots):
            pages = pages.host_pages
        elif pages is not None:
            pages = np.unique(np.asarray(pages, dtype=np.int64).reshape(-1))
            if pages.size and (pages[0] < 0 or pages[-1] >= self._capacity["host"]):
                raise IndexError(f"host pages {pages[0]}..{pages[-1]} outside the pool's {self._capacity['host']}")
        with self._lock:
            self._wrote_host(pages)

    def host_writes(self) -> list[tuple[object, np.ndarray | None]]:
        """The recorded host writes not known to be done, as (CUDA event, host pages or None: any
        page): work that waits for the event is ordered after the write. Writes recorded without
        an event get one now, on the current stream (they were enqueued there); finished ones are
        dropped. Empty on a CPU cache."""
        with self._lock:
            self._settle_writes()
            return [(ev, pages) for ev, pages in self._host_writes]

    def _settle_writes(self) -> None:
        """Give the recorded writes without an event one on the current stream; drop the done."""
        if not self._host_writes:
            return
        lazy = [w for w in self._host_writes if w[0] is None]
        if lazy:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            for w in lazy:
                w[0] = ev
        self._host_writes = [w for w in self._host_writes if not w[0].query()]

    def _wrote_host(self, pages, event=None) -> None:
        """Record a host write (see ``host_writes``): ``event`` marks its end on the stream it was
        enqueued on; None: the current stream, at the next ``host_writes``."""
        if self.device.type != "cuda" or (pages is not None and not len(pages)):
            return
        self._host_writes.append([event, pages])
        if len(self._host_writes) > MAX_HOST_WRITES:  # no staged call has read them lately: merge
            cur = torch.cuda.current_stream(self.device)
            for ev, _ in self._host_writes:
                if ev is not None:  # the current stream then orders all of them
                    cur.wait_event(ev)
            every = [p for _, p in self._host_writes]
            union = None if any(p is None for p in every) else np.unique(np.concatenate(every))
            self._host_writes = [[None, union]]

    @_locked
    def read(
        self, seq_id: int, layer: int | None, start: int = 0, stop: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens ``[start, stop)``, gathered on the cache device.

        Returns (n, num_kv_heads, head_dim) tensors for one layer, or
        (n, num_layers, num_kv_heads, head_dim) for ``layer=None``.
        """
        seq = self._seq(seq_id)
        if layer is not None:
            layer = self._check_layer(layer)
        stop = seq.length if stop is None else _check_int(stop, "stop")
        start = _check_int(start, "start")
        if not start <= stop <= seq.length:
            raise ValueError(f"read range [{start}, {stop}) outside sequence {seq_id} of length {seq.length}")
        lsel = slice(None) if layer is None else layer
        token_shape = (self.num_kv_heads, self.head_dim)
        if layer is None:
            token_shape = (self.num_layers, *token_shape)
        slots = self._seq_slots(seq, start, stop - start).parts
        if len(slots) == 1:  # one tier: the gathers are the result
            tier, _, pidx, off = slots[0]
            return self._gather(tier, pidx, lsel, off)
        k = torch.empty((stop - start, *token_shape), dtype=self.compute_dtype, device=self.device)  # (n, [L,] Hkv, d)
        v = torch.empty_like(k)
        for tier, tok, pidx, off in slots:
            k[tok], v[tok] = self._gather(tier, pidx, lsel, off)
        return k, v

    @_locked
    def fork(self, seq_id: int, length: int | None = None) -> int:
        """New sequence with the same contents: full pages shared, the partial last page copied now.

        ``length`` (a multiple of the page size, at most the sequence's length): the new sequence
        holds only the first ``length`` tokens, all in shared pages (a fork at a shared prefix)."""
        seq = self._seq(seq_id)
        if length is not None:
            length = _check_int(length, "length")
            if length % self.page_size or length > seq.length:
                raise ValueError(f"fork of sequence {seq_id} at {length} tokens: a multiple of the page size "
                                 f"{self.page_size} up to its length {seq.length} is needed")
            entries = list(seq.pages[: length // self.page_size])
            for entry in entries:
                tier, index = decode_page(entry)
                self._refs[tier][index] += 1
            new_id = self.add_sequence()
            self._seqs[new_id].add_entries(entries)
            self._seqs[new_id].length = length
            return new_id
        n_full = seq.length // self.page_size
        partial = seq.pages[n_full:]  # [] or [the partial last page]
        self._require(self._tier_counts(seq, range(n_full, len(seq.pages))), f"fork sequence {seq_id}")
        entries = list(seq.pages[:n_full])
        for entry in entries:
            tier, index = decode_page(entry)
            self._refs[tier][index] += 1
        for entry in partial:
            tier = decode_page(entry)[0]
            copy = encode_page(tier, self._alloc(tier))
            self._copy_page(entry, copy)
            entries.append(copy)
        new_id = self.add_sequence()
        self._seqs[new_id].add_entries(entries)
        self._seqs[new_id].length = seq.length
        return new_id

    @_locked
    def free(self, seq_id: int) -> None:
        """Drop the sequence; pages whose refcount reaches 0 return to their tier's free list."""
        seq = self._seq(seq_id)
        self._drop_mirrors(seq, list(seq.mirrors))
        for entry in seq.pages:
            self._decref(entry)
        del self._seqs[seq_id]

    @_locked
    def truncate(self, seq_id: int, length: int) -> None:
        """Shorten the sequence to its first ``length`` tokens; pages past them are released.

        A page that stays but was shared becomes the new partial last page: it is copied first
        (capacity checked before anything changes), so the last page stays private.
        """
        seq = self._seq(seq_id)
        length = _check_int(length, "length")
        if length > seq.length:
            raise ValueError(f"truncate of sequence {seq_id} to {length} tokens: it has only {seq.length}")
        keep = self._pages_for(length)
        last = keep - 1
        partial_shared = length % self.page_size and self._refcount(seq.pages[last]) > 1
        if partial_shared:
            self._require(self._tier_counts(seq, [last]), f"truncate sequence {seq_id}")
        self._drop_mirrors(seq, [lp for lp in seq.mirrors if lp >= keep])
        for entry in reversed(seq.pages[keep:]):  # last first: the free stack pops them in order again
            self._decref(entry)
        seq.pages = seq.pages[:keep]
        seq._table = None
        seq.length = length
        if partial_shared:
            self._unshare(seq, [last])

    @_locked
    def move_pages(self, seq_id: int, logical_pages: Iterable[int], tier: Tier) -> None:
        """Move the given logical pages of a sequence to ``tier``.

        The physical page moves: its data is copied to a new page of ``tier``, every sequence
        sharing it is repointed, and the old page is freed. Pages already in ``tier`` stay.
        """
        seq = self._seq(seq_id)
        self._check_tier(tier)
        if isinstance(logical_pages, (int, np.integer)):
            raise TypeError("logical_pages must be an iterable of ints, not a single int")
        lps = sorted({_check_int(lp, "logical page") for lp in logical_pages})
        if lps and lps[-1] >= len(seq.pages):
            raise IndexError(f"logical page {lps[-1]} out of range: sequence {seq_id} has {len(seq.pages)} pages")
        moving = [seq.pages[lp] for lp in lps if decode_page(seq.pages[lp])[0] != tier]
        self._require({tier: len(moving)}, f"move {len(moving)} pages of sequence {seq_id} to {tier}")
        remap = {}
        for old in moving:
            new = encode_page(tier, self._alloc(tier, refs=self._refcount(old)))
            self._copy_page(old, new)
            self._release(old)
            remap[old] = new
        shared = any(self._refcount(new) > 1 for new in remap.values())
        for s in self._seqs.values() if shared else [seq]:
            for i, entry in enumerate(s.pages):
                if entry in remap:
                    s.set_entry(i, remap[entry])
            self._drop_mirrors(s, [lp for lp in s.mirrors if s.pages[lp] < 0])

    @_locked
    def set_hbm_fraction(self, seq_id: int, fraction: float, placement: str = "recent") -> None:
        """Place ``floor(fraction * num_pages + 0.5)`` of the sequence's pages in HBM, the rest in host memory.

        placement "recent": the most recent (last) pages go to HBM; "strided": evenly spread pages
        (page i is in HBM iff floor((i + 1) * f) > floor(i * f) for f = hbm_pages / num_pages).
        Pages shared with forks move for every sharer (see ``move_pages``).
        """
        seq = self._seq(seq_id)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        n = len(seq.pages)
        n_hbm = math.floor(fraction * n + 0.5)
        if placement == "recent":
            want_hbm = [i >= n - n_hbm for i in range(n)]
        else:
            want_hbm = [(i + 1) * n_hbm // n > i * n_hbm // n for i in range(n)]
        is_hbm = [e < 0 for e in seq.pages]
        to_host = [i for i in range(n) if is_hbm[i] and not want_hbm[i]]
        to_hbm = [i for i in range(n) if want_hbm[i] and not is_hbm[i]]
        # Host-bound moves run first and free HBM pages for the HBM-bound ones.
        if len(to_host) > self.free_pages("host") or len(to_hbm) > self.free_pages("hbm") + len(to_host):
            raise CacheCapacityError(
                f"set_hbm_fraction({fraction}) of sequence {seq_id} moves {len(to_host)} pages to host "
                f"({self.free_pages('host')} free) and {len(to_hbm)} to hbm ({self.free_pages('hbm')} free "
                f"+ {len(to_host)} freed); the cache is unchanged"
            )
        self.move_pages(seq_id, to_host, "host")
        self.move_pages(seq_id, to_hbm, "hbm")

    @_locked
    def kernel_tables(self, seq_ids: Sequence[int], back_to_back: bool = False) -> KernelTables:
        """Page tables and lengths of a batch for the kernels (one host-to-device copy);
        ``back_to_back``: the calls over them come in long runs (``KernelTables.back_to_back``)."""
        self._check_open()
        if isinstance(seq_ids, (int, np.integer)) or len(seq_ids) == 0:
            raise ValueError(f"seq_ids must be a non-empty sequence of ids, got {seq_ids!r}")
        seqs = [self._seq(s) for s in seq_ids]
        for s, seq in zip(seq_ids, seqs):
            if seq.length == 0:
                raise ValueError(f"sequence {s} is empty; kernel_tables needs at least one token per sequence")
        batch, max_pages = len(seqs), max(len(seq.pages) for seq in seqs)
        packed = np.empty(batch * max_pages + batch, dtype=np.int32)  # page_table then seq_lens
        table = packed[: batch * max_pages].reshape(batch, max_pages)
        for row, seq in zip(table, seqs):
            pages = seq.table()
            row[: len(pages)] = pages
            row[len(pages) :] = pages[-1]
            for lp, w in seq.mirrors.items():
                if self._refs["host"][pages[lp]] == 1:  # private: read its mirror
                    row[lp] = encode_page("hbm", w)
                    if lp == len(pages) - 1:
                        row[len(pages) :] = row[lp]
        packed[batch * max_pages :] = [seq.length for seq in seqs]
        # non_blocking: a pageable source is staged by the driver before the call returns (so
        # `packed` may go), and the host does not wait for the GPU's queued work, as a blocking
        # copy (stream synchronize) would on every attention call.
        dev = torch.from_numpy(packed).to(self.device, non_blocking=True)
        return KernelTables(dev[: batch * max_pages].view(batch, max_pages), dev[batch * max_pages :], id(self),
                            self._generation, tuple(seq.length for seq in seqs), table.copy(), bool(back_to_back))

    def check_tables(self, tables: KernelTables) -> None:
        """Raise ``StaleTablesError`` unless ``tables`` came from this cache's ``kernel_tables``
        and no page has been freed, moved or copied-on-write since (two integer compares)."""
        if getattr(tables, "cache_id", 0) != id(self):
            raise StaleTablesError("kernel tables from another cache (or built by hand); build them with "
                                   "this cache's kernel_tables()")
        if tables.generation != self._generation:
            raise StaleTablesError("stale kernel tables: pages they name were freed, moved or copied since "
                                   "they were built; call kernel_tables() again")

    # ---- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the cache is closed")

    def _seq(self, seq_id: int) -> _Sequence:
        self._check_open()
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
        try:
            return self._seqs[int(seq_id)]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence id {seq_id} (live: {self.seq_ids})") from None

    def _check_tier(self, tier: str) -> Tier:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        return tier

    def _check_layer(self, layer: int) -> int:
        layer = _check_int(layer, "layer")
        if layer >= self.num_layers:
            raise IndexError(f"layer {layer} out of range for a cache of {self.num_layers} layers")
        return layer

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, tail: tuple[int, ...], expected: str) -> int:
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

    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def _require(self, needs: dict[str, int], what: str) -> None:
        short = {t: n for t, n in needs.items() if n > len(self._free[t])}
        if short:
            detail = ", ".join(f"{n} {t} pages needed, {len(self._free[t])} free" for t, n in short.items())
            raise CacheCapacityError(f"cannot {what}: {detail}; the cache is unchanged")

    def _alloc(self, tier: Tier, refs: int = 1) -> int:
        index = self._free[tier].pop()
        self._refs[tier][index] = refs
        return index

    def _refcount(self, entry: int) -> int:
        tier, index = decode_page(entry)
        return int(self._refs[tier][index])

    def _decref(self, entry: int) -> None:
        tier, index = decode_page(entry)
        self._refs[tier][index] -= 1
        if self._refs[tier][index] == 0:
            self._free[tier].append(index)
            self._generation += 1

    def _release(self, entry: int) -> None:
        """Return a page to its free list whatever its refcount (its users were repointed)."""
        tier, index = decode_page(entry)
        self._refs[tier][index] = 0
        self._free[tier].append(index)
        self._generation += 1

    def _copy_page(self, src: int, dst: int) -> None:
        """Copy a whole page (all layers) on the cache device, on the current stream.

        An indexed-copy kernel rather than ``copy_``: ``copy_`` between two CUDA tensors is a
        device-to-device memcpy, which is not specified for host memory reached through UVA;
        a kernel's loads and stores are.
        """
        (src_tier, si), (dst_tier, di) = decode_page(src), decode_page(dst)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)  # (1,)
        dst_page = _raw(self.device_pool(dst_tier))[di : di + 1]  # (1, L, Hkv, 2, page_size, d)
        dst_page.index_copy_(0, zero, _raw(self.device_pool(src_tier))[si : si + 1])
        if self.fp8:
            self.device_scales(dst_tier)[di : di + 1].index_copy_(0, zero, self.device_scales(src_tier)[si : si + 1])
        if dst_tier == "host":
            self._wrote_host(np.array([di], np.int64))

    def _copy_back(self, layer: int, runs) -> None:
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
        self._wrote_host(np.concatenate([np.arange(h, h + count) for _, h, count in runs]), self._copy_done)

    def _host_current(self) -> None:
        """Make the current stream wait for the copies ``write_slots(defer_host=True)`` queued."""
        if self._copy_pending:
            torch.cuda.current_stream(self.device).wait_event(self._copy_done)
            self._copy_pending = False

    def _drop_mirrors(self, seq: _Sequence, logical_pages: list[int]) -> None:
        """Return the given logical pages' mirrors to the window (tables naming them go stale)."""
        for lp in logical_pages:
            self._free_window.append(seq.mirrors.pop(lp))
        if logical_pages:
            seq._table = None
            self._generation += 1

    def _mirror_of(self, seq: _Sequence, start: int, n: int) -> np.ndarray:
        """int64 (n,): the window page mirroring each of tokens [start, start + n) (-1: none)."""
        if not seq.mirrors:
            return np.full(n, -1, dtype=np.int64)
        lps = np.arange(start, start + n) // self.page_size
        return np.array([seq.mirrors.get(int(lp), -1) for lp in lps], dtype=np.int64)

    def _shared_pages(self, seq: _Sequence, start: int, stop: int) -> list[int]:
        """Logical pages holding tokens [start, stop) whose physical page is shared."""
        if stop <= start:
            return []
        lps = range(start // self.page_size, (stop - 1) // self.page_size + 1)
        return [lp for lp in lps if self._refcount(seq.pages[lp]) > 1]

    def _tier_counts(self, seq: _Sequence, logical_pages: Iterable[int]) -> dict[str, int]:
        """Pages per tier among the given logical pages of the sequence."""
        counts: dict[str, int] = {}
        for lp in logical_pages:
            tier = decode_page(seq.pages[lp])[0]
            counts[tier] = counts.get(tier, 0) + 1
        return counts

    def _unshare(self, seq: _Sequence, logical_pages: list[int]) -> None:
        """Give the sequence private copies of the given (shared) logical pages."""
        for lp in logical_pages:
            old = seq.pages[lp]
            tier = decode_page(old)[0]
            new = encode_page(tier, self._alloc(tier))
            self._copy_page(old, new)
            self._decref(old)
            seq.set_entry(lp, new)
            self._generation += 1

    def _entries(self, seq: _Sequence, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(page entry, row in page) int64 (n,) of tokens [start, start + n) of the sequence."""
        pos = np.arange(start, start + n)  # (n,)
        return seq.table()[pos // self.page_size].astype(np.int64), pos % self.page_size

    def _seq_slots(self, seq: _Sequence, start: int, n: int, mirrors: bool = False) -> TokenSlots:
        """Where tokens [start, start + n) live (``TokenSlots``, one host-to-device copy); with
        ``mirrors`` their window mirrors too."""
        entry, off = self._entries(seq, start, n)
        return TokenSlots.build(entry, off, self.device, self._mirror_of(seq, start, n) if mirrors else None)

    def _store(self, seq: _Sequence, layer: int | None, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Indexed stores of k, v ((n, Hkv, d) for one layer, (n, L, Hkv, d) for None) into their pages."""
        lsel = slice(None) if layer is None else layer
        enc = self._encode(k, v)
        slots = self._seq_slots(seq, start, k.shape[0], mirrors=True)
        for tier, tok, pidx, off in slots.parts + slots.mirrored:  # mirrors written through
            self._put(tier, pidx, lsel, off, tok, enc)
        self._wrote_host(slots.host_pages)
