"""Timeline stamps of the multi-token kernel, a compile-time option (``bench timeline``).

With a ``Trace`` the kernel's first consumer thread of each CTA writes ``%globaltimer`` into
that CTA's ``SLOTS`` int64 stamps of a device buffer whose address is baked into the code:
[0] the walk's start, [1 + 2j] round j's first tiles landed, [2 + 2j] round j done (j < 31),
[64 + 4p + k] pass p < 16 of round ``chunk``: k = 0 start, 1 before the WGMMA loop, 2 after it,
3 stored. ``skip_passes`` compiles the walk without its passes (the link phase alone). Without a
trace (every launch of the op) none of it is compiled in.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

SLOTS = 128  # int64 stamps per CTA
TRACE_ELEMS = 1 << 26  # the buffer's int64 elements: room for TRACE_ELEMS // SLOTS CTAs


@dataclass(frozen=True)
class Trace:
    """A timeline compile option: the stamp buffer's device address, the round whose passes are
    stamped, and whether the passes are compiled out."""

    addr: int
    chunk: int = 2
    skip_passes: bool = False


# The trace the op compiles its multi-token kernels with in this context (``tracing``).
_TRACE: contextvars.ContextVar = contextvars.ContextVar("directkv_trace", default=None)


@contextlib.contextmanager
def tracing(trace: Trace):
    """Within the block, the op's multi-token kernels are compiled with ``trace``'s timeline
    stamps (a compile key of their own, never on disk: the buffer address is in the code)."""
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)


def current_trace() -> Trace | None:
    return _TRACE.get()
