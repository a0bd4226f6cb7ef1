"""Qwen3 dense (``Qwen3ForCausalLM``): vLLM's ``Qwen3DecoderLayer`` (q/k RMSNorm inside attention;
the residual structure is Llama's). Hook points: :mod:`._residual`.
"""

from .base import DecoderAdapter

ADAPTER = DecoderAdapter(("Qwen3ForCausalLM",), "vllm.model_executor.models.qwen3", "Qwen3DecoderLayer",
                         "Qwen3Model")
