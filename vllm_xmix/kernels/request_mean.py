"""Request-scope condition values (CAST): the mean of a condition read over a request's prompt,
the kernel beside its torch reference.

Semantics, for every token ``t`` of the step::

    s = tok_slot[t]; P = slot_plen[s]
    if s != 0 and tok_pos[t] == P - 1:            # the last prompt token is in this step
        req_mean[s, k] = sum(vals[s, 0:P]) / P     # vals: the read's value at every prompt position

``vals[s, p]`` is written position by position as the prompt is processed (any chunking), so the
mean is the same whatever the chunk sizes: the sum runs over positions in a fixed order
(blocks of ``BLOCK`` positions, tree-reduced inside a block), never in arrival order.

Before it, ``store_values`` keeps this step's values: for every token with a non-null slot whose
request has the read on and ``pos < P``: ``vals[s, pos] = out[t, col]``.

Shapes / dtypes: ``vals`` float32 ``[S, L]`` (``L`` = max_model_len); ``tok_slot``, ``tok_pos``
int32 ``[>= T]``; ``slot_plen`` int32 ``[S]``; ``req_mean`` float32 ``[S, K]``, column ``k``
written. Graph-safe: no host sync, one program per token (returns at once for all but the last
prompt token of a request).
"""

from __future__ import annotations

import torch

from .launch import CompiledLaunch
from .steer_add import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _request_mean_kernel(vals_ptr, stride_v, tok_slot_ptr, tok_pos_ptr, plen_ptr, mean_ptr, stride_m, k,
                             BLOCK: tl.constexpr):
        t = tl.program_id(0)
        s = tl.load(tok_slot_ptr + t).to(tl.int64)
        P = tl.load(plen_ptr + s)
        if s != 0 and tl.load(tok_pos_ptr + t) == P - 1:
            offs = tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p0 in range(0, P, BLOCK):
                acc += tl.load(vals_ptr + s * stride_v + p0 + offs, mask=p0 + offs < P, other=0.0)
            tl.store(mean_ptr + s * stride_m + k, tl.sum(acc, axis=0) / P)


    @triton.jit
    def _store_kernel(vals_ptr, stride_v, out_ptr, stride_out, col, tok_slot_ptr, tok_pos_ptr, plen_ptr, coef_ptr,
                      stride_coef, e):
        t = tl.program_id(0)
        s = tl.load(tok_slot_ptr + t).to(tl.int64)
        if s != 0:
            pos = tl.load(tok_pos_ptr + t)
            if (pos < tl.load(plen_ptr + s)) & (tl.load(coef_ptr + s * stride_coef + e) != 0.0):
                tl.store(vals_ptr + s * stride_v + pos, tl.load(out_ptr + t.to(tl.int64) * stride_out + col))

    #: the kernels' launches, through their compiled handles once the JIT has made them (launch.py)
    _MEAN = CompiledLaunch(_request_mean_kernel)
    _STORE = CompiledLaunch(_store_kernel)


def store_values_reference(vals, out, col: int, tok_slot, tok_pos, slot_plen, coef, e: int, T: int) -> None:
    """Torch version (static shapes; tokens that do not store write into row 0, the null slot)."""
    slot = tok_slot[:T].long()
    pos = tok_pos[:T].long()
    on = (slot != 0) & (coef[slot, e] != 0) & (pos < slot_plen[slot].long())
    zero = torch.zeros_like(slot)
    vals.index_put_((torch.where(on, slot, zero), torch.where(on, pos, zero)),
                    torch.where(on, out[:T, col], vals[0, 0]))


def store_values_triton(vals, out, col: int, tok_slot, tok_pos, slot_plen, coef, e: int, T: int) -> None:
    if T == 0:
        return
    _STORE((T,), (vals, vals.stride(0), out, out.stride(0), col, tok_slot, tok_pos, slot_plen, coef,
                   coef.stride(0), e))


def request_mean_reference(vals: torch.Tensor, tok_slot: torch.Tensor, tok_pos: torch.Tensor,
                           slot_plen: torch.Tensor, req_mean: torch.Tensor, k: int, T: int) -> None:
    """Torch reference (also the CPU implementation; it reads indices back to the host, which the
    CPU path allows). Sums positions ``0..P-1`` of the slot's row (in float64), so the value does
    not depend on how the prompt was chunked."""
    slots = tok_slot[:T].long()
    plen = slot_plen[slots]
    last = ((slots != 0) & (tok_pos[:T] == plen - 1)).nonzero().flatten().tolist()
    for t in last:
        s, P = int(slots[t]), int(plen[t])
        req_mean[s, k] = vals[s, :P].double().sum().float() / P


def request_mean_triton(vals, tok_slot, tok_pos, slot_plen, req_mean, k: int, T: int, block: int = 256) -> None:
    if T == 0:
        return
    _MEAN((T,), (vals, vals.stride(0), tok_slot, tok_pos, slot_plen, req_mean, req_mean.stride(0), k, block))
