"""Conditions of conditional writes: the per-token gate and the token bookkeeping at the
embedding, each Triton implementation beside its torch reference.

Gate of write entry ``e`` for token ``t`` (``s = tok_slot[t]``, ``pos = tok_pos[t]``,
``P = slot_plen[s]``)::

    ckind[e] == 0 (none):          1
    ckind[e] == 1 (tokens):        bitmaps[cidx[e], tok_cur[t]]
    ckind[e] == 2 (tokens_prev):   tok_prev[t] >= 0 and bitmaps[cidx[e], tok_prev[t]]
    ckind[e] == 3 (token buffer):  out[t, cidx[e]]  <op[e]>  thr[e]
    ckind[e] == 4 (request):       req_mean[s, cidx[e]]  <op[e]>  thr[e]  and  pos >= P - 1
    ckind[e] == 5 (latch):         pos >= latch_pos[s, cidx[e]]     # kernels/latch.py sets it
    and, if gen[e]:                pos >= P

``op``: 0 ``>``, 1 ``>=``, 2 ``<``, 3 ``<=``. The row kernel (``kernels/row_write.py``)
evaluates :func:`cond_gate` inline (no extra launch, nothing when the token's slot is null);
:func:`gate_reference` builds the same ``[T, E]`` matrix with torch ops (static shapes).

Token bookkeeping (``note_tokens``), at the embedding, for every token with a non-null slot::

    hist[s, pos] = input_ids[t]
    tok_cur[t]  = input_ids[t]
    tok_prev[t] = -1 if pos == 0 else (input_ids[t-1] if token t-1 is the previous position of the
                  same request in this step else hist[s, pos - 1])   # from an earlier step

Shapes / dtypes: ``tok_slot``, ``tok_pos`` int32 ``[>= T]``; ``slot_plen`` int32 ``[S]``;
``tok_cur``, ``tok_prev`` int64 ``[>= T]``; ``hist`` int32 ``[S, L]``; ``bitmaps`` int8
``[n_sets, V]``; ``out`` float32 ``[>= T, n_cols]``; ``req_mean`` float32 ``[S, K]``;
``latch_pos`` int32 ``[S, K_latch]``; ``cond_i`` int32 ``[E_total, 4]`` (ckind, cidx, op, gen);
``cond_thr`` float32 ``[E_total]``.
"""

from __future__ import annotations

import torch

from .launch import CompiledLaunch
from .steer_add import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def cond_gate(t, slot, e, cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr, tok_prev_ptr,
                  bitmap_ptr, V, out_ptr, stride_out, mean_ptr, stride_mean, latch_ptr, stride_latch):
        """The gate (float32 0/1) of entry ``e`` for token ``t`` of slot ``slot``."""
        ck = tl.load(cond_i_ptr + e * 4)
        g = tl.full([], 1.0, tl.float32)  # a typed scalar: it is reassigned under runtime branches
        if ck != 0:
            idx = tl.load(cond_i_ptr + e * 4 + 1).to(tl.int64)
            pos = tl.load(tok_pos_ptr + t)
            plen = tl.load(plen_ptr + slot)
            if ck == 1:
                tok = tl.load(tok_cur_ptr + t)
                g = (tl.load(bitmap_ptr + idx * V + tok) != 0).to(tl.float32)
            elif ck == 2:
                prev = tl.load(tok_prev_ptr + t)
                hit = tl.load(bitmap_ptr + idx * V + tl.maximum(prev, 0)) != 0
                g = (hit & (prev >= 0)).to(tl.float32)
            elif ck == 5:
                g = (pos >= tl.load(latch_ptr + slot * stride_latch + idx)).to(tl.float32)
            else:
                if ck == 3:
                    v = tl.load(out_ptr + t * stride_out + idx)
                else:
                    v = tl.load(mean_ptr + slot * stride_mean + idx)
                op = tl.load(cond_i_ptr + e * 4 + 2)
                thr = tl.load(cond_thr_ptr + e)
                ok = tl.where(op == 0, v > thr, tl.where(op == 1, v >= thr, tl.where(op == 2, v < thr, v <= thr)))
                g = ok.to(tl.float32)
                if ck == 4:
                    g = g * (pos >= plen - 1).to(tl.float32)
            if tl.load(cond_i_ptr + e * 4 + 3) != 0:
                g = g * (pos >= plen).to(tl.float32)
        return g

    @triton.jit
    def _note_tokens_kernel(ids_ptr, tok_slot_ptr, tok_pos_ptr, hist_ptr, stride_hist, cur_ptr, prev_ptr):
        t = tl.program_id(0)
        s = tl.load(tok_slot_ptr + t).to(tl.int64)
        if s != 0:
            pos = tl.load(tok_pos_ptr + t)
            tok = tl.load(ids_ptr + t).to(tl.int64)
            tl.store(hist_ptr + s * stride_hist + pos, tok.to(tl.int32))
            tl.store(cur_ptr + t, tok)
            prev = tl.full([], -1, tl.int64)
            if pos > 0:
                tm1 = tl.maximum(t - 1, 0)
                same = (t > 0) & (tl.load(tok_slot_ptr + tm1).to(tl.int64) == s) & (tl.load(tok_pos_ptr + tm1) == pos - 1)
                if same:
                    prev = tl.load(ids_ptr + tm1).to(tl.int64)
                else:  # the chunk's first token: its previous token came in an earlier step
                    prev = tl.load(hist_ptr + s * stride_hist + pos - 1).to(tl.int64)
            tl.store(prev_ptr + t, prev)

    #: the kernel's launches, through its compiled handles once the JIT has made them (launch.py)
    _NOTE_TOKENS = CompiledLaunch(_note_tokens_kernel)


_OPS = (torch.gt, torch.ge, torch.lt, torch.le)


def gate_reference(T: int, entries: list[int], cond_host: list[tuple[int, int, int, int, float]], tok_slot, tok_pos,
                   slot_plen, tok_cur, tok_prev, bitmaps, out, req_mean, latch_pos=None) -> torch.Tensor:
    """``[T, len(entries)]`` float32 gate (torch ops, static shapes). ``cond_host[e]`` =
    (ckind, cidx, op, gen, thr); ``latch_pos`` int32 ``[S, K_latch]`` (latched entries only)."""
    slot = tok_slot[:T].long()
    pos = tok_pos[:T].long()
    plen = slot_plen[slot].long()
    cols = []
    for e in entries:
        ck, idx, op, gen, thr = cond_host[e]
        if ck == 0:
            cols.append(torch.ones(T, dtype=torch.bool, device=tok_slot.device))
            continue
        if ck == 1:
            g = bitmaps[idx][tok_cur[:T]] != 0
        elif ck == 2:
            prev = tok_prev[:T]
            g = (bitmaps[idx][prev.clamp(min=0)] != 0) & (prev >= 0)
        elif ck == 3:
            g = _OPS[op](out[:T, idx], thr)
        elif ck == 5:
            g = pos >= latch_pos[slot, idx].long()
        else:
            g = _OPS[op](req_mean[slot, idx], thr) & (pos >= plen - 1)
        if gen:
            g = g & (pos >= plen)
        cols.append(g)
    return torch.stack(cols, dim=1).float()


def note_tokens_reference(input_ids, tok_slot, tok_pos, hist, tok_cur, tok_prev) -> None:
    """Torch version (static shapes; null-slot tokens write into row 0 of ``hist``, never read
    for a gate since their coefficients are 0)."""
    T = input_ids.shape[0]
    slot = tok_slot[:T].long()
    pos = tok_pos[:T].long()
    ids = input_ids.long()
    hist.index_put_((slot, pos), ids.to(hist.dtype))
    prev = hist[slot, (pos - 1).clamp(min=0)].long()
    tok_cur[:T].copy_(ids)
    tok_prev[:T].copy_(torch.where(pos > 0, prev, torch.full_like(prev, -1)))


def note_tokens_triton(input_ids, tok_slot, tok_pos, hist, tok_cur, tok_prev) -> None:
    T = input_ids.shape[0]
    if T == 0:
        return
    _NOTE_TOKENS((T,), (input_ids, tok_slot, tok_pos, hist, hist.stride(0), tok_cur, tok_prev))
