"""Page bookkeeping of the paged KV cache: per-sequence page tables, reference counts, free lists,
fork / copy-on-write, tier moves, window mirrors and the capacity checks, with no tensors.

Each sequence has a list of page-table entries in logical order; ``e >= 0`` is host page ``e``,
``e < 0`` is HBM page ``-e - 1`` (``encode_page`` / ``decode_page``). Pages are reference-counted
per tier; a page with refcount 0 is on its tier's free list, and a page never appears twice in
one table. A sequence of length ``n`` owns exactly ``ceil(n / page_size)`` pages. Every operation
computes how many free pages it needs per tier and raises ``CacheCapacityError`` before it
modifies anything.

The book moves no data itself: where an operation needs a page's data copied (a fork's partial
last page, copy-on-write, a move between tiers, a mirror of a page with history) it calls the
``copy_page(src_entry, dst_entry)`` it was given, in the order the copies must run; where it hands
out pages with nothing in them (``extend``'s new pages, a window mirror its writes will fill) it
calls ``fresh_pages(entries)`` once with their entries (the page summaries start empty there).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Tier = Literal["host", "hbm"]
TIERS: tuple[Tier, ...] = ("host", "hbm")
PLACEMENTS = ("recent", "strided")
MAX_PAGES = 2**31 - 1  # page ids must fit int32 entries


class CacheCapacityError(ValueError):
    """A tier has too few free pages for the operation; the cache was left unchanged."""


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


def kernel_host_pool(cache):
    """The host pool of a ``PagedKVCache`` or ``runner.PoolView`` as GPU kernels address it: the
    CUDA alias of the pinned pool where there is one, else the pool itself."""
    return cache.host_pool if cache.host_pool_cuda is None else cache.host_pool_cuda


def kernel_host_scales(cache):
    """The host pool's FP8 scales as GPU kernels address them (``kernel_host_pool``), or None."""
    return cache.host_scales if cache.host_scales_cuda is None else cache.host_scales_cuda


def check_int(value: object, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_tier(tier: str) -> Tier:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    return tier


def fork_tiers(tails: Sequence[Tier | None], free: dict[str, int]) -> list[Tier | None]:
    """The tier of each fork's copy of its sequence's partial last page, in order: the page's own
    tier (``tails[i]``; None: the sequence ends on a full page, nothing to copy) while it has
    free pages (``free``), else the other tier. ``CacheCapacityError`` when neither has one."""
    left = {t: free.get(t, 0) for t in TIERS}
    out: list[Tier | None] = []
    for tier in tails:
        if tier is not None:
            if not left[tier]:
                tier = "host" if tier == "hbm" else "hbm"
            if not left[tier]:
                copies = sum(t is not None for t in tails)
                raise CacheCapacityError(f"cannot fork: {copies} partial last pages to copy, "
                                         f"{free.get('host', 0)} host and {free.get('hbm', 0)} hbm pages free; "
                                         "the cache is unchanged")
            left[tier] -= 1
        out.append(tier)
    return out


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
class SeqPages:
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


def _no_copy(src: int, dst: int) -> None:
    return None


def _no_fresh(entries: list[int]) -> None:
    return None


class PageBook:
    """The page tables of every sequence over two tiers of ``capacity`` pages and a window of
    ``num_window_pages`` HBM pages numbered after the HBM tier's (``mirror``).

    ``generation`` goes up whenever an existing page changes owner or meaning (freed, moved,
    copied on write, a mirror dropped) or a sequence is freed: kernel tables built before then
    are stale. ``slot_generation`` goes up with it and also when a page gains a sharer (fork) or
    a mirror, or a sequence is truncated: token slots taken before then would write a page
    another sequence reads, miss a mirror the tables name, or write past a sequence's end.
    """

    def __init__(self, capacity: dict[str, int], page_size: int, num_window_pages: int = 0,
                 copy_page: Callable[[int, int], None] = _no_copy,
                 fresh_pages: Callable[[list[int]], None] = _no_fresh) -> None:
        self.capacity = dict(capacity)
        self.page_size = page_size
        self.copy_page = copy_page
        self.fresh_pages = fresh_pages
        self.generation = 0
        self.slot_generation = 0
        self.refs = {tier: np.zeros(n, dtype=np.int32) for tier, n in self.capacity.items()}
        # Free lists are stacks popped from the end, so pages are handed out in increasing order.
        self.free = {tier: list(range(n - 1, -1, -1)) for tier, n in self.capacity.items()}
        hbm = self.capacity["hbm"]
        self.free_window = list(range(hbm + num_window_pages - 1, hbm - 1, -1))
        self.seqs: dict[int, SeqPages] = {}
        self._next_id = 0
        # Host pages ``extend`` handed out that no write was planned into since (``written``):
        # nothing in them to copy into a mirror.
        self.unwritten: set[int] = set()

    # ---- queries ---------------------------------------------------------------------------
    def seq(self, seq_id: int) -> SeqPages:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
        try:
            return self.seqs[int(seq_id)]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence id {seq_id} (live: {list(self.seqs)})") from None

    def free_pages(self, tier: Tier) -> int:
        return len(self.free[check_tier(tier)])

    def page_counts(self, seq_id: int) -> dict[str, int]:
        table = self.seq(seq_id).table()
        hbm = int(np.count_nonzero(table < 0))
        return {"host": len(table) - hbm, "hbm": hbm}

    def state(self) -> CacheState:
        return CacheState(
            seq_lens={i: s.length for i, s in self.seqs.items()},
            page_tables={i: tuple(s.pages) for i, s in self.seqs.items()},
            refcounts={t: tuple(int(r) for r in self.refs[t]) for t in TIERS},
            free_lists={t: tuple(self.free[t]) for t in TIERS},
            mirrors={i: tuple(sorted(s.mirrors.items())) for i, s in self.seqs.items() if s.mirrors},
            free_window=tuple(self.free_window),
        )

    def entries(self, seq: SeqPages, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(page entry, row in page) int64 (n,) of tokens [start, start + n) of the sequence."""
        pos = np.arange(start, start + n)  # (n,)
        return seq.table()[pos // self.page_size].astype(np.int64), pos % self.page_size

    def mirror_of(self, seq: SeqPages, start: int, n: int) -> np.ndarray:
        """int64 (n,): the window page mirroring each of tokens [start, start + n) (-1: none)."""
        if not seq.mirrors:
            return np.full(n, -1, dtype=np.int64)
        lps = np.arange(start, start + n) // self.page_size
        return np.array([seq.mirrors.get(int(lp), -1) for lp in lps], dtype=np.int64)

    def mirror_entries(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
        """int64 (total,): the window page mirroring each token's page (-1: none)."""
        out = [self.mirror_of(self.seq(sid), start, n) for sid, start, n in zip(seq_ids, starts, counts)]
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    # ---- sequence operations ---------------------------------------------------------------
    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self.seqs[seq_id] = SeqPages()
        return seq_id

    def extend(self, seq_id: int, n: int, tier: Tier = "host") -> int:
        """Reserve ``n`` more tokens; new pages come from ``tier``. Returns the start position."""
        seq = self.seq(seq_id)
        n = check_int(n, "n")
        check_tier(tier)
        need = self.pages_for(seq.length + n) - len(seq.pages)
        self.require({tier: need}, f"extend sequence {seq_id} by {n} tokens")
        start = seq.length
        new = [self.alloc(tier) for _ in range(need)]
        seq.add_entries([encode_page(tier, i) for i in new])
        if new:
            self.fresh_pages(seq.pages[-len(new):])
        if tier == "host":
            self.unwritten.update(new)
        seq.length += n
        return start

    def written(self, seq: SeqPages, start: int, n: int) -> None:
        """Note that tokens [start, start + n) of the sequence are about to be written."""
        if n and self.unwritten:
            for lp in range(start // self.page_size, (start + n - 1) // self.page_size + 1):
                self.unwritten.discard(seq.pages[lp])  # HBM entries are negative: never there

    def written_host(self, pages) -> None:
        """Note writes to host pages by other means (None: any page)."""
        if pages is None:
            self.unwritten.clear()
        else:
            self.unwritten.difference_update(int(p) for p in pages)

    def unshare_range(self, seq_id: int, start: int, stop: int) -> None:
        """Copy-on-write before a write of tokens [start, stop): private copies of the shared
        pages holding them, capacity checked first."""
        seq = self.seq(seq_id)
        shared = self.shared_pages(seq, start, stop)
        self.require(self.tier_counts(seq, shared), f"copy-on-write of {len(shared)} shared pages of sequence {seq_id}")
        self.unshare(seq, shared)

    def token_entries(self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int]):
        """(page entry, row in page) int64 (total,) per token of the spans, after copy-on-write of
        their shared pages (capacity for all the copies checked before any is made)."""
        if not (len(seq_ids) == len(starts) == len(counts)):
            raise ValueError("seq_ids, starts and counts must have one entry per sequence")
        seqs = [self.seq(s) for s in seq_ids]
        spans = []
        for sid, seq, start, n in zip(seq_ids, seqs, starts, counts):
            start, n = check_int(start, "start"), check_int(n, "count")
            if start + n > seq.length:
                raise ValueError(f"tokens [{start}, {start + n}) past the end of sequence {sid} (length {seq.length})")
            spans.append((seq, start, n))
        shared = [(seq, self.shared_pages(seq, start, start + n)) for seq, start, n in spans]
        needs: dict[str, int] = {}
        for seq, lps in shared:
            for tier, m in self.tier_counts(seq, lps).items():
                needs[tier] = needs.get(tier, 0) + m
        self.require(needs, "copy-on-write of shared pages before a batched write")
        for seq, lps in shared:
            self.unshare(seq, lps)
        for seq, start, n in spans:
            self.written(seq, start, n)
        got = [self.entries(seq, start, n) for seq, start, n in spans]
        entry = np.concatenate([e for e, _ in got]) if got else np.zeros(0, np.int64)  # (total,)
        off = np.concatenate([o for _, o in got]) if got else np.zeros(0, np.int64)  # (total,)
        return entry, off

    def mirror(self, seq_id: int, start: int, n: int) -> int:
        """Give the host pages holding tokens ``[start, start + n)`` a window mirror, first page
        first, as far as free window pages go; a page holding tokens before ``start`` is copied
        into its mirror. Returns the pages mirrored now."""
        seq = self.seq(seq_id)
        start, n = check_int(start, "start"), check_int(n, "n")
        if start + n > seq.length:
            raise ValueError(f"mirror of tokens [{start}, {start + n}) past the end of sequence {seq_id} "
                             f"(length {seq.length}; extend it first)")
        if n == 0:
            return 0
        made = 0
        fresh = []  # window pages the writes to come fill
        ps = self.page_size
        for lp in range(start // ps, (start + n - 1) // ps + 1):
            if lp in seq.mirrors or seq.pages[lp] < 0:
                continue
            if not self.free_window:
                break
            w = self.free_window.pop()
            seq.mirrors[lp] = w
            # The mirror starts as a copy of its host page, unless nothing was written there since
            # ``extend`` handed it out and no token of the page lies outside the range (before it,
            # or after it up to the sequence's end): then the writes to come fill it.
            unwritten = seq.pages[lp] in self.unwritten
            if not unwritten or lp * ps < start or min((lp + 1) * ps, seq.length) > start + n:
                self.copy_page(seq.pages[lp], encode_page("hbm", w))
            else:
                fresh.append(encode_page("hbm", w))
            made += 1
        if fresh:
            self.fresh_pages(fresh)
        seq._table = None
        if made:
            self.slot_generation += 1  # slots taken before would miss the mirrors
        return made

    def release_mirrors(self, seq_id: int, keep_partial: bool = True) -> int:
        """Drop the sequence's mirrors, except, with ``keep_partial``, the partial last page's.
        Returns the pages released."""
        seq = self.seq(seq_id)
        full = seq.length // self.page_size
        drop = [lp for lp in seq.mirrors if not (keep_partial and lp >= full)]
        self.drop_mirrors(seq, drop)
        return len(drop)

    def fork(self, seq_id: int, length: int | None = None) -> int:
        """New sequence with the same contents: full pages shared, the partial last page copied;
        with ``length`` (a multiple of the page size) only its first ``length`` tokens."""
        seq = self.seq(seq_id)
        if length is not None:
            length = check_int(length, "length")
            if length % self.page_size or length > seq.length:
                raise ValueError(f"fork of sequence {seq_id} at {length} tokens: a multiple of the page size "
                                 f"{self.page_size} up to its length {seq.length} is needed")
            entries = list(seq.pages[: length // self.page_size])
            for entry in entries:
                tier, index = decode_page(entry)
                self.refs[tier][index] += 1
            new_id = self.add_sequence()
            self.seqs[new_id].add_entries(entries)
            self.seqs[new_id].length = length
            self.slot_generation += 1  # its pages gained a sharer
            return new_id
        n_full = seq.length // self.page_size
        partial = seq.pages[n_full:]  # [] or [the partial last page]
        dst = fork_tiers([decode_page(e)[0] for e in partial], {t: len(self.free[t]) for t in TIERS})
        entries = list(seq.pages[:n_full])
        for entry in entries:
            tier, index = decode_page(entry)
            self.refs[tier][index] += 1
        for entry, tier in zip(partial, dst):
            copy = encode_page(tier, self.alloc(tier))
            self.copy_page(entry, copy)
            entries.append(copy)
        new_id = self.add_sequence()
        self.seqs[new_id].add_entries(entries)
        self.seqs[new_id].length = seq.length
        self.slot_generation += 1  # its full pages gained a sharer
        return new_id

    def free_sequence(self, seq_id: int) -> None:
        """Drop the sequence; pages whose refcount reaches 0 return to their tier's free list."""
        seq = self.seq(seq_id)
        self.drop_mirrors(seq, list(seq.mirrors))
        for entry in seq.pages:
            self.decref(entry)
        del self.seqs[seq_id]
        self.changed()  # tables and slots naming the sequence are refused from now on

    def truncate(self, seq_id: int, length: int) -> None:
        """Shorten the sequence to its first ``length`` tokens; a shared page that becomes the
        partial last page is copied (capacity checked before anything changes)."""
        seq = self.seq(seq_id)
        length = check_int(length, "length")
        if length > seq.length:
            raise ValueError(f"truncate of sequence {seq_id} to {length} tokens: it has only {seq.length}")
        keep = self.pages_for(length)
        last = keep - 1
        partial_shared = length % self.page_size and self.refcount(seq.pages[last]) > 1
        if partial_shared:
            self.require(self.tier_counts(seq, [last]), f"truncate sequence {seq_id}")
        self.drop_mirrors(seq, [lp for lp in seq.mirrors if lp >= keep])
        for entry in reversed(seq.pages[keep:]):  # last first: the free stack pops them in order again
            self.decref(entry)
        seq.pages = seq.pages[:keep]
        seq._table = None
        seq.length = length
        self.slot_generation += 1  # slots may name tokens past the new end
        if partial_shared:
            self.unshare(seq, [last])

    def move_pages(self, seq_id: int, logical_pages: Iterable[int], tier: Tier) -> None:
        """Move the given logical pages of a sequence to ``tier``: each physical page is copied to
        a new page of ``tier``, every sharer repointed, the old page freed."""
        seq = self.seq(seq_id)
        check_tier(tier)
        if isinstance(logical_pages, (int, np.integer)):
            raise TypeError("logical_pages must be an iterable of ints, not a single int")
        lps = sorted({check_int(lp, "logical page") for lp in logical_pages})
        if lps and lps[-1] >= len(seq.pages):
            raise IndexError(f"logical page {lps[-1]} out of range: sequence {seq_id} has {len(seq.pages)} pages")
        moving = [seq.pages[lp] for lp in lps if decode_page(seq.pages[lp])[0] != tier]
        self.require({tier: len(moving)}, f"move {len(moving)} pages of sequence {seq_id} to {tier}")
        remap = {}
        for old in moving:
            new = encode_page(tier, self.alloc(tier, refs=self.refcount(old)))
            self.copy_page(old, new)
            self.release(old)
            remap[old] = new
        shared = any(self.refcount(new) > 1 for new in remap.values())
        for s in self.seqs.values() if shared else [seq]:
            for i, entry in enumerate(s.pages):
                if entry in remap:
                    s.set_entry(i, remap[entry])
            self.drop_mirrors(s, [lp for lp in s.mirrors if s.pages[lp] < 0])

    def set_hbm_fraction(self, seq_id: int, fraction: float, placement: str = "recent") -> None:
        """Place ``floor(fraction * num_pages + 0.5)`` of the sequence's pages in HBM ("recent":
        the last pages; "strided": page i iff floor((i + 1) * f) > floor(i * f)), the rest in host
        memory; capacity for both directions checked first."""
        seq = self.seq(seq_id)
        if isinstance(fraction, (bool, np.bool_)) or not isinstance(fraction, numbers.Real):
            raise TypeError(f"fraction must be a real number in [0, 1], got {type(fraction).__name__} {fraction!r}")
        fraction = float(fraction)
        if not math.isfinite(fraction) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be a finite number in [0, 1], got {fraction!r}")
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

    # ---- page-level steps ------------------------------------------------------------------
    def changed(self) -> None:
        """A page changed owner or meaning: tables and slots built before are stale."""
        self.generation += 1
        self.slot_generation += 1

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def require(self, needs: dict[str, int], what: str) -> None:
        short = {t: n for t, n in needs.items() if n > len(self.free[t])}
        if short:
            detail = ", ".join(f"{n} {t} pages needed, {len(self.free[t])} free" for t, n in short.items())
            raise CacheCapacityError(f"cannot {what}: {detail}; the cache is unchanged")

    def alloc(self, tier: Tier, refs: int = 1) -> int:
        index = self.free[tier].pop()
        self.refs[tier][index] = refs
        return index

    def refcount(self, entry: int) -> int:
        tier, index = decode_page(entry)
        return int(self.refs[tier][index])

    def decref(self, entry: int) -> None:
        tier, index = decode_page(entry)
        self.refs[tier][index] -= 1
        if self.refs[tier][index] == 0:
            self.free[tier].append(index)
            if tier == "host":
                self.unwritten.discard(index)
            self.changed()

    def release(self, entry: int) -> None:
        """Return a page to its free list whatever its refcount (its users were repointed)."""
        tier, index = decode_page(entry)
        self.refs[tier][index] = 0
        self.free[tier].append(index)
        if tier == "host":
            self.unwritten.discard(index)
        self.changed()

    def drop_mirrors(self, seq: SeqPages, logical_pages: list[int]) -> None:
        """Return the given logical pages' mirrors to the window (tables naming them go stale)."""
        for lp in logical_pages:
            self.free_window.append(seq.mirrors.pop(lp))
        if logical_pages:
            seq._table = None
            self.changed()

    def shared_pages(self, seq: SeqPages, start: int, stop: int) -> list[int]:
        """Logical pages holding tokens [start, stop) whose physical page is shared."""
        if stop <= start:
            return []
        lps = range(start // self.page_size, (stop - 1) // self.page_size + 1)
        return [lp for lp in lps if self.refcount(seq.pages[lp]) > 1]

    def tier_counts(self, seq: SeqPages, logical_pages: Iterable[int]) -> dict[str, int]:
        """Pages per tier among the given logical pages of the sequence."""
        counts: dict[str, int] = {}
        for lp in logical_pages:
            tier = decode_page(seq.pages[lp])[0]
            counts[tier] = counts.get(tier, 0) + 1
        return counts

    def unshare(self, seq: SeqPages, logical_pages: list[int]) -> None:
        """Give the sequence private copies of the given (shared) logical pages."""
        for lp in logical_pages:
            old = seq.pages[lp]
            tier = decode_page(old)[0]
            new = encode_page(tier, self.alloc(tier))
            self.copy_page(old, new)
            self.decref(old)
            seq.set_entry(lp, new)
            self.changed()
