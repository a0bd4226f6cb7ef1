"""Qwen3 dense (``Qwen3ForCausalLM``): vLLM's ``Qwen3DecoderLayer`` (q/k RMSNorm inside attention;
the residual structure is Llama's). Hook points: :mod:`._residual`.
"""

from __future__ import annotations

import torch

from ._residual import RESIDUAL_HOOKS, install_residual_hooks, install_token_hook

ARCHITECTURES = ("Qwen3ForCausalLM",)
HOOKS = RESIDUAL_HOOKS


def layer_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer

    return (Qwen3DecoderLayer,)


def install(layer: torch.nn.Module, state, layer_idx: int) -> None:
    install_residual_hooks(layer, state, layer_idx)


def model_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.qwen3 import Qwen3Model

    return (Qwen3Model,)


def install_model(model: torch.nn.Module, state) -> None:
    """Model-level hooks (after the layers are built): the token embedding, for token conditions."""
    install_token_hook(model, state)
