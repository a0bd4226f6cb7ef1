"""Multi-layer unconditional steering (Stickland et al. 2024): one vector added at several layers,
and a vector per layer from a file (a GGUF control vector, as repeng exports them for llama.cpp).

    python examples/multi_layer.py
"""

import os
import tempfile

import _style as S
from vllm_xmix import deploy
from vllm_xmix.apps import multi_layer_steering
from vllm_xmix.extract import save_vectors, steering_app

if __name__ == "__main__":
    dirs = S.style_direction([1, 2])
    path = os.path.join(tempfile.mkdtemp(), "to_code.gguf")
    save_vectors(path, {L: 0.5 * v for L, v in dirs.items()})  # a control vector file, direction.L per layer
    apps = [multi_layer_steering(0.5 * dirs[2], layers=[1, 2], name="same_vector"),
            steering_app("per_layer", path)]
    llm = S.engine(additional_config=deploy(*apps))
    for sel in (None, ["same_vector"], ["per_layer"], [{"name": "per_layer", "layers": [2]}]):
        print(f"{str(sel):<40} code share from prose prompts {sum(S.style_of(llm, S.PROSE, sel)) / 3:4.0%}")
