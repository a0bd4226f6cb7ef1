"""vllm_xmix.apps against their HF references on random-weight models (CPU, real vLLM, fp32).

Refusal-direction ablation (Arditi et al. 2024) must equal the paper's weight orthogonalisation:
an HF model whose embedding, attention-output and MLP-down weights were orthogonalised against r,
decoded greedily, gives the tokens the ablation app gives in vLLM (Llama, Qwen3). Single- and
multi-layer steering, the probe, SEAL and CAST equal HF forward hooks on Llama, Qwen3 and
Mixtral; SteerMoE equals HF with the bias on Mixtral's router logits. Bad constructor input is
refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import PROMPTS, close_llm, make_llm

pytestmark = pytest.mark.one_version  # runs on the primary vLLM only (CONTRIBUTING.md, Running the tests)

N_NEW = 8


def orthogonalised_hf(model_dir: str, r: np.ndarray):
    """The HF model with every matrix that writes to the residual stream orthogonalised against
    ``r`` (Arditi et al. 2024, section 4.1): ``W_E <- W_E - (W_E r) r^T`` for the token
    embedding, ``W <- W - r (r^T W)`` for each attention ``o_proj`` and MLP ``down_proj``."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rt = torch.from_numpy(r / np.linalg.norm(r)).float()
    with torch.no_grad():
        E = m.model.embed_tokens.weight
        tied = m.get_output_embeddings() is not None and m.get_output_embeddings().weight is E
        if not tied:  # the unembedding reads the stream, it does not write it: left as it is
            m.lm_head.weight.data = m.lm_head.weight.data.clone()
        E -= torch.outer(E @ rt, rt)
        for layer in m.model.layers:
            for W in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                W -= torch.outer(rt, rt @ W)
    return m


@torch.no_grad()
def greedy(m, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_refusal_ablation_equals_weight_orthogonalisation(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from vllm_xmix import SamplingParams, deploy
    from vllm_xmix.apps import refusal_ablation
    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model(arch, root=tmp_path / arch)
    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    # a direction the stream really has: the embedding of a prompt token (a random direction in a
    # random model would change too few tokens for the comparison to mean anything)
    r = plain.model.embed_tokens.weight[PROMPTS[0][1]].detach().numpy().astype(np.float32)
    n_layers = plain.config.num_hidden_layers
    orth = orthogonalised_hf(model, r)
    want = [greedy(orth, p, N_NEW) for p in PROMPTS]
    base = [greedy(plain, p, N_NEW) for p in PROMPTS]
    assert want != base, "the direction changes nothing: the comparison would not test the ablation"

    llm = make_llm(model, "eager", additional_config=deploy(refusal_ablation(r, n_layers, name="refusal")))
    try:
        on = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, mi_apps=["refusal"])
        off = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 2, [on] * len(PROMPTS) + [off] * len(PROMPTS),
                            use_tqdm=False)
    finally:
        close_llm(llm)
    got_on = [list(o.outputs[0].token_ids) for o in outs[: len(PROMPTS)]]
    got_off = [list(o.outputs[0].token_ids) for o in outs[len(PROMPTS):]]
    assert got_on == want
    assert got_off == base


def test_app_constructors_refuse_bad_input():
    from vllm_xmix import XmixSpecError
    from vllm_xmix.apps import cast, multi_layer_steering, refusal_ablation, seal, single_layer_steering, steer_moe

    v = np.ones(8, dtype=np.float32)
    with pytest.raises(XmixSpecError, match="n_layers"):
        refusal_ablation(v, 0)
    with pytest.raises(XmixSpecError, match="no trigger_tokens given"):
        seal(v, [], [1])
    with pytest.raises(XmixSpecError, match="no layers"):
        multi_layer_steering(v, [])
    with pytest.raises(XmixSpecError, match="op"):
        cast(v, 1, 0.0, v, [2], op="!=").to_spec()
    with pytest.raises(XmixSpecError, match=r"outside 0\.\.7"):
        steer_moe(8, deactivate=[8])
    with pytest.raises(XmixSpecError, match="both"):
        steer_moe(8, deactivate=[1], activate=[1])
    with pytest.raises(XmixSpecError, match="name experts"):
        steer_moe(8)
    with pytest.raises(XmixSpecError, match="deactivate must be a list of integers, got str"):
        steer_moe(8, deactivate="12")  # never read as experts 1 and 2
    with pytest.raises(XmixSpecError, match="layer must be an integer, got bool"):
        single_layer_steering(v, True)
    with pytest.raises(XmixSpecError, match="layer must be an integer, got float"):
        single_layer_steering(v, 1.9)
    with pytest.raises(XmixSpecError, match="generated_only must be True or False"):
        seal(v, [1], [1], generated_only="no")
    with pytest.raises(XmixSpecError, match=r"outside \[-1, 1\]"):
        cast(v, 1, 5.0, v, [2])
    with pytest.raises(XmixSpecError, match="trigger_tokens must be a list of integers, got int"):
        seal(v, 5, [1])
    spec = steer_moe(8, deactivate=[0], activate=[3], boost=5.0).to_spec()
    vec = spec.ops[0].vector
    assert vec[0] == -np.inf and vec[3] == 5.0 and vec[1] == 0.0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_steering_and_probe_apps_equal_hf(arch, tmp_path):
    """single_layer_steering + multi_layer_steering on together, and truthfulness_probe, against
    HF with plain forward hooks, on each architecture."""
    from conftest import HFOracle

    from vllm_xmix import SamplingParams, deploy
    from vllm_xmix.apps import multi_layer_steering, single_layer_steering, truthfulness_probe
    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model(arch, root=tmp_path / arch)
    hf = HFOracle(model)
    d = hf.model.config.hidden_size
    rng = np.random.default_rng(5)
    v1, v2, w = (rng.standard_normal(d).astype(np.float32) for _ in range(3))
    v1 *= 4 / np.sqrt((v1 ** 2).mean())
    v2 *= 2 / np.sqrt((v2 ** 2).mean())
    w /= np.linalg.norm(w)
    apps = [single_layer_steering(v1, 1, name="one"), multi_layer_steering(v2, [0, 2], name="multi"),
            truthfulness_probe(w, 0.25, 2, name="probe")]
    llm = make_llm(model, "eager", additional_config=deploy(*apps))
    try:
        sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, mi_apps=["one", "multi", "probe"])
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    finally:
        close_llm(llm)
    deltas = {1: v1, 0: v2, 2: v2}
    for p, o in zip(PROMPTS, outs):
        toks = list(o.outputs[0].token_ids)
        assert toks == hf.greedy(p, N_NEW, deltas=deltas)
        x = hf.record(p + toks[:-1], [(2, "hook_resid_post")], deltas=deltas)[(2, "hook_resid_post")]
        want = 1 / (1 + np.exp(-(x @ w + 0.25)))
        np.testing.assert_allclose(o.mi_results["probe"]["probe"], want, rtol=1e-4, atol=1e-5)
    assert [list(o.outputs[0].token_ids) for o in outs] != [hf.greedy(p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_seal_and_cast_apps_equal_hf(arch, tmp_path):
    """apps.seal (all and generated positions) and apps.cast against the HF references of
    test_conditions (token-masked adds; the prompt's mean cosine deciding every generated
    token), on each architecture."""
    from conftest import HFOracle
    from test_conditions import CAST_LAYERS, READ_LAYER, SCALE, SEAL_LAYERS, SEAL_SET, C, V, hf_greedy_masked
    from test_conditions import PROMPTS as CPROMPTS

    from vllm_xmix import SamplingParams, deploy
    from vllm_xmix.apps import cast, seal
    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model(arch, root=tmp_path / arch)
    hf = HFOracle(model)

    def cos_mean(ids):
        x = hf.record(ids, [(READ_LAYER, "hook_resid_post")])[(READ_LAYER, "hook_resid_post")].astype(np.float64)
        return float(((x @ C.astype(np.float64)) / np.linalg.norm(C) / np.linalg.norm(x, axis=1)).mean())

    means = [cos_mean(p) for p in CPROMPTS]
    t = float(np.median(means))
    S = set(SEAL_SET)
    apps = [seal(V, SEAL_SET, SEAL_LAYERS, scale=SCALE, generated_only=False, name="seal"),
            seal(V, SEAL_SET, SEAL_LAYERS, scale=SCALE, name="seal_gen"),
            cast(C, READ_LAYER, t, V, CAST_LAYERS, scale=SCALE, name="cast")]
    want = {
        "seal": [hf_greedy_masked(hf, p, N_NEW, SEAL_LAYERS, lambda ids, P: [x in S for x in ids]) for p in CPROMPTS],
        "seal_gen": [hf_greedy_masked(hf, p, N_NEW, SEAL_LAYERS,
                                      lambda ids, P: [i >= P and x in S for i, x in enumerate(ids)]) for p in CPROMPTS],
        "cast": [hf_greedy_masked(hf, p, N_NEW, CAST_LAYERS,
                                  lambda ids, P, on=m > t: [on and i >= P - 1 for i in range(len(ids))])
                 for p, m in zip(CPROMPTS, means)],
    }
    plain = [hf.greedy(p, N_NEW) for p in CPROMPTS]
    llm = make_llm(model, "eager", additional_config=deploy(*apps))
    try:
        for name in want:
            sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, mi_apps=[name])
            got = [list(o.outputs[0].token_ids) for o in
                   llm.generate([{"prompt_token_ids": p} for p in CPROMPTS], sp, use_tqdm=False)]
            assert got == want[name], name
            assert want[name] != plain, f"{name}: the condition never fired on these prompts"
    finally:
        close_llm(llm)


def test_steer_moe_app_equals_hf(tmp_path):
    """apps.steer_moe (expert 2 masked, expert 0 boosted, every layer) against HF with the same
    bias added to each router's logits before top-k (test_router's reference)."""
    from conftest import HFOracle
    from test_router import hf_router_bias

    from vllm_xmix import SamplingParams, deploy
    from vllm_xmix.apps import steer_moe
    from vllm_xmix.tiny import build_tiny_model

    model = build_tiny_model("mixtral", root=tmp_path / "mixtral")
    hf = HFOracle(model)
    E, n_layers = hf.model.config.num_local_experts, hf.model.config.num_hidden_layers
    bias = torch.zeros(E)
    bias[2], bias[0] = -math.inf, 3.0
    seen: list = []
    with hf_router_bias(hf.model, {L: bias for L in range(n_layers)}, seen):
        want = [hf.greedy(p, N_NEW) for p in PROMPTS]
    assert all(not (t == 2).any() for t in seen)
    assert want != [hf.greedy(p, N_NEW) for p in PROMPTS]
    llm = make_llm(model, "eager", additional_config=deploy(steer_moe(E, deactivate=[2], activate=[0], boost=3.0)))
    try:
        sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, mi_apps=["steer_moe"])
        got = [list(o.outputs[0].token_ids) for o in
               llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    finally:
        close_llm(llm)
    assert got == want
