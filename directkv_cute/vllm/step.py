"""The vLLM backend's host-side decisions and its K/V store, without vLLM.

* ``step_shape``: one model step's shape from vLLM's CPU metadata (query start locations, sequence
  lengths): each request's query length and length, its cached context, the decode / prefill
  split, and the requests that have query rows at all (padded requests have none).
* ``page_table``: vLLM's block table rows -> the int32 page table the kernels read (block id =
  host page index; past a sequence's pages its last page repeats, so a stray read stays valid).
* ``slot_destinations``: vLLM's ``slot_mapping`` (``block * block_size + offset``, -1 for a
  padding token) -> the (row, page, offset) of every token whose K/V is stored.
* ``store_kv``: a layer's new K/V rows into their pages of the layer's vLLM KV tensor.
* ``kv_bytes_per_block``, ``host_blocks``, ``check_host_bytes``: host bytes -> blocks for a
  model, and the refusal when the host cannot pin them.

Every check raises one ``ValueError`` (``MemoryError`` for host memory) line naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from directkv_cute.config import SUPPORTED_HEAD_DIMS, SUPPORTED_PAGE_SIZES

KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2}  # the page dtypes the backend stores


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


def _ints(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def step_shape(query_start_loc, seq_lens, num_reqs: int) -> StepShape:
    """The step's shape from vLLM's ``query_start_loc_cpu`` ((num_reqs + 1,) or longer, starting
    at 0, non-decreasing) and per-request lengths (``seq_lens_cpu_upper_bound``: exact without
    speculative decoding). Requests with no query rows (padding) are left out."""
    if isinstance(num_reqs, bool) or not isinstance(num_reqs, (int, np.integer)) or num_reqs < 0:
        raise ValueError(f"num_reqs must be an int >= 0, got {num_reqs!r}")
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
    those requests, in kernel blocks of ``page_size`` tokens), then its last page repeated."""
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


@dataclass(frozen=True)
class SlotDestinations:
    """Where the step's new K/V rows go: token ``rows[i]`` to page ``pages[i]``, row ``offsets[i]``.
    ``dense``: every token ``0..n-1`` is stored, in order (``rows`` is ``arange(n)``)."""

    rows: np.ndarray  # int64 (m,)
    pages: np.ndarray  # int64 (m,)
    offsets: np.ndarray  # int64 (m,)
    dense: bool


def slot_destinations(slots, page_size: int, num_blocks: int) -> SlotDestinations:
    """Destinations of vLLM's ``slot_mapping`` entries (``block * page_size + offset``; negative:
    a padding token, not stored)."""
    s = _ints(slots, "slot_mapping")
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    over = s >= num_blocks * page_size
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(f"slot {int(s[i])} of token {i} is past the cache's {num_blocks} blocks of {page_size} tokens")
    stored = s >= 0
    rows = np.flatnonzero(stored).astype(np.int64)
    kept = s[rows]
    return SlotDestinations(rows, kept // page_size, kept % page_size, bool(stored.all()))


def store_kv(kv_cache, key, value, dest, dense: bool) -> None:
    """Store K/V rows into a layer's pages. ``kv_cache``: (blocks, Hkv, 2, block_size, d), the
    backend's per-layer layout; ``key`` / ``value``: (tokens, Hkv, d); ``dest``: int64 (2 or 3, m)
    on their device, the rows' pages, offsets and, unless ``dense``, the token rows they come from
    (``slot_destinations``). On a GPU the stores go straight into the mapped host pages (indexed
    stores on the current stream)."""
    pages, offsets = dest[0], dest[1]
    m = pages.shape[0]
    k, v = (key[:m], value[:m]) if dense else (key[dest[2]], value[dest[2]])
    kv_cache[pages, :, 0, offsets] = k
    kv_cache[pages, :, 1, offsets] = v


def check_geometry(head_dim: int, block_size: int) -> None:
    """That the kernels read pages of this head dim and block size."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: the DirectKV kernels support head dims {SUPPORTED_HEAD_DIMS}")
    if block_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"block_size {block_size}: the DirectKV kernels read pages of {SUPPORTED_PAGE_SIZES} tokens "
                         "(vLLM's --block-size)")


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       kv_dtype: str = "bfloat16") -> int:
    """Bytes one block costs over every layer: K and V rows of ``block_size`` tokens per KV head."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: the backend stores {sorted(KV_DTYPE_BYTES)} pages")
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return num_layers * num_kv_heads * 2 * block_size * head_dim * KV_DTYPE_BYTES[kv_dtype]


def host_blocks(host_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                kv_dtype: str = "bfloat16") -> int:
    """Whole blocks that ``host_bytes`` of host memory hold for the model (what vLLM makes of
    ``--kv-cache-memory-bytes`` for one group of full-attention layers); at least one."""
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 1:
        raise ValueError(f"host_bytes must be an int >= 1, got {host_bytes!r}")
    one = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, kv_dtype)
    if host_bytes < one:
        raise ValueError(f"{host_bytes} bytes of host KV hold no block: one block of {block_size} tokens over "
                         f"{num_layers} layers costs {one} bytes")
    return host_bytes // one



def check_host_bytes(nbytes: int, available: int | None) -> None:
    """Refuse to pin ``nbytes`` of KV pages that the host's available memory cannot hold."""
    if available is not None and nbytes > available:
        raise MemoryError(f"the KV cache needs {nbytes} bytes ({nbytes / 2**30:.3g} GiB) of pinned host memory, the "
                          f"host has {available} bytes ({available / 2**30:.3g} GiB) available; lower "
                          "--kv-cache-memory-bytes")


__all__ = ["StepShape", "step_shape", "page_table", "SlotDestinations", "slot_destinations", "store_kv", "check_geometry",
           "kv_bytes_per_block", "host_blocks", "check_host_bytes"]
