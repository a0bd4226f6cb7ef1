"""What the runtime and the engine checks read of a model's Hugging Face config."""

from __future__ import annotations


def text_config(hf_config):
    """The text model's config of ``hf_config`` (multimodal configs nest it), else the config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def n_experts(text_config) -> int | None:
    """Routed experts per MoE layer (the router logits' width), None for a dense model."""
    for k in ("num_local_experts", "num_experts", "n_routed_experts"):
        v = getattr(text_config, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
