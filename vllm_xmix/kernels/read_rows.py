"""Per-token gated reads: linear probes and captures, the kernel beside its torch reference.

Semantics, for every token ``t`` and the site's read entries ``e``::

    if coef[tok_slot[t], e] != 0:                  # the request of token t has the app on
        x = h[t] + other[t]                        # the hook's value (other None => h[t])
        kind[e] == PROBE:   out[t, col[e]] = s if not sigmoid[e] else 1 / (1 + exp(-s)),
                            s = x . vectors[e] + bias[e]          (a linear / logistic probe)
        kind[e] == CAPTURE: out[t, col[e] : col[e] + D] = x
        kind[e] == COSINE:  out[t, col[e]] = x . vectors[e] / max(|x|, 1e-12)   (vectors[e] unit)

Rows of tokens whose request has the read off are not written (stale values stay: the host reads
only the rows of requests that have it on). Arithmetic and ``out`` in float32.

Shapes / dtypes: ``h``, ``other`` ``[T, D]`` (same dtype, last dim contiguous); ``tok_slot``
int32 ``[>= T]``; ``coef`` float32 ``[S, E_total]``; ``entries`` int32 ``[E]``; ``kinds``,
``cols``, ``flags`` (1 = sigmoid) int32 ``[E_total]``; ``bias`` float32 ``[E_total]``;
``vectors`` float32 ``[E_total, >= D]``; ``out`` float32 ``[>= T, n_cols]`` (persistent, not
reallocated: CUDA graphs bake its address). Graph-safe: no host sync, fixed launch (one program
per token, which returns at once for tokens of requests without apps).
"""

from __future__ import annotations

import torch

from .launch import CompiledLaunch
from .steer_add import HAS_TRITON

PROBE, CAPTURE, COSINE = 2, 3, 4  # entry kinds (writes use 0 / 1, kernels.row_write)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_entries"])
    def _read_rows_kernel(h_ptr, stride_h, o_ptr, stride_o, tok_slot_ptr, coef_ptr, stride_coef, entries_ptr,
                          kinds_ptr, cols_ptr, flags_ptr, bias_ptr, vec_ptr, stride_vec, out_ptr, stride_out,
                          n_entries, D, HAS_OTHER: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(tok_slot_ptr + t).to(tl.int64)
        if slot != 0:
            offs = tl.arange(0, BLOCK_D)
            m = offs < D
            x = tl.load(h_ptr + t * stride_h + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_OTHER:
                x += tl.load(o_ptr + t * stride_o + offs, mask=m, other=0.0).to(tl.float32)
            for i in range(n_entries):
                e = tl.load(entries_ptr + i).to(tl.int64)
                c = tl.load(coef_ptr + slot * stride_coef + e)
                if c != 0.0:
                    col = tl.load(cols_ptr + e).to(tl.int64)
                    kind = tl.load(kinds_ptr + e)
                    if kind == 3:
                        tl.store(out_ptr + t * stride_out + col + offs, x, mask=m)
                    else:
                        w = tl.load(vec_ptr + e * stride_vec + offs, mask=m, other=0.0)
                        s = tl.sum(x * w, axis=0)
                        if kind == 4:
                            s = s / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), 1e-12)
                        else:
                            s += tl.load(bias_ptr + e)
                            if tl.load(flags_ptr + e) != 0:
                                s = 1.0 / (1.0 + tl.exp(-s))
                        tl.store(out_ptr + t * stride_out + col, s)

    #: the kernel's launches, through its compiled handles once the JIT has made them (launch.py)
    _LAUNCH = CompiledLaunch(_read_rows_kernel)


def read_rows_reference(h: torch.Tensor, other: torch.Tensor | None, tok_slot: torch.Tensor, coef: torch.Tensor,
                        entries: list[int], kinds: list[int], cols: list[int], flags: list[int], bias: list[float],
                        vectors: torch.Tensor, out: torch.Tensor) -> None:
    """Torch reference (also the CPU implementation). ``entries``/``kinds``/``cols``/``flags``/
    ``bias`` are the site's static host lists. Writes ``out``."""
    T, D = h.shape
    if T == 0:
        return
    slots = tok_slot[:T].long()
    x = h.float() + other.float() if other is not None else h.float()
    for e in entries:
        on = coef[slots, e] != 0  # [T]
        col = cols[e]
        if kinds[e] == PROBE:
            s = x @ vectors[e, :D].float() + bias[e]
            if flags[e]:
                s = torch.sigmoid(s)
            out[:T, col].copy_(torch.where(on, s, out[:T, col]))
        elif kinds[e] == COSINE:
            s = (x @ vectors[e, :D].float()) / x.norm(dim=1).clamp_min(1e-12)
            out[:T, col].copy_(torch.where(on, s, out[:T, col]))
        else:
            out[:T, col:col + D].copy_(torch.where(on.unsqueeze(1), x, out[:T, col:col + D]))


def read_rows_triton(h, other, tok_slot, coef, entries_dev, kinds_dev, cols_dev, flags_dev, bias_dev, vectors,
                     out) -> None:
    T, D = h.shape
    if T == 0:
        return
    assert h.stride(1) == 1 and (other is None or other.stride(1) == 1)
    o = other if other is not None else h
    _LAUNCH((T,), (h, h.stride(0), o, o.stride(0), tok_slot, coef, coef.stride(0), entries_dev, kinds_dev,
                   cols_dev, flags_dev, bias_dev, vectors, vectors.stride(0), out, out.stride(0),
                   entries_dev.shape[0], D, other is not None, triton.next_power_of_2(D)))
