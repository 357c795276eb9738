"""The host decisions of a model step, as plain functions (Python, numpy, CPU torch): which new
tokens are real, which batch rows are identical or share a prompt prefix, how each sequence grows
and where its pages go (HBM placement), and which of the step's tokens are stored.

Placement: with an HBM quota a sequence keeps its first ``sink_pages`` pages and its most recent
pages in HBM; when it outgrows its quota its oldest non-sink HBM page moves to host memory, so
every byte crosses the link once, as in the host-only cache. Under a sparse budget the HBM tier is
also a recall cache: the pages its decode steps keep selecting (``preferred``, from
``sparse.RecallCounts``) take the quota's places after the sinks and the newest pages, moved from
host memory once, instead of being read over the link at every step that selects them.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from directkv_cute.cache import CacheCapacityError
from directkv_cute.cache.pages import fork_tiers


WINDOW_TOKENS = 8192  # DirectKVCache's default write window: new tokens per step mirrored in HBM


@dataclass(frozen=True)
class CachePages:
    """The page pools a ``DirectKVCache`` allocates for a request (``cache_pages``)."""

    host: int  # pinned host pages: the host tier alone holds every token
    hbm: int  # HBM tier pages under the budget
    window: int  # HBM window pages (mirrors of the pages a step writes)


def cache_pages(max_tokens: int, max_batch_size: int, page_size: int, page_bytes: int, hbm_budget: int = 0,
                window_tokens: int = WINDOW_TOKENS) -> CachePages:
    """The one sizing rule of ``DirectKVCache``'s pools (``directkv-generate`` checks memory with
    it before a model loads). The host tier holds ``max_tokens`` on its own, one partial page per
    sequence included (a short sequence leaves part of its HBM share unused); the window holds
    ``ceil(window_tokens / page_size) + 2 * max_batch_size`` pages (a step's pages and each
    sequence's partial last page); the HBM tier whole pages of ``hbm_budget`` bytes."""
    host = -(-max_tokens // page_size) + max_batch_size
    window = -(-window_tokens // page_size) + 2 * max_batch_size if window_tokens else 0
    return CachePages(host, hbm_budget // page_bytes, window)


def hbm_targets(num_pages: int, quota: int, sink_pages: int, preferred: Sequence[int] = (),
                recent_pages: int = 0) -> set[int]:
    """Logical pages a sequence of ``num_pages`` pages keeps in HBM under ``quota`` pages: the
    first sink pages, then the most recent ones. With ``preferred`` (a recall cache's ranking,
    best first): the sinks, the newest ``recent_pages``, then the preferred pages, then the most
    recent others, up to the quota."""
    sinks = min(sink_pages, quota, num_pages)
    if not preferred:
        recent = quota - sinks
        return set(range(sinks)) | set(range(max(sinks, num_pages - recent), num_pages))
    out = set(range(sinks))
    for lp in [*range(num_pages - 1, max(sinks, num_pages - recent_pages) - 1, -1), *preferred,
               *range(num_pages - 1, sinks - 1, -1)]:
        if len(out) >= min(quota, num_pages):
            break
        if 0 <= lp < num_pages:
            out.add(lp)
    return out


@dataclass(frozen=True)
class Growth:
    """How one sequence grows in a step: pages to demote first, then ``extend`` runs."""

    demote: tuple[int, ...]  # logical pages moving HBM -> host
    runs: tuple[tuple[str, int], ...]  # (tier, tokens) extends, in order
    promote: tuple[int, ...] = ()  # logical pages moving host -> HBM (a recall cache's), after the demotions


def plan_growth(length: int, hbm_pages: Sequence[int], n: int, page_size: int, quota: int,
                sink_pages: int, preferred: Sequence[int] = (), recent_pages: int = 0) -> Growth:
    """Plan for a sequence of ``length`` tokens whose logical pages ``hbm_pages`` are in HBM to
    grow by ``n`` tokens under an HBM ``quota`` (pages): the old HBM pages that fall out of the
    targets (``hbm_targets``) are demoted, the old host pages among them that a recall cache
    prefers are promoted (never a partial last page: it grows where it is), and the new pages are
    allocated in runs by tier."""
    old = -(-length // page_size)
    new = -(-(length + n) // page_size)
    target = hbm_targets(new, quota, sink_pages, preferred, recent_pages) if quota > 0 else set()
    demote = tuple(sorted(lp for lp in hbm_pages if lp not in target))
    held, chosen = set(hbm_pages), set(preferred)
    # old host pages the targets name for being chosen (a recall cache's ranking; the plain rule
    # keeps a page where it was written); a partial last page is extended in place, wherever it is
    promote = tuple(sorted(lp for lp in target if lp < old and lp not in held and lp in chosen
                           and (lp < old - 1 or length % page_size == 0)))
    runs: list[tuple[str, int]] = []
    at = length
    lp = old
    while lp < new:
        tier = "hbm" if lp in target else "host"
        end = lp
        while end < new and (("hbm" if end in target else "host") == tier):
            end += 1
        stop = min(end * page_size, length + n)
        runs.append((tier, stop - at))
        at, lp = stop, end
    if at < length + n:  # the tokens fit the partial last page
        runs.append(("host", length + n - at))
    return Growth(demote, tuple(runs), promote)


def growth_needs(plans: Sequence[Growth], lengths: Sequence[int], page_size: int) -> dict[str, int]:
    """Net new pages per tier of a step's plans (demotions free HBM pages, take host ones)."""
    need = {"host": 0, "hbm": 0}
    for g, length in zip(plans, lengths):
        need["host"] += len(g.demote) - len(g.promote)
        need["hbm"] += len(g.promote) - len(g.demote)
        for tier, m in g.runs:
            need[tier] += -(-(length + m) // page_size) - -(-length // page_size)
            length += m
    return need


def plan_step_growth(lengths: Sequence[int], hbm_pages: Sequence[Sequence[int]], counts: Sequence[int],
                     page_size: int, quota: int, sink_pages: int, free: dict[str, int],
                     preferred: Sequence[Sequence[int]] | None = None, recent_pages: int = 0) -> list[Growth]:
    """Every sequence's growth for a step (sequence i: ``lengths[i]`` tokens, logical pages
    ``hbm_pages[i]`` in HBM, ``counts[i]`` new tokens, ``preferred[i]`` a recall cache's ranking
    of its pages), with the step's capacity checked as a whole against ``free`` pages per tier:
    when the HBM tier is short (shared pages crowd it) nothing is promoted and the new pages all
    go to host memory; ``CacheCapacityError`` when the host tier is short."""
    preferred = preferred if preferred is not None else [()] * len(lengths)
    plans = [plan_growth(length, hbm, int(n), page_size, quota, sink_pages, pref, recent_pages)
             for length, hbm, n, pref in zip(lengths, hbm_pages, counts, preferred)]
    need = growth_needs(plans, lengths, page_size)
    if need["hbm"] > free["hbm"]:  # shared pages can crowd the tier: spill to host
        plans = [Growth(g.demote, tuple(("host", m) for _, m in g.runs)) for g in plans]
        need = growth_needs(plans, lengths, page_size)
    if need["host"] > free["host"]:
        raise CacheCapacityError(
            f"this step adds {sum(counts)} tokens over {len(counts)} sequences and needs {need['host']} host "
            f"pages, {free['host']} free (raise max_tokens); the cache is unchanged")
    return plans


def valid_tokens(attention_mask, batch: int, q_len: int) -> torch.Tensor | None:
    """bool (B, S): which of the step's new tokens are real, from the 2-D padding mask."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = getattr(attention_mask, "shape", type(attention_mask).__name__)
        raise ValueError(f"DirectKV attention takes the 2-D padding mask (batch, tokens), got {shape}; "
                         "load the model with attn_implementation='directkv' so transformers builds that mask")
    if attention_mask.shape[0] != batch or attention_mask.shape[1] < q_len:
        raise ValueError(f"padding mask of shape {tuple(attention_mask.shape)} for {batch} rows x {q_len} new tokens")
    return attention_mask[:, -q_len:].to(torch.bool)


def identical_rows(key: torch.Tensor, value: torch.Tensor, valid, rows: list[int]) -> list[list[int]]:
    """``rows`` grouped by equality of their new tokens: padding mask, first layer's K and V (B,
    Hkv, S, d), bit for bit. Groups in order of their first row; ``rows[0]`` leads the first."""
    k = key[rows].reshape(len(rows), -1)
    v = value[rows].reshape(len(rows), -1)
    sig = torch.stack([k.float().sum(1), v.float().sum(1), k.float().abs().sum(1)], 1)
    if valid is not None:
        sig = torch.cat([sig, valid[rows].float().to(sig.device)], 1)
    sig = sig.tolist()
    groups: list[list[int]] = []
    for i, b in enumerate(rows):
        for g in groups:
            j = rows.index(g[0])
            if sig[i] == sig[j] and torch.equal(k[i], k[j]) and torch.equal(v[i], v[j]) \
                    and (valid is None or torch.equal(valid[b], valid[g[0]])):
                g.append(b)
                break
        else:
            groups.append([b])
    return groups


def shared_prefixes(key: torch.Tensor, value: torch.Tensor, valid, rows: list[int], page_size: int):
    """{row: (earlier row, tokens)}: rows of the first step whose real tokens begin with at least
    one page of another row's (same first-layer K and V, bit for bit), each paired with the
    earlier row it shares the most whole pages with. A random projection of each token's K and V
    finds the candidates; the shared part is then compared exactly."""
    n_rows, hkv, s, d = key.shape
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(d, generator=g, dtype=torch.float64).to(key.device)
    sig = ((key[rows].double() @ w).sum(1) + 3.0 * (value[rows].double() @ w).sum(1)).cpu()  # (R, S)
    real = [torch.arange(s) if valid is None else valid[b].nonzero().squeeze(1).cpu() for b in rows]
    toks = [sig[i, real[i]].numpy() for i in range(len(rows))]
    out: dict[int, tuple[int, int]] = {}
    for i in range(1, len(rows)):
        best_j, best = -1, 0
        for j in range(i):
            n = min(len(toks[i]), len(toks[j]))
            diff = np.flatnonzero(toks[i][:n] != toks[j][:n])
            c = int(diff[0]) if diff.size else n
            if c // page_size * page_size > best:
                best_j, best = j, c // page_size * page_size
        if best >= page_size:
            a, b = rows[best_j], rows[i]
            ia, ib = real[best_j][:best].to(key.device), real[i][:best].to(key.device)
            if torch.equal(key[a][:, ia], key[b][:, ib]) and torch.equal(value[a][:, ia], value[b][:, ib]):
                out[b] = (a, best)
    return out


def stored_tokens(rows: Sequence[int], q_lens: Sequence[int], writers: Sequence[int],
                  skip: dict[int, int]) -> list[int]:
    """Indices, among the real new tokens of ``rows`` (row by row, ``q_lens`` each), of the tokens
    stored: those of the ``writers`` rows, past the ``skip[row]`` leading tokens a row shares with
    an earlier row's prompt."""
    cu = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)])
    pos = {b: i for i, b in enumerate(rows)}
    return [t for b in writers for t in range(int(cu[pos[b]]) + skip.get(b, 0), int(cu[pos[b] + 1]))]


def fork_needs(tails: Sequence[str | None], free: dict[str, int]) -> dict[str, int]:
    """Free pages per tier that forks of sequences take: a fork copies the partial last page,
    whose tier is ``tails[i]`` (None: the sequence ends on a full page, nothing to copy), into
    that tier or, when it is full, the other (``cache.pages.fork_tiers``; ``CacheCapacityError``
    when neither has room)."""
    need: dict[str, int] = {}
    for tier in fork_tiers(tails, free):
        if tier is not None:
            need[tier] = need.get(tier, 0) + 1
    return need


def as_index_list(indices) -> list[int]:
    """Batch indices (a sequence of ints, an integer tensor or a bool mask) as a list of ints;
    ``TypeError`` for anything else (a float index is refused, never truncated)."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool:
            indices = indices.nonzero().squeeze(1)
        elif indices.dtype.is_floating_point or indices.dtype.is_complex:
            raise TypeError(f"batch indices must be integers, got a {indices.dtype} tensor")
        return [int(i) for i in indices.reshape(-1).tolist()]
    if isinstance(indices, np.ndarray):
        if indices.dtype == np.bool_:
            return [int(i) for i in np.flatnonzero(indices)]
        indices = indices.reshape(-1).tolist()
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise TypeError(f"batch indices must be a sequence of ints, got {type(indices).__name__}")
    out = []
    for i in indices:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral):
            raise TypeError(f"batch indices must be integers, got {type(i).__name__} {i!r}")
        out.append(int(i))
    return out


def as_count(value, name: str, minimum: int = 0) -> int:
    """A whole count (an int, a numpy integer or a 0-d integer tensor), at least ``minimum``."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)
