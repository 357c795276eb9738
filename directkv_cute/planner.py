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

and returns a frozen ``AttentionPlan`` (``directkv_cute.plan_types``): the route that runs the
call (``directkv_cute.routes``, each named in ``ROUTES``) with that route's own fields: which
kernel runs with which config, whether and how the host pages are staged into HBM first, the FP8
variant, the cascade's passes, and the plan a CUDA graph capture runs instead. Every routing
decision is made here, once; how a staged call is cut into pieces, splits and copy runs, and
which such plan the cost model prefers, is ``directkv_cute.stage_plan``'s. ``plan.explain()``
says which and why, with the cost model's numbers. ``directkv_cute.runner`` executes a plan. No
GPU is asked.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from directkv_cute.cascade import pack_shape, plan_cascade, sub_table
from directkv_cute.config import DecodeConfig, QTiledConfig, multi_token_splits, q_tiles
from directkv_cute.fp8 import decode_config as fp8_decode_adapted
from directkv_cute.kernels.specs import config_kernel, op_kernel
from directkv_cute.kernels.specs import get as get_spec
from directkv_cute.machine import DeviceInfo, MachineModel
from directkv_cute.plan import causal_flops, cascade_ms, compute_bound, stage_instead_of_cascade
from directkv_cute.plan_types import (AUTOMATIC, AttentionPlan, ByHead, CallShape, CascadePass, CascadePasses,
                                      DefaultConfigs, Dequantized, FP8Part, InPlace, PlanError, ProfileConfigs,
                                      QTiled, QTiledLayout, Sparse, StagedDecode, StagingRequest, WholeBatch)
from directkv_cute.routes import (ROUTES, Cascade, CascadeStaged, Decode, DecodeFP8, DecodeFP8Staged,
                                  DecodeFP8TwoPiece, FP8ByHead, FP8Dequantized, MultiToken, QTiledHBM, QTiledStaged,
                                  Reference, SparseDecode)
from directkv_cute.stage_plan import (SLOTS, fp8_head_groups, fp8_stage_plan, pages_used, plan_staging,
                                      split_staged_table, staged_layout, staging_choice)

__all__ = ["ROUTES", "AttentionPlan", "CallShape", "DefaultConfigs", "PlanError", "ProfileConfigs", "StagingRequest",
           "fills_a_wave", "fp8_decode_config", "plan_attention", "q_tiled_config"]


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
    if shape.sparse is not None:
        got = _plan_sparse(shape, device, machine, configs, config)
        if got is not None:
            return got
    if shape.cascade and shape.host_table is not None and config is None:
        got = _plan_cascade(shape, device, machine, configs, cascade_plan)
        if got is not None:
            return got
    if device.cpu:
        return _done(AttentionPlan(Reference(), None, why=("a CPU cache: the float32 reference",)), shape, machine)
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
        return AttentionPlan(MultiToken(), kernel, cfg, InPlace(splits), why=(
            f"group x q_len = {group * q_len} rows exceed one streaming CTA's", why))
    splits = cfg.splits_for(shape.batch, hkv, shape.context, device.sms)
    return AttentionPlan(Decode(), kernel, cfg, InPlace(splits), why=(
        f"group x q_len = {group * q_len} rows fit one streaming CTA", why))


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


def _q_tiled_route(shape: CallShape, device: DeviceInfo, m: MachineModel, configs, config,
                   req: StagingRequest = AUTOMATIC):
    """The Q-tiled plan of a call, or None where another kernel runs it.

    It runs directly when every page of a multi-token call is in HBM and its query tiles fill a
    wave, or over host pages staged into HBM when the cost model (``stage_plan.staging_choice``)
    says the copy plus its compute beats reading in place: compute-bound chunks, and long
    link-bound reads (decode included), where the copy engine outruns the SMs' reads of host
    memory. An explicit QTiledConfig always runs it, or raises where it cannot, staged as ``req``
    asks; without one the config is the tuned profile's, looked up once the call is one the
    kernel may run."""
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
            return AttentionPlan(QTiledHBM(), "q_tiled", cfg, QTiled(
                QTiledLayout(1, math.ceil(max(lens) / cfg.tile_n), 1, 0, False, req.order == 2, n_qt)), why=(why,))
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
    layout = staged_layout(stage_plan, shape.page_size, cfg.tile_n, max(lens), want, by_head, order == 2,
                           q_tiles(max(q_lens), group, cfg.rows))
    buffer_bytes = stage_plan.pages * shape.layer_page_bytes()
    ahead = device.copies_ahead and device.fits_staging(buffer_bytes, SLOTS)
    bound = "compute-bound" if compute_bound(m, n_host * shape.layer_page_bytes(shape.compute_dtype),
                                             causal_flops(lens, q_lens, shape.num_q_heads, shape.head_dim)) \
        else "link-bound"
    why = (asked if explicit else
           f"{bound}: staged beats in place ({choice.staged_ms:.3f} vs {choice.in_place_ms:.3f} ms)",
           "copy head by head" if by_head else ("one wave in coarse pieces" if choice.coarse else
                                                 f"{layout.splits} split(s) folded in the kernel"))
    if choice.pipelined:
        why += ("planned for its copy running ahead of its kernel (back-to-back calls)",)
    return AttentionPlan(QTiledStaged(), "q_tiled", cfg, QTiled(layout, stage_plan, ahead), choice=choice, why=why)


# ---- FP8 pages -------------------------------------------------------------------------------
def fp8_decode_config(configs, shape: CallShape, group: int, batch: int, context: int, q_len: int) -> DecodeConfig:
    """The config of a decode-sized call over FP8 pages: the profile's decode_fp8 entry, else
    (silently) the decode entry for 16-bit pages adapted to FP8 stages (``fp8.decode_config``),
    which warns as the decode lookup does where that is missing too."""
    cfg, source = configs.get("decode_fp8", shape, group, batch, context, q_len, quiet=True)
    if source == "default" or cfg is None:
        cfg = fp8_decode_adapted(configs.get("decode", shape, group, batch, context, q_len)[0], shape.head_dim,
                                 shape.page_size)
    return cfg


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
    in_place = AttentionPlan(DecodeFP8(), "decode_fp8", cfg, InPlace(splits), why=(
        f"group x q_len = {group * q_len} rows fit one streaming CTA",) + why)
    sp = None if explicit else fp8_stage_plan(shape, device, m)
    if sp is None:
        return _done(in_place, shape, m)
    if len(sp.pieces) == 1:
        return _done(AttentionPlan(DecodeFP8Staged(), "decode_fp8", cfg, StagedDecode(splits, sp), capture=in_place,
                                   why=in_place.why + ("long link-bound read: the copy engine moves the FP8 pages "
                                                       "and scales first",)), shape, m)
    parts = []
    for table, part_lens in split_staged_table(sp.table, shape.seq_lens, sp.piece_pages, shape.page_size):
        parts.append(FP8Part(table, part_lens, cfg.splits_for(shape.batch, shape.num_kv_heads,
                                                              max(int(part_lens.max()), 1), device.sms)))
    return _done(AttentionPlan(
        DecodeFP8TwoPiece(), "decode_fp8", cfg, StagedDecode(sum(p.splits for p in parts), sp, tuple(parts)),
        capture=in_place, why=in_place.why + ("long link-bound decode: staged in two pieces, the first launch under "
                                              "the second's copy",)), shape, m)


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
        groups = fp8_head_groups(m, hkv, P, d, shape.page_itemsize, lens, shape.q_lens, shape.num_q_heads)
        n_qt = q_tiles(max(shape.q_lens), group, cfg.rows)
        layout = QTiledLayout(1, math.ceil(max(lens) / cfg.tile_n), 1, 0, False, req.order == 2, n_qt)
        return AttentionPlan(FP8ByHead(), "q_tiled", cfg, ByHead(layout, sp, tuple(groups)),
                             why=("FP8 pages of a multi-token call: staged, dequantized group by group of KV heads, "
                                  f"each group's Q-tiled launch under the next group's copy ({len(groups)} groups)",))
    inner_shape = shape.replace(host_table=sp.table, page_dtype=shape.compute_dtype, num_layers=1,
                                hbm_pages=sp.pages, back_to_back=False, cascade=False)
    inner = _plan_16bit(inner_shape, device, m, configs, config)
    return AttentionPlan(FP8Dequantized(), None, None, Dequantized(sp, inner),
                         why=("FP8 pages of a multi-token call: staged and dequantized into an HBM buffer, then run "
                              "as pages all in HBM",))


# ---- shared pages: the cascade ---------------------------------------------------------------
def _plan_cascade(shape: CallShape, device: DeviceInfo, m: MachineModel, configs, cp=None) -> AttentionPlan | None:
    """The cascade of a batch whose sequences share pages (``cascade.plan_cascade``, or ``cp``), or
    one staged call of the whole batch where that is estimated faster; None where nothing is shared."""
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
        if stage_instead_of_cascade(m, cp.host_pages_read * shape.layer_page_bytes(), 1 + len(cp.spans), choice):
            whole = plan_attention(plain, device, m, configs)
            cascade_est = cascade_ms(m, cp.host_pages_read * shape.layer_page_bytes(), 1 + len(cp.spans))
            return _done(AttentionPlan(
                CascadeStaged(), whole.kernel, whole.config, WholeBatch(cp, whole), choice=choice,
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
    return _done(AttentionPlan(Cascade(), None, detail=CascadePasses(cp, tuple(passes)),
                               why=(f"{len(cp.spans)} shared span(s): {cp.host_pages_read} host pages read instead "
                                    f"of {cp.host_pages_naive}",)), shape, m)



def _plan_sparse(shape: CallShape, device: DeviceInfo, machine: MachineModel, configs, config) -> AttentionPlan | None:
    """Decode rows under a ``SparseBudget``: the plan of the compact table of each row's selected
    pages (the in-place decode kernel, its splits for the budget's context), where the budget
    reads fewer pages than the longest sequence has; None (exact) for multi-token rows or a budget
    that covers every page."""
    if shape.max_q_len != 1:
        return None  # prefill and multi-token rows stay exact
    P = shape.page_size
    max_pages = math.ceil(max(shape.seq_lens) / P) if shape.seq_lens else shape.width
    pages = shape.sparse.budget_pages(max_pages)
    if pages >= max_pages:
        return None
    inner_shape = shape.replace(host_table=None, seq_lens=tuple(min(n, pages * P) for n in shape.seq_lens)
                                if shape.seq_lens else None, width=pages, max_seq_len=pages * P, cascade=False,
                                hbm_only=False, sparse=None)
    inner = plan_attention(inner_shape, device, machine, configs, config)
    why = (f"decode rows under a budget of {pages} of {max_pages} pages: each layer reads each row's best pages",)
    return _done(AttentionPlan(SparseDecode(), inner.kernel, inner.config, Sparse(shape.sparse, pages, inner),
                               why=why), shape, machine)
