"""A model step over the batch's sequences: ``BatchSequences`` maps batch rows to ``PagedKVCache``
sequences (rows with identical tokens share one), plans each step once -- the real new tokens,
forks of diverging rows and shared prompt prefixes, growth and placement (``step_plan``), window
mirrors, the store slots, the kernel tables and the attention plan (``DirectKVAttention.plan``:
kernel, staging, the cascade over shared pages) -- and undoes a failed step. ``Step`` is what
every layer of the step reuses; ``Step.attention`` runs one layer under the step's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from directkv_cute.attention import DirectKVAttention
from directkv_cute.cache import CacheCapacityError, PagedKVCache, TokenSlots
from directkv_cute.hf.step_plan import (
    fork_needs,
    identical_rows,
    plan_growth,
    plan_step_growth,
    shared_prefixes,
    stored_tokens,
    valid_tokens,
)


@dataclass
class Step:
    """One forward step, planned by its first layer and reused by the others."""

    batch: int
    q_len: int
    rows: list[int]  # batch rows with at least one real new token
    q_lens: list[int]  # their real new tokens
    seq_ids: list[int]  # their sequences
    tok_idx: torch.Tensor | None  # int64 (total,) rows of (B * S) that are real, None when all are
    slots: object  # TokenSlots of the real tokens, row by row
    tables: object | None  # KernelTables of `rows`
    max_seq_len: int
    undo: list[tuple[int, int]]  # (seq_id, length before the step)
    processed_before: int
    attn: DirectKVAttention | None = None  # planned for this step's tables (None when no row has tokens)
    write_idx: torch.Tensor | None = None  # int64: the real tokens stored (merged rows store once), None: all
    defer_host: bool = False  # mirrored pages reach their host pages by the copy engine (write_slots)
    fused_dest: dict | None = None  # kv_project's destinations of the step's slots (fused layers)

    def attention(self, q: torch.Tensor, scaling, layer_idx: int) -> torch.Tensor:
        """One layer's attention of every row over its whole history, the step's new tokens
        stored, under the step's plan: q (total real tokens, Hq, d) -> (total, Hq, d)."""
        return self.attn.run(q.contiguous(), layer_idx, softmax_scale=scaling)


class BatchSequences:
    """The ``PagedKVCache`` sequence of each batch row (``seqs``) and the planning of a step over
    them. ``hbm`` placement: each sequence's equal share of the HBM tier holds its first
    ``sink_pages`` pages and its most recent ones."""

    def __init__(self, kv: PagedKVCache, sink_pages: int, share_prompts: bool) -> None:
        self.kv = kv
        self.attention = DirectKVAttention(kv)  # planned once per step, run by every layer
        self.sink_pages = sink_pages
        self.share_prompts = share_prompts
        self.seqs: list[int] = []

    def reset(self) -> None:
        for sid in dict.fromkeys(self.seqs):
            self.kv.free(sid)
        self.seqs = []

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
        kv = self.kv
        tails = [None if kv.seq_len(sid) % kv.page_size == 0 else
                 "hbm" if kv.page_table(sid)[-1] < 0 else "host" for sid in sids]
        for tier, n in fork_needs(tails).items():
            if n > kv.free_pages(tier):
                raise CacheCapacityError(f"{what} {n} sequences needs {n} free {tier} pages, "
                                         f"{kv.free_pages(tier)} free; the cache is unchanged")

    def hbm_quota(self) -> int:
        return self.kv.num_pages("hbm") // max(1, len(set(self.seqs)))

    def _hbm_pages(self, sid: int) -> list[int]:
        return [lp for lp, e in enumerate(self.kv.page_table(sid)) if e < 0]

    def plan(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, attention_mask,
             processed: int) -> Step:
        """Plan the step whose first layer has ``query`` (B, Hq, S, d) and new ``key``/``value``
        (B, Hkv, S, d; None when the layer projects them itself, which rules out sharing):
        sequences grown, mirrored and sliced into store slots, tables built. On failure every
        sequence is back at its length before the step."""
        kv = self.kv
        batch, hq, q_len, d = query.shape
        if self.seqs and batch != len(self.seqs):
            raise ValueError(f"a batch of {batch} rows for a cache holding {len(self.seqs)} sequences "
                             "(one DirectKVCache per batch; reset() it for a new one)")
        valid = valid_tokens(attention_mask, batch, q_len)  # bool (B, S) or None
        counts = [q_len] * batch if valid is None else valid.sum(dim=1).tolist()
        prefixes, groups_of = self._assign(key, value, valid, batch)
        uniq = [sid for sid in dict.fromkeys(self.seqs) if sid >= 0]  # each sequence once, in row order
        first = {}
        for b, sid in enumerate(self.seqs):
            if sid >= 0:
                first.setdefault(sid, b)
        for sid in uniq:  # last step's full pages are current on the host: read there from now on
            kv.release_mirrors(sid)
        plans = plan_step_growth([kv.seq_len(sid) for sid in uniq], [self._hbm_pages(sid) for sid in uniq],
                                 [counts[first[sid]] for sid in uniq], kv.page_size, self.hbm_quota(),
                                 self.sink_pages, {t: kv.free_pages(t) for t in ("host", "hbm")})
        undo = [(sid, kv.seq_len(sid)) for sid in uniq]
        before = dict(undo)
        skip: dict[int, int] = {}  # sequence -> leading tokens of this step it shares (not stored)
        try:
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
            for b in sorted(prefixes):  # rows sharing an earlier row's prompt prefix: fork it there
                a, m = prefixes[b]
                child = kv.fork(self.seqs[a], m)
                undo.append((child, 0))
                before[child], skip[child] = m, m
                for r in groups_of[b]:
                    self.seqs[r] = child
                first[child] = b
                self._grow(child, plan_growth(m, self._hbm_pages(child), int(counts[b]) - m, kv.page_size,
                                              self.hbm_quota(), self.sink_pages))
                if counts[b] > m:  # its tokens after the shared prefix, taken before any later fork of it
                    span = ([child], [m], [int(counts[b]) - m])
                    kv.mirror(child, m, int(counts[b]) - m)
                    entries.append((*kv.token_entries(*span), kv.mirror_entries(*span)))
                    writers.append(b)
            slots = TokenSlots.build(*(np.concatenate([e[i] for e in entries]) for i in range(2)), kv.device,
                                     np.concatenate([e[2] for e in entries]))
            seq_ids = [self.seqs[b] for b in rows]
            q_lens = [int(counts[b]) for b in rows]
            max_seq_len = max((kv.seq_len(sid) for sid in seq_ids), default=0)
            tables = attn = None
            if rows:  # the step's layers run back to back over these tables
                tables = kv.kernel_tables(seq_ids, back_to_back=True)
                attn = self.attention
                attn.plan(tables=tables, q_lens=q_lens, num_q_heads=hq, max_seq_len=max_seq_len, q=query)
        except BaseException:
            for sid, length in undo:
                kv.truncate(sid, length)
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
        return Step(batch, q_len, rows, q_lens, seq_ids, tok_idx, slots, tables, max_seq_len, undo, processed, attn,
                    write_idx, defer)

    def _assign(self, key, value, valid, batch: int) -> tuple[dict[int, tuple[int, int]], dict[int, list[int]]]:
        """Give every batch row its sequence for this step. First step: identical rows share a new
        sequence, and a row whose prompt starts with whole pages of an earlier row's is left at
        -1 to fork it (returned: row -> (earlier row, shared tokens), and each group's rows by its
        first row). Later steps: rows of one sequence whose new tokens differ fork it."""
        share = self.share_prompts and batch > 1
        prefixes: dict[int, tuple[int, int]] = {}
        groups_of: dict[int, list[int]] = {}
        if not self.seqs:
            groups = identical_rows(key, value, valid, list(range(batch))) if share else [[b] for b in range(batch)]
            if share and len(groups) > 1:
                prefixes = shared_prefixes(key, value, valid, [g[0] for g in groups], self.kv.page_size)
            self.seqs = [-1] * batch
            for g in groups:
                groups_of[g[0]] = g
                if g[0] not in prefixes:  # the others fork an earlier row once it is extended
                    sid = self.kv.add_sequence()
                    for b in g:
                        self.seqs[b] = sid
        elif share and len(set(self.seqs)) < batch:
            self._split(key, value, valid)
        return prefixes, groups_of

    def _grow(self, sid: int, growth) -> None:
        """Apply one sequence's ``Growth``: its demotions to host, then its extends by tier."""
        if growth.demote:
            self.kv.move_pages(sid, growth.demote, "host")
        for tier, n in growth.runs:
            self.kv.extend(sid, n, tier)

    def rollback(self, step: Step) -> None:
        """Every sequence the step grew (or forked) back at its length before the step."""
        for sid, length in step.undo:
            if self.kv.seq_len(sid) > length:
                self.kv.truncate(sid, length)

    def _split(self, key: torch.Tensor, value: torch.Tensor, valid) -> None:
        """Rows that share a sequence but whose new tokens differ now get their own: each group
        of rows that still agree forks the sequence (its state before this step), capacity
        checked for all the forks first."""
        by_sid: dict[int, list[int]] = {}
        for b, sid in enumerate(self.seqs):
            by_sid.setdefault(sid, []).append(b)
        splits = []
        for sid, rows in by_sid.items():
            if len(rows) > 1:
                groups = identical_rows(key, value, valid, rows)
                splits += [(sid, g) for g in groups if rows[0] not in g]
        self.check_forks([sid for sid, _ in splits], "rows that diverged forking")
        for sid, g in splits:
            child = self.kv.fork(sid)
            for b in g:
                self.seqs[b] = child
