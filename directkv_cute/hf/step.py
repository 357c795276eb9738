"""A model step over the batch's sequences: ``BatchSequences`` maps batch rows to ``PagedKVCache``
sequences (rows with identical tokens share one), plans each step once -- the real new tokens,
forks of diverging rows and shared prompt prefixes, growth and placement (``step_plan``), window
mirrors, the store slots, the kernel tables and the attention plan (``DirectKVAttention.plan``:
kernel, staging, the cascade over shared pages) -- and undoes a failed step.

``Step`` is what every layer of the step reuses, and it runs a layer: ``run`` stores the layer's
new K/V into their pages (``store``: ``PagedKVCache.write_slots``) and attends (``attend``: the
step's plan over every row's whole history); ``run_fused`` stores them with ``kv_project`` from
the layer's ``KVProjection`` instead (``store_fused``: one kernel for the K/V projection, RoPE
and the stores, into the same destinations, ``PagedKVCache.write_destinations``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from directkv_cute.attention import DirectKVAttention
from directkv_cute.cache import CacheCapacityError, PagedKVCache
from directkv_cute.hf.step_plan import (
    fork_needs,
    identical_rows,
    plan_step_growth,
    shared_prefixes,
    stored_tokens,
    valid_tokens,
)
from directkv_cute.kv_proj import kv_project
from directkv_cute.sparse import RecallCounts, SparseBudget

# The HBM tier as a sparse budget's recall cache (``BatchSequences.recall_preferred``): per step a
# page's score is the (layer, row) selections of it since the last step plus this share of its
# score before; pages scoring at least RECALL_MIN_SCORE x the model's layers are kept in HBM.
RECALL_DECAY = 0.5
RECALL_MIN_SCORE = 0.5


@dataclass
class Undo:
    """What undoing a step needs: the batch rows' sequences before it, the lengths of the
    sequences it found, and the sequences it made (new ones, forks)."""

    seqs: list[int]
    lengths: list[tuple[int, int]]
    created: list[int]


@dataclass(frozen=True)
class KVProjection:
    """A fused layer's K/V inputs (``hf.fused.fuse_kv_projection``), from which ``kv_project``
    computes K and V and applies RoPE: the layer's input rows ``x`` (B * S, hidden), its k_proj /
    v_proj weights (Hkv * d, hidden) and biases (or None), the rotary ``cos`` / ``sin`` (B * S,
    d)."""

    x: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    b_k: torch.Tensor | None
    b_v: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           query: torch.Tensor) -> "KVProjection":
        """The inputs of attention module ``module`` for ``hidden_states`` (B, S, hidden) and the
        rotary ``cos`` / ``sin`` (B, S, d) of a layer whose ``query`` is (B, Hq, S, d)."""
        batch, _, q_len, d = query.shape
        if hidden_states.shape[:2] != (batch, q_len):
            raise ValueError(f"hidden_states {tuple(hidden_states.shape)} do not match query {tuple(query.shape)}")
        return cls(hidden_states.reshape(batch * q_len, -1), module.k_proj.weight, module.v_proj.weight,
                   module.k_proj.bias, module.v_proj.bias, cos.reshape(-1, d), sin.reshape(-1, d))

    def dense(self, query: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (B, Hkv, S, d) of the layer whose ``query`` is (B, Hq, S, d), as dense tensors
        in its dtype (no page store)."""
        batch, _, q_len, d = query.shape
        kd = torch.empty(batch * q_len, num_kv_heads, d, dtype=query.dtype, device=query.device)
        vd = torch.empty_like(kd)
        kv_project(self.x.contiguous(), self.w_k, self.w_v, self.b_k, self.b_v, cos=self.cos.contiguous(),
                   sin=self.sin.contiguous(), out_k=kd, out_v=vd, check_slots=False)
        return kd.view(batch, q_len, -1, d).transpose(1, 2), vd.view(batch, q_len, -1, d).transpose(1, 2)

    def store(self, destinations: dict, layer: int, sel: torch.Tensor | None) -> None:
        """K and V of the rows ``sel`` (int64, None: all) into ``destinations`` (``kv_project``'s
        ``host=`` / ``hbm=``, ``PagedKVCache.write_destinations``) at layer ``layer``."""
        x, c, s = self.x, self.cos, self.sin
        if sel is not None:
            x, c, s = x[sel], c[sel], s[sel]
        kv_project(x.contiguous(), self.w_k, self.w_v, self.b_k, self.b_v, cos=c.contiguous(), sin=s.contiguous(),
                   layer=layer, check_slots=False, **destinations)


@dataclass
class Step:
    """One forward step, planned by its first layer and reused by the others; it runs each layer
    (``run``, ``run_fused``)."""

    kv: PagedKVCache
    batch: int
    q_len: int
    rows: list[int]  # batch rows with at least one real new token
    q_lens: list[int]  # their real new tokens
    seq_ids: list[int]  # their sequences
    tok_idx: torch.Tensor | None  # int64 (total,) rows of (B * S) that are real, None when all are
    slots: object  # TokenSlots of the real tokens, row by row
    tables: object | None  # KernelTables of `rows`
    max_seq_len: int
    undo: Undo  # what rolling the step back needs
    processed_before: int
    attn: DirectKVAttention | None = None  # planned for this step's tables (None when no row has tokens)
    write_idx: torch.Tensor | None = None  # int64: the real tokens stored (merged rows store once), None: all
    defer_host: bool = False  # mirrored pages reach their host pages by the copy engine (write_slots)
    layers_done: int = 0  # layers that ran to the end; the step is complete once all have

    def complete(self, num_layers: int) -> bool:
        """True once every layer of the model ran."""
        return self.layers_done >= num_layers

    # ---- one layer -------------------------------------------------------------------------
    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling, layer_idx: int) -> torch.Tensor:
        """One layer: its new ``key`` / ``value`` (B, Hkv, S, d) stored into their pages, then its
        attention; ``query`` (B, Hq, S, d) -> (B, S, Hq, d), zeros for pad rows."""
        batch, hq, q_len, d = query.shape
        hkv = key.shape[1]
        k = key.transpose(1, 2).reshape(batch * q_len, hkv, d)  # (B * S, Hkv, d)
        v = value.transpose(1, 2).reshape(batch * q_len, hkv, d)  # (B * S, Hkv, d)
        if self.tok_idx is not None:
            k, v = k[self.tok_idx], v[self.tok_idx]
        if not self.rows:
            return query.new_zeros(batch, q_len, hq, d)
        self.store(layer_idx, k, v)
        return self.attend(query, scaling, layer_idx)

    def run_fused(self, query: torch.Tensor, projection: KVProjection, scaling, layer_idx: int) -> torch.Tensor:
        """One layer whose K/V ``kv_project`` computes from ``projection`` and stores into their
        pages (``store_fused``), then its attention; as ``run``."""
        self.kv.check_slots(self.slots)  # kv_project writes where they point
        batch, hq, q_len, d = query.shape
        if not self.rows:
            return query.new_zeros(batch, q_len, hq, d)
        self.store_fused(layer_idx, projection)
        return self.attend(query, scaling, layer_idx)

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The layer's K/V of the step's real tokens ((total, Hkv, d), row by row) into their pages
        (and window mirrors), each sequence's tokens once (rows that share a sequence, a shared
        prompt prefix)."""
        if self.write_idx is not None:
            k, v = k.index_select(0, self.write_idx), v.index_select(0, self.write_idx)
        self.kv.write_slots(self.slots, layer_idx, k, v, defer_host=self.defer_host)

    def store_fused(self, layer_idx: int, projection: KVProjection) -> None:
        """``store`` with the K/V computed by ``kv_project``, which stores them itself into the
        destinations ``write_slots`` would; then the cache's part of that store (the page
        summaries brought up to date, the host writes recorded, the copy engine's copy of the
        mirrored pages queued)."""
        sel = self.tok_idx
        if self.write_idx is not None:
            sel = self.write_idx if sel is None else sel[self.write_idx]
        projection.store(self.kv.write_destinations(self.slots, self.defer_host), layer_idx, sel)
        self.kv.refresh_summaries(self.slots, layer_idx)  # the page summaries of the rows just stored
        self.kv.note_host_write(self.slots)  # staged calls copy these host pages after the kernel
        if self.defer_host:
            self.kv.copy_mirrors_to_host(self.slots, layer_idx)

    def attend(self, query: torch.Tensor, scaling, layer_idx: int) -> torch.Tensor:
        """One layer's attention of every row over its whole history, the step's new tokens
        stored, under the step's plan: ``query`` (B, Hq, S, d) -> (B, S, Hq, d), zeros for the
        query rows of pad tokens."""
        batch, hq, q_len, d = query.shape
        q = query.transpose(1, 2).reshape(batch * q_len, hq, d)  # (B * S, Hq, d)
        if self.tok_idx is not None:
            q = q[self.tok_idx]
        o = self.attn.run(q.contiguous(), layer_idx, softmax_scale=scaling)  # (total, Hq, d)
        if self.tok_idx is None:
            return o.view(batch, q_len, hq, d)
        out = query.new_zeros(batch * q_len, hq, d)
        out[self.tok_idx] = o
        return out.view(batch, q_len, hq, d)


class BatchSequences:
    """The ``PagedKVCache`` sequence of each batch row (``seqs``) and the planning of a step over
    them. ``hbm`` placement: each sequence's equal share of the HBM tier holds its first
    ``sink_pages`` pages and its most recent ones. ``sparse``: the ``SparseBudget`` decode steps
    are planned under (None: exact); with an HBM tier, the tier is also their recall cache: the
    pages their selections keep choosing are moved there (``recall_preferred``)."""

    def __init__(self, kv: PagedKVCache, sink_pages: int, share_prompts: bool,
                 sparse: SparseBudget | None = None) -> None:
        self.kv = kv
        self.attention = DirectKVAttention(kv)  # planned once per step, run by every layer
        self.sink_pages = sink_pages
        self.share_prompts = share_prompts
        self.sparse = sparse
        self.seqs: list[int] = []
        self.recall: RecallCounts | None = None
        self._scores: dict[int, np.ndarray] = {}  # sequence -> decayed selection counts per logical page
        if sparse is not None and kv.num_pages("hbm") > 0:
            # sized by the pools: a table may also name the HBM window's mirrors (past the tier)
            self.recall = RecallCounts(kv.device_pool("host").shape[0], kv.device_pool("hbm").shape[0], kv.device)
            self.attention.sparse_hooks.append(self.recall)

    def reset(self) -> None:
        for sid in dict.fromkeys(self.seqs):
            self.kv.free(sid)
        self.seqs = []
        self._scores = {}
        if self.recall is not None:
            self.recall.take()

    def recall_preferred(self, sids) -> dict[int, list[int]]:
        """Each sequence's logical pages worth a place in HBM, best first: the selection counts
        since the last step (``RecallCounts.take``, one copy from the device) added to the
        earlier ones halved (``RECALL_DECAY``), those at least ``RECALL_MIN_SCORE`` x the layers.
        A page moved to HBM costs one read of all its layers; a page every layer chose in the last
        step, or half the layers in each of the last steps, is read that often anyway."""
        host, hbm = self.recall.take()
        kept = {}
        out = {}
        for sid in sids:
            e = np.asarray(self.kv.page_table(sid), dtype=np.int64)
            hits = np.where(e >= 0, host[np.clip(e, 0, None)], hbm[np.clip(-e - 1, 0, None)]) if e.size else e
            old = self._scores.get(sid, np.zeros(0))
            score = hits.astype(np.float64)
            n = min(old.size, score.size)
            score[:n] += RECALL_DECAY * old[:n]
            kept[sid] = score
            order = np.argsort(-score, kind="stable")
            out[sid] = [int(lp) for lp in order if score[lp] >= RECALL_MIN_SCORE * self.kv.num_layers]
        self._scores = kept
        return out

    def select(self, rows: list[int]) -> None:
        """Batch rows become ``seqs[rows[i]]``; a row used again is forked (full pages shared),
        rows never used are freed. Capacity for the forks is checked first."""
        if not self.seqs:
            return
        if any(not 0 <= r < len(self.seqs) for r in rows):
            raise IndexError(f"batch rows {rows} out of range for a batch of {len(self.seqs)}")
        seen: set[int] = set()
        forks = []
        for r in rows:
            if r in seen:
                forks.append(self.seqs[r])
            seen.add(r)
        self.check_forks(forks, "forking")
        used: set[int] = set()
        new = []
        for r in rows:
            new.append(self.seqs[r] if r not in used else self.kv.fork(self.seqs[r]))
            used.add(r)
        kept = set(new)
        for sid in dict.fromkeys(self.seqs):  # merged rows hold one sequence: free it once, if no row keeps it
            if sid not in kept:
                self.kv.free(sid)
        self.seqs = new

    def check_forks(self, sids: list[int], what: str) -> None:
        """``CacheCapacityError`` unless the free pages cover a fork of each of ``sids`` (a fork
        copies the partial last page), before any is made."""
        try:
            fork_needs([self._tail(sid) for sid in sids], {t: self.kv.free_pages(t) for t in ("host", "hbm")})
        except CacheCapacityError as exc:
            raise CacheCapacityError(f"{what} {len(sids)} sequences: {exc}") from None

    def _hbm_pages(self, sid: int) -> list[int]:
        return [lp for lp, e in enumerate(self.kv.page_table(sid)) if e < 0]

    def plan(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, attention_mask,
             processed: int) -> Step:
        """Plan the step whose first layer has ``query`` (B, Hq, S, d) and new ``key``/``value``
        (B, Hkv, S, d; None when the layer projects them itself, which rules out sharing):
        sequences grown, mirrored and sliced into store slots, tables built.

        Every decision is made and the capacity of the whole step (forks of diverging rows and
        prompt prefixes, growth, placement) is checked before anything changes: a step refused
        for capacity leaves the cache as it was, mirrors included. A failure after that rolls
        the step back (``rollback``)."""
        kv = self.kv
        batch, hq, q_len, d = query.shape
        if self.seqs and batch != len(self.seqs):
            raise ValueError(f"a batch of {batch} rows for a cache holding {len(self.seqs)} sequences "
                             "(one DirectKVCache per batch; reset() it for a new one)")
        valid = valid_tokens(attention_mask, batch, q_len)  # bool (B, S) or None
        counts = [q_len] * batch if valid is None else valid.sum(dim=1).tolist()
        # ---- decisions, nothing changed yet ---------------------------------------------------
        first_step = not self.seqs
        if first_step:
            share = self.share_prompts and batch > 1
            groups = identical_rows(key, value, valid, list(range(batch))) if share else [[b] for b in range(batch)]
            prefixes = (shared_prefixes(key, value, valid, [g[0] for g in groups], kv.page_size)
                        if share and len(groups) > 1 else {})
            groups_of = {g[0]: g for g in groups}
            splits: list[tuple[int, list[int]]] = []
        else:
            prefixes, groups_of = {}, {}
            splits = self._splits(key, value, valid) if self.share_prompts and len(set(self.seqs)) < batch else []
        n_seqs = (len(groups) if first_step else len(set(self.seqs)) + len(splits))
        quota = kv.num_pages("hbm") // max(1, n_seqs)
        free = {t: kv.free_pages(t) for t in ("host", "hbm")}
        try:
            for tier, n in fork_needs([self._tail(sid) for sid, _ in splits], free).items():
                free[tier] -= n
        except CacheCapacityError as exc:
            raise CacheCapacityError(f"rows that diverged forking {len(splits)} sequences: {exc}") from None
        # Growing sequences: each existing one (its split copies grow like it), each new group
        # leader, then each prompt-prefix fork (its shared pages stay where their owner put them).
        if first_step:
            grow = [(0, [], int(counts[g[0]])) for g in groups if g[0] not in prefixes]
            grow += [(m, [], int(counts[b]) - m) for b, (_, m) in sorted(prefixes.items())]
        else:  # in the order of the rows' sequences once split (a split copy grows like its sequence)
            after: list[tuple[int, int]] = [(sid, -1) for sid in self.seqs]  # (sequence, split index)
            for i, (_, g) in enumerate(splits):
                for b in g:
                    after[b] = (after[b][0], i)
            leads: dict[tuple[int, int], int] = {}
            for b, key_ in enumerate(after):
                leads.setdefault(key_, b)
            grow = [(kv.seq_len(sid), self._hbm_pages(sid), int(counts[b])) for (sid, _), b in leads.items()]
        preferred = None
        if self.recall is not None and not first_step and quota > 0:
            ranked = self.recall_preferred(dict.fromkeys(self.seqs))
            preferred = [ranked[sid] for (sid, _) in leads]  # a split copy ranks as its sequence
        plans = plan_step_growth([g[0] for g in grow], [g[1] for g in grow], [g[2] for g in grow], kv.page_size,
                                 quota, self.sink_pages, free, preferred,
                                 self.sparse.recent_pages if self.sparse is not None else 0)
        # ---- the step's changes, undone on failure -------------------------------------------
        undo = Undo(list(self.seqs), [(sid, kv.seq_len(sid)) for sid in dict.fromkeys(self.seqs)], [])
        skip: dict[int, int] = {}  # sequence -> leading tokens of this step it shares (not stored)
        try:
            if first_step:
                self.seqs = [-1] * batch
                for g in groups:
                    if g[0] not in prefixes:  # the others fork an earlier row once it is extended
                        sid = kv.add_sequence()
                        undo.created.append(sid)
                        for b in g:
                            self.seqs[b] = sid
            for sid, g in splits:
                child = kv.fork(sid)
                undo.created.append(child)
                for b in g:
                    self.seqs[b] = child
            uniq = [sid for sid in dict.fromkeys(self.seqs) if sid >= 0]  # each sequence once, in row order
            first: dict[int, int] = {}
            for b, sid in enumerate(self.seqs):
                if sid >= 0:
                    first.setdefault(sid, b)
            before = {sid: kv.seq_len(sid) for sid in uniq}
            for sid in uniq:  # last step's full pages are current on the host: read there from now on
                kv.release_mirrors(sid)
            for sid, growth in zip(uniq, plans):
                self._grow(sid, growth)
            rows = [b for b in range(batch) if counts[b]]
            # One row per sequence stores its new tokens. Their slots are taken before any prompt
            # prefix is forked, so the forks share the pages these writes fill (no copy-on-write).
            writers = [b for b in rows if self.seqs[b] >= 0 and first[self.seqs[b]] == b]
            spans = ([self.seqs[b] for b in writers], [before[self.seqs[b]] for b in writers],
                     [int(counts[b]) for b in writers])
            for sid, start, n in zip(*spans):
                kv.mirror(sid, start, n)
            entries = [(*kv.token_entries(*spans), kv.mirror_entries(*spans))]
            taken_at = kv.page_generation  # no page may move or be freed until the slots are built
            for (b, (a, m)), growth in zip(sorted(prefixes.items()), plans[len(uniq):]):
                child = kv.fork(self.seqs[a], m)  # rows sharing an earlier row's prompt prefix fork it there
                undo.created.append(child)
                before[child], skip[child] = m, m
                for r in groups_of[b]:
                    self.seqs[r] = child
                first[child] = b
                self._grow(child, growth)
                if counts[b] > m:  # its tokens after the shared prefix, taken before any later fork of it
                    span = ([child], [m], [int(counts[b]) - m])
                    kv.mirror(child, m, int(counts[b]) - m)
                    entries.append((*kv.token_entries(*span), kv.mirror_entries(*span)))
                    writers.append(b)
            slots = kv.build_slots(*(np.concatenate([e[i] for e in entries]) for i in range(3)), taken_at=taken_at)
            seq_ids = [self.seqs[b] for b in rows]
            q_lens = [int(counts[b]) for b in rows]
            max_seq_len = max((kv.seq_len(sid) for sid in seq_ids), default=0)
            tables = attn = None
            if rows:  # the step's layers run back to back over these tables
                tables = kv.kernel_tables(seq_ids, back_to_back=True)
                attn = self.attention
                attn.plan(tables=tables, q_lens=q_lens, num_q_heads=hq, max_seq_len=max_seq_len, q=query,
                          sparse=self.sparse)
        except BaseException:
            self.undo(undo)
            raise
        tok_idx = None
        if valid is not None and sum(counts) != batch * q_len:
            tok_idx = valid.reshape(-1).nonzero().squeeze(1).to(query.device)  # (total,) row-major
        write_idx = None
        if len(writers) < len(rows) or skip:  # the stored tokens among the real tokens of `rows`
            stored = stored_tokens(rows, q_lens, writers, {b: skip.get(self.seqs[b], 0) for b in writers})
            write_idx = torch.tensor(stored, dtype=torch.long).to(query.device)
        # A chunk of at least a page per sequence: its mirrored pages are copied to the host by the
        # copy engine, off the layer's path (a decode step's few rows are stored directly). Not
        # when prompts were forked in this step: the forks read the shared pages from the host.
        defer = not prefixes and max(q_lens, default=0) >= kv.page_size
        return Step(kv, batch, q_len, rows, q_lens, seq_ids, tok_idx, slots, tables, max_seq_len, undo, processed,
                    attn, write_idx, defer)

    def _tail(self, sid: int) -> str | None:
        """The tier of the sequence's partial last page (None: it ends on a full page)."""
        if self.kv.seq_len(sid) % self.kv.page_size == 0:
            return None
        return "hbm" if self.kv.page_table(sid)[-1] < 0 else "host"

    def _grow(self, sid: int, growth) -> None:
        """Apply one sequence's ``Growth``: its demotions to host, its promotions to HBM, then its
        extends by tier."""
        if growth.demote:
            self.kv.move_pages(sid, growth.demote, "host")
        if growth.promote:
            self.kv.move_pages(sid, growth.promote, "hbm")
        for tier, n in growth.runs:
            self.kv.extend(sid, n, tier)

    def rollback(self, step: Step) -> None:
        """The step undone: sequences it made freed, the others back at their lengths before it,
        every batch row back on its sequence."""
        self.undo(step.undo)

    def undo(self, undo: "Undo") -> None:
        for sid in undo.created:
            if sid in self.kv.seq_ids:
                self.kv.free(sid)
        for sid, length in undo.lengths:
            if self.kv.seq_len(sid) > length:
                self.kv.truncate(sid, length)
        self.seqs = list(undo.seqs)

    def _splits(self, key: torch.Tensor, value: torch.Tensor, valid) -> list[tuple[int, list[int]]]:
        """(sequence, rows) for each group of rows that share a sequence but whose new tokens now
        differ from its first row's: each such group forks the sequence (its state before this
        step)."""
        by_sid: dict[int, list[int]] = {}
        for b, sid in enumerate(self.seqs):
            by_sid.setdefault(sid, []).append(b)
        splits = []
        for sid, rows in by_sid.items():
            if len(rows) > 1:
                groups = identical_rows(key, value, valid, rows)
                splits += [(sid, g) for g in groups if rows[0] not in g]
        return splits
