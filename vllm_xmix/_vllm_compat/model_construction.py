"""Model construction: the ``__init__`` of each adapter's decoder-layer and model classes
(exact type only: EAGLE/MTP subclasses are left alone) is wrapped so that the adapter installs
its hooks at construction, before Dynamo traces the model; the first layer built creates the
model instance's runtime state (:func:`vllm_xmix.runtime.get_or_create_state`). A family whose
MoE block hands its router to ``FusedMoE`` gets the gate back out on layers with a deployed router
hook (:func:`.fused_moe.take_gate_out`) before the hooks are installed."""

from __future__ import annotations

import functools
import inspect

from ..runtime import get_or_create_state, get_state_from_config
from .core import mark


def _init_args(sig, self, args, kwargs):
    """(prefix, vllm_config) of a model-layer constructor call (vllm_config from the current
    config context when the class takes the pieces, e.g. Qwen3DecoderLayer(config, ...))."""
    bound = sig.bind_partial(self, *args, **kwargs).arguments
    vllm_config = bound.get("vllm_config")
    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    return bound.get("prefix", ""), vllm_config


def _patch_init(cls, after) -> None:
    """Wrap ``cls.__init__`` (exact type only: subclasses such as EAGLE/MTP layers are left
    alone) to call ``after(self, prefix, vllm_config)`` once the module is built."""

    def wrap(orig):
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if type(self) is cls:
                after(self, *_init_args(sig, self, args, kwargs))

        return __init__

    mark(f"{cls.__name__}.__init__", cls, "__init__", wrap)


def patch_layer_classes() -> None:
    from ..adapters import ADAPTERS
    from ..adapters.base import submodule
    from ..spec import ROUTER_HOOK
    from .fused_moe import take_gate_out
    from .versions import table

    unserved = table().unserved_architectures
    for adapter in ADAPTERS:
        if all(a in unserved for a in adapter.architectures):
            continue  # this vLLM serves them with other classes (refused at engine configuration)

        def layer_built(layer, prefix, vllm_config, adapter=adapter):
            state = get_or_create_state(vllm_config, layer)
            if state is not None:
                from vllm.model_executor.models.utils import extract_layer_index

                idx = extract_layer_index(prefix)
                if adapter.gate_in_experts and state.site_id(idx, ROUTER_HOOK) is not None:
                    experts = submodule(layer, adapter.gate_in_experts)
                    if experts is not None:  # (a dense layer: no router, the self-check names the site)
                        take_gate_out(experts)
                adapter.install(layer, state, idx)

        def model_built(model, prefix, vllm_config, adapter=adapter):
            state = get_state_from_config(vllm_config)  # created by the model's first layer
            if state is not None:
                adapter.install_model(model, state)

        for cls in adapter.layer_classes():
            _patch_init(cls, layer_built)
        for cls in adapter.model_classes():
            _patch_init(cls, model_built)
