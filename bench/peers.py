"""FlashAttention-4 (``flash-attn-4``, its CuTe-DSL SM90 path) as a peer in the kernel benches.

Three methods, each checked against the fp32 anchor and the HBM baseline like every other:

* ``fa4[hbm]``: dense K/V ``(B, S, Hkv, d)`` in HBM, ``causal=True`` (FA's causal mask is
  bottom-right aligned: query j of L sits at key position S - L + j, as in ours). This is the
  compute peer: ``max(floor, fa4[hbm])`` is the honest limit of a kernel over host KV.
* ``fa4[zero_copy_paged]``: its ``page_table`` path over CUDA views (UVA) of pinned host K and
  V pools ``(pages, P, Hkv, d)``, pages in order; it reads host pages in place, once per query
  tile that needs them.
* ``swap+fa4``: the host pools copied into an HBM staging buffer (one cudaMemcpy each), then
  ``fa4[hbm]`` over it; the buffer's bytes are reported as staging.

``pip install -e ".[peers]"`` brings it (the versions verified on the H200 are pinned there). Without it (or without CUDA) the methods are listed as missing, with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

METHODS = ("fa4[hbm]", "fa4[zero_copy_paged]", "swap+fa4")
# Host and HBM copies of one set beyond this are not made: the peer is timed on one set.
ONE_SET_BYTES = 2 << 30
# A shape whose KV exceeds this has no FA4 host copy (host memory also holds ours' pool).
MAX_HOST_BYTES = 24 << 30


def unavailable(device: str) -> str | None:
    """Why FA4 cannot run here, or None."""
    if device != "cuda" or not torch.cuda.is_available():
        return "FA4 needs CUDA"
    if torch.cuda.get_device_capability() < (9, 0):
        return "FA4's CuTe path needs SM90 or newer"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is absent
        return f"flash-attn-4 not importable ({type(e).__name__}: {e}); pip install -e '.[peers]'"
    return None


def _funcs():
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    return flash_attn_func, flash_attn_varlen_func


def _out(res) -> torch.Tensor:
    return res[0] if isinstance(res, tuple) else res


@dataclass
class Fa4Inputs:
    """FA4's layouts of one set: dense K/V in HBM and paged host pools (or None when too big)."""

    dense: torch.Tensor  # (2, B, S, Hkv, d) in HBM
    host: object | None  # PinnedBuffer (2, B * pages, P, Hkv, d), pages of sequence b at b * pages
    page_table: torch.Tensor  # (B, pages) int32
    seqused_k: torch.Tensor  # (B,) int32
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32


def fa4_layout(kv: torch.Tensor, page_size: int, pinned_cls, want_host: bool, q_len: int) -> Fa4Inputs:
    """FA4's inputs from dense KV ``(2, B, Hkv, S, d)`` (in HBM)."""
    _, batch, hkv, s, d = kv.shape
    dense = kv.permute(0, 1, 3, 2, 4).contiguous()  # (2, B, S, Hkv, d)
    pages = math.ceil(s / page_size)
    host = None
    if want_host:
        pad = pages * page_size - s
        paged = torch.nn.functional.pad(dense, (0, 0, 0, 0, 0, pad)) if pad else dense
        host = pinned_cls((2, batch * pages, page_size, hkv, d), kv.dtype, "cuda")
        host.cpu.copy_(paged.reshape(2, batch * pages, page_size, hkv, d))
    dev = kv.device
    table = (torch.arange(batch * pages, dtype=torch.int32, device=dev)).view(batch, pages)
    seqused = torch.full((batch,), s, dtype=torch.int32, device=dev)
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=dev)
    return Fa4Inputs(dense, host, table, seqused, cu_q)


def hbm_call(q: torch.Tensor, inp: Fa4Inputs, batch: int, q_len: int) -> Callable[[], torch.Tensor]:
    """fa4[hbm]: returns a call giving (B * L, Hq, d)."""
    fa, _ = _funcs()
    _, hq, d = q.shape
    q4 = q.view(batch, q_len, hq, d)
    k, v = inp.dense[0], inp.dense[1]
    return lambda: _out(fa(q4, k, v, causal=True)).view(batch * q_len, hq, d)


def zero_copy_paged_call(q: torch.Tensor, inp: Fa4Inputs, q_len: int) -> Callable[[], torch.Tensor]:
    """fa4[zero_copy_paged] over the UVA views of the pinned host pools."""
    _, fav = _funcs()
    view = inp.host.device_view
    k, v = view[0], view[1]
    return lambda: _out(fav(q, k, v, cu_seqlens_q=inp.cu_seqlens_q, seqused_k=inp.seqused_k,
                            page_table=inp.page_table, max_seqlen_q=q_len, causal=True))


def swap_call(q: torch.Tensor, inp: Fa4Inputs, staging: torch.Tensor, batch: int, q_len: int,
              context: int) -> Callable[[], torch.Tensor]:
    """swap+fa4: the pinned host pools copied into ``staging`` (their shape, in HBM), then FA4 dense."""
    fa, _ = _funcs()
    _, hq, d = q.shape
    q4 = q.view(batch, q_len, hq, d)
    hkv = staging.shape[-2]

    def call():
        staging.copy_(inp.host.cpu, non_blocking=True)
        kv = staging.view(2, batch, -1, hkv, d)[:, :, :context]
        return _out(fa(q4, kv[0], kv[1], causal=True)).view(batch * q_len, hq, d)
    return call
