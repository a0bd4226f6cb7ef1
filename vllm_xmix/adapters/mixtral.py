"""Mixtral (``MixtralForCausalLM``, MoE): vLLM's ``MixtralDecoderLayer``. The residual structure is
Llama's with ``block_sparse_moe`` in place of ``mlp``, so ``hook_mlp_out`` is the MoE output
(after the expert all-reduce). Router-logit hooks (``mlp.hook_router_logits``) are not yet here.
vLLM 0.26 runs Mixtral on the V1 model runner by default. Hook points: :mod:`._residual`.
"""

from __future__ import annotations

import torch

from ._residual import RESIDUAL_HOOKS, install_residual_hooks

ARCHITECTURES = ("MixtralForCausalLM",)
HOOKS = RESIDUAL_HOOKS


def layer_classes() -> tuple[type, ...]:
    from vllm.model_executor.models.mixtral import MixtralDecoderLayer

    return (MixtralDecoderLayer,)


def install(layer: torch.nn.Module, state, layer_idx: int) -> None:
    install_residual_hooks(layer, state, layer_idx, mlp="block_sparse_moe")
