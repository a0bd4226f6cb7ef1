"""Per-architecture adapters: where each TransformerLens hook point lives in a vLLM model.

:mod:`.families` declares every supported family (:class:`.base.DecoderAdapter`): the HF
architecture names it serves, the vLLM decoder-layer and model classes (resolved lazily), and
where each hook point lives in the layer. ``SUPPORTED_ARCHITECTURES`` is checked at engine start:
an app deployed on any other architecture is an error, never a silent no-op.
"""

from .base import DecoderAdapter
from .families import ADAPTERS

SUPPORTED_ARCHITECTURES: dict[str, DecoderAdapter] = {a: ad for ad in ADAPTERS for a in ad.architectures}

__all__ = ["ADAPTERS", "SUPPORTED_ARCHITECTURES", "DecoderAdapter"]
