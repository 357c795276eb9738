"""The plan of a staged call: its pieces, its KV splits and its copy runs, and the search over them.

A staged call copies the host pages it reads into an HBM buffer with the copy engine, piece by
piece (``piece_pages`` logical pages of every sequence), each piece flagged ready once it has
landed, while the kernel reads the pieces as their flags come (``staging.Stager`` executes it).
Every choice about that is made here, in plain Python on the host page table:

- the pieces: ``piece_pages_for`` (about ``PIECES`` over the longest sequence; ``LINK_BOUND_PIECES``
  where the copy binds, ``LINK_PIECES`` for one wave, ``HEAD_PIECES`` per head copied head by
  head), pieces of their own for pages already in HBM (``window_piece_pages``);
- the KV splits of the Q-tiled launch: ``q_tiled_splits``, ``ready_split``, ``staged_layout``;
- the copy runs: ``plan_staging`` -> ``StagePlan`` (one ``Run`` per run of consecutive pages of a
  tier in a piece), ``head_groups`` for copies made head by head;
- the search over these under the cost model's estimates (``directkv_cute.plan``):
  ``choose_staged`` and ``choose_pipelined`` weigh candidates, ``staging_choice`` plans a 16-bit
  call, ``fp8_stage_plan`` a decode-sized call over FP8 pages.

The planner (``directkv_cute.planner``) asks and decides; nothing here asks the GPU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from directkv_cute.config import QTiledConfig, q_tiles
from directkv_cute.kernels.specs import op_kernel
from directkv_cute.machine import DeviceInfo, MachineModel
from directkv_cute.plan import (StagedChoice, causal_flops, compute_bound, copy_time_ms, head_major_ms, in_place_ms,
                                kv_bytes, may_stage, one_wave_ms, partial_bytes, pipelined_ms, pipelined_tail_ms,
                                q_read_ms, split_work, stage_margin, staged_ms, trails_copy)
from directkv_cute.plan_types import AUTOMATIC, CallShape, QTiledLayout, StagingRequest

# ---- pieces and splits -----------------------------------------------------------------------
# Pieces over the longest sequence of a staged call whose CTAs the pieces pace (decode, one wave,
# compute-bound chunks): its CTAs start once the first piece has landed, and each piece costs a
# copy call per sequence and a ready flag.
PIECES = 16
MAX_PIECES = 64  # pieces per call; more are merged into fewer, larger ones
MAX_FLAGS = 4096  # ready flags per stager: a copy staged head by head has one per (KV head, piece)
HEAD_PIECES = 4  # pieces per KV head of a copy staged head by head
# Rows of a strided copy narrower than this run the copy engine slowly: FP8 pages staged head by
# head in rows of one head's 16 KiB block (page 64, d 128) moved 8 MB in about 250 us, 33 GB/s
# against 52 GB/s for rows of 32 KiB and more (measured on the H200). FP8 pages are staged in
# groups of heads whose rows reach it (``head_groups``).
MIN_COPY_ROW = 32 * 1024
SLOTS = 2  # staging buffers (and flag sets) that consecutive calls alternate between
STAGED_SPLITS = 4  # KV splits of a staged call

# Pieces of a one-split staged call whose CTAs all fit one wave (``one_wave_ms``): a wave's CTAs
# walk a piece as soon as it lands, so two pieces leave only half the compute after the copy
# (measured 8k q512 over host pages: 0.676 ms staged so, 0.745 in place).
LINK_PIECES = 2
# Pieces of a staged call whose Q-tiled compute trails its copy (``trails_copy``): each costs a
# copy call and a ready flag (measured at 8k q2048: 8 pieces 2-3% faster than 16 at 2 and 4
# splits). From ``LONG_LINK_TOKENS`` keys on, 16 pieces in 16 folded splits (a split of 16 KV
# tiles or more): the last split's tail after the copy halves (measured at q2048, splits folded,
# 8 pieces / 8 splits vs 16 / 16, ms: 8k 0.713 vs 0.945, 16k 1.349 vs 1.360, 32k 2.663 vs 2.598,
# 128k 10.51 vs 10.14). Only there: offered to compute-bound chunks too, 16 splits displaced the
# head-by-head copy at 128k q8192 and ran slower (27.88 vs 26.14 ms).
LINK_BOUND_PIECES = 8
LONG_LINK_BOUND_PIECES = 16
LONG_LINK_TOKENS = 32768
SPLIT_CHOICES = (1, 2, 4, 8)


def piece_pages_for(max_pages: int, page_size: int, tile_n: int, want: int = 0, pieces: int = PIECES) -> int:
    """Pages per ready piece: ``want`` (0: about ``pieces`` pieces over the longest sequence),
    rounded up to whole KV tiles, and coarse enough for at most ``MAX_PIECES`` flags."""
    tile_pages = max(1, tile_n // page_size)
    pp = want or math.ceil(max_pages / pieces)
    pp = max(pp, math.ceil(max_pages / MAX_PIECES), 1)
    return math.ceil(pp / tile_pages) * tile_pages


def link_bound_staging(max_tokens: int) -> tuple[int, tuple[int, ...]]:
    """(pieces, split counts the cost model weighs: ``choose_staged``'s ``choices``) of a staged
    chunk whose compute trails its copy, by its longest sequence's keys: from ``LONG_LINK_TOKENS``
    on, 16 pieces and up to 16 splits."""
    if max_tokens >= LONG_LINK_TOKENS:
        return LONG_LINK_BOUND_PIECES, SPLIT_CHOICES + (LONG_LINK_BOUND_PIECES,)
    return LINK_BOUND_PIECES, SPLIT_CHOICES


def window_piece_pages(piece_pages: int, ready_page: int, max_pages: int, tile_pages: int, min_pages: int = 1) -> int:
    """Pages per piece of a staged chunk whose pages from ``ready_page`` on were all in HBM before
    the call (a step's own tokens mirrored): the multiple of ``tile_pages`` (at least ``min_pages``)
    within half to twice ``piece_pages`` that divides ``ready_page`` and is nearest to it, so those
    pages form pieces of their own (ready when the kernel starts); ``piece_pages`` where none does."""
    if not 0 < ready_page < max_pages:
        return piece_pages
    lo = max(tile_pages, min_pages, piece_pages // 2)
    cands = [c for c in range(math.ceil(lo / tile_pages) * tile_pages, 2 * piece_pages + 1, tile_pages)
             if ready_page % c == 0]
    return min(cands, key=lambda c: (abs(c - piece_pages), c)) if cands else piece_pages


def q_tiled_splits(max_tiles: int, piece_tiles: int, want: int = 0, ready_tiles: int = 0) -> tuple[int, int]:
    """(splits, tiles per split) of a staged Q-tiled call: ``want`` (0: ``STAGED_SPLITS``) runs of
    whole pieces over the longest sequence's tiles; fewer when there are fewer pieces. With
    ``ready_tiles`` (the tiles before the pieces that are ready when the kernel starts, a whole
    number of pieces) and ``want`` > 1: about ``want`` runs of whole pieces over those tiles,
    the rest in splits of their own (``ready_split``), where one is left."""
    want = want or STAGED_SPLITS
    if want > 1 and 0 < ready_tiles < max_tiles:
        per = max(1, round(ready_tiles / want / piece_tiles)) * piece_tiles
        if math.ceil(ready_tiles / per) < math.ceil(max_tiles / per):
            return math.ceil(max_tiles / per), per
    per = math.ceil(max_tiles / want)
    per = max(piece_tiles, math.ceil(per / piece_tiles) * piece_tiles)
    return math.ceil(max_tiles / per), per


def ready_split(ready_piece: int, piece_tiles: int, split_tiles: int, splits: int) -> int:
    """The split a staged call's launch starts at: the first one whose tiles, and every later
    split's, lie in pieces from ``ready_piece`` on (pages in HBM before the call, ready when the
    kernel starts), so their CTAs run while the copy lands the rest; 0 where there is none."""
    first = math.ceil(ready_piece * piece_tiles / split_tiles)
    return first if 0 < first < splits else 0


def staged_layout(sp: StagePlan, page_size: int, tile_n: int, max_tokens: int, want: int, by_head: bool,
                  ascending: bool, query_tiles: int) -> QTiledLayout:
    """The split layout of a Q-tiled launch over the staged pages of ``sp``: ``want`` KV splits
    (``q_tiled_splits``) over the longest sequence's ``max_tokens`` keys, the pieces ready at the
    start in splits of their own launched first (``ready_split``); one split in the order the copy
    lands where it runs head by head (``by_head``) or lightest query tiles first (``ascending``)."""
    in_order = by_head or ascending
    max_tiles = math.ceil(max_tokens / tile_n)
    piece_tiles = sp.piece_pages * page_size // tile_n
    splits, split_tiles = q_tiled_splits(max_tiles, piece_tiles, want, 0 if in_order else sp.ready_from * piece_tiles)
    first = 0 if in_order else ready_split(sp.ready_from, piece_tiles, split_tiles, splits)
    return QTiledLayout(splits, split_tiles, piece_tiles, first, by_head, ascending, query_tiles)


# ---- copy runs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One copy: ``count`` consecutive pages of a tier (``hbm``: the HBM pool, else the host
    pool) from page ``src`` to staging page ``dst``."""

    hbm: bool
    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class StagePlan:
    """The copies of one staged call, piece by piece, and the page table over the buffer."""

    pieces: tuple[tuple[Run, ...], ...]  # piece p: the runs of logical pages [p * pp, (p + 1) * pp)
    # (B, max_pages) int32: HBM-encoded entries (-(staging page) - 1); follows from the host table
    # and the pieces, so plans compare by their pieces
    table: np.ndarray = field(compare=False)
    pages: int  # staging pages used
    piece_pages: int  # pp
    # The first piece whose pages, and every later piece's, were all in HBM before the call (a
    # step's own tokens mirrored): copied ahead of the kernel, so ready when it starts (len(pieces):
    # none).
    ready_from: int
    # Pages already in HBM, where the call reads any, are read where they are (entries >= 0 into
    # ``hbm_in_place``'s view), not copied: ``plan_staging``'s ``hbm_layers``.
    reads_in_place: bool = False

    @property
    def host_pages(self) -> int:
        return sum(r.count for piece in self.pieces for r in piece if not r.hbm)

    @property
    def copy_calls(self) -> tuple[int, int]:
        """(copies from the host pool, copies of pages already in HBM): one per run."""
        hbm = sum(r.hbm for piece in self.pieces for r in piece)
        return sum(len(piece) for piece in self.pieces) - hbm, hbm


def head_groups(heads: int, head_bytes: int, first: int = 0) -> list[range]:
    """KV heads in consecutive groups whose blocks of a page, together, span at least
    ``MIN_COPY_ROW`` bytes (the last group may be smaller): the steps of a copy staged by head.
    With ``first``, the first group is that many heads, the rest grouped so from there."""
    g = min(heads, max(1, math.ceil(MIN_COPY_ROW / head_bytes)))
    first = min(max(first, 0), heads)
    lead = [range(0, first)] if first else []
    return lead + [range(h, min(heads, h + g)) for h in range(first, heads, g)]


def _runs(entries: np.ndarray, piece: np.ndarray, n_pieces: int) -> tuple[tuple[Run, ...], ...]:
    """Per piece, the maximal runs of same-tier, consecutive pages in encoded entries (>= 0 host
    page, < 0 HBM page -e - 1) in staging order (entry i goes to staging page i; ``piece[i]``
    its piece, non-decreasing). One vectorized pass: a run also breaks where the piece does."""
    out = [[] for _ in range(n_pieces)]
    if entries.size:
        hbm = entries < 0
        src = np.where(hbm, -entries.astype(np.int64) - 1, entries.astype(np.int64))
        brk = np.flatnonzero((hbm[1:] != hbm[:-1]) | (np.diff(src) != 1) | (piece[1:] != piece[:-1])) + 1
        starts = np.concatenate(([0], brk))
        ends = np.concatenate((brk, [entries.size]))
        hbm_l, src_l, piece_l = hbm.tolist(), src.tolist(), piece.tolist()
        for s, e in zip(starts.tolist(), ends.tolist()):
            out[piece_l[s]].append(Run(hbm_l[s], src_l[s], s, e - s))
    return tuple(tuple(runs) for runs in out)


def plan_staging(host_table: np.ndarray, seq_lens, page_size: int, piece_pages: int,
                 hbm_layers: int = 0) -> StagePlan:
    """The copies and staged page table for a batch. Piece p holds logical pages
    [p * piece_pages, (p + 1) * piece_pages) of every sequence; each distinct page entry is
    copied once, in the first piece that needs it, so pages that sequences share (forks of one
    prompt) cross the link once per call. A piece's pages take the next free staging pages in
    tier and page order: one copy per run of consecutive pages, whatever their logical order.
    With ``hbm_layers`` (the pool's L) pages already in HBM are not copied: the kernel reads them
    where they are, their entries ``page * hbm_layers`` (>= 0) indexing ``hbm_in_place``'s view of
    the HBM pool; only host pages are staged."""
    table = np.asarray(host_table, dtype=np.int32)
    if table.ndim != 2 or table.shape[0] != len(seq_lens):
        raise ValueError(f"host_table {table.shape} does not match {len(seq_lens)} sequences")
    if piece_pages < 1:
        raise ValueError(f"piece_pages must be >= 1, got {piece_pages}")
    n_pages = [math.ceil(int(n) / page_size) for n in seq_lens]
    if min(n_pages) < 1 or max(n_pages) > table.shape[1]:
        raise ValueError(f"sequence lengths {list(seq_lens)[:8]} do not fit the table's {table.shape[1]} pages")
    n_pieces = math.ceil(max(n_pages) / piece_pages)
    # Every (row, logical page) in copy order: piece by piece, row by row within a piece.
    counts = np.asarray(n_pages, dtype=np.int64)
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    cols = np.arange(len(rows), dtype=np.int64) - starts
    piece_of = cols // piece_pages
    order = np.lexsort((cols, rows, piece_of))  # by piece, then row, then page
    rows, cols, piece_of = rows[order], cols[order], piece_of[order]
    flat = table[rows, cols]
    if hbm_layers and flat.size and int(-flat.min()) * hbm_layers >= 2**31:
        raise ValueError(f"HBM pages read in place: page {-int(flat.min()) - 1} x {hbm_layers} layers overflows int32")
    uniq, first, inv = np.unique(flat, return_index=True, return_inverse=True)
    # Distinct entries by the piece that first uses them, then by tier and page: within a piece the
    # staging order is free (the kernel finds each page through the staged table), and in page
    # order a piece's pages form the fewest runs whatever order the sequences hold them in (an
    # engine that frees blocks last to first hands them out descending).
    src = np.where(uniq < 0, -uniq.astype(np.int64) - 1, uniq.astype(np.int64))
    order = np.lexsort((src, uniq < 0, piece_of[first]))
    if hbm_layers:  # only host entries take staging pages
        order = order[uniq[order] >= 0]
    dst_of = np.zeros(len(uniq), dtype=np.int64)
    dst_of[order] = np.arange(len(order))
    staged = np.empty_like(table)
    staged[rows, cols] = -dst_of[inv.reshape(-1)] - 1
    if hbm_layers:
        in_hbm = flat < 0
        staged[rows[in_hbm], cols[in_hbm]] = (-flat[in_hbm].astype(np.int64) - 1) * hbm_layers
    # Past a sequence's pages, its last one repeats.
    width = table.shape[1]
    past = np.arange(width)[None, :] >= counts[:, None]  # (B, width)
    last = staged[np.arange(len(counts)), counts - 1]
    staged = np.where(past, last[:, None], staged)
    pieces = _runs(flat[first[order]], piece_of[first[order]], n_pieces)  # entries in staging order
    host = flat >= 0
    ready_from = int(piece_of[host].max()) + 1 if host.any() else 0
    return StagePlan(pieces, staged, int(len(order)), piece_pages, ready_from, bool(hbm_layers) and not host.all())


# ---- the search ------------------------------------------------------------------------------
def choose_staged(m, host_bytes: int, hbm_bytes: int, flops: float, partial_bytes: float = 0.0,
                  splits: int = 0, host_calls: int = 1, hbm_calls: int = 0,
                  in_place_bytes: int | None = None, kv_read_bytes: int = 0, heads: int = 1,
                  head_calls: int = 0, chunk_q: int = 0, wave_calls: int = 0, pieces: int = 1,
                  head_flags: int = 0, split_ctas: int = 0, sms: int = 0,
                  choices: tuple[int, ...] = SPLIT_CHOICES) -> StagedChoice:
    """Stage when the model says the copy of ``host_bytes`` (``host_calls`` copy calls;
    ``hbm_calls`` for the pages already in HBM) + Q-tiled kernel (its compute, or its reads of
    ``kv_read_bytes`` from the buffer, at the best of ``choices``, or at ``splits``) beats reading
    ``in_place_bytes`` in place (default ``host_bytes``; more where sequences share pages, which
    the staging copies once), by ``stage_margin``: the in-place kernel is bound by max(link, its
    compute), plus ``chunk_tail_ms(chunk_q)`` for the chunk kernel. With ``head_calls`` (the copy
    calls of the call staged head by head over ``heads`` KV heads) that order is weighed too, and
    with ``wave_calls`` (the copy calls of the call in ``LINK_PIECES`` pieces, given when its CTAs
    fit one wave) one split over those pieces. Each piece's ready flag costs ``flag_ms`` of the
    copy (``pieces`` flags; ``head_flags`` staged head by head; ``LINK_PIECES`` in one wave).
    ``split_ctas`` (CTAs of one split) over ``sms`` SMs: the split's CTAs beyond one per SM run
    after their pieces have landed (``staged_ms``'s ``waiting``)."""
    in_place = in_place_ms(m, host_bytes if in_place_bytes is None else in_place_bytes, flops, chunk_q)
    copy = copy_time_ms(m, host_bytes, host_calls, pieces)
    d2d_ms = hbm_bytes / (m.d2d_gbps * 1e6) + hbm_calls * m.copy_call_ms  # copied before the kernel starts
    q_ms = q_read_ms(m, flops, kv_read_bytes)
    waiting = max(0.0, 1.0 - sms / split_ctas) if split_ctas and sms else 0.0
    best = min((splits,) if splits else choices, key=lambda s: staged_ms(m, copy, q_ms, partial_bytes, s, waiting))
    est = d2d_ms + staged_ms(m, copy, q_ms, partial_bytes, best, waiting)
    by_head = coarse = False
    if wave_calls and splits in (0, 1):
        ow = d2d_ms + one_wave_ms(m, copy_time_ms(m, host_bytes, wave_calls, LINK_PIECES), q_ms, LINK_PIECES)
        if ow < est:
            est, best, coarse = ow, 1, True
    if head_calls and heads > 1 and splits in (0, 1):
        hm = d2d_ms + head_major_ms(m, copy_time_ms(m, host_bytes, head_calls, head_flags), q_ms, heads)
        if hm < est:
            est, best, by_head, coarse = hm, 1, True, False
    return StagedChoice(in_place, est, est < stage_margin(m, host_bytes, flops) * in_place, best, by_head, coarse)


def choose_pipelined(m, host_bytes: int, hbm_bytes: int, flops: float, partial_bytes: float, candidates,
                     in_place_bytes: int | None = None, kv_read_bytes: int = 0, chunk_q: int = 0,
                     ctas: int = 0, sms: int = 0, wait_bytes: int = 0) -> tuple[StagedChoice, int]:
    """The best of ``candidates`` -- (KV splits, host copy calls, HBM copy calls, pieces, the
    splits' (work, landed) in launch order as ``pipelined_tail_ms`` takes them, or None for a plan
    paced by its pieces, whose tail is left out) of each staging plan weighed -- for a call whose
    copy runs ahead of its kernel (``pipelined_ms``; the pages already in HBM copied ahead of the
    kernel on its stream, or read in place: no HBM copy calls; ``wait_bytes`` of the host pages,
    the step's own, copied only after the previous kernel), and whether it beats reading
    ``in_place_bytes`` (default ``host_bytes``) in place by the margin ``choose_staged`` uses.
    Returns (the verdict, the index of the chosen candidate)."""
    if not candidates:
        raise ValueError("choose_pipelined needs at least one candidate plan")
    in_place = in_place_ms(m, host_bytes if in_place_bytes is None else in_place_bytes, flops, chunk_q)
    q_ms = q_read_ms(m, flops, kv_read_bytes)
    fold_ms = partial_bytes / (m.fold_gbps * 1e6)
    busy = min(1.0, ctas / sms) if ctas and sms else 1.0

    def est(splits: int, host_calls: int, hbm_calls: int, pieces: int, layout) -> float:
        d2d_ms = hbm_bytes / (m.d2d_gbps * 1e6) + hbm_calls * m.copy_call_ms
        copy = copy_time_ms(m, host_bytes, host_calls, pieces)
        tail = 0.0 if layout is None else pipelined_tail_ms(copy, q_ms, fold_ms, *layout, busy=busy)
        return d2d_ms + pipelined_ms(m, copy, q_ms, partial_bytes, splits, ctas, sms,
                                     wait_bytes / (m.memcpy_gbps * 1e6), tail)

    ests = [est(*c) for c in candidates]
    best = min(range(len(ests)), key=lambda i: (ests[i], candidates[i][0]))
    staged = ests[best] < stage_margin(m, host_bytes, flops) * in_place
    return StagedChoice(in_place, ests[best], staged, candidates[best][0], pipelined=True), best


def pages_used(host_table, lens, page_size: int):
    """(pages per sequence, the table entries the call reads, how many of them are host pages)."""
    n_pages = [math.ceil(n / page_size) for n in lens]
    used = np.concatenate([np.asarray(host_table)[b, :n] for b, n in enumerate(n_pages)])
    return n_pages, used, int((used >= 0).sum())


def hbm_runs_per_sequence(host_table, n_pages) -> int:
    """The most runs of consecutive HBM entries (negative) in any sequence's first ``n_pages[b]``
    table entries: 1 for a window of HBM pages (a step's own tokens mirrored)."""
    table = np.asarray(host_table)
    live = np.arange(table.shape[1])[None, :] < np.asarray(n_pages)[:, None]
    hbm = (table < 0) & live
    starts = hbm & ~np.concatenate([np.zeros((len(table), 1), dtype=bool), hbm[:, :-1]], axis=1)
    return int(starts.sum(axis=1).max()) if len(table) else 0


def ready_page(host_table, n_pages) -> int:
    """The first logical page from which every sequence's pages (its first ``n_pages[b]`` table
    entries) are HBM entries: one past the last host page of any sequence."""
    table = np.asarray(host_table)
    if not len(table):
        return 0
    live = np.arange(table.shape[1])[None, :] < np.asarray(n_pages)[:, None]
    host = (table >= 0) & live
    past_last = table.shape[1] - np.argmax(host[:, ::-1], axis=1)  # one past each row's last host page
    return int(np.where(host.any(axis=1), past_last, 0).max())


def staging_choice(shape: CallShape, device: DeviceInfo, m: MachineModel, cfg: QTiledConfig | None = None,
                   explicit: bool = False, pipelined: bool = False, req: StagingRequest = AUTOMATIC):
    """The cost model's verdict on staging one call (some pages on the host) with ``cfg`` as
    ``req`` asks: (StagedChoice, StagePlan); None when staging cannot pay (decided before
    planning; never for an explicit config); a str saying why it cannot run (over the staging
    cap). With ``pipelined`` (the call's copy runs ahead of its kernel) a chunk whose request
    leaves every decision to the planner is planned by ``_pipelined_choice``."""
    cfg = cfg or QTiledConfig()
    host_table, lens, q_lens = shape.host_table, shape.seq_lens, shape.q_lens
    P, L = shape.page_size, shape.in_place_layers
    group, heads, head_dim = shape.group, shape.num_kv_heads, shape.head_dim
    n_pages, used, n_host = pages_used(host_table, lens, P)
    page_bytes = shape.layer_page_bytes(shape.compute_dtype)
    flops = causal_flops(lens, q_lens, shape.num_q_heads, head_dim)
    bound = compute_bound(m, n_host * page_bytes, flops)
    chunk = op_kernel(group, max(q_lens)) != "decode"  # in place, the chunk kernel would run it
    chunk_q = sum(q_lens) if chunk else 0
    # A chunk with more CTAs than SMs whose compute trails the copy: coarser pieces (fewer copy calls
    # and flags); elsewhere finer pieces pace the CTAs (decode, one wave, compute-bound chunks).
    ctas = q_tiles(max(q_lens), group, cfg.rows) * heads * len(lens)
    coarse_link = chunk and ctas > device.sms and trails_copy(m, n_host * page_bytes, flops)
    pieces, split_choices = link_bound_staging(max(lens)) if coarse_link else (PIECES, SPLIT_CHOICES)
    pp = piece_pages_for(max(n_pages), P, cfg.tile_n, req.piece_pages, pieces=pieces)
    hbm_runs = hbm_runs_per_sequence(host_table, n_pages) if chunk else 0
    window = chunk and hbm_runs <= 1
    if hbm_runs == 1 and not req.piece_pages:  # a step's own pages in HBM: pieces of their own, ready at the start
        pp = window_piece_pages(pp, ready_page(host_table, n_pages), max(n_pages), max(1, cfg.tile_n // P),
                                math.ceil(max(n_pages) / MAX_PIECES))
    calls = sum(math.ceil(n / pp) for n in n_pages)  # at least one copy per sequence and piece
    if not explicit and not may_stage(m, n_host * page_bytes, flops, (used.size - n_host) * page_bytes, calls,
                                      chunk_q, window=window):
        return None
    # Staged head by head: fewer, larger pieces per head (each piece is copied once per head);
    # only the first head's copy is exposed, so finer pieces would only add copy calls.
    stage_plan = plan_staging(host_table, lens, P, pp, L) if req.copy_order != 2 else None
    head_plan = None  # weighed where compute binds (elsewhere the pieces of all heads win: measured)
    if req.copy_order == 2 or (req.copy_order == 0 and req.splits <= 1 and bound):
        pp_h = piece_pages_for(max(n_pages), P, cfg.tile_n, req.piece_pages, pieces=HEAD_PIECES)
        head_plan = stage_plan if stage_plan is not None and pp_h == pp else \
            plan_staging(host_table, lens, P, pp_h, L)
        if len(head_plan.pieces) * heads > MAX_FLAGS:
            head_plan = None
    if stage_plan is None and head_plan is None:
        return f"copy_order 2 (head by head) needs at most {MAX_FLAGS} (KV head, piece) ready flags"
    # A chunk whose CTAs all fit one wave: one split over LINK_PIECES coarse pieces is weighed too.
    wave_plan = None
    if (chunk and stage_plan is not None and req.splits <= 1 and req.order != 2 and not req.piece_pages
            and ctas <= device.sms):
        wave_plan = plan_staging(host_table, lens, P,
                                 piece_pages_for(max(n_pages), P, cfg.tile_n, pieces=LINK_PIECES), L)
    any_plan = stage_plan if stage_plan is not None else head_plan
    need = any_plan.pages * page_bytes
    if not device.fits_staging(need):
        return (f"staging needs {need / 2**30:.2f} GiB of HBM, over the {device.staging_cap / 2**30:.2f} GiB cap "
                "(DIRECTKV_MAX_STAGING_GB)")
    host_b = any_plan.host_pages * page_bytes
    host_calls, hbm_calls = any_plan.copy_calls
    head_calls = 0 if head_plan is None else heads * head_plan.copy_calls[0]
    wave_calls = 0 if wave_plan is None else wave_plan.copy_calls[0]
    # What the Q-tiled kernel reads from the buffer beyond its compute: each sequence's pages
    # (its query tiles read them together, through the L2), however many sequences share them.
    kv_read = used.size * page_bytes
    choice = choose_staged(m, host_b, need - host_b, flops, partial_bytes(sum(q_lens), shape.num_q_heads, head_dim),
                           1 if req.one_split else req.splits, host_calls=host_calls, hbm_calls=hbm_calls,
                           in_place_bytes=n_host * page_bytes, kv_read_bytes=kv_read, heads=heads,
                           head_calls=head_calls, chunk_q=chunk_q, wave_calls=wave_calls, pieces=len(any_plan.pieces),
                           head_flags=0 if head_plan is None else heads * len(head_plan.pieces),
                           split_ctas=ctas, sms=device.sms, choices=split_choices)
    if stage_plan is None:  # head by head asked for
        choice = dataclasses.replace(choice, by_head=True, splits=1, coarse=False)
    out = (choice, head_plan) if choice.by_head else (choice, wave_plan if choice.coarse else stage_plan)
    if pipelined and chunk and req.automatic:
        # Weighed against this plan back to back: the step's own host pages, or a kernel as long
        # as the copy, may keep it the better one.
        return _pipelined_choice(shape, device, m, used, n_host, page_bytes, flops, chunk_q, ctas, cfg, out) or out
    return out


def _pipelined_choice(shape, device, m, used, n_host: int, page_bytes: int, flops: float, chunk_q: int, ctas: int,
                      cfg: QTiledConfig, regular):
    """(StagedChoice, StagePlan) of a chunk whose copy runs ahead of its kernel: one plan per
    split count of ``SPLIT_CHOICES``, each in as many pieces as it has splits over the pages before
    the step's own tokens (the first logical page holding any sequence's new tokens ends a piece,
    so that the history's copy waits for none of the step's writes), and ``regular`` (the
    (StagedChoice, StagePlan) planned for one call, paced by its pieces: no pipeline to fill),
    weighed by ``choose_pipelined``. None where ``regular`` wins, or where the copy would not
    run ahead after all (two buffers over the staging cap)."""
    host_table, lens, q_lens = shape.host_table, shape.seq_lens, shape.q_lens
    P, L = shape.page_size, shape.in_place_layers
    n_pages = [math.ceil(n / P) for n in lens]
    staged = n_host if L else used.size  # the pages a buffer takes
    if not device.fits_staging(staged * page_bytes, SLOTS):
        return None
    max_pages = max(n_pages)
    tile_pages = max(1, cfg.tile_n // P)
    min_pp = math.ceil(max_pages / MAX_PIECES)
    own = min((n - ql) // P for n, ql in zip(lens, q_lens))  # pages before every sequence's new tokens
    own -= own % tile_pages  # pieces end on whole KV tiles
    max_tiles = math.ceil(max(lens) / cfg.tile_n)
    plans, candidates, wants = [], [], []
    for want in SPLIT_CHOICES:
        if own >= tile_pages:
            pp = max(min_pp, tile_pages * math.ceil(own / want / tile_pages))
            pp = window_piece_pages(pp, own, max_pages, tile_pages, min_pp)
        else:
            pp = piece_pages_for(max_pages, P, cfg.tile_n, pieces=want)
        if any(p.piece_pages == pp for p in plans):
            continue
        sp = plan_staging(host_table, lens, P, pp, L)
        plans.append(sp)
        wants.append(want)
        candidates.append((_staged_splits(sp, P, cfg.tile_n, max_tiles, want)[0], *sp.copy_calls,
                           len(sp.pieces), _split_layout(sp, P, cfg.tile_n, max_tiles, want, lens, q_lens)))
    reg_choice, reg_plan = regular
    host_calls, hbm_calls = reg_plan.copy_calls
    if reg_choice.by_head:
        heads = shape.num_kv_heads
        candidates.append((1, heads * host_calls, hbm_calls, heads * len(reg_plan.pieces), None))
    else:
        want = reg_choice.splits
        candidates.append((_staged_splits(reg_plan, P, cfg.tile_n, max_tiles, want)[0], host_calls, hbm_calls,
                           len(reg_plan.pieces), _split_layout(reg_plan, P, cfg.tile_n, max_tiles, want, lens,
                                                               q_lens)))
    host_b = plans[0].host_pages * page_bytes
    # The step's own host pages were just written: their copy waits for the previous kernel.
    table = np.asarray(host_table)
    wait_pages = sum(int((table[b, (n - ql) // P:n_pages[b]] >= 0).sum())
                     for b, (n, ql) in enumerate(zip(lens, q_lens)))
    choice, best = choose_pipelined(m, host_b, plans[0].pages * page_bytes - host_b, flops,
                                    partial_bytes(sum(q_lens), shape.num_q_heads, shape.head_dim), candidates,
                                    in_place_bytes=n_host * page_bytes, kv_read_bytes=used.size * page_bytes,
                                    chunk_q=chunk_q, ctas=ctas, sms=device.sms, wait_bytes=wait_pages * page_bytes)
    if best == len(plans):
        return None
    return dataclasses.replace(choice, splits=wants[best]), plans[best]


def _split_layout(sp: StagePlan, page_size: int, tile_n: int, max_tiles: int, want: int, lens, q_lens):
    """The splits of a staged launch over ``sp`` (``_staged_splits``, the ready ones first) in
    launch order, as ``plan.pipelined_tail_ms`` weighs them: (each one's share of the causal work,
    the share of the host copy after which its pages have all landed, None where they are ready
    before it starts)."""
    splits, split_tiles, piece_tiles = _staged_splits(sp, page_size, tile_n, max_tiles, want)
    first = ready_split(sp.ready_from, piece_tiles, split_tiles, splits)
    work = split_work(lens, q_lens, tile_n, split_tiles, splits)
    copied = np.cumsum([sum(r.count for r in piece if not r.hbm) for piece in sp.pieces], dtype=np.float64)
    copied /= max(copied[-1], 1.0)
    landed = []
    for s in range(splits):
        lo, hi = s * split_tiles // piece_tiles, min(((s + 1) * split_tiles - 1) // piece_tiles, len(sp.pieces) - 1)
        landed.append(None if lo >= sp.ready_from else float(copied[hi]))
    order = [(first + r) % splits for r in range(splits)]
    return [work[s] for s in order], [landed[s] for s in order]


def _staged_splits(sp: StagePlan, page_size: int, tile_n: int, max_tiles: int, want: int):
    """(splits, tiles per split, tiles per piece) of a staged launch over ``sp`` asking for
    ``want`` splits (``q_tiled_splits``), the pieces ready at the start in splits of their own."""
    piece_tiles = sp.piece_pages * page_size // tile_n
    splits, split_tiles = q_tiled_splits(max_tiles, piece_tiles, want, sp.ready_from * piece_tiles)
    return splits, split_tiles, piece_tiles


# ---- FP8 pages -------------------------------------------------------------------------------
# The second piece of a staged FP8 decode: this share of the longest sequence's pages. The first
# launch reads the rest from HBM while the copy engine moves it (the FP8 kernel reads the staged
# pages at about 1.25 TB/s, 55 us after a 1.25 ms copy at batch 1 over 32k), so it hides behind
# that copy while the share is above about 4.4%; what stays exposed is the second launch.
FP8_TAIL_SHARE = 1 / 16


def fp8_stage_plan(shape: CallShape, device: DeviceInfo, m: MachineModel) -> StagePlan | None:
    """The staging plan of a decode-sized call over FP8 pages when copying their bytes and scales
    into HBM first beats reading them in place (``plan.may_stage`` on those bytes, as for 16-bit
    pages: long link-bound reads with every page on the host), else None: two pieces (the last
    ``FP8_TAIL_SHARE`` of the longest sequence's pages apart) where every sequence has one query
    token, else one. Never inside a CUDA graph capture (the copies are planned per call)."""
    if shape.host_table is None or device.capturing:
        return None
    lens, q_lens, P = shape.seq_lens, shape.q_lens, shape.page_size
    n_pages, used, n_host = pages_used(shape.host_table, lens, P)
    page_bytes = shape.layer_page_bytes()  # FP8 rows and their scales, one layer
    flops = causal_flops(lens, q_lens, shape.num_q_heads, shape.head_dim)
    if not n_host or not may_stage(m, n_host * page_bytes, flops, (used.size - n_host) * page_bytes, 2 * len(lens)):
        return None
    longest = max(n_pages)
    pp = longest
    if max(q_lens) == 1 and longest > 1:
        pp = min(longest - 1, math.ceil(longest * (1 - FP8_TAIL_SHARE)))
    sp = plan_staging(shape.host_table, lens, P, pp)
    if not device.fits_staging(sp.pages * page_bytes):
        return None
    return sp


def split_staged_table(table: np.ndarray, lens, pages_a: int, page_size: int):
    """The two launches of a two-piece staged decode: ((table, lengths) of every sequence's first
    ``pages_a`` pages, (table, lengths) of the rest), each part a sequence of its own (a part
    can be empty: length 0, no tiles)."""
    lens = np.asarray(lens, dtype=np.int64)
    len_a = np.minimum(lens, pages_a * page_size)
    return ((np.ascontiguousarray(table[:, :pages_a]), len_a.astype(np.int32)),
            (np.ascontiguousarray(table[:, pages_a:]), (lens - len_a).astype(np.int32)))


def fp8_head_groups(m: MachineModel, hkv: int, page_size: int, head_dim: int, elem_bytes: int, lens, q_lens,
                    num_q_heads: int):
    """The KV head groups an FP8 chunk is copied, dequantized and attended in (``fp8_by_head``):
    ``head_groups`` of one head's FP8 block of a page (two heads at page 64, d 128), the
    first group a single head where the call's compute outlasts the copy of its pages at 16 bits
    (``trails_copy`` false: the first group's copy is the exposed part; measured at 32k q8192 5.78
    ms so vs 5.93 in pairs, 8k q8192 0.961 vs 0.971; at q2048, where the compute is shorter,
    single heads cost 15%)."""
    bound = not trails_copy(m, kv_bytes(sum(lens), hkv, head_dim), causal_flops(lens, q_lens, num_q_heads, head_dim))
    return head_groups(hkv, 2 * page_size * head_dim * elem_bytes, first=1 if bound else 0)

