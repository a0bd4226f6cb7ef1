"""Compile the tiny Llama test model (4 layers, d_model 64, fp32) on CPU, without the plugin
(`plain`) or with the benchmark deployment (`xmix`: common.serving_apps, fused_writes="norm"),
and generate 4 tokens; with TORCH_LOGS=output_code the log holds Inductor's output code. Run from the repository root:

    TORCH_LOGS=output_code VLLM_DISABLE_COMPILE_CACHE=1 python compile_one.py plain|xmix 2> code.log
"""
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
mode = sys.argv[1]
if mode == "plain":
    import vllm_xmix.plugin
    vllm_xmix.plugin._REGISTERED = True
from vllm_xmix.tiny import build_tiny_model
from benchmarks.xmix_bench import common
m = build_tiny_model("llama", root=os.path.join(tempfile.mkdtemp(), "tiny-llama"))
from vllm import LLM, SamplingParams
kw = dict(model=m, dtype="float32", max_model_len=256, max_num_seqs=16, seed=0)
if mode != "plain":
    from vllm_xmix import deploy
    cfg = common.load_config(m)
    apps = common.serving_apps(cfg)
    kw["additional_config"] = deploy(*apps, fused_writes="norm")
llm = LLM(**kw)
o = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("TOKENS", o[0].outputs[0].token_ids)
