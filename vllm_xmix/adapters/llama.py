"""Llama family (``LlamaForCausalLM``): vLLM's ``LlamaDecoderLayer``.

Hook points and their meaning on vLLM's fused residual stream: :mod:`._residual`.
"""

from .base import DecoderAdapter

ADAPTER = DecoderAdapter(("LlamaForCausalLM",), "vllm.model_executor.models.llama", "LlamaDecoderLayer",
                         "LlamaModel")
