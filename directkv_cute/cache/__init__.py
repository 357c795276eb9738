"""Paged KV cache in pinned host memory, with an optional HBM tier (docs/ARCHITECTURE.md: the module map).

``PagedKVCache`` (``cache.paged``) is one lock over three parts:

* ``cache.pages``: the page book -- per-sequence page tables, refcounts, free lists, fork and
  copy-on-write, tier moves, window mirrors, capacity checks. Plain Python and numpy.
* ``cache.pools``: the device side -- the page pools (pinned host, HBM + window, FP8 scales),
  stores from GPU/CPU tensors, gathers, page copies and the copy engine's copy-back of mirrors;
  ``cache.host_writes`` records the host-page writes staged attention calls order after.
* ``cache.tables``: what the kernels and stores index by -- ``KernelTables`` of a batch, built
  from the book, and ``TokenSlots``, the destinations of a batch of token rows.

``cache.store`` is the one store path of new K/V rows, which the pools, the fused projection
(``kv_project``'s destinations) and the vLLM backend share: the rows of a pool that hold a
batch's tokens (``StoreIndex``) and the indexed copies into the host pool and the HBM copies.

``cache.summaries`` (``PagedKVCache(..., summaries=True)``): per page, layer and KV head the
elementwise sum and sum of squares of the K rows written (float32), on the cache device, kept by every store and
page operation, for choosing pages by query without reading them.

Layout
------
A *page* holds ``page_size`` consecutive tokens of one sequence for every layer and KV head. Each
tier is one pool tensor of shape ``(num_pages, num_layers, num_kv_heads, 2, page_size, head_dim)``
(``2`` = K then V), so for one (page, layer, kv_head) the K rows and then the V rows form one
contiguous piece of ``2 * page_size * head_dim * elem`` bytes -- at least 4 KB for the kernel
shapes (page 16, d 64), the size from which randomly ordered host pages stream over PCIe at full
speed. Pieces start at multiples of their size from a page-aligned base, hence 16-byte aligned.
``device="cpu"`` (no CUDA) keeps both tiers in ordinary CPU tensors, so every code path -- mixed
tiers included -- runs in CPU tests.

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
* **Stale tables and slots** are refused, never used: ``KernelTables`` and ``TokenSlots`` carry
  the identity of the cache that built them and its generation then. Tables go stale when a
  page they name is freed, moved or copied on write, or a sequence is freed (``check_tables``,
  ``check_kernel_tables``); slots go stale on those and also when a page gains a sharer (fork)
  or a mirror (``check_slots``), so a write never lands in a page another sequence now owns or
  reads. A mirror starts as a copy of its host page unless nothing was written to that page
  since ``extend`` handed it out and the writes to come cover it.
* **Writes** of GPU tensors go straight into the destination pages -- host pages through
  ``host_pool_cuda`` (the GPU stores into host memory over the link), no staging buffer -- as
  one indexed copy per pool (``cache.store``) covering all touched pages. All data movement
  (writes, copies, moves) is enqueued on the current CUDA stream; host-side reads of
  ``host_pool`` must synchronise first (``read`` works on the device and needs no care).
* **Host writes are recorded** (``host_writes``): every write path notes the host pages it
  enqueues a write to, so that a staged attention call (``directkv_cute.staging``) copies a host
  page only after the writes recorded for it, and the rest of its copy need not wait for the
  current stream (it overlaps the previous layer's kernel). A caller that writes host pages by
  other means (``kv_project`` into ``write_destinations``, a kernel of its own) calls
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

from directkv_cute.cache.host_writes import MAX_HOST_WRITES, HostWriteLog
from directkv_cute.cache.paged import PagedKVCache
from directkv_cute.cache.pages import (
    PLACEMENTS,
    TIERS,
    CacheCapacityError,
    CacheState,
    PageBook,
    Tier,
    UnknownSequenceError,
    decode_page,
    encode_page,
)
from directkv_cute.cache.pools import CPU_ONLY_DTYPES, PAGE_DTYPES, SUPPORTED_DTYPES, DevicePools, page_bytes
from directkv_cute.cache.summaries import PageSummaries
from directkv_cute.cache.tables import (
    KernelTables,
    StaleTablesError,
    TokenSlots,
    check_kernel_tables,
    check_slots,
    check_tables,
)

__all__ = [
    "CPU_ONLY_DTYPES",
    "MAX_HOST_WRITES",
    "PAGE_DTYPES",
    "PLACEMENTS",
    "SUPPORTED_DTYPES",
    "TIERS",
    "CacheCapacityError",
    "CacheState",
    "DevicePools",
    "HostWriteLog",
    "KernelTables",
    "PageBook",
    "PageSummaries",
    "PagedKVCache",
    "StaleTablesError",
    "Tier",
    "TokenSlots",
    "UnknownSequenceError",
    "check_kernel_tables",
    "check_slots",
    "check_tables",
    "decode_page",
    "encode_page",
    "page_bytes",
]
