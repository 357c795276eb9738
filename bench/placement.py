"""Which pages of a sequence live in the HBM tier, for the hybrid runs and the traffic check."""

from __future__ import annotations

import math

PLACEMENTS = ("spread", "recent", "oldest")
_GOLDEN = (math.sqrt(5) - 1) / 2


def hbm_page_order(n_pages: int, placement: str) -> list[int]:
    """Order in which pages go to HBM as the fraction grows (so placements are nested).

    spread: a low-discrepancy order (page p ranked by frac(p * golden ratio)), so any prefix
    is spread evenly over the sequence and every split of the kernel gets a share of both
    tiers; recent: last pages first; oldest: first pages first.
    """
    if placement == "spread":
        return sorted(range(n_pages), key=lambda p: ((p * _GOLDEN) % 1.0, p))
    if placement == "recent":
        return list(range(n_pages - 1, -1, -1))
    if placement == "oldest":
        return list(range(n_pages))
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def hbm_pages(n_pages: int, fraction: float, placement: str) -> set[int]:
    """The logical pages of one sequence that live in HBM at this fraction (round(f * n) pages)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    return set(hbm_page_order(n_pages, placement)[:math.floor(fraction * n_pages + 0.5)])


def page_mask(context: int, page_size: int, fraction: float, placement: str) -> list[bool]:
    """Per logical page of a sequence of ``context`` tokens: whether it is in HBM."""
    n = math.ceil(context / page_size)
    in_hbm = hbm_pages(n, fraction, placement)
    return [p in in_hbm for p in range(n)]


def tier_tokens(context: int, page_size: int, in_hbm: set[int]) -> tuple[int, int]:
    """(host tokens, HBM tokens) of a sequence whose pages ``in_hbm`` live in HBM."""
    hbm = sum(min(context, (p + 1) * page_size) - p * page_size for p in in_hbm)
    return context - hbm, hbm
