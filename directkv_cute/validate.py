"""The one validation of the attention op's arguments, for every entry point and both devices.

``paged_attention`` (CPU reference or GPU kernels), ``paged_attention_tables`` and the
``torch.ops.directkv_cute.paged_attention`` op all call ``check_attention`` before any work, so a
mistake gets the same message wherever it is made. Plain Python, no GPU needed.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch

from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.fp8 import is_fp8

ALIGN = 16


@functools.lru_cache(maxsize=4096)
def check_config(cfg: DecodeConfig, head_dim: int, page_size: int) -> None:
    """``cfg.check``, once per (config, head_dim, page_size): the op asks on every call."""
    cfg.check(head_dim, page_size)


def check_int(value, name: str) -> int:
    """An integer argument (a Python or numpy int, never a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


# The kernels multiply scores by ``softmax_scale * log2(e)`` in fp32 after taking the row maximum
# of the unscaled scores: a scale must be positive (a negative one would turn the maximum into the
# minimum) and small enough that scaled scores stay representable. 1e4 is far beyond
# 1 / sqrt(head_dim) for any head dim (0.125 for 64), and 1e4 * log2(e) * |q.k| stays finite in
# fp32 for |q.k| up to 2.3e34.
MAX_SOFTMAX_SCALE = 1e4


def check_softmax_scale(softmax_scale) -> float | None:
    """A softmax scale: None (the default 1 / sqrt(head_dim)) or a real number in
    (0, ``MAX_SOFTMAX_SCALE``]; ``TypeError`` for a bool, string, tensor or other non-real,
    ``ValueError`` for NaN, an infinity or a value out of range. Returns it as given."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number in (0, {MAX_SOFTMAX_SCALE:g}] or None, got "
                        f"{type(softmax_scale).__name__} {_short(softmax_scale)}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number in (0, {MAX_SOFTMAX_SCALE:g}], got {softmax_scale!r}")
    if not 0 < softmax_scale <= MAX_SOFTMAX_SCALE:
        raise ValueError(f"softmax_scale {softmax_scale!r} is outside (0, {MAX_SOFTMAX_SCALE:g}]: the kernels scale "
                         f"scores by it in fp32 after their row maximum (1 / sqrt(head_dim) is the usual scale)")
    return softmax_scale


def check_max_seq_len(max_seq_len) -> int | None:
    """``max_seq_len``: None or a positive int (``TypeError`` for a bool, float or string)."""
    if max_seq_len is None:
        return None
    if isinstance(max_seq_len, (bool, np.bool_)) or not isinstance(max_seq_len, numbers.Integral):
        raise TypeError(f"max_seq_len must be a positive int or None, got {type(max_seq_len).__name__} "
                        f"{_short(max_seq_len)}")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int or None, got {int(max_seq_len)}")
    return int(max_seq_len)


def check_groups(groups, batch: int) -> tuple[tuple[int, ...], ...] | None:
    """``groups`` (the rows that may share pages): None, or a sequence of sequences of row
    indices, disjoint, each in [0, batch); returned as a tuple of tuples of ints."""
    if groups is None:
        return None
    if isinstance(groups, (str, bytes, torch.Tensor)) or not isinstance(groups, (Sequence, np.ndarray)) \
            or (isinstance(groups, np.ndarray) and groups.ndim != 2):
        raise TypeError(f"groups must be a sequence of row lists (or None), got {type(groups).__name__} "
                        f"{_short(groups)}")
    out = []
    for g in groups:
        if isinstance(g, (str, bytes, torch.Tensor)) or not isinstance(g, (Sequence, np.ndarray)) \
                or (isinstance(g, np.ndarray) and g.ndim != 1):
            raise TypeError(f"groups must be a sequence of row lists, got an entry {type(g).__name__} {_short(g)}")
        out.append(tuple(check_int(r, "every row of groups") for r in g))
    flat = [r for g in out for r in g]
    if len(set(flat)) != len(flat) or any(not 0 <= r < batch for r in flat):
        raise ValueError(f"groups must be disjoint lists of rows in [0, {batch}), got {_short(groups)}")
    return tuple(out)


def _short(value, limit: int = 80) -> str:
    """A value's repr on one line, cut to ``limit`` characters (for error messages)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit] + "..."


def check_seq_ids(seq_ids) -> list[int]:
    if isinstance(seq_ids, (numbers.Number, str, bytes, torch.Tensor)) or not isinstance(seq_ids, Sequence):
        raise TypeError(f"seq_ids must be a sequence of sequence ids, got {type(seq_ids).__name__} {seq_ids!r}")
    ids = [check_int(s, "every seq_id") for s in seq_ids]
    if not ids:
        raise ValueError("seq_ids is empty")
    return ids


def check_q_lens(q_lens, batch: int, total_q: int | None, seq_lens: Sequence[int] | None = None) -> tuple[int, ...]:
    """Query rows per sequence (default one each), checked against q's ``total_q`` rows (None:
    planned before q exists) and, when the host knows them, the sequences' lengths (a sequence's
    new tokens are part of its history)."""
    if q_lens is None:
        if total_q is not None and total_q != batch:
            raise ValueError(f"q has {total_q} rows but there are {batch} sequences and no q_lens")
        lens = (1,) * batch
    else:
        if isinstance(q_lens, torch.Tensor):
            if q_lens.dtype.is_floating_point or q_lens.dtype == torch.bool:
                raise TypeError(f"q_lens must hold integers, got a {q_lens.dtype} tensor")
            q_lens = q_lens.tolist()
        if isinstance(q_lens, (numbers.Number, str, bytes)) or not isinstance(q_lens, Sequence):
            raise TypeError(f"q_lens must be a sequence of ints, got {type(q_lens).__name__}")
        lens = tuple(check_int(n, "every q_len") for n in q_lens)
        if len(lens) != batch:
            raise ValueError(f"q_lens has {len(lens)} entries for {batch} sequences")
        if min(lens) < 1:
            raise ValueError(f"every q_len must be >= 1, got {min(lens)}")
        if total_q is not None and sum(lens) != total_q:
            raise ValueError(f"sum(q_lens) = {sum(lens)} but q has {total_q} rows")
    if seq_lens is not None:
        for i, (n, length) in enumerate(zip(lens, seq_lens)):
            if n > length:
                raise ValueError(f"q_lens[{i}] = {n} exceeds its sequence's length {length} "
                                 "(append the new tokens' K/V to the cache first)")
    return lens


def check_kernel_pages(cache) -> None:
    """The GPU kernels compute in bf16 or fp16: 16-bit pages, or FP8 pages whose compute dtype is
    one of those (a TypeError otherwise)."""
    compute = getattr(cache, "compute_dtype", None) or cache.dtype
    if compute not in (torch.bfloat16, torch.float16):
        kind = f"FP8 pages ({cache.dtype}) computed" if is_fp8(cache.dtype) else "pages"
        raise TypeError(f"the GPU attention kernels compute in bfloat16 or float16; these {kind} in {compute}")


def check_attention(q, cache, layer, *, batch: int, q_lens=None, out=None, config=None, softmax_scale=None,
                    seq_lens: Sequence[int] | None = None, cuda: bool | None = None) -> tuple[int, tuple[int, ...]]:
    """Validate one attention call; returns (layer, q_lens). ``cuda`` True: the kernels' extra
    needs (q on a GPU, contiguous and aligned, the config legal for this cache)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3 or q.layout != torch.strided:
        raise ValueError(f"q must be a dense (total_q, Hq, head_dim) tensor, got shape {tuple(q.shape)}")
    compute = getattr(cache, "compute_dtype", None) or cache.dtype
    if q.dtype != compute:
        raise TypeError(f"q has dtype {q.dtype}, the cache holds {compute}")
    total_q, hq, d = q.shape
    if d != cache.head_dim:
        raise ValueError(f"q has head_dim {d}, the cache has {cache.head_dim}")
    if hq < 1 or hq % cache.num_kv_heads:
        raise ValueError(f"Hq = {hq} is not a multiple of the cache's Hkv = {cache.num_kv_heads}")
    layer = check_int(layer, "layer")
    if not 0 <= layer < cache.num_layers:
        raise IndexError(f"layer {layer} out of range [0, {cache.num_layers})")
    check_softmax_scale(softmax_scale)
    lens = check_q_lens(q_lens, batch, total_q, seq_lens)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype \
                or out.device != q.device or not out.is_contiguous():
            desc = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                    else type(out).__name__)
            raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor on {q.device}, got {desc}")
    if config is not None:
        if not isinstance(config, (DecodeConfig, QTiledConfig)):
            raise TypeError(f"config must be a DecodeConfig or a QTiledConfig, got {type(config).__name__}")
        # Over FP8 pages a DecodeConfig runs the FP8 kernel (its own SMEM rule, checked when it
        # compiles) or the 16-bit kernels over the dequantized pages (checked there): both before
        # anything is written.
        if not (is_fp8(cache.dtype) and isinstance(config, DecodeConfig)):
            check_config(config, d, cache.page_size)
    if cuda:
        check_kernel_pages(cache)
        if not q.is_cuda:
            raise ValueError("the GPU kernels need q on a CUDA device (paged_attention runs the reference on CPU)")
        if not q.is_contiguous() or q.data_ptr() % ALIGN:
            raise ValueError("q must be contiguous and 16-byte aligned")
    return layer, lens
