"""What an adapter declares: for one architecture family, which vLLM classes to hook and where
each hook point lives in its decoder layer (:class:`DecoderAdapter`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.layout import RESIDUAL_HOOKS
from ._residual import install_residual_hooks, install_token_hook


@dataclass(frozen=True)
class DecoderAdapter:
    """A family whose decoder layer has the ``(hidden_states, residual)`` body of vLLM's Llama
    (:mod:`._residual`), with its attention, MLP and second norm under the given attribute names.

    ``architectures``: the HF architecture names it serves; ``module``: the vLLM model module;
    ``layer_class`` / ``model_class``: the decoder-layer and model class names in it (resolved
    lazily, so importing the adapter imports no vLLM model); ``hooks``: the TransformerLens hook
    names it can attach to; ``extra_hooks(layer, state, layer_idx)``: hook points beyond the
    residual body (e.g. the MoE router logits)."""

    architectures: tuple[str, ...]
    module: str
    layer_class: str
    model_class: str
    hooks: tuple[str, ...] = RESIDUAL_HOOKS
    attn: str = "self_attn"
    mlp: str = "mlp"
    extra_hooks: Callable[[torch.nn.Module, object, int], None] | None = None

    def layer_classes(self) -> tuple[type, ...]:
        """The vLLM decoder-layer classes whose construction installs the hooks."""
        return (getattr(importlib.import_module(self.module), self.layer_class),)

    def model_classes(self) -> tuple[type, ...]:
        """The vLLM model classes whose construction installs the model-level hooks."""
        return (getattr(importlib.import_module(self.module), self.model_class),)

    def install(self, layer: torch.nn.Module, state, layer_idx: int) -> None:
        """Register the hook-point forward hooks of one decoder layer (before torch.compile
        traces it): only the sites some deployed app uses."""
        install_residual_hooks(layer, state, layer_idx, attn=self.attn, mlp=self.mlp)
        if self.extra_hooks is not None:
            self.extra_hooks(layer, state, layer_idx)

    def install_model(self, model: torch.nn.Module, state) -> None:
        """Model-level hooks (after the layers are built): the token embedding, for token
        conditions."""
        install_token_hook(model, state)
