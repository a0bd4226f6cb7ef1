"""Llama family (``LlamaForCausalLM``): vLLM's ``LlamaDecoderLayer``.

Hook points and their meaning on vLLM's fused residual stream: :mod:`._residual`.
"""

from __future__ import annotations

import torch

from ._residual import RESIDUAL_HOOKS, install_residual_hooks, install_token_hook

ARCHITECTURES = ("LlamaForCausalLM",)
HOOKS = RESIDUAL_HOOKS


def layer_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.llama import LlamaDecoderLayer

    return (LlamaDecoderLayer,)


def install(layer: torch.nn.Module, state, layer_idx: int) -> None:
    """Register the hook-point forward hooks of one decoder layer (before torch.compile traces)."""
    install_residual_hooks(layer, state, layer_idx)


def model_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.llama import LlamaModel

    return (LlamaModel,)


def install_model(model: torch.nn.Module, state) -> None:
    """Model-level hooks (after the layers are built): the token embedding, for token conditions."""
    install_token_hook(model, state)
