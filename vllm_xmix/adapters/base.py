"""What an adapter declares: for one architecture family, which vLLM classes to hook and where
each hook point lives in its decoder layer (:class:`DecoderAdapter`). The declarations
themselves are in :mod:`.families`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..runtime.layout import RESIDUAL_HOOKS
from ..spec import ROUTER_HOOK
from ._residual import install_residual_hooks, install_router_hook, install_token_hook, submodule

PAIR = "pair"
"""vLLM's fused residual stream: the layer takes and returns ``(hidden_states, residual)`` and the
next fused add + RMSNorm adds them (Llama's body; the stream is their sum)."""
SINGLE = "single"
"""One tensor is the stream: the layer takes and returns ``hidden_states`` and adds its
sub-layers' outputs itself (Granite's multiplied residual, OLMo 2/3's post-norms)."""


def all_layers(text_config) -> range:
    """Every decoder layer (the default of :attr:`DecoderAdapter.router_layers`)."""
    return range(text_config.num_hidden_layers)


@dataclass(frozen=True)
class DecoderAdapter:
    """Where each TransformerLens hook point of one family lives in vLLM's decoder layer.

    Classes (resolved lazily, so importing the declaration imports no vLLM model):
    ``architectures``: the HF architecture names served; ``module``: the vLLM model module;
    ``layer_class`` / ``model_class``: its decoder-layer and model class names (exact types: a
    subclass gets its own declaration).

    The layer (attribute paths relative to the decoder layer, dotted for nested modules):

    - ``stream``: :data:`PAIR` or :data:`SINGLE`;
    - ``args``: positions of ``hidden_states`` and ``residual`` in the layer's ``forward``
      (``(positions, hidden_states, residual)`` by default);
    - ``attn_out``: the module whose output is ``hook_attn_out`` (what the attention adds to the
      stream: ``self_attn``, or the norm after it where the layer has one);
    - ``mlp_out``: likewise for ``hook_mlp_out`` (the MLP or MoE block, or the norm after it);
    - ``resid_mid``: :data:`PAIR`: the fused norm called as ``norm(h, residual)`` whose
      ``residual`` argument is ``resid_pre + attn_out``; :data:`SINGLE`: the first module that
      takes the stream after the attention as its input;
    - ``input_norm``: :data:`PAIR` only: the layer's first fused add + norm (hosts the writes of
      ``fused_writes="norm"`` when it is vLLM's plain ``RMSNorm``);
    - ``router``: the module whose output (first element) is the router logits ``[T, n_experts]``
      (``mlp.hook_router_logits``), None for dense families; ``router_layers(text_config)``:
      the layers that have it (dense layers of a MoE model do not);
    - ``gate_in_experts``: the ``FusedMoE`` that was handed the router as its ``gate`` and would
      call it itself, inside its opaque MoE op: on a layer with a deployed router hook the patch
      (``_vllm_compat/fused_moe.py``) takes the gate back out, so the MoE block computes the
      logits in its own ``forward`` (vLLM's branch for a runner without a gate) and the hook runs
      in the model's graph.
    - ``embed``: the model's token embedding (relative to the model class; token conditions
      record the step's token ids at its output);
    - ``meaning``: what a hook means where it differs from Llama's (``docs/hooks.md``'s table);
    - ``refuse``: ``refuse(text_config, dtype) -> str | None``: why this model in this dtype
      (a ``torch.dtype``) would not carry the stream the hooks describe (None: it does); an
      engine with apps is then refused at start with that reason.
    """

    architectures: tuple[str, ...]
    module: str
    layer_class: str
    model_class: str
    stream: str = PAIR
    args: tuple[int, int] = (1, 2)
    attn_out: str = "self_attn"
    mlp_out: str = "mlp"
    resid_mid: str = "post_attention_layernorm"
    input_norm: str = "input_layernorm"
    router: str | None = None
    router_layers: Callable[[object], range | list[int]] = all_layers
    gate_in_experts: str | None = None
    embed: str = "embed_tokens"
    meaning: dict[str, str] = field(default_factory=dict)
    refuse: Callable[[object, object], str | None] | None = None

    @property
    def hooks(self) -> tuple[str, ...]:
        """The TransformerLens hook names this family provides (a deployed hook outside them is
        refused at engine start)."""
        return RESIDUAL_HOOKS + ((ROUTER_HOOK,) if self.router else ())

    def layer_classes(self) -> tuple[type, ...]:
        """The vLLM decoder-layer classes whose construction installs the hooks."""
        return (getattr(importlib.import_module(self.module), self.layer_class),)

    def model_classes(self) -> tuple[type, ...]:
        """The vLLM model classes whose construction installs the model-level hooks."""
        return (getattr(importlib.import_module(self.module), self.model_class),)

    def install(self, layer: torch.nn.Module, state, layer_idx: int) -> None:
        """Register the hook-point forward hooks of one decoder layer (before torch.compile
        traces it): only the sites some deployed app uses."""
        install_residual_hooks(layer, state, layer_idx, self)
        if self.router is not None:
            install_router_hook(layer, state, layer_idx, self.router)

    def install_model(self, model: torch.nn.Module, state) -> None:
        """Model-level hooks (after the layers are built): the token embedding, for token
        conditions."""
        install_token_hook(model, state, self.embed)


__all__ = ["PAIR", "SINGLE", "DecoderAdapter", "all_layers", "submodule"]
