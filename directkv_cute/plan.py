"""The cost model and the in-place split schedule, in plain Python (testable on a CPU).

The decode kernel's grid is (num_splits, num_kv_heads, batch). CTA (s, h, b) owns the KV tiles
``split_range(n_tiles_b, num_splits, s)`` of sequence b and KV head h: every tile of every
sequence belongs to exactly one CTA, and each CTA serves all ``group * q_len`` query rows of
its KV head, so each host KV byte crosses the link once. The kernel computes the same ranges on
the device; ``decode_schedule`` mirrors it so that tests and the CI traffic check can count bytes.

The rest is the cost model: the estimates of a call read in place, staged, staged head by head, in
one wave or back to back (``in_place_ms``, ``staged_ms``, ``head_major_ms``, ``one_wave_ms``,
``pipelined_ms``, ...), each taking the GPU's ``machine.MachineModel``, and the margins a staged
estimate must beat reading in place by. ``stage_plan`` weighs the pieces and splits of a staged
call with them; ``planner`` decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def split_range(n_tiles: int, num_splits: int, split: int) -> tuple[int, int]:
    """Tiles [start, stop) of one split: contiguous, balanced to within one tile."""
    per = n_tiles // num_splits
    extra = n_tiles % num_splits
    start = split * per + min(split, extra)
    stop = start + per + (1 if split < extra else 0)
    return start, stop


@dataclass(frozen=True)
class TileRead:
    """One tile a CTA loads: tokens [tok_start, tok_stop) of one sequence and KV head."""

    batch: int
    kv_head: int
    split: int
    tok_start: int
    tok_stop: int


def decode_schedule(seq_lens, num_kv_heads: int, tile_n: int, num_splits: int):
    """Every tile load the decode kernel issues, as TileRead records."""
    reads = []
    for b, n in enumerate(seq_lens):
        n_tiles = math.ceil(n / tile_n)
        for h in range(num_kv_heads):
            for s in range(num_splits):
                t0, t1 = split_range(n_tiles, num_splits, s)
                for t in range(t0, t1):
                    reads.append(TileRead(b, h, s, t * tile_n, min(n, (t + 1) * tile_n)))
    return reads


def kv_bytes(n_tokens: int, num_kv_heads: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Bytes of K and V for n_tokens of one layer."""
    return 2 * n_tokens * num_kv_heads * head_dim * elem_bytes


def decode_traffic(seq_lens, page_hbm, num_kv_heads, head_dim, page_size, tile_n, num_splits, elem_bytes=2):
    """(host_bytes, hbm_bytes) of K/V the decode schedule reads for one layer.

    page_hbm[b][p] tells whether page p of sequence b lives in the HBM tier. Tiles read whole
    page rows up to the tile end (a partial last page is read to its tile boundary), so this
    counts tokens rounded up to the tile the way the kernel's TMA copies do, capped at the
    sequence's allocated pages.
    """
    host = hbm = 0
    row = 2 * head_dim * elem_bytes  # one token of K and V for one head
    for r in decode_schedule(seq_lens, num_kv_heads, tile_n, num_splits):
        n_pages = math.ceil(seq_lens[r.batch] / page_size)
        stop = min(r.tok_start + tile_n, n_pages * page_size)
        tok = r.tok_start
        while tok < stop:
            p = tok // page_size
            chunk = min(stop, (p + 1) * page_size) - tok
            if page_hbm[r.batch][p]:
                hbm += chunk * row
            else:
                host += chunk * row
            tok += chunk
    return host, hbm


# ---- staged vs in-place multi-token attention ---------------------------------------------------
# The cost model. Its rates are the GPU's (``machine.MachineModel``, from the profile); what is
# here is its estimates and the margins a staged estimate must beat reading in place by (the
# pieces and splits it is asked about are ``stage_plan``'s).

def causal_flops(seq_lens, q_lens, num_q_heads: int, head_dim: int) -> float:
    """Multiply-add FLOPs (x2) of causal attention: query j of a sequence of length L and q_len
    Q sees L - Q + j + 1 keys; two GEMMs (Q K^T, P V) of 2 x d FLOPs per (row, key)."""
    pairs = sum(q * (n - q) + q * (q + 1) / 2 for n, q in zip(seq_lens, q_lens))
    return 4.0 * num_q_heads * head_dim * pairs


@dataclass(frozen=True)
class StagedChoice:
    """The cost model's verdict for one multi-token call (ms estimates)."""

    in_place_ms: float  # the kernel reading host pages in place
    staged_ms: float  # copy engine into HBM, overlapped with the Q-tiled kernel, at ``splits``
    staged: bool
    splits: int  # KV splits of the staged call
    by_head: bool = False  # one split, the copy and the CTAs head by head (``head_major_ms``)
    coarse: bool = False  # one split in ``stage_plan.LINK_PIECES`` pieces, its CTAs one wave (``one_wave_ms``)
    pipelined: bool = False  # weighed as a call whose copy runs ahead of its kernel (``pipelined_ms``)


# Calls whose in-place compute reaches this share of their link time are compute-bound: staged
# when the model's estimate beats reading in place by 3%. Below it the in-place kernel sits at
# the link and staging only wins the copy engine's edge over SM reads of host memory, less
# ``copy_call_ms`` per copy call (one run of consecutive pages of one sequence in one piece), so
# a link-bound call stages only when the estimate beats reading in place by LINK_STAGE_MARGIN.
# Fitted to decode at batch 1/16/64 over 1k-128k tokens (the model within 4% of every staged
# time): staging wins from about 16k tokens per sequence and loses up to 22% on many short
# sequences (batch 64 over 1k: 512 copy calls).
COMPUTE_SHARE = 0.5
COMPUTE_STAGE_MARGIN = 0.97
LINK_STAGE_MARGIN = 0.98
HYBRID_STAGE_SHARE = 0.05

# Calls whose staged copies run ahead of their kernels, back to back (a model's layers): the run
# lasts about its calls' copies plus what the last call's kernel still has to do once its copy
# has landed (its tail), weighed as 1 / RUN_CALLS of it per call (measured at 32k q2048 with the
# step's window, history in one piece: 2.28 ms per call in the run, 3.65 for the call that waited
# for a whole copy and then its whole kernel).
RUN_CALLS = 32


def chunk_tail_ms(m, total_q: int) -> float:
    """The chunk kernel's time past the link for ``total_q`` query tokens (0: not the chunk kernel)."""
    return m.chunk_tail_ms + m.chunk_tail_ms_per_token * total_q if total_q else 0.0


def copy_time_ms(m, host_bytes: int, calls: int, flags: int = 0) -> float:
    """The copy engine's time for ``host_bytes`` in ``calls`` copy calls and ``flags`` ready flags."""
    return host_bytes / (m.memcpy_gbps * 1e6) + calls * m.copy_call_ms + flags * m.flag_ms


def compute_bound(m, host_bytes: int, flops: float) -> bool:
    """Whether the in-place kernel's compute reaches ``COMPUTE_SHARE`` of the call's link time."""
    return flops / (m.chunked_tflops * 1e9) >= COMPUTE_SHARE * host_bytes / (m.link_gbps * 1e6)


def trails_copy(m, host_bytes: int, flops: float) -> bool:
    """Whether the Q-tiled kernel's compute of a staged call is shorter than the copy of its pages."""
    return flops / (m.q_tiled_tflops * 1e9) < host_bytes / (m.memcpy_gbps * 1e6)


def may_stage(m, host_bytes: int, flops: float, hbm_bytes: int = 0, copy_calls: int = 1, chunk_q: int = 0,
              window: bool = False) -> bool:
    """Whether staging can pay at all (checked before any staging plan): a compute-bound call, or
    a link-bound one with every page on the host whose copy at the copy engine's rate in at least
    ``copy_calls`` calls, plus the staged call's overhead, beats reading the same bytes in place by
    ``LINK_STAGE_MARGIN``.
    A link-bound call with more than ``HYBRID_STAGE_SHARE`` of its bytes in HBM reads in place:
    the streaming kernel overlaps those pages with the host reads (measured with staging that
    copied them first: decode at 25% HBM, batch 1-64, 8k-128k, 12-37% slower staged). A few
    pages in HBM (the window mirroring a step's new tokens) may be staged, and so may any number
    where they form one run per sequence (``window``, given for chunks; the staged kernel reads
    them where they are; measured with a chunk's own pages mirrored: 8k q512 0.644 ms staged,
    0.701 in place).
    ``chunk_q``: the query tokens of a call the chunk kernel would run in place (its
    ``chunk_tail_ms`` past the link); 0 for the streaming kernel."""
    if compute_bound(m, host_bytes, flops):
        return True
    if hbm_bytes > HYBRID_STAGE_SHARE * host_bytes and not window:
        return False
    in_place = host_bytes / (m.link_gbps * 1e6) + chunk_tail_ms(m, chunk_q)
    return copy_time_ms(m, host_bytes, copy_calls) + m.stage_overhead_ms < LINK_STAGE_MARGIN * in_place


def staged_ms(m, copy_ms: float, compute_ms: float, partial_bytes: float, splits: int,
              waiting: float = 0.0) -> float:
    """A staged call in ``splits`` KV splits: the first split's copy is exposed (the CTAs of a
    split are paced by its pieces), then max(the rest of the copy, the compute), plus, with
    several splits, the last split's fold (``partial_bytes``: one split's fp32 O and LSE read and
    written); the other splits' folds run with the compute, so they count there. ``waiting``: the
    share of a split's CTAs that find no SM while its pieces land (1 - SMs / CTAs per split): their
    part of the last split's compute comes after the copy."""
    first = copy_ms / splits
    partials = 0.0
    if splits > 1:
        partials = partial_bytes / (m.partial_gbps * 1e6)
        compute_ms += (splits - 1) * partials
    body = max(first + max(copy_ms - first, compute_ms), copy_ms + waiting * compute_ms / splits)
    return body + partials + m.stage_overhead_ms


def kernel_ms(m, q_ms: float, partial_bytes: float, splits: int, ctas: int = 0, sms: int = 0) -> float:
    """The Q-tiled kernel of a staged call whose pages have landed, in ``splits`` KV splits:
    ``q_ms`` (its compute or buffer reads) over the SMs its ``ctas`` x ``splits`` CTAs fill, plus
    the folds of every split past the first."""
    busy = min(1.0, ctas * splits / sms) if ctas and sms else 1.0
    return q_ms / busy + (splits - 1) * partial_bytes / (m.fold_gbps * 1e6)


def pipelined_ms(m, copy_ms: float, q_ms: float, partial_bytes: float, splits: int, ctas: int = 0,
                 sms: int = 0, wait_ms: float = 0.0, tail_ms: float = 0.0) -> float:
    """A staged call whose copy runs ahead of its kernel (the previous staged call's kernel is
    still running, and its copy waits only for the kernel two calls back): calls follow each other
    one per max(copy, kernel), so the first piece's copy is not exposed; pieces only cost copy
    calls and flags, and splits only their folds. Except the copy of host pages the step has just
    written (``wait_ms`` of it): it waits for the previous kernel, and the kernel's first CTAs
    (the heaviest query tiles, which read them) wait for it in turn (measured at 16k q8192, the
    step's 8192 tokens on the host: 2.82 ms per call, about the kernel plus that copy, against
    2.38 planned for one call). The run's last kernel's ``tail_ms`` (``pipelined_tail_ms``) is
    shared among ``RUN_CALLS`` calls."""
    k = kernel_ms(m, q_ms, partial_bytes, splits, ctas, sms)
    return max(copy_ms, k + wait_ms) + tail_ms / RUN_CALLS + m.stage_overhead_ms


def split_work(seq_lens, q_lens, tile_n: int, split_tiles: int, splits: int) -> list[float]:
    """Each KV split's share of a causal chunk's attention work (split s: keys [s, s + 1) x
    ``split_tiles`` x ``tile_n``; a query row sees the keys before it and itself)."""
    import numpy as np

    work = np.zeros(splits)
    lo = np.arange(splits)[:, None] * split_tiles * tile_n
    for n, q in zip(seq_lens, q_lens):
        seen = (n - q + 1 + np.arange(q))[None, :]  # (1, q): keys each row sees
        work += np.clip(np.minimum(lo + split_tiles * tile_n, seen) - lo, 0, None).sum(axis=1)
    total = work.sum()
    return (work / total).tolist() if total else [1.0 / splits] * splits


def pipelined_tail_ms(copy_ms: float, q_ms: float, fold_ms: float, work, landed, busy: float = 1.0) -> float:
    """What the last kernel of a run of back-to-back staged calls does after its copy has landed:
    its splits run in launch order, ``work[i]`` the share of ``q_ms`` of the i-th launched and
    ``landed[i]`` the share of the copy after which its pages are all in (None: pages ready before
    the copy starts, run while it goes); each split after the first folds (``fold_ms``), and the
    CTAs of one split fill ``busy`` of the SMs. A list-scheduling bound: T = max over copied
    splits j of (landed_j x copy + the work from j on), the tail T - copy (at least 0)."""
    end, rest = copy_ms, 0.0
    for i in range(len(work) - 1, -1, -1):
        rest += work[i] * q_ms / busy + (fold_ms if i else 0.0)
        if landed[i] is not None:
            end = max(end, landed[i] * copy_ms + rest)
    return end - copy_ms


def head_major_ms(m, copy_ms: float, compute_ms: float, heads: int) -> float:
    """A staged call copied head by head, its CTAs head-major, one split: a two-stage pipeline
    of ``heads`` equal items (copy of head h, then its compute), so the first head's copy and the
    last head's compute are exposed, no partials."""
    c, k = copy_ms / heads, compute_ms / heads
    return c + (heads - 1) * max(c, k) + k + m.stage_overhead_ms


def one_wave_ms(m, copy_ms: float, compute_ms: float, pieces: int) -> float:
    """One split whose CTAs all run at once: each walks a piece's tiles as the piece lands, so the
    copy and then the last piece's share of the compute, or the first piece's copy and then the
    whole compute where that is longer."""
    return max(copy_ms + compute_ms / pieces, copy_ms / pieces + compute_ms) + m.stage_overhead_ms


def in_place_ms(m, read_bytes: int, flops: float, chunk_q: int = 0) -> float:
    """The in-place kernel's estimate: max(``read_bytes`` at the link, its compute), plus
    ``chunk_tail_ms(chunk_q)`` for the chunk kernel."""
    return max(read_bytes / (m.link_gbps * 1e6), flops / (m.chunked_tflops * 1e9)) + chunk_tail_ms(m, chunk_q)


def q_read_ms(m, flops: float, kv_read_bytes: int) -> float:
    """The Q-tiled kernel's time over landed pages: its compute, or its reads of the buffer."""
    return max(flops / (m.q_tiled_tflops * 1e9), kv_read_bytes / (m.q_tiled_read_gbps * 1e6))


def stage_margin(m, host_bytes: int, flops: float) -> float:
    """How much faster than reading in place a staged estimate must be to be chosen."""
    return COMPUTE_STAGE_MARGIN if compute_bound(m, host_bytes, flops) else LINK_STAGE_MARGIN


# A batch whose sequences share pages is attended by the cascade (each shared span once, each
# sequence's own pages, in place: about the unique bytes at the link plus the staged call's
# overhead per pass) unless one staged call of the whole batch -- the staging copies each
# distinct page once, at the copy engine's rate -- is estimated faster by this margin (the staged
# model is up to 11% optimistic on many short own parts). Fitted to ``python -m bench prefix``,
# batch 4-64 over a 32k prompt with 0/1k/8k own tokens: the margin picks the faster of the two on
# every row.
CASCADE_MARGIN = 0.95


def cascade_ms(m, host_bytes: int, passes: int) -> float:
    """The cascade's estimate: ``host_bytes`` (the unique pages) at the link, ``passes`` passes."""
    return host_bytes / (m.link_gbps * 1e6) + passes * m.stage_overhead_ms


def stage_instead_of_cascade(m, host_bytes: int, passes: int, staged: StagedChoice | None) -> bool:
    """Whether one staged call of the batch beats its cascade (see ``CASCADE_MARGIN``)."""
    return staged is not None and staged.staged and \
        staged.staged_ms < CASCADE_MARGIN * cascade_ms(m, host_bytes, passes)


def partial_bytes(total_q: int, num_q_heads: int, head_dim: int) -> int:
    """fp32 partial O and LSE of one split, written and read back once (a split's fold)."""
    return 2 * total_q * num_q_heads * (head_dim + 1) * 4
