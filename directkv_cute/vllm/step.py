"""The vLLM backend's host-side decisions and its K/V store, without vLLM.

* ``step_shape``: one model step's shape from vLLM's CPU metadata (query start locations, sequence
  lengths): each request's query length and length, its cached context, the decode / prefill
  split, and the requests that have query rows at all (padded requests have none).
* ``page_table``: vLLM's block table rows -> the int32 page table the kernels read (block id =
  host page index, or the HBM page of the block's mirror; past a sequence's pages its last page
  repeats, so a stray read stays valid).
* ``slot_destinations``: vLLM's ``slot_mapping`` (``block * block_size + offset``, -1 for a
  padding token) -> the (row, page, offset) of every token whose K/V is stored;
  ``SlotDestinations.mirrored`` adds the HBM copies of the rows whose blocks have mirrors;
  ``SlotDestinations.store_index`` turns them into the pools' rows (``cache.store.StoreIndex``),
  once per step.
* ``HbmMirrors``: the HBM tier's policy: which blocks get a copy ("mirror") in the per-layer HBM
  pools of ``hbm_pages`` pages, step by step; ``mirrors_every_block``: whether the tier is large
  enough to mirror every block at its own index instead (``EVERY_BLOCK``).
* ``GraphDecode``: the persistent device buffers of decode steps over such a tier, filled on the
  device from vLLM's block table and slot mapping, which full CUDA graphs capture and replay.
* ``store_kv``: a layer's new K/V rows into their pages of the layer's vLLM KV tensor, and into
  the mirrors of mirrored blocks (write-through), checked, then stored by the package's one
  store path (``cache.store.store_rows``, which the ``PagedKVCache`` stores through too): one
  indexed copy each of K and V per pool; with a sparse budget the layer's page summaries take the K rows too
  (``cache.summaries.StoreSummaries``).
* ``kv_bytes_per_block``, ``host_blocks``, ``check_host_bytes``, ``hbm_pages``: host bytes ->
  blocks for a model, the refusal when the host cannot pin them, and the HBM budget -> mirror pages.

Every check raises one line naming what is wrong: ``ValueError`` (``TypeError`` for an argument
of the wrong type, ``MemoryError`` for host memory).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from directkv_cute.attention import DirectKVAttention
from directkv_cute.cache import KernelTables, page_bytes
from directkv_cute.cache.pages import check_int, encode_page
from directkv_cute.cache.store import StoreIndex, pool_rows, store_rows
from directkv_cute.config import SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES
from directkv_cute.env import VLLM_HBM_GB
from directkv_cute.runner import plan_kernels, tables_from_host

KV_DTYPES = ("bfloat16", "float16")  # the page dtypes the backend stores


@dataclass(frozen=True)
class StepShape:
    """One step's attention shape on the host.

    rows:     indices (into vLLM's requests) of the requests with query rows, in order.
    q_lens:   query rows of each of those requests (>= 1).
    seq_lens: their lengths after the step (cached context + the step's tokens).
    num_tokens: the query rows of all of them (the packed rows ``q[:num_tokens]``).
    """

    rows: tuple
    q_lens: tuple
    seq_lens: tuple
    num_tokens: int

    @property
    def context_lens(self) -> tuple:
        """Tokens already cached before the step, per request."""
        return tuple(s - q for s, q in zip(self.seq_lens, self.q_lens))

    @property
    def num_decodes(self) -> int:
        """Requests with one query row."""
        return sum(1 for q in self.q_lens if q == 1)

    @property
    def num_prefills(self) -> int:
        """Requests with several query rows (prompt chunks, or several tokens verified at once)."""
        return sum(1 for q in self.q_lens if q > 1)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)


def check_page_size(page_size) -> int:
    """The one check of a page (kernel block) size: an int the kernels read pages of."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or int(page_size) not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size!r}")
    return int(page_size)


def _ints(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def step_shape(query_start_loc, seq_lens, num_reqs: int) -> StepShape:
    """The step's shape from vLLM's ``query_start_loc_cpu`` ((num_reqs + 1,) or longer, starting
    at 0, non-decreasing) and per-request lengths (``seq_lens_cpu_upper_bound``: exact without
    speculative decoding). Requests with no query rows (padding) are left out."""
    num_reqs = check_int(num_reqs, "num_reqs")
    starts = _ints(query_start_loc, "query_start_loc")
    lens = _ints(seq_lens, "seq_lens")
    if len(starts) < num_reqs + 1:
        raise ValueError(f"query_start_loc has {len(starts)} entries, {num_reqs} requests need {num_reqs + 1}")
    if len(lens) < num_reqs:
        raise ValueError(f"seq_lens has {len(lens)} entries for {num_reqs} requests")
    starts, lens = starts[: num_reqs + 1], lens[:num_reqs]
    if starts[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(starts[0])}")
    q = np.diff(starts)
    if (q < 0).any():
        i = int(np.argmax(q < 0))
        raise ValueError(f"query_start_loc decreases at request {i}: {int(starts[i])} -> {int(starts[i + 1])}")
    short = (q > 0) & (lens < q)
    if short.any():
        i = int(np.argmax(short))
        raise ValueError(f"request {i} has {int(q[i])} query tokens but length {int(lens[i])} (< its query)")
    rows = np.flatnonzero(q > 0)
    return StepShape(tuple(int(r) for r in rows), tuple(int(x) for x in q[rows]), tuple(int(x) for x in lens[rows]),
                     int(q.sum()))


def page_table(block_table, seq_lens, page_size: int, num_blocks: int) -> np.ndarray:
    """The (B, max_pages) int32 page table of B requests: row b holds the first
    ``ceil(seq_lens[b] / page_size)`` block ids of ``block_table[b]`` (vLLM's block table rows of
    those requests, in kernel blocks of ``page_size`` tokens), then its last page repeated
    (``mirror_table`` then names the blocks that have HBM mirrors by them)."""
    page_size = check_page_size(page_size)
    table = np.asarray(block_table)
    lens = _ints(seq_lens, "seq_lens")
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"block_table must be a 2-D integer array, got shape {table.shape} dtype {table.dtype}")
    if table.shape[0] != len(lens):
        raise ValueError(f"block_table has {table.shape[0]} rows for {len(lens)} sequences")
    if len(lens) == 0:
        raise ValueError("page_table needs at least one sequence")
    if (lens < 1).any():
        raise ValueError(f"sequence {int(np.argmax(lens < 1))} has length {int(lens.min())}; lengths must be >= 1")
    pages = (lens + page_size - 1) // page_size
    width = int(pages.max())
    if width > table.shape[1]:
        b = int(np.argmax(pages))
        raise ValueError(f"sequence {b} of length {int(lens[b])} needs {width} blocks of {page_size} tokens, "
                         f"its block table row holds {table.shape[1]}")
    out = np.empty((len(lens), width), dtype=np.int32)
    for b, n in enumerate(pages.tolist()):
        ids = table[b, :n]
        bad = (ids < 0) | (ids >= num_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"sequence {b}: block {j} has id {int(ids[j])}, outside the cache's {num_blocks} blocks")
        out[b, :n] = ids
        out[b, n:] = ids[-1]
    return out


class _EveryBlock:
    """The mirrors of a tier that holds every block of the pool: block b's mirror is HBM page b,
    for good. As a policy (``HbmMirrors``' interface) each step's mirrors are all of them."""

    def step(self, table_blocks, pages, offsets) -> "_EveryBlock":
        return self

    def __repr__(self) -> str:
        return "EVERY_BLOCK"


EVERY_BLOCK = _EveryBlock()


def mirrors_every_block(hbm_bytes: int, host_bytes: int) -> bool:
    """Whether an HBM tier of ``hbm_bytes`` (``DIRECTKV_VLLM_HBM_GB``) mirrors every block of a
    host pool of ``host_bytes`` (``--kv-cache-memory-bytes``): the tier is at least as large, so
    block b lives at HBM page b for good (``EVERY_BLOCK``). Then nothing about the mirrors is
    decided per step, attention reads only HBM, and decode steps run inside full CUDA graphs
    (``GraphDecode``). A smaller tier mirrors the blocks ``HbmMirrors`` picks, step by step."""
    return bool(hbm_bytes) and host_bytes is not None and int(hbm_bytes) >= int(host_bytes)


def mirror_slots(ids, mirrors) -> np.ndarray:
    """int64 array of ``ids``' shape: each block id's HBM slot in ``mirrors`` ({block id: slot},
    or ``EVERY_BLOCK``), -1 where the block has no mirror."""
    ids = np.asarray(ids)
    if mirrors is EVERY_BLOCK:
        return ids.astype(np.int64)
    out = np.full(ids.shape, -1, dtype=np.int64)
    if mirrors:
        keys = np.fromiter(mirrors.keys(), np.int64, len(mirrors))
        slots = np.fromiter(mirrors.values(), np.int64, len(mirrors))
        order = np.argsort(keys)
        keys, slots = keys[order], slots[order]
        at = np.searchsorted(keys, ids).clip(max=len(keys) - 1)
        hit = keys[at] == ids
        out[hit] = slots[at[hit]]
    return out


def mirror_table(table: np.ndarray, mirrors) -> np.ndarray:
    """``table`` (host block ids) with every block of ``mirrors`` named by its mirror: the entry
    ``encode_page("hbm", slot)`` (``directkv_cute.cache.pages``), which the planner and the
    kernels read from the HBM pool. In place; returns ``table``."""
    slots = mirror_slots(table, mirrors)
    hit = slots >= 0
    if hit.any():
        table[hit] = encode_page("hbm", slots[hit])
    return table


@dataclass(frozen=True)
class SlotDestinations:
    """Where the step's new K/V rows go: token ``rows[i]`` to page ``pages[i]``, row ``offsets[i]``.
    ``dense``: every token ``0..n-1`` is stored, in order (``rows`` is ``arange(n)``).
    ``hbm_at``, ``hbm_slots``: the stores ``i = hbm_at[j]`` whose blocks have mirrors also go to
    HBM page ``hbm_slots[j]``, row ``offsets[i]`` (``mirrored``)."""

    rows: np.ndarray  # int64 (m,)
    pages: np.ndarray  # int64 (m,)
    offsets: np.ndarray  # int64 (m,)
    dense: bool
    hbm_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 (k,): into rows / pages
    hbm_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 (k,)

    def mirrored(self, mirrors) -> "SlotDestinations":
        """These destinations plus the mirror copies of the rows stored into blocks of ``mirrors``
        ({block id: HBM slot}, ``HbmMirrors.step``, or ``EVERY_BLOCK``)."""
        slots = mirror_slots(self.pages, mirrors)
        at = np.flatnonzero(slots >= 0).astype(np.int64)
        return replace(self, hbm_at=at, hbm_slots=slots[at])

    def store_index(self, num_kv_heads: int, page_size: int) -> "StoreIndex":
        """``store_kv``'s destinations of these rows in pools of ``num_kv_heads`` KV heads and
        ``page_size``-row pages (on the host; ``StoreIndex.to`` moves them to a device)."""
        at = self.hbm_at
        return StoreIndex.build((None if self.dense else self.rows, self.pages, self.offsets),
                                (self.rows[at], self.hbm_slots, self.offsets[at]),
                                int(self.rows[-1]) + 1 if len(self.rows) else 0, num_kv_heads, page_size)


def slot_destinations(slots, page_size: int, num_blocks: int) -> SlotDestinations:
    """Destinations of vLLM's ``slot_mapping`` entries (``block * page_size + offset``; negative:
    a padding token, not stored)."""
    s = _ints(slots, "slot_mapping")
    check_page_size(page_size)
    over = s >= num_blocks * page_size
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(f"slot {int(s[i])} of token {i} is past the cache's {num_blocks} blocks of {page_size} tokens")
    stored = s >= 0
    rows = np.flatnonzero(stored).astype(np.int64)
    kept = s[rows]
    return SlotDestinations(rows, kept // page_size, kept % page_size, bool(stored.all()))


def store_kv(kv_cache, key, value, index: StoreIndex, hbm=None, summaries=None) -> None:
    """Store a step's K/V rows into a layer's pages. ``kv_cache``: (blocks, Hkv, 2, block_size,
    d), the backend's contiguous per-layer layout; ``key`` / ``value``: (tokens, Hkv, d);
    ``index``: the step's ``StoreIndex`` on their device; ``hbm``: the layer's HBM pool (slots,
    Hkv, 2, block_size, d), which the rows of mirrored blocks go to as well; ``summaries``: the
    layer's ``cache.summaries.StoreSummaries`` (a sparse budget's page summaries), which take the
    stored K rows too (None: none kept). The checks, then ``cache.store.store_rows``: one indexed
    copy each of K and V per pool (on a GPU the host stores go straight into the
    mapped host pages, on the current stream), then the summaries' merge (device operations, no
    host sync)."""
    if index.num_mirrored and hbm is None:
        raise ValueError(f"{index.num_mirrored} K/V rows go to HBM mirrors, but no HBM pool was given")
    for name, pool in (("the KV cache", kv_cache), ("the HBM pool", hbm)):
        if pool is not None and (pool.dim() != 5 or not pool.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous (pages, kv_heads, 2, block_size, head_size) tensor, got "
                             f"shape {tuple(pool.shape)} strides {pool.stride()}")
    if hbm is not None and hbm.shape[1:] != kv_cache.shape[1:]:
        raise ValueError(f"the HBM pool's pages {tuple(hbm.shape[1:])} differ from the KV cache's "
                         f"{tuple(kv_cache.shape[1:])}")
    want = (kv_cache.shape[1], kv_cache.shape[4])  # (Hkv, d)
    if key.dim() != 3 or tuple(key.shape[1:]) != want or value.shape != key.shape:
        raise ValueError(f"key and value must be (tokens, {want[0]}, {want[1]}) as the KV cache's pages, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if index.span > key.shape[0]:
        raise ValueError(f"the step stores token rows up to {index.span}, key has {key.shape[0]}")
    if index.extents is not None:
        for name, need, pool in (("KV cache", index.extents[0], kv_cache), ("HBM pool", index.extents[1], hbm)):
            rows = 0 if pool is None else pool.numel() // pool.shape[-1]
            if need > rows:
                raise ValueError(f"the step stores into row {need - 1} of the {name}, which has {rows} rows of "
                                 f"{kv_cache.shape[-1]} (a slot or mirror past its pages)")
    if summaries is not None and (summaries.host.shape[0] != kv_cache.shape[0] or
                                  (hbm is not None and summaries.hbm.shape[0] != hbm.shape[0])):
        raise ValueError(f"the page summaries hold {summaries.host.shape[0]} host and {summaries.hbm.shape[0]} HBM "
                         f"pages, the pools {kv_cache.shape[0]} and {'no' if hbm is None else hbm.shape[0]}")
    store_rows(index, key[: index.span].to(kv_cache.dtype), value[: index.span].to(kv_cache.dtype), kv_cache, hbm)
    if summaries is not None:
        summaries.merge(index, key[: index.span])


class HbmMirrors:
    """The HBM tier's policy: which KV blocks have a copy (a mirror) in the backend's per-layer HBM
    pools of ``slots`` pages, decided once per step on the host (every layer shares it). Plain
    Python and numpy, no tensors.

    * A block gets a mirror only when it is fresh: its offset-0 row is stored in this step. Its
      rows are written in order from offset 0, so nothing of its current use was written before
      and no copy from its host page is ever needed. It takes a free slot, else the slot of the
      mirrored block seen least recently among those absent from this step; else it stays on
      the host.
    * Every store into a mirrored block goes to its host page and to its mirror (write-through):
      a mirror equals its host page in every row written since it was made, and those are the
      only rows attention reads.
    * Blocks present in the step (named by its page table or stored into) keep their mirrors. A
      block that loses its mirror is read from the host again. A block vLLM frees and reuses
      keeps its mirror (the writes of its new use go through it) or, without one, gets one when
      its offset 0 is written again.
    """

    def __init__(self, slots: int):
        self.slots = check_int(slots, "slots")
        self._slot_of: OrderedDict = OrderedDict()  # mirrored block -> slot, least recently present first
        self._fresh = 0  # slots [_fresh, slots) were never given out (none is ever freed: slots move)

    @property
    def mirrored(self) -> dict:
        """{block id: HBM slot} of every block with a mirror now."""
        return dict(self._slot_of)

    def step(self, table_blocks, pages, offsets) -> dict:
        """One step: ``table_blocks``, the block ids its page table names (any shape); ``pages``
        and ``offsets``, where its K/V rows are stored (``SlotDestinations``). Returns
        {block id: HBM slot} of the step's blocks (named or stored into) that have mirrors."""
        pages, offsets = np.asarray(pages, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
        if pages.shape != offsets.shape or pages.ndim != 1:
            raise ValueError(f"pages and offsets must be 1-D of one length, got {pages.shape} and {offsets.shape}")
        if not self.slots:
            return {}
        present = np.concatenate([np.asarray(table_blocks, dtype=np.int64).ravel(), pages])
        mirrored = np.fromiter(self._slot_of.keys(), np.int64, len(self._slot_of))
        kept = mirrored[np.isin(mirrored, present)].tolist()
        for b in kept:  # seen now: the most recent
            self._slot_of.move_to_end(b)
        takeable = len(self._slot_of) - len(kept)  # the first ones in _slot_of: absent from this step
        out = {b: self._slot_of[b] for b in kept}
        for b in dict.fromkeys(pages[offsets == 0].tolist()):
            if b in out:
                continue
            if self._fresh < self.slots:
                slot, self._fresh = self._fresh, self._fresh + 1
            elif takeable:
                _, slot = self._slot_of.popitem(last=False)
                takeable -= 1
            else:
                break
            self._slot_of[b] = out[b] = slot
        return out


class GraphDecode:
    """Decode steps over a tier that mirrors every block (``EVERY_BLOCK``), the same in a full
    CUDA graph and out of one: what the launches read lives in these persistent device buffers,
    which ``fill`` rewrites in place before each step from vLLM's own device tensors (block
    table, sequence lengths, slot mapping) with a few device operations on the current stream:
    nothing is read back to the host, and a captured graph's replay reads the new step. The
    plans over them depend only on the batch size (``DirectKVMetadataBuilder`` plans once per
    size, for the longest context).

    page_table: int32 (max_reqs, max_blocks): row b names the HBM mirror of each block of request
                b (``encode_page("hbm", block)``, which is ``~block``); the kernels read its first
                ``ceil(seq_len / page_size)`` entries.
    seq_lens:   int32 (max_reqs,): each request's length, at least 1: a padded request (length 0,
                block table row of zeros) reads one page of vLLM's null block 0.
    rows:       int64 (max_tokens * 2 * Hkv,): the pool rows (``cache.store.pool_rows``) that
                each token's K and V of every KV head go to; with every block mirrored at its own
                index they are the same rows in the host pool and in the HBM tier.
    tokens:     int64 (max_tokens,): the token whose K/V each of those rows gets: itself, or for a
                padding token (slot -1) the first stored token, whose rows it writes again with
                the same values (a fixed-size store, so that a graph can hold it).
    """

    def __init__(self, max_reqs: int, max_blocks: int, num_kv_heads: int, page_size: int, device):
        for name, v in (("max_reqs", max_reqs), ("max_blocks", max_blocks), ("num_kv_heads", num_kv_heads)):
            check_int(v, name, 1)
        check_page_size(page_size)
        self.page_size, self.num_kv_heads = page_size, num_kv_heads
        self.page_table = torch.zeros((max_reqs, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_reqs, dtype=torch.int32, device=device)
        self.rows = torch.zeros(max_reqs * 2 * num_kv_heads, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self.counted = torch.zeros(max_reqs, dtype=torch.float32, device=device)  # 0 for a padding token
        self._positions = torch.arange(max_reqs, dtype=torch.int64, device=device)
        self._hc = torch.arange(2 * num_kv_heads, dtype=torch.int64, device=device)  # h * 2 + c

    @property
    def max_reqs(self) -> int:
        return self.page_table.shape[0]

    def tables(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page_table (num_reqs, max_blocks), seq_lens (num_reqs,)): views the plans keep."""
        return self.page_table[:num_reqs], self.seq_lens[:num_reqs]

    def store_index(self, num_tokens: int) -> StoreIndex:
        """``store_kv``'s index of a step of ``num_tokens`` tokens over these buffers (host and HBM
        rows alike)."""
        n = num_tokens * 2 * self.num_kv_heads
        tokens = self.tokens[:num_tokens]
        return StoreIndex(self.rows[:n], tokens, self.rows[:n], tokens, num_tokens, counted=self.counted[:num_tokens])

    def fill(self, block_table: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor, num_reqs: int,
             num_tokens: int, max_seq_len: int) -> StoreIndex:
        """Write one decode step of ``num_reqs`` requests (padded ones included) and ``num_tokens``
        tokens (one per request) into the buffers; returns the step's ``store_index``.
        ``block_table``: vLLM's int32 (>= num_reqs, blocks) on the buffers' device; ``seq_lens``:
        its int32 (>= num_reqs,); ``slot_mapping``: its int64 (>= num_tokens,), -1 for padding;
        ``max_seq_len``: the longest length on the host (only the columns it needs are written)."""
        num_reqs, num_tokens = check_int(num_reqs, "num_reqs", 1), check_int(num_tokens, "num_tokens", 1)
        if num_reqs > self.max_reqs or num_tokens != num_reqs:
            raise ValueError(f"a graph decode step has one token per request, at most {self.max_reqs} requests; got "
                             f"{num_tokens} tokens for {num_reqs} requests")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] < num_reqs:
            raise ValueError(f"block_table must be int32 (>= {num_reqs}, blocks), got {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        width = min(-(-int(max_seq_len) // self.page_size), block_table.shape[1], self.page_table.shape[1])
        torch.bitwise_not(block_table[:num_reqs, :width], out=self.page_table[:num_reqs, :width])
        torch.clamp(seq_lens[:num_reqs], min=1, out=self.seq_lens[:num_reqs])
        tokens, rows, counted = every_block_rows(slot_mapping[:num_tokens], self._positions[:num_tokens], self._hc,
                                                 self.page_size)
        self.tokens[:num_tokens].copy_(tokens)
        self.counted[:num_tokens].copy_(counted)
        self.rows[: rows.numel()].copy_(rows)
        return self.store_index(num_tokens)


def every_block_rows(slots: torch.Tensor, positions: torch.Tensor, hc: torch.Tensor, page_size: int):
    """(tokens, rows, counted) of a store over a tier that mirrors every block, computed on the
    slots' device from vLLM's ``slots`` (int64 (n,), -1 for a padding token): ``rows`` int64 (n * 2 *
    Hkv,) the pool rows (``cache.store.pool_rows``, the same in the host pool and the tier) of
    each token's K and V of every KV head, ``tokens`` int64 (n,) the token each row takes: itself, or for a
    padding token the first stored token, written again with the same values (a fixed-size
    store), ``counted`` float32 (n,) 1 where a token names itself, 0 for padding (``StoreIndex.counted``;
    in a step of padding only, token 0 names itself and block 0, vLLM's null block, takes its rows).
    ``positions``: int64 arange(n); ``hc``: int64 arange(2 * Hkv)."""
    stored = slots >= 0
    first = torch.argmax(stored.to(torch.int32))  # the first stored token (0 if none: a capture's dummy step)
    tokens = torch.where(stored, positions, first)
    dest = slots.index_select(0, tokens).clamp_(min=0)  # a step that stores nothing writes block 0, vLLM's null block
    page, offset = dest.div(page_size, rounding_mode="floor"), dest.remainder(page_size)
    counted = (tokens == positions).to(torch.float32)  # a token's own row; padding names another's
    return tokens, pool_rows(page, offset, hc.numel() // 2, page_size, hc=hc), counted


def every_block_step(block_table: torch.Tensor, slot_mapping: torch.Tensor, shape: StepShape, num_tokens: int,
                     num_kv_heads: int, page_size: int):
    """(tables, store) of a step with prompt rows over a tier that mirrors every block, made on
    the device from vLLM's own block table (int32 (>= requests, blocks)) and slot mapping (int64
    (>= num_tokens,)) and the step's host ``shape``: nothing is read back, so the step's host
    work overlaps the GPU's queued work. ``tables``: ``KernelTables`` of the requests with query
    rows (row b: ``~block`` of each block, ``encode_page("hbm", block)``), their lengths on the
    host, marked ``hbm_only`` (the planner routes them as HBM reads) and back to back; None
    without query rows. ``store``: ``StoreIndex`` of the step's ``num_tokens`` tokens (host and
    HBM rows alike); None without tokens."""
    page_size, num_tokens = check_page_size(page_size), check_int(num_tokens, "num_tokens")
    device = block_table.device
    tables = None
    if shape.rows:
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] <= max(shape.rows):
            raise ValueError(f"block_table must be int32 (> {max(shape.rows)}, blocks), got {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        width = min(-(-shape.max_seq_len // page_size), block_table.shape[1])
        packed = np.concatenate([np.asarray(shape.rows, dtype=np.int64), np.asarray(shape.seq_lens, dtype=np.int64)])
        packed = torch.from_numpy(packed).to(device, non_blocking=True)  # rows then lengths: one copy
        rows, lens = packed[: len(shape.rows)], packed[len(shape.rows):].to(torch.int32)
        table = torch.bitwise_not(block_table[:, :width].index_select(0, rows))
        tables = KernelTables(table, lens, host_seq_lens=shape.seq_lens, back_to_back=True, hbm_only=True)
    store = None
    if num_tokens:
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"slot_mapping must be 1-D with >= {num_tokens} entries, got {tuple(slot_mapping.shape)}")
        positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
        hc = torch.arange(2 * check_int(num_kv_heads, "num_kv_heads", 1), dtype=torch.int64, device=device)
        tokens, rows, counted = every_block_rows(slot_mapping[:num_tokens].to(torch.int64), positions, hc, page_size)
        store = StoreIndex(rows, tokens, rows, tokens, num_tokens, counted=counted)
    return tables, store


WARMUP_CONTEXTS = (1024, 4096, 16384, 65536, 262144)  # with max_model_len: one per few profile buckets
WARMUP_CHUNKS = (16, 128, 512, 2048)  # prompt chunks below the token budget, with the budget itself


def warmup_steps(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, page_size: int,
                 num_blocks: int) -> list[tuple[tuple, tuple]]:
    """(seq_lens, q_lens) of steps a vLLM server makes, for the kernels' warm-up: decode steps
    of 1, 2, 4, ... up to ``max_num_seqs`` requests at each warm-up context up to
    ``max_model_len``; prompt chunks of the token budget and of shorter lengths at every context
    that holds them; mixed steps of decodes and one chunk filling the budget. Steps whose pages
    exceed ``num_blocks`` are left out (the server cannot make them)."""
    for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("max_model_len", max_model_len), ("page_size", page_size), ("num_blocks", num_blocks)):
        check_int(v, name, 1)
    contexts = sorted({c for c in WARMUP_CONTEXTS if c < max_model_len} | {int(max_model_len)})
    batches, b = [], 1
    while b <= max_num_seqs:
        batches.append(b)
        b *= 2
    budget = min(int(max_num_batched_tokens), int(max_model_len))
    chunks = sorted({q for q in WARMUP_CHUNKS if q < budget} | {budget})
    steps = [((c,) * b, (1,) * b) for b in batches for c in contexts]
    steps += [((c,), (q,)) for q in chunks for c in sorted({q} | {c for c in contexts if c > q})]
    steps += [((contexts[-1],) * b + (budget,), (1,) * b + (budget - b,)) for b in batches if b < budget]

    def pages(step):
        return sum(-(-n // page_size) for n in step[0])

    return [step for step in steps if pages(step) <= num_blocks]


def warmup_kernels(pools, steps, *, num_q_heads: int, dtype, device, device_info=None, sparse=None) -> dict:
    """{key: (compile function, arguments)} of every kernel the plans of ``steps`` (``warmup_steps``)
    launch over ``pools`` (a layer's ``runner.PoolView``), planned as the builder plans a step:
    each step's sequences on consecutive host pages and, where ``pools`` has an HBM tier, the
    same pages with their mirrors (``warmup_mirrors``), whose plans may route to other kernels.
    ``device_info``: the GPU to plan for (default: the pools' device's); ``sparse``: the
    ``SparseBudget`` the builder plans decode rows under (their plans list the kernels over the
    selected pages; the pools need their page summaries)."""
    page_size, num_blocks = pools.page_size, pools.host_pool.shape[0]
    slots = pools.hbm_pool.shape[0]
    out: dict = {}
    for seq_lens, q_lens in steps:
        n = [-(-s // page_size) for s in seq_lens]
        first = np.cumsum([0] + n[:-1])
        blocks = np.zeros((len(n), max(n)), dtype=np.int64)
        for b, (f, k) in enumerate(zip(first, n)):
            blocks[b, :k] = np.arange(f, f + k)
        host_table = page_table(blocks, seq_lens, page_size, num_blocks)
        for mirrors in [None, *warmup_mirrors(blocks, n, slots)]:
            table = mirror_table(host_table.copy(), mirrors)
            tables = tables_from_host(table, seq_lens, device)._replace(back_to_back=True)
            plan = DirectKVAttention(pools).plan(tables=tables, q_lens=q_lens, num_q_heads=num_q_heads,
                                                 max_seq_len=max(seq_lens), device_info=device_info, sparse=sparse)
            for fn, args in plan_kernels(plan, dtype):
                out.setdefault((fn.__name__, *args), (fn, args))
    return out


def warmup_mirrors(blocks, num_pages, slots: int) -> list[dict]:
    """The HBM-tier layouts the warm-up plans a step in (``HbmMirrors`` as {block id: slot}):
    every block mirrored (a tier that holds the step), and each sequence's first half of blocks
    mirrored, the rest on the host (a tier that filled while its sequences grew: fresh blocks
    get mirrors while slots are free). Only the layouts whose mirrors fit ``slots``; none
    without a tier. ``blocks``: the step's (B, max pages) block ids; ``num_pages``: each
    sequence's pages."""
    layouts = []
    for share in (1.0, 0.5):
        ids = np.concatenate([np.asarray(blocks[b, :max(1, int(k * share))]) for b, k in enumerate(num_pages)])
        if 0 < len(ids) <= slots:
            layouts.append({int(x): i for i, x in enumerate(ids.tolist())})
    return layouts


def check_geometry(head_dim: int, block_size: int) -> None:
    """That the kernels read pages of this head dim and block size."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: the DirectKV kernels support head dims {SUPPORTED_HEAD_DIMS}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"block_size {block_size}: the DirectKV kernels read pages of {SUPPORTED_PAGE_SIZES} tokens "
                         "(vLLM's --block-size)")


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       kv_dtype: str = "bfloat16") -> int:
    """Bytes one block costs over every layer (``cache.page_bytes`` of a ``block_size`` page)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: the backend stores {sorted(KV_DTYPES)} pages")
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("block_size", block_size)):
        check_int(v, name, 1)
    return page_bytes(num_layers, num_kv_heads, block_size, head_dim, getattr(torch, kv_dtype))


def host_blocks(host_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                kv_dtype: str = "bfloat16") -> int:
    """Whole blocks that ``host_bytes`` of host memory hold for the model (what vLLM makes of
    ``--kv-cache-memory-bytes`` for one group of full-attention layers); at least one."""
    check_int(host_bytes, "host_bytes", 1)
    one = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, kv_dtype)
    if host_bytes < one:
        raise ValueError(f"{host_bytes} bytes of host KV hold no block: one block of {block_size} tokens over "
                         f"{num_layers} layers costs {one} bytes")
    return host_bytes // one


def hbm_pages(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
              kv_dtype: str = "bfloat16") -> int:
    """Mirror pages per layer that ``budget_bytes`` of HBM hold over ``num_layers`` layers
    (``DIRECTKV_VLLM_HBM_GB``): whole blocks, 0 when the budget holds none."""
    check_int(budget_bytes, "budget_bytes")
    return budget_bytes // kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, kv_dtype)


def check_host_bytes(nbytes: int, available: int | None, ranks: int = 1) -> None:
    """Refuse to pin ``nbytes`` of KV pages that the host's available memory cannot hold
    (``ranks``: GPUs of this host whose KV caches ``nbytes`` counts together)."""
    what = "the KV cache" if ranks == 1 else f"the KV caches of {ranks} GPUs"
    _refuse_beyond(nbytes, available, what, "pinned host memory", "the host", "--kv-cache-memory-bytes")


def check_hbm_tier(nbytes: int, available: int | None) -> None:
    """Refuse an HBM tier of ``nbytes`` (its mirror pools over every layer) that the GPU's
    available memory (free, plus what torch's allocator holds unused) cannot hold, before any
    of it is allocated."""
    _refuse_beyond(nbytes, available, "the HBM tier", "GPU memory", "the GPU", VLLM_HBM_GB, " after vLLM's own")


def _refuse_beyond(nbytes: int, available: int | None, what: str, memory: str, holder: str, knob: str,
                   qualifier: str = "") -> None:
    """One line: ``what`` needs more ``memory`` than ``holder`` has ``available`` (None: unknown,
    nothing refused), and the setting that lowers it."""
    if available is not None and nbytes > available:
        raise MemoryError(f"{what} needs {nbytes} bytes ({nbytes / 2**30:.3g} GiB) of {memory}, {holder} has "
                          f"{available} bytes ({available / 2**30:.3g} GiB) available{qualifier}; lower {knob}")


__all__ = ["StepShape", "step_shape", "check_page_size", "page_table", "EVERY_BLOCK", "mirrors_every_block",
           "mirror_slots", "mirror_table", "SlotDestinations", "GraphDecode",
           "slot_destinations", "StoreIndex", "store_kv", "HbmMirrors", "check_geometry", "kv_bytes_per_block", "host_blocks",
           "hbm_pages", "check_host_bytes", "check_hbm_tier", "warmup_steps", "warmup_kernels", "warmup_mirrors"]
