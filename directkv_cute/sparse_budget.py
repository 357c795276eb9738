"""The sparse decode budget (``sparse.SparseBudget``) and its text form (``parse_budget``), in
plain Python: the environment reader of the vLLM backend's budget (``env``) parses it without
importing torch. ``directkv_cute.sparse`` holds the selection and exports both names.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class SparseBudget:
    """How many pages each decode row reads: ``fraction`` of the longest sequence's pages
    (0 < fraction <= 1), or ``pages`` pages; at least ``sink_pages + recent_pages``. The first
    ``sink_pages`` (>= 0) and the last ``recent_pages`` (>= 1: the newest token's page) of every
    sequence are always read. An invalid budget raises when it is made (``TypeError`` /
    ``ValueError`` naming the field)."""

    fraction: float | None = None
    pages: int | None = None
    sink_pages: int = 1
    recent_pages: int = 2

    def __post_init__(self):
        if (self.fraction is None) == (self.pages is None):
            raise ValueError("SparseBudget needs fraction or pages (exactly one)")
        if self.fraction is not None:
            f = self.fraction
            if isinstance(f, bool) or not isinstance(f, numbers.Real):
                raise TypeError(f"SparseBudget.fraction must be a real number, got {type(f).__name__}")
            if not (math.isfinite(f) and 0 < f <= 1):
                raise ValueError(f"SparseBudget.fraction must be in (0, 1], got {f!r}")
        for name, low in (("pages", 1), ("sink_pages", 0), ("recent_pages", 1)):
            v = getattr(self, name)
            if name == "pages" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"SparseBudget.{name} must be an int, got {type(v).__name__}")
            if v < low:
                raise ValueError(f"SparseBudget.{name} must be >= {low}, got {v}")

    def budget_pages(self, max_pages: int) -> int:
        """Pages each row reads when the longest sequence has ``max_pages`` pages (at most that)."""
        want = self.pages if self.pages is not None else math.ceil(self.fraction * max_pages)
        return max(1, min(max_pages, max(want, self.sink_pages + self.recent_pages)))

    def __str__(self) -> str:
        size = f"{self.pages} pages" if self.pages is not None else f"{self.fraction:g} of the pages"
        return f"{size}, {self.sink_pages} sink + {self.recent_pages} recent always"


def parse_budget(text: str) -> SparseBudget:
    """A command line's budget: a fraction of the pages ("1/8", "0.125") or a page count ("256p");
    a ``ValueError`` in one line otherwise."""
    t = str(text).strip().lower()
    try:
        if t.endswith("p"):
            return SparseBudget(pages=int(t[:-1]))
        if "/" in t:
            num, den = t.split("/", 1)
            return SparseBudget(fraction=int(num) / int(den))
        return SparseBudget(fraction=float(t))
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"a sparse budget is a fraction of the pages (1/8, 0.125) or a page count (256p), "
                         f"got {text!r}" + (f": {e}" if "SparseBudget" in str(e) else "")) from None


__all__ = ["SparseBudget", "parse_budget"]
