"""FP8 KV pages: the one statement of the format (plain torch, CPU and CUDA tensors alike).

Format
------
A value ``x`` (a K or V element, bf16/fp16/fp32) is stored as ``q = fp8(clamp(x / s, -M, M))`` with

* ``M``: the format's largest finite value, 448 for ``float8_e4m3fn`` (4 exponent, 3 mantissa bits,
  no infinities), 57344 for ``float8_e5m2`` (5 exponent, 2 mantissa bits);
* ``s``: a float32 scale, ``s = amax / M`` over the values that share it (``amax`` = the largest
  magnitude of their finite values), floored at ``SCALE_FLOOR`` so it is never 0 (an all-zero
  group stores zeros) and never inf;
* non-finite values stay non-finite and never count in the scale, so one NaN or inf leaves the
  values that share its scale as precise as without it: NaN is stored as NaN, +-inf as +-inf in
  ``float8_e5m2`` and as NaN in ``float8_e4m3fn`` (which has no infinities);
* the cast rounding to nearest, ties to even (torch's float8 conversion); the clamp first, because
  an out-of-range cast to e4m3fn gives NaN, not the maximum.

It reads back as ``x' = float32(q) * s``, cast to the compute dtype. With ``m`` mantissa bits the
scale-normalised value ``y = x / s`` (``|y| <= M``) is rounded with an error of at most
``2^-(m+1) * |y|`` while ``|y|`` is at least the smallest normal (``2^-6`` for e4m3, ``2^-14``
for e5m2), and at most half the smallest subnormal (``2^-10``, ``2^-17``) below it; so
``|x - x'| <= s * max(2^-(m+1) * |y|, 2^-(subnormal exponent + 1))``, i.e. a relative error of
``2^-4`` (e4m3) or ``2^-3`` (e5m2) plus a tiny absolute term (``round_trip_bound``).

Scale granularity (measured by ``bench/fp8_accuracy.py``; docs/FP8.md has the table)
-------------------------------------------------------------------------------------
``"token"`` -- one scale per token per KV head per K/V (a row of ``head_dim`` values): the chosen
one, and the one ``PagedKVCache`` stores. ``"page"`` -- one per page per layer per KV head per
K/V. ``"tensor"`` -- one fixed (calibrated) scale for everything.

Measured (GQA 8/2, head_dim 128, 1k and 8k contexts; output error vs float64): on random inputs
e4m3 with token, full-page or calibrated tensor scales are alike (RMS relative error 3.6-3.9e-2,
against 2.4e-3 for bf16 pages); on heavy-tailed K (a few channels 20-100x larger) token scales
are ~2x better than the best page scale and 2-4x better than a tensor scale (RMS 0.09-0.11 vs
0.20-0.21 vs 0.25-0.49): with one scale per row, the row's largest element -- the outlier channel
that dominates ``q . k`` -- maps to ``M`` exactly. A page scale fixed at the first write clamps
later outliers (error > 1). The write path and the kernel decide the rest:

* token scales are final when a token is written -- an append, a write-through to a window
  mirror, the fused K/V projection's store: every token is quantized once, on the GPU, as it is
  stored, and is never read back or requantized (DirectKV writes each new token to the host once);
* page scales must cover tokens not yet seen: either the partial page is requantized whenever its
  amax grows (a read of up to ``page_size - 1`` rows back over the link, a second rounding of
  them, and writers racing on one scale), or the scale is fixed at the first write and later
  larger tokens clamp (the "page-first" rows of the bench);
* in the kernel (``kernels/decode_fp8.py``) a token scale costs one multiply per element of the
  pass that casts each FP8 tile in SMEM to the MMA's dtype anyway, so the operands equal the
  reference's dequantized rows bit for bit; no second pass, no rescale of S or P.

Bytes per token per KV head per K/V at ``head_dim`` 128: bf16 256 B; FP8 128 B plus 4 B of token
scale (+3.1%, 0.516x bf16); page scales 4 B per (page, layer, KV head, K/V) (+0.05% at page 64);
a tensor scale none.
"""

from __future__ import annotations

import math

from collections.abc import Sequence

import torch

from directkv_cute.config import SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e5m2: 2.0**-14}
MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}
SCALE_DTYPE = torch.float32
SCALE_FLOOR = 2.0**-120  # the smallest scale: finite, a normal float32, and 1/scale too
GRANULARITIES = ("token", "page", "tensor")
GRANULARITY = "token"  # what PagedKVCache stores
NAMES = {"fp8": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
         "e5m2": torch.float8_e5m2, "float8_e5m2": torch.float8_e5m2}


def is_fp8(dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_dtype(value) -> torch.dtype:
    """An FP8 dtype from a torch dtype or a name ("fp8" = e4m3fn, "e4m3", "e5m2", torch's names)."""
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in NAMES:
            return NAMES[key]
    elif value in FP8_DTYPES:
        return value
    raise ValueError(f"FP8 dtype must be one of {FP8_DTYPES} or a name in {sorted(NAMES)}, got {value!r}")


def _dims(x: torch.Tensor, dims: Sequence[int] | int) -> tuple[int, ...]:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return tuple(sorted(d % x.dim() for d in dims))


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """float32 ``amax / M``, floored at SCALE_FLOOR (a NaN amax counts as 0, an infinite one as the
    float32 maximum; ``quantize`` passes the amax of the finite values only)."""
    amax = amax.float().nan_to_num(nan=0.0, posinf=torch.finfo(torch.float32).max)
    return (amax / FP8_MAX[fp8_dtype(dtype)]).clamp_min(SCALE_FLOOR)


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, dims: Sequence[int] | int = -1,
             scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): ``x`` in ``dtype`` with one float32 scale per slice over ``dims`` (default the
    last dim: one per row). ``scale`` given (shape of x without ``dims``, or a number): used as
    is (a calibrated scale; values beyond it clamp). The scale has x's shape without ``dims``."""
    dtype = fp8_dtype(dtype)
    dims = _dims(x, dims)
    xf = x.float()
    if scale is None:
        finite_abs = torch.nan_to_num(xf.abs(), nan=0.0, posinf=0.0)
        scale = scale_from_amax(finite_abs.amax(dim=dims) if xf.numel() else xf.sum(dim=dims), dtype)
    elif not isinstance(scale, torch.Tensor):
        scale = torch.full([s for i, s in enumerate(x.shape) if i not in dims], float(scale), dtype=SCALE_DTYPE,
                           device=x.device)
    s = scale.to(SCALE_DTYPE)
    m = FP8_MAX[dtype]
    y = (xf / _expand(s, dims)).clamp(-m, m)  # NaN stays NaN; finite values saturate at +-M
    # +-inf stays infinite where the format has infinities, else NaN (no host sync: always applied)
    inf = xf.isinf()
    y = torch.where(inf, xf, y) if dtype == torch.float8_e5m2 else y.masked_fill(inf, math.nan)
    return y.to(dtype), s


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               dims: Sequence[int] | int = -1) -> torch.Tensor:
    """``float32(q) * scale`` (the scale broadcast over ``dims``) cast to ``dtype``."""
    dims = _dims(q, dims)
    return (q.float() * _expand(scale.float(), dims)).to(dtype)


def _expand(s: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        s = s.unsqueeze(d)
    return s


def round_trip_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                     dims: Sequence[int] | int = -1) -> torch.Tensor:
    """The largest ``|x - dequantize(quantize(x))|`` the format allows, per element (float32), for
    values within the scale's range (no clamping); see the module docstring."""
    dtype = fp8_dtype(dtype)
    dims = _dims(x, dims)
    s = _expand(scale.float(), dims)
    y = (x.float() / s).abs()
    rel = 2.0 ** -(MANTISSA_BITS[dtype] + 1)
    return s * torch.maximum(rel * y, torch.full_like(y, MIN_SUBNORMAL[dtype] / 2))


def relative_error(dtype) -> float:
    """Half an ulp relative to the value: the format's relative rounding error for normals
    (bf16 2^-8, fp16 2^-11, e4m3 2^-4, e5m2 2^-3)."""
    bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, **MANTISSA_BITS}[dtype]
    return 2.0 ** -(bits + 1)


def bytes_per_row(head_dim: int, dtype: torch.dtype, granularity: str = GRANULARITY, page_size: int = 64) -> float:
    """Bytes one token's K (or V) row of one KV head costs, its share of the scales included."""
    if not is_fp8(dtype):
        return head_dim * dtype.itemsize
    scale = {"token": 4.0, "page": 4.0 / page_size, "tensor": 0.0}[granularity]
    return head_dim + scale


# ---- the FP8 decode kernel's SMEM rule (kernels/decode_fp8.py: one statement of its legality) ----
def decode_smem_bytes(cfg, head_dim: int, page_size: int | None = None, q_bytes: int = 2) -> int:
    """Dynamic SMEM of the streaming kernel over FP8 pages for a DecodeConfig: the FP8 ring
    (K and V boxes plus their fp32 token scales per stage, each copy's scales padded to the 128
    bytes a TMA destination needs), one K and one V operand tile and the Q tile in the q dtype,
    the mbarriers and the tiles' 1 KB alignment."""
    n = cfg.tile_n
    rows = min(n, page_size) if page_size else n
    scale_row = max(rows, 32) * (n // rows)  # each copy's scale box padded to 128 bytes
    ring = cfg.stages * (2 * n * head_dim + 2 * scale_row * SCALE_DTYPE.itemsize)
    operands = 2 * n * head_dim * q_bytes
    q_tile = cfg.rows * head_dim * q_bytes
    return ring + operands + q_tile + 2 * 1024


def decode_problems(cfg, head_dim: int, page_size: int | None = None, kv_dtype=torch.float8_e4m3fn) -> list[str]:
    """Why ``cfg`` cannot run the streaming kernel over ``kv_dtype`` pages: the config's rules
    (at one byte per KV element) and the kernel's SMEM (``decode_smem_bytes``)."""
    out = [] if is_fp8(kv_dtype) else [f"kv_dtype must be one of {FP8_DTYPES}, got {kv_dtype}"]
    out += cfg.problems(head_dim, page_size, 1)
    smem = decode_smem_bytes(cfg, head_dim, page_size)
    if smem > SM90_SMEM_PER_BLOCK_OPTIN:
        out.append(f"FP8 pages: needs {smem} B of SMEM, over the {SM90_SMEM_PER_BLOCK_OPTIN} B per-block limit")
    elif cfg.smem_budget() < smem + SMEM_RESERVED_PER_BLOCK:
        out.append(f"FP8 pages: needs {smem} B of SMEM, over the carveout budget {cfg.smem_budget()} B "
                   f"({cfg.carveout}% of {SM90_SMEM_PER_SM} B)")
    return out


def decode_config(cfg, head_dim: int, page_size: int | None = None):
    """A decode config (the tuned profile's or the default, chosen for 16-bit pages) as the FP8
    kernel runs it: its ring as deep as FP8 stages allow within the same SMEM (an FP8 stage is half
    the bytes), at most 12 stages, fewer where the operand tiles leave no room."""
    import dataclasses

    budget = cfg.smem_bytes(head_dim)
    best = None
    for stages in range(12, 1, -1):
        c = dataclasses.replace(cfg, stages=stages, max_inflight=min(cfg.max_inflight, stages - 1))
        fits = decode_smem_bytes(c, head_dim, page_size) <= budget or stages <= cfg.stages
        if fits and not decode_problems(c, head_dim, page_size):
            best = c
            break
    if best is None:
        raise ValueError(f"{cfg}: no stage count runs the FP8 decode kernel at head_dim {head_dim}, page {page_size}")
    return best


__all__ = ["FP8_DTYPES", "FP8_MAX", "GRANULARITIES", "GRANULARITY", "MANTISSA_BITS", "MIN_NORMAL", "MIN_SUBNORMAL",
           "SCALE_DTYPE", "SCALE_FLOOR", "bytes_per_row", "decode_config", "decode_problems", "decode_smem_bytes",
           "dequantize", "fp8_dtype", "is_fp8", "quantize",
           "relative_error", "round_trip_bound", "scale_from_amax"]
