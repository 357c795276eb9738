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
_BARRIER_AND_ALIGN_BYTES = 2048  # mbarriers plus 1 KB alignment padding of the tiles

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)


class ConfigError(ValueError):
    """A config that cannot run for the given problem (raised before compiling)."""


@dataclass(frozen=True)
class DecodeConfig:
    """Static configuration of the split-KV decode kernel.

    tile_n:        KV tokens per pipeline stage (one K tile and one V tile of tile_n x head_dim).
    stages:        depth of the SMEM ring the TMA producer warp keeps in flight.
    num_splits:    CTAs per (sequence, KV head) along the context; 0 lets the op pick
                   (enough CTAs to fill the GPU ``ctas_per_sm`` times over).
    ctas_per_sm:   target resident CTAs per SM for the automatic split count.
    carveout:      percent of the unified L1/SMEM reserved as SMEM
                   (cudaFuncAttributePreferredSharedMemoryCarveout); the paper's default is 80.
    consumer_wgs:  consumer warpgroups (1-3); each holds 64 query rows (GQA group x q_len).
    """

    tile_n: int = 64
    stages: int = 4
    num_splits: int = 0
    ctas_per_sm: int = 2
    carveout: int = 80
    consumer_wgs: int = 1

    # ---- derived -------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Query rows (GQA group x q_len) one CTA holds."""
        return 64 * self.consumer_wgs

    @property
    def num_threads(self) -> int:
        return 128 * (self.consumer_wgs + 1)

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Dynamic SMEM one CTA needs: the K/V ring, the Q tile, barriers and padding."""
        kv_ring = self.stages * 2 * self.tile_n * head_dim * elem_bytes
        q_tile = self.rows * head_dim * elem_bytes
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


def default_prefill_config(head_dim: int) -> DecodeConfig:
    """Untuned default of the multi-token (KV-chunk resident) kernel: two consumer warpgroups
    (128 query rows per block) and the largest KV chunk (up to 6 tiles of 64) that fits SMEM with
    all of L1 given to it (measured on the H200: 6 tiles beat 4 by 1.2-1.6x at q_len 512-2048)."""
    for stages in (6, 5, 4, 3, 2):
        cfg = DecodeConfig(tile_n=64, stages=stages, consumer_wgs=2, carveout=100)
        if cfg.is_legal(head_dim):
            return cfg
    raise ConfigError(f"no legal default prefill config for head_dim={head_dim}")


def resident_splits(cfg: DecodeConfig, max_context: int) -> int:
    """Chunks per sequence for the resident kernel: each CTA's chunk must fit its SMEM ring."""
    n_tiles = max(1, math.ceil(max_context / cfg.tile_n))
    return math.ceil(n_tiles / cfg.stages)
