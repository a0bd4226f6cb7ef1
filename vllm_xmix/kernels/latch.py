"""Latches of probe-triggered writes (``cond(latch=<read>)``): after a site's reads, each
request's latch position is lowered to the first absolute position whose read value crosses the
trigger's threshold; the kernel beside its torch reference.

Semantics, for every token ``t`` of the step and the site's latch-setting read entries ``e``
(reads whose trigger some write latches on; ``k, op = latch_i[e]``, ``thr = latch_thr[e]``)::

    s = tok_slot[t]
    if s != 0 and coef[s, e] != 0 and out[t, cols[e]] <op> thr:    # the request has the read on
        latch_pos[s, k] = min(latch_pos[s, k], tok_pos[t])           # atomic min

``out[t, cols[e]]`` is the value the site's read kernel just wrote (``kernels/read_rows.py``);
``op``: 0 ``>``, 1 ``>=``, 2 ``<``, 3 ``<=`` (float32 comparison, NaN never crosses).
``latch_pos`` holds :data:`NEVER` until the read first crosses; a write entry latched on ``k``
applies at token ``t`` iff ``tok_pos[t] >= latch_pos[tok_slot[t], k]`` (``kernels/cond_gate.py``).
A minimum over positions does not depend on the order tokens arrive in, nor on how a request's
positions are split over steps, nor on a position being computed twice (recompute after
preemption).

Shapes / dtypes: ``out`` float32 ``[>= T, n_cols]``; ``tok_slot``, ``tok_pos`` int32 ``[>= T]``;
``coef`` float32 ``[S, E_total]``; ``entries`` int32 ``[E]``; ``latch_i`` int32 ``[E_total, 2]``
(latch index, comparison); ``latch_thr`` float32 ``[E_total]``; ``cols`` int32 ``[E_total]``;
``latch_pos`` int32 ``[S, K]`` (persistent: CUDA graphs bake its address). Graph-safe: no host
sync, no allocation that outlives the call, one program per token (returning at once for tokens
of requests without apps), the same launch for every batch mix.
"""

from __future__ import annotations

import torch

from .launch import CompiledLaunch
from .steer_add import HAS_TRITON

#: the latch position of a request whose read has not crossed: larger than any position
NEVER = 2**31 - 1

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_entries"])
    def _latch_set_kernel(out_ptr, stride_out, tok_slot_ptr, tok_pos_ptr, coef_ptr, stride_coef, entries_ptr,
                          latch_i_ptr, latch_thr_ptr, cols_ptr, latch_ptr, stride_latch, n_entries):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(tok_slot_ptr + t).to(tl.int64)
        if slot != 0:
            pos = tl.load(tok_pos_ptr + t)
            for i in range(n_entries):
                e = tl.load(entries_ptr + i).to(tl.int64)
                if tl.load(coef_ptr + slot * stride_coef + e) != 0.0:
                    v = tl.load(out_ptr + t * stride_out + tl.load(cols_ptr + e).to(tl.int64))
                    op = tl.load(latch_i_ptr + e * 2 + 1)
                    thr = tl.load(latch_thr_ptr + e)
                    ok = tl.where(op == 0, v > thr, tl.where(op == 1, v >= thr, tl.where(op == 2, v < thr, v <= thr)))
                    k = tl.load(latch_i_ptr + e * 2).to(tl.int64)
                    tl.atomic_min(latch_ptr + slot * stride_latch + k, pos, mask=ok)

    #: the kernel's launches, through its compiled handles once the JIT has made them (launch.py)
    _LAUNCH = CompiledLaunch(_latch_set_kernel)


_OPS = (torch.gt, torch.ge, torch.lt, torch.le)


def latch_set_reference(out: torch.Tensor, tok_slot: torch.Tensor, tok_pos: torch.Tensor, coef: torch.Tensor,
                        entries: list[int], latch_host: list[tuple[int, int, float]], cols: list[int],
                        latch_pos: torch.Tensor, T: int) -> None:
    """Torch reference (also the CPU implementation; static shapes, no host sync).
    ``entries``: the site's latch-setting read entries; ``latch_host[e]`` = (latch index,
    comparison, threshold); ``cols``: the entries' ``out`` columns. Lowers ``latch_pos``
    (tokens that set nothing scatter :data:`NEVER` into row 0, the null slot, which keeps it)."""
    if T == 0:
        return
    slot = tok_slot[:T].long()
    pos = tok_pos[:T]
    zero = torch.zeros_like(slot)
    for e in entries:
        k, op, thr = latch_host[e]
        hit = (slot != 0) & (coef[slot, e] != 0) & _OPS[op](out[:T, cols[e]], thr)
        latch_pos[:, k].scatter_reduce_(0, torch.where(hit, slot, zero),
                                        torch.where(hit, pos, torch.full_like(pos, NEVER)), reduce="amin")


def latch_set_triton(out, tok_slot, tok_pos, coef, entries_dev, latch_i, latch_thr, cols_dev, latch_pos,
                     T: int) -> None:
    """The kernel (CUDA tensors; ``entries_dev`` int32 device tensor of the site's entries)."""
    if T == 0:
        return
    _LAUNCH((T,), (out, out.stride(0), tok_slot, tok_pos, coef, coef.stride(0), entries_dev, latch_i,
                   latch_thr, cols_dev, latch_pos, latch_pos.stride(0), entries_dev.shape[0]))
