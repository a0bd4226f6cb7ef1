"""Condition state of conditional writes (SEAL: token-triggered, Chen et al. 2025; CAST: a
condition read at an earlier layer, Lee et al. 2025): the device tables that decide, per token,
whether a conditional write applies.

* token sets as vocabulary bitmaps ``bitmaps [n_sets, vocab]`` int8, and per token of the step
  its id ``tok_cur [max_tokens]`` int64 and its previous token ``tok_prev`` (from the same step,
  or the slot's history ``hist [max_slots, max_model_len]`` int32 for a chunk's first token);
* per token its absolute position ``tok_pos [max_tokens]`` int32 and per slot the prompt length
  ``slot_plen [max_slots]`` int32 (both written by the step fill);
* for request-scope condition reads the read's value at every prompt position
  ``cbuf_req [K, max_slots, max_model_len]`` float32 and the per-slot mean over the prompt
  ``req_mean [max_slots, K]`` float32;
* for latched writes (``cond(latch=<read>)``) per slot and latch the first absolute position
  whose value of the read crossed its trigger's threshold, ``latch_pos [max_slots, K_latch]``
  int32 (:data:`..kernels.latch.NEVER` until then), lowered by the read's site in the forward
  (``kernels/latch.py``) and reset when the step fill gives the slot to a request. Like the
  other per-slot state it stays with a preempted request's slot (a recompute sets the same
  minimum again) and is lost only if that slot is taken back (``slots.SlotRegistry.slot_for``).

The kernels live in ``kernels/cond_gate.py``, ``kernels/request_mean.py`` and
``kernels/latch.py`` (Triton beside the torch reference).
"""

from __future__ import annotations

import torch

from ..kernels import request_mean
from ..kernels.cond_gate import gate_reference, note_tokens_reference, note_tokens_triton
from ..kernels.latch import NEVER, latch_set_reference, latch_set_triton
from ..kernels.steer_add import HAS_TRITON

#: condition kinds of a write entry (``Entry.ckind``): none, the current token in a set, the
#: previous token in a set, a per-token condition read, a request-scope condition read, a latch
CK_NONE, CK_TOKENS, CK_TOKENS_PREV, CK_BUF_TOKEN, CK_BUF_REQUEST, CK_LATCH = 0, 1, 2, 3, 4, 5
#: comparison codes (``Entry.cop``)
COMPARISONS = {">": 0, ">=": 1, "<": 2, "<=": 3}


class ConditionTables:
    """The condition state of one deployment (see the module docstring).

    Built by :meth:`build` from the layout's entries, which it annotates in place (``ckind``,
    ``cidx``, ``cop``, ``cthr``, ``cgen``: what the gate kernel reads per entry)."""

    def __init__(self) -> None:
        self.has_cond = False
        self.has_token_cond = False
        self.n_req_bufs = 0
        self.n_latches = 0
        self.cond_entries: list[int] = []

    @classmethod
    def build(cls, entries: list, conds: list, buffers: dict, n_req: int, *, site_writes: list,
              tok_slot: torch.Tensor, coef: torch.Tensor, out: torch.Tensor, max_tokens: int, max_slots: int,
              vocab_size: int, max_model_len: int, device: torch.device, latches: dict | None = None,
              n_latches: int = 0) -> "ConditionTables":
        """``conds``: ``(write entry index, app name, Cond)`` per conditional write; ``buffers``:
        ``(app, buffer name) -> entry index`` of the condition read that fills it; ``n_req``: the
        number of request-scope condition reads; ``latches``: ``(app, read name) -> latch index``
        (``0 .. n_latches - 1``) of the reads that latched writes name (their entries carry
        ``latch_k``, ``lop``, ``lthr``); ``site_writes[site]``: the site's write entries.
        ``tok_slot``, ``coef``, ``out``: the layout's per-step tables the gate reads."""
        ct = cls()
        dev = device
        ct.entries, ct.tok_slot, ct.coef, ct.out = entries, tok_slot, coef, out
        ct.site_writes = site_writes
        ct.has_cond = bool(conds)
        ct.n_req_bufs = n_req
        ct.n_latches = n_latches
        ct.tok_pos = torch.zeros(max_tokens, dtype=torch.int32, device=dev)
        ct.slot_plen = torch.zeros(max_slots, dtype=torch.int32, device=dev)
        sets: list[list[int]] = []
        for e_idx, app, c in conds:
            e = entries[e_idx]
            if c.tokens is not None or c.tokens_prev is not None:
                ids = c.tokens if c.tokens is not None else c.tokens_prev
                e.ckind = CK_TOKENS if c.tokens is not None else CK_TOKENS_PREV
                e.cidx = len(sets)
                sets.append(ids)
            elif c.latch is not None:
                e.ckind, e.cidx = CK_LATCH, latches[(app, c.latch)]
            else:
                src = entries[buffers[(app, c.buffer)]]
                if src.req_k >= 0:
                    e.ckind, e.cidx = CK_BUF_REQUEST, src.req_k
                else:
                    e.ckind, e.cidx = CK_BUF_TOKEN, src.col
                e.cop, e.cthr = COMPARISONS[c.op or ">"], float(c.threshold)
            e.cgen = c.positions == "generated"
            ct.cond_entries.append(e_idx)
        ct.has_token_cond = bool(sets)
        L = max(1, max_model_len)
        if sets:
            bm = torch.zeros(len(sets), vocab_size, dtype=torch.int8)  # ids < vocab: checked by validate_deployment
            for i, ids in enumerate(sets):
                bm[i, ids] = 1
            ct.bitmaps = bm.to(dev)
            ct.hist = torch.zeros(max_slots, L, dtype=torch.int32, device=dev)
            ct.tok_cur = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
            ct.tok_prev = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        if n_req:
            ct.cbuf_req = torch.zeros(n_req, max_slots, L, dtype=torch.float32, device=dev)
            ct.req_mean = torch.zeros(max_slots, n_req, dtype=torch.float32, device=dev)
        # latches: per slot the latch position of each latch; per entry (the reads that set
        # one) its latch index, comparison and threshold
        ct.latch_pos = torch.full((max_slots, max(1, n_latches)), NEVER, dtype=torch.int32, device=dev)
        ct.latch_host = [(e.latch_k, e.lop, e.lthr) for e in entries]
        ct.latch_args = dict(
            latch_i=torch.tensor([[c[0], c[1]] for c in ct.latch_host] or [[0, 0]], dtype=torch.int32, device=dev),
            latch_thr=torch.tensor([c[2] for c in ct.latch_host] or [0.0], dtype=torch.float32, device=dev))
        cond_set = set(ct.cond_entries)
        ct.site_has_cond = [any(e in cond_set for e in (w or ())) for w in site_writes]
        # per-entry condition parameters, host lists (reference) and device tensors (kernel)
        ct.cond_host = [(e.ckind, e.cidx, e.cop, int(e.cgen), e.cthr) for e in entries]
        zero_i = torch.zeros(1, dtype=torch.int64, device=dev)
        ct.cond_args = dict(
            cond_i=torch.tensor([[c[0], c[1], c[2], c[3]] for c in ct.cond_host] or [[0, 0, 0, 0]],
                                dtype=torch.int32, device=dev),
            cond_thr=torch.tensor([c[4] for c in ct.cond_host] or [0.0], dtype=torch.float32, device=dev),
            tok_pos=ct.tok_pos, slot_plen=ct.slot_plen,
            tok_cur=getattr(ct, "tok_cur", zero_i), tok_prev=getattr(ct, "tok_prev", zero_i),
            bitmaps=getattr(ct, "bitmaps", torch.zeros(1, 1, dtype=torch.int8, device=dev)), out=out,
            req_mean=getattr(ct, "req_mean", torch.zeros(1, 1, dtype=torch.float32, device=dev)),
            latch_pos=ct.latch_pos,
        )
        return ct

    def gate(self, site: int, T: int, entries: list[int] | None = None) -> torch.Tensor:
        """``[T, len(entries)]`` float32 (default entries: the site's writes): 1 where an entry's
        condition holds for the token (unconditional entries: 1):
        :func:`..kernels.cond_gate.gate_reference` (the CPU path; on CUDA the row kernel
        evaluates the same gate inline)."""
        a = self.cond_args
        entries = self.site_writes[site] if entries is None else entries
        return gate_reference(T, entries, self.cond_host, self.tok_slot, self.tok_pos,
                              self.slot_plen, a["tok_cur"], a["tok_prev"], a["bitmaps"], self.out, a["req_mean"],
                              self.latch_pos)

    def set_latches(self, entries: list[int], entries_dev: torch.Tensor | None, T: int, cols: list[int],
                    cols_dev: torch.Tensor) -> None:
        """After a site's reads: for its latch-setting reads ``entries`` (entry indices,
        ``SitePlan.latch_reads``; ``entries_dev`` the same as an int32 device tensor) lower each
        token's request's latch position to the token's position where the read's value crosses
        its trigger's threshold (``kernels/latch.py``). ``cols``/``cols_dev``: the layout's
        ``out`` column per entry."""
        if self.tok_slot.is_cuda and HAS_TRITON:
            a = self.latch_args
            latch_set_triton(self.out, self.tok_slot, self.tok_pos, self.coef, entries_dev, a["latch_i"],
                             a["latch_thr"], cols_dev, self.latch_pos, T)
        else:
            latch_set_reference(self.out, self.tok_slot, self.tok_pos, self.coef, entries, self.latch_host, cols,
                                self.latch_pos, T)

    def reset_latches(self, slots: list[int] | torch.Tensor) -> None:
        """Slots given to a request (``slots``: host ints, or an int64 device tensor): no latch
        has fired for it yet. Runs in the step fill, on the forward's stream, before the forward."""
        if not self.n_latches:
            return
        if isinstance(slots, torch.Tensor):
            self.latch_pos.index_fill_(0, slots, NEVER)
        else:
            for s in slots:
                self.latch_pos[s].fill_(NEVER)

    def store_request_values(self, entries: list[int], T: int) -> None:
        """After a site's reads: for its request-scope condition reads ``entries`` (entry
        indices, ``SitePlan.req_reads``) keep the values by (slot, position) for prompt
        positions, then the mean over the prompt for requests whose last prompt token is in this
        step (``kernels/request_mean.py``)."""
        cuda = self.tok_slot.is_cuda and HAS_TRITON
        store = request_mean.store_values_triton if cuda else request_mean.store_values_reference
        mean = request_mean.request_mean_triton if cuda else request_mean.request_mean_reference
        for e_idx in entries:
            e = self.entries[e_idx]
            vals = self.cbuf_req[e.req_k]
            store(vals, self.out, e.col, self.tok_slot, self.tok_pos, self.slot_plen, self.coef, e_idx, T)
            mean(vals, self.tok_slot, self.tok_pos, self.slot_plen, self.req_mean, e.req_k, T)

    def note_tokens(self, input_ids: torch.Tensor) -> None:
        """At the embedding: this step's token ids ``input_ids [T]`` (int), and each token's
        previous token (from the same step, or the slot's history for a chunk's first token):
        ``kernels/cond_gate.py``."""
        impl = note_tokens_triton if input_ids.is_cuda and HAS_TRITON else note_tokens_reference
        impl(input_ids, self.tok_slot, self.tok_pos, self.hist, self.tok_cur, self.tok_prev)
