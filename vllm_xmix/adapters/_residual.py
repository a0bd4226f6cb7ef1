"""Hook points of a pre-norm decoder layer on vLLM's fused residual stream.

Llama, Qwen2/Qwen3 and Mixtral layers in vLLM 0.26 share one body::

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
hook_attn_out      attention output (after o_proj)        ``self_attn`` output
hook_resid_mid     resid_pre + attn_out                   ``residual`` argument of
                                                          ``post_attention_layernorm``
hook_mlp_out       MLP / MoE output                       ``mlp`` output
hook_resid_post    resid_mid + mlp_out                    ``residual`` output of layer L
=================  =====================================  =====================================

For ``add`` a write at hook_attn_out and one at hook_resid_mid change the stream identically
(likewise mlp_out and resid_post, and resid_post[L] and resid_pre[L+1]); they differ for reads
and for projections (ablate, clamp), which see the hook's whole value (``hidden + residual`` for
the ``hook_resid_*`` hooks; the op receives the other half as ``other``).
"""

from __future__ import annotations

import functools

import torch

RESIDUAL_HOOKS = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")


def _write(t: torch.Tensor, other: torch.Tensor | None, site: int) -> None:
    """``t``: the tensor the write lands on; ``other``: the rest of the hook's value (or None)."""
    torch.ops.vllm_xmix.hook_write_(t, other, site)


def _resid_pre(site: int, module, args, kwargs):
    if len(args) >= 3:
        hidden_states, residual = args[1], args[2]
    else:
        hidden_states = args[1] if len(args) >= 2 else kwargs["hidden_states"]
        residual = kwargs.get("residual")
    if residual is None:  # layer 0: the stream is the embeddings
        _write(hidden_states, None, site)
    else:
        _write(residual, hidden_states, site)
    return None  # arguments mutated in place


def _component_out(site: int, module, args, output):
    _write(output, None, site)
    return output


def _resid_mid(site: int, module, args):
    # post_attention_layernorm(hidden_states=attn_out, residual=resid_pre)
    _write(args[1], args[0], site)
    return None


def _resid_post(site: int, module, args, output):
    hidden_states, residual = output
    _write(residual, hidden_states, site)
    return hidden_states, residual


def install_residual_hooks(layer: torch.nn.Module, state, layer_idx: int, *, attn: str = "self_attn",
                           mlp: str = "mlp", norm2: str = "post_attention_layernorm") -> None:
    """Register forward (pre-)hooks for every deployed residual-stream site of this layer.

    Only sites that some deployed app uses get a hook (and an op in the graph). Order at one
    boundary: resid_post[L] then resid_pre[L+1]; inside a layer: attn_out, resid_mid, mlp_out.
    """
    sid = functools.partial(state.site_id, layer_idx)
    if (s := sid("hook_resid_pre")) is not None:
        layer.register_forward_pre_hook(functools.partial(_resid_pre, s), with_kwargs=True)
        state.installed.add(s)
    if (s := sid("hook_attn_out")) is not None:
        getattr(layer, attn).register_forward_hook(functools.partial(_component_out, s))
        state.installed.add(s)
    if (s := sid("hook_resid_mid")) is not None:
        getattr(layer, norm2).register_forward_pre_hook(functools.partial(_resid_mid, s))
        state.installed.add(s)
    if (s := sid("hook_mlp_out")) is not None:
        getattr(layer, mlp).register_forward_hook(functools.partial(_component_out, s))
        state.installed.add(s)
    if (s := sid("hook_resid_post")) is not None:
        layer.register_forward_hook(functools.partial(_resid_post, s))
        state.installed.add(s)


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
