"""Query rows in, outputs and partials out: the kernels' global-memory I/O besides the KV ring.

Row r of a block of query rows is token ``tok0 + r // group``, head ``r % group`` of the KV
head's GQA group. With ``split_out`` a CTA writes its normalised partial O (fp32) and LSE for the
combine kernel; otherwise the final O (q dtype) and LSE. The multi-token kernel carries a block's
softmax state across chunks in the split's partial (``store`` then ``reload``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from directkv_cute.kernels.helpers import LOG2_E, acc_as_mn


class QIO:
    """Static configuration of the query and output I/O. ``q_per_wg``: query tokens of a 64-row
    block (the multi-token kernel's blocks; 0 when the GQA group exceeds 64 rows)."""

    def __init__(self, dtype, head_dim: int, group: int, q_per_wg: int, split_out: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.group = group
        self.q_per_wg = q_per_wg
        self.split_out = split_out

    @cute.jit
    def load_q(self, mQ, sQ, q_start, q_len, kvh, ctidx, tok0, n_thr, q_per_block):
        """``n_thr`` consumer threads gather a block of query rows into ``sQ`` (rows, d)."""
        rQ = cute.make_rmem_tensor((8, cute.size(sQ, mode=[0]) * self.head_dim // 8 // n_thr), self.dtype)
        self.gather_q(mQ, rQ, q_start, q_len, kvh, ctidx, tok0, n_thr, q_per_block)
        self.store_q(rQ, sQ, ctidx, n_thr)

    @cute.jit
    def gather_q(self, mQ, rQ, q_start, q_len, kvh, ctidx, tok0, n_thr, q_per_block):
        """Issue this thread's loads of a block of query rows (row r = token tok0 + r // group,
        head r % group of the KV head's group) into ``rQ`` (8, pieces), one 16-byte piece per
        column; rows past the block's tokens are zero. Fully unrolled, nothing waits on a load
        here: the caller overlaps them with other loads before ``store_q`` consumes them."""
        d, group, vec = self.head_dim, self.group, 8  # 8 x 16-bit = one 16-byte access
        n_valid = cutlass.min(q_len - tok0, q_per_block)
        for k in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
            i = ctidx + k * n_thr
            r = i // (d // vec)
            qi = r // group
            if qi < n_valid:
                gQv = cute.local_tile(mQ[q_start + tok0 + qi, kvh * group + r % group, None], (vec,), (i % (d // vec),))
                cute.autovec_copy(gQv, rQ[None, k])
            else:
                rQ[None, k].fill(self.dtype(0.0))

    @cute.jit
    def gather_q_regs(self, mQ, rQc, thr_pv, q_start, q_len, kvh, tok0):
        """Load this thread's elements of a pass's Q rows into ``rQc`` ((64, d) in the P V
        accumulator layout): 4-byte column pairs, as ``reload`` reads the partial; rows past the
        block's tokens are zero. Nothing waits here: the first Q K^T WGMMA does."""
        group, d = self.group, self.head_dim
        tQcQ = acc_as_mn(thr_pv.partition_C(cute.make_identity_tensor((64, d))))
        q_mn = acc_as_mn(rQc)
        for r in cutlass.range_constexpr(cute.size(q_mn, mode=[0])):
            row = tQcQ[r, 0][0]
            qi = row // group
            if qi < cutlass.min(q_len - tok0, self.q_per_wg):
                self.load_pairs(q_mn, tQcQ, r, mQ[q_start + tok0 + qi, kvh * group + row % group, None], self.dtype)
            else:
                for c in cutlass.range_constexpr(cute.size(q_mn, mode=[1])):
                    q_mn[r, c] = self.dtype(0.0)

    @cute.jit
    def load_pairs(self, x_mn, tXcX, r, g_row, dtype: cutlass.Constexpr):
        """Row ``r`` of ``x_mn`` (this thread's (row, column) view of a (64, d) accumulator-layout
        tensor, ``tXcX`` its coordinates) from ``g_row`` (d,) in ``dtype``: the thread's columns come
        in adjacent pairs (2c, 2c + 1), one vector load each."""
        for c in cutlass.range_constexpr(cute.size(x_mn, mode=[1]) // 2):
            rPair = cute.make_rmem_tensor((2,), dtype)  # (2,) columns 2c, 2c + 1
            cute.autovec_copy(cute.local_tile(g_row, (2,), (tXcX[r, 2 * c][1] // 2,)), rPair)
            x_mn[r, 2 * c] = rPair[0]
            x_mn[r, 2 * c + 1] = rPair[1]

    @cute.jit
    def store_q(self, rQ, sQ, ctidx, n_thr):
        """Write the pieces ``gather_q`` loaded into ``sQ`` (rows, d)."""
        d, vec = self.head_dim, 8
        for k in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
            i = ctidx + k * n_thr
            sQv = cute.local_tile(sQ[i // (d // vec), None], (vec,), (i % (d // vec),))  # (8,) swizzle keeps 16 B whole
            cute.autovec_copy(rQ[None, k], sQv)

    @cute.jit
    def prefetch_block(self, mQ, mO, split, q_start, q_len, kvh, tok0, wg_tidx, with_partial):
        """Prefetch into L2 one block's Q rows (and, ``with_partial``, its fp32 partial O)."""
        n_tok = cutlass.min(q_len - tok0, self.q_per_wg)
        self.prefetch_rows(mQ, q_start + tok0, kvh, n_tok, wg_tidx)
        if const_expr(self.split_out):
            if with_partial:
                self.prefetch_rows(mO[split, None, None, None], q_start + tok0, kvh, n_tok, wg_tidx)

    @cute.jit
    def prefetch_rows(self, mRows, tok0, kvh, n_tok, wg_tidx):
        """Prefetch into L2 the GQA group of KV head ``kvh`` for tokens [tok0, tok0 + n_tok) of a
        (tokens, Hq, d) tensor: each token's group is one contiguous run of ``group * d``
        elements. The 128 threads of a warpgroup issue one prefetch per 128-byte line."""
        group, d = self.group, self.head_dim
        elems = 128 * 8 // mRows.element_type.width  # elements per line
        lines = group * d // elems  # lines per token
        for k in cutlass.range_constexpr((self.q_per_wg * lines + 127) // 128):
            i = wg_tidx + k * 128
            if i // lines < n_tok:
                row = mRows[tok0 + i // lines, kvh * group, None]  # (d,) first head of the group
                cute.arch.prefetch((row.iterator + (i % lines) * elems).to_llvm_ptr(), cache_level="L2")

    @cute.jit
    def store(self, mO, mLSE, acc_O, lse, thr_pv, split, q_start, q_len, kvh, row0, tok0, q_per_block):
        """Write this warpgroup's rows of O (and their LSE) for valid query tokens."""
        group, d = self.group, self.head_dim
        o_split = 0
        if const_expr(self.split_out):
            o_split = split
        tOcO = acc_as_mn(thr_pv.partition_C(cute.make_identity_tensor((64, d))))
        o_mn = acc_as_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = row0 + tOcO[r, 0][0]
            qi = row // group
            if qi < cutlass.min(q_len - tok0, q_per_block):
                head = kvh * group + row % group
                gO_row = mO[o_split, q_start + tok0 + qi, head, None]  # (d,)
                # Columns come in pairs (2c, 2c + 1) held in adjacent registers: one vector store
                # each, so a quad of lanes writes a whole 32-byte sector of the row at once.
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                    gO = cute.local_tile(gO_row, (2,), (tOcO[r, 2 * c][1] // 2,))  # (2,)
                    rO = cute.make_rmem_tensor((2,), gO.element_type)  # (2,)
                    rO[0] = o_mn[r, 2 * c].to(gO.element_type)
                    rO[1] = o_mn[r, 2 * c + 1].to(gO.element_type)
                    cute.autovec_copy(rO, gO)
                if tOcO[r, 0][1] == 0:
                    mLSE[o_split, q_start + tok0 + qi, head] = lse[r]

    @cute.jit
    def merge(self, mAcc, mAccLSE, acc_O, lse, thr_pv, q_start, q_len, kvh, row0, tok0, q_per_block):
        """Fold a running (normalised O, LSE) from ``mAcc`` / ``mAccLSE`` (1, tokens, Hq, ...) into
        this warpgroup's finalised rows: O = (w_a O_a + w_b O_b) / (w_a + w_b), LSE = log(e^a +
        e^b), in registers; a side that saw no key (LSE -inf) weighs 0, two such stay empty. Every
        load is issued before any is used."""
        group, d = self.group, self.head_dim
        tOcO = acc_as_mn(thr_pv.partition_C(cute.make_identity_tensor((64, d))))
        o_mn = acc_as_mn(acc_O)
        rAcc = cute.make_rmem_tensor_like(acc_O, Float32)
        a_mn = acc_as_mn(rAcc)  # the accumulator's values at this thread's (row, column)s
        rLse = cute.make_rmem_tensor((cute.size(o_mn, mode=[0]),), Float32)  # (rows,) its LSEs
        n_valid = cutlass.min(q_len - tok0, q_per_block)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = row0 + tOcO[r, 0][0]
            qi = row // group
            rLse[r] = -Float32.inf
            if qi < n_valid:
                head = kvh * group + row % group
                rLse[r] = mAccLSE[0, q_start + tok0 + qi, head]
                self.load_pairs(a_mn, tOcO, r, mAcc[0, q_start + tok0 + qi, head, None], Float32)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            top = cutlass.max(rLse[r], lse[r])
            ref = Float32(0.0)
            if top != -Float32.inf:
                ref = top
            w_a = cute.math.exp2((rLse[r] - ref) * LOG2_E, fastmath=True)
            w_b = cute.math.exp2((lse[r] - ref) * LOG2_E, fastmath=True)
            total = w_a + w_b
            inv = Float32(0.0)
            merged = -Float32.inf
            if total > Float32(0.0):
                inv = Float32(1.0) / total
                merged = ref + cute.math.log(total, fastmath=True)
            lse[r] = merged
            w_a = w_a * inv
            w_b = w_b * inv
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[r, c] = w_a * a_mn[r, c] + w_b * o_mn[r, c]

    @cute.jit
    def reload(self, mO, mLSE, acc_O, row_max, row_sum, thr_pv, split, q_start, q_len, kvh, tok0, scale_log2):
        """Resume a block's online softmax from the normalised partial O and LSE this thread
        stored after the previous chunk: O_norm with max = LSE (in raw-score units) and sum = 1
        (a quarter on each of the 4 lanes that share a row). Rows past the block's tokens start
        empty."""
        group, d = self.group, self.head_dim
        tOcO = acc_as_mn(thr_pv.partition_C(cute.make_identity_tensor((64, d))))
        o_mn = acc_as_mn(acc_O)
        to_raw = LOG2_E / scale_log2
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = tOcO[r, 0][0]
            qi = row // group
            if qi < cutlass.min(q_len - tok0, self.q_per_wg):
                head = kvh * group + row % group
                self.load_pairs(o_mn, tOcO, r, mO[split, q_start + tok0 + qi, head, None], Float32)
                row_max[r] = mLSE[split, q_start + tok0 + qi, head] * to_raw
                row_sum[r] = Float32(0.25)
            else:
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    o_mn[r, c] = Float32(0.0)
                row_max[r] = -Float32.inf
                row_sum[r] = Float32(0.0)
