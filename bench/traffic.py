"""GPU-free check of the host-traffic model: every host KV byte is read exactly once.

For a grid of cases (ragged lengths, page sizes, tile sizes, split counts, HBM fractions and
placements) it takes the kernel's schedule (``directkv_cute.plan.decode_schedule``) and byte
count (``plan.decode_traffic``) and asserts, per sequence and KV head:

* every tile starts on a tile boundary and is read by one CTA only (no tile read twice);
* the tiles' token ranges are disjoint and their union is exactly [0, seq_len);
* each CTA's tiles are contiguous and the CTAs' ranges come in split order;
* host bytes == the unique host page bytes of the sequence rounded the way the schedule
  reads them (tokens up to the last tile's end, capped at the allocated pages), computed
  here independently of the plan module; the same for HBM bytes.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from bench.placement import page_mask


@dataclass(frozen=True)
class TrafficCase:
    seq_lens: tuple[int, ...]
    page_size: int
    tile_n: int
    num_splits: int
    num_kv_heads: int = 2
    head_dim: int = 128
    hbm_fraction: float = 0.0
    placement: str = "spread"
    elem_bytes: int = 2

    @property
    def label(self) -> str:
        lens = ",".join(map(str, self.seq_lens))
        return (f"lens=[{lens}] page={self.page_size} tile={self.tile_n} splits={self.num_splits} "
                f"hkv={self.num_kv_heads} d={self.head_dim} hbm={self.hbm_fraction:g}/{self.placement}")

    def page_hbm(self) -> list[list[bool]]:
        return [page_mask(n, self.page_size, self.hbm_fraction, self.placement) for n in self.seq_lens]


@dataclass
class TrafficResult:
    case: TrafficCase
    host_bytes: int = 0
    hbm_bytes: int = 0
    expected_host: int = 0
    expected_hbm: int = 0
    tiles: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def expected_bytes(case: TrafficCase) -> tuple[int, int]:
    """(host, HBM) bytes the kernel should read, from first principles.

    A sequence of n tokens owns ceil(n / page) pages; the schedule reads whole tiles, so it
    reads tokens [0, R) with R = min(ceil(n / tile) * tile, pages * page): the unique tokens,
    rounded up to the tile the way the TMA copies do, never past the allocated pages.
    """
    row = 2 * case.head_dim * case.elem_bytes * case.num_kv_heads
    host = hbm = 0
    for n, mask in zip(case.seq_lens, case.page_hbm()):
        n_pages = math.ceil(n / case.page_size)
        read_to = min(math.ceil(n / case.tile_n) * case.tile_n, n_pages * case.page_size)
        for p in range(n_pages):
            tokens = max(0, min((p + 1) * case.page_size, read_to) - p * case.page_size)
            if mask[p]:
                hbm += tokens * row
            else:
                host += tokens * row
    return host, hbm


def _coverage_problems(case: TrafficCase, reads) -> list[str]:
    """Tiles of each (sequence, KV head): aligned, read once, disjoint, covering [0, n)."""
    problems = []
    by_head = defaultdict(list)
    for r in reads:
        by_head[(r.batch, r.kv_head)].append(r)
    for b, n in enumerate(case.seq_lens):
        for h in range(case.num_kv_heads):
            tiles = by_head.get((b, h), [])
            where = f"seq {b} (len {n}) head {h}"
            dup = sorted(s for s, k in Counter(t.tok_start for t in tiles).items() if k > 1)
            if dup:
                problems.append(f"{where}: tiles starting at {dup[:4]} read by more than one CTA")
            if any(t.tok_start % case.tile_n for t in tiles):
                problems.append(f"{where}: a tile starts off a tile boundary")
            if any(t.tok_stop <= t.tok_start or t.tok_stop > n for t in tiles):
                problems.append(f"{where}: a tile is empty or reaches past the sequence")
            problems += _union_problems(where, n, sorted((t.tok_start, t.tok_stop) for t in tiles))
            problems += _split_order_problems(where, tiles, case.tile_n)
    extra = set(by_head) - {(b, h) for b in range(len(case.seq_lens)) for h in range(case.num_kv_heads)}
    if extra:
        problems.append(f"reads of nonexistent (sequence, head) pairs {sorted(extra)[:4]}")
    return problems


def _union_problems(where: str, n: int, spans: list[tuple[int, int]]) -> list[str]:
    pos = 0
    for start, stop in spans:
        if start < pos:
            return [f"{where}: tokens [{start}, {min(stop, pos)}) read twice"]
        if start > pos:
            return [f"{where}: tokens [{pos}, {start}) never read"]
        pos = stop
    return [] if pos == n else [f"{where}: tokens [{pos}, {n}) never read"]


def _split_order_problems(where: str, tiles, tile_n: int) -> list[str]:
    """Each split's tiles are one contiguous run, and splits follow each other in order."""
    runs = defaultdict(list)
    for t in tiles:
        runs[t.split].append(t.tok_start)
    last_end = -1
    for split in sorted(runs):
        starts = sorted(runs[split])
        if starts != [starts[0] + k * tile_n for k in range(len(starts))]:
            return [f"{where}: split {split} reads a non-contiguous set of tiles"]
        if starts[0] <= last_end:
            return [f"{where}: split {split} starts before the previous split ends"]
        last_end = starts[-1]
    return []


def check_case(case: TrafficCase) -> TrafficResult:
    """Run the plan's schedule and byte count for one case and compare with the invariants."""
    from directkv_cute import plan

    res = TrafficResult(case)
    reads = plan.decode_schedule(list(case.seq_lens), case.num_kv_heads, case.tile_n, case.num_splits)
    res.tiles = len(reads)
    res.problems += _coverage_problems(case, reads)
    res.host_bytes, res.hbm_bytes = plan.decode_traffic(list(case.seq_lens), case.page_hbm(), case.num_kv_heads,
                                                        case.head_dim, case.page_size, case.tile_n,
                                                        case.num_splits, case.elem_bytes)
    res.expected_host, res.expected_hbm = expected_bytes(case)
    if res.host_bytes != res.expected_host:
        res.problems.append(f"host bytes {res.host_bytes} != unique host page bytes {res.expected_host}")
    if res.hbm_bytes != res.expected_hbm:
        res.problems.append(f"HBM bytes {res.hbm_bytes} != unique HBM page bytes {res.expected_hbm}")
    return res


SEQ_SETS = ((1,), (17, 300, 1000, 65), (4109,), (5, 2048, 777, 129))
PAGE_SIZES = (16, 32, 64, 128)
TILE_SIZES = (16, 64, 256)
ALL_TILE_SIZES = (16, 32, 64, 128, 256)
SPLITS = (1, 3, 8, 64)
FRACTIONS = ((0.0, "spread"), (0.5, "spread"), (1.0, "spread"), (0.25, "recent"))


def auto_splits(seq_lens, tile_n: int, num_kv_heads: int) -> int:
    """The split count the op would pick with the default config (132 SMs)."""
    from directkv_cute.config import DecodeConfig

    return DecodeConfig(tile_n=tile_n).splits_for(len(seq_lens), num_kv_heads, max(seq_lens))


def multi_token_splits_for(seq_lens, page_size: int, tile_n: int, stages: int, chunk_tiles: int = 0,
                           num_kv_heads: int = 2) -> int:
    """The split count of the multi-token kernel, sized as the op sizes it:
    from the page table's width, one chunk per CTA (chunk_tiles 0) or one wave of CTAs walking
    several chunks each (chunk_tiles > 0)."""
    from directkv_cute.config import DecodeConfig, multi_token_splits

    width = -(-max(seq_lens) // page_size) * page_size
    cfg = DecodeConfig(tile_n=tile_n, stages=stages, chunk_tiles=chunk_tiles, consumer_wgs=2, carveout=100)
    return multi_token_splits(cfg, width, len(seq_lens), num_kv_heads)


def default_cases() -> list[TrafficCase]:
    """The CI grid: every page size with several tile sizes (all five at page 64), fixed and
    automatic split counts (the decode kernel's and the multi-token kernel's), and HBM fractions
    with two placements, over ragged batches."""
    cases = []
    for lens, page in itertools.product(SEQ_SETS, PAGE_SIZES):
        for tile in (ALL_TILE_SIZES if page == 64 else TILE_SIZES):
            multi_token_splits = {multi_token_splits_for(lens, page, tile, st, ch)
                                  for st, ch in ((2, 0), (6, 0), (6, 3))}
            splits = sorted(set(SPLITS) | {auto_splits(lens, tile, 2)} | multi_token_splits)
            for s, (frac, placement) in itertools.product(splits, FRACTIONS):
                cases.append(TrafficCase(lens, page, tile, s, hbm_fraction=frac, placement=placement))
    cases.append(TrafficCase((3000, 31), 32, 64, 5, num_kv_heads=1, head_dim=64, hbm_fraction=0.5))
    cases.append(TrafficCase((3000, 31), 128, 32, 7, num_kv_heads=3, head_dim=64, hbm_fraction=0.75,
                             placement="oldest"))
    return cases


def run_traffic_check(cases: list[TrafficCase] | None = None) -> list[TrafficResult]:
    return [check_case(c) for c in (default_cases() if cases is None else cases)]


# ---- a model's steps through the HBM window -----------------------------------------------------
@dataclass(frozen=True)
class StepCase:
    """Steps of a batch as a model runs them: ``steps[i][b]`` new tokens of sequence b in step i
    (chunked prefill, then decode), through a cache whose window mirrors each step's pages."""

    steps: tuple[tuple[int, ...], ...]
    page_size: int
    tile_n: int
    num_kv_heads: int = 2
    head_dim: int = 64

    num_splits: int = 1

    @property
    def label(self) -> str:
        return f"steps={len(self.steps)} batch={len(self.steps[0])} page={self.page_size} tile={self.tile_n}"


def check_step_case(case: StepCase) -> TrafficResult:
    """Every step's host bytes (``plan.decode_traffic`` over the step's kernel tables, pages
    mirrored by ``PagedKVCache.mirror`` after the step's ``release_mirrors``, as
    ``directkv_cute.hf.DirectKVCache`` does) equal the history's full pages read once: the new
    tokens, and the history sharing the partial last page, come from HBM."""
    import torch

    from directkv_cute.cache import PagedKVCache
    from directkv_cute.plan import decode_traffic

    P, hkv, d = case.page_size, case.num_kv_heads, case.head_dim
    batch = len(case.steps[0])
    total = [sum(s[b] for s in case.steps) for b in range(batch)]
    window = max(math.ceil(sum(s) / P) + 2 * batch for s in case.steps)
    cache = PagedKVCache(1, hkv, d, P, sum(math.ceil(n / P) for n in total) + batch, 0, dtype=torch.bfloat16,
                         device="cpu", num_window_pages=window)
    sids = [cache.add_sequence() for _ in range(batch)]
    res = TrafficResult(case)
    row = 2 * d * 2 * hkv  # one token of K and V over the KV heads
    for i, step in enumerate(case.steps):
        hist = [cache.seq_len(s) for s in sids]
        for sid, n in zip(sids, step):
            cache.release_mirrors(sid)
            cache.extend(sid, n)
            cache.mirror(sid, cache.seq_len(sid) - n, n)
        t = cache.kernel_tables(sids)
        lens = list(t.host_seq_lens)
        page_hbm = [(t.host_table[b, : math.ceil(n / P)] < 0).tolist() for b, n in enumerate(lens)]
        host, hbm = decode_traffic(lens, page_hbm, 1, d, P, case.tile_n, 1)
        host *= hkv
        hbm *= hkv
        want = sum((h // P) * P for h in hist) * row
        res.host_bytes += host
        res.hbm_bytes += hbm
        res.expected_host += want
        res.expected_hbm += hbm
        if host != want:
            res.problems.append(f"step {i}: host bytes {host} != the history's full pages {want}")
        new_hbm = all(t.host_table[b, p] < 0 for b, (h, n) in enumerate(zip(hist, step))
                      for p in range(h // P, math.ceil((h + n) / P)))
        if not new_hbm:
            res.problems.append(f"step {i}: a page holding new tokens is read from the host")
    return res


def default_step_cases() -> list[StepCase]:
    """Chunked prefills of ragged prompts then decode, at every page size and two tile sizes."""
    cases = []
    for P, tile in itertools.product(PAGE_SIZES, (64, 128)):
        prefill = [(128, 100, 17), (128, 100, 0), (128, 0, 0), (45, 0, 0)]
        decode = [(1, 1, 1)] * (P + 3)
        cases.append(StepCase(tuple(prefill + decode), P, tile))
        cases.append(StepCase(((P * 3 + 5,), (P - 5,), (1,), (2 * P,), (1,)), P, tile, num_kv_heads=1, head_dim=128))
    return cases


def run_step_traffic_check(cases: list[StepCase] | None = None) -> list[TrafficResult]:
    return [check_step_case(c) for c in (default_step_cases() if cases is None else cases)]


def split_summary(splits) -> str:
    """The split counts a row covers, whole: "1,2,4" while short, else "1..65 (12 counts)"."""
    vals = sorted(splits)
    text = ",".join(map(str, vals))
    return text if len(text) <= 28 else f"{vals[0]}..{vals[-1]} ({len(vals)} counts)"


def format_traffic_table(results: list[TrafficResult], max_failures: int = 20) -> str:
    """One row per (page size, tile size): cases, splits covered, bytes read vs expected,
    failures; then the first failing cases in full."""
    groups = defaultdict(list)
    for r in results:
        groups[(r.case.page_size, r.case.tile_n)].append(r)
    rows = [("page", "tile", "cases", "splits", "tiles", "host MiB", "expected", "hbm MiB", "expected", "failed")]
    for (page, tile), rs in sorted(groups.items()):
        rows.append((page, tile, len(rs), split_summary({r.case.num_splits for r in rs}),
                     sum(r.tiles for r in rs), f"{sum(r.host_bytes for r in rs) / 2**20:.2f}",
                     f"{sum(r.expected_host for r in rs) / 2**20:.2f}", f"{sum(r.hbm_bytes for r in rs) / 2**20:.2f}",
                     f"{sum(r.expected_hbm for r in rs) / 2**20:.2f}", sum(not r.ok for r in rs)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    failed = [r for r in results if not r.ok]
    for r in failed[:max_failures]:
        lines.append(f"FAIL {r.case.label}: " + "; ".join(r.problems[:3]))
    if len(failed) > max_failures:
        lines.append(f"... and {len(failed) - max_failures} more failing cases")
    ok = len(results) - len(failed)
    lines.append(f"traffic check: {ok}/{len(results)} cases pass"
                 + ("" if not failed else f", {len(failed)} FAIL"))
    return "\n".join(lines)
