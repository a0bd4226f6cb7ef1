"""Mixtral (``MixtralForCausalLM``, MoE): vLLM's ``MixtralDecoderLayer``. The residual structure is
Llama's with ``block_sparse_moe`` in place of ``mlp``, so ``hook_mlp_out`` is the MoE output
(after the expert all-reduce). ``mlp.hook_router_logits`` is the gate's output ``[T, n_experts]``
before vLLM's fused softmax + top-k (inside the opaque MoE op), so a write there changes routing.
vLLM 0.26 runs Mixtral on the V1 model runner by default. Hook points: :mod:`._residual`.
"""

from __future__ import annotations

import functools

import torch

from ..runtime.layout import RESIDUAL_HOOKS
from ..spec import ROUTER_HOOK
from .base import DecoderAdapter


def _router_hook(site: int, module, args, output):
    logits = output[0] if isinstance(output, tuple) else output
    torch.ops.vllm_xmix.hook_write_(logits, None, site, 0)
    return output


def _install_router_hook(layer: torch.nn.Module, state, layer_idx: int) -> None:
    site = state.site_id(layer_idx, ROUTER_HOOK)
    if site is not None:
        layer.block_sparse_moe.gate.register_forward_hook(functools.partial(_router_hook, site))
        state.installed.add(site)


ADAPTER = DecoderAdapter(("MixtralForCausalLM",), "vllm.model_executor.models.mixtral", "MixtralDecoderLayer",
                         "MixtralModel", hooks=RESIDUAL_HOOKS + (ROUTER_HOOK,), mlp="block_sparse_moe",
                         extra_hooks=_install_router_hook)
