"""``PagedKVCache``: the whole-model paged KV cache, one lock over a page book (``pages``), the
device pools (``pools``) and the tables built from them (``tables``)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from directkv_cute.cache.pages import (
    MAX_PAGES,
    CacheState,
    PageBook,
    SeqPages,
    Tier,
    check_int,
    check_tier,
    encode_page,
)
from directkv_cute.cache.pools import DevicePools, page_bytes, resolve_device, resolve_dtypes
from directkv_cute.cache.store import layer_start
from directkv_cute.cache.summaries import PageSummaries
from directkv_cute.cache.tables import (
    KernelTables,
    StaleTablesError,
    TokenSlots,
    build_kernel_tables,
    check_slots,
    check_tables,
)
from directkv_cute.config import DEFAULT_PAGE_SIZE, SUPPORTED_PAGE_SIZES


def _locked(method):
    """Run a cache method under the cache's lock: every operation is atomic for concurrent callers,
    and runs after the host copies ``write_slots(defer_host=True)`` queued (current stream order)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            self._pools.host_current()
            return method(self, *args, **kwargs)

    return run


def _pooled(name: str, doc: str) -> property:
    return property(lambda self: getattr(self._pools, name), doc=doc)


class PagedKVCache:
    """Whole-model paged KV cache: host tier in pinned memory, optional HBM tier.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (head_dim a multiple of 8, so that every
            row is 16-byte aligned).
        page_size: tokens per page, one of 16, 32, 64, 128.
        num_host_pages: capacity of the host tier (>= 1); allocated and pinned once, exactly.
        num_hbm_pages: capacity of the HBM tier (may be 0).
        dtype: the page dtype: torch.bfloat16 or torch.float16, or torch.float8_e4m3fn /
            torch.float8_e5m2 (FP8 pages with per-token scales; see "FP8 pages" in the package
            docstring).
        device: "cuda" / "cuda:N" (pinned, GPU-mapped host pool; HBM pool on that GPU) or "cpu"
            (everything in ordinary CPU tensors).
        num_window_pages: HBM pages that mirror pages being written (``mirror``).
        compute_dtype: the dtype of the K/V that ``write``/``append``/``write_slots`` take and
            ``read`` returns: ``dtype`` for bf16/fp16 pages (the default; nothing else is
            accepted), bf16 (default) or fp16 (float32 on device='cpu' too) for FP8 pages.
        summaries: keep ``summaries`` (``cache.summaries.PageSummaries``): per page, layer and KV
            head the sum and sum of squares of the K rows written (float32), on the cache device,
            2/page_size of 16-bit KV's bytes, kept by every store and page operation. Off (the default): nothing is
            allocated and no store does more than without.
    """

    host_pool = _pooled("host_pool", "(num_host_pages, L, Hkv, 2, page_size, d) CPU tensor; pinned and mapped on CUDA.")
    host_pool_cuda = _pooled("host_pool_cuda", "CUDA alias of host_pool's memory (None on CPU and once closed).")
    hbm_pool = _pooled("hbm_pool", "(num_hbm_pages + num_window_pages, L, Hkv, 2, page_size, d) on the device.")
    host_scales = _pooled("host_scales", "FP8 scales of the host pages (None for bf16/fp16 pages).")
    host_scales_cuda = _pooled("host_scales_cuda", "CUDA alias of host_scales (None on CPU and once closed).")
    hbm_scales = _pooled("hbm_scales", "FP8 scales of the HBM and window pages (None for bf16/fp16 pages).")
    dtype = _pooled("dtype", "The page dtype.")
    compute_dtype = _pooled("compute_dtype", "The dtype of the K/V the cache takes and returns.")
    fp8 = _pooled("fp8", "True for FP8 pages.")
    page_shape = _pooled("page_shape", "One page: (num_layers, num_kv_heads, 2, page_size, head_dim).")
    scale_shape = _pooled("scale_shape", "One page's FP8 scales: (num_layers, num_kv_heads, 2, page_size).")
    page_data_bytes = _pooled("page_data_bytes", "Bytes of one page's K/V rows.")
    page_scale_bytes = _pooled("page_scale_bytes", "Bytes of one page's FP8 scales (0 for bf16/fp16).")
    page_bytes = _pooled("page_bytes", "Bytes one page of every layer costs, scales included.")
    num_window_pages = _pooled("num_window_pages", "Pages of the HBM window (``mirror``).")

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
        summaries: bool = False,
    ) -> None:
        self.num_layers = check_int(num_layers, "num_layers", 1)
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 8)
        if self.head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 (16-byte rows), got {head_dim}")
        self.page_size = check_int(page_size, "page_size", 1)
        if self.page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
        capacity = {
            "host": check_int(num_host_pages, "num_host_pages", 1),
            "hbm": check_int(num_hbm_pages, "num_hbm_pages", 0),
        }
        window = check_int(num_window_pages, "num_window_pages", 0)
        for tier, n in capacity.items():
            if n + (window if tier == "hbm" else 0) > MAX_PAGES:
                raise ValueError(f"{tier} tier: {n} pages do not fit int32 page-table entries")
        device = torch.device(device)
        dtype, compute_dtype = resolve_dtypes(dtype, compute_dtype, device)
        device = resolve_device(device, self.head_dim)
        self._pools = DevicePools(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, capacity,
                                  window, dtype, compute_dtype, device)
        if not isinstance(summaries, bool):
            raise TypeError(f"summaries must be a bool, got {type(summaries).__name__}")
        self._summaries = PageSummaries(self._pools) if summaries else None
        if summaries:
            self._book = PageBook(capacity, self.page_size, window, self._copy_page, self._summaries.reset)
        else:
            self._book = PageBook(capacity, self.page_size, window, self._pools.copy_page)
        self._capacity = capacity
        self._lock = threading.RLock()
        self._closed = False

    @classmethod
    def for_model(cls, config, *, host_bytes: int, hbm_bytes: int = 0, page_size: int = DEFAULT_PAGE_SIZE,
                  dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                  compute_dtype: torch.dtype | None = None, summaries: bool = False) -> "PagedKVCache":
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
        host = check_int(host_bytes, "host_bytes") // one
        if host < 1:
            raise ValueError(f"host_bytes={host_bytes} holds no page of {one} bytes ({page_size} tokens)")
        return cls(layers, hkv, head_dim, page_size, num_host_pages=host,
                   num_hbm_pages=check_int(hbm_bytes, "hbm_bytes") // one, dtype=dtype, device=device,
                   compute_dtype=compute_dtype, summaries=summaries)

    @property
    def device(self) -> torch.device:
        """The cache device (the HBM pool's; the GPU the host pool is mapped for)."""
        return self._pools.device

    @device.setter
    def device(self, value: torch.device) -> None:  # tests stand a CPU cache in for a CUDA one
        self._pools.device = self._pools.log.device = value

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Unpin the host pool now (idempotent). The cache, and CUDA views of it, are unusable after."""
        self._closed = True
        self._pools.close()

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
            f"hbm {self.free_pages('hbm')}/{self._capacity['hbm']} free, {len(self._book.seqs)} sequences)"
        )

    @property
    def summaries(self) -> PageSummaries | None:
        """The page summaries (``summaries=True``): ``host`` / ``hbm`` tensors (pages, L, Hkv, 2, d),
        min then max of each page's K rows, indexed by the decoded page-table entries; None when
        off."""
        return self._summaries

    @property
    def host_pinned(self) -> bool:
        """True while the host pool is page-locked and mapped for the GPU."""
        return self._pools.host_pinned

    # ---- queries ---------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        """Ids of the live sequences, in creation order."""
        return list(self._book.seqs)

    def num_pages(self, tier: Tier = "host") -> int:
        """Capacity of ``tier`` in pages."""
        return self._capacity[check_tier(tier)]

    @_locked
    def free_pages(self, tier: Tier = "host") -> int:
        """Free pages of ``tier``."""
        return self._book.free_pages(tier)

    @_locked
    def free_window_pages(self) -> int:
        """Free pages of the HBM window (``mirror``)."""
        return len(self._book.free_window)

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
        self._check_open()
        return self._book.page_counts(seq_id)

    @_locked
    def page_hbm(self, seq_ids: Sequence[int]) -> list[list[bool]]:
        """Per sequence, per logical page: whether it lives in HBM (``plan.decode_traffic`` input)."""
        return [(self._seq(s).table() < 0).tolist() for s in seq_ids]

    @property
    def page_generation(self) -> int:
        """Goes up whenever a page changes owner or meaning, or a sequence is freed: kernel
        tables built before are stale (``check_tables``)."""
        return self._book.generation

    @_locked
    def state(self) -> CacheState:
        """A deep snapshot of the bookkeeping, for invariant checks and tests."""
        return self._book.state()

    def device_pool(self, tier: Tier) -> torch.Tensor:
        """The tier's pool as a tensor on the cache device (``host_pool_cuda`` for host on CUDA).

        Shape (num_pages, num_layers, num_kv_heads, 2, page_size, head_dim).
        """
        self._check_open()
        return self._pools.pool(tier)

    def device_scales(self, tier: Tier) -> torch.Tensor | None:
        """The tier's FP8 scale pool on the cache device (None for bf16/fp16 pages).

        Shape (num_pages, num_layers, num_kv_heads, 2, page_size), float32.
        """
        self._check_open()
        return self._pools.scales(tier)

    # ---- sequence operations ---------------------------------------------------------------
    @_locked
    def add_sequence(self) -> int:
        """Create an empty sequence and return its id (ids are never reused)."""
        self._check_open()
        return self._book.add_sequence()

    @_locked
    def extend(self, seq_id: int, n: int, tier: Tier = "host") -> int:
        """Reserve ``n`` more tokens (all layers); new pages come from ``tier``. Returns the start position."""
        self._check_open()
        return self._book.extend(seq_id, n, tier)

    @_locked
    def write(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens ``[start, start + n)`` of one layer; the tokens must be allocated.

        k, v: (n, num_kv_heads, head_dim), cache dtype, on the cache device. Pages still shared
        with a fork are copied first (copy-on-write).
        """
        seq = self._seq(seq_id)
        layer = self._check_layer(layer)
        n = self._pools.check_kv(k, v, (self.num_kv_heads, self.head_dim), "(n, num_kv_heads, head_dim)")
        start = check_int(start, "start")
        if start + n > seq.length:
            raise ValueError(
                f"write of tokens [{start}, {start + n}) past the end of sequence {seq_id} "
                f"(length {seq.length}; extend it first)"
            )
        if n == 0:
            return
        self._book.unshare_range(seq_id, start, start + n)
        self._store(seq, layer, start, k, v)

    @_locked
    def append(self, seq_id: int, k: torch.Tensor, v: torch.Tensor, tier: Tier = "host") -> int:
        """Extend by n tokens and write them for all layers. Returns the start position.

        k, v: (n, num_layers, num_kv_heads, head_dim), cache dtype, on the cache device.
        """
        seq = self._seq(seq_id)
        n = self._pools.check_kv(
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
    def token_slots(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> TokenSlots:
        """Where tokens ``[starts[i], starts[i] + counts[i])`` of ``seq_ids[i]`` live, for
        ``write_slots``: one host-to-device copy for the whole batch, reused by every layer.

        The tokens must be allocated (``extend``). Pages in the range that are still shared with
        a fork get private copies first (copy-on-write), for every sequence, before anything is
        returned; the capacity for those copies is checked before any is made.
        """
        entry, off = self.token_entries(seq_ids, starts, counts)
        return self.build_slots(entry, off, self.mirror_entries(seq_ids, starts, counts),
                                taken_at=self._book.generation)

    @_locked
    def build_slots(self, entry: np.ndarray, off: np.ndarray, mirror: np.ndarray | None = None, *,
                    taken_at: int) -> TokenSlots:
        """``TokenSlots`` of per-token page entries and rows (``token_entries``, several calls
        concatenated) and window pages (``mirror_entries``), stamped with this cache's identity
        and slot generation now: ``write_slots`` refuses them once a page may have changed owner
        since (freed, moved, copied, forked or mirrored).

        ``taken_at``: ``page_generation`` read when the first of the entries were taken; the
        entries are refused (``StaleTablesError``) if a page has been freed, moved or copied, or
        a sequence freed, since. Forks and new mirrors in between are the caller's to mean:
        a fork then shares what the slots write."""
        self._check_open()
        if taken_at != self._book.generation:
            raise StaleTablesError("stale token entries: a page they name was freed, moved or copied since they "
                                   "were taken; take them again")
        return TokenSlots.build(entry, off, self.device, mirror, cache_id=id(self),
                                generation=self._book.slot_generation, geometry=self._geometry)

    def check_slots(self, slots: TokenSlots) -> None:
        """Raise ``StaleTablesError`` unless ``slots`` came from this cache (``token_slots`` /
        ``build_slots``) and no page has changed owner since (``TypeError`` for non-slots)."""
        check_slots(slots, id(self), self._book.slot_generation)

    @_locked
    def mirror_entries(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
        """int64 (total,): the HBM window page mirroring each token's page (-1: none), in
        ``token_entries`` order, for ``TokenSlots.build``."""
        self._check_open()
        return self._book.mirror_entries(seq_ids, starts, counts)

    @_locked
    def mirror(self, seq_id: int, start: int, n: int) -> int:
        """Give the host pages holding tokens ``[start, start + n)`` (allocated) an HBM mirror
        from the window, first page first, as far as free window pages go. A mirror starts as a
        copy of its host page (all layers), except a page that ``extend`` handed out, that no
        write went to since, and whose tokens all lie in the range: the writes to come fill that
        one. Kernel tables naming a mirror thus read what its host page holds. Pages in the HBM
        tier, and pages already mirrored, are left as they are. Returns the pages mirrored now.

        From then on every write to such a page goes to both copies, and ``kernel_tables`` names
        the mirror while the host page is private (a shared page is read where its sharers read
        it, so a cascade still finds it)."""
        self._check_open()
        return self._book.mirror(seq_id, start, n)

    @_locked
    def release_mirrors(self, seq_id: int, keep_partial: bool = True) -> int:
        """Drop the sequence's mirrors (their host pages are current: writes went to both),
        except, with ``keep_partial``, the partial last page's. Returns the pages released."""
        self._check_open()
        return self._book.release_mirrors(seq_id, keep_partial)

    @_locked
    def token_entries(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]):
        """``token_slots`` as host arrays: (page entry, row in page) int64 (total,) per token, after
        the same copy-on-write. Entries of several calls concatenate into one ``TokenSlots.build``
        (a step that forks sequences between them: the forks then share what the first call's
        tokens write)."""
        self._check_open()
        return self._book.token_entries(seq_ids, starts, counts)

    @_locked
    def write_slots(self, slots: TokenSlots, layer: int, k: torch.Tensor, v: torch.Tensor,
                    defer_host: bool = False) -> None:
        """Store K/V rows ``k[i]``, ``v[i]`` ((total, num_kv_heads, head_dim), cache dtype, on the
        cache device) of one layer at the positions ``slots`` (from ``token_slots``) names.

        ``defer_host``: tokens whose page has a mirror are stored in the mirror only, and the copy
        engine then copies this layer of those pages into their host pages on a side stream
        (ordered after this write), off the current stream's path; every later operation of the
        cache that reads host pages, and every ``kernel_tables`` call, waits for it first."""
        self._check_open()
        self.check_slots(slots)
        layer = self._check_layer(layer)
        n = self._pools.check_kv(k, v, (self.num_kv_heads, self.head_dim), "(n, num_kv_heads, head_dim)")
        if n != slots.total:
            raise ValueError(f"{n} K/V rows for {slots.total} slots")
        stored, scales = self._pools.store(slots.store_index(defer_host), self._layer_start(layer), k, v,
                                           slots.host_pages)
        if self._summaries is not None:
            self._summaries.merge(slots, layer, self._summaries.stored_k(k, stored, scales))
        if defer_host:
            self._copy_back(layer, slots.runs)

    def write_destinations(self, slots: TokenSlots, defer_host: bool = False) -> dict:
        """``kv_project``'s ``host=`` / ``hbm=`` arguments for the tokens of ``slots``: the pools on
        the cache device and int64 (total,) slots (``page * page_size + row``, -1 for a token the
        pool does not take), the destinations ``write_slots`` stores to (a tier no token goes to
        is left out). ``defer_host``: mirrored tokens go to their mirrors only (then
        ``copy_mirrors_to_host(slots, layer)``, as ``write_slots(defer_host=True)`` does). After
        enqueueing the write, call ``note_host_write(slots)``: a staged attention call then copies
        those host pages after it (``host_writes``); with ``summaries``, also
        ``refresh_summaries(slots, layer)``. No host synchronisation."""
        self._check_open()
        self.check_slots(slots)  # this cache's slots, no page they name freed or moved since
        return {tier: (self._pools.pool(tier), s) for tier, s in slots.project_slots(defer_host).items()}

    def refresh_summaries(self, slots: TokenSlots, layer: int | None = None) -> None:
        """Bring ``summaries`` up to date with a store of the tokens of ``slots`` at ``layer``
        (None: every layer) that a writer made by other means (``kv_project`` into
        ``write_destinations``): the stored K rows are read back from the pools, from the HBM copy
        where a token has one, else from its host page (on a GPU, ``Hkv * head_dim`` elements per
        such token and layer cross the link), and merged. Call it after enqueueing the write, on
        the same stream; no host synchronisation. Nothing to do without summaries."""
        if self._summaries is None:
            return
        with self._lock:  # reads the rows just stored and the mirrors: no wait for the copy engine
            self._check_open()
            self.check_slots(slots)
            self._summaries.refresh(slots, None if layer is None else self._check_layer(layer))

    @_locked
    def copy_mirrors_to_host(self, slots: TokenSlots, layer: int) -> None:
        """The host half of ``write_slots(defer_host=True)`` for a writer that stored the slots'
        mirrored tokens itself (``kv_project``): queue the copies of this layer of their pages."""
        self._check_open()
        self.check_slots(slots)
        self._copy_back(self._check_layer(layer), slots.runs)

    def note_host_write(self, pages=None) -> None:
        """Record that work already enqueued on the current stream writes host pages ``pages``
        (a ``TokenSlots``, host page indices, or None: any page). The cache's own writes are
        recorded; call this after a write by other means (``kv_project`` into
        ``kv_proj.cache_destinations``), so that staged attention calls copy those pages after it."""
        if isinstance(pages, TokenSlots):
            with self._lock:
                self.check_slots(pages)
            pages = pages.host_pages
        elif pages is not None:
            if isinstance(pages, torch.Tensor):
                pages = pages.detach().cpu().numpy()
            raw = np.asarray(pages)
            if raw.size and (raw.dtype.kind not in "iu"):
                raise TypeError(f"host pages must be integers (page indices), got {raw.dtype} values")
            pages = np.unique(raw.astype(np.int64).reshape(-1))
            if pages.size and (pages[0] < 0 or pages[-1] >= self._capacity["host"]):
                raise IndexError(f"host pages {pages[0]}..{pages[-1]} outside the pool's {self._capacity['host']}")
        with self._lock:
            self._book.written_host(pages)
            self._pools.log.record(pages)

    def host_writes(self) -> list[tuple[object, np.ndarray | None]]:
        """The recorded host writes not known to be done, as (CUDA event, host pages or None: any
        page): work that waits for the event is ordered after the write. Writes recorded without
        an event get one now, on the current stream (they were enqueued there); finished ones are
        dropped. Empty on a CPU cache."""
        with self._lock:
            return self._pools.log.pending()

    @property
    def _host_writes(self) -> list[list]:
        """The raw record behind ``host_writes`` (entries [event or None, pages or None])."""
        return self._pools.log.entries

    def _wrote_host(self, pages, event=None) -> None:
        """Record a host write by the cache's own means (see ``host_writes``)."""
        self._pools.log.record(pages, event)

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
        stop = seq.length if stop is None else check_int(stop, "stop")
        start = check_int(start, "start")
        if not start <= stop <= seq.length:
            raise ValueError(f"read range [{start}, {stop}) outside sequence {seq_id} of length {seq.length}")
        lsel = slice(None) if layer is None else layer
        token_shape = (self.num_kv_heads, self.head_dim)
        if layer is None:
            token_shape = (self.num_layers, *token_shape)
        slots = TokenSlots.of(self._book, seq, start, stop - start, self.device)
        return self._pools.read(slots.parts, lsel, stop - start, token_shape)

    @_locked
    def fork(self, seq_id: int, length: int | None = None) -> int:
        """New sequence with the same contents: full pages shared, the partial last page copied now.

        ``length`` (a multiple of the page size, at most the sequence's length): the new sequence
        holds only the first ``length`` tokens, all in shared pages (a fork at a shared prefix)."""
        self._check_open()
        return self._book.fork(seq_id, length)

    @_locked
    def free(self, seq_id: int) -> None:
        """Drop the sequence; pages whose refcount reaches 0 return to their tier's free list."""
        self._check_open()
        self._book.free_sequence(seq_id)

    @_locked
    def truncate(self, seq_id: int, length: int) -> None:
        """Shorten the sequence to its first ``length`` tokens; pages past them are released.

        A page that stays but was shared becomes the new partial last page: it is copied first
        (capacity checked before anything changes), so the last page stays private.
        """
        self._check_open()
        self._book.truncate(seq_id, length)
        rows = length % self.page_size
        if self._summaries is not None and rows:  # the new partial last page: its remaining rows
            seq = self._book.seq(seq_id)
            lp = len(seq.pages) - 1
            mirror = seq.mirrors.get(lp)
            if mirror is None:
                self._summaries.recompute(seq.pages[lp], rows)
            else:  # the mirror is current (the host copy may be on its way): read it
                self._summaries.recompute(encode_page("hbm", mirror), rows, also=(seq.pages[lp],))

    @_locked
    def move_pages(self, seq_id: int, logical_pages: Iterable[int], tier: Tier) -> None:
        """Move the given logical pages of a sequence to ``tier``.

        The physical page moves: its data is copied to a new page of ``tier``, every sequence
        sharing it is repointed, and the old page is freed. Pages already in ``tier`` stay.
        """
        self._check_open()
        self._book.move_pages(seq_id, logical_pages, tier)

    @_locked
    def set_hbm_fraction(self, seq_id: int, fraction: float, placement: str = "recent") -> None:
        """Place ``floor(fraction * num_pages + 0.5)`` of the sequence's pages in HBM, the rest in host memory.

        placement "recent": the most recent (last) pages go to HBM; "strided": evenly spread pages
        (page i is in HBM iff floor((i + 1) * f) > floor(i * f) for f = hbm_pages / num_pages).
        Pages shared with forks move for every sharer (see ``move_pages``).
        """
        self._check_open()
        self._book.set_hbm_fraction(seq_id, fraction, placement)

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
        return build_kernel_tables(self._book, seqs, self.device, id(self), back_to_back)

    def check_tables(self, tables: KernelTables) -> None:
        """Raise ``StaleTablesError`` unless ``tables`` came from this cache's ``kernel_tables``
        and no page has been freed, moved or copied-on-write, nor any sequence freed, since (two
        integer compares); ``TypeError`` unless they are ``KernelTables``."""
        check_tables(tables, id(self), self._book.generation)

    # ---- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the cache is closed")

    def _seq(self, seq_id: int) -> SeqPages:
        self._check_open()
        return self._book.seq(seq_id)

    def _check_layer(self, layer: int) -> int:
        layer = check_int(layer, "layer")
        if layer >= self.num_layers:
            raise IndexError(f"layer {layer} out of range for a cache of {self.num_layers} layers")
        return layer

    def _copy_page(self, src: int, dst: int) -> None:
        """Copy a page (encoded entries), its summaries with it."""
        self._pools.copy_page(src, dst)
        self._summaries.copy(src, dst)

    def _copy_back(self, layer: int, runs) -> None:
        """Queue the copy engine's copies of one layer of mirrored pages to their host pages."""
        self._pools.copy_back(layer, runs)

    @property
    def _geometry(self) -> tuple[int, int, int]:
        """(num_kv_heads, page_size, num_layers): what the store rows of ``TokenSlots`` need."""
        return self.num_kv_heads, self.page_size, self.num_layers

    def _layer_start(self, layer: int) -> int:
        return layer_start(layer, self.num_kv_heads, self.page_size)

    def _store(self, seq: SeqPages, layer: int | None, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Indexed stores of k, v ((n, Hkv, d) for one layer, (n, L, Hkv, d) for None) into their
        pages, window mirrors written through."""
        self._book.written(seq, start, k.shape[0])
        slots = TokenSlots.of(self._book, seq, start, k.shape[0], self.device, mirrors=True, geometry=self._geometry,
                              all_layers=layer is None)
        stored, scales = self._pools.store(slots.store_index(), 0 if layer is None else self._layer_start(layer),
                                           k, v, slots.host_pages)
        if self._summaries is not None:
            self._summaries.merge(slots, layer, self._summaries.stored_k(k, stored, scales))
