"""SEAL, token-triggered steering (Chen et al. 2025) on the shipped model: add the code direction
only where the current token is a newline, in generated text. Nothing changes before the first
generated newline; after it, the verses turn into code.

    python examples/seal.py
"""

import _style as S
from vllm_xmix import SamplingParams, deploy
from vllm_xmix.apps import seal

if __name__ == "__main__":
    v = S.style_direction([2])[2]
    llm = S.engine(enforce_eager=True)
    tok = llm.get_tokenizer()
    newline = [i for i in range(len(tok)) if "\n" in tok.decode([i])]
    del llm
    llm = S.engine(additional_config=deploy(seal(v, newline, layers=[2], scale=8.0, name="seal")))
    prompt = S.TEXTS["prose"]["held"][0][:120]
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                                          mi_apps=["seal"])], use_tqdm=False)
    off, on = (list(o.outputs[0].token_ids) for o in outs)
    first = next((j for j, t in enumerate(off) if t in set(newline)), None)
    same = next((j for j, (a, b) in enumerate(zip(off, on)) if a != b), len(off))
    print(f"prompt: {S.show(prompt)}")
    print(f"off: {S.show(outs[0].outputs[0].text, 200)}")
    print(f"on:  {S.show(outs[1].outputs[0].text, 200)}")
    print(f"first generated newline at token {first}; first difference at token {same} (after the trigger was fed back)")
