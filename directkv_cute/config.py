"""Kernel configurations: the knobs the autotuner searches and their static legality.

Plain Python, importable without CUDA or cutlass: the tuner, the profile code and the CPU
tests use it to reason about configs without compiling anything.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Hopper (sm_90) limits used by the legality filter.
SM90_SMEM_PER_SM = 228 * 1024  # unified L1/SMEM capacity usable as SMEM per SM
SM90_SMEM_PER_BLOCK_OPTIN = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin
SM90_NUM_SMS = 132  # H200 SXM; the op reads the real count off the device
SMEM_RESERVED_PER_BLOCK = 1024  # the driver reserves 1 KB of SMEM per resident block
_BARRIER_AND_ALIGN_BYTES = 1024  # the mbarriers (<= 192 B), padded to the tiles' 1 KB alignment

SUPPORTED_HEAD_DIMS = (64, 128)
MAX_LINK_CREDITS = 1 << 20  # far above any useful value; keeps ticket differences inside int32
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
DEFAULT_PAGE_SIZE = 64  # what caches and the vLLM backend use unless told: the shipped profiles' tuned page size


class ConfigError(ValueError):
    """A config that cannot run for the given problem (raised before compiling)."""


@dataclass(frozen=True)
class DecodeConfig:
    """Static configuration of the split-KV decode kernel.

    tile_n:        KV tokens per pipeline stage (one K tile and one V tile of tile_n x head_dim).
    stages:        depth of the SMEM ring the TMA producer warp keeps in flight.
    num_splits:    CTAs per (sequence, KV head) along the context; 0 lets the op pick
                   (enough CTAs to fill the GPU ``ctas_per_sm`` times over).
    ctas_per_sm:   target resident CTAs per SM for the automatic split count; the multi-token
                   kernel runs two per SM where they fit (``multi_token_occupancy``).
    carveout:      percent of the unified L1/SMEM reserved as SMEM
                   (cudaFuncAttributePreferredSharedMemoryCarveout); the paper's default is 80.
    consumer_wgs:  consumer warpgroups (1-3); each holds 64 query rows (GQA group x q_len).
    chunk_tiles:   multi-token kernel only: KV tiles every query block is applied to
                   before the chunk's ring slots are released. 0 = the whole ring (one chunk per
                   CTA, no overlap); 1..stages-1 keeps ``stages - chunk_tiles`` slots loading the
                   next chunk while the consumers work, and each CTA walks several chunks, merging
                   its partial in place (double buffering when 2 * chunk_tiles <= stages).
    max_inflight:  tiles the producer keeps issued but not yet landed (0 = no limit beyond the
                   ring). Host reads have a long round trip, and while the whole ring is in flight
                   on every SM the consumers' own HBM traffic (Q gathers, partials) slows down;
                   a limit of 1-2 small tiles still keeps the link busy with one wave of CTAs.
    edge_tiles:    multi-token kernel only: the first and the last chunk of each CTA hold this many
                   tiles instead of ``chunk`` (0 = off). A small first chunk lets compute start
                   once one tile per CTA has landed; a small last chunk shortens the compute left
                   after the link goes quiet. Each costs one more pass of every query block.
    q_regs:        multi-token kernel only (1 = on): each consumer warpgroup keeps its pass's Q rows
                   in registers and the Q K^T WGMMA reads them from there, so the Q tile leaves
                   SMEM (rows x head_dim x 2 B: 32 KB with two warpgroups at d 128) for one more
                   ring stage.
    stagger:       multi-token kernel only: groups (0 = off, else 2..chunk) into which each consumer
                   warpgroup's query blocks fall, in walk order, whose chunk boundaries are staggered
                   (``config.block_passes``). The first pass of a block in group g covers tiles
                   [0, c_g) with c_g = ceil(chunk * (g + 1) / stagger), so the first blocks start
                   once one tile has landed, not a whole chunk; its later passes cover ``chunk`` tiles
                   each from there (a short remainder joins the last pass while the ring holds it).
                   The warpgroup frees each tile as soon as no later pass of its own needs it, so
                   the ring refills a tile at a time through the walk instead of stalling at chunk
                   boundaries. Costs one more pass of the blocks whose remainder is not absorbed.
    q_cluster:     multi-token kernel only: CTAs of a thread-block cluster (0 = none; 2 or 4) that
                   share each KV tile and split the query rows of their (sequence, KV head, split)
                   between them. The CTAs share out each tile's TMA boxes (K and V per page piece,
                   pieces halved until there is a box per CTA), each issued once and multicast to
                   all of them, so a host tile still crosses the link once, while each CTA walks
                   only every q_cluster-th block of query rows: fewer passes per chunk (the work
                   left after the link goes quiet) and fewer splits (less combine traffic).
    link_credits:  host-link admission control across the whole GPU (0 = off): at most this many
                   tiles are in flight from all CTAs of all launches on the device together. Each
                   producer takes a ticket from a device-wide counter and issues its tile once no
                   more than ``link_credits - 1`` earlier tickets are still unlanded, so host
                   requests never queue far beyond what the link needs (bandwidth x round trip)
                   and the consumers' HBM traffic is not stuck behind them. Needs
                   ``max_inflight == 1`` (a producer reports each tile's landing before taking
                   its next ticket, so no spinning producer holds a credit). In a cluster the
                   rank-0 CTA takes each tile's ticket for all of them and signals the peers,
                   which take none (a ticket never waits on another ticket holder's boxes).
    """

    tile_n: int = 64
    stages: int = 4
    num_splits: int = 0
    ctas_per_sm: int = 2
    carveout: int = 80
    consumer_wgs: int = 1
    chunk_tiles: int = 0
    max_inflight: int = 0
    link_credits: int = 0
    edge_tiles: int = 0
    q_regs: int = 0
    q_cluster: int = 0
    stagger: int = 0

    # ---- derived -------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Query rows (GQA group x q_len) one CTA holds."""
        return 64 * self.consumer_wgs

    @property
    def multi_token_only(self) -> tuple[str, ...]:
        """The options set in this config that only the multi-token kernel has (``q_regs``,
        ``q_cluster``, ``stagger``): such a config runs there at any row count."""
        return tuple(f for f in ("q_regs", "q_cluster", "stagger") if getattr(self, f))

    @property
    def cluster(self) -> int:
        """CTAs per cluster of the multi-token kernel (1 without ``q_cluster``)."""
        return max(1, self.q_cluster)

    @property
    def chunk(self) -> int:
        """KV tiles per chunk of the multi-token kernel."""
        return self.chunk_tiles or self.stages

    def multi_token_occupancy(self, head_dim: int, elem_bytes: int = 2) -> int:
        """CTAs per SM the multi-token kernel is compiled for: 2 when asked (ctas_per_sm >= 2) with one
        consumer warpgroup and SMEM for two, so one CTA loads its chunk while the other computes;
        else 1."""
        if self.ctas_per_sm >= 2 and self.consumer_wgs == 1 and self.resident_ctas(head_dim, elem_bytes) >= 2:
            return 2
        return 1

    @property
    def num_threads(self) -> int:
        return 128 * (self.consumer_wgs + 1)

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Dynamic SMEM one CTA needs: the K/V ring, the Q tile, barriers and padding."""
        kv_ring = self.stages * 2 * self.tile_n * head_dim * elem_bytes
        q_tile = 0 if self.q_regs else self.rows * head_dim * elem_bytes
        return kv_ring + q_tile + _BARRIER_AND_ALIGN_BYTES

    def smem_budget(self) -> int:
        """SMEM per SM allowed by the carveout alpha."""
        return (SM90_SMEM_PER_SM * self.carveout) // 100

    def resident_ctas(self, head_dim: int, elem_bytes: int = 2) -> int:
        per_cta = self.smem_bytes(head_dim, elem_bytes) + SMEM_RESERVED_PER_BLOCK
        return max(0, self.smem_budget() // per_cta)

    # ---- legality ------------------------------------------------------------------------
    def check(self, head_dim: int, page_size: int | None = None, elem_bytes: int = 2) -> None:
        """Raise ConfigError unless this config can be compiled and launched for the shape."""
        problems = self.problems(head_dim, page_size, elem_bytes)
        if problems:
            raise ConfigError(f"{self}: " + "; ".join(problems))

    def problems(self, head_dim: int, page_size: int | None = None, elem_bytes: int = 2) -> list[str]:
        out = []
        if head_dim not in SUPPORTED_HEAD_DIMS:
            out.append(f"head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}")
        if self.tile_n not in (16, 32, 64, 128, 256):
            out.append(f"tile_n {self.tile_n} must be a power of two in 16..256")
        if not 2 <= self.stages <= 12:
            out.append(f"stages {self.stages} must be in 2..12")
        if self.num_splits < 0:
            out.append("num_splits must be >= 0 (0 = automatic)")
        if not 1 <= self.ctas_per_sm <= 8:
            out.append("ctas_per_sm must be in 1..8")
        if not 0 <= self.carveout <= 100:
            out.append("carveout must be a percentage 0..100")
        if not 0 <= self.chunk_tiles < self.stages:
            out.append(f"chunk_tiles {self.chunk_tiles} must be 0 (the whole ring) or in 1..stages-1")
        if not 0 <= self.max_inflight < self.stages:
            out.append(f"max_inflight {self.max_inflight} must be 0 (no limit) or in 1..stages-1")
        if not 0 <= self.link_credits <= MAX_LINK_CREDITS:
            out.append(f"link_credits {self.link_credits} must be 0 (off) or in 1..{MAX_LINK_CREDITS}")
        elif self.link_credits and self.max_inflight != 1:
            out.append(f"link_credits {self.link_credits} needs max_inflight 1 (got {self.max_inflight})")
        if not 0 <= self.edge_tiles <= self.chunk:
            out.append(f"edge_tiles {self.edge_tiles} must be 0 (off) or in 1..chunk ({self.chunk})")
        if self.stagger and not 2 <= self.stagger <= self.chunk:
            out.append(f"stagger {self.stagger} must be 0 (off) or in 2..chunk ({self.chunk})")
        elif self.stagger and self.edge_tiles:
            out.append(f"stagger {self.stagger} replaces edge chunks (got edge_tiles {self.edge_tiles})")
        if self.q_regs not in (0, 1):
            out.append(f"q_regs {self.q_regs} must be 0 or 1")
        if self.q_cluster not in (0, 2, 4):
            out.append(f"q_cluster {self.q_cluster} must be 0 (off), 2 or 4")
        elif self.q_cluster and self.multi_token_occupancy(head_dim, elem_bytes) != 1:
            out.append("q_cluster needs one CTA per SM (ctas_per_sm 1 or a config that fits only one)")
        if self.consumer_wgs not in (1, 2, 3):
            out.append("consumer_wgs must be 1, 2 or 3")
        elif self.consumer_wgs == 3 and self.tile_n > 64:
            out.append("3 consumer warpgroups (160 registers each) need tile_n <= 64")
        if page_size is not None:
            if page_size not in SUPPORTED_PAGE_SIZES:
                out.append(f"page_size {page_size} not in {SUPPORTED_PAGE_SIZES}")
            elif max(page_size, self.tile_n) % min(page_size, self.tile_n):
                out.append(f"tile_n {self.tile_n} and page_size {page_size} must divide one another")
        if not out:
            smem = self.smem_bytes(head_dim, elem_bytes)
            if smem > SM90_SMEM_PER_BLOCK_OPTIN:
                out.append(f"needs {smem} B of SMEM, over the {SM90_SMEM_PER_BLOCK_OPTIN} B per-block limit")
            elif self.resident_ctas(head_dim, elem_bytes) < 1:
                out.append(
                    f"needs {smem} B of SMEM, over the carveout budget "
                    f"{self.smem_budget()} B ({self.carveout}% of {SM90_SMEM_PER_SM} B)"
                )
        return out

    def is_legal(self, head_dim: int, page_size: int | None = None, elem_bytes: int = 2) -> bool:
        return not self.problems(head_dim, page_size, elem_bytes)

    # ---- planning ------------------------------------------------------------------------
    def splits_for(self, batch: int, num_kv_heads: int, max_context: int, num_sms: int = SM90_NUM_SMS) -> int:
        """Split count for a launch: fixed, or enough CTAs to fill every SM ctas_per_sm times."""
        n_tiles = max(1, math.ceil(max_context / self.tile_n))
        if self.num_splits:
            return max(1, min(self.num_splits, n_tiles))
        want = math.ceil(self.ctas_per_sm * num_sms / max(1, batch * num_kv_heads))
        return max(1, min(want, n_tiles))

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown DecodeConfig fields: {sorted(unknown)}")
        try:
            return cls(**{k: int(v) for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad DecodeConfig values {d}: {e}") from e


def default_decode_config(head_dim: int, rows: int = 8, page_size: int | None = None) -> DecodeConfig:
    """The untuned heuristic default: 64-token tiles, as many stages as the carveout allows (<= 6)."""
    wgs = 1 if rows <= 64 else 2
    tile_n = 64  # divides, or is divided by, every supported page size
    for stages in (6, 5, 4, 3, 2):
        cfg = DecodeConfig(tile_n=tile_n, stages=stages, consumer_wgs=wgs)
        if cfg.is_legal(head_dim, page_size) and cfg.resident_ctas(head_dim) >= 1:
            return cfg
    raise ConfigError(f"no legal default decode config for head_dim={head_dim} rows={rows}")


# Device-wide host tiles in flight of the multi-token default: 16 x 32 KB is several times the
# link's bandwidth x round trip, yet keeps host requests from queueing in front of the consumers'
# HBM traffic (an H200 A/B of ``python -m bench prefill --compare-configs ...``:
# ``git show 7747519:bench/results/NVIDIA_H200-2026-11-29-s4-ab1.json``, ``...-s4-ab2.json``,
# ``...-s4-ab3.json``).
MULTI_TOKEN_LINK_CREDITS = 16
# Query rows per KV head (q_len x group) up to which the multi-token default walks chunks of four
# tiles: an H200 A/B of ``python -m bench prefill`` (``git show
# 7747519:bench/results/NVIDIA_H200-2026-11-29-prefill-sweep.txt``, run K):
# chunks of 4 won at 2048 query tokens x group 4 (8k: 1.30 vs 1.39 ms at 5, 32k: 4.29 vs 4.38),
# chunks of 6 at 8192 tokens (32k: 13.64 vs 14.32 ms at 5, 15.39 at 4); 512 tokens and below tie.
MULTI_TOKEN_CHUNK4_ROWS = 8192
# Query rows per KV head from which the multi-token default runs clusters of two CTAs (up to
# MULTI_TOKEN_CHUNK4_ROWS): an H200 A/B of ``python -m bench prefill --compare-configs ...``
# (``git show 7747519:bench/results/NVIDIA_H200-2026-11-30-s6-ab1.txt`` to ``...-s6-ab4.txt``),
# seven stages in chunks of 4 in clusters of two against the unclustered default, ms: 8k q512
# 0.783 vs 0.858, 32k q512
# 2.928 vs 3.002, 128k q512 11.07 vs 11.17, 8k q2048 1.232 vs 1.309, 32k q2048 4.180 vs 4.341;
# but 32k q64 (256 rows) 2.776 vs 2.721 and 32k q8192 15.39 vs 13.91. Clusters of four lost
# everywhere (fewer 4-CTA clusters fit the GPCs at one CTA per SM: 128k q512 14.5 ms).
MULTI_TOKEN_CLUSTER_ROWS = 2048
# Query rows per KV head from which the clusters (up to MULTI_TOKEN_CHUNK4_ROWS) stagger their blocks'
# chunk boundaries in four groups under 8 link credits (rank 0 admits for the cluster): an H200 A/B
# of ``python -m bench prefill --compare-configs ...`` (``git show
# 7747519:bench/results/NVIDIA_H200-2026-11-30-s9-ab-stagger-credits.txt`` and
# ``...-s9-ab-stagger.txt``), ms, against the cluster default:
# 8k q2048 1.082 vs 1.217, 16k q2048 2.048 vs 2.161. Without credits the link served some clusters
# late (round 0 done at max 380 vs med 228 us: 1.242 ms). At 8k q512 (2048 rows) four groups
# without credits were 0.747 vs 0.740 ms, so the smaller shapes keep the plain walk.
MULTI_TOKEN_STAGGER_ROWS = 4096
MULTI_TOKEN_STAGGER = 4
MULTI_TOKEN_STAGGER_CREDITS = 8


def default_multi_token_config(head_dim: int, rows: int | None = None) -> DecodeConfig:
    """Untuned default of the multi-token (KV-outer chunk) kernel: two consumer warpgroups (128
    query rows per pass) that keep each pass's Q rows in registers, all of L1 as SMEM, a ring of
    seven 64-token tiles (the Q tile's SMEM buys the seventh) walked in chunks of four (three
    tiles of prefetch per chunk) up to ``MULTI_TOKEN_CHUNK4_ROWS`` query rows per KV head and of six
    above (a third fewer passes of each query block over the split), and the producer admitted
    to the link one tile at a time under ``MULTI_TOKEN_LINK_CREDITS``. Falls back to Q in SMEM where
    registers cannot hold it. From ``MULTI_TOKEN_CLUSTER_ROWS`` up to ``MULTI_TOKEN_CHUNK4_ROWS`` rows
    the seven-stage config runs in clusters of two CTAs sharing each tile (``q_cluster``, which
    goes without link credits): half the passes per chunk and half the splits. From
    ``MULTI_TOKEN_STAGGER_ROWS`` those clusters stagger their blocks' chunk boundaries
    (``MULTI_TOKEN_STAGGER`` groups) under ``MULTI_TOKEN_STAGGER_CREDITS`` link credits, so compute starts
    after one tile and the link serves the clusters in turn."""
    chunk = 4 if rows is None or rows <= MULTI_TOKEN_CHUNK4_ROWS else 6
    cluster = 2 if rows is not None and MULTI_TOKEN_CLUSTER_ROWS <= rows <= MULTI_TOKEN_CHUNK4_ROWS else 0
    stagger = MULTI_TOKEN_STAGGER if cluster and rows >= MULTI_TOKEN_STAGGER_ROWS else 0
    for tile_n, stages, chunk_tiles, q_regs, q_cluster in ((64, 7, chunk, 1, cluster), (64, 6, 5, 0, 0),
                                                           (128, 3, 2, 0, 0), (64, 4, 3, 0, 0), (64, 2, 1, 0, 0)):
        credits = MULTI_TOKEN_LINK_CREDITS
        if q_cluster:
            credits = MULTI_TOKEN_STAGGER_CREDITS if stagger else 0
        cfg = DecodeConfig(tile_n=tile_n, stages=stages, ctas_per_sm=1, consumer_wgs=2, carveout=100,
                           chunk_tiles=chunk_tiles, max_inflight=1, q_regs=q_regs, q_cluster=q_cluster,
                           link_credits=credits, stagger=stagger if q_cluster else 0)
        if cfg.is_legal(head_dim):
            return cfg
    raise ConfigError(f"no legal default multi-token config for head_dim={head_dim}")


def chunk_bounds(n_tiles: int, chunk: int, edge: int = 0) -> list[tuple[int, int]]:
    """The chunks [begin, end) (tile offsets from the split's first tile) the multi-token kernel
    walks over a split of ``n_tiles`` tiles: ``chunk`` tiles each, or with ``edge`` > 0 a first and
    a last chunk of ``edge`` tiles around middle chunks of up to ``chunk``. A split with no tiles
    still makes one (empty) pass. The kernel computes the same bounds (``chunk_start``)."""
    if edge <= 0:
        n_chunks = max(1, math.ceil(n_tiles / chunk))
        return [(j * chunk, min(n_tiles, (j + 1) * chunk)) for j in range(n_chunks)]
    if n_tiles <= edge:
        return [(0, n_tiles)]
    n_chunks = 2 + math.ceil(max(0, n_tiles - 2 * edge) / chunk)
    starts = [0] + [max(edge, min(edge + (j - 1) * chunk, n_tiles - edge)) for j in range(1, n_chunks)]
    return [(b, e) for b, e in zip(starts, starts[1:] + [n_tiles])]


def stagger_first(chunk: int, stagger: int, m: int, n_mine: int) -> int:
    """Tiles in the first pass of a warpgroup's m-th block (of ``n_mine``) under ``stagger``:
    ceil(chunk * (g + 1) / stagger) for its group g = m * stagger // n_mine (``chunk`` when off)."""
    if not stagger:
        return chunk
    g = m * stagger // max(1, n_mine)
    return (chunk * (g + 1) + stagger - 1) // stagger


def pass_bounds(j: int, n_tiles: int, chunk: int, stages: int, first: int) -> tuple[int, int]:
    """[begin, end) (tiles from the split's first) of round j's pass of a staggered block whose
    first pass holds ``first`` tiles: [0, first), then ``chunk`` tiles a pass; a remainder of at
    most min(first, stages - chunk) tiles joins the pass before it (that round's pass is then
    empty, as are those past the split). The kernel computes the same (``pass_bounds``)."""
    take = min(first, stages - chunk)  # the longest remainder a pass absorbs
    if j == 0:
        return 0, min(first, n_tiles)
    begin = first + chunk * (j - 1)
    if j >= 2 and 0 < n_tiles - begin <= take:
        return n_tiles, n_tiles  # absorbed by round j - 1
    end = begin + chunk
    if 0 < n_tiles - end <= take:
        end = n_tiles
    return min(begin, n_tiles), min(end, n_tiles)


def stagger_rounds(n_tiles: int, chunk: int, stagger: int) -> int:
    """Rounds (passes of each block, some empty) of a staggered walk over ``n_tiles``: those of
    the blocks with the shortest first pass."""
    first = stagger_first(chunk, stagger, 0, 1)
    return 1 + (max(0, n_tiles - first) + chunk - 1) // chunk


def block_passes(cfg: DecodeConfig, n_tiles: int, m: int, n_mine: int) -> list[tuple[int, int]]:
    """The non-empty passes [begin, end) of a warpgroup's m-th block (of ``n_mine``), in order:
    the chunks of ``chunk_bounds``, or with ``stagger`` the block's own bounds; round 0 always
    makes one (it writes the block's partial)."""
    if not cfg.stagger:
        return chunk_bounds(n_tiles, cfg.chunk, cfg.edge_tiles)
    first = stagger_first(cfg.chunk, cfg.stagger, m, n_mine)
    out = []
    for j in range(stagger_rounds(n_tiles, cfg.chunk, cfg.stagger)):
        b, e = pass_bounds(j, n_tiles, cfg.chunk, cfg.stages, first)
        if j == 0 or e > b:
            out.append((b, e))
    return out


def multi_token_splits(cfg: DecodeConfig, max_context: int, batch: int = 1, num_kv_heads: int = 1,
                       num_sms: int = SM90_NUM_SMS, head_dim: int = 128, elem_bytes: int = 2) -> int:
    """Splits (CTAs per sequence and KV head) of the multi-token kernel.

    A fixed ``num_splits`` is honoured (up to one per tile). With ``chunk_tiles == 0`` every CTA
    holds one chunk of ``stages`` tiles (splits = chunks). Otherwise CTAs walk several chunks
    each, so one wave of CTAs (as many as fit the SMs) covers the context and the fp32 partial
    workspace scales with the SM count, not with the context. With ``q_cluster`` each split is a
    cluster of that many CTAs."""
    n_tiles = max(1, math.ceil(max_context / cfg.tile_n))
    if cfg.num_splits:
        return max(1, min(cfg.num_splits, n_tiles))
    n_chunks = math.ceil(n_tiles / cfg.chunk)
    if cfg.chunk_tiles == 0:
        return n_chunks
    wave = cfg.multi_token_occupancy(head_dim, elem_bytes) * num_sms
    return max(1, min(n_chunks, wave // max(1, batch * num_kv_heads * cfg.cluster)))


# A staging request's keys (``planner.StagingRequest``), which tuned profiles record in their
# q_tiled configs at 0 (the planner's choice): ``QTiledConfig.from_dict`` drops them there.
STAGING_KEYS = ("piece_pages", "splits", "order", "copy_order")


@dataclass(frozen=True)
class QTiledConfig:
    """Static configuration of the Q-tiled kernel (``kernels/q_tiled.py``): one CTA per
    (128 query rows, KV head, sequence) walks every KV tile its rows see, O held in registers,
    the KV read from HBM (the HBM tier, or host pages the op staged into HBM).

    tile_n:      KV tokens per ring stage.
    stages:      depth of the SMEM ring.
    carveout:    percent of the unified L1/SMEM reserved as SMEM.
    pingpong:    1 = the two consumer warpgroups take turns issuing their WGMMAs (a named-barrier
                 handshake), so one's softmax runs while the other's GEMMs keep the tensor cores
                 busy; 0 = each issues as soon as it is ready.
    cluster:     CTAs of a thread-block cluster (1 = none, or 2) that share each KV tile: adjacent
                 query tiles of one KV head walk the same KV tiles (the cluster's longest causal
                 range), each CTA issues half of a tile's TMA boxes multicast to both, halving
                 the KV bytes the SMs pull from L2/HBM (measured 1.06-1.10x faster than 1 on
                 8k/32k x q512-8192).

    Every field generates code. How a call's host pages are staged and its splits launched
    (pieces, KV splits, query-tile order, copy order) is the plan's: the planner chooses it per
    call, or follows an explicit ``planner.StagingRequest``.
    """

    tile_n: int = 128
    stages: int = 3
    carveout: int = 100
    pingpong: int = 1
    cluster: int = 2

    CONSUMER_WGS = 2

    @property
    def rows(self) -> int:
        return 64 * self.CONSUMER_WGS

    def for_query_tiles(self, n_tiles: int) -> "QTiledConfig":
        """The config a launch of ``n_tiles`` query tiles per sequence and KV head runs: with one
        (decode, short windows) no cluster, whose other CTA would hold no rows and only double
        the CTAs that walk the KV."""
        return dataclasses.replace(self, cluster=1) if n_tiles == 1 and self.cluster > 1 else self

    def ring_config(self) -> DecodeConfig:
        """The fields the shared ring, producer and consumers read, as a DecodeConfig."""
        return DecodeConfig(tile_n=self.tile_n, stages=self.stages, num_splits=1, ctas_per_sm=1,
                            carveout=self.carveout, consumer_wgs=self.CONSUMER_WGS,
                            q_cluster=self.cluster if self.cluster > 1 else 0)

    def problems(self, head_dim: int, page_size: int | None = None, elem_bytes: int = 2) -> list[str]:
        out = []
        if self.tile_n not in (64, 128):
            out.append(f"tile_n {self.tile_n} must be 64 or 128")
        if self.pingpong not in (0, 1):
            out.append(f"pingpong {self.pingpong} must be 0 or 1")
        if self.cluster not in (1, 2):
            out.append(f"cluster {self.cluster} must be 1 (none) or 2")
        return out or self.ring_config().problems(head_dim, page_size, elem_bytes)

    def check(self, head_dim: int, page_size: int | None = None, elem_bytes: int = 2) -> None:
        problems = self.problems(head_dim, page_size, elem_bytes)
        if problems:
            raise ConfigError(f"{self}: " + "; ".join(problems))

    def is_legal(self, head_dim: int, page_size: int | None = None, elem_bytes: int = 2) -> bool:
        return not self.problems(head_dim, page_size, elem_bytes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QTiledConfig":
        """The config of a dict (a profile record's, a command line's). Staging keys
        (``STAGING_KEYS``) are dropped where 0, the planner's choice; any other value is refused:
        staging is asked of the planner (``planner.StagingRequest``), not of the kernel."""
        names = {f.name for f in dataclasses.fields(cls)}
        staged = {k: d[k] for k in STAGING_KEYS if k in d}
        asked = {k: v for k, v in staged.items() if isinstance(v, bool) or v not in (0, "0")}
        if asked:
            raise ConfigError(f"QTiledConfig has no staging fields, got {asked}: pass them to the planner as a "
                              "StagingRequest (directkv_cute.planner) instead")
        d = {k: v for k, v in d.items() if k not in staged}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown QTiledConfig fields: {sorted(unknown)}")
        try:
            return cls(**{k: int(v) for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad QTiledConfig values {d}: {e}") from e


def q_tiles(max_q_len: int, group: int, rows: int = 128) -> int:
    """Q tiles (CTAs along x) of the Q-tiled kernel: ``rows // group`` tokens each."""
    return math.ceil(max_q_len / (rows // group))
