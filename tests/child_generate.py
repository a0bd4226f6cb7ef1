"""Run one engine in a fresh process (plugin loading, spawn, compile cache are per process).

usage: python child_generate.py MODEL MODE CONFIG_JSON APPS_JSON OUT_JSON
Writes {"tokens1": first tokens, "tokens": 10 greedy tokens per prompt, "logprobs": their
logprobs} or {"error": "..."} to OUT_JSON.
"""

import json
import sys

if __name__ == "__main__":
    model, mode, cfg, apps, out = sys.argv[1:6]
    import os

    if os.environ.get("XMIX_TEST_BLOCK_PLUGIN") == "1":
        # simulate "vllm-xmix not installed" without touching any env var vLLM hashes into its
        # compile-cache key (VLLM_PLUGINS is one): register() becomes a no-op in this process
        import vllm_xmix.plugin

        vllm_xmix.plugin._REGISTERED = True
    try:
        from vllm import LLM, SamplingParams

        from conftest import PROMPTS

        kw = dict(model=model, dtype="float32", max_model_len=256, max_num_seqs=16, seed=0,
                  enforce_eager=(mode == "eager"))
        cfg = json.loads(cfg)
        if cfg:
            kw["additional_config"] = cfg
        llm = LLM(**kw)
        apps = json.loads(apps)
        extra = {"xmix": {"apps": apps}} if apps else None
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, extra_args=extra)
        tokens = [list(o.outputs[0].token_ids) for o in
                  llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, extra_args=extra, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        tokens10 = [list(o.outputs[0].token_ids) for o in outs]
        # each generated token's logprob (float32 values as Python floats: exact)
        logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        res = {"tokens1": tokens, "tokens": tokens10, "logprobs": logprobs}
    except Exception as e:  # report, the parent asserts on it
        res = {"error": f"{type(e).__name__}: {e}"}
    json.dump(res, open(out, "w"))
