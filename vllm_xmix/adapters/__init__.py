"""Per-architecture adapters: where each TransformerLens hook point lives in a vLLM model.

Each family's module declares its ``ADAPTER`` (:class:`.base.DecoderAdapter`): the HF
architecture names it serves, the vLLM decoder-layer and model classes (resolved lazily), the
TransformerLens hook names it can attach to and where they live in the layer.
``SUPPORTED_ARCHITECTURES`` is checked at engine start: an app deployed on any other architecture
is an error, never a silent no-op.
"""

from . import llama, mixtral, qwen3
from .base import DecoderAdapter

ADAPTERS: tuple[DecoderAdapter, ...] = (llama.ADAPTER, qwen3.ADAPTER, mixtral.ADAPTER)
SUPPORTED_ARCHITECTURES: dict[str, DecoderAdapter] = {a: ad for ad in ADAPTERS for a in ad.architectures}
