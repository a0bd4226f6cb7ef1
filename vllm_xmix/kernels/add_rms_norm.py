"""A hook site's writes inside vLLM's residual add + RMSNorm: the kernel beside its torch reference.

In vLLM's pre-norm decoder layers (:mod:`vllm_xmix.adapters._residual`) the residual stream at
``hook_resid_pre`` (layers >= 1), ``hook_resid_mid`` and ``hook_resid_post`` (all but the last
layer) exists only as two tensors that the next norm adds and normalises in one kernel::

    x, residual = norm(x, residual)     # residual <- x + residual; x <- RMSNorm(residual) * weight

With the deployment's ``fused_writes="norm"`` the site's hook op replaces that call
(``ops.hook_norm_``). In a graph variant where none of the site's apps is on it runs vLLM's own
fused add + RMSNorm kernel (``torch.ops._C.fused_add_rms_norm``), so steps with apps off add no
launch there. Where they are on, this kernel applies the writes and the norm in one launch
instead of a write kernel followed by the norm kernel.

Semantics, per token ``t`` (``h`` = ``residual[t]``, the tensor the write lands on; ``x[t]``
the other half of the stream)::

    pre (the site's unconditional adds beside conditional writes, kernels/steer_add.py), first:
        c = coef[tok_slot[t], pre]; if any(c != 0): h = (h.float() + sum_e c[e] * vectors[pre[e]]).to(dtype)
    writes, ROW == False (adds only: kernels/steer_add.py):
        c = coef[tok_slot[t], entries]                       # [E] float32
        if any(c != 0): h = (h.float() + sum_e c[e] * vectors[entries[e]]).to(dtype)
    writes, ROW == True (kernels/row_write.py without conditions: entries in order, each rounded):
        for e in entries: c = coef[tok_slot[t], e] * gate(t, e)    # gate: kernels/cond_gate.py (cond), else 1
            if c != 0: coeff = c                         if kinds[e] == ADD
                              c * (values[e] - (h + x) . vectors[e])   if kinds[e] == PROJ
                       h = (h.float() + coeff * vectors[e]).to(dtype)
    then vLLM's CUDA fused_add_rms_norm:
        z = (x.float() + h.float()).to(dtype)                # the new residual (the stream)
        x = ((z.float() * rsqrt(mean(z.float() ** 2) + eps)).to(dtype) * weight)

Shapes / dtypes: ``x``, ``residual`` ``[T, D]`` float32 / bfloat16 / float16, last dim
contiguous, both mutated; ``weight`` ``[D]`` of their dtype; ``tok_slot`` int32 ``[>= T]``;
``coef`` float32 ``[S, E_total]``; ``entries`` int32 ``[E]`` (E may be 0: the norm alone);
``kinds`` int32 / ``values`` float32 ``[E_total]``; ``vectors`` float32 ``[E_total, >= D]``;
``eps`` a float; ``pre`` int32 ``[E_pre]`` or None; ``cond``: None, or the condition tensors of
:mod:`.cond_gate` (``ConditionState.cond_args``), for ROW writes with conditions (SEAL, CAST, latches). One program per token over the whole row (``BLOCK_D`` = next power of two >= D).
Graph-safe: no host sync, fixed launch for a given T.
"""

from __future__ import annotations

import torch

from .row_write import ADD, PROJ, row_write_reference
from .steer_add import HAS_TRITON, steer_add_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .cond_gate import cond_gate

    @triton.jit(do_not_specialize=["n_entries", "n_pre"])
    def _add_rms_norm_kernel(x_ptr, stride_x, r_ptr, stride_r, w_ptr, tok_slot_ptr, coef_ptr, stride_coef,
                             entries_ptr, kinds_ptr, values_ptr, vec_ptr, stride_vec, n_entries, D, eps,
                             pre_ptr, n_pre,
                             cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr, tok_prev_ptr, bitmap_ptr, V,
                             out_ptr, stride_out, mean_ptr, stride_mean, latch_ptr, stride_latch,
                             ROW: tl.constexpr, HAS_PRE: tl.constexpr, HAS_COND: tl.constexpr,
                             BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0)
        h = tl.load(r_ptr + t * stride_r + offs, mask=m, other=0.0)
        slot = tl.load(tok_slot_ptr + t).to(tl.int64)
        if HAS_PRE:  # the add kernel's semantics: one float32 sum, rounded once
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            nz = tl.zeros([BLOCK_D], dtype=tl.int32)
            for i in range(n_pre):
                e = tl.load(pre_ptr + i).to(tl.int64)
                c = tl.zeros([BLOCK_D], dtype=tl.float32) + tl.load(coef_ptr + slot * stride_coef + e)
                on = c != 0.0
                v = tl.load(vec_ptr + e * stride_vec + offs, mask=m & on, other=0.0)
                acc += c * v
                nz += on.to(tl.int32)
            h = tl.where(nz > 0, (h.to(tl.float32) + acc).to(h.dtype), h)
        if ROW:
            for i in range(n_entries):
                e = tl.load(entries_ptr + i).to(tl.int64)
                c = tl.load(coef_ptr + slot * stride_coef + e)
                if HAS_COND:
                    if c != 0.0:  # the condition, only for tokens with the entry on (kernels/cond_gate.py)
                        c = c * cond_gate(t, slot, e, cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr,
                                          tok_prev_ptr, bitmap_ptr, V, out_ptr, stride_out, mean_ptr, stride_mean,
                                          latch_ptr, stride_latch)
                if c != 0.0:
                    v = tl.load(vec_ptr + e * stride_vec + offs, mask=m, other=0.0)
                    coeff = c
                    if tl.load(kinds_ptr + e) == 1:
                        s = h.to(tl.float32) + x.to(tl.float32)
                        coeff = c * (tl.load(values_ptr + e) - tl.sum(s * v, axis=0))
                    h = (h.to(tl.float32) + coeff * v).to(h.dtype)
        else:
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            nz = tl.zeros([BLOCK_D], dtype=tl.int32)
            for i in range(n_entries):
                e = tl.load(entries_ptr + i).to(tl.int64)
                c = tl.zeros([BLOCK_D], dtype=tl.float32) + tl.load(coef_ptr + slot * stride_coef + e)
                on = c != 0.0
                v = tl.load(vec_ptr + e * stride_vec + offs, mask=m & on, other=0.0)
                acc += c * v
                nz += on.to(tl.int32)
            h = tl.where(nz > 0, (h.to(tl.float32) + acc).to(h.dtype), h)
        z = (x.to(tl.float32) + h.to(tl.float32)).to(h.dtype)
        zf = tl.where(m, z.to(tl.float32), 0.0)
        rs = 1.0 / tl.sqrt(tl.sum(zf * zf, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0)
        out = ((zf * rs).to(h.dtype).to(tl.float32) * w.to(tl.float32)).to(h.dtype)
        tl.store(r_ptr + t * stride_r + offs, z, mask=m)
        tl.store(x_ptr + t * stride_x + offs, out, mask=m)


def _norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """vLLM's CUDA ``fused_add_rms_norm`` in torch (the residual rounded before the norm), in place."""
    z = (x.float() + residual.float()).to(x.dtype)
    zf = z.float()
    rs = torch.rsqrt(zf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = ((zf * rs).to(x.dtype).float() * weight.float()).to(x.dtype)
    residual.copy_(z)
    x.copy_(out)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           tok_slot: torch.Tensor, coef: torch.Tensor, entries: list[int], kinds: list[int],
                           values: list[float], vectors: torch.Tensor, row: bool, pre: list[int] | None = None,
                           mult: torch.Tensor | None = None) -> None:
    """Torch reference of :func:`add_rms_norm_triton` (the module docstring's semantics);
    ``entries`` / ``kinds`` / ``values`` / ``pre`` are host lists; ``mult`` ``[T, len(entries)]``
    float32: the entries' condition gates (``cond_gate.gate_reference``), None for none. Mutates
    ``x`` and ``residual``."""
    if x.shape[0] == 0:
        return
    if pre:
        steer_add_reference(residual, tok_slot, coef, torch.tensor(pre, dtype=torch.int32, device=residual.device),
                            vectors)
    if entries:
        if row:
            row_write_reference(residual, x, tok_slot, coef, entries, kinds, values, vectors, mult=mult)
        else:
            idx = torch.tensor(entries, dtype=torch.int32, device=residual.device)
            steer_add_reference(residual, tok_slot, coef, idx, vectors)
    _norm_reference(x, residual, weight, eps)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        tok_slot: torch.Tensor, coef: torch.Tensor, entries: torch.Tensor | None,
                        kinds: torch.Tensor, values: torch.Tensor, vectors: torch.Tensor, row: bool,
                        pre: torch.Tensor | None = None, cond: dict | None = None) -> None:
    """Triton implementation (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``entries`` / ``pre``:
    int32 device tensors, or None for none; ``cond``: the condition tensors (``cond_i``,
    ``cond_thr``, ``tok_pos``, ``slot_plen``, ``tok_cur``, ``tok_prev``, ``bitmaps``, ``out``,
    ``req_mean``, ``latch_pos``, as ``ConditionState.cond_args``) to gate ROW entries, None for
    unconditional ones. Mutates ``x`` and ``residual``.

    Raises:
        ValueError: ``x`` / ``residual`` of different shapes or dtypes, a last dim that is not
        contiguous, or ``cond`` without ``row``."""
    T, D = x.shape
    if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape[0] != D:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, weight {tuple(weight.shape)}: need equal [T, D] and weight [D]")
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("add_rms_norm: x and residual need a contiguous last dim")
    if cond is not None and not row:
        raise ValueError("add_rms_norm: conditional writes need the row semantics (row=True)")
    if T == 0:
        return
    n = 0 if entries is None else entries.shape[0]
    e = entries if entries is not None else tok_slot
    n_pre = 0 if pre is None else pre.shape[0]
    c = cond or {}
    bm, latch = c.get("bitmaps", kinds), c.get("latch_pos", tok_slot.view(1, -1))
    out, mean = c.get("out", coef), c.get("req_mean", coef)
    block = triton.next_power_of_2(D)
    _add_rms_norm_kernel[(T,)](x, x.stride(0), residual, residual.stride(0), weight, tok_slot, coef, coef.stride(0),
                               e, kinds, values, vectors, vectors.stride(0), n, D, float(eps),
                               pre if pre is not None else tok_slot, n_pre,
                               c.get("cond_i", kinds), c.get("cond_thr", values), c.get("tok_pos", tok_slot),
                               c.get("slot_plen", tok_slot), c.get("tok_cur", tok_slot), c.get("tok_prev", tok_slot),
                               bm, bm.shape[-1] if bm.dim() == 2 else 0, out, out.stride(0), mean, mean.stride(0),
                               latch, latch.stride(0),
                               ROW=bool(row), HAS_PRE=n_pre > 0, HAS_COND=cond is not None,
                               BLOCK_D=block, num_warps=8 if block >= 2048 else 4)


__all__ = ["ADD", "PROJ", "add_rms_norm_reference", "add_rms_norm_triton"]
