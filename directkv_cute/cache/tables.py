"""What the kernels and the stores index by: a batch's kernel tables (``KernelTables``, built
from the page book) and the destinations of a batch of token rows (``TokenSlots``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from directkv_cute.cache.pages import PageBook, SeqPages, encode_page
from directkv_cute.cache.store import StoreIndex, one_copy, pool_rows, token_slots


class StaleTablesError(ValueError):
    """Kernel tables from another cache, or built before pages they name were freed or moved."""


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
    # Every entry names an HBM page: the builder's word for tables made on the device without a
    # host copy (``host_table`` None), so that a plan routes them as HBM reads without reading
    # them back (vLLM's blocks over a tier that mirrors every block).
    hbm_only: bool = False

    @property
    def is_hbm(self) -> torch.Tensor:
        """bool (B, max_pages): True where the entry is an HBM page."""
        return self.page_table < 0

    def num_pages(self, page_size: int) -> torch.Tensor:
        """int32 (B,): pages each sequence owns, ``ceil(seq_len / page_size)``."""
        return torch.div(self.seq_lens + (page_size - 1), page_size, rounding_mode="floor")


def host_kernel_table(book: PageBook, seqs: list[SeqPages]) -> tuple[np.ndarray, np.ndarray]:
    """(packed, table): int32 (B * max_pages + B,), the batch's page table row by row then its
    lengths, and the table part as a (B, max_pages) view of it.

    A mirrored page whose host page is private is named by its mirror (the step's own K/V are
    read from HBM); a shared page is read where its sharers read it."""
    batch, max_pages = len(seqs), max(len(seq.pages) for seq in seqs)
    packed = np.empty(batch * max_pages + batch, dtype=np.int32)  # page_table then seq_lens
    table = packed[: batch * max_pages].reshape(batch, max_pages)
    for row, seq in zip(table, seqs):
        pages = seq.table()
        row[: len(pages)] = pages
        row[len(pages) :] = pages[-1]
        for lp, w in seq.mirrors.items():
            if book.refs["host"][pages[lp]] == 1:  # private: read its mirror
                row[lp] = encode_page("hbm", w)
                if lp == len(pages) - 1:
                    row[len(pages) :] = row[lp]
    packed[batch * max_pages :] = [seq.length for seq in seqs]
    return packed, table


def build_kernel_tables(book: PageBook, seqs: list[SeqPages], device: torch.device, cache_id: int,
                        back_to_back: bool = False) -> KernelTables:
    """``KernelTables`` of the batch ``seqs`` on ``device`` (one host-to-device copy)."""
    packed, table = host_kernel_table(book, seqs)
    batch, max_pages = table.shape
    # non_blocking: a pageable source is staged by the driver before the call returns (so
    # `packed` may go), and the host does not wait for the GPU's queued work, as a blocking
    # copy (stream synchronize) would on every attention call.
    dev = torch.from_numpy(packed).to(device, non_blocking=True)
    return KernelTables(dev[: batch * max_pages].view(batch, max_pages), dev[batch * max_pages :], cache_id,
                        book.generation, tuple(seq.length for seq in seqs), table.copy(), bool(back_to_back))


def check_tables(tables: KernelTables, cache_id: int, generation: int) -> None:
    """Raise ``StaleTablesError`` unless ``tables`` came from the cache ``cache_id`` at page
    generation ``generation`` (``TypeError`` unless they are ``KernelTables``)."""
    if not isinstance(tables, KernelTables):
        raise TypeError(f"tables must be KernelTables from the cache's kernel_tables(), got {type(tables).__name__}")
    if tables.cache_id != cache_id:
        raise StaleTablesError("kernel tables from another cache (or built by hand); build them with "
                               "this cache's kernel_tables()")
    if tables.generation != generation:
        raise StaleTablesError("stale kernel tables: pages they name were freed, moved or copied since "
                               "they were built; call kernel_tables() again")


def check_kernel_tables(tables, cache) -> None:
    """The check every user of kernel tables runs before reading through them: ``TypeError``
    unless ``tables`` are ``KernelTables``; over a ``PagedKVCache`` (anything with
    ``check_tables``), ``StaleTablesError`` unless that cache built them and no page they name
    was freed, moved or copied since, and no sequence of the cache was freed since. Pool views
    without a page book (the plain-tensor op) have only the type checked."""
    if not isinstance(tables, KernelTables):
        raise TypeError(f"tables must be KernelTables from the cache's kernel_tables(), got {type(tables).__name__}")
    check = getattr(cache, "check_tables", None)
    if check is not None:
        check(tables)


def check_slots(slots, cache_id: int, generation: int) -> None:
    """Raise ``StaleTablesError`` unless ``slots`` are ``TokenSlots`` that the cache ``cache_id``
    built at slot generation ``generation`` (``TypeError`` unless they are ``TokenSlots``)."""
    if not isinstance(slots, TokenSlots):
        raise TypeError(f"slots must be TokenSlots from the cache's token_slots(), got {type(slots).__name__}")
    if slots.cache_id != cache_id:
        raise StaleTablesError("token slots from another cache (or built by hand); take them with this cache's "
                               "token_slots()")
    if slots.generation != generation:
        raise StaleTablesError("stale token slots: a page they name was freed, moved, copied, forked or mirrored "
                               "since they were taken (it may belong to another sequence now); nothing was "
                               "written: call token_slots() again")


@dataclass(frozen=True)
class TokenSlots:
    """Destinations of a batch of token rows, by tier (see ``PagedKVCache.token_slots``).

    parts: (tier, tok, pidx, off) per destination: ``tok`` int64 (m,) the rows it takes, or None
    when all rows go there; ``pidx`` int64 (m,) their pages; ``off`` int64 (m,) their rows within
    the page. All on the cache device. A token whose page has a window mirror goes to the mirror
    (a part of tier "hbm") and to its host page, the part in ``mirrored``; ``runs`` (window page,
    host page, pages) cover those pages, for copying them instead (``write_slots(defer_host=True)``).

    The same destinations for the writers (``cache.store``), made with the cache's geometry
    (``build_slots``, the cache's own writes): ``store`` holds the rows of every destination
    (``StoreIndex``, layer 0, or every layer for a store of all layers) and the same without the
    host rows of mirrored tokens (``store_index(defer_host=True)``); ``slots`` holds
    ``kv_project``'s per-token slots of the host pool (every host page; without the mirrored
    tokens) and of the HBM pool, None where no token goes (``project_slots``).
    """

    total: int
    parts: tuple
    mirrored: tuple = ()
    runs: tuple = ()
    host_pages: np.ndarray | None = None  # int64: the distinct host pages the rows go to (mirrored ones too)
    # The cache that took them (id(), 0: built by hand) and its slot generation then: a write
    # through them is refused once any page may have changed owner (``check_slots``).
    cache_id: int = 0
    generation: int = -1
    store: tuple = ()  # (StoreIndex of every destination, StoreIndex without mirrored tokens' host rows)
    slots: tuple = ()  # kv_project's int64 (total,) slots: (host, host without mirrored tokens, HBM)

    def store_index(self, defer_host: bool = False) -> StoreIndex:
        """The rows a store of these tokens writes (``defer_host``: mirrored tokens to their
        mirrors only)."""
        if not self.store:
            raise ValueError("these token slots were built without the cache's geometry: take them with the "
                             "cache's token_slots()")
        return self.store[1 if defer_host else 0]

    def project_slots(self, defer_host: bool = False) -> dict:
        """``kv_project``'s slots of these tokens per tier, {"host": int64 (total,), "hbm": ...},
        -1 for a token the tier does not take; a tier no token goes to is left out."""
        if not self.slots:
            raise ValueError("these token slots were built without the cache's geometry: take them with the "
                             "cache's token_slots()")
        host, direct, hbm = self.slots
        return {tier: s for tier, s in (("host", direct if defer_host else host), ("hbm", hbm)) if s is not None}

    @staticmethod
    def build(entry: np.ndarray, off: np.ndarray, device, mirror: np.ndarray | None = None, *,
              cache_id: int = 0, generation: int = -1, geometry: tuple | None = None,
              all_layers: bool = False) -> "TokenSlots":
        """From per-token page entries and rows (``token_entries``); ``mirror`` int64 (total,):
        each token's HBM window page (``mirror_entries``, -1: none) -- a second destination.
        ``cache_id``, ``generation``: the identity ``check_slots`` compares (a cache's
        ``build_slots`` fills them). ``geometry``: the cache's (num_kv_heads, page_size,
        num_layers), for the writers' ``store`` and ``slots`` (``all_layers``: rows of every
        layer, for a store of all layers at once)."""
        stamp = {"cache_id": cache_id, "generation": generation}
        total = len(entry)
        entry, off = np.asarray(entry, dtype=np.int64), np.asarray(off, dtype=np.int64)
        in_hbm = entry < 0
        mirrored = np.zeros(total, bool) if mirror is None else mirror >= 0
        plain, mir = np.flatnonzero(~in_hbm & ~mirrored), np.flatnonzero(mirrored)
        hbm = np.flatnonzero(in_hbm)
        host_pages = np.unique(entry[~in_hbm]).astype(np.int64)
        # (tokens, pages, offsets) of each group: host pages, the mirrored tokens' host pages (the
        # part ``defer_host`` leaves to the copy engine), HBM pages, window mirrors. Each pool's
        # destinations are its groups one after the other, so every group is a slice of them.
        groups = [(plain, entry[plain]), (mir, entry[mir]), (hbm, -entry[hbm] - 1),
                  (mir, mirror[mir] if len(mir) else mir)]
        groups = [(tok, pages, off[tok]) for tok, pages in groups]
        dests = [tuple(np.concatenate(x) for x in zip(*pair)) for pair in (groups[:2], groups[2:])]
        arrays = [a for dest in dests for a in dest]
        if geometry is not None:
            page_size = geometry[1]
            arrays += [token_slots(total, groups[:2], page_size), token_slots(total, groups[:1], page_size),
                       token_slots(total, groups[2:], page_size)]
        views = one_copy(arrays, device)
        (h_tok, h_page, h_off), (b_tok, b_page, b_off) = views[:3], views[3:6]
        n_plain, n_hbm = len(plain), len(hbm)
        tiered = [("host", h_tok[:n_plain], h_page[:n_plain], h_off[:n_plain]),
                  ("hbm", b_tok[:n_hbm], b_page[:n_hbm], b_off[:n_hbm]),
                  ("hbm", b_tok[n_hbm:], b_page[n_hbm:], b_off[n_hbm:]),
                  ("host", h_tok[n_plain:], h_page[n_plain:], h_off[n_plain:])]
        # parts in the order host pages, HBM pages, window mirrors, mirrored tokens' host pages
        parts = tuple((tier, None if len(tok) == total else tok, pidx, o) for tier, tok, pidx, o in tiered if len(tok))
        extra = {}
        if geometry is not None:
            num_kv_heads, page_size, num_layers = geometry
            h_rows = pool_rows(h_page, h_off, num_kv_heads, page_size, num_layers, all_layers)
            b_rows = pool_rows(b_page, b_off, num_kv_heads, page_size, num_layers, all_layers)
            dense = bool(np.array_equal(dests[0][0], np.arange(total)))
            write = StoreIndex(h_rows, None if dense else h_tok, b_rows, b_tok, total)
            direct = write
            if len(mir):  # the host rows of the plain tokens: the first of them
                per_token = len(h_rows) // len(h_tok)
                direct = StoreIndex(h_rows[:n_plain * per_token], h_tok[:n_plain], b_rows, b_tok, total)
            extra = {"store": (write, direct), "slots": tuple(views[6:9])}
        if not len(mir):
            return TokenSlots(total, parts, host_pages=host_pages, **stamp, **extra)
        runs: list[list[int]] = []  # (window page, host page, pages) over the distinct pairs, in order
        for w, h in dict.fromkeys(zip(mirror[mir].tolist(), entry[mir].tolist())):
            if runs and runs[-1][0] + runs[-1][2] == w and runs[-1][1] + runs[-1][2] == h:
                runs[-1][2] += 1
            else:
                runs.append([w, h, 1])
        return TokenSlots(total, parts[:-1], (parts[-1],), tuple(map(tuple, runs)), host_pages, **stamp, **extra)

    @staticmethod
    def of(book: PageBook, seq: SeqPages, start: int, n: int, device, mirrors: bool = False,
           geometry: tuple | None = None, all_layers: bool = False) -> "TokenSlots":
        """Where tokens [start, start + n) of one sequence live; with ``mirrors`` their window
        mirrors too; ``geometry``, ``all_layers``: as ``build``."""
        entry, off = book.entries(seq, start, n)
        return TokenSlots.build(entry, off, device, book.mirror_of(seq, start, n) if mirrors else None,
                                geometry=geometry, all_layers=all_layers)
