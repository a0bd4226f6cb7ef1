"""Per-token gated steering add: the kernel and its torch reference, side by side.

Semantics (activation addition, Turner et al. 2023; xMIx "write" primitive)::

    for t in range(T):                      # T = h.shape[0] (padded token count)
        c = coef[tok_slot[t], entries]      # [E] float32, one coefficient per (app, layer) entry
        if any(c != 0):
            h[t] = (h[t].float() + sum_e c[e] * vectors[entries[e]].float()).to(h.dtype)
        # else: h[t] is not touched (bit-identical to the unsteered model)

Shapes / dtypes:
    h:        [T, D], float32 / bfloat16 / float16, last dim contiguous. Mutated in place.
    tok_slot: [>= T] int32; row index into ``coef`` for each token (padding rows point at the
              all-zero null row).
    coef:     [S, E_total] float32 per-slot coefficients.
    entries:  [E] int32, the entries (columns of ``coef`` / rows of ``vectors``) at this site.
    vectors:  [E_total, >= D] float32 (the first D columns are used: router biases share the table).

Graph safety: no host sync, no data-dependent shapes, no allocation that outlives the call; the
same launches for every batch mix, so it can be captured in CUDA graphs and replayed with new
``tok_slot`` / ``coef`` contents.
"""

from __future__ import annotations

import torch

from .launch import CompiledLaunch

try:  # Triton is optional (CPU-only installs may lack a usable backend).
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False


def steer_add_reference(h: torch.Tensor, tok_slot: torch.Tensor, coef: torch.Tensor,
                        entries: torch.Tensor, vectors: torch.Tensor) -> None:
    """Torch reference (also the CPU implementation). Mutates ``h`` in place."""
    T = h.shape[0]
    if T == 0:
        return
    slots = tok_slot[:T].long()
    c = coef.index_select(0, slots).index_select(1, entries.long())  # [T, E]
    v = vectors.index_select(0, entries.long())[:, : h.shape[1]]  # [E, D] (table may be wider)
    if c.shape[1] == 1:
        delta = c * v  # [T, D]: exactly c*v per element (rows with c == 0 are dropped below)
    else:  # entries that are off contribute nothing, even where v is -inf (router masks)
        delta = torch.where(c.unsqueeze(-1) != 0, c.unsqueeze(-1) * v.unsqueeze(0), 0.0).sum(1)
    active = (c != 0).any(dim=1, keepdim=True)
    new = (h.float() + delta).to(h.dtype)
    h.copy_(torch.where(active, new, h))


if HAS_TRITON:

    @triton.jit
    def add_sum(slot, coef_ptr, stride_coef, entries_ptr, n_entries, vec_ptr, stride_vec, offs, m,
                BLOCK_D: tl.constexpr):
        """The adds of one token over the columns ``offs`` (mask ``m``): ``(acc, nz)``, the float32
        sum of ``coef[slot, e] * vectors[e]`` over the entries and how many of them are on (an
        entry that is off adds nothing, even where its vector is -inf). Shared by this kernel and
        the add + RMSNorm kernel (kernels/add_rms_norm.py), so both add alike."""
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        nz = tl.full([], 0, tl.int32)
        for i in range(n_entries):
            e = tl.load(entries_ptr + i).to(tl.int64)
            # the vector's load does not wait for the coefficient's (it depends on the entry only):
            # two dependent global loads per token, not three (a decode step is latency-bound)
            v = tl.load(vec_ptr + e * stride_vec + offs, mask=m, other=0.0)
            c = tl.load(coef_ptr + slot * stride_coef + e)
            # a branch on the token's coefficient (the same for the whole program), not a select:
            # an entry that is off adds nothing, even where its vector is -inf, and costs no
            # arithmetic over the row (as the row kernel's entries, kernels/row_write.py)
            if c != 0.0:
                acc += c * v.to(tl.float32)
                nz += 1
        return acc, nz

    @triton.jit(do_not_specialize=["n_entries"])
    def _steer_add_kernel(h_ptr, stride_h, tok_slot_ptr, coef_ptr, stride_coef, entries_ptr,
                          vec_ptr, stride_vec, n_entries, D, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        db = tl.program_id(1)
        slot = tl.load(tok_slot_ptr + t).to(tl.int64)
        offs = db * BLOCK_D + tl.arange(0, BLOCK_D)
        m = offs < D
        acc, nz = add_sum(slot, coef_ptr, stride_coef, entries_ptr, n_entries, vec_ptr, stride_vec, offs, m, BLOCK_D)
        mm = m & (nz > 0)
        row = h_ptr + t.to(tl.int64) * stride_h + offs
        h = tl.load(row, mask=mm, other=0.0)
        tl.store(row, (h.to(tl.float32) + acc).to(h.dtype), mask=mm)

    #: the kernel's launches, through its compiled handles once the JIT has made them (launch.py)
    _LAUNCH = CompiledLaunch(_steer_add_kernel)


def steer_add_triton(h: torch.Tensor, tok_slot: torch.Tensor, coef: torch.Tensor,
                     entries: torch.Tensor, vectors: torch.Tensor, block_d: int = 512) -> None:
    """Triton implementation; one program per (token, ``block_d``-wide slice of D)."""
    T, D = h.shape
    if T == 0:
        return
    assert h.stride(1) == 1, "h: last dim must be contiguous"
    grid = (T, triton.cdiv(D, block_d))
    _LAUNCH(grid, (h, h.stride(0), tok_slot, coef, coef.stride(0), entries, vectors, vectors.stride(0),
                   entries.shape[0], D, block_d))


def steer_add(h, tok_slot, coef, entries, vectors) -> None:
    """Dispatch: Triton on CUDA tensors, the torch reference elsewhere (CPU)."""
    if h.is_cuda and HAS_TRITON:
        steer_add_triton(h, tok_slot, coef, entries, vectors)
    else:
        steer_add_reference(h, tok_slot, coef, entries, vectors)
