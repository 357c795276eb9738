"""Compiling the kernels, with a cache keyed by everything that changes code generation.

``compile_decode`` and ``compile_combine`` compile on the first request for a key and return
the same compiled function afterwards. They need no GPU when ``CUTE_DSL_ARCH=sm_90a`` is set
(CI compiles every shipped config that way). Sizes are runtime arguments, never part of a key.

Compiled kernels also persist on disk (``export_to_c`` objects, loaded back with
``cute.runtime.load_module``), so a new process skips compilation. The folder is
``$DIRECTKV_CACHE_DIR`` (default ``~/.cache/directkv_cute``) / ``sources.cache_fingerprint()``
(the code files of every kernel, config rules included, and the cutlass-dsl version);
``DIRECTKV_DISK_CACHE=0`` (or false / no / off) turns it off. ``disk_cache`` decides what may be loaded: private
folders, objects authenticated by a per-user key, writes renamed into place under a lock.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

from directkv_cute.config import DecodeConfig, QTiledConfig
from directkv_cute.fp8 import decode_problems
from directkv_cute.paths import kernel_cache_root
from directkv_cute.kernels import disk_cache, sources, specs

_LOCK = threading.Lock()  # cute.compile is not thread-safe
_CACHE: dict[tuple, object] = {}


def source_fingerprint() -> str:
    """The disk cache's folder name for these sources and this cutlass-dsl."""
    return sources.cache_fingerprint()


def disk_cache_dir() -> Path | None:
    """The disk cache's folder, None when it is turned off (``paths.kernel_cache_root``: a bad
    value of its variables raises there, before anything is compiled)."""
    root = kernel_cache_root()
    return None if root is None else root / source_fingerprint()


def _cached_compile(key: tuple, build):
    """Memory cache -> disk cache -> build(); returns the compiled callable."""
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            fn = _load_or_build(key, build)
            _CACHE[key] = fn
    return fn


def object_name(key: tuple) -> str:
    return "dk_" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]


def _load_or_build(key: tuple, build):
    return disk_cache.load_or_build(disk_cache_dir(), object_name(key), build, _load_object)


def _load_object(path: str, name: str):
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(path), name)


_TORCH_TO_CUTLASS = {}


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    if not _TORCH_TO_CUTLASS:
        _TORCH_TO_CUTLASS.update(
            {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32,
             torch.int32: cutlass.Int32, torch.float8_e4m3fn: cutlass.Float8E4M3FN,
             torch.float8_e5m2: cutlass.Float8E5M2}
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


def decode_key(cfg: DecodeConfig, dtype: torch.dtype, head_dim: int, page_size: int, group: int, split_out: bool,
               multi_token: bool = False, trace=None):
    # The config enters the key as its kernel's spec states (``KernelSpec.key_config``): the
    # fields that generate code as they are, the launch-only ones (num_splits; ctas_per_sm
    # beyond the occupancy it resolves to; the chunk walk outside the multi-token kernel) fixed.
    code = specs.paged_kernel(multi_token).key_values(cfg, head_dim)
    key = ("decode", arch(), str(dtype), head_dim, page_size, group, bool(split_out), bool(multi_token), *code)
    return key if trace is None else (*key, "trace", trace.addr, trace.chunk, bool(trace.skip_passes))


def compile_decode(cfg: DecodeConfig, dtype: torch.dtype, head_dim: int, page_size: int, group: int,
                   max_q_len: int = 1, split_out: bool = True, multi_token: bool = False, trace=None):
    """Compile (once per key) a paged attention kernel over host pages; returns a callable taking
    the runtime arguments. ``multi_token=False``: the streaming kernel (``decode``: KV tiles stream
    through the SMEM ring; every query row of a KV head fits one CTA); ``multi_token=True``: the
    multi-token kernel (``multi_token``: each CTA keeps its KV chunk, ``cfg.chunk`` tiles, in SMEM
    and applies it to any number of query rows, walking its split a chunk at a time while the
    next chunk loads). The kernel's spec states its shape rules (``KernelSpec.shape_problems``)."""
    cfg.check(head_dim, page_size)
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
    problems = specs.paged_kernel(multi_token).shape_problems(cfg, group, max_q_len)
    if problems:
        raise ValueError(problems[0])
    if trace is not None and not multi_token:
        raise ValueError("timeline stamps (trace) exist in the multi-token kernel only")
    key = decode_key(cfg, dtype, head_dim, page_size, group, split_out, multi_token, trace)
    build = lambda: _compile_decode(cfg, dtype, head_dim, page_size, group, split_out, multi_token, trace)  # noqa: E731
    if trace is not None:
        return _traced_compile(key, build)
    return _cached_compile(key, build)


def compile_multi_token(cfg: DecodeConfig, dtype: torch.dtype, head_dim: int, page_size: int, group: int,
                        trace=None):
    """The multi-token (KV-outer chunk) kernel; always writes split partials. ``trace``
    (``kernels.trace.Trace``) compiles timeline stamps in."""
    return compile_decode(cfg, dtype, head_dim, page_size, group, 1, split_out=True, multi_token=True, trace=trace)


def _traced_compile(key: tuple, build):
    """Memory cache only: a traced kernel's code holds a buffer address of this process."""
    fn = _CACHE.get(key)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                fn = _CACHE[key] = build()
    return fn


def _compile_decode(cfg, dtype, head_dim, page_size, group, split_out, multi_token, trace=None):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    dt = cutlass_dtype(dtype)
    if multi_token:
        # CuTe DSL (cutlass) loads only to compile: the keys and the compile cache import without it
        from directkv_cute.kernels.multi_token import MultiTokenAttention

        kernel = MultiTokenAttention(dt, head_dim, page_size, group, cfg, split_out, trace)
    else:
        # CuTe DSL (cutlass) loads only to compile: the keys and the compile cache import without it
        from directkv_cute.kernels.decode import DecodeAttention

        kernel = DecodeAttention(dt, head_dim, page_size, group, cfg, split_out)
    o_dt = cutlass.Float32 if split_out else dt
    args = (
        _ptr(dt), _ptr(o_dt), _ptr(cutlass.Float32, 4), _ptr(dt), _ptr(dt),
        _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4),
        *(Int32(1) for _ in range(9)), Float32(1.0), cuda.CUstream(0),
    )
    return cute.compile(kernel, *args)


def decode_fp8_key(cfg: DecodeConfig, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, page_size: int,
                   group: int, split_out: bool):
    # The config as the streaming kernel's spec keeps it; the page format adds the FP8 dtype.
    code = specs.get("decode_fp8").key_values(cfg, head_dim)
    return ("decode_fp8", arch(), str(dtype), str(kv_dtype), head_dim, page_size, group, bool(split_out), *code)


def compile_decode_fp8(cfg: DecodeConfig, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, page_size: int,
                       group: int, max_q_len: int = 1, split_out: bool = True):
    """Compile (once per key) the streaming kernel over FP8 pages (``kernels/decode_fp8.py``):
    ``kv_dtype`` float8_e4m3fn or float8_e5m2 pages with their fp32 token scales, queries and
    outputs in ``dtype``."""
    problems = decode_problems(cfg, head_dim, page_size, kv_dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        problems.insert(0, f"dtype must be bfloat16 or float16, got {dtype}")
    problems += specs.get("decode_fp8").shape_problems(cfg, group, max_q_len)
    if problems:
        raise ValueError(problems[0])
    key = decode_fp8_key(cfg, dtype, kv_dtype, head_dim, page_size, group, split_out)
    return _cached_compile(key, lambda: _compile_decode_fp8(cfg, dtype, kv_dtype, head_dim, page_size, group,
                                                            split_out))


def _compile_decode_fp8(cfg, dtype, kv_dtype, head_dim, page_size, group, split_out):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    # CuTe DSL (cutlass) loads only to compile: the keys and the compile cache import without it
    from directkv_cute.kernels.decode_fp8 import DecodeFP8Attention

    dt = cutlass_dtype(dtype)
    kv_dt = cutlass_dtype(kv_dtype)
    kernel = DecodeFP8Attention(dt, kv_dt, head_dim, page_size, group, cfg, split_out)
    o_dt = cutlass.Float32 if split_out else dt
    f32 = cutlass.Float32
    args = (
        _ptr(dt), _ptr(o_dt), _ptr(f32, 4), _ptr(kv_dt), _ptr(kv_dt), _ptr(f32), _ptr(f32),
        _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4),
        *(Int32(1) for _ in range(9)), Float32(1.0), cuda.CUstream(0),
    )
    return cute.compile(kernel, *args)


def q_tiled_key(cfg: QTiledConfig, dtype: torch.dtype, head_dim: int, page_size: int, group: int,
                wait_ready: bool, fold: bool = False):
    # Every config field generates code. The plan's staging (pieces, KV splits, launch and copy
    # order) enters as runtime arguments (piece_tiles, num_splits / split_tiles, ascending,
    # flag_stride), except that more than one split folds them (fold).
    return ("q_tiled", arch(), str(dtype), head_dim, page_size, group, bool(wait_ready), bool(fold),
            *specs.get("q_tiled").key_values(cfg, head_dim))


def compile_q_tiled(cfg: QTiledConfig, dtype: torch.dtype, head_dim: int, page_size: int, group: int,
                    wait_ready: bool, fold: bool = False):
    """Compile (once per key) the Q-tiled kernel over HBM-resident (or staged) KV; ``wait_ready``
    makes its producer wait for each staged piece's ready flag; ``fold`` runs several KV splits,
    each query tile's folded into one fp32 accumulator in launch order (the last writing O)."""
    cfg.check(head_dim, page_size)
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
    problems = specs.get("q_tiled").shape_problems(cfg, group)
    if problems:
        raise ValueError(problems[0])
    key = q_tiled_key(cfg, dtype, head_dim, page_size, group, wait_ready, fold)
    return _cached_compile(key, lambda: _compile_q_tiled(cfg, dtype, head_dim, page_size, group, wait_ready, fold))


def _compile_q_tiled(cfg, dtype, head_dim, page_size, group, wait_ready, fold):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    # CuTe DSL (cutlass) loads only to compile: the keys and the compile cache import without it
    from directkv_cute.kernels.q_tiled import QTiledAttention

    dt = cutlass_dtype(dtype)
    kernel = QTiledAttention(dt, head_dim, page_size, group, cfg, wait_ready, bool(fold))
    args = (
        _ptr(dt), _ptr(dt), _ptr(cutlass.Float32, 4), _ptr(dt), _ptr(dt),
        _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4), _ptr(cutlass.Int32, 4),
        _ptr(cutlass.Float32), _ptr(cutlass.Float32, 4), _ptr(cutlass.Int32, 4),
        *(Int32(1) for _ in range(18)), Float32(1.0), cuda.CUstream(0),
    )
    return cute.compile(kernel, *args)


def combine_key(head_dim: int, dtype: torch.dtype):
    return ("combine", arch(), str(dtype), head_dim)


def compile_combine(head_dim: int, dtype: torch.dtype):
    """Compile (once per key) the split-KV combine kernel."""
    return _cached_compile(combine_key(head_dim, dtype), lambda: _compile_combine(head_dim, dtype))


def _compile_combine(head_dim, dtype):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    # CuTe DSL (cutlass) loads only to compile: the keys and the compile cache import without it
    from directkv_cute.kernels.combine import SplitCombine

    dt = cutlass_dtype(dtype)
    args = (_ptr(cutlass.Float32), _ptr(cutlass.Float32, 4), _ptr(dt), _ptr(cutlass.Float32, 4),
            Int32(1), Int32(1), cuda.CUstream(0))
    return cute.compile(SplitCombine(dt, head_dim), *args)


def dequant_key(kv_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, page_size: int):
    return ("dequant", arch(), str(kv_dtype), str(dtype), head_dim, page_size)


def compile_dequant(kv_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, page_size: int):
    """Compile (once per key) the kernel that dequantizes staged FP8 pages into 16-bit ones."""
    if kv_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"kv_dtype must be float8_e4m3fn or float8_e5m2, got {kv_dtype}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
    return _cached_compile(dequant_key(kv_dtype, dtype, head_dim, page_size),
                           lambda: _compile_dequant(kv_dtype, dtype, head_dim, page_size))


def _compile_dequant(kv_dtype, dtype, head_dim, page_size):
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    # CuTe DSL (cutlass) loads only to compile: the keys and the compile cache import without it
    from directkv_cute.kernels.dequant import DequantizePages

    kernel = DequantizePages(cutlass_dtype(kv_dtype), cutlass_dtype(dtype), head_dim, page_size)
    args = (Int64(0), Int64(0), Int64(0), *(Int32(1) for _ in range(4)), cuda.CUstream(0))
    return cute.compile(kernel, *args)


def cache_size() -> int:
    """Kernels compiled or loaded by this process."""
    return len(_CACHE)


def clear_memory_cache() -> None:
    """Forget this process's compiled kernels (the disk cache stays)."""
    with _LOCK:
        _CACHE.clear()


def kv_proj_key(cfg, dtype: torch.dtype, hidden: int, kv_heads: int, head_dim: int, page_size: int, bias: bool,
                to_host: bool, to_hbm: bool, to_out: bool):
    # The config enters as its spec states (splits is a launch argument); sizes (tokens, pages,
    # layers, the layer) are runtime arguments.
    return ("kv_proj", arch(), str(dtype), hidden, kv_heads, head_dim, page_size, bool(bias), bool(to_host),
            bool(to_hbm), bool(to_out), *specs.get("kv_proj").key_values(cfg, head_dim))


def compile_kv_proj(cfg, dtype: torch.dtype, hidden: int, kv_heads: int, head_dim: int, page_size: int, bias: bool,
                    to_host: bool, to_hbm: bool, to_out: bool):
    """Compile (once per key) the fused K/V projection + RoPE + store kernel (``kernels/kv_proj.py``)
    for a ``KVProjConfig``; ``page_size`` 0 when it stores to no pool."""
    cfg.check(head_dim, page_size or None, 2, hidden)
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
    if not (to_host or to_hbm or to_out):
        raise ValueError("the kernel must store somewhere: to_host, to_hbm or to_out")
    if (to_host or to_hbm) != bool(page_size):
        raise ValueError(f"page_size {page_size} with to_host={to_host}, to_hbm={to_hbm}: a pool needs its page size, "
                         "no pool takes 0")
    key = kv_proj_key(cfg, dtype, hidden, kv_heads, head_dim, page_size, bias, to_host, to_hbm, to_out)
    return _cached_compile(key, lambda: _compile_kv_proj(cfg, dtype, hidden, kv_heads, head_dim, page_size, bias,
                                                         to_host, to_hbm, to_out))


def _compile_kv_proj(cfg, dtype, hidden, kv_heads, head_dim, page_size, bias, to_host, to_hbm, to_out):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    # CuTe DSL (cutlass) loads only to compile: the keys and the compile cache import without it
    from directkv_cute.kernels.kv_proj import KVProjection

    dt = cutlass_dtype(dtype)
    kernel = KVProjection(dt, hidden, kv_heads, head_dim, page_size, bool(bias), bool(to_host), bool(to_hbm),
                          bool(to_out), cfg.tile_m, cfg.consumer_wgs, cfg.stages, cfg.ctas_per_sm)
    args = (
        *(_ptr(dt) for _ in range(7)), _ptr(cutlass.Int64, 8), _ptr(cutlass.Int64, 8), _ptr(dt), _ptr(dt),
        _ptr(cutlass.Float32), _ptr(cutlass.Int32, 4), Int64(0), Int64(0), *(Int32(1) for _ in range(6)),
        cuda.CUstream(0),
    )
    return cute.compile(kernel, *args)
