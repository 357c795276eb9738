"""The record of host-page writes not known to be done (``PagedKVCache.host_writes``).

Every write path of the cache notes the host pages it enqueues a write to, so that a staged
attention call (``directkv_cute.staging``) copies a host page only after the writes recorded for
it, and the rest of its copy need not wait for the current stream. Nothing is recorded on a CPU
cache (every write there is done when it returns).
"""

from __future__ import annotations

import numpy as np
import torch

MAX_HOST_WRITES = 256  # recorded host writes kept apart; more are merged into one


class HostWriteLog:
    """Entries [event (None: enqueued on the current stream, no event yet), host pages (int64
    ndarray; None: every page)], oldest first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.entries: list[list] = []

    def record(self, pages, event=None) -> None:
        """Record a host write: ``event`` marks its end on the stream it was enqueued on; None:
        the current stream, at the next ``pending``."""
        if self.device.type != "cuda" or (pages is not None and not len(pages)):
            return
        self.entries.append([event, pages])
        if len(self.entries) > MAX_HOST_WRITES:  # no staged call has read them lately: merge
            cur = torch.cuda.current_stream(self.device)
            for ev, _ in self.entries:
                if ev is not None:  # the current stream then orders all of them
                    cur.wait_event(ev)
            every = [p for _, p in self.entries]
            union = None if any(p is None for p in every) else np.unique(np.concatenate(every))
            self.entries = [[None, union]]

    def restart(self, event) -> None:
        """Forget the recorded writes: all of them were enqueued before ``event`` (recorded after
        them on their stream), which stands for them as one write of any page. An engine that
        records its own writes per step calls this once per step."""
        if self.device.type == "cuda":
            self.entries = [[event, None]]

    def pending(self) -> list[tuple[object, np.ndarray | None]]:
        """The writes not known to be done, as (CUDA event, host pages or None); writes recorded
        without an event get one now, on the current stream; finished ones are dropped."""
        if self.entries:
            lazy = [w for w in self.entries if w[0] is None]
            if lazy:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                for w in lazy:
                    w[0] = ev
            self.entries = [w for w in self.entries if not w[0].query()]
        return [(ev, pages) for ev, pages in self.entries]
