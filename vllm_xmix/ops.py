"""Custom ops (library ``vllm_xmix``) called from the hook points.

``torch.ops.vllm_xmix.hook_write_(h, other, site, fused)``: apply every write deployed at hook site ``site``
(an index into the model's :class:`~vllm_xmix.runtime.XmixState`) to ``h`` ``[T, d_model]`` in
place, then every read deployed there (into the state's persistent ``out`` buffer: reads see the
hook's value after its writes), then the latches its reads set (``cond(latch=...)``).
It declares ``mutates_args=["h"]`` so torch.compile keeps it and orders it (an op with no
declared mutation and no used output is dead-code eliminated, see research notes section 3.1),
and it is opaque to Dynamo/Inductor. The per-step data it reads (``tok_slot``, ``coef``) is found
through vLLM's forward context at call time, not traced as globals, so the AOT compile cache
stays valid and CUDA-graph replays read the current buffer contents.

Registered at plugin load (``register()``), in every process, before any model is built, so that
AOT-compiled artifacts referring to ``torch.ops.vllm_xmix.*`` resolve.
"""

from __future__ import annotations

import torch
from torch.library import Library

from vllm.forward_context import get_forward_context, is_forward_context_available

from .kernels.add_rms_norm import AddRmsNormLaunch
from .kernels.read_rows import read_rows_reference, read_rows_triton
from .kernels.row_write import row_write_reference, row_write_triton
from .kernels.steer_add import HAS_TRITON, steer_add
from .runtime import STATE_KEY

_LIB: Library | None = None


def _state():
    if not is_forward_context_available():
        raise RuntimeError("vllm_xmix: hook op called outside a vLLM forward context")
    st = get_forward_context().no_compile_layers.get(STATE_KEY)
    if st is None:
        raise RuntimeError("vllm_xmix: hook op called but this model has no xmix state")
    return st


def hook_write_(h: torch.Tensor, other: torch.Tensor | None, key: torch.Tensor, fused: int) -> None:
    """``h`` [T, d_model]: the tensor the write lands on (mutated); ``other`` [T, d_model] or
    None: the other half of the residual stream (the hook's value is ``h + other``), read by
    projection writes only; ``key``: the hooked module's key buffer of the site (one element;
    the op looks the (layer, hook) site up from it, ``runtime.site_keys.SiteKeys``, so that no
    per-layer constant enters the compiled graph); ``fused``: 0, or the fingerprint
    (``runtime.layout.fused_id``) of the site's unconditional writes (``DeviceLayout.site_fused``)
    that torch ops in the compiled graph already applied (``adapters._residual``), so only the
    rest is applied here; a fingerprint other than the runtime's raises ``RuntimeError`` (a stale
    compile cache), as does a key no hooked module has."""
    st = _state()
    site = st.site_keys.sites_of(key)[0]
    st.calls[site] += 1  # host-side: counts eager calls, compiled calls and graph captures
    if st.replicas.on:  # the first dummy forward under tensor parallelism (runtime/replicas.py)
        st.replicas.record(site, h, other)
    plan = st.variants.site_plan(site, fused)  # the entries of the step's variant at this site
    if plan is None:  # no app of this step needs this site (graph variants)
        return
    _apply_plan(st, h, other, site, plan)


def _apply_plan(st, h: torch.Tensor, other: torch.Tensor | None, site: int, plan) -> None:
    """The writes then the reads of ``site`` (``plan``: its ``runtime.variants.SitePlan``) on ``h``."""
    lay = st.layout  # the device tables (runtime/layout.py)
    triton_ok = h.is_cuda and HAS_TRITON
    if plan.pre is not None:  # eager, mixed site: the compiled order (the fused adds first)
        steer_add(h, lay.tok_slot, lay.coef, plan.pre, lay.vectors)
    if plan.writes is None:
        pass  # nothing (left) to write here
    elif not plan.row:  # the (token, slice)-parallel kernel
        steer_add(h, lay.tok_slot, lay.coef, plan.writes, lay.vectors)
    else:  # one program per token; conditional entries get a per-token gate
        if triton_ok:  # the gate is evaluated inside the kernel
            row_write_triton(h, other, lay.tok_slot, lay.coef, plan.writes, lay.kinds, lay.values, lay.vectors,
                             cond=lay.conditions.cond_args if plan.has_cond else None)
        else:
            mult = lay.conditions.gate(site, h.shape[0], plan.writes_host) if plan.has_cond else None
            row_write_reference(h, other, lay.tok_slot, lay.coef, plan.writes_host, lay.kinds_host,
                                lay.values_host, lay.vectors, mult=mult)
    _reads(st, h, other, plan)


def _reads(st, h: torch.Tensor, other: torch.Tensor | None, plan) -> None:
    """The site's reads of ``plan`` on the hook's value ``h + other`` (``other`` None: ``h``)."""
    if plan.reads is None:
        return
    lay = st.layout
    if h.is_cuda and HAS_TRITON:
        read_rows_triton(h, other, lay.tok_slot, lay.coef, plan.reads, lay.kinds, lay.cols, lay.flags,
                         lay.values, lay.vectors, lay.out)
    else:
        read_rows_reference(h, other, lay.tok_slot, lay.coef, plan.reads_host, lay.kinds_host, lay.cols_host,
                            lay.flags_host, lay.values_host, lay.vectors, lay.out)
    if plan.req_reads:
        lay.conditions.store_request_values(plan.req_reads, h.shape[0])
    if plan.latch_reads:  # after the values: the latches of cond(latch=...) writes at later layers
        lay.conditions.set_latches(plan.latch_reads, plan.latch_idx, h.shape[0], lay.cols_host, lay.cols)


def hook_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """The hook op of the residual-stream sites (``site_a`` then ``site_b``, looked up from the
    norm's ``weight``: ``runtime.site_keys.SiteKeys``, so that no per-layer constant enters the
    compiled graph) that lie
    just before one of vLLM's fused residual add + RMSNorm calls, which it replaces (deployment
    ``fused_writes="norm"``, :mod:`.kernels.add_rms_norm`): ``x`` [T, d_model] the norm's input
    (the other half of the stream) and ``residual`` [T, d_model], same dtype, both mutated to the
    norm's outputs (``x`` <- RMSNorm(x + residual) * ``weight`` [d_model], ``residual`` <- the
    stream after the sites' writes); ``eps``: the norm's epsilon. No site of the step's variant
    on: the norm alone (:func:`_app_free_norm`: on CUDA the plugin's kernel without writes, on
    CPU vLLM's norm, :func:`plain_add_rms_norm`).
    Sites on (on CUDA): one kernel applies their writes in order, conditional ones included (the
    gates evaluated inline), and the norm (``kernels.add_rms_norm``: an ``AddRmsNormLaunch`` kept
    per pair of site plans, :func:`_norm_launch`), then the reads of the last
    site on (on the stream as the kernel rounded it, ``residual``); when the first of two sites
    has reads, the same kernel applies each site's writes alone, each site's reads see the
    stream rounded the same way, then the kernel applies the norm alone (the same arithmetic
    either way: a request's values do not depend on which other apps' sites are on). Without
    Triton: each site as :func:`hook_write_` (on ``residual``, ``other`` = ``x``), then vLLM's
    norm.

    Raises:
        RuntimeError: ``weight`` is no hosting norm's (see ``SiteKeys.lookup``; not looked up
        in a step with no app on once the hook self-check has passed)."""
    st = _state()
    mask = st.variants.run_mask
    # vLLM's norm without the per-site bookkeeping, which only the self-check (verify_hooks_fired,
    # passed) and the replica record (off) use, when no app is on in this step or none of this
    # norm's sites is in the step's variant (a hosting norm's sites are never fused writes, so
    # a site runs exactly when its bit is in the run mask: GraphVariants._op_mask): host time in
    # every step that runs without CUDA graphs, for each norm an app on does not write at
    bare = st.verified and not st.replicas.on
    if bare and not mask:
        _app_free_norm(st, x, residual, weight, eps)
        return
    entry = st.site_keys.lookup(weight)  # (sites, their run-mask bits, ...)
    if bare and not mask & entry[1]:
        _app_free_norm(st, x, residual, weight, eps)
        return
    plans = []
    for s in entry[0]:
        if s >= 0:
            st.calls[s] += 1
            if st.replicas.on:
                st.replicas.record(s, residual, x)
            p = st.variants.site_plan(s, 0)
            if p is not None:
                plans.append((s, p))
    if not plans:
        _app_free_norm(st, x, residual, weight, eps)
        return
    if x.is_cuda and HAS_TRITON:
        if len(plans) == 1 or plans[0][1].reads is None:  # one kernel: the sites' writes, then the norm
            p, q = plans[0][1], (plans[1][1] if len(plans) > 1 else None)
            _norm_launch(st, p, q, True)(x, residual, weight, eps)
            _reads(st, residual, None, q or p)  # on the stream as the kernel rounded it
            return
        # the first site's reads see the stream between the two sites' writes: the same kernel
        # applies each site's writes alone, the reads see the stream rounded as the kernel rounds
        # it, then the norm alone; so a site's values do not depend on which other sites are on
        for _, p in plans:
            _norm_launch(st, p, None, False)(x, residual, weight, eps)
            if p.reads is not None:
                _reads(st, residual + x, None, p)
        _norm_launch(st, None, None, True)(x, residual, weight, eps)
        return
    for s, p in plans:
        _apply_plan(st, residual, x, s, p)
    plain_add_rms_norm(x, residual, weight, eps)


def _app_free_norm(st, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """A hosted norm none of whose sites is on in the step: the residual add + RMSNorm alone, in
    place (``x``, ``residual`` [T, d_model]). On CUDA with Triton the plugin's kernel without
    writes (:func:`_norm_launch` with no plans), the same arithmetic, reduction order included,
    that a token on the null slot gets where a site is on: an app-off token's values do not
    depend on whether other requests' apps are on in its step (its graph variant), and where the
    step runs in CUDA graphs it is the faster kernel at every measured size up to 512 tokens
    (0.04-1.1 us a launch below vLLM's own on an H100 and an H200, benchmarks/RESULTS.md
    2026-12-04 and 2026-12-06, ``kernels --kernel norm``: ``xmix_norm`` against ``vllm``).
    Elsewhere vLLM's norm (:func:`plain_add_rms_norm`)."""
    if x.is_cuda and HAS_TRITON:
        _norm_launch(st, None, None, True)(x, residual, weight, eps)
    else:
        plain_add_rms_norm(x, residual, weight, eps)


#: launches kept per state (``XmixState.norm_launches``) before the cache is emptied (an eager
#: engine's run masks follow its requests' layer subsets, and so do its site plans)
_MAX_NORM_LAUNCHES = 1024


def _norm_launch(st, p, q, norm: bool) -> AddRmsNormLaunch:
    """The hosted norm's kernel launch for site plan ``p`` (None: no writes), then ``q`` (None:
    no second site), with the norm (``norm``) or the writes alone, on ``st``'s tables: built
    once per pair of plans and kept in ``st.norm_launches`` (the tables are updated in place,
    never replaced, so a launch's bound tensors stay the runtime's)."""
    key = (id(p), id(q), norm)
    hit = st.norm_launches.get(key)
    if hit is not None and hit[0] is p and hit[1] is q:  # (the plans themselves: an id can be reused)
        return hit[2]
    lay = st.layout
    has_cond = (p is not None and p.has_cond) or (q is not None and q.has_cond)
    launch = AddRmsNormLaunch(
        lay.tok_slot, lay.coef, None if p is None else p.writes, lay.kinds, lay.values, lay.vectors,
        False if p is None else p.row, pre=None if p is None else p.pre,
        cond=lay.conditions.cond_args if has_cond else None, gated=p is not None and p.has_cond,
        second=None if q is None else (q.writes, q.row, q.pre, q.has_cond), norm=norm)
    if len(st.norm_launches) >= _MAX_NORM_LAUNCHES:
        st.norm_launches.clear()
    st.norm_launches[key] = (p, q, launch)
    return launch


#: whether CPU tensors go to ``_C.fused_add_rms_norm`` (None: not yet looked up)
_CPU_C_NORM: bool | None = None


def plain_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """vLLM's fused residual add + RMSNorm, in place (``residual += x``, then ``x`` = the
    normalized sum): its compiled kernel (``torch.ops._C.fused_add_rms_norm``) on CUDA tensors
    and on CPU builds that have it (vLLM's CPU wheels do), its native (torch) implementation
    elsewhere (five unfused torch ops and two copies: several times the host time)."""
    global _CPU_C_NORM
    if x.is_cuda:
        torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)
        return
    if _CPU_C_NORM is None:
        _CPU_C_NORM = _has_cpu_c_norm()
    if _CPU_C_NORM:
        torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)
        return
    from vllm import ir

    out, res = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, residual, weight, eps)
    residual.copy_(res)
    x.copy_(out)


def _has_cpu_c_norm() -> bool:
    """Whether this vLLM build registers ``_C.fused_add_rms_norm`` with a CPU kernel."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads the ``_C`` extension)

        op = torch.ops._C.fused_add_rms_norm
        return op.default.has_kernel_for_dispatch_key("CPU")
    except Exception:
        return False


def hook_norm_fake(x, residual, weight, eps) -> None:
    return None


def hook_write_fake(h: torch.Tensor, other: torch.Tensor | None, key: torch.Tensor, fused: int) -> None:
    return None


def note_tokens_(h: torch.Tensor, input_ids: torch.Tensor) -> None:
    """At the embedding (``h`` [T, d_model]: its output, declared mutated so the op is kept and
    ordered before the layers; not written): record this step's token ids ``input_ids`` [T]
    (int) and each token's previous token for token-conditioned writes."""
    st = _state()
    st.token_hook_calls += 1
    v = st.variants
    if (v.run_mask >> v.tok_unit) & 1:
        st.conditions.note_tokens(input_ids)


def note_tokens_fake(h: torch.Tensor, input_ids: torch.Tensor) -> None:
    return None


def register_ops() -> None:
    """Define ``vllm_xmix::hook_write_`` once per process (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    if hasattr(torch.ops, "vllm_xmix") and hasattr(torch.ops.vllm_xmix, "hook_write_"):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    lib = Library("vllm_xmix", "FRAGMENT")
    for name, func, fake in (("hook_write_", hook_write_, hook_write_fake), ("note_tokens_", note_tokens_, note_tokens_fake)):
        direct_register_custom_op(op_name=name, op_func=func, mutates_args=["h"], fake_impl=fake, target_lib=lib)
    direct_register_custom_op(op_name="hook_norm_", op_func=hook_norm_, mutates_args=["x", "residual"],
                              fake_impl=hook_norm_fake, target_lib=lib)
    _LIB = lib
