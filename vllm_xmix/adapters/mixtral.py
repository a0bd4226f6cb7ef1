"""Mixtral (``MixtralForCausalLM``, MoE): vLLM's ``MixtralDecoderLayer``. The residual structure is
Llama's with ``block_sparse_moe`` in place of ``mlp``, so ``hook_mlp_out`` is the MoE output
(after the expert all-reduce). ``mlp.hook_router_logits`` is the gate's output ``[T, n_experts]``
before vLLM's fused softmax + top-k (inside the opaque MoE op), so a write there changes routing.
vLLM 0.26 runs Mixtral on the V1 model runner by default. Hook points: :mod:`._residual`.
"""

from __future__ import annotations

import functools

import torch

from ._residual import RESIDUAL_HOOKS, install_residual_hooks, install_token_hook

ARCHITECTURES = ("MixtralForCausalLM",)
HOOKS = RESIDUAL_HOOKS + ("mlp.hook_router_logits",)


def layer_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.mixtral import MixtralDecoderLayer

    return (MixtralDecoderLayer,)


def _router_hook(site: int, module, args, output):
    logits = output[0] if isinstance(output, tuple) else output
    torch.ops.vllm_xmix.hook_write_(logits, None, site, 0)
    return output


def install(layer: torch.nn.Module, state, layer_idx: int) -> None:
    install_residual_hooks(layer, state, layer_idx, mlp="block_sparse_moe")
    site = state.site_id(layer_idx, "mlp.hook_router_logits")
    if site is not None:
        layer.block_sparse_moe.gate.register_forward_hook(functools.partial(_router_hook, site))
        state.installed.add(site)


def model_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.mixtral import MixtralModel

    return (MixtralModel,)


def install_model(model: torch.nn.Module, state) -> None:
    """Model-level hooks (after the layers are built): the token embedding, for token conditions."""
    install_token_hook(model, state)
