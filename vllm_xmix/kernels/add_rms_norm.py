"""A hook site's writes inside vLLM's residual add + RMSNorm: the kernel beside its torch reference.

In vLLM's pre-norm decoder layers (:mod:`vllm_xmix.adapters._residual`) the residual stream at
``hook_resid_pre`` (layers >= 1), ``hook_resid_mid`` and ``hook_resid_post`` (all but the last
layer) exists only as two tensors that the next norm adds and normalises in one kernel::

    x, residual = norm(x, residual)     # residual <- x + residual; x <- RMSNorm(residual) * weight

With the deployment's ``fused_writes="norm"`` the site's hook op replaces that call
(``ops.hook_norm_``). Where they are on, this kernel applies the writes and the norm in one
launch instead of a write kernel followed by the norm kernel. In a graph variant where none of
the site's apps is on, it runs without writes (``entries`` None: the norm alone, the arithmetic
a token on the null slot gets where they are on), so steps with apps off add no launch there
(vLLM's own ``torch.ops._C.fused_add_rms_norm`` on CPU, ``ops.plain_add_rms_norm``).

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
:mod:`.cond_gate` (``ConditionState.cond_args``), for ROW writes with conditions (SEAL, CAST,
latches). Two sites at one norm (``resid_post[L-1]`` then ``resid_pre[L]``): the first's writes,
then the second's, then the norm. One program per token over the whole row (``BLOCK_D`` = next
power of two >= D).
Graph-safe: no host sync, fixed launch for a given T.
"""

from __future__ import annotations

import torch

from .launch import as_pointers, tensor_spec
from .row_write import ADD, PROJ, row_write_reference
from .steer_add import HAS_TRITON, steer_add_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .cond_gate import cond_gate
    from .launch import CompiledLaunch
    from .steer_add import add_sum

    @triton.jit
    def _adds(h, m, offs, slot, coef_ptr, stride_coef, vec_ptr, stride_vec, entries_ptr, n_entries,
              BLOCK_D: tl.constexpr):
        """Adds with the add kernel's semantics (kernels/steer_add.py): one float32 sum over the
        entries on for this token, rounded once; ``h`` untouched when none is on."""
        acc, nz = add_sum(slot, coef_ptr, stride_coef, entries_ptr, n_entries, vec_ptr, stride_vec, offs, m, BLOCK_D)
        return tl.where(nz > 0, (h.to(tl.float32) + acc).to(h.dtype), h)

    @triton.jit
    def _site_writes(h, x, m, offs, t, slot, coef_ptr, stride_coef, kinds_ptr, values_ptr, vec_ptr, stride_vec,
                     entries_ptr, n_entries, pre_ptr, n_pre,
                     cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr, tok_prev_ptr, bitmap_ptr, V,
                     out_ptr, stride_out, mean_ptr, stride_mean, latch_ptr, stride_latch,
                     ROW: tl.constexpr, HAS_PRE: tl.constexpr, HAS_COND: tl.constexpr, BLOCK_D: tl.constexpr):
        """One site's writes on the row ``h`` (the other half of the stream: ``x``)."""
        if HAS_PRE:
            h = _adds(h, m, offs, slot, coef_ptr, stride_coef, vec_ptr, stride_vec, pre_ptr, n_pre, BLOCK_D)
        if ROW:
            for i in range(n_entries):
                e = tl.load(entries_ptr + i).to(tl.int64)
                # the entry's vector, kind and value depend on the entry only: their loads go out
                # beside the coefficient's, not after its test (one dependent round trip less
                # per entry in a latency-bound kernel; as add_sum does for adds). A token whose
                # coefficient is 0 leaves them unused, whatever they hold.
                v = tl.load(vec_ptr + e * stride_vec + offs, mask=m, other=0.0)
                kind = tl.load(kinds_ptr + e)
                val = tl.load(values_ptr + e)
                c = tl.load(coef_ptr + slot * stride_coef + e)
                if HAS_COND:
                    if c != 0.0:  # the condition, only for tokens with the entry on (kernels/cond_gate.py)
                        c = c * cond_gate(t, slot, e, cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr,
                                          tok_prev_ptr, bitmap_ptr, V, out_ptr, stride_out, mean_ptr, stride_mean,
                                          latch_ptr, stride_latch)
                if c != 0.0:
                    coeff = c
                    if kind == 1:
                        s = h.to(tl.float32) + x.to(tl.float32)
                        coeff = c * (val - tl.sum(s * v, axis=0))
                    h = (h.to(tl.float32) + coeff * v).to(h.dtype)
        else:
            h = _adds(h, m, offs, slot, coef_ptr, stride_coef, vec_ptr, stride_vec, entries_ptr, n_entries, BLOCK_D)
        return h

    @triton.jit(do_not_specialize=["n_entries", "n_pre", "n_entries2", "n_pre2"])
    def _add_rms_norm_kernel(x_ptr, stride_x, r_ptr, stride_r, w_ptr, tok_slot_ptr, coef_ptr, stride_coef,
                             kinds_ptr, values_ptr, vec_ptr, stride_vec, D, eps,
                             entries_ptr, n_entries, pre_ptr, n_pre, entries2_ptr, n_entries2, pre2_ptr, n_pre2,
                             cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr, tok_cur_ptr, tok_prev_ptr, bitmap_ptr, V,
                             out_ptr, stride_out, mean_ptr, stride_mean, latch_ptr, stride_latch,
                             ROW: tl.constexpr, HAS_PRE: tl.constexpr, HAS_COND: tl.constexpr,
                             TWO: tl.constexpr, ROW2: tl.constexpr, HAS_PRE2: tl.constexpr, HAS_COND2: tl.constexpr,
                             NORM: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0)
        h = tl.load(r_ptr + t * stride_r + offs, mask=m, other=0.0)
        slot = tl.load(tok_slot_ptr + t).to(tl.int64)
        w = tl.load(w_ptr + offs, mask=m, other=0.0)  # issued before the writes' loads (unused without NORM)
        h = _site_writes(h, x, m, offs, t, slot, coef_ptr, stride_coef, kinds_ptr, values_ptr, vec_ptr, stride_vec,
                         entries_ptr, n_entries, pre_ptr, n_pre, cond_i_ptr, cond_thr_ptr, tok_pos_ptr, plen_ptr,
                         tok_cur_ptr, tok_prev_ptr, bitmap_ptr, V, out_ptr, stride_out, mean_ptr, stride_mean,
                         latch_ptr, stride_latch, ROW, HAS_PRE, HAS_COND, BLOCK_D)
        if TWO:  # the second site at the same norm (resid_pre[L] after resid_post[L-1]), in order
            h = _site_writes(h, x, m, offs, t, slot, coef_ptr, stride_coef, kinds_ptr, values_ptr, vec_ptr,
                             stride_vec, entries2_ptr, n_entries2, pre2_ptr, n_pre2, cond_i_ptr, cond_thr_ptr,
                             tok_pos_ptr, plen_ptr, tok_cur_ptr, tok_prev_ptr, bitmap_ptr, V, out_ptr, stride_out,
                             mean_ptr, stride_mean, latch_ptr, stride_latch, ROW2, HAS_PRE2, HAS_COND2, BLOCK_D)
        if not NORM:  # the writes alone (the residual half; x untouched)
            tl.store(r_ptr + t * stride_r + offs, h, mask=m)
            return
        z = (x.to(tl.float32) + h.to(tl.float32)).to(h.dtype)
        zf = tl.where(m, z.to(tl.float32), 0.0)
        rs = 1.0 / tl.sqrt(tl.sum(zf * zf, axis=0) / D + eps)
        out = ((zf * rs).to(h.dtype).to(tl.float32) * w.to(tl.float32)).to(h.dtype)
        tl.store(r_ptr + t * stride_r + offs, z, mask=m)
        tl.store(x_ptr + t * stride_x + offs, out, mask=m)

    #: the kernel's launches through its compiled handles (AddRmsNormLaunch)
    _LAUNCH = CompiledLaunch(_add_rms_norm_kernel)


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
                           mult: torch.Tensor | None = None, second: tuple | None = None, norm: bool = True) -> None:
    """Torch reference of :func:`add_rms_norm_triton` (the module docstring's semantics);
    ``entries`` / ``kinds`` / ``values`` / ``pre`` are host lists; ``mult`` ``[T, len(entries)]``
    float32: the entries' condition gates (``cond_gate.gate_reference``), None for none;
    ``second``: ``(entries, row, pre, mult)`` of a second site applied after the first, or None;
    ``norm``: False for the writes alone (``residual`` mutated, ``x`` not). Mutates ``x`` and
    ``residual``."""
    if x.shape[0] == 0:
        return
    for ents, rw, pr, mu in [(entries, row, pre, mult)] + ([tuple(second)] if second is not None else []):
        if pr:
            steer_add_reference(residual, tok_slot, coef, torch.tensor(pr, dtype=torch.int32, device=residual.device),
                                vectors)
        if ents:
            if rw:
                row_write_reference(residual, x, tok_slot, coef, ents, kinds, values, vectors, mult=mu)
            else:
                idx = torch.tensor(ents, dtype=torch.int32, device=residual.device)
                steer_add_reference(residual, tok_slot, coef, idx, vectors)
    if norm:
        _norm_reference(x, residual, weight, eps)


class AddRmsNormLaunch:
    """:func:`add_rms_norm_triton` for one set of tables and sites: the arguments other than
    ``x``, ``residual``, ``weight`` and ``eps`` are checked and bound once, and each launch after
    the first of its specialization goes to the compiled kernel directly
    (:class:`.launch.CompiledLaunch`): on an H100's host a hosted norm's op with its sites on
    took 113 us per call through the JIT and 28.6 us this way (vLLM's own kernel: ~10 us), in
    every step without CUDA graphs (benchmarks/RESULTS.md 2026-12-05). Arguments as for
    :func:`add_rms_norm_triton`; every tensor is used as it is when the launch is made (the
    runtime's tables are updated in place, never replaced), and is kept alive by this object.

    Raises:
        ValueError: gated writes without ``cond`` or without ``row`` (at construction); at a
        launch, ``x`` / ``residual`` of different shapes or dtypes, a last dim that is not
        contiguous, a ``weight`` of another width."""

    __slots__ = ("_mid", "_tail", "_mid_ptrs", "_tail_ptrs", "_static_key", "_num_warps", "_width")

    def __init__(self, tok_slot: torch.Tensor, coef: torch.Tensor, entries: torch.Tensor | None, kinds: torch.Tensor,
                 values: torch.Tensor, vectors: torch.Tensor, row: bool, pre: torch.Tensor | None = None,
                 cond: dict | None = None, gated: bool | None = None, second: tuple | None = None,
                 norm: bool = True, num_warps: int | None = None) -> None:
        gated = cond is not None if gated is None else gated
        sites = [(entries, row, pre, gated)] + ([tuple(second)] if second is not None else [])
        for ents, rw, pr, g in sites:
            if g and (cond is None or not rw):
                raise ValueError("add_rms_norm: conditional writes need the condition tensors (cond) and the row "
                                 "semantics (row=True)")
        c = cond or {}
        bm, latch = c.get("bitmaps", kinds), c.get("latch_pos", tok_slot.view(1, -1))
        out, mean = c.get("out", coef), c.get("req_mean", coef)

        def site_args(site):
            ents, rw, pr, g = site
            return ((ents if ents is not None else tok_slot), 0 if ents is None else ents.shape[0],
                    (pr if pr is not None else tok_slot), 0 if pr is None else pr.shape[0])

        a = site_args(sites[0])
        b = site_args(sites[1]) if len(sites) > 1 else (tok_slot, 0, tok_slot, 0)
        # the signature's order (_add_rms_norm_kernel): x, stride_x, r, stride_r, w | _mid | D, eps |
        # _tail (BLOCK_D last, from D)
        self._mid = (tok_slot, coef, coef.stride(0), kinds, values, vectors, vectors.stride(0))
        self._tail = (*a, *b, c.get("cond_i", kinds), c.get("cond_thr", values), c.get("tok_pos", tok_slot),
                      c.get("slot_plen", tok_slot), c.get("tok_cur", tok_slot), c.get("tok_prev", tok_slot),
                      bm, bm.shape[-1] if bm.dim() == 2 else 0, out, out.stride(0), mean, mean.stride(0),
                      latch, latch.stride(0),
                      bool(row), a[3] > 0, bool(gated), len(sites) > 1, bool(len(sites) > 1 and sites[1][1]),
                      b[3] > 0, bool(len(sites) > 1 and sites[1][3]), bool(norm))
        # what Triton specializes these arguments on (they never change for this object); the
        # counts (n_entries, n_pre, ...) are do_not_specialize and small: only their width, i32
        self._static_key = tuple(tensor_spec(v) if isinstance(v, torch.Tensor) else v
                                 for v in self._mid + self._tail)
        # the same with the tensors as device addresses, for the compiled launch (launch.py)
        self._mid_ptrs, self._tail_ptrs = as_pointers(self._mid), as_pointers(self._tail)
        self._num_warps = num_warps
        self._width = (0, 0, 0)  # (D, BLOCK_D, num_warps) of the last width (_dims)

    def _dims(self, D: int) -> tuple[int, int, int]:
        """``(D, BLOCK_D, num_warps)`` for width ``D`` (kept for the last width)."""
        if self._width[0] != D:
            block = triton.next_power_of_2(D)
            self._width = (D, block, self._num_warps or (8 if block >= 2048 else 4))
        return self._width

    def num_warps(self, D: int) -> int:
        """The launch's warps per program for width ``D`` (the constructor's, else 8 from a block
        of 2048 on, else 4)."""
        return self._dims(D)[2]

    def key(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple:
        """What Triton's specialization of a launch on these tensors depends on (with the bound
        arguments', fixed): dtypes, the width, the row strides, whether each address is 16-byte
        aligned and on CUDA, ``num_warps``, and last the current CUDA device (-1 for CPU
        tensors), whose compiled kernel the JIT made (:mod:`.launch`)."""
        D = x.shape[1]
        cuda = x.is_cuda
        return (self._static_key, x.dtype, weight.dtype, D, x.stride(0), residual.stride(0),
                x.data_ptr() % 16 == 0, residual.data_ptr() % 16 == 0, weight.data_ptr() % 16 == 0,
                residual.is_cuda, weight.is_cuda, self._dims(D)[2], torch._C._cuda_getDevice() if cuda else -1)

    def args(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
        """Every argument of ``_add_rms_norm_kernel``'s signature, in order, constexprs included."""
        D = x.shape[1]
        return ((x, x.stride(0), residual, residual.stride(0), weight) + self._mid + (D, float(eps)) + self._tail
                + (self._dims(D)[1],))

    def ptr_args(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
        """:meth:`args` with every tensor as its device address (the compiled launch's)."""
        D = x.shape[1]
        return ((x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr())
                + self._mid_ptrs + (D, float(eps)) + self._tail_ptrs + (self._dims(D)[1],))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """Apply the writes and the norm (module docstring) to ``x`` / ``residual`` ``[T, D]``, in
        place, with ``weight`` ``[D]`` and ``eps``."""
        T, D = x.shape
        if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape[0] != D:
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                             f"{residual.dtype}, weight {tuple(weight.shape)}: need equal [T, D] and weight [D]")
        if x.stride(1) != 1 or residual.stride(1) != 1:
            raise ValueError("add_rms_norm: x and residual need a contiguous last dim")
        if T == 0:
            return
        key = self.key(x, residual, weight)
        k = _LAUNCH.compiled(key)
        if k is not None:  # (the JIT launched this specialization before)
            _LAUNCH.run(k, (T,), key[-1], self.ptr_args(x, residual, weight, eps))
        else:
            _LAUNCH.jit(key, (T,), self.args(x, residual, weight, eps), self.num_warps(D))


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        tok_slot: torch.Tensor, coef: torch.Tensor, entries: torch.Tensor | None,
                        kinds: torch.Tensor, values: torch.Tensor, vectors: torch.Tensor, row: bool,
                        pre: torch.Tensor | None = None, cond: dict | None = None, gated: bool | None = None,
                        second: tuple | None = None, norm: bool = True, num_warps: int | None = None) -> None:
    """Triton implementation (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``entries`` / ``pre``:
    int32 device tensors, or None for none; ``cond``: the condition tensors (``cond_i``,
    ``cond_thr``, ``tok_pos``, ``slot_plen``, ``tok_cur``, ``tok_prev``, ``bitmaps``, ``out``,
    ``req_mean``, ``latch_pos``, as ``ConditionState.cond_args``); ``gated``: whether the
    (first) site's ROW entries are gated by them (default: ``cond`` given); ``second``:
    ``(entries, row, pre, gated)`` of a second site at this norm, applied after the first, or
    None; ``norm``: False for the writes alone (``residual`` mutated, ``x`` not: the same
    arithmetic as with the norm, so a site's writes do not depend on which path applied them);
    ``num_warps``: the launch's warps per program (default: 8 from ``D`` >= 2048, else 4; one
    value for every launch of a site, since the norm's reduction order follows it).
    Mutates ``x`` and ``residual``. Builds an :class:`AddRmsNormLaunch` per call (a caller that
    launches the same tables and sites again keeps one instead); its launch goes through the
    compiled kernel of an equal key launched before, in this process.

    Raises:
        ValueError: ``x`` / ``residual`` of different shapes or dtypes, a last dim that is not
        contiguous, gated writes without ``cond`` or without ``row``."""
    AddRmsNormLaunch(tok_slot, coef, entries, kinds, values, vectors, row, pre=pre, cond=cond, gated=gated,
                     second=second, norm=norm, num_warps=num_warps)(x, residual, weight, eps)


__all__ = ["ADD", "PROJ", "AddRmsNormLaunch", "add_rms_norm_reference", "add_rms_norm_triton"]
