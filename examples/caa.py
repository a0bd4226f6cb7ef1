"""Single-layer steering (CAA, Rimsky et al. 2024; SAKE, Scialanga et al. 2025) on the shipped
model: the code-minus-prose direction at layer 2, scaled per request.

    python examples/caa.py
"""

import _style as S
from vllm_xmix import deploy
from vllm_xmix.apps import single_layer_steering

if __name__ == "__main__":
    v = S.style_direction([2])[2]
    llm = S.engine(additional_config=deploy(single_layer_steering(v, layer=2, name="to_code")))
    for scale in (-1.0, 0.0, 0.5, 1.0):
        sel = [{"name": "to_code", "scale": scale}] if scale else None
        shares = S.style_of(llm, S.PROSE + S.CODE, sel)
        print(f"scale {scale:+.1f}: code share from prose prompts {sum(shares[:3]) / 3:4.0%}, "
              f"from code prompts {sum(shares[3:]) / 3:4.0%}")
