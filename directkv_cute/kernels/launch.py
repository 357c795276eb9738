"""Launching compiled kernels with torch tensors: raw UVA pointers, sizes, the current stream."""

from __future__ import annotations

import math

import torch

from directkv_cute.cache.pages import kernel_host_pool, kernel_host_scales
from directkv_cute.fp8 import is_fp8
from directkv_cute.kernels.jit import cutlass_dtype

LOG2_E = math.log2(math.e)


def _ptr(t: torch.Tensor, align: int = 16, dtype: torch.dtype | None = None):
    """A global-memory pointer to ``t``'s storage, typed as ``t`` (or as ``dtype``: an argument
    the kernel never reads)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(cutlass_dtype(dtype or t.dtype), t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def fold_turn_count(batch: int, num_kv_heads: int, n_q_tiles: int) -> int:
    """Turn counters a folding Q-tiled launch uses: one per (sequence, KV head, grid x, warpgroup),
    grid x rounded up to whole clusters of two."""
    return batch * num_kv_heads * (-(-n_q_tiles // 2) * 2) * 2


def _stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


_LINK_COUNTERS: dict[int, torch.Tensor] = {}


def link_counters(device: torch.device, capturing: bool) -> torch.Tensor:
    """The device's (2,) int32 link-ticket counters (issued, landed), shared by every launch in
    this process so ``link_credits`` bounds the host reads in flight across concurrent kernels.
    They only ever grow (int32, wrapping); every launch reports each ticket it takes. They are
    allocated on the first call on a device, which must not be inside a CUDA graph capture
    (``capturing``: the current stream captures one; the allocation would come from the graph's
    private pool and die with it)."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    counters = _LINK_COUNTERS.get(index)
    if counters is None:
        if capturing:
            raise RuntimeError(
                f"paged_attention: call it once outside CUDA graph capture on cuda:{index} first (it compiles its "
                "kernels and allocates the device's link counters then); later calls can be captured")
        counters = _LINK_COUNTERS.setdefault(index, torch.zeros(2, dtype=torch.int32, device=f"cuda:{index}"))
    return counters


def launch_decode(fn, q, o, lse, cache, layer, page_table, seq_lens, cu_q, num_splits, scale, counters):
    """Run a compiled streaming / multi-token kernel (or the FP8-page one, which also takes the
    scale pools beside the page pools). o/lse are the final (q dtype / fp32) outputs when
    num_splits == 1, else the fp32 split partials (splits, ...); ``counters`` is
    ``link_counters(q.device, capturing)``."""
    from cutlass import Float32, Int32

    # The device-side alias of the pinned pool (its UVA/device address), not the host tensor.
    host = kernel_host_pool(cache)
    hbm = cache.hbm_pool
    no_hbm = hbm is None or hbm.numel() == 0
    if no_hbm:  # no HBM tier: a valid stand-in the kernel never reads
        hbm = host
    scales = ()
    if is_fp8(cache.dtype):
        host_s = kernel_host_scales(cache)
        scales = (_ptr(host_s), _ptr(host_s if no_hbm else cache.hbm_scales))
    batch, max_pages = page_table.shape
    fn(
        _ptr(q), _ptr(o), _ptr(lse, 4), _ptr(host), _ptr(hbm), *scales,
        _ptr(page_table, 4), _ptr(seq_lens, 4), _ptr(cu_q, 4), _ptr(counters, 4),
        Int32(batch), Int32(q.shape[0]), Int32(cache.num_kv_heads), Int32(cache.num_layers), Int32(layer),
        Int32(host.shape[0]), Int32(hbm.shape[0]), Int32(max_pages), Int32(num_splits),
        Float32(scale * LOG2_E), _stream(),
    )


def _head_range(heads, num_kv_heads: int) -> range:
    """``heads`` (None: every KV head) checked to be consecutive KV heads of ``num_kv_heads``."""
    heads = range(num_kv_heads) if heads is None else heads
    if heads.step != 1 or not 0 <= heads.start < heads.stop <= num_kv_heads:
        raise ValueError(f"heads {heads} is not a range of consecutive KV heads within {num_kv_heads}")
    return heads


def launch_q_tiled(fn, q, out, lse, host, hbm, num_layers, layer, num_kv_heads, page_table, seq_lens, cu_q, ready,
                   n_q_tiles, num_splits, split_tiles, epoch, piece_tiles, scale, ascending=False, flag_stride=0,
                   heads=None, split_first=0, fold=None):
    """Run the compiled Q-tiled kernel over ``hbm`` (the HBM pool, or a staging buffer with one
    layer) and, for page entries >= 0, ``host``: the host pool, unread unless the table holds such
    entries, or for a staged launch ``staging.hbm_in_place``'s one-layer view of the HBM pool (the
    pages it reads where they are). ``flag_stride``: ready flags per KV
    head of a copy staged head by head (0: the heads share each piece's flag; one split only).
    ``heads``: a range of KV heads to run (their query, output and LSE rows; default all). The
    launch runs ``num_splits`` splits of ``split_tiles`` KV tiles, from ``split_first`` on, wrapping
    at ``num_splits``; more than one needs a kernel compiled with ``fold`` and ``fold`` = (accumulator
    (total_q, Hq, d) fp32, its LSE (total_q, Hq) fp32, ``fold_turn_count`` zeroed int32 counters,
    which the launch leaves at zero: ``Stager.fold_turns``): the splits fold into them in that
    order, the last writing ``out`` and ``lse``."""
    from cutlass import Float32, Int32

    heads = _head_range(heads, num_kv_heads)
    if not 0 <= split_first < num_splits or (flag_stride and num_splits != 1):
        raise ValueError(f"split {split_first} of {num_splits} (a copy staged head by head, flag_stride: one split)")
    if flag_stride and len(heads) != num_kv_heads:
        raise ValueError("a copy staged head by head (flag_stride) needs a launch over every KV head")
    if (fold is not None) != (num_splits > 1):
        raise ValueError(f"{num_splits} KV splits {'need' if num_splits > 1 else 'take no'} fold buffers")
    if fold is not None:
        acc, acc_lse, turns = fold
        if acc.shape != q.shape or acc.dtype != torch.float32 or acc_lse.shape != lse.shape \
                or acc_lse.dtype != torch.float32 \
                or turns.numel() < fold_turn_count(page_table.shape[0], num_kv_heads, n_q_tiles):
            raise ValueError("fold needs an fp32 accumulator shaped as q, an fp32 LSE shaped as lse and fold_turn_count "
                             "zeroed turn counters")
        acc, acc_lse, turns = _ptr(acc), _ptr(acc_lse, 4), _ptr(turns, 4)
    else:  # never read
        acc, acc_lse, turns = _ptr(lse, dtype=torch.float32), _ptr(lse, 4, torch.float32), _ptr(ready, 4)
    batch, max_pages = page_table.shape
    fn(
        _ptr(q), _ptr(out), _ptr(lse, 4), _ptr(host), _ptr(hbm),
        _ptr(page_table, 4), _ptr(seq_lens, 4), _ptr(cu_q, 4), _ptr(ready, 4), acc, acc_lse, turns,
        Int32(batch), Int32(q.shape[0]), Int32(num_kv_heads), Int32(num_layers), Int32(layer),
        Int32(host.shape[0]), Int32(hbm.shape[0]), Int32(max_pages), Int32(n_q_tiles), Int32(num_splits),
        Int32(split_tiles), Int32(int(ascending)), Int32(epoch), Int32(piece_tiles), Int32(flag_stride),
        Int32(heads.start), Int32(len(heads)), Int32(split_first), Float32(scale * LOG2_E),
        _stream(),
    )


def launch_combine(fn, o_part, lse_part, out, lse, num_splits):
    from cutlass import Int32

    rows = out.shape[0] * out.shape[1]
    fn(_ptr(o_part), _ptr(lse_part, 4), _ptr(out), _ptr(lse, 4), Int32(rows), Int32(num_splits), _stream())


def launch_dequant(fn, raw, scales, out, heads=None):
    """Dequantize KV heads ``heads`` (a range, default all) of staged FP8 pages ``raw`` (pages, 1,
    Hkv, 2, P, d) with their ``scales`` (pages, 1, Hkv, 2, P) fp32 into ``out`` (``raw``'s shape,
    the 16-bit dtype the kernel was compiled for), on the current stream."""
    from cutlass import Int32, Int64

    pages, _, hkv = raw.shape[:3]
    heads = _head_range(heads, hkv)
    if out.shape != raw.shape or scales.shape != raw.shape[:-1] or scales.dtype != torch.float32:
        raise ValueError(f"dequant: pages {tuple(raw.shape)}, scales {tuple(scales.shape)} {scales.dtype}, "
                         f"out {tuple(out.shape)} do not match")
    if not (raw.is_contiguous() and scales.is_contiguous() and out.is_contiguous()):
        raise ValueError("dequant: the buffers must be contiguous")
    if raw.data_ptr() % 16 or out.data_ptr() % 16 or scales.data_ptr() % 4:
        raise ValueError("dequant: the page buffers must be 16-byte aligned")
    fn(Int64(raw.data_ptr()), Int64(scales.data_ptr()), Int64(out.data_ptr()), Int32(pages), Int32(hkv),
       Int32(heads.start), Int32(len(heads)), _stream())
