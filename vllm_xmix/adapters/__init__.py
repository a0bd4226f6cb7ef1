"""Per-architecture adapters: where each TransformerLens hook point lives in a vLLM model.

Each adapter module exposes ``ARCHITECTURES`` (HF architecture names it serves), ``HOOKS`` (the
TransformerLens hook names it can attach to), ``layer_classes()``
(the vLLM decoder-layer classes, resolved lazily), ``install(layer, state, layer_idx)``, and
``model_classes()`` / ``install_model(model, state)`` for model-level hooks (the token embedding).
``SUPPORTED_ARCHITECTURES`` is checked at engine start: an app deployed on any other architecture
is an error, never a silent no-op.
"""

from . import llama, mixtral, qwen3

ADAPTERS = (llama, qwen3, mixtral)
SUPPORTED_ARCHITECTURES: dict[str, object] = {a: m for m in ADAPTERS for a in m.ARCHITECTURES}
