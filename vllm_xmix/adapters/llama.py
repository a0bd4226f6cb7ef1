"""Llama family (``LlamaForCausalLM``): vLLM's ``LlamaDecoderLayer``.

vLLM's layer returns ``(hidden_states, residual)``; the residual stream after layer L
(TransformerLens ``blocks.{L}.hook_resid_post``) is their sum, and the next layer's fused
add+RMSNorm consumes both. A write at ``hook_resid_post`` therefore adds to ``residual`` (output
``[1]``): layer L+1 (or the final norm) sees ``hidden + residual + delta``, exactly the HF
semantics of a forward hook returning ``output + delta`` on ``model.layers[L]``.
"""

from __future__ import annotations

import functools

import torch

ARCHITECTURES = ("LlamaForCausalLM",)


def layer_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.llama import LlamaDecoderLayer

    return (LlamaDecoderLayer,)


def _resid_post_hook(site: int, module, args, output):
    hidden_states, residual = output
    torch.ops.vllm_xmix.hook_write_(residual, site)
    return hidden_states, residual


def install(layer: torch.nn.Module, state, layer_idx: int) -> None:
    """Register the hook-point forward hooks of one decoder layer (before torch.compile traces)."""
    site = state.site_id(layer_idx, "hook_resid_post")
    if site is not None:
        layer.register_forward_hook(functools.partial(_resid_post_hook, site))
        state.installed.add(site)
