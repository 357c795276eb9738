"""The compiled kernels, one :class:`KernelSpec` each: the registry every layer reads.

A spec states, for one compiled kernel, and only here:

- its name (the profile key, the tuner's ``--kernel``, the op's dispatch result);
- its config class and its legality: the config's own ``problems()`` (the config rules) plus the
  kernel's rules on the problem shape (GQA group, query rows), in :meth:`KernelSpec.problems`;
- which config fields generate code (:attr:`KernelSpec.codegen_fields`): the compile key keeps
  those, and every other field enters it as a fixed value (or as what it resolves to), so configs
  that differ only in launch fields share one compiled kernel (:meth:`KernelSpec.key_config`);
- its source files (:data:`directkv_cute.kernels.sources.CODE_FILES` is built from them) and,
  for a tuned kernel, the compiled kernels one launch runs (its profile hash covers all of them);
- its compile, compile-key and launch functions, by dotted name (resolved on first use).

Adding a kernel means adding its files and its spec. The op's dispatch (``ops``), the compile keys
(``kernels.jit``), the tuner's spaces (``tuning.space``) and ``bench check`` read these specs.

Plain Python with no imports beyond the standard library at module import (like ``sources``):
the config classes and functions are imported when first asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable

# The parts both paged attention kernels over host pages (and the Q-tiled kernel) are built from:
# each imports all of them; config.py holds the rules they read at trace time, jit.py the argument
# types and what the compile key keeps.
SHARED_FILES = ("kernels/paged.py", "kernels/producer.py", "kernels/qio.py", "kernels/walk.py", "kernels/masks.py",
                "kernels/softmax.py", "kernels/helpers.py", "kernels/jit.py", "config.py")

# Query rows (GQA group x q_len) one streaming (decode) CTA holds: two consumer warpgroups of 64.
STREAM_MAX_ROWS = 128
# GQA group the multi-token kernel holds (one consumer warpgroup's 64 rows per KV head and token).
MULTI_TOKEN_MAX_GROUP = 64


def resolve(dotted: str):
    """The object a dotted name ``package.module.attr[.attr...]`` names (imports the module)."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and not ".".join(parts[:i]).startswith(e.name):
                raise  # a module that exists but fails to import
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot resolve {dotted!r}")


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel.

    name:            the kernel's one name (code, CLI, profiles, docs).
    summary:         one line on its loop structure.
    files:           package-relative files that generate its code (its device module, the shared
                     parts it imports, the config rules, the compile driver); a test checks they
                     are closed under the package imports.
    compile / key / launch: dotted names of its compile function, its compile key and its launch.
    config:          dotted name of its config class (None: the kernel takes no config).
    codegen_fields:  config fields that change the generated code: kept in the compile key as
                     they are.
    launch_fields:   (field, value) for every other field that enters the key as a fixed value:
                     fields that only steer the launch (split counts) or that this kernel lacks.
    resolved_fields: (field, function(cfg, head_dim) -> value) for fields that enter the key only
                     as what they resolve to (the multi-token kernel's ``ctas_per_sm`` as the
                     occupancy it is compiled for).
    shape_rules:     function(cfg, group, q_len) -> [problems]: the kernel's rules on the problem
                     shape, in the order the compiler checks them (the first is what it raises).
    launches:        the compiled kernels one tuned launch of this kernel runs (the profile hash
                     covers their files); () for a kernel without tuned profile entries.
    max_rows:        query rows (GQA group x q_len) of a KV head the kernel holds at most, where it
                     has such a bound (the streaming kernel: one CTA's); None: any.
    """

    name: str
    summary: str
    files: tuple[str, ...]
    compile: str
    key: str
    launch: str
    config: str | None = None
    codegen_fields: tuple[str, ...] = ()
    launch_fields: tuple[tuple[str, int], ...] = ()
    resolved_fields: tuple[tuple[str, Callable], ...] = ()
    shape_rules: Callable | None = None
    launches: tuple[str, ...] = ()
    max_rows: int | None = None

    # ---- lazily resolved references ----------------------------------------------------------
    @property
    def config_class(self):
        return None if self.config is None else resolve(self.config)

    @property
    def compile_fn(self):
        return resolve(self.compile)

    @property
    def key_fn(self):
        return resolve(self.key)

    @property
    def launch_fn(self):
        return resolve(self.launch)

    @property
    def tuned(self) -> bool:
        return bool(self.launches)

    # ---- legality ----------------------------------------------------------------------------
    def shape_problems(self, cfg, group: int, q_len: int = 1) -> list[str]:
        """Why ``cfg`` cannot run ``group`` x ``q_len`` query rows per KV head in this kernel."""
        return [] if self.shape_rules is None else self.shape_rules(cfg, group, q_len)

    def accepts(self, cfg, group: int, q_len: int = 1) -> bool:
        """Whether this kernel runs ``cfg`` for the shape (its shape rules only)."""
        return not self.shape_problems(cfg, group, q_len)

    def problems(self, cfg, head_dim: int, page_size: int | None = None, elem_bytes: int = 2, *,
                 group: int | None = None, q_len: int = 1) -> list[str]:
        """Why ``cfg`` cannot be compiled and launched by this kernel: the config's own rules
        (``cfg.problems``, the one statement of them), then with ``group`` the shape rules."""
        out = list(cfg.problems(head_dim, page_size, elem_bytes))
        if group is not None:
            out += self.shape_problems(cfg, group, q_len)
        return out

    def is_legal(self, cfg, head_dim: int, page_size: int | None = None, elem_bytes: int = 2, *,
                 group: int | None = None, q_len: int = 1) -> bool:
        return not self.problems(cfg, head_dim, page_size, elem_bytes, group=group, q_len=q_len)

    # ---- code generation ---------------------------------------------------------------------
    def key_config(self, cfg, head_dim: int):
        """``cfg`` as the compile key holds it: the codegen fields as they are, the launch fields
        at their fixed value, the resolved fields as what they resolve to."""
        fixed = dict(self.launch_fields)
        fixed.update({name: fn(cfg, head_dim) for name, fn in self.resolved_fields})
        return dataclasses.replace(cfg, **fixed)

    def key_values(self, cfg, head_dim: int) -> tuple:
        """The config's part of the compile key (every field of :meth:`key_config`, in order)."""
        return dataclasses.astuple(self.key_config(cfg, head_dim))


# ---- the kernels' shape rules --------------------------------------------------------------------
def _streaming_rules(cfg, group: int, q_len: int) -> list[str]:
    out = []
    if cfg.multi_token_only:
        out.append(f"{', '.join(cfg.multi_token_only)}: options of the multi-token kernel only")
    if group < 1 or group > cfg.rows:
        out.append(f"GQA group {group} must be in 1..{cfg.rows}")
    elif q_len > cfg.rows // group:
        out.append(f"group {group} x q_len {q_len} rows exceed the config's {cfg.rows} rows")
    return out


def _multi_token_rules(cfg, group: int, q_len: int) -> list[str]:
    out = []
    if group > MULTI_TOKEN_MAX_GROUP:
        out.append(f"the multi-token kernel holds GQA groups up to {MULTI_TOKEN_MAX_GROUP}, got {group}")
    if group < 1 or group > cfg.rows:
        out.append(f"GQA group {group} must be in 1..{cfg.rows}")
    return out


def _q_tiled_rules(cfg, group: int, q_len: int) -> list[str]:
    return [] if 1 <= group <= cfg.rows else [f"GQA group {group} must be in 1..{cfg.rows}"]


def _multi_token_occupancy(cfg, head_dim: int) -> int:
    return cfg.multi_token_occupancy(head_dim, 2)


_RING = ("tile_n", "stages", "carveout", "consumer_wgs", "max_inflight", "link_credits")
_CHUNK_WALK = ("chunk_tiles", "edge_tiles", "q_regs", "q_cluster", "stagger")  # the multi-token kernel's walk

# (wait_ready, fold) of the Q-tiled kernels the op launches: over HBM pages; over staged pages in
# several KV splits folded in the kernel, or in one.
Q_TILED_VARIANTS = ((False, False), (True, True), (True, False))

SPECS: tuple[KernelSpec, ...] = (
    KernelSpec(
        name="decode",
        summary="streaming split-KV decode: KV tiles stream through the SMEM ring past every query row "
                f"of a KV head, all in one CTA (group x q_len <= {STREAM_MAX_ROWS})",
        files=("kernels/decode.py", *SHARED_FILES),
        compile="directkv_cute.kernels.jit.compile_decode",
        key="directkv_cute.kernels.jit.decode_key",
        launch="directkv_cute.kernels.launch.launch_decode",
        config="directkv_cute.config.DecodeConfig",
        codegen_fields=_RING,
        launch_fields=(("num_splits", 0), ("ctas_per_sm", 1), *((f, 0) for f in _CHUNK_WALK)),
        shape_rules=_streaming_rules,
        launches=("decode", "combine"),
        max_rows=STREAM_MAX_ROWS,
    ),
    KernelSpec(
        name="decode_fp8",
        summary="the streaming decode kernel over FP8 pages: FP8 K/V boxes and their token scales stream "
                "through the ring, dequantized in SMEM into q-dtype operand tiles",
        files=("kernels/decode_fp8.py", "kernels/decode.py", "fp8.py", *SHARED_FILES),
        compile="directkv_cute.kernels.jit.compile_decode_fp8",
        key="directkv_cute.kernels.jit.decode_fp8_key",
        launch="directkv_cute.kernels.launch.launch_decode",
        config="directkv_cute.config.DecodeConfig",
        codegen_fields=_RING,
        launch_fields=(("num_splits", 0), ("ctas_per_sm", 1), *((f, 0) for f in _CHUNK_WALK)),
        shape_rules=_streaming_rules,
        launches=("decode_fp8", "combine"),
        max_rows=STREAM_MAX_ROWS,
    ),
    KernelSpec(
        name="multi_token",
        summary="multi-token KV-outer chunk walk: each CTA holds a chunk of KV tiles in SMEM and applies "
                "it to every block of query rows while the next chunk loads (prefill, chunked prefill, "
                "long speculative windows)",
        files=("kernels/multi_token.py", "kernels/trace.py", *SHARED_FILES),
        compile="directkv_cute.kernels.jit.compile_multi_token",
        key="directkv_cute.kernels.jit.decode_key",
        launch="directkv_cute.kernels.launch.launch_decode",
        config="directkv_cute.config.DecodeConfig",
        codegen_fields=(*_RING, *_CHUNK_WALK),
        launch_fields=(("num_splits", 0),),
        resolved_fields=(("ctas_per_sm", _multi_token_occupancy),),
        shape_rules=_multi_token_rules,
        launches=("multi_token", "combine"),
    ),
    KernelSpec(
        name="q_tiled",
        summary="Q-tiled over HBM (or staged) KV: one CTA per 128 query rows walks every KV tile its rows see",
        files=("kernels/q_tiled.py", *SHARED_FILES),
        compile="directkv_cute.kernels.jit.compile_q_tiled",
        key="directkv_cute.kernels.jit.q_tiled_key",
        launch="directkv_cute.kernels.launch.launch_q_tiled",
        config="directkv_cute.config.QTiledConfig",
        codegen_fields=("tile_n", "stages", "carveout", "pingpong", "cluster"),  # every field: staging is the plan's
        shape_rules=_q_tiled_rules,
        launches=("q_tiled",),  # staged calls in KV splits fold them in the kernel
    ),
    KernelSpec(
        name="kv_proj",
        summary="fused K/V projection + RoPE + KV-cache store: a TMA/WGMMA GEMM over one head per N tile, "
                "split-K at small token counts, the epilogue storing rows straight into host and HBM pages",
        files=("kernels/kv_proj.py", "kernels/helpers.py", "kernels/jit.py"),
        compile="directkv_cute.kernels.jit.compile_kv_proj",
        key="directkv_cute.kernels.jit.kv_proj_key",
        launch="directkv_cute.kv_proj.launch_kv_proj",
        config="directkv_cute.kv_proj.KVProjConfig",
        codegen_fields=("tile_m", "consumer_wgs", "stages", "ctas_per_sm"),
        launch_fields=(("splits", 0),),
    ),
    KernelSpec(
        name="dequant",
        summary="staged FP8 pages of a range of KV heads dequantized into 16-bit pages (float32 product, one rounding)",
        files=("kernels/dequant.py", "kernels/jit.py"),
        compile="directkv_cute.kernels.jit.compile_dequant",
        key="directkv_cute.kernels.jit.dequant_key",
        launch="directkv_cute.kernels.launch.launch_dequant",
    ),
    KernelSpec(
        name="combine",
        summary="split-KV combine: merges the fp32 partials of several splits by their LSE",
        files=("kernels/combine.py", "kernels/jit.py"),
        compile="directkv_cute.kernels.jit.compile_combine",
        key="directkv_cute.kernels.jit.combine_key",
        launch="directkv_cute.kernels.launch.launch_combine",
    ),
)

KERNELS: dict[str, KernelSpec] = {s.name: s for s in SPECS}


def get(name: str) -> KernelSpec:
    """The spec of kernel ``name``."""
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"no kernel {name!r}; kernels: {sorted(KERNELS)}") from None


def tuned() -> tuple[str, ...]:
    """The kernels that have tuned profile entries."""
    return tuple(s.name for s in SPECS if s.tuned)


def paged_kernel(multi_token: bool) -> KernelSpec:
    """The spec of the paged kernel over host pages ``compile_decode`` builds: the multi-token
    chunk kernel, else the streaming one."""
    return KERNELS["multi_token" if multi_token else "decode"]


def op_kernel(group: int, q_len: int) -> str:
    """The kernel the op runs over host pages for a launch without an explicit config: "decode"
    (streaming) while every query row of a KV head fits one CTA (group x q_len <= STREAM_MAX_ROWS),
    else "multi_token"."""
    return "decode" if group * q_len <= KERNELS["decode"].max_rows else "multi_token"


def config_kernel(cfg, group: int, q_len: int) -> str:
    """The kernel the op runs an explicit DecodeConfig with: "decode" where the streaming kernel
    accepts it (every query row of a KV head in one CTA, no multi-token-only option), else
    "multi_token"."""
    return "decode" if KERNELS["decode"].accepts(cfg, group, q_len) else "multi_token"
