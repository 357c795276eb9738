"""Search spaces of the tunable kernels, with a static legality filter.

A :class:`KernelSpace` declares, for one kernel, the tunable parameters (each a small ordered
tuple of integer choices), the parameters fixed by the problem (``consumer_wgs`` follows the
query rows), how a point becomes a config object, and which points are illegal for a problem
shape *before* anything is sampled, compiled or launched (SMEM under the carveout alpha, the
per-block opt-in limit, tile / page divisibility: ``DecodeConfig.problems()``).

Spaces live in a registry (:func:`register_space`, :func:`get_space`), so a second kernel
("multi_token") only needs a new subclass; the tuner, the profile code and the lookup work on any
registered space. Each space is of a compiled kernel whose spec (``directkv_cute.kernels.specs``)
states its name, config class and legality; a space adds only the tuner's own restrictions (the
fields the problem fixes).

Plain Python: importable without CUDA, cutlass or optuna.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass, field

from directkv_cute.config import SM90_NUM_SMS, ConfigError, DecodeConfig, default_decode_config, default_multi_token_config
from directkv_cute.kernels import specs
from directkv_cute.kernels.specs import STREAM_MAX_ROWS, op_kernel

# Bump when the meaning of a space changes in a way its parameter lists do not show
# (e.g. a new legality rule); it is part of the space hash.
SPACE_RULES_VERSION = 9  # 2: exact SMEM estimate (1 KB barrier padding), prefill chunk_tiles/ctas_per_sm; 3: prefill max_inflight; 4: link_credits, edge_tiles; 5: q_regs; 6: q_cluster; 7: q_cluster 4; 8: q_cluster with link_credits; 9: stagger

DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
}
ELEM_BYTES = {"bf16": 2, "fp16": 2}


def normalize_dtype(dtype) -> str:
    """'bf16' or 'fp16' from a torch dtype or one of its usual spellings."""
    name = DTYPE_ALIASES.get(str(dtype).lower())
    if name is None:
        raise ValueError(f"unsupported dtype {dtype!r} (expected one of bf16, fp16)")
    return name


def torch_dtype(dtype):
    """The torch dtype for 'bf16' / 'fp16' (imports torch lazily)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[normalize_dtype(dtype)]


# STREAM_MAX_ROWS and op_kernel (the kernel the op runs for a launch without an explicit config)
# are the kernel specs' (directkv_cute.kernels.specs): the tuner's CLI asks them, never its own
# copy of the rule (tests/test_tuning_hardening.py checks it against the op).


def consumer_wgs_for(rows: int) -> int:
    """Consumer warpgroups a decode CTA needs for ``rows`` query rows (64 rows each)."""
    return 1 if rows <= 64 else 2


@dataclass(frozen=True)
class TuneShape:
    """One problem the tuner measures: a model's attention geometry at one shape bucket."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    context: int
    q_len: int = 1
    page_size: int = 64
    dtype: str = "bf16"

    def __post_init__(self):
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "batch", "context", "q_len", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TuneShape.{name} must be a positive int, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows(self) -> int:
        """Query rows one CTA serves: GQA group x q_len."""
        return self.group * self.q_len

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def bucket(self) -> tuple[int, int, int]:
        return (self.batch, self.context, self.q_len)

    @property
    def class_key(self) -> tuple[str, int, int, int]:
        """(dtype, head_dim, group, page_size): fields a profile never borrows across."""
        return (self.dtype, self.head_dim, self.group, self.page_size)

    def kv_bytes(self) -> int:
        """Bytes of K and V one layer of this shape holds (= host bytes one decode step reads)."""
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * self.elem_bytes

    def describe(self) -> str:
        return (
            f"hq={self.num_q_heads} hkv={self.num_kv_heads} d={self.head_dim} {self.dtype} page={self.page_size} "
            f"batch={self.batch} context={self.context} q_len={self.q_len}"
        )

    def to_dict(self) -> dict:
        return {
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "batch": self.batch,
            "context": self.context,
            "q_len": self.q_len,
            "page_size": self.page_size,
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class Param:
    """One tunable parameter: an ordered tuple of integer choices."""

    name: str
    choices: tuple[int, ...]
    doc: str = ""

    def index(self, value: int) -> int:
        return self.choices.index(value)


@dataclass
class LegalityReport:
    """Outcome of the static filter over the whole Cartesian space for one shape."""

    total: int
    legal: list = field(default_factory=list)
    illegal: list = field(default_factory=list)  # (config, [reasons])

    @property
    def legal_count(self) -> int:
        return len(self.legal)

    def reason_counts(self) -> Counter:
        """How many points each reason excludes (SMEM budget, opt-in limit, divisibility...)."""
        c = Counter()
        for _cfg, reasons in self.illegal:
            for r in reasons:
                c[_reason_class(r)] += 1
        return c


def _reason_class(reason: str) -> str:
    if "carveout budget" in reason:
        return "SMEM over the carveout budget"
    if "per-block limit" in reason:
        return "SMEM over the per-block opt-in limit"
    if "divide one another" in reason:
        return "tile_n / page_size divisibility"
    return reason


class KernelSpace:
    """Base class of a kernel's search space; subclasses fill in the kernel specifics."""

    kernel: str = ""
    source_kernel: str = ""  # the kernel of directkv_cute.kernels.sources whose hash keys the entries
    config_cls: type = object
    params: tuple[Param, ...] = ()
    fixed_doc: str = ""

    # ---- points <-> configs -----------------------------------------------------------------
    def fixed(self, shape: TuneShape) -> dict:
        """Config fields fixed by the problem rather than tuned."""
        return {}

    def make_config(self, values: dict, shape: TuneShape):
        return self.config_cls(**values, **self.fixed(shape))

    def config_from_dict(self, d: dict):
        return self.config_cls.from_dict(d)

    def point(self, cfg) -> dict:
        """The tunable values of a config (the fixed fields left out)."""
        d = cfg.to_dict()
        return {p.name: d[p.name] for p in self.params}

    def in_space(self, cfg) -> bool:
        pt = self.point(cfg)
        return all(pt[p.name] in p.choices for p in self.params)

    def config_key(self, cfg) -> str:
        """A stable, readable key of a whole config (used to deduplicate trials)."""
        d = cfg.to_dict()
        return ",".join(f"{k}={d[k]}" for k in sorted(d))

    def launch_key(self, cfg, shape: TuneShape, num_sms: int = SM90_NUM_SMS):
        """Key under which two configs run the very same kernel launch for ``shape``."""
        return self.config_key(cfg)

    # ---- legality -------------------------------------------------------------------------
    def problems(self, cfg, shape: TuneShape) -> list[str]:
        """Why ``cfg`` cannot run ``shape`` (empty: it is legal). Checked before any launch."""
        raise NotImplementedError

    def static_problems(self, cfg, *, head_dim: int, page_size: int, rows: int, dtype="bf16") -> list[str]:
        """The same check from the fields a profile lookup knows (no full shape)."""
        raise NotImplementedError

    def is_legal(self, cfg, shape: TuneShape) -> bool:
        return not self.problems(cfg, shape)

    def default_config(self, head_dim: int, rows: int, page_size: int):
        raise NotImplementedError

    def default_for(self, shape: TuneShape):
        return self.default_config(shape.head_dim, shape.rows, shape.page_size)

    def portfolio(self, shape: TuneShape) -> list:
        """Configs that measured well on some GPU (next to the default), which the tuner tries
        right after the default and the profile's previous entry: with a trial budget of a few
        per bucket in a space of 10^5 points, known-good starting points are worth more than
        random TPE start-up trials. The tuner skips the ones illegal for ``shape``."""
        return []

    def compile_for(self, cfg, shape: TuneShape) -> None:
        """Compile the kernel the GPU objective launches for ``cfg`` on ``shape`` (the op's compile,
        so its memory and disk caches serve the measurement; ``Tuner.precompile`` runs this in
        worker processes to fill the disk cache before measuring)."""
        raise NotImplementedError(f"no compile hook for kernel {self.kernel!r}")

    # ---- enumeration ----------------------------------------------------------------------
    def cardinality(self) -> int:
        return math.prod(len(p.choices) for p in self.params)

    def iter_points(self):
        names = [p.name for p in self.params]
        for values in itertools.product(*(p.choices for p in self.params)):
            yield dict(zip(names, values))

    def legality(self, shape: TuneShape) -> LegalityReport:
        """Run the static filter over every point of the Cartesian space."""
        return self._filter(self.iter_points(), shape)

    def sample_legality(self, shape: TuneShape, n: int, seed: int = 0) -> LegalityReport:
        """The static filter over ``n`` points drawn uniformly (seeded) from the space: a quick
        estimate of the legal share of a space too large to enumerate (``total`` is ``n``)."""
        import random

        rng = random.Random(seed)
        return self._filter(({p.name: rng.choice(p.choices) for p in self.params} for _ in range(n)), shape)

    def _filter(self, points, shape: TuneShape) -> LegalityReport:
        rep = LegalityReport(total=0)
        for values in points:
            rep.total += 1
            cfg = self.make_config(values, shape)
            reasons = self.problems(cfg, shape)
            if reasons:
                rep.illegal.append((cfg, reasons))
            else:
                rep.legal.append(cfg)
        return rep

    def legal_configs(self, shape: TuneShape) -> list:
        return self.legality(shape).legal

    def launch_classes(self, shape: TuneShape, num_sms: int = SM90_NUM_SMS) -> int:
        """Number of distinct launches among the legal configs (what exhaustive search must run)."""
        return len({self.launch_key(c, shape, num_sms) for c in self.legal_configs(shape)})

    # ---- identity -------------------------------------------------------------------------
    def describe(self) -> dict:
        return {
            "kernel": self.kernel,
            "rules_version": SPACE_RULES_VERSION,
            "params": {p.name: list(p.choices) for p in self.params},
            "fixed": self.fixed_doc,
        }

    def space_hash(self) -> str:
        """sha256 of the canonical JSON description of the space (stable across runs and hosts)."""
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


class DecodeSpace(KernelSpace):
    """The split-KV decode kernel (``DecodeConfig``)."""

    kernel = "decode"
    source_kernel = "decode"
    config_cls = specs.get("decode").config_class
    params = (
        Param("tile_n", (32, 64, 128), "KV tokens per pipeline stage"),
        Param("stages", (2, 3, 4, 5, 6, 7, 8), "depth of the SMEM ring"),
        Param("num_splits", (0, 1, 2, 4, 8, 16, 32, 64), "CTAs along the context (0 = automatic)"),
        Param("ctas_per_sm", (1, 2, 3, 4), "target CTAs per SM of the automatic split count"),
        Param("carveout", (50, 60, 70, 80, 90, 100), "percent of L1/SMEM reserved as SMEM (alpha)"),
    )
    fixed_doc = "consumer_wgs = 1 if group*q_len <= 64 else 2"

    def fixed(self, shape: TuneShape) -> dict:
        return {"consumer_wgs": consumer_wgs_for(shape.rows)}

    def problems(self, cfg: DecodeConfig, shape: TuneShape) -> list[str]:
        return self.static_problems(
            cfg, head_dim=shape.head_dim, page_size=shape.page_size, rows=shape.rows, dtype=shape.dtype
        )

    def config_problems(self, cfg: DecodeConfig, head_dim: int, page_size: int, dtype="bf16") -> list[str]:
        """The config's own rules for the kernel (its SMEM at the page dtype among them)."""
        return specs.get(self.source_kernel).problems(cfg, head_dim, page_size, ELEM_BYTES[normalize_dtype(dtype)])

    def static_problems(self, cfg: DecodeConfig, *, head_dim: int, page_size: int, rows: int, dtype="bf16") -> list[str]:
        out = self.config_problems(cfg, head_dim, page_size, dtype)
        want = consumer_wgs_for(rows)
        if cfg.consumer_wgs != want:
            out.append(f"consumer_wgs {cfg.consumer_wgs} does not fit {rows} query rows (needs {want})")
        if rows > STREAM_MAX_ROWS:
            out.append(f"{rows} query rows (group x q_len) exceed the {STREAM_MAX_ROWS} rows of one CTA")
        return out

    def launch_key(self, cfg: DecodeConfig, shape: TuneShape, num_sms: int = SM90_NUM_SMS):
        # num_splits and ctas_per_sm only choose the split count of the launch (the compiled
        # code does not depend on them), so configs with the same resolved split count run the
        # same launch for this shape.
        splits = cfg.splits_for(shape.batch, shape.num_kv_heads, shape.context, num_sms)
        return (cfg.tile_n, cfg.stages, splits, cfg.carveout, cfg.consumer_wgs)

    def default_config(self, head_dim: int, rows: int, page_size: int) -> DecodeConfig:
        return default_decode_config(head_dim, rows, page_size)

    def compile_for(self, cfg: DecodeConfig, shape: TuneShape, num_sms: int = SM90_NUM_SMS) -> None:
        # split partials when the launch splits the context (the split count of an H200's SMs)
        split = cfg.splits_for(shape.batch, shape.num_kv_heads, shape.context, num_sms) > 1
        specs.get("decode").compile_fn(cfg, torch_dtype(shape.dtype), shape.head_dim, shape.page_size, shape.group,
                                       shape.q_len, split_out=split)


class MultiTokenSpace(KernelSpace):
    """The multi-token KV-outer chunk kernel (the op's path over host pages for rows > 128).

    Same ``DecodeConfig`` type. Each CTA applies every query block to a chunk of ``chunk_tiles``
    tiles (0 = the whole ``stages`` ring) while the rest of the ring loads the next chunk; the
    split count follows from the config (``multi_token_splits``), so num_splits and ctas_per_sm are
    fixed.
    """

    kernel = "multi_token"
    source_kernel = "multi_token"
    config_cls = specs.get("multi_token").config_class
    params = (
        Param("tile_n", (32, 64, 128), "KV tokens per tile"),
        Param("stages", (2, 3, 4, 5, 6, 7, 8), "depth of the SMEM ring of KV tiles"),
        Param("chunk_tiles", (0, 1, 2, 3, 4, 5, 6), "tiles per chunk (0 = the whole ring, one chunk per CTA)"),
        Param("carveout", (50, 60, 70, 80, 90, 100), "percent of L1/SMEM reserved as SMEM (alpha)"),
        Param("consumer_wgs", (1, 2, 3), "consumer warpgroups: 64 query rows each per pass over the chunk"),
        Param("ctas_per_sm", (1, 2), "CTAs per SM (2 needs one consumer warpgroup and SMEM for two)"),
        Param("max_inflight", (0, 1, 2), "tiles the producer keeps in flight (0 = the whole free ring)"),
        Param("link_credits", (0, 8, 16), "host tiles in flight on the whole GPU (0 = no admission control; needs max_inflight 1)"),
        Param("edge_tiles", (0, 1, 2), "tiles in each CTA's first and last chunk (0 = chunk_tiles)"),
        Param("q_regs", (0, 1), "Q rows of a pass in registers, not SMEM (frees the Q tile for the ring)"),
        Param("q_cluster", (0, 2, 4), "CTAs of a cluster sharing each KV tile by TMA multicast, splitting the query rows"),
        Param("stagger", (0, 2, 4), "groups of query blocks with staggered chunk boundaries (0 = off; needs edge_tiles 0)"),
    )
    fixed_doc = "num_splits = 0 (splits follow from the chunk and occupancy, multi_token_splits)"

    def fixed(self, shape: TuneShape) -> dict:
        return {"num_splits": 0}

    def problems(self, cfg: DecodeConfig, shape: TuneShape) -> list[str]:
        return self.static_problems(
            cfg, head_dim=shape.head_dim, page_size=shape.page_size, rows=shape.rows, dtype=shape.dtype
        )

    def static_problems(self, cfg: DecodeConfig, *, head_dim: int, page_size: int, rows: int, dtype="bf16") -> list[str]:
        eb = ELEM_BYTES[normalize_dtype(dtype)]
        out = specs.get(self.source_kernel).problems(cfg, head_dim, page_size, eb)
        if not out and cfg.ctas_per_sm >= 2 and cfg.multi_token_occupancy(head_dim, eb) < 2:
            out.append(f"ctas_per_sm {cfg.ctas_per_sm} needs one consumer warpgroup and SMEM for two CTAs")
        return out

    def launch_key(self, cfg: DecodeConfig, shape: TuneShape, num_sms: int = SM90_NUM_SMS):
        # ctas_per_sm only matters through the occupancy it resolves to (num_splits is fixed);
        # every other field is part of the launch.
        occupancy = cfg.multi_token_occupancy(shape.head_dim, ELEM_BYTES[normalize_dtype(shape.dtype)])
        return self.config_key(dataclasses.replace(cfg, ctas_per_sm=occupancy))

    def default_config(self, head_dim: int, rows: int, page_size: int) -> DecodeConfig:
        return default_multi_token_config(head_dim, rows)

    def compile_for(self, cfg: DecodeConfig, shape: TuneShape) -> None:
        specs.get("multi_token").compile_fn(cfg, torch_dtype(shape.dtype), shape.head_dim, shape.page_size,
                                            shape.group)

    def portfolio(self, shape: TuneShape) -> list:
        # The runners-up and the tuner's winners of the H200 prefill config sweeps and tunes
        # (``python -m bench prefill --compare-configs``, ``directkv-tune run``; their logs:
        # ``git show 7747519:bench/results/NVIDIA_H200-2026-11-29-prefill-sweep.txt`` and the
        # ``*-tune-prefill*.log`` files of bench/results at that commit), the strongest families first: seeds
        # count against --trials, so a short tune (6 trials: the default, the profile's entry and
        # four of these) measures the strongest four.
        base = dict(num_splits=0, ctas_per_sm=1, carveout=100, consumer_wgs=2, max_inflight=1, link_credits=8)
        picks = (
            # clusters of two with staggered chunk boundaries under link admission (the default
            # from 4096 to 8192 rows): compute starts after one tile, tiles are freed one at
            # a time, and the link serves the clusters in turn
            dict(tile_n=64, stages=7, chunk_tiles=4, link_credits=8, q_regs=1, q_cluster=2, stagger=4),
            dict(tile_n=64, stages=7, chunk_tiles=4, link_credits=16, q_regs=1, q_cluster=2, stagger=2),
            # clusters of two sharing each tile (chunks of 4: the default from 2048 to 8192 query rows
            # per KV head; won 8k q8192): half the passes per chunk and half the splits
            dict(tile_n=64, stages=7, chunk_tiles=4, link_credits=0, q_regs=1, q_cluster=2),
            # ... under link admission (rank 0 of each cluster admits its tiles)
            dict(tile_n=64, stages=7, chunk_tiles=4, link_credits=16, q_regs=1, q_cluster=2),
            # Q in registers, seven stages: chunks of 6 (the default above 8192 rows; fewest passes,
            # won all-HBM at 32k q2048), 4 (the default below 2048 rows) and 5
            dict(tile_n=64, stages=7, chunk_tiles=6, link_credits=16, q_regs=1),
            dict(tile_n=64, stages=7, chunk_tiles=4, link_credits=16, q_regs=1),
            dict(tile_n=64, stages=7, chunk_tiles=6, link_credits=0, q_regs=1, q_cluster=2),
            dict(tile_n=64, stages=7, chunk_tiles=5, link_credits=16, q_regs=1),
            dict(tile_n=128, stages=3, chunk_tiles=2, link_credits=16),  # 128k q512, link-bound shapes
            dict(tile_n=64, stages=6, chunk_tiles=5, link_credits=16),  # Q in SMEM, six stages (128k q2048)
            dict(tile_n=64, stages=6, chunk_tiles=4),  # 32k q2048 tuned winner, Q in SMEM
            dict(tile_n=64, stages=5, chunk_tiles=3, carveout=90),  # 32k q512 tuned winner, Q in SMEM
            dict(tile_n=64, stages=5, chunk_tiles=4, consumer_wgs=3),  # 128k q512
        )
        return [DecodeConfig(**{**base, **p}) for p in picks]


class DecodeFP8Space(DecodeSpace):
    """The streaming kernel over FP8 pages (``kernels/decode_fp8.py``): the decode kernel's knobs,
    its ring of FP8 stages (half the bytes of a bf16 stage, so up to 12 deep) and its own SMEM rule
    (``fp8.decode_problems``: the FP8 ring, the q-dtype operand tiles and Q). Without a profile
    entry the op adapts the decode kernel's tuned config (``fp8.decode_config``)."""

    kernel = "decode_fp8"
    source_kernel = "decode_fp8"
    config_cls = specs.get("decode_fp8").config_class
    params = (
        Param("tile_n", (32, 64, 128), "KV tokens per pipeline stage"),
        Param("stages", (2, 3, 4, 5, 6, 7, 8, 9, 10, 12), "depth of the SMEM ring of FP8 stages"),
        Param("num_splits", (0, 1, 2, 4, 8, 16, 32, 64), "CTAs along the context (0 = automatic)"),
        Param("ctas_per_sm", (1, 2, 3, 4), "target CTAs per SM of the automatic split count"),
        Param("carveout", (50, 60, 70, 80, 90, 100), "percent of L1/SMEM reserved as SMEM (alpha)"),
    )

    def config_problems(self, cfg: DecodeConfig, head_dim: int, page_size: int, dtype="bf16") -> list[str]:
        # loads torch: the spaces import without it (directkv_cute.tuning, the CLI)
        from directkv_cute.fp8 import decode_problems

        return decode_problems(cfg, head_dim, page_size)

    def default_config(self, head_dim: int, rows: int, page_size: int) -> DecodeConfig:
        # loads torch: the spaces import without it (directkv_cute.tuning, the CLI)
        from directkv_cute.fp8 import decode_config

        return decode_config(default_decode_config(head_dim, rows, page_size), head_dim, page_size)

    def compile_for(self, cfg: DecodeConfig, shape: TuneShape, num_sms: int = SM90_NUM_SMS) -> None:
        import torch

        split = cfg.splits_for(shape.batch, shape.num_kv_heads, shape.context, num_sms) > 1
        specs.get("decode_fp8").compile_fn(cfg, torch_dtype(shape.dtype), torch.float8_e4m3fn, shape.head_dim,
                                           shape.page_size, shape.group, shape.q_len, split)

    def portfolio(self, shape: TuneShape) -> list:
        # A same-run A/B of FP8 decode configs on an H200 (``python -m bench decode --kv-dtype fp8
        # --compare-configs ...``; ``git show
        # 7747519:bench/results/NVIDIA_H200-2026-12-01-s14-fp8-ab.txt``): 6 stages at carveout 100
        # beat the adapted default (7 at 80) at B1 and B4 over 128k.
        wgs = consumer_wgs_for(shape.rows)
        picks = (dict(tile_n=64, stages=6, carveout=100), dict(tile_n=64, stages=9, carveout=100),
                 dict(tile_n=128, stages=4, carveout=100), dict(tile_n=32, stages=12, carveout=100))
        return [DecodeConfig(consumer_wgs=wgs, **p) for p in picks]


class QTiledSpace(KernelSpace):
    """The Q-tiled kernel (``QTiledConfig``, ``kernels/q_tiled.py``): the op's kernel for
    compute-bound multi-token calls, over HBM pages or host pages it staged into HBM.

    Every config field generates code (the spec's ``codegen_fields``) and is tuned: the KV tile,
    the ring depth, the carveout, the consumers' pingpong and the cluster. How a call is staged
    (pieces, KV splits, launch and copy order) is no config field: the planner picks it per call
    from the call's tiers and lengths (``directkv_cute.planner``), and the measured launch (all
    pages in HBM: no staging, one split) has none. Legality is the spec's: the config's rules
    (tile_n 64/128, the ring and the Q tile within SMEM under the carveout) and the GQA group.
    """

    kernel = "q_tiled"
    source_kernel = "q_tiled"
    config_cls = specs.get("q_tiled").config_class
    params = (
        Param("tile_n", (64, 128), "KV tokens per ring stage"),
        Param("stages", (2, 3, 4), "depth of the SMEM ring"),
        Param("carveout", (80, 90, 100), "percent of L1/SMEM reserved as SMEM (alpha)"),
        Param("pingpong", (0, 1), "the two consumer warpgroups take turns at the tensor cores (1) or not (0)"),
        Param("cluster", (1, 2), "CTAs per cluster sharing each KV tile by TMA multicast (2: adjacent query tiles)"),
    )
    fixed_doc = "no field (the planner picks the staging pieces, KV splits and launch order per call)"

    def problems(self, cfg, shape: TuneShape) -> list[str]:
        return specs.get(self.source_kernel).problems(cfg, shape.head_dim, shape.page_size, shape.elem_bytes,
                                                      group=shape.group, q_len=shape.q_len)

    def static_problems(self, cfg, *, head_dim: int, page_size: int, rows: int, dtype="bf16") -> list[str]:
        # The kernel tiles the query rows (any number of them); its GQA-group rule is checked by
        # the op (and a profile class never changes group), so the config's rules are all.
        return specs.get(self.source_kernel).problems(cfg, head_dim, page_size, ELEM_BYTES[normalize_dtype(dtype)])

    def default_config(self, head_dim: int, rows: int, page_size: int):
        """The op's untuned config (``QTiledConfig()``: 128-token tiles, 3 stages, pingpong, one
        K+V ring, clusters of two), whatever the rows."""
        return self.config_cls()

    def portfolio(self, shape: TuneShape) -> list:
        # The default (clusters of two sharing each tile), one CTA per query tile, and 64-token
        # tiles over a deeper ring: the variants that came closest in a same-run A/B on an H200
        # (``python -m bench.compute_ab``; ``git show
        # 7747519:bench/results/NVIDIA_H200-2026-12-02-s15-ab1-variants.txt``: separate K and V
        # pipelines lost 5-12% on every shape), tried first.
        cls = self.config_cls
        return [cls(), cls(cluster=1), cls(tile_n=64, stages=4)]

    def compile_for(self, cfg, shape: TuneShape) -> None:
        # the GPU objective's launch: every page in HBM, no ready flags, one split
        specs.get("q_tiled").compile_fn(cfg, torch_dtype(shape.dtype), shape.head_dim, shape.page_size, shape.group,
                                        False, False)


_SPACES: dict[str, KernelSpace] = {}


def register_space(space: KernelSpace, *, replace: bool = False) -> KernelSpace:
    """Add a kernel's space to the registry (the tuner, the profiles and the lookup use it)."""
    if not space.kernel:
        raise ValueError("a KernelSpace needs a kernel name")
    if space.kernel in _SPACES and not replace:
        raise ValueError(f"a space for kernel {space.kernel!r} is already registered")
    _SPACES[space.kernel] = space
    return space


def get_space(kernel: str) -> KernelSpace:
    try:
        return _SPACES[kernel]
    except KeyError:
        raise KeyError(f"no search space for kernel {kernel!r}; known: {sorted(_SPACES)}") from None


def kernels() -> list[str]:
    return sorted(_SPACES)


def space_hash(kernel: str) -> str:
    return get_space(kernel).space_hash()


def legal_configs(kernel: str, shape: TuneShape) -> list:
    return get_space(kernel).legal_configs(shape)


def config_problems(kernel: str, cfg, shape: TuneShape) -> list[str]:
    return get_space(kernel).problems(cfg, shape)


register_space(DecodeSpace())
register_space(MultiTokenSpace())
register_space(DecodeFP8Space())
register_space(QTiledSpace())

__all__ = [
    "ConfigError",
    "DecodeSpace",
    "KernelSpace",
    "MultiTokenSpace",
    "QTiledSpace",
    "LegalityReport",
    "STREAM_MAX_ROWS",
    "Param",
    "TuneShape",
    "config_problems",
    "consumer_wgs_for",
    "get_space",
    "kernels",
    "legal_configs",
    "normalize_dtype",
    "op_kernel",
    "register_space",
    "space_hash",
    "torch_dtype",
]
