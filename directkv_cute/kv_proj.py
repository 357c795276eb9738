"""Fused K/V projection + RoPE + KV-cache store of one layer's new tokens.

``kv_project`` computes, for T new tokens with hidden states ``x`` (T, hidden),

    K = x W_k^T (+ b_k),  V = x W_v^T (+ b_v)        (each rounded to the model dtype)
    K = K * cos + rotate_half(K) * sin                  (transformers' apply_rotary_pos_emb)

and stores every token's K and V rows of layer ``layer`` into up to two page pools -- the
pinned host pool (through its CUDA alias, ``PagedKVCache.host_pool_cuda``) and an HBM pool --
and, optionally, dense (T, Hkv, d) outputs. On CUDA one kernel does all of it
(``kernels/kv_proj.py``); on CPU (or through ``kv_project_reference``) plain torch computes the
same rounded values and does the same stores.

Rounding follows transformers in the model dtype: the linear output (fp32 accumulation + bias)
is rounded to the model dtype, then ``round(round(k * cos) + round(rotate_half(k) * sin))``, each
product and the sum rounded to the model dtype. The kernel and the reference differ only in how
the fp32 (kernel) / fp64 (reference) dot products are summed: a linear output that lands next
to a rounding boundary may round the other way (one ulp), which RoPE then carries into K.

Destinations: ``host=`` / ``hbm=`` take ``(pool, slots)`` or ``(pool, page_idx, row)``. ``pool``
is (num_pages, L, Hkv, 2, P, d), contiguous (``PagedKVCache`` pools); ``slots`` int64 (T,) is
``page * P + row`` per token, -1 to skip the token for that destination. Token t's K lands in
``pool[slot // P, layer, :, 0, slot % P, :]`` and V in ``[..., 1, ...]``. ``cache_destinations``
turns a cache's ``TokenSlots`` into both arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import dataclass

import torch

from directkv_cute.config import ConfigError, SUPPORTED_PAGE_SIZES
from directkv_cute.kernels import specs
from directkv_cute.kernels.jit import cutlass_dtype
from directkv_cute.machine import stream_capturing

HEAD_DIM = 128  # the kernel's N tile is one head of 128 columns
TILE_K = 64  # hidden columns per ring stage (kernels/kv_proj.py)
C_PAD = 8  # fp32 staging row padding (kernels/kv_proj.py)
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024
SMEM_RESERVED = 1024  # per CTA, taken by the system
SMEM_EXTRA = 1024  # mbarriers, flags and the 1 KB alignment of the ring
MIN_SPLIT_BLOCKS = 8  # a split-K CTA reads at least this many 64-column blocks of W
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
ALIGN = 16


@dataclass(frozen=True)
class KVProjConfig:
    """Static configuration of the fused K/V projection kernel.

    tile_m:       token rows per CTA (64 or 128).
    consumer_wgs: consumer warpgroups sharing those rows (tile_m / consumer_wgs rows each, a
                  multiple of 64).
    stages:       depth of the X / W SMEM ring (64 hidden columns a stage).
    ctas_per_sm:  CTAs per SM the kernel is compiled for (1 or 2; 2 lets one CTA's stores drain
                  while the other computes; it needs one consumer warpgroup).
    splits:       K splits (0 = the op's choice: enough CTAs to cover the SMs when the tiles
                  alone do not); a launch argument, not code.
    """

    tile_m: int = 128
    consumer_wgs: int = 1
    stages: int = 3
    ctas_per_sm: int = 2
    splits: int = 0

    @property
    def ring_bytes(self) -> int:
        return (self.tile_m + HEAD_DIM) * TILE_K * 2 * self.stages

    @property
    def staging_bytes(self) -> int:
        return self.tile_m * (HEAD_DIM + C_PAD) * 4

    @property
    def smem_bytes(self) -> int:
        return self.ring_bytes + SMEM_EXTRA

    def problems(self, head_dim: int = HEAD_DIM, page_size: int | None = None, elem_bytes: int = 2,
                 hidden: int | None = None) -> list[str]:
        """Why this config cannot compile or launch for the shape (empty: legal). The one
        statement of the kernel's legality."""
        out = []
        if head_dim != HEAD_DIM:
            out.append(f"head_dim {head_dim}: the kernel's N tile is one head of {HEAD_DIM} columns")
        if elem_bytes != 2:
            out.append(f"{elem_bytes}-byte elements: the kernel runs bfloat16 and float16")
        if page_size is not None and page_size not in SUPPORTED_PAGE_SIZES:
            out.append(f"page_size {page_size} must be one of {SUPPORTED_PAGE_SIZES}")
        if hidden is not None and (hidden < TILE_K or hidden % TILE_K):
            out.append(f"hidden {hidden} must be a positive multiple of {TILE_K}")
        if self.tile_m not in (64, 128):
            out.append(f"tile_m {self.tile_m} must be 64 or 128")
        if self.consumer_wgs not in (1, 2):
            out.append(f"consumer_wgs {self.consumer_wgs} must be 1 or 2")
        elif self.tile_m in (64, 128) and (self.tile_m // self.consumer_wgs) % 64:
            out.append(f"tile_m {self.tile_m} over {self.consumer_wgs} warpgroups is not whole 64-row atoms")
        if self.ctas_per_sm not in (1, 2):
            out.append(f"ctas_per_sm {self.ctas_per_sm} must be 1 or 2")
        elif self.ctas_per_sm == 2 and self.consumer_wgs != 1:
            out.append("ctas_per_sm 2 needs consumer_wgs 1 (two CTAs of 384 threads leave too few registers)")
        if self.stages < 2:
            out.append(f"stages {self.stages} must be >= 2")
        if self.splits < 0:
            out.append(f"splits {self.splits} must be >= 0 (0 = automatic)")
        elif hidden is not None and hidden >= TILE_K and self.splits > hidden // TILE_K:
            out.append(f"splits {self.splits} exceed the {hidden // TILE_K} blocks of hidden {hidden}")
        if not out:
            if self.ring_bytes < self.staging_bytes:
                out.append(f"the ring ({self.ring_bytes} B) is smaller than the fp32 staging tile "
                           f"({self.staging_bytes} B) it holds in the epilogue: more stages")
            if self.smem_bytes > SMEM_PER_BLOCK:
                out.append(f"{self.smem_bytes} B of SMEM exceed the {SMEM_PER_BLOCK} B of a block")
            elif self.ctas_per_sm * (self.smem_bytes + SMEM_RESERVED) > SMEM_PER_SM:
                out.append(f"{self.ctas_per_sm} CTAs x {self.smem_bytes + SMEM_RESERVED} B of SMEM exceed the "
                           f"{SMEM_PER_SM} B of an SM")
        return out

    def check(self, head_dim: int = HEAD_DIM, page_size: int | None = None, elem_bytes: int = 2,
              hidden: int | None = None) -> None:
        problems = self.problems(head_dim, page_size, elem_bytes, hidden)
        if problems:
            raise ConfigError(f"{self}: " + "; ".join(problems))

    def is_legal(self, head_dim: int = HEAD_DIM, page_size: int | None = None, elem_bytes: int = 2,
                 hidden: int | None = None) -> bool:
        return not self.problems(head_dim, page_size, elem_bytes, hidden)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVProjConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown KVProjConfig fields: {sorted(unknown)}")
        try:
            return cls(**{k: int(v) for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad KVProjConfig values {d}: {e}") from e


DECODE_MAX_TOKENS = 64  # up to here: 64-row tiles, split-K over the SMs


def default_kv_proj_config(tokens: int) -> KVProjConfig:
    """The untuned default: 64-row tiles and a 4-deep ring for up to DECODE_MAX_TOKENS tokens
    (weight-bandwidth bound: split-K spreads W over the SMs), else 128-row tiles, 3 stages; two
    CTAs per SM either way."""
    if tokens <= DECODE_MAX_TOKENS:
        return KVProjConfig(tile_m=64, consumer_wgs=1, stages=4, ctas_per_sm=2)
    return KVProjConfig(tile_m=128, consumer_wgs=1, stages=3, ctas_per_sm=2)


def auto_splits(tiles: int, k_blocks: int, num_sms: int) -> int:
    """K splits for ``tiles`` output tiles: about one CTA per SM when the tiles alone are fewer
    than the SMs, each split at least MIN_SPLIT_BLOCKS blocks of W."""
    if tiles >= num_sms:
        return 1
    return max(1, min(round(num_sms / tiles), k_blocks // MIN_SPLIT_BLOCKS, k_blocks))


# ---- validation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Destination:
    """A validated page-pool destination: pool (pages, L, Hkv, 2, P, d) and int64 (T,) slots."""

    pool: torch.Tensor
    slots: torch.Tensor

    @property
    def pages(self) -> int:
        return self.pool.shape[0]

    @property
    def page_size(self) -> int:
        return self.pool.shape[4]


@dataclass(frozen=True)
class Problem:
    """The validated arguments of one call."""

    x: torch.Tensor  # (T, hidden)
    w_k: torch.Tensor  # (Hkv d, hidden)
    w_v: torch.Tensor
    b_k: torch.Tensor | None  # (Hkv d,)
    b_v: torch.Tensor | None
    cos: torch.Tensor  # (T, d)
    sin: torch.Tensor  # (T, d)
    layer: int
    host: Destination | None
    hbm: Destination | None
    out_k: torch.Tensor | None  # (T, Hkv, d)
    out_v: torch.Tensor | None
    kv_heads: int
    head_dim: int

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def hidden(self) -> int:
        return self.x.shape[1]

    @property
    def page_size(self) -> int:
        """The pools' page size (0 without a pool)."""
        for dest in (self.host, self.hbm):
            if dest is not None:
                return dest.page_size
        return 0

    @property
    def num_layers(self) -> int:
        for dest in (self.host, self.hbm):
            if dest is not None:
                return dest.pool.shape[1]
        return 1


def _tensor(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    return t


def _like(t, name: str, shape: tuple, x: torch.Tensor, what: str) -> torch.Tensor:
    """A tensor of ``x``'s dtype and device, ``shape``, contiguous."""
    t = _tensor(t, name)
    if t.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, x has {x.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x is on {x.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {what} = {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _rotary(t, name: str, tokens: int, head_dim: int, x: torch.Tensor) -> torch.Tensor:
    """cos / sin as the model's rotary module returns them: (T, d), or (1, T, d) for one sequence."""
    t = _tensor(t, name)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    return _like(t, name, (tokens, head_dim), x, "(T, head_dim) or (1, T, head_dim)")


def _destination(arg, name: str, x: torch.Tensor, layer_pool: tuple, tokens: int, check_slots: bool) -> Destination:
    """Validate ``(pool, slots)`` / ``(pool, page_idx, row)``; returns pool and int64 slots."""
    if not isinstance(arg, (tuple, list)) or len(arg) not in (2, 3):
        raise TypeError(f"{name} must be (pool, slots) or (pool, page_idx, row), got {type(arg).__name__}")
    pool = _tensor(arg[0], f"{name} pool")
    if pool.dtype != x.dtype:
        raise TypeError(f"{name} pool has dtype {pool.dtype}, x has {x.dtype}")
    if pool.device != x.device:
        where = " (pass the host pool's CUDA alias, PagedKVCache.host_pool_cuda)" if name == "host" else ""
        raise ValueError(f"{name} pool is on {pool.device}, x is on {x.device}{where}")
    hkv, d = layer_pool
    if pool.dim() != 6 or pool.shape[2] != hkv or pool.shape[3] != 2 or pool.shape[5] != d:
        raise ValueError(f"{name} pool has shape {tuple(pool.shape)}, expected (pages, layers, {hkv}, 2, "
                         f"page_size, {d})")
    if pool.shape[0] < 1:
        raise ValueError(f"{name} pool has no pages")
    page_size = pool.shape[4]
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"{name} pool page size {page_size} must be one of {SUPPORTED_PAGE_SIZES}")
    if not pool.is_contiguous():
        raise ValueError(f"{name} pool must be contiguous")
    idx = []
    for i, part in enumerate(arg[1:]):
        label = f"{name} " + (("slots",) if len(arg) == 2 else ("page_idx", "row"))[i]
        part = _tensor(part, label)
        if part.dtype != torch.int64:
            raise TypeError(f"{label} must be int64, got {part.dtype}")
        if part.device != x.device:
            raise ValueError(f"{label} is on {part.device}, x is on {x.device}")
        if tuple(part.shape) != (tokens,):
            raise ValueError(f"{label} has shape {tuple(part.shape)}, expected (T,) = ({tokens},)")
        idx.append(part.contiguous())
    pages = pool.shape[0]
    if len(idx) == 2:
        page_idx, row = idx
        if check_slots and tokens:
            bad = ((page_idx < -1) | (page_idx >= pages)).nonzero()
            if len(bad):
                t = int(bad[0, 0])
                raise ValueError(f"{name} page_idx[{t}] = {int(page_idx[t])} is outside [-1, {pages}) "
                                 f"(-1 skips the token)")
            bad = ((page_idx >= 0) & ((row < 0) | (row >= page_size))).nonzero()
            if len(bad):
                t = int(bad[0, 0])
                raise ValueError(f"{name} row[{t}] = {int(row[t])} is outside the page's rows [0, {page_size})")
        # A row outside the page skips the token (never another page's row), checked or not.
        inside = (page_idx >= 0) & (row >= 0) & (row < page_size)
        slots = torch.where(inside, page_idx * page_size + row, torch.full_like(page_idx, -1))
    else:
        slots = idx[0]
    if check_slots and tokens:
        cap = pages * page_size
        bad = ((slots < -1) | (slots >= cap)).nonzero()
        if len(bad):
            t = int(bad[0, 0])
            raise ValueError(f"{name} slots[{t}] = {int(slots[t])} is outside [-1, {cap}) "
                             f"({pages} pages of {page_size}; -1 skips the token)")
        used = slots[slots >= 0]
        if used.numel() != torch.unique(used).numel():
            raise ValueError(f"{name} slots name a cache row twice (two tokens would race for it)")
    return Destination(pool, slots)


def check_kv_project(x, w_k, w_v, b_k=None, b_v=None, *, cos, sin, layer: int = 0, host=None, hbm=None,
                     out_k=None, out_v=None, check_slots: bool = True) -> Problem:
    """The one validation of ``kv_project``'s arguments (both devices); returns them normalised.
    ``check_slots`` also checks every slot against its pool (a device-to-host read on CUDA)."""
    x = _tensor(x, "x")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}, expected one of {SUPPORTED_DTYPES}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x is on {x.device}, expected a CUDA device or the CPU")
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (T, hidden)")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    tokens, hidden = x.shape
    w_k = _tensor(w_k, "w_k")
    if w_k.dim() != 2 or w_k.shape[1] != hidden:
        raise ValueError(f"w_k has shape {tuple(w_k.shape)}, expected (kv_heads * head_dim, {hidden})")
    _like(w_k, "w_k", w_k.shape, x, "")
    _like(w_v, "w_v", w_k.shape, x, "w_k's shape")
    cos_t = _tensor(cos, "cos")
    head_dim = cos_t.shape[-1] if cos_t.dim() >= 1 else 0
    if head_dim < 2 or head_dim % 2 or w_k.shape[0] % head_dim:
        raise ValueError(f"cos has shape {tuple(cos_t.shape)}: its last dim (head_dim) must be even and divide "
                         f"w_k's {w_k.shape[0]} rows")
    kv_heads = w_k.shape[0] // head_dim
    cos = _rotary(cos, "cos", tokens, head_dim, x)
    sin = _rotary(sin, "sin", tokens, head_dim, x)
    if (b_k is None) != (b_v is None):
        raise ValueError("give both b_k and b_v, or neither")
    if b_k is not None:
        b_k = _like(b_k, "b_k", (w_k.shape[0],), x, "(kv_heads * head_dim,)")
        b_v = _like(b_v, "b_v", (w_k.shape[0],), x, "(kv_heads * head_dim,)")
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    dests = {}
    for name, arg in (("host", host), ("hbm", hbm)):
        if arg is not None:
            dests[name] = _destination(arg, name, x, (kv_heads, head_dim), tokens, check_slots)
    if len(dests) == 2:
        a, b = dests["host"].pool, dests["hbm"].pool
        if a.shape[1:] != b.shape[1:]:
            raise ValueError(f"host pool {tuple(a.shape)} and hbm pool {tuple(b.shape)} differ past the page count")
    for dest in dests.values():
        if not 0 <= layer < dest.pool.shape[1]:
            raise ValueError(f"layer {layer} is outside the pools' {dest.pool.shape[1]} layers")
    if (out_k is None) != (out_v is None):
        raise ValueError("give both out_k and out_v, or neither")
    if out_k is not None:
        out_k = _like(out_k, "out_k", (tokens, kv_heads, head_dim), x, "(T, kv_heads, head_dim)")
        out_v = _like(out_v, "out_v", (tokens, kv_heads, head_dim), x, "(T, kv_heads, head_dim)")
        if out_k.data_ptr() == out_v.data_ptr() and tokens:
            raise ValueError("out_k and out_v are the same memory")
    if not dests and out_k is None:
        raise ValueError("nothing to write: give host=, hbm= or out_k/out_v")
    if x.device.type == "cuda":
        # TMA needs 16-byte aligned bases, the epilogue's 16-byte vector accesses too.
        named = [("x", x), ("w_k", w_k), ("w_v", w_v), ("b_k", b_k), ("b_v", b_v), ("cos", cos), ("sin", sin),
                 ("out_k", out_k), ("out_v", out_v)]
        named += [(f"{n} pool", d.pool) for n, d in dests.items()]
        for name, t in named:
            if t is not None and t.data_ptr() % ALIGN:
                raise ValueError(f"{name} must start at a {ALIGN}-byte aligned address")
    return Problem(x, w_k, w_v, b_k, b_v, cos, sin, int(layer), dests.get("host"), dests.get("hbm"), out_k, out_v,
                   kv_heads, head_dim)


# ---- the reference ---------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (-x[..., d/2:], x[..., :d/2])."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def project_reference(x, w_k, w_v, b_k, b_v, cos, sin, kv_heads: int, head_dim: int):
    """(K after RoPE, V), each (T, Hkv, d) in x's dtype: the dot products in float64, rounded once
    to the model dtype with the bias; RoPE in the model dtype with torch's elementwise ops (each
    product and the sum rounded), as transformers computes it."""
    tokens = x.shape[0]
    xd = x.double()
    outs = []
    for w, b in ((w_k, b_k), (w_v, b_v)):
        y = xd @ w.double().t()  # (T, Hkv d) float64
        if b is not None:
            y = y + b.double()
        outs.append(y.to(x.dtype).view(tokens, kv_heads, head_dim))
    k, v = outs
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, d)
    k = (k * c) + (rotate_half(k) * s)
    return k, v


def _store(dest: Destination, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    keep = (dest.slots >= 0).nonzero().flatten()  # (m,) tokens stored here
    slots = dest.slots[keep]
    P = dest.page_size
    page, row = torch.div(slots, P, rounding_mode="floor"), slots % P
    dest.pool[page, layer, :, 0, row] = k[keep]
    dest.pool[page, layer, :, 1, row] = v[keep]


def _run_reference(p: Problem):
    k, v = project_reference(p.x, p.w_k, p.w_v, p.b_k, p.b_v, p.cos, p.sin, p.kv_heads, p.head_dim)
    for dest in (p.host, p.hbm):
        if dest is not None:
            _store(dest, p.layer, k, v)
    if p.out_k is not None:
        p.out_k.copy_(k)
        p.out_v.copy_(v)
    return p.out_k, p.out_v


def kv_project_reference(x, w_k, w_v, b_k=None, b_v=None, *, cos, sin, layer: int = 0, host=None, hbm=None,
                         out_k=None, out_v=None, check_slots: bool = True):
    """``kv_project`` in plain torch on any device: the same rounded K and V, the same stores."""
    p = check_kv_project(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=layer, host=host, hbm=hbm, out_k=out_k,
                         out_v=out_v, check_slots=check_slots)
    return _run_reference(p)


# ---- the op ----------------------------------------------------------------------------------


def kv_project(x, w_k, w_v, b_k=None, b_v=None, *, cos, sin, layer: int = 0, host=None, hbm=None, out_k=None,
               out_v=None, config: KVProjConfig | None = None, check_slots: bool = True):
    """Project, rotate and store one layer's K and V of T new tokens (see the module docstring).

    x: (T, hidden) bf16/fp16, contiguous. w_k, w_v: (Hkv * d, hidden) (the k_proj / v_proj
    weights); b_k, b_v: (Hkv * d,) or None (Qwen2-style biases). cos, sin: (T, d) or (1, T, d), the
    model's rotary embedding for these tokens in the model dtype. host / hbm: (pool, slots) or
    (pool, page_idx, row), slots/page_idx/row int64 (T,) on x's device (-1 skips a token).
    out_k, out_v: optional (T, Hkv, d) outputs. ``config``: kernel config (default
    ``default_kv_proj_config(T)``). ``check_slots``: check every slot against its pool and for
    duplicates first (a device-to-host read; pass False in a hot loop once the slots are known
    good; the kernel never writes outside a pool either way: out-of-range slots are skipped).

    Returns (out_k, out_v) (None, None without dense outputs). Everything is enqueued on the
    current CUDA stream. On CPU tensors this is ``kv_project_reference``.
    """
    p = check_kv_project(x, w_k, w_v, b_k, b_v, cos=cos, sin=sin, layer=layer, host=host, hbm=hbm, out_k=out_k,
                         out_v=out_v, check_slots=check_slots)
    if p.x.device.type != "cuda":
        return _run_reference(p)
    cfg = config if config is not None else default_kv_proj_config(p.tokens)
    if not isinstance(cfg, KVProjConfig):
        raise TypeError(f"config must be a KVProjConfig, got {type(cfg).__name__}")
    _check_config(cfg, p.head_dim, p.page_size or None, p.hidden)
    if p.tokens == 0:
        return p.out_k, p.out_v
    fn = compiled(cfg, p.x.dtype, p.hidden, p.kv_heads, p.head_dim, p.page_size, p.b_k is not None,
                  p.host is not None, p.hbm is not None, p.out_k is not None)
    launch_kv_proj(fn, p, cfg, stream_capturing())
    return p.out_k, p.out_v


@functools.lru_cache(maxsize=1024)
def _check_config(cfg: KVProjConfig, head_dim: int, page_size, hidden: int) -> None:
    cfg.check(head_dim, page_size, 2, hidden)


def compiled(cfg: KVProjConfig, dtype, hidden, kv_heads, head_dim, page_size, bias, to_host, to_hbm, to_out):
    """The compiled kernel for the shape (the spec's compile function, cached by its key)."""
    return specs.get("kv_proj").compile_fn(cfg, dtype, hidden, kv_heads, head_dim, page_size, bias, to_host, to_hbm,
                                           to_out)


def cache_destinations(cache, slots, defer_host: bool = False) -> dict:
    """``host=`` / ``hbm=`` arguments of ``kv_project`` for the tokens of a cache's ``TokenSlots``
    (``PagedKVCache.token_slots``): int64 slots per tier, -1 for the tokens the tier does not
    hold. A tier's parts merge into one slot list: the HBM pages and the HBM window mirrors of
    host pages name disjoint tokens (only host pages are mirrored), so a step's host pages and
    their window mirrors are both written by the one kernel. Enqueued on the current stream, no
    host synchronisation. ``defer_host``: mirrored tokens go to their mirrors only (then
    ``cache.copy_mirrors_to_host(slots, layer)``, as ``write_slots(defer_host=True)`` does).
    After enqueueing the ``kv_project`` that writes them, call ``cache.note_host_write(slots)``:
    a staged attention call then copies those host pages after it (``PagedKVCache.host_writes``)."""
    check_slots = getattr(cache, "check_slots", None)
    if check_slots is not None:
        check_slots(slots)  # this cache's slots, no page they name freed or moved since
    out = {}
    for tier, tok, pidx, off in slots.parts + (() if defer_host else slots.mirrored):
        s = pidx * cache.page_size + off
        if tok is None:
            out[tier] = s
            continue
        full = out.get(tier)
        if full is None:
            full = out[tier] = torch.full((slots.total,), -1, dtype=torch.int64, device=s.device)
        full[tok] = s
    return {tier: (cache.device_pool(tier), s) for tier, s in out.items()}


# ---- launch ----------------------------------------------------------------------------------

_COUNTERS: dict[tuple, torch.Tensor] = {}
_MIN_COUNTERS = 4096


def split_counters(device: torch.device, stream: int, tiles: int, capturing: bool) -> torch.Tensor:
    """The (n,) int32 split-K arrival counters of ``stream`` on ``device`` (n >= tiles): zero
    between launches (the last CTA of a tile resets its counter), one set per stream so
    concurrent launches never share one. Allocated (zeroed) on first use or when more tiles
    are needed, which must not be inside a CUDA graph capture (``capturing``: the current stream
    captures one)."""
    key = (device.index, stream)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.numel() < tiles:
        if capturing:
            raise RuntimeError("kv_project: call it once outside CUDA graph capture first with as many tiles "
                               "(it allocates its split-K counters then); later calls can be captured")
        cnt = torch.zeros(max(tiles, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = cnt
    return cnt


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_splits(cfg: KVProjConfig, tokens: int, kv_heads: int, hidden: int, device: torch.device) -> int:
    """The K splits a launch runs: the config's, else ``auto_splits``."""
    if cfg.splits:
        return cfg.splits
    tiles = -(-tokens // cfg.tile_m) * 2 * kv_heads
    return auto_splits(tiles, hidden // TILE_K, _num_sms(device.index if device.index is not None else 0))


def launch_kv_proj(fn, p: Problem, cfg: KVProjConfig, capturing: bool) -> None:
    """Run the compiled kernel on the current stream (``capturing``: it captures a CUDA graph,
    ``machine.stream_capturing``)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    from cutlass.cute.runtime import make_ptr

    def ptr(t, dtype=None, align=16):
        return make_ptr(dtype or cutlass_dtype(t.dtype), t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    x, device = p.x, p.x.device
    stream = torch.cuda.current_stream(device)
    tokens, d = p.tokens, p.head_dim
    splits = launch_splits(cfg, tokens, p.kv_heads, p.hidden, device)
    tiles = -(-tokens // cfg.tile_m) * 2 * p.kv_heads
    cnt = split_counters(device, stream.cuda_stream, tiles, capturing)
    ws = x  # stand-in, never read with one split
    if splits > 1:
        ws = torch.empty(tiles * splits * cfg.tile_m * d, dtype=torch.float32, device=device)
    b_k = p.b_k if p.b_k is not None else x
    b_v = p.b_v if p.b_v is not None else x
    host_pool = p.host.pool if p.host is not None else x
    host_slots = p.host.slots if p.host is not None else x
    hbm_pool = p.hbm.pool if p.hbm is not None else x
    hbm_slots = p.hbm.slots if p.hbm is not None else x
    out_k = p.out_k if p.out_k is not None else x
    out_v = p.out_v if p.out_v is not None else x
    fn(
        ptr(x), ptr(p.w_k), ptr(p.w_v), ptr(b_k), ptr(b_v), ptr(p.cos), ptr(p.sin),
        ptr(host_slots, cutlass.Int64, 8), ptr(hbm_slots, cutlass.Int64, 8), ptr(out_k), ptr(out_v),
        ptr(ws, cutlass.Float32), ptr(cnt, cutlass.Int32, 4),
        Int64(host_pool.data_ptr()), Int64(hbm_pool.data_ptr()),
        Int32(tokens), Int32(p.num_layers), Int32(p.layer),
        Int32(p.host.pages if p.host is not None else 0), Int32(p.hbm.pages if p.hbm is not None else 0),
        Int32(splits), cuda.CUstream(stream.cuda_stream),
    )
