"""CAST, conditional activation steering (Lee et al. 2025) on the shipped model: if the prompt
reads as code (its mean cosine with the code direction at layer 1 passes a threshold), steer
the generation away from code at layer 2; prose prompts are left alone.

    python examples/cast.py
"""

import numpy as np

import _style as S
from vllm_xmix import SamplingParams, deploy
from vllm_xmix.apps import cast

if __name__ == "__main__":
    d = S.style_direction([1, 2])
    c = d[1] / np.linalg.norm(d[1])
    app = cast(c, condition_layer=1, threshold=0.0, vector=-d[2], layers=[2], report=True, name="cast")
    llm = S.engine(additional_config=deploy(app))
    prompts = [t[:100] for t in S.TEXTS["code"]["held"][:3] + S.TEXTS["prose"]["held"][:3]]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, mi_apps=["cast"])
    for p, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
        sim = float(o.mi_results["cast"]["similarity"][: len(o.prompt_token_ids)].mean())
        print(f"{S.show(p, 40):<40} mean cos {sim:+.3f} -> {'steered' if sim > 0 else 'left alone':10s} "
              f"{S.show(o.outputs[0].text, 40)}")
