"""The torch SDPA baselines and the checks every method's output goes through.

Layouts: dense KV is ``(2, B, Hkv, S, d)`` (K then V, per sequence, contiguous), queries are
packed ``(B * L, Hq, d)`` as the op takes them; SDPA sees ``q4 = (B, Hq, L, d)`` views.

SDPA formulations ("forms") tried for every baseline, the fastest correct one wins:
* ``fold`` (decode only): the ``group`` query heads of a KV head become ``group`` query rows
  of one head, ``(B, Hkv, group, d)``; no mask is needed for one query token, Hq == Hkv for
  flash, and each KV head is read by one attention head.
* ``gqa``: ``enable_gqa=True`` with the KV heads as they are; for L > 1 the causal mask is
  ``causal_lower_right(L, S)`` (query j sits at position S - L + j), which SDPA runs on flash.
* ``kvhead_loop`` (fallback): one SDPA call per KV head with that head expanded (stride 0)
  to its query heads; for backends that reject grouped heads.
Each form runs on flash only, or on any fused backend ("auto": flash, mem-efficient, cuDNN).
The math backend is never allowed on CUDA: it would materialise B x Hq x L x S scores.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn.functional as F

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - the project requires torch >= 2.4
    SDPBackend = sdpa_kernel = causal_lower_right = None


@dataclass(frozen=True)
class SdpaVariant:
    """One SDPA formulation on one backend set; fallbacks run only if no primary works."""

    form: str
    backends: str
    fallback: bool = False

    @property
    def name(self) -> str:
        return f"{self.form}/{self.backends}"


def sdpa_variants(q_len: int, hq: int, hkv: int) -> list[SdpaVariant]:
    """Candidate formulations for a shape, primaries first."""
    if hq == hkv:
        forms, spare = ["gqa"], []
    elif q_len == 1:
        forms, spare = ["fold", "gqa"], ["kvhead_loop"]
    else:
        forms, spare = ["gqa"], ["kvhead_loop"]
    out = [SdpaVariant(f, "flash") for f in forms]
    out += [SdpaVariant(f, "flash", fallback=True) for f in spare]
    out += [SdpaVariant(f, "auto", fallback=True) for f in forms + spare]
    return out


def backend_context(variant: SdpaVariant, device: str) -> ContextManager:
    """Restrict SDPA to the variant's backends on CUDA (never the math backend)."""
    if device != "cuda" or sdpa_kernel is None:
        return contextlib.nullcontext()
    if variant.backends == "flash":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        fused.append(SDPBackend.CUDNN_ATTENTION)
    return sdpa_kernel(fused)


def q_as_4d(q: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    """Packed ``(B * L, Hq, d)`` queries as the ``(B, Hq, L, d)`` view SDPA takes."""
    _, hq, d = q.shape
    return q.view(batch, q_len, hq, d).transpose(1, 2)


def _mask(q_len: int, s: int):
    return causal_lower_right(q_len, s) if q_len > 1 else None


def sdpa(variant: SdpaVariant, q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of ``q4 (B, Hq, L, d)`` over ``k, v (B, Hkv, S, d)``, query j at position S-L+j.

    Returns ``(B, Hq, L, d)``. Runs under whatever backend context the caller set.
    """
    b, hq, q_len, d = q4.shape
    hkv, s = k.shape[1], k.shape[2]
    group = hq // hkv
    if variant.form == "fold":
        if q_len != 1:
            raise ValueError("the fold form needs one query token per sequence")
        qf = q4.reshape(b, hkv, group, d)
        return F.scaled_dot_product_attention(qf, k, v).reshape(b, hq, 1, d)
    if variant.form == "gqa":
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=_mask(q_len, s), enable_gqa=group > 1)
    if variant.form == "kvhead_loop":
        out = torch.empty(b, hq, q_len, d, dtype=q4.dtype, device=q4.device)
        for h in range(hkv):
            rows = slice(h * group, (h + 1) * group)
            kh = k[:, h:h + 1].expand(b, group, s, d)
            vh = v[:, h:h + 1].expand(b, group, s, d)
            out[:, rows] = F.scaled_dot_product_attention(q4[:, rows], kh, vh, attn_mask=_mask(q_len, s))
        return out
    raise ValueError(f"unknown SDPA form {variant.form!r}")


# ---- correctness ---------------------------------------------------------------------------
def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float32; inf when out has a NaN or Inf (or shapes differ)."""
    if out.shape != ref.shape:
        return math.inf
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    denom = float(r.abs().max().clamp_min(1e-12))
    return float((o - r).abs().max()) / denom


def anchor_rows(batch: int, q_len: int, max_rows: int = 16) -> tuple[list[int], int]:
    """(batch indices, number of last query rows) the float32 anchor checks."""
    batches = sorted({0, batch - 1})
    return batches, min(q_len, max_rows)


def anchor_reference(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batches: list[int],
                     rows: int, scale: float | None = None) -> torch.Tensor:
    """Independent float32 attention for the last ``rows`` query rows of ``batches``.

    Returns ``(len(batches), Hq, rows, d)`` float32. Query row j of L sits at position
    S - L + j and sees keys [0, S - L + j]; query head h uses KV head h // group.
    """
    _, hq, q_len, d = q4.shape
    hkv, s = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pos = torch.arange(s - rows, s, device=k.device)  # absolute position of each checked row
    visible = torch.arange(s, device=k.device)[None, :] <= pos[:, None]  # (rows, S)
    out = torch.empty(len(batches), hq, rows, d, dtype=torch.float32, device=k.device)
    for i, b in enumerate(batches):
        for h in range(hkv):
            qh = q4[b, h * group:(h + 1) * group, q_len - rows:].float()  # (group, rows, d)
            kh, vh = k[b, h].float(), v[b, h].float()  # (S, d)
            logits = torch.matmul(qh, kh.T) * scale  # (group, rows, S)
            logits.masked_fill_(~visible, float("-inf"))
            out[i, h * group:(h + 1) * group] = torch.matmul(torch.softmax(logits, dim=-1), vh)
    return out


def anchor_slice(out4: torch.Tensor, batches: list[int], rows: int) -> torch.Tensor:
    """The part of a ``(B, Hq, L, d)`` output the anchor covers."""
    return out4[batches, :, out4.shape[2] - rows:]
