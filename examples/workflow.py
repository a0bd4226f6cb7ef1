"""The vector and probe workflow on vLLM, end to end, on the shipped model:
capture -> extract (difference of means, PCA of paired differences, a logistic probe) -> save
(safetensors and a GGUF control vector) -> load -> deploy -> measure.

    python examples/workflow.py [OUT_DIR]
"""

import os
import sys
import tempfile

import numpy as np

import _style as S
from vllm_xmix import deploy
from vllm_xmix.extract import (capture_app, collect_activations, diff_of_means, fit_probe, load_vectors,
                               pca_of_differences, save_vectors, steering_app)

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="xmix-workflow-")
    os.makedirs(out, exist_ok=True)
    layers = [1, 2, 3]
    # 1. capture: the residual stream of every excerpt, per layer, through vLLM
    llm = S.engine(enforce_eager=True, additional_config=deploy(capture_app(layers)))
    acts = {(s, k): collect_activations(llm, S.TEXTS[s][k]) for s in ("code", "prose") for k in ("train", "held")}
    del llm
    # 2. extract
    caa = diff_of_means(acts[("code", "train")], acts[("prose", "train")])
    means = {s: {L: np.stack([a.mean(0) for a in acts[(s, "train")][L]]) for L in layers} for s in ("code", "prose")}
    # excerpt pairs (one code and one prose mean each): repeng's centred pca_diff, and uncentred
    pca = pca_of_differences(means["code"], means["prose"])
    raw = pca_of_differences(means["code"], means["prose"], center=False)
    for L in layers:
        probe = fit_probe(acts[("code", "train")][L], acts[("prose", "train")][L],
                          acts[("code", "held")][L], acts[("prose", "held")][L])
        cos = float(caa[L] @ pca[L] / np.linalg.norm(caa[L]))
        cos_raw = float(caa[L] @ raw[L] / np.linalg.norm(caa[L]))
        print(f"layer {L}: |CAA| {np.linalg.norm(caa[L]):5.1f}, cos(CAA, PCA centred / uncentred) {cos:+.2f} / "
              f"{cos_raw:+.2f}, probe held-out "
              f"accuracy {probe.held_out_accuracy:.1%}")
    # 3. save, in the project's safetensors layout and as a llama.cpp / repeng control vector
    save_vectors(os.path.join(out, "to_code.safetensors"), caa, metadata={"model": "two_style"})
    save_vectors(os.path.join(out, "to_code.gguf"), {L: v / len(layers) for L, v in caa.items()})
    print(f"saved {sorted(os.listdir(out))} in {out}")
    # 4. load and deploy: one app per file, each layer its own vector
    gguf = load_vectors(os.path.join(out, "to_code.gguf"))
    llm = S.engine(additional_config=deploy(steering_app("caa_L2", os.path.join(out, "to_code.safetensors"), layers=[2]),
                                            steering_app("control_vector", os.path.join(out, "to_code.gguf"))))
    print(f"control vector layers {sorted(gguf)}")
    # 5. measure: the style of continuations from Bible prompts
    for sel in (None, ["caa_L2"], ["control_vector"]):
        print(f"{str(sel):<22} code share from prose prompts {sum(S.style_of(llm, S.PROSE, sel)) / 3:4.0%}")
