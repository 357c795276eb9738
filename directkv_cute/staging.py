"""Staging host KV into HBM for compute-bound chunks, overlapped with the attention kernel.

When a chunk's attention costs more compute than its KV costs link time (long prefills), the
Q-tiled kernel (``kernels/q_tiled.py``) runs at the GPU's compute speed only over KV in HBM: read
in place from host it would pull every page across the link once per query tile. So the op copies
the batch's host pages of one layer (pages already in HBM are read where they are) into an HBM
buffer with the copy engine (one ``cudaMemcpy2DAsync`` per run of consecutive pages, which also
runs faster than SM reads of host memory) on a side stream, *piece by piece*: after each piece
(``piece_pages`` logical pages of every sequence) the call's epoch is written into that piece's
ready flag (``cuStreamWriteValue32``, behind a memory fence, on a flag stream that waits for an
event the side stream records after the piece's copies). The kernel is launched right away; its
producer issues a tile once its piece is ready, so compute starts after the first piece and
overlaps the rest of the copy. Host bytes moved = the unique KV, once. Staged head by head
(``by_head``), each piece's copies are made once per KV head (that head's K and V block of each
page, a strided 2-D copy), all pieces of head 0 first, with a flag per (head, piece): the kernel's
CTAs run head-major, so the copy of head h + 1 lands while head h computes.

Consecutive calls alternate between two buffers (and flag sets), and a call's copy waits only
for what it must: the kernel that last read its buffer (two calls back), and, piece by piece, the
recorded writes to the host pages it copies (``PagedKVCache.host_writes``; a step's own pages were
just written, its history was not). So in a model the history of layer l + 1 crosses the link
while layer l's kernel finishes and the layer's other work runs, instead of after it. A pool
without that record (the tensor-only op) waits for the current stream's work so far, as does
every call with ``DIRECTKV_STAGE_OVERLAP=0`` or a buffer over half the staging cap.

The plan of a staged call (its pieces, KV splits and copy runs: ``stage_plan.StagePlan``) is
plain Python on the host page table, and whether a call copies ahead is the plan's (``planner``:
the cache records its host writes, the overlap is on, and a buffer per slot fits the staging
cap). Here is the device part: ``piece_waits`` (the recorded writes each piece's copies wait
for) and ``Stager``, one per (device, stream), holding the side stream, the buffers and the
flags.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from directkv_cute.cache.pages import kernel_host_pool, kernel_host_scales
from directkv_cute.stage_plan import MAX_FLAGS, SLOTS, Run, StagePlan

HEADS_PER_COPY = 1  # KV heads per strided copy of a copy staged head by head (wider rows, coarser steps)
SLOT_BUFFERS = ("buffer", "buffer1")  # the Stager attribute holding each slot's buffer


def piece_waits(plan: StagePlan, writes) -> list[list[int]]:
    """For each piece of ``plan``, the recorded host writes (indices into ``writes``: host page
    indices as int64 arrays, None for any page) its host copies must follow and no earlier
    piece's did: a write is waited for once, before the first piece copying one of its pages
    (the side stream keeps the order for the later pieces)."""
    out = [[] for _ in plan.pieces]
    runs = [(p, r.src, r.count) for p, piece in enumerate(plan.pieces) for r in piece if not r.hbm]
    if not runs:
        return out
    piece, lo, count = (np.asarray(x, dtype=np.int64) for x in zip(*runs))
    hi = lo + count
    for i, pages in enumerate(writes):
        if pages is None:
            out[int(piece[0])].append(i)
            continue
        pages = np.sort(np.asarray(pages, dtype=np.int64))
        if not pages.size:
            continue
        k = np.minimum(np.searchsorted(pages, lo), pages.size - 1)  # the first page >= each run's start
        hit = (pages[k] >= lo) & (pages[k] < hi)
        if hit.any():
            out[int(piece[hit].min())].append(i)
    return out


def _copy_run(buf, pool, r: Run, layer: int, stream, part: int = 0, cols: int = 0) -> None:
    """Queue the copy of run ``r``: its pages' blocks of ``layer`` in ``pool`` (pages, L, ...)
    into ``buf`` (pages, 1, ...) from staging page ``r.dst`` on, one strided 2-D copy; whole
    blocks, or bytes [part, part + cols) of each."""
    import cuda.bindings.runtime as rt

    width = int(np.prod(pool.shape[2:])) * pool.element_size()  # one page of one layer
    layers = pool.shape[1]
    src = pool.data_ptr() + (r.src * layers + layer) * width + part
    dst = buf.data_ptr() + r.dst * width + part
    _check(rt.cudaMemcpy2DAsync(dst, width, src, layers * width, cols or width, r.count,
                                rt.cudaMemcpyKind.cudaMemcpyDefault, stream), "cudaMemcpy2DAsync")


def hbm_in_place(hbm_pool, layer: int):
    """The HBM pool (pages, L, Hkv, 2, P, d) as the one-layer pool (pages * L - layer, 1, Hkv, 2,
    P, d) whose page ``page * L`` is pool page ``page``'s block of ``layer``: what a staged launch
    reads the entries of ``plan_staging(..., hbm_layers=L)`` for pages already in HBM through (the
    kernel indexes both of its sources with the buffer's one layer)."""
    pages, layers = hbm_pool.shape[:2]
    if not 0 <= layer < layers or not pages:
        raise ValueError(f"hbm_in_place: layer {layer} of an HBM pool of {pages} pages x {layers} layers")
    block = math.prod(hbm_pool.shape[2:])
    return hbm_pool.view(-1)[layer * block:].view(pages * layers - layer, 1, *hbm_pool.shape[2:])


def _check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"staging: {what} failed ({err})")


class Stager:
    """The side stream, staging buffer and ready flags of one (device, stream)."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        # The copied pieces' ready flags are written here, each after an event the side stream
        # records behind the piece's copies: the side stream holds only copies and event records
        # (a flag write there kept the copy engine idle about 4 us after each piece; measured
        # on the H200: 32 calls of 8k q2048 0.625 -> 0.619 ms, with the window 0.471 -> 0.465).
        self.flag_stream = torch.cuda.Stream(self.device)
        self.landed = torch.cuda.Event()  # re-recorded after each piece (a wait takes its latest record)
        self.ready = torch.cuda.Event()  # re-recorded on the current stream before a call's ready flags
        self.flag_sets = torch.zeros(SLOTS, MAX_FLAGS, dtype=torch.int32, device=self.device)
        self.buffer = None  # (pages, 1, Hkv, 2, P, d): slot 0 (and FP8 calls)
        self.buffer1 = None  # slot 1
        self.slot = 0  # the slot of the latest call
        self.freed = [None] * SLOTS  # per slot: an event after the last kernel launched over it
        # Memory new to the side stream (the flags above, a buffer just allocated: the caching
        # allocator orders it on the current stream only): the next call waits for that stream.
        self.fresh = True
        self.scale_buffer = None  # (pages, 1, Hkv, 2, P) fp32: FP8 pages' scales (stage_fp8)
        self.aux_streams = []  # more streams for work run side by side (``streams``)
        self.urgent = None  # a high-priority stream (``urgent_stream``)
        self.epoch = 0
        self.turns = None  # (n,) int32 fold turn counters of this stream's launches, at zero between them
        self.lock = threading.Lock()

    def _buffer(self, name: str, pages: int, like_shape, dtype):
        """``self.<name>`` (pages or more, 1, *like_shape): grown by a quarter when too small, made
        anew at ``pages`` for another dtype or page shape (calls over caches of two dtypes that
        alternate must not grow it call after call)."""
        import torch

        buf = getattr(self, name)
        same = buf is not None and buf.dtype == dtype and tuple(buf.shape[2:]) == tuple(like_shape)
        if not same or buf.shape[0] < pages:
            if buf is not None:
                torch.cuda.synchronize(self.device)  # the old buffer may still be read or written
            setattr(self, name, None)
            grow = max(pages, int(buf.shape[0] * 1.25)) if same else pages
            buf = torch.empty((grow, 1, *like_shape), dtype=dtype, device=self.device)
            setattr(self, name, buf)
            self.fresh = True
        return buf[:pages]

    def _begin(self, plan: StagePlan, layer: int, copies, ahead: bool = False) -> None:
        """Start a staged call: the side stream waits for the current stream's work so far (new
        tokens' K/V stored, the buffers' last readers done), or with ``ahead`` only for the last
        kernel over this call's slot; the pages already in HBM that the plan copies (FP8 pages, a
        pool whose entries would overflow: ``in_place_layers``) are copied on the current stream,
        ahead of the kernel (a device-to-device copy may run on SMs, which the kernel's waiting
        CTAs would hold); ``copies``: (buffer, HBM pool) pairs."""
        import torch

        cur = torch.cuda.current_stream(self.device)
        if not ahead or self.fresh:
            self.stream.wait_stream(cur)
            self.fresh = False
        elif self.freed[self.slot] is not None:
            self.stream.wait_event(self.freed[self.slot])
        for runs in plan.pieces:
            for r in runs:
                if r.hbm:
                    for buf, pool in copies:
                        _copy_run(buf, pool, r, layer, cur.cuda_stream)

    def stage(self, cache, layer: int, plan: StagePlan, by_head: bool = False, ahead: bool = False):
        """Queue the plan's copies on the side stream after the current stream's work so far, and
        each copied piece's ready flag on the flag stream after an event behind the piece's copies;
        returns (buffer (pages, 1, Hkv, 2, P, d), flags, epoch). Flag p marks piece p
        of every head, or with ``by_head`` flag h * len(plan.pieces) + p piece p of KV head h. The
        pieces from ``plan.ready_from`` on (pages already in HBM: read in place, or copied ahead of
        the kernel on the current stream) are flagged on the flag stream after the current stream's
        work so far.
        ``ahead`` (the plan's ``copy_ahead``): the copy runs ahead of the current stream, into the
        other slot, waiting only for the kernel that last read that slot and for the recorded
        host writes to its pages (``cache.host_writes()``).
        The caller launches the kernel on the current stream, then calls ``finish``."""
        import cuda.bindings.driver as drv
        import torch

        host = kernel_host_pool(cache)
        piece_shape = tuple(host.shape[2:])  # (Hkv, 2, P, d)
        heads = piece_shape[0]
        n_flags = len(plan.pieces) * (heads if by_head else 1)
        if n_flags > MAX_FLAGS:
            raise ValueError(f"staging: {n_flags} ready flags needed, at most {MAX_FLAGS}")
        head_bytes = int(np.prod(piece_shape[1:])) * host.element_size()  # one KV head's block of a page
        writes, waits = [], None
        if ahead:  # the other slot; its copy waits for recorded writes to its pages only
            self.slot = (self.slot + 1) % SLOTS
            writes = cache.host_writes()
            waits = piece_waits(plan, [pages for _, pages in writes])
        buf = self._buffer(SLOT_BUFFERS[self.slot], plan.pages, piece_shape, host.dtype)
        flags = self.flag_sets[self.slot]
        self.epoch = self.epoch % (2**31 - 2) + 1
        epoch = self.epoch
        self._begin(plan, layer, ((buf, cache.hbm_pool),), ahead)
        s = self.stream.cuda_stream
        n = len(plan.pieces)

        def flag(p: int, h) -> None:  # on the flag stream
            f = p if h is None else h * n + p
            _check(drv.cuStreamWriteValue32(drv.CUstream(self.flag_stream.cuda_stream),
                                            drv.CUdeviceptr(flags.data_ptr() + 4 * f), epoch, 0),
                   "cuStreamWriteValue32")

        g = max(1, min(heads, HEADS_PER_COPY)) if by_head else heads
        groups = [range(h0, min(heads, h0 + g)) for h0 in range(0, heads, g)] if by_head else [(None,)]
        # The pieces already in HBM are ready once the current stream's work so far is done (the
        # pages it copies ahead of the kernel): their flags are written on the flag stream after an
        # event there, off the side stream, whose copies pace back-to-back calls, and off the
        # current stream, which so holds no stream memory operation between two kernels.
        if plan.ready_from < n:
            self.ready.record(torch.cuda.current_stream(self.device))
            self.flag_stream.wait_event(self.ready)
            for group in groups:
                for p in range(plan.ready_from, n):
                    for h in group:
                        flag(p, h)
        for group in groups:
            for p, runs in enumerate(plan.pieces[:plan.ready_from]):
                for i in waits[p] if waits else ():
                    self.stream.wait_event(writes[i][0])
                for r in runs:
                    if not r.hbm:
                        if by_head:  # KV heads [group.start, group.stop)'s blocks of each page
                            _copy_run(buf, host, r, layer, s, group.start * head_bytes, len(group) * head_bytes)
                        else:
                            _copy_run(buf, host, r, layer, s)
                self.landed.record(self.stream)
                self.flag_stream.wait_event(self.landed)
                for h in group:
                    flag(p, h)
            waits = None  # the first group's waits order the rest
        return buf, flags, epoch

    def stage_fp8(self, cache, layer: int, plan: StagePlan, groups=None):
        """FP8 pages and their scale rows (``cache.host_scales`` / ``hbm_scales``, (pages, L, Hkv, 2,
        P) fp32) on the side stream, after the current stream's work so far: piece by piece, each
        piece's page runs, then its scale runs, then an event; or (``groups``: ranges of KV heads,
        ``head_groups``; a one-piece plan) every scale run first, then group by group those heads'
        blocks of each page, then an event. Returns (pages (pages, 1, Hkv, 2, P, d), scales (pages,
        1, Hkv, 2, P), the events, one per piece or per group): work over pieces [0, p] (groups
        [0, g]) waits for event p (g) on its stream; ``finish`` after the last launch."""
        import torch

        host, host_s = kernel_host_pool(cache), kernel_host_scales(cache)
        if groups is not None and len(plan.pieces) != 1:
            raise ValueError(f"staging: FP8 pages staged head by head need a one-piece plan, got "
                             f"{len(plan.pieces)} pieces")
        self.slot = 0  # its buffer is slot 0's: ``finish`` marks that slot's last reader
        buf = self._buffer("buffer", plan.pages, tuple(host.shape[2:]), host.dtype)
        sbuf = self._buffer("scale_buffer", plan.pages, tuple(host_s.shape[2:]), torch.float32)
        self._begin(plan, layer, ((buf, cache.hbm_pool), (sbuf, cache.hbm_scales)))
        s, events = self.stream.cuda_stream, []

        def landed():
            events.append(torch.cuda.Event())
            events[-1].record(self.stream)

        if groups is not None:
            host_runs = [r for r in plan.pieces[0] if not r.hbm]
            head_bytes = int(np.prod(host.shape[3:])) * host.element_size()  # one KV head's block of a page
            for r in host_runs:
                _copy_run(sbuf, host_s, r, layer, s)
            for group in groups:
                for r in host_runs:
                    _copy_run(buf, host, r, layer, s, group.start * head_bytes, len(group) * head_bytes)
                landed()
            return buf, sbuf, events
        for runs in plan.pieces:
            host_runs = [r for r in runs if not r.hbm]
            for r in host_runs:
                _copy_run(buf, host, r, layer, s)
            for r in host_runs:
                _copy_run(sbuf, host_s, r, layer, s)
            landed()
        return buf, sbuf, events

    def streams(self, n: int) -> list:
        """The current stream and ``n`` - 1 more of this stager's own, for work run side by side
        (FP8 chunks: KV heads on alternate streams). Each waits for the current stream's work so
        far; the caller makes the current stream wait for them before ``finish``."""
        import torch

        cur = torch.cuda.current_stream(self.device)
        while len(self.aux_streams) < n - 1:
            self.aux_streams.append(torch.cuda.Stream(self.device))
        out = [cur, *self.aux_streams[:n - 1]]
        for st in out[1:]:
            st.wait_stream(cur)
        return out

    def urgent_stream(self):
        """This stager's highest-priority stream (its blocks are scheduled ahead of queued blocks of
        other streams), after the current stream's work so far; the caller makes the current stream
        wait for it before ``finish``."""
        import torch

        if self.urgent is None:
            self.urgent = torch.cuda.Stream(self.device, priority=-64)  # clamped to the highest
        self.urgent.wait_stream(torch.cuda.current_stream(self.device))
        return self.urgent

    def fold_turns(self, count: int):
        """``count`` turn counters for a folding Q-tiled launch on this stager's stream, at zero
        (each launch leaves its counters at zero, and launches on one stream run one after
        another): no zeroing per call, no kernel between two launches. Grown as needed."""
        import torch

        if self.turns is None or self.turns.numel() < count:
            self.turns = torch.zeros(count, dtype=torch.int32, device=self.device)
        return self.turns[:count]

    def finish(self):
        """After the kernel's launch: later work on the current stream waits for the copies, and
        the next copy into this call's slot for the kernel."""
        import torch

        cur = torch.cuda.current_stream(self.device)
        if self.freed[self.slot] is None:
            self.freed[self.slot] = torch.cuda.Event()
        self.freed[self.slot].record(cur)
        cur.wait_stream(self.stream)

    def fence(self):
        """Make the next copies wait for the current stream's work so far (a timer's start)."""
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))


_STAGERS: dict = {}
_STAGERS_LOCK = threading.Lock()


def _key(device, stream) -> tuple[str, int]:
    return str(device), int(stream.cuda_stream)


def stager(device, stream) -> Stager:
    """The Stager of (device, stream): each stream stages into its own buffer."""
    key = _key(device, stream)
    with _STAGERS_LOCK:
        st = _STAGERS.get(key)
        if st is None:
            st = _STAGERS[key] = Stager(device)
        return st


def fence(device=None) -> None:
    """Every stager of ``device`` (default: the current one): its next copies wait for the
    current stream's work so far. A benchmark calls it after its start event, so that no copy of
    the calls it times runs before it."""
    import torch

    dev = str(torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device))
    with _STAGERS_LOCK:
        for (d, _), s in _STAGERS.items():
            if d == dev:
                s.fence()


def _held(s) -> list:
    return [b for b in (*(getattr(s, name) for name in SLOT_BUFFERS), s.scale_buffer) if b is not None]


def staging_bytes() -> int:
    """HBM bytes the staging buffers (pages and FP8 scales) of this process hold."""
    with _STAGERS_LOCK:
        return sum(b.numel() * b.element_size() for s in _STAGERS.values() for b in _held(s))


def release_staging() -> int:
    """Free every staging buffer (after the work queued on their streams); returns the bytes
    freed. The next staged call allocates again."""
    import torch

    freed = 0
    with _STAGERS_LOCK:
        for s in _STAGERS.values():
            with s.lock:
                held = _held(s)
                if held:
                    torch.cuda.synchronize(s.device)
                    freed += sum(b.numel() * b.element_size() for b in held)
                    for name in (*SLOT_BUFFERS, "scale_buffer"):
                        setattr(s, name, None)
    return freed
