"""Per-token gated writes that need the whole row: directional ablation and clamping (plus adds
at the same site), the kernel beside its torch reference.

Semantics, for every token ``t`` and the site's entries ``e`` in order (sequential: each entry
sees the result of the previous ones)::

    c = coef[tok_slot[t], e] * mult[t, i]         # 0 => entry off for this token; mult (optional,
                                                  # [T, E] float32, i = index of e at the site):
                                                  # the per-token condition gate of the entry
    if c != 0:
        x = h[t] + other[t]                       # the hook's value (other: the residual half
                                                  # the write does not land on; None => h[t])
        kind[e] == ADD:  h[t] += c * vectors[e]
        kind[e] == PROJ: h[t] += c * (values[e] - x . vectors[e]) * vectors[e]   # vectors[e] unit

``PROJ`` with ``values[e] = 0`` and ``c = 1`` is directional ablation (Arditi et al. 2024,
"Refusal in language models is mediated by a single direction": ``x -= (x . r) r``); with a
non-zero value it clamps the projection on ``r`` to that value. Arithmetic in float32.

Shapes / dtypes: ``h``, ``other`` ``[T, D]`` (same dtype, last dim contiguous; ``h`` mutated);
``tok_slot`` int32 ``[>= T]``; ``coef`` float32 ``[S, E_total]``; ``entries`` int32 ``[E]``;
``kinds`` int32 ``[E_total]``; ``values`` float32 ``[E_total]``; ``vectors`` float32
``[E_total, D]``. Graph-safe: no host sync, fixed launch, branches only inside the kernel.
"""

from __future__ import annotations

import torch

from .launch import CompiledLaunch
from .steer_add import HAS_TRITON

ADD, PROJ = 0, 1

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .cond_gate import cond_gate

    @triton.jit(do_not_specialize=["n_entries"])
    def _row_write_kernel(h_ptr, stride_h, o_ptr, stride_o, tok_slot_ptr, coef_ptr, stride_coef, entries_ptr,
                          kinds_ptr, values_ptr, vec_ptr, stride_vec, mult_ptr, stride_mult, n_entries, D,
                          cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr, tok_prev_ptr, bitmap_ptr, V,
                          out_ptr, stride_out, mean_ptr, stride_mean, latch_ptr, stride_latch,
                          HAS_OTHER: tl.constexpr, HAS_MULT: tl.constexpr, HAS_COND: tl.constexpr,
                          BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(tok_slot_ptr + t).to(tl.int64)
        ar = tl.arange(0, BLOCK_D)
        for i in range(n_entries):
            e = tl.load(entries_ptr + i).to(tl.int64)
            c = tl.load(coef_ptr + slot * stride_coef + e)
            if HAS_MULT:
                c = c * tl.load(mult_ptr + t * stride_mult + i)
            if HAS_COND:
                if c != 0.0:  # conditions (kernels/cond_gate.py), only for tokens with the entry on
                    c = c * cond_gate(t, slot, e, cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr,
                                      tok_prev_ptr, bitmap_ptr, V, out_ptr, stride_out, mean_ptr, stride_mean,
                                      latch_ptr, stride_latch)
            if c != 0.0:
                kind = tl.load(kinds_ptr + e)
                coeff = c
                if kind == 1:
                    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                    for d0 in range(0, D, BLOCK_D):
                        offs = d0 + ar
                        m = offs < D
                        x = tl.load(h_ptr + t * stride_h + offs, mask=m, other=0.0).to(tl.float32)
                        if HAS_OTHER:
                            x += tl.load(o_ptr + t * stride_o + offs, mask=m, other=0.0).to(tl.float32)
                        r = tl.load(vec_ptr + e * stride_vec + offs, mask=m, other=0.0)
                        acc += x * r
                    coeff = c * (tl.load(values_ptr + e) - tl.sum(acc, axis=0))
                for d0 in range(0, D, BLOCK_D):
                    offs = d0 + ar
                    m = offs < D
                    row = h_ptr + t * stride_h + offs
                    x = tl.load(row, mask=m, other=0.0)
                    r = tl.load(vec_ptr + e * stride_vec + offs, mask=m, other=0.0)
                    tl.store(row, (x.to(tl.float32) + coeff * r).to(x.dtype), mask=m)
                tl.debug_barrier()

    #: the kernel's launches, through its compiled handles once the JIT has made them (launch.py)
    _LAUNCH = CompiledLaunch(_row_write_kernel)


def row_write_reference(h: torch.Tensor, other: torch.Tensor | None, tok_slot: torch.Tensor, coef: torch.Tensor,
                        entries: list[int], kinds: list[int], values: list[float], vectors: torch.Tensor,
                        mult: torch.Tensor | None = None) -> None:
    """Torch reference (also the CPU implementation). ``entries``/``kinds``/``values`` are the
    site's static host lists. Mutates ``h``."""
    T = h.shape[0]
    if T == 0:
        return
    slots = tok_slot[:T].long()
    for i, e in enumerate(entries):
        c = coef[slots, e].unsqueeze(1)  # [T, 1]
        if mult is not None:
            c = c * mult[:T, i : i + 1]
        v = vectors[e, : h.shape[1]].float()
        hf = h.float()
        if kinds[e] == PROJ:
            x = hf + other.float() if other is not None else hf
            coeff = c * (values[e] - (x * v).sum(dim=1, keepdim=True))
        else:
            coeff = c
        new = (hf + coeff * v).to(h.dtype)
        h.copy_(torch.where(c != 0, new, h))


def row_write_triton(h, other, tok_slot, coef, entries_dev, kinds_dev, values_dev, vectors, block_d: int = 1024,
                     mult: torch.Tensor | None = None, cond: dict | None = None) -> None:
    """``mult``: an explicit ``[T, E]`` gate; ``cond``: evaluate the conditions in the kernel
    (dict of the tensors of :mod:`.cond_gate`: cond_i, cond_thr, tok_pos, slot_plen, tok_cur,
    tok_prev, bitmaps, out, req_mean, latch_pos)."""
    T, D = h.shape
    if T == 0:
        return
    assert h.stride(1) == 1 and (other is None or other.stride(1) == 1)
    o = other if other is not None else h
    m = mult if mult is not None else coef
    c = cond or {}
    ci, cthr = c.get("cond_i", kinds_dev), c.get("cond_thr", values_dev)
    pos, plen = c.get("tok_pos", tok_slot), c.get("slot_plen", tok_slot)
    cur, prev = c.get("tok_cur", tok_slot), c.get("tok_prev", tok_slot)
    bm, out, mean = c.get("bitmaps", kinds_dev), c.get("out", coef), c.get("req_mean", coef)
    latch = c.get("latch_pos", tok_slot.view(1, -1))
    _LAUNCH((T,), (h, h.stride(0), o, o.stride(0), tok_slot, coef, coef.stride(0), entries_dev, kinds_dev,
                   values_dev, vectors, vectors.stride(0), m, m.stride(0), entries_dev.shape[0], D,
                   ci, cthr, pos, plen, cur, prev, bm, bm.shape[-1] if bm.dim() == 2 else 0,
                   out, out.stride(0), mean, mean.stride(0), latch, latch.stride(0),
                   other is not None, mult is not None, cond is not None, min(block_d, triton.next_power_of_2(D))))
