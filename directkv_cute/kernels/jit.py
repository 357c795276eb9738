"""Compiling the kernels, with a cache keyed by everything that changes code generation.

``compile_decode`` and ``compile_combine`` compile on the first request for a key and return
the same compiled function afterwards. They need no GPU when ``CUTE_DSL_ARCH=sm_90a`` is set
(CI compiles every shipped config that way). Sizes are runtime arguments, never part of a key.
"""

from __future__ import annotations

import os
import threading

import torch

from directkv_cute.config import DecodeConfig

_LOCK = threading.Lock()  # cute.compile is not thread-safe
_CACHE: dict[tuple, object] = {}

_TORCH_TO_CUTLASS = {}


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    if not _TORCH_TO_CUTLASS:
        _TORCH_TO_CUTLASS.update(
            {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32,
             torch.int32: cutlass.Int32}
        )
    try:
        return _TORCH_TO_CUTLASS[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}") from None


def arch() -> str:
    """The compile target: CUTE_DSL_ARCH if set, else the current GPU's."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
    return "unknown"


def _ptr(dtype, align=16):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, 16 * 1024, cute.AddressSpace.gmem, assumed_align=align)


def decode_key(cfg: DecodeConfig, dtype: torch.dtype, head_dim: int, page_size: int, group: int, split_out: bool):
    # num_splits and ctas_per_sm only change the launch, not the code: keep them out of the key.
    return ("decode", arch(), str(dtype), head_dim, page_size, group, cfg.tile_n, cfg.stages,
            cfg.consumer_wgs, cfg.carveout, bool(split_out))


def compile_decode(cfg: DecodeConfig, dtype: torch.dtype, head_dim: int, page_size: int, group: int,
                   max_q_len: int = 1, split_out: bool = True):
    """Compile (once per key) the decode kernel; returns a callable taking the runtime arguments."""
    cfg.check(head_dim, page_size)
    if group * max_q_len > cfg.rows:
        raise ValueError(f"group {group} x q_len {max_q_len} rows exceed the config's {cfg.rows} rows")
    if cfg.rows % group:
        raise ValueError(f"GQA group {group} must divide {cfg.rows}")
    key = decode_key(cfg, dtype, head_dim, page_size, group, split_out)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            fn = _compile_decode(key, cfg, dtype, head_dim, page_size, group, split_out)
            _CACHE[key] = fn
    return fn


def _compile_decode(key, cfg, dtype, head_dim, page_size, group, split_out):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from directkv_cute.kernels.decode import DecodeAttention

    dt = cutlass_dtype(dtype)
    kernel = DecodeAttention(dt, head_dim, page_size, group, cfg, split_out)
    o_dt = cutlass.Float32 if split_out else dt
    args = (
        _ptr(dt), _ptr(o_dt), _ptr(cutlass.Float32, 4), _ptr(dt), _ptr(dt),
        _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4),
        *(Int32(1) for _ in range(9)), Float32(1.0), cuda.CUstream(0),
    )
    return cute.compile(kernel, *args)


def compile_combine(head_dim: int, dtype: torch.dtype):
    """Compile (once per key) the split-KV combine kernel."""
    key = ("combine", arch(), str(dtype), head_dim)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            import cuda.bindings.driver as cuda
            import cutlass
            import cutlass.cute as cute
            from cutlass import Int32

            from directkv_cute.kernels.combine import SplitCombine

            dt = cutlass_dtype(dtype)
            args = (_ptr(cutlass.Float32), _ptr(cutlass.Float32, 4), _ptr(dt), _ptr(cutlass.Float32, 4),
                    Int32(1), Int32(1), cuda.CUstream(0))
            fn = cute.compile(SplitCombine(dt, head_dim), *args)
            _CACHE[key] = fn
    return fn


def cache_size() -> int:
    return len(_CACHE)
