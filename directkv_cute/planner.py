"""The planner: one pure function from a call's shape to the plan that runs it.

``plan_attention(shape, device, machine, configs, config=None)`` takes

- ``CallShape``: the host summary of the call (host page table, lengths, query lengths, heads,
  head dim, page dtype, pool geometry, whether the calls come back to back, whether sequences
  that share pages are read once: the cascade);
- ``machine.DeviceInfo``: the GPU's name, SM count and memory, whether a CUDA graph is being
  captured, whether staged copies may run ahead (decided once per step);
- ``machine.MachineModel``: the cost model's rates (from the GPU's profile);
- ``configs``: the tuned configs (``ProfileConfigs``: the profile lookup; ``DefaultConfigs``);
- an explicit config, if the caller gives one, and with an explicit ``QTiledConfig`` an explicit
  ``StagingRequest`` (pieces, KV splits, launch and copy order of its staged launch);

and returns a frozen ``AttentionPlan``: which kernel runs with which config, whether and how the
host pages are staged into HBM first (pieces, splits, order, copies ahead), the FP8 variant, the
cascade's passes, and the plan a CUDA graph capture runs instead. Every routing and staging
decision is made here, once; ``plan.explain()`` says which and why, with the cost model's numbers.
``directkv_cute.runner`` executes a plan. Plain Python (numpy, torch dtypes): no GPU is asked.

The routes (``ROUTES``, each named in ``AttentionPlan.route``):

- ``decode``: the streaming split-KV kernel in place, while every query row of a KV head fits
  one CTA (decode, short speculative windows);
- ``multi_token``: the KV-outer chunk kernel in place (longer query runs);
- ``q_tiled_hbm``: the Q-tiled kernel over pages all in HBM, once its query tiles fill a wave;
- ``q_tiled_staged``: host pages copied into HBM by the copy engine, piece by piece, under the
  Q-tiled kernel, where the cost model says the copy and its compute beat reading in place
  (compute-bound chunks, long link-bound reads);
- ``decode_fp8`` / ``decode_fp8_staged`` / ``decode_fp8_two_piece``: FP8 pages read by the
  streaming FP8 kernel in place, or after the copy engine moved them (long link-bound reads),
  in one launch or in two (one per piece, the first under the second's copy);
- ``fp8_dequantized``: multi-token calls over FP8 pages: staged, dequantized into a buffer, then
  the 16-bit plan over it (``inner``);
- ``fp8_by_head``: the same group by group of KV heads, each group's Q-tiled launch under the
  next group's copy, where the Q-tiled kernel would run the call over HBM pages;
- ``cascade``: sequences that share pages: each shared span read once for all its sharers;
- ``cascade_staged``: the same batch as one staged call, where that is estimated faster;
- ``reference``: a CPU cache: the float32 reference.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from directkv_cute import plan as cm
from directkv_cute.config import ConfigError, DecodeConfig, QTiledConfig, multi_token_splits, q_tiles
from directkv_cute.kernels.specs import config_kernel, op_kernel
from directkv_cute.kernels.specs import get as get_spec
from directkv_cute.machine import DeviceInfo, MachineModel
from directkv_cute.staging import HEAD_PIECES, MAX_FLAGS, MAX_PIECES, SLOTS, StagePlan, head_groups, \
    piece_pages_for, plan_staging

ROUTES = ("decode", "multi_token", "q_tiled_hbm", "q_tiled_staged", "decode_fp8", "decode_fp8_staged",
          "decode_fp8_two_piece", "fp8_dequantized", "fp8_by_head", "cascade", "cascade_staged", "reference")

# The second piece of a staged FP8 decode: this share of the longest sequence's pages. The first
# launch reads the rest from HBM while the copy engine moves it (the FP8 kernel reads the staged
# pages at about 1.25 TB/s, 55 us after a 1.25 ms copy at batch 1 over 32k), so it hides behind
# that copy while the share is above about 4.4%; what stays exposed is the second launch.
FP8_TAIL_SHARE = 1 / 16
# Streams that FP8 chunks run their KV head groups on, at most: one group's launch may fill only
# part of the SMs (its query tiles), so the next groups' launches run beside it.
FP8_HEAD_STREAMS = 4


# The in-place kernel (``kernels.specs.op_kernel``) of the calls whose profile buckets each tuned
# kernel's entries serve: the planner looks decode_fp8 up for decode-sized calls over FP8 pages
# and q_tiled for multi-token calls (staged, or over pages in HBM).
TUNED_BUCKETS = {"decode": "decode", "decode_fp8": "decode", "multi_token": "multi_token", "q_tiled": "multi_token"}


def tuned_buckets(kernel: str) -> str:
    """``op_kernel``'s answer for the buckets the planner looks ``kernel``'s tuned entries up for."""
    return TUNED_BUCKETS.get(kernel, kernel)


# ---- inputs ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class CallShape:
    """The host summary of one call (or of every layer of one step).

    host_table:   (B, max_pages) int32 encoded entries (>= 0 host page, < 0 HBM page -e - 1),
                  None where only device tables exist (the dispatcher's op): then nothing is staged
                  but what cannot run otherwise.
    seq_lens, q_lens: per sequence.
    page_dtype:   the pages' torch dtype (16-bit or FP8); compute_dtype: q's.
    num_layers, hbm_pages: the pools' layer count and HBM pages (staged calls read pages already in
                  HBM in place where page x layers fits int32).
    width:        the device page table's width (max_pages): the multi-token split count's bound.
    max_seq_len:  the caller's hint of the longest sequence (decode split count, profile bucket).
    back_to_back: the calls come in long runs (a model step's layers): a staged chunk is planned
                  for its copy running ahead of its kernel, where copies may run ahead.
    cascade:      read the pages that sequences share once per batch; groups: rows that may share.
    hbm_only:     every page the device tables name is in HBM (``KernelTables.hbm_only``): a call
                  without a host table is routed as one whose pages are all in HBM.
    """

    host_table: np.ndarray | None
    seq_lens: tuple
    q_lens: tuple
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    page_dtype: object
    compute_dtype: object
    num_layers: int
    hbm_pages: int
    width: int
    max_seq_len: int | None = None
    back_to_back: bool = False
    cascade: bool = False
    groups: tuple | None = None
    hbm_only: bool = False

    @classmethod
    def of(cls, cache, tables, q_lens, num_q_heads: int, compute_dtype=None, *, max_seq_len=None,
           cascade: bool = False, groups=None, back_to_back=None) -> "CallShape":
        """The shape of a call over ``cache`` (its public attributes) and ``tables``
        (``cache.kernel_tables``)."""
        host = getattr(tables, "host_table", None)
        lens = getattr(tables, "host_seq_lens", None)
        width = tables.page_table.shape[1] if tables.page_table is not None else np.asarray(host).shape[1]
        if lens is None:
            host = None
        hbm = getattr(cache, "hbm_pool", None)
        return cls(None if host is None else np.asarray(host), tuple(int(n) for n in lens) if lens is not None
                   else None, tuple(int(q) for q in q_lens), int(num_q_heads), cache.num_kv_heads, cache.head_dim,
                   cache.page_size, cache.dtype, compute_dtype or getattr(cache, "compute_dtype", None) or cache.dtype,
                   cache.num_layers, int(hbm.shape[0]) if hbm is not None else 0, int(width), max_seq_len,
                   bool(getattr(tables, "back_to_back", False) if back_to_back is None else back_to_back),
                   cascade, None if groups is None else tuple(tuple(g) for g in groups),
                   bool(getattr(tables, "hbm_only", False)) and host is None)

    @classmethod
    def example(cls, seq_lens, q_lens=None, *, num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                page_size: int = 64, tier: str = "host", page_dtype=None, compute_dtype=None, num_layers: int = 32,
                back_to_back: bool = False, max_seq_len: int | None = None) -> "CallShape":
        """The shape of a batch laid out in a fresh cache, without one: each sequence's pages
        consecutive, all on the host (``tier`` "host"), all in HBM ("hbm"), or on the host but
        for the step's own tokens' pages mirrored in HBM ("window"). What the planner would do
        for a call: ``plan_attention(CallShape.example([32768], [2048]), ...)``."""
        import torch

        seq_lens = tuple(int(n) for n in seq_lens)
        q_lens = (1,) * len(seq_lens) if q_lens is None else tuple(int(q) for q in q_lens)
        if tier not in ("host", "hbm", "window"):
            raise ValueError(f"tier must be 'host', 'hbm' or 'window', got {tier!r}")
        n_pages = [math.ceil(n / page_size) for n in seq_lens]
        table = np.zeros((len(seq_lens), max(n_pages)), dtype=np.int32)
        k = 0
        for b, n in enumerate(n_pages):
            ids = np.arange(k, k + n)
            table[b, :n] = -ids - 1 if tier == "hbm" else ids
            if tier == "window":
                own = (seq_lens[b] - q_lens[b]) // page_size
                table[b, own:n] = -np.arange(k, k + n - own) - 1
            table[b, n:] = table[b, n - 1]
            k += n
        page_dtype = torch.bfloat16 if page_dtype is None else page_dtype
        compute = compute_dtype or (torch.bfloat16 if _itemsize(page_dtype) == 1 else page_dtype)
        return cls(table, seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, page_size, page_dtype, compute,
                   num_layers, max(k, 1), table.shape[1], max_seq_len, back_to_back)

    # ---- derived ------------------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def fp8(self) -> bool:
        from directkv_cute.fp8 import is_fp8

        return is_fp8(self.page_dtype)

    @property
    def context(self) -> int:
        """The longest sequence as the decode split count and profile bucket see it."""
        return self.max_seq_len if self.max_seq_len is not None else self.width * self.page_size

    @property
    def q_itemsize(self) -> int:
        return _itemsize(self.compute_dtype)

    def layer_page_bytes(self, dtype=None) -> int:
        """Bytes of one page of one layer in ``dtype`` (default the pages'), FP8 scales included."""
        from directkv_cute.fp8 import is_fp8

        dtype = self.page_dtype if dtype is None else dtype
        rows = self.num_kv_heads * 2 * self.page_size
        return rows * self.head_dim * _itemsize(dtype) + (rows * 4 if is_fp8(dtype) else 0)

    @property
    def in_place_layers(self) -> int:
        """``plan_staging``'s ``hbm_layers``: the layer count, so that pages already in HBM are read
        in place; 0 (copy them) where page x layers of the HBM pool overflows int32."""
        return self.num_layers if self.hbm_pages * self.num_layers < 2**31 else 0

    def replace(self, **changes) -> "CallShape":
        return dataclasses.replace(self, **changes)


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StagingRequest:
    """How an explicit Q-tiled call stages its host pages and launches its KV splits (with an
    explicit ``QTiledConfig``); each field 0 leaves that decision to the planner. None of it
    generates code: the plan's layout (``QTiledLayout``) and staging plan carry it to the launch.

    piece_pages: pages per ready piece: a KV tile is issued once the copy engine has finished the
                 piece holding its pages, so compute starts after the first piece instead of the
                 whole copy.
    splits:      KV splits, each a run of pieces, folded into one fp32 accumulator inside the
                 kernel: the CTAs of early splits run while later pieces still copy. Pages already
                 in HBM at the end of the call (a step's own tokens mirrored) get splits of their
                 own beyond these, launched first (``plan.q_tiled_splits``, ``plan.ready_split``).
    order:       launch order of the query tiles: 1 = heaviest first; 2 = lightest first, one
                 split (the tiles that need the fewest keys run while the copy lands the rest, as
                 in a prefill from the first token).
    copy_order:  1 = each piece copies the pages of every KV head; 2 = head by head, one split:
                 the copy lands KV head 0's pages, then head 1's, ..., and the CTAs run head-major,
                 so only the first head's copy is exposed (about 1/Hkv of it) and no partials are
                 written.

    An invalid request raises when it is made (``TypeError``, or ``ConfigError`` naming the rule).
    """

    piece_pages: int = 0
    splits: int = 0
    order: int = 0
    copy_order: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"StagingRequest.{f.name} must be an int, got {type(value).__name__} {value!r}")
        problems = self.problems()
        if problems:
            raise ConfigError(f"{self}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        if self.piece_pages < 0:
            out.append("piece_pages must be >= 0 (0 = the planner's choice)")
        if self.splits < 0:
            out.append("splits must be >= 0 (0 = the planner's choice)")
        for name, one, two in (("order", "heaviest first", "lightest first"),
                               ("copy_order", "all heads per piece", "head by head")):
            value = getattr(self, name)
            if value not in (0, 1, 2):
                out.append(f"{name} {value} must be 0 (the planner's choice), 1 ({one}) or 2 ({two})")
            elif value == 2 and self.splits > 1:
                out.append(f"{name} 2 ({two}) runs one split, got splits {self.splits}")
        return out

    @property
    def automatic(self) -> bool:
        """Every decision left to the planner."""
        return not (self.piece_pages or self.splits or self.order or self.copy_order)

    @property
    def one_split(self) -> bool:
        """Lightest first or head by head: one split, in the order the copy lands."""
        return 2 in (self.order, self.copy_order)


AUTOMATIC = StagingRequest()


class ProfileConfigs:
    """The tuned configs of one GPU for one cache geometry: the profile lookup (exact bucket,
    else the nearest, else the kernel's default, warned as ``tuning.lookup`` does)."""

    def __init__(self, gpu_name: str):
        self.gpu_name = gpu_name

    def get(self, kernel: str, shape: CallShape, group: int, batch: int, context: int, q_len: int,
            quiet: bool = False):
        """(config, source) of ``kernel``; ``quiet``: no warning for a missing entry."""
        from directkv_cute.tuning.lookup import select_config
        from directkv_cute.tuning.profiles import current_kernel_hash

        return select_config(kernel, gpu_name=self.gpu_name, kernel_hash=current_kernel_hash(kernel),
                             dtype=shape.compute_dtype, head_dim=shape.head_dim, group=group,
                             page_size=shape.page_size, batch=batch, context=context, q_len=q_len,
                             rows=group * q_len, quiet=quiet)


class DefaultConfigs:
    """Every kernel's untuned default (no profile): what the tests route with."""

    def get(self, kernel: str, shape: CallShape, group: int, batch: int, context: int, q_len: int,
            quiet: bool = False):
        from directkv_cute.config import default_decode_config, default_multi_token_config

        if kernel == "q_tiled":
            return QTiledConfig(), "default"
        if kernel == "multi_token":
            return default_multi_token_config(shape.head_dim, group * q_len), "default"
        if kernel == "decode_fp8":
            return None, "default"
        return default_decode_config(shape.head_dim, group * q_len, shape.page_size), "default"


# ---- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class QTiledLayout:
    """A Q-tiled launch's split layout: ``splits`` KV splits of ``split_tiles`` tiles (pieces of
    ``piece_tiles``), launched from ``first`` (the splits ready at the start first); ``by_head``:
    the copy and the CTAs head by head; ``ascending``: lightest query tiles first."""

    splits: int = 1
    split_tiles: int = 0
    piece_tiles: int = 1
    first: int = 0
    by_head: bool = False
    ascending: bool = False
    query_tiles: int = 1


@dataclass(frozen=True)
class FP8Part:
    """One launch of a two-piece staged FP8 decode: its host table and lengths, its splits."""

    table: np.ndarray = field(compare=False)
    lens: np.ndarray = field(compare=False)
    splits: int


@dataclass(frozen=True)
class CascadePass:
    """One pass of a cascade: the rows of q it gathers (None: every row, the own pass), its
    packing (pseudo-sequences of ``g2`` rows each), and the plan of its call."""

    rows: tuple | None
    n_pseudo: int
    g2: int
    plan: "AttentionPlan"
    shape: CallShape = field(compare=False, repr=False)


@dataclass(frozen=True)
class AttentionPlan:
    """How one call (or every layer of one step) runs. Frozen and printable: ``explain()``."""

    route: str
    kernel: str | None  # the compiled kernel ("decode", "decode_fp8", "multi_token", "q_tiled"); None: passes
    config: object = None  # DecodeConfig or QTiledConfig (None for the cascade)
    splits: int = 1  # in-place KV splits (decode, multi_token, decode_fp8)
    layout: QTiledLayout | None = None
    staging: StagePlan | None = field(default=None, repr=False)
    copy_ahead: bool = False  # the staged copy may run ahead of the current stream
    fp8_parts: tuple = field(default=(), repr=False)  # decode_fp8_two_piece: (FP8Part, FP8Part)
    head_groups: tuple = ()  # fp8_by_head: KV head ranges, in copy order
    inner: "AttentionPlan | None" = None  # fp8_dequantized: the plan over the dequantized buffer
    cascade: object = field(default=None, repr=False)  # CascadePlan
    passes: tuple = field(default=(), repr=False)  # cascade: the own pass, then each span's
    capture: "AttentionPlan | None" = field(default=None, repr=False)  # what a CUDA graph capture runs
    choice: cm.StagedChoice | None = None
    why: tuple = ()
    shape: CallShape | None = field(default=None, compare=False, repr=False)
    machine: str = ""

    @property
    def staged(self) -> bool:
        return self.staging is not None

    def explain(self) -> str:
        """Which kernel runs and why, with the cost model's numbers."""
        s = self.shape
        lines = [f"route {self.route}: kernel {self.kernel or '-'}" + (f", {self.config}" if self.config else "")]
        if s is not None:
            lines.append(f"  call: batch {s.batch}, q_lens {_brief(s.q_lens)}, seq_lens {_brief(s.seq_lens)}, "
                         f"heads {s.num_q_heads}/{s.num_kv_heads}, d {s.head_dim}, page {s.page_size}, "
                         f"pages {str(s.page_dtype).removeprefix('torch.')}")
        if self.kernel in ("decode", "multi_token", "decode_fp8") and not self.fp8_parts:
            lines.append(f"  in place, {self.splits} split(s)")
        if self.staging is not None:
            p = self.staging
            lines.append(f"  staged: {p.pages} pages ({p.host_pages} from host) in {len(p.pieces)} piece(s) of "
                         f"{p.piece_pages}, {p.copy_calls[0]} host copy calls"
                         + (", copies ahead" if self.copy_ahead else ""))
        if self.layout is not None:
            lo = self.layout
            lines.append(f"  Q-tiled: {lo.query_tiles} query tile(s), {lo.splits} split(s) of {lo.split_tiles} tiles"
                         + (f", launched from split {lo.first}" if lo.first else "")
                         + (", head by head" if lo.by_head else "") + (", lightest first" if lo.ascending else ""))
        if self.choice is not None:
            c = self.choice
            lines.append(f"  cost model ({self.machine}): in place {c.in_place_ms:.3f} ms, staged {c.staged_ms:.3f} ms"
                         f" at {c.splits} split(s)" + (" (copies ahead)" if c.pipelined else ""))
        lines += [f"  - {w}" for w in self.why]
        if self.inner is not None:
            what = "the whole batch" if self.route == "cascade_staged" else "then over the dequantized pages"
            lines.append(f"  {what}: " + self.inner.explain().replace("\n", "\n  "))
        for p in self.passes:
            lines.append(f"  pass over {'every row' if p.rows is None else f'rows {_brief(p.rows)}'}: "
                         + p.plan.explain().replace("\n", "\n  "))
        if self.capture is not None:
            lines.append(f"  inside a CUDA graph capture: {self.capture.route} ({self.capture.kernel})")
        return "\n".join(lines)


def _brief(xs, n: int = 6) -> str:
    xs = list(xs or ())
    return f"[{', '.join(map(str, xs[:n]))}{', ...' if len(xs) > n else ''}]"


class PlanError(ValueError):
    """A call the asked-for kernel cannot run (raised before anything is launched)."""


# ---- the planner -----------------------------------------------------------------------------
def plan_attention(shape: CallShape, device: DeviceInfo, machine: MachineModel, configs, config=None, *,
                   staging: StagingRequest | None = None, cascade_plan=None) -> AttentionPlan:
    """The plan of a call (see the module docstring). ``config``: an explicit DecodeConfig (runs
    the streaming or the multi-token kernel in place) or QTiledConfig (runs the Q-tiled kernel,
    or raises ``PlanError`` saying why it cannot). ``staging``: with a QTiledConfig, the
    ``StagingRequest`` its staged launch follows (None: the planner's choice). ``cascade_plan``:
    the batch's ``cascade.plan_cascade``, where the caller has made it (``shape.cascade``)."""
    if staging is not None:
        if not isinstance(staging, StagingRequest):
            raise TypeError(f"staging must be a StagingRequest, got {type(staging).__name__}")
        if not isinstance(config, QTiledConfig):
            raise PlanError("a StagingRequest steers the Q-tiled kernel's staged launch: it needs an explicit "
                            f"QTiledConfig (config=QTiledConfig(...)), got config {config!r}")
    staging = staging or AUTOMATIC
    if shape.cascade and shape.host_table is not None and config is None:
        got = _plan_cascade(shape, device, machine, configs, cascade_plan)
        if got is not None:
            return got
    if device.cpu:
        return _done(AttentionPlan("reference", None, why=("a CPU cache: the float32 reference",)), shape, machine)
    if shape.fp8:
        return _plan_fp8(shape, device, machine, configs, config, staging)
    return _plan_16bit(shape, device, machine, configs, config, staging)


def _done(plan: AttentionPlan, shape: CallShape, machine: MachineModel) -> AttentionPlan:
    """The plan, and the capture fallback it carries, stamped with the call they were made for
    (the runner compiles and launches from ``plan.shape``)."""
    capture = plan.capture
    if capture is not None and capture.shape is None:
        capture = dataclasses.replace(capture, shape=shape, machine=machine.name)
    return dataclasses.replace(plan, shape=shape, machine=machine.name, capture=capture)


def _plan_16bit(shape, device, machine, configs, config, staging: StagingRequest = AUTOMATIC) -> AttentionPlan:
    if isinstance(config, QTiledConfig) or config is None:
        route = _q_tiled_route(shape, device, machine, configs, config, staging)
        if route is not None:
            plan = route
            if config is None and plan.staging is not None:
                try:  # what a capture of this call runs: it reads in place (staging is refused there)
                    plan = dataclasses.replace(plan, capture=_in_place(shape, device, configs, None))
                except ValueError:
                    pass  # the in-place kernels cannot run this shape at all (workspace cap)
            return _done(plan, shape, machine)
    return _done(_in_place(shape, device, configs, config), shape, machine)


def _in_place(shape: CallShape, device: DeviceInfo, configs, config) -> AttentionPlan:
    """The kernels that read the pages in place: the streaming kernel, or the multi-token one."""
    group, q_len = shape.group, shape.max_q_len
    if config is not None:
        cfg, kernel, why = config, config_kernel(config, group, q_len), "an explicit config"
    else:
        kernel = op_kernel(group, q_len)
        cfg, source = configs.get(kernel, shape, group, shape.batch, shape.context, q_len)
        why = f"{kernel} config: profile {source}"
    cfg.check(shape.head_dim, shape.page_size)
    problems = get_spec(kernel).shape_problems(cfg, group, q_len)
    if problems:  # what the compiler would raise, said before anything runs
        raise PlanError(f"{kernel}: {problems[0]}")
    hkv, d = shape.num_kv_heads, shape.head_dim
    if kernel == "multi_token":
        # Sized from the page table's width (a bound the host knows), never from a caller's hint.
        splits = multi_token_splits(cfg, shape.width * shape.page_size, shape.batch, hkv, device.sms, d,
                                    shape.q_itemsize)
        total_q = sum(shape.q_lens)
        ws = splits * total_q * shape.num_q_heads * (d + 1) * 4
        if ws > device.workspace_cap:
            raise ValueError(
                f"the multi-token kernel needs {ws / 2**30:.1f} GiB of fp32 partials ({splits} splits x "
                f"{total_q} query rows x {shape.num_q_heads} heads), over the {device.workspace_cap / 2**30:.1f} GiB "
                "cap (DIRECTKV_MAX_WORKSPACE_GB); use a config with chunk_tiles > 0 (fewer splits) or feed fewer "
                "query tokens per call")
        reason = f"group x q_len = {group * q_len} rows exceed one streaming CTA's"
    else:
        splits = cfg.splits_for(shape.batch, hkv, shape.context, device.sms)
        reason = f"group x q_len = {group * q_len} rows fit one streaming CTA"
    return AttentionPlan("multi_token" if kernel == "multi_token" else "decode", kernel, cfg, splits,
                         why=(reason, why))


def q_tiled_config(configs, shape: CallShape, group: int, batch: int, context: int, q_len: int) -> QTiledConfig:
    """The config of an automatic Q-tiled launch: the profile's q_tiled entry (exact bucket, else
    the nearest), else ``QTiledConfig()``. A miss warns as the other kernels' lookups do, except
    for decode-sized calls (the profile's buckets are prefill chunks, and the Q-tiled kernel runs
    them only staged, paced by the copy). One query tile per sequence and KV head: no clusters."""
    quiet = op_kernel(group, q_len) == "decode"
    cfg = configs.get("q_tiled", shape, group, batch, context, q_len, quiet=quiet)[0]
    return cfg.for_query_tiles(q_tiles(q_len, group, cfg.rows))


def fills_a_wave(shape: CallShape, sms: int) -> bool:
    """Whether the Q-tiled kernel runs a multi-token call over KV all in HBM: once its query tiles
    fill about a wave of SMs (measured from q 512 at Hkv 8); fewer tiles leave SMs idle and the
    split chunk kernel is faster. Streaming launches (decode) keep their kernel."""
    if op_kernel(shape.group, shape.max_q_len) == "decode":
        return False
    ctas = q_tiles(shape.max_q_len, shape.group, QTiledConfig().rows) * shape.num_kv_heads * shape.batch
    return 2 * ctas >= sms


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


def _q_tiled_route(shape: CallShape, device: DeviceInfo, m: MachineModel, configs, config,
                   req: StagingRequest = AUTOMATIC):
    """The Q-tiled plan of a call, or None where another kernel runs it.

    It runs directly when every page of a multi-token call is in HBM and its query tiles fill a
    wave, or over host pages staged into HBM when the cost model (``plan.choose_staged``) says the
    copy plus its compute beats reading in place: compute-bound chunks, and long link-bound reads
    (decode included), where the copy engine outruns the SMs' reads of host memory. An explicit
    QTiledConfig always runs it, or raises where it cannot, staged as ``req`` asks; without one
    the config is the tuned profile's, looked up once the call is one the kernel may run."""
    explicit = isinstance(config, QTiledConfig)
    asked = "an explicit QTiledConfig" + ("" if req.automatic else f" and {req}")

    def refuse(why: str):
        if explicit:
            raise PlanError(f"QTiledConfig: {why}")
        return None

    if shape.host_table is None and not shape.hbm_only:
        return refuse("needs tables from cache.kernel_tables() (the staging plan reads the host page table)")
    if device.capturing:
        return refuse("the staged Q-tiled path cannot be captured in a CUDA graph (its copies are planned per call)")
    group, lens, q_lens = shape.group, shape.seq_lens, shape.q_lens
    if group > 128:
        return refuse(f"GQA group {group} exceeds the kernel's 128 query rows")

    def looked_up() -> QTiledConfig:
        return q_tiled_config(configs, shape, group, len(lens), max(lens), max(q_lens))

    n_host = 0 if shape.host_table is None else pages_used(shape.host_table, lens, shape.page_size)[2]
    if n_host == 0:  # every page already in HBM: the Q-tiled kernel (no KV splits) where it fills a wave
        if explicit or fills_a_wave(shape, device.sms):
            cfg = config if explicit else looked_up()
            n_qt = q_tiles(max(q_lens), group, cfg.rows)
            why = asked if explicit else \
                f"every page in HBM and {n_qt * shape.num_kv_heads * shape.batch} query-tile CTAs fill a wave"
            return AttentionPlan("q_tiled_hbm", "q_tiled", cfg, 1,
                                 QTiledLayout(1, math.ceil(max(lens) / cfg.tile_n), 1, 0, False, req.order == 2,
                                              n_qt), why=(why,))
        return None
    cfg = config if explicit else looked_up()
    got = staging_choice(shape, device, m, cfg, explicit, shape.back_to_back and device.copies_ahead, req)
    if isinstance(got, str):
        return refuse(got)
    if got is None:
        return None  # short link-bound reads: in place (decided before any planning)
    choice, stage_plan = got
    if not explicit and not choice.staged:
        return None
    order = req.order or 1
    copy_order = req.copy_order or (2 if choice.by_head else 1)
    want = req.splits or (1 if 2 in (order, copy_order) else choice.splits)
    by_head = copy_order == 2
    in_order = by_head or order == 2  # one split, in the order the copy lands
    P = shape.page_size
    max_tiles = math.ceil(max(lens) / cfg.tile_n)
    piece_tiles = stage_plan.piece_pages * P // cfg.tile_n
    splits, split_tiles = cm.q_tiled_splits(max_tiles, piece_tiles, want,
                                            0 if in_order else stage_plan.ready_from * piece_tiles)
    first = 0 if in_order else cm.ready_split(stage_plan.ready_from, piece_tiles, split_tiles, splits)
    heads = shape.num_kv_heads
    buffer_bytes = stage_plan.pages * shape.layer_page_bytes()
    ahead = device.copies_ahead and device.fits_staging(buffer_bytes, SLOTS)
    bound = "compute-bound" if cm.compute_bound(m, n_host * shape.layer_page_bytes(shape.compute_dtype),
                                                cm.causal_flops(lens, q_lens, shape.num_q_heads, shape.head_dim)) \
        else "link-bound"
    why = (asked if explicit else
           f"{bound}: staged beats in place ({choice.staged_ms:.3f} vs {choice.in_place_ms:.3f} ms)",
           "copy head by head" if by_head else ("one wave in coarse pieces" if choice.coarse else
                                                 f"{splits} split(s) folded in the kernel"))
    if choice.pipelined:
        why += ("planned for its copy running ahead of its kernel (back-to-back calls)",)
    return AttentionPlan("q_tiled_staged", "q_tiled", cfg, 1,
                         QTiledLayout(splits, split_tiles, piece_tiles, first, by_head, order == 2,
                                      q_tiles(max(q_lens), group, cfg.rows)),
                         stage_plan, ahead, choice=choice, why=why)


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
    flops = cm.causal_flops(lens, q_lens, shape.num_q_heads, head_dim)
    bound = cm.compute_bound(m, n_host * page_bytes, flops)
    chunk = op_kernel(group, max(q_lens)) != "decode"  # in place, the chunk kernel would run it
    chunk_q = sum(q_lens) if chunk else 0
    # A chunk with more CTAs than SMs whose compute trails the copy: coarser pieces (fewer copy calls
    # and flags); elsewhere finer pieces pace the CTAs (decode, one wave, compute-bound chunks).
    ctas = q_tiles(max(q_lens), group, cfg.rows) * heads * len(lens)
    coarse_link = chunk and ctas > device.sms and cm.trails_copy(m, n_host * page_bytes, flops)
    pieces, split_choices = cm.link_bound_staging(max(lens)) if coarse_link else (16, cm.SPLIT_CHOICES)
    pp = piece_pages_for(max(n_pages), P, cfg.tile_n, req.piece_pages, pieces=pieces)
    hbm_runs = hbm_runs_per_sequence(host_table, n_pages) if chunk else 0
    window = chunk and hbm_runs <= 1
    if hbm_runs == 1 and not req.piece_pages:  # a step's own pages in HBM: pieces of their own, ready at the start
        pp = cm.window_piece_pages(pp, ready_page(host_table, n_pages), max(n_pages), max(1, cfg.tile_n // P),
                                   math.ceil(max(n_pages) / MAX_PIECES))
    calls = sum(math.ceil(n / pp) for n in n_pages)  # at least one copy per sequence and piece
    if not explicit and not cm.may_stage(m, n_host * page_bytes, flops, (used.size - n_host) * page_bytes, calls,
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
                                 piece_pages_for(max(n_pages), P, cfg.tile_n, pieces=cm.LINK_PIECES), L)
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
    choice = cm.choose_staged(m, host_b, need - host_b, flops,
                              cm.partial_bytes(sum(q_lens), shape.num_q_heads, head_dim),
                              1 if req.one_split else req.splits, host_calls=host_calls, hbm_calls=hbm_calls,
                              in_place_bytes=n_host * page_bytes, kv_read_bytes=kv_read, heads=heads,
                              head_calls=head_calls, chunk_q=chunk_q, wave_calls=wave_calls,
                              pieces=len(any_plan.pieces),
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
    weighed by ``plan.choose_pipelined``. None where ``regular`` wins, or where the copy would not
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
    for want in cm.SPLIT_CHOICES:
        if own >= tile_pages:
            pp = max(min_pp, tile_pages * math.ceil(own / want / tile_pages))
            pp = cm.window_piece_pages(pp, own, max_pages, tile_pages, min_pp)
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
    choice, best = cm.choose_pipelined(m, host_b, plans[0].pages * page_bytes - host_b, flops,
                                       cm.partial_bytes(sum(q_lens), shape.num_q_heads, shape.head_dim), candidates,
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
    first = cm.ready_split(sp.ready_from, piece_tiles, split_tiles, splits)
    work = cm.split_work(lens, q_lens, tile_n, split_tiles, splits)
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
    ``want`` splits (``plan.q_tiled_splits``), the pieces ready at the start in splits of their own."""
    piece_tiles = sp.piece_pages * page_size // tile_n
    splits, split_tiles = cm.q_tiled_splits(max_tiles, piece_tiles, want, sp.ready_from * piece_tiles)
    return splits, split_tiles, piece_tiles


# ---- FP8 pages -------------------------------------------------------------------------------
def fp8_decode_config(configs, shape: CallShape, group: int, batch: int, context: int, q_len: int) -> DecodeConfig:
    """The config of a decode-sized call over FP8 pages: the profile's decode_fp8 entry, else
    (silently) the decode entry for 16-bit pages adapted to FP8 stages (``fp8.decode_config``),
    which warns as the decode lookup does where that is missing too."""
    from directkv_cute.fp8 import decode_config

    cfg, source = configs.get("decode_fp8", shape, group, batch, context, q_len, quiet=True)
    if source == "default" or cfg is None:
        cfg = decode_config(configs.get("decode", shape, group, batch, context, q_len)[0], shape.head_dim,
                            shape.page_size)
    return cfg


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
    ``staging.head_groups`` of one head's FP8 block of a page (two heads at page 64, d 128), the
    first group a single head where the call's compute outlasts the copy of its pages at 16 bits
    (``trails_copy`` false: the first group's copy is the exposed part; measured at 32k q8192 5.78
    ms so vs 5.93 in pairs, 8k q8192 0.961 vs 0.971; at q2048, where the compute is shorter,
    single heads cost 15%)."""
    bound = not cm.trails_copy(m, cm.kv_bytes(sum(lens), hkv, head_dim),
                               cm.causal_flops(lens, q_lens, num_q_heads, head_dim))
    return head_groups(hkv, 2 * page_size * head_dim * elem_bytes, first=1 if bound else 0)


def _plan_fp8(shape: CallShape, device: DeviceInfo, m: MachineModel, configs, config,
              req: StagingRequest = AUTOMATIC) -> AttentionPlan:
    """FP8 pages: the streaming FP8 kernel in place (decode, short windows), staged first where
    the copy engine outruns the link; multi-token calls dequantized into an HBM buffer."""
    group, q_len = shape.group, shape.max_q_len
    explicit = isinstance(config, DecodeConfig)
    kernel = config_kernel(config, group, q_len) if explicit else op_kernel(group, q_len)
    if isinstance(config, QTiledConfig) or kernel != "decode":
        return _done(_plan_fp8_chunk(shape, device, m, configs, config, req), shape, m)
    cfg = config if explicit else fp8_decode_config(configs, shape, group, shape.batch, shape.context, q_len)
    splits = cfg.splits_for(shape.batch, shape.num_kv_heads, shape.context, device.sms)
    why = ("an explicit config" if explicit else "decode_fp8 config: profile (or the decode entry adapted)",)
    in_place = AttentionPlan("decode_fp8", "decode_fp8", cfg, splits, why=(
        f"group x q_len = {group * q_len} rows fit one streaming CTA",) + why)
    sp = None if explicit else _fp8_stage_plan(shape, device, m)
    if sp is None:
        return _done(in_place, shape, m)
    if len(sp.pieces) == 1:
        return _done(dataclasses.replace(in_place, route="decode_fp8_staged", staging=sp, capture=in_place,
                                         why=in_place.why + ("long link-bound read: the copy engine moves the "
                                                             "FP8 pages and scales first",)), shape, m)
    parts = []
    for table, part_lens in split_staged_table(sp.table, shape.seq_lens, sp.piece_pages, shape.page_size):
        parts.append(FP8Part(table, part_lens, cfg.splits_for(shape.batch, shape.num_kv_heads,
                                                              max(int(part_lens.max()), 1), device.sms)))
    return _done(dataclasses.replace(
        in_place, route="decode_fp8_two_piece", splits=sum(p.splits for p in parts), staging=sp,
        fp8_parts=tuple(parts), capture=in_place,
        why=in_place.why + ("long link-bound decode: staged in two pieces, the first launch under the second's "
                            "copy",)), shape, m)


def _fp8_stage_plan(shape: CallShape, device: DeviceInfo, m: MachineModel) -> StagePlan | None:
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
    flops = cm.causal_flops(lens, q_lens, shape.num_q_heads, shape.head_dim)
    if not n_host or not cm.may_stage(m, n_host * page_bytes, flops, (used.size - n_host) * page_bytes, 2 * len(lens)):
        return None
    longest = max(n_pages)
    pp = longest
    if max(q_lens) == 1 and longest > 1:
        pp = min(longest - 1, math.ceil(longest * (1 - FP8_TAIL_SHARE)))
    sp = plan_staging(shape.host_table, lens, P, pp)
    if not device.fits_staging(sp.pages * page_bytes):
        return None
    return sp


def _plan_fp8_chunk(shape: CallShape, device: DeviceInfo, m: MachineModel, configs, config,
                    req: StagingRequest = AUTOMATIC) -> AttentionPlan:
    """Multi-token calls over FP8 pages: every page the batch reads (once, however many sequences
    share it) is copied by the copy engine into a staging buffer (the FP8 bytes and their scales),
    dequantized into a buffer in the q dtype, and the call runs over that as an all-HBM cache
    (``inner``: the multi-token kernel, or an explicit DecodeConfig's), or, where the Q-tiled
    kernel would run it, group by group of KV heads (``fp8_by_head``). The link carries each
    page's FP8 bytes and scales once. A call over the staging cap is refused before any copy.
    Of a ``StagingRequest`` only ``order`` applies here (2: lightest query tiles first): the pages
    are staged in one piece, copied group by group of heads."""
    if device.capturing:
        raise PlanError("paged_attention: multi-token calls over FP8 pages dequantize into a buffer planned per "
                        "call and cannot be captured in a CUDA graph (decode-sized calls can)")
    if shape.host_table is None:
        raise PlanError("multi-token calls over FP8 pages need the host page table (cache.kernel_tables())")
    lens, P, hkv, d = shape.seq_lens, shape.page_size, shape.num_kv_heads, shape.head_dim
    sp = plan_staging(shape.host_table, lens, P, max(math.ceil(n / P) for n in lens))  # one piece
    need = sp.pages * (shape.layer_page_bytes() + shape.layer_page_bytes(shape.compute_dtype))
    if not device.fits_staging(need):
        raise PlanError(f"paged_attention: a multi-token call over FP8 pages stages and dequantizes "
                        f"{sp.pages} pages ({need / 2**30:.2f} GiB of HBM), over the "
                        f"{device.staging_cap / 2**30:.2f} GiB cap (DIRECTKV_MAX_STAGING_GB); feed fewer sequences "
                        "or shorter contexts per call")
    group = shape.group
    cfg = None
    if isinstance(config, QTiledConfig):
        cfg = config
    elif config is None and group <= 128 and fills_a_wave(shape, device.sms):
        cfg = q_tiled_config(configs, shape, group, len(lens), max(lens), max(shape.q_lens))
    if cfg is not None:
        groups = fp8_head_groups(m, hkv, P, d, _itemsize(shape.page_dtype), lens, shape.q_lens, shape.num_q_heads)
        n_qt = q_tiles(max(shape.q_lens), group, cfg.rows)
        return AttentionPlan("fp8_by_head", "q_tiled", cfg, 1,
                             QTiledLayout(1, math.ceil(max(lens) / cfg.tile_n), 1, 0, False, req.order == 2, n_qt),
                             sp, head_groups=tuple(groups),
                             why=("FP8 pages of a multi-token call: staged, dequantized group by group of KV heads, "
                                  f"each group's Q-tiled launch under the next group's copy ({len(groups)} groups)",))
    inner_shape = shape.replace(host_table=sp.table, page_dtype=shape.compute_dtype, num_layers=1,
                                hbm_pages=sp.pages, back_to_back=False, cascade=False)
    inner = _plan_16bit(inner_shape, device, m, configs, config)
    return AttentionPlan("fp8_dequantized", None, None, 1, None, sp, inner=inner,
                         why=("FP8 pages of a multi-token call: staged and dequantized into an HBM buffer, then run "
                              "as pages all in HBM",))


# ---- shared pages: the cascade ---------------------------------------------------------------
def _plan_cascade(shape: CallShape, device: DeviceInfo, m: MachineModel, configs, cp=None) -> AttentionPlan | None:
    """The cascade of a batch whose sequences share pages (``cascade.plan_cascade``, or ``cp``), or
    one staged call of the whole batch where that is estimated faster; None where nothing is shared."""
    from directkv_cute.cascade import pack_shape, plan_cascade, sub_table

    if cp is None:
        cp = plan_cascade(shape.host_table, shape.seq_lens, shape.q_lens, shape.page_size, groups=shape.groups)
    if not cp.shared:
        return None
    plain = shape.replace(cascade=False, groups=None)
    if not device.cpu and not device.capturing and cp.host_pages_read:
        try:
            got = staging_choice(plain, device, m)
        except ValueError:
            got = None
        choice = got[0] if isinstance(got, tuple) else None
        if cm.stage_instead_of_cascade(m, cp.host_pages_read * shape.layer_page_bytes(), 1 + len(cp.spans), choice):
            whole = plan_attention(plain, device, m, configs)
            cascade_est = cm.cascade_ms(m, cp.host_pages_read * shape.layer_page_bytes(), 1 + len(cp.spans))
            return _done(AttentionPlan(
                "cascade_staged", whole.kernel, whole.config, inner=whole, cascade=cp, choice=choice,
                why=(f"shared pages: one staged call of the batch ({choice.staged_ms:.3f} ms) beats the cascade "
                     f"({cascade_est:.3f} ms)",)), shape, m)
    P, hkv, group = shape.page_size, shape.num_kv_heads, shape.group
    n_pages = [math.ceil(n / P) for n in cp.seq_lens]
    own_lens = tuple(n - lo * P for n, lo in zip(cp.seq_lens, cp.own_lo))
    own_table = sub_table(shape.host_table, range(shape.batch), cp.own_lo, n_pages)
    own_shape = plain.replace(host_table=own_table, seq_lens=own_lens, width=own_table.shape[1], max_seq_len=None,
                              back_to_back=False)
    passes = [CascadePass(None, 1, group, plan_attention(own_shape, device, m, configs), own_shape)]
    host = np.asarray(shape.host_table)
    for span in cp.spans:
        rows = sum(shape.q_lens[r] for r in span.rows) * group
        n_pseudo, g2 = pack_shape(rows)
        table = sub_table(host, [span.rows[0]] * n_pseudo, [span.page_lo] * n_pseudo, [span.page_hi] * n_pseudo)
        span_len = (span.page_hi - span.page_lo) * P
        sub = plain.replace(host_table=table, seq_lens=(span_len,) * n_pseudo, q_lens=(1,) * n_pseudo,
                            num_q_heads=hkv * g2, width=table.shape[1], max_seq_len=None, back_to_back=False)
        staged = n_pseudo > 1 and int((host[span.rows[0], span.page_lo:span.page_hi] >= 0).sum()) > 0
        p = None
        if staged:  # more than one pseudo-sequence: copied once into HBM, read by the Q-tiled kernel
            try:
                p = plan_attention(sub, device, m, configs, QTiledConfig())
            except ValueError:
                p = None  # over the staging cap, or inside a capture: read in place
        if p is None:
            p = plan_attention(sub, device, m, configs)
        passes.append(CascadePass(span.rows, n_pseudo, g2, p, sub))
    return _done(AttentionPlan("cascade", None, cascade=cp, passes=tuple(passes),
                               why=(f"{len(cp.spans)} shared span(s): {cp.host_pages_read} host pages read instead "
                                    f"of {cp.host_pages_naive}",)), shape, m)
