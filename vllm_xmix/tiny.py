"""The embedded default model: tiny random-weight HF checkpoints built locally (no hub access).

``build_tiny_model("llama")`` writes (once, cached) a ``LlamaForCausalLM`` with random weights
and a byte-level BPE tokenizer trained locally on text that ships with Python, into
``$XMIX_CACHE`` (default ``~/.cache/vllm_xmix``). Sizes respect vLLM's CPU attention backend
(head_dim 32). ``initializer_range=0.2`` spreads the logits so greedy decoding is not decided by
near-ties (fp32 vLLM == fp32 HF token for token).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

_BASE = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=128, max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
             rms_norm_eps=1e-5)  # 2 heads of 32 where the config derives head_dim from d_model

TINY_SPECS = {
    "llama": dict(arch="LlamaForCausalLM", vocab_size=1024, hidden_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
                  max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
                  rms_norm_eps=1e-5, seed=0),
    "qwen3": dict(arch="Qwen3ForCausalLM", vocab_size=1024, hidden_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
                  max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, seed=0),
    "mixtral": dict(arch="MixtralForCausalLM", vocab_size=1024, hidden_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                    initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-5, seed=0),
    "mistral": dict(_BASE, arch="MistralForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    sliding_window=None, seed=1),
    "qwen2": dict(_BASE, arch="Qwen2ForCausalLM", rms_norm_eps=1e-6, seed=2),  # q/k/v projections with bias
    "phi3": dict(_BASE, arch="Phi3ForCausalLM", seed=3),  # fused qkv_proj and gate_up_proj
    # Granite's multipliers: embeddings x4, each sub-layer's output x0.5 into the stream, logits / 2
    "granite": dict(_BASE, arch="GraniteForCausalLM", embedding_multiplier=4.0, residual_multiplier=0.5,
                    attention_multiplier=1 / 32, logits_scaling=2.0, seed=4),
    "qwen3_moe": dict(_BASE, arch="Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, seed=5),
    # sandwich norms, sqrt(d_model) embedding scale, soft-capping, sliding window on every other layer
    "gemma2": dict(_BASE, arch="Gemma2ForCausalLM", head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"] * 2, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, tie_word_embeddings=True, rms_norm_eps=1e-6, seed=7),
    # Gemma 2's sandwich norms with q/k norms, a local rope base on the sliding layers (5 of 6 in
    # Gemma 3; 3 of 4 here); HF's config class for the text model is Gemma3TextConfig
    "gemma3": dict(_BASE, arch="Gemma3ForCausalLM", config="Gemma3TextConfig", head_dim=32, query_pre_attn_scalar=32,
                   sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                   tie_word_embeddings=True, rms_norm_eps=1e-6, seed=10,
                   initializer_range=0.05),  # at 0.2 its greedy text repeats one token: some writes changed nothing
    # OLMo 2's post-norm layer (norms on the sub-layers' outputs), sliding window on three layers of four
    "olmo3": dict(_BASE, arch="Olmo3ForCausalLM", sliding_window=8,
                  layer_types=["sliding_attention"] * 3 + ["full_attention"], seed=8),
    # DeepSeek-V2-Lite's shape: MLA without a q LoRA (q_proj; kv compressed to kv_lora_rank, a
    # shared rope key), softmax top-k over routed experts plus shared experts, the first layer
    # dense. One attention head: vLLM 0.26's CPU rotary kernel takes a 3-D query [T, H, rope] as
    # T x H tokens of one head, so with H > 1 the MHA form (VLLM_MLA_DISABLE=1, the only one on
    # CPU) rotates head h of token t by position t * H + h (docs/hooks.md). rms_norm_eps 1e-6:
    # HF's kv_a_layernorm always uses 1e-6, vLLM's the config's (V2-Lite's is 1e-6)
    "deepseek_v2": dict(_BASE, arch="DeepseekV2ForCausalLM", num_attention_heads=1, num_key_value_heads=1,
                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
                        first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
                        routed_scaling_factor=1.0, rms_norm_eps=1e-6, seed=11),
    # OLMo 2 (vLLM 0.26 serves it through its Transformers backend): the oracle for an OLMo 2
    # checkpoint whose config.json is rewritten as OLMo 3's (docs/hooks.md), served by vLLM's OLMo 3 classes
    "olmo2": dict(_BASE, arch="Olmo2ForCausalLM", seed=13),
    # GPT-OSS: attention with sinks, sliding window on even layers, a router with a bias, clamped
    # SwiGLU experts. Sinks rounded to bfloat16 values (``bf16_exact``): vLLM 0.26's CPU attention
    # kernel takes sinks only as bfloat16, so a float32 engine can be handed the same values in bf16
    "gpt_oss": dict(_BASE, arch="GptOssForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=131072,
                    bf16_exact=["sinks"], seed=12),
}
_VERSION = 2  # bump to rebuild cached models

#: the tiny models' chat template (so chat completions work out of the box): one "role: content"
#: line per message, then "assistant:" for the reply
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def cache_dir() -> Path:
    return Path(os.environ.get("XMIX_CACHE", Path.home() / ".cache" / "vllm_xmix"))


def _corpus() -> list[str]:
    texts = []
    lic = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"
    if lic.exists():
        texts += [ln for ln in lic.read_text(errors="ignore").splitlines() if ln.strip()]
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (the Zen of Python, rot13 in the module source)

    texts += codecs.decode(sys.modules["this"].s, "rot13").splitlines()
    rng = random.Random(0)
    subj = ["the model", "a steering vector", "the residual stream", "each layer", "the probe", "our server",
            "a request", "the batch", "this token", "the cat", "my friend", "the weather"]
    verb = ["reads", "writes", "adds", "changes", "keeps", "moves", "sees", "likes", "returns", "computes"]
    obj = ["the answer", "a direction", "every token", "the output", "some numbers", "a happy story",
           "the graph", "new words", "the cache", "a sad poem"]
    for _ in range(600):
        texts.append(f"{rng.choice(subj).capitalize()} {rng.choice(verb)} {rng.choice(obj)}.")
    return texts


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                  pad_token="<|pad|>")
    out.chat_template = CHAT_TEMPLATE
    return out


def build_tiny_model(arch: str = "llama", root: str | os.PathLike | None = None) -> str:
    """Build (or reuse) a tiny random-weight model (``arch``: a key of ``TINY_SPECS``); returns its directory.

    Raises:
        KeyError: unknown ``arch`` (known: ``TINY_SPECS``).
    """
    spec = dict(TINY_SPECS[arch])
    key = hashlib.sha256(json.dumps([spec, _VERSION], sort_keys=True).encode()).hexdigest()[:10]
    out = Path(root) if root is not None else cache_dir() / f"tiny-{arch}-{key}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)
    import torch
    import transformers

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    seed = spec.pop("seed")
    arch_name = spec.pop("arch")
    bf16_exact = set(spec.pop("bf16_exact", ()))
    model_cls = getattr(transformers, arch_name)
    config_cls = getattr(transformers, spec.pop("config", None) or arch_name.replace("ForCausalLM", "Config"))
    tokenizer = _train_tokenizer(min(spec["vocab_size"], 1000))
    cfg = config_cls(**spec, bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="float32")
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # parameters whose values must be exact in bfloat16
            if name.rsplit(".", 1)[-1] in bf16_exact:
                p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # a concurrent builder won
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return str(out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] not in TINY_SPECS:
        sys.exit(f"usage: python -m vllm_xmix.tiny [{'|'.join(TINY_SPECS)}]: builds (once) and prints the "
                 "directory of a tiny random-weight model of that architecture (llama by default)")
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "llama"))
