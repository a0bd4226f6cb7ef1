"""Every supported family in one table: where each hook point lives in its vLLM decoder layer
(:class:`.base.DecoderAdapter`; defaults: Llama's body, :mod:`._residual`). The odd ones say
what differs; ``docs/hooks.md`` has the same as a table of family x hook point x meaning.
"""

from __future__ import annotations

from .base import SINGLE, DecoderAdapter

_M = "vllm.model_executor.models."


def _qwen3_moe_layers(c) -> list[int]:
    """vLLM's ``Qwen3MoeDecoderLayer``: a sparse block unless the layer is in ``mlp_only_layers``
    or off the ``decoder_sparse_step`` grid."""
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return [L for L in range(c.num_hidden_layers) if L not in dense and (L + 1) % step == 0]


def _deepseek_v2_moe_layers(c) -> list[int]:
    """vLLM's ``DeepseekV2DecoderLayer``: a MoE block from ``first_k_dense_replace`` on, on the
    ``moe_layer_freq`` grid (routed experts configured); the first layers are dense."""
    if getattr(c, "n_routed_experts", None) is None:
        return []
    first = getattr(c, "first_k_dense_replace", 0) or 0
    freq = getattr(c, "moe_layer_freq", 1) or 1
    return [L for L in range(c.num_hidden_layers) if L >= first and L % freq == 0]


def _deepseek_v2_fp16(c, dtype) -> str | None:
    """vLLM's ``DeepseekV2DecoderLayer`` in float16 (against overflow) divides the attention
    output, layer 0's residual and the dense MLPs' output by ``routed_scaling_factor``, and its
    MoE runner leaves the factor off the routed experts and divides the shared experts' output by
    it: the stream it carries is the model's stream / factor, and a write at ``hook_attn_out``
    lands before the division."""
    f = getattr(c, "routed_scaling_factor", 1.0)
    if str(dtype) == "torch.float16" and f != 1.0:
        return (f"in float16 vLLM carries this model's residual stream divided by routed_scaling_factor {f} "
                "(its overflow guard), so hook values and writes would not mean what docs/hooks.md says; "
                "use bfloat16 or float32")
    return None


LLAMA = DecoderAdapter(
    # vLLM serves Phi-3 with Llama's model and layer classes (fused qkv / gate_up weights)
    ("LlamaForCausalLM", "Phi3ForCausalLM"), _M + "llama", "LlamaDecoderLayer", "LlamaModel")
MISTRAL = DecoderAdapter(("MistralForCausalLM",), _M + "mistral", "MistralDecoderLayer", "MistralModel")
QWEN2 = DecoderAdapter(("Qwen2ForCausalLM",), _M + "qwen2", "Qwen2DecoderLayer", "Qwen2Model")
QWEN3 = DecoderAdapter(("Qwen3ForCausalLM",), _M + "qwen3", "Qwen3DecoderLayer", "Qwen3Model")

GRANITE = DecoderAdapter(
    ("GraniteForCausalLM",), _M + "granite", "GraniteDecoderLayer", "GraniteModel",
    stream=SINGLE, args=(1, 1),
    meaning={
        "hook_resid_pre": "layer input; L=0: embeddings x embedding_multiplier",
        "hook_attn_out": "self_attn output (o_proj), before x residual_multiplier",
        "hook_resid_mid": "resid_pre + residual_multiplier x attn_out",
        "hook_mlp_out": "mlp output, before x residual_multiplier",
        "hook_resid_post": "resid_mid + residual_multiplier x mlp_out",
    })

MIXTRAL = DecoderAdapter(
    ("MixtralForCausalLM",), _M + "mixtral", "MixtralDecoderLayer", "MixtralModel",
    mlp_out="block_sparse_moe", router="block_sparse_moe.gate",
    meaning={"hook_mlp_out": "MoE output (block_sparse_moe)",
             "mlp.hook_router_logits": "block_sparse_moe.gate output, before softmax / top-k"})

QWEN3_MOE = DecoderAdapter(
    ("Qwen3MoeForCausalLM",), _M + "qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeModel",
    router="mlp.gate", router_layers=_qwen3_moe_layers, gate_in_experts="mlp.experts",
    meaning={"hook_mlp_out": "MoE output (mlp: the sparse block)",
             "mlp.hook_router_logits": "mlp.gate output, computed in the block's forward (taken out of "
                                       "FusedMoE), before softmax / top-k"})

GEMMA2 = DecoderAdapter(
    # sandwich norms: what the attention / MLP add to the stream is the output of the norm after them
    ("Gemma2ForCausalLM",), _M + "gemma2", "Gemma2DecoderLayer", "Gemma2Model",
    attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm",
    resid_mid="pre_feedforward_layernorm",
    meaning={"hook_resid_pre": "stream entering layer L; L=0: embeddings x sqrt(d_model)",
             "hook_attn_out": "post_attention_layernorm(self_attn output): what attention adds to the stream",
             "hook_resid_mid": "resid_pre + attn_out (the residual of pre_feedforward_layernorm)",
             "hook_mlp_out": "post_feedforward_layernorm(mlp output): what the MLP adds to the stream"})

GEMMA3 = DecoderAdapter(
    # Gemma 2's layer with q/k norms inside the attention: the same places
    ("Gemma3ForCausalLM",), _M + "gemma3", "Gemma3DecoderLayer", "Gemma3Model",
    attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm",
    resid_mid="pre_feedforward_layernorm", meaning=GEMMA2.meaning)

OLMO3 = DecoderAdapter(
    # OLMo 2's layer (vLLM 0.26 serves OLMo 2 itself through its Transformers backend, not this class)
    ("Olmo3ForCausalLM",), _M + "olmo3", "Olmo3DecoderLayer", "Olmo3Model",
    stream=SINGLE, args=(1, 1), attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm",
    resid_mid="mlp",
    meaning={"hook_attn_out": "post_attention_layernorm(self_attn output): what attention adds to the stream",
             "hook_resid_mid": "resid_pre + attn_out (the MLP's input: no pre-norm)",
             "hook_mlp_out": "post_feedforward_layernorm(mlp output): what the MLP adds to the stream"})

DEEPSEEK_V2 = DecoderAdapter(
    # Llama's pair body around MLA attention (the MLA form on GPU, its MHA form with
    # VLLM_MLA_DISABLE=1; both end in o_proj) and a MoE block whose gate is handed to FusedMoE
    # with the shared experts, as Qwen3-MoE's; the first first_k_dense_replace layers are dense
    ("DeepseekV2ForCausalLM",), _M + "deepseek_v2", "DeepseekV2DecoderLayer", "DeepseekV2Model",
    router="mlp.gate", router_layers=_deepseek_v2_moe_layers, gate_in_experts="mlp.experts",
    refuse=_deepseek_v2_fp16,
    meaning={"hook_attn_out": "self_attn output (MLA, o_proj)",
             "hook_mlp_out": "MoE output (mlp: routed experts + shared experts) or the dense MLP's",
             "mlp.hook_router_logits": "mlp.gate output, computed in the block's forward (taken out of "
                                       "FusedMoE), before softmax / top-k; MoE layers only"})

GPT_OSS = DecoderAdapter(
    # Llama's pair body (forward(hidden_states, positions, residual)); attention with sinks in
    # `attn`; the router is a linear layer the block calls itself before FusedMoE (as Mixtral's)
    ("GptOssForCausalLM",), _M + "gpt_oss", "TransformerBlock", "GptOssModel",
    args=(0, 2), attn_out="attn", router="mlp.router", embed="embedding",
    meaning={"hook_attn_out": "attn output (o_proj; attention with sinks)",
             "hook_mlp_out": "MoE output (mlp)",
             "mlp.hook_router_logits": "mlp.router output (with its bias), before softmax / top-k"})

ADAPTERS: tuple[DecoderAdapter, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GRANITE, MIXTRAL, QWEN3_MOE, GEMMA2, GEMMA3,
                                        OLMO3, DEEPSEEK_V2, GPT_OSS)
