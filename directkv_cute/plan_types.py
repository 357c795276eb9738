"""The planner's vocabulary: what a call is (``CallShape``), what a caller may ask of its staging
(``StagingRequest``), where tuned configs come from (``ProfileConfigs``, ``DefaultConfigs``), and
what the planner answers (``AttentionPlan``: the route that runs the call and that route's own
fields, ``QTiledLayout``, ``PlanError``).

Each route's fields are one record (``AttentionPlan.detail``):

- ``InPlace``: the kernel reads the pages where they are, in ``splits`` KV splits (``decode``,
  ``multi_token``, ``decode_fp8``);
- ``QTiled``: the Q-tiled kernel's split layout, with the staging plan and copy-ahead of a staged
  call (``q_tiled_hbm``, ``q_tiled_staged``);
- ``StagedDecode``: FP8 decode over staged pages, in one launch or in two parts
  (``decode_fp8_staged``, ``decode_fp8_two_piece``);
- ``ByHead``: FP8 pages staged, dequantized and attended group by group of KV heads
  (``fp8_by_head``);
- ``Dequantized``: FP8 pages staged and dequantized, then the inner 16-bit plan
  (``fp8_dequantized``);
- ``CascadePasses``: the sharing tree and the plan of each pass (``cascade``);
- ``WholeBatch``: the sharing tree and one staged plan of the whole batch (``cascade_staged``).

Plain values: nothing here asks the GPU or runs anything (``directkv_cute.routes`` binds and runs a
plan; ``directkv_cute.planner`` makes it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from directkv_cute.cascade import CascadePlan
from directkv_cute.config import ConfigError, QTiledConfig, default_decode_config, default_multi_token_config
from directkv_cute.fp8 import is_fp8
from directkv_cute.plan import StagedChoice
from directkv_cute.sparse import SparseBudget
from directkv_cute.tuning.lookup import select_config
from directkv_cute.tuning.profiles import current_kernel_hash

if TYPE_CHECKING:
    from directkv_cute.routes import Route
    from directkv_cute.stage_plan import StagePlan


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
    sparse:       a ``sparse.SparseBudget``: decode rows read only their best pages (None: exact).
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
    sparse: SparseBudget | None = None

    @classmethod
    def of(cls, cache, tables, q_lens, num_q_heads: int, compute_dtype=None, *, max_seq_len=None,
           cascade: bool = False, groups=None, back_to_back=None, sparse=None) -> "CallShape":
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
                   bool(getattr(tables, "hbm_only", False)) and host is None, sparse)

    @classmethod
    def example(cls, seq_lens, q_lens=None, *, num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                page_size: int = 64, tier: str = "host", page_dtype=None, compute_dtype=None, num_layers: int = 32,
                back_to_back: bool = False, max_seq_len: int | None = None) -> "CallShape":
        """The shape of a batch laid out in a fresh cache, without one: each sequence's pages
        consecutive, all on the host (``tier`` "host"), all in HBM ("hbm"), or on the host but
        for the step's own tokens' pages mirrored in HBM ("window"). What the planner would do
        for a call: ``plan_attention(CallShape.example([32768], [2048]), ...)``."""
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
        return is_fp8(self.page_dtype)

    @property
    def context(self) -> int:
        """The longest sequence as the decode split count and profile bucket see it."""
        return self.max_seq_len if self.max_seq_len is not None else self.width * self.page_size

    @property
    def q_itemsize(self) -> int:
        return _itemsize(self.compute_dtype)

    @property
    def page_itemsize(self) -> int:
        return _itemsize(self.page_dtype)

    def layer_page_bytes(self, dtype=None) -> int:
        """Bytes of one page of one layer in ``dtype`` (default the pages'), FP8 scales included."""
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
                 own beyond these, launched first (``stage_plan.q_tiled_splits``,
                 ``stage_plan.ready_split``).
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
        return select_config(kernel, gpu_name=self.gpu_name, kernel_hash=current_kernel_hash(kernel),
                             dtype=shape.compute_dtype, head_dim=shape.head_dim, group=group,
                             page_size=shape.page_size, batch=batch, context=context, q_len=q_len,
                             rows=group * q_len, quiet=quiet)


class DefaultConfigs:
    """Every kernel's untuned default (no profile): what the tests route with."""

    def get(self, kernel: str, shape: CallShape, group: int, batch: int, context: int, q_len: int,
            quiet: bool = False):
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
    plan: AttentionPlan
    shape: CallShape = field(compare=False, repr=False)



# ---- each route's fields ---------------------------------------------------------------------
@dataclass(frozen=True)
class InPlace:
    """``decode``, ``multi_token``, ``decode_fp8``: the kernel reads the pages where they are, in
    ``splits`` KV splits (merged by the combine kernel where more than one)."""

    splits: int = 1


@dataclass(frozen=True)
class QTiled:
    """``q_tiled_hbm``, ``q_tiled_staged``: the Q-tiled kernel's split layout; for a staged call
    the copies of its host pages (``staging``) and whether they may run ahead of the current
    stream (``copy_ahead``)."""

    layout: QTiledLayout
    staging: StagePlan | None = field(default=None, repr=False)
    copy_ahead: bool = False


@dataclass(frozen=True)
class StagedDecode:
    """``decode_fp8_staged``, ``decode_fp8_two_piece``: the FP8 pages and scales copied into HBM
    (``staging``), read by the FP8 decode kernel in ``splits`` KV splits: one launch after the
    copy, or one per part (``parts``: two ``FP8Part``), the first under the second's copy."""

    splits: int
    staging: StagePlan = field(repr=False)
    parts: tuple = field(default=(), repr=False)


@dataclass(frozen=True)
class ByHead:
    """``fp8_by_head``: the FP8 pages copied (``staging``, one piece), dequantized and attended by
    the Q-tiled kernel (``layout``) group by group of KV heads (``head_groups``, in copy order)."""

    layout: QTiledLayout
    staging: StagePlan = field(repr=False)
    head_groups: tuple


@dataclass(frozen=True)
class Dequantized:
    """``fp8_dequantized``: the FP8 pages copied (``staging``) and dequantized into a buffer, then
    ``inner``, the 16-bit plan over that buffer."""

    staging: StagePlan = field(repr=False)
    inner: AttentionPlan


@dataclass(frozen=True)
class CascadePasses:
    """``cascade``: the batch's sharing tree (``cascade``) and its passes, the own pass first,
    then one per shared span, merged by their LSE."""

    cascade: CascadePlan = field(repr=False)
    passes: tuple = field(repr=False)


@dataclass(frozen=True)
class WholeBatch:
    """``cascade_staged``: a batch whose rows share pages (``cascade``) run as ``inner``, one
    staged call of the whole batch, where that is estimated faster than the cascade."""

    cascade: CascadePlan = field(repr=False)
    inner: AttentionPlan


@dataclass(frozen=True)
class Sparse:
    """``sparse_decode``: per layer, each row's ``pages`` best pages under ``budget`` are selected
    on the device into a compact table, then ``inner``, the in-place decode plan over it."""

    budget: SparseBudget
    pages: int
    inner: AttentionPlan


@dataclass(frozen=True)
class AttentionPlan:
    """How one call (or every layer of one step) runs. Frozen and printable: ``explain()``.

    route:   the ``routes.Route`` that binds, runs and explains it; a ``str``, its name
             (``plan.route == "decode"``)
    kernel:  the compiled kernel it launches ("decode", "decode_fp8", "multi_token", "q_tiled"),
             None where it runs other plans (an inner plan, the cascade's passes)
    config:  that kernel's DecodeConfig or QTiledConfig
    detail:  the route's own fields, the record its route names (``route.detail``: ``InPlace``,
             ``QTiled``, ...; None for the reference)
    capture: the plan a CUDA graph capture of the call runs instead (it reads in place)
    choice:  the cost model's verdict, where the planner weighed staging
    why:     the reasons, in the order the planner found them
    shape, machine: the call it was made for, the machine model's name
    """

    route: Route
    kernel: str | None
    config: object = None
    detail: object = None
    capture: AttentionPlan | None = field(default=None, repr=False)
    choice: StagedChoice | None = None
    why: tuple = ()
    shape: CallShape | None = field(default=None, compare=False, repr=False)
    machine: str = ""

    def __post_init__(self):
        want = self.route.detail
        if not (isinstance(self.detail, want) if want is not None else self.detail is None):
            raise TypeError(f"a {self.route} plan holds {want.__name__ if want else 'no'} detail, "
                            f"got {type(self.detail).__name__}")

    @property
    def staging(self) -> StagePlan | None:
        """The copies of the pages the plan stages into HBM per call (None: it stages none)."""
        return getattr(self.detail, "staging", None)

    @property
    def staged(self) -> bool:
        return self.staging is not None

    def explain(self) -> str:
        """Which kernel runs and why, with the cost model's numbers."""
        return self.route.explain(self)


class PlanError(ValueError):
    """A call the asked-for kernel cannot run (raised before anything is launched)."""
