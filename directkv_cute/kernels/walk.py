"""Device walk helpers shared by the kernels: named barriers, the per-CTA work item, the
consumers' ring waits and releases, and the multi-token kernel's chunk schedule (the device side
of ``config.chunk_bounds`` / ``config.pass_bounds``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.pipeline import PipelineState


class NamedBarrier(IntEnum):
    """Named barrier ids (0 is ``__syncthreads``)."""

    Q_STORED = 1  # streaming: every consumer thread has stored its part of the Q tile
    WG_BASE = 2  # multi-token: warpgroup wg syncs its own 128 threads on WG_BASE + wg
    SCHED_BASE = 4  # Q-tiled pingpong: warpgroup wg waits on SCHED_BASE + wg for its turn at the tensor cores


@dataclass
class CtaWork:
    """What one CTA works on: grid (split, KV head, sequence), its place in the cluster and its
    sequence's extent. Fields are device values (``rank`` a Python 0 without clusters)."""

    split: object  # the CTA's split of the KV tiles
    kvh: object  # KV head
    b: object  # sequence
    rank: object  # place in the cluster (q_cluster): the CTAs of a split are adjacent in x
    seq_len: object  # keys of the sequence
    q_start: object  # the sequence's first query row (cu_q)
    q_len: object  # its query rows
    n_pages: object  # pages of the sequence
    t_begin: object  # the split's KV tiles [t_begin, t_end)
    t_end: object


class RingState(PipelineState):
    """A consumer's place in the KV ring (a ``PipelineState``) that waits for or releases a run
    of tiles: ``waited = wait_state.wait_through(kv_pipe, waited, upto)`` instead of the loop.
    (Called as a method, so a loop around the call carries the state as it carried the
    ``state.advance()`` of the loop it replaces.)"""

    @staticmethod
    def consumer(stages: int) -> "RingState":
        """The consumer's first state (as ``pipeline.make_pipeline_state``)."""
        return RingState(stages, Int32(0), Int32(0), Int32(0))

    def __new_from_mlir_values__(self, values) -> "RingState":
        return RingState(self.stages, Int32(values[0]), Int32(values[1]), Int32(values[2]))

    def _take(self, state):
        self._count, self._index, self._phase = state._count, state._index, state._phase

    @cute.jit
    def wait_through(self, pipe, done, upto):
        """Wait until ring tiles [done, upto) (counted from the split's first) have landed,
        advancing this state past them; returns ``max(done, upto)``."""
        state = self
        for _t in cutlass.range(done, upto, unroll=1):
            pipe.consumer_wait(state, pipe.consumer_try_wait(state))
            state.advance()
        self._take(state)
        return cutlass.max(done, upto)

    @cute.jit
    def release_through(self, pipe, done, upto):
        """Release ring tiles [done, upto) to the producer, advancing this state past them;
        returns ``max(done, upto)``."""
        state = self
        for _t in cutlass.range(done, upto, unroll=1):
            pipe.consumer_release(state)
            state.advance()
        self._take(state)
        return cutlass.max(done, upto)


class ChunkWalk:
    """The KV-outer walk's rounds over a split of ``n_tiles``: chunks of ``chunk`` tiles (edge
    chunks of ``edge`` tiles at both ends), or with ``stagger`` each block's own bounds."""

    def __init__(self, chunk: int, edge: int, stagger: int, stages: int):
        self.chunk = chunk
        self.edge = edge
        self.stagger = stagger
        self.stages = stages

    @cute.jit
    def num_rounds(self, n_tiles):
        """Rounds of the chunk walk over a split of ``n_tiles`` (at least one): its chunks
        (config.chunk_bounds), or with stagger config.stagger_rounds."""
        chunk = self.chunk
        if const_expr(self.stagger > 0):
            first = (chunk + self.stagger - 1) // self.stagger
            n = 1 + (cutlass.max(n_tiles - first, 0) + chunk - 1) // chunk
        elif const_expr(self.edge > 0):
            # Edge chunks of `edge` tiles open and close the split.
            n = 1
            if n_tiles > self.edge:
                n = 2 + (cutlass.max(n_tiles - 2 * self.edge, 0) + chunk - 1) // chunk
        else:
            n = cutlass.max((n_tiles + chunk - 1) // chunk, 1)
        return n

    @cute.jit
    def round_begin(self, j, n_rounds, n_mine, n_tiles):
        """The first tile any pass of round j needs (its first block's begin; ``n_tiles`` past the
        last round)."""
        begin = n_tiles
        if j < n_rounds:
            begin = self.pass_bounds(j, 0, n_mine, n_tiles)[0]
        return begin

    @cute.jit
    def pass_bounds(self, j, m, n_mine, n_tiles):
        """[begin, end) (tiles from the split's first) of round j's pass of this warpgroup's m-th
        block (of ``n_mine``): config.chunk_bounds, or with stagger config.pass_bounds."""
        chunk = self.chunk
        begin = cutlass.min(j * chunk, n_tiles)
        end = cutlass.min(begin + chunk, n_tiles)
        if const_expr(self.stagger > 0):
            g = m * self.stagger // cutlass.max(n_mine, 1)
            first = (chunk * (g + 1) + self.stagger - 1) // self.stagger
            take = cutlass.min(first, self.stages - chunk)  # the longest remainder a pass absorbs
            begin = Int32(0)
            end = cutlass.min(first, n_tiles)
            if j > 0:
                begin = first + chunk * (j - 1)
                end = begin + chunk
                if n_tiles - end > 0 and n_tiles - end <= take:
                    end = n_tiles
                if j >= 2 and n_tiles - begin > 0 and n_tiles - begin <= take:
                    begin = n_tiles  # absorbed by round j - 1
                begin = cutlass.min(begin, n_tiles)
                end = cutlass.min(end, n_tiles)
        elif const_expr(self.edge > 0):
            # Edge chunks: the first holds `edge` tiles, the middle ones `chunk`, the last what is
            # left of `edge` (config.chunk_bounds).
            begin = self.chunk_start(j, n_tiles)
            end = n_tiles
            if j + 1 < self.num_rounds(n_tiles):
                end = self.chunk_start(j + 1, n_tiles)
        return begin, end

    @cute.jit
    def chunk_start(self, j, n_tiles):
        """First tile (from the split's start) of chunk j >= 0 with edge chunks."""
        start = 0
        if j > 0:
            start = cutlass.max(self.edge, cutlass.min(self.edge + (j - 1) * self.chunk, n_tiles - self.edge))
        return start
