"""Directional ablation at every layer (Arditi et al. 2024) on the shipped model: removing the
style direction from the residual stream everywhere, which equals orthogonalising the weights
against it. Here the "refusal" direction is the code direction: ablated, code prompts lose what
made the model continue them as code.

    python examples/refusal_ablation.py
"""

import _style as S
from vllm_xmix import SamplingParams, deploy
from vllm_xmix.apps import refusal_ablation
from vllm_xmix.models import code_share

if __name__ == "__main__":
    r = S.style_direction([1])[1]
    llm = S.engine(additional_config=deploy(refusal_ablation(r, n_layers=4, name="ablate_code")))
    for sel in (None, ["ablate_code"]):
        shares = S.style_of(llm, S.CODE, sel)
        print(f"{'ablated' if sel else 'plain':8s} code share from code prompts {sum(shares) / 3:4.0%}")
    sp = SamplingParams(temperature=0, max_tokens=30, mi_apps=["ablate_code"])
    out = llm.generate(S.CODE[:1], sp, use_tqdm=False)[0]
    print(f"greedy, ablated, from {S.CODE[0]!r}: {S.show(out.outputs[0].text)} "
          f"(code share {code_share(out.outputs[0].text):.0%})")
