"""A linear probe at one layer (Orgad et al. 2025 use such probes for truthfulness) on the shipped
model: a logistic probe for "this token is code", trained on captures, scored per token through
the read path on held-out text.

    python examples/probe.py
"""

import numpy as np

import _style as S
from vllm_xmix import SamplingParams, deploy
from vllm_xmix.apps import truthfulness_probe
from vllm_xmix.extract import capture_app, collect_activations, fit_probe

if __name__ == "__main__":
    llm = S.engine(enforce_eager=True, additional_config=deploy(capture_app([2])))
    acts = {(s, k): collect_activations(llm, S.TEXTS[s][k])[2] for s in ("code", "prose") for k in ("train", "held")}
    del llm
    p = fit_probe(acts[("code", "train")], acts[("prose", "train")], acts[("code", "held")], acts[("prose", "held")])
    print(f"probe: train accuracy {p.train_accuracy:.1%}, held-out {p.held_out_accuracy:.1%} ({p.n_held_out} tokens)")
    llm = S.engine(additional_config=deploy(truthfulness_probe(p.weight, p.bias, layer=2, name="is_code")))
    right = total = 0
    for style, label in (("code", 1), ("prose", 0)):
        for o in llm.generate(S.TEXTS[style]["held"], SamplingParams(max_tokens=1, mi_apps=["is_code"]),
                              use_tqdm=False):
            s = o.mi_results["is_code"]["probe"][1:len(o.prompt_token_ids)]
            right += int(((s > 0.5) == label).sum())
            total += len(s)
    print(f"through vLLM's read path: {right / total:.1%} of {total} held-out tokens classified by style")
    o = llm.generate(["And he said unto them,\ndef f(x):\n    return x"], SamplingParams(max_tokens=1, mi_apps=["is_code"]),
                     use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    print(" ".join(f"{tok.decode([t])!r}:{s:.2f}" for t, s in zip(o.prompt_token_ids[1:], o.mi_results["is_code"]["probe"][1:])))
    print("mean score:", float(np.mean(o.mi_results["is_code"]["probe"])))
