"""Hook points on a decoder layer's residual stream, placed from a family's declaration
(:class:`.base.DecoderAdapter`).

Most vLLM 0.26 decoder layers (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen3-MoE)
share one body, the :data:`.base.PAIR` stream::

    if residual is None: residual = h; h = input_layernorm(h)          # layer 0
    else:                h, residual = input_layernorm(h, residual)     # fused add + norm
    h = self_attn(positions=..., hidden_states=h)                       # attn_out
    h, residual = post_attention_layernorm(h, residual)                 # residual = resid_mid
    h = mlp(h)                                                          # mlp_out
    return h, residual                                                  # resid_post = h + residual

so the residual stream exists only as the sum of two tensors. TransformerLens names and where a
write (an in-place op on one tensor) lands:

=================  =====================================  =====================================
hook               value (TransformerLens meaning)        write goes to
=================  =====================================  =====================================
hook_resid_pre     stream entering layer L                ``residual`` argument of layer L
                   (= resid_post[L-1]; L=0: embeddings)   (L=0: ``hidden_states``, the embeddings)
hook_attn_out      what the attention adds to the stream  output of the ``attn_out`` module
hook_resid_mid     resid_pre + attn_out                   ``residual`` argument of the
                                                          ``resid_mid`` norm
hook_mlp_out       what the MLP / MoE adds to the stream  output of the ``mlp_out`` module
hook_resid_post    resid_mid + mlp_out                    ``residual`` output of layer L
=================  =====================================  =====================================

Gemma 2/3 keep this body with sandwich norms: ``attn_out`` / ``mlp_out`` are then the outputs of
the norms after attention and MLP, and ``resid_mid`` is the residual of
``pre_feedforward_layernorm``. A :data:`.base.SINGLE` layer (Granite, OLMo 3) carries the stream
as one tensor: ``resid_pre`` / ``resid_post`` are its input / output, ``resid_mid`` the input of
the first module after the attention's addition (written in place, since the layer keeps that
tensor as its residual too).

For ``add`` a write at hook_attn_out and one at hook_resid_mid change the stream identically
(likewise mlp_out and resid_post, and resid_post[L] and resid_pre[L+1]) unless the layer scales
the sub-layer's output before adding it (Granite); they differ for reads and for projections
(ablate, clamp), which see the hook's whole value (``hidden + residual`` for the
``hook_resid_*`` hooks of a pair stream; the op receives the other half as ``other``).
"""

from __future__ import annotations

import functools

import torch

from ..kernels.row_write import ADD, PROJ
from ..runtime.layout import MODULE_BUFFERS
from ..runtime.site_keys import key_buffer


def _fused_writes(module: torch.nn.Module, t: torch.Tensor, other: torch.Tensor | None,
                  spec: tuple[tuple[int, int, float, int], ...]) -> torch.Tensor:
    """``t`` [T, D] with the unconditional writes ``spec`` (``(entry, kind, value, column)`` in
    the site's order) of this site applied, as torch ops; each token's coefficient of an entry is
    ``tok_fc[t, column]`` (written per step by ``StepFill.fill``: one load, not a gather through
    the token's slot). Adds only: the semantics of
    :func:`..kernels.steer_add.steer_add_reference` (float32 accumulation, one rounding, rows
    whose coefficients are all 0 untouched); with projections (directional ablation, clamp):
    those of :func:`..kernels.row_write.row_write_reference` (entries in order, each on the
    previous result, the projection taken on the hook's value ``t + other``). Under
    torch.compile Inductor fuses these loads, dot products and multiply-adds into the
    neighbouring kernels instead of launching one of its own."""
    T, D = t.shape
    torch._check(T <= module.xmix_tok_fc.shape[0])  # (fill() guarantees it; keeps [:T] exactly T long)
    coef = module.xmix_tok_fc[:T]  # [T, n_fused]
    if all(kind == ADD for _, kind, _, _ in spec):
        acc = None
        on = None
        for e, _, _, k in spec:
            c = coef[:, k: k + 1]
            d = torch.where(c != 0, c * module.xmix_vectors[e, :D], 0.0)
            acc = d if acc is None else acc + d
            on = (c != 0) if on is None else on | (c != 0)
        return torch.where(on, (t.float() + acc).to(t.dtype), t)
    for e, kind, value, k in spec:
        c = coef[:, k: k + 1]
        v = module.xmix_vectors[e, :D]
        hf = t.float()
        if kind == PROJ:
            x = hf + other.float() if other is not None else hf
            coeff = c * (value - (x * v).sum(dim=1, keepdim=True))
        else:
            coeff = c
        t = torch.where(c != 0, (hf + coeff * v).to(t.dtype), t)
    return t


def _freezing() -> bool:
    try:
        from torch._inductor import config
    except Exception:  # pragma: no cover
        return False
    return bool(getattr(config, "freezing", False))


def _write(module, t: torch.Tensor, other: torch.Tensor | None, key: str,
           fused: tuple[tuple[tuple[int, int, float, int], ...], int]) -> torch.Tensor:
    """``t``: the tensor the write lands on; ``other``: the rest of the hook's value (or None);
    ``key``: the module's key buffer of this site (``runtime.site_keys``: the op finds the site
    from it, so no per-layer constant enters the compiled graph). Returns the written tensor (a
    new one when the fused writes ran, else ``t`` mutated)."""
    # Inductor freezing (CPU max_autotune sets it while Dynamo traces) would inline the buffers'
    # contents at compile time (all zero) as constants: then the op applies every entry itself
    spec, fid = fused  # the site's fused writes and their fingerprint (runtime.fused_id)
    compiled = bool(spec) and torch.compiler.is_compiling() and not _freezing()
    if compiled:
        t = _fused_writes(module, t, other, spec)
    # the op learns which fused writes this graph applied (0: none) and checks them (GraphVariants.site_plan)
    torch.ops.vllm_xmix.hook_write_(t, other, getattr(module, key), fid if compiled else 0)
    return t


def _resid_pre(key: str, fused, module, args, kwargs, *, where: tuple[int, int]):
    """Pre-hook of a :data:`.base.PAIR` layer: ``where`` = positions of ``hidden_states`` and
    ``residual`` in its ``forward``."""
    hi, ri = where
    hidden_states = args[hi] if len(args) > hi else kwargs["hidden_states"]
    residual = args[ri] if len(args) > ri else kwargs.get("residual")
    if residual is None:  # layer 0: the stream is the embeddings
        new, i, key = _write(module, hidden_states, None, key, fused), hi, "hidden_states"
    else:
        new, i, key = _write(module, residual, hidden_states, key, fused), ri, "residual"
    if len(args) > i:
        args = args[:i] + (new,) + args[i + 1:]
    else:
        kwargs = {**kwargs, key: new}
    return args, kwargs


def _single_pre(key: str, fused, module, args, kwargs, *, where: tuple[int, int]):
    """Pre-hook of a :data:`.base.SINGLE` layer: its ``hidden_states`` argument is the stream."""
    hi = where[0]
    if len(args) > hi:
        return args[:hi] + (_write(module, args[hi], None, key, fused),) + args[hi + 1:], kwargs
    return args, {**kwargs, "hidden_states": _write(module, kwargs["hidden_states"], None, key, fused)}


def _single_mid(key: str, fused, module, args):
    """Pre-hook on the first module after a :data:`.base.SINGLE` layer's attention addition: its
    input is also the layer's residual, so the write lands in place (a fused write is copied
    back)."""
    x = args[0]
    new = _write(module, x, None, key, fused)
    if new is not x:
        x.copy_(new)
    return None


def _component_out(key: str, fused, module, args, output):
    return _write(module, output, None, key, fused)


def _resid_mid(key: str, fused, module, args):
    # post_attention_layernorm(hidden_states=attn_out, residual=resid_pre)
    return (args[0], _write(module, args[1], args[0], key, fused)) + tuple(args[2:])


def _resid_post(key: str, fused, module, args, output):
    if isinstance(output, torch.Tensor):  # a SINGLE layer returns the stream
        return _write(module, output, None, key, fused)
    hidden_states, residual = output
    return hidden_states, _write(module, residual, hidden_states, key, fused)


def _register_buffers(module: torch.nn.Module, state) -> None:
    """The runtime's buffers as (non-persistent) buffers of a module whose hook emits fused writes."""
    if hasattr(module, "xmix_tok_fc"):
        return
    for name in MODULE_BUFFERS:
        module.register_buffer(f"xmix_{name}", getattr(state.layout, name), persistent=False)
    state.buffer_modules.append(module)  # XmixState.verify_hooks_fired: still the same tensors?


def fusable_norm(module) -> bool:
    """Whether ``module`` is vLLM's plain ``RMSNorm`` (with a weight, over the whole width), the
    norm whose fused residual add ``ops.hook_norm_`` replaces (``fused_writes="norm"``)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    return type(module) is RMSNorm and bool(module.has_weight) and module.variance_size_override is None


def _norm_forward(norm, x: torch.Tensor, residual: torch.Tensor | None = None):
    if residual is None:  # the first layer's input norm has no residual; no site is placed there
        raise RuntimeError("vllm_xmix: a norm hosting hook sites was called without a residual")
    # no site constants in the graph: the op finds the sites from the weight (runtime/site_keys.py),
    # so identically hooked layers compile to isomorphic pieces that vLLM compiles once
    torch.ops.vllm_xmix.hook_norm_(x, residual, norm.weight.data, norm.variance_epsilon)
    return x, residual


def _install_norm(norm: torch.nn.Module, state, site_a: int | None, site_b: int | None) -> None:
    """Make ``norm`` (a :func:`fusable_norm`) the hook op of the sites just before it: its
    ``forward(x, residual)`` becomes ``ops.hook_norm_`` (the sites' writes, vLLM's add + RMSNorm)."""
    sites = (-1 if site_a is None else site_a, -1 if site_b is None else site_b)
    norm.forward = functools.partial(_norm_forward, norm)
    state.site_keys.add(norm, "weight", sites)
    state.installed.update(s for s in sites if s >= 0)


def submodule(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """``root``'s submodule at the dotted ``path`` (None where a part is missing)."""
    m = root
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def _module(layer: torch.nn.Module, path: str, what: str) -> torch.nn.Module:
    m = submodule(layer, path)
    if not isinstance(m, torch.nn.Module):
        raise RuntimeError(f"vllm_xmix: {type(layer).__name__} has no module {path!r} ({what})")
    return m


def install_residual_hooks(layer: torch.nn.Module, state, layer_idx: int, ad) -> None:
    """Register forward (pre-)hooks for every deployed residual-stream site of this layer, where
    the family's declaration ``ad`` (:class:`.base.DecoderAdapter`) places them.

    Only sites that some deployed app uses get a hook (and an op in the graph). Order at one
    boundary: resid_post[L] then resid_pre[L+1]; inside a layer: attn_out, resid_mid, mlp_out.
    With ``fused_writes="norm"`` on a pair stream the sites that a fused residual add + RMSNorm
    consumes are hooked at that norm instead (:func:`_install_norm`): resid_post[L-1] and
    resid_pre[L] at this layer's input norm, resid_mid[L] at the ``resid_mid`` norm; resid_pre[0]
    and the last layer's resid_post keep their hooks (no such norm follows them inside a layer).
    Raises RuntimeError if a declared module is missing (a declaration that does not fit).
    """
    pair = ad.stream == "pair"
    at_norm = state.layout.deployment.fused_writes == "norm" and pair
    n1 = submodule(layer, ad.input_norm) if pair else None
    n2 = _module(layer, ad.resid_mid, "hook_resid_mid")
    n1_ok, n2_ok = at_norm and fusable_norm(n1), at_norm and fusable_norm(n2)
    pre_fn = functools.partial(_resid_pre if pair else _single_pre, where=ad.args)
    if n1_ok and layer_idx >= 1:
        a, b = state.site_id(layer_idx - 1, "hook_resid_post"), state.site_id(layer_idx, "hook_resid_pre")
        if a is not None or b is not None:
            _install_norm(n1, state, a, b)
    elif at_norm and layer_idx >= 1:  # the previous layer left its resid_post to this norm, which cannot host it
        a = state.site_id(layer_idx - 1, "hook_resid_post")
        if a is not None and a not in state.installed:
            key = key_buffer(layer, "hook_resid_post_prev")
            state.site_keys.add(layer, key, (a,))
            layer.register_forward_pre_hook(functools.partial(pre_fn, key, ((), 0)), with_kwargs=True)
            state.installed.add(a)
    if n2_ok:
        m = state.site_id(layer_idx, "hook_resid_mid")
        if m is not None:
            _install_norm(n2, state, m, None)

    def hook(name: str, module: torch.nn.Module, fn, pre: bool, with_kwargs: bool = False) -> None:
        s = state.site_id(layer_idx, name)
        if s is None or s in state.installed:
            return
        if name == "hook_resid_post" and n1_ok and layer_idx < state.layout.n_layers - 1:
            return  # the next layer's input norm hosts it
        fused = (state.site_fused_spec[s], state.site_fused_id[s])
        if fused[0]:
            _register_buffers(module, state)
        key = key_buffer(module, name)
        state.site_keys.add(module, key, (s,))
        f = functools.partial(fn, key, fused)
        if pre:
            module.register_forward_pre_hook(f, with_kwargs=with_kwargs)
        else:
            module.register_forward_hook(f)
        state.installed.add(s)

    hook("hook_resid_pre", layer, pre_fn, pre=True, with_kwargs=True)
    hook("hook_attn_out", _module(layer, ad.attn_out, "hook_attn_out"), _component_out, pre=False)
    hook("hook_resid_mid", n2, _resid_mid if pair else _single_mid, pre=True)
    hook("hook_mlp_out", _module(layer, ad.mlp_out, "hook_mlp_out"), _component_out, pre=False)
    hook("hook_resid_post", layer, _resid_post, pre=False)


def _router_hook(key: str, module, args, output):
    logits = output[0] if isinstance(output, tuple) else output
    torch.ops.vllm_xmix.hook_write_(logits, None, getattr(module, key), 0)
    return output


def install_router_hook(layer: torch.nn.Module, state, layer_idx: int, path: str) -> None:
    """``mlp.hook_router_logits`` of this layer, if deployed: a forward hook on the module at
    ``path`` whose output (first element) is the router logits ``[T, n_experts]``, before the
    softmax / top-k that vLLM's MoE op fuses; the write changes them in place, so routing follows.
    A layer without that module (a dense layer of a MoE model) installs nothing, and the
    self-check (``XmixState.verify_hooks_fired``) names the site."""
    from ..spec import ROUTER_HOOK

    site = state.site_id(layer_idx, ROUTER_HOOK)
    gate = submodule(layer, path)
    if site is not None and gate is not None:
        key = key_buffer(gate, ROUTER_HOOK)
        state.site_keys.add(gate, key, (site,))
        gate.register_forward_hook(functools.partial(_router_hook, key))
        state.installed.add(site)


def _note_tokens(module, args, output):
    input_ids = args[0]
    torch.ops.vllm_xmix.note_tokens_(output, input_ids)
    return output


def install_token_hook(model: torch.nn.Module, state, embed: str = "embed_tokens") -> None:
    """For token-conditioned writes: a forward hook on the model's token embedding records the
    step's token ids on the device (graph-safe; async scheduling puts sampled ids there)."""
    if not getattr(state, "has_token_cond", False):
        return
    emb = getattr(model, embed, None)
    if emb is None or not isinstance(emb, torch.nn.Module):
        return  # verify_hooks_fired reports it
    emb.register_forward_hook(_note_tokens)
    state.token_hook_installed = True
